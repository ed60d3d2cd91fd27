"""Tests of the retention-quota planner (DESIGN.md 3.4), pure CPU, no process group.

Notation as in ``megatron_lrmoe/lrmoe/planner.py``: R ranks, E experts (I == E
instances, E_loc = E / R per rank), n[s, e] counts, N_e routed pairs per expert,
L_r routed load per rank, C_r capacity, f_e = ceil(m * N_e) floors, T_r target,
tau_r water level, Q_e expert quotas, q[s, e] cell quotas.

The reference below is written independently of the planner: Python integers
and Fractions, one unit at a time, so it is slow but obviously right.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_lrmoe.lrmoe import retention as planner_module
from megatron_lrmoe.lrmoe.retention import (
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


def reference_plan(counts: list[list[int]], gamma: float, m: float):
    """(capacity C, expert quotas Q, cell quotas q) by the slowest obvious method."""
    num_ranks, num_experts = len(counts), len(counts[0])
    per_rank = num_experts // num_ranks
    routed = [sum(row[e] for row in counts) for e in range(num_experts)]
    if math.isinf(gamma):
        cap, kept = UNLIMITED_CAPACITY, list(routed)
    else:
        cap = math.ceil(_frac(gamma) * sum(routed) / num_ranks)
        kept = list(routed)
        for r in range(num_ranks):
            experts = range(r * per_rank, (r + 1) * per_rank)
            if sum(routed[e] for e in experts) <= cap:
                continue
            floors = {e: math.ceil(_frac(m) * routed[e]) for e in experts}
            target = max(cap, sum(floors.values()))
            for e in experts:
                kept[e] = floors[e]
            # Raise the lowest quota with room, one unit at a time: water rising.
            while sum(kept[e] for e in experts) < target:
                e = min((e for e in experts if kept[e] < routed[e]),
                        key=lambda e: (kept[e], -routed[e], e))
                kept[e] += 1
    cells = [[0] * num_experts for _ in range(num_ranks)]
    for e in range(num_experts):
        if routed[e] == 0:
            continue
        shares = [Fraction(kept[e] * counts[s][e], routed[e]) for s in range(num_ranks)]
        for s in range(num_ranks):
            cells[s][e] = math.floor(shares[s])
        leftover = kept[e] - sum(cells[s][e] for s in range(num_ranks))
        by_remainder = sorted(range(num_ranks), key=lambda s: (-(shares[s] % 1), s))
        for s in by_remainder[:leftover]:
            cells[s][e] += 1
    return cap, kept, cells


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
    plan = _plan(counts, gamma, m)
    cap, kept, cells = reference_plan(counts, gamma, m)
    assert plan.capacity.tolist() == [cap] * len(counts)
    assert plan.retained_per_instance.tolist() == kept
    assert plan.quotas.tolist() == cells


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
    base = torch.tensor([[10, 0, 3, 1], [20, 5, 0, 1]])
    expected = plan_retention(base, 2).quotas
    assert torch.equal(plan_retention(base.to(torch.int32), 2).quotas, expected)
    transposed = base.t().contiguous().t()  # same values, non-contiguous
    assert torch.equal(plan_retention(transposed, 2).quotas, expected)


def test_128_experts_64_ranks_is_fast():
    # A later goal is well under 1 ms; here only guard against a loop over pairs.
    gen = torch.Generator().manual_seed(0)
    counts = (torch.rand(64, 128, generator=gen) ** 4 * 500).to(torch.int64)
    plan_retention(counts, 64, 1.0, 0.1)
    times = []
    for _ in range(10):
        start = time.perf_counter()
        plan_retention(counts, 64, 1.0, 0.1)
        times.append(time.perf_counter() - start)
    assert sorted(times)[len(times) // 2] < 0.02


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
# Frozen reference: the torch implementation before the numpy rewrite
# ---------------------------------------------------------------------------
# Copied verbatim (helpers renamed with a _ref prefix) from planner.py as it was
# before it moved to numpy int64 with cached layouts. The rewrite must give the same
# plan to the unit, ties included, so this oracle is compared with torch.equal.

def _plan_retention_reference(
    counts: torch.Tensor,
    num_ranks: int,
    capacity_factor: float = 1.0,
    min_retention: float = 0.0,
    instance_rank: Sequence[int] | None = None,
    instance_expert: Sequence[int] | None = None,
) -> RetentionPlan:
    """Plan backward retention quotas by capacity water-filling (DESIGN.md 3.4).

    Args:
        counts: [R, I] integer tensor, n[s, i] routed pairs from source rank s to
            instance i. Without ``instance_rank`` the columns are experts in Megatron's
            layout (I = E, a multiple of R). Copied to CPU int64.
        num_ranks: R, the expert-parallel group size; must equal ``counts.shape[0]``.
        capacity_factor: gamma > 0, or ``math.inf`` to drop nothing.
        min_retention: m in [0, 1], the share of each instance's pairs always kept.
        instance_rank: [I] rank hosting each instance (a placement with replicas);
            None for Megatron's layout, instance i on rank i // (I / R).
        instance_expert: [I] expert of each instance (for logs and the caller); None
            for the identity.

    Returns:
        The plan; see the module docstring for the exact semantics. Water-filling
        runs over each rank's instances, whatever their experts.

    Raises:
        TypeError: ``counts`` is not a tensor.
        ValueError: a malformed argument; the message names it.
    """
    n = _ref_check_counts(counts, num_ranks, layout_given=instance_rank is not None)
    gamma = _ref_check_capacity_factor(capacity_factor)
    floor_share = _ref_check_min_retention(min_retention)
    num_instances = n.shape[1]
    instance_rank, instance_expert = _ref_check_layout(
        num_instances, num_ranks, instance_rank, instance_expert)

    slots = _ref_rank_slots(instance_rank, num_ranks)     # [R, K] instance ids, -1 = padding
    valid = slots >= 0
    index = slots.clamp(min=0)
    routed = n.sum(0)                                  # [I] N_i
    routed_loc = torch.where(valid, routed[index], 0)  # [R, K] N_i of each rank's instances
    load = routed_loc.sum(1)                           # [R] L_r

    if gamma is None:
        capacity = torch.full((num_ranks,), UNLIMITED_CAPACITY, dtype=torch.int64)
        kept = routed
        level = routed_loc.amax(1)
    else:
        total = int(load.sum())
        cap = min(_ref_ceil_div(gamma.numerator * total, gamma.denominator * num_ranks),
                  UNLIMITED_CAPACITY)
        capacity = torch.full((num_ranks,), cap, dtype=torch.int64)
        floors = torch.where(valid, _ref_floors(routed, floor_share)[index], 0)  # [R, K] f_i
        target = torch.minimum(load, torch.maximum(capacity, floors.sum(1)))  # [R] T_r
        kept_loc, level = _ref_water_fill(routed_loc, floors, target)
        kept = torch.zeros_like(routed).index_put_((index[valid],), kept_loc[valid])

    return RetentionPlan(
        counts=n,
        quotas=_ref_split_by_source(n, routed, kept),
        capacity=capacity,
        water_level=level,
        instance_rank=instance_rank,
        instance_expert=instance_expert,
        capacity_factor=float(capacity_factor),
        min_retention=float(min_retention),
    )


def _ref_rank_slots(instance_rank: tuple[int, ...], num_ranks: int) -> torch.Tensor:
    """[R, K] the instance ids of each rank in ascending order, padded with -1."""
    ranks = torch.tensor(instance_rank, dtype=torch.int64)
    per_rank = torch.bincount(ranks, minlength=num_ranks)
    width = max(int(per_rank.max()), 1)
    order = torch.sort(ranks, stable=True).indices                 # instances by rank, then id
    starts = torch.cumsum(per_rank, 0) - per_rank
    column = torch.arange(len(instance_rank)) - starts[ranks[order]]
    slots = torch.full((num_ranks, width), -1, dtype=torch.int64)
    slots[ranks[order], column] = order
    return slots


# ---------------------------------------------------------------------------
# Steps
# ---------------------------------------------------------------------------


def _ref_water_fill(
    routed: torch.Tensor, floors: torch.Tensor, target: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Integer water-filling with floors, every rank at once.

    Args:
        routed: [R, E_loc] N_i of each rank's instances.
        floors: [R, E_loc] f_i, 0 <= f_i <= N_i.
        target: [R] T_r with sum_i f_i <= T_r <= L_r.

    Returns:
        ([R, E_loc] Q_i, [R] level): Q_i = N_i on ranks with T_r == L_r.

    S(t) = sum_i clamp(t, f_i, N_i) is piecewise linear and nondecreasing in t, with
    breaks only at the values f_i and N_i. The last break b with S(b) <= T_r and
    the slope after it (the instances with f_i <= b < N_i) give the largest
    integer level t with S(t) <= T_r in closed form, without a search.
    """
    cut = target < routed.sum(1)                                     # [R]
    breaks = torch.cat([floors, routed], dim=1).sort(dim=1).values   # [R, 2 E_loc]
    s_at = torch.maximum(floors[:, None, :],
                         torch.minimum(routed[:, None, :], breaks[:, :, None])).sum(2)
    last = (s_at <= target[:, None]).sum(1, keepdim=True) - 1       # >= 0: S(min f) = sum f
    b = breaks.gather(1, last)                                       # [R, 1]
    slope = ((floors <= b) & (b < routed)).sum(1)                    # > 0 on cut ranks
    level = b[:, 0] + (target - s_at.gather(1, last)[:, 0]) // slope.clamp(min=1)
    kept = torch.maximum(floors, torch.minimum(routed, level[:, None]))

    # Leftover units (fewer than the instances that can take one): one each to
    # instances at the level with room, largest N_i first, ties by lower index.
    leftover = target - kept.sum(1)                                  # [R]
    room = (floors <= level[:, None]) & (level[:, None] < routed)    # [R, E_loc]
    key = torch.where(room, routed, torch.full_like(routed, -1))
    kept = kept + (room & (_ref_rank_in_order(key, dim=1) < leftover[:, None])).to(torch.int64)

    kept = torch.where(cut[:, None], kept, routed)
    level = torch.where(cut, level, routed.amax(1))
    return kept, level


def _ref_split_by_source(counts: torch.Tensor, routed: torch.Tensor,
                     kept: torch.Tensor) -> torch.Tensor:
    """Split Q_i over sources in proportion to n[s, i], largest remainder first.

    Args:
        counts: [R, I] n[s, i].
        routed: [I] N_i.
        kept: [I] Q_i <= N_i.

    Returns:
        [R, I] q[s, i] with sum_s q[s, i] = Q_i and q[s, i] <= n[s, i].
    """
    share = counts * kept                        # [R, I] Q_i * n[s, i], exact in int64
    denom = routed.clamp(min=1)
    base = share // denom                        # floor of the proportional share
    remainder = share - base * denom             # numerators over the same N_i: comparable
    leftover = kept - base.sum(0)                # [I], < number of nonzero remainders
    bonus = _ref_rank_in_order(remainder, dim=0) < leftover
    return base + bonus.to(torch.int64)


def _ref_rank_in_order(key: torch.Tensor, dim: int) -> torch.Tensor:
    """Position of each entry when sorted by ``key`` descending along ``dim``, ties by index."""
    order = torch.sort(key, dim=dim, descending=True, stable=True).indices
    shape = [1] * key.dim()
    shape[dim] = key.shape[dim]
    positions = torch.arange(key.shape[dim], dtype=torch.int64).view(shape).expand_as(order)
    return torch.empty_like(order).scatter_(dim, order, positions)


def _ref_floors(routed: torch.Tensor, share: Fraction) -> torch.Tensor:
    """[I] f_i = ceil(m * N_i), exact (Python integers over I values, not over pairs)."""
    if share == 0:
        return torch.zeros_like(routed)
    p, q = share.numerator, share.denominator
    return torch.tensor([_ref_ceil_div(p * v, q) for v in routed.tolist()], dtype=torch.int64)


def _ref_ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _ref_as_decimal_fraction(x: float) -> Fraction:
    """The decimal ``repr`` shows for x, exactly: 1.1 -> 11/10 (not the binary double)."""
    return Fraction(repr(float(x)))


# ---------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------


def _ref_check_counts(counts: torch.Tensor, num_ranks: int,
                      layout_given: bool = False) -> torch.Tensor:
    if not isinstance(counts, torch.Tensor):
        raise TypeError(f"counts must be a torch.Tensor, got {type(counts).__name__}")
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < 1:
        raise ValueError(f"num_ranks must be a positive int, got {num_ranks!r}")
    if counts.dim() != 2:
        raise ValueError(f"counts must be 2-D [R, E], got shape {tuple(counts.shape)}")
    if counts.dtype == torch.bool or counts.is_floating_point() or counts.is_complex():
        raise ValueError(f"counts must be an integer tensor, got dtype {counts.dtype}")
    ranks, experts = counts.shape
    if ranks != num_ranks:
        raise ValueError(f"counts has {ranks} rows but num_ranks is {num_ranks}")
    if experts == 0 or (experts % num_ranks and not layout_given):
        raise ValueError(
            f"counts has E={experts} columns: E must be a positive multiple of "
            f"num_ranks={num_ranks}")
    n = counts.detach().to(device="cpu", dtype=torch.int64)   # device sync if not on CPU
    if bool((n < 0).any()):
        raise ValueError("counts must be non-negative")
    return n


def _ref_check_layout(
    num_instances: int, num_ranks: int, instance_rank: Sequence[int] | None,
    instance_expert: Sequence[int] | None,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    if instance_rank is None:
        per_rank = num_instances // num_ranks
        instance_rank = tuple(i // per_rank for i in range(num_instances))
    instance_rank = tuple(int(r) for r in instance_rank)
    if len(instance_rank) != num_instances:
        raise ValueError(f"instance_rank has {len(instance_rank)} entries, counts has "
                         f"{num_instances} instance columns")
    if any(not 0 <= r < num_ranks for r in instance_rank):
        raise ValueError(f"instance_rank entries must be in [0, {num_ranks})")
    if instance_expert is None:
        instance_expert = range(num_instances)
    instance_expert = tuple(int(e) for e in instance_expert)
    if len(instance_expert) != num_instances:
        raise ValueError(f"instance_expert has {len(instance_expert)} entries, counts has "
                         f"{num_instances} instance columns")
    return instance_rank, instance_expert


def _ref_check_capacity_factor(capacity_factor: float) -> Fraction | None:
    """gamma as an exact fraction, or None for inf."""
    gamma = float(capacity_factor)
    if math.isnan(gamma) or gamma <= 0:
        raise ValueError(f"capacity_factor must be > 0 or inf, got {capacity_factor!r}")
    return None if math.isinf(gamma) else _ref_as_decimal_fraction(gamma)


def _ref_check_min_retention(min_retention: float) -> Fraction:
    m = float(min_retention)
    if not 0.0 <= m <= 1.0:  # also rejects nan
        raise ValueError(f"min_retention must be in [0, 1], got {min_retention!r}")
    return _ref_as_decimal_fraction(m)


def _random_layout(gen: torch.Generator, num_ranks: int, num_instances: int) -> tuple[int, ...]:
    """Replica-like layout: random rank per instance, ranks non-contiguous, some empty."""
    ranks = torch.randint(0, num_ranks, (num_instances,), generator=gen)
    if num_instances >= num_ranks and bool(torch.rand(1, generator=gen) < 0.5):
        ranks[torch.randperm(num_instances, generator=gen)[:num_ranks]] = torch.arange(num_ranks)
    return tuple(ranks.tolist())


def _random_counts(gen: torch.Generator, num_ranks: int, num_instances: int) -> torch.Tensor:
    kind = int(torch.randint(0, 5, (1,), generator=gen))
    if kind == 0:
        return torch.zeros(num_ranks, num_instances, dtype=torch.int64)
    scale = [3, 40, 500, 10**6][kind - 1]
    skew = torch.rand(num_instances, generator=gen) ** 4          # a few hot instances
    counts = (torch.rand(num_ranks, num_instances, generator=gen) * skew * scale).to(torch.int64)
    counts[torch.rand(num_ranks, num_instances, generator=gen) < 0.3] = 0  # zero cells
    return counts


ORACLE_GAMMAS = [0.5, 0.75, 1.0, 1.1, 1.5, math.inf]
ORACLE_MIN_RETENTIONS = [0.0, 0.1, 0.25, 1.0]


@pytest.fixture
def one_thread():
    """The torch reference runs ~60 tiny ops per call: one thread keeps it fast."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _assert_same_plan(counts, num_ranks, gamma, m, instance_rank=None, instance_expert=None):
    plan = plan_retention(counts, num_ranks, gamma, m, instance_rank=instance_rank,
                          instance_expert=instance_expert)
    ref = _plan_retention_reference(counts, num_ranks, gamma, m, instance_rank=instance_rank,
                                    instance_expert=instance_expert)
    for name in ("counts", "quotas", "capacity", "water_level"):
        new, old = getattr(plan, name), getattr(ref, name)
        assert new.dtype == old.dtype == torch.int64 and new.device == old.device, name
        assert torch.equal(new, old), (name, counts.tolist(), gamma, m, instance_rank)
    assert plan.instance_rank == ref.instance_rank
    assert plan.instance_expert == ref.instance_expert
    assert torch.equal(plan.retained_matrix, ref.retained_matrix)


def test_matches_frozen_reference_on_random_cases(one_thread):
    """The numpy planner equals the old torch one to the unit on random layouts and counts."""
    gen = torch.Generator().manual_seed(1234)
    cases = 0
    for num_ranks in (1, 2, 3, 4, 8, 64):
        for _ in range(3 if num_ranks == 64 else 12):
            replicas = bool(torch.rand(1, generator=gen) < 0.6)
            per_rank = int(torch.randint(1, 5, (1,), generator=gen))
            if num_ranks == 64:
                per_rank = 2
            num_instances = num_ranks * per_rank
            layout = None
            if replicas:
                num_instances += int(torch.randint(0, num_ranks + 3, (1,), generator=gen))
                layout = _random_layout(gen, num_ranks, num_instances)
            counts = _random_counts(gen, num_ranks, num_instances)
            experts = (None if layout is None
                       else tuple(torch.randint(0, 1000, (num_instances,), generator=gen).tolist()))
            for gamma, m in itertools.product(ORACLE_GAMMAS, ORACLE_MIN_RETENTIONS):
                _assert_same_plan(counts, num_ranks, gamma, m, layout, experts)
            gamma = float(torch.rand(1, generator=gen)) * 3 + 0.01
            m = float(torch.rand(1, generator=gen))
            _assert_same_plan(counts, num_ranks, gamma, m, layout, experts)
            cases += len(ORACLE_GAMMAS) * len(ORACLE_MIN_RETENTIONS) + 1
    assert cases > 1500


@settings(max_examples=100, deadline=None)
@given(planner_cases(max_ranks=5, max_local=5), st.data())
def test_matches_frozen_reference_hypothesis(case, data):
    counts, gamma, m = case
    tensor = torch.tensor(counts, dtype=torch.int64)
    num_ranks, num_experts = tensor.shape
    _assert_same_plan(tensor, num_ranks, gamma, m)
    extra = data.draw(st.integers(0, 4))
    layout = data.draw(st.lists(st.integers(0, num_ranks - 1), min_size=num_experts + extra,
                                max_size=num_experts + extra))
    wide = tensor[:, [j % num_experts for j in range(num_experts + extra)]]  # replica columns
    _assert_same_plan(wide, num_ranks, gamma, m, tuple(layout))
    _assert_same_plan(wide, num_ranks, gamma, m, layout)  # a list: not the cached tuple


def test_matches_frozen_reference_on_large_and_overflowing_values(one_thread):
    # Long decimals for m (p * N_i beyond int64: exact Python-int fallback for the
    # floors), tiny m (denominator beyond int64), and the benchmark's scale.
    gen = torch.Generator().manual_seed(7)
    big = (torch.rand(8, 16, generator=gen) ** 3 * 2_000_000).to(torch.int64)
    for m in (0.123456789012345, 1e-20, 0.9999999999999999, 5e-324, 0.3):
        for gamma in (0.3, 1.0, 1.0000000000000002, math.inf):
            _assert_same_plan(big, 8, gamma, m)
    for num_ranks, num_instances in ((1, 30), (2, 45), (3, 60)):  # > 16 instances per rank
        wide = _random_counts(gen, num_ranks, num_instances)
        wide[0, :5] = torch.arange(5) * 40 + 7                       # never all zero
        layout = _random_layout(gen, num_ranks, num_instances)
        for gamma, m in itertools.product(ORACLE_GAMMAS, ORACLE_MIN_RETENTIONS):
            _assert_same_plan(wide, num_ranks, gamma, m, layout)
    counts = (torch.rand(64, 128, generator=gen) ** 4 * 500).to(torch.int64)
    for gamma, m in itertools.product(ORACLE_GAMMAS, ORACLE_MIN_RETENTIONS):
        _assert_same_plan(counts, 64, gamma, m)
        _assert_same_plan(counts.to(torch.int32), 64, gamma, m)
        _assert_same_plan(counts.t().contiguous().t(), 64, gamma, m)


@pytest.mark.parametrize("rows", [1, 3, 16, 17, 64])
def test_first_in_order_paths_agree(rows):
    # The unique-key paths (pairwise for <= 16 rows, sort above) and the stable-argsort
    # fallback for keys near the int64 limit mark the same entries as torch's order.
    gen = torch.Generator().manual_seed(rows)
    key = torch.randint(-1, 4, (rows, 50), generator=gen)             # many ties
    count = torch.randint(-1, rows + 2, (50,), generator=gen)
    order = torch.sort(key, dim=0, descending=True, stable=True).indices
    position = torch.empty_like(order).scatter_(0, order, torch.arange(rows)[:, None]
                                                .expand_as(order).contiguous())
    expected = (position < count).numpy()
    for bound in (3, planner_module._INT64_MAX):
        got = planner_module._first_in_order(key.numpy(), count.numpy(), bound)
        assert (got == expected).all()


def test_layout_cache_returns_the_callers_layout():
    counts = torch.tensor([[4, 1, 0, 7, 2], [0, 9, 3, 1, 1]])
    a = plan_retention(counts, 2, 0.5, 0.0, instance_rank=(1, 0, 1, 0, 0))
    b = plan_retention(counts, 2, 0.5, 0.0, instance_rank=[1, 0, 1, 0, 0],
                       instance_expert=(3, 2, 1, 0, 0))
    assert a.instance_rank == b.instance_rank == (1, 0, 1, 0, 0)
    assert a.instance_expert == (0, 1, 2, 3, 4) and b.instance_expert == (3, 2, 1, 0, 0)
    assert torch.equal(a.quotas, b.quotas)
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
