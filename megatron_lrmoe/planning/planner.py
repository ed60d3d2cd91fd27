"""The per-layer planner: placement per step, instance assignment and retention per micro-batch.

One ``LayerPlanner`` per MoE layer, identical on every EP rank: each rank feeds it the
same gathered counts and gets the same answer, so the ranks agree without
communicating. Pure: counts, plain numbers and frozen values in; placements,
instance assignments and retention plans out; no process group and no config object
(``integration/planner_inputs.py`` derives the settings from Megatron's config).
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from megatron_lrmoe.planning.cost_model import CostModel
from megatron_lrmoe.planning.instance_assignment import (
    InstanceAssignment,
    assign_checked,
    check_assignment_counts,
)
from megatron_lrmoe.planning.native import native_available, native_judge, native_planner
from megatron_lrmoe.planning.placement import Placement
from megatron_lrmoe.planning.placement_policies import (
    PairSeconds,
    dhondt_order,
    greedy_replicas,
    local_greedy_replicas,
    pair_seconds,
    popularity_placement,
    popularity_replicas,
)
from megatron_lrmoe.planning.plan_types import MicroBatchPlan, PlannerSettings
from megatron_lrmoe.planning.retention import (
    RetentionPlan,
    capacity_for_factor,
    decimal_fraction,
    factor_for_capacity,
    plan_retention,
)
from megatron_lrmoe.planning.shapes import InstanceRows

__all__ = ["PRICED_MICROBATCHES", "LayerPlanner", "MicroBatchPlan", "PlannerSettings"]


@dataclass(frozen=True, eq=False)
class _PlacementContext:
    """What ``plan`` needs per placement, computed once when the placement is set."""

    placement: Placement
    replicas: np.ndarray                # [R] int64 replicas each rank hosts
    receive_limit: np.ndarray | None    # [R] int64 most pairs each rank receives (None: no budget)
    rank_starts: np.ndarray             # [R] first instance of each rank
    instance_rank: np.ndarray           # [I] int64 the rank hosting each instance
    busiest: int                        # _busiest(placement)
    native: Any = None                  # the compiled planner of the placement, or None
    # [R] bytes of the replicas' gradients each rank receives home at its step's last
    # backward (CostModel.returned_gradient_bytes); budgeted on every micro-batch, since
    # the plan of a call does not depend on which of the step's micro-batches it is.
    returned: np.ndarray | float = 0.0


@dataclass(frozen=True, eq=False)
class _Judged:
    """A placement the memory-aware choice judges (``_memory_aware_placement``)."""

    name: str
    replicas: tuple[tuple[int, int], ...]
    fits: bool                        # within the budget on every plan made
    # (forward s, backward s) of each plan made: on the smoothed counts, then, where
    # ``kept``, on each kept micro-batch's
    times: list[tuple[float, float]]
    busiest: int                      # _busiest of the placement
    kept: bool                        # planned (and fitting) on every kept micro-batch


@dataclass(frozen=True, eq=False)
class _Unbudgeted:
    """A placement's plan without the budget's influence (``LayerPlanner._unbudgeted``)."""

    ctx: _PlacementContext
    load: np.ndarray                    # [R] routed pairs per rank
    peak: float                         # the largest CostModel.rank_memory over ranks
    cells: np.ndarray                   # [R, I] the assignment's counts
    quotas: np.ndarray                  # [R, I] the retained pairs


class LayerPlanner:
    """One MoE layer's placement and micro-batch planner (pure; identical on every rank).

    Life cycle per training step: ``plan(counts)`` for each micro-batch (forward),
    ``observe(counts)`` for each training micro-batch, then ``next_step()`` at the step
    boundary, which folds the step's mean counts into the smoothed loads; the placement
    of the next step is chosen from them when ``placement`` is first read, in the layer's
    first forward of that step (docs/design.md, "Placement").
    """

    def __init__(self, settings: PlannerSettings, native: bool | None = None):
        """``native``: plan each call with the compiled planner (``planning/native.py``;
        the same plans, to the bit), or in Python (False: the reference); None: compiled
        where the extension has it."""
        if native and not native_available():
            raise ValueError("LayerPlanner(native=True): megatron_lrmoe._kernels has no "
                             "NativePlanner; rebuild the extension or pass native=None")
        self.native = native_available() if native is None else bool(native)
        if native is None and not self.native:
            _warn_python_planner()
        self.settings = settings
        self._placement_chosen = Placement.static(settings.num_ranks, settings.num_experts)
        self._placement_notes: tuple[str, ...] = ()
        self._choice_due = False     # next_step folded new loads; the choice waits for a read
        self.step = 0
        self.smoothed_counts: torch.Tensor | None = None
        self._observed_sum: np.ndarray | None = None    # [R, E] float64 (numpy: no tensor op)
        self._observed = 0
        # The first PRICED_MICROBATCHES micro-batches' [R, E] counts of this step, and of
        # the step the next placement is chosen from: candidates are priced on them.
        self._step_counts: list[np.ndarray] = []
        self._priced_counts: list[np.ndarray] = []
        self._capacity_tensors: dict[int, torch.Tensor] = {}
        self._last_arrays: tuple[MicroBatchPlan, np.ndarray, np.ndarray] | None = None
        self._contexts: dict[Placement, _PlacementContext] = {}
        self._placements: dict[tuple[tuple[int, int], ...], Placement] = {}
        self._replica_costs: dict[int, float] = {}
        self._receive_limits: dict[tuple[int, float], int] = {}   # _receive_limit's
        self._native_judge: Any = None                # _evaluator's compiled judge
        self.last_memory: np.ndarray | None = None
        """[R] bytes the latest ``plan`` holds on each rank (``CostModel.rank_memory``),
        computed whenever the settings carry a cost model (a budget, or a run held to its
        device); None without one. The planner only reports it: what a rank over its
        device means is the caller's (the launcher stops the run)."""

    # ------------------------------------------------------------- placement
    @property
    def placement(self) -> Placement:
        """This step's placement. The first read after ``next_step`` chooses it from the
        smoothed loads (a pure function of them and the settings): the layer reads it at
        its first forward of the step, where the host runs ahead of the device work it
        queued, instead of at the step boundary (docs/design.md, "Placement")."""
        if self._choice_due:
            self._choice_due = False
            self._placement_chosen, self._placement_notes = self._choose_placement()
        return self._placement_chosen

    @placement.setter
    def placement(self, placement: Placement) -> None:
        self._placement_chosen, self._placement_notes = placement, ()
        self._choice_due = False

    @property
    def placement_notes(self) -> tuple[str, ...]:
        """What the latest choice of placement did, for logs."""
        self.placement     # noqa: B018  (a due choice is made first)
        return self._placement_notes

    @property
    def placement_due(self) -> bool:
        """Whether ``next_step`` folded loads whose placement is not chosen yet."""
        return self._choice_due

    # ------------------------------------------------------------- per batch
    def observe(self, counts: torch.Tensor | np.ndarray) -> None:
        """Record one training micro-batch's gathered [R, E] counts of this step."""
        n = check_assignment_counts(counts, self.placement).astype(np.float64)
        self._observed_sum = n if self._observed_sum is None else self._observed_sum + n
        self._observed += 1
        if len(self._step_counts) < PRICED_MICROBATCHES:
            self._step_counts.append(n)

    def observations(self) -> tuple[torch.Tensor | None, int, list[torch.Tensor]]:
        """This step's observations so far: (sum of the [R, E] counts, micro-batches, the
        first ``PRICED_MICROBATCHES`` micro-batches' [R, E] counts)."""
        total = self._observed_sum
        return ((None if total is None else torch.from_numpy(total)), self._observed,
                [torch.from_numpy(n) for n in self._step_counts])

    def replace_observations(self, counts_sum: torch.Tensor | None, microbatches: int,
                             microbatch_counts: list[torch.Tensor] | None = None) -> None:
        """Make (``counts_sum``, ``microbatches``, ``microbatch_counts``) this step's
        observations (``microbatch_counts`` None: the planner's own stay).

        For callers that pool the observations of several planners of the same layer
        (its expert-data-parallel replicas) before ``next_step``, so that all of them
        fold the same counts and stay identical.
        """
        shape = (self.settings.num_ranks, self.settings.num_experts)
        for value in [counts_sum, *(microbatch_counts or [])]:
            if value is not None and tuple(value.shape) != shape:
                raise ValueError(f"observations of shape {tuple(value.shape)}, this planner "
                                 f"has (R, E) = {shape}")
        if (counts_sum is None) != (microbatches == 0):
            raise ValueError("observations: counts without micro-batches or the reverse")
        if microbatch_counts is not None and len(microbatch_counts) > PRICED_MICROBATCHES:
            raise ValueError(f"observations: {len(microbatch_counts)} micro-batches' counts, "
                             f"the planner keeps at most {PRICED_MICROBATCHES}")
        self._observed_sum = (None if counts_sum is None
                              else counts_sum.detach().to("cpu", torch.float64).numpy().copy())
        self._observed = int(microbatches)
        if microbatch_counts is not None:
            self._step_counts = [c.detach().to("cpu", torch.float64).numpy().copy()
                                 for c in microbatch_counts]

    def plan(self, counts: torch.Tensor | np.ndarray) -> MicroBatchPlan:
        """Instance assignment and quotas of one micro-batch under the current placement.

        With a budget the instance assignment respects each rank's receive limit (the layer share
        minus its replicas), and when the plan at gamma does not fit, gamma is lowered
        until the backward buffers do; the forward never drops. What was done is in
        ``notes``.
        """
        plan, self.last_memory, arrays = self._plan(counts, self._context(self.placement))
        self._last_arrays = (plan, *arrays)
        return plan

    def _plan(self, counts: torch.Tensor | np.ndarray, ctx: _PlacementContext
              ) -> tuple[MicroBatchPlan, np.ndarray | None, tuple[np.ndarray, np.ndarray]]:
        """(the plan, [R] CostModel.rank_memory of it or None without a cost model, the
        plan's [R, I] counts and quotas as the arrays its tensors view).

        Stages: the instance assignment within the receive limits; the retention at the
        configured gamma; where that does not fit the budget, gamma lowered to what fits
        (``_fitting_gamma``) and the retention again; the notes of what was done."""
        # numpy on [R] arrays (a torch op costs ~10 us here), as the cost model is.
        s = self.settings
        n = check_assignment_counts(counts, ctx.placement)
        assignment, cells, routed = self._assign(n, ctx, ctx.receive_limit)  # routed: [R] load
        notes = []
        if assignment.overflow:
            notes.append(f"overflow: {assignment.overflow} pairs above the ranks' receive "
                         f"limits went to home instances")
        gamma = float(s.capacity_factor)
        retention, quotas, memory = self._retain(assignment, cells, gamma, ctx, routed)
        lowered = self._fitting_gamma(memory, ctx, cells, routed, gamma)
        if lowered is not None:
            gamma, needed = lowered
            notes.append(f"budget: backward capacity factor lowered from "
                         f"{s.capacity_factor:g} to {gamma:.4g} (C={needed})")
            retention, quotas, memory = self._retain(assignment, cells, gamma, ctx, routed)
        share = s.layer_share
        if share is not None and memory is not None:
            over = memory > share
            if over.any():
                notes.append(f"over budget on {int(np.add.reduce(over))} rank(s) by up to "
                             f"{float(np.maximum.reduce(memory - share)) / 2**20:.1f} MiB "
                             f"(the forward is never dropped)")
        plan = MicroBatchPlan(assignment=assignment, retention=retention(),
                              capacity_factor_used=gamma, notes=tuple(notes), rank_load=routed)
        return plan, memory, (cells, quotas)

    def _retain(self, assignment: InstanceAssignment, cells: np.ndarray, gamma: float,
                ctx: _PlacementContext, routed: np.ndarray
                ) -> tuple[Callable[[], RetentionPlan], np.ndarray, np.ndarray | None]:
        """``_retention`` at ``gamma`` and the [R] rank memory of the result (None without
        a cost model)."""
        retention, quotas = self._retention(assignment, cells, gamma, ctx, routed)
        memory = (None if self.settings.cost is None
                  else self._memory(ctx, routed, cells, quotas))
        return retention, quotas, memory

    def _fitting_gamma(self, memory: np.ndarray | None, ctx: _PlacementContext,
                       cells: np.ndarray, routed: np.ndarray, gamma: float
                       ) -> tuple[float, int] | None:
        """(the lowered gamma, its C) when the plan at ``gamma`` (its [R] ``memory``) does
        not fit the layer share and a smaller C does; None when it fits, gamma is inf, or
        lowering cannot help."""
        s = self.settings
        share = s.layer_share
        if (share is None or memory is None or not math.isfinite(gamma)
                or not bool((memory > share).any())):
            return None
        # Lower gamma to the smallest rank limit. The limits bound what they cannot know
        # before the plan (each source's kept pairs, the retained rows per instance), so a
        # plan within them fits.
        if ctx.native is not None:
            limit = ctx.native.retained_limit(share, cells, routed)
        else:
            instance_routed = np.add.reduce(cells, axis=0)                          # [I]
            limit = s.cost.retained_limit(share, ctx.replicas, routed,
                                          np.maximum.reduceat(instance_routed, ctx.rank_starts),
                                          returned=ctx.returned)
        # Ranks that do not fit even keeping nothing (limit 0) stay over budget whatever
        # gamma is: they do not drag every rank's C to 1.
        short = (routed > limit) & (limit > 0)
        total = int(np.add.reduce(routed))
        if not short.any() or not total:
            return None
        needed = max(int(np.minimum.reduce(limit[short])), 1)
        if needed >= capacity_for_factor(gamma, total, s.num_ranks):
            return None
        return factor_for_capacity(needed, total, s.num_ranks), needed

    def native_layout(self, plan: MicroBatchPlan, rank: int) -> tuple | None:
        """The region's host layout of ``plan`` on ``rank`` from the compiled planner
        (``NativePlanner.layout``: split sizes, packed index tables, instance-order chunk
        tables), or None when this planner plans in Python."""
        ctx = self._contexts.get(plan.assignment.placement) if self.native else None
        if ctx is None or ctx.native is None:
            return None
        last = self._last_arrays
        cells, quotas = (last[1:] if last is not None and last[0] is plan
                         else (plan.retention.counts.numpy(), plan.retention.quotas.numpy()))
        return ctx.native.layout(cells, quotas, rank)

    def _assign(self, n: np.ndarray, ctx: _PlacementContext, limit: np.ndarray | None
                ) -> tuple[InstanceAssignment, np.ndarray, np.ndarray]:
        """(the instance assignment of checked counts ``n`` under receive ``limit``, its [R, I]
        counts, [R] load per rank)."""
        if ctx.native is None:
            assignment, load = assign_checked(n, ctx.placement, limit)
            return assignment, assignment.counts.numpy(), load
        cells, load = ctx.native.assign(n, limit)
        overflow = (0 if limit is None
                    else int(np.add.reduce(np.maximum(load - limit, 0))))
        return InstanceAssignment(counts=torch.from_numpy(cells), overflow=overflow,
                                  placement=ctx.placement), cells, load

    def _retention(self, assignment: InstanceAssignment, cells: np.ndarray, gamma: float,
                   ctx: _PlacementContext, routed: np.ndarray
                   ) -> tuple[Callable[[], RetentionPlan], np.ndarray]:
        """(plan_retention of the assignment at ``gamma``, built when called: a plan the
        budget replaces costs no tensors; its quotas as an array). ``cells``: the
        assignment's counts, ``routed``: its [R] loads."""
        s = self.settings
        placement = assignment.placement
        floor = decimal_fraction(s.min_retention)
        if (ctx.native is None or floor.numerator > _INT64_MAX
                or floor.denominator > _INT64_MAX):
            plan = plan_retention(assignment.counts, s.num_ranks, gamma, s.min_retention,
                                  instance_rank=placement.instance_rank,
                                  instance_expert=placement.instance_expert)
            return (lambda: plan), plan.quotas.numpy()
        cap = capacity_for_factor(gamma, int(np.add.reduce(routed)), s.num_ranks)
        quotas, level = ctx.native.retain(cells, cap, floor.numerator, floor.denominator)

        def make() -> RetentionPlan:
            # One read-only [R] tensor per capacity value (it repeats from call to call).
            capacity = self._capacity_tensors.get(cap)
            if capacity is None:
                if len(self._capacity_tensors) >= 64:
                    self._capacity_tensors.clear()
                capacity = torch.from_numpy(np.full(s.num_ranks, cap, dtype=np.int64))
                self._capacity_tensors[cap] = capacity
            return RetentionPlan(counts=assignment.counts, quotas=torch.from_numpy(quotas),
                                 capacity=capacity, water_level=torch.from_numpy(level),
                                 instance_rank=placement.instance_rank,
                                 instance_expert=placement.instance_expert,
                                 capacity_factor=float(gamma),
                                 min_retention=float(s.min_retention))
        return make, quotas

    def _memory(self, ctx: _PlacementContext, routed: np.ndarray, cells: np.ndarray,
                quotas: np.ndarray) -> np.ndarray:
        """[R] ``CostModel.rank_memory`` of a planned micro-batch (``_memory``)."""
        if ctx.native is not None:
            return ctx.native.memory(cells, quotas, routed)
        return _memory(self.settings.cost, ctx, routed, cells, quotas)

    def _placement(self, replicas: tuple[tuple[int, int], ...]) -> Placement:
        """``Placement(R, E, replicas)``, the same object for the same replicas while
        cached: the search proposes the same prefixes step after step once the loads
        settle, and a placement and its context cost more to build than to look up."""
        placement = self._placements.get(replicas)
        if placement is None:
            if len(self._placements) >= _CACHED_PLACEMENTS:
                self._placements.clear()
            placement = Placement(self.settings.num_ranks, self.settings.num_experts, replicas)
            self._placements[replicas] = placement
        return placement

    def _context(self, placement: Placement) -> _PlacementContext:
        ctx = self._contexts.get(placement)
        if ctx is None:
            if len(self._contexts) >= _CACHED_PLACEMENTS:
                self._contexts.clear()
            replicas = np.asarray(placement.replicas_per_rank(), dtype=np.int64)
            cost = self.settings.cost
            returned = 0.0 if cost is None else cost.returned_gradient_bytes(placement)
            ctx = _PlacementContext(placement, replicas, self._receive_limit(replicas, returned),
                                    np.asarray(placement.rank_starts[:-1], dtype=np.int64),
                                    np.asarray(placement.instance_rank, dtype=np.int64),
                                    _busiest(placement),
                                    native_planner(placement, cost, replicas, returned)
                                    if self.native else None, returned)
            self._contexts[placement] = ctx
        return ctx

    @functools.cached_property
    def _pair_seconds(self) -> PairSeconds:
        """``pair_seconds`` of the settings' cost model (a constant of the planner)."""
        return pair_seconds(self.settings.cost)

    def _receive_limit(self, replicas: np.ndarray, returned: np.ndarray | float
                       ) -> np.ndarray | None:
        """``CostModel.receive_limit`` of the layer share (None without a budget). Each
        rank's limit depends on its replica count and returned bytes only (elementwise
        arithmetic), so it is kept per such pair: candidates repeat them."""
        share = self.settings.layer_share
        if share is None:
            return None
        keys = list(zip(replicas.tolist(), np.broadcast_to(
            returned, replicas.shape).tolist(), strict=True))
        memo = self._receive_limits
        if len(memo) > 4096:
            memo.clear()
        new = list(dict.fromkeys(k for k in keys if k not in memo))
        if new:
            limits = self.settings.cost.receive_limit(
                share, np.array([n for n, _ in new], dtype=np.int64),
                returned=np.array([b for _, b in new], dtype=np.float64))
            memo.update(zip(new, limits.tolist(), strict=True))
        return np.array([memo[k] for k in keys], dtype=np.int64)

    # -------------------------------------------------------------- per step
    def next_step(self) -> None:
        """Fold this step's observations into the EMA and advance; the next placement is
        chosen when ``placement`` is next read.

        The fold is all the step boundary pays; the choice (up to ~1 ms per layer at EP
        64 for memory-aware placement) moves to the layer's first forward of the next
        step, where it overlaps the device work queued before the counts read.
        Without observations (evaluation only) nothing changes: not the EMA, not the
        step counter, not the placement.
        """
        if not self._observed:
            if not self._choice_due:
                self._placement_notes = ("no training micro-batch observed: placement kept",)
            return
        mean = torch.from_numpy(self._observed_sum / self._observed)
        a = float(self.settings.load_smoothing)
        self.smoothed_counts = (mean if self.smoothed_counts is None
                                else a * self.smoothed_counts + (1.0 - a) * mean)
        self._observed_sum, self._observed = None, 0
        self._priced_counts, self._step_counts = self._step_counts, []
        self.step += 1
        if self.settings.policy == "static":
            self._placement_notes = ()
        else:
            self._choice_due = True

    def _choose_placement(self) -> tuple[Placement, tuple[str, ...]]:
        """The placement of the smoothed loads under the policy (``next_step``'s choice)."""
        if self.settings.policy == "popularity":
            return popularity_placement(
                self.smoothed_counts.sum(0).numpy(), self.settings.num_ranks,
                self.settings.num_experts, self.settings.popularity_slots(),
                native=self.native)
        return self._memory_aware_placement()

    def _memory_aware_placement(self) -> tuple[Placement, tuple[str, ...]]:
        """The fastest admissible candidate placement (docs/design.md, "Placement").

        Candidates, from the smoothed counts:

        - ``greedy``: all, 3/4, 1/2 and 1/4 of ``greedy_replicas``' replicas (the
          per-expert totals);
        - ``local greedy``: all and 1/2 of ``local_greedy_replicas``' (the [R, E]
          counts: locality in its estimate and in its choice of rank);
        - ``popularity``: SYMI-style's popularity placement at the most slots that fit,
          found by bisection on [E/R, E] from the slots the ``popularity`` policy takes
          at this budget (each probe a candidate too; fitting on the smoothed counts and
          on every kept micro-batch's, as SYMI-style must fit every step), and the
          locality-aware popularity placement at those most slots.

        Stage 1 plans each exactly on the smoothed counts, like ``plan`` does but with
        neither receive limits nor a lowered gamma (``_unbudgeted``), and prices it as
        the simulator judges a call (``_plan_times`` and ``_group_time``: GEMMs instance
        by instance, plus the replicas' refresh and reduction amortised over the step);
        each candidate is judged in one call of ``_evaluator``'s judge. A candidate
        qualifies if it is faster than static, its peak memory fits the layer share (at
        gamma = inf: no larger than max(share, static's peak)) and the budget's receive
        limits do not bind on its routing. Stage 2 prices static, the ``FINALISTS``
        fastest qualifying candidates and SYMI-style's (at the ``popularity`` policy's
        slots and at the most that fit) again on the
        first ``PRICED_MICROBATCHES`` micro-batches' counts of the step the loads come
        from (each must fit on each of them too), and the lowest mean time wins (ties:
        fewer replicas).

        Only the qualification and the bisection's start read the budget.
        """
        s = self.settings
        share = s.layer_share
        static = self._placement(())
        counts = check_assignment_counts(
            torch.round(self.smoothed_counts).to(torch.int64).numpy(), static)
        priced = [check_assignment_counts(np.rint(c).astype(np.int64), static)
                  for c in self._priced_counts]
        capacity = self._capacity(counts)
        caps = [self._capacity(c) for c in priced]
        evaluate = self._evaluator()
        static_key, _, peaks, times, _ = evaluate((), [counts], [capacity], math.inf, False)
        # At a finite gamma a candidate must fit the share outright, or the budget would
        # lower gamma for it and it would buy its time with drops. At gamma = inf nothing
        # is dropped and the hot rank's rows set the peak: a candidate may not add to an
        # excess static already has, but one that lowers it by balancing is admitted (held
        # to the share alone, the EP 16 CPU run at gamma = inf, whose routing swings to
        # 5 x the mean load, kept fewer replicas and stopped sooner over its device).
        allowed = max(share, peaks[0]) if math.isinf(s.capacity_factor) else share
        judged = {static_key: _Judged("static", (), True, times, 0, False)}

        def judge(name: str, replicas: tuple[tuple[int, int], ...] | list[tuple[int, int]],
                  every: bool = False) -> tuple[bool, Any]:
            """(whether the placement of ``replicas`` fits, its key in ``judged``): planned
            on the smoothed counts, and with ``every`` on each kept micro-batch's too
            until one does not fit. A placement judged before keeps its first judgement."""
            matrices, limits = ([counts, *priced], [capacity, *caps]) if every else (
                [counts], [capacity])
            key, fits, _, times, busiest = evaluate(replicas, matrices, limits, allowed, True)
            if key not in judged:
                judged[key] = _Judged(name, tuple(replicas), fits, times, busiest,
                                      every and fits)
            return judged[key].fits, key

        replicas = greedy_replicas(counts.sum(0).tolist(), capacity, s, native=self.native,
                                   sync_cost=self._replica_costs)
        n = len(replicas)
        for size in sorted({n, 3 * n // 4, n // 2, n // 4} - {0}):
            judge(f"greedy {size}", replicas[:size])
        local = local_greedy_replicas(counts, capacity, s, native=self.native,
                                      sync_cost=self._replica_costs)
        n = len(local)
        for size in sorted({n, n // 2} - {0}):
            judge(f"local greedy {size}", local[:size])
        # The D'Hondt order of the popularity, shared by the Python placements (the
        # compiled ones draw it themselves, as far as they need).
        order = None if self.native else dhondt_order(counts.sum(0), s.num_ranks)
        slots, symi = self._most_popularity_slots(counts, order, judge)
        if slots > s.num_experts // s.num_ranks:
            judge(f"popularity {slots} slots, locality-aware", popularity_replicas(
                counts.sum(0), s.num_ranks, s.num_experts, slots, counts,
                self._pair_seconds, native=self.native, order=order)[0])

        # Stage 1: every candidate priced on the smoothed counts.
        times = [self._group_time(j.times[:1], j.busiest) for j in judged.values()]
        base_time = times[0]
        qualified = sorted((time, len(j.replicas), k, key)
                           for k, ((key, j), time) in enumerate(zip(
                               judged.items(), times, strict=True))
                           if j.fits and time < base_time)
        # Stage 2: the finalists on the step's own micro-batches.
        finalists = [static_key] + [key for *_, key in qualified[:FINALISTS]]
        for key in symi:              # SYMI-style's at its own slots and at the most
            if key not in finalists and judged[key].fits:
                finalists.append(key)
        matrices, limits = (priced, caps) if priced else ([counts], [capacity])
        best: tuple[float, int, Any] | None = None
        static_time = None
        for key in finalists:
            j = judged[key]
            if j.kept and priced:
                fits, times = True, j.times[1:]
            else:
                _, fits, _, times, _ = evaluate(j.replicas, matrices, limits, allowed, False)
            time = self._group_time(times, j.busiest)
            if key == static_key:
                static_time = time
            elif not fits:
                continue
            # Times equal but for rounding (1e-12) are ties: fewer replicas win.
            if (best is None or time < best[0] * (1 - 1e-12)
                    or (time <= best[0] * (1 + 1e-12) and len(j.replicas) < best[1])):
                best = (time, len(j.replicas), key)
        time, _, key = best
        if key == static_key:
            return static, (f"memory-aware: no candidate pays off within the budget "
                            f"(static {time * 1e3:.3f} ms, {len(judged)} candidates)",)
        placement = self._placement(judged[key].replicas)
        return placement, (
            f"memory-aware: {judged[key].name} ({len(placement.replicas)} replicas), "
            f"estimated layer time {time * 1e3:.3f} ms vs static {static_time * 1e3:.3f} ms"
            f" ({len(judged)} candidates)",)

    def _most_popularity_slots(self, counts: np.ndarray, order: np.ndarray | None,
                               judge: Callable[..., tuple[bool, Any]]
                               ) -> tuple[int, list[Any]]:
        """(the most slots per rank at which SYMI-style's popularity placement of
        ``counts`` fits, judged by ``judge``; the keys ``judge`` gave the placements at
        the ``popularity`` policy's slots and at the most, where above E/R; ``order``:
        ``dhondt_order`` of the counts or None): a bisection
        on [E/R, E] that starts from the ``popularity`` policy's own slots at this budget
        and gallops up from there while they fit. Fitting is taken as monotone in the
        slots (replicas add memory, balance takes buffers away); where it is not, the
        bisection returns a fitting count, not always the most."""
        s = self.settings
        per_rank = s.num_experts // s.num_ranks
        popularity = counts.sum(0)
        keys: dict[int, Any] = {}

        def fits(slots: int) -> bool:
            fit, keys[slots] = judge(f"popularity {slots} slots", popularity_replicas(
                popularity, s.num_ranks, s.num_experts, slots, native=self.native,
                order=order)[0], every=True)
            return fit

        low, high = per_rank, s.num_experts + 1        # low fits (static); high does not
        start = min(max(s.popularity_slots(), per_rank + 1), s.num_experts)
        if start > per_rank and fits(start):
            low, step = start, 1
            while low + step < high and fits(low + step):
                low, step = low + step, 2 * step
            high = min(high, low + step)
        elif start > per_rank:
            high = start
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if fits(mid) else (low, mid)
        return low, [keys[k] for k in dict.fromkeys((start, low)) if k in keys]

    def _fits(self, planned: list[_Unbudgeted], ctx: _PlacementContext,
              allowed: float) -> bool:
        """Whether every plan of ``planned`` fits: its peak at most ``allowed`` and its
        routing within the budget's receive limits."""
        limit = ctx.receive_limit
        return all(u.peak <= allowed and (limit is None or bool((u.load <= limit).all()))
                   for u in planned)

    def _evaluator(self) -> Callable[..., tuple[Any, bool, list[float],
                                                 list[tuple[float, float]], int]]:
        """The memory-aware choice's judge of one candidate: ``evaluate(replicas,
        matrices, caps, allowed, stop)`` -> (key, fits, [peak per plan], [(forward s,
        backward s) per plan], busiest), the placement of ``replicas`` planned on each
        checked [R, E] matrix as ``_unbudgeted`` plans it (``caps``: each matrix's
        ``_capacity``), whether every plan fits (``_fits`` at ``allowed``; with
        ``stop`` no plan follows one that does not), and each plan priced
        (``_plan_times``). The key is equal for equal placements. Compiled
        (``native_judge``, the same numbers to the bit) where this planner plans
        compiled; else in Python, the reference."""
        s = self.settings
        floor = decimal_fraction(s.min_retention)
        if not self.native or max(floor.numerator, floor.denominator) > _INT64_MAX:
            return self._evaluate
        if self._native_judge is None:
            self._native_judge = native_judge(s.cost, s.num_ranks, s.num_experts,
                                              s.layer_share)
        compiled = self._native_judge.evaluate

        def evaluate(replicas, matrices, caps, allowed, stop):
            return compiled(replicas, matrices, caps, floor.numerator, floor.denominator,
                            allowed, stop)
        return evaluate

    def _evaluate(self, replicas: tuple[tuple[int, int], ...] | list[tuple[int, int]],
                  matrices: list[np.ndarray], caps: list[int], allowed: float, stop: bool
                  ) -> tuple[Placement, bool, list[float], list[tuple[float, float]], int]:
        """``_evaluator``'s judge in Python (``caps`` unused: ``_unbudgeted`` computes
        them)."""
        ctx = self._context(self._placement(tuple(replicas)))
        plans, fits = [], True
        for n in matrices:
            plans.append(self._unbudgeted(n, ctx))
            if not self._fits(plans[-1:], ctx, allowed):
                fits = False
                if stop:
                    break
        return (ctx.placement, fits, [u.peak for u in plans], self._plan_times(plans),
                ctx.busiest)

    def _capacity(self, counts: np.ndarray) -> int:
        """The backward capacity per rank of ``counts``' plans at the configured gamma
        (``capacity_for_factor``; UNLIMITED_CAPACITY at gamma = inf)."""
        return capacity_for_factor(float(self.settings.capacity_factor),
                                   int(np.add.reduce(counts, axis=None)),
                                   self.settings.num_ranks)

    def _group_time(self, times: list[tuple[float, float]], busiest: int) -> float:
        """Mean seconds per micro-batch of one placement's plans (their (forward s,
        backward s)), plus the replicas' refresh and reduction amortised over the
        step's micro-batches (``busiest``: the placement's ``_busiest``)."""
        sync = self._replica_costs.get(busiest)
        if sync is None:        # a pure function of the busiest count: priced once
            sync = self._replica_costs[busiest] = (
                self.settings.cost.replica_cost_per_microbatch(busiest))
        return sum(f + b for f, b in times) / len(times) + sync

    def _plan_times(self, plans: list[_Unbudgeted]) -> list[tuple[float, float]]:
        """(forward s, backward s) of each plan as the simulator prices a call,
        ``CostModel.layer_time`` of its [R, R] routed and retained matrices with its GEMMs
        instance by instance (``layer_times`` of their rank loads with
        ``instance_gemm_times``: the same numbers, all plans in one call)."""
        cost = self.settings.cost
        num_ranks = self.settings.num_ranks
        loads, ranks, routed, retained = [], [], [], []
        for k, u in enumerate(plans):
            ctx = u.ctx
            if ctx.native is not None:
                loads.append(ctx.native.rank_loads(u.cells, u.quotas))
            else:
                loads.append(cost.rank_loads(np.add.reduceat(u.cells, ctx.rank_starts, axis=1),
                                             np.add.reduceat(u.quotas, ctx.rank_starts,
                                                             axis=1)))
            ranks.append(ctx.instance_rank + k * num_ranks)
            routed.append(np.add.reduce(u.cells, axis=0))
            retained.append(np.add.reduce(u.quotas, axis=0))
        gemm = cost.instance_gemm_times(InstanceRows(
            np.concatenate(ranks), np.concatenate(routed), np.concatenate(retained)),
            len(plans) * num_ranks)
        fwd, bwd = cost.layer_times(np.stack(loads), tuple(
            g.reshape(len(plans), num_ranks) for g in gemm))
        return list(zip(fwd, bwd, strict=True))

    def _unbudgeted(self, counts: np.ndarray, ctx: _PlacementContext) -> _Unbudgeted:
        """The plan of ``ctx``'s placement on ``counts`` (checked: ``check_assignment_counts``)
        without the budget's influence: instance assignment without receive limits, gamma
        as set (``_Unbudgeted``)."""
        gamma = float(self.settings.capacity_factor)
        assignment, cells, routed = self._assign(counts, ctx, None)   # checked by the caller
        _, quotas = self._retention(assignment, cells, gamma, ctx, routed)
        peak = float(np.maximum.reduce(self._memory(ctx, routed, cells, quotas)))
        return _Unbudgeted(ctx, routed, peak, cells, quotas)

    # ------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """Small and picklable: smoothed loads, step, placement and this step's
        observations so far, so that a resume is exact. A due placement is chosen first
        (checkpoints and Megatron's re-run snapshots are rare next to layer calls)."""
        s = self.settings
        return {
            "version": 2,
            "num_ranks": s.num_ranks,
            "num_experts": s.num_experts,
            "step": self.step,
            "smoothed_counts": (None if self.smoothed_counts is None
                                else self.smoothed_counts.clone()),
            "replicas": [list(p) for p in self.placement.replicas],
            "observed_sum": (None if self._observed_sum is None
                             else torch.from_numpy(self._observed_sum.copy())),
            "observed": self._observed,
            # version 2: the counts the next choice prices, and this step's so far
            "priced_counts": [torch.from_numpy(n.copy()) for n in self._priced_counts],
            "step_counts": [torch.from_numpy(n.copy()) for n in self._step_counts],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict``. A state of another EP size or expert count is refused
        (its per-rank loads do not apply); the caller may then start fresh. A version 1
        state (before the per-micro-batch counts) loads with none: its next choice
        prices on the smoothed counts."""
        s = self.settings
        if state.get("version", 1) not in (1, 2):
            raise ValueError(f"planner state version {state.get('version')!r}, this code "
                             f"reads 1 and 2")
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
                              else observed_sum.detach().to("cpu", torch.float64).numpy().copy())
        self._observed = int(state["observed"])
        lists = [state.get(name, []) for name in ("priced_counts", "step_counts")]
        for value in lists[0] + lists[1]:
            if tuple(value.shape) != (s.num_ranks, s.num_experts):
                raise ValueError(f"planner state micro-batch counts of shape "
                                 f"{tuple(value.shape)}")
        self._priced_counts, self._step_counts = (
            [v.detach().to("cpu", torch.float64).numpy().copy() for v in values]
            for values in lists)


_INT64_MAX = np.iinfo(np.int64).max
PRICED_MICROBATCHES = 4
FINALISTS = 3
"""Qualifying candidates, fastest on the smoothed counts, that the placement choice
prices again on each kept micro-batch's counts (beside static and SYMI-style's)."""
"""Micro-batches of a step whose counts the placement choice prices its candidates on
(the step's first ones): the mean hides the per-call peaks a placement must absorb, and
every one more costs a plan per candidate in host time."""
# Placements (and their contexts) kept per planner: a step plans static and up to about
# a dozen candidates, so this keeps a few steps' worth.
_CACHED_PLACEMENTS = 64


def _busiest(placement: Placement) -> int:
    """The most replicas one rank sends (as home) or receives (as holder): what paces
    the refresh and the gradient reduction (``CostModel.replica_cost_per_microbatch``)."""
    sent = [0] * placement.num_ranks
    received = [0] * placement.num_ranks
    for e, r in placement.replicas:
        sent[e // placement.experts_per_rank] += 1
        received[r] += 1
    return max(max(sent), max(received))


def _memory(cost: CostModel, ctx: _PlacementContext, routed: np.ndarray,
            cells: np.ndarray, quotas: np.ndarray) -> np.ndarray:
    """[R] ``CostModel.rank_memory`` of a planned micro-batch: its routed and retained
    loads, each source's kept pairs, each instance's rows and two-stage's stored rows
    (numpy, as the planner's other per-call arithmetic)."""
    instance_retained = np.add.reduce(quotas, axis=0)                          # [I]
    return cost.rank_memory(ctx.replicas, routed,
                            np.add.reduceat(instance_retained, ctx.rank_starts),
                            sent_kept=np.add.reduce(quotas, axis=1),
                            instance_routed=np.add.reduce(cells, axis=0),
                            instance_retained=instance_retained,
                            rank_starts=ctx.rank_starts, returned=ctx.returned,
                            stored=cost.stored_per_rank(cells, quotas, ctx.rank_starts))


@functools.cache
def _warn_python_planner() -> None:
    """Once per process: the per-call planning runs in Python, ~10 x the host time."""
    warnings.warn("megatron_lrmoe._kernels has no compiled planner (not built, or built from "
                  "older sources): LayerPlanner plans in Python, about 10 x the host time per "
                  "layer call; rebuild with `bash scripts/setup.sh` or "
                  "`pip install --no-build-isolation -e .`", RuntimeWarning, stacklevel=3)
