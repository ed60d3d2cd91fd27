"""Expert replicas of one MoE layer on this rank: weights plus a gradient buffer.

Design: docs/design.md, "Placement".

A replica is a copy of a home expert's weights on another EP rank. It holds no
optimizer state and is not a parameter: the home instance owns both. Two
transfers keep replicas consistent with Megatron's training loop unchanged:

* ``refresh``: at the layer's first forward of a step the home weights are
  current (the optimizer stepped, and under the distributed optimizer with
  overlapped parameter gather the pre-forward hooks have just gathered them), so
  the homes send them to the replica holders then. One all-to-all of flat buffers.
* ``reduce_into_home``: replicas accumulate their weight gradients over the
  step's micro-batches; in the region's backward of the last one the holders send
  them to the homes, which add them to the gradients the region returns, so
  Megatron's (bucketed, possibly overlapped) reduction sees complete gradients.

Both are collectives over the EP group: every rank calls them at the same point,
also ranks without replicas (they send and receive nothing).

Flat buffer layout, for a transfer between home rank h and holder r: the
replicas hosted on r of experts homed on h, by expert ascending, each as W1 then
W2 flattened. Placement's rank-major instance order puts a rank's replicas by
expert ascending too, so both sides walk their lists in the same order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_lrmoe.lrmoe.comm import all_to_all_rows
from megatron_lrmoe.lrmoe.placement import Placement

__all__ = ["ExpertReplicas"]


class ExpertReplicas:
    """The replicas this rank hosts for one layer, with their gradient buffers."""

    def __init__(self, rank: int, group: dist.ProcessGroup | None) -> None:
        self.rank = rank
        self.group = group
        self.placement: Placement | None = None
        self.experts: tuple[int, ...] = ()            # expert of each hosted replica
        self.w1: tuple[torch.Tensor, ...] = ()
        self.w2: tuple[torch.Tensor, ...] = ()
        self.grad1: tuple[torch.Tensor, ...] = ()     # accumulated dW1 of each replica
        self.grad2: tuple[torch.Tensor, ...] = ()
        self.has_grads = False

    # ------------------------------------------------------------------ layout
    def _hosted(self, placement: Placement) -> list[int]:
        return [e for e, r in placement.replicas if r == self.rank]

    def _served(self, placement: Placement, home_experts: range) -> list[tuple[int, int]]:
        """(holder rank, expert) of the replicas of this rank's home experts, by holder."""
        return sorted((r, e) for e, r in placement.replicas if e in home_experts)

    # ----------------------------------------------------------------- refresh
    def refresh(self, placement: Placement, home_w1: tuple[torch.Tensor, ...],
                home_w2: tuple[torch.Tensor, ...]) -> None:
        """Make this rank's replicas (for ``placement``) bitwise copies of the home weights.

        Collective over the EP group. Gradient buffers must be empty (the previous
        step's were reduced in its last backward).
        """
        if self.has_grads:
            raise RuntimeError("replica gradients of the previous step were never reduced "
                               "into the home experts (missing last-micro-batch backward)")
        local = len(home_w1)
        home_experts = range(self.rank * local, (self.rank + 1) * local)
        hosted = self._hosted(placement)
        self.placement, self.experts = placement, tuple(hosted)
        self._shape1, self._shape2 = home_w1[0].shape, home_w2[0].shape
        self._grad_dtype = _accumulation_dtype(home_w1[0].dtype)
        self._device = home_w1[0].device
        if not placement.replicas:
            self.w1 = self.w2 = self.grad1 = self.grad2 = ()
            return
        shape1, shape2 = self._shape1, self._shape2
        per_expert = shape1.numel() + shape2.numel()
        served = self._served(placement, home_experts)
        send_parts = [torch.cat([home_w1[e - home_experts.start].detach().reshape(-1),
                                 home_w2[e - home_experts.start].detach().reshape(-1)])
                      for _, e in served]
        send = _counts_by_rank([r for r, _ in served], placement.num_ranks, per_expert)
        homes = [e // local for e in hosted]
        recv = _counts_by_rank(homes, placement.num_ranks, per_expert)
        reference = home_w1[0]
        flat = torch.cat(send_parts) if send_parts else reference.new_empty(0)
        got = all_to_all_rows(flat, send, recv, self.group).view(len(hosted), per_expert)
        self.w1 = tuple(row[: shape1.numel()].view(shape1) for row in got)
        self.w2 = tuple(row[shape1.numel():].view(shape2) for row in got)
        self.grad1 = tuple(torch.zeros(shape1, dtype=self._grad_dtype, device=reference.device)
                           for _ in hosted)
        self.grad2 = tuple(torch.zeros(shape2, dtype=self._grad_dtype, device=reference.device)
                           for _ in hosted)

    # --------------------------------------------------------------- gradients
    def accumulate(self, dw1: list[torch.Tensor], dw2: list[torch.Tensor]) -> None:
        """Add one micro-batch's replica weight gradients to the buffers."""
        for buf, grad in zip((*self.grad1, *self.grad2), (*dw1, *dw2), strict=True):
            buf.add_(grad.to(buf.dtype))
        self.has_grads = self.has_grads or bool(self.experts)

    def reduce_into_home(self, num_local: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Send the accumulated replica gradients home; return this rank's home additions.

        Collective over the EP group. Returns (dW1, dW2) lists over this rank's
        ``num_local`` home experts (zeros where no replica exists), in the
        accumulation dtype; the buffers are emptied.
        """
        placement = self.placement
        if placement is None or not placement.replicas:
            return [], []
        home_experts = range(self.rank * num_local, (self.rank + 1) * num_local)
        shape1, shape2 = self._shape1, self._shape2
        per_expert = shape1.numel() + shape2.numel()
        send = _counts_by_rank([e // num_local for e in self.experts], placement.num_ranks,
                               per_expert)
        served = self._served(placement, home_experts)
        recv = _counts_by_rank([r for r, _ in served], placement.num_ranks, per_expert)
        parts = [torch.cat([g1.reshape(-1), g2.reshape(-1)])
                 for g1, g2 in zip(self.grad1, self.grad2, strict=True)]
        dtype, device = self._grad_dtype, self._device
        flat = torch.cat(parts) if parts else torch.zeros(0, dtype=dtype, device=device)
        got = all_to_all_rows(flat, send, recv, self.group).view(len(served), per_expert)
        add1 = [torch.zeros(shape1, dtype=dtype, device=device) for _ in home_experts]
        add2 = [torch.zeros(shape2, dtype=dtype, device=device) for _ in home_experts]
        for (_, e), row in zip(served, got, strict=True):
            add1[e - home_experts.start] += row[: shape1.numel()].view(shape1)
            add2[e - home_experts.start] += row[shape1.numel():].view(shape2)
        for buf in (*self.grad1, *self.grad2):
            buf.zero_()
        self.has_grads = False
        return add1, add2

    def memory_bytes(self) -> int:
        """Bytes held by this rank's replicas: weights plus gradient buffers."""
        return sum(t.numel() * t.element_size()
                   for t in (*self.w1, *self.w2, *self.grad1, *self.grad2))


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Replica gradients accumulate in fp32 for low-precision weights, as Megatron's
    main grads do."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def _counts_by_rank(ranks: list[int], num_ranks: int, per_item: int) -> list[int]:
    sizes = [0] * num_ranks
    for r in ranks:
        sizes[r] += per_item
    return sizes
