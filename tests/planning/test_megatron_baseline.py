"""Megatron-Core's own MoELayer as the baseline (``planning/megatron_baseline.py``): its
bytes phase by phase against a ledger of what Megatron allocates and frees, by hand, and
against the measured layer; its token drop; a pipeline stage's MoE memory under
Megatron's recompute settings."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_lrmoe.planning.megatron_baseline import stage_moe_memory
from megatron_lrmoe.planning.shapes import MoEShape
from tests.planning.test_layer_memory import _Ledger, _model

# ---------------------------------------------------------------------------------------
# Megatron's own MoELayer (MegatronMoEMemory). The reference is a ledger of the buffers
# Megatron-Core 0.19.2 allocates and frees, statement by statement: moe_layer.MoELayer.
# forward's custom_forward, the all-to-all dispatcher (token_dispatcher.py), permute /
# sort_chunks_by_idxs / unpermute (moe_utils.py), SequentialMLP and MLP.forward with
# Megatron's linear autograd function, and autograd's order in backward (each node's
# saved tensors released when it has run; a storage freed with its last view).
# ---------------------------------------------------------------------------------------


def _megatron_ledger(s: MoEShape, ranks: int, rows: list[int], sent: int, pg: bool,
                     recompute: bool) -> tuple[int, int]:
    """(saved bytes, peak bytes) of one forward+backward of Megatron's MoELayer
    (SequentialMLP, unfused activation, no bias) on a rank whose local experts receive
    ``rows`` and which sends ``sent`` rows; y stays alive through backward (the caller
    holds it). ``pg``: the routing probabilities require grad."""
    H, F, F1, b = s.hidden_size, s.ffn_hidden_size, s.fc1_size, s.dtype_bytes
    T, E, L, P, N = s.tokens_per_rank, s.num_experts, len(rows), sent, sum(rows)
    xc, rc = ranks > 1, L > 1
    led = _Ledger()
    if recompute:
        led.alloc("y_outer", T * H * b)          # the first (no-grad) call's output
    # dispatch_preprocess -> permute: argsort of routing_map.T [E, T], int64, sliced to
    # P; sorted_indices = flat_sorted % T; probs gathered by flat_sorted.
    led.alloc("flat_sorted", E * T * 8)
    led.alloc("sorted_indices", P * 8)
    led.alloc("probs_perm", P * b)
    if not pg:
        led.free("flat_sorted")                  # nothing saves it
    led.alloc("x_perm", P * H * b)               # tokens.index_select(0, sorted_indices)
    # token_dispatch: all_to_all of tokens and probs (one rank: the input itself).
    if xc:
        led.alloc("x_recv", N * H * b)
        led.alloc("probs_recv", N * b)
        led.free("probs_perm")                   # custom_forward's probs rebound
    # dispatch_postprocess: sort_chunks (split + cat) with more than one local expert.
    if rc:
        led.alloc("x_sort", N * H * b)
        led.alloc("probs_sort", N * b)
    # SequentialMLP: per expert, MLP.forward (glu(z) * probs, then fc2).
    for e, n in enumerate(rows):
        led.alloc(f"z{e}", n * F1 * b)           # fc1 (saves its input, a view)
        if s.gated:
            led.alloc(f"s{e}", n * F * b)        # silu(z1), saves z1 (view of z)
            led.alloc(f"t{e}", n * F * b)        # z2 + offset
            led.alloc(f"g{e}", n * F * b)        # s * t, saves s and t
        else:
            led.alloc(f"g{e}", n * F * b)        # act(z), saves z
        led.alloc(f"h{e}", n * F * b)            # g * probs: saves probs, g if pg
        if not pg:
            led.free(f"g{e}")
        led.alloc(f"o{e}", n * H * b)            # fc2, saves h
    if rc:
        led.alloc("o_cat", N * H * b)            # torch.cat(output_local_list)
        led.free(*(f"o{e}" for e in range(L)))
        led.alloc("o_unsort", N * H * b)         # combine_preprocess: sort_chunks back
        led.free("o_cat")
    else:
        led.rename("o0", "o_unsort")
    if xc:
        led.alloc("o_recv", P * H * b)           # token_combine's all_to_all
        led.free("o_unsort")
    else:
        led.rename("o_unsort", "o_recv")
    led.alloc("y", T * H * b)                    # unpermute: zeros + scatter_add_
    # custom_forward returns: its locals (permuted, received tokens and probs) go.
    led.free("o_recv", "x_perm", "x_recv", "probs_perm", "probs_recv")
    if not rc:
        # One local expert: fc1 saved a view of the received (or permuted) tokens.
        led.alloc("x_sort", N * H * b)
        led.alloc("probs_sort", N * b)
    saved_names = [k for k in led.live if k not in ("y", "y_outer")]
    saved = sum(led.live[k] for k in saved_names)
    if recompute:
        # The checkpoint's first forward kept nothing but its output: what the ledger
        # above holds is the rerun's, inside backward, beside the first output.
        pass
    # ---- backward
    led.alloc("d_perm_out", P * H * b)           # scatter_add_'s backward: gather
    if xc:
        led.alloc("d_o_send", N * H * b)         # combine all_to_all backward
        led.free("d_perm_out")
    else:
        led.rename("d_perm_out", "d_o_send")
    if rc:
        led.alloc("G_o", N * H * b)              # unsort: split backward = cat
        led.free("d_o_send")
    else:
        led.rename("d_o_send", "G_o")
    for e in range(L - 1, -1, -1):
        n = rows[e]
        led.alloc(f"dh{e}", n * F * b)           # fc2 backward: grad_output @ W2
        led.alloc("dW2", H * F * b)              # grad_output.t() @ h, then accumulated
        led.free(f"h{e}", "dW2")
        if e == 0:
            led.free("G_o")                      # its last view consumed
        led.alloc(f"dg{e}", n * F * b)           # (g * probs) backward
        if pg:
            led.alloc("tmp", n * F * b)          # dh * g, summed to the probs' grad
            led.free("tmp")
        led.free(f"dh{e}", f"g{e}")
        if s.gated:
            led.alloc(f"ds{e}", n * F * b)       # (s * t) backward
            led.alloc(f"dt{e}", n * F * b)
            led.free(f"dg{e}", f"s{e}", f"t{e}")
            led.alloc(f"dz1{e}", n * F * b)      # silu backward
            led.free(f"ds{e}", f"z{e}")
            led.alloc(f"dz{e}", n * F1 * b)      # chunk backward: cat
            led.free(f"dz1{e}", f"dt{e}")
        else:
            led.alloc(f"dz{e}", n * F1 * b)      # activation backward
            led.free(f"dg{e}", f"z{e}")
        led.alloc(f"dx{e}", n * H * b)           # fc1 backward
        led.alloc("dW1", F1 * H * b)
        led.free(f"dz{e}", "dW1")
    led.free("x_sort", "probs_sort", "probs_perm")   # fc1's saved views, the probs
    if rc:
        led.alloc("dx_sort", N * H * b)          # SequentialMLP's split backward: cat
        led.free(*(f"dx{e}" for e in range(L)))
        led.alloc("dx_recv", N * H * b)          # the sort's split backward: cat
        led.free("dx_sort")
    else:
        led.rename("dx0", "dx_recv")
    if xc:
        led.alloc("dx_perm", P * H * b)          # dispatch all_to_all backward
        led.free("dx_recv")
    else:
        led.rename("dx_recv", "dx_perm")
    led.alloc("dX", T * H * b)                   # index_select backward: index_add_
    return (0 if recompute else saved), led.peak


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("pg", [True, False])
@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("ranks, rows, sent", [
    (2, [30, 5, 0, 12], 40), (2, [3], 60), (1, [20, 0, 7, 13], 40), (1, [40], 40),
    (4, [200, 1, 1, 90], 37), (2, [0, 0], 40)])
def test_megatron_layer_memory_equals_its_ledger(gated, pg, recompute, ranks, rows, sent):
    from megatron_lrmoe.planning.megatron_baseline import MegatronMoEMemory

    shape = MoEShape(hidden_size=16, ffn_hidden_size=12, num_experts=8, topk=2,
                     gated=gated, dtype_bytes=2, tokens_per_rank=20,
                     expert_parallel_size=ranks)
    model = MegatronMoEMemory(shape, recompute=recompute, probs_require_grad=pg)
    saved, peak = _megatron_ledger(shape, ranks, rows, sent, pg, recompute)
    assert model.saved_bytes(rows, sent) == saved
    assert model.peak_bytes(rows, sent, ranks) == peak


def test_megatron_layer_memory_by_hand():
    from megatron_lrmoe.planning.megatron_baseline import MegatronMoEMemory

    # H = 4, F = 2 (F1 = 4), b = 1, T = 3, E = 4, two ranks, one local expert of 5 rows,
    # P = 6 sent, probabilities without grad. Saved: input 5 x 4, z 5 x 4, silu, z2 + 0
    # and h 3 x 5 x 2, probs 5, indices 8 x 6 = 123. Forward at the combine: indices
    # 48 + probs 5 + permuted 24 + received 20 + activations 50 + expert output 20 +
    # received output 24 = 191; at the unpermute the expert output has gone and y (12)
    # is there: 183. Backward from S + y = 135: the expert's fc2 (G = 20, dh 10, dW2 8)
    # = 173.
    shape = MoEShape(4, 2, 4, 2, gated=True, dtype_bytes=1, tokens_per_rank=3,
                     expert_parallel_size=2)
    model = MegatronMoEMemory(shape, probs_require_grad=False)
    assert model.saved_bytes([5], 6) == 123
    levels = model.phase_levels([5], 6, 2)
    assert levels["forward/combine"] == 191
    assert levels["forward/unpermute"] == 183
    assert levels["backward/experts"] == 173
    assert model.peak_bytes([5], 6, 2) == 191
    recompute = MegatronMoEMemory(shape, recompute=True, probs_require_grad=False)
    assert recompute.saved_bytes([5], 6) == 0
    assert recompute.peak_bytes([5], 6, 2) == 191 + 12


def test_megatron_kept_counts_by_hand():
    from megatron_lrmoe.planning.megatron_baseline import megatron_kept_counts

    counts = np.array([[9, 1, 4, 2], [3, 3, 3, 7]])     # T = 8 tokens, top-2, E = 4
    # C = ceil(8 x 2 / 4 x 1.0) = 4: keep min(count, 4); padded: 4 everywhere.
    assert megatron_kept_counts(counts, 8, 2, 1.0).tolist() == [[4, 1, 4, 2],
                                                                    [3, 3, 3, 4]]
    assert megatron_kept_counts(counts, 8, 2, 1.0, pad=True).tolist() == [[4] * 4] * 2
    # C = ceil(4 x 2.5) = 10 > T: nothing dropped.
    assert megatron_kept_counts(counts, 8, 2, 2.5).tolist() == counts.tolist()


def test_megatron_grouped_memory_by_hand():
    # TEGroupedMLP (unvalidated model: no GPU with Transformer Engine has measured it).
    # H = 4, F = 2, F1 = 4, b = 1, T = 3, E = 4 over 2 ranks (2 local experts, 3 + 2
    # rows), P = 6, probabilities with grad (argsort index 8 x 12). Saved: input 20, z 20,
    # h 10, probs 5, indices 48 + 96 = 199.
    from megatron_lrmoe.planning.megatron_baseline import MegatronMoEMemory

    shape = MoEShape(4, 2, 4, 2, gated=True, dtype_bytes=1, tokens_per_rank=3,
                     expert_parallel_size=2)
    model = MegatronMoEMemory(shape, grouped=True)
    assert model.saved_bytes([3, 2], 6) == 199
    levels = model.phase_levels([3, 2], 6, 2)
    alive = 144 + (6 + 5 + 5) * 4 + 2 * 5       # indices, rows alive, probs (2 copies)
    assert levels["forward/experts"] == alive + 5 * max(4 + 2 * 2, 4 + 2 + 4)
    assert levels["forward/unsort"] == alive + 5 * 6 + 2 * 5 * 4
    # From S + y = 211: fc2 backward G + dh = 20 + 10; the activation's backward, G and
    # h gone, dh, dh x w, dz and swiglu(z) x dh = 5 x 10; fc1, z and h gone, dz + dx =
    # 5 x 8. Unfused wgrad adds both experts' dW2 (2 x 8) and dW1 (2 x 16) at once.
    assert levels["backward/experts"] == max(211 + 30, 211 - 10 + 50, 211 - 30 + 40)
    unfused = MegatronMoEMemory(shape, grouped=True, wgrad_accumulation_fused=False)
    assert unfused.phase_levels([3, 2], 6, 2)["backward/experts"] == max(
        211 + 30 + 2 * 8, 211 - 10 + 50, 211 - 30 + 40 + 2 * 16)


_MEGATRON_VARIANTS = {
    # name: (TransformerConfig fields, forced routing (None: Megatron's router), whether
    # the forced probabilities require grad)
    "dropless": ({}, "forced", False),
    "dropless, probs with grad": ({}, "forced", True),
    "moe recompute": ({"recompute_granularity": "selective", "recompute_modules": ["moe"]},
                      "forced", True),
    "router, capacity drop": ({"moe_expert_capacity_factor": 1.0,
                               "moe_token_drop_policy": "probs"}, None, True),
    "router, capacity pad": ({"moe_expert_capacity_factor": 1.0,
                             "moe_token_drop_policy": "probs",
                             "moe_pad_expert_input_to_capacity": True}, None, True),
}


def _measure_megatron_layer(cfg: dict, name: str) -> dict:
    """On each gloo rank: Megatron's MoELayer built with the variant's config, one
    measured forward+backward (``layer_bench.measure_memory``: saved bytes by autograd's
    hooks, the allocator's peak by torch.profiler's memory events), and the [R, E]
    routed counts of that call (after the router's capacity drop)."""
    import torch.distributed as dist

    from lrmoe_studies.layer_bench import (
        build_megatron_layer,
        gather_counts,
        measure_memory,
        skewed_routing,
    )

    fields, routing, probs_grad = _MEGATRON_VARIANTS[name]
    rank = dist.get_rank()
    layer = build_megatron_layer(cfg, **fields)
    gen = torch.Generator().manual_seed(cfg["seed"] + 1000 + rank)
    x = torch.randn(cfg["tokens"], 1, cfg["hidden"], generator=gen)
    dy = torch.randn(cfg["tokens"], 1, cfg["hidden"], generator=gen)
    if routing == "forced":
        probs, routing_map = skewed_routing(cfg["tokens"], cfg["experts"], cfg["topk"], 1.2,
                                            cfg["seed"], rank, torch.float32)
        probs.requires_grad_(probs_grad)
        layer.route = lambda hidden, padding_mask=None, _r=(probs, routing_map): _r
    else:
        with torch.no_grad():
            _, routing_map = layer.route(x)
    counts = gather_counts(routing_map, cfg["ep"])
    memory = measure_memory(cfg, layer, x, dy, lambda: None, dist.barrier)
    return {"counts": counts.tolist(), **memory}


@pytest.mark.parametrize("name", list(_MEGATRON_VARIANTS))
def test_megatron_layer_memory_matches_the_measured_layer(gloo2, name):
    # Megatron-Core's own MoELayer (all-to-all dispatcher, SequentialMLP, SwiGLU, fp32)
    # over two gloo ranks, skewed so that the ranks differ: the model's saved bytes and
    # peak against the allocator's, on every rank. The model leaves out the router's own
    # saved logits and scores (a few T x E) and small counts: within 2% here (0.6% at
    # most when written).
    from megatron_lrmoe.planning.megatron_baseline import MegatronMoEMemory

    cfg = dict(device="cpu", dtype="fp32", ep=2, seed=1234, hidden=128, ffn=64, experts=8,
               topk=2, tokens=256, kernels="auto", grouped_gemm="auto")
    results = gloo2.run(_measure_megatron_layer, cfg, name, timeout=300)
    fields, _, probs_grad = _MEGATRON_VARIANTS[name]
    counts = np.asarray(results[0]["counts"], dtype=np.float64)
    padded = bool(fields.get("moe_pad_expert_input_to_capacity"))
    if padded:
        from megatron_lrmoe.planning.megatron_baseline import megatron_kept_counts

        counts = megatron_kept_counts(counts, cfg["tokens"], cfg["topk"], 1.0, pad=True)
    shape = MoEShape(cfg["hidden"], cfg["ffn"], cfg["experts"], cfg["topk"], True, 4,
                     cfg["tokens"], expert_parallel_size=2)
    model = MegatronMoEMemory(shape, recompute="recompute_modules" in fields,
                              probs_require_grad=probs_grad, padded=padded)
    saved, peak = model.rank_memory(counts)
    for rank, measured in enumerate(results):
        if model.recompute:
            assert saved[rank] == measured["mem_saved"] == 0
        else:
            assert abs(saved[rank] / measured["mem_saved"] - 1) <= 0.02, (rank, measured)
        assert abs(peak[rank] / measured["mem_peak"] - 1) <= 0.02, (rank, peak, measured)




# ---------------------------------------------------------------------------------------
# A stage's MoE layers under Megatron's recompute settings (stage_moe_memory)
# ---------------------------------------------------------------------------------------


def test_stage_memory_without_recompute_is_the_layers_rank_memories():
    # The planner's convention: a stage holds the sum of its layers' rank_memory.

    model = _model(layers=3, in_flight=2)
    loads = [(np.array([20.0, 14.0]), np.array([15.0, 14.0])),
             (np.array([12.0, 22.0]), np.array([12.0, 16.0])),
             (np.array([17.0, 17.0]), np.array([9.0, 17.0]))]
    replicas = np.array([1.0, 0.0])
    levels = [model.rank_levels(routed, retained, replicas) for routed, retained in loads]
    rep = replicas * model.shape.instance_bytes
    stage = stage_moe_memory(np.stack([lv[0] for lv in levels]),
                             np.stack([lv[1] for lv in levels]), np.stack([rep] * 3),
                             model.shape.output_bytes, microbatches_in_flight=2)
    want = sum(model.rank_memory(replicas, routed, retained) for routed, retained in loads)
    np.testing.assert_allclose(stage, want)


def test_stage_memory_under_moe_recompute_is_megatrons_recomputed_peak():
    # Megatron's own model of its checkpointed layer (levels + y, nothing saved) is the
    # independent reference for the recompute composition.
    from megatron_lrmoe.planning.megatron_baseline import MegatronMoEMemory

    shape = MoEShape(16, 8, 4, 2, gated=True, dtype_bytes=4, tokens_per_rank=12,
                     expert_parallel_size=2)
    counts = np.array([[5.0, 9.0, 4.0, 6.0], [7.0, 3.0, 8.0, 6.0]])
    saved, peak = MegatronMoEMemory(shape).rank_memory(counts)
    _, want = MegatronMoEMemory(shape, recompute=True).rank_memory(counts)
    got = stage_moe_memory(saved[None], peak[None], np.zeros((1, 2)), shape.output_bytes,
                           recompute_moe=True)
    np.testing.assert_allclose(got, want)


def test_stage_memory_under_full_recompute_by_hand():

    saved = np.array([[10.0], [20.0], [30.0]])
    peak = np.array([[50.0], [45.0], [70.0]])
    none = np.zeros((3, 1))
    kw = dict(output_bytes=5.0, microbatches_in_flight=2)
    # Nothing recomputed: 2 (10 + 20 + 30) + (40 + 25 + 40) / 3.
    assert stage_moe_memory(saved, peak, none, **kw)[0] == 120 + 35
    # Block of 1: layers 2-3 keep 2 (20 + 30); transients (50 + 25 + 40) / 3.
    assert stage_moe_memory(saved, peak, none, full_recompute_layers=1, **kw)[0] == 100 + 115 / 3
    # Block of 3: nothing kept; the rebuilt peaks' mean.
    assert stage_moe_memory(saved, peak, none, full_recompute_layers=3, **kw)[0] == 55
    # moe recompute: mean(peak + y).
    assert stage_moe_memory(saved, peak, none, recompute_moe=True, **kw)[0] == 60
    # Replicas add whatever the layers do.
    assert stage_moe_memory(saved, peak, np.full((3, 1), 2.0), full_recompute_layers=3,
                            **kw)[0] == 61


# ---------------------------------------------------------------------------------------
# A run's MoE memory step by step (steps_moe_memory): each step's levels with that step's
# replicas, never maxima joined from different steps
# ---------------------------------------------------------------------------------------


def test_steps_memory_is_each_steps_own_levels_and_replicas():
    from megatron_lrmoe.planning.megatron_baseline import steps_moe_memory

    # [N=2 steps, 1 layer, R=2]: step 0 (the warm-up) has a hot rank 0 and no replica;
    # step 1 is level, with replicas on both ranks.
    saved = np.array([[[10.0, 2.0]], [[3.0, 3.0]]])
    peak = np.array([[[14.0, 3.0]], [[5.0, 5.0]]])
    replicas = np.array([[[0.0, 0.0]], [[8.0, 8.0]]])
    got = steps_moe_memory(saved, peak, replicas, output_bytes=1.0)
    # One layer, nothing recomputed: a rank holds its replicas and the layer's peak.
    np.testing.assert_allclose(got, [[14.0, 3.0], [13.0, 13.0]])
    assert got.max() == 14.0
    # The maxima of each quantity over the steps join step 0's hot rank with step 1's
    # replicas: 22, which no step holds.
    joined = stage_moe_memory(saved.max(0), peak.max(0), replicas.max(0), 1.0)
    assert joined.max() == 22.0


@pytest.mark.parametrize("recompute", [{}, {"full_recompute_layers": 2},
                                       {"recompute_moe": True}])
def test_steps_memory_by_brute_force(recompute):
    from megatron_lrmoe.planning.megatron_baseline import steps_moe_memory

    rng = np.random.default_rng(3)
    steps, layers, ranks, mif, y = 4, 3, 5, 2, 7.0
    saved = rng.uniform(0, 50, (steps, layers, ranks))
    peak = saved + rng.uniform(0, 80, (steps, layers, ranks))
    replicas = rng.integers(0, 4, (steps, layers, ranks)) * 9.0
    got = steps_moe_memory(saved, peak, replicas, y, mif, **recompute)
    n = recompute.get("full_recompute_layers", 0)
    for t in range(steps):
        for r in range(ranks):
            # Per step and rank, from the recompute rules of stage_moe_memory's doc.
            if recompute.get("recompute_moe"):
                want = sum(replicas[t, :, r]) + sum(peak[t, :, r] + y) / layers
            else:
                want = (sum(replicas[t, :, r]) + sum(mif * saved[t, n:, r])
                        + (sum(peak[t, :n, r]) + sum(peak[t, n:, r] - saved[t, n:, r]))
                        / layers)
            assert got[t, r] == pytest.approx(want)
    with pytest.raises(ValueError, match=r"\[N, Lyr, R\]"):
        steps_moe_memory(saved[0], peak[0], replicas[0], y)
