"""Placement policies: which replicas a layer hosts next step.

``popularity`` is the SYMI-style baseline (instances in proportion to popularity,
within a fixed number of slots per rank); ``memory-aware`` is LRMoE's choice among
candidate placements (the greedy searches and popularity placements here), judged by
the cost model under the memory budget. All are pure functions of the smoothed loads;
``planner.LayerPlanner`` calls them at the first read of a step's placement.

Locality: the instance assignment sends a source's pairs to an instance on its own rank
first (``instance_assignment``), and those pairs cross no link. The ``local_*`` variants
see the [R, E] counts, not only the per-expert totals: a replica placed on a rank that
routes to its expert takes that rank's pairs off the network (docs/design.md,
"Placement").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from megatron_lrmoe.planning.cost_model import CostModel
from megatron_lrmoe.planning.native import (
    native_available,
    native_greedy,
    native_local_greedy,
    native_popularity,
    native_pricer,
)
from megatron_lrmoe.planning.placement import Placement
from megatron_lrmoe.planning.plan_types import PlannerSettings
from megatron_lrmoe.planning.retention import UNLIMITED_CAPACITY

__all__ = ["PairSeconds", "dhondt_order", "greedy_replicas", "local_greedy_replicas",
           "pair_seconds", "popularity_placement", "popularity_replicas"]


@dataclass(frozen=True)
class PairSeconds:
    """The cost model linearised at the balanced load, per pair and call (forward +
    backward): ``compute`` seconds a rank spends on one more routed row, ``network``
    seconds one more pair on the busiest link costs. The locality-aware rank choices
    weigh a rank's load against its off-rank traffic with them."""

    compute: float
    network: float


def pair_seconds(cost: CostModel) -> PairSeconds:
    """``PairSeconds`` of ``cost``: finite differences of ``CostModel.load_time`` around
    P = ``shape.source_pairs`` rows (the balanced load)."""
    p = float(max(cost.shape.source_pairs, 1))
    base = cost.load_time(p, p, 0.0, 0.0)
    return PairSeconds(compute=max((cost.load_time(2 * p, 2 * p, 0.0, 0.0) - base) / p, 0.0),
                       network=max((cost.load_time(p, p, p, p) - base) / p, 0.0))


def popularity_placement(popularity: np.ndarray, num_ranks: int, num_experts: int,
                          slots: int, counts: np.ndarray | None = None,
                          weights: PairSeconds | None = None, native: bool = False,
                          order: np.ndarray | None = None
                          ) -> tuple[Placement, tuple[str, ...]]:
    """``popularity_replicas`` as a ``Placement``."""
    replicas, notes = popularity_replicas(popularity, num_ranks, num_experts, slots, counts,
                                          weights, native, order)
    return Placement(num_ranks, num_experts, replicas), notes


def dhondt_order(popularity: np.ndarray, num_ranks: int) -> np.ndarray:
    """The D'Hondt quotients P_e / c of every expert and instance count c = 2..R, by
    decreasing value (ties: lower expert, then lower c), as flat indices e * (R - 1) +
    c - 2: what ``popularity_replicas`` takes its extra instances from, in order. The
    same for every slot count, so a caller trying several computes it once."""
    pop = np.maximum(np.asarray(popularity, dtype=np.float64), 0.0)
    quotients = (pop[:, None] / np.arange(2, num_ranks + 1)[None, :]).ravel()   # [E * (R-1)]
    return np.argsort(-quotients, kind="stable")


def popularity_replicas(popularity: np.ndarray, num_ranks: int, num_experts: int,
                        slots: int, counts: np.ndarray | None = None,
                        weights: PairSeconds | None = None, native: bool = False,
                        order: np.ndarray | None = None
                        ) -> tuple[tuple[tuple[int, int], ...], tuple[str, ...]]:
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

    ``counts`` [R, E] with ``weights``: the locality-aware rank choice (LRMoE's
    candidate; without them, SYMI-style's own, which sees the totals only). Each
    instance of e is expected to take p_e = P_e / c_e pairs, min(n[r, e], p_e) of them
    from its own rank r (the assignment sends local pairs first). A replica then goes to
    the eligible rank whose own expected time after it is the least:
    ``weights.compute`` x its load + ``weights.network`` x the larger of its off-rank
    pairs sent and received (ties: lower rank).
    """
    if counts is not None and weights is None:
        raise ValueError("popularity_placement: counts without weights")
    kind = "popularity" if counts is None else "popularity (locality-aware)"
    if native and native_available():
        replicas, skipped = native_popularity(
            popularity, num_ranks, num_experts, slots, counts,
            *((0.0, 0.0) if weights is None else (weights.compute, weights.network)))
    else:
        replicas, skipped = _popularity_replicas(popularity, num_ranks, num_experts, slots,
                                                 counts, weights, order)
    if not replicas and not skipped:
        return (), ()
    notes = (f"{kind}: {len(replicas)} replicas in {slots} slots per rank",)
    if skipped:
        notes += (f"{kind}: {skipped} replica(s) found no free rank",)
    return tuple(replicas), notes


def _popularity_replicas(popularity: np.ndarray, num_ranks: int, num_experts: int,
                         slots: int, counts: np.ndarray | None, weights: PairSeconds | None,
                         order: np.ndarray | None) -> tuple[list[tuple[int, int]], int]:
    """``popularity_replicas`` in Python (the reference of the compiled one): (replicas,
    skipped)."""
    per_rank = num_experts // num_ranks
    extra = num_ranks * slots - num_experts
    pop = np.maximum(np.asarray(popularity, dtype=np.float64), 0.0)
    if extra <= 0 or num_ranks == 1 or pop.sum() <= 0:
        return [], 0
    quotients = (pop[:, None] / np.arange(2, num_ranks + 1)[None, :]).ravel()   # [E * (R-1)]
    order = (dhondt_order(pop, num_ranks) if order is None else order)[:extra]
    order = order[quotients[order] > 0]
    instances = 1 + np.bincount(order // (num_ranks - 1), minlength=num_experts)
    per_instance = pop / instances
    rank_load = per_instance.reshape(num_ranks, per_rank).sum(1)
    experts = sorted(np.nonzero(instances > 1)[0].tolist(),
                     key=lambda e: (-instances[e], -pop[e], e))
    local = received_off = sent_off = None
    if counts is not None:
        n = np.maximum(np.asarray(counts, dtype=np.float64), 0.0)            # [R, E]
        # local[r, e]: pairs of rank r an instance of e on r is expected to keep
        local = np.minimum(n, per_instance[None, :])
        home = np.arange(num_experts) // per_rank
        kept = np.bincount(home, weights=local[home, np.arange(num_experts)],
                           minlength=num_ranks)
        received_off = rank_load - kept
        sent_off = n.sum(1) - kept
    extra_of = [int(instances[e]) - 1 for e in experts]
    args = (experts, extra_of, per_instance.tolist(), rank_load.tolist(), slots - per_rank,
            per_rank, num_ranks)
    local_args = (None if local is None else
                  (local, received_off.tolist(), sent_off.tolist(), weights.compute,
                   weights.network))
    return _place_popularity(*args, local_args)


def _place_popularity(experts: list[int], extra_of: list[int], per_instance: list[float],
                      rank_load: list[float], free_slots: int, per_rank: int, num_ranks: int,
                      local: tuple | None) -> tuple[list[tuple[int, int]], int]:
    """``popularity_placement``'s placement loop (its doc): (replicas, skipped). Plain
    float operations in numpy's order, so the compiled loop repeats them to the bit."""
    load = list(rank_load)
    free = [free_slots] * num_ranks
    replicas: list[tuple[int, int]] = []
    skipped = 0
    if local is not None:
        table, received_off, sent_off, compute, network = local
        received_off, sent_off = list(received_off), list(sent_off)
    for e, extra in zip(experts, extra_of, strict=True):
        hosts = {e // per_rank}
        p = per_instance[e]
        for placed in range(extra):
            eligible = [r for r in range(num_ranks) if free[r] > 0 and r not in hosts]
            if not eligible:
                skipped += extra - placed
                break
            if local is None:
                r = min(eligible, key=lambda r: (load[r], r))
            else:
                gain = table[:, e].tolist()
                own = [compute * (load[r] + p)
                       + network * max(sent_off[r] - gain[r], received_off[r] + p - gain[r])
                       if r in eligible else math.inf for r in range(num_ranks)]
                r = min(eligible, key=lambda r: (own[r], r))
                g = gain[r]
                received_off[r] += p - g
                sent_off[r] -= g
            replicas.append((e, r))
            hosts.add(r)
            free[r] -= 1
            load[r] += p
    return replicas, skipped


def greedy_replicas(routed: list[int], capacity: int,
                     settings: PlannerSettings, native: bool = False,
                     sync_cost: dict[int, float] | None = None) -> list[tuple[int, int]]:
    """Replicas in the order a greedy search adds them, on a fluid load estimate.

    State: each expert's pairs spread over its instances' ranks (starting from
    Megatron's layout). A move takes the most loaded rank u, an expert with pairs on u
    (largest share first, up to four tried), and adds a replica of it on the least
    loaded rank not hosting it; the expert's pairs are then water-filled over its
    ranks with the other loads fixed. A move is allowed if u's load drops and no rank
    rises above the old maximum. The estimated time (``CostModel.load_time`` at the
    maximum load, retained load capped at the backward ``capacity``, all-to-all
    pairs estimated as (R - 1) / R of the load; plus ``CostModel.
    replica_cost_per_microbatch``, the refresh and gradient reduction of the replicas
    amortised over the step's micro-batches) decides which prefix of moves to keep: the
    one with the lowest time, none when no prefix saves more than it costs. Ties between
    ranks at the maximum are why single moves are not judged alone: the maximum only
    falls once every rank at it has been relieved.

    The budget is not read: the caller admits a prefix or not by its memory, so that a
    larger budget admits every prefix a smaller one did (``LayerPlanner``'s memory-aware
    search is monotone in the budget); ``capacity`` is therefore the configured gamma's
    (``retention.capacity_for_factor`` of the routed pairs, ``UNLIMITED_CAPACITY`` at
    gamma = inf), not a lowered one.

    ``native``: the search compiled, moves and prices (``GreedyReplicas.best_prefix``,
    ``planning/native.py``: the same prefix, to the bit); else in Python (the
    reference). ``sync_cost``: a cache of ``CostModel.replica_cost_per_microbatch`` by
    busiest count for ``settings.cost`` (filled by the Python search), which a caller
    keeps across steps.
    """
    cost = settings.cost
    num_ranks, num_experts = settings.num_ranks, settings.num_experts
    per_rank = num_experts // num_ranks
    retained_cap = math.inf if capacity == UNLIMITED_CAPACITY else float(capacity)
    max_moves = num_ranks * (num_experts - per_rank)
    if native:                          # the search below, compiled
        return native_greedy(routed, num_ranks, num_experts).best_prefix(
            native_pricer(cost), retained_cap, max_moves)
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
    best_time, best_len = float(est_times([max(load)], [0])[0]), 0
    priced = 0                       # moves whose time is known
    # The search stops once num_ranks moves in a row fail to beat the best prefix. Moves
    # do not depend on the times, so they are made in batches (on the best prefix known
    # so far), priced together, and the batch is cut where a move-by-move search would
    # have stopped: the same prefix, with one cost-model call per batch.
    exhausted = False                # no allowed move is left
    while True:
        while (not exhausted and len(added) < max_moves
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


def local_greedy_replicas(counts: np.ndarray, capacity: int,
                          settings: PlannerSettings, native: bool = False,
                          sync_cost: dict[int, float] | None = None) -> list[tuple[int, int]]:
    """``greedy_replicas``' search on the [R, E] ``counts``, seeing locality.

    The same fluid state and moves (relieve the most loaded rank u with a replica of one
    of its four largest experts, water-filled, allowed if u's load drops and no rank
    rises above the old maximum), with two differences:

    - the replica's rank: first the rank outside the expert's hosts that routes the
      most pairs to it (ties: less loaded, then lower rank), else, if that move is not
      allowed, the least loaded one as ``greedy_replicas`` takes;
    - the estimate's all-to-all: the busiest link's off-rank pairs of the fluid state,
      max over ranks of max(sent, received) minus the pairs it keeps (an instance on
      rank r of expert e with x pairs keeps min(n[r, e], x) of them off the network),
      where ``greedy_replicas`` assumes (R - 1) / R of the top load.

    The prefix kept is the one with the lowest estimate, as there. The budget is not read
    (``greedy_replicas``). ``native``: the search compiled, moves and prices
    (``LocalGreedyReplicas.best_prefix``: the same prefix, to the bit), where the
    extension has it.
    """
    cost = settings.cost
    num_ranks, num_experts = settings.num_ranks, settings.num_experts
    per_rank = num_experts // num_ranks
    retained_cap = math.inf if capacity == UNLIMITED_CAPACITY else float(capacity)
    if sync_cost is None:
        sync_cost = {}
    n_array = np.maximum(np.asarray(counts, dtype=np.float64), 0.0)        # [R, E]
    max_moves = num_ranks * (num_experts - per_rank)

    def est_times(tops: list[float], nets: list[float], busiest: list[int]) -> np.ndarray:
        top = np.asarray(tops, dtype=np.float64)
        net = np.asarray(nets, dtype=np.float64)
        ret = np.minimum(top, retained_cap)
        # the retained pairs cross the links in the routed pairs' proportions
        net_ret = np.where(top > 0, net * (ret / np.where(top > 0, top, 1.0)), 0.0)
        for b in set(busiest) - sync_cost.keys():
            sync_cost[b] = cost.replica_cost_per_microbatch(b)
        sync = np.array([sync_cost[b] for b in busiest])
        return cost.load_times(top, ret, net, net_ret) + sync

    if native and native_available():   # the search below, compiled
        return native_local_greedy(n_array, num_ranks, num_experts).best_prefix(
            native_pricer(cost), retained_cap, max_moves)
    n = n_array.tolist()
    routed = [sum(n[r][e] for r in range(num_ranks)) for e in range(num_experts)]
    row_total = [sum(row) for row in n]
    load = [0.0] * num_ranks
    kept = [0.0] * num_ranks                   # pairs each rank keeps off the network
    spread: list[dict[int, float]] = []        # expert -> {hosting rank: its pairs}
    on_rank: list[list[int]] = [[] for _ in range(num_ranks)]
    for e, total in enumerate(routed):
        home = e // per_rank
        spread.append({home: total})
        load[home] += total
        kept[home] += n[home][e]
        on_rank[home].append(e)

    def network() -> float:
        return max(max(a, b) - k for a, b, k in zip(load, row_total, kept, strict=True))

    sent, received = [0] * num_ranks, [0] * num_ranks
    busiest = 0
    added: list[tuple[int, int]] = []
    tops: list[float] = []
    nets: list[float] = []
    syncs: list[int] = []
    best_time, best_len = float(est_times([max(load)], [network()], [0])[0]), 0
    priced = 0
    exhausted = False
    # Moves in batches priced together; the search stops once R moves in a row fail to
    # beat the best prefix (as greedy_replicas).
    while True:
        while (not exhausted and len(added) < max_moves
               and len(added) - best_len <= num_ranks):
            move = _local_move(load, spread, on_rank, routed, n, num_ranks)
            if move is None:
                exhausted = True
                break
            e, v, new = move
            for r, x in new.items():
                old = spread[e].get(r, 0.0)
                load[r] += x - old
                kept[r] += min(n[r][e], x) - min(n[r][e], old)
            spread[e] = new
            on_rank[v].append(e)
            sent[e // per_rank] += 1
            received[v] += 1
            busiest = max(busiest, sent[e // per_rank], received[v])
            added.append((e, v))
            tops.append(max(load))
            nets.append(network())
            syncs.append(busiest)
        if priced < len(added):
            times = est_times(tops[priced:], nets[priced:], syncs[priced:])
            for k, t in enumerate(times.tolist(), start=priced + 1):
                if t < best_time * (1 - 1e-12):
                    best_time, best_len = t, k
                if k - best_len > num_ranks:
                    return added[:best_len]
            priced = len(added)
        if exhausted or len(added) >= max_moves:
            break
    return added[:best_len]


def _local_move(load: list[float], spread: list[dict[int, float]], on_rank: list[list[int]],
                routed: list[float], n: list[list[float]], num_ranks: int
                ) -> tuple[int, int, dict[int, float]] | None:
    """One move of ``local_greedy_replicas`` (its doc): (expert, new rank, the expert's
    new pairs per hosting rank), or None when no allowed move exists. The state is not
    changed here."""
    top = max(load)
    u = load.index(top)
    for e in sorted(on_rank[u], key=lambda e: (-spread[e][u], e))[:4]:
        hosts = spread[e]
        if len(hosts) >= num_ranks:
            continue
        outside = [r for r in range(num_ranks) if r not in hosts]
        nearest = min(outside, key=lambda r: (-n[r][e], load[r], r))
        least = min(outside, key=lambda r: (load[r], r))
        for v in (nearest,) if nearest == least else (nearest, least):
            move = _spread_move(load, hosts, float(routed[e]), u, v, top)
            if move is not None:
                return e, v, move[2]
    return None


def _spread_move(load: list[float], hosts: dict[int, float], routed: float, u: int, v: int,
                 top: float) -> tuple[list[int], list[float], dict[int, float]] | None:
    """An expert's ``routed`` pairs, now on ``hosts``, water-filled over them and rank
    ``v``: (the ranks, their loads without the expert, its new pairs per rank) if that
    lowers the top rank ``u``'s share and lifts no rank above ``top``, else None."""
    ranks = [*hosts, v]
    others = [load[r] - h for r, h in hosts.items()]
    others.append(load[v])
    new = dict(zip(ranks, _spread_to_level(routed, others), strict=True))
    if new[u] >= hosts[u] - 1e-9:
        return None
    if all(r == u or o + new[r] <= top for r, o in zip(ranks, others, strict=True)):
        return ranks, others, new
    return None


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
        spread_move = _spread_move(load, hosts, float(routed[e]), u, v, top)
        if spread_move is not None:
            move = (e, v, *spread_move)
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
