"""Expert replicas of one MoE layer on this rank: weights plus a gradient buffer.

Design: docs/design.md, "Placement".

A replica is a copy of a home expert's weights on another EP rank. It holds no
optimizer state and is not a parameter: the home instance owns both. Two
transfers keep replicas consistent with Megatron's training loop unchanged:

* ``refresh``: at the layer's first forward of a step the home weights are
  current (the optimizer stepped, and under the distributed optimizer with
  overlapped parameter gather the pre-forward hooks have just gathered them), so
  the homes send them to the replica holders then. One all-to-all of flat buffers,
  started asynchronously at the start of the layer's forward (``start_refresh``) and
  waited for right before the region needs the replica weights (``finish_refresh``);
  received into the buffers of the previous step when the hosted replicas did not
  change.
* ``reduce_into_home``: replicas accumulate their weight gradients over the
  step's micro-batches; in the region's backward of the last one the holders send
  them to the homes, which add them to the gradients the region returns, so
  Megatron's (bucketed, possibly overlapped) reduction sees complete gradients.
  Only experts with replicas get an addition (None elsewhere: nothing allocated).

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

from megatron_lrmoe.layer.comm import all_to_all_rows, all_to_all_rows_start
from megatron_lrmoe.planning.placement import Placement

__all__ = ["ExpertReplicas"]


class ExpertReplicas:
    """The replicas this rank hosts for one layer, with their gradient buffers.

    Buffers: one flat receive buffer of the hosted replicas' weights (``w1``/``w2`` are
    views into it) and one flat gradient buffer in the accumulation dtype (``grad1``/
    ``grad2`` are views; it is what ``reduce_into_home`` sends, without a copy). Both are
    kept across steps while the hosted replicas stay the same (the weights are
    received into them again at each refresh: the homes changed with the optimizer
    step), and reallocated only when the hosted set changes.
    """

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
        self.allocations = 0
        """Times the buffers were (re)allocated: a refresh with the same hosted replicas
        reuses them."""
        self._key: tuple | None = None                # what the buffers were sized for
        self._weights_flat: torch.Tensor | None = None
        self._grads_flat: torch.Tensor | None = None
        self._pending = None                          # (work, send buffer) of a refresh

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

        Collective over the EP group: ``start_refresh`` then ``finish_refresh``."""
        self.start_refresh(placement, home_w1, home_w2)
        self.finish_refresh()

    def start_refresh(self, placement: Placement, home_w1: tuple[torch.Tensor, ...],
                      home_w2: tuple[torch.Tensor, ...]) -> None:
        """Start the refresh's all-to-all (asynchronous); ``finish_refresh`` waits for it,
        and the replica weights (``w1``, ``w2``) are valid only after that.

        Collective over the EP group (every rank starts it at the same point; none when
        ``placement`` has no replicas, which every rank knows alike). Gradient buffers
        must be empty (the previous step's were reduced in its last backward). The home
        weights must not change before ``finish_refresh``.
        """
        self.finish_refresh()
        if self.has_grads:
            raise RuntimeError("replica gradients of the previous step were never reduced "
                               "into the home experts (missing last-micro-batch backward)")
        local = len(home_w1)
        home_experts = range(self.rank * local, (self.rank + 1) * local)
        hosted = self._hosted(placement)
        self.placement = placement
        shape1, shape2 = home_w1[0].shape, home_w2[0].shape
        self._shape1, self._shape2 = shape1, shape2
        self._grad_dtype = _accumulation_dtype(home_w1[0].dtype)
        self._device = home_w1[0].device
        self.w1 = self.w2 = ()
        if not placement.replicas:
            self.experts = ()
            self.grad1 = self.grad2 = ()
            self._key = self._weights_flat = self._grads_flat = None
            return
        size1 = shape1.numel()
        per_expert = size1 + shape2.numel()
        reference = home_w1[0]
        key = (tuple(hosted), tuple(shape1), tuple(shape2), reference.dtype, self._device)
        if key != self._key:
            self._key, self.experts = key, tuple(hosted)
            self._weights_flat = reference.new_empty(len(hosted) * per_expert)
            self._grads_flat = torch.zeros(len(hosted) * per_expert, dtype=self._grad_dtype,
                                           device=self._device)
            self.grad1 = tuple(self._grads_flat[i * per_expert:i * per_expert + size1]
                               .view(shape1) for i in range(len(hosted)))
            self.grad2 = tuple(self._grads_flat[i * per_expert + size1:(i + 1) * per_expert]
                               .view(shape2) for i in range(len(hosted)))
            self.allocations += 1
        served = self._served(placement, home_experts)
        send_parts = [part for _, e in served for part in (
            home_w1[e - home_experts.start].detach().reshape(-1),
            home_w2[e - home_experts.start].detach().reshape(-1))]
        send = _counts_by_rank([r for r, _ in served], placement.num_ranks, per_expert)
        recv = _counts_by_rank([e // local for e in hosted], placement.num_ranks, per_expert)
        flat = torch.cat(send_parts) if send_parts else reference.new_empty(0)
        out, work = all_to_all_rows_start(flat, send, recv, self.group, out=self._weights_flat)
        self._weights_flat = out
        self._pending = (work, flat)

    def finish_refresh(self) -> None:
        """Wait for the refresh ``start_refresh`` began (no-op when none is pending); the
        replica weights are then bitwise the home weights."""
        if self._pending is None:
            return
        work, _ = self._pending
        self._pending = None
        if work is not None:
            work.wait()
        if not self.experts:
            self.w1 = self.w2 = ()
            return
        size1 = self._shape1.numel()
        per_expert = size1 + self._shape2.numel()
        rows = self._weights_flat.view(len(self.experts), per_expert)
        self.w1 = tuple(row[:size1].view(self._shape1) for row in rows)
        self.w2 = tuple(row[size1:].view(self._shape2) for row in rows)

    # --------------------------------------------------------------- gradients
    def accumulate(self, dw1: list[torch.Tensor], dw2: list[torch.Tensor]) -> None:
        """Add one micro-batch's replica weight gradients to the buffers."""
        for buf, grad in zip((*self.grad1, *self.grad2), (*dw1, *dw2), strict=True):
            buf.add_(grad.to(buf.dtype))
        self.has_grads = self.has_grads or bool(self.experts)

    def reduce_into_home(self, num_local: int
                         ) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
        """Send the accumulated replica gradients home; return this rank's home additions.

        Collective over the EP group. Returns (dW1, dW2) lists over this rank's
        ``num_local`` home experts: the summed gradients of the expert's replicas in the
        accumulation dtype, None for an expert without replicas (empty lists when the
        placement has none); the buffers are emptied.
        """
        placement = self.placement
        if placement is None or not placement.replicas:
            return [], []
        home_experts = range(self.rank * num_local, (self.rank + 1) * num_local)
        shape1, shape2 = self._shape1, self._shape2
        size1 = shape1.numel()
        per_expert = size1 + shape2.numel()
        send = _counts_by_rank([e // num_local for e in self.experts], placement.num_ranks,
                               per_expert)
        served = self._served(placement, home_experts)
        recv = _counts_by_rank([r for r, _ in served], placement.num_ranks, per_expert)
        flat = self._grads_flat
        if flat is None:
            flat = torch.zeros(0, dtype=self._grad_dtype, device=self._device)
        got = all_to_all_rows(flat, send, recv, self.group).view(len(served), per_expert)
        add1: list[torch.Tensor | None] = [None] * num_local
        add2: list[torch.Tensor | None] = [None] * num_local
        for (_, e), row in zip(served, got, strict=True):
            i = e - home_experts.start
            d1, d2 = row[:size1].view(shape1), row[size1:].view(shape2)
            add1[i] = d1 if add1[i] is None else add1[i] + d1
            add2[i] = d2 if add2[i] is None else add2[i] + d2
        if self._grads_flat is not None:
            self._grads_flat.zero_()
        self.has_grads = False
        return add1, add2

    def memory_bytes(self) -> int:
        """Bytes held by this rank's replicas: weights plus gradient buffers."""
        return sum(t.numel() * t.element_size()
                   for t in (self._weights_flat, self._grads_flat) if t is not None)


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Replica gradients accumulate in fp32 for low-precision weights, as Megatron's
    main grads do."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def _counts_by_rank(ranks: list[int], num_ranks: int, per_item: int) -> list[int]:
    sizes = [0] * num_ranks
    for r in ranks:
        sizes[r] += per_item
    return sizes
