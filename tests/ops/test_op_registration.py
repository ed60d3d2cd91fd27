"""The kernels as torch ops (lrmoe::*): schemas, fake implementations, fake-mode dispatch,
empty inputs, and the int64 arithmetic of the counter-based generator.

Oracles: ``torch.library.opcheck`` (each op's fake implementation against its real output
metadata on CPU, schema and functionalization checks), the pure-torch reference backend
for values, and Python integers mod 2^64 for splitmix64.
"""

from __future__ import annotations

import gc
import importlib

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_lrmoe.ops import backend as backend_mod
from megatron_lrmoe.ops import combine as combine_mod
from megatron_lrmoe.ops import (
    combine_rows,
    combine_rows_backward,
    resolve_backend,
    scatter_add_rows,
    select_rows,
)
from megatron_lrmoe.ops import select as select_mod
from megatron_lrmoe.ops.select import splitmix64, splitmix64_tensor
from tests.ops.test_kernels import _WithoutCuda  # a build without its CUDA part

# The package's attribute of that name is the function, not the module.
scatter_mod = importlib.import_module("megatron_lrmoe.ops.scatter_add_rows")

MASK64 = (1 << 64) - 1
OPS = ("scatter_add_rows", "select_rows", "combine_rows", "combine_rows_backward")


@pytest.fixture(scope="module")
def ops(kernels):
    return torch.ops.lrmoe


# ---------------------------------------------------------------------------
# Schemas
# ---------------------------------------------------------------------------


def test_every_kernel_is_a_registered_op_with_cpu_and_cuda_kernels(ops, kernels):
    for name in OPS:
        qualname = f"lrmoe::{name}"
        assert torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "CPU")
        # The fake implementation registers a Meta kernel.
        assert torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "Meta")
        if kernels.built_with_cuda():
            assert torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "CUDA")


def test_only_scatter_add_rows_mutates_and_only_its_out(ops):
    for name in OPS:
        schema = getattr(ops, name).default._schema
        written = [a.name for a in schema.arguments
                   if a.alias_info is not None and a.alias_info.is_write]
        assert written == (["out"] if name == "scatter_add_rows" else []), name
    assert len(ops.scatter_add_rows.default._schema.returns) == 0


# ---------------------------------------------------------------------------
# opcheck: fake implementation vs real output metadata, on CPU
# ---------------------------------------------------------------------------


def _pairs(p: int, t: int, h: int, dtype: torch.dtype = torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    src = torch.randn(p, h, generator=g).to(dtype)
    token = torch.randint(0, max(t, 1), (p,), generator=g)
    scale = torch.rand(p, generator=g)
    order = torch.sort(token, stable=True).indices
    offsets = torch.searchsorted(token[order], torch.arange(t + 1))
    dy = torch.randn(t, h, generator=g).to(dtype)
    return src, token, scale, order, offsets, dy


def _opcheck(op, args, kwargs=None) -> None:
    result = torch.library.opcheck(op, args, kwargs or {})
    assert all(v == "SUCCESS" for v in result.values()), result


@pytest.mark.parametrize("shape", [(30, 9, 17), (0, 3, 4), (5, 0, 4), (6, 2, 0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_combine_rows(ops, shape, dtype):
    src, _, scale, order, offsets, _ = _pairs(*shape, dtype)
    if shape[1] == 0:  # no token, so no entry in order (P pairs stay)
        order, offsets = order[:0], offsets[:1]
    _opcheck(ops.combine_rows.default, (src, scale, order, offsets, True))


@pytest.mark.parametrize("shape", [(30, 9, 17), (0, 3, 4), (8, 3, 0)])
def test_opcheck_combine_rows_backward(ops, shape):
    src, token, scale, _, _, dy = _pairs(*shape)
    p = shape[0]
    _opcheck(ops.combine_rows_backward.default, (dy, src, token, scale), {"check": True})
    # With kept_row and w: every other pair kept, K of them, each row written once.
    kept = torch.arange(0, p, 2)
    kept_row = torch.full((p,), -1, dtype=torch.int64)
    kept_row[kept] = torch.arange(kept.numel())
    w = torch.rand(kept.numel())
    _opcheck(ops.combine_rows_backward.default,
             (dy, src, token, scale, kept_row, w, kept.numel(), True))


@pytest.mark.parametrize("shape", [(6, 20, 7), (5, 0, 8), (0, 0, 3)])
def test_opcheck_scatter_add_rows(ops, shape):
    n, m, h = shape
    g = torch.Generator().manual_seed(1)
    out = torch.randn(n, h, generator=g)
    index = torch.randint(0, max(n, 1), (m,), generator=g)
    src = torch.randn(m, h, generator=g)
    scale = torch.rand(m, generator=g)
    _opcheck(ops.scatter_add_rows.default, (out, index, src, scale, True))
    _opcheck(ops.scatter_add_rows.default, (out, index, src), {"check": True})


@pytest.mark.parametrize("rule", ["topk", "sample", "uniform", "hybrid"])
def test_opcheck_select_rows(ops, rule):
    g = torch.Generator().manual_seed(2)
    sizes = torch.tensor([5, 0, 9, 3])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)])
    metric = torch.rand(int(sizes.sum()), generator=g)
    quotas = torch.tensor([2, 4, 9, 1])
    n_kept = int(torch.minimum(quotas, sizes).sum())
    _opcheck(ops.select_rows.default, (metric, offsets, quotas, rule, 7, 0.5, n_kept, True))


def test_opcheck_select_rows_of_nothing(ops):
    empty = torch.zeros(0)
    offsets = torch.zeros(1, dtype=torch.int64)
    _opcheck(ops.select_rows.default,
             (empty, offsets, torch.zeros(0, dtype=torch.int64), "topk", 0, 0.5, 0, True))


def test_fake_select_rows_refuses_a_data_dependent_size(ops):
    metric = torch.rand(6)
    offsets = torch.tensor([0, 6])
    quotas = torch.tensor([2])
    with FakeTensorMode() as mode:
        args = [mode.from_tensor(t) for t in (metric, offsets, quotas)]
        with pytest.raises(ValueError, match="pass n_kept"):
            ops.select_rows(*args, "topk", 0)
        with pytest.raises(ValueError, match="pass n_kept"):
            select_rows(*args, "topk", 0)  # the ops layer too, without n_kept
        kept, scale, counts = select_rows(*args, "topk", 0, n_kept=2)
    assert kept.shape == (2,) and scale.shape == (2,) and counts.shape == (1,)


def test_fake_combine_rows_backward_refuses_an_unknown_k(ops):
    src, token, scale, _, _, dy = _pairs(4, 2, 3)
    kept_row = torch.tensor([0, -1, 1, -1])
    with FakeTensorMode() as mode:
        args = [mode.from_tensor(t) for t in (dy, src, token, scale, kept_row)]
        with pytest.raises(ValueError, match="K = -1"):
            ops.combine_rows_backward(*args)


def test_fake_implementations_read_no_values(ops):
    """Out-of-range indices and broken offsets pass under fake tensors with check on: the
    range checks need values, which fake tensors lack (the real op would raise)."""
    src = torch.randn(4, 3)
    scale = torch.rand(4)
    order = torch.tensor([9, -5, 0, 1])
    offsets = torch.tensor([3, 1, 4])
    with pytest.raises((IndexError, ValueError)):
        combine_rows(src, scale, order, offsets, backend="cpu")
    with FakeTensorMode() as mode:
        y = combine_rows(*[mode.from_tensor(t) for t in (src, scale, order, offsets)],
                         backend="cpu")
    assert y.shape == (2, 3)


# ---------------------------------------------------------------------------
# Fake CUDA tensors: the ops layer picks the compiled CUDA kernels (their fake
# implementations), never the pure-torch path, on a machine without a GPU
# ---------------------------------------------------------------------------


@pytest.fixture
def no_torch_backend(monkeypatch):
    """Make every pure-torch path fail loudly, so a fallback cannot go unnoticed."""
    def refuse(*args, **kwargs):
        raise AssertionError("the pure-torch backend ran")

    monkeypatch.setattr(combine_mod, "combine_rows_reference", refuse)
    monkeypatch.setattr(combine_mod, "combine_rows_backward_reference", refuse)
    monkeypatch.setattr(scatter_mod, "_scatter_add_rows_torch", refuse)
    monkeypatch.setattr(select_mod, "select_rows_reference", refuse)


def _run_every_op_on_fake_cuda() -> None:
    p, t, h, c = 12, 5, 8, 3
    with FakeTensorMode():
        cuda = torch.device("cuda")
        src = torch.empty(p, h, dtype=torch.bfloat16, device=cuda)
        scale = torch.empty(p, device=cuda)
        order = torch.empty(p, dtype=torch.int64, device=cuda)
        offsets = torch.empty(t + 1, dtype=torch.int64, device=cuda)
        y = combine_rows(src, scale, order, offsets)
        assert y.shape == (t, h) and y.dtype == torch.bfloat16 and y.device == cuda_0()

        dy = torch.empty(t, h, dtype=torch.bfloat16, device=cuda)
        token = torch.empty(p, dtype=torch.int32, device=cuda)
        kept_row = torch.empty(p, dtype=torch.int64, device=cuda)
        w = torch.empty(7, device=cuda)
        dscale, g = combine_rows_backward(dy, src, token, scale, kept_row, w, n_out=7)
        assert dscale.shape == (p,) and dscale.dtype == torch.float32
        assert g.shape == (7, h) and g.dtype == torch.bfloat16
        assert dscale.device == g.device == cuda_0()

        out = torch.empty(t, h, dtype=torch.bfloat16, device=cuda)
        assert scatter_add_rows(out, token, src, scale) is out
        assert out.shape == (t, h) and out.device == cuda_0()

        metric = torch.empty(p, device=cuda)
        cell_offsets = torch.empty(c + 1, dtype=torch.int64, device=cuda)
        quotas = torch.empty(c, dtype=torch.int64, device=cuda)
        for m in (metric, None):
            rule = "sample" if m is not None else "uniform"
            kept, kept_scale, counts = select_rows(m, cell_offsets, quotas, rule, seed=3,
                                                   n_kept=6, num_rows=p)
            assert kept.shape == (6,) and kept.dtype == torch.int64
            assert kept_scale.shape == (6,) and kept_scale.dtype == torch.float32
            assert counts.shape == (c,) and counts.dtype == torch.int64
            assert kept.device == kept_scale.device == counts.device == cuda_0()


def cuda_0() -> torch.device:
    return torch.device("cuda", 0)


def test_fake_cuda_tensors_pick_the_cuda_kernels(ops, no_torch_backend):
    _run_every_op_on_fake_cuda()


def test_fake_cuda_tensors_pick_the_cuda_kernels_without_a_cuda_build(
        kernels, no_torch_backend, monkeypatch):
    # A build without nvcc registers the same ops and fake implementations.
    monkeypatch.setattr(backend_mod, "_kernels", _WithoutCuda(kernels))
    assert resolve_backend("auto", "cuda", fake=True) == "cuda"
    assert resolve_backend("cuda", "cuda", fake=True) == "cuda"
    assert resolve_backend("torch", "cuda", fake=True) == "torch"
    _run_every_op_on_fake_cuda()


def test_fake_cpu_tensors_run_the_fake_implementations(ops, no_torch_backend):
    src, token, scale, order, offsets, dy = _pairs(10, 4, 6)
    with FakeTensorMode() as mode:
        f = [mode.from_tensor(x) for x in (src, token, scale, order, offsets, dy)]
        y = combine_rows(f[0], f[2], f[3], f[4])
        dscale, g = combine_rows_backward(f[5], f[0], f[1], f[2])
    assert y.shape == (4, 6) and dscale.shape == (10,) and g.shape == (10, 6)


# ---------------------------------------------------------------------------
# Empty inputs: decided once in the binding, the same on every backend
# ---------------------------------------------------------------------------


def _backends() -> list[str]:
    cuda = backend_mod.cuda_kernels_available() and torch.cuda.is_available()
    return ["cpu", "torch"] + (["cuda"] if cuda else [])


def _device(backend: str) -> str:
    return "cuda" if backend == "cuda" else "cpu"


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_combine_rows_without_pairs_gives_zeros(kernels, backend, dtype):
    """P = 0 with T > 0 (the CUDA launcher refused the null scale pointer of an empty
    tensor), and P > 0 with no entry in order: every backend returns zeros [T, H]."""
    dev = _device(backend)
    t, h = 3, 5
    src = torch.empty(0, h, dtype=dtype, device=dev)
    scale = torch.empty(0, device=dev)
    order = torch.empty(0, dtype=torch.int64, device=dev)
    offsets = torch.zeros(t + 1, dtype=torch.int64, device=dev)
    y = combine_rows(src, scale, order, offsets, backend=backend)
    assert y.shape == (t, h) and y.dtype == dtype and y.device.type == dev
    assert torch.equal(y.cpu(), torch.zeros(t, h, dtype=dtype))
    y = combine_rows(torch.randn(4, h, device=dev).to(dtype), torch.rand(4, device=dev),
                     order, offsets, backend=backend)
    assert torch.equal(y.cpu(), torch.zeros(t, h, dtype=dtype))
    # Through the op itself, for the compiled backends.
    if backend != "torch":
        y = torch.ops.lrmoe.combine_rows(src, scale, order, offsets, False)
        assert torch.equal(y.cpu(), torch.zeros(t, h, dtype=dtype))


@pytest.mark.parametrize("backend", _backends())
def test_combine_rows_without_pairs_still_checks_offsets(kernels, backend):
    dev = _device(backend)
    src = torch.empty(0, 4, device=dev)
    scale = torch.empty(0, device=dev)
    with pytest.raises(ValueError, match="offsets"):
        combine_rows(src, scale, torch.empty(0, dtype=torch.int64, device=dev),
                     torch.tensor([0, 2, 0], device=dev), backend=backend)
    with pytest.raises(IndexError, match="order"):
        combine_rows(src, scale, torch.tensor([0], device=dev),
                     torch.tensor([0, 1], device=dev), backend=backend)


@pytest.mark.parametrize("backend", _backends())
def test_combine_rows_backward_without_pairs_gives_zero_rows(kernels, backend):
    """P = 0: dscale is empty and no kept_row names a row, so out [K, H] is zeros (as the
    torch backend gives), not whatever memory the allocator handed out."""
    dev = _device(backend)
    k, h = 4, 16
    # Leave non-zero bytes where the allocator is likely to place out.
    junk = torch.full((k, h), float("nan"), device=dev)
    del junk
    gc.collect()
    dscale, out = combine_rows_backward(
        torch.randn(3, h, device=dev), torch.empty(0, h, device=dev),
        torch.empty(0, dtype=torch.int64, device=dev), torch.empty(0, device=dev),
        torch.empty(0, dtype=torch.int64, device=dev), torch.rand(k, device=dev), n_out=k,
        backend=backend)
    assert dscale.shape == (0,) and out.shape == (k, h)
    assert torch.equal(out.cpu(), torch.zeros(k, h))


@pytest.mark.parametrize("backend", _backends())
def test_other_ops_on_empty_inputs(kernels, backend):
    dev = _device(backend)
    # scatter_add_rows: nothing to add (M = 0), and empty rows (H = 0).
    out = torch.randn(5, 3, device=dev)
    before = out.clone()
    scatter_add_rows(out, torch.empty(0, dtype=torch.int64, device=dev),
                     torch.empty(0, 3, device=dev), torch.empty(0, device=dev), backend=backend)
    assert torch.equal(out, before)
    # select_rows: no rows (P = 0) and no cells (C = 0).
    for sizes in ([0, 0], []):
        offsets = torch.zeros(len(sizes) + 1, dtype=torch.int64, device=dev)
        quotas = torch.ones(len(sizes), dtype=torch.int64, device=dev)
        kept, scale, counts = select_rows(torch.empty(0, device=dev), offsets, quotas, "sample",
                                          backend=backend, n_kept=0)
        assert kept.shape == (0,) and scale.shape == (0,)
        assert torch.equal(counts.cpu(), torch.zeros(len(sizes), dtype=torch.int64))
    # combine_rows_backward: pairs with empty rows (H = 0) give dscale 0.
    dscale, g = combine_rows_backward(torch.empty(2, 0, device=dev), torch.empty(3, 0, device=dev),
                                      torch.tensor([0, 1, 1], device=dev),
                                      torch.rand(3, device=dev), backend=backend)
    assert torch.equal(dscale.cpu(), torch.zeros(3)) and g.shape == (3, 0)


# ---------------------------------------------------------------------------
# splitmix64 in int64 (the "random" metric and the row keys)
# ---------------------------------------------------------------------------


class _NoUint64Mul(TorchDispatchMode):
    """Refuses uint64 multiplication, as torch's CUDA mul has (no uint64 kernels)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket in (torch.ops.aten.mul, torch.ops.aten.mul_):
            dtypes = [a.dtype for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            if torch.uint64 in dtypes:
                raise NotImplementedError('"mul_cuda" not implemented for \'UInt64\'')
        return func(*args, **kwargs)


def _inputs64() -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    edges = torch.tensor([0, 1, -1, 2**63 - 1, -(2**63), 0x9E3779B97F4A7C15 - 2**64])
    random = torch.randint(-(2**63), 2**63 - 1, (500,), generator=g, dtype=torch.int64)
    return torch.cat([edges, random])


def test_splitmix64_tensor_does_no_uint64_arithmetic():
    x = _inputs64()
    with _NoUint64Mul():
        got = splitmix64_tensor(x)
    assert got.dtype == torch.int64


def test_splitmix64_tensor_matches_python_ints_mod_2_64():
    x = _inputs64()
    got = [v & MASK64 for v in splitmix64_tensor(x).tolist()]
    assert got == [splitmix64(v & MASK64) for v in x.tolist()]


def test_splitmix64_int64_equals_the_uint64_arithmetic():
    """The int64 products have the bits of the uint64 ones (CPU has uint64 mul)."""
    x = _inputs64()

    def mul_u64(z: torch.Tensor, m: int) -> torch.Tensor:
        return (z.view(torch.uint64) * torch.tensor(m, dtype=torch.uint64)).view(torch.int64)

    def lsr(z: torch.Tensor, s: int) -> torch.Tensor:  # CPU has no uint64 >>
        return (z >> s) & ((1 << (64 - s)) - 1)

    z = x + (0x9E3779B97F4A7C15 - 2**64)
    z = mul_u64(z ^ lsr(z, 30), 0xBF58476D1CE4E5B9)
    z = mul_u64(z ^ lsr(z, 27), 0x94D049BB133111EB)
    expected = z ^ lsr(z, 31)
    assert torch.equal(splitmix64_tensor(x), expected)


# ---------------------------------------------------------------------------
# torch.compile: the ops layer traces into one graph of lrmoe ops
# ---------------------------------------------------------------------------


def test_the_ops_layer_compiles_without_graph_breaks(ops):
    src, token, scale, order, offsets, _ = _pairs(12, 4, 6)
    quotas = torch.tensor([1, 2, 0, 3])
    n_kept = int(torch.minimum(quotas, offsets.diff()).sum())  # the plan's K: a host int

    def step(src, token, scale, order, offsets):
        y = combine_rows(src, scale, order, offsets)
        dscale, g = combine_rows_backward(y, src, token, scale)
        out = torch.zeros_like(y)
        scatter_add_rows(out, token, g, scale)
        kept, kept_scale, counts = select_rows(dscale.abs(), offsets, quotas, "sample", 3,
                                               n_kept=n_kept)
        return y, dscale, g, out, kept, kept_scale, counts

    args = (src, token, scale, order, offsets)
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    for got, expected in zip(compiled(*args), step(*args), strict=True):
        assert torch.equal(got, expected)
