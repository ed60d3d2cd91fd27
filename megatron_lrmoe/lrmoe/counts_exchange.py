"""The routed-counts exchange of the LRMoE layer.

Megatron's MoEAlltoAllTokenDispatcher owns the expert-parallel groups. The LRMoE
region moves the tokens itself (its backward sends retained rows only), so the
dispatcher's own dispatch and combine are never called: this subclass is what the
layer keeps of it, the groups, plus the one collective the plan needs, every rank's
per-expert counts n[s, e]. It stays a dispatcher subclass so Megatron code that
reads ``MoELayer.token_dispatcher`` (groups, sizes) keeps working.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher


class RoutedCountsExchange(MoEAlltoAllTokenDispatcher):
    """Megatron's all-to-all dispatcher used only for its EP groups and the counts exchange."""

    @property
    def ep_rank(self) -> int:
        return dist.get_rank(self.ep_group) if self.ep_size > 1 else 0

    def gather_counts(self, routing_map: torch.Tensor) -> torch.Tensor:
        """n[s, e] [R, E] int64 on the CPU: routed pairs from every source to every expert.

        One all-gather of E integers per rank (the planner runs on the host; every rank
        derives the same plan from the same matrix).
        """
        local = routing_map.sum(dim=0).to(torch.int64)
        if self.ep_size == 1:
            return local.unsqueeze(0).cpu()
        gathered = local.new_empty(self.ep_size * local.numel())
        dist.all_gather_into_tensor(gathered, local, group=self.ep_group)
        return gathered.view(self.ep_size, -1).cpu()
