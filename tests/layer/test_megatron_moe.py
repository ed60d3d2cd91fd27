"""Megatron-Core's own MoELayer (all-to-all dispatcher, SequentialMLP experts)
trains with expert parallelism over gloo through the CPU runtime."""

from __future__ import annotations

import pytest
import torch


def _train_moe_layer(steps: int, ep: int, topk: int) -> list[float]:
    """Regress a fixed random teacher with Megatron's MoELayer; return the losses."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.moe.moe_layer import MoELayer

    ps.initialize_model_parallel(expert_model_parallel_size=ep)
    model_parallel_cuda_manual_seed(42)
    hidden, experts = 16, 4
    config = TransformerConfig(
        num_layers=1, hidden_size=hidden, num_attention_heads=1, ffn_hidden_size=32,
        num_moe_experts=experts, moe_router_topk=topk, moe_token_dispatcher_type="alltoall",
        moe_aux_loss_coeff=1e-2, expert_model_parallel_size=ep, add_bias_linear=False,
        bias_activation_fusion=False, gradient_accumulation_fusion=False,
    )
    spec = get_gpt_layer_local_spec(num_experts=experts).submodules.mlp
    layer = spec(config=config)
    assert isinstance(layer, MoELayer)
    assert type(layer.token_dispatcher).__name__ == "MoEAlltoAllTokenDispatcher"
    optimizer = torch.optim.Adam(layer.parameters(), lr=1e-2)

    teacher = torch.Generator().manual_seed(0)  # same teacher on every rank
    w_in = torch.randn(hidden, 32, generator=teacher)
    w_out = torch.randn(32, hidden, generator=teacher)
    data = torch.Generator().manual_seed(100 + dist.get_rank())  # different tokens per rank
    losses = []
    for _ in range(steps):
        x = torch.randn(8, 2, hidden, generator=data)  # [s, b, h], Megatron's layout
        target = torch.tanh(x @ w_in) @ w_out / 4
        out, _ = layer(x)
        loss = torch.nn.functional.mse_loss(out, target)
        optimizer.zero_grad()
        loss.backward()
        # The router is replicated over the EP ranks: average its gradient, as DDP would.
        for name, param in layer.named_parameters():
            if "router" in name:
                dist.all_reduce(param.grad)
                param.grad /= dist.get_world_size()
        optimizer.step()
        reported = loss.detach().clone()
        dist.all_reduce(reported)
        losses.append(float(reported) / dist.get_world_size())
    return losses


@pytest.mark.parametrize("topk", [2, 3])
def test_megatron_moe_layer_trains_with_ep2(gloo2, topk):
    results = gloo2.run(_train_moe_layer, 60, 2, topk, timeout=300)
    losses = results[0]
    assert results[1] == losses
    assert all(torch.isfinite(torch.tensor(losses)))
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.6 * first, losses
