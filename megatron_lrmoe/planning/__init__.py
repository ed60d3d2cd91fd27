"""Pure host-side planning: planner, placement, instance assignment, retention, cost model."""
