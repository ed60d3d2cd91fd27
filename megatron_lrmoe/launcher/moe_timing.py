"""Wall time spent inside MoE layers, forward and backward.

This figure is the basis of every benchmark of the project, so here is exactly
what it measures.

Forward: for each MoE layer call, the wall time from the layer's forward entry
(a forward pre-hook) to its exit (a forward hook). It spans the router, token
dispatch (all-to-all or all-gather), the experts, combine and any shared expert.

Backward: the layer's input and output are wrapped in two identity autograd
functions. The autograd engine calls the output's identity when the gradient of
the layer output is ready (backward enters the layer) and the input's identity
once every gradient path inside the layer has delivered into the input's
gradient (backward leaves the layer). The interval between the two is the
layer's backward: expert backward, both backward all-to-alls, router backward,
aux-loss backward. Each call gets its own token, so micro-batches interleaved by
pipeline schedules are paired correctly.

On CUDA both ends synchronize the device first, otherwise wall time would
measure kernel launches; that costs some overlap, so timing is on by default in
the launcher and can be disabled (``--no-moe-timing``). On CPU every op is
synchronous and nothing extra happens.

Per step the launcher reduces these per-rank sums: the maximum over the ranks of
a pipeline stage (the slowest rank sets the pace under expert parallelism),
summed over pipeline stages.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from megatron.core.transformer.moe.moe_layer import BaseMoELayer

__all__ = ["MoETimer", "attach_moe_timer"]


def _now(sync_cuda: bool) -> float:
    if sync_cuda:
        torch.cuda.synchronize()
    return time.perf_counter()


@dataclass
class _Interval:
    start: float | None = None


@dataclass
class MoETimer:
    """Accumulates MoE forward/backward seconds of this rank until ``reset()``."""

    sync_cuda: bool = False
    forward_seconds: float = 0.0
    backward_seconds: float = 0.0
    forward_calls: int = 0
    backward_calls: int = 0

    def reset(self) -> None:
        self.forward_seconds = self.backward_seconds = 0.0
        self.forward_calls = self.backward_calls = 0

    def now(self) -> float:
        return _now(self.sync_cuda)


class _BackwardExit(torch.autograd.Function):
    """Identity on the layer input; its backward marks the end of the layer's backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, timer: MoETimer, interval: _Interval) -> torch.Tensor:
        ctx.timer, ctx.interval = timer, interval
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        timer, interval = ctx.timer, ctx.interval
        if interval.start is not None:
            timer.backward_seconds += timer.now() - interval.start
            timer.backward_calls += 1
            interval.start = None
        return grad, None, None


class _BackwardEntry(torch.autograd.Function):
    """Identity on the layer output; its backward marks the start of the layer's backward."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, timer: MoETimer, interval: _Interval) -> torch.Tensor:
        ctx.timer, ctx.interval = timer, interval
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.interval.start = ctx.timer.now()
        return grad, None, None


def attach_moe_timer(model: torch.nn.Module, timer: MoETimer) -> int:
    """Register the timing hooks on every Megatron MoE layer of ``model``.

    Returns the number of layers instrumented.
    """
    count = 0
    for module in model.modules():
        if isinstance(module, BaseMoELayer):
            _instrument(module, timer)
            count += 1
    return count


def _instrument(layer: torch.nn.Module, timer: MoETimer) -> None:
    def pre_hook(module, args, kwargs):
        interval = _Interval()
        module._lrmoe_timing = (interval, timer.now())
        hidden = args[0] if args else kwargs["hidden_states"]
        if torch.is_grad_enabled() and hidden.requires_grad:
            hidden = _BackwardExit.apply(hidden, timer, interval)
        if args:
            return (hidden, *args[1:]), kwargs
        return args, dict(kwargs, hidden_states=hidden)

    def post_hook(module, args, kwargs, output):
        interval, start = module._lrmoe_timing
        del module._lrmoe_timing
        out, *rest = output
        if torch.is_grad_enabled() and out.requires_grad:
            out = _BackwardEntry.apply(out, timer, interval)
        timer.forward_seconds += timer.now() - start
        timer.forward_calls += 1
        return (out, *rest)

    layer.register_forward_pre_hook(pre_hook, with_kwargs=True)
    layer.register_forward_hook(post_hook, with_kwargs=True)
