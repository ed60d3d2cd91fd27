"""Expert replicas of one MoE layer on this rank: weights plus a gradient buffer.

Design: docs/design.md, "Placement".

A replica is a copy of a home expert's weights (and biases, where the layer has them) on
another EP rank. It holds no optimizer state and is not a parameter: the home instance
owns both. Two transfers keep replicas consistent with Megatron's training loop unchanged:

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
replicas hosted on r of experts homed on h, by expert ascending, each as W1 then W2
(then b1, b2 with expert biases) flattened. Placement's rank-major instance order puts a
rank's replicas by expert ascending too, so both sides walk their lists in the same order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_lrmoe.layer.comm import all_to_all_rows, all_to_all_rows_start
from megatron_lrmoe.planning.placement import Placement

__all__ = ["ExpertReplicas"]


class ExpertReplicas:
    """The replicas this rank hosts for one layer, with their gradient buffers.

    Buffers: one flat receive buffer of the hosted replicas' parameters (``params``:
    views into it, by kind; ``w1``/``w2`` the weights') and one flat
    gradient buffer in the accumulation dtype (``grads`` holds views, by kind; it is what
    ``reduce_into_home`` sends, without a copy). Both are kept across steps while the
    hosted replicas stay the same (the parameters are received into them again at each
    refresh: the homes changed with the optimizer step), and reallocated only when the
    hosted set changes.
    """

    def __init__(self, rank: int, group: dist.ProcessGroup | None) -> None:
        self.rank = rank
        self.group = group
        self.placement: Placement | None = None
        self.experts: tuple[int, ...] = ()            # expert of each hosted replica
        self.params: tuple[tuple[torch.Tensor, ...], ...] = ()
        """Each hosted replica's parameters by kind (W1s, W2s[, b1s, b2s]: the home
        parameters' order given to ``start_refresh``); empty without replicas."""
        self.grads: tuple[tuple[torch.Tensor, ...], ...] = ()
        """Each hosted replica's accumulated gradients, by kind likewise."""
        self.has_grads = False
        self.allocations = 0
        """Times the buffers were (re)allocated: a refresh with the same hosted replicas
        reuses them."""
        self._key: tuple | None = None                # what the buffers were sized for
        self._shapes: tuple[torch.Size, ...] = ()     # one per kind
        self._weights_flat: torch.Tensor | None = None
        self._grads_flat: torch.Tensor | None = None
        self._pending = None                          # (work, send buffer) of a refresh

    def _kind(self, index: int) -> tuple[torch.Tensor, ...]:
        return self.params[index] if len(self.params) > index else ()

    @property
    def w1(self) -> tuple[torch.Tensor, ...]:
        return self._kind(0)

    @property
    def w2(self) -> tuple[torch.Tensor, ...]:
        return self._kind(1)

    # ------------------------------------------------------------------ layout
    def _hosted(self, placement: Placement) -> list[int]:
        return [e for e, r in placement.replicas if r == self.rank]

    def _served(self, placement: Placement, home_experts: range) -> list[tuple[int, int]]:
        """(holder rank, expert) of the replicas of this rank's home experts, by holder."""
        return sorted((r, e) for e, r in placement.replicas if e in home_experts)

    def _per_expert(self) -> int:
        return sum(shape.numel() for shape in self._shapes)

    def _split(self, row: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """One expert's flat row as its parameters (views), kind by kind."""
        parts = row.split([shape.numel() for shape in self._shapes])
        return tuple(part.view(shape) for part, shape in zip(parts, self._shapes, strict=True))

    def _by_kind(self, flat: torch.Tensor, count: int) -> tuple[tuple[torch.Tensor, ...], ...]:
        """A flat buffer of ``count`` experts as views by kind (``params``' layout)."""
        rows = [self._split(row) for row in flat.split(self._per_expert())[:count]]
        return tuple(zip(*rows, strict=True)) if rows else ()

    # ----------------------------------------------------------------- refresh
    def refresh(self, placement: Placement,
                home: tuple[tuple[torch.Tensor, ...], ...]) -> None:
        """Make this rank's replicas (for ``placement``) bitwise copies of the home
        parameters ``home`` (by kind: W1s, W2s[, b1s, b2s]).

        Collective over the EP group: ``start_refresh`` then ``finish_refresh``."""
        self.start_refresh(placement, home)
        self.finish_refresh()

    def start_refresh(self, placement: Placement,
                      home: tuple[tuple[torch.Tensor, ...], ...]) -> None:
        """Start the refresh's all-to-all (asynchronous); ``finish_refresh`` waits for it,
        and the replica parameters (``params``) are valid only after that.

        ``home``: this rank's home experts' parameters by kind (W1s, W2s, then b1s, b2s
        for a layer with expert biases), each one tensor per home expert. Collective over
        the EP group (every rank starts it at the same point; none when ``placement`` has
        no replicas, which every rank knows alike). Gradient buffers must be empty (the
        previous step's were reduced in its last backward). The home parameters must not
        change before ``finish_refresh``.

        Flat layout per expert: its parameters kind by kind, each flattened (W1, W2, b1,
        b2), in one row of the transfer and of the gradient buffer.
        """
        self.finish_refresh()
        if self.has_grads:
            raise RuntimeError("replica gradients of the previous step were never reduced "
                               "into the home experts (missing last-micro-batch backward)")
        local = len(home[0])
        home_experts = range(self.rank * local, (self.rank + 1) * local)
        hosted = self._hosted(placement)
        self.placement = placement
        reference = home[0][0]
        self._shapes = tuple(kind[0].shape for kind in home)
        self._grad_dtype = _accumulation_dtype(reference.dtype)
        self._device = reference.device
        self.params = ()
        if not placement.replicas:
            self.experts = ()
            self.grads = ()
            self._key = self._weights_flat = self._grads_flat = None
            return
        per_expert = self._per_expert()
        key = (tuple(hosted), self._shapes, reference.dtype, self._device)
        if key != self._key:
            self._key, self.experts = key, tuple(hosted)
            self._weights_flat = reference.new_empty(len(hosted) * per_expert)
            self._grads_flat = torch.zeros(len(hosted) * per_expert, dtype=self._grad_dtype,
                                           device=self._device)
            self.grads = self._by_kind(self._grads_flat, len(hosted))
            self.allocations += 1
        served = self._served(placement, home_experts)
        send_parts = [kind[e - home_experts.start].detach().reshape(-1)
                      for _, e in served for kind in home]
        send = _counts_by_rank([r for r, _ in served], placement.num_ranks, per_expert)
        recv = _counts_by_rank([e // local for e in hosted], placement.num_ranks, per_expert)
        flat = torch.cat(send_parts) if send_parts else reference.new_empty(0)
        out, work = all_to_all_rows_start(flat, send, recv, self.group, out=self._weights_flat)
        self._weights_flat = out
        self._pending = (work, flat)

    def finish_refresh(self) -> None:
        """Wait for the refresh ``start_refresh`` began (no-op when none is pending); the
        replica parameters are then bitwise the home parameters."""
        if self._pending is None:
            return
        work, _ = self._pending
        self._pending = None
        if work is not None:
            work.wait()
        if not self.experts:
            self.params = ()
            return
        self.params = self._by_kind(self._weights_flat, len(self.experts))

    # --------------------------------------------------------------- gradients
    def accumulate(self, grads: tuple[list[torch.Tensor], ...]) -> None:
        """Add one micro-batch's replica gradients (by kind, as ``params``) to the
        buffers."""
        buffers = [buf for kind in self.grads for buf in kind]
        for buf, grad in zip(buffers, [g for kind in grads for g in kind], strict=True):
            buf.add_(grad.to(buf.dtype))
        self.has_grads = self.has_grads or bool(self.experts)

    def reduce_into_home(self, num_local: int) -> tuple[list[torch.Tensor | None], ...]:
        """Send the accumulated replica gradients home; return this rank's home additions.

        Collective over the EP group. Returns, by kind (as ``params``), lists over this
        rank's ``num_local`` home experts: the summed gradients of the expert's replicas
        in the accumulation dtype, None for an expert without replicas (an empty tuple
        when the placement has none); the buffers are emptied.
        """
        placement = self.placement
        if placement is None or not placement.replicas:
            return ()
        home_experts = range(self.rank * num_local, (self.rank + 1) * num_local)
        per_expert = self._per_expert()
        send = _counts_by_rank([e // num_local for e in self.experts], placement.num_ranks,
                               per_expert)
        served = self._served(placement, home_experts)
        recv = _counts_by_rank([r for r, _ in served], placement.num_ranks, per_expert)
        flat = self._grads_flat
        if flat is None:
            flat = torch.zeros(0, dtype=self._grad_dtype, device=self._device)
        got = all_to_all_rows(flat, send, recv, self.group).view(len(served), per_expert)
        adds: list[list[torch.Tensor | None]] = [[None] * num_local for _ in self._shapes]
        for (_, e), row in zip(served, got, strict=True):
            i = e - home_experts.start
            for add, part in zip(adds, self._split(row), strict=True):
                add[i] = part if add[i] is None else add[i] + part
        if self._grads_flat is not None:
            self._grads_flat.zero_()
        self.has_grads = False
        return tuple(adds)

    def memory_bytes(self) -> int:
        """Bytes held by this rank's replicas: parameters plus gradient buffers."""
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
