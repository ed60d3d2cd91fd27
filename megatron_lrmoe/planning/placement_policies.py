"""Placement policies: which replicas a layer hosts next step.

``popularity`` is the SYMI-style baseline (instances in proportion to popularity,
within a fixed number of slots per rank); ``memory-aware`` is LRMoE's greedy search on
a fluid load estimate, judged by the cost model under the memory budget. Both are pure
functions of the smoothed loads; ``planner.LayerPlanner`` calls them at a step boundary.
"""

from __future__ import annotations

import math

import numpy as np

from megatron_lrmoe.planning.native import native_greedy
from megatron_lrmoe.planning.placement import Placement
from megatron_lrmoe.planning.plan_types import MicroBatchPlan, PlannerSettings
from megatron_lrmoe.planning.retention import UNLIMITED_CAPACITY

__all__ = ["greedy_replicas", "popularity_placement"]


def popularity_placement(popularity: np.ndarray, num_ranks: int, num_experts: int,
                          slots: int) -> tuple[Placement, tuple[str, ...]]:
    """SYMI-style: R * slots instances, shared in proportion to popularity.

    Instances per expert c_e by the divisor (D'Hondt) method with c_e >= 1 (the home)
    and c_e <= R: the extra instances go one at a time to the expert with the largest
    expected load per instance P_e / c_e (ties: lower expert): proportional allocation
    that minimises the largest P_e / c_e over the counts alone. The counts ignore
    where instances can go (a replica may not share a rank with its expert's other
    instances), so after placement the result is not optimal in general. Replicas
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


def greedy_replicas(routed: list[int], base: MicroBatchPlan,
                     settings: PlannerSettings, native: bool = False,
                     sync_cost: dict[int, float] | None = None) -> list[tuple[int, int]]:
    """Replicas in the order a greedy search adds them, on a fluid load estimate.

    State: each expert's pairs spread over its instances' ranks (starting from
    Megatron's layout). A move takes the most loaded rank u, an expert with pairs on u
    (largest share first, up to four tried), and adds a replica of it on the least
    loaded rank not hosting it; the expert's pairs are then water-filled over its
    ranks with the other loads fixed. A move is allowed if u's load drops and no rank
    rises above the old maximum. The estimated time (``CostModel.load_time`` at the
    maximum load, retained load capped at the base plan's backward capacity, all-to-all
    pairs estimated as (R - 1) / R of the load; plus ``CostModel.
    replica_cost_per_microbatch``, the refresh and gradient reduction of the replicas
    amortised over the step's micro-batches) decides which prefix of moves to keep: the
    one with the lowest time, none when no prefix saves more than it costs. Ties between
    ranks at the maximum are why single moves are not judged alone: the maximum only
    falls once every rank at it has been relieved.

    The budget is not read: the caller admits a prefix or not by its memory, so that a
    larger budget admits every prefix a smaller one did (``LayerPlanner``'s memory-aware
    search is monotone in the budget); ``base`` must therefore be planned without the
    budget's influence too.

    ``native``: the moves by the compiled planner (``planning/native.py``: the same
    moves, to the bit); else in Python (the reference). ``sync_cost``: a cache of
    ``CostModel.replica_cost_per_microbatch`` by busiest count for ``settings.cost``
    (filled here), which a caller keeps across steps.
    """
    cost = settings.cost
    num_ranks, num_experts = settings.num_ranks, settings.num_experts
    per_rank = num_experts // num_ranks
    cap_count = int(base.retention.capacity[0])
    retained_cap = math.inf if cap_count == UNLIMITED_CAPACITY else float(cap_count)
    off_rank = (num_ranks - 1) / num_ranks

    if sync_cost is None:                 # replica_cost_per_microbatch by busiest
        sync_cost = {}

    def est_times(tops: list[float], busiest_sync: list[int]) -> np.ndarray:
        # Per micro-batch: the layer at the top load, plus what the replicas cost in
        # transfers amortised over the step's micro-batches; a prefix is kept only if
        # the time it saves exceeds that cost. Priced in one call per batch of moves.
        top = np.asarray(tops, dtype=np.float64)
        ret = np.minimum(top, retained_cap)
        for b in set(busiest_sync) - sync_cost.keys():
            sync_cost[b] = cost.replica_cost_per_microbatch(b)
        sync = np.array([sync_cost[b] for b in busiest_sync])
        return cost.load_times(top, ret, top * off_rank, ret * off_rank) + sync

    load = [0.0] * num_ranks
    spread: list[dict[int, float]] = []        # expert -> {hosting rank: its pairs}
    on_rank: list[list[int]] = [[] for _ in range(num_ranks)]
    for e, n in enumerate(routed):
        spread.append({e // per_rank: float(n)})
        load[e // per_rank] += n
        on_rank[e // per_rank].append(e)
    sync_sent, sync_recv = [0] * num_ranks, [0] * num_ranks
    busiest = 0
    added: list[tuple[int, int]] = []
    tops: list[float] = []           # after each move: the maximum load ...
    syncs: list[int] = []            # ... and the busiest replica sender or receiver
    compiled = native_greedy(routed, num_ranks, num_experts) if native else None
    best_time, best_len = float(est_times([max(load)], [0])[0]), 0
    priced = 0                       # moves whose time is known
    max_moves = num_ranks * (num_experts - per_rank)
    # The search stops once num_ranks moves in a row fail to beat the best prefix. Moves
    # do not depend on the times, so they are made in batches (on the best prefix known
    # so far), priced together, and the batch is cut where a move-by-move search would
    # have stopped: the same prefix, with one cost-model call per batch.
    exhausted = False                # no allowed move is left
    while True:
        if compiled is not None:        # the loop below, in one call
            target = min(max_moves, best_len + num_ranks + 1)
            if not exhausted and len(added) < target:
                moves, new_tops, new_syncs, exhausted = compiled.advance(target)
                added += moves
                tops += new_tops
                syncs += new_syncs
        while (compiled is None and not exhausted and len(added) < max_moves
               and len(added) - best_len <= num_ranks):
            if not _greedy_move(load, spread, on_rank, routed, num_ranks, added, per_rank,
                                sync_sent, sync_recv):
                exhausted = True
                break
            busiest = max(busiest, sync_sent[added[-1][0] // per_rank],
                          sync_recv[added[-1][1]])
            tops.append(max(load))
            syncs.append(busiest)
        if priced < len(added):
            times = est_times(tops[priced:], syncs[priced:])
            for k, t in enumerate(times.tolist(), start=priced + 1):
                if t < best_time * (1 - 1e-12):
                    best_time, best_len = t, k
                if k - best_len > num_ranks:
                    return added[:best_len]   # where the move-by-move search stops
            priced = len(added)
        if exhausted or len(added) >= max_moves:
            break
    return added[:best_len]


def _greedy_move(load: list[float], spread: list[dict[int, float]], on_rank: list[list[int]],
                 routed: list[int], num_ranks: int, added: list[tuple[int, int]],
                 per_rank: int, sync_sent: list[int], sync_recv: list[int]) -> bool:
    """One move of ``greedy_replicas`` (its doc), applied to the state in place; False
    when no allowed move exists."""
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
        new = dict(zip(ranks, _spread_to_level(float(routed[e]), others), strict=True))
        if new[u] >= hosts[u] - 1e-9:
            continue
        if all(r == u or o + new[r] <= top
               for r, o in zip(ranks, others, strict=True)):
            move = (e, v, ranks, others, new)
            break
    if move is None:
        return False
    e, v, ranks, others, new = move
    for r, o in zip(ranks, others, strict=True):
        load[r] = o + new[r]
    spread[e] = new
    on_rank[v].append(e)
    sync_sent[e // per_rank] += 1
    sync_recv[v] += 1
    added.append((e, v))
    return True


def _spread_to_level(amount: float, others: list[float]) -> list[float]:
    """Continuous water-filling of ``amount`` over ranks with loads ``others``: what
    each rank gets so that the receiving ranks end level and no other rank is above
    that level."""
    order = sorted(range(len(others)), key=others.__getitem__)
    prefix, level = 0.0, 0.0
    for m, j in enumerate(order):
        prefix += others[j]
        level = (amount + prefix) / (m + 1)
        if m + 1 == len(order) or level <= others[order[m + 1]]:
            break
    return [max(level - o, 0.0) for o in others]
