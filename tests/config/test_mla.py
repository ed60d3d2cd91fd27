"""Multi-latent attention (MLA): ``LRMoEMLATransformerConfig``, and the LRMoE layer inside
an MLA model against Megatron's MoELayer in the same model.

The model is DeepSeek-V3's shape in miniature (MLA with q/kv latent norms and YaRN rope, a
dense first layer, then MoE layers with a shared expert and a sigmoid router with expert
bias over expert groups), built from Megatron's own local block spec (its core attention
taking MLA's head dims, which megatron-core 0.19.2's local one does not:
workshop/lrmoe_testing/local_mla.py); the LRMoE model is the same spec through
``to_lrmoe_spec`` with Megatron's model's weights. "Equal" as
docs/design.md, "Exactness", defines it (fp32, rtol 1e-5, atol 1e-6).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from tests.layer.test_lrmoe_layer import ATOL, RTOL

MLA = dict(
    num_layers=3, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48,
    moe_layer_freq=[0, 1, 1], num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=16,
    moe_shared_expert_intermediate_size=16, moe_token_dispatcher_type="alltoall",
    moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
    moe_router_num_groups=4, moe_router_group_topk=2, moe_router_topk_scaling_factor=2.5,
    moe_router_pre_softmax=True, moe_router_dtype="fp32",
    # Balanced by the expert bias alone: an auxiliary loss would size Megatron's process-wide
    # MoE metrics tracker to this model's 3 layers for the pool's later models (the layer
    # tests hold the sequence auxiliary loss to Megatron's).
    moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
    add_bias_linear=False, bias_activation_fusion=False, gated_linear_unit=True,
    normalization="RMSNorm", qk_layernorm=True, hidden_dropout=0.0, attention_dropout=0.0,
    q_lora_rank=16, kv_lora_rank=8, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8,
)


def _plain(config) -> dict:
    """The config's field values that compare by value (functions set by the post-init,
    such as ``init_method``, are new objects each time)."""
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
            if not callable(getattr(config, f.name))}


def test_the_mla_config_is_megatrons_with_the_lrmoe_fields():
    import torch.nn.functional as F
    from megatron.core.transformer import MLATransformerConfig

    from megatron_lrmoe.config.transformer_config import (
        LRMoEMLATransformerConfig,
        LRMoETransformerConfig,
    )
    from megatron_lrmoe.options.lrmoe import OPTIONS, LRMoEConfigError

    fields = {f.name: f.default for f in dataclasses.fields(LRMoEMLATransformerConfig)}
    megatron = {f.name: f.default for f in dataclasses.fields(MLATransformerConfig)}
    # MLA's fields with MLA's defaults, and the LRMoE options with theirs.
    assert {k: fields[k] for k in megatron} == megatron
    assert sorted(fields.keys() - megatron.keys()) == sorted(o.field for o in OPTIONS)
    config = LRMoEMLATransformerConfig(**MLA, activation_func=F.silu, moe_lrmoe=True)
    assert isinstance(config, MLATransformerConfig) and isinstance(config, LRMoETransformerConfig)
    assert config.multi_latent_attention and config.moe_lrmoe
    # Built from Megatron's own MLA config (as Megatron-LM's entry point does): the same
    # config as built directly.
    converted = LRMoEMLATransformerConfig.from_mla_config(
        MLATransformerConfig(**MLA, activation_func=F.silu), moe_lrmoe=True)
    assert _plain(converted) == _plain(config)
    # MLA's own post-init runs (not only TransformerConfig's), LRMoE's checks around it.
    with pytest.raises(NotImplementedError, match="Output gate is not supported for MLA"):
        LRMoEMLATransformerConfig(**MLA, moe_lrmoe=True, attention_output_gate=True)
    with pytest.raises(LRMoEConfigError, match="--moe-lrmoe-bwd-capacity-factor"):
        LRMoEMLATransformerConfig(**MLA, moe_lrmoe=True, moe_lrmoe_bwd_capacity_factor=0.0)


def _model(lrmoe: bool):
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from lrmoe_testing.local_mla import with_local_mla_attention
    from megatron_lrmoe.config.transformer_config import LRMoEMLATransformerConfig
    from megatron_lrmoe.layer.spec import to_lrmoe_spec

    config = LRMoEMLATransformerConfig(**MLA, activation_func=F.silu, moe_lrmoe=lrmoe,
                                       moe_lrmoe_bwd_capacity_factor=math.inf,
                                       expert_model_parallel_size=2)
    # Megatron's local MLA spec with a core attention that takes MLA's head dims (its own
    # does not: lrmoe_testing/local_mla.py).
    spec = with_local_mla_attention(
        get_gpt_decoder_block_spec(config, use_transformer_engine=False, pp_rank=0))
    return GPTModel(config, to_lrmoe_spec(spec) if lrmoe else spec, vocab_size=64,
                    max_sequence_length=16, position_embedding_type="rope")


def _step(model, tokens, labels) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    loss = model(tokens, positions, None, labels=labels).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                           if p.grad is not None}


def _mla_model_against_megatron() -> dict:
    """A pool task: Megatron's MLA model and the LRMoE one with its weights, one forward
    and backward on this rank's tokens at EP 2: the layer classes and what is equal."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_lrmoe.integration.step_hooks import setup_lrmoe_layers

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(expert_model_parallel_size=2)
    model_parallel_cuda_manual_seed(321)
    megatron, lrmoe = _model(False), _model(True)
    missing, unexpected = lrmoe.load_state_dict(megatron.state_dict(), strict=False)
    setup_lrmoe_layers([lrmoe], None, 1)
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    tokens = torch.randint(0, 64, (2, 16), generator=g)
    labels = torch.randint(0, 64, (2, 16), generator=g)
    loss_m, grads_m = _step(megatron, tokens, labels)
    loss_l, grads_l = _step(lrmoe, tokens, labels)
    ps.destroy_model_parallel()
    return {
        "mlps": [type(m).__name__ for n, m in lrmoe.named_modules() if n.endswith(".mlp")],
        "attention": sorted({type(m).__name__ for n, m in lrmoe.named_modules()
                             if n.endswith("self_attention")}),
        "weights_copied": (unexpected == [] and all(k.endswith("_extra_state")
                                                    for k in missing)),
        "loss": torch.allclose(loss_l, loss_m, rtol=RTOL, atol=ATOL),
        "same_params": sorted(grads_l) == sorted(grads_m),
        "grads": [n for n, g in grads_m.items()
                  if not torch.allclose(grads_l[n], g, rtol=RTOL, atol=ATOL)],
    }


def test_lrmoe_in_an_mla_model_equals_megatron_at_gamma_inf(gloo2):
    for result in gloo2.run(_mla_model_against_megatron, timeout=300):
        assert result["mlps"] == ["MLP", "LRMoELayer", "LRMoELayer"]
        assert result["attention"] == ["MLASelfAttention"]
        assert result["weights_copied"]
        assert result["loss"] and result["same_params"]
        assert result["grads"] == [], result["grads"]
