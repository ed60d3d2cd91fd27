"""Collectives the LRMoE region and the replicas share."""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["all_to_all_rows"]


def all_to_all_rows(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    """Variable-size all-to-all along dim 0 (identity on a single rank)."""
    if group is None or dist.get_world_size(group) == 1:
        return x.clone() if sum(send) else x.new_empty((0, *x.shape[1:]))
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv,
                           input_split_sizes=send, group=group)
    return out
