"""The LRMoE layer under context parallelism: EP 2 x CP 2 (and CP 4) on 4 gloo ranks.

In Megatron-Core 0.19 each context-parallel rank's MoE layer routes its own S / CP tokens;
the expert grid is cut from TP x CP x DP, so an expert-parallel group mixes CP ranks, and
the router's auxiliary losses reduce over TP x CP. Megatron's local attention refuses
CP > 1, so no full model trains here with CP (scripts/gpu_check.sh runs one on a GPU):
the layer is tested alone, each rank's tokens standing for its sequence shard. The
oracles are independent of the code under test: Megatron's own MoELayer under the same
parallel state (gamma = inf), the dense reference less the dropped pairs and the kept-pairs
selection on it (finite gamma), Megatron's router's own routing maps (statistics), and an
uninterrupted run (a save and resume through ``dist_checkpointing``).
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.layer.test_lrmoe_layer import (
    EXPERTS,
    HIDDEN,
    ROUTERS,
    _compare_with_dense_reference,
    _compare_with_megatron,
    _kept_pairs_against_reference,
)


def _groups() -> dict[str, list[int]]:
    """The global ranks of this rank's EP, CP and expert-data-parallel groups."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    return {name: dist.get_process_group_ranks(group) for name, group in (
        ("ep", ps.get_expert_model_parallel_group()), ("cp", ps.get_context_parallel_group()),
        ("edp", ps.get_expert_data_parallel_group()))}


def _no_drop_against_megatron(ep: int, cp: int) -> dict:
    """LRMoE against Megatron's layer at gamma = inf under (EP, CP), with the router's
    default aux loss and the sequence aux loss (both reduce over TP x CP)."""
    out = {}
    for name in ("softmax-aux", "softmax-pre-seq-aux"):
        result = _compare_with_megatron(ep, math.inf, 12, True, None, ROUTERS[name], cp=cp)
        out[name] = (result["forward"] and result["dx"] and result["same-params"]
                     and all(result["grads"].values()))
    return {"equal": out, "groups": _groups()}


@pytest.mark.parametrize("ep, cp", [(2, 2), (2, 4), (4, 2)])
def test_no_drop_equals_megatron_under_context_parallelism(gloo4, ep, cp):
    results = gloo4.run(_no_drop_against_megatron, ep, cp)
    for rank, result in enumerate(results):
        assert all(result["equal"].values()), (rank, result)
    # The layouts the test is for: every EP group holds ranks of one sequence (CP ranks,
    # each with its own tokens), at EP 4 x CP 2 with data-parallel ranks besides.
    for result in results:
        groups = result["groups"]
        assert len(groups["ep"]) == ep and len(groups["cp"]) == cp
        assert len(set(groups["ep"]) & set(groups["cp"])) == min(ep, cp), groups


def _drops_against_references(cp: int) -> dict:
    """At gamma 0.6: the gradients of the dense reference less the dropped pairs, and
    the kept pairs and scales of an independent selection on it."""
    dense = _compare_with_dense_reference(2, 0.6, "sample", 0.1, cp=cp)
    kept = _kept_pairs_against_reference(2, "hybrid", cp=cp)
    return {"dense": dense, "kept": kept}


@pytest.mark.parametrize("cp", [2, 4])
def test_drops_equal_the_references_at_ep2(gloo4, cp):
    for rank, result in enumerate(gloo4.run(_drops_against_references, cp)):
        assert result["dense"].pop("dropped") and result["kept"]["dropped"], rank
        assert all(result["dense"].values()), (rank, result["dense"])
        assert all(result["kept"].values()), (rank, result["kept"])


# -----------------------------------------------------------------------------
# Steps, statistics, and a save and resume at EP 2 x CP 2
# -----------------------------------------------------------------------------

MICROBATCHES = 2


def _layer(ep: int, cp: int):
    """An LRMoE layer with replicas (popularity placement, 6 slots for 4 homes per rank)
    and random draws (``sample`` at gamma 0.6), planned for ``MICROBATCHES`` per step."""
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_lrmoe.config.transformer_config import LRMoETransformerConfig
    from megatron_lrmoe.integration.step_hooks import setup_lrmoe_layers
    from megatron_lrmoe.layer.spec import to_lrmoe_spec

    ps.initialize_model_parallel(expert_model_parallel_size=ep, context_parallel_size=cp)
    model_parallel_cuda_manual_seed(123)
    config = LRMoETransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=2, ffn_hidden_size=24,
        moe_ffn_hidden_size=24, num_moe_experts=EXPERTS, moe_router_topk=2,
        moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=1e-2,
        expert_model_parallel_size=ep, context_parallel_size=cp, add_bias_linear=False,
        bias_activation_fusion=False, gated_linear_unit=True, activation_func=F.silu,
        moe_lrmoe=True, moe_lrmoe_bwd_capacity_factor=0.6,
        moe_lrmoe_selection="sample", moe_lrmoe_placement="popularity",
        moe_lrmoe_slots_per_rank=6)
    layer = to_lrmoe_spec(get_gpt_layer_local_spec(num_experts=EXPERTS).submodules.mlp)(
        config=config, layer_number=1)
    setup_lrmoe_layers([layer], None, MICROBATCHES)
    return layer


def _reduce_gradients(layer) -> None:
    """What Megatron's DDP does with the gradients: experts averaged over the expert-data-
    parallel group, the router over data x context parallel ranks (all four here)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    for name, param in layer.named_parameters():
        group = (ps.get_expert_data_parallel_group() if name.startswith("experts")
                 else ps.get_data_parallel_group(with_context_parallel=True))
        dist.all_reduce(param.grad, group=group)
        param.grad /= dist.get_world_size(group)


def _checkpoint_dict(layer) -> dict:
    from megatron_lrmoe.integration.step_hooks import STEP_STATE_FLAG

    return layer.sharded_state_dict(metadata={STEP_STATE_FLAG: True})


def _steps(first: int, last: int, save: str | None = None, load: str | None = None) -> dict:
    """Steps ``first`` .. ``last`` - 1 of one training run at EP 2 x CP 2 (each step's
    inputs drawn from its step, micro-batch and rank), SGD, LRMoE's step boundary; ``load``
    resumes from a checkpoint (weights perturbed first: they must come from it), ``save``
    saves after the last step. Returns the outputs, the final weights, the step state and
    the statistics against the router's own routing maps."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from megatron_lrmoe.integration.step_hooks import finish_lrmoe_step
    from megatron_lrmoe.layer.stats import collect_lrmoe_stats

    layer = _layer(2, 2)
    if load is not None:
        with torch.no_grad():
            for param in layer.parameters():
                param.add_(1.0)
        layer.load_state_dict(dist_checkpointing.load(_checkpoint_dict(layer), load))
    routed = torch.zeros(EXPERTS, dtype=torch.int64)

    def count(module, args, output):      # the router's routing map, as Megatron made it
        routed.add_(output[1].sum(0).to(torch.int64))

    layer.router.register_forward_hook(count)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.5)
    outputs = []
    for step in range(first, last):
        optimizer.zero_grad()
        for micro in range(MICROBATCHES):
            g = torch.Generator().manual_seed(10_000 * step + 100 * micro + dist.get_rank())
            x = torch.randn(10, 2, HIDDEN, generator=g)
            out, _ = layer(x)
            out.backward(torch.randn(out.shape, generator=g))
            outputs.append(out.detach())
        _reduce_gradients(layer)
        optimizer.step()
        finish_lrmoe_step([layer])
    if save is not None:
        dist_checkpointing.save(_checkpoint_dict(layer), save)
    sent = layer.lrmoe_stats.dispatch_counts()[0][0]
    stats = collect_lrmoe_stats([layer], 1, EXPERTS)
    everyone = routed.clone()
    dist.all_reduce(everyone)
    return {"outputs": outputs, "weights": {k: v.detach().clone()
                                            for k, v in layer.state_dict().items()
                                            if isinstance(v, torch.Tensor)},
            "planner": layer.placement_planner.state_dict(), "step": layer.lrmoe_state.step,
            "origin": layer.planner_state_origin, "sent": sent, "routed": int(routed.sum()),
            "stats_load": stats["lrmoe/layer1/expert-load"], "router_load": everyone.tolist(),
            "stats_sent": stats["lrmoe/layer1/rank-sent-pairs"],
            "retained": stats["lrmoe/layer1/retained-fraction"]}


def test_step_state_save_and_resume_is_bitwise_at_ep2_cp2(gloo4, tmp_path):
    """Four steps straight, and two steps saved then two resumed in a fresh layer: the
    outputs, the weights and the step state (planner with replicas, draw step) agree
    bitwise. The statistics of every run sum the router's own routed pairs over the four
    ranks, each rank's sent pairs its own."""
    from tests.integration.test_step_state import _differs

    straight = gloo4.run(_steps, 0, 4)
    gloo4.run(_steps, 0, 2, save=str(tmp_path))
    resumed = gloo4.run(_steps, 2, 4, load=str(tmp_path))
    for rank, (s, r) in enumerate(zip(straight, resumed, strict=True)):
        assert r["origin"] == "checkpoint", r["origin"]
        assert r["step"] == s["step"] == 4
        assert not _differs(r["outputs"], s["outputs"][2 * MICROBATCHES:]), rank
        assert not _differs(r["weights"], s["weights"]), rank
        assert not _differs(r["planner"], s["planner"]), rank
    assert straight[0]["planner"]["replicas"], "replicas were placed"
    for run in (straight, resumed):
        assert all(r["retained"] < 1.0 for r in run), "gamma 0.6 drops pairs"
        for r in run:
            assert r["stats_load"] == r["router_load"]
            assert sum(r["stats_load"]) == sum(x["routed"] for x in run)
            assert r["stats_sent"] == [x["sent"] for x in run]
            assert r["sent"] == r["routed"]
