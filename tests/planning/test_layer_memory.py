"""The memory half of the cost model (``planning/layer_memory.py``; docs/design.md, "Cost
model") and the shapes it reads, against ledgers of the region's buffers, brute force and
the allocator. Megatron's own layer: test_megatron_baseline.py; time: test_layer_time.py;
the machine constants: test_machine.py."""

from __future__ import annotations

import math
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_lrmoe.planning.cost_model import CostModel
from megatron_lrmoe.planning.machine import MachineConstants
from megatron_lrmoe.planning.megatron_baseline import stage_moe_memory
from megatron_lrmoe.planning.retention import plan_retention, stored_in_forward
from megatron_lrmoe.planning.shapes import MoEShape

ROOT = Path(__file__).resolve().parents[2]
MACHINE = MachineConstants(gemm_flops_per_s=2e9, alltoall_bytes_per_s=1e8,
                           alltoall_latency_s=1e-5, source="test")


def test_shape_numbers_match_the_design_reference():
    # docs/design.md, "Reference shapes": Qwen3-30B-A3B per pair (bf16): 9.4 MFLOP forward, 18.9
    # backward, 4 KiB per all-to-all direction.
    qwen = MoEShape(2048, 768, 128, 8, gated=True, dtype_bytes=2, tokens_per_rank=4096)
    assert qwen.forward_flops_per_pair == 2 * 2048 * (1536 + 768) == 9_437_184
    assert qwen.backward_flops_per_pair == 2 * qwen.forward_flops_per_pair
    assert qwen.hidden_size * qwen.dtype_bytes == 4096
    assert qwen.instance_bytes == 2 * (1536 + 768) * 2048 * 2     # weights + grad buffer
    fp32_grads = MoEShape(2048, 768, 128, 8, True, 2, 4096, grad_dtype_bytes=4)
    assert fp32_grads.instance_bytes == (1536 + 768) * 2048 * (2 + 4)
    glm = MoEShape(4096, 1408, 128, 8, True, 2, 4096)
    assert round(glm.forward_flops_per_pair / 1e6, 1) == 34.6


def _model(layers: int = 3, in_flight: int = 2, **fields) -> CostModel:
    shape = MoEShape(**{**dict(hidden_size=8, ffn_hidden_size=4, num_experts=4, topk=2,
                               gated=False, dtype_bytes=2, tokens_per_rank=10,
                               num_layers=layers, microbatches_in_flight=in_flight),
                        **fields})
    return CostModel(shape, MACHINE)


# ---------------------------------------------------------------------------------------
# Memory. The reference is a ledger: the region's buffers allocated and freed in the order
# layer/region.py and layer/expert_gemms.py allocate and free them (the tensor each statement
# creates, and when its last reference goes), with the peak of the running total. It is
# written from the code, not from the cost model's closed form, which must equal it.
# ---------------------------------------------------------------------------------------


class _Ledger:
    def __init__(self):
        self.live: dict[str, int] = {}
        self.peak = 0

    def alloc(self, name: str, nbytes: float) -> None:
        assert name not in self.live, name
        self.live[name] = nbytes
        self.peak = max(self.peak, sum(self.live.values()))

    def free(self, *names: str) -> None:
        for name in names:
            self.live.pop(name, None)

    def rename(self, old: str, new: str) -> None:
        self.live[new] = self.live.pop(old)


def _ledger_peak(s: MoEShape, ranks: int, n_fwd: list[int], n_bwd: list[int],
                 kept: int) -> int:
    """Peak bytes of one forward+backward of the region on a rank whose local instances
    receive n_fwd rows (routed) and keep n_bwd (retained), which keeps ``kept`` of its
    P pairs as a source; the layer output y stays alive through backward (the caller
    holds it) and the 32 bytes of pair metadata per source pair exist throughout."""
    H, F, F1, b = s.hidden_size, s.ffn_hidden_size, s.fc1_size, s.dtype_bytes
    gb = s.grad_dtype_bytes or b
    P, T, L = s.source_pairs, s.tokens_per_rank, len(n_fwd)
    N, K = sum(n_fwd), sum(n_bwd)
    exchange, reorder, drops = ranks > 1, ranks > 1 and L > 1, K < N
    forward = s.forward_retention           # kept set drawn in forward, x and z compacted
    led = _Ledger()
    # Pair metadata; drawn in forward, the source's kept index (int64) and scale (fp32)
    # too, upper-bounded by all P pairs.
    led.alloc("meta", (32 + (12 if forward else 0)) * P)
    # ---- forward: dispatch
    led.alloc("x_sel", P * H * b)                           # x.index_select(pair_token)
    if exchange:
        led.alloc("x_recv", N * H * b)                      # all_to_all output
        led.free("x_sel")
    else:
        led.rename("x_sel", "x_recv")                       # one rank: the rows themselves
    if reorder:
        led.alloc("x_exp", N * H * b)
        led.free("x_recv")
    else:
        led.rename("x_recv", "x_exp")
    # ---- experts
    if s.grouped_gemm:
        led.alloc("w1s", L * F1 * H * b)
        led.alloc("z", N * F1 * b)
        led.free("w1s")
        if s.gated:
            led.alloc("silu", N * F * b)
            led.alloc("lin", N * F * b)
            led.alloc("h", N * F * b)
            led.free("silu", "lin")
        else:
            led.alloc("h", N * F * b)
        led.alloc("w2s", L * H * F * b)
        led.alloc("o_exp", N * H * b)
        led.free("h", "w2s")
    else:
        led.alloc("z", N * F1 * b)
        led.alloc("o_exp", N * H * b)
        for e, n in enumerate(n_fwd):
            if n == 0:
                continue                                    # skipped: h stays as it was
            if s.gated:
                led.alloc(f"silu{e}", n * F * b)
                led.alloc(f"lin{e}", n * F * b)
                led.alloc(f"h{e}", n * F * b)
                led.free(f"silu{e}", f"lin{e}")
            else:
                led.alloc(f"h{e}", n * F * b)
            led.free(*(f"h{j}" for j in range(e)))          # the previous h is replaced
        led.free(*(f"h{j}" for j in range(L)))
    if forward and drops:                                   # compaction to the kept rows
        led.alloc("xk", K * H * b)
        led.free("x_exp")
        led.alloc("zk", K * F1 * b)
        led.free("z")
    gathers = drops and not forward                         # backward gathers x and z
    # ---- back to the sources, combine
    if reorder:
        led.alloc("o_src", N * H * b)
        led.free("o_exp")
    else:
        led.rename("o_exp", "o_src")
    if exchange:
        led.alloc("o", P * H * b)
        led.free("o_src")
    else:
        led.rename("o_src", "o")
    led.alloc("y", T * H * b)
    # ---- backward: source side
    led.alloc("book", (16 if forward else 28) * P)
    led.alloc("g_kept", kept * H * b)
    if exchange:
        led.alloc("g_recv", K * H * b)
        led.free("g_kept")
    else:
        led.rename("g_kept", "g_recv")
    if reorder:
        led.alloc("g_exp", K * H * b)
        led.free("g_recv")
    else:
        led.rename("g_recv", "g_exp")
    # ---- expert backward
    conv1 = F1 * H * gb if gb != b else 0
    if s.grouped_gemm:
        if gathers:
            led.alloc("xg", K * H * b)
            led.alloc("zg", K * F1 * b)
        if s.gated:
            led.alloc("silu", K * F * b)
            led.alloc("lin", K * F * b)
        led.alloc("h", K * F * b)
        led.alloc("w2s", L * H * F * b)
        led.alloc("dh", K * F * b)
        led.free("w2s")
        if s.gated:                                         # mul, silu and split backward
            led.alloc("g_silu", K * F * b)
            led.alloc("g_lin", K * F * b)
            led.free("silu", "lin")
            led.alloc("g_z1", K * F * b)
            led.free("g_silu")
            led.alloc("dz", K * F1 * b)
            led.free("g_z1", "g_lin")
        else:
            led.alloc("dz", K * F1 * b)
        led.alloc("w1s", L * F1 * H * b)
        led.alloc("dx", K * H * b)
        led.free("w1s")
        led.alloc("dw2", L * H * F * b)
        if gb != b:
            led.alloc("conv", H * F * gb)
            led.free("conv")
        led.free("dw2")
        led.alloc("dw1", L * F1 * H * b)
        if conv1:
            led.alloc("conv", conv1)
            led.free("conv")
        led.free("dw1", "h", "dh", "dz", "xg", "zg")
    else:
        led.alloc("dx", K * H * b)
        for e, n in enumerate(n_bwd):
            if gathers:
                led.alloc(f"xg{e}", n * H * b)
                led.free(f"xg{e - 1}")
                led.alloc(f"zg{e}", n * F1 * b)
                led.free(f"zg{e - 1}")
            if s.gated:
                led.alloc(f"silu{e}", n * F * b)
                led.alloc(f"lin{e}", n * F * b)
            led.alloc(f"h{e}", n * F * b)
            led.free(f"h{e - 1}")
            led.alloc(f"dh{e}", n * F * b)
            if s.gated:
                led.alloc(f"g_silu{e}", n * F * b)
                led.alloc(f"g_lin{e}", n * F * b)
                led.free(f"silu{e}", f"lin{e}")
                led.alloc(f"g_z1{e}", n * F * b)
                led.free(f"g_silu{e}")
                led.alloc(f"dz{e}", n * F1 * b)
                led.free(f"g_z1{e}", f"g_lin{e}")
            else:
                led.alloc(f"dz{e}", n * F1 * b)
            led.free(f"dz{e - 1}", f"dh{e}")
            led.alloc("dw2", H * F * b)
            if gb != b:
                led.alloc("conv", H * F * gb)
                led.free("conv")
            led.free("dw2")
            led.alloc("dw1", F1 * H * b)
            if conv1:
                led.alloc("conv", conv1)
                led.free("conv")
            led.free("dw1")
        led.free(f"h{L - 1}", f"dz{L - 1}", f"xg{L - 1}", f"zg{L - 1}")
    led.free("g_exp")
    # ---- dX back to the sources
    if reorder:
        led.alloc("dx_src", K * H * b)
        led.free("dx")
    else:
        led.rename("dx", "dx_src")
    if exchange:
        led.alloc("dx_back", kept * H * b)
        led.free("dx_src")
    else:
        led.rename("dx_src", "dx_back")
    led.alloc("dx_tokens", T * H * b)
    return led.peak


def _one_rank_memory(cost: CostModel, n_fwd: list[int], n_bwd: list[int], kept: int,
                     replicas: int = 0) -> float:
    starts = np.array([0])
    return float(cost.rank_memory(
        np.array([replicas]), np.array([sum(n_fwd)]), np.array([sum(n_bwd)]),
        sent_kept=np.array([kept]), instance_routed=np.array(n_fwd),
        instance_retained=np.array(n_bwd), rank_starts=starts)[0])


def test_memory_terms_by_hand():
    # Qwen3-30B-A3B-like, bf16 with fp32 gradient buffers.
    s = MoEShape(2048, 768, 128, 8, True, 2, 4096, grad_dtype_bytes=4)
    assert s.row_bytes == 4096
    assert s.saved_bytes_per_routed_pair == (2048 + 1536) * 2
    assert s.saved_bytes_per_source_pair == 4096 + 32
    assert s.output_bytes == 4096 * 4096
    assert s.weight_gradient_temporary_bytes == 1536 * 2048 * (2 + 4)
    assert s.forward_activation_factor == 3
    plain = MoEShape(2048, 768, 128, 8, False, 2, 4096)
    assert plain.weight_gradient_temporary_bytes == 768 * 2048 * 2
    assert plain.forward_activation_factor == 1


def test_rank_memory_by_hand():
    # H=8, F=4, gated (F1=8), b=2, T=10, top-2 (P=20), 4 experts on 2 ranks: one rank
    # receiving 20 + 10 rows, keeping all, keeping 20 pairs as a source. Bytes:
    #   row 16, x_exp + z 32 per routed row, o + metadata 48 per source pair, y 160,
    #   bookkeeping 28 * 20 = 560, activation rows F*b = 8, F1*b = 16, dW1 8*8*2 = 128.
    #   saved S = 30*32 + 20*48 = 1920
    #   forward: dispatch (20 + 30)*16 = 800, 2*30*16 = 960; experts 30*32 + 30*16 +
    #     max(3*20*8, (3*10 + 20)*8) = 1920; o reordered 30*(32 + 32) = 1920; o received
    #     30*(32 + 16) + 20*16 = 1760 -> 1920
    #   backward: 1920 + 160 + 560 = 2640 plus the largest of (30 + 20)*16 = 800,
    #     2*30*16 = 960, 30*16*2 + max(max(60*16, 20*24 + 128), max(50*16, 10*24 + 128))
    #     = 1920, 800, 20*16 + 160 = 480 -> 4560
    cost = _model(layers=1, in_flight=1, gated=True, expert_parallel_size=2)
    assert _one_rank_memory(cost, [20, 10], [20, 10], 20) == 4560
    assert _ledger_peak(cost.shape, 2, [20, 10], [20, 10], 20) == 4560
    # Three layers, two micro-batches in flight: 2*1920 + (4560 - 1920)/3 = 4720; a
    # replica adds (8 + 4)*8 elements * (2 + 2) bytes = 384.
    three = _model(layers=3, in_flight=2, gated=True, expert_parallel_size=2)
    assert _one_rank_memory(three, [20, 10], [20, 10], 20) == 4720
    assert _one_rank_memory(three, [20, 10], [20, 10], 20, replicas=1) == 4720 + 384
    # plan_memory reads the same from a plan: rank 0 routed (20, 10), rank 1 (5, 5).
    plan = plan_retention(torch.tensor([[12, 5, 2, 1], [8, 5, 3, 4]]), 2, math.inf)
    got = cost.plan_memory(plan, np.zeros(2))
    assert got[0] == 4560
    assert got[1] == _ledger_peak(cost.shape, 2, [5, 5], [5, 5], 20)


LEDGER_SHAPES = [
    dict(gated=True, expert_parallel_size=2),
    dict(gated=True, expert_parallel_size=2, forward_retention=True),
    dict(gated=False, expert_parallel_size=1, forward_retention=True),
    dict(gated=True, expert_parallel_size=2, grouped_gemm=True, forward_retention=True),
    dict(gated=False, expert_parallel_size=2),
    dict(gated=True, expert_parallel_size=2, grad_dtype_bytes=4),
    dict(gated=True, expert_parallel_size=1),
    dict(gated=True, expert_parallel_size=4, num_experts=4),      # one expert per rank
    dict(gated=True, expert_parallel_size=2, grouped_gemm=True),
    dict(gated=False, expert_parallel_size=2, grouped_gemm=True, grad_dtype_bytes=4),
    dict(gated=True, expert_parallel_size=1, grouped_gemm=True),
]


@pytest.mark.parametrize("fields", LEDGER_SHAPES)
def test_rank_memory_equals_the_region_ledger(fields):
    cost = _model(layers=1, in_flight=1, **fields)
    s = cost.shape
    ep = s.expert_parallel_size
    local = s.num_experts // ep
    gen = np.random.default_rng(0)
    p = s.source_pairs
    for trial in range(60):
        if ep == 1:                 # one rank: it receives and keeps its own pairs
            n_fwd = gen.multinomial(p, np.ones(local) / local).tolist()
        else:
            n_fwd = gen.integers(0, 3 * p // local + 2, size=local).tolist()
        n_bwd = (list(n_fwd) if trial % 3 == 0                      # keeps every row
                 else [int(gen.integers(0, n + 1)) for n in n_fwd])
        kept = sum(n_bwd) if ep == 1 else int(gen.integers(0, p + 1))
        want = _ledger_peak(s, ep, n_fwd, n_bwd, kept)
        assert _one_rank_memory(cost, n_fwd, n_bwd, kept) == want, (n_fwd, n_bwd, kept)
        # Without the per-instance rows the model bounds them: never below.
        bound = cost.rank_memory(np.zeros(1), np.array([sum(n_fwd)]), np.array([sum(n_bwd)]),
                                 sent_kept=np.array([kept]))[0]
        assert bound >= want


# share, layers, in flight: the capacity and the limit inverted by scanning rank_memory.
@pytest.mark.parametrize("fields", [
    dict(gated=False), dict(gated=True, expert_parallel_size=2),
    dict(gated=True, expert_parallel_size=1),
    dict(gated=False, forward_retention=True),
    dict(gated=True, expert_parallel_size=2, forward_retention=True),
    dict(gated=True, expert_parallel_size=1, forward_retention=True),
    dict(gated=True, expert_parallel_size=2, grouped_gemm=True, forward_retention=True),
    dict(gated=True, expert_parallel_size=2, grouped_gemm=True, grad_dtype_bytes=4),
    # Under recompute (kept_layers_fraction, rerun_output_bytes).
    dict(gated=True, expert_parallel_size=2, recompute_moe=True),
    dict(gated=False, forward_retention=True, full_recompute_layers=1),
    dict(gated=True, expert_parallel_size=2, grouped_gemm=True, forward_retention=True,
         full_recompute_layers=3),
])
@pytest.mark.parametrize("layers, in_flight", [(1, 1), (3, 2)])
def test_capacity_and_retained_limit_against_brute_force(fields, layers, in_flight):
    cost = _model(layers, in_flight, **fields)
    reps = np.array([0, 2])
    one_rank = cost.shape.expert_parallel_size == 1
    if one_rank:
        reps = np.array([0])
    p = cost.shape.source_pairs

    top = 20_000
    grid = np.arange(top + 1)

    def largest(replicas, routed, retained, slack=0.0):
        """The largest n in [0, top] whose memory fits (0 if none), by evaluating all;
        ``slack``: relative give in the share (a level exactly at it is a float tie)."""
        memory = cost.rank_memory(np.full(top + 1, replicas), routed, retained)
        fits = memory <= share * (1 + slack)
        assert not fits[-1]             # the answer is inside the grid
        return int(grid[fits].max()) if fits.any() else 0

    def check(got, replicas, routed, retained):
        # Exact, but for a level that meets the share to rounding.
        assert (largest(replicas, routed, retained, -1e-12) <= got
                <= largest(replicas, routed, retained, 1e-12)), (share, got)

    balanced = cost.rank_memory(np.zeros(1), np.array([p]), np.array([p]))[0]
    for share in (balanced * 0.7, balanced, balanced * 1.3, balanced * 2.0, 2400.5):
        assert math.isclose(cost.memory_share(layers * share), share, rel_tol=1e-15)
        cap = cost.receive_limit(share, reps)
        assert cap.dtype == np.int64
        for got, r in zip(cap.tolist(), reps.tolist(), strict=True):
            check(got, r, grid, 0 * grid)
        for routed in ([60, 10], [45, 45], [0, 0], [20, 120]):
            routed = [p] if one_rank else routed    # one rank receives its own pairs
            limit = cost.retained_limit(share, reps, np.array(routed))
            for got, r, n in zip(limit.tolist(), reps.tolist(), routed, strict=True):
                check(got, r, np.full(top + 1, n), grid)


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("store_factor", [1.5, 2.0])
def test_two_stage_retained_limit_is_safe(grouped, store_factor):
    # The limit prices the stored rows at rho K (not capped at the routed rows, nor
    # floored per cell): keeping up to it fits the share whatever the cells, and it is no
    # more than the brute-force largest K at the rank's bound min(routed, rho K).
    cost = _model(layers=2, in_flight=2, gated=True, expert_parallel_size=2,
                  grouped_gemm=grouped, forward_retention=True, store_factor=store_factor)
    gen = np.random.default_rng(2)
    p = cost.shape.source_pairs
    grid = np.arange(0, 4 * p + 1)
    for _ in range(30):
        routed = int(gen.integers(1, 4 * p))
        share = float(gen.uniform(0.6, 1.6)) * cost.balanced_dropless_need() / 2
        # (a limit at or above the routed rows keeps them all)
        limit = min(routed, int(cost.retained_limit(share, np.zeros(1), np.array([routed]))[0]))
        k = grid[grid <= routed]
        memory = cost.rank_memory(np.zeros(len(k)), np.full(len(k), routed), k)
        assert limit <= (int(k[memory <= share].max()) if (memory <= share).any() else 0)
        if limit > 0:
            assert memory[limit] <= share
            # Exact per-cell stored rows (two sources, two instances) never need more.
            for _ in range(5):
                n = gen.multinomial(routed, np.ones(4) / 4).reshape(2, 2)
                q = np.minimum(n, gen.multinomial(min(limit, routed), n.ravel() / routed)
                               .reshape(2, 2))
                stored = cost.stored_per_rank(n, q, np.zeros(1, dtype=np.int64))
                got = cost.rank_memory(np.zeros(1), np.array([routed]), np.array([q.sum()]),
                                       stored=stored)[0]
                assert got <= share


def test_retained_limit_with_the_largest_instance_is_safe_and_tighter():
    # Per-instance rows the limit does not know: whatever they are (largest routed
    # instance at most M), keeping up to the limit fits the share.
    cost = _model(layers=2, in_flight=1, gated=True, expert_parallel_size=2)
    gen = np.random.default_rng(1)
    for _ in range(40):
        n_fwd = gen.integers(0, 40, size=2)
        routed = int(n_fwd.sum())
        share = float(gen.uniform(0.8, 1.6)) * cost.balanced_dropless_need() / 2
        plain = int(cost.retained_limit(share, np.zeros(1), np.array([routed]))[0])
        limit = int(cost.retained_limit(share, np.zeros(1), np.array([routed]),
                                        np.array([n_fwd.max()]))[0])
        assert limit >= plain
        if not 0 < limit < routed:
            continue
        for _ in range(10):        # spread `limit` retained rows within each instance's
            n_bwd = np.minimum(n_fwd, gen.multinomial(limit, n_fwd / routed))
            got = _one_rank_memory(cost, n_fwd.tolist(), n_bwd.tolist(), cost.shape.source_pairs)
            assert got <= share


def test_balanced_dropless_need_by_hand():
    # Every rank receives and keeps its own P = 20 pairs, spread over its 2 experts (10
    # rows each), no replica: the rank of test_rank_memory_by_hand with rows (10, 10).
    # forward: 800 (dispatch 40*16), 640 (2*20*16), 20*32 + 20*16 + (30 + 10)*8 = 1280,
    #   20*64 = 1280, 20*48 + 20*16 = 1280 -> 1280; S = 20*32 + 20*48 = 1600
    # backward: 1600 + 160 + 560 = 2320 + max(640, 640, 20*16*2 + max(max(30*16, 10*24
    #   + 128), max(40*16, 368)) = 1280, 640, 20*16 + 160 = 480) = 3600
    cost = _model(layers=1, in_flight=1, gated=True, expert_parallel_size=2)
    assert cost.balanced_dropless_need() == 3600
    assert _ledger_peak(cost.shape, 2, [10, 10], [10, 10], 20) == 3600
    # Three layers, two in flight: per layer 2*1600 + (3600 - 1600)/3, times 3.
    three = _model(layers=3, in_flight=2, gated=True, expert_parallel_size=2)
    assert math.isclose(three.balanced_dropless_need(), 3 * (3200 + Fraction(2000, 3)),
                        rel_tol=1e-15)
    # Unknown EP size: the per-instance rows are bounded by the rank's, never less.
    assert _model(layers=1, in_flight=1, gated=True).balanced_dropless_need() >= 3600


def test_balanced_need_under_recompute_by_hand():
    # The shape of test_balanced_dropless_need_by_hand: S = 1600, peak 3600, y = T H b =
    # 160; three layers, two micro-batches in flight.
    kw = dict(layers=3, in_flight=2, gated=True, expert_parallel_size=2)
    # moe recompute: no layer keeps S; each answers for a third of (peak + y).
    assert math.isclose(_model(**kw, recompute_moe=True).balanced_dropless_need(),
                        3600 + 160, rel_tol=1e-15)
    # Full recompute of 1 of 3: two layers keep 2 S; the transient is the rebuilt
    # layer's peak and the others' peak - S, a third each.
    assert math.isclose(_model(**kw, full_recompute_layers=1).balanced_dropless_need(),
                        2 * 2 * 1600 + (3600 + 2 * 2000) / 3, rel_tol=1e-15)
    # Every layer (uniform, or n beyond the stage): one layer's peak.
    for n in (3, 7):
        assert math.isclose(_model(**kw, full_recompute_layers=n).balanced_dropless_need(),
                            3600, rel_tol=1e-15)


@pytest.mark.parametrize("recompute", [dict(), dict(recompute_moe=True),
                                       dict(full_recompute_layers=1),
                                       dict(full_recompute_layers=3)])
def test_like_layers_sum_to_the_stage_composition(recompute):
    # rank_memory's per-layer share under recompute, over Lyr layers routed alike, is the
    # stage's peak as stage_moe_memory composes it from their levels.
    cost = _model(layers=3, in_flight=2, gated=True, expert_parallel_size=2, **recompute)
    s = cost.shape
    gen = np.random.default_rng(2)
    for _ in range(10):
        routed = gen.integers(0, 80, size=2).astype(np.float64)
        retained = np.floor(routed * gen.uniform(0, 1, size=2))
        reps = gen.integers(0, 3, size=2)
        saved, peak = cost.rank_levels(routed, retained, reps)
        want = stage_moe_memory(np.stack([saved] * 3), np.stack([peak] * 3),
                                np.stack([reps * s.instance_bytes] * 3), s.output_bytes, 2,
                                s.recompute_moe, s.full_recompute_layers)
        got = 3 * cost.rank_memory(reps, routed, retained)
        np.testing.assert_allclose(got, want, rtol=1e-12)


def test_shape_refuses_bad_recompute_layers():
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="full_recompute_layers"):
            MoEShape(8, 4, 4, 2, True, 2, 10, full_recompute_layers=bad)


def test_shape_refuses_grouped_without_ep_size():
    with pytest.raises(ValueError, match="expert_parallel_size"):
        MoEShape(8, 4, 4, 2, True, 2, 10, grouped_gemm=True)
    with pytest.raises(ValueError, match="multiple"):
        MoEShape(8, 4, 4, 2, True, 2, 10, expert_parallel_size=3)


def _measured_region_peak(gated: bool, grouped: bool, gamma: float,
                          selection: str = "uniform") -> tuple[int, float]:
    """(peak bytes the allocator held over one forward+backward of the region on one
    rank, the cost model's plan_memory of the same call). torch.profiler's memory events
    count every allocation and free on the CPU (as benchmarks/bench_moe_layer.py does)."""
    import torch.nn.functional as F
    from torch.profiler import ProfilerActivity, profile

    from megatron_lrmoe.layer.region import ExpertWeights, RegionContext, lrmoe_region

    hidden, ffn, experts, topk, tokens = 128, 64, 4, 2, 256
    fc1 = 2 * ffn if gated else ffn
    gen = torch.Generator().manual_seed(0)
    popularity = torch.tensor([8.0, 4.0, 2.0, 1.0])
    chosen = torch.stack([torch.multinomial(popularity, topk, generator=gen)
                          for _ in range(tokens)])
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, chosen, True)
    pairs = torch.nonzero(routing_map.t())                 # [P, 2] (expert, token)
    pair_token = pairs[:, 1].clone()
    pair_prob = torch.rand(pairs.shape[0], generator=gen).requires_grad_(True)
    w1 = tuple((0.1 * torch.randn(fc1, hidden, generator=gen)).requires_grad_()
               for _ in range(experts))
    w2 = tuple((0.1 * torch.randn(hidden, ffn, generator=gen)).requires_grad_()
               for _ in range(experts))
    for w in (*w1, *w2):
        w.grad = torch.zeros_like(w)                       # as Megatron's gradient buffers

    def activation(z):          # Megatron's MLP, unfused: act(z1) * (z2 + offset)
        if gated:
            z1, z2 = torch.chunk(z, 2, dim=-1)
            return F.silu(z1) * (z2 + 0.0)
        return F.gelu(z)

    plan = plan_retention(routing_map.sum(0).view(1, experts).long(), 1, gamma)
    rc = RegionContext(plan=plan, group=None, rank=0, selection=selection,
                       grouped_gemm=grouped, measure=True)
    x = torch.randn(tokens, hidden, generator=gen, requires_grad=True)
    dy = torch.randn(tokens, hidden, generator=gen)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        y = lrmoe_region(x, pair_token, pair_prob, rc, ExpertWeights(w1, w2, activation))
        y.backward(dy)
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type().name == "CPU")
    level = peak = 0
    for _, nbytes in events:
        level += nbytes
        peak = max(peak, level)
    shape = MoEShape(hidden, ffn, experts, topk, gated, 4, tokens, expert_parallel_size=1,
                     grouped_gemm=grouped,
                     forward_retention=stored_in_forward(selection, rc.metric),
                     store_factor=rc.store_factor if selection == "two-stage" else None)
    predicted = CostModel(shape, MACHINE).plan_memory(plan, np.zeros(1))[0]
    return peak, float(predicted)


@pytest.mark.parametrize("gated, grouped", [(True, False), (False, False), (True, True)])
@pytest.mark.parametrize("gamma", [math.inf, 0.6])
# drawn in forward / backward / a superset in forward and the rest in backward
@pytest.mark.parametrize("selection", ["uniform", "topk", "two-stage"])
def test_rank_memory_matches_the_measured_region(gated, grouped, gamma, selection):
    # One rank (no exchange): the model's buffers against the allocator's own count. The
    # model charges 32 bytes of pair metadata per pair; here the token index and the
    # probabilities exist before the call (a is the only one allocated inside), so it
    # may exceed the measurement by 28 bytes per pair, ~1% at this size.
    # two-stage's backward draws again: its bookkeeping (12 bytes per pair beside the
    # stored set's index and scale) is charged whether or not the call drops, ~0.4% more.
    measured, predicted = _measured_region_peak(gated, grouped, gamma, selection)
    slack = 1.025 if selection == "two-stage" else 1.02
    assert measured <= predicted <= measured * slack, (measured, predicted)


def _saved_by_region(selection: str, gamma: float) -> tuple[dict[str, int], int, int]:
    """Bytes the region saves for backward, by role, measured with autograd's saved-tensor
    hooks over one forward on one rank, and the plan's (routed, retained) rows."""
    from megatron_lrmoe.layer.region import ExpertWeights, RegionContext, lrmoe_region

    hidden, ffn, experts, topk, tokens = 32, 24, 4, 2, 64
    gen = torch.Generator().manual_seed(1)
    chosen = torch.stack([torch.randperm(experts, generator=gen)[:topk] for _ in range(tokens)])
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, chosen, True)
    pair_token = torch.nonzero(routing_map.t())[:, 1].clone()
    pair_prob = torch.rand(pair_token.shape[0], generator=gen).requires_grad_(True)
    w1 = tuple(torch.randn(2 * ffn, hidden, generator=gen).requires_grad_()
               for _ in range(experts))
    w2 = tuple(torch.randn(hidden, ffn, generator=gen).requires_grad_()
               for _ in range(experts))

    def activation(z):
        z1, z2 = torch.chunk(z, 2, dim=-1)
        return torch.nn.functional.silu(z1) * z2

    plan = plan_retention(routing_map.sum(0).view(1, experts).long(), 1, gamma)
    rc = RegionContext(plan=plan, group=None, rank=0, selection=selection, measure=False)
    x = torch.randn(tokens, hidden, generator=gen, requires_grad=True)
    by_width: dict[str, int] = {}

    def pack(t):
        width = {hidden: "x", 2 * ffn: "z"}.get(t.shape[-1] if t.dim() == 2 else -1, "other")
        by_width[width] = by_width.get(width, 0) + t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = lrmoe_region(x, pair_token, pair_prob, rc, ExpertWeights(w1, w2, activation))
    y.sum().backward()          # the saved tensors are what backward then uses
    return by_width, int(plan.counts.sum()), int(plan.quotas.sum())


@pytest.mark.parametrize("gamma", [math.inf, 0.75, 0.5])
def test_saved_activations_fall_with_retention(gamma):
    # Drawn in forward (uniform): x_exp and z are saved for the retained rows only;
    # drawn in backward (topk on grad_act): for every routed row. The unweighted
    # outputs o [P, H] are saved for the router gradient either way. Exact arithmetic
    # on the shapes (fp32, H = 32, F1 = 48), against what autograd was handed.
    hidden, fc1, b = 32, 48, 4
    forward, routed, retained = _saved_by_region("uniform", gamma)
    backward, routed_b, _ = _saved_by_region("topk", gamma)
    assert routed == routed_b
    if gamma < math.inf:
        assert retained < routed
    assert forward["z"] == retained * fc1 * b
    assert forward["x"] == (retained + routed) * hidden * b       # x_exp kept rows, o
    assert backward["z"] == routed * fc1 * b
    assert backward["x"] == 2 * routed * hidden * b


@pytest.mark.parametrize("forward_retention", [False, True])
def test_fitting_micro_batch_size_against_brute_force(forward_retention):
    import dataclasses

    from megatron_lrmoe.integration.planner_inputs import fitting_micro_batch_size

    cost = _model(layers=4, in_flight=2, gated=True, expert_parallel_size=2,
                  forward_retention=forward_retention)
    assert cost.balanced_need(1.0) == cost.balanced_dropless_need()
    per_sequence = 5.0                                  # tokens of one sequence on a rank

    def need(size: int, retention: float) -> float:
        shape = dataclasses.replace(cost.shape, tokens_per_rank=round(size * per_sequence))
        return CostModel(shape, MACHINE).balanced_need(retention)

    for budget in (3e4, 1e5, 4e5):
        for retention in (1.0, 0.75, 0.5):
            got = fitting_micro_batch_size(cost, budget, per_sequence, retention)
            sizes = [m for m in range(1, 400) if need(m, retention) <= budget]
            assert got == (max(sizes) if sizes else 0), (budget, retention)
    # Drawn in forward, retention frees the saved x and z of every layer and micro-batch
    # in flight: strictly more fits at half retention than dropless.
    low = fitting_micro_batch_size(cost, 4e5, per_sequence, 0.5)
    full = fitting_micro_batch_size(cost, 4e5, per_sequence, 1.0)
    assert low >= full
    if forward_retention:
        assert low > full


_LRMOE_RECOMPUTE = {"recompute_granularity": "selective", "recompute_modules": ["moe"]}
_LRMOE_VARIANTS = {
    # name: LRMoETransformerConfig fields (a budget far above the need: the planner then
    # has its cost model and reports rank_memory of each plan, and never binds)
    "gamma 1.0": {"moe_lrmoe_bwd_capacity_factor": 1.0},
    "gamma 1.0, moe recompute": {"moe_lrmoe_bwd_capacity_factor": 1.0, **_LRMOE_RECOMPUTE},
    "gamma 0.75, moe recompute": {"moe_lrmoe_bwd_capacity_factor": 0.75, **_LRMOE_RECOMPUTE},
    "gamma 0.5, two-stage": {"moe_lrmoe_bwd_capacity_factor": 0.5,
                             "moe_lrmoe_selection": "two-stage"},
}


def _measure_skewed_call(cfg: dict, layer: torch.nn.Module) -> dict:
    """On each gloo rank: the layer's router replaced by a skewed routing of this rank's
    tokens (probabilities that need a gradient), and one measured forward+backward."""
    import torch.distributed as dist

    from lrmoe_studies.layer_bench import measure_memory, skewed_routing

    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(cfg["seed"] + 1000 + rank)
    x = torch.randn(cfg["tokens"], 1, cfg["hidden"], generator=gen)
    dy = torch.randn(cfg["tokens"], 1, cfg["hidden"], generator=gen)
    probs, routing_map = skewed_routing(cfg["tokens"], cfg["experts"], cfg["topk"], 1.2,
                                        cfg["seed"], rank, torch.float32)
    probs.requires_grad_(True)
    layer.route = lambda hidden, padding_mask=None, _r=(probs, routing_map): _r
    return measure_memory(cfg, layer, x, dy, lambda: None, dist.barrier)


def _measure_lrmoe_layer(cfg: dict, name: str) -> dict:
    """On each gloo rank: the LRMoE layer of the variant (same weights as Megatron's), the
    skewed routing forced, one measured forward+backward (``measure_memory``) and the
    planner's ``rank_memory`` of that call's plan for every rank."""
    from lrmoe_studies.layer_bench import build_layers

    fields = {**_LRMOE_VARIANTS[name], "moe_lrmoe_memory_budget_gb": 64.0}
    _, _, variants = build_layers(cfg, {name: fields})
    layer = variants[name]
    memory = _measure_skewed_call(cfg, layer)
    planner = layer.placement_planner
    return {"model": planner.last_memory.tolist(),
            "recompute_moe": planner.settings.cost.shape.recompute_moe, **memory}


@pytest.mark.parametrize("name", list(_LRMOE_VARIANTS))
def test_lrmoe_layer_memory_under_recompute_matches_the_measured_layer(gloo2, name):
    # The planner's own figure for the call (one layer, one micro-batch: under moe
    # recompute the rerun's peak plus the first pass's output y) against the allocator's
    # peak of the LRMoE layer, Megatron's checkpoint around it, on every rank.
    cfg = dict(device="cpu", dtype="fp32", ep=2, seed=1234, hidden=128, ffn=64, experts=8,
               topk=2, tokens=256, kernels="auto", grouped_gemm="auto")
    results = gloo2.run(_measure_lrmoe_layer, cfg, name, timeout=300)
    recompute = "recompute" in name
    for rank, measured in enumerate(results):
        assert measured["recompute_moe"] is recompute
        if recompute:       # Megatron's checkpoint keeps the layer's input only
            assert measured["mem_saved"] == 0, measured
        model = measured["model"][rank]
        # Within 1.8% when written (the router's and dispatcher's small tensors).
        assert abs(model / measured["mem_peak"] - 1) <= 0.03, (rank, model, measured)


def _measure_replicated_layer(cfg: dict, replicas: tuple[tuple[int, int], ...]) -> dict:
    """On each gloo rank: an LRMoE layer (no drop, a budget that never binds, one
    micro-batch per step) whose placement is forced to ``replicas``, one measured
    forward+backward (the step's first and last micro-batch: the replica refresh and the
    replicas' gradients sent home both inside it), and the model's figures of the call."""
    from lrmoe_studies.layer_bench import build_layers
    from megatron_lrmoe.planning.placement import Placement

    name = "replicas"
    fields = {"moe_lrmoe_bwd_capacity_factor": 1.0, "moe_lrmoe_memory_budget_gb": 64.0}
    _, _, variants = build_layers(cfg, {name: fields})
    layer = variants[name]
    planner = layer.placement_planner
    placement = Placement(cfg["ep"], cfg["experts"], replicas)
    planner.placement = placement
    memory = _measure_skewed_call(cfg, layer)
    cost = planner.settings.cost
    plan = layer.last_plan.retention
    hosted = np.asarray(placement.replicas_per_rank(), dtype=np.float64)
    return {"model": planner.last_memory.tolist(),
            "without_return": cost.plan_memory(plan, hosted).tolist(),
            "replica_buffers": layer.replicas.memory_bytes(),
            "instance_bytes": cost.shape.instance_bytes, "hosted": hosted.tolist(), **memory}


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "expert-bias"])
def test_replicas_gradients_returned_home_and_held_are_in_the_model(gloo2, bias):
    # Expert weights large against the call's rows (192 KiB per expert in fp32, 64 tokens):
    # rank 0 serves three replicas, so the step's last backward receives their gradients
    # (576 KiB) after the token gradient exists; rank 1 hosts them, and the per-expert loop
    # holds each replica's dW until the layer's hook. The oracle is the allocator. With
    # expert biases (Megatron's add_bias_linear) each replica also carries b1, b2 and
    # their gradient buffer, and sends their gradients home.
    cfg = dict(device="cpu", dtype="fp32", ep=2, seed=1234, hidden=64, ffn=256, experts=8,
               topk=2, tokens=64, kernels="auto", grouped_gemm="off", bias=bias)
    replicas = ((0, 1), (1, 1), (2, 1), (4, 0))
    results = gloo2.run(_measure_replicated_layer, cfg, replicas, timeout=300)
    for rank, measured in enumerate(results):
        # The first refresh with these replicas allocates their buffers inside the span,
        # as rank_memory counts them (hosted x instance bytes).
        assert (measured["replica_buffers"]
                == measured["hosted"][rank] * measured["instance_bytes"])
        model = measured["model"][rank]
        # Within 0.04% when written (the router's and dispatcher's small tensors).
        assert abs(model / measured["mem_peak"] - 1) <= 0.01, (rank, model, measured)
    # Without the gradients returned home, rank 0's model falls short of the allocator.
    short = results[0]["without_return"][0] / results[0]["mem_peak"]
    assert short < 0.9, short
