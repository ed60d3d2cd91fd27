"""combine_rows and combine_rows_backward against per-row loops (ops/combine.py specs).

Oracles written from the docstrings, independent of the ops' code: a Python loop over
tokens and their segment of ``order`` (each product rounded to the dtype, the sum in
fp64 then compared bitwise after the op-math rounding for fp32, within one op-math
rounding for 16-bit types), and a loop over pairs for the backward. Every CPU backend
("cpu" compiled, "torch") is checked, empty and degenerate shapes included.
"""

from __future__ import annotations

import pytest
import torch

from megatron_lrmoe.ops import combine_rows, combine_rows_backward, scatter_add_rows

BACKENDS = ["cpu", "torch"]
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def _problem(p: int, t: int, h: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    src = torch.randn(p, h, generator=g).to(dtype)
    token = torch.randint(0, max(t, 1), (p,), generator=g)  # p = 0 whenever t = 0
    scale = torch.rand(p, generator=g)
    order = torch.sort(token, stable=True).indices
    offsets = torch.searchsorted(token[order], torch.arange(t + 1))
    return src, token, scale, order, offsets


def _naive_combine(src, scale, order, offsets) -> torch.Tensor:
    """y[t] = sum over its segment, in ascending j, of round(scale * src) in op-math."""
    opmath = torch.promote_types(src.dtype, torch.float32)
    t_count = offsets.numel() - 1
    out = torch.zeros(t_count, src.shape[1], dtype=opmath)
    for t in range(t_count):
        acc = torch.zeros(src.shape[1], dtype=opmath)
        for j in range(int(offsets[t]), int(offsets[t + 1])):
            r = int(order[j])
            product = (src[r].to(opmath) * scale[r].to(opmath)).to(src.dtype)
            acc = acc + product.to(opmath)
        out[t] = acc
    return out.to(src.dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(0, 0, 4), (0, 3, 4), (7, 1, 5), (30, 9, 17), (64, 64, 1),
                                   (200, 13, 33)])
def test_combine_matches_per_token_loop(kernels, backend, dtype, shape):
    src, token, scale, order, offsets = _problem(*shape, dtype)
    got = combine_rows(src, scale, order, offsets, backend=backend)
    assert got.dtype == dtype and got.shape == (shape[1], shape[2])
    assert torch.equal(got, _naive_combine(src, scale, order, offsets))


@pytest.mark.parametrize("backend", BACKENDS)
def test_combine_equals_scatter_add_in_pair_order(kernels, backend):
    """With order = pairs stably sorted by token, the combine is scatter_add_rows into
    zeros, bitwise (the same sum in the same order)."""
    for dtype in (torch.float32, torch.bfloat16):
        src, token, scale, order, offsets = _problem(300, 40, 24, dtype, seed=3)
        expected = scatter_add_rows(torch.zeros(40, 24, dtype=dtype), token, src, scale,
                                    backend="cpu")
        assert torch.equal(combine_rows(src, scale, order, offsets, backend=backend), expected)


def test_combine_is_independent_of_thread_count(kernels):
    src, _, scale, order, offsets = _problem(5000, 700, 300, torch.bfloat16, seed=5)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2):
            torch.set_num_threads(n)
            results.append(combine_rows(src, scale, order, offsets, backend="cpu"))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0], results[1])


def _naive_backward(dy, src, token, scale, kept_row, w, k):
    opmath = torch.promote_types(src.dtype, torch.float32)
    dscale = torch.zeros(src.shape[0], dtype=torch.float64)
    out = torch.full((k, dy.shape[1]), float("nan"), dtype=dy.dtype)
    for i in range(src.shape[0]):
        row = dy[int(token[i])]
        dscale[i] = float((row.double() * src[i].double()).sum())
        s = i if kept_row is None else int(kept_row[i])
        if s < 0:
            continue
        factor = scale[i].to(opmath) * (w[s].to(opmath) if w is not None else 1.0)
        out[s] = (row.to(opmath) * factor).to(dy.dtype)
    return dscale, out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kept_share", [0.0, 0.4, 1.0])
def test_backward_matches_per_pair_loop(kernels, backend, dtype, kept_share):
    src, token, scale, _, _ = _problem(120, 17, 33, dtype, seed=11)
    dy = torch.randn(17, 33, generator=torch.Generator().manual_seed(12)).to(dtype)
    g = torch.Generator().manual_seed(13)
    kept = torch.randperm(120, generator=g)[: int(120 * kept_share)].sort().values
    kept_row = torch.full((120,), -1, dtype=torch.long)
    kept_row[kept] = torch.arange(kept.numel())
    w = torch.rand(kept.numel(), generator=g) + 0.5
    for s, ww, k in ((None, None, 120), (kept_row, w, kept.numel()),
                     (kept_row, None, kept.numel())):
        dscale, out = combine_rows_backward(dy, src, token, scale, s, ww, k, backend=backend)
        want_d, want_out = _naive_backward(dy, src, token, scale, s, ww, k)
        assert dscale.dtype == torch.promote_types(dtype, torch.float32)
        tol = 1e-12 if dtype == torch.float64 else 1e-5
        assert torch.allclose(dscale.double(), want_d, rtol=tol, atol=tol * 10)
        assert out.shape == (k, 33) and torch.equal(out, want_out), "every kept row, bitwise"


@pytest.mark.parametrize("backend", BACKENDS)
def test_backward_of_nothing(kernels, backend):
    dy = torch.randn(3, 4)
    dscale, out = combine_rows_backward(dy, torch.zeros(0, 4), torch.zeros(0, dtype=torch.long),
                                        torch.zeros(0), backend=backend)
    assert dscale.shape == (0,) and out.shape == (0, 4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_values_raise_naming_them(kernels, backend):
    src, token, scale, order, offsets = _problem(10, 4, 3, torch.float32)
    with pytest.raises(IndexError, match=r"order\[\d+\] = 10 is outside \[0, P\)"):
        combine_rows(src, scale, torch.where(order == order[0], 10, order), offsets,
                     backend=backend)
    bad = offsets.clone()
    bad[2] = bad[1] - 1 if bad[1] > 0 else 5
    with pytest.raises(ValueError, match="offsets"):
        combine_rows(src, scale, order, bad, backend=backend)
    with pytest.raises(IndexError, match=r"token\[3\] = 4 is outside \[0, T\)"):
        combine_rows_backward(torch.zeros(4, 3), src, token.index_put((torch.tensor(3),),
                                                                      torch.tensor(4)),
                              scale, backend=backend)
    kept_row = torch.full((10,), -1, dtype=torch.long)
    kept_row[2] = 5
    with pytest.raises(IndexError, match=r"kept_row\[2\] = 5 is outside \[-1, K\)"):
        combine_rows_backward(torch.zeros(4, 3), src, token, scale, kept_row, None, 2,
                              backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_arguments_raise(kernels, backend):
    src, token, scale, order, offsets = _problem(10, 4, 3, torch.float32)
    with pytest.raises(TypeError, match="offsets must be int64"):
        combine_rows(src, scale, order, offsets.int(), backend=backend)
    with pytest.raises(ValueError, match="scale must be 1-D"):
        combine_rows(src, scale[:5], order, offsets, backend=backend)
    with pytest.raises(ValueError, match="K = 3 must equal P = 10"):
        combine_rows_backward(torch.zeros(4, 3), src, token, scale, None, None, 3,
                              backend=backend)
    with pytest.raises(RuntimeError, match="no autograd support"):
        combine_rows(src.requires_grad_(True), scale, order, offsets, backend=backend)
