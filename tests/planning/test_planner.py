"""Tests of the retention-quota planner (docs/design.md, "Retention"), pure CPU, no process group.

Notation as in ``megatron_lrmoe/planning/retention.py``: R ranks, I instances (columns;
I == E and instance i on rank i // (I / R) without a layout), n[s, i] counts, N_i routed
pairs per instance, L_r routed load per rank, C_r capacity, f_i = ceil(m * N_i) floors,
T_r target, tau_r water level, Q_i instance quotas, q[s, i] cell quotas.

The reference below is written independently of the planner, from the module
docstring's rules: Python integers and Fractions, a per-rank binary search for the
water level and a sort for the leftover units, so it is slow but obviously right.
``test_water_filling_is_leximin_optimal`` checks those rules themselves by brute force.
"""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_lrmoe.planning import retention as planner_module
from megatron_lrmoe.planning.retention import (
    UNLIMITED_CAPACITY,
    RetentionPlan,
    plan_retention,
)

GAMMAS = [0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.5, 3.0, math.inf]
MIN_RETENTIONS = [0.0, 0.1, 0.25, 0.5, 0.9, 1.0]


# ---------------------------------------------------------------------------
# Independent reference and helpers
# ---------------------------------------------------------------------------


def _frac(x: float) -> Fraction:
    return Fraction(repr(float(x)))


def _reference_fill(routed: list[int], floors: list[int], target: int) -> tuple[list[int], int]:
    """(Q, level) of one rank: t = the largest integer with S(t) <= T, S(t) = sum_i
    clamp(t, f_i, N_i) (found by bisection: S is nondecreasing), Q_i = clamp(t, f_i, N_i),
    then the T - S(t) units left one each to the instances with f_i <= t < N_i, largest
    N_i first, ties by lower position."""
    def fill(t: int) -> int:
        return sum(min(max(t, f), n) for f, n in zip(floors, routed, strict=True))

    lo, hi = 0, max(routed)              # S(0) = sum f <= T, S(max N) = L >= T
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fill(mid) <= target else (lo, mid - 1)
    kept = [min(max(lo, f), n) for f, n in zip(floors, routed, strict=True)]
    room = sorted((j for j in range(len(routed)) if floors[j] <= lo < routed[j]),
                  key=lambda j: (-routed[j], j))
    for j in room[:target - sum(kept)]:
        kept[j] += 1
    return kept, lo


def reference_plan(counts: list[list[int]], gamma: float, m: float,
                   instance_rank: list[int] | None = None):
    """(capacity C, instance quotas Q, cell quotas q, water levels) by the obvious method.

    ``instance_rank``: the rank of each column (instance); None for Megatron's layout.
    Water-filling runs per rank over that rank's instances, in instance order.
    """
    num_ranks, num_instances = len(counts), len(counts[0])
    if instance_rank is None:
        per_rank = num_instances // num_ranks
        instance_rank = [i // per_rank for i in range(num_instances)]
    routed = [sum(row[i] for row in counts) for i in range(num_instances)]
    cap = (UNLIMITED_CAPACITY if math.isinf(gamma)
           else math.ceil(_frac(gamma) * sum(routed) / num_ranks))
    kept, levels = list(routed), []
    for r in range(num_ranks):
        mine = [i for i in range(num_instances) if instance_rank[i] == r]
        n_r = [routed[i] for i in mine]
        levels.append(max(n_r, default=0))
        if sum(n_r) <= cap:
            continue
        floors = [math.ceil(_frac(m) * n) for n in n_r]
        q_r, levels[r] = _reference_fill(n_r, floors, max(cap, sum(floors)))
        for i, q in zip(mine, q_r, strict=True):
            kept[i] = q
    # Largest remainder: floor(Q_i n[s, i] / N_i), then one unit each to the largest
    # remainders (all over the same N_i), ties by lower source.
    cells = [[0] * num_instances for _ in range(num_ranks)]
    for i in range(num_instances):
        if routed[i] == 0:
            continue
        parts = [divmod(kept[i] * counts[s][i], routed[i]) for s in range(num_ranks)]
        for s in range(num_ranks):
            cells[s][i] = parts[s][0]
        leftover = kept[i] - sum(cells[s][i] for s in range(num_ranks))
        for s in sorted(range(num_ranks), key=lambda s: (-parts[s][1], s))[:leftover]:
            cells[s][i] += 1
    return cap, kept, cells, levels


def _assert_matches_reference(counts: list[list[int]], gamma: float, m: float,
                              instance_rank=None, instance_expert=None,
                              tensor: torch.Tensor | None = None) -> RetentionPlan:
    """plan_retention on ``tensor`` (default: ``counts`` as int64) against the reference."""
    tensor = torch.tensor(counts, dtype=torch.int64) if tensor is None else tensor
    plan = plan_retention(tensor, len(counts), gamma, m, instance_rank=instance_rank,
                          instance_expert=instance_expert)
    cap, kept, cells, levels = reference_plan(
        counts, gamma, m, None if instance_rank is None else list(instance_rank))
    for name in ("counts", "quotas", "capacity", "water_level"):
        value = getattr(plan, name)
        assert value.dtype == torch.int64 and value.device.type == "cpu", name
    assert plan.counts.tolist() == counts
    assert plan.capacity.tolist() == [cap] * len(counts)
    assert plan.retained_per_instance.tolist() == kept
    assert plan.quotas.tolist() == cells
    assert plan.water_level.tolist() == levels
    if instance_rank is not None:
        assert plan.instance_rank == tuple(instance_rank)
    expected_experts = range(len(counts[0])) if instance_expert is None else instance_expert
    assert plan.instance_expert == tuple(expected_experts)
    return plan


def _plan(counts: list[list[int]], gamma: float = 1.0, m: float = 0.0) -> RetentionPlan:
    return plan_retention(torch.tensor(counts, dtype=torch.int64), len(counts), gamma, m)


@st.composite
def planner_cases(draw, max_ranks: int = 4, max_local: int = 4):
    """Small skewed count matrices plus (gamma, m)."""
    num_ranks = draw(st.integers(1, max_ranks))
    num_experts = num_ranks * draw(st.integers(1, max_local))
    scale = draw(st.lists(st.sampled_from([0, 1, 3, 10, 40]),
                          min_size=num_experts, max_size=num_experts))
    counts = [[draw(st.integers(0, scale[e])) for e in range(num_experts)]
              for _ in range(num_ranks)]
    gamma = draw(st.one_of(st.sampled_from(GAMMAS), st.floats(0.05, 4.0)))
    m = draw(st.one_of(st.sampled_from(MIN_RETENTIONS), st.floats(0.0, 1.0)))
    return counts, gamma, m


# ---------------------------------------------------------------------------
# Property tests
# ---------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(planner_cases())
def test_matches_reference(case):
    counts, gamma, m = case
    _assert_matches_reference(counts, gamma, m)


# Long decimals (p * N beyond int64 in the floors), a denominator beyond int64, the
# double next to 1, the smallest subnormal.
ODD_GAMMAS = [1.0000000000000002, 0.3, 0.123456789012345]
ODD_MIN_RETENTIONS = [0.123456789012345, 1e-20, 0.9999999999999999, 5e-324]


@st.composite
def layout_cases(draw):
    """Replica-like layouts: any rank per instance (ranks non-contiguous, some empty,
    some with more than 16 instances), counts from 0 to millions, odd gamma and m."""
    num_ranks = draw(st.integers(1, 5))
    num_instances = draw(st.one_of(st.integers(1, 3 * num_ranks + 3), st.integers(17, 40)))
    instance_rank = draw(st.lists(st.integers(0, num_ranks - 1), min_size=num_instances,
                                  max_size=num_instances))
    scale = draw(st.lists(st.sampled_from([0, 1, 3, 40, 500, 10**6]),
                          min_size=num_instances, max_size=num_instances))
    counts = [[draw(st.integers(0, scale[i])) for i in range(num_instances)]
              for _ in range(num_ranks)]
    gamma = draw(st.one_of(st.sampled_from(GAMMAS + ODD_GAMMAS), st.floats(0.05, 4.0)))
    m = draw(st.one_of(st.sampled_from(MIN_RETENTIONS + ODD_MIN_RETENTIONS),
                       st.floats(0.0, 1.0)))
    experts = draw(st.one_of(st.none(), st.lists(st.integers(0, 99), min_size=num_instances,
                                                 max_size=num_instances)))
    as_list = draw(st.booleans())           # a list, not the cached tuple
    return counts, gamma, m, (instance_rank if as_list else tuple(instance_rank)), experts


@settings(max_examples=100, deadline=None)
@given(layout_cases())
def test_matches_reference_on_instance_layouts(case):
    counts, gamma, m, instance_rank, experts = case
    _assert_matches_reference(counts, gamma, m, instance_rank, experts)


@pytest.mark.parametrize("gamma", [0.3, 1.0, 1.0000000000000002, math.inf])
def test_matches_reference_on_large_values(gamma):
    # Up to 2 million pairs per cell with long decimals for m: the exact floors need
    # more than int64 for p * N_i (0.123456789012345) or for q (1e-20, 5e-324).
    gen = torch.Generator().manual_seed(7)
    big = (torch.rand(8, 16, generator=gen) ** 3 * 2_000_000).to(torch.int64).tolist()
    for m in (0.123456789012345, 1e-20, 0.9999999999999999, 5e-324, 0.3):
        _assert_matches_reference(big, gamma, m)


def test_benchmark_scale_64_ranks_128_experts():
    # The benchmark's shape, int64 and other dtypes and strides.
    gen = torch.Generator().manual_seed(0)
    counts = (torch.rand(64, 128, generator=gen) ** 4 * 500).to(torch.int64)
    values = counts.tolist()
    plan = _assert_matches_reference(values, 1.0, 0.1)
    assert plan.quotas.shape == (64, 128) and plan.capacity.shape == (64,)
    assert bool(plan.overloaded.any())                  # this case does cut ranks
    _assert_matches_reference(values, 0.75, 0.0, tensor=counts.to(torch.int32))
    _assert_matches_reference(values, 1.1, 0.25, tensor=counts.t().contiguous().t())


@settings(max_examples=200, deadline=None)
@given(planner_cases())
def test_invariants(case):
    counts, gamma, m = case
    plan = _plan(counts, gamma, m)
    n, q = plan.counts, plan.quotas
    num_ranks, num_experts = n.shape
    per_rank = num_experts // num_ranks
    assert q.dtype == torch.int64 and q.shape == n.shape
    assert bool((q >= 0).all()) and bool((q <= n).all())

    routed, kept = n.sum(0), q.sum(0)
    floors = [math.ceil(_frac(m) * v) for v in routed.tolist()]
    load, retained = plan.routed_per_rank.tolist(), plan.retained_per_rank.tolist()
    for r in range(num_ranks):
        cap, level = int(plan.capacity[r]), int(plan.water_level[r])
        experts = range(r * per_rank, (r + 1) * per_rank)
        assert load[r] == sum(int(routed[e]) for e in experts)
        if load[r] <= cap:  # under capacity: keep all
            assert torch.equal(q[:, experts.start:experts.stop], n[:, experts.start:experts.stop])
            continue
        f_sum = sum(floors[e] for e in experts)
        assert retained[r] == max(cap, f_sum)
        assert bool(plan.over_capacity[r]) == (f_sum > cap)
        for e in experts:
            big_n, big_q = int(routed[e]), int(kept[e])
            assert big_q >= floors[e]
            if big_q < big_n:  # only experts above the water level lose pairs
                assert big_q >= level
            if big_n <= level:
                assert big_q == big_n
            assert big_q <= max(floors[e], level + 1)
        if retained[r] < load[r]:  # level is floor(tau): S(level) <= T_r < S(level + 1)
            def fill(t, experts=experts):
                return sum(min(max(t, floors[e]), int(routed[e])) for e in experts)
            assert fill(level) <= retained[r] < fill(level + 1)
    assert not bool(plan.over_capacity[torch.tensor(load) <= plan.capacity].any())

    # Largest-remainder split: exact sums, each cell within 1 of its share.
    for s, e in itertools.product(range(num_ranks), range(num_experts)):
        if int(routed[e]):
            share = Fraction(int(kept[e]) * int(n[s, e]), int(routed[e]))
            assert abs(int(q[s, e]) - share) < 1

    # All-to-all splits agree with each other and with the totals.
    for s in range(num_ranks):
        assert sum(plan.send_splits(s)) == int(q[s].sum())
        assert sum(plan.forward_send_splits(s)) == int(n[s].sum())
        for d in range(num_ranks):
            assert plan.recv_splits(d)[s] == plan.send_splits(s)[d]
            assert plan.forward_recv_splits(d)[s] == plan.forward_send_splits(s)[d]
            cols = slice(d * per_rank, (d + 1) * per_rank)
            assert plan.send_splits(s)[d] == int(q[s, cols].sum())
            assert plan.forward_send_splits(s)[d] == int(n[s, cols].sum())
    assert [sum(plan.recv_splits(d)) for d in range(num_ranks)] == retained


@settings(max_examples=150, deadline=None)
@given(
    routed=st.lists(st.integers(0, 5), min_size=1, max_size=4),
    gamma=st.floats(0.05, 0.95),
    m=st.sampled_from([0.0, 0.2, 0.5, 0.8]),
)
def test_water_filling_is_leximin_optimal(routed, gamma, m):
    """Among all integer quota vectors with floors <= Q <= N and the same sum, the
    planner's has the lexicographically smallest sorted-descending vector: the largest
    quota is as small as it can be, then the second largest, and so on."""
    plan = _plan([routed], gamma, m)  # one rank: C = ceil(gamma * L)
    kept = plan.retained_per_instance.tolist()
    floors = [math.ceil(_frac(m) * v) for v in routed]
    target = sum(kept)
    candidates = [
        sorted(v, reverse=True)
        for v in itertools.product(*(range(f, big + 1) for f, big in zip(floors, routed,
                                                                            strict=True)))
        if sum(v) == target
    ]
    assert sorted(kept, reverse=True) == min(candidates)
    if sum(routed) > int(plan.capacity[0]):
        assert target == max(int(plan.capacity[0]), sum(floors))


@settings(max_examples=100, deadline=None)
@given(planner_cases())
def test_gamma_inf_keeps_everything(case):
    counts, _, m = case
    plan = _plan(counts, math.inf, m)
    assert torch.equal(plan.quotas, plan.counts)
    assert plan.capacity.tolist() == [UNLIMITED_CAPACITY] * len(counts)
    assert not bool(plan.over_capacity.any()) and not bool(plan.overloaded.any())
    assert plan.retained_fraction == 1.0
    assert "C=inf" in plan.describe()


@settings(max_examples=100, deadline=None)
@given(planner_cases())
def test_deterministic_and_input_untouched(case):
    counts, gamma, m = case
    tensor = torch.tensor(counts, dtype=torch.int64)
    a = plan_retention(tensor, len(counts), gamma, m)
    b = plan_retention(tensor.clone(), len(counts), gamma, m)
    assert torch.equal(tensor, torch.tensor(counts))
    for name in ("counts", "quotas", "capacity", "water_level"):
        assert torch.equal(getattr(a, name), getattr(b, name))


# ---------------------------------------------------------------------------
# Worked examples
# ---------------------------------------------------------------------------


def test_worked_example():
    # R = 2, E = 4: rank 0 hosts experts 0, 1 (N = 30, 5), rank 1 experts 2, 3 (N = 3, 2).
    # L = (35, 5), mean 20, C = 20; rank 0: min(30, tau) + min(5, tau) = 20 -> tau = 15.
    plan = _plan([[10, 0, 3, 1], [20, 5, 0, 1]])
    assert plan.capacity.tolist() == [20, 20]
    assert plan.water_level.tolist() == [15, 3]
    assert plan.retained_per_instance.tolist() == [15, 5, 3, 2]
    assert plan.quotas.tolist() == [[5, 0, 3, 1], [10, 5, 0, 1]]  # 15 split 1:2
    assert plan.overloaded.tolist() == [True, False]
    assert plan.over_capacity.tolist() == [False, False]
    assert plan.forward_send_splits(0) == [10, 4] and plan.send_splits(0) == [5, 4]
    assert plan.forward_recv_splits(0) == [10, 25] and plan.recv_splits(0) == [5, 15]
    assert plan.retained_fraction == pytest.approx(25 / 40)
    assert plan.retained_fraction == pytest.approx(1 - 15 / 40)
    assert "kept 25/40" in plan.describe() and "cut ranks 1/2" in plan.describe()


def test_floors_win_over_capacity():
    # Same counts, m = 0.9: floors (27, 5) sum to 32 > C = 20, so rank 0 keeps 32.
    plan = _plan([[10, 0, 3, 1], [20, 5, 0, 1]], 1.0, 0.9)
    assert plan.retained_per_instance.tolist() == [27, 5, 3, 2]
    assert plan.retained_per_rank.tolist() == [32, 5]
    assert plan.over_capacity.tolist() == [True, False]


def test_floor_pins_one_expert_and_water_fills_the_rest():
    # One rank, N = (40, 20, 20): C = ceil(0.5 * 80) = 40. m = 0.4 -> floors (16, 8, 8).
    # Expert 0 is pinned at its floor; the level fills the remaining capacity over the
    # others: 16 + 2 * min(20, tau) = 40 -> tau = 12. (Without floors: (14, 13, 13);
    # water-filling the residuals N - f instead would give (19, 11, 10).)
    plan = _plan([[40, 20, 20]], 0.5, 0.4)
    assert plan.capacity.tolist() == [40]
    assert plan.retained_per_instance.tolist() == [16, 12, 12]
    assert plan.water_level.tolist() == [12]
    assert _plan([[40, 20, 20]], 0.5).retained_per_instance.tolist() == [14, 13, 13]
    assert plan.over_capacity.tolist() == [False]


def test_leftover_units_go_to_largest_then_lowest_index():
    # Rank 0: N = (5, 6, 5, 1), rank 1: (0, 0, 0, 1); C = ceil(18 / 2) = 9.
    # Level 2 fills 7; 2 units left: expert 1 (N = 6), then expert 0
    # (N = 5 like expert 2, lower index).
    plan = _plan([[5, 6, 5, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0, 1]])
    assert plan.capacity.tolist() == [9, 9]
    assert plan.water_level.tolist() == [2, 1]
    assert plan.retained_per_instance.tolist() == [3, 3, 2, 1, 0, 0, 0, 1]


def test_split_ties_go_to_lower_source():
    # Expert 0 gets 1 from each source; C = 1, so Q_0 = 1, split 0.5 : 0.5 -> source 0.
    plan = _plan([[1, 0], [1, 0]])
    assert plan.quotas.tolist() == [[1, 0], [0, 0]]
    # Remainders decide before the index: shares (7/3, 14/3) of Q = 7 from n = (3, 6)
    # at C = ceil(1.5 * 4.5) = 7 have remainders (1/3, 2/3), so source 1 gets it: (2, 5).
    plan = _plan([[3, 0], [6, 0]], 1.5)
    assert plan.capacity.tolist() == [7, 7]
    assert plan.quotas.tolist() == [[2, 0], [5, 0]]


def test_gamma_and_floor_are_read_as_decimals():
    # gamma = 1.1 on a mean load of 100 gives 110 (the binary double would give 111).
    plan = _plan([[111, 89], [0, 0]], 1.1)  # mean 100 -> C = 110
    assert plan.capacity.tolist() == [110, 110]
    assert plan.retained_per_instance.tolist() == [110, 89]
    # m = 0.1 of N = 30 is 3 (the binary double times 30 is just above 3, ceil 4).
    plan = _plan([[30, 0], [0, 0]], 0.01, 0.1)  # C = ceil(0.15) = 1 < floor
    assert plan.retained_per_instance.tolist() == [3, 0]


# ---------------------------------------------------------------------------
# Edge cases
# ---------------------------------------------------------------------------


def test_zero_counts():
    plan = _plan([[0, 0, 0, 0], [0, 0, 0, 0]], 1.0, 0.5)
    assert plan.capacity.tolist() == [0, 0]
    assert plan.quotas.tolist() == [[0] * 4] * 2
    assert plan.retained_fraction == 1.0
    assert plan.send_splits(1) == [0, 0] and plan.recv_splits(0) == [0, 0]


def test_one_rank():
    # R = 1: C = ceil(gamma * L), so gamma >= 1 keeps all and gamma < 1 cuts.
    assert torch.equal(_plan([[5, 1, 9]], 1.0).quotas, torch.tensor([[5, 1, 9]]))
    plan = _plan([[5, 1, 9]], 0.5)  # C = 8: min(5,t)+min(1,t)+min(9,t) = 8 -> t = 3, +1
    assert plan.quotas.tolist() == [[3, 1, 4]]  # the leftover unit goes to the larger N
    assert plan.send_splits(0) == [8] and plan.forward_send_splits(0) == [15]


def test_every_pair_to_one_expert():
    # All 4 * 10 pairs to expert 5 (rank 2 of 4): C = 10:
    # expert 5 keeps 10, a share of 2.5 per source.
    counts = [[0, 0, 0, 0, 0, 10, 0, 0] for _ in range(4)]
    plan = _plan(counts)
    assert plan.capacity.tolist() == [10] * 4
    assert plan.quotas[:, 5].tolist() == [3, 3, 2, 2]  # ties by source index
    assert int(plan.quotas.sum()) == 10
    assert plan.overloaded.tolist() == [False, False, True, False]
    assert plan.water_level.tolist() == [0, 0, 10, 0]
    assert plan.recv_splits(2) == [3, 3, 2, 2] and plan.send_splits(0) == [0, 0, 3, 0]


def test_one_expert_per_rank():
    # E == R: the rank's only expert keeps exactly C.
    plan = _plan([[4, 0, 2], [4, 0, 2], [4, 3, 2]])  # N = (12, 3, 6), C = 7
    assert plan.retained_per_instance.tolist() == [7, 3, 6]
    assert plan.quotas[:, 0].tolist() == [3, 2, 2]


def test_other_integer_dtypes_and_layouts():
    values = [[10, 0, 3, 1], [20, 5, 0, 1]]
    base = torch.tensor(values)
    for tensor in (base.to(torch.int32), base.to(torch.uint8), base.to(torch.int16),
                   base.t().contiguous().t()):             # the last: non-contiguous
        _assert_matches_reference(values, 1.0, 0.0, tensor=tensor)


# ---------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("counts", "num_ranks", "kwargs", "match"),
    [
        (torch.zeros(4, dtype=torch.int64), 1, {}, "counts must be 2-D"),
        (torch.zeros(2, 4), 2, {}, "counts must be an integer tensor"),
        (torch.zeros(2, 4, dtype=torch.bool), 2, {}, "counts must be an integer tensor"),
        (torch.tensor([[1, -1], [0, 0]]), 2, {}, "counts must be non-negative"),
        (torch.zeros(2, 3, dtype=torch.int64), 2, {}, "E must be a positive multiple"),
        (torch.zeros(2, 0, dtype=torch.int64), 2, {}, "E must be a positive multiple"),
        (torch.zeros(2, 4, dtype=torch.int64), 4, {}, "num_ranks is 4"),
        (torch.zeros(2, 4, dtype=torch.int64), 0, {}, "num_ranks must be a positive int"),
        (torch.zeros(2, 4, dtype=torch.int64), 2, {"capacity_factor": 0.0}, "capacity_factor"),
        (torch.zeros(2, 4, dtype=torch.int64), 2, {"capacity_factor": -1.0}, "capacity_factor"),
        (torch.zeros(2, 4, dtype=torch.int64), 2, {"capacity_factor": math.nan},
         "capacity_factor"),
        (torch.zeros(2, 4, dtype=torch.int64), 2, {"min_retention": -0.1}, "min_retention"),
        (torch.zeros(2, 4, dtype=torch.int64), 2, {"min_retention": 1.5}, "min_retention"),
        (torch.zeros(2, 4, dtype=torch.int64), 2, {"min_retention": math.nan}, "min_retention"),
    ],
)
def test_validation(counts, num_ranks, kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan_retention(counts, num_ranks, **kwargs)


def test_counts_must_be_a_tensor():
    with pytest.raises(TypeError, match="counts must be a torch.Tensor"):
        plan_retention([[1, 2]], 1)  # type: ignore[arg-type]


def test_plan_checks_shapes():
    plan = _plan([[1, 2], [3, 4]])
    with pytest.raises(ValueError, match="quotas must have counts' shape"):
        RetentionPlan(plan.counts, plan.quotas[:1], plan.capacity, plan.water_level,
                      plan.instance_rank, plan.instance_expert)
    with pytest.raises(ValueError, match="capacity must have shape"):
        RetentionPlan(plan.counts, plan.quotas, plan.capacity[:1], plan.water_level,
                      plan.instance_rank, plan.instance_expert)
    assert plan.instance_rank == (0, 1) and plan.instance_expert == (0, 1)
    assert _plan([[1, 2, 3, 4]] * 2).instance_rank == (0, 0, 1, 1)


# ---------------------------------------------------------------------------
# Helpers and the layout cache
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("rows", [1, 3, 16, 17, 64])
def test_first_in_order_paths_agree(rows):
    # Each path (pairwise for <= 16 rows, a sort above, the stable-argsort fallback for
    # keys near the int64 limit) marks the first count[b] rows of column b in the order
    # (key descending, row ascending): here a plain Python sort of every column.
    gen = torch.Generator().manual_seed(rows)
    key = torch.randint(-1, 4, (rows, 50), generator=gen).numpy()     # many ties
    count = torch.randint(-1, rows + 2, (50,), generator=gen).numpy()
    expected = np.zeros(key.shape, dtype=bool)
    for b in range(key.shape[1]):
        order = sorted(range(rows), key=lambda a, b=b: (-int(key[a, b]), a))
        for a in order[:max(int(count[b]), 0)]:
            expected[a, b] = True
    for bound in (3, planner_module._INT64_MAX):
        got = planner_module._first_in_order(key, count, bound)
        assert (got == expected).all()


def test_layout_cache_returns_the_callers_layout():
    counts = torch.tensor([[4, 1, 0, 7, 2], [0, 9, 3, 1, 1]])
    a = plan_retention(counts, 2, 0.5, 0.0, instance_rank=(1, 0, 1, 0, 0))
    b = plan_retention(counts, 2, 0.5, 0.0, instance_rank=[1, 0, 1, 0, 0],
                       instance_expert=(3, 2, 1, 0, 0))
    assert a.instance_rank == b.instance_rank == (1, 0, 1, 0, 0)
    assert a.instance_expert == (0, 1, 2, 3, 4) and b.instance_expert == (3, 2, 1, 0, 0)
    cells = reference_plan(counts.tolist(), 0.5, 0.0, [1, 0, 1, 0, 0])[2]
    assert a.quotas.tolist() == b.quotas.tolist() == cells
    # Another layout of the same counts after these calls: its own plan, not a cached one.
    other = plan_retention(counts, 2, 0.5, 0.0, instance_rank=[0, 0, 1, 1, 1])
    assert other.quotas.tolist() == reference_plan(counts.tolist(), 0.5, 0.0,
                                                   [0, 0, 1, 1, 1])[2]
    with pytest.raises(ValueError, match="instance_rank entries"):
        plan_retention(counts, 2, instance_rank=(1, 0, 2, 0, 0))
    with pytest.raises(ValueError, match="instance_rank entries"):  # errors are not cached
        plan_retention(counts, 2, instance_rank=(1, 0, 2, 0, 0))


def test_plan_tensors_are_independent_of_the_input():
    counts = torch.tensor([[3, 3], [1, 1]])
    plan = plan_retention(counts, 2, math.inf)
    assert torch.equal(plan.quotas, counts)
    plan.quotas[0, 0] = 99  # quotas are a fresh tensor, never a view of counts
    assert int(counts[0, 0]) == 3
