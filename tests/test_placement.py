"""Tests of placement, capacity-aware routing and the per-layer planner (DESIGN.md 3.3, 6, 7).

Pure CPU, no process group. The routing reference is brute force: every integer split
of every replicated expert's pairs over its instances, written independently of the
implementation. Notation as in ``megatron_lrmoe/lrmoe/placement.py``.
"""

from __future__ import annotations

import itertools
import math
import pickle
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_lrmoe.lrmoe.cost_model import CostModel, MachineConstants, MoEShape
from megatron_lrmoe.lrmoe.placement import Placement
from megatron_lrmoe.lrmoe.placement_policies import _greedy_replicas, _popularity_placement
from megatron_lrmoe.lrmoe.planner import LayerPlanner, MicroBatchPlan, PlannerSettings
from megatron_lrmoe.lrmoe.retention import (
    UNLIMITED_CAPACITY,
    capacity_for_factor,
    factor_for_capacity,
    plan_retention,
)
from megatron_lrmoe.lrmoe.routing import Routing, route_pairs

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


def _planner(policy: str, counts: torch.Tensor, **kwargs) -> LayerPlanner:
    num_ranks, num_experts = counts.shape
    planner = LayerPlanner(PlannerSettings(policy, num_ranks, num_experts, **kwargs))
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


def _excess(planner: LayerPlanner, plan) -> float:
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
    planner = LayerPlanner(PlannerSettings("static", 2, 4, capacity_factor=2.0,
                                               budget_bytes=budget, cost=cost))
    plan = planner.plan(counts)
    assert plan.capacity_factor_used < 2.0
    assert any("lowered" in note for note in plan.notes)
    assert torch.equal(plan.retention.counts, counts)              # forward: everything
    memory = cost.plan_memory(plan.retention, torch.zeros(2))
    assert float(memory.max()) <= planner.settings.layer_share
    # gamma = inf means "no drop": the budget does not lower it.
    inf = LayerPlanner(PlannerSettings("static", 2, 4, capacity_factor=math.inf,
                                           budget_bytes=budget, cost=cost))
    assert inf.plan(counts).capacity_factor_used == math.inf


# ---------------------------------------------------------------------------
# Planner life cycle
# ---------------------------------------------------------------------------


def test_smoothing_and_eval_steps():
    counts_a = _skewed_counts(2, 4, 50, seed=1)
    counts_b = _skewed_counts(2, 4, 50, seed=2)
    planner = LayerPlanner(PlannerSettings("popularity", 2, 4, slots_per_rank=3,
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
    ref = LayerPlanner(s)
    for counts in batches[:3]:
        ref.observe(counts)
        ref.next_step()
    ref.observe(batches[3])                  # mid-step observation is part of the state
    state = pickle.loads(pickle.dumps(ref.state_dict()))
    resumed = LayerPlanner(s)
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
        LayerPlanner(PlannerSettings("static", 2, 8)).load_state_dict(state)


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


# ---------------------------------------------------------------------------
# Frozen oracle: route_pairs and _greedy_replicas as they were before the speed-up
# (megatron_lrmoe/lrmoe/placement.py at commit 02ac288 + its uncommitted changes of
# 2026-11-29). The optimised code must give exactly the same results.
# ---------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class _OracleLayout:
    """Index arrays ``_oracle_route_pairs`` needs, built once per placement."""

    replicated: np.ndarray          # [K] experts with replicas, ascending
    instance_table: np.ndarray      # [K, J] their instance ids, home first; -1 padding
    rank_table: np.ndarray          # [K, J] the ranks hosting them; -1 padding
    ranks_of: tuple[tuple[int, ...], ...]   # rank_table rows without padding
    single: np.ndarray              # [E - K] experts without replicas
    single_rank: np.ndarray         # [E - K] their home rank
    single_instance: np.ndarray     # [E - K] their home instance
    rank_incidence: tuple[tuple[tuple[int, int], ...], ...]  # [R] (k, j) hosted on r
    involved_ranks: tuple[int, ...]  # ranks hosting an instance of a replicated expert
    involved_set: frozenset[int]
    rank_degree: np.ndarray          # [R] replicated-expert instances on each rank
    valid_index: tuple[np.ndarray, np.ndarray]   # nonzero(instance_table >= 0)

    @classmethod
    def build(cls, placement: Placement) -> _OracleLayout:
        per_expert = placement.replicas_per_expert()
        replicated = [e for e, c in enumerate(per_expert) if c]
        single = [e for e, c in enumerate(per_expert) if not c]
        width = max((c + 1 for c in per_expert), default=1)
        instance_table = np.full((len(replicated), width), -1, dtype=np.int64)
        rank_table = np.full((len(replicated), width), -1, dtype=np.int64)
        incidence: list[list[tuple[int, int]]] = [[] for _ in range(placement.num_ranks)]
        ranks_of = []
        for k, e in enumerate(replicated):
            instances = placement.instances_of(e)
            ranks = tuple(placement.instance_rank[i] for i in instances)
            instance_table[k, :len(instances)] = instances
            rank_table[k, :len(instances)] = ranks
            ranks_of.append(ranks)
            for j, r in enumerate(ranks):
                incidence[r].append((k, j))
        return cls(
            replicated=np.asarray(replicated, dtype=np.int64),
            instance_table=instance_table,
            rank_table=rank_table,
            ranks_of=tuple(ranks_of),
            single=np.asarray(single, dtype=np.int64),
            single_rank=np.asarray([placement.home_rank(e) for e in single], dtype=np.int64),
            single_instance=np.asarray([placement.home_instance[e] for e in single],
                                       dtype=np.int64),
            rank_incidence=tuple(tuple(v) for v in incidence),
            involved_ranks=tuple(r for r in range(placement.num_ranks) if incidence[r]),
            involved_set=frozenset(r for r in range(placement.num_ranks) if incidence[r]),
            valid_index=np.nonzero(instance_table >= 0),
            rank_degree=np.asarray([len(v) for v in incidence], dtype=np.float64),
        )



def _oracle_route_pairs(counts: torch.Tensor, placement: Placement, capacity=None) -> Routing:
    """Assign every routed pair to an instance of its expert (DESIGN.md 3.3).

    Args:
        counts: [R, E] integer n[s, e] (copied to CPU int64).
        placement: the instances; R and E must match ``counts``.
        capacity: [R] most pairs each rank can receive, or None for no limit.

    Returns:
        The routing; the module docstring states the semantics (overflow first,
        then the most loaded rank, then locality, then a fixed fill order).
    """
    n = counts.to(torch.int64).numpy()
    cap = None if capacity is None else np.asarray(capacity, dtype=np.int64)
    layout = _OracleLayout.build(placement)
    num_ranks = placement.num_ranks
    routed = n.sum(0)                                               # [E] N_e
    out = np.zeros((num_ranks, placement.num_instances), dtype=np.int64)
    out[:, layout.single_instance] = n[:, layout.single]
    base = np.bincount(layout.single_rank, weights=routed[layout.single],
                       minlength=num_ranks).astype(np.int64)        # [R] fixed loads
    overflow = 0
    if len(layout.replicated):
        x = _oracle_balance(base.tolist(), None if cap is None else cap.tolist(),
                     routed[layout.replicated], layout)
        x = np.asarray(x, dtype=np.int64)                            # [K, J]
        split = _oracle_split_sources(n[:, layout.replicated].T, x, layout.rank_table)  # [K, R, J]
        kk, jj = layout.valid_index
        out[:, layout.instance_table[kk, jj]] = split[kk, :, jj].T
    if cap is not None:
        load = np.zeros(num_ranks, dtype=np.int64)
        np.add.at(load, np.asarray(placement.instance_rank), out.sum(0))
        overflow = int(np.maximum(load - cap, 0).sum())
    return Routing(counts=torch.from_numpy(out), overflow=overflow, placement=placement)


def _oracle_balance(
    base: list[int], cap: list[int] | None, totals: np.ndarray, layout: _OracleLayout,
) -> list[list[int]]:
    """Per-instance totals x[k][j] of the replicated experts: min overflow, then min max.

    A transportation problem with an integral optimum, solved by augmenting paths in
    the transfer graph (rank r -> rank r' when an expert with pairs on r also has an
    instance on r'), moving whole blocks of pairs at a time:
      0. start from an even split of each expert over its instances;
      1. with capacities, push the pairs above capacity to ranks with room until no
         over-full rank reaches one (a maximum flow: overflow is minimal), then move
         replica pairs still above capacity to their homes (the overflow stays equal,
         every home on the way being full);
      2. repair towards a level M that is a proven lower bound of the max load: push
         load above M to ranks below M (and below capacity). When a rank above M
         reaches no such rank, the ranks it reaches, T, hold every pair of the experts
         they touch, so any assignment puts load(T) on T: the least M' that fits it
         is a larger lower bound; raise M to it and go on. When no rank is above M,
         M is optimal.
    """
    num_ranks = len(base)
    ranks_of, incidence = layout.ranks_of, layout.rank_incidence
    valid = layout.rank_table >= 0
    # Lower bounds of the max load: every set of ranks holds at least the pairs of the
    # experts confined to it: all involved ranks, and each expert's own ranks.
    rank_index = np.where(valid, layout.rank_table, 0)
    base_arr = np.asarray(base, dtype=np.int64)
    involved = np.asarray(layout.involved_ranks)
    own = totals + np.where(valid, base_arr[rank_index], 0).sum(1)
    bound = max(int(np.max(-(-own // valid.sum(1)))),
                -(-int(base_arr[involved].sum() + totals.sum()) // len(involved)))
    # Start: split each expert in proportion to its ranks' room under that bound,
    # shared among the replicated experts on the rank (close to the optimum, so few
    # augmenting paths remain).
    room = np.maximum(bound - base_arr, 1.0) / np.maximum(layout.rank_degree, 1)
    weight = np.where(valid, room[rank_index], 0.0)
    ideal = totals[:, None] * weight / weight.sum(1, keepdims=True)
    x_arr = np.floor(ideal).astype(np.int64)
    x_arr[:, 0] += totals - x_arr.sum(1)
    load_arr = np.asarray(base, dtype=np.int64) + np.bincount(
        layout.rank_table[valid], weights=x_arr[valid], minlength=num_ranks).astype(np.int64)
    x = x_arr.tolist()
    load = load_arr.tolist()
    involved = layout.involved_ranks
    stuck: set[int] = set()
    if cap is None:
        limit = [math.inf] * num_ranks
    else:
        limit = list(cap)
        for u in involved:
            while load[u] > limit[u]:
                path = _oracle_augmenting_path(u, lambda r: load[r] < limit[r], x,
                                               ranks_of, incidence)
                if path[0] is None:
                    break
                end, hops = path
                delta = min(load[u] - limit[u], limit[end] - load[end],
                            *(x[k][j] for k, j, _ in hops))
                _oracle_shift(x, hops, delta)
                load[u] -= delta
                load[end] += delta
        _oracle_overflow_home(x, load, limit, ranks_of, incidence)
        stuck = {r for r in range(num_ranks) if load[r] > limit[r]}      # overflow stays
        limit = [max(c, ld) for c, ld in zip(limit, load, strict=True)]

    fixed = [load[r] for r in range(num_ranks) if r not in layout.involved_set or r in stuck]
    level = max(max(fixed, default=0), bound,
                _oracle_least_level(sum(load[r] for r in involved), [limit[r] for r in involved]))
    while True:
        over = [r for r in involved if load[r] > level]
        if not over:
            return x
        raised = False
        for u in over:
            while load[u] > level:
                end, found = _oracle_augmenting_path(
                    u, lambda r, m=level: load[r] < m and load[r] < limit[r],
                    x, ranks_of, incidence)
                if end is None:                      # found = the ranks u reaches
                    bound = _oracle_least_level(sum(load[r] for r in found),
                                                [limit[r] for r in found])
                    if bound is None or bound <= level:   # no certificate: stop here
                        return x
                    level, raised = bound, True
                    break
                delta = min(load[u] - level, min(level, limit[end]) - load[end],
                            *(x[k][j] for k, j, _ in found))
                _oracle_shift(x, found, delta)
                load[u] -= delta
                load[end] += delta
            if raised:
                break


def _oracle_augmenting_path(start, is_target, x, ranks_of, incidence):
    """Breadth-first search of the transfer graph from rank ``start``.

    Returns (end rank, hops) with hops the (k, j_from, j_to) moves of a path to the
    first rank found with ``is_target``, or (None, ranks reached) when there is none.
    Deterministic: ranks in the order found, incidences in (k, j) order.
    """
    parent = {start: None}
    queue = [start]
    for r in queue:
        for k, j in incidence[r]:
            if not x[k][j]:
                continue
            for j2, r2 in enumerate(ranks_of[k]):
                if r2 in parent:
                    continue
                parent[r2] = (r, k, j, j2)
                if is_target(r2):
                    hops = []
                    node = r2
                    while parent[node] is not None:
                        prev, hk, hj, hj2 = parent[node]
                        hops.append((hk, hj, hj2))
                        node = prev
                    return r2, hops
                queue.append(r2)
    return None, queue


def _oracle_overflow_home(x, load, limit, ranks_of, incidence) -> None:
    """Move replica pairs above capacity to their homes (no augmenting path is left,
    so every home reached is full and the overflow stays the same)."""
    work = [r for r in range(len(load)) if load[r] > limit[r]]
    while work:
        u = work.pop()
        for k, j in incidence[u]:
            if load[u] <= limit[u]:
                break
            if j == 0 or not x[k][j]:
                continue
            delta = min(x[k][j], load[u] - limit[u])
            home = ranks_of[k][0]
            x[k][j] -= delta
            x[k][0] += delta
            load[u] -= delta
            load[home] += delta
            work.append(home)


def _oracle_least_level(total: int, limits: list) -> int | None:
    """Least integer M with sum_r min(M, limit_r) >= total; None if no M is enough."""
    if not limits:
        return 0
    ordered = sorted(limits)
    used = 0
    for i, lim in enumerate(ordered):
        level = -(-(total - used) // (len(ordered) - i))
        if level <= lim:
            return max(level, 0)
        used += lim
    return None


def _oracle_shift(x: list[list[int]], hops, delta: int) -> None:
    for k, j_from, j_to in hops:
        x[k][j_from] -= delta
        x[k][j_to] += delta


def _oracle_split_sources(n_rep: np.ndarray, x: np.ndarray, rank_table: np.ndarray) -> np.ndarray:
    """[K, R, J] pairs from source s to instance j of replicated expert k.

    n_rep: [K, R] n[s, e] of the replicated experts; x: [K, J] instance totals (sum_j =
    sum_s); rank_table: [K, J] instance ranks, -1 padding. A source on an instance's
    rank sends min(n, x) there first; the rest is a north-west-corner fill.
    """
    num_k, num_ranks = n_rep.shape
    valid = rank_table >= 0
    rank_index = np.where(valid, rank_table, 0)
    own = np.take_along_axis(n_rep, rank_index, axis=1)              # [K, J] n[r_j, e]
    local = np.where(valid, np.minimum(own, x), 0)                    # [K, J]
    source_left = n_rep.copy()
    kk, jj = np.nonzero(valid)
    source_left[kk, rank_index[kk, jj]] -= local[kk, jj]
    instance_left = x - local
    s_hi = np.cumsum(source_left, axis=1)                             # [K, R]
    s_lo = s_hi - source_left
    i_hi = np.cumsum(instance_left, axis=1)                           # [K, J]
    i_lo = i_hi - instance_left
    split = np.minimum(s_hi[:, :, None], i_hi[:, None, :]) - np.maximum(
        s_lo[:, :, None], i_lo[:, None, :])
    split = np.maximum(split, 0)                                      # [K, R, J]
    split[kk, rank_index[kk, jj], jj] += local[kk, jj]
    return split



def _oracle_greedy_replicas(routed: list[int], base: MicroBatchPlan,
                     settings: PlannerSettings) -> list[tuple[int, int]]:
    """Replicas in the order a greedy search adds them, on a fluid load estimate.

    State: each expert's pairs spread over its instances' ranks (starting from
    Megatron's layout). A move takes the most loaded rank u, an expert with pairs on u
    (largest share first, up to four tried), and adds a replica of it on the least
    loaded rank not hosting it; the expert's pairs are then water-filled over its
    ranks with the other loads fixed. A move is allowed if u's load drops, no rank
    rises above the old maximum, and no rank whose load rises ends over the layer share
    unless it already was. The estimated time (``CostModel.load_time`` at the maximum
    load, retained load capped at the base plan's backward capacity, all-to-all pairs
    estimated as (R - 1) / R of the load; plus the amortised replica refresh) decides
    which prefix of moves to keep: the one with the lowest time. Ties between ranks at
    the maximum are why single moves are not judged alone: the maximum only falls once
    every rank at it has been relieved.
    """
    cost, share = settings.cost, settings.layer_share
    shape = cost.shape
    num_ranks, num_experts = settings.num_ranks, settings.num_experts
    per_rank = num_experts // num_ranks
    cap_count = int(base.retention.capacity[0])
    retained_cap = math.inf if cap_count == UNLIMITED_CAPACITY else float(cap_count)
    off_rank = (num_ranks - 1) / num_ranks
    mif, layers = shape.microbatches_in_flight, shape.num_layers
    fixed = cost.rank_memory(torch.zeros(1), torch.zeros(1), torch.zeros(1))[0].item()
    saved, fwd_t = shape.saved_bytes_per_routed_pair, shape.forward_transient_bytes_per_routed_pair
    bwd_t, inst = shape.backward_transient_bytes_per_retained_pair, shape.instance_bytes

    def capacity(replicas: int) -> float:
        """Largest load whose memory (backward at the base plan's capacity) fits."""
        if share is None:
            return math.inf
        room = max(0.0, share - fixed - replicas * inst)
        load = room / (mif * saved + max(fwd_t, bwd_t) / layers)       # retained = load
        if load <= retained_cap:
            return load
        load = (room - bwd_t * retained_cap / layers) / (mif * saved)  # retained = C
        if fwd_t * load <= bwd_t * retained_cap:
            return load
        return room / (mif * saved + fwd_t / layers)                   # forward dominates

    def memory(load: float, replicas: int) -> float:
        transient = max(fwd_t * load, bwd_t * min(load, retained_cap))
        return fixed + replicas * inst + mif * saved * load + transient / layers

    weight = shape.weight_elements * (shape.dtype_bytes + (shape.grad_dtype_bytes
                                                            or shape.dtype_bytes))

    def est_time(top: float, busiest_sync: int) -> float:
        ret = min(top, retained_cap)
        sync = (busiest_sync * weight / cost.machine.alltoall_bytes_per_s
                + (2 * cost.machine.alltoall_latency_s if busiest_sync else 0.0))
        return (cost.load_time(top, ret, top * off_rank, ret * off_rank)
                + sync / shape.microbatches_per_step)

    load = [0.0] * num_ranks
    spread: list[dict[int, float]] = []        # expert -> {hosting rank: its pairs}
    on_rank: list[list[int]] = [[] for _ in range(num_ranks)]
    for e, n in enumerate(routed):
        spread.append({e // per_rank: float(n)})
        load[e // per_rank] += n
        on_rank[e // per_rank].append(e)
    reps_on = [0] * num_ranks
    sync_sent, sync_recv = [0] * num_ranks, [0] * num_ranks
    busiest = 0
    added: list[tuple[int, int]] = []
    best_time, best_len = est_time(max(load), 0), 0
    max_moves = num_ranks * (num_experts - per_rank)
    while len(added) < max_moves and len(added) - best_len <= num_ranks:
        top = max(load)
        u = load.index(top)
        move = None
        candidates = sorted(on_rank[u], key=lambda e: (-spread[e][u], e))[:4]
        for e in candidates:
            hosts = spread[e]
            if len(hosts) >= num_ranks:
                continue
            v = min((r for r in range(num_ranks) if r not in hosts), key=lambda r: (load[r], r))
            ranks = [*hosts, v]
            others = [load[r] - hosts.get(r, 0.0) for r in ranks]
            limits = [capacity(reps_on[r] + (r == v)) for r in ranks]
            new = dict(zip(ranks, _oracle_fluid_fill(float(routed[e]), others, limits),
                           strict=True))
            if new[u] >= hosts[u] - 1e-9:
                continue
            ok = True
            for r, o in zip(ranks, others, strict=True):
                after = o + new[r]
                if r == u or after <= load[r]:
                    continue
                if after > top or (share is not None and memory(after, reps_on[r] + (r == v))
                                   > max(share, memory(load[r], reps_on[r]))):
                    ok = False
                    break
            if ok:
                move = (e, v, ranks, others, new)
                break
        if move is None:
            break
        e, v, ranks, others, new = move
        for r, o in zip(ranks, others, strict=True):
            load[r] = o + new[r]
        spread[e] = new
        on_rank[v].append(e)
        reps_on[v] += 1
        sync_sent[e // per_rank] += 1
        sync_recv[v] += 1
        busiest = max(busiest, sync_sent[e // per_rank], sync_recv[v])
        added.append((e, v))
        t = est_time(max(load), busiest)
        if t < best_time * (1 - 1e-12):
            best_time, best_len = t, len(added)
    return added[:best_len]


def _oracle_fluid_fill(amount: float, others: list[float], limits: list[float]) -> list[float]:
    """Continuous water-filling of ``amount`` over ranks with loads ``others``, each up
    to its limit; what fits nowhere stays on the first rank (the home)."""
    give = [0.0] * len(others)
    active = [j for j in range(len(others)) if limits[j] > others[j]]
    left = amount
    while active and left > 0:
        order = sorted(active, key=lambda j: others[j])
        prefix, level = 0.0, 0.0
        for m, j in enumerate(order):
            prefix += others[j]
            level = (left + prefix) / (m + 1)
            if m + 1 == len(order) or level <= others[order[m + 1]]:
                break
        capped = [j for j in order if others[j] < level and limits[j] <= level]
        if not capped:
            for j in order:
                give[j] = max(level - others[j], 0.0)
            return give
        for j in capped:
            give[j] = limits[j] - others[j]
            left -= give[j]
            active.remove(j)
    give[0] += max(left, 0.0)
    return give



def _oracle_plan(planner: LayerPlanner, counts: torch.Tensor,
                 placement: Placement) -> tuple[MicroBatchPlan, tuple[float, float] | None]:
    """LayerPlanner._plan and ._score of commit 4e3fe41 (torch), for one placement."""
    s = planner.settings
    replicas = torch.tensor(placement.replicas_per_rank(), dtype=torch.int64)
    share = s.layer_share
    capacity = None if share is None else s.cost.routing_capacity(share, replicas)
    routing = _oracle_route_pairs(counts, placement, capacity)
    notes = []
    if routing.overflow:
        notes.append(f"overflow: {routing.overflow} pairs above the ranks' buffer "
                     f"capacity went to home instances")
    gamma = float(s.capacity_factor)
    if share is not None and math.isfinite(gamma):
        routed = torch.zeros(s.num_ranks, dtype=torch.int64).index_add_(
            0, torch.tensor(placement.instance_rank), routing.counts.sum(0))
        limit = s.cost.retained_limit(share, replicas, routed)
        short = (routed > limit) & (limit > 0)
        total = int(routed.sum())
        if bool(short.any()) and total:
            needed = max(int(limit[short].min()), 1)
            if needed < capacity_for_factor(gamma, total, s.num_ranks):
                gamma = factor_for_capacity(needed, total, s.num_ranks)
                notes.append(f"budget: backward capacity factor lowered from "
                             f"{s.capacity_factor:g} to {gamma:.4g} (C={needed})")
    retention = plan_retention(routing.counts, s.num_ranks, gamma, s.min_retention,
                               instance_rank=placement.instance_rank,
                               instance_expert=placement.instance_expert)
    score = None
    if share is not None:
        memory = s.cost.plan_memory(retention, replicas)
        over = memory > share
        if bool(over.any()):
            notes.append(f"over budget on {int(over.sum())} rank(s) by up to "
                         f"{float((memory - share).max()) / 2**20:.1f} MiB "
                         f"(the forward is never dropped)")
        excess = max(0.0, float((memory - share).max()))
        fwd, bwd = s.cost.layer_time(retention)
        sync = s.cost.replica_sync_time(placement.replicas, s.num_ranks,
                                        placement.experts_per_rank)
        score = (excess, fwd + bwd + sync / s.cost.shape.microbatches_per_step)
    plan = MicroBatchPlan(routing=routing, retention=retention, capacity_factor_used=gamma,
                          notes=tuple(notes))
    return plan, score


# ---------------------------------------------------------------------------
# The optimised planner against the frozen oracle: exactly the same results
# ---------------------------------------------------------------------------


def _random_placement(gen: torch.Generator, num_ranks: int, num_experts: int,
                      replicas: int) -> Placement:
    per_rank = num_experts // num_ranks
    candidates = [(e, r) for e in range(num_experts) for r in range(num_ranks)
                  if r != e // per_rank]
    # Hot experts replicated more (a few with many instances: long augmenting paths).
    weight = torch.tensor([1.0 + 8.0 * (e % 5 == 0) for e, _ in candidates])
    chosen = torch.multinomial(weight, min(replicas, len(candidates)), replacement=False,
                               generator=gen) if candidates and replicas else []
    return Placement(num_ranks, num_experts, tuple(candidates[int(i)] for i in chosen))


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_route_pairs_matches_frozen_oracle(data):
    num_ranks = data.draw(st.integers(1, 12))
    num_experts = num_ranks * data.draw(st.integers(1, 3))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    placement = _random_placement(gen, num_ranks, num_experts,
                                  data.draw(st.integers(0, 3 * num_experts)))
    skew = torch.rand(num_experts, generator=gen) ** data.draw(st.sampled_from([1, 3, 6]))
    scale = data.draw(st.sampled_from([1, 5, 40, 400]))
    counts = torch.poisson((skew * scale).expand(num_ranks, -1), generator=gen).to(torch.int64)
    mean = max(1, int(counts.sum()) // num_ranks)
    capacity = data.draw(st.one_of(
        st.none(),
        st.lists(st.integers(0, 3 * mean), min_size=num_ranks, max_size=num_ranks),
        st.integers(mean, 2 * mean).map(lambda c: [c] * num_ranks)))
    routing = route_pairs(counts, placement, capacity)
    oracle = _oracle_route_pairs(counts, placement, capacity)
    assert torch.equal(routing.counts, oracle.counts)
    assert routing.overflow == oracle.overflow


@pytest.mark.parametrize("seed", range(4))
def test_route_pairs_matches_frozen_oracle_at_scale(seed):
    # The benchmark's size: 64 ranks, 128 experts, skewed counts; popularity-style
    # placements (up to 192 replicas) and random ones, with and without capacities.
    gen = torch.Generator().manual_seed(seed)
    counts = _skewed_counts(64, 128, 2048, seed, zipf=1.0)
    popularity = _popularity_placement(counts.sum(0).double().numpy(), 64, 128,
                                       2 + 1 + seed)[0]
    for placement in (popularity, _random_placement(gen, 64, 128, 40 + 30 * seed)):
        mean = int(counts.sum()) // 64
        for capacity in (None, [mean + mean // 50] * 64, [mean + mean // 4] * 64):
            routing = route_pairs(counts, placement, capacity)
            oracle = _oracle_route_pairs(counts, placement, capacity)
            assert torch.equal(routing.counts, oracle.counts)
            assert routing.overflow == oracle.overflow


@pytest.mark.parametrize("policy, gamma", [("static", 1.0), ("static", 0.75),
                                           ("popularity", math.inf),
                                           ("memory-aware", 1.0), ("memory-aware", math.inf)])
@pytest.mark.parametrize("seed", range(3))
def test_planner_matches_frozen_oracle(policy, gamma, seed):
    # plan (numpy) and the memory-aware score and greedy against their torch originals.
    num_ranks, num_experts = 8, 16
    cost = _cost(num_experts, tokens=256, topk=2)
    budget = cost.balanced_dropless_need() * (1.0 + 0.5 * seed)
    planner = LayerPlanner(PlannerSettings(policy, num_ranks, num_experts,
                                               capacity_factor=gamma, budget_bytes=budget,
                                               cost=cost))
    batches = [_skewed_counts(num_ranks, num_experts, 512, 10 * seed + i, zipf=1.4)
               for i in range(4)]
    gen = torch.Generator().manual_seed(seed)
    for step, counts in enumerate(batches):
        planner.observe(counts)
        planner.next_step()
        for placement in (planner.placement, _random_placement(gen, num_ranks, num_experts,
                                                               4 * step)):
            got, memory = planner._plan(counts, planner._context(placement))
            want, score = _oracle_plan(planner, counts, placement)
            assert torch.equal(got.routing.counts, want.routing.counts)
            assert got.routing.overflow == want.routing.overflow
            assert torch.equal(got.retention.quotas, want.retention.quotas)
            assert got.capacity_factor_used == want.capacity_factor_used
            assert got.notes == want.notes
            assert planner._score(got, memory, placement) == score
        if policy == "memory-aware":
            smoothed = torch.round(planner.smoothed_counts).to(torch.int64)
            base = planner._plan(smoothed, planner._context(Placement.static(
                num_ranks, num_experts)))[0]
            routed = smoothed.sum(0).tolist()
            assert (_greedy_replicas(routed, base, planner.settings)
                    == _oracle_greedy_replicas(routed, base, planner.settings))


def test_cost_model_numpy_twins_are_identical():
    cost = _cost(16, tokens=256)
    gen = torch.Generator().manual_seed(0)
    share = cost.memory_share(cost.balanced_dropless_need() * 1.3)
    for _ in range(20):
        replicas = torch.randint(0, 4, (8,), generator=gen)
        routed = torch.randint(0, 4000, (8,), generator=gen)
        retained = torch.minimum(routed, torch.randint(0, 4000, (8,), generator=gen))
        assert np.array_equal(cost.rank_memory_np(replicas.numpy(), routed.numpy(),
                                                  retained.numpy()),
                              cost.rank_memory(replicas, routed, retained).numpy())
        assert np.array_equal(cost.retained_limit_np(share, replicas.numpy(), routed.numpy()),
                              cost.retained_limit(share, replicas, routed).numpy())
        assert np.array_equal(cost.routing_capacity_np(share, replicas.numpy()),
                              cost.routing_capacity(share, replicas).numpy())
        counts = torch.randint(0, 50, (8, 16), generator=gen)
        plan = plan_retention(counts, 8, 0.9)
        assert cost.layer_time_np(plan.routed_matrix.numpy(),
                                  plan.retained_matrix.numpy()) == cost.layer_time(plan)
