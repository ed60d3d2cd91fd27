"""LRMoE's all-to-all token dispatcher.

Megatron's MoEAlltoAllTokenDispatcher owns the expert-parallel groups and the
routing metadata. The LRMoE region moves the tokens itself (its backward sends
retained rows only), so this subclass keeps Megatron's groups and adds the one
collective the plan needs: every rank's per-expert counts, n[s, e].
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher


class LRMoEAlltoAllTokenDispatcher(MoEAlltoAllTokenDispatcher):
    """All-to-all dispatcher whose dispatch and combine are done by the LRMoE region."""

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
