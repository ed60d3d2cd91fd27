"""LRMoELayer against Megatron-Core's MoELayer and against a dense drop reference.

"Equal" as docs/design.md, "Exactness", defines it: fp32, rtol 1e-5, atol 1e-6 against
Megatron; bitwise between LRMoE settings in forward.
"""

from __future__ import annotations

import math

import pytest
import torch

RTOL, ATOL = 1e-5, 1e-6
HIDDEN, FFN, EXPERTS = 16, 24, 8


def _build(ep: int, gamma: float, selection: str = "topk", aux: float = 1e-2,
           swiglu: bool = True, shared: int | None = None, min_retention: float = 0.0,
           hybrid_fraction: float = 0.5, metric: str = "grad_act",
           router: dict | None = None, fields: dict | None = None, cp: int = 1):
    """Megatron's MoELayer and an LRMoELayer with the same weights, on this rank.
    ``router``: config fields of a router variant (ROUTERS), set in both; ``fields``:
    other config fields set in both (expert biases, tests/layer/test_expert_biases.py:
    drawn nonzero, Megatron's are zeros at start); ``cp``: the context-parallel size
    (tests/layer/test_context_parallel.py: each rank's tokens are its sequence shard)."""
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    from megatron_lrmoe.config.transformer_config import LRMoETransformerConfig
    from megatron_lrmoe.integration.step_hooks import setup_lrmoe_layers
    from megatron_lrmoe.layer.spec import to_lrmoe_spec

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(expert_model_parallel_size=ep, context_parallel_size=cp)
    model_parallel_cuda_manual_seed(123)
    common = dict(dict(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=2, ffn_hidden_size=FFN,
        moe_ffn_hidden_size=FFN, num_moe_experts=EXPERTS, moe_router_topk=2,
        moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=aux,
        moe_router_load_balancing_type="aux_loss" if aux else "none",
        expert_model_parallel_size=ep, context_parallel_size=cp, add_bias_linear=False,
        bias_activation_fusion=False, gated_linear_unit=swiglu,
        activation_func=F.silu if swiglu else F.gelu,
        moe_shared_expert_intermediate_size=shared,
    ), **(router or {}), **(fields or {}))
    spec = get_gpt_layer_local_spec(num_experts=EXPERTS).submodules.mlp
    megatron = spec(config=TransformerConfig(**common))
    if common["add_bias_linear"]:
        _draw_expert_biases(megatron)
    lrmoe_config = LRMoETransformerConfig(
        **common, moe_lrmoe=True, moe_lrmoe_bwd_capacity_factor=gamma,
        moe_lrmoe_selection=selection, moe_lrmoe_min_retention=min_retention,
        moe_lrmoe_hybrid_fraction=hybrid_fraction, moe_lrmoe_metric=metric)
    lrmoe = to_lrmoe_spec(spec)(config=lrmoe_config)
    lrmoe.load_state_dict(megatron.state_dict())  # same keys: interchangeable experts
    setup_lrmoe_layers([lrmoe], None, 1)          # the run's planner settings, handed over
    return megatron, lrmoe


def _draw_expert_biases(layer) -> None:
    """Nonzero expert biases, per rank (its experts are its own)."""
    import torch.distributed as dist

    g = torch.Generator().manual_seed(2000 + dist.get_rank())
    with torch.no_grad():
        for expert in layer.experts.local_experts:
            for linear in (expert.linear_fc1, expert.linear_fc2):
                linear.bias.copy_(0.5 * torch.randn(linear.bias.shape, generator=g))


def _inputs(tokens: int):
    import torch.distributed as dist

    g = torch.Generator().manual_seed(1000 + dist.get_rank())
    x = torch.randn(tokens, 2, HIDDEN, generator=g)
    dy = torch.randn(tokens, 2, HIDDEN, generator=g)
    return x, dy


def _run(layer, x, dy):
    x = x.clone().requires_grad_(True)
    out, _ = layer(x)
    out.backward(dy)
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    return out.detach(), x.grad.clone(), grads


#: Megatron routers the layer keeps (routing is Megatron's, only the span from dispatch to
#: combine is LRMoE's): score functions, expert bias, group-limited top-k, the balancing
#: types. Each runs in both layers with the same weights.
ROUTERS = {
    "softmax-aux": dict(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2),
    "softmax-pre-seq-aux": dict(moe_router_pre_softmax=True, moe_aux_loss_coeff=1e-2,
                                moe_router_load_balancing_type="seq_aux_loss"),
    "sigmoid-bias-group": dict(moe_router_score_function="sigmoid",
                               moe_router_enable_expert_bias=True, moe_router_num_groups=4,
                               moe_router_group_topk=2, moe_aux_loss_coeff=0.0,
                               moe_router_load_balancing_type="none"),
    "sqrtsoftplus-bias": dict(moe_router_score_function="sqrtsoftplus",
                              moe_router_enable_expert_bias=True, moe_aux_loss_coeff=0.0,
                              moe_router_load_balancing_type="none"),
    "quantile-balancing": dict(moe_router_load_balancing_type="quantile_balancing",
                               moe_aux_loss_coeff=0.0),
}


def _compare_with_megatron(ep: int, gamma: float, tokens: int, swiglu: bool, shared,
                           router: dict | None = None, fields: dict | None = None,
                           grouped: bool | None = None, cp: int = 1):
    megatron, lrmoe = _build(ep, gamma, swiglu=swiglu, shared=shared, router=router,
                             fields=fields, cp=cp)
    lrmoe.grouped_gemm = grouped
    x, dy = _inputs(tokens)
    out_m, dx_m, grads_m = _run(megatron, x, dy)
    out_l, dx_l, grads_l = _run(lrmoe, x, dy)
    result = {"forward": torch.allclose(out_l, out_m, rtol=RTOL, atol=ATOL)}
    result["dx"] = torch.allclose(dx_l, dx_m, rtol=RTOL, atol=ATOL)
    result["same-params"] = sorted(grads_l) == sorted(grads_m)
    result["grads"] = {n: torch.allclose(grads_l[n], g, rtol=RTOL, atol=ATOL)
                       for n, g in grads_m.items()}
    return result


@pytest.mark.parametrize("pool_name,ep", [("gloo1", 1), ("gloo2", 2), ("gloo4", 4)])
def test_no_drop_equals_megatron(request, pool_name, ep):
    pool = request.getfixturevalue(pool_name)
    for swiglu, shared in ((True, None), (False, 32)):
        results = pool.run(_compare_with_megatron, ep, math.inf, 12, swiglu, shared)
        for rank, r in enumerate(results):
            assert r["forward"] and r["dx"] and r["same-params"], (rank, r)
            assert all(r["grads"].values()), (rank, r["grads"])


@pytest.mark.parametrize("router", sorted(ROUTERS))
def test_router_variants_no_drop_equal_megatron(gloo2, router):
    for rank, r in enumerate(gloo2.run(_compare_with_megatron, 2, math.inf, 12, True, None,
                                       ROUTERS[router])):
        assert r["forward"] and r["dx"] and r["same-params"], (rank, r)
        assert all(r["grads"].values()), (rank, r["grads"])


def _grouped_gemm_flag_is_honoured(ep: int):
    """Megatron's grouped-GEMM spec (GroupedMLP) converted to LRMoE, with
    moe_grouped_gemm: the region runs grouped_mm (fp32 on the CPU) and still equals
    Megatron's SequentialMLP layer without drops."""
    import torch.nn.functional as F
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_lrmoe.config.transformer_config import LRMoETransformerConfig
    from megatron_lrmoe.integration.step_hooks import setup_lrmoe_layers
    from megatron_lrmoe.layer.spec import to_lrmoe_spec

    megatron, plain = _build(ep, math.inf, aux=0.0)
    common = {f: getattr(plain.config, f) for f in (
        "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
        "moe_ffn_hidden_size", "num_moe_experts", "moe_router_topk",
        "moe_token_dispatcher_type", "moe_aux_loss_coeff", "moe_router_load_balancing_type",
        "expert_model_parallel_size", "add_bias_linear", "bias_activation_fusion",
        "gated_linear_unit")}
    spec = get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=True).submodules.mlp
    grouped = to_lrmoe_spec(spec)(config=LRMoETransformerConfig(
        **common, activation_func=F.silu, moe_grouped_gemm=True, moe_lrmoe=True,
        moe_lrmoe_bwd_capacity_factor=math.inf))
    grouped.load_state_dict(megatron.state_dict())
    setup_lrmoe_layers([grouped], None, 1)
    x, dy = _inputs(12)
    out_m, dx_m, grads_m = _run(megatron, x, dy)
    out_g, dx_g, grads_g = _run(grouped, x, dy)
    _run(plain, x, dy)
    return {"ran-grouped": [c.grouped_gemm for c in grouped.lrmoe_stats.calls] == [True],
            "loop-by-default-on-cpu": [c.grouped_gemm for c in plain.lrmoe_stats.calls]
            == [False],
            "forward": torch.allclose(out_g, out_m, rtol=RTOL, atol=ATOL),
            "dx": torch.allclose(dx_g, dx_m, rtol=RTOL, atol=ATOL),
            "grads": all(torch.allclose(grads_g[n], g, rtol=RTOL, atol=ATOL)
                         for n, g in grads_m.items())}


def test_moe_grouped_gemm_runs_grouped_in_the_region(gloo2):
    for rank, result in enumerate(gloo2.run(_grouped_gemm_flag_is_honoured, 2)):
        assert all(result.values()), (rank, result)


def _forward_is_exact_under_drops(ep: int):
    megatron, lrmoe = _build(ep, 0.5)
    x, dy = _inputs(10)
    out_m, _, _ = _run(megatron, x, dy)
    out_l, _, grads_l = _run(lrmoe, x, dy)
    _, lrmoe_inf = _build(ep, math.inf)
    out_inf, _, _ = _run(lrmoe_inf, x, dy)
    summary = lrmoe.lrmoe_stats.summary()
    return (torch.allclose(out_l, out_m, rtol=RTOL, atol=ATOL), torch.equal(out_l, out_inf),
            summary["retained-fraction"])


def test_forward_exact_with_drops(gloo2):
    for exact, bitwise, retained in gloo2.run(_forward_is_exact_under_drops, 2):
        assert exact and bitwise
        assert retained < 1.0, "capacity 0.5 must drop pairs"


# -----------------------------------------------------------------------------
# Dense reference with drops: remove exactly the dropped pairs' dX/dW contributions
# -----------------------------------------------------------------------------


def _gather_expert_weights(lrmoe, kind: str = "weight"):
    """All experts' (w1, w2), stacked [E, ...], from every EP rank (``kind`` "bias": their
    biases b1, b2)."""
    import torch.distributed as dist

    experts = lrmoe.experts.local_experts
    w1 = torch.stack([getattr(e.linear_fc1, kind).detach() for e in experts])
    w2 = torch.stack([getattr(e.linear_fc2, kind).detach() for e in experts])
    group = lrmoe.ep_group
    size = dist.get_world_size(group)
    if size == 1:
        return w1, w2
    out1 = [torch.empty_like(w1) for _ in range(size)]
    out2 = [torch.empty_like(w2) for _ in range(size)]
    dist.all_gather(out1, w1.contiguous(), group=group)
    dist.all_gather(out2, w2.contiguous(), group=group)
    return torch.cat(out1), torch.cat(out2)


def _reference_draw(selection: str, metric: torch.Tensor, prob: torch.Tensor,
                    offsets: torch.Tensor, counts: torch.Tensor, quotas: torch.Tensor,
                    seed: int, fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(kept, scale) of one source's pairs, drawn with the reference op per the design's
    rules; "two-stage" composed here from its two "sample" draws (docs/design.md,
    "Selection rules"): floor(1.5 q) per cell stored by probability, then q of them by
    the metric over pi1, weighted 1/(pi1 pi2)."""
    from megatron_lrmoe.ops import select_rows_reference
    from megatron_lrmoe.ops.select import splitmix64

    if selection != "two-stage":
        return select_rows_reference(metric, offsets, quotas.clone(), rule=selection,
                                     seed=seed, hybrid_fraction=fraction)[:2]
    stored_q = torch.minimum(counts, quotas * 3 // 2)
    stored, pi1_inv, _ = select_rows_reference(prob, offsets, stored_q, rule="sample",
                                               seed=seed)
    stored_off = torch.cat([torch.zeros(1, dtype=torch.int64), stored_q.cumsum(0)])
    kept2, pi2_inv, _ = select_rows_reference(
        metric[stored] * pi1_inv, stored_off, quotas.clone(), rule="sample",
        seed=splitmix64(seed ^ 0x7F4A7C159E3779B9))
    return stored[kept2], pi1_inv[kept2] * pi2_inv


def _compare_with_dense_reference(ep: int, gamma: float, selection: str, min_ret: float,
                                  grouped: bool | None = None, metric_name: str = "grad_act",
                                  router: dict | None = None, fields: dict | None = None,
                                  cp: int = 1):
    import torch.distributed as dist

    from megatron_lrmoe.layer.step_state import _mix_seed
    from megatron_lrmoe.planning.retention import plan_retention

    # hybrid at a non-default fraction: the layer must pass its config's value on.
    megatron, lrmoe = _build(ep, gamma, selection=selection, aux=0.0, min_retention=min_ret,
                             hybrid_fraction=0.3 if selection == "hybrid" else 0.5,
                             metric=metric_name, router=router, fields=fields, cp=cp)
    router_ref = megatron.router  # same weights, separate parameters
    lrmoe.grouped_gemm = grouped
    x, dy = _inputs(14)
    out_l, dx_l, grads_l = _run(lrmoe, x, dy)

    # Reference, on this rank's tokens, with every expert available.
    params = dict(zip(("linear_fc1.weight", "linear_fc2.weight"), _gather_expert_weights(lrmoe),
                      strict=True))
    if lrmoe.config.add_bias_linear:
        params.update(zip(("linear_fc1.bias", "linear_fc2.bias"),
                          _gather_expert_weights(lrmoe, "bias"), strict=True))
    for p_all in params.values():
        p_all.requires_grad_(True)
    w1_all, w2_all = params["linear_fc1.weight"], params["linear_fc2.weight"]
    x_ref = x.clone().requires_grad_(True)
    flat = x_ref.reshape(-1, HIDDEN)
    probs, routing_map = router_ref(x_ref)
    pair_expert, pair_token = routing_map.t().nonzero(as_tuple=True)
    p = probs[pair_token, pair_expert]
    rows = flat[pair_token]
    z = torch.einsum("ph,pfh->pf", rows, w1_all[pair_expert])
    if "linear_fc1.bias" in params:
        z = z + params["linear_fc1.bias"][pair_expert]
    h = lrmoe.experts._activation(z)
    o = torch.einsum("pf,phf->ph", h, w2_all[pair_expert])
    if "linear_fc2.bias" in params:
        o = o + params["linear_fc2.bias"][pair_expert]
    g = p.detach().unsqueeze(1) * dy.reshape(-1, HIDDEN)[pair_token]
    metric = torch.linalg.vector_norm(g, dim=1) * torch.linalg.vector_norm(h.detach(), dim=1)
    if metric_name == "grad":
        metric = torch.linalg.vector_norm(g, dim=1)
    if metric_name == "prob":
        metric = p.detach().float()

    counts_local = routing_map.sum(0).to(torch.int64)
    counts = [counts_local.clone() for _ in range(ep)]
    if ep > 1:
        dist.all_gather(counts, counts_local, group=lrmoe.ep_group)
    counts = torch.stack(counts)
    plan = plan_retention(counts, ep, gamma, min_ret)
    rank = dist.get_rank(lrmoe.ep_group) if ep > 1 else 0
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts[rank].cumsum(0)])
    seed = _mix_seed(lrmoe.lrmoe_state.seed_base, lrmoe.layer_number or 0, 0)
    kept, scale = _reference_draw(selection, metric, p.detach().float(), offsets, counts[rank],
                                  plan.quotas[rank], seed,
                                  lrmoe.config.moe_lrmoe_hybrid_fraction)
    factor = torch.zeros(p.shape[0])
    factor[kept] = scale if selection != "topk" else 1.0
    o_eff = o.detach() + factor.unsqueeze(1) * (o - o.detach())
    y = torch.zeros_like(flat).index_add(0, pair_token, p.unsqueeze(1) * o_eff)
    (y * dy.reshape(-1, HIDDEN)).sum().backward()

    expert_grads = {name: p_all.grad.clone() for name, p_all in params.items()}
    if ep > 1:
        for grad in expert_grads.values():
            dist.all_reduce(grad, group=lrmoe.ep_group)
    local = lrmoe.experts.num_local_experts
    ok = {"forward": torch.allclose(out_l.reshape(-1, HIDDEN), y.detach(), rtol=RTOL, atol=ATOL),
          "dx": torch.allclose(dx_l, x_ref.grad, rtol=RTOL, atol=ATOL)}
    for name, grad in grads_l.items():
        if name.startswith("router"):
            ok[name] = torch.allclose(grad, dict(router_ref.named_parameters())[
                name.removeprefix("router.")].grad, rtol=RTOL, atol=ATOL)
        else:
            _, _, index, linear, kind = name.split(".")   # experts.local_experts.<i>....
            ref = expert_grads[f"{linear}.{kind}"][rank * local + int(index)]
            ok[name] = torch.allclose(grad, ref, rtol=RTOL, atol=ATOL)
    ok["dropped"] = kept.numel() < p.shape[0]
    return ok


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped_mm", "loop"])
@pytest.mark.parametrize("selection", ["topk", "sample", "uniform", "hybrid", "two-stage"])
@pytest.mark.parametrize("pool_name,ep", [("gloo1", 1), ("gloo2", 2), ("gloo4", 4)])
def test_drops_equal_dense_reference(request, pool_name, ep, selection, grouped):
    pool = request.getfixturevalue(pool_name)
    gamma = 0.6 if ep > 1 else 0.5  # one rank: capacity below 1 still drops (C < load)
    for rank, result in enumerate(pool.run(_compare_with_dense_reference, ep, gamma,
                                           selection, 0.1, grouped)):
        assert result.pop("dropped"), "the setting must actually drop pairs"
        assert all(result.values()), (rank, result)


@pytest.mark.parametrize("router", sorted(ROUTERS))
def test_router_variants_drops_equal_dense_reference(gloo2, router):
    for rank, result in enumerate(gloo2.run(_compare_with_dense_reference, 2, 0.6, "uniform",
                                            0.1, None, "grad_act", ROUTERS[router])):
        assert result.pop("dropped"), "the setting must actually drop pairs"
        assert all(result.values()), (rank, result)


@pytest.mark.parametrize("selection", ["topk", "hybrid"])
def test_prob_metric_drawn_in_forward_equals_dense_reference(gloo2, selection):
    # Metric prob: the retained set is drawn in forward (retention.retention_in_forward), x
    # and z saved for the retained rows only; gradients as the dense reference's.
    for rank, result in enumerate(gloo2.run(_compare_with_dense_reference, 2, 0.6,
                                            selection, 0.1, False, "prob")):
        assert result.pop("dropped"), "the setting must actually drop pairs"
        assert all(result.values()), (rank, result)


def _kept_pairs_against_reference(ep: int, selection: str, cp: int = 1):
    """The debug view's kept pairs and scales vs an independent selection on a dense
    reference metric, and its absence when not asked for (``cp``: see ``_build``)."""
    import torch.distributed as dist

    from megatron_lrmoe.layer.region import active_kept_pairs_log, record_kept_pairs
    from megatron_lrmoe.layer.step_state import _mix_seed
    from megatron_lrmoe.planning.retention import plan_retention

    megatron, lrmoe = _build(ep, 0.6, selection=selection, aux=0.0, min_retention=0.1,
                             hybrid_fraction=0.3, cp=cp)
    x, dy = _inputs(14)
    with record_kept_pairs() as log:
        _run(lrmoe, x, dy)
    off_by_default = active_kept_pairs_log() is None
    (record,) = log.records
    # Reference metric ||p dy|| ||h|| over the pairs, by expert then token.
    w1_all, w2_all = _gather_expert_weights(lrmoe)
    with torch.no_grad():
        flat = x.reshape(-1, HIDDEN)
        probs, routing_map = megatron.router(x)
        pair_expert, pair_token = routing_map.t().nonzero(as_tuple=True)
        h = lrmoe.experts._activation(torch.einsum("ph,pfh->pf", flat[pair_token],
                                                   w1_all[pair_expert]))
        g = probs[pair_token, pair_expert].unsqueeze(1) * dy.reshape(-1, HIDDEN)[pair_token]
        metric = torch.linalg.vector_norm(g, dim=1) * torch.linalg.vector_norm(h, dim=1)
    counts = [routing_map.sum(0).to(torch.int64) for _ in range(ep)]
    if ep > 1:
        dist.all_gather(counts, counts[0].clone(), group=lrmoe.ep_group)
    counts = torch.stack(counts)
    rank = dist.get_rank(lrmoe.ep_group) if ep > 1 else 0
    plan = plan_retention(counts, ep, 0.6, 0.1)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts[rank].cumsum(0)])
    kept, scale = _reference_draw(
        selection, metric, probs[pair_token, pair_expert].float(), offsets, counts[rank],
        plan.quotas[rank], _mix_seed(lrmoe.lrmoe_state.seed_base, lrmoe.layer_number or 0, 0),
        0.3)
    if selection == "topk":
        scale = torch.ones_like(scale)
    want = list(zip(pair_token[kept].tolist(), pair_expert[kept].tolist(), strict=True))
    got = list(zip(record.pair_token[record.kept].tolist(),
                   record.pair_expert[record.kept].tolist(), strict=True))
    return {"off-by-default": off_by_default,
            "layer-and-call": (record.layer, record.call) == (lrmoe.layer_number or 0, 0),
            "same-pairs": got == want,
            "same-scales": torch.allclose(record.scale, scale, rtol=1e-5, atol=0.0),
            "dropped": kept.numel() < pair_token.numel()}


@pytest.mark.parametrize("selection", ["topk", "sample", "uniform", "hybrid", "two-stage"])
def test_kept_pairs_debug_view_matches_reference(gloo2, selection):
    for rank, result in enumerate(gloo2.run(_kept_pairs_against_reference, 2, selection)):
        assert all(result.values()), (rank, result)


def _selection_arguments(selection: str, fraction: float):
    """The rule and fraction the region hands select_rows (captured on the way)."""
    from unittest import mock

    from megatron_lrmoe.layer import region

    _, lrmoe = _build(1, 0.5, selection=selection, aux=0.0, hybrid_fraction=fraction)
    seen = []

    def spy(*args, **kwargs):
        seen.append((kwargs["rule"], kwargs["hybrid_fraction"]))
        return real(*args, **kwargs)

    real = region.select_rows
    with mock.patch.object(region, "select_rows", spy):
        _run(lrmoe, *_inputs(8))
    return seen


@pytest.mark.parametrize("selection,fraction", [("hybrid", 0.3), ("uniform", 0.0)])
def test_selection_and_fraction_reach_the_kernel(gloo1, selection, fraction):
    (seen,) = gloo1.run(_selection_arguments, selection, fraction)
    assert seen == [(selection, fraction)]


# -----------------------------------------------------------------------------
# What the backward sends and computes
# -----------------------------------------------------------------------------


def _backward_accounting(ep: int, gamma: float):
    import torch.distributed as dist

    _, lrmoe = _build(ep, gamma, aux=0.0)
    x, dy = _inputs(16)
    _run(lrmoe, x, dy)
    (stats,) = lrmoe.lrmoe_stats.calls
    totals = torch.tensor([stats.retained_pairs, stats.expert_backward_rows,
                           stats.routed_pairs], dtype=torch.float64)
    if ep > 1:
        dist.all_reduce(totals, group=lrmoe.ep_group)
    # Positions go only to receivers that drop some of their rows (the others keep
    # every row they received, in order): from the plan, independently of the region.
    plan = lrmoe.last_plan.retention
    rank = dist.get_rank(lrmoe.ep_group) if ep > 1 else 0
    inst_rank = torch.tensor(plan.instance_rank)
    drops = [bool((plan.quotas[:, inst_rank == r] < plan.counts[:, inst_rank == r]).any())
             for r in range(plan.num_ranks)]
    positioned = sum(int(plan.retained_matrix[rank, r]) for r in range(plan.num_ranks)
                     if drops[r])
    return {"sent": stats.backward_bytes_sent, "dense": stats.backward_bytes_dense,
            "retained": stats.retained_pairs, "routed": stats.routed_pairs,
            "positioned": positioned, "all_retained": int(totals[0]),
            "all_expert_rows": int(totals[1]), "all_routed": int(totals[2])}


@pytest.mark.parametrize("gamma", [math.inf, 1.0, 0.5])
def test_backward_bytes_and_rows_follow_retained_pairs(gloo2, gamma):
    row_bytes = HIDDEN * 4  # fp32 rows
    for r in gloo2.run(_backward_accounting, 2, gamma):
        # Payload = retained rows + one int32 position per row sent to a receiver that
        # drops rows; dense = every routed row.
        assert r["sent"] == r["retained"] * row_bytes + 4 * r["positioned"]
        assert r["dense"] == r["routed"] * row_bytes
        # Expert backward GEMMs run over exactly the retained rows, summed over ranks.
        assert r["all_expert_rows"] == r["all_retained"]
        if gamma == math.inf:
            assert r["all_retained"] == r["all_routed"]
            assert r["positioned"] == 0, "nothing dropped: no positions are sent"
        else:
            assert r["all_retained"] < r["all_routed"]


def _sample_mean_gradient(draws: int, selection: str = "sample"):
    """Relative L2 errors (mean over many draws, one draw) of the expert-weight gradients
    and of the token gradients of ``selection`` at gamma 0.5, against the dense ones."""
    _, dense = _build(1, math.inf, aux=0.0)
    _, sampled = _build(1, 0.5, selection=selection, aux=0.0)
    x, dy = _inputs(8)
    _, dense_dx, dense_grads = _run(dense, x, dy)
    keys = [k for k in dense_grads if k.startswith("experts")]
    total = {k: torch.zeros_like(dense_grads[k]) for k in keys}
    total_dx = torch.zeros_like(dense_dx)
    for _ in range(draws):  # each call draws with a new seed (the layer's call counter)
        sampled.zero_grad()
        _, dx, grads = _run(sampled, x, dy)
        total_dx += dx
        for k in keys:
            total[k] += grads.get(k, torch.zeros_like(total[k]))
    mean = torch.cat([(total[k] / draws).flatten() for k in keys])
    exact = torch.cat([dense_grads[k].flatten() for k in keys])
    one = torch.cat([grads.get(k, torch.zeros_like(total[k])).flatten() for k in keys])

    def error(v, ref):
        return float((v - ref).norm() / ref.norm())

    # The token gradient also carries the router's exact part (every pair's <dy, o>).
    return (error(mean, exact), error(one, exact), error(total_dx / draws, dense_dx),
            error(dx, dense_dx))


@pytest.mark.parametrize("selection", ["sample", "two-stage"])
def test_sampled_gradients_are_unbiased(gloo1, selection):
    """With 400 draws the mean is within 10% (relative L2) of the dense gradient, while a
    single draw is far off: the estimator is unbiased, its noise averages out. The same
    for the token gradients, at a quarter of the single draw's error."""
    ((mean_error, single_error, mean_dx, single_dx),) = gloo1.run(
        _sample_mean_gradient, 400, selection, timeout=300)
    assert single_error > 0.2, single_error
    assert mean_error < 0.1, mean_error
    assert mean_error < single_error / 4
    assert single_dx > 0.02, single_dx
    assert mean_dx < single_dx / 4, (mean_dx, single_dx)


# -----------------------------------------------------------------------------
# Degenerate routing: zero tokens on a rank, idle experts, everything to one expert
# -----------------------------------------------------------------------------


def _forced_routing(tokens: int, experts: tuple[int, ...]):
    """A route() replacement: every token to the given experts, equal probabilities."""
    def route(hidden_states, padding_mask=None):
        n = hidden_states.shape[0] * hidden_states.shape[1]
        routing_map = torch.zeros(n, EXPERTS, dtype=torch.bool)
        routing_map[:, list(experts)] = True
        probs = routing_map.float() / len(experts)
        return probs, routing_map
    return route


def _degenerate(ep: int, gamma: float):
    import torch.distributed as dist

    megatron, lrmoe = _build(ep, gamma, aux=0.0)
    rank = dist.get_rank()
    tokens = 0 if rank == 1 else 6  # rank 1 routes nothing
    experts = (0, 1)  # experts 2..7 idle; rank 0 of EP holds both hot experts
    for layer in (megatron, lrmoe):
        layer.route = _forced_routing(tokens, experts)
    x, dy = _inputs(max(tokens, 1))
    x, dy = x[:tokens], dy[:tokens]
    out_m, dx_m, grads_m = _run(megatron, x, dy)
    out_l, dx_l, grads_l = _run(lrmoe, x, dy)
    weights = {n for n, p in lrmoe.named_parameters() if n.startswith("experts")}
    return {
        "forward": torch.allclose(out_l, out_m, rtol=RTOL, atol=ATOL),
        "dx": gamma != math.inf or torch.allclose(dx_l, dx_m, rtol=RTOL, atol=ATOL),
        "every-weight-has-grad": weights <= set(grads_l),
        "idle-grads-zero": all(float(grads_l[n].abs().sum()) == 0 for n in weights
                               if int(n.split(".")[2]) + rank * lrmoe.num_local_experts
                               not in experts),
        "grads": gamma != math.inf or all(
            torch.allclose(grads_l[n], grads_m[n], rtol=RTOL, atol=ATOL)
            for n in grads_m if n in grads_l),
    }


@pytest.mark.parametrize("gamma", [math.inf, 0.5])
def test_degenerate_routing(gloo2, gamma):
    for rank, result in enumerate(gloo2.run(_degenerate, 2, gamma)):
        assert all(result.values()), (rank, result)


# -----------------------------------------------------------------------------
# gradient_accumulation_fusion: weight gradients land in main_grad
# -----------------------------------------------------------------------------


def _main_grad_accumulation():
    _, plain = _build(1, 0.5, aux=0.0)
    _, fused = _build(1, 0.5, aux=0.0)
    fused.experts.config.gradient_accumulation_fusion = True  # apex-free: set by hand
    experts = [p for n, p in fused.named_parameters() if n.startswith("experts")]
    for p in experts:
        p.main_grad = torch.full_like(p, 0.5)  # pre-existing accumulation
        p.grad_added_to_main_grad = False
    x, dy = _inputs(8)
    _, _, grads_plain = _run(plain, x, dy)
    _, _, grads_fused = _run(fused, x, dy)
    ok = True
    for name, p in fused.named_parameters():
        if name.startswith("experts"):
            ok &= torch.allclose(p.main_grad - 0.5, grads_plain[name], rtol=RTOL, atol=ATOL)
            ok &= p.grad_added_to_main_grad is True
            ok &= float(grads_fused[name].abs().sum()) == 0  # the dummy grad DDP skips
    return ok


def test_gradient_accumulation_fusion_adds_into_main_grad(gloo1):
    assert gloo1.run(_main_grad_accumulation) == [True]


def _forward_before_and_after_setup() -> dict:
    """A layer built from its spec plans only with the settings integration hands it."""
    from megatron_lrmoe.integration.step_hooks import setup_lrmoe_layers
    from megatron_lrmoe.planning.planner import PlannerSettings

    megatron, lrmoe = _build(1, 0.5, aux=0.0)
    lrmoe.lrmoe_state.planner = None              # as built, before setup_lrmoe_layers
    x, _ = _inputs(6)
    out = {}
    try:
        lrmoe(x)
    except RuntimeError as error:
        out["error"] = str(error)
    setup_lrmoe_layers([lrmoe], None, 1)
    settings = lrmoe.placement_planner.settings
    out["settings"] = isinstance(settings, PlannerSettings)
    out["gamma"] = settings.capacity_factor
    out["forward"] = torch.allclose(lrmoe(x)[0], megatron(x)[0], rtol=RTOL, atol=ATOL)
    return out


def test_the_layer_plans_only_with_the_settings_it_is_handed(gloo1):
    (out,) = gloo1.run(_forward_before_and_after_setup)
    assert "setup_lrmoe_layers(model, tokens_per_rank, microbatches_per_step)" in out["error"]
    assert out["settings"] and out["gamma"] == 0.5 and out["forward"]
