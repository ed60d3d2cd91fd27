"""The compiled per-call planner (kernels/planner.cpp via planning/native.py) against the
Python planner, which specifies it.

Property tests on random counts, placements, capacities, budgets and cost-model shapes:
the compiled instance assignment, retention quotas, rank memory and call layout must
equal the Python ones exactly (integers to the unit, memory to the bit), and a
``LayerPlanner`` must give the same plans, gamma, notes, memory and placements either
way. The Python planner is itself checked against brute force, maximum flow and exact
rational references in test_placement.py and test_planner.py.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from megatron_lrmoe.layer.moe_layer import _instance_order_tables
from megatron_lrmoe.layer.region import local_instances
from megatron_lrmoe.layer.region_layout import CallLayout
from megatron_lrmoe.planning.cost_model import CostModel
from megatron_lrmoe.planning.instance_assignment import (
    assign_instances,
    check_assignment_counts,
)
from megatron_lrmoe.planning.machine import MachineConstants
from megatron_lrmoe.planning.native import native_available, native_planner, native_pricer
from megatron_lrmoe.planning.placement import Placement
from megatron_lrmoe.planning.placement_policies import (
    PairSeconds,
    greedy_replicas,
    local_greedy_replicas,
    popularity_placement,
)
from megatron_lrmoe.planning.plan_types import budget_floor
from megatron_lrmoe.planning.planner import LayerPlanner, PlannerSettings
from megatron_lrmoe.planning.retention import (
    UNLIMITED_CAPACITY,
    capacity_for_factor,
    decimal_fraction,
    plan_retention,
)
from megatron_lrmoe.planning.shapes import MoEShape

MACHINE = MachineConstants(gemm_flops_per_s=1e9, alltoall_bytes_per_s=1e9,
                           alltoall_latency_s=1e-6, source="test constants")
# Rate tables, a memory rate and fixed costs: every branch of the time model's arithmetic
# (interpolation inside, below and above a table; memory passes; the gather).
TABLED = MachineConstants(
    gemm_flops_per_s=1e9, alltoall_bytes_per_s=1e9, alltoall_latency_s=1e-6,
    source="test tables", gemm_rows=(4.0, 16.0, 64.0, 256.0),
    gemm_forward_flops_per_s=(1.1e8, 3.3e8, 7.7e8, 9.1e8),
    gemm_backward_flops_per_s=(0.9e8, 2.9e8, 7.1e8, 8.3e8), memory_bytes_per_s=7.3e9,
    layer_forward_fixed_s=3.1e-5, layer_backward_fixed_s=4.7e-5,
    alltoall_sizes=(512.0, 8192.0, 131072.0), alltoall_size_bytes_per_s=(3e7, 2.1e8, 6.7e8))
GAMMAS = [0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.5, 3.0, math.inf]
MIN_RETENTIONS = [0.0, 0.1, 0.25, 0.5, 0.9, 1.0]
SETTINGS = settings(max_examples=120, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@st.composite
def placements_and_counts(draw, max_ranks: int = 6, max_per_rank: int = 4,
                          max_count: int = 40):
    """(placement, counts [R, E] int64): up to every possible replica (experts with many
    instances, long augmenting paths), counts with zero rows, zero columns and skew."""
    num_ranks = draw(st.integers(1, max_ranks))
    num_experts = num_ranks * draw(st.integers(1, max_per_rank))
    per_rank = num_experts // num_ranks
    candidates = [(e, r) for e in range(num_experts) for r in range(num_ranks)
                  if r != e // per_rank]
    replicas = draw(st.lists(st.sampled_from(candidates), unique=True,
                             max_size=len(candidates)) if candidates else st.just([]))
    high = draw(st.sampled_from([0, 1, 3, max_count]))
    counts = draw(st.lists(st.lists(st.integers(0, high), min_size=num_experts,
                                    max_size=num_experts),
                           min_size=num_ranks, max_size=num_ranks))
    hot = draw(st.integers(0, num_experts - 1))
    boost = draw(st.sampled_from([0, 10, 200]))
    n = torch.tensor(counts, dtype=torch.int64).reshape(num_ranks, num_experts)
    n[:, hot] += boost
    return Placement(num_ranks, num_experts, tuple(replicas)), n


def _capacity(draw, num_ranks: int, counts: torch.Tensor):
    total = int(counts.sum())
    return draw(st.one_of(st.none(), st.lists(
        st.integers(0, max(total // max(num_ranks, 1) * 2, 1)), min_size=num_ranks,
        max_size=num_ranks)))


def _check_assignment(placement: Placement, counts: torch.Tensor, capacity) -> None:
    expected = assign_instances(counts, placement, capacity)
    native = native_planner(placement, None, np.zeros(placement.num_ranks, np.int64))
    cells, load = native.assign(counts.numpy(),
                                None if capacity is None else np.asarray(capacity))
    assert np.array_equal(cells, expected.counts.numpy())
    assert np.array_equal(load, expected.load_per_rank().numpy())
    if capacity is not None:
        assert int(np.maximum(load - np.asarray(capacity), 0).sum()) == expected.overflow


@given(data=st.data())
@SETTINGS
def test_assignment_equals_python(data):
    placement, counts = data.draw(placements_and_counts())
    _check_assignment(placement, counts, _capacity(data.draw, placement.num_ranks, counts))


@pytest.mark.parametrize("placement, counts, capacity", [
    (Placement(1, 2), torch.zeros(1, 2, dtype=torch.int64), None),          # one rank, empty
    (Placement(2, 4, ((0, 1), (3, 0))), torch.zeros(2, 4, dtype=torch.int64), [0, 0]),
    (Placement(2, 2, ((0, 1),)), torch.tensor([[50, 0], [0, 0]]), [3, 100]),  # overflow
    (Placement(3, 3, ((0, 1), (0, 2), (1, 0), (1, 2), (2, 0), (2, 1))),     # all replicated
     torch.tensor([[9, 0, 4], [0, 7, 0], [3, 3, 3]]), [5, 5, 5]),
])
def test_assignment_edge_cases_equal_python(placement, counts, capacity):
    _check_assignment(placement, counts, capacity)


@given(case=placements_and_counts(), gamma=st.one_of(st.sampled_from(GAMMAS),
                                                     st.floats(0.01, 4.0)),
       m=st.one_of(st.sampled_from(MIN_RETENTIONS), st.floats(0.0, 1.0)))
@SETTINGS
def test_retention_equals_python(case, gamma, m):
    placement, counts = case
    cells = assign_instances(counts, placement).counts
    expected = plan_retention(cells, placement.num_ranks, gamma, m,
                              instance_rank=placement.instance_rank,
                              instance_expert=placement.instance_expert)
    floor = decimal_fraction(m)
    # m beyond int64 as a decimal fraction (1e-193): LayerPlanner plans it in Python
    assume(max(floor.numerator, floor.denominator) <= np.iinfo(np.int64).max)
    native = native_planner(placement, None, np.zeros(placement.num_ranks, np.int64))
    cap = capacity_for_factor(gamma, int(cells.sum()), placement.num_ranks)
    quotas, level = native.retain(cells.numpy(), cap, floor.numerator, floor.denominator)
    assert np.array_equal(quotas, expected.quotas.numpy())
    assert np.array_equal(level, expected.water_level.numpy())
    assert (cap == UNLIMITED_CAPACITY) == math.isinf(gamma)
    assert bool((expected.capacity == cap).all())


@pytest.mark.parametrize("scale", [2**26 - 3, 2**26, 2**31 + 11])
@pytest.mark.parametrize("gamma", [0.3, 0.77])
def test_retention_of_large_counts_equals_python(scale, gamma):
    # The quota split divides n K by N in doubles, corrected to the exact integer, while
    # N < 2^26, and in integers beyond: on both sides of the bound, against Python's
    # integer arithmetic (the hypothesis cases above stay far below it).
    placement = Placement(2, 4, ((0, 1), (3, 0)))
    counts = torch.tensor([[scale, 7, scale // 3, 1], [scale // 5, 3, 2, scale - 9]])
    cells = assign_instances(counts, placement).counts
    expected = plan_retention(cells, 2, gamma, 0.0, instance_rank=placement.instance_rank,
                              instance_expert=placement.instance_expert)
    native = native_planner(placement, None, np.zeros(2, np.int64))
    cap = capacity_for_factor(gamma, int(cells.sum()), 2)
    quotas, level = native.retain(cells.numpy(), cap, 0, 1)
    assert np.array_equal(quotas, expected.quotas.numpy())
    assert np.array_equal(level, expected.water_level.numpy())
    assert int(expected.quotas.sum()) < int(cells.sum())       # it dropped: the split ran


@st.composite
def planner_cases(draw):
    """(settings, count matrices): a small cost model in one of its variants, a budget
    from the floor up to room for several replicas, a policy, gamma and m."""
    num_ranks = draw(st.sampled_from([1, 2, 3, 4, 8]))
    num_experts = num_ranks * draw(st.integers(1, 4))
    grouped = draw(st.booleans())
    recompute = draw(st.sampled_from(["none", "moe", "full"]))
    layers = draw(st.integers(1, 3))
    # The rows saved: every routed one, the retained ones, or two-stage's stored ones.
    saved = draw(st.sampled_from(["routed", "retained", 1.5, 1.3, 2.0]))
    shape = MoEShape(hidden_size=64, ffn_hidden_size=32, num_experts=num_experts,
                     topk=min(2, num_experts), gated=draw(st.booleans()), dtype_bytes=2,
                     tokens_per_rank=draw(st.sampled_from([8, 64])), num_layers=layers,
                     microbatches_in_flight=draw(st.integers(1, 2)),
                     microbatches_per_step=draw(st.integers(1, 4)),
                     expert_parallel_size=(num_ranks if grouped or draw(st.booleans())
                                           else None),
                     grouped_gemm=grouped, forward_retention=saved != "routed",
                     store_factor=saved if isinstance(saved, float) else None,
                     recompute_moe=recompute == "moe",
                     full_recompute_layers=layers if recompute == "full" else 0)
    cost = CostModel(shape, draw(st.sampled_from([MACHINE, TABLED])))
    floor = budget_floor(cost)
    roomy = (cost.balanced_dropless_need()
             + 3 * shape.instance_bytes * shape.num_layers)
    budget = floor + draw(st.floats(0.0, 1.5)) * (roomy - floor)
    policy = draw(st.sampled_from(["static", "popularity", "memory-aware"]))
    with_budget = policy == "memory-aware" or draw(st.booleans())
    plain_cost = draw(st.booleans())          # a cost model without a budget
    settings_ = PlannerSettings(
        policy, num_ranks, num_experts,
        capacity_factor=draw(st.sampled_from(GAMMAS)),
        min_retention=draw(st.sampled_from(MIN_RETENTIONS)),
        budget_bytes=budget if with_budget else None,
        cost=cost if with_budget or plain_cost else None,
        load_smoothing=draw(st.sampled_from([0.0, 0.5])))
    pairs = shape.source_pairs
    matrices = []
    for _ in range(draw(st.integers(2, 4))):
        hot = draw(st.integers(0, num_experts - 1))
        skew = draw(st.sampled_from([0.0, 0.5, 0.9, 1.0]))
        rows = []
        for _ in range(num_ranks):
            rest = draw(st.lists(st.integers(0, 5), min_size=num_experts,
                                 max_size=num_experts))
            row = np.asarray(rest, dtype=np.int64)
            scale = (pairs * (1 - skew)) / max(row.sum(), 1)
            row = np.floor(row * scale).astype(np.int64)
            row[hot] += pairs - row.sum() if draw(st.booleans()) else 0
            rows.append(np.maximum(row, 0))
        matrices.append(torch.from_numpy(np.stack(rows)))
    if draw(st.booleans()):
        matrices[0] = torch.zeros_like(matrices[0])
    return settings_, matrices


def _assert_same_plan(a, b) -> None:
    assert torch.equal(a.assignment.counts, b.assignment.counts)
    assert a.assignment.overflow == b.assignment.overflow
    assert a.assignment.placement == b.assignment.placement
    for name in ("counts", "quotas", "capacity", "water_level"):
        assert torch.equal(getattr(a.retention, name), getattr(b.retention, name)), name
    assert a.retention.instance_rank == b.retention.instance_rank
    assert a.retention.instance_expert == b.retention.instance_expert
    assert a.retention.capacity_factor == b.retention.capacity_factor
    assert a.retention.min_retention == b.retention.min_retention
    assert a.capacity_factor_used == b.capacity_factor_used
    assert a.notes == b.notes
    assert np.array_equal(a.rank_load, b.rank_load)


def _assert_same_layout(native: LayerPlanner, plan) -> None:
    placement = plan.assignment.placement
    for rank in range(placement.num_ranks):
        local = local_instances(plan.retention, rank)
        sizes, tables, order = native.native_layout(plan, rank)
        got = CallLayout.from_native(rank, local, sizes, tables)
        want = CallLayout(plan.retention, rank, local)
        for name, value in vars(want).items():
            other = getattr(got, name)
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, other), name
            else:
                assert value == other, name
        expected = _instance_order_tables(plan.assignment.counts[rank], placement)
        assert (order is None) == (expected is None)
        if order is not None:
            assert np.array_equal(order, expected)


@given(case=planner_cases())
@SETTINGS
def test_layer_planner_equals_python(case):
    """Plans, gamma used, notes, memory, call layouts and the placements next_step picks:
    the same with the compiled planner as with the Python one, over several steps."""
    settings_, matrices = case
    native, python = LayerPlanner(settings_, native=True), LayerPlanner(settings_, native=False)
    assert native.native and not python.native
    for _ in range(3):
        for counts in matrices:
            a, b = native.plan(counts), python.plan(counts)
            _assert_same_plan(a, b)
            if python.last_memory is None:
                assert native.last_memory is None
            else:
                assert np.array_equal(native.last_memory, python.last_memory)
            _assert_same_layout(native, a)
            native.observe(counts)
            python.observe(counts)
        native.next_step()
        python.next_step()
        assert native.placement == python.placement
        assert native.placement_notes == python.placement_notes
        assert torch.equal(native.smoothed_counts, python.smoothed_counts)


@given(case=planner_cases(), data=st.data())
@SETTINGS
def test_placement_judge_equals_python(case, data):
    """The memory-aware choice's judge of a candidate placement (its plans' peaks, whether
    they fit, their prices and the busiest replica sender): compiled, the Python judge's
    numbers to the bit (prices ``CostModel.layer_times`` with ``instance_gemm_times``);
    and one key per placement, whatever the replicas' order."""
    settings_, matrices = case
    assume(settings_.budget_bytes is not None)
    settings_ = dataclasses.replace(settings_, policy="memory-aware")
    native, python = LayerPlanner(settings_, native=True), LayerPlanner(settings_, native=False)
    num_ranks, num_experts = settings_.num_ranks, settings_.num_experts
    per_rank = num_experts // num_ranks
    candidates = [(e, r) for e in range(num_experts) for r in range(num_ranks)
                  if r != e // per_rank]
    replicas = data.draw(st.lists(st.sampled_from(candidates), unique=True,
                                  max_size=len(candidates)) if candidates else st.just([]))
    static = Placement.static(num_ranks, num_experts)
    counts = [check_assignment_counts(m.numpy(), static) for m in matrices]
    caps = [python._capacity(c) for c in counts]
    share = settings_.layer_share
    allowed = data.draw(st.sampled_from([math.inf, 0.0, share, share * 0.9]))
    stop = data.draw(st.booleans())
    got = native._evaluator()(replicas, counts, caps, allowed, stop)
    want = python._evaluator()(replicas, counts, caps, allowed, stop)
    assert got[1:] == want[1:]
    assert native._evaluator()(replicas[::-1], counts, caps, allowed, stop)[0] == got[0]


@given(case=planner_cases(), scale=st.floats(0.0, 2.0), replicas=st.integers(0, 6),
       data=st.data())
@SETTINGS
def test_memory_and_retained_limit_equal_the_cost_model(case, scale, replicas, data):
    """Rank memory and the retained limit (the budget's gamma lowering), compiled, equal
    the cost model's at any share, on placements with replicas."""
    settings_, matrices = case
    cost = settings_.cost
    assume(cost is not None)
    num_ranks, num_experts = settings_.num_ranks, settings_.num_experts
    per_rank = num_experts // num_ranks
    candidates = [(e, r) for e in range(num_experts) for r in range(num_ranks)
                  if r != e // per_rank]
    chosen = data.draw(st.lists(st.sampled_from(candidates), unique=True,
                                max_size=min(replicas, len(candidates)))
                       if candidates else st.just([]))
    placement = Placement(num_ranks, num_experts, tuple(chosen))
    rank_replicas = np.asarray(placement.replicas_per_rank(), dtype=np.int64)
    native = native_planner(placement, cost, rank_replicas)
    share = scale * cost.balanced_dropless_need() / cost.shape.num_layers
    starts = np.asarray(placement.rank_starts[:-1], dtype=np.int64)
    for counts in matrices:
        assignment = assign_instances(counts, placement)
        cells = assignment.counts.numpy()
        load = assignment.load_per_rank().numpy()
        plan = plan_retention(assignment.counts, num_ranks, 0.5, 0.0,
                              instance_rank=placement.instance_rank,
                              instance_expert=placement.instance_expert)
        # The compiled planner budgets the replicas' gradient return on every call.
        returned = cost.returned_gradient_bytes(placement)
        assert np.array_equal(native.memory(cells, plan.quotas.numpy(), load),
                              cost.plan_memory(plan, rank_replicas, returned))
        largest = np.maximum.reduceat(np.add.reduce(cells, axis=0), starts)
        assert np.array_equal(native.retained_limit(share, cells, load),
                              cost.retained_limit(share, rank_replicas, load, largest,
                                                  returned=returned))


@given(machine=st.sampled_from([MACHINE, TABLED]), num_ranks=st.sampled_from([None, 2, 8]),
       loads=st.lists(st.floats(0.0, 1e5), min_size=4, max_size=4),
       busiest=st.integers(0, 40), forward_retention=st.booleans(), gated=st.booleans(),
       store_factor=st.sampled_from([None, 1.5, 1.3]))
@SETTINGS
def test_pricer_equals_the_cost_model(machine, num_ranks, loads, busiest, forward_retention,
                                      gated, store_factor):
    """The compiled time model the greedy searches price with: ``CostModel.load_times``
    and ``replica_cost_per_microbatch`` to the bit."""
    shape = MoEShape(hidden_size=64, ffn_hidden_size=32, num_experts=16, topk=2,
                     gated=gated, dtype_bytes=2, tokens_per_rank=512,
                     microbatches_per_step=3, expert_parallel_size=4,
                     forward_retention=forward_retention or store_factor is not None,
                     store_factor=store_factor)
    cost = CostModel(shape, machine)
    pricer = native_pricer(cost, num_ranks)
    top, retained, routed_pairs, retained_pairs = loads
    want = cost.load_times(np.array([top]), np.array([retained]), np.array([routed_pairs]),
                           np.array([retained_pairs]), num_ranks)
    assert pricer.load_time(top, retained, routed_pairs, retained_pairs) == float(want[0])
    assert pricer.replica_cost(busiest) == cost.replica_cost_per_microbatch(busiest)


@given(routed=st.lists(st.integers(0, 5000), min_size=1, max_size=24),
       num_ranks=st.sampled_from([1, 2, 3, 4, 8]), per_step=st.integers(1, 16),
       gamma=st.sampled_from([0.5, 1.0, math.inf]), data=st.data())
@SETTINGS
def test_greedy_replicas_equals_python(routed, num_ranks, per_step, gamma, data):
    """The compiled greedy moves give the replicas the Python search gives (the same
    moves, priced by the same cost model)."""
    num_experts = num_ranks * max(1, len(routed) // num_ranks)
    routed = (routed * num_experts)[:num_experts]
    if data.draw(st.booleans()):                     # a few very hot experts
        routed[data.draw(st.integers(0, num_experts - 1))] *= 50
    shape = MoEShape(hidden_size=64, ffn_hidden_size=32, num_experts=num_experts, topk=1,
                     gated=True, dtype_bytes=2, tokens_per_rank=max(sum(routed), 1),
                     microbatches_per_step=per_step)
    settings_ = PlannerSettings("static", num_ranks, num_experts, capacity_factor=gamma,
                                cost=CostModel(shape, data.draw(st.sampled_from(
                                    [MACHINE, TABLED]))))
    counts = torch.tensor([routed] + [[0] * num_experts] * (num_ranks - 1))
    base = LayerPlanner(settings_, native=False).plan(counts)
    capacity = int(base.retention.capacity[0])
    assert (greedy_replicas(routed, capacity, settings_, native=True)
            == greedy_replicas(routed, capacity, settings_, native=False))


@given(num_ranks=st.sampled_from([2, 3, 4, 8, 16]), per_rank=st.integers(1, 4),
       per_step=st.integers(1, 16), gamma=st.sampled_from([0.5, 1.0, math.inf]),
       zipf=st.floats(0.0, 2.0), locality=st.floats(0.0, 2.0), seed=st.integers(0, 10**6),
       machine=st.sampled_from([MACHINE, TABLED]))
@SETTINGS
def test_local_greedy_replicas_equals_python(num_ranks, per_rank, per_step, gamma, zipf,
                                             locality, seed, machine):
    """The compiled locality-aware moves give the replicas the Python search gives."""
    num_experts = num_ranks * per_rank
    counts = _local_counts(num_ranks, num_experts, seed, zipf, locality)
    shape = MoEShape(hidden_size=64, ffn_hidden_size=32, num_experts=num_experts, topk=1,
                     gated=True, dtype_bytes=2, tokens_per_rank=max(int(counts.sum(1).max()), 1),
                     microbatches_per_step=per_step)
    settings_ = PlannerSettings("static", num_ranks, num_experts, capacity_factor=gamma,
                                cost=CostModel(shape, machine))
    base = LayerPlanner(settings_, native=False).plan(torch.from_numpy(counts))
    capacity = int(base.retention.capacity[0])
    assert (local_greedy_replicas(counts, capacity, settings_, native=True)
            == local_greedy_replicas(counts, capacity, settings_, native=False))


@given(num_ranks=st.sampled_from([1, 2, 3, 4, 8, 16]), per_rank=st.integers(1, 4),
       extra=st.integers(0, 40), zipf=st.floats(0.0, 2.0), locality=st.floats(0.0, 2.0),
       seed=st.integers(0, 10**6), aware=st.booleans(),
       weights=st.tuples(st.floats(0.0, 1e-3), st.floats(0.0, 1e-3)))
@SETTINGS
def test_popularity_placement_equals_python(num_ranks, per_rank, extra, zipf, locality, seed,
                                            aware, weights):
    """The compiled placement loop places the replicas the Python loop places, SYMI-style's
    and the locality-aware one alike."""
    num_experts = num_ranks * per_rank
    counts = _local_counts(num_ranks, num_experts, seed, zipf, locality)
    slots = min(per_rank + extra, num_experts)
    local = (counts, PairSeconds(*weights)) if aware else (None, None)
    assert (popularity_placement(counts.sum(0), num_ranks, num_experts, slots, *local,
                                 native=True)
            == popularity_placement(counts.sum(0), num_ranks, num_experts, slots, *local,
                                    native=False))


def _local_counts(num_ranks: int, num_experts: int, seed: int, zipf: float,
                  locality: float) -> np.ndarray:
    """[R, E] int64 counts: Zipf popularity, each rank's own preferences spread by
    ``locality``, with ties (equal counts) on purpose: a small number of pairs."""
    rng = np.random.default_rng(seed)
    base = np.arange(1, num_experts + 1, dtype=np.float64) ** -zipf
    p = base[rng.permutation(num_experts)] * np.exp(
        locality * rng.standard_normal((num_ranks, num_experts)))
    p /= p.sum(1, keepdims=True)
    pairs = int(rng.choice([8, 64, 1000]))
    return np.stack([rng.multinomial(pairs, row) for row in p]).astype(np.int64)


def test_planner_reads_host_arrays_like_tensors():
    """A numpy [R, E] array plans and observes as the tensor it holds; bad arrays are
    refused with the same messages."""
    placement_settings = PlannerSettings("static", 2, 4, capacity_factor=0.5)
    counts = torch.tensor([[5, 0, 2, 1], [0, 9, 3, 3]])
    for native in (True, False):
        from_tensor, from_array = (LayerPlanner(placement_settings, native=native)
                                   for _ in range(2))
        _assert_same_plan(from_tensor.plan(counts), from_array.plan(counts.numpy()))
        from_tensor.observe(counts)
        from_array.observe(counts.numpy())
        assert torch.equal(from_tensor.observations()[0], from_array.observations()[0])
        with pytest.raises(ValueError, match="non-negative"):
            from_array.plan(-counts.numpy())
        with pytest.raises(ValueError, match="shape"):
            from_array.plan(counts.numpy()[:, :2])
        with pytest.raises(ValueError, match="integer"):
            from_array.plan(counts.numpy().astype(np.float64))


def test_native_refuses_bad_shapes():
    native = native_planner(Placement(2, 4, ((0, 1),)), None, np.asarray([0, 1]))
    with pytest.raises(ValueError, match=r"counts must have shape \[R, 4\]"):
        native.assign(np.zeros((2, 3), dtype=np.int64), None)
    with pytest.raises(ValueError, match="limit must have one entry per rank"):
        native.assign(np.zeros((2, 4), dtype=np.int64), np.zeros(3, dtype=np.int64))
    with pytest.raises(ValueError, match="no cost model"):
        native.memory(np.zeros((2, 5), dtype=np.int64), np.zeros((2, 5), dtype=np.int64),
                      np.zeros(2, dtype=np.int64))
    with pytest.raises(ValueError, match="rank out of range"):
        native.layout(np.zeros((2, 5), dtype=np.int64), np.zeros((2, 5), dtype=np.int64), 2)


def test_native_true_without_the_extension_is_refused(monkeypatch):
    from megatron_lrmoe.planning import planner as planner_module
    monkeypatch.setattr(planner_module, "native_available", lambda: False)
    with pytest.raises(ValueError, match="NativePlanner"):
        LayerPlanner(PlannerSettings("static", 1, 2), native=True)
    planner_module._warn_python_planner.cache_clear()
    with pytest.warns(RuntimeWarning, match="plans in Python"):
        assert not LayerPlanner(PlannerSettings("static", 1, 2)).native


@given(data=st.data())
@SETTINGS
def test_rank_loads_equal_python(data):
    """The compiled rank loads of a plan (what the memory-aware search prices) are
    ``CostModel.rank_loads`` of its routed and retained matrices."""
    placement, counts = data.draw(placements_and_counts())
    native = native_planner(placement, None, np.zeros(placement.num_ranks, np.int64))
    assignment = assign_instances(counts, placement)
    plan = plan_retention(assignment.counts, placement.num_ranks, 0.5, 0.0,
                          instance_rank=placement.instance_rank,
                          instance_expert=placement.instance_expert)
    loads = native.rank_loads(assignment.counts.numpy(), plan.quotas.numpy())
    assert np.array_equal(loads, CostModel.rank_loads(plan.routed_matrix.numpy(),
                                                      plan.retained_matrix.numpy()))


def test_the_extension_has_the_compiled_planner():
    """The project always builds the extension (scripts/setup.sh), so the compiled planner
    must be there: its absence fails here instead of skipping the comparisons above."""
    assert native_available(), "megatron_lrmoe._kernels has no NativePlanner: rebuild it"
