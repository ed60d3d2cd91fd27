"""Argument checks shared by the ops (same messages from every backend)."""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int64, torch.int32)


def opmath(dtype: torch.dtype) -> torch.dtype:
    """Arithmetic dtype of the kernels: fp32 for 16-bit floats, else the dtype."""
    return torch.promote_types(dtype, torch.float32)


def check_row_scale(op: str, scale: torch.Tensor, rows: int, rows_symbol: str,
                    dtype: torch.dtype, device: torch.device, device_of: str) -> None:
    """A per-row scale: 1-D with one value per row, ``dtype`` or float32, on ``device``."""
    if scale.dim() != 1 or scale.shape[0] != rows:
        raise ValueError(
            f"{op}: scale must be 1-D [{rows_symbol}] with {rows_symbol} = {rows}, "
            f"got shape {tuple(scale.shape)}"
        )
    if scale.dtype not in (dtype, torch.float32):
        raise TypeError(
            f"{op}: scale must have src's dtype ({dtype}) or float32, got {scale.dtype}"
        )
    if scale.device != device:
        raise ValueError(f"{op}: scale is on {scale.device}, {device_of} on {device}")
