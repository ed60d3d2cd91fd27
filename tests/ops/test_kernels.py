"""Kernel tier: scatter_add_rows vs a loop written from its spec, backend selection, CUDA sources.

Oracle: ``naive_scatter_add_rows`` below, a Python loop over the rows written
from the op's docstring alone (not ``scatter_add_rows_reference``, which is
index_add_ like the torch backend). Every CPU backend must equal it bitwise.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_lrmoe.ops import backend as backend_mod
from megatron_lrmoe.ops import (
    describe_backend,
    kernels_available,
    resolve_backend,
    scatter_add_rows,
)

ROOT = Path(__file__).resolve().parents[2]
CHECK_SCRIPT = ROOT / "scripts" / "dev" / "check_cuda_sources.sh"

FLOAT_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
INDEX_DTYPES = [torch.int32, torch.int64]
CPU_BACKENDS = ["cpu", "torch"]
# (N, M, H): rows of out, rows of src, hidden size.
SHAPES = [
    (5, 0, 8),  # M = 0: nothing to add
    (7, 5, 0),  # H = 0: empty rows
    (0, 0, 3),  # N = 0 with M = 0 is valid
    (1, 17, 5),  # N = 1: every row repeats one destination
    (6, 9, 1),  # H = 1
    (4, 64, 33),  # many repeats per destination
    (300, 50, 700),  # H spans several column blocks, most rows untouched
]


def make_inputs(n, m, h, dtype, index_dtype, scale_dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = torch.randn(n, h, generator=g).to(dtype)
    src = torch.randn(m, h, generator=g).to(dtype)
    index = torch.randint(0, max(n, 1), (m,), generator=g).to(index_dtype)
    scale = None if scale_dtype is None else torch.rand(m, generator=g).to(scale_dtype)
    return out, index, src, scale


def naive_scatter_add_rows(out, index, src, scale=None):
    """The spec as a loop: product rounded to the dtype, sum in op-math, one rounding."""
    acc_dtype = torch.float64 if out.dtype == torch.float64 else torch.float32
    acc = out.to(acc_dtype, copy=True)
    for i, d in enumerate(index.tolist()):
        row = src[i].to(acc_dtype)
        if scale is not None:
            row = (row * scale[i].to(acc_dtype)).to(out.dtype).to(acc_dtype)
        acc[d] += row
    return acc.to(out.dtype)


# ---------------------------------------------------------------------------
# Correctness against the oracles
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "N{}-M{}-H{}".format(*s))
@pytest.mark.parametrize("scale_kind", ["none", "same", "fp32"])
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES, ids=str)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_matches_naive_loop(kernels, backend, shape, scale_kind, index_dtype, dtype):
    n, m, h = shape
    scale_dtype = {"none": None, "same": dtype, "fp32": torch.float32}[scale_kind]
    out, index, src, scale = make_inputs(n, m, h, dtype, index_dtype, scale_dtype)
    expected = naive_scatter_add_rows(out, index, src, scale)

    src_before = src.clone()
    result = scatter_add_rows(out, index, src, scale, backend=backend)
    assert result is out, "scatter_add_rows works in place and returns out"
    assert torch.equal(out, expected)
    assert torch.equal(src, src_before)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 9),
    m=st.integers(0, 40),
    h=st.integers(0, 300),
    dtype=st.sampled_from(FLOAT_DTYPES),
    index_dtype=st.sampled_from(INDEX_DTYPES),
    scaled=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_random_shapes_match_naive_loop(kernels, n, m, h, dtype, index_dtype, scaled, seed):
    out, index, src, scale = make_inputs(
        n, m, h, dtype, index_dtype, dtype if scaled else None, seed=seed
    )
    expected = naive_scatter_add_rows(out, index, src, scale)
    for backend in CPU_BACKENDS:
        result = out.clone()
        scatter_add_rows(result, index, src, scale, backend=backend)
        assert torch.equal(result, expected), backend


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_repeated_destinations_summed_in_index_order(kernels, backend):
    # In fp32, out + 1 + 1e8 - 1e8 == 0 in index order (1e8 absorbs the 1),
    # while the reverse order, or adding the 1 last, gives 1.
    out = torch.zeros(2, 300)
    src = torch.tensor([1.0, 1e8, -1e8]).repeat_interleave(300).view(3, 300)
    scatter_add_rows(out, torch.tensor([1, 1, 1]), src, backend=backend)
    assert torch.equal(out, torch.zeros(2, 300))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_bf16_rows_are_summed_in_fp32(kernels, backend):
    # bf16 has 8 significant bits: adding 1.0 to 256 rounds back to 256, so a
    # sum rounded after every add would stop at 256. The sum is kept in fp32.
    out = torch.zeros(1, 4, dtype=torch.bfloat16)
    src = torch.ones(300, 4, dtype=torch.bfloat16)
    scatter_add_rows(out, torch.zeros(300, dtype=torch.int64), src, backend=backend)
    assert out.float().eq(300.0).all()


def test_scale_product_rounded_to_dtype_before_the_sum(kernels):
    # p = 1 + 2**-8 - 2**-20 lies just below the midpoint of bf16's 1 and
    # 1 + 2**-7, so it rounds to 1.0: three rows give exactly 3.0. Summing the
    # unrounded products would give 3.0117..., which rounds to 3.015625.
    out = torch.zeros(1, 1, dtype=torch.bfloat16)
    src = torch.ones(3, 1, dtype=torch.bfloat16)
    scale = torch.full((3,), 1 + 2**-8 - 2**-20, dtype=torch.float32)
    scatter_add_rows(out, torch.zeros(3, dtype=torch.int64), src, scale, backend="cpu")
    assert out.item() == 3.0


def test_bitwise_deterministic_across_runs_and_thread_counts(kernels):
    out0, index, src, scale = make_inputs(64, 4096, 1000, torch.float32, torch.int64, torch.float32)
    threads = torch.get_num_threads()
    results = []
    try:
        for n_threads in (1, 2, 2, 1, 2):
            torch.set_num_threads(n_threads)
            out = out0.clone()
            scatter_add_rows(out, index, src, scale, backend="cpu")
            results.append(out)
    finally:
        torch.set_num_threads(threads)
    for r in results[1:]:
        assert torch.equal(r, results[0])
    assert torch.equal(results[0], naive_scatter_add_rows(out0, index, src, scale))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_strided_read_only_operands_are_accepted(kernels, backend):
    out, index, src, scale = make_inputs(8, 12, 10, torch.float32, torch.int64, torch.float32)
    src_t = src.t().contiguous().t()  # same values, column-major
    index_s = torch.stack([index, index], 1)[:, 0]  # stride 2
    scale_s = torch.stack([scale, scale], 1)[:, 0]
    assert not (src_t.is_contiguous() or index_s.is_contiguous() or scale_s.is_contiguous())
    expected = naive_scatter_add_rows(out, index, src, scale)
    scatter_add_rows(out, index_s, src_t, scale_s, backend=backend)
    assert torch.equal(out, expected)


# ---------------------------------------------------------------------------
# Errors: the same exception type from every backend, out left unchanged
# ---------------------------------------------------------------------------


def _valid(n=4, m=6, h=3):
    return make_inputs(n, m, h, torch.float32, torch.int64, None)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("bad", [4, -1, 1000])
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES, ids=str)
def test_out_of_range_index_raises_and_leaves_out_unchanged(kernels, backend, bad, index_dtype):
    out, index, src, _ = _valid()
    index = index.to(index_dtype)
    index[3] = bad
    before = out.clone()
    with pytest.raises(IndexError, match=rf"{bad}.*outside \[0, N\) with N = 4"):
        scatter_add_rows(out, index, src, backend=backend)
    assert torch.equal(out, before)


def _bad_calls():
    """(id, expected exception, callable(out, index, src) -> args for scatter_add_rows)."""
    return [
        ("out-int", TypeError, lambda o, i, s: (o.long(), i, s.long(), None)),
        ("src-dtype", TypeError, lambda o, i, s: (o, i, s.double(), None)),
        ("index-float", TypeError, lambda o, i, s: (o, i.float(), s, None)),
        ("scale-fp64", TypeError, lambda o, i, s: (o, i, s, torch.ones(6, dtype=torch.float64))),
        ("out-1d", ValueError, lambda o, i, s: (o[:, 0].contiguous(), i, s, None)),
        ("src-3d", ValueError, lambda o, i, s: (o, i, s[None], None)),
        ("index-2d", ValueError, lambda o, i, s: (o, i[None], s, None)),
        ("h-mismatch", ValueError, lambda o, i, s: (o, i, s[:, :2], None)),
        ("m-mismatch", ValueError, lambda o, i, s: (o, i[:5], s, None)),
        ("scale-len", ValueError, lambda o, i, s: (o, i, s, torch.ones(5))),
        ("out-strided", ValueError, lambda o, i, s: (o.t().contiguous().t(), i, s, None)),
        ("index-meta", ValueError, lambda o, i, s: (o, i.to("meta"), s, None)),
        ("src-meta", ValueError, lambda o, i, s: (o, i, s.to("meta"), None)),
        ("scale-meta", ValueError, lambda o, i, s: (o, i, s, torch.ones(6, device="meta"))),
    ]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize(
    "exc,make_args", [c[1:] for c in _bad_calls()], ids=[c[0] for c in _bad_calls()]
)
def test_bad_arguments_raise(kernels, backend, exc, make_args):
    out, index, src, _ = _valid()
    args = make_args(out, index, src)
    before = args[0].clone()
    with pytest.raises(exc, match="scatter_add_rows"):
        scatter_add_rows(*args, backend=backend)
    assert torch.equal(args[0], before)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_out_aliasing_src_is_refused(kernels, backend):
    buf = torch.randn(4, 3)
    with pytest.raises(RuntimeError):
        scatter_add_rows(buf, torch.tensor([0, 1, 2, 3]), buf, backend=backend)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_refused_under_autograd_and_accepted_under_no_grad(kernels, backend):
    out, index, src, _ = _valid()
    src.requires_grad_(True)
    with pytest.raises(RuntimeError, match="no autograd"):
        scatter_add_rows(out, index, src, backend=backend)
    with torch.no_grad():
        expected = naive_scatter_add_rows(out, index, src)
        scatter_add_rows(out, index, src, backend=backend)
    assert torch.equal(out, expected)


def test_binding_refuses_non_contiguous_operands(kernels):
    # The binding itself never copies: strided inputs are refused there, and
    # only the Python wrapper makes read-only operands contiguous.
    out, index, src, _ = _valid()
    with pytest.raises(ValueError, match="src must be contiguous"):
        kernels.scatter_add_rows(out, index, src.t().contiguous().t())
    with pytest.raises(ValueError, match="index must be contiguous"):
        kernels.scatter_add_rows(out, torch.stack([index, index], 1)[:, 0], src)


def test_binding_reports_cuda_support(kernels):
    assert isinstance(kernels.built_with_cuda(), bool)
    if torch.version.cuda is None:
        assert kernels.built_with_cuda() is False


def test_binding_refuses_devices_other_than_cpu_and_cuda(kernels):
    out = torch.empty(2, 2, device="meta")
    index = torch.zeros(1, dtype=torch.long, device="meta")
    with pytest.raises(ValueError, match="CPU or CUDA device"):
        kernels.scatter_add_rows(out, index, torch.empty(1, 2, device="meta"))


# ---------------------------------------------------------------------------
# Backend selection
# ---------------------------------------------------------------------------


@pytest.fixture
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(backend_mod, "_warned", set())


def test_resolve_backend_with_compiled_kernels(kernels):
    assert resolve_backend() == "cpu"
    assert resolve_backend("auto", torch.device("cpu")) == "cpu"
    assert resolve_backend("cpu", "cpu") == "cpu"
    assert resolve_backend("torch", "cpu") == "torch"
    assert resolve_backend("torch", "cuda") == "torch"


@pytest.mark.parametrize("name", ["", "CPU", "gpu", "triton", "Auto"])
def test_resolve_backend_rejects_unknown_names(name):
    with pytest.raises(ValueError, match="--moe-lrmoe-kernels"):
        resolve_backend(name, "cpu")


def test_explicit_backend_for_another_device_is_refused(kernels):
    with pytest.raises(ValueError, match="tensors are on cpu"):
        resolve_backend("cuda", "cpu")
    with pytest.raises(ValueError, match="tensors are on cuda"):
        resolve_backend("cpu", "cuda")


class _WithoutCuda:
    """The compiled extension as a build without its CUDA part would present it."""

    def __init__(self, module):
        self._module = module

    def built_with_cuda(self) -> bool:
        return False

    def __getattr__(self, name):
        return getattr(self._module, name)


def test_cuda_request_without_cuda_build(kernels, fresh_warnings, caplog, monkeypatch):
    # Where nvcc was found the build has CUDA (setup.sh): stand in for one without it.
    monkeypatch.setattr(backend_mod, "_kernels", _WithoutCuda(kernels))
    with pytest.raises(ValueError, match=r"--moe-lrmoe-kernels cuda.*bash scripts/setup\.sh"):
        resolve_backend("cuda", "cuda")
    with caplog.at_level(logging.WARNING, logger=backend_mod.__name__):
        assert resolve_backend("auto", "cuda") == "torch"
        assert resolve_backend("auto", "cuda:0") == "torch"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, "the fallback is logged once"
    assert "without CUDA support" in warnings[0].getMessage()


def test_without_extension_auto_falls_back_to_torch(monkeypatch, fresh_warnings, caplog):
    monkeypatch.setattr(backend_mod, "_kernels", None)
    monkeypatch.setattr(backend_mod, "_kernels_import_error", "ImportError: not built")
    assert not kernels_available()
    with caplog.at_level(logging.WARNING, logger=backend_mod.__name__):
        for _ in range(3):
            assert resolve_backend("auto", "cpu") == "torch"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "bash scripts/setup.sh" in warnings[0] and "not built" in warnings[0]

    with pytest.raises(ValueError, match=r"--moe-lrmoe-kernels cpu.*bash scripts/setup\.sh"):
        resolve_backend("cpu", "cpu")
    with pytest.raises(RuntimeError, match="not built"):
        backend_mod.kernels_module()

    # The op still works, through the torch backend.
    out, index, src, scale = make_inputs(5, 20, 7, torch.bfloat16, torch.int64, torch.float32)
    expected = naive_scatter_add_rows(out, index, src, scale)
    scatter_add_rows(out, index, src, scale)
    assert torch.equal(out, expected)


def test_describe_backend(kernels):
    line = describe_backend("auto", "cpu")
    assert "'cpu'" in line and "--moe-lrmoe-kernels auto" in line and "compiled" in line
    assert "'torch'" in describe_backend("torch", "cpu")
    # describe never raises: an impossible request is described, not thrown.
    assert "unavailable" in describe_backend("bogus", "cpu")


# ---------------------------------------------------------------------------
# CUDA sources compile (nvcc, no GPU needed)
# ---------------------------------------------------------------------------


def _nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    candidate = Path(home) / "bin" / "nvcc"
    return str(candidate) if candidate.exists() else None


def _run_check(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(CHECK_SCRIPT), *args],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.skipif(_nvcc() is None, reason="nvcc is not installed")
def test_cuda_sources_compile_with_nvcc():
    # Passes are cached in the user's cache folder by a hash of every input (sources,
    # headers, flags, nvcc, torch): a compile is not repeated while its inputs are
    # unchanged, in this checkout or another on the machine; a change compiles again.
    proc = _run_check()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for cu in sorted((ROOT / "kernels").glob("*.cu")):
        assert f"ok   kernels/{cu.name}" in proc.stdout
    assert "ok   kernels/bindings.cpp (-DWITH_CUDA" in proc.stdout
    again = _run_check()   # the key is stable: every check is now a cache hit
    assert again.returncode == 0, again.stdout + again.stderr
    assert again.stdout.count(", cached)") == proc.stdout.count("check_cuda_sources: ok")


@pytest.mark.skipif(_nvcc() is None, reason="nvcc is not installed")
def test_cuda_check_fails_on_a_compile_error(tmp_path):
    broken = tmp_path / "broken.cu"
    broken.write_text("__global__ void k(float* x) { x[0] = not_declared; }\n")
    # CUDA_CHECK_CACHE="": no cache is read or written, nvcc itself must say no.
    proc = _run_check(str(broken), CUDA_ARCHS="80", CUDA_STDS="c++17", CUDA_CHECK_CACHE="")
    assert proc.returncode != 0
    assert "FAIL" in proc.stdout and "cached" not in proc.stdout
    assert "not_declared" in proc.stderr   # nvcc's own diagnostic


def test_cuda_check_skips_cleanly_without_nvcc():
    proc = _run_check(NVCC="/nonexistent/nvcc")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SKIP" in proc.stdout
