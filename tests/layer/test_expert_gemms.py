"""The choice between grouped expert GEMMs and the per-expert loop.

torch's CUDA grouped_mm runs its grouped kernel only for bf16 on compute capability
9.x/10.x; elsewhere it takes a per-group fallback that reads the group offsets on the
host (a sync per call). Oracles: the rule's table (``grouped_mm_rule``, a pure function,
checked on CPU), ``use_grouped_mm`` on fake CUDA tensors with the device's capability
patched (no GPU needed), and the probe run on the CPU with a grouped_mm that is wrong in
one call pattern only. On a CUDA machine, one more case runs the probe for real.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from megatron_lrmoe.layer import expert_gemms as eg

BF16, FP32, FP16 = torch.bfloat16, torch.float32, torch.float16


def _clear_probe_cache() -> None:
    for name in ("_probe", "grouped_mm_works"):
        clear = getattr(getattr(eg, name, None), "cache_clear", None)
        if clear is not None:
            clear()


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    _clear_probe_cache()
    monkeypatch.setattr(eg, "_warned", set())
    yield
    _clear_probe_cache()


# -----------------------------------------------------------------------------
# The rule
# -----------------------------------------------------------------------------


@pytest.mark.parametrize("device_type, dtype, capability, grouped, syncs, words", [
    ("cuda", BF16, (9, 0), True, False, "9.0"),      # H100 / H200
    ("cuda", BF16, (10, 0), True, False, "10.0"),    # B200
    ("cuda", FP32, (9, 0), False, True, "float32"),  # fp32 on an H200: the fallback
    ("cuda", FP16, (9, 0), False, True, "float16"),
    ("cuda", BF16, (8, 0), False, True, "8.0"),      # bf16 on an A100: the fallback
    ("cuda", BF16, (8, 9), False, True, "8.9"),
    ("cuda", BF16, (12, 0), False, True, "12.0"),
    ("cuda", BF16, None, False, False, "fake"),      # no GPU to read a capability from
    ("cuda", FP32, None, False, True, "float32"),
    ("cpu", FP32, None, False, False, "cpu"),
    ("cpu", BF16, None, False, False, "cpu"),
])
def test_rule(device_type, dtype, capability, grouped, syncs, words):
    rule = eg.grouped_mm_rule(device_type, dtype, capability)
    assert (rule.grouped, rule.syncs) == (grouped, syncs), rule.reason
    assert words in rule.reason


def test_rule_on_rocm_leaves_an_explicit_request_to_the_probe():
    rule = eg.grouped_mm_rule("cuda", BF16, (9, 4), hip=True)
    assert not rule.grouped and not rule.syncs and "ROCm" in rule.reason


# -----------------------------------------------------------------------------
# use_grouped_mm on fake CUDA tensors (the capability patched where a GPU is implied)
# -----------------------------------------------------------------------------


def _fake_cuda(dtype, h=16, f=32):
    x = torch.empty(10, h, dtype=dtype, device="cuda")
    w1 = torch.empty(f, h, dtype=dtype, device="cuda")
    w2 = torch.empty(h, f, dtype=dtype, device="cuda")
    return x, w1, w2


@pytest.fixture
def gpu(monkeypatch):
    """A GPU of the given compute capability, as far as use_grouped_mm can tell, whose
    grouped_mm computes the right numbers (what the old, numbers-only probe saw)."""
    def make(capability):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(eg, "grouped_mm_works", lambda device, dtype: True)
        monkeypatch.setattr(eg, "_probe", lambda device, dtype: None, raising=False)
    return make


@pytest.mark.parametrize("capability, dtype, want", [
    ((9, 0), BF16, True), ((10, 0), BF16, True),
    ((9, 0), FP32, False), ((8, 0), BF16, False), ((12, 0), BF16, False),
])
def test_the_default_follows_the_rule(gpu, capability, dtype, want):
    gpu(capability)
    with FakeTensorMode():
        assert eg.use_grouped_mm(None, *_fake_cuda(dtype)) is want


@pytest.mark.parametrize("capability, dtype, words", [
    ((9, 0), FP32, "float32"), ((8, 0), BF16, "8.0")])
def test_an_explicit_request_that_would_sync_runs_the_loop_and_says_why(
        gpu, caplog, capability, dtype, words):
    gpu(capability)
    with caplog.at_level(logging.WARNING, logger=eg.__name__), FakeTensorMode():
        assert eg.use_grouped_mm(True, *_fake_cuda(dtype)) is False
    text = caplog.text
    assert "--moe-grouped-gemm" in text and words in text and "sync" in text


def test_fake_cuda_tensors_take_the_grouped_path_when_asked():
    """No GPU, no capability: the default is the loop, an explicit request is grouped,
    and the region's grouped GEMMs trace with fake tensors."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: its capability decides")
    rows = [3, 0, 5]
    with FakeTensorMode():
        x, w1, w2 = _fake_cuda(BF16, h=16, f=32)
        assert eg.use_grouped_mm(None, x, w1, w2) is False
        assert eg.use_grouped_mm(True, x, w1, w2) is True
        assert eg.use_grouped_mm(False, x, w1, w2) is False
        x = torch.empty(sum(rows), 16, dtype=BF16, device="cuda")
        offs = torch.empty(len(rows), dtype=torch.int32, device="cuda")
        w1s = [torch.empty(32, 16, dtype=BF16, device="cuda") for _ in rows]
        w2s = [torch.empty(16, 32, dtype=BF16, device="cuda") for _ in rows]
        z, o, a = eg.experts_forward(x, rows, offs, w1s, w2s, torch.relu, True, grouped=True)
        assert z.shape == (8, 32) and o.shape == (8, 16) and a.shape == (8,)
        # (the backward's GEMMs on fake CUDA tensors: the patterns experts_backward calls;
        # its activation gradient needs autograd's CUDA engine, which a machine without a
        # GPU lacks)
        dh = eg._GROUPED_MM(o, torch.stack(w2s), offs=offs)             # dH = G W2
        dx = eg._GROUPED_MM(z, torch.stack(w1s), offs=offs)             # dX = dZ W1
        dw1 = eg._GROUPED_MM(z.t(), x, offs=offs)                        # dW1 = dZ^T X
        assert dh.shape == (8, 32) and dx.shape == (8, 16) and dw1.shape == (3, 32, 16)
        # fp32 cannot take it: torch's fake CUDA grouped_mm takes bf16 only
        assert eg.use_grouped_mm(True, *_fake_cuda(FP32)) is False


def test_cpu_keeps_the_loop_by_default_and_grouped_when_asked():
    x, w1, w2 = torch.randn(10, 16), torch.randn(32, 16), torch.randn(16, 32)
    assert eg.use_grouped_mm(None, x, w1, w2) is False
    assert eg.use_grouped_mm(True, x, w1, w2) is True


# -----------------------------------------------------------------------------
# The probe runs the backward's call patterns too
# -----------------------------------------------------------------------------


@pytest.mark.parametrize("pattern", ["forward", "backward_dx", "backward_dw"])
def test_the_probe_fails_when_any_of_the_regions_patterns_is_wrong(monkeypatch, pattern):
    real = eg._GROUPED_MM

    def kind(a, b):
        if a.dim() == 2 and b.dim() == 2:
            return "backward_dw"                      # dZ^T @ X per group: [L, F, H]
        return "forward" if b.stride(-2) == 1 else "backward_dx"   # W^T, or W as is

    def wrong_in_one(a, b, **kwargs):
        out = real(a, b, **kwargs)
        return out + 1 if kind(a, b) == pattern else out

    monkeypatch.setattr(eg, "_GROUPED_MM", wrong_in_one)
    assert eg.grouped_mm_works(torch.device("cpu"), FP32) is False
    monkeypatch.setattr(eg, "_GROUPED_MM", real)
    _clear_probe_cache()
    assert eg.grouped_mm_works(torch.device("cpu"), FP32) is True


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_probe_catches_the_syncing_fallback_on_a_gpu():
    major, _ = torch.cuda.get_device_capability()
    dev = torch.device("cuda")
    assert eg.grouped_mm_works(dev, FP32) is False          # fallback: host sync per call
    if major in (9, 10):
        assert eg.grouped_mm_works(dev, BF16) is True
