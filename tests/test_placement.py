"""Tests of placement, capacity-aware routing and the per-layer planner (DESIGN.md 3.3, 6, 7).

Pure CPU, no process group. The routing reference is brute force: every integer split
of every replicated expert's pairs over its instances, written independently of the
implementation. Notation as in ``megatron_lrmoe/lrmoe/placement.py``.
"""

from __future__ import annotations

import itertools
import math
import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_lrmoe.lrmoe.cost_model import CostModel, MachineConstants, MoEShape
from megatron_lrmoe.lrmoe.placement import (
    Placement,
    PlacementPlanner,
    PlannerSettings,
    route_pairs,
)

# ---------------------------------------------------------------------------
# Placement
# ---------------------------------------------------------------------------


def test_static_placement_is_megatrons_layout():
    p = Placement.static(4, 8)
    assert p.instance_expert == tuple(range(8))
    assert p.instance_rank == (0, 0, 1, 1, 2, 2, 3, 3)
    assert p.home_instance == tuple(range(8))
    assert [list(p.rank_instances(r)) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert p.replicas_per_expert() == (0,) * 8


def test_instances_are_rank_major_homes_then_replicas():
    # R=2, E=4: rank 0 homes 0,1; rank 1 homes 2,3. Replicas given out of order.
    p = Placement(2, 4, ((3, 0), (2, 0), (0, 1)))
    assert p.replicas == ((2, 0), (3, 0), (0, 1))          # normalised: by (rank, expert)
    assert p.instance_expert == (0, 1, 2, 3, 2, 3, 0)
    assert p.instance_rank == (0, 0, 0, 0, 1, 1, 1)
    assert p.home_instance == (0, 1, 4, 5)
    assert p.instances_of(2) == (4, 2) and p.instances_of(0) == (0, 6)
    assert list(p.rank_instances(0)) == [0, 1, 2, 3]
    assert p.replicas_per_expert() == (1, 0, 1, 1)
    assert p.replicas_per_rank() == (2, 1)
    assert p == Placement(2, 4, ((0, 1), (2, 0), (3, 0)))
    assert hash(p) == hash(Placement(2, 4, ((0, 1), (2, 0), (3, 0))))


@pytest.mark.parametrize("replicas, message", [
    (((0, 0),), "home rank"),
    (((2, 0), (2, 0)), "twice"),
    (((4, 0),), "out of range"),
    (((0, 2),), "out of range"),
])
def test_placement_refuses_bad_replicas(replicas, message):
    with pytest.raises(ValueError, match=message):
        Placement(2, 4, replicas)


def test_placement_refuses_experts_not_multiple_of_ranks():
    with pytest.raises(ValueError, match="multiple"):
        Placement(3, 4)


# ---------------------------------------------------------------------------
# Routing against brute force
# ---------------------------------------------------------------------------


def _splits(total: int, parts: int):
    if parts == 1:
        yield (total,)
        return
    for first in range(total + 1):
        for rest in _splits(total - first, parts - 1):
            yield (first, *rest)


def brute_force(counts: list[list[int]], placement: Placement, capacity):
    """(least overflow, least max load among assignments without overflow or None)."""
    num_ranks, num_experts = len(counts), len(counts[0])
    totals = [sum(row[e] for row in counts) for e in range(num_experts)]
    options = [list(_splits(totals[e], len(placement.instances_of(e))))
               for e in range(num_experts)]
    best_overflow, best_max = math.inf, math.inf
    for choice in itertools.product(*options):
        load = [0] * num_ranks
        for e, split in enumerate(choice):
            for i, amount in zip(placement.instances_of(e), split, strict=True):
                load[placement.instance_rank[i]] += amount
        overflow = 0 if capacity is None else sum(
            max(0, ld - c) for ld, c in zip(load, capacity, strict=True))
        best_overflow = min(best_overflow, overflow)
        if overflow == 0:
            best_max = min(best_max, max(load))
    return best_overflow, (None if best_max == math.inf else best_max)


@st.composite
def small_cases(draw):
    num_ranks = draw(st.integers(1, 3))
    num_experts = num_ranks * draw(st.integers(1, 4 // num_ranks))
    per_rank = num_experts // num_ranks
    candidates = [(e, r) for e in range(num_experts) for r in range(num_ranks)
                  if r != e // per_rank]
    replicas = draw(st.lists(st.sampled_from(candidates), max_size=3, unique=True)
                    if candidates else st.just([]))
    counts = draw(st.lists(st.lists(st.integers(0, 4), min_size=num_experts,
                                    max_size=num_experts),
                           min_size=num_ranks, max_size=num_ranks))
    capacity = draw(st.one_of(st.none(), st.lists(st.integers(0, 12), min_size=num_ranks,
                                                  max_size=num_ranks)))
    return Placement(num_ranks, num_experts, tuple(replicas)), counts, capacity


def _loads(routing, placement) -> list[int]:
    return routing.load_per_rank(placement).tolist()


def _assert_exact(routing, counts: torch.Tensor, placement: Placement) -> None:
    """Every source's pairs of every expert are assigned to that expert's instances."""
    assert routing.counts.dtype == torch.int64 and routing.counts.shape == (
        placement.num_ranks, placement.num_instances)
    assert bool((routing.counts >= 0).all())
    for e in range(placement.num_experts):
        assert torch.equal(routing.counts[:, list(placement.instances_of(e))].sum(1),
                           counts[:, e])


@settings(max_examples=250, deadline=None)
@given(small_cases())
def test_route_pairs_matches_brute_force(case):
    placement, counts, capacity = case
    n = torch.tensor(counts, dtype=torch.int64)
    routing = route_pairs(n, placement, capacity)
    _assert_exact(routing, n, placement)
    load = _loads(routing, placement)
    best_overflow, best_max = brute_force(counts, placement, capacity)
    overflow = 0 if capacity is None else sum(
        max(0, ld - c) for ld, c in zip(load, capacity, strict=True))
    assert routing.overflow == overflow == best_overflow
    if best_overflow == 0:
        assert max(load) == best_max


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_route_pairs_properties_on_larger_cases(data):
    num_ranks = data.draw(st.sampled_from([2, 4, 8]))
    num_experts = num_ranks * data.draw(st.integers(1, 3))
    per_rank = num_experts // num_ranks
    candidates = [(e, r) for e in range(num_experts) for r in range(num_ranks)
                  if r != e // per_rank]
    replicas = data.draw(st.lists(st.sampled_from(candidates), max_size=12, unique=True))
    placement = Placement(num_ranks, num_experts, tuple(replicas))
    seed = data.draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    skew = torch.rand(num_experts, generator=gen) ** 3 * 50
    counts = torch.poisson(skew.expand(num_ranks, -1), generator=gen).to(torch.int64)
    routing = route_pairs(counts, placement)
    _assert_exact(routing, counts, placement)
    # Deterministic: a second call (as on another rank) gives the same.
    assert torch.equal(route_pairs(counts.clone(), placement).counts, routing.counts)
    # Experts without replicas stay at home, untouched.
    for e, reps in enumerate(placement.replicas_per_expert()):
        if not reps:
            assert torch.equal(routing.counts[:, placement.home_instance[e]], counts[:, e])
    # Locality: with the instance totals fixed, a source on an instance's rank sends
    # min(its pairs, the instance total) there.
    totals = routing.counts.sum(0)
    for i, (e, r) in enumerate(zip(placement.instance_expert, placement.instance_rank,
                                   strict=True)):
        if placement.replicas_per_expert()[e]:
            assert int(routing.counts[r, i]) == min(int(counts[r, e]), int(totals[i]))
    # Optimal max load: no assignment beats the lower bound of any rank set; check the
    # bounds that are cheap to state (every rank's own fixed load, the mean over all).
    load = _loads(routing, placement)
    assert max(load) >= -(-int(counts.sum()) // num_ranks)


def test_locality_when_it_costs_nothing():
    # Expert 0 (home rank 0) replicated on rank 1; the balanced split is 4 + 4 and
    # source 1 has 4 pairs of it: they stay on rank 1 (no network).
    placement = Placement(2, 2, ((0, 1),))
    counts = torch.tensor([[4, 0], [4, 0]])
    routing = route_pairs(counts, placement)
    # instances: 0 = expert 0 home (rank 0), 1 = expert 1 (rank 1), 2 = expert 0 on rank 1
    assert routing.counts.tolist() == [[4, 0, 0], [0, 0, 4]]
    assert routing.overflow == 0


def test_capacity_overflow_goes_home():
    # Expert 0 replicated on rank 1, but rank 1 has no room: all pairs stay at home,
    # and what exceeds rank 0's capacity is the overflow.
    placement = Placement(2, 2, ((0, 1),))
    counts = torch.tensor([[3, 0], [3, 2]])
    routing = route_pairs(counts, placement, capacity=[4, 2])
    assert routing.counts[:, 2].sum() == 0
    assert routing.overflow == 2
    assert _loads(routing, placement) == [6, 2]


def test_static_routing_is_identity():
    counts = torch.randint(0, 9, (4, 8), generator=torch.Generator().manual_seed(1))
    routing = route_pairs(counts, Placement.static(4, 8))
    assert torch.equal(routing.counts, counts) and routing.overflow == 0


def test_route_pairs_refuses_bad_input():
    placement = Placement.static(2, 4)
    with pytest.raises(ValueError, match="shape"):
        route_pairs(torch.zeros(2, 3, dtype=torch.int64), placement)
    with pytest.raises(ValueError, match="non-negative"):
        route_pairs(-torch.ones(2, 4, dtype=torch.int64), placement)
    with pytest.raises(ValueError, match="capacity"):
        route_pairs(torch.zeros(2, 4, dtype=torch.int64), placement, capacity=[1])


# ---------------------------------------------------------------------------
# Planner fixtures
# ---------------------------------------------------------------------------

MACHINE = MachineConstants(gemm_flops_per_s=1e9, alltoall_bytes_per_s=1e9,
                           alltoall_latency_s=1e-6, source="test constants")


def _cost(num_experts: int, tokens: int = 64, topk: int = 2, layers: int = 2,
          per_step: int = 4) -> CostModel:
    shape = MoEShape(hidden_size=64, ffn_hidden_size=32, num_experts=num_experts, topk=topk,
                     gated=True, dtype_bytes=2, tokens_per_rank=tokens, num_layers=layers,
                     microbatches_in_flight=1, microbatches_per_step=per_step)
    return CostModel(shape, MACHINE)


def _skewed_counts(num_ranks: int, num_experts: int, pairs: int, seed: int,
                   zipf: float = 1.2) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    popularity = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64) ** zipf
    popularity = popularity[torch.randperm(num_experts, generator=gen)]
    draws = torch.multinomial(popularity.expand(num_ranks, -1), pairs, replacement=True,
                              generator=gen)
    return torch.stack([torch.bincount(d, minlength=num_experts) for d in draws])


def _planner(policy: str, counts: torch.Tensor, **kwargs) -> PlacementPlanner:
    num_ranks, num_experts = counts.shape
    planner = PlacementPlanner(PlannerSettings(policy, num_ranks, num_experts, **kwargs))
    planner.observe(counts)
    planner.next_step()
    return planner


# ---------------------------------------------------------------------------
# Popularity (SYMI-style baseline)
# ---------------------------------------------------------------------------


def test_popularity_instances_are_proportional():
    # 8 instance slots over experts of popularity 4:2:1:1 -> exactly 4, 2, 1, 1 instances.
    counts = torch.tensor([[40, 20, 10, 10]] * 4)
    planner = _planner("popularity", counts, slots_per_rank=2, capacity_factor=math.inf)
    placement = planner.placement
    assert [len(placement.instances_of(e)) for e in range(4)] == [4, 2, 1, 1]
    assert all(len(placement.rank_instances(r)) <= 2 for r in range(4))
    # Forward load spread evenly: every rank receives exactly a quarter.
    routing = route_pairs(counts, placement)
    assert _loads(routing, placement) == [int(counts.sum()) // 4] * 4


def test_popularity_hot_expert_gets_more_instances():
    counts = _skewed_counts(8, 16, 400, seed=3)
    planner = _planner("popularity", counts, slots_per_rank=3, capacity_factor=math.inf)
    placement = planner.placement
    popularity = counts.sum(0)
    hot, cold = int(popularity.argmax()), int(popularity.argmin())
    instances = [len(placement.instances_of(e)) for e in range(16)]
    assert instances[hot] > instances[cold] >= 1
    assert sum(instances) <= 8 * 3
    # More popular never gets fewer instances (monotone allocation).
    order = popularity.argsort(descending=True).tolist()
    assert all(instances[a] >= instances[b] for a, b in itertools.pairwise(order))
    static_load = counts.sum(0).view(8, 2).sum(1)
    spread = route_pairs(counts, placement).load_per_rank(placement)
    assert float(static_load.max()) / float(static_load.float().mean()) > 3
    assert float(spread.max()) / float(spread.float().mean()) < 1.3


def test_popularity_budget_converts_to_slots():
    cost = _cost(8)
    need = cost.balanced_dropless_need()
    per_layer = need / cost.shape.num_layers
    extra = 3
    budget = (per_layer + extra * cost.shape.instance_bytes + 1) * cost.shape.num_layers
    s = PlannerSettings("popularity", 4, 8, budget_bytes=budget, cost=cost)
    assert s.popularity_slots() == 2 + extra
    assert PlannerSettings("popularity", 4, 8, budget_bytes=budget, cost=cost,
                           slots_per_rank=3).popularity_slots() == 3
    assert PlannerSettings("popularity", 4, 8).popularity_slots() == 2


def test_static_policy_never_replicates():
    counts = _skewed_counts(4, 8, 200, seed=0)
    planner = _planner("static", counts)
    assert planner.placement == Placement.static(4, 8)


# ---------------------------------------------------------------------------
# Memory-aware (LRMoE)
# ---------------------------------------------------------------------------


def _excess(planner: PlacementPlanner, plan) -> float:
    s = planner.settings
    memory = s.cost.plan_memory(plan.retention, torch.tensor(
        planner.placement.replicas_per_rank()))
    return max(0.0, float((memory - s.layer_share).max()))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), slack=st.floats(1.0, 4.0), zipf=st.floats(0.0, 2.0),
       gamma=st.sampled_from([0.75, 1.0, math.inf]))
def test_memory_aware_fits_budget_and_beats_static(seed, slack, zipf, gamma):
    counts = _skewed_counts(4, 8, 128, seed, zipf)
    cost = _cost(8)
    budget = cost.balanced_dropless_need() * slack
    common = dict(budget_bytes=budget, cost=cost, capacity_factor=gamma)
    aware = _planner("memory-aware", counts, **common)
    static = _planner("static", counts, **common)
    plan, base = aware.plan(counts), static.plan(counts)
    _assert_exact(plan.routing, counts, aware.placement)
    # Replicas never push a rank over its share: memory-aware fits whenever static
    # does, and never exceeds the share by more than static does.
    assert _excess(aware, plan) <= _excess(static, base) + 1e-6
    # Estimated layer time never worse than static under the same budget.
    assert sum(cost.layer_time(plan.retention)) <= sum(cost.layer_time(base.retention)) + 1e-12
    # Replicas never buy time with more drops.
    assert plan.capacity_factor_used >= base.capacity_factor_used


def test_memory_aware_replicates_hot_expert_when_budget_allows():
    counts = torch.zeros(4, 8, dtype=torch.int64)
    counts[:, 0] = 100                       # one hot expert on rank 0
    counts[:, 1:] = 10
    cost = _cost(8, tokens=85)
    big = _planner("memory-aware", counts, budget_bytes=cost.balanced_dropless_need() * 4,
                   cost=cost)
    assert big.placement.replicas_per_expert()[0] >= 1
    plan = big.plan(counts)
    static_max = int(counts.sum(0).view(4, 2).sum(1).max())
    assert int(plan.retention.routed_per_rank.max()) < static_max
    # At the balanced need only lightly loaded ranks have room; replicas go there only,
    # and every rank hosting one stays within its share.
    tight = _planner("memory-aware", counts, budget_bytes=cost.balanced_dropless_need(),
                     cost=cost)
    hosting = torch.tensor(tight.placement.replicas_per_rank())
    memory = cost.plan_memory(tight.plan(counts).retention, hosting)
    assert bool((memory[hosting > 0] <= tight.settings.layer_share).all())
    assert len(tight.placement.replicas) < len(big.placement.replicas)


def test_budget_lowers_gamma_not_forward():
    # Rank 0's routed load fits its forward buffers but not its backward ones at
    # gamma = 2: the planner lowers gamma until the backward buffers fit.
    cost = _cost(4, tokens=64, topk=2, layers=1)
    counts = torch.tensor([[40, 40, 24, 24], [40, 40, 24, 24]])
    budget = cost.balanced_dropless_need() * 1.1
    planner = PlacementPlanner(PlannerSettings("static", 2, 4, capacity_factor=2.0,
                                               budget_bytes=budget, cost=cost))
    plan = planner.plan(counts)
    assert plan.capacity_factor_used < 2.0
    assert any("lowered" in note for note in plan.notes)
    assert torch.equal(plan.retention.counts, counts)              # forward: everything
    memory = cost.plan_memory(plan.retention, torch.zeros(2))
    assert float(memory.max()) <= planner.settings.layer_share
    # gamma = inf means "no drop": the budget does not lower it.
    inf = PlacementPlanner(PlannerSettings("static", 2, 4, capacity_factor=math.inf,
                                           budget_bytes=budget, cost=cost))
    assert inf.plan(counts).capacity_factor_used == math.inf


# ---------------------------------------------------------------------------
# Planner life cycle
# ---------------------------------------------------------------------------


def test_smoothing_and_eval_steps():
    counts_a = _skewed_counts(2, 4, 50, seed=1)
    counts_b = _skewed_counts(2, 4, 50, seed=2)
    planner = PlacementPlanner(PlannerSettings("popularity", 2, 4, slots_per_rank=3,
                                               load_smoothing=0.25))
    planner.observe(counts_a)
    planner.observe(counts_b)                # mean over the step's micro-batches
    planner.next_step()
    first = (counts_a + counts_b).double() / 2
    assert torch.allclose(planner.smoothed_counts, first)
    planner.observe(counts_b)
    planner.next_step()
    assert torch.allclose(planner.smoothed_counts, 0.25 * first + 0.75 * counts_b.double())
    assert planner.step == 2
    before = (planner.placement, planner.smoothed_counts.clone())
    assert planner.next_step() is before[0]  # nothing observed: nothing changes
    assert planner.step == 2 and torch.equal(planner.smoothed_counts, before[1])


def test_state_dict_resume_is_exact():
    cost = _cost(8)
    s = PlannerSettings("memory-aware", 4, 8, budget_bytes=cost.balanced_dropless_need() * 3,
                        cost=cost, load_smoothing=0.5)
    batches = [_skewed_counts(4, 8, 128, seed=i) for i in range(6)]
    ref = PlacementPlanner(s)
    for counts in batches[:3]:
        ref.observe(counts)
        ref.next_step()
    ref.observe(batches[3])                  # mid-step observation is part of the state
    state = pickle.loads(pickle.dumps(ref.state_dict()))
    resumed = PlacementPlanner(s)
    resumed.load_state_dict(state)
    for planner in (ref, resumed):
        planner.next_step()
        for counts in batches[4:]:
            planner.observe(counts)
            planner.next_step()
    assert resumed.placement == ref.placement and resumed.step == ref.step
    assert torch.equal(resumed.smoothed_counts, ref.smoothed_counts)
    assert torch.equal(resumed.plan(batches[0]).retention.quotas,
                       ref.plan(batches[0]).retention.quotas)
    with pytest.raises(ValueError, match=r"\(R, E\)"):
        PlacementPlanner(PlannerSettings("static", 2, 8)).load_state_dict(state)


@pytest.mark.parametrize("kwargs, field", [
    (dict(policy="symi"), "policy"),
    (dict(capacity_factor=0.0), "capacity_factor"),
    (dict(min_retention=1.5), "min_retention"),
    (dict(slots_per_rank=1), "slots_per_rank"),
    (dict(load_smoothing=1.0), "load_smoothing"),
    (dict(policy="memory-aware"), "budget_bytes"),
    (dict(budget_bytes=1e9), "cost"),
])
def test_settings_validation_names_the_field(kwargs, field):
    args = dict(policy="static", num_ranks=4, num_experts=8) | kwargs
    with pytest.raises(ValueError, match=field):
        PlannerSettings(**args)


def test_budget_below_balanced_need_is_refused_with_the_number():
    cost = _cost(8)
    need = cost.balanced_dropless_need()
    with pytest.raises(ValueError, match=f"{need:.6g}"):
        PlannerSettings("static", 4, 8, budget_bytes=need * 0.99, cost=cost)
    PlannerSettings("static", 4, 8, budget_bytes=need, cost=cost)   # exactly enough: fine
