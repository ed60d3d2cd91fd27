"""Retention-quota planner: how many routed pairs each (source, instance) cell keeps in backward.

This is the default policy "backward capacity water-filling" (docs/design.md,
"Retention"), over any instance layout: without replicas every expert has
one instance, its home under Megatron's expert-parallel layout; with replicas
(``instance_rank`` / ``instance_expert``) water-filling runs over each rank's
instances, whatever their experts. The planner is pure: a function of
the gathered counts and two numbers, with no process group and no config object,
and every rank computes the same plan from the same counts.

Notation (docs/design.md, "Notation")
  R        ranks of the expert-parallel group
  E        experts; Megatron's layout puts expert e on rank e // (E / R)
  I        instances (copies of an expert's weights). Without replicas I == E,
           instance i is expert i on its home rank, and ``instance_rank`` /
           ``instance_expert`` are the identity layout. Columns of every [R, I]
           matrix are indexed by instance.
  E_loc    E / R, instances per rank
  n[s, i]  routed pairs from source rank s to instance i (``counts``)
  N_i      sum_s n[s, i], routed pairs of instance i
  L_r      sum of N_i over the instances on rank r, the routed load of rank r
  gamma    the backward capacity factor; m the minimum retention
  C_r      ceil(gamma * sum_r L_r / R), backward capacity of rank r (the same for all)
  f_i      ceil(m * N_i), the floor of instance i (pairs it always keeps)
  T_r      backward target of rank r: L_r if L_r <= C_r, else max(C_r, sum_i f_i)
  tau_r    water level of rank r: sum over its instances of clamp(tau_r, f_i, N_i) = T_r
  Q_i      pairs of instance i kept in backward, sum over rank r's instances = T_r
  q[s, i]  pairs of cell (s, i) kept in backward (``quotas``), sum_s q[s, i] = Q_i

Semantics
  * Ranks with L_r <= C_r keep every pair: q[s, i] = n[s, i].
  * On a rank with L_r > C_r, the quotas are the water-filling of T_r over the
    rank's instances with box constraints f_i <= Q_i <= N_i: Q_i = clamp(tau_r, f_i, N_i).
    Only instances above the level lose pairs; an instance whose floor is above
    the level keeps exactly its floor. This is the unique allocation that makes
    the largest instance quota as small as possible, then the second largest,
    and so on (the backward load is as flat as the floors allow). With m = 0 it
    is plain water-filling: sum_i min(N_i, tau_r) = C_r.
  * Floors win over capacity: when sum_i f_i > C_r the rank keeps exactly its
    floors, more than its capacity, and ``over_capacity`` reports it.
  * Integers: t_r = floor(tau_r) is the largest integer level with
    sum_i clamp(t_r, f_i, N_i) <= T_r; the T_r - sum_i clamp(t_r, f_i, N_i) units
    left over (fewer than the instances at the level that could take one) go one
    each to instances with f_i <= t_r < N_i, largest N_i first, ties by lower
    instance index. So Q_i <= N_i and the sum is exactly T_r.
  * Q_i is split across sources in proportion to n[s, i] with largest-remainder
    rounding (ties by lower source index): sum_s q[s, i] = Q_i exactly,
    q[s, i] <= n[s, i] and |q[s, i] - Q_i * n[s, i] / N_i| < 1.
  * gamma = inf drops nothing (floors are moot); ``capacity`` is then
    ``UNLIMITED_CAPACITY`` (the int64 maximum), so comparisons such as
    ``retained <= capacity`` hold without a special case.
  * gamma and m are read as the decimal their ``repr`` shows (1.1 means 11/10,
    0.1 means 1/10) and C_r and f_i are computed exactly in integers, so
    gamma = 1.1 on a mean load of 100 gives C_r = 110, not 111.

Tensors: every tensor in and out is a torch int64 tensor on the CPU. ``counts``
on another device is copied to the host (a device sync): gather the counts and
bring them to the host once per layer and micro-batch, then call the planner.

Speed: the planner runs once per layer and micro-batch on one CPU thread, so it
works in numpy int64 (a small op costs ~1 us, a torch op ~10 us), only on the ranks
and instances that lose pairs, and caches what depends on the layout alone (the
validated ``instance_rank`` / ``instance_expert`` tuples and their index arrays) and
the decimal parsing of gamma and m. The results are those of the integer rules
above, to the unit; tests compare them with an exact rational reference.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from functools import cached_property, lru_cache
from typing import Final

import numpy as np
import torch

from megatron_lrmoe.options.lrmoe import check_capacity_factor, check_fraction

__all__ = [
    "UNLIMITED_CAPACITY",
    "RetentionPlan",
    "capacity_for_factor",
    "decimal_fraction",
    "factor_for_capacity",
    "plan_retention",
    "retention_in_forward",
    "rule_reads_metric",
    "stored_counts",
    "stored_in_forward",
    "stored_quotas",
]

TWO_STAGE: Final[str] = "two-stage"
"""The selection rule that stores a superset in forward and draws the quota in backward."""

UNLIMITED_CAPACITY: Final[int] = torch.iinfo(torch.int64).max
"""``capacity`` of every rank when gamma = inf: nothing is dropped."""


@dataclass(frozen=True, eq=False)
class RetentionPlan:
    """The retention plan of one layer and micro-batch: routed counts and backward quotas.

    A value (STYLE lesson 2): the region's forward and backward receive it
    explicitly. Tensors are int64 on the CPU and must not be modified. Equality
    is identity (``eq=False``): compare tensors with ``torch.equal``.
    """

    counts: torch.Tensor
    """[R, I] n[s, i]: routed pairs from source rank s to instance i."""
    quotas: torch.Tensor
    """[R, I] q[s, i] <= n[s, i]: pairs of cell (s, i) kept in backward."""
    capacity: torch.Tensor
    """[R] C_r, backward capacity per rank; ``UNLIMITED_CAPACITY`` when gamma = inf."""
    water_level: torch.Tensor
    """[R] floor(tau_r) on ranks over capacity; on the others the largest N_i of the
    rank (a level nothing is above). On every rank: Q_i < N_i implies Q_i >= level,
    and N_i <= level implies Q_i = N_i."""
    instance_rank: tuple[int, ...]
    """instance -> rank hosting it (home rank e // E_loc without replicas)."""
    instance_expert: tuple[int, ...]
    """instance -> expert whose weights it holds (identity without replicas)."""
    capacity_factor: float = math.inf
    """gamma the plan was made with (for logs)."""
    min_retention: float = 0.0
    """m the plan was made with (for logs)."""

    def __post_init__(self) -> None:
        r, i = self.counts.shape
        if self.quotas.shape != (r, i):
            raise ValueError(
                f"quotas must have counts' shape {(r, i)}, got {tuple(self.quotas.shape)}")
        for name in ("capacity", "water_level"):
            if getattr(self, name).shape != (r,):
                raise ValueError(f"{name} must have shape ({r},), got {getattr(self, name).shape}")
        if len(self.instance_rank) != i or len(self.instance_expert) != i:
            raise ValueError(f"instance_rank and instance_expert must have {i} entries")

    # ------------------------------------------------------------------ sizes
    @property
    def num_ranks(self) -> int:
        """R."""
        return self.counts.shape[0]

    @property
    def num_instances(self) -> int:
        """I (== E without replicas)."""
        return self.counts.shape[1]

    # ---------------------------------------------------------- per instance
    @cached_property
    def routed_per_instance(self) -> torch.Tensor:
        """[I] N_i, routed pairs of each instance."""
        return self.counts.sum(0)

    @cached_property
    def retained_per_instance(self) -> torch.Tensor:
        """[I] Q_i, retained pairs of each instance."""
        return self.quotas.sum(0)

    # --------------------------------------------------------------- per rank
    @cached_property
    def _rank_index(self) -> torch.Tensor:
        return torch.tensor(self.instance_rank, dtype=torch.int64)

    @cached_property
    def routed_matrix(self) -> torch.Tensor:
        """[R, R] routed pairs from source rank (row) to destination rank (column)."""
        out = torch.zeros(self.num_ranks, self.num_ranks, dtype=torch.int64)
        return out.index_add_(1, self._rank_index, self.counts)

    @cached_property
    def retained_matrix(self) -> torch.Tensor:
        """[R, R] retained pairs from source rank (row) to destination rank (column)."""
        out = torch.zeros(self.num_ranks, self.num_ranks, dtype=torch.int64)
        return out.index_add_(1, self._rank_index, self.quotas)

    @property
    def routed_per_rank(self) -> torch.Tensor:
        """[R] L_r, routed pairs each rank's instances receive (forward load)."""
        return self.routed_matrix.sum(0)

    @property
    def retained_per_rank(self) -> torch.Tensor:
        """[R] retained pairs each rank's instances receive (backward load)."""
        return self.retained_matrix.sum(0)

    @property
    def overloaded(self) -> torch.Tensor:
        """[R] bool, ranks whose routed load exceeds their capacity (water-filled)."""
        return self.routed_per_rank > self.capacity

    @property
    def over_capacity(self) -> torch.Tensor:
        """[R] bool, ranks that keep more than their capacity because floors win."""
        return self.retained_per_rank > self.capacity

    # ----------------------------------------------------------------- totals
    @property
    def routed(self) -> int:
        """Total routed pairs (host value)."""
        return int(self.counts.sum())

    @property
    def retained(self) -> int:
        """Total retained pairs (host value)."""
        return int(self.quotas.sum())

    @property
    def retained_fraction(self) -> float:
        """retained / routed; 1.0 when nothing was routed."""
        routed = self.routed
        return self.retained / routed if routed else 1.0

    # ----------------------------------------------------- all-to-all splits
    def forward_send_splits(self, source: int) -> list[int]:
        """Routed rows ``source`` sends to each rank, by destination rank (forward dispatch)."""
        return self.routed_matrix[source].tolist()

    def forward_recv_splits(self, dest: int) -> list[int]:
        """Routed rows ``dest`` receives from each rank, by source rank (forward dispatch)."""
        return self.routed_matrix[:, dest].tolist()

    def send_splits(self, source: int) -> list[int]:
        """Retained rows ``source`` sends to each rank, by destination rank (backward)."""
        return self.retained_matrix[source].tolist()

    def recv_splits(self, dest: int) -> list[int]:
        """Retained rows ``dest`` receives from each rank, by source rank (backward)."""
        return self.retained_matrix[:, dest].tolist()

    # ------------------------------------------------------------------- logs
    def describe(self) -> str:
        """One line for logs: totals, capacity, ranks cut, ranks over capacity, peak loads."""
        cap = int(self.capacity[0]) if self.num_ranks else 0
        cap_text = "inf" if cap == UNLIMITED_CAPACITY else str(cap)
        return (
            f"retention plan R={self.num_ranks} I={self.num_instances} "
            f"gamma={self.capacity_factor:g} m={self.min_retention:g}: "
            f"kept {self.retained}/{self.routed} pairs ({self.retained_fraction:.1%}), "
            f"C={cap_text}, cut ranks {int(self.overloaded.sum())}/{self.num_ranks}, "
            f"over capacity {int(self.over_capacity.sum())}, "
            f"max rank load fwd {int(self.routed_per_rank.max())} "
            f"bwd {int(self.retained_per_rank.max())}"
        )


def plan_retention(
    counts: torch.Tensor,
    num_ranks: int,
    capacity_factor: float = 1.0,
    min_retention: float = 0.0,
    instance_rank: Sequence[int] | None = None,
    instance_expert: Sequence[int] | None = None,
) -> RetentionPlan:
    """Plan backward retention quotas by capacity water-filling (docs/design.md, "Retention").

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
    n = _check_counts(counts, num_ranks, layout_given=instance_rank is not None)
    gamma = _check_capacity_factor(capacity_factor)
    floor_share = _check_min_retention(min_retention)
    layout = _layout(n.shape[1], num_ranks, _layout_key(instance_rank),
                     _layout_key(instance_expert))

    # The arithmetic runs in numpy int64 on [R, K] and [R, I] arrays of a few thousand
    # entries: a numpy op costs ~1 us there, a torch op ~10 us, and this runs once per
    # layer and micro-batch. Integer results are identical (same int64 operations).
    # Per-rank arrays are [K, R] (ranks last, contiguous), and reductions call
    # ufunc.reduce: the .sum / .max methods' Python wrappers cost more than the work.
    cells = n.numpy()                                   # [R, I] n[s, i], a view
    routed = np.add.reduce(cells, axis=0)               # [I] N_i
    routed_loc = layout.per_rank(routed)                # [K, R] N_i of each rank's instances
    load = np.add.reduce(routed_loc, axis=0)            # [R] L_r
    bound = int(np.maximum.reduce(routed))              # max N_i

    if gamma is None:
        capacity = np.full(num_ranks, UNLIMITED_CAPACITY, dtype=np.int64)
        kept = routed
        level = np.maximum.reduce(routed_loc, axis=0)
    else:
        cap = capacity_for_factor(float(capacity_factor), int(np.add.reduce(load)), num_ranks)
        capacity = np.full(num_ranks, cap, dtype=np.int64)
        if floor_share:
            floors = layout.per_rank(_floors(routed, floor_share))       # [K, R] f_i
            floor_sum = np.add.reduce(floors, axis=0)
            target = np.minimum(load, np.maximum(capacity, floor_sum))  # [R] T_r
        else:                                           # m = 0: no floors, T_r = min(L_r, C)
            floors = np.zeros_like(routed_loc)
            target = np.minimum(load, capacity)
        kept_loc, level = _integer_fill_with_floors(routed_loc, floors, target, load, bound)
        kept = kept_loc.reshape(-1)[layout.position]    # each instance sits in one place

    return RetentionPlan(
        counts=n,
        quotas=torch.from_numpy(_split_by_source(cells, routed, kept, bound)),
        capacity=torch.from_numpy(capacity),
        water_level=torch.from_numpy(level),
        instance_rank=layout.instance_rank,
        instance_expert=layout.instance_expert,
        capacity_factor=float(capacity_factor),
        min_retention=float(min_retention),
    )


# ---------------------------------------------------------------------------
# Layout (cached: a placement is reused for every layer call of a training step)
# ---------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class _Layout:
    """A validated instance layout and the index arrays the planner derives from it."""

    instance_rank: tuple[int, ...]
    instance_expert: tuple[int, ...]
    grid: np.ndarray
    """[K, R] the instance ids of each rank (a column) in ascending order; padding places
    (ranks with fewer than K instances) hold 0 and are masked by ``filled``. Ranks are
    the last, contiguous axis: numpy's inner loops then run over R, not over a short K."""
    filled: np.ndarray | None
    """[K, R] int64 1 on real places, 0 on padding; None when no rank has padding."""
    position: np.ndarray
    """[I] flat index into [K, R] of each instance's place (the inverse of ``grid``)."""

    def per_rank(self, values: np.ndarray) -> np.ndarray:
        """[K, R] values[i] of each rank's instances, 0 in the padding places."""
        out = values[self.grid]
        if self.filled is not None:
            out *= self.filled
        return out


def _layout_key(values: Sequence[int] | None) -> tuple[int, ...] | None:
    """A hashable cache key: tuples as given (no copy), anything else as a tuple of ints."""
    if values is None or type(values) is tuple:
        return values
    return tuple(int(v) for v in values)


# Bounded by the number of distinct placements alive at once: one per MoE layer and
# step (a few hundred entries of a few KB each). A layer loop over more layers than
# this would evict on every call and only lose the speed-up, never correctness.
@lru_cache(maxsize=1024)
def _layout(
    num_instances: int, num_ranks: int, instance_rank: tuple[int, ...] | None,
    instance_expert: tuple[int, ...] | None,
) -> _Layout:
    # Equal keys give equal results: entries are compared with ==, and int() of equal
    # numbers is equal, so a cached entry is what the uncached call would return.
    # Exceptions are not cached.
    ranks, experts = _check_layout(num_instances, num_ranks, instance_rank, instance_expert)
    rank_of = np.asarray(ranks, dtype=np.int64)
    per_rank = np.bincount(rank_of, minlength=num_ranks)
    width = max(int(per_rank.max()), 1)
    order = np.argsort(rank_of, kind="stable")          # instances by rank, then id
    starts = np.cumsum(per_rank) - per_rank
    column = np.arange(num_instances) - starts[rank_of[order]]
    grid = np.zeros((width, num_ranks), dtype=np.int64)
    grid[column, rank_of[order]] = order
    filled = np.zeros((width, num_ranks), dtype=np.int64)
    filled[column, rank_of[order]] = 1
    position = np.empty(num_instances, dtype=np.int64)
    position[order] = column * num_ranks + rank_of[order]
    for array in (grid, filled, position):
        array.setflags(write=False)
    return _Layout(ranks, experts, grid, None if filled.all() else filled, position)


# ---------------------------------------------------------------------------
# Steps
# ---------------------------------------------------------------------------


def _integer_fill_with_floors(
    routed: np.ndarray, floors: np.ndarray, target: np.ndarray, load: np.ndarray, bound: int
) -> tuple[np.ndarray, np.ndarray]:
    """Integer water-filling with floors, every rank at once.

    Args:
        routed: [K, R] N_i of each rank's instances (0 in padding places).
        floors: [K, R] f_i, 0 <= f_i <= N_i.
        target: [R] T_r with sum_i f_i <= T_r <= L_r.
        load: [R] L_r = sum_i N_i.
        bound: max N_i.

    Returns:
        ([K, R] Q_i, [R] level): Q_i = N_i and level = max N_i on ranks with T_r == L_r.

    S(t) = sum_i clamp(t, f_i, N_i) is piecewise linear and nondecreasing in t, with
    breaks only at the values f_i and N_i. The last break b with S(b) <= T_r and
    the slope after it (the instances with f_i <= b < N_i) give the largest
    integer level t with S(t) <= T_r in closed form, without a search.
    """
    level = np.maximum.reduce(routed, axis=0)
    cut = np.flatnonzero(target < load)
    if not cut.size:
        return routed, level
    kept = routed.copy()                         # fill in the cut ranks' columns only
    routed, floors, target = routed[:, cut], floors[:, cut], target[cut]
    breaks = np.concatenate([floors, routed], axis=0)
    breaks.sort(axis=0)                                              # [2K, R_cut]
    s_at = np.add.reduce(np.maximum(floors[None, :, :],
                                    np.minimum(routed[None, :, :], breaks[:, None, :])),
                         axis=1)                                     # [2K, R_cut] S(b)
    last = np.add.reduce(s_at <= target, axis=0) - 1                 # >= 0: S(min f) = sum f
    ranks = np.arange(cut.size)
    b = breaks[last, ranks]                                          # [R_cut]
    slope = np.add.reduce((floors <= b) & (b < routed), axis=0)      # > 0 on cut ranks
    cut_level = b + (target - s_at[last, ranks]) // np.maximum(slope, 1)
    cut_kept = np.maximum(floors, np.minimum(routed, cut_level))

    # Leftover units (fewer than the instances that can take one): one each to
    # instances at the level with room, largest N_i first, ties by lower index.
    leftover = target - np.add.reduce(cut_kept, axis=0)              # [R_cut], >= 0
    if np.add.reduce(leftover):
        room = (floors <= cut_level) & (cut_level < routed)
        key = np.where(room, routed, -1)
        cut_kept += room & _first_in_order(key, leftover, bound)
    kept[:, cut] = cut_kept
    level[cut] = cut_level
    return kept, level


def _split_by_source(counts: np.ndarray, routed: np.ndarray, kept: np.ndarray,
                     bound: int) -> np.ndarray:
    """Split Q_i over sources in proportion to n[s, i], largest remainder first.

    Args:
        counts: [R, I] n[s, i].
        routed: [I] N_i.
        kept: [I] Q_i <= N_i.
        bound: max N_i.

    Returns:
        [R, I] q[s, i] with sum_s q[s, i] = Q_i and q[s, i] <= n[s, i] (a new array).
    """
    quotas = counts.copy()                       # Q_i = N_i splits exactly: q = n
    cut = np.flatnonzero(kept < routed)          # only these columns lost pairs (N_i >= 1)
    if cut.size:
        kept_cut = kept[cut]
        # floor of the proportional share Q_i * n[s, i] / N_i (exact in int64) and its
        # remainder; remainders of one column share the denominator N_i: comparable.
        base, remainder = np.divmod(counts[:, cut] * kept_cut, routed[cut])
        leftover = kept_cut - np.add.reduce(base, axis=0)   # [cut], < nonzero remainders
        base += _first_in_order(remainder, leftover, bound)
        quotas[:, cut] = base
    return quotas


def _first_in_order(key: np.ndarray, count: np.ndarray, bound: int) -> np.ndarray:
    """[A, B] bool: the first ``count[b]`` entries of column b in the order ``key``
    descending, ties by lower row index (torch's stable descending sort).

    Args:
        key: [A, B] int64 in [-1, bound].
        count: [B] how many entries of each column to mark (<= 0: none, >= A: all).
        bound: an upper bound of ``key``.
    """
    rows, cols = key.shape
    if bound < _INT64_MAX // (rows + 1) - 2:
        # (key + 1) * A + (A - 1 - a) is unique in its column and orders entries as
        # (key descending, index ascending) read from the top: the first count[b] are
        # those at or above the count[b]-th largest (a stable argsort and its inverse
        # permutation would cost ~5x more).
        unique = key * rows
        unique += np.arange(2 * rows - 1, rows - 1, -1)[:, None]
        if rows <= 16:   # few candidates (a rank's instances): count those ahead of each
            ahead = np.add.reduce(unique[None, :, :] > unique[:, None, :], axis=1)
            return ahead < count
        pick = np.minimum(np.maximum(rows - count, 0), rows - 1)
        threshold = np.sort(unique, axis=0)[pick, np.arange(cols)]
        return (unique >= threshold) & (count > 0)
    # Keys near the int64 limit: a stable sort of -key keeps ties in index order.
    order = np.argsort(-key, axis=0, kind="stable")
    first = np.zeros(key.shape, dtype=bool)
    np.put_along_axis(first, order, np.arange(rows)[:, None] < count, axis=0)
    return first


_INT64_MAX: Final[int] = np.iinfo(np.int64).max


def _floors(routed: np.ndarray, share: Fraction) -> np.ndarray:
    """[I] f_i = ceil(m * N_i), exact: int64 when p * max N_i fits, else Python ints."""
    if share == 0:
        return np.zeros_like(routed)
    p, q = share.numerator, share.denominator
    if p * max(int(routed.max()), 1) <= _INT64_MAX and q <= _INT64_MAX:
        return -((-p * routed) // q)             # p * N_i exact, floor division exact
    # A long decimal m (0.123456789012345, 1e-20) or millions of pairs overflow int64.
    return np.array([_ceil_div(p * v, q) for v in routed.tolist()], dtype=np.int64)


def capacity_for_factor(gamma: float, total: int, num_ranks: int) -> int:
    """C = ceil(gamma * total / R), gamma read as its decimal repr; UNLIMITED_CAPACITY
    for gamma = inf. The one place the backward capacity is computed."""
    if math.isinf(gamma):
        return UNLIMITED_CAPACITY
    f = _as_decimal_fraction(gamma)
    return min(_ceil_div(f.numerator * total, f.denominator * num_ranks), UNLIMITED_CAPACITY)


def factor_for_capacity(capacity: int, total: int, num_ranks: int) -> float:
    """A gamma > 0 for which ``capacity_for_factor`` gives exactly ``capacity`` (>= 1)."""
    gamma = capacity * num_ranks / total
    while capacity_for_factor(gamma, total, num_ranks) > capacity:
        gamma = math.nextafter(gamma, 0.0)
    return gamma


def decimal_fraction(x: float) -> Fraction:
    """x as the exact decimal its ``repr`` shows (how gamma and m are read)."""
    return _as_decimal_fraction(float(x))


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@lru_cache(maxsize=256)
def _as_decimal_fraction(x: float) -> Fraction:
    """The decimal ``repr`` shows for x, exactly: 1.1 -> 11/10 (not the binary double).

    Cached: gamma and m take few distinct values and parsing costs ~10 us per call.
    """
    return Fraction(repr(float(x)))


# ---------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------


def _check_counts(counts: torch.Tensor, num_ranks: int, layout_given: bool = False) -> torch.Tensor:
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
    n = counts.detach()
    if n.dtype != torch.int64 or n.device.type != "cpu":
        n = n.to(device="cpu", dtype=torch.int64)   # device sync if not on CPU
    if np.minimum.reduce(n.numpy(), axis=None) < 0:
        raise ValueError("counts must be non-negative")
    return n


def _check_layout(
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


def _check_capacity_factor(capacity_factor: float) -> Fraction | None:
    """gamma as an exact fraction, or None for inf (the option table's rule)."""
    if (problem := check_capacity_factor(capacity_factor)) is not None:
        raise ValueError(f"capacity_factor: {problem}")
    gamma = float(capacity_factor)
    return None if math.isinf(gamma) else _as_decimal_fraction(gamma)


def _check_min_retention(min_retention: float) -> Fraction:
    """m as an exact fraction (the option table's rule)."""
    if (problem := check_fraction(min_retention)) is not None:
        raise ValueError(f"min_retention: {problem}")
    return _as_decimal_fraction(float(min_retention))


def rule_reads_metric(selection: str) -> bool:
    """Whether a selection rule reads the per-pair metric (``uniform`` does not)."""
    return selection != "uniform"


def retention_in_forward(selection: str, metric: str) -> bool:
    """Whether the retained set is drawn in forward: the choice does not need the
    backward gradient (the rule ignores the metric, or the metric is ``prob`` or
    ``random``). The draw is the one backward would make (same seed, same quotas), so
    the kept pairs do not depend on where it runs; drawn in forward, the receivers save
    x_exp and z for the retained rows only. ``two-stage`` draws its final set in
    backward (from the superset stored in forward: ``stored_in_forward``)."""
    if selection == TWO_STAGE:
        return False
    return not rule_reads_metric(selection) or metric in ("prob", "random")


def stored_in_forward(selection: str, metric: str) -> bool:
    """Whether forward draws the rows whose x_exp and z are saved (the retained set, or
    ``two-stage``'s superset), so that the receivers compact them in forward."""
    return selection == TWO_STAGE or retention_in_forward(selection, metric)


def stored_quotas(counts: torch.Tensor, quotas: torch.Tensor, store_factor: float
                  ) -> torch.Tensor:
    """[R, I] int64 q1[s, i] = min(n[s, i], floor(rho q[s, i])): the pairs of each cell
    that ``two-stage`` stores in forward, rho = ``store_factor`` >= 1 read as the decimal
    its ``repr`` shows (1.5 = 3/2), computed exactly in integers. q <= q1 <= n, and
    q1 = q where rho q < q + 1; the sum over a rank is at most rho times its quota."""
    return torch.from_numpy(stored_counts(counts.numpy(), quotas.numpy(), store_factor))


def stored_counts(counts: np.ndarray, quotas: np.ndarray, store_factor: float) -> np.ndarray:
    """``stored_quotas`` on int64 numpy arrays (the planner's per-call arithmetic)."""
    rho = _as_decimal_fraction(float(store_factor))
    if not rho >= 1:
        raise ValueError(f"store_factor must be >= 1, got {store_factor!r}")
    if rho.numerator >= 2**62 // max(1, int(quotas.max(initial=0))):
        raise ValueError(f"store_factor {store_factor!r} has too many decimals for exact "
                         "integer arithmetic at these quotas")
    return np.minimum(counts, quotas * rho.numerator // rho.denominator)
