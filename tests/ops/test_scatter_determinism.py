"""scatter_add_rows in deterministic mode: a fixed summation order, whatever the rows' order
and the thread count.

Oracles: ``naive_in_key_order``, the spec as a Python loop that visits the rows in
ascending (key, position) (written from the op's docstring, not from the kernels); the
property itself (a permutation of the rows with their keys, or another thread count,
gives bitwise the same ``out``); ``scatter_add_rows_reference`` (index_add_) for the
order without a key. The CUDA kernel's twin checks (run twice, compare bitwise, compare
with the CPU) are ``scripts/dev/determinism_check.py``, run here where a GPU exists.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

from megatron_lrmoe.ops import deterministic_mode, scatter_add_rows, scatter_add_rows_reference
from tests.ops.test_kernels import make_inputs

scatter_mod = importlib.import_module("megatron_lrmoe.ops.scatter_add_rows")
ROOT = Path(__file__).resolve().parents[2]
CPU_BACKENDS = ["cpu", "torch"]
FLOAT_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def naive_in_key_order(out, index, src, scale=None, key=None):
    """The spec as a loop: rows visited in ascending (key, position), each product rounded
    to the dtype, the sum in op-math from out's value, one rounding."""
    acc_dtype = torch.float64 if out.dtype == torch.float64 else torch.float32
    acc = out.to(acc_dtype, copy=True)
    positions = range(index.shape[0])
    if key is not None:
        positions = sorted(positions, key=lambda i: (int(key[i]), i))
    for i in positions:
        row = src[i].to(acc_dtype)
        if scale is not None:
            row = (row * scale[i].to(acc_dtype)).to(out.dtype).to(acc_dtype)
        acc[int(index[i])] += row
    return acc.to(out.dtype)


def _keys(m: int, seed: int) -> torch.Tensor:
    """Distinct int64 keys in no particular order (pair indices of a larger list)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(4 * m + 1, generator=g)[:m].to(torch.int64) * 3 - 5


def _permute(perm, index, src, scale, key):
    return (index[perm], src[perm], None if scale is None else scale[perm],
            None if key is None else key[perm])


# ---------------------------------------------------------------------------
# The order: ascending key, then position
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_rows_are_summed_in_key_order(kernels, backend, scaled, index_dtype, dtype):
    out, index, src, scale = make_inputs(9, 70, 37, dtype, index_dtype,
                                         torch.float32 if scaled else None, seed=3)
    key = _keys(70, seed=4)
    expected = naive_in_key_order(out, index, src, scale, key)
    scatter_add_rows(out, index, src, scale, backend=backend, key=key, deterministic=True)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_deterministic_without_key_equals_the_reference(kernels, backend, dtype):
    """No key: position order, which is index_add_'s on the CPU (the pure-torch oracle)."""
    out, index, src, scale = make_inputs(16, 300, 130, dtype, torch.int64, torch.float32)
    expected = scatter_add_rows_reference(out, index, src, scale)
    scatter_add_rows(out, index, src, scale, backend=backend, deterministic=True)
    assert torch.equal(out, expected)


def test_equal_keys_keep_position_order(kernels):
    out, index, src, _ = make_inputs(3, 40, 5, torch.float32, torch.int64, None, seed=8)
    key = torch.arange(40) % 4          # ties: each tie class in position order
    expected = naive_in_key_order(out, index, src, None, key)
    scatter_add_rows(out, index, src, backend="cpu", key=key)
    assert torch.equal(out, expected)


# ---------------------------------------------------------------------------
# The property: permuting the rows (with their keys) changes no bit
# ---------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 12), m=st.integers(0, 90), h=st.integers(1, 40),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       scaled=st.booleans(), backend=st.sampled_from(CPU_BACKENDS),
       seed=st.integers(0, 2**16))
def test_permuting_the_rows_with_their_keys_changes_no_bit(kernels, n, m, h, dtype, scaled,
                                                          backend, seed):
    out0, index, src, scale = make_inputs(n, m, h, dtype, torch.int64,
                                          torch.float32 if scaled else None, seed=seed)
    key = _keys(m, seed)
    perm = torch.randperm(m, generator=torch.Generator().manual_seed(seed + 1))
    first, second = out0.clone(), out0.clone()
    scatter_add_rows(first, index, src, scale, backend=backend, key=key, deterministic=True)
    scatter_add_rows(second, *_permute(perm, index, src, scale, key)[:3], backend=backend,
                     key=key[perm], deterministic=True)
    assert torch.equal(first, second)
    assert torch.equal(first, naive_in_key_order(out0, index, src, scale, key))


def test_without_keys_a_permutation_does_change_bits(kernels):
    """The property above is not vacuous: position order depends on the permutation
    (many rows per destination, fp32 sums that round)."""
    out0, index, src, _ = make_inputs(4, 400, 64, torch.float32, torch.int64, None, seed=5)
    perm = torch.randperm(400, generator=torch.Generator().manual_seed(6))
    first, second = out0.clone(), out0.clone()
    scatter_add_rows(first, index, src, backend="cpu", deterministic=True)
    scatter_add_rows(second, index[perm], src[perm], backend="cpu", deterministic=True)
    assert not torch.equal(first, second)
    assert torch.allclose(first, second, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------
# The property: another thread count changes no bit (fresh processes)
# ---------------------------------------------------------------------------

_THREADS_SCRIPT = """
import hashlib, sys, torch
import megatron_lrmoe.ops  # registers the ops
from megatron_lrmoe.ops import scatter_add_rows
torch.set_num_threads(int(sys.argv[1]))
g = torch.Generator().manual_seed(11)
n, m, h = 48, 6000, 700
out = torch.randn(n, h, generator=g).to(torch.bfloat16)
src = torch.randn(m, h, generator=g).to(torch.bfloat16)
index = torch.randint(0, n, (m,), generator=g)
scale = torch.rand(m, generator=g)
key = torch.randperm(m, generator=g)
for backend in ("cpu", "torch"):
    o = out.clone()
    scatter_add_rows(o, index, src, scale, backend=backend, key=key, deterministic=True)
    print(backend, torch.get_num_threads(), hashlib.sha256(o.view(torch.int16).numpy()).hexdigest())
"""


def _digests(threads: int) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", _THREADS_SCRIPT, str(threads)], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    lines = [line.split() for line in proc.stdout.splitlines()]
    assert all(int(t) == threads for _, t, _ in lines), proc.stdout  # really that many
    return {backend: digest for backend, _, digest in lines}


def test_thread_counts_change_no_bit(kernels):
    one, two = _digests(1), _digests(2)
    assert one == two
    assert one["cpu"] == one["torch"]


# ---------------------------------------------------------------------------
# The torch backend's GPU path, run on CPU tensors
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_torch_segment_sum_equals_the_loop_from_zero(dtype):
    _, index, src, _ = make_inputs(7, 120, 33, dtype, torch.int64, None, seed=2)
    out = torch.zeros(7, 33, dtype=dtype)
    expected = naive_in_key_order(out, index, src)
    scatter_mod._segment_sum_into(out, index, src)
    assert torch.equal(out, expected)


# ---------------------------------------------------------------------------
# The mode: Megatron's flag or torch's, read by the caller
# ---------------------------------------------------------------------------


@pytest.fixture
def torch_deterministic():
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


def test_mode_is_off_by_default_and_follows_either_flag(torch_deterministic):
    assert deterministic_mode() and deterministic_mode(False)
    torch.use_deterministic_algorithms(False)
    assert not deterministic_mode() and not deterministic_mode(False)
    assert deterministic_mode(True)


def test_the_op_follows_torch_deterministic_algorithms(kernels, monkeypatch):
    seen = []

    class Ops:
        @staticmethod
        def scatter_add_rows(*args):
            seen.append(args[-1])

    monkeypatch.setattr(scatter_mod, "registered_ops", lambda: Ops)
    out, index, src, _ = make_inputs(3, 4, 2, torch.float32, torch.int64, None)
    scatter_add_rows(out, index, src, backend="cpu")
    torch.use_deterministic_algorithms(True)
    try:
        scatter_add_rows(out, index, src, backend="cpu")
        scatter_add_rows(out, index, src, backend="cpu", deterministic=False)
    finally:
        torch.use_deterministic_algorithms(False)
    assert seen == [False, True, False]


# ---------------------------------------------------------------------------
# Arguments, the torch op and fake tensors
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("bad,exc,match", [
    (torch.arange(6, dtype=torch.int32), TypeError, "key must be int64"),
    (torch.arange(5), ValueError, r"key must be 1-D \[M\] with M = 6"),
    (torch.arange(6).view(2, 3), ValueError, r"key must be 1-D"),
])
def test_bad_keys_are_refused(kernels, backend, bad, exc, match):
    out, index, src, _ = make_inputs(4, 6, 3, torch.float32, torch.int64, None)
    before = out.clone()
    with pytest.raises(exc, match=match):
        scatter_add_rows(out, index, src, backend=backend, key=bad)
    assert torch.equal(out, before)


@pytest.mark.parametrize("shape", [(6, 20, 7), (5, 0, 8)])
def test_opcheck_with_key_and_deterministic(kernels, shape):
    n, m, h = shape
    out, index, src, scale = make_inputs(n, m, h, torch.float32, torch.int64, torch.float32)
    result = torch.library.opcheck(torch.ops.lrmoe.scatter_add_rows.default,
                                   (out, index, src, scale, True, _keys(m, 1), True))
    assert all(v == "SUCCESS" for v in result.values()), result


def test_fake_cuda_deterministic_call_runs_the_fake_kernel(kernels, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the pure-torch backend ran")

    monkeypatch.setattr(scatter_mod, "_scatter_add_rows_torch", refuse)
    with FakeTensorMode():
        cuda = torch.device("cuda")
        out = torch.empty(5, 8, dtype=torch.bfloat16, device=cuda)
        src = torch.empty(12, 8, dtype=torch.bfloat16, device=cuda)
        index = torch.empty(12, dtype=torch.int64, device=cuda)
        key = torch.empty(12, dtype=torch.int64, device=cuda)
        assert scatter_add_rows(out, index, src, key=key, deterministic=True) is out
        with pytest.raises(TypeError, match="key must be int64"):
            scatter_add_rows(out, index, src, key=key.int(), deterministic=True)


# ---------------------------------------------------------------------------
# On a GPU: the CUDA kernel twice, bitwise, and against the CPU
# ---------------------------------------------------------------------------


def _determinism_check():
    """The GPU check's script, loaded from its file (a script, not a package module)."""
    name = "lrmoe_determinism_check"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, ROOT / "scripts" / "dev" / "determinism_check.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module        # its dataclasses resolve their module by name
        spec.loader.exec_module(module)
    return sys.modules[name]


def test_the_device_check_runs_on_the_cpu(kernels):
    """scripts/dev/determinism_check.py (the GPU check's step) passes on the CPU kernels."""
    result = _determinism_check().check_determinism("cpu", large_rows=4000, small=True,
                                                    layer=False)
    assert result.ok, "\n".join(result.lines)
    assert len(result.lines) == 9 and all(line.startswith("ok") for line in result.lines)


def _layer_check_on_cpu() -> tuple[bool, list[str]]:
    result = _determinism_check().check_layer_determinism("cpu", small=True)
    return result.ok, result.lines


def test_the_device_checks_layer_step_runs_on_the_cpu(gloo1):
    """Its layer step (Megatron's layer, so in a worker process): two fresh layers in
    deterministic mode give bitwise the same gradients."""
    ((ok, lines),) = gloo1.run(_layer_check_on_cpu)
    assert ok, "\n".join(lines)
    assert [line.split()[0] for line in lines] == ["ok", "ok", "info"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_the_device_check_reports_no_device(kernels, capsys):
    assert _determinism_check().main(["--device", "cuda"]) == 2
    assert "determinism: no device" in capsys.readouterr().out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_kernel_is_bitwise_reproducible_and_equals_the_cpu(kernels):
    result = _determinism_check().check_determinism("cuda", large_rows=50_000, layer=False)
    assert result.ok, "\n".join(result.lines)
