"""The LRMoE region's expert GEMMs, forward and backward: grouped or a per-expert loop.

Notation (docs/design.md, "Notation"), on one rank: L local instances, rows grouped by
instance (rows[l] each, exp-major), N = sum of rows; H hidden, F1 = rows of W1 (2F when
gated), F expert FFN size. w1[l] [F1, H], w2[l] [H, F] (Megatron's linear layouts).

Forward:  z = x W1^T + b1 [N, F1], h = act(z) [N, F], o = h W2^T + b2 [N, H], a = ||h||
per row (b1 [F1], b2 [H]: each instance's biases, Megatron's ``add_bias_linear``; none
without it).
Backward over the retained rows (K of them): h = act(z) again, dh = g W2, dz from the
activation's gradient, dW2 = g^T h, dW1 = dz^T x, dX = dz W1; with biases db2 = the sum
of g's rows, db1 = the sum of dz's rows, per instance.

Two implementations, numerically equivalent (not bitwise):
- ``grouped``: ``torch.nn.functional.grouped_mm`` over variable-size groups (int32
  cumulative offsets): one call per GEMM whatever L is. It reads the weights as one
  [L, F1, H] and one [L, H, F] tensor: ``WeightStack``, zero-copy strided views over the
  storage the per-expert weights live in when they lie there at one spacing
  (``stacked_view``; descending: the caller runs the groups in that order), else one
  ``torch.stack`` per weight and call (a copy). A start-up probe
  (``strided_weights_work``) checks grouped_mm reads such views as it reads a stack.
- the loop: per-instance matmuls writing into slices of preallocated outputs (no
  concatenation copies), the CPU default.

Biases: the loop folds each instance's into its GEMM (``addmm``); the grouped path adds
them in place to each instance's rows (``add_bias_rows``: slices of host-known size,
one small kernel per instance, no temporary), since torch's grouped_mm takes one bias
for all groups, and sums the bias gradients per instance with one grouped GEMM against a
column of ones (``_grouped_row_sums``).

Which one runs: ``use_grouped_mm``, by the rule ``grouped_mm_rule`` (a pure function of
device type, dtype and compute capability), then a start-up probe. grouped_mm needs
16-byte aligned rows (H, F, F1 multiples of 16 bytes). On CUDA, torch (2.9 to 2.13 at
least: ``_grouped_mm_cuda`` in aten/src/ATen/native/cuda/Blas.cpp) runs its grouped
kernel (``bf16bf16_grouped_mm``, CUTLASS, sm90/sm100) only for bf16 operands and output on
compute capability 9.x or 10.x; any other dtype or GPU goes to ``_grouped_mm_fallback``
(ATen/native/GroupedMMUtils.h), a per-group loop that copies ``offs`` to the host and
reads one ``.item()`` per group: a host sync in every call, which the region's own loop
does not have. So the default (``grouped_gemm=None``) takes the grouped path on CUDA
only where the kernel exists, and an explicit request (``--moe-grouped-gemm``) that would
land on the fallback runs the loop with a warning naming the dtype and the GPU. The
probe (``grouped_mm_works``: once per device and dtype, tiny shapes in the region's
forward and backward call patterns, compared with the loop; on a CUDA device the GEMMs
run under ``torch.cuda.set_sync_debug_mode("error")``) catches a torch whose dispatch
differs from the rule; a failed probe means the loop. On the CPU grouped_mm runs in
fp32 and bf16 (torch's reference implementation, the same per-group loop, no device to
sync with); the loop stays the CPU default. Fake tensors (FakeTensorMode) never run
the probe: with no GPU to read a capability from, the default is the loop and an
explicit request traces the grouped path (in bf16, the only dtype torch's fake/meta
implementation of CUDA grouped_mm accepts).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch._subclasses.fake_tensor import is_fake

_LOG = logging.getLogger(__name__)

__all__ = ["GradSink", "GroupedMMRule", "WeightStack", "add_bias_rows", "experts_backward",
           "experts_forward", "grouped_mm_rule", "grouped_mm_works", "stacked_view",
           "strided_weights_work", "use_grouped_mm", "weight_stack"]

# (parameter "w1", "w2", "b1" or "b2", local instance, its gradient) -> whether it was
# taken (accumulated already)
GradSink = Callable[[str, int, torch.Tensor], bool]

_GROUPED_MM: Callable | None = getattr(torch.nn.functional, "grouped_mm", None) or getattr(
    torch, "_grouped_mm", None)
_warned: set[str] = set()


def _warn_once(text: str) -> None:
    if text not in _warned:
        _warned.add(text)
        _LOG.warning(text)


# -----------------------------------------------------------------------------
# Choice
# -----------------------------------------------------------------------------


class GroupedMMRule(NamedTuple):
    """What ``grouped_mm_rule`` decided, and why."""

    grouped: bool
    """The default (``grouped_gemm=None``) runs the expert GEMMs grouped."""
    syncs: bool
    """torch's grouped_mm would take its per-group fallback here, which reads the group
    offsets on the host (a device sync per call): an explicit request falls back to the
    region's loop, with a warning."""
    reason: str


# torch's CUDA grouped_mm kernel (bf16bf16_grouped_mm): sm90 and sm100 families only.
_KERNEL_MAJORS = (9, 10)


def grouped_mm_rule(device_type: str, dtype: torch.dtype,
                    capability: tuple[int, int] | None, hip: bool = False) -> GroupedMMRule:
    """Whether the region's default runs its expert GEMMs grouped on this device, and why.

    ``capability``: the CUDA device's compute capability, None where none can be read
    (fake tensors on a machine without a GPU). ``hip``: a ROCm build of torch. A pure
    function of its arguments: torch's ``_grouped_mm_cuda`` (2.9 to 2.13) runs its
    grouped kernel only for bf16 on compute capability 9.x/10.x, and otherwise a
    fallback loop that syncs with the host once per call.
    """
    if device_type != "cuda":
        return GroupedMMRule(False, False, f"on {device_type} torch's grouped_mm is its "
                             "per-group reference loop: the region's own loop is the default")
    if hip:
        return GroupedMMRule(False, False, "on ROCm torch's grouped_mm has its kernel only "
                             "on gfx942/gfx950 in bf16, which this rule does not check: the "
                             "default keeps the loop, an explicit request is left to the "
                             "start-up probe (run in sync-debug mode)")
    if dtype != torch.bfloat16:
        return GroupedMMRule(False, True, f"torch's CUDA grouped_mm has a kernel only for "
                             f"bf16, and in {dtype} takes its per-group fallback, which copies "
                             "the group offsets to the host (a device sync per call)")
    if capability is None:
        return GroupedMMRule(False, False, "no compute capability to read (fake tensors "
                             "without a GPU): the default keeps the per-expert loop")
    if capability[0] not in _KERNEL_MAJORS:
        return GroupedMMRule(False, True, f"torch's CUDA grouped_mm has its bf16 kernel only "
                             f"on compute capability 9.x/10.x, and on "
                             f"{capability[0]}.{capability[1]} takes its per-group fallback, "
                             "which copies the group offsets to the host (a device sync per "
                             "call)")
    return GroupedMMRule(True, False, f"bf16 on compute capability "
                         f"{capability[0]}.{capability[1]}: torch's grouped kernel")


def _probe_inputs(device: torch.device, dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    rows, h, f = [3, 0, 5], 16, 32
    n = sum(rows)
    x = torch.randn(n, h, generator=g).to(device, dtype)
    w = torch.randn(len(rows), f, h, generator=g).to(device, dtype)
    dy = torch.randn(n, f, generator=g).to(device, dtype)
    offs = torch.tensor(rows, device=device).cumsum(0).to(torch.int32)
    return rows, x, w, dy, offs


def _probe_gemms(x, w, dy, offs):
    """The region's call patterns: forward x @ W^T (stacked weights, transposed);
    backward dZ @ W (stacked weights as they are: dX, dH), dZ^T @ X per group (dW1, dW2)."""
    return (_GROUPED_MM(x, w.transpose(1, 2), offs=offs),
            _GROUPED_MM(dy, w, offs=offs),
            _GROUPED_MM(dy.t(), x, offs=offs))


@functools.lru_cache(maxsize=16)
def _probe(device: torch.device, dtype: torch.dtype) -> str | None:
    """None when grouped_mm passes the start-up probe, else why it failed."""
    if _GROUPED_MM is None:
        return "this torch has no grouped_mm"
    on_cuda = device.type == "cuda"
    mode = torch.cuda.get_sync_debug_mode() if on_cuda else 0
    try:
        if on_cuda:
            torch.cuda.set_sync_debug_mode(0)   # the inputs' host-to-device copies block
        rows, x, w, dy, offs = _probe_inputs(device, dtype)
        if on_cuda:
            torch.cuda.synchronize(device)
            torch.cuda.set_sync_debug_mode("error")
        try:
            got = _probe_gemms(x, w, dy, offs)
        except RuntimeError as error:
            if on_cuda and "synchroniz" in str(error):
                return (f"torch's grouped_mm synchronised with the host on {device.type} in "
                        f"{dtype} ({str(error).splitlines()[0]})")
            raise
        finally:
            if on_cuda:
                torch.cuda.set_sync_debug_mode(0)
        want = (torch.cat([a @ b.t() for a, b in zip(x.split(rows), w, strict=True)]),
                torch.cat([a @ b for a, b in zip(dy.split(rows), w, strict=True)]),
                torch.stack([a.t() @ b for a, b in zip(dy.split(rows), x.split(rows),
                                                        strict=True)]))
        tol = 1e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-4
        for name, a, b in zip(("x @ W^T", "dZ @ W", "dZ^T @ X"), got, want, strict=True):
            if not torch.allclose(a.float(), b.float(), rtol=tol, atol=tol):
                return (f"torch's grouped_mm gave wrong results for {name} on {device.type} in "
                        f"{dtype}")
        return None
    except (RuntimeError, NotImplementedError, TypeError, ValueError) as error:
        return (f"torch's grouped_mm failed its start-up probe on {device.type} in {dtype} "
                f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})")
    finally:
        if on_cuda:
            torch.cuda.set_sync_debug_mode(mode)


@functools.lru_cache(maxsize=16)
def _probe_views(device: torch.device, dtype: torch.dtype) -> str | None:
    """None when grouped_mm reads a strided [L, ...] weight view (a batch stride beyond
    one weight, as ``stacked_view`` gives) as it reads the contiguous stack, else why not."""
    try:
        rows, x, w, dy, offs = _probe_inputs(device, dtype)
        padded = w.new_zeros((w.shape[0], w[0].numel() + 16 // w.element_size()))
        padded[:, :w[0].numel()] = w.reshape(w.shape[0], -1)
        view = padded[:, :w[0].numel()].view(w.shape)
        for name, a, b in zip(("x @ W^T", "dZ @ W"), _probe_gemms(x, view, dy, offs)[:2],
                              _probe_gemms(x, w, dy, offs)[:2], strict=True):
            if not torch.equal(a, b):
                return f"torch's grouped_mm misreads strided weights ({name})"
        return None
    except (RuntimeError, NotImplementedError, TypeError, ValueError) as error:
        return (f"torch's grouped_mm refused strided weights ({type(error).__name__}: "
                f"{str(error).splitlines()[0] if str(error) else ''})")


def strided_weights_work(x: torch.Tensor) -> str | None:
    """None when the grouped GEMMs may read ``stacked_view``'s strided weights on x's
    device and dtype (a start-up probe, once per device and dtype; fake tensors are
    trusted, having no values to compare), else why not."""
    return None if is_fake(x) else _probe_views(x.device, x.dtype)


def grouped_mm_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Start-up probe: grouped_mm gives the loop's result on ``device`` in ``dtype``.

    Runs the region's call patterns (forward x @ W^T with stacked, transposed weights;
    backward dZ @ W and dZ^T @ X per group; an empty group in the middle) on tiny aligned
    shapes and compares with per-group matmuls; on a CUDA device the grouped calls run
    under ``torch.cuda.set_sync_debug_mode("error")``, so a fallback that reads the host
    fails the probe. Cached per (device, dtype): paid once per process, at the first
    region call.
    """
    return _probe(device, dtype) is None


def _aligned(dtype: torch.dtype, w1: torch.Tensor, w2: torch.Tensor) -> bool:
    step = 16 // dtype.itemsize
    return all(d % step == 0 for d in (*w1.shape, *w2.shape))


def _capability(device: torch.device, fake: bool) -> tuple[int, int] | None:
    if device.type != "cuda" or (fake and not torch.cuda.is_available()):
        return None
    return tuple(torch.cuda.get_device_capability(device))


def use_grouped_mm(requested: bool | None, x: torch.Tensor, w1: torch.Tensor,
                   w2: torch.Tensor) -> bool:
    """Whether the region's expert GEMMs run grouped (else the per-expert loop).

    ``requested``: None = where ``grouped_mm_rule`` says so (CUDA, bf16, compute
    capability 9.x/10.x) and the probe passes, else the loop; True
    (``--moe-grouped-gemm``) = grouped on any device where it applies without a host
    sync, else the loop with a warning naming why; False = the loop.
    """
    if requested is False:
        return False
    fake = is_fake(x)
    rule = grouped_mm_rule(x.device.type, x.dtype, _capability(x.device, fake),
                           hip=torch.version.hip is not None)
    if requested is None and not rule.grouped:
        return False
    why = None
    if not _aligned(x.dtype, w1, w2):
        why = (f"expert dims {tuple(w1.shape)}, {tuple(w2.shape)} are not multiples of 16 "
               f"bytes in {x.dtype}")
    elif _GROUPED_MM is None:
        why = "this torch has no grouped_mm"
    elif rule.syncs:
        why = rule.reason
    elif fake:
        if x.device.type == "cuda" and x.dtype != torch.bfloat16:
            why = f"torch's fake CUDA grouped_mm takes bf16 only, not {x.dtype}"
    else:
        why = _probe(x.device, x.dtype)
    if why is None:
        return True
    if requested:
        _warn_once(f"LRMoE: --moe-grouped-gemm (grouped_gemm=True) asks for grouped expert "
                   f"GEMMs in {x.dtype}, but {why}; the region runs its per-expert loop "
                   "instead (grouped GEMMs on CUDA need --bf16 on a compute capability "
                   "9.x/10.x GPU)")
    return False


# -----------------------------------------------------------------------------
# The weights as [L, ...] tensors
# -----------------------------------------------------------------------------


class WeightStack(NamedTuple):
    """The local instances' weights as grouped_mm reads them: w1 [L, F1, H], w2 [L, H, F].

    ``reversed``: entry g is instance L-1-g (the weights lie in descending order in their
    storage, as Megatron's distributed optimizer lays out a buffer: last parameter
    first), so the grouped GEMMs take the rows in reverse order too."""

    w1: torch.Tensor
    w2: torch.Tensor
    reversed: bool = False


def stacked_view(weights: Sequence[torch.Tensor]) -> tuple[torch.Tensor, bool] | str:
    """``weights`` (L tensors of one shape) as one [L, ...] view of their storage, without
    a copy, and whether it lists them last first; or the reason there is none.

    Host metadata only (storage, offsets, strides; no device read, no data pointer, so
    fake tensors work too). A view exists when every weight is contiguous and they lie in
    one storage at one spacing, ascending or descending, at least a weight apart (no
    overlap), 16-byte aligned (grouped_mm's rule for its operands' starts and strides).
    """
    first = weights[0]
    shape, dtype, device = first.shape, first.dtype, first.device
    if any(w.shape != shape or w.dtype != dtype or w.device != device for w in weights):
        return "the weights differ in shape, dtype or device"
    if not all(w.is_contiguous() for w in weights):
        return "a weight is not contiguous"
    storage = first.untyped_storage()._cdata
    if any(w.untyped_storage()._cdata != storage for w in weights[1:]):
        return "the weights live in separate storages"
    offsets = [w.storage_offset() for w in weights]
    steps = {b - a for a, b in zip(offsets, offsets[1:], strict=False)} or {first.numel()}
    if len(steps) > 1:
        return "the weights lie in one storage at uneven spacing (padding between them)"
    (step,) = steps
    descending = step < 0
    step, start = abs(step), min(offsets)
    if step < first.numel():
        return "the weights overlap in their storage"
    align = 16 // first.element_size()
    if start % align or step % align:
        return "the weights are not 16-byte aligned in their storage"
    view = torch.as_strided(first.detach(), (len(weights), *shape), (step, *first.stride()),
                            start)
    return view, descending


def weight_stack(w1: Sequence[torch.Tensor],
                 w2: Sequence[torch.Tensor]) -> WeightStack | str:
    """Both projections' ``stacked_view``, or the reason there is none."""
    v1, v2 = stacked_view(w1), stacked_view(w2)
    for name, view in (("W1", v1), ("W2", v2)):
        if isinstance(view, str):
            return f"{name}: {view}"
    if v1[1] != v2[1]:
        return "W1 and W2 lie in opposite orders"
    return WeightStack(v1[0], v2[0], v1[1])


# -----------------------------------------------------------------------------
# Forward
# -----------------------------------------------------------------------------


def add_bias_rows(out: torch.Tensor, rows: Sequence[int],
                  bias: Sequence[torch.Tensor]) -> None:
    """out[rows of instance l] += bias[l], in place, for rows grouped by instance.

    The group sizes are the plan's host integers, so each add is a slice of known size
    (no device read); no [N, ...] temporary of gathered bias rows, which a one-kernel
    gather would need. One small elementwise kernel per non-empty group."""
    start = 0
    for count, b in zip(rows, bias, strict=True):
        if count:
            out[start:start + count].add_(b)
        start += count


def experts_forward(x: torch.Tensor, rows: Sequence[int], offs: torch.Tensor | None,
                    w1: Sequence[torch.Tensor], w2: Sequence[torch.Tensor],
                    activation: Callable[[torch.Tensor], torch.Tensor], need_norm: bool,
                    grouped: bool, stack: WeightStack | None = None,
                    b1: Sequence[torch.Tensor] = (), b2: Sequence[torch.Tensor] = ()
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(z [N, F1], o [N, H], a [N] fp32 or None) for rows grouped by instance.

    ``offs``: int32 cumulative rows on x's device (grouped only). ``stack``: the weights
    as grouped_mm reads them (grouped only; None: stacked here, a copy). ``b1`` [F1] and
    ``b2`` [H] per instance: the biases (empty: none), in z and o, as Megatron's expert
    MLP adds them before the activation and to the output it scales by p.
    """
    if grouped and x.shape[0] > 0:
        w1s = torch.stack(tuple(w1)) if stack is None else stack.w1     # [L, F1, H]
        z = _GROUPED_MM(x, w1s.transpose(1, 2), offs=offs)
        del w1s
        if b1:
            add_bias_rows(z, rows, b1)
        h = activation(z)
        w2s = torch.stack(tuple(w2)) if stack is None else stack.w2     # [L, H, F]
        o = _GROUPED_MM(h, w2s.transpose(1, 2), offs=offs)
        a = torch.linalg.vector_norm(h, dim=1, dtype=torch.float32) if need_norm else None
        del h
        if b2:
            add_bias_rows(o, rows, b2)
        return z, o, a
    n, f1 = x.shape[0], w1[0].shape[0]
    z = x.new_empty((n, f1))
    o = x.new_empty((n, x.shape[1]))
    a = x.new_empty((n,), dtype=torch.float32) if need_norm else None
    start = 0
    for e, count in enumerate(rows):
        if count == 0:
            continue
        part = slice(start, start + count)
        if b1:
            torch.addmm(b1[e], x[part], w1[e].t(), out=z[part])
        else:
            torch.matmul(x[part], w1[e].t(), out=z[part])
        h = activation(z[part])
        if b2:
            torch.addmm(b2[e], h, w2[e].t(), out=o[part])
        else:
            torch.matmul(h, w2[e].t(), out=o[part])
        if a is not None:
            torch.linalg.vector_norm(h, dim=1, dtype=torch.float32, out=a[part])
        start += count
    return z, o, a


# -----------------------------------------------------------------------------
# Backward
# -----------------------------------------------------------------------------


def _offer_one(sink: GradSink | None, name: str, e: int,
               grad: torch.Tensor) -> torch.Tensor | None:
    return None if sink is not None and sink(name, e, grad) else grad


def _offer(sink: GradSink | None, name: str,
           stacked: torch.Tensor) -> list[torch.Tensor | None]:
    """Per-instance views of a grouped gradient [L, ...], each offered to the sink (the
    stacked tensor is freed once every view was taken)."""
    return [_offer_one(sink, name, e, grad) for e, grad in enumerate(stacked.unbind(0))]


def _grouped_row_sums(rows: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """[L, C]: each group's sum of ``rows`` [K, C] (groups by ``offs``), as one grouped
    GEMM against a column of ones: one call whatever L is, the GEMM's fixed reduction
    order (run-to-run identical) and accumulation, no device read. The ones block is 16
    bytes wide, the grouped kernel's alignment; its first column is the sum."""
    ones = rows.new_ones((rows.shape[0], max(1, 16 // rows.element_size())))
    return _GROUPED_MM(rows.t(), ones, offs=offs)[..., 0]


def experts_backward(x: torch.Tensor, z: torch.Tensor, g: torch.Tensor, rows: Sequence[int],
                     offs: torch.Tensor | None, w1: Sequence[torch.Tensor],
                     w2: Sequence[torch.Tensor],
                     activation: Callable[[torch.Tensor], torch.Tensor], grouped: bool,
                     weight_grads: bool = True, sink: GradSink | None = None,
                     index: torch.Tensor | None = None, stack: WeightStack | None = None,
                     biases: bool = False
                     ) -> tuple[torch.Tensor, list[torch.Tensor | None] | None,
                                list[torch.Tensor | None] | None,
                                list[torch.Tensor | None] | None,
                                list[torch.Tensor | None] | None]:
    """(dX [K, H], dW1, dW2, db1, db2) over the retained rows only: per local instance
    dW1[l] [F1, H], dW2[l] [H, F], and with ``biases`` db1[l] [F1] (the sum of dz's rows)
    and db2[l] [H] (the sum of g's rows); None for what is not computed.

    g: [K, H] rows grouped by instance (rows[l] each), contiguous (grouped_mm needs it,
    and the loop's matmuls read it row-major); x [., H] and z [., F1] the saved forward
    rows (z with the fc1 bias in it), of which ``index`` [K] names the retained ones
    (None: x and z are those rows), gathered per instance by the loop, all at once by the
    grouped path. ``weight_grads`` False (frozen experts) skips the dW and db GEMMs.
    ``sink(name, l, grad)`` may take each gradient as soon as it exists (True: taken, its
    entry becomes None), so that every expert's dW need not be held at once.
    ``stack``: as ``experts_forward``'s.
    """
    if grouped and g.shape[0] > 0:
        if index is not None:
            x, z = x.index_select(0, index), z.index_select(0, index)
        z = z.detach()
        with torch.enable_grad():
            z.requires_grad_(True)
            h = activation(z)                                          # [K, F]
        w2s = torch.stack(tuple(w2)) if stack is None else stack.w2     # [L, H, F]
        dh = _GROUPED_MM(g, w2s, offs=offs)                             # [K, F]
        del w2s
        (dz,) = torch.autograd.grad(h, z, dh)                           # [K, F1]
        w1s = torch.stack(tuple(w1)) if stack is None else stack.w1     # [L, F1, H]
        dx = _GROUPED_MM(dz, w1s, offs=offs)                            # [K, H]
        del w1s
        if not weight_grads:
            return dx, None, None, None, None
        db2 = _offer(sink, "b2", _grouped_row_sums(g, offs)) if biases else None   # [L, H]
        dw2 = _offer(sink, "w2", _GROUPED_MM(g.t(), h.detach(), offs=offs))      # [L, H, F]
        db1 = _offer(sink, "b1", _grouped_row_sums(dz, offs)) if biases else None  # [L, F1]
        dw1 = _offer(sink, "w1", _GROUPED_MM(dz.t(), x, offs=offs))              # [L, F1, H]
        return dx, dw1, dw2, db1, db2
    # The loop: one instance at a time, so the recomputed activation, dh and dz exist
    # for one instance's rows only (as in Megatron's SequentialMLP backward).
    dx = g.new_empty((g.shape[0], w1[0].shape[1]))
    dw1, dw2, db1, db2 = [], [], [], []
    start = 0
    for e, count in enumerate(rows):
        part = slice(start, start + count)
        start += count
        x_e = x[part] if index is None else x.index_select(0, index[part])
        z_e = (z[part] if index is None else z.index_select(0, index[part])).detach()
        with torch.enable_grad():
            z_e.requires_grad_(True)
            h_e = activation(z_e)                                       # [n, F]
        (dz_e,) = torch.autograd.grad(h_e, z_e, g[part] @ w2[e])          # [n, F1]
        if weight_grads:
            if biases:
                db2.append(_offer_one(sink, "b2", e, g[part].sum(0)))
            dw2.append(_offer_one(sink, "w2", e, g[part].t() @ h_e.detach()))
            if biases:
                db1.append(_offer_one(sink, "b1", e, dz_e.sum(0)))
            dw1.append(_offer_one(sink, "w1", e, dz_e.t() @ x_e))
        torch.matmul(dz_e, w1[e], out=dx[part])
    if not weight_grads:
        return dx, None, None, None, None
    return dx, dw1, dw2, (db1 if biases else None), (db2 if biases else None)
