"""Collectives the LRMoE region and the replicas share."""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["all_to_all_rows", "all_to_all_rows_start"]


def all_to_all_rows(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    """Variable-size all-to-all along dim 0 (identity on a single rank)."""
    if group is None or dist.get_world_size(group) == 1:
        return x.clone() if sum(send) else x.new_empty((0, *x.shape[1:]))
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv,
                           input_split_sizes=send, group=group)
    return out


def all_to_all_rows_start(x: torch.Tensor, send: list[int], recv: list[int], group,
                          out: torch.Tensor | None = None):
    """``all_to_all_rows`` started asynchronously: returns (out, work), where ``work`` is
    the collective's handle (``work.wait()`` before reading ``out``; None when nothing
    was started: a single rank, where ``out`` is ready). ``out``: a receive buffer of
    [sum(recv), ...] to reuse (a new one otherwise). ``x`` must stay unchanged until the
    wait."""
    rows = sum(recv)
    if out is None or out.shape[0] != rows or out.dtype != x.dtype or out.device != x.device:
        out = x.new_empty((rows, *x.shape[1:]))
    if group is None or dist.get_world_size(group) == 1:
        if rows:
            out.copy_(x)
        return out, None
    work = dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv,
                                  input_split_sizes=send, group=group, async_op=True)
    return out, work
