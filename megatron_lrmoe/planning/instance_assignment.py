"""Instance assignment under receive limits: every routed pair to an instance of its expert.

Pure: counts, a placement and receive limits in; an assignment out. Every EP rank assigns the
same gathered counts identically, so the ranks agree without communicating.

Notation (docs/design.md, "Notation")
  n[s, e]  routed pairs from source rank s to expert e (``counts`` [R, E])
  N_e      sum_s n[s, e]
  x_i      pairs assigned to instance i (a column total of the assignment)
  L_r      routed load of rank r: sum of x_i over the instances on r
  u_r      receive limit of rank r: the most pairs its buffers can take (optional)

Assignment semantics (``assign_instances``), in order of priority:
  1. every pair goes to an instance of its expert (the forward is exact); experts
     without replicas go to their home instance;
  2. overflow, the pairs above the ranks' limits sum_r max(0, L_r - u_r), is as
     small as any assignment can make it; the pairs that fit nowhere go to the home
     instance (exactness wins) and ``InstanceAssignment.overflow`` counts them;
  3. without overflow, the most loaded rank's load max_r L_r is as small as any
     assignment within the limits can make it (an exact integer optimum);
  4. per instance totals fixed, a source whose rank hosts an instance of the expert
     sends min(n[s, e], x_i) pairs there (local, no network); the other pairs fill
     the remaining instance totals sources in rank order, each expert's instances in
     its own order, home first, then its replicas by rank (a north-west-corner fill),
     so the result is deterministic.
  With overflow, priority 3 applies to the pairs that fit (the home instances take the
  rest); the max load is then not claimed optimal.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from megatron_lrmoe.planning.placement import Placement

__all__ = ["InstanceAssignment", "assign_instances"]


@lru_cache(maxsize=64)
def assignment_layout(placement: Placement) -> _AssignmentLayout:
    """The index arrays instance assignment needs for ``placement``, built once per placement."""
    return _AssignmentLayout.build(placement)


@dataclass(frozen=True, eq=False)
class _AssignmentLayout:
    """Index arrays ``assign_instances`` needs, built once per placement (read-only).

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
    def build(cls, placement: Placement) -> _AssignmentLayout:
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
            rank_starts=np.asarray(placement.rank_starts[:-1], dtype=np.int64),
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


@dataclass(frozen=True, eq=False)
class InstanceAssignment:
    """Assignment of one micro-batch's routed pairs to instances (a value)."""

    counts: torch.Tensor
    """[R, I] int64 CPU: pairs from source s assigned to instance i."""
    overflow: int
    """Pairs above the ranks' receive limits (0 without limits): the least any
    assignment achieves; pairs that fit nowhere went to their home instance."""
    placement: Placement | None = None
    """The placement the instances belong to."""

    def load_per_rank(self, placement: Placement | None = None) -> torch.Tensor:
        """[R] routed pairs each rank receives. ``placement`` defaults to the assignment's own."""
        placement = placement if placement is not None else self.placement
        if placement is None:
            raise ValueError("InstanceAssignment.load_per_rank needs the placement")
        ranks = torch.tensor(placement.instance_rank, dtype=torch.int64)
        out = torch.zeros(placement.num_ranks, dtype=torch.int64)
        return out.index_add_(0, ranks, self.counts.sum(0))


def assign_instances(
    counts: torch.Tensor,
    placement: Placement,
    receive_limit: torch.Tensor | Sequence[int] | None = None,
) -> InstanceAssignment:
    """Assign every routed pair to an instance of its expert (docs/design.md, "InstanceAssignment").

    Args:
        counts: [R, E] integer n[s, e] (copied to CPU int64).
        placement: the instances; R and E must match ``counts``.
        receive_limit: [R] most pairs each rank can receive, or None for no limit.

    Returns:
        The assignment; the module docstring states the semantics (overflow first,
        then the most loaded rank, then locality, then a fixed fill order).
    """
    n = check_assignment_counts(counts, placement)
    limit = _check_receive_limit(receive_limit, placement.num_ranks)
    return assign_checked(n, placement, limit)[0]


def assign_checked(n: np.ndarray, placement: Placement,
                  receive_limit: np.ndarray | None) -> tuple[InstanceAssignment, np.ndarray]:
    """``assign_instances`` on checked input: (the assignment, [R] routed load per rank)."""
    out, load = _assign(n, placement, None if receive_limit is None else receive_limit.tolist())
    overflow = (0 if receive_limit is None
                else int(np.add.reduce(np.maximum(load - receive_limit, 0))))
    assignment = InstanceAssignment(counts=torch.from_numpy(out), overflow=overflow,
                                    placement=placement)
    return assignment, load


def _assign(n: np.ndarray, placement: Placement,
           cap: list[int] | None) -> tuple[np.ndarray, np.ndarray]:
    """``assign_instances`` on checked input: ([R, I] routed counts, [R] load per rank).

    Numpy and plain Python only: this runs once per layer and micro-batch, and a torch
    op costs ~10 us on these small arrays, a numpy op ~1 us. ``n`` is not modified.
    """
    layout = assignment_layout(placement)
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
    base: np.ndarray, cap: list[int] | None, totals: np.ndarray, layout: _AssignmentLayout,
) -> tuple[np.ndarray, list[int]]:
    """Per-instance totals x[k, j] of the replicated experts: min overflow, then min max.

    Returns x ([K, J] int64, 0 in the padding) and the rank loads with it. A transportation
    problem with an integral optimum, solved by augmenting paths in the transfer graph
    (rank r -> rank r' when an expert with pairs on r also has an instance on r'),
    moving whole blocks of pairs at a time:
      0. start from an even split of each expert over its instances;
      1. with receive limits, push the pairs above a limit to ranks with room until no
         over-full rank reaches one (a maximum flow: overflow is minimal), then move
         replica pairs still above a limit to their homes (the overflow stays equal,
         every home on the way being full);
      2. repair towards a level M that is a proven lower bound of the max load: push
         load above M to ranks below M (and below their limit). When a rank above M
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

    def __init__(self, x: list[list[int]], load: list[int], layout: _AssignmentLayout):
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
    """Move replica pairs above the limits to their homes (no augmenting path is left,
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


_ZERO = np.zeros(1, dtype=np.int64)
_ZERO.setflags(write=False)


def _fill_replicated(out: np.ndarray, n: np.ndarray, x: np.ndarray,
                     layout: _AssignmentLayout) -> None:
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


def check_assignment_counts(counts: torch.Tensor | np.ndarray,
                            placement: Placement) -> np.ndarray:
    """[R, E] int64 host counts (read in place where they are already), checked."""
    if isinstance(counts, np.ndarray):            # host counts the caller already read
        if counts.dtype.kind not in "iu":
            raise ValueError(f"counts must be an integer array, got dtype {counts.dtype}")
        if counts.shape != (placement.num_ranks, placement.num_experts):
            raise ValueError(f"counts must have shape [R, E] = "
                             f"{(placement.num_ranks, placement.num_experts)}, "
                             f"got {counts.shape}")
        n = counts.astype(np.int64, copy=False)
        if (n < 0).any():
            raise ValueError("counts must be non-negative")
        return n
    if not isinstance(counts, torch.Tensor):
        raise TypeError(f"counts must be a torch.Tensor or a numpy array, "
                        f"got {type(counts).__name__}")
    if counts.dim() != 2 or tuple(counts.shape) != (placement.num_ranks, placement.num_experts):
        raise ValueError(f"counts must have shape [R, E] = "
                         f"{(placement.num_ranks, placement.num_experts)}, "
                         f"got {tuple(counts.shape)}")
    if counts.dtype == torch.bool or counts.is_floating_point() or counts.is_complex():
        raise ValueError(f"counts must be an integer tensor, got dtype {counts.dtype}")
    # Host int64 counts are read in place (no tensor op); others are copied to them.
    n = (counts.numpy() if counts.dtype == torch.int64 and counts.device.type == "cpu"
         else counts.detach().to(device="cpu", dtype=torch.int64).numpy())
    if (n < 0).any():
        raise ValueError("counts must be non-negative")
    return n


def _check_receive_limit(receive_limit, num_ranks: int) -> np.ndarray | None:
    if receive_limit is None:
        return None
    if isinstance(receive_limit, torch.Tensor):
        cap = receive_limit.detach().to("cpu").numpy()
    else:
        cap = np.asarray(list(receive_limit))
    if cap.shape != (num_ranks,):
        raise ValueError(f"receive_limit must have {num_ranks} entries, got shape {cap.shape}")
    if cap.dtype.kind not in "iu" or (cap < 0).any():
        raise ValueError("receive_limit must hold non-negative integers")
    return cap.astype(np.int64)


