"""combine_rows: the LRMoE region's weighted combine, and its one-pass adjoint.

This is the "combine" kernel pair (docs/design.md, "Region": forward step 4 and
backward step 1). Forward, every token's output is the probability-weighted sum of
its pairs' expert outputs; backward, one pass over the output gradient per pair
gives both the router gradient <dy, o> (every pair, kept or dropped) and the
scaled gradient row a kept pair sends to its expert, already in send order.

Notation
  P  pair rows of ``src`` (expert outputs o, one per routed pair)
  T  tokens; M entries of ``order`` (normally P); K rows of the backward output
  H  hidden size

Forward: ``combine_rows(src, scale, order, offsets)``
  src [P, H] float32/float64/float16/bfloat16; scale [P] src's dtype or float32;
  order [M] int64/int32 in [0, P); offsets [T + 1] int64, 0 = off[0] <= ... = off[T] = M
  -> y [T, H] src's dtype:
  y[t] = sum over j in [off[t], off[t+1]) of scale[order[j]] * src[order[j]]
  Rounding (every backend): each product formed in op-math (fp32 for 16-bit types)
  and rounded to the dtype, the sum kept in op-math in ascending j and rounded once
  (scatter_add_rows' rounding: with ``order`` = the pairs stably sorted by token,
  y equals ``scatter_add_rows(zeros, token, src, scale)`` bitwise on the CPU). No
  atomics on any compiled backend, so results are bitwise reproducible, and the
  "cpu" and "cuda" backends agree bitwise.

Backward: ``combine_rows_backward(dy, src, token, scale, kept_row, w, n_out)``
  dy [T, H]; src [P, H] (dy's dtype); token [P] int64/int32 in [0, T); scale [P]
  src's dtype or float32; kept_row [P] int64 in [-1, K) or None (kept_row[i] = i, K = P);
  w [K] float32 or None (1)
  -> (dscale [P] op-math dtype, out [K, H] dy's dtype):
  dscale[i] = <dy[token[i]], src[i]>                       for every pair
  out[kept_row[i]] = (scale[i] * w[kept_row[i]]) * dy[token[i]]    for kept_row[i] >= 0
  The factor scale * w is formed in op-math and rounded once with the row
  (as scatter_add_rows rounds its products). Rows of ``out`` that no kept_row names are left
  unwritten: ``kept_row`` must map the kept pairs one-to-one onto [0, K). The dot
  product's summation order is each backend's own (reproducible per backend, not
  bitwise across them).

Value checks (offsets, index ranges) run on the host always and on a GPU only with
the debug checks on (``megatron_lrmoe.ops.backend.debug_checks``: a host sync);
without them the CUDA kernels skip out-of-range rows. Never on fake tensors.

Empty input: with no pair (P = 0 or M = 0) y is zeros, and the backward's out is
zeros when P = 0, on every backend.

Compiled backends run the torch ops ``lrmoe::combine_rows`` and
``lrmoe::combine_rows_backward`` (kernels/bindings.cpp); their fake implementations
are registered here. K is an argument, so both give every output size from metadata.
The "torch" backend is the fallback and not sync-free on a GPU. No autograd: the
region calls these inside its own autograd function.
"""

from __future__ import annotations

import torch

from megatron_lrmoe.ops._checks import FLOAT_DTYPES, INDEX_DTYPES, check_row_scale
from megatron_lrmoe.ops._checks import opmath as opmath_of
from megatron_lrmoe.ops.backend import (
    debug_checks,
    is_fake,
    kernels_available,
    needs_value_check,
    registered_ops,
    resolve_backend,
)


def _refuse_autograd(op: str, *tensors: torch.Tensor | None) -> None:
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        raise RuntimeError(f"{op} has no autograd support: call it with grad mode off "
                           "(torch.no_grad(), or inside an autograd Function)")


# ---------------------------------------------------------------------------
# The "torch" backend (after validation); the tests' oracles are per-row loops
# ---------------------------------------------------------------------------


def combine_rows_reference(src: torch.Tensor, scale: torch.Tensor, order: torch.Tensor,
                           offsets: torch.Tensor) -> torch.Tensor:
    """The "torch" backend of ``combine_rows`` without its checks."""
    opmath = opmath_of(src.dtype)
    n_tokens = offsets.numel() - 1
    rows = src.index_select(0, order).to(opmath)
    products = (rows * scale.index_select(0, order).to(opmath).unsqueeze(1)).to(src.dtype)
    token_of = torch.repeat_interleave(torch.arange(n_tokens, device=src.device),
                                       offsets[1:] - offsets[:-1], output_size=order.numel())
    out = torch.zeros(n_tokens, src.shape[1], dtype=opmath, device=src.device)
    return out.index_add_(0, token_of, products.to(opmath)).to(src.dtype)


def combine_rows_backward_reference(
    dy: torch.Tensor, src: torch.Tensor, token: torch.Tensor, scale: torch.Tensor,
    kept_row: torch.Tensor | None, w: torch.Tensor | None, n_out: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The "torch" backend of ``combine_rows_backward`` without its checks."""
    opmath = opmath_of(src.dtype)
    g = dy.index_select(0, token).to(opmath)                              # [P, H]
    dscale = (g * src.to(opmath)).sum(1)
    out = torch.zeros(n_out, dy.shape[1], dtype=dy.dtype, device=dy.device)
    if kept_row is None:
        kept_row = torch.arange(src.shape[0], device=src.device)
    kept = (kept_row >= 0).nonzero().flatten()
    factor = scale.index_select(0, kept).to(opmath)
    if w is not None:
        factor = factor * w.index_select(0, kept_row.index_select(0, kept)).to(opmath)
    rows = kept_row.index_select(0, kept)
    out[rows] = (g.index_select(0, kept) * factor.unsqueeze(1)).to(dy.dtype)
    return dscale, out


# ---------------------------------------------------------------------------
# Checks (the messages of kernels/bindings.cpp and kernels/combine_rows.cpp)
# ---------------------------------------------------------------------------


def _check_forward(src, scale, order, offsets) -> None:
    if src.dim() != 2:
        raise ValueError(f"combine_rows: src must be 2-D [P, H], got shape {tuple(src.shape)}")
    if order.dim() != 1:
        raise ValueError(f"combine_rows: order must be 1-D [M], got shape {tuple(order.shape)}")
    if offsets.dim() != 1 or offsets.numel() < 1:
        raise ValueError("combine_rows: offsets must be 1-D [T + 1] with at least one entry, "
                         f"got shape {tuple(offsets.shape)}")
    if src.dtype not in FLOAT_DTYPES:
        raise TypeError(f"combine_rows: src must be float32, float64, float16 or bfloat16, "
                        f"got {src.dtype}")
    if order.dtype not in INDEX_DTYPES:
        raise TypeError(f"combine_rows: order must be int64 or int32, got {order.dtype}")
    if offsets.dtype != torch.int64:
        raise TypeError(f"combine_rows: offsets must be int64, got {offsets.dtype}")
    if order.device != src.device or offsets.device != src.device:
        raise ValueError(f"combine_rows: all tensors must be on one device; src is on "
                         f"{src.device}, order on {order.device}, offsets on {offsets.device}")
    check_row_scale("combine_rows", scale, src.shape[0], "P", src.dtype, src.device, "src")


def _check_forward_values(order, offsets, n_src: int) -> None:
    off = offsets.cpu()
    if int(off[0]) != 0:
        raise ValueError(f"combine_rows: offsets[0] = {int(off[0])} but must be 0")
    bad = (off[1:] < off[:-1]).nonzero()
    if bad.numel():
        t = int(bad[0]) + 1
        raise ValueError(f"combine_rows: offsets[{t}] = {int(off[t])} is less than "
                         f"offsets[{t - 1}] = {int(off[t - 1])} (offsets must be non-decreasing)")
    if int(off[-1]) != order.numel():
        raise ValueError(f"combine_rows: offsets[{off.numel() - 1}] = {int(off[-1])} but order "
                         f"has M = {order.numel()} entries")
    o = order.cpu()
    bad = ((o < 0) | (o >= n_src)).nonzero()
    if bad.numel():
        j = int(bad[0])
        raise IndexError(f"combine_rows: order[{j}] = {int(o[j])} is outside [0, P) with "
                         f"P = {n_src} (rows of src)")


def _check_backward(dy, src, token, scale, kept_row, w, n_out: int) -> None:
    op = "combine_rows_backward"
    if dy.dim() != 2 or src.dim() != 2 or dy.shape[1] != src.shape[1]:
        raise ValueError(f"{op}: dy [T, H] and src [P, H] must be 2-D with one H, got "
                         f"{tuple(dy.shape)} and {tuple(src.shape)}")
    if token.dim() != 1 or token.shape[0] != src.shape[0]:
        raise ValueError(f"{op}: token must be 1-D [P] with P = {src.shape[0]}, got shape "
                         f"{tuple(token.shape)}")
    if src.dtype not in FLOAT_DTYPES or dy.dtype != src.dtype:
        raise TypeError(f"{op}: dy and src must share one of float32, float64, float16, "
                        f"bfloat16; got {dy.dtype} and {src.dtype}")
    if token.dtype not in INDEX_DTYPES:
        raise TypeError(f"{op}: token must be int64 or int32, got {token.dtype}")
    if dy.device != src.device or token.device != src.device:
        raise ValueError(f"{op}: all tensors must be on one device; src is on {src.device}, "
                         f"dy on {dy.device}, token on {token.device}")
    check_row_scale(op, scale, src.shape[0], "P", src.dtype, src.device, "src")
    if kept_row is None and n_out != src.shape[0]:
        raise ValueError(f"{op}: without kept_row every pair has its row, so K = {n_out} must "
                         f"equal P = {src.shape[0]}")
    if kept_row is not None and (kept_row.dim() != 1 or kept_row.shape[0] != src.shape[0]
                             or kept_row.dtype != torch.int64 or kept_row.device != src.device):
        raise ValueError(f"{op}: kept_row must be 1-D int64 [P] with P = {src.shape[0]} on "
                         f"{src.device}")
    if w is not None and (w.dim() != 1 or w.shape[0] != n_out or w.dtype != torch.float32
                          or w.device != src.device):
        raise ValueError(f"{op}: w must be 1-D float32 [K] with K = {n_out} on {src.device}")


def _check_backward_values(token, kept_row, n_tokens: int, n_out: int) -> None:
    t = token.cpu()
    bad = ((t < 0) | (t >= n_tokens)).nonzero()
    if bad.numel():
        i = int(bad[0])
        raise IndexError(f"combine_rows_backward: token[{i}] = {int(t[i])} is outside [0, T) "
                         f"with T = {n_tokens} (rows of dy)")
    if kept_row is not None:
        s = kept_row.cpu()
        bad = ((s < -1) | (s >= n_out)).nonzero()
        if bad.numel():
            i = int(bad[0])
            raise IndexError(f"combine_rows_backward: kept_row[{i}] = {int(s[i])} is outside "
                             f"[-1, K) with K = {n_out}")


# ---------------------------------------------------------------------------
# Fake implementations of the compiled ops: shapes, dtypes and devices from the
# arguments' metadata, the binding's argument checks, no values read
# ---------------------------------------------------------------------------


def _combine_rows_fake(src: torch.Tensor, scale: torch.Tensor, order: torch.Tensor,
                       offsets: torch.Tensor, check: bool = True) -> torch.Tensor:
    _check_forward(src, scale, order, offsets)
    return src.new_empty((offsets.shape[0] - 1, src.shape[1]))


def _combine_rows_backward_fake(
    dy: torch.Tensor, src: torch.Tensor, token: torch.Tensor, scale: torch.Tensor,
    kept_row: torch.Tensor | None = None, w: torch.Tensor | None = None, n_out: int = -1,
    check: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    if n_out == -1 and kept_row is None:
        n_out = src.shape[0]  # every pair has its row, as in the binding
    if n_out < 0:
        raise ValueError(f"combine_rows_backward: K = {n_out} must be >= 0 (with kept_row, K is "
                         "the caller's: the plan's kept rows)")
    _check_backward(dy, src, token, scale, kept_row, w, n_out)
    dscale = src.new_empty((src.shape[0],), dtype=opmath_of(src.dtype))
    return dscale, dy.new_empty((n_out, dy.shape[1]))


if kernels_available():
    torch.library.register_fake("lrmoe::combine_rows", _combine_rows_fake)
    torch.library.register_fake("lrmoe::combine_rows_backward", _combine_rows_backward_fake)


# ---------------------------------------------------------------------------
# The ops
# ---------------------------------------------------------------------------


def combine_rows(src: torch.Tensor, scale: torch.Tensor, order: torch.Tensor,
                 offsets: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """y [T, H] with y[t] = sum over its segment of scale[order[j]] * src[order[j]].

    Shapes, rounding and checks: see the module docstring. ``backend`` is a
    ``--moe-lrmoe-kernels`` value ("auto", "cpu", "cuda", "torch").
    """
    _refuse_autograd("combine_rows", src, scale)
    fake = is_fake(src)
    chosen = resolve_backend(backend, src.device, fake=fake)
    if chosen == "torch":
        _check_forward(src, scale, order, offsets)
        if needs_value_check(src.device):
            _check_forward_values(order, offsets, src.shape[0])
        return combine_rows_reference(src, scale, order, offsets)
    return registered_ops().combine_rows(src.contiguous(), scale.contiguous(),
                                         order.contiguous(), offsets.contiguous(),
                                         debug_checks() and not fake)


def combine_rows_backward(
    dy: torch.Tensor, src: torch.Tensor, token: torch.Tensor, scale: torch.Tensor,
    kept_row: torch.Tensor | None = None, w: torch.Tensor | None = None,
    n_out: int | None = None, backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dscale [P], out [K, H]): the router gradient of every pair and the scaled
    output-gradient rows of the kept ones (see the module docstring).

    ``n_out`` is K (default: P, which requires ``kept_row`` None).
    """
    _refuse_autograd("combine_rows_backward", dy, src, scale)
    n_out = src.shape[0] if n_out is None else int(n_out)
    fake = is_fake(src)
    chosen = resolve_backend(backend, src.device, fake=fake)
    if chosen == "torch":
        _check_backward(dy, src, token, scale, kept_row, w, n_out)
        if needs_value_check(src.device):
            _check_backward_values(token, kept_row, dy.shape[0], n_out)
        return combine_rows_backward_reference(dy, src, token, scale, kept_row, w, n_out)
    return registered_ops().combine_rows_backward(
        dy.contiguous(), src.contiguous(), token.contiguous(), scale.contiguous(),
        None if kept_row is None else kept_row.contiguous(), None if w is None else w.contiguous(),
        n_out, debug_checks() and not fake)
