"""Tests of placement, capacity-aware routing and the per-layer planner
(docs/design.md, "InstanceAssignment", "Placement", "Memory budget").

Pure CPU, no process group. Notation as in ``megatron_lrmoe/planning/placement.py``.

References, all independent of the implementation:
  * routing optimality: brute force (every integer split of every replicated expert's
    pairs over its instances) on small cases, and a maximum flow (networkx) on larger
    ones: least overflow = pairs - max flow under the capacities; the max load M is
    least when no flow places every pair with the ranks capped at M - 1;
  * routing fill order: the documented rule transcribed unit by unit, and a brute-force
    enumeration of every assignment with the same instance totals for locality;
  * placement heuristics (popularity, memory-aware): properties only (slots, budget,
    never worse than static in the cost model's estimate, determinism).
"""

from __future__ import annotations

import itertools
import math
import pickle
from pathlib import Path

import networkx as nx
import numpy as np
import pytest
import torch
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from megatron_lrmoe.planning.cost_model import CostModel
from megatron_lrmoe.planning.instance_assignment import assign_instances
from megatron_lrmoe.planning.machine import MachineConstants
from megatron_lrmoe.planning.placement import Placement
from megatron_lrmoe.planning.placement_policies import greedy_replicas, popularity_placement
from megatron_lrmoe.planning.plan_types import budget_floor
from megatron_lrmoe.planning.planner import LayerPlanner, MicroBatchPlan, PlannerSettings
from megatron_lrmoe.planning.retention import plan_retention
from megatron_lrmoe.planning.shapes import InstanceRows, MoEShape
from megatron_lrmoe.tools.simulate import load_traces, source_batches

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
# Instance assignment against brute force
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


def _draw_case(draw, num_ranks: int, experts_per_rank_max: int, min_replicas: int,
               max_count: int):
    """(placement, counts [R][E], capacity or None) with up to 3 replicas."""
    num_experts = num_ranks * draw(st.integers(1, experts_per_rank_max))
    per_rank = num_experts // num_ranks
    candidates = [(e, r) for e in range(num_experts) for r in range(num_ranks)
                  if r != e // per_rank]
    replicas = draw(st.lists(st.sampled_from(candidates), min_size=min_replicas, max_size=3,
                             unique=True) if candidates else st.just([]))
    counts = draw(st.lists(st.lists(st.integers(0, max_count), min_size=num_experts,
                                    max_size=num_experts),
                           min_size=num_ranks, max_size=num_ranks))
    capacity = draw(st.one_of(st.none(), st.lists(st.integers(0, 12), min_size=num_ranks,
                                                  max_size=num_ranks)))
    return Placement(num_ranks, num_experts, tuple(replicas)), counts, capacity


@st.composite
def small_cases(draw):
    num_ranks = draw(st.integers(1, 3))
    return _draw_case(draw, num_ranks, 4 // num_ranks, 0, 4)


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
    routing = assign_instances(n, placement, capacity)
    _assert_exact(routing, n, placement)
    load = _loads(routing, placement)
    best_overflow, best_max = brute_force(counts, placement, capacity)
    overflow = 0 if capacity is None else sum(
        max(0, ld - c) for ld, c in zip(load, capacity, strict=True))
    assert routing.overflow == overflow == best_overflow
    if best_overflow == 0:
        assert max(load) == best_max


def _most_placed(counts: torch.Tensor, placement: Placement, rank_cap: list[int]) -> int:
    """Most pairs any assignment puts within ``rank_cap``: a maximum flow source -> expert
    e (N_e) -> each rank hosting an instance of e (unbounded) -> sink (rank_cap[r])."""
    graph = nx.DiGraph()
    graph.add_node("source")
    graph.add_node("sink")
    for e, total in enumerate(counts.sum(0).tolist()):
        if total:
            graph.add_edge("source", ("expert", e), capacity=total)
            for i in placement.instances_of(e):
                graph.add_edge(("expert", e), ("rank", placement.instance_rank[i]))
    for r, cap in enumerate(rank_cap):
        graph.add_edge(("rank", r), "sink", capacity=cap)
    return nx.maximum_flow_value(graph, "source", "sink")


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


def _assert_optimal(counts: torch.Tensor, placement: Placement, capacity) -> None:
    """assign_instances against the maximum flow: exact, least overflow, then least max load;
    deterministic and the input untouched."""
    before = counts.clone()
    routing = assign_instances(counts, placement, capacity)
    assert torch.equal(counts, before)
    _assert_exact(routing, counts, placement)
    again = assign_instances(counts.clone(), placement, capacity)     # as on another rank
    assert torch.equal(again.counts, routing.counts) and again.overflow == routing.overflow
    load = _loads(routing, placement)
    total = int(counts.sum())
    caps = [total] * placement.num_ranks if capacity is None else list(capacity)
    overflow = sum(max(0, ld - c) for ld, c in zip(load, caps, strict=True))
    assert routing.overflow == overflow == total - _most_placed(counts, placement, caps)
    if overflow == 0 and max(load) > 0:
        lower = [min(c, max(load) - 1) for c in caps]
        assert _most_placed(counts, placement, lower) < total, "a smaller max load exists"


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_route_pairs_is_optimal_against_max_flow(data):
    num_ranks = data.draw(st.integers(2, 12))
    num_experts = num_ranks * data.draw(st.integers(1, 4))
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
    _assert_optimal(counts, placement, capacity)


@pytest.mark.parametrize("seed", range(2))
def test_route_pairs_is_optimal_at_scale(seed):
    # The benchmark's size: 64 ranks, 128 experts, skewed counts; a popularity placement
    # and a random one, with and without capacities.
    gen = torch.Generator().manual_seed(seed)
    counts = _skewed_counts(64, 128, 2048, seed, zipf=1.0)
    popularity = popularity_placement(counts.sum(0).double().numpy(), 64, 128, 3 + seed)[0]
    mean = int(counts.sum()) // 64
    for placement in (popularity, _random_placement(gen, 64, 128, 40 + 60 * seed)):
        for capacity in (None, [mean + mean // 50] * 64, [mean + mean // 4] * 64):
            _assert_optimal(counts, placement, capacity)


def _documented_fill(counts: list[list[int]], placement: Placement,
                     totals: list[int]) -> list[list[int]]:
    """[R, I] from the instance totals by the documented rule, one pair at a time: a
    source on an instance's rank first sends min(n[s, e], x_i) there; then each source
    in rank order gives its remaining pairs to the first instance of the expert (home
    first, then replicas by rank) whose total is not yet reached."""
    out = [[0] * placement.num_instances for _ in range(placement.num_ranks)]
    for e in range(placement.num_experts):
        instances = placement.instances_of(e)
        source_left = [row[e] for row in counts]
        instance_left = {i: totals[i] for i in instances}
        for i in instances:
            s = placement.instance_rank[i]
            local = min(counts[s][e], totals[i])
            out[s][i] += local
            source_left[s] -= local
            instance_left[i] -= local
        for s in range(placement.num_ranks):
            for _ in range(source_left[s]):
                i = next(i for i in instances if instance_left[i] > 0)
                out[s][i] += 1
                instance_left[i] -= 1
    return out


def _assignments(row_sums: list[int], column_sums: list[int]):
    """Every non-negative integer matrix with these row and column sums (brute force:
    each row any split of its sum within what the columns have left)."""
    if not row_sums:
        if not any(column_sums):
            yield ()
        return
    for split in _splits(row_sums[0], len(column_sums)):
        left = [c - x for c, x in zip(column_sums, split, strict=True)]
        if min(left) >= 0:
            for rest in _assignments(row_sums[1:], left):
                yield (split, *rest)


@st.composite
def fill_cases(draw):
    """2-4 ranks, at least one replica. The order of the instances only matters with two
    sources left for two instances with room after the local pairs: 4 ranks at least."""
    num_ranks = draw(st.integers(2, 4))
    return _draw_case(draw, num_ranks, 2 if num_ranks < 4 else 1, 1, 3)


@settings(max_examples=80, deadline=None)
@given(fill_cases())
def test_route_pairs_fill_order_against_brute_force(case):
    # With the instance totals of the routing fixed, many assignments are equally good
    # for overflow and max load: the documented one maximises the pairs that stay on
    # their source's rank, then fills north-west-corner.
    placement, counts, capacity = case
    routing = assign_instances(torch.tensor(counts, dtype=torch.int64), placement, capacity)
    got = routing.counts.tolist()
    totals = routing.counts.sum(0).tolist()
    assert got == _documented_fill(counts, placement, totals)
    several = False
    for e in range(placement.num_experts):
        instances = placement.instances_of(e)
        ranks = [placement.instance_rank[i] for i in instances]
        options = list(_assignments([row[e] for row in counts], [totals[i] for i in instances]))
        several |= len(options) > 1
        most_local = max(sum(m[r][j] for j, r in enumerate(ranks)) for m in options)
        assert sum(got[r][i] for i, r in zip(instances, ranks, strict=True)) == most_local
    assume(several)


def test_locality_when_it_costs_nothing():
    # Expert 0 (home rank 0) replicated on rank 1; the balanced split is 4 + 4 and
    # source 1 has 4 pairs of it: they stay on rank 1 (no network).
    placement = Placement(2, 2, ((0, 1),))
    counts = torch.tensor([[4, 0], [4, 0]])
    routing = assign_instances(counts, placement)
    # instances: 0 = expert 0 home (rank 0), 1 = expert 1 (rank 1), 2 = expert 0 on rank 1
    assert routing.counts.tolist() == [[4, 0, 0], [0, 0, 4]]
    assert routing.overflow == 0


def test_fill_order_is_home_first_then_replicas_by_rank():
    # Expert 3 (home rank 3, instance 4) has a replica on rank 0 (instance 1): the fill
    # order is the expert's instance order, home first, not the instance ids. Sources
    # 1 and 2 host neither; the totals split 2 + 2; source 1 fills the home first.
    placement = Placement(4, 4, ((3, 0),))
    assert placement.instances_of(3) == (4, 1)
    counts = [[0, 0, 0, 0], [0, 0, 0, 2], [0, 0, 0, 2], [0, 0, 0, 0]]
    routing = assign_instances(torch.tensor(counts), placement)
    assert routing.counts.tolist() == [[0] * 5, [0, 0, 0, 0, 2], [0, 2, 0, 0, 0], [0] * 5]


def test_capacity_overflow_goes_home():
    # Expert 0 replicated on rank 1, but rank 1 has no room: all pairs stay at home,
    # and what exceeds rank 0's capacity is the overflow.
    placement = Placement(2, 2, ((0, 1),))
    counts = torch.tensor([[3, 0], [3, 2]])
    routing = assign_instances(counts, placement, receive_limit=[4, 2])
    assert routing.counts[:, 2].sum() == 0
    assert routing.overflow == 2
    assert _loads(routing, placement) == [6, 2]


def test_static_routing_is_identity():
    counts = torch.randint(0, 9, (4, 8), generator=torch.Generator().manual_seed(1))
    routing = assign_instances(counts, Placement.static(4, 8))
    assert torch.equal(routing.counts, counts) and routing.overflow == 0


def test_route_pairs_refuses_bad_input():
    placement = Placement.static(2, 4)
    with pytest.raises(ValueError, match="shape"):
        assign_instances(torch.zeros(2, 3, dtype=torch.int64), placement)
    with pytest.raises(ValueError, match="non-negative"):
        assign_instances(-torch.ones(2, 4, dtype=torch.int64), placement)
    with pytest.raises(ValueError, match="receive_limit"):
        assign_instances(torch.zeros(2, 4, dtype=torch.int64), placement, receive_limit=[1])


# ---------------------------------------------------------------------------
# Planner fixtures
# ---------------------------------------------------------------------------

MACHINE = MachineConstants(gemm_flops_per_s=1e9, alltoall_bytes_per_s=1e9,
                           alltoall_latency_s=1e-6, source="test constants")


def _cost(num_experts: int, tokens: int = 64, topk: int = 2, layers: int = 2,
          per_step: int = 4, forward_retention: bool = False) -> CostModel:
    shape = MoEShape(hidden_size=64, ffn_hidden_size=32, num_experts=num_experts, topk=topk,
                     gated=True, dtype_bytes=2, tokens_per_rank=tokens, num_layers=layers,
                     microbatches_in_flight=1, microbatches_per_step=per_step,
                     forward_retention=forward_retention)
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
    routing = assign_instances(counts, placement)
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
    spread = assign_instances(counts, placement).load_per_rank(placement)
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


@settings(max_examples=50, deadline=None)
@given(st.data())
def test_popularity_placement_properties(data):
    num_ranks = data.draw(st.integers(1, 8))
    per_rank = data.draw(st.integers(1, 3))
    num_experts = num_ranks * per_rank
    slots = data.draw(st.integers(per_rank, num_experts))
    popularity = data.draw(st.lists(st.one_of(st.just(0.0), st.floats(0.0, 1e4)),
                                    min_size=num_experts, max_size=num_experts))
    placement, notes = popularity_placement(np.array(popularity), num_ranks, num_experts,
                                             slots)
    again = popularity_placement(np.array(popularity), num_ranks, num_experts, slots)
    assert again == (placement, notes)                                  # deterministic
    assert (placement.num_ranks, placement.num_experts) == (num_ranks, num_experts)
    assert all(len(placement.rank_instances(r)) <= slots for r in range(num_ranks))
    assert all(len(placement.instances_of(e)) <= num_ranks for e in range(num_experts))
    # Replicas only of experts with load (the homes are Placement's own invariant).
    assert all(popularity[e] > 0 for e, _ in placement.replicas)
    if slots == per_rank or num_ranks == 1 or sum(popularity) == 0:
        assert placement == Placement.static(num_ranks, num_experts)


def test_static_policy_never_replicates():
    counts = _skewed_counts(4, 8, 200, seed=0)
    planner = _planner("static", counts)
    assert planner.placement == Placement.static(4, 8)


# ---------------------------------------------------------------------------
# Memory-aware (LRMoE)
# ---------------------------------------------------------------------------


def _excess(planner: LayerPlanner, plan) -> float:
    s = planner.settings
    memory = s.cost.plan_memory(plan.retention, np.array(planner.placement.replicas_per_rank()))
    return max(0.0, float((memory - s.layer_share).max()))


def _estimated_time(cost: CostModel, plan, placement: Placement) -> float:
    """The cost model's estimate as the simulator judges a call: forward + backward, GEMMs
    instance by instance, + amortised replica refresh."""
    retention = plan.retention
    fwd, bwd = cost.layer_time(retention.routed_matrix.numpy(),
                               retention.retained_matrix.numpy(), 0.0,
                               InstanceRows.of_plan(retention))
    sync = cost.replica_sync_time(placement.replicas, placement.num_ranks,
                                  placement.experts_per_rank)
    return fwd + bwd + sync / cost.shape.microbatches_per_step


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), slack=st.floats(1.0, 4.0), zipf=st.floats(0.0, 2.0),
       gamma=st.sampled_from([0.75, 1.0, math.inf]), ranks=st.sampled_from([2, 4, 8]),
       min_retention=st.sampled_from([0.0, 0.25]))
@example(seed=0, slack=1.1875, zipf=1.0, gamma=1.0, ranks=4, min_retention=0.0)
def test_memory_aware_fits_budget_and_beats_static(seed, slack, zipf, gamma, ranks,
                                                   min_retention):
    experts = 2 * ranks
    counts = _skewed_counts(ranks, experts, 128, seed, zipf)
    cost = _cost(experts)
    budget = cost.balanced_dropless_need() * slack
    common = dict(budget_bytes=budget, cost=cost, capacity_factor=gamma,
                  min_retention=min_retention)
    aware = _planner("memory-aware", counts, **common)
    static = _planner("static", counts, **common)
    plan, base = aware.plan(counts), static.plan(counts)
    _assert_exact(plan.assignment, counts, aware.placement)
    # Replicas never push a rank over its share: memory-aware fits whenever static
    # does, and never exceeds the share by more than static does.
    assert _excess(aware, plan) <= _excess(static, base)
    if _excess(static, base) == 0:
        assert _excess(aware, plan) == 0
    # The cost model's estimate (replica refresh included) never worse than static's at
    # the same retention. Where the budget lowered static's gamma (it bought its time
    # with drops the replicas spared), the comparison is static at aware's gamma without
    # the budget, which is what the placement search weighs (found by this test: seed 0,
    # slack 1.1875, zipf 1, gamma 1, 4 ranks; static at 0.52 is 1.5% faster than aware
    # keeping every pair).
    reference = base
    if plan.capacity_factor_used > base.capacity_factor_used:
        reference = _planner("static", counts, cost=cost,
                             capacity_factor=plan.capacity_factor_used,
                             min_retention=min_retention).plan(counts)
    assert (_estimated_time(cost, plan, aware.placement)
            <= _estimated_time(cost, reference, static.placement))
    # Replicas never buy time with more drops.
    assert plan.capacity_factor_used >= base.capacity_factor_used
    # Deterministic: another planner (another rank) fed the same chooses the same.
    assert _planner("memory-aware", counts, **common).placement == aware.placement
    capacity = int(base.retention.capacity[0])
    assert (greedy_replicas(counts.sum(0).tolist(), capacity, aware.settings)
            == greedy_replicas(counts.sum(0).tolist(), capacity, aware.settings))


def _budgets_estimates(counts: torch.Tensor, gamma: float, slacks,
                       forward_retention: bool = False) -> list[tuple[float, float]]:
    """(gamma used, estimated time of the plan the layer runs) per budget, in order."""
    cost = _cost(counts.shape[1], forward_retention=forward_retention)
    out = []
    for slack in slacks:
        planner = _planner("memory-aware", counts, capacity_factor=gamma, cost=cost,
                           budget_bytes=cost.balanced_dropless_need() * slack)
        plan = planner.plan(counts)
        out.append((plan.capacity_factor_used,
                    _estimated_time(cost, plan, planner.placement)))
    return out


@pytest.mark.parametrize("seed, zipf, ranks, slacks", [
    (0, 0.5, 8, (1.2, 1.35)),     # the greedy used to take other moves at 1.35x: +2.4%
    (9, 0.5, 4, (1.1, 1.2)),      # the largest rise the search found (+16.4%)
])
def test_memory_aware_monotone_in_the_budget_regressions(seed, zipf, ranks, slacks):
    (_, smaller), (_, larger) = _budgets_estimates(
        _skewed_counts(ranks, 2 * ranks, 128, seed, zipf), math.inf, slacks)
    assert larger <= smaller


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), zipf=st.floats(0.0, 2.0), ranks=st.sampled_from([2, 4, 8]),
       gamma=st.sampled_from([0.75, 1.0, math.inf]),
       slacks=st.lists(st.floats(1.0, 4.0), min_size=2, max_size=4, unique=True),
       forward_retention=st.booleans())
def test_memory_aware_is_monotone_in_the_budget(seed, zipf, ranks, gamma, slacks,
                                                forward_retention):
    # More memory never makes the placement's plan worse by the cost model: at gamma =
    # inf its estimated time never rises. At a finite gamma the budget may lower gamma
    # (cheaper, less exact), so only plans at an equal gamma are compared. Whether gamma
    # itself rises with the budget is the budget rule's property, not the placement's
    # (it is not monotone: docs/design.md, "Memory budget"); the placement never uses a
    # lower gamma than static at the same budget (test above).
    counts = _skewed_counts(ranks, 2 * ranks, 128, seed, zipf)
    runs = _budgets_estimates(counts, gamma, sorted(slacks), forward_retention)
    for (gamma_a, time_a), (gamma_b, time_b) in itertools.pairwise(runs):
        if gamma_b == gamma_a:
            # Every candidate but the popularity placements is budget-free, and a larger
            # budget admits all a smaller one did; the popularity slots are bisected on the
            # budget, so a larger budget may settle on other slot counts, a replica or two
            # per rank apart (a scan of 150 random cases: at most +0.70%). The plan then
            # routes under the budget's capacities, and routings with equal per-rank loads
            # but other cross-rank traffic differ in the estimate by ~1e-4.
            assert time_b <= time_a * (1 + 0.02)


def test_memory_aware_keeps_the_best_qualifying_prefix():
    # The greedy proposes replicas at 1.5x the balanced need (seed 56, zipf 0.5, 4 ranks,
    # gamma = inf); a shorter prefix is estimated faster than all of them, so the planner
    # keeps it: brute force over the tried prefixes, each routed without capacities and
    # planned by the public functions.
    counts = _skewed_counts(4, 8, 128, 56, 0.5)
    cost = _cost(8)
    planner = _planner("memory-aware", counts, capacity_factor=math.inf, cost=cost,
                       budget_bytes=cost.balanced_dropless_need() * 1.5)
    unbudgeted = LayerPlanner(PlannerSettings("static", 4, 8, capacity_factor=math.inf,
                                              cost=cost))
    proposal = greedy_replicas(counts.sum(0).tolist(),
                               int(unbudgeted.plan(counts).retention.capacity[0]),
                               planner.settings)
    n = len(proposal)
    sizes = sorted({n, 3 * n // 4, n // 2, n // 4} - {0})
    prefixes = {k: Placement(4, 8, tuple(proposal[:k])) for k in sizes}

    def estimate(placement: Placement) -> tuple[float, float]:
        routing = assign_instances(counts, placement)
        retention = plan_retention(routing.counts, 4, math.inf,
                                   instance_rank=placement.instance_rank,
                                   instance_expert=placement.instance_expert)
        plan = MicroBatchPlan(routing, retention, math.inf)
        peak = float(cost.plan_memory(retention, np.array(placement.replicas_per_rank())).max())
        return _estimated_time(cost, plan, placement), peak

    static_time, static_peak = estimate(Placement.static(4, 8))
    allowed = max(planner.settings.layer_share, static_peak)
    times = {k: t for k, (t, peak) in ((k, estimate(p)) for k, p in prefixes.items())
             if t <= static_time and peak <= allowed}
    best = min(times, key=lambda k: (times[k], k))
    assert best < n                       # the case a first-qualifying rule gets wrong
    assert planner.placement == prefixes[best]


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
    hosting = np.array(tight.placement.replicas_per_rank())
    memory = cost.plan_memory(tight.plan(counts).retention, hosting)
    assert bool((memory[hosting > 0] <= tight.settings.layer_share).all())
    assert len(tight.placement.replicas) < len(big.placement.replicas)


def _cost_with(num_experts: int, per_step: int, machine: MachineConstants) -> CostModel:
    shape = MoEShape(hidden_size=64, ffn_hidden_size=32, num_experts=num_experts, topk=2,
                     gated=True, dtype_bytes=2, tokens_per_rank=64, num_layers=2,
                     microbatches_in_flight=1, microbatches_per_step=per_step)
    return CostModel(shape, machine)


def test_replica_cost_per_microbatch_is_transfers_amortised():
    cost = _cost(8, per_step=4)
    s, m = cost.shape, cost.machine
    assert cost.replica_cost_per_microbatch(0) == 0.0
    one = (s.weight_elements * 2 * 2 / m.alltoall_bytes_per_s + 2 * m.alltoall_latency_s) / 4
    assert cost.replica_cost_per_microbatch(1) == pytest.approx(one)
    # The per-step figure of the whole placement, amortised, is the same model.
    replicas = ((0, 1), (1, 1), (4, 0))
    assert cost.replica_cost_per_microbatch(2) == pytest.approx(
        cost.replica_sync_time(replicas, 2, 4) / 4)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), zipf=st.floats(0.5, 2.0), ranks=st.sampled_from([2, 4]),
       gamma=st.sampled_from([0.75, math.inf]), slack=st.floats(1.5, 4.0))
def test_memory_aware_adds_replicas_only_when_they_pay(seed, zipf, ranks, gamma, slack):
    # The same routing, budget and rates; only what a replica costs in transfers per
    # micro-batch changes. A huge fixed cost per replica all-to-all (latency: the layer's
    # own all-to-alls pay it whatever the placement) and one micro-batch per step: no
    # replica saves its cost, none is added. Cheap transfers amortised over many
    # micro-batches: the placement is the one free replica transfers would give.
    experts = 2 * ranks
    counts = _skewed_counts(ranks, experts, 128, seed, zipf)
    slow = MachineConstants(gemm_flops_per_s=1e9, alltoall_bytes_per_s=1e9,
                            alltoall_latency_s=10.0, source="costly replica transfers")
    costly = _cost_with(experts, 1, slow)
    planner = _planner("memory-aware", counts, capacity_factor=gamma, cost=costly,
                       budget_bytes=costly.balanced_dropless_need() * slack)
    assert planner.placement == Placement.static(ranks, experts)
    base = _planner("static", counts, capacity_factor=gamma, cost=costly).plan(counts)
    assert greedy_replicas(counts.sum(0).tolist(), int(base.retention.capacity[0]),
                           planner.settings) == []

    cheap = _cost_with(experts, 10**6, MACHINE)
    common = dict(capacity_factor=gamma, cost=cheap,
                  budget_bytes=cheap.balanced_dropless_need() * slack)
    amortised = _planner("memory-aware", counts, **common)

    class FreeTransfers(CostModel):
        def replica_cost_per_microbatch(self, busiest: int) -> float:
            return 0.0

    free = FreeTransfers(cheap.shape, cheap.machine)
    unpriced = _planner("memory-aware", counts, **{**common, "cost": free})
    # Equal up to ties: candidates the free transfers price alike (to rounding) may differ
    # in which rank sends the most replicas, and the amortised cost then tells them apart.
    times = [_estimated_time(free, planner.plan(counts), planner.placement)
             for planner in (amortised, unpriced)]
    assert times[0] == pytest.approx(times[1], rel=1e-9)


def test_memory_aware_replica_pays_at_enough_microbatches():
    # One hot expert: a replica saves ~56 pairs x 37 us = ~2 ms per micro-batch and
    # costs two 5 ms all-to-all calls per step. Worth it only once amortised over enough
    # micro-batches per step (the same budget, routing and machine otherwise).
    counts = torch.zeros(2, 4, dtype=torch.int64)
    counts[:, 0] = 60
    counts[:, 1:] = 4
    machine = MachineConstants(gemm_flops_per_s=1e9, alltoall_bytes_per_s=1e9,
                               alltoall_latency_s=5e-3, source="test")
    replicas = {}
    for per_step in (1, 64):
        cost = _cost_with(4, per_step, machine)
        planner = _planner("memory-aware", counts, capacity_factor=math.inf, cost=cost,
                           budget_bytes=cost.balanced_dropless_need() * 4)
        replicas[per_step] = planner.placement.replicas
    assert replicas[1] == ()
    assert replicas[64]


def test_budget_lowers_gamma_not_forward():
    # Rank 0's routed load fits its forward buffers but not its backward ones at
    # gamma = 2: the planner lowers gamma until the backward buffers fit.
    cost = _cost(4, tokens=64, topk=2, layers=1)
    counts = torch.tensor([[60, 60, 4, 4], [60, 60, 4, 4]])
    budget = cost.balanced_dropless_need() * 1.1
    # The premise, by the cost model: rank 0 (240 routed pairs) fits keeping nothing, not
    # keeping all of them, which gamma = 2 (C = 256) would.
    assert cost.rank_memory(np.zeros(1), np.array([240]), np.array([0]))[0] <= budget
    assert float(cost.plan_memory(plan_retention(counts, 2, 2.0), np.zeros(2))[0]) > budget
    planner = LayerPlanner(PlannerSettings("static", 2, 4, capacity_factor=2.0,
                                               budget_bytes=budget, cost=cost))
    plan = planner.plan(counts)
    assert plan.capacity_factor_used < 2.0
    assert any("lowered" in note for note in plan.notes)
    assert torch.equal(plan.retention.counts, counts)              # forward: everything
    memory = cost.plan_memory(plan.retention, np.zeros(2))
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
    planner.next_step()                      # nothing observed: nothing changes
    assert planner.placement is before[0]
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


def _run_steps(planner: LayerPlanner, steps: list[list[torch.Tensor]]) -> list[tuple]:
    """Each step's placement and every micro-batch's quotas, planned as the layer plans."""
    out = []
    for micro in steps:
        quotas = []
        for counts in micro:
            planner.observe(counts)
            quotas.append(planner.plan(counts).retention.quotas.clone())
        out.append((planner.placement.replicas, quotas))
        planner.next_step()
    return out


def test_state_dict_resume_from_a_version_1_state():
    # A checkpoint written before the planner kept per-micro-batch counts (version 1, at a
    # step boundary, as checkpoints are) loads, and the run resumes bitwise: at a boundary
    # the next placement is already chosen (state_dict chooses a due one first) and this
    # step's kept counts are still empty, so version 1 lost nothing.
    cost = _cost(8)
    s = PlannerSettings("memory-aware", 4, 8, budget_bytes=cost.balanced_dropless_need() * 3,
                        cost=cost, load_smoothing=0.5)
    steps = [[_skewed_counts(4, 8, 128, seed=10 * step + m) for m in range(3)]
             for step in range(6)]
    ref = LayerPlanner(s)
    _run_steps(ref, steps[:3])
    state = ref.state_dict()
    assert state["version"] == 2 and len(state["priced_counts"]) == 3
    old = {k: v for k, v in state.items() if k not in ("priced_counts", "step_counts")}
    resumed = LayerPlanner(s)
    resumed.load_state_dict(pickle.loads(pickle.dumps(old | {"version": 1})))
    for a, b in zip(_run_steps(ref, steps[3:]), _run_steps(resumed, steps[3:]), strict=True):
        assert a[0] == b[0]
        assert all(torch.equal(x, y) for x, y in zip(a[1], b[1], strict=True))
    assert torch.equal(resumed.smoothed_counts, ref.smoothed_counts)
    with pytest.raises(ValueError, match="version 3"):
        LayerPlanner(s).load_state_dict(state | {"version": 3})


def _plans_with_threads(threads: int) -> list[tuple]:
    """A gloo pool task: this rank plans a run at ``threads`` torch threads."""
    import torch.distributed as dist

    before = torch.get_num_threads()
    torch.set_num_threads(threads + dist.get_rank())
    try:       # the pool's workers outlive the task: their thread count is given back
        micro = [_step_counts(16, 128, 1024 * 8, 4, seed, 1.0, 1.0) for seed in range(5)]
        cost = _dominance_cost(16, 128, 4)
        planner = LayerPlanner(PlannerSettings(
            "memory-aware", 16, 128, capacity_factor=1.0,
            budget_bytes=cost.balanced_dropless_need() * 1.5, cost=cost))
        out = _run_steps(planner, [[torch.from_numpy(c) for c in m] for m in micro])
        return [(torch.get_num_threads(), replicas, [q.numpy().tobytes() for q in quotas])
                for replicas, quotas in out]
    finally:
        torch.set_num_threads(before)


def test_same_plans_on_ranks_with_different_thread_counts(gloo2):
    # The choice reads only the gathered counts and the settings: no timing, no thread
    # count, nothing measured on the rank. Two ranks at 1 and 2 torch threads agree.
    first, second = gloo2.run(_plans_with_threads, 1)
    assert first[0][0] == 1 and second[0][0] == 2
    assert len({replicas for _, replicas, _ in first}) > 1     # the placement moved
    assert [(r, q) for _, r, q in first] == [(r, q) for _, r, q in second]


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


def test_budget_below_the_floor_is_refused_with_the_number():
    # The floor: balanced routing with nothing retained in backward. Below the balanced
    # dropless need but above the floor is planned (gamma lowered), not refused.
    cost = _cost(8)
    floor, need = budget_floor(cost), cost.balanced_dropless_need()
    assert floor == cost.balanced_need(0.0) < need
    with pytest.raises(ValueError, match=f"below the floor of {floor:.6g} bytes"):
        PlannerSettings("static", 4, 8, budget_bytes=floor * 0.99, cost=cost)
    PlannerSettings("static", 4, 8, budget_bytes=floor, cost=cost)   # exactly enough: fine
    PlannerSettings("static", 4, 8, budget_bytes=need * 0.99, cost=cost)


@pytest.mark.parametrize("forward_retention", [False, True])
@pytest.mark.parametrize("policy", ["static", "popularity", "memory-aware"])
def test_budget_between_floor_and_dropless_need_lowers_gamma(policy, forward_retention):
    # Between the floor and the balanced dropless need, even balanced routing does not
    # fit at the configured gamma: from the first plan on (no step observed yet) the
    # planner lowers gamma so that it fits, and the forward keeps every pair.
    cost = _cost(8, forward_retention=forward_retention)
    floor, need = budget_floor(cost), cost.balanced_dropless_need()
    budget = floor + 0.5 * (need - floor)
    settings = PlannerSettings(policy, 4, 8, capacity_factor=1.0, budget_bytes=budget,
                               cost=cost)
    planner = LayerPlanner(settings)
    balanced = torch.full((4, 8), 16, dtype=torch.int64)        # P = 64 x 2 per rank
    plan = planner.plan(balanced)
    assert plan.capacity_factor_used < 1.0
    assert any("lowered" in note for note in plan.notes)
    assert torch.equal(plan.retention.counts, balanced)
    memory = cost.plan_memory(plan.retention, np.zeros(4))
    assert float(memory.max()) <= settings.layer_share
    # Skewed routing over steps: placement and plans without error; replicas only on
    # ranks that hold them within their share (popularity: none, no slot beyond E/R).
    for seed in range(3):
        counts = _skewed_counts(4, 8, 128, seed)
        planner.observe(counts)
        planner.next_step()
        plan = planner.plan(counts)
        assert plan.capacity_factor_used <= 1.0
        assert int(plan.retention.counts.sum()) == int(counts.sum())     # forward: all
        hosting = np.array(planner.placement.replicas_per_rank())
        memory = cost.plan_memory(plan.retention, hosting)
        assert bool((memory[hosting > 0] <= settings.layer_share).all())
    if policy == "popularity":
        assert settings.popularity_slots() == 2
        assert planner.placement == Placement.static(4, 8)


def test_planner_reports_each_plans_memory_with_a_cost_model():
    """``last_memory``: the [R] ``rank_memory`` of the latest plan whenever the settings
    carry a cost model (a run held to its device, without a budget; or with one, after
    gamma was lowered), recomputed here from the plan by ``CostModel.plan_memory``; None
    without a cost model (nothing is computed)."""
    counts = _skewed_counts(4, 8, 64, 3, 1.0)
    cost = _cost(8)
    plain = LayerPlanner(PlannerSettings("static", 4, 8, capacity_factor=1.0))
    plain.plan(counts)
    assert plain.last_memory is None
    held = LayerPlanner(PlannerSettings("static", 4, 8, capacity_factor=1.0, cost=cost))
    plan = held.plan(counts)
    assert not plan.notes
    assert np.array_equal(held.last_memory, cost.plan_memory(plan.retention, np.zeros(4)))
    budget = budget_floor(cost) * 1.05           # the budget binds: some ranks stay over
    budgeted = LayerPlanner(PlannerSettings("static", 4, 8, capacity_factor=1.0, cost=cost,
                                            budget_bytes=budget))
    plan = budgeted.plan(counts)
    assert any(note.startswith("over budget") for note in plan.notes)
    assert np.array_equal(budgeted.last_memory, cost.plan_memory(plan.retention, np.zeros(4)))


def test_placement_is_chosen_at_its_first_read_after_the_step():
    """next_step only folds the loads: the choice (the costly part) waits for the first
    read of ``placement`` (the layer's first forward of the next step), happens once, and
    is the same placement however late it is read: a planner read after every step and
    one read only at the end agree, and a state saved with the choice due resumes alike."""
    cost = _cost(8)
    s = PlannerSettings("memory-aware", 4, 8, budget_bytes=cost.balanced_dropless_need() * 3,
                        cost=cost, load_smoothing=0.5)
    batches = [_skewed_counts(4, 8, 128, seed=i) for i in range(6)]
    eager, lazy = LayerPlanner(s), LayerPlanner(s)
    choices = []
    choose = lazy._choose_placement
    lazy._choose_placement = lambda: choices.append(lazy.step) or choose()
    for counts in batches:
        for planner in (eager, lazy):
            planner.observe(counts)
            planner.next_step()
        assert lazy.placement_due and choices[-1:] != [lazy.step]   # not at the boundary
        eager.placement                                  # noqa: B018  (read every step)
    assert choices == [1, 2, 3, 4, 5]                    # each due choice made by observe
    assert lazy.placement == eager.placement and lazy.placement_due is False
    assert choices == [1, 2, 3, 4, 5, 6]                 # the last, at the read, once
    assert lazy.placement == eager.placement and len(choices) == 6   # a second read: none
    assert lazy.placement.replicas, "the skew must make memory-aware place replicas"

    due = LayerPlanner(s)
    due.load_state_dict(lazy.state_dict())
    due.observe(batches[0])
    due.next_step()
    state = due.state_dict()                             # saved with the choice due
    assert not due.placement_due
    eager.observe(batches[0])
    eager.next_step()
    assert state["replicas"] == [list(p) for p in eager.placement.replicas]


# ---------------------------------------------------------------------------
# Dominance: LRMoE's choice is never judged slower than SYMI-style's at the same budget
# ---------------------------------------------------------------------------

TRACES = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "routing_traces"

# An H100-like node's rates (bf16 dense GEMMs, HBM, an inter-node link per GPU): the
# property does not depend on them, but the all-to-all's share of the time does.
H100_LIKE = MachineConstants(gemm_flops_per_s=6e14, alltoall_bytes_per_s=4.5e10,
                             alltoall_latency_s=2e-5, memory_bytes_per_s=2.5e12,
                             source="H100-like rates for the dominance property")


def _dominance_cost(num_ranks: int, num_experts: int, per_step: int) -> CostModel:
    shape = MoEShape(hidden_size=2048, ffn_hidden_size=768, num_experts=num_experts, topk=8,
                     gated=True, dtype_bytes=2, tokens_per_rank=1024, num_layers=4,
                     microbatches_in_flight=1, microbatches_per_step=per_step,
                     expert_parallel_size=num_ranks)
    return CostModel(shape, H100_LIKE)


def _step_counts(num_ranks: int, num_experts: int, pairs: int, steps: int, seed: int,
                 zipf: float, locality: float) -> list[np.ndarray]:
    """[R, E] counts of ``steps`` micro-batches: Zipf(``zipf``) popularity over a random
    expert order, each source rank's own preferences spread by ``locality`` (a
    log-normal factor per rank and expert, as data-parallel shards route differently)."""
    rng = np.random.default_rng(seed)
    base = np.arange(1, num_experts + 1, dtype=np.float64) ** -zipf
    base = base[rng.permutation(num_experts)]
    taste = np.exp(locality * rng.standard_normal((num_ranks, num_experts)))
    p = base * taste
    p /= p.sum(1, keepdims=True)
    return [np.stack([rng.multinomial(pairs, row) for row in p]) for _ in range(steps)]


def _judged_step(cost: CostModel, planner: LayerPlanner, micro: list[np.ndarray]) -> float:
    """The simulator's per-step MoE time of one layer (tools/simulate.py): every
    micro-batch's plan as the layer runs it (budget applied), priced instance by
    instance, plus the step's replica refresh and gradient return."""
    total = 0.0
    for counts in micro:
        plan = planner.plan(torch.from_numpy(counts)).retention
        fwd, bwd = cost.layer_time(plan.routed_matrix.numpy(), plan.retained_matrix.numpy(),
                                   0.0, InstanceRows.of_plan(plan))
        total += fwd + bwd
    p = planner.placement
    return total + cost.replica_sync_time(p.replicas, p.num_ranks, p.experts_per_rank)


def _after_one_step(settings_: PlannerSettings, micro: list[np.ndarray]) -> LayerPlanner:
    planner = LayerPlanner(settings_)
    for counts in micro:
        planner.observe(torch.from_numpy(counts))
    planner.next_step()
    return planner


def _symi_fitted(cost: CostModel, budget: float, micro: list[np.ndarray]) -> LayerPlanner:
    """SYMI-style at its fitted slots, by brute force: of every slot count its budget
    allows, the most whose plans fit the layer share on every micro-batch with nothing
    routed past a receive limit (its users shrink the slots until the run fits)."""
    num_ranks, num_experts = micro[0].shape
    best = None
    for slots in range(num_experts // num_ranks, num_experts + 1):
        settings_ = PlannerSettings("popularity", num_ranks, num_experts,
                                    capacity_factor=math.inf, slots_per_rank=slots,
                                    budget_bytes=budget, cost=cost)
        if settings_.popularity_slots() < slots:       # the budget's own cap
            break
        planner = _after_one_step(settings_, micro)
        fits = True
        for counts in micro:
            plan = planner.plan(torch.from_numpy(counts))
            fits &= (not plan.assignment.overflow
                     and bool((planner.last_memory <= settings_.layer_share).all()))
        if fits or best is None:
            best = _after_one_step(settings_, micro)
    return best


def _assert_not_slower_than_symi_style(micro: list[np.ndarray], slack: float) -> None:
    """At gamma = inf (nothing dropped in backward) and the same budget and counts,
    LRMoE's placement, chosen from ``micro`` (one step's micro-batches), is judged on
    them as the simulator judges a step, against SYMI-style's at its fitted slots:
    never slower (equal up to rounding is a tie)."""
    num_ranks, num_experts = micro[0].shape
    cost = _dominance_cost(num_ranks, num_experts, len(micro))
    budget = cost.balanced_dropless_need() * slack
    lrmoe = _after_one_step(PlannerSettings("memory-aware", num_ranks, num_experts,
                                            capacity_factor=math.inf, budget_bytes=budget,
                                            cost=cost), micro)
    symi = _symi_fitted(cost, budget, micro)
    ours, theirs = _judged_step(cost, lrmoe, micro), _judged_step(cost, symi, micro)
    assert ours <= theirs * (1 + 1e-9), (ours / theirs, lrmoe.placement_notes,
                                         symi.placement_notes)


def _random_case(case: int) -> tuple[int, int, float, float, float]:
    rng = np.random.default_rng([case, 46])
    return (int(rng.choice([4, 8, 16, 32, 64])), int(rng.integers(10**6)),
            float(rng.uniform(0.0, 1.6)), float(rng.uniform(0.0, 2.0)),
            float(rng.uniform(1.1, 4.0)))


# Random cases (fixed seeds) and three found by a sweep of 80 where the two tie: LRMoE
# keeps static, or proposes SYMI-style's own placement.
@pytest.mark.parametrize("num_ranks, seed, zipf, locality, slack",
                         [_random_case(case) for case in range(16)]
                         + [(4, 215183, 1.52, 1.06, 1.48), (16, 163486, 0.88, 0.26, 1.09),
                            (8, 866286, 1.4, 0.06, 1.68)])
def test_memory_aware_never_judged_slower_than_symi_style(num_ranks, seed, zipf, locality,
                                                          slack):
    micro = _step_counts(num_ranks, 128, 1024 * 8, 4, seed, zipf, locality)
    if slack * _dominance_cost(num_ranks, 128, 4).balanced_dropless_need() < budget_floor(
            _dominance_cost(num_ranks, 128, 4)):
        pytest.skip("budget below the floor")
    _assert_not_slower_than_symi_style(micro, slack)


@pytest.mark.parametrize("trace", ["qwen3", "glm45"])
@pytest.mark.parametrize("num_ranks, slack", [(8, 1.3), (16, 1.6), (32, 2.0)])
def test_memory_aware_never_judged_slower_than_symi_style_on_recorded_traces(
        trace, num_ranks, slack):
    # The recorded Qwen3-like and GLM-like routers (benchmarks/results/routing_traces/),
    # their source rows grouped into EP-size calls as the simulator groups them, resampled
    # to 8,192 pairs per rank; a step of 4 micro-batches from the second half of training.
    traces, _ = load_traces(TRACES / trace / "trace", 128, 2, 0.5)
    for layer, recorded in enumerate(traces):
        batches = source_batches(recorded, num_ranks, 1024 * 8,
                                 np.random.default_rng([num_ranks, layer]))
        _assert_not_slower_than_symi_style([next(batches) for _ in range(4)], slack)
