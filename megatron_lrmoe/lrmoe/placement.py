"""Expert placement, capacity-aware routing and the per-layer placement planner.

DESIGN.md sections 3.2-3.3 (placement, routing), 6 (replicas, policies) and 7 (the
budget). Pure: counts, plain numbers and frozen values in; placements, routings and
retention plans out. No process group and no config object: every EP rank holds an
identical planner, feeds it the same gathered counts and gets the same answer, so the
ranks agree without communicating.

Notation (DESIGN.md section 2)
  R        ranks of the expert-parallel group
  E        experts, a multiple of R; E_loc = E / R; home rank of expert e is e // E_loc
  I        instances: the E homes plus the replicas (I = E + number of replicas)
  n[s, e]  routed pairs from source rank s to expert e (``counts`` [R, E])
  N_e      sum_s n[s, e]
  x_i      pairs assigned to instance i (a column total of the routing)
  L_r      routed load of rank r: sum of x_i over the instances on r
  c_r      buffer capacity of rank r: the most pairs it can receive (optional)

Instance order is rank-major: rank 0's E_loc home experts ascending, then the replicas
rank 0 hosts by expert ascending, then rank 1, ... So the instances of a rank are
contiguous, and without replicas instance i is expert i (Megatron's layout).

Routing semantics (``route_pairs``), in order of priority:
  1. every pair goes to an instance of its expert (the forward is exact); experts
     without replicas go to their home instance;
  2. overflow, the pairs above the ranks' capacities sum_r max(0, L_r - c_r), is as
     small as any assignment can make it; the pairs that fit nowhere go to the home
     instance (exactness wins) and ``Routing.overflow`` counts them;
  3. without overflow, the most loaded rank's load max_r L_r is as small as any
     assignment within the capacities can make it (an exact integer optimum);
  4. per instance totals fixed, a source whose rank hosts an instance of the expert
     sends min(n[s, e], x_i) pairs there (local, no network); the other pairs fill
     the remaining instance totals sources in rank order, instances in instance order
     (a north-west-corner fill), so the result is deterministic.
  With overflow, priority 3 applies to the pairs that fit (the home instances take the
  rest); the max load is then not claimed optimal.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from functools import cached_property
from typing import Any

import numpy as np
import torch

from megatron_lrmoe.lrmoe.cost_model import CostModel
from megatron_lrmoe.lrmoe.planner import UNLIMITED_CAPACITY, RetentionPlan, plan_retention

__all__ = [
    "POLICIES",
    "MicroBatchPlan",
    "Placement",
    "PlacementPlanner",
    "PlannerSettings",
    "Routing",
    "route_pairs",
]

POLICIES = ("static", "popularity", "memory-aware")


# ---------------------------------------------------------------------------
# Placement
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Placement:
    """Which instances exist on which rank: Megatron's homes plus replicas.

    ``replicas`` are (expert, rank) pairs. They are normalised, not refused: any order
    is accepted and stored sorted by (rank, expert), so two placements with the same
    replicas are equal and hash alike. Refused: a replica on the expert's home rank,
    a duplicate, an expert or rank out of range.
    """

    num_ranks: int
    num_experts: int
    replicas: tuple[tuple[int, int], ...] = ()
    instance_expert: tuple[int, ...] = field(init=False, repr=False, compare=False)
    """[I] expert whose weights instance i holds."""
    instance_rank: tuple[int, ...] = field(init=False, repr=False, compare=False)
    """[I] rank hosting instance i."""
    home_instance: tuple[int, ...] = field(init=False, repr=False, compare=False)
    """[E] instance id of expert e's home."""

    def __post_init__(self) -> None:
        num_ranks, num_experts = self.num_ranks, self.num_experts
        for name, value in (("num_ranks", num_ranks), ("num_experts", num_experts)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Placement.{name} must be a positive int, got {value!r}")
        if num_experts % num_ranks:
            raise ValueError(f"Placement.num_experts={num_experts} must be a multiple of "
                             f"num_ranks={num_ranks}")
        per_rank = num_experts // num_ranks
        replicas = sorted(((int(e), int(r)) for e, r in self.replicas), key=lambda p: (p[1], p[0]))
        for (e, r), previous in zip(replicas, [None, *replicas], strict=False):
            if not (0 <= e < num_experts and 0 <= r < num_ranks):
                raise ValueError(f"Placement.replicas: ({e}, {r}) out of range "
                                 f"(E={num_experts}, R={num_ranks})")
            if r == e // per_rank:
                raise ValueError(f"Placement.replicas: ({e}, {r}) is expert {e}'s home rank")
            if (e, r) == previous:
                raise ValueError(f"Placement.replicas: ({e}, {r}) appears twice")
        object.__setattr__(self, "replicas", tuple(replicas))

        instance_expert: list[int] = []
        instance_rank: list[int] = []
        home = [0] * num_experts
        hosted = [[] for _ in range(num_ranks)]
        for e, r in replicas:
            hosted[r].append(e)
        for r in range(num_ranks):
            for e in range(r * per_rank, (r + 1) * per_rank):
                home[e] = len(instance_expert)
                instance_expert.append(e)
                instance_rank.append(r)
            instance_expert.extend(hosted[r])
            instance_rank.extend([r] * len(hosted[r]))
        object.__setattr__(self, "instance_expert", tuple(instance_expert))
        object.__setattr__(self, "instance_rank", tuple(instance_rank))
        object.__setattr__(self, "home_instance", tuple(home))

    @classmethod
    def static(cls, num_ranks: int, num_experts: int) -> Placement:
        """Megatron's layout: homes only."""
        return cls(num_ranks, num_experts)

    @property
    def experts_per_rank(self) -> int:
        """E_loc."""
        return self.num_experts // self.num_ranks

    @property
    def num_instances(self) -> int:
        """I = E + number of replicas."""
        return len(self.instance_expert)

    def home_rank(self, expert: int) -> int:
        """Rank owning expert's weights and optimizer state (Megatron's layout)."""
        return expert // self.experts_per_rank

    @cached_property
    def _rank_starts(self) -> tuple[int, ...]:
        counts = [0] * (self.num_ranks + 1)
        for r in self.instance_rank:
            counts[r + 1] += 1
        for r in range(self.num_ranks):
            counts[r + 1] += counts[r]
        return tuple(counts)

    def rank_instances(self, rank: int) -> range:
        """Instance ids on ``rank`` (contiguous: homes first, then replicas by expert)."""
        return range(self._rank_starts[rank], self._rank_starts[rank + 1])

    @cached_property
    def _instances_of(self) -> tuple[tuple[int, ...], ...]:
        out = [[h] for h in self.home_instance]
        for i in range(self.num_instances):       # rank-major: replicas come by rank
            e = self.instance_expert[i]
            if i != self.home_instance[e]:
                out[e].append(i)
        return tuple(tuple(v) for v in out)

    def instances_of(self, expert: int) -> tuple[int, ...]:
        """Instance ids of ``expert``: home first, then replicas by rank."""
        return self._instances_of[expert]

    def replicas_per_expert(self) -> tuple[int, ...]:
        """[E] number of replicas of each expert (instances minus the home)."""
        return tuple(len(v) - 1 for v in self._instances_of)

    def replicas_per_rank(self) -> tuple[int, ...]:
        """[R] replica instances each rank hosts (what costs it replica memory)."""
        out = [0] * self.num_ranks
        for _, r in self.replicas:
            out[r] += 1
        return tuple(out)

    def describe(self) -> str:
        """One line for logs."""
        per_expert = self.replicas_per_expert()
        most = max(per_expert) if per_expert else 0
        return (f"placement R={self.num_ranks} E={self.num_experts}: "
                f"{len(self.replicas)} replicas of "
                f"{sum(1 for c in per_expert if c)} experts (most {most} of one expert)")

    @cached_property
    def _layout(self) -> _RoutingLayout:
        return _RoutingLayout.build(self)


@dataclass(frozen=True, eq=False)
class _RoutingLayout:
    """Index arrays ``route_pairs`` needs, built once per placement (read-only).

    K replicated experts, J = most instances of one (padding where fewer); "valid"
    entries are the real (k, j) slots, in row-major order.
    """

    replicated: np.ndarray          # [K] experts with replicas, ascending
    instance_table: np.ndarray      # [K, J] their instance ids, home first; -1 padding
    rank_table: np.ndarray          # [K, J] the ranks hosting them; -1 padding
    ranks_of: tuple[tuple[int, ...], ...]   # rank_table rows without padding
    instance_count: tuple[int, ...]  # [K] len(ranks_of[k])
    single: np.ndarray              # [E - K] experts without replicas
    single_instance: np.ndarray     # [E - K] their home instance
    rank_incidence: tuple[tuple[tuple[int, int], ...], ...]  # [R] (k, j) hosted on r
    involved_ranks: tuple[int, ...]  # ranks hosting an instance of a replicated expert
    involved_set: frozenset[int]
    involved_array: np.ndarray       # involved_ranks as an array
    rank_degree: np.ndarray          # [R] replicated-expert instances on each rank
    rank_starts: np.ndarray          # [R] first instance of each rank (rank-major order)
    width_of: np.ndarray             # [K] instances of each replicated expert
    rank_or_sentinel: np.ndarray     # [K, J] rank_table with R in the padding
    valid_flat: np.ndarray           # [V] flat k * J + j of the valid slots
    valid_ranks: np.ndarray          # [V] their ranks
    valid_experts: np.ndarray        # [V] their experts
    valid_instances: np.ndarray      # [V] their instances
    valid_source_flat: np.ndarray    # [V] flat k * R + rank (into [K, R])
    flat_instance: np.ndarray        # [K * J] instance_table flattened (-1 padding)
    source_row_offset: np.ndarray    # [K * R] (flat % R) * I: row offset into [R, I]

    @classmethod
    def build(cls, placement: Placement) -> _RoutingLayout:
        num_ranks = placement.num_ranks
        per_expert = placement.replicas_per_expert()
        replicated = [e for e, c in enumerate(per_expert) if c]
        single = [e for e, c in enumerate(per_expert) if not c]
        width = max((c + 1 for c in per_expert), default=1)
        instance_table = np.full((len(replicated), width), -1, dtype=np.int64)
        rank_table = np.full((len(replicated), width), -1, dtype=np.int64)
        incidence: list[list[tuple[int, int]]] = [[] for _ in range(num_ranks)]
        ranks_of = []
        for k, e in enumerate(replicated):
            instances = placement.instances_of(e)
            ranks = tuple(placement.instance_rank[i] for i in instances)
            instance_table[k, :len(instances)] = instances
            rank_table[k, :len(instances)] = ranks
            ranks_of.append(ranks)
            for j, r in enumerate(ranks):
                incidence[r].append((k, j))
        valid = instance_table >= 0
        kk, jj = np.nonzero(valid)
        involved = tuple(r for r in range(num_ranks) if incidence[r])
        layout = cls(
            replicated=np.asarray(replicated, dtype=np.int64),
            instance_table=instance_table,
            rank_table=rank_table,
            ranks_of=tuple(ranks_of),
            instance_count=tuple(len(v) for v in ranks_of),
            single=np.asarray(single, dtype=np.int64),
            single_instance=np.asarray([placement.home_instance[e] for e in single],
                                       dtype=np.int64),
            rank_incidence=tuple(tuple(v) for v in incidence),
            involved_ranks=involved,
            involved_set=frozenset(involved),
            involved_array=np.asarray(involved, dtype=np.int64),
            rank_degree=np.asarray([len(v) for v in incidence], dtype=np.float64),
            rank_starts=np.asarray(placement._rank_starts[:-1], dtype=np.int64),
            width_of=valid.sum(1),
            rank_or_sentinel=np.where(valid, rank_table, num_ranks),
            valid_flat=kk * width + jj,
            valid_ranks=rank_table[kk, jj],
            valid_experts=np.asarray(replicated, dtype=np.int64)[kk],
            valid_instances=instance_table[kk, jj],
            valid_source_flat=kk * num_ranks + rank_table[kk, jj],
            flat_instance=instance_table.reshape(-1),
            source_row_offset=np.tile(np.arange(num_ranks) * placement.num_instances,
                                      len(replicated)),
        )
        for value in vars(layout).values():
            if isinstance(value, np.ndarray):
                value.setflags(write=False)
        return layout


# ---------------------------------------------------------------------------
# Capacity-aware routing
# ---------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Routing:
    """Assignment of one micro-batch's routed pairs to instances (a value)."""

    counts: torch.Tensor
    """[R, I] int64 CPU: pairs from source s assigned to instance i."""
    overflow: int
    """Pairs above the ranks' buffer capacities (0 without capacities): the least any
    assignment achieves; pairs that fit nowhere went to their home instance."""
    placement: Placement | None = None
    """The placement the instances belong to."""

    def load_per_rank(self, placement: Placement | None = None) -> torch.Tensor:
        """[R] routed pairs each rank receives. ``placement`` defaults to the routing's own."""
        placement = placement if placement is not None else self.placement
        if placement is None:
            raise ValueError("Routing.load_per_rank needs the placement")
        ranks = torch.tensor(placement.instance_rank, dtype=torch.int64)
        out = torch.zeros(placement.num_ranks, dtype=torch.int64)
        return out.index_add_(0, ranks, self.counts.sum(0))


def route_pairs(
    counts: torch.Tensor,
    placement: Placement,
    capacity: torch.Tensor | Sequence[int] | None = None,
) -> Routing:
    """Assign every routed pair to an instance of its expert (DESIGN.md 3.3).

    Args:
        counts: [R, E] integer n[s, e] (copied to CPU int64).
        placement: the instances; R and E must match ``counts``.
        capacity: [R] most pairs each rank can receive, or None for no limit.

    Returns:
        The routing; the module docstring states the semantics (overflow first,
        then the most loaded rank, then locality, then a fixed fill order).
    """
    n = _check_route_counts(counts, placement)
    cap = _check_route_capacity(capacity, placement.num_ranks)
    out, load = _route(n, placement, None if cap is None else cap.tolist())
    overflow = 0 if cap is None else int(np.add.reduce(np.maximum(load - cap, 0)))
    return Routing(counts=torch.from_numpy(out), overflow=overflow, placement=placement)


def _route(n: np.ndarray, placement: Placement,
           cap: list[int] | None) -> tuple[np.ndarray, np.ndarray]:
    """``route_pairs`` on checked input: ([R, I] routed counts, [R] load per rank).

    Numpy and plain Python only: this runs once per layer and micro-batch, and a torch
    op costs ~10 us on these small arrays, a numpy op ~1 us. ``n`` is not modified.
    """
    layout = placement._layout
    num_ranks = placement.num_ranks
    routed = np.add.reduce(n, axis=0)                               # [E] N_e
    if not len(layout.replicated):                                  # instance i = expert i
        return n.copy(), np.add.reduce(routed.reshape(num_ranks, -1), axis=1)
    out = np.zeros((num_ranks, placement.num_instances), dtype=np.int64)
    out[:, layout.single_instance] = n[:, layout.single]
    column = np.zeros(placement.num_instances, dtype=np.int64)
    column[layout.single_instance] = routed[layout.single]
    base = np.add.reduceat(column, layout.rank_starts)             # [R] fixed loads
    x, load = _balance(base, cap, routed[layout.replicated], layout)
    _fill_replicated(out, n, x, layout)
    return out, np.asarray(load, dtype=np.int64)


def _balance(
    base: np.ndarray, cap: list[int] | None, totals: np.ndarray, layout: _RoutingLayout,
) -> tuple[np.ndarray, list[int]]:
    """Per-instance totals x[k, j] of the replicated experts: min overflow, then min max.

    Returns x ([K, J] int64, 0 in the padding) and the rank loads with it. A transportation
    problem with an integral optimum, solved by augmenting paths in the transfer graph
    (rank r -> rank r' when an expert with pairs on r also has an instance on r'),
    moving whole blocks of pairs at a time:
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
    The paths are those of a breadth-first search (``_Flow``).
    """
    num_ranks = len(base)
    sentinel = layout.rank_or_sentinel                  # padding reads the appended 0
    # Lower bounds of the max load: every set of ranks holds at least the pairs of the
    # experts confined to it: all involved ranks, and each expert's own ranks.
    own = totals + np.add.reduce(np.append(base, 0)[sentinel], axis=1)
    involved_arr = layout.involved_array
    bound = max(int(np.maximum.reduce(-(-own // layout.width_of))),
                -(-int(np.add.reduce(base[involved_arr]) + np.add.reduce(totals))
                  // len(involved_arr)))
    # Start: split each expert in proportion to its ranks' room under that bound,
    # shared among the replicated experts on the rank (close to the optimum, so few
    # augmenting paths remain).
    room = np.maximum(bound - base, 1.0) / np.maximum(layout.rank_degree, 1)
    weight = np.append(room, 0.0)[sentinel]                           # [K, J]
    ideal = totals[:, None] * weight / weight.sum(1, keepdims=True)
    x_arr = np.floor(ideal).astype(np.int64)
    x_arr[:, 0] += totals - np.add.reduce(x_arr, axis=1)
    load_arr = base + np.bincount(sentinel.reshape(-1), weights=x_arr.reshape(-1),
                                  minlength=num_ranks + 1)[:num_ranks].astype(np.int64)
    x = x_arr.tolist()
    load = load_arr.tolist()
    involved = layout.involved_ranks
    flow = _Flow(x, load, layout)
    stuck: set[int] = set()
    if cap is None:
        limit = [math.inf] * num_ranks
    else:
        limit = list(cap)
        flow.set_ceiling(limit)
        for u in involved:
            if load[u] > limit[u]:
                flow.drain(u, limit[u])
        _overflow_home(x, load, limit, layout.ranks_of, layout.rank_incidence, flow.moved)
        stuck = {r for r in range(num_ranks) if load[r] > limit[r]}      # overflow stays
        limit = [max(c, ld) for c, ld in zip(limit, load, strict=True)]

    fixed = [load[r] for r in range(num_ranks) if r not in layout.involved_set or r in stuck]
    level = max(max(fixed, default=0), bound,
                _least_level(sum(load[r] for r in involved), [limit[r] for r in involved]))
    while True:
        over = [r for r in involved if load[r] > level]
        if not over:
            return _patched(x_arr, x, flow.moved), load
        flow.set_ceiling([min(level, lim) for lim in limit])
        for u in over:
            found = flow.drain(u, level)
            if found is not None:                    # the ranks u reaches: all full
                bound = _least_level(sum(load[r] for r in found), [limit[r] for r in found])
                if bound is None or bound <= level:   # no certificate: stop here
                    return _patched(x_arr, x, flow.moved), load
                level = bound
                break


def _patched(x_arr: np.ndarray, x: list[list[int]], moved: list[tuple[int, int]]) -> np.ndarray:
    """x_arr with the entries listed in ``moved`` set from x (cheaper than converting
    all of x back: few entries change)."""
    if moved:
        kk, jj = zip(*moved, strict=True)
        x_arr[kk, jj] = [x[k][j] for k, j in moved]
    return x_arr


class _Flow:
    """Augmenting paths in the transfer graph: x and the loads, updated in place.

    A rank is a target while its load is below its ceiling. ``drain(u, stop)`` moves
    pairs from rank u along paths to targets until u's load is at ``stop`` (or no
    target is reachable). Each path is what a breadth-first search from u finds first:
    ranks in the order found; from each rank r, its incidences (k, j) in order, those
    with pairs (x[k][j] > 0); from each, expert k's ranks in instance order, skipping
    ranks already found; the first target ends it. The path carries
    min(load_u - stop, ceiling_end - load_end, x along the path).

    Found cheaply: ``first[k]`` is the position of the first target among expert k's
    ranks, kept up to date as loads change; from u itself the path is then the first
    incidence with pairs whose expert has a target (one hop, the usual case), and an
    expert already scanned without a target is not scanned again (its ranks were all
    found then).
    """

    __slots__ = ("ceiling", "count", "done", "first", "incidence", "load", "moved",
                 "ranks_of", "seen", "stamp", "x")

    def __init__(self, x: list[list[int]], load: list[int], layout: _RoutingLayout):
        self.x, self.load = x, load
        self.ranks_of = layout.ranks_of
        self.incidence = layout.rank_incidence
        self.count = layout.instance_count
        self.ceiling: list = []
        self.first: list[int] = []
        self.seen = [0] * len(load)
        self.done = [0] * len(x)
        self.stamp = 0
        self.moved: list[tuple[int, int]] = []    # (k, j) of every x changed

    def set_ceiling(self, ceiling: list) -> None:
        """Targets from now on: the ranks whose load is below ``ceiling``."""
        self.ceiling = ceiling
        load, first = self.load, []
        for ranks in self.ranks_of:
            f = 0
            for r in ranks:
                if load[r] < ceiling[r]:
                    break
                f += 1
            first.append(f)
        self.first = first

    def drain(self, u: int, stop) -> list[int] | None:
        """Move load from u to targets until load[u] <= stop. None when done, else the
        ranks u reaches (none of them a target)."""
        x, load, ceiling, first = self.x, self.load, self.ceiling, self.first
        count, ranks_of, incidence, moved = self.count, self.ranks_of, self.incidence, self.moved
        # u is no target (load[u] >= its ceiling) and no path enters it, so its x only
        # fall, and targets only fill up: an incidence of u without a one-hop path
        # stays without one; scan them once.
        own, i = incidence[u], 0
        search = None
        while load[u] > stop:
            while i < len(own):
                k, j = own[i]
                f = first[k]
                if f < count[k] and x[k][j]:
                    break
                i += 1
            if i < len(own):                                     # one hop: k from j to f
                end = ranks_of[k][f]
                xk = x[k]
                delta = min(load[u] - stop, ceiling[end] - load[end], xk[j])
                xk[j] -= delta
                xk[f] += delta
                moved.append((k, j))
                moved.append((k, f))
            else:
                if search is None:
                    search = self._search(u)
                end, hops = next(search)
                if end is None:
                    return hops
                delta = min(load[u] - stop, ceiling[end] - load[end],
                            *(x[k][j] for k, j, _ in hops))
                for k, j_from, j_to in hops:
                    x[k][j_from] -= delta
                    x[k][j_to] += delta
                    moved.append((k, j_from))
                    moved.append((k, j_to))
                    if not x[k][j_from]:
                        search = None    # an edge of the search tree is gone: search anew
            load[u] -= delta             # still >= stop: u does not become a target
            load[end] += delta
            if load[end] >= ceiling[end]:                        # end is full now
                for k, j in incidence[end]:
                    if first[k] == j:
                        ranks = ranks_of[k]
                        f, size = j + 1, count[k]
                        while f < size and load[ranks[f]] >= ceiling[ranks[f]]:
                            f += 1
                        first[k] = f
            else:
                search = None
        return None

    def _search(self, start: int):
        """Breadth-first search from ``start``, a generator: yields (end, hops (k, j_from,
        j_to) from end back to start) for the first target found, and at the end (None,
        the ranks reached in the order found).

        Resumable: if the caller then fills ``end`` (no target any more) and no x on the
        path fell to 0, the search so far is exactly what a new search from ``start``
        would do up to finding ``end``: the same ranks found in the same order with the
        same parents (x only changed on the path, and each expert on it was already
        scanned where the path enters it; no expert scanned before hosts ``end``, or the
        search would have stopped there). ``next`` then goes on from ``end`` as a new
        search would, instead of redoing it all.
        """
        x, first, count, ranks_of = self.x, self.first, self.count, self.ranks_of
        incidence = self.incidence
        self.stamp += 1
        stamp, seen, done = self.stamp, self.seen, self.done
        seen[start] = stamp
        parent = {start: None}
        queue = [start]
        for r in queue:
            for k, j in incidence[r]:
                if not x[k][j] or done[k] == stamp:
                    continue
                done[k] = stamp
                ranks, position = ranks_of[k], 0
                while True:
                    f = first[k]
                    for j2 in range(position, f):    # no target before position f
                        r2 = ranks[j2]
                        if seen[r2] != stamp:
                            seen[r2] = stamp
                            parent[r2] = (r, k, j, j2)
                            queue.append(r2)
                    if f >= count[k]:
                        break
                    hops = [(k, j, f)]
                    node = r
                    while node != start:
                        node, hk, hj, hj2 = parent[node]
                        hops.append((hk, hj, hj2))
                    yield ranks[f], hops
                    position = f                     # resumed: ranks[f] is full now
        yield None, queue


def _overflow_home(x, load, limit, ranks_of, incidence, moved) -> None:
    """Move replica pairs above capacity to their homes (no augmenting path is left,
    so every home reached is full and the overflow stays the same). Appends the (k, j)
    of the x changed to ``moved``."""
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
            moved.append((k, j))
            moved.append((k, 0))
            load[u] -= delta
            load[home] += delta
            work.append(home)


def _least_level(total: int, limits: list) -> int | None:
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


def _shift(x: list[list[int]], hops, delta: int) -> None:
    for k, j_from, j_to in hops:
        x[k][j_from] -= delta
        x[k][j_to] += delta


_ZERO = np.zeros(1, dtype=np.int64)
_ZERO.setflags(write=False)


def _fill_replicated(out: np.ndarray, n: np.ndarray, x: np.ndarray,
                     layout: _RoutingLayout) -> None:
    """Write the replicated experts' columns of ``out`` ([R, I] C-contiguous, zero there).

    n: [R, E] n[s, e]; x: [K, J] instance totals (sum_j = sum_s, 0 in the padding). A
    source on an instance's rank sends min(n, x) there first; the rest is a
    north-west-corner fill. Computed as intervals: lay the remaining source pairs of
    expert 0 (sources in rank order), then of expert 1, ... on a line, and the
    remaining instance totals (instances in order) likewise on a second copy of it; a
    cell (s, i) gets the overlap of s's and i's intervals. The end points of all the
    intervals cut the line into segments, each within one cell, and a cell with pairs
    is exactly one segment: O(K (R + J)) work, not O(K R J).
    """
    local = np.minimum(n[layout.valid_ranks, layout.valid_experts],
                       x.reshape(-1)[layout.valid_flat])              # [V]
    source_left = n.T[layout.replicated]                              # [K, R], a copy
    source_left.reshape(-1)[layout.valid_source_flat] -= local
    instance_left = x.reshape(-1).copy()
    instance_left[layout.valid_flat] -= local
    s_end = np.cumsum(source_left.reshape(-1))                        # interval ends
    ends = np.concatenate((s_end, np.cumsum(instance_left)))
    order = ends.argsort(kind="stable")       # two sorted runs: a merge; sources first on ties
    points = np.concatenate((_ZERO, ends[order]))                     # the line's cut points
    ahead = np.concatenate((_ZERO, np.cumsum(order < s_end.size)))    # source ends up to each
    length = points[1:] - points[:-1]
    cut = np.flatnonzero(length)              # segment [points[m], points[m + 1]) has pairs
    # The cell of the segment starting at points[m] (the last point of its value): the
    # sources and instances ending at or before it are those before it in the order.
    source = ahead[cut]                                               # flat k * R + s
    instance = cut - source                                           # flat k * J + j
    length = length[cut]
    flat = out.reshape(-1)
    flat[layout.source_row_offset[source] + layout.flat_instance[instance]] = length
    flat[layout.valid_ranks * out.shape[1] + layout.valid_instances] += local


def _check_route_counts(counts: torch.Tensor, placement: Placement) -> np.ndarray:
    if not isinstance(counts, torch.Tensor):
        raise TypeError(f"counts must be a torch.Tensor, got {type(counts).__name__}")
    if counts.dim() != 2 or tuple(counts.shape) != (placement.num_ranks, placement.num_experts):
        raise ValueError(f"counts must have shape [R, E] = "
                         f"{(placement.num_ranks, placement.num_experts)}, "
                         f"got {tuple(counts.shape)}")
    if counts.dtype == torch.bool or counts.is_floating_point() or counts.is_complex():
        raise ValueError(f"counts must be an integer tensor, got dtype {counts.dtype}")
    n = counts.detach().to(device="cpu", dtype=torch.int64).numpy()
    if (n < 0).any():
        raise ValueError("counts must be non-negative")
    return n


def _check_route_capacity(capacity, num_ranks: int) -> np.ndarray | None:
    if capacity is None:
        return None
    if isinstance(capacity, torch.Tensor):
        cap = capacity.detach().to("cpu").numpy()
    else:
        cap = np.asarray(list(capacity))
    if cap.shape != (num_ranks,):
        raise ValueError(f"capacity must have {num_ranks} entries, got shape {cap.shape}")
    if cap.dtype.kind not in "iu" or (cap < 0).any():
        raise ValueError("capacity must hold non-negative integers")
    return cap.astype(np.int64)


# ---------------------------------------------------------------------------
# The per-layer planner
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class PlannerSettings:
    """What one layer's planner needs: plain numbers and the cost model.

    ``budget_bytes`` is per rank for all MoE layers and micro-batches in flight
    (DESIGN.md 7); each layer's planner gets ``budget_bytes / cost.shape.num_layers``.
    A budget below ``cost.balanced_dropless_need()`` is refused here, with that number.
    """

    policy: str
    """static | popularity (SYMI-style) | memory-aware (LRMoE)."""
    num_ranks: int
    num_experts: int
    capacity_factor: float = 1.0
    """gamma of the retention planner; inf drops nothing (and then the budget never
    lowers it: dropping was switched off, as for the SYMI-style baseline)."""
    min_retention: float = 0.0
    slots_per_rank: int | None = None
    """popularity: instance slots per rank (E/R..E). None: E/R, or what the budget
    converts to. With a budget as well, the smaller of the two."""
    budget_bytes: float | None = None
    load_smoothing: float = 0.5
    """EMA weight a: smoothed = a * smoothed + (1 - a) * this step's mean counts."""
    cost: CostModel | None = None
    """Needed with a budget and for memory-aware."""

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"PlannerSettings.policy: {self.policy!r} is not one of {POLICIES}")
        for name in ("num_ranks", "num_experts"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"PlannerSettings.{name} must be a positive int, got {value!r}")
        if self.num_experts % self.num_ranks:
            raise ValueError(f"PlannerSettings.num_experts={self.num_experts} must be a "
                             f"multiple of num_ranks={self.num_ranks}")
        gamma = float(self.capacity_factor)
        if math.isnan(gamma) or gamma <= 0:
            raise ValueError(f"PlannerSettings.capacity_factor must be > 0 or inf, "
                             f"got {self.capacity_factor!r}")
        if not 0.0 <= float(self.min_retention) <= 1.0:
            raise ValueError(f"PlannerSettings.min_retention must be in [0, 1], "
                             f"got {self.min_retention!r}")
        per_rank = self.num_experts // self.num_ranks
        slots = self.slots_per_rank
        if slots is not None and (isinstance(slots, bool) or not isinstance(slots, int)
                                  or not per_rank <= slots <= self.num_experts):
            raise ValueError(f"PlannerSettings.slots_per_rank must be an int in "
                             f"[{per_rank}, {self.num_experts}] (experts per rank .. experts), "
                             f"got {slots!r}")
        if not 0.0 <= float(self.load_smoothing) < 1.0:
            raise ValueError(f"PlannerSettings.load_smoothing must be in [0, 1), "
                             f"got {self.load_smoothing!r}")
        if self.cost is not None and self.cost.shape.num_experts != self.num_experts:
            raise ValueError(f"PlannerSettings.cost: shape has {self.cost.shape.num_experts} "
                             f"experts, settings {self.num_experts}")
        budget = self.budget_bytes
        if budget is not None:
            if not (isinstance(budget, int | float) and math.isfinite(budget) and budget > 0):
                raise ValueError(f"PlannerSettings.budget_bytes must be a positive number, "
                                 f"got {budget!r}")
            if self.cost is None:
                raise ValueError("PlannerSettings.cost is needed with budget_bytes")
            need = self.cost.balanced_dropless_need()
            if budget < need:
                raise ValueError(
                    f"PlannerSettings.budget_bytes={budget:.6g} is below the balanced dropless "
                    f"need of {need:.6g} bytes ({need / 2**30:.3f} GiB) per rank: even "
                    f"perfectly balanced routing does not fit")
        if self.policy == "memory-aware" and budget is None:
            raise ValueError("PlannerSettings.budget_bytes: memory-aware placement needs a "
                             "budget (and a cost model)")

    @property
    def layer_share(self) -> float | None:
        """Bytes one layer may hold per rank (budget / MoE layers), or None."""
        if self.budget_bytes is None or self.cost is None:
            return None
        return self.cost.memory_share(self.budget_bytes)

    def popularity_slots(self) -> int:
        """Instance slots per rank for ``popularity``: the explicit value, the budget's
        (E/R plus the replicas that fit in the layer share after the balanced dropless
        execution buffers), or the smaller of the two; at least E/R, at most E."""
        per_rank = self.num_experts // self.num_ranks
        slots = self.slots_per_rank
        share = self.layer_share
        if share is not None:
            cost = self.cost
            p = torch.tensor([float(cost.shape.source_pairs)])
            balanced = float(cost.rank_memory(torch.zeros(1), p, p)[0])
            fit = per_rank + int((share - balanced) // cost.shape.instance_bytes)
            slots = fit if slots is None else min(slots, fit)
        slots = per_rank if slots is None else slots
        return max(per_rank, min(slots, self.num_experts))


@dataclass(frozen=True, eq=False)
class MicroBatchPlan:
    """Routing and retention quotas of one layer and micro-batch (a value)."""

    routing: Routing
    retention: RetentionPlan
    """plan_retention over the routing's [R, I] counts and the placement's layout."""
    capacity_factor_used: float
    """gamma actually used: below the settings' when the budget required it."""
    notes: tuple[str, ...] = ()
    """What the planner did (overflow, lowered gamma, over budget), for logs."""


@dataclass(frozen=True, eq=False)
class _PlacementContext:
    """What ``plan`` needs per placement, computed once when the placement is set."""

    placement: Placement
    replicas_per_rank: torch.Tensor     # [R] int64
    routing_capacity: torch.Tensor | None
    replicas: np.ndarray                # [R] int64, replicas_per_rank
    capacity: np.ndarray | None         # [R] int64, routing_capacity
    capacity_list: list[int] | None
    rank_starts: np.ndarray             # [R] first instance of each rank


class PlacementPlanner:
    """One MoE layer's placement and micro-batch planner (pure; identical on every rank).

    Life cycle per training step: ``plan(counts)`` for each micro-batch (forward),
    ``observe(counts)`` for each training micro-batch, then ``next_step()`` at the step
    boundary, which folds the step's mean counts into the smoothed loads and picks the
    placement of the next step (DESIGN.md 6).
    """

    def __init__(self, settings: PlannerSettings):
        self.settings = settings
        self.placement = Placement.static(settings.num_ranks, settings.num_experts)
        self.step = 0
        self.smoothed_counts: torch.Tensor | None = None
        self.placement_notes: tuple[str, ...] = ()
        """What the last ``next_step`` did, for logs."""
        self._observed_sum: torch.Tensor | None = None
        self._observed = 0
        self._contexts: dict[Placement, _PlacementContext] = {}

    # ------------------------------------------------------------- per batch
    def observe(self, counts: torch.Tensor) -> None:
        """Record one training micro-batch's gathered [R, E] counts of this step."""
        n = torch.from_numpy(_check_route_counts(counts, self.placement)).to(torch.float64)
        self._observed_sum = n if self._observed_sum is None else self._observed_sum + n
        self._observed += 1

    def plan(self, counts: torch.Tensor) -> MicroBatchPlan:
        """Routing and quotas of one micro-batch under the current placement.

        With a budget the routing respects each rank's buffer capacity (the layer share
        minus its replicas), and gamma is lowered until the backward buffers fit; the
        forward never drops. What was done is in ``notes``.
        """
        return self._plan(counts, self._context(self.placement))[0]

    def _plan(self, counts: torch.Tensor,
              ctx: _PlacementContext) -> tuple[MicroBatchPlan, np.ndarray | None]:
        """(the plan, [R] CostModel.plan_memory of it or None without a budget)."""
        # numpy on [R] arrays (a torch op costs ~10 us here); the same numbers as
        # route_pairs, CostModel.retained_limit and CostModel.plan_memory.
        s = self.settings
        placement = ctx.placement
        out, routed = _route(_check_route_counts(counts, placement), placement,
                             ctx.capacity_list)                 # routed: [R] load per rank
        overflow = (0 if ctx.capacity is None
                    else int(np.add.reduce(np.maximum(routed - ctx.capacity, 0))))
        routing = Routing(counts=torch.from_numpy(out), overflow=overflow, placement=placement)
        notes = []
        if overflow:
            notes.append(f"overflow: {overflow} pairs above the ranks' buffer "
                         f"capacity went to home instances")
        gamma = float(s.capacity_factor)
        share = s.layer_share
        if share is not None and math.isfinite(gamma):
            limit = s.cost.retained_limit_np(share, ctx.replicas, routed)
            # Ranks whose forward buffers alone exceed the share (limit 0) stay over
            # budget whatever gamma is: they do not drag every rank's capacity to 1.
            short = (routed > limit) & (limit > 0)
            total = int(np.add.reduce(routed))
            if short.any() and total:
                needed = max(int(np.minimum.reduce(limit[short])), 1)
                if needed < _capacity_for_factor(gamma, total, s.num_ranks):
                    gamma = _factor_for_capacity(needed, total, s.num_ranks)
                    notes.append(f"budget: backward capacity factor lowered from "
                                 f"{s.capacity_factor:g} to {gamma:.4g} (C={needed})")
        retention = plan_retention(routing.counts, s.num_ranks, gamma, s.min_retention,
                                   instance_rank=placement.instance_rank,
                                   instance_expert=placement.instance_expert)
        memory = None
        if share is not None:
            retained = np.add.reduceat(np.add.reduce(retention.quotas.numpy(), axis=0),
                                       ctx.rank_starts)         # [R] retained per rank
            memory = s.cost.rank_memory_np(ctx.replicas, routed, retained)
            over = memory > share
            if over.any():
                notes.append(f"over budget on {int(np.add.reduce(over))} rank(s) by up to "
                             f"{float(np.maximum.reduce(memory - share)) / 2**20:.1f} MiB "
                             f"(the forward is never dropped)")
        return MicroBatchPlan(routing=routing, retention=retention,
                              capacity_factor_used=gamma, notes=tuple(notes)), memory

    def _context(self, placement: Placement) -> _PlacementContext:
        ctx = self._contexts.get(placement)
        if ctx is None:
            if len(self._contexts) >= 8:
                self._contexts.clear()
            replicas = np.asarray(placement.replicas_per_rank(), dtype=np.int64)
            share = self.settings.layer_share
            cap = (None if share is None
                   else self.settings.cost.routing_capacity_np(share, replicas))
            ctx = _PlacementContext(
                placement, torch.from_numpy(replicas),
                None if cap is None else torch.from_numpy(cap), replicas, cap,
                None if cap is None else cap.tolist(),
                np.asarray(placement._rank_starts[:-1], dtype=np.int64))
            self._contexts[placement] = ctx
        return ctx

    # -------------------------------------------------------------- per step
    def next_step(self) -> Placement:
        """Fold this step's observations into the EMA, advance, choose the placement.

        Without observations (evaluation only) nothing changes: not the EMA, not the
        step counter, not the placement.
        """
        if not self._observed:
            self.placement_notes = ("no training micro-batch observed: placement kept",)
            return self.placement
        mean = self._observed_sum / self._observed
        a = float(self.settings.load_smoothing)
        self.smoothed_counts = (mean if self.smoothed_counts is None
                                else a * self.smoothed_counts + (1.0 - a) * mean)
        self._observed_sum, self._observed = None, 0
        self.step += 1
        policy = self.settings.policy
        if policy == "static":
            self.placement, self.placement_notes = self.placement, ()
        elif policy == "popularity":
            self.placement, self.placement_notes = _popularity_placement(
                self.smoothed_counts.sum(0).numpy(), self.settings.num_ranks,
                self.settings.num_experts, self.settings.popularity_slots())
        else:
            self.placement, self.placement_notes = self._memory_aware_placement()
        return self.placement

    def _memory_aware_placement(self) -> tuple[Placement, tuple[str, ...]]:
        """Greedy replicas on a load estimate, then an exact check against static.

        The estimate (``_greedy_replicas``) adds replicas of the experts on the most
        loaded rank while the estimated layer time (with the amortised replica refresh)
        drops and no rank is pushed over its share. The candidate is then planned
        exactly, like ``plan`` does, on the smoothed counts, and kept only if its
        estimated time is no worse than static's, its memory excess over the share no
        larger and its gamma no lower (replicas must not buy time with more drops);
        otherwise its first 3/4, 1/2 and 1/4 are tried, then static.
        """
        s = self.settings
        counts = torch.round(self.smoothed_counts).to(torch.int64)
        static = Placement.static(s.num_ranks, s.num_experts)
        base, memory = self._plan(counts, self._context(static))
        base_score = self._score(base, memory, static)
        replicas = _greedy_replicas(counts.sum(0).tolist(), base, s)
        tried = []
        n = len(replicas)
        for size in (n, 3 * n // 4, n // 2, n // 4):
            if size == 0 or size in tried:
                continue
            tried.append(size)
            candidate = Placement(s.num_ranks, s.num_experts, tuple(replicas[:size]))
            planned, memory = self._plan(counts, self._context(candidate))
            score = self._score(planned, memory, candidate)
            if (score[0] <= base_score[0] and score[1] <= base_score[1]
                    and planned.capacity_factor_used >= base.capacity_factor_used):
                return candidate, (
                    f"memory-aware: {size} replicas, estimated layer time "
                    f"{score[1] * 1e3:.3f} ms vs static {base_score[1] * 1e3:.3f} ms",)
        note = (f"memory-aware: no replica pays off (static {base_score[1] * 1e3:.3f} ms, "
                f"greedy proposed {len(replicas)})")
        return static, (note,)

    def _score(self, plan: MicroBatchPlan, memory: np.ndarray,
               placement: Placement) -> tuple[float, float]:
        """(largest memory excess over the share, estimated fwd + bwd + amortised refresh).

        ``memory``: [R] ``CostModel.plan_memory`` of the plan, from ``_plan``. The numbers
        of ``CostModel.layer_time`` are computed in numpy (the same values).
        """
        s = self.settings
        cost = s.cost
        excess = max(0.0, float(np.maximum.reduce(memory - s.layer_share)))
        starts = self._context(placement).rank_starts
        routed = np.add.reduceat(plan.routing.counts.numpy(), starts, axis=1)     # [R, R]
        retained = np.add.reduceat(plan.retention.quotas.numpy(), starts, axis=1)
        fwd, bwd = cost.layer_time_np(routed, retained)
        sync = cost.replica_sync_time(placement.replicas, s.num_ranks,
                                      placement.experts_per_rank)
        return excess, fwd + bwd + sync / cost.shape.microbatches_per_step

    # ------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """Small and picklable: smoothed loads, step, placement and this step's
        observations so far, so that a resume is exact."""
        s = self.settings
        return {
            "version": 1,
            "num_ranks": s.num_ranks,
            "num_experts": s.num_experts,
            "step": self.step,
            "smoothed_counts": (None if self.smoothed_counts is None
                                else self.smoothed_counts.clone()),
            "replicas": [list(p) for p in self.placement.replicas],
            "observed_sum": None if self._observed_sum is None else self._observed_sum.clone(),
            "observed": self._observed,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict``. A state of another EP size or expert count is refused
        (its per-rank loads do not apply); the caller may then start fresh."""
        s = self.settings
        shape = (state.get("num_ranks"), state.get("num_experts"))
        if shape != (s.num_ranks, s.num_experts):
            raise ValueError(f"planner state is for (R, E) = {shape}, this planner has "
                             f"{(s.num_ranks, s.num_experts)}")
        smoothed, observed_sum = state["smoothed_counts"], state["observed_sum"]
        for name, value in (("smoothed_counts", smoothed), ("observed_sum", observed_sum)):
            if value is not None and tuple(value.shape) != (s.num_ranks, s.num_experts):
                raise ValueError(f"planner state {name} has shape {tuple(value.shape)}")
        self.placement = Placement(s.num_ranks, s.num_experts,
                                   tuple(tuple(p) for p in state["replicas"]))
        self.step = int(state["step"])
        self.smoothed_counts = (None if smoothed is None
                                else smoothed.detach().to("cpu", torch.float64).clone())
        self._observed_sum = (None if observed_sum is None
                              else observed_sum.detach().to("cpu", torch.float64).clone())
        self._observed = int(state["observed"])


# ---------------------------------------------------------------------------
# Policies
# ---------------------------------------------------------------------------


def _popularity_placement(popularity: np.ndarray, num_ranks: int, num_experts: int,
                          slots: int) -> tuple[Placement, tuple[str, ...]]:
    """SYMI-style: R * slots instances, shared in proportion to popularity.

    Instances per expert c_e by the divisor (D'Hondt) method with c_e >= 1 (the home)
    and c_e <= R: the extra instances go one at a time to the expert with the largest
    expected load per instance P_e / c_e (ties: lower expert). This is proportional
    allocation that makes the largest load per instance as small as possible. Replicas
    are then placed hottest expert first (more instances first, then popularity), each
    on the rank not yet hosting that expert with a free slot and the least expected
    load (sum of P_e / c_e over its instances; ties: lower rank). An instance that finds
    no such rank is skipped (noted).
    """
    per_rank = num_experts // num_ranks
    extra = num_ranks * slots - num_experts
    pop = np.maximum(np.asarray(popularity, dtype=np.float64), 0.0)
    if extra <= 0 or num_ranks == 1 or pop.sum() <= 0:
        return Placement.static(num_ranks, num_experts), ()
    quotients = (pop[:, None] / np.arange(2, num_ranks + 1)[None, :]).ravel()   # [E * (R-1)]
    order = np.argsort(-quotients, kind="stable")[:extra]
    order = order[quotients[order] > 0]
    instances = 1 + np.bincount(order // (num_ranks - 1), minlength=num_experts)
    per_instance = pop / instances
    rank_load = per_instance.reshape(num_ranks, per_rank).sum(1)
    free = np.full(num_ranks, slots - per_rank)
    hosts = np.zeros((num_experts, num_ranks), dtype=bool)
    hosts[np.arange(num_experts), np.arange(num_experts) // per_rank] = True
    replicas, skipped = [], 0
    for e in sorted(np.nonzero(instances > 1)[0].tolist(),
                    key=lambda e: (-instances[e], -pop[e], e)):
        for _ in range(int(instances[e]) - 1):
            eligible = (free > 0) & ~hosts[e]
            if not eligible.any():
                skipped += int(instances[e]) - 1 - sum(1 for p in replicas if p[0] == e)
                break
            r = int(np.argmin(np.where(eligible, rank_load, np.inf)))
            replicas.append((e, r))
            hosts[e, r] = True
            free[r] -= 1
            rank_load[r] += per_instance[e]
    notes = (f"popularity: {len(replicas)} replicas in {slots} slots per rank",)
    if skipped:
        notes += (f"popularity: {skipped} replica(s) found no free rank",)
    return Placement(num_ranks, num_experts, tuple(replicas)), notes


def _greedy_replicas(routed: list[int], base: MicroBatchPlan,
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
    fixed = float(cost.rank_memory_np(np.zeros(1), np.zeros(1), np.zeros(1))[0])
    saved, fwd_t = shape.saved_bytes_per_routed_pair, shape.forward_transient_bytes_per_routed_pair
    bwd_t, inst = shape.backward_transient_bytes_per_retained_pair, shape.instance_bytes

    capacities: dict[int, float] = {}

    def capacity(replicas: int) -> float:
        """``_capacity(replicas)``, memoised (called for every rank of every move tried)."""
        value = capacities.get(replicas)
        if value is None:
            value = capacities[replicas] = _capacity(replicas)
        return value

    def _capacity(replicas: int) -> float:
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
        least = None
        for e in candidates:
            hosts = spread[e]
            if len(hosts) >= num_ranks:
                continue
            # v: the least loaded rank not hosting e, the lowest on ties (min keeps the
            # first of equal keys)
            if least is None:
                least = min(range(num_ranks), key=load.__getitem__)
            v = least if least not in hosts else min(
                (r for r in range(num_ranks) if r not in hosts), key=load.__getitem__)
            ranks = [*hosts, v]
            others = [load[r] - h for r, h in hosts.items()]
            others.append(load[v])
            limits = [capacity(reps_on[r]) for r in hosts]
            limits.append(capacity(reps_on[v] + 1))
            new = dict(zip(ranks, _fluid_fill(float(routed[e]), others, limits), strict=True))
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


def _fluid_fill(amount: float, others: list[float], limits: list[float]) -> list[float]:
    """Continuous water-filling of ``amount`` over ranks with loads ``others``, each up
    to its limit; what fits nowhere stays on the first rank (the home)."""
    give = [0.0] * len(others)
    active = [j for j in range(len(others)) if limits[j] > others[j]]
    left = amount
    while active and left > 0:
        order = sorted(active, key=others.__getitem__)
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


# ---------------------------------------------------------------------------
# Capacity factor <-> backward capacity, exactly as plan_retention computes it
# ---------------------------------------------------------------------------


def _capacity_for_factor(gamma: float, total: int, num_ranks: int) -> int:
    """C = ceil(gamma * total / R), gamma read as its decimal repr (plan_retention's rule)."""
    if math.isinf(gamma):
        return UNLIMITED_CAPACITY
    f = Fraction(repr(float(gamma)))
    return -(-(f.numerator * total) // (f.denominator * num_ranks))


def _factor_for_capacity(capacity: int, total: int, num_ranks: int) -> float:
    """A gamma > 0 for which plan_retention's C is exactly ``capacity`` (>= 1)."""
    gamma = capacity * num_ranks / total
    while _capacity_for_factor(gamma, total, num_ranks) > capacity:
        gamma = math.nextafter(gamma, 0.0)
    return gamma
