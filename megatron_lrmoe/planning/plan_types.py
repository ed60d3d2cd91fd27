"""The planner's values: its settings and the plan of one micro-batch.

Shared by ``planner.LayerPlanner`` and the placement policies it calls
(``placement_policies``), which is why they live below both.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from megatron_lrmoe.options.lrmoe import (
    check_capacity_factor,
    check_fraction,
    check_load_smoothing,
    check_positive_int,
    check_positive_number,
    option,
)
from megatron_lrmoe.planning.cost_model import CostModel
from megatron_lrmoe.planning.instance_assignment import InstanceAssignment
from megatron_lrmoe.planning.retention import RetentionPlan

__all__ = ["MicroBatchPlan", "PlannerSettings", "budget_floor"]


def budget_floor(cost: CostModel) -> float:
    """The least memory budget (bytes per rank, all MoE layers and micro-batches in
    flight) that can run at all: perfectly balanced routing with nothing retained in
    backward (``cost.balanced_need(0.0)``: every pair is still routed in forward, with
    the forward's buffers and what is saved regardless). The one rule of the start-up
    refusal (``PlannerSettings``, ``integration.planner_inputs.check_memory_budget``); between
    it and ``cost.balanced_dropless_need()`` the planner lowers gamma
    (docs/design.md, "Memory budget")."""
    return cost.balanced_need(0.0)


@dataclass(frozen=True)
class PlannerSettings:
    """What one layer's planner needs: plain numbers and the cost model.

    ``budget_bytes`` is per rank for all MoE layers and micro-batches in flight
    (docs/design.md, "Memory budget"); each layer's planner gets
    ``budget_bytes / cost.shape.num_layers``.
    A budget below ``budget_floor(cost)`` (nothing fits even with nothing retained) is
    refused here, with that number; one between it and the balanced dropless need is
    planned: gamma is lowered to fit.
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
        # The user options' own rules are the option table's checks (options/lrmoe.py);
        # what is checked here beyond them relates the settings to each other.
        checks = [("policy", option("moe_lrmoe_placement").problem),
                  ("num_ranks", check_positive_int), ("num_experts", check_positive_int),
                  ("capacity_factor", check_capacity_factor), ("min_retention", check_fraction),
                  ("load_smoothing", check_load_smoothing)]
        if self.slots_per_rank is not None:
            checks.append(("slots_per_rank", check_positive_int))
        if self.budget_bytes is not None:
            checks.append(("budget_bytes", check_positive_number))
        for name, check in checks:
            problem = check(getattr(self, name))
            if problem is not None:
                raise ValueError(f"PlannerSettings.{name}: {problem}")
        if self.num_experts % self.num_ranks:
            raise ValueError(f"PlannerSettings.num_experts={self.num_experts} must be a "
                             f"multiple of num_ranks={self.num_ranks}")
        per_rank = self.num_experts // self.num_ranks
        slots = self.slots_per_rank
        if slots is not None and not per_rank <= slots <= self.num_experts:
            raise ValueError(f"PlannerSettings.slots_per_rank must be in "
                             f"[{per_rank}, {self.num_experts}] (experts per rank .. experts), "
                             f"got {slots!r}")
        if self.cost is not None and self.cost.shape.num_experts != self.num_experts:
            raise ValueError(f"PlannerSettings.cost: shape has {self.cost.shape.num_experts} "
                             f"experts, settings {self.num_experts}")
        ep = None if self.cost is None else self.cost.shape.expert_parallel_size
        if ep is not None and ep != self.num_ranks:
            raise ValueError(f"PlannerSettings.cost: shape has expert_parallel_size {ep}, "
                             f"settings {self.num_ranks} ranks")
        budget = self.budget_bytes
        if budget is not None:
            if self.cost is None:
                raise ValueError("PlannerSettings.cost is needed with budget_bytes")
            floor = budget_floor(self.cost)
            if budget < floor:
                raise ValueError(
                    f"PlannerSettings.budget_bytes={budget:.6g} is below the floor of "
                    f"{floor:.6g} bytes ({floor / 2**30:.3f} GiB) per rank: even perfectly "
                    f"balanced routing with nothing retained in backward does not fit")
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
        return self._popularity_slots

    @functools.cached_property
    def _popularity_slots(self) -> int:
        # Computed once: the memory-aware choice reads it every step (frozen settings).
        per_rank = self.num_experts // self.num_ranks
        slots = self.slots_per_rank
        share = self.layer_share
        if share is not None:
            cost = self.cost
            balanced = cost.balanced_dropless_need() / cost.shape.num_layers
            fit = per_rank + int((share - balanced) // cost.shape.instance_bytes)
            slots = fit if slots is None else min(slots, fit)
        slots = per_rank if slots is None else slots
        return max(per_rank, min(slots, self.num_experts))


@dataclass(frozen=True, eq=False)
class MicroBatchPlan:
    """Instance assignment and retention quotas of one layer and micro-batch (a value)."""

    assignment: InstanceAssignment
    retention: RetentionPlan
    """plan_retention over the assignment's [R, I] counts and the placement's layout."""
    capacity_factor_used: float
    """gamma actually used: below the settings' when the budget required it."""
    notes: tuple[str, ...] = ()
    """What the planner did (overflow, lowered gamma, over budget), for logs."""
    rank_load: np.ndarray | None = None
    """[R] int64 L_r, the routed pairs each rank receives (``retention.routed_per_rank``
    as a host array, without a tensor op); None where the plan was built without it."""
