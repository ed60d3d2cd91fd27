"""The routed-counts exchange of the LRMoE layer.

The LRMoE region moves the tokens itself (its backward sends retained rows only), so
Megatron's token dispatcher has no role in an LRMoE layer: the layer drops the one
``MoELayer.__init__`` built and keeps this instead, the one collective the plan needs,
every rank's per-expert counts n[s, e], over the layer's expert-parallel group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class RoutedCountsExchange:
    """Every EP rank's routed pairs per expert, gathered to the host."""

    def __init__(self, ep_group: dist.ProcessGroup | None) -> None:
        self.ep_group = ep_group
        self.ep_size = dist.get_world_size(ep_group) if ep_group is not None else 1
        self.ep_rank = dist.get_rank(ep_group) if self.ep_size > 1 else 0

    def gather_counts(self, routing_map: torch.Tensor) -> torch.Tensor:
        """n[s, e] [R, E] int64 on the CPU: routed pairs from every source to every expert.

        One all-gather of E integers per rank (the planner runs on the host; every rank
        derives the same plan from the same matrix). The forward's one host read.
        """
        local = routing_map.sum(dim=0).to(torch.int64)
        if self.ep_size == 1:
            return local.unsqueeze(0).cpu()
        gathered = local.new_empty(self.ep_size * local.numel())
        dist.all_gather_into_tensor(gathered, local, group=self.ep_group)
        return gathered.view(self.ep_size, -1).cpu()
