"""scatter_add_rows: add rows of ``src`` into the rows of ``out`` that ``index`` names.

This is the "scatter" kernel (docs/design.md, "Region", backward step 5): in the backward pass,
returned expert-output gradients are added into token gradients by index (the
unpermute). Dropped pairs simply have no row in ``src``, so their tokens get
nothing from them (zero fill for free).

Notation
  N  rows of ``out`` (e.g. tokens of the micro-batch)
  M  rows of ``src`` (e.g. returned token-expert pairs); M = len(index)
  H  hidden size, the row length of ``out`` and ``src``

Shapes and dtypes
  out    [N, H]  float32, float64, float16 or bfloat16; contiguous; updated in place
  index  [M]     int64 or int32, every value in [0, N); repeats allowed
  src    [M, H]  out's dtype
  scale  [M]     optional; src's dtype or float32 (e.g. fp32 routing probabilities)
  key    [M]     optional int64: each row's name (e.g. its pair index), distinct

Semantics
  out[index[i], :] += scale[i] * src[i, :]        for i = 0, 1, ..., M-1

Rounding (all backends): the product is formed in the op-math type (fp32 for
16-bit dtypes, the dtype itself otherwise) and rounded to out's dtype; the
sum into a destination row is formed in the op-math type, starting from the
row's value, and rounded to out's dtype once. For fp32/fp64 that is exactly
``out[index[i]] += p[i]`` in a loop; for fp16/bf16 it avoids a rounding per
add. Exception: the "cuda" kernel adds with atomics in the dtype itself, so
16-bit results there round after every add.

Order of repeated destinations. The fixed order: each destination's rows in
ascending position, or with ``key`` in ascending (key, position). With distinct
keys the order is a function of the (key, index, row) triples alone, so any
permutation of the rows that carries their keys along gives bitwise the same
``out``. "cpu" (and "torch" on CPU) always sums in the fixed order, whatever the
thread count; without a key it equals ``scatter_add_rows_reference`` bitwise.
On CUDA:
  - deterministic (``deterministic=True``; None, the default, means
    ``torch.are_deterministic_algorithms_enabled()``) or a key given: a sorted
    segment sum in the fixed order. The "cuda" kernel sorts the rows stably on
    the device (by key, then by destination) and sums each destination in one
    thread per element with the CPU backend's rounding: bitwise reproducible and
    equal to "cpu". "torch" sums the sorted rows with ``torch.segment_reduce``
    from zero and adds the sum to ``out`` (reproducible; equal to "cpu" where
    ``out`` starts at zero, as the LRMoE token gradient does).
  - otherwise (the fast path) atomic adds, whose order is not fixed: the last
    bits may vary run to run.

Compiled backends run the torch op ``lrmoe::scatter_add_rows`` (kernels/bindings.cpp),
whose schema marks ``out`` as mutated (``Tensor(a!)``) and returns nothing; its fake
implementation, registered here, checks the arguments and computes nothing (the
deterministic path's sorts are inside the op). Value checks never run on fake
tensors; the distinctness of keys is never checked (equal keys keep position order).

No autograd yet: call it where grad mode is off (inside an autograd
Function's forward or backward, or under ``torch.no_grad()``).
"""

from __future__ import annotations

import torch

from megatron_lrmoe.ops._checks import FLOAT_DTYPES, INDEX_DTYPES, check_row_scale
from megatron_lrmoe.ops._checks import opmath as opmath_of
from megatron_lrmoe.ops.backend import (
    debug_checks,
    deterministic_mode,
    is_fake,
    kernels_available,
    needs_value_check,
    registered_ops,
    resolve_backend,
)


def _scaled_rows(src: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """scale[:, None] * src [M, H], rounded to src's dtype as the kernels do."""
    if scale is None:
        return src
    opmath = opmath_of(src.dtype)
    return (src.to(opmath) * scale.to(opmath).unsqueeze(1)).to(src.dtype)


def scatter_add_rows_reference(
    out: torch.Tensor,
    index: torch.Tensor,
    src: torch.Tensor,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Test oracle: a new tensor equal to ``out`` after ``scatter_add_rows`` on CPU.

    ``out`` itself is not modified. ``index_add_`` in the op-math dtype on a
    copy (CPU index_add_ adds in index order), without the real op's checks.
    """
    opmath = opmath_of(out.dtype)
    acc = out.to(opmath, copy=True).index_add_(0, index, _scaled_rows(src, scale).to(opmath))
    return acc.to(out.dtype)


def _check_args(
    out: torch.Tensor, index: torch.Tensor, src: torch.Tensor, scale: torch.Tensor | None,
    key: torch.Tensor | None = None,
) -> None:
    """The checks of kernels/bindings.cpp, for the torch backend (same errors)."""
    if out.dim() != 2:
        raise ValueError(f"scatter_add_rows: out must be 2-D [N, H], got shape {tuple(out.shape)}")
    if src.dim() != 2:
        raise ValueError(f"scatter_add_rows: src must be 2-D [M, H], got shape {tuple(src.shape)}")
    if index.dim() != 1:
        raise ValueError(f"scatter_add_rows: index must be 1-D [M], got shape {tuple(index.shape)}")
    if src.shape[1] != out.shape[1]:
        raise ValueError(
            f"scatter_add_rows: src [M, H] = {tuple(src.shape)} and out [N, H] = "
            f"{tuple(out.shape)} differ in H"
        )
    if index.shape[0] != src.shape[0]:
        raise ValueError(
            f"scatter_add_rows: index has {index.shape[0]} entries but src has {src.shape[0]} rows"
        )
    if out.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"scatter_add_rows: out must be float32, float64, float16 or bfloat16, got {out.dtype}"
        )
    if src.dtype != out.dtype:
        raise TypeError(
            f"scatter_add_rows: src dtype {src.dtype} differs from out dtype {out.dtype}"
        )
    if index.dtype not in INDEX_DTYPES:
        raise TypeError(f"scatter_add_rows: index must be int64 or int32, got {index.dtype}")
    if src.device != out.device or index.device != out.device:
        raise ValueError(
            f"scatter_add_rows: all tensors must be on one device; out is on {out.device}, "
            f"src on {src.device}, index on {index.device}"
        )
    # Same contract as the compiled backends: out is updated in place.
    if not out.is_contiguous():
        raise ValueError("scatter_add_rows: out must be contiguous")
    if scale is not None:
        check_row_scale("scatter_add_rows", scale, src.shape[0], "M", src.dtype, out.device,
                        "out")
    if key is not None:
        if key.dim() != 1 or key.shape[0] != src.shape[0]:
            raise ValueError(f"scatter_add_rows: key must be 1-D [M] with M = {src.shape[0]}, "
                             f"got shape {tuple(key.shape)}")
        if key.dtype != torch.int64:
            raise TypeError(f"scatter_add_rows: key must be int64, got {key.dtype}")
        if key.device != out.device:
            raise ValueError(f"scatter_add_rows: key is on {key.device}, out on {out.device}")


def _scatter_add_rows_fake(out: torch.Tensor, index: torch.Tensor, src: torch.Tensor,
                           scale: torch.Tensor | None = None, check: bool = True,
                           key: torch.Tensor | None = None, deterministic: bool = False) -> None:
    """Fake implementation of ``lrmoe::scatter_add_rows``: the argument checks only (it
    returns nothing and mutates ``out``, whose metadata stays as it is)."""
    _check_args(out, index, src, scale, key)


if kernels_available():
    torch.library.register_fake("lrmoe::scatter_add_rows", _scatter_add_rows_fake)


def _check_index_range(index: torch.Tensor, n_out: int) -> None:
    """IndexError unless every index value is in [0, n_out); one reduction, one sync."""
    if index.numel() == 0:
        return
    lo, hi = torch.stack(torch.aminmax(index)).tolist()  # host sync
    if lo < 0 or hi >= n_out:
        bad = lo if lo < 0 else hi
        raise IndexError(
            f"scatter_add_rows: index holds {bad}, outside [0, N) with N = {n_out} (rows of out)"
        )


def _segment_sum_into(out: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> None:
    """out[d] += the sum of d's rows in their order, in op-math from zero (one segment per
    destination after a stable sort; no atomics, no host read)."""
    sorted_index, order = torch.sort(index, stable=True)
    offsets = torch.searchsorted(
        sorted_index, torch.arange(out.shape[0] + 1, device=out.device, dtype=index.dtype))
    opmath = opmath_of(out.dtype)
    sums = torch.segment_reduce(rows.index_select(0, order).to(opmath), "sum",
                                offsets=offsets, axis=0, unsafe=True)
    out.copy_(out.to(opmath).add_(sums).to(out.dtype))


def _scatter_add_rows_torch(
    out: torch.Tensor, index: torch.Tensor, src: torch.Tensor, scale: torch.Tensor | None,
    key: torch.Tensor | None = None, deterministic: bool = False,
) -> None:
    _check_args(out, index, src, scale, key)
    if src.shape[0] == 0 or src.shape[1] == 0:
        return
    # Checked before writing so that a bad index leaves out untouched (on a GPU only
    # in debug mode: the check reads device values on the host).
    if needs_value_check(out.device):
        _check_index_range(index, out.shape[0])
    rows = _scaled_rows(src, scale)
    if key is not None:
        # Rows in (key, position) order: then every destination's rows are too.
        by_key = torch.sort(key, stable=True).indices
        index, rows = index.index_select(0, by_key), rows.index_select(0, by_key)
    if out.device.type != "cpu" and (deterministic or key is not None):
        _segment_sum_into(out, index, rows)   # index_add_ would use atomics here
        return
    opmath = opmath_of(out.dtype)
    if opmath == out.dtype:
        out.index_add_(0, index, rows)
    else:
        # Sum in fp32 and round once, like the compiled CPU backend; costs an
        # fp32 copy of out.
        out.copy_(out.to(opmath).index_add_(0, index, rows.to(opmath)))


def scatter_add_rows(
    out: torch.Tensor,
    index: torch.Tensor,
    src: torch.Tensor,
    scale: torch.Tensor | None = None,
    backend: str = "auto",
    *,
    key: torch.Tensor | None = None,
    deterministic: bool | None = None,
) -> torch.Tensor:
    """``out[index[i], :] += scale[i] * src[i, :]`` in place; returns ``out``.

    Shapes, dtypes and order of summation: see the module docstring.
    ``backend`` is a ``--moe-lrmoe-kernels`` value ("auto", "cpu", "cuda",
    "torch"), resolved by ``megatron_lrmoe.ops.backend.resolve_backend``.
    ``key`` [M] int64 (distinct): each destination's rows are summed in ascending key,
    on every backend. ``deterministic``: the fixed order on every device (CUDA then
    sorts instead of using atomics); None follows ``torch.use_deterministic_algorithms``.

    Raises IndexError for an index value outside [0, N) (``out`` is then left
    unchanged; on GPU tensors only with ``debug_checks()`` on), TypeError for a
    wrong dtype, ValueError for a wrong shape, mixed devices or a non-contiguous
    ``out``. ``index``, ``src`` and
    ``scale`` may be strided views: they are made contiguous (a copy).
    """
    if torch.is_grad_enabled() and (
        out.requires_grad or src.requires_grad or (scale is not None and scale.requires_grad)
    ):
        raise RuntimeError(
            "scatter_add_rows has no autograd support: call it with grad mode off "
            "(torch.no_grad(), or inside an autograd Function)"
        )
    if deterministic is None:
        deterministic = deterministic_mode()
    fake = is_fake(out)
    chosen = resolve_backend(backend, out.device, fake=fake)
    if chosen == "torch":
        _scatter_add_rows_torch(out, index, src, scale, key, deterministic)
        return out
    registered_ops().scatter_add_rows(
        out,
        index.contiguous(),
        src.contiguous(),
        None if scale is None else scale.contiguous(),
        debug_checks() and not fake,
        None if key is None else key.contiguous(),
        deterministic,
    )
    return out
