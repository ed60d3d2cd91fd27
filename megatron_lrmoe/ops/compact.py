"""compact_rows: gather the kept rows into a new contiguous buffer.

This is the "compact" kernel (docs/design.md, "Region", backward step 2): the
rows ``select_rows`` kept are packed, optionally scaled, in the order of
``kept_index`` (grouped by cell in forward-dispatch order), ready for the
backward all-to-all. Its adjoint is ``scatter_add_rows``: scattering the
compacted rows back to ``kept_index`` into zeros restores them in place.

Notation
  P  rows of ``src`` (per-pair rows in forward order)
  K  kept rows; K = len(kept_index)
  H  hidden size, the row length of ``src`` and of the result
  C  cells, ordered by (destination rank, local expert) like the forward dispatch

Shapes and dtypes
  src         [P, H]  float32, float64, float16 or bfloat16
  kept_index  [K]     int64 or int32, every value in [0, P); repeats allowed
  scale       [K]     optional; src's dtype or float32
  -> out      [K, H]  src's dtype, new contiguous memory

Semantics
  out[j, :] = scale[j] * src[kept_index[j], :]        for j = 0, 1, ..., K-1

Rounding (all backends, as in scatter_add_rows): the product is formed in the
op-math type (fp32 for 16-bit dtypes, the dtype itself otherwise) and rounded
to src's dtype once, so every backend gives the same bits.

Strided ``src``, ``kept_index`` or ``scale`` are accepted and copied to
contiguous memory first (the compiled binding itself refuses them). An index
outside [0, P) raises IndexError naming it, on GPU tensors only with the debug
checks on (``megatron_lrmoe.ops.backend.debug_checks``: the check is a host sync;
without it the CUDA kernel skips such rows). No autograd: call it with grad
mode off, like scatter_add_rows.
"""

from __future__ import annotations

import torch

from megatron_lrmoe.ops._checks import FLOAT_DTYPES, INDEX_DTYPES, check_row_scale
from megatron_lrmoe.ops._checks import opmath as opmath_of
from megatron_lrmoe.ops.backend import (
    debug_checks,
    kernels_module,
    needs_value_check,
    resolve_backend,
)


def compact_rows_reference(
    src: torch.Tensor, kept_index: torch.Tensor, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """The "torch" backend of ``compact_rows`` without its checks: index_select plus
    a scaled copy in op-math. Not an oracle (tests check every backend against a
    per-row loop written from the semantics above)."""
    rows = src.index_select(0, kept_index)
    if scale is None:
        return rows
    opmath = opmath_of(src.dtype)
    return (rows.to(opmath) * scale.to(opmath).unsqueeze(1)).to(src.dtype)


def _check_args(src: torch.Tensor, kept_index: torch.Tensor, scale: torch.Tensor | None) -> None:
    """The checks of kernels/bindings.cpp, for the torch backend (same errors)."""
    if src.dim() != 2:
        raise ValueError(f"compact_rows: src must be 2-D [P, H], got shape {tuple(src.shape)}")
    if kept_index.dim() != 1:
        raise ValueError(
            f"compact_rows: kept_index must be 1-D [K], got shape {tuple(kept_index.shape)}"
        )
    if src.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"compact_rows: src must be float32, float64, float16 or bfloat16, got {src.dtype}"
        )
    if kept_index.dtype not in INDEX_DTYPES:
        raise TypeError(f"compact_rows: kept_index must be int64 or int32, got {kept_index.dtype}")
    if kept_index.device != src.device:
        raise ValueError(f"compact_rows: kept_index is on {kept_index.device}, src on {src.device}")
    if scale is not None:
        check_row_scale("compact_rows", scale, kept_index.shape[0], "K", src.dtype, src.device,
                        "src")


def _check_index_range(kept_index: torch.Tensor, n_src: int) -> None:
    """IndexError naming the first index outside [0, n_src) (one reduction, one sync)."""
    bad = (kept_index < 0) | (kept_index >= n_src)
    if bool(bad.any()):  # host sync
        j = int(bad.nonzero()[0])
        raise IndexError(
            f"compact_rows: kept_index[{j}] = {int(kept_index[j])} is outside [0, P) "
            f"with P = {n_src} (rows of src)"
        )


def compact_rows(
    src: torch.Tensor,
    kept_index: torch.Tensor,
    scale: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """``out[j] = scale[j] * src[kept_index[j]]``, a new contiguous [K, H] tensor.

    Shapes, dtypes and rounding: see the module docstring. ``backend`` is a
    ``--moe-lrmoe-kernels`` value ("auto", "cpu", "cuda", "torch"). Raises
    IndexError for an index outside [0, P), TypeError for a wrong dtype,
    ValueError for a wrong shape or mixed devices.
    """
    if torch.is_grad_enabled() and (
        src.requires_grad or (scale is not None and scale.requires_grad)
    ):
        raise RuntimeError(
            "compact_rows has no autograd support: call it with grad mode off "
            "(torch.no_grad(), or inside an autograd Function)"
        )
    chosen = resolve_backend(backend, src.device)
    if chosen == "torch":
        _check_args(src, kept_index, scale)
        if kept_index.numel() and needs_value_check(src.device):
            _check_index_range(kept_index, src.shape[0])
        return compact_rows_reference(src, kept_index, scale).contiguous()
    return kernels_module().compact_rows(
        src.contiguous(),
        kept_index.contiguous(),
        None if scale is None else scale.contiguous(),
        debug_checks(),
    )

