"""Device ops per layer call: LRMoE's layer against Megatron's own MoELayer, at
Qwen3-30B-A3B's MoE size on fake CUDA (EP 8, rank 3; workshop/lrmoe_testing/device_ops.py).

The ceiling is relative to Megatron's classes, measured in the same run: Megatron's
MoELayer with the all-to-all dispatcher and its ``SequentialMLP`` experts (megatron-core
0.19.2 builds no grouped-GEMM experts without Transformer Engine; the first test checks
that this is still so). Since ``SequentialMLP`` launches every op once per local expert,
the grouped baseline is Megatron's count with its experts stage counted for one expert
(its experts ops divided by the local experts, rounded down): what grouped experts could
at best launch, with Megatron's router, dispatch and combine as they are. LRMoE at
gamma = inf stays within 1.3 x that, per phase; with retention and replicas (gamma 0.75,
whose selection and replica stages Megatron has no counterpart for) within 2 x.

One subprocess for all cases (the fake process group and the modes are process-wide).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lrmoe_testing.device_ops import DeviceOpCounter, op_kind
from lrmoe_testing.host_reads import HostReadDetector

ROOT = Path(__file__).resolve().parents[2]
RANK = 3
CASES = {"megatron": "megatron:8:inf:uniform:0", "lrmoe inf": "lrmoe:8:inf:uniform:0",
         "lrmoe 0.75 replicas": "lrmoe:8:0.75:uniform:1"}
TIMEOUT_S = 300
GOAL = 1.3                    # LRMoE at gamma = inf against Megatron's grouped baseline
RETENTION_CEILING = 2.0       # gamma 0.75 with replicas: selection and replica stages added
PHASES = ("forward", "backward")


@pytest.fixture(scope="module")
def counts() -> dict[str, dict]:
    run = subprocess.run(
        [sys.executable, "-m", "lrmoe_testing.device_ops", str(RANK),
         *CASES.values()],
        cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
        text=True, timeout=TIMEOUT_S)
    assert run.returncode == 0, run.stderr[-6000:]
    return dict(zip(CASES, json.loads(run.stdout), strict=True))


def _device(record: dict, phase: str) -> int:
    return record["summary"][phase]["kinds"].get("device", 0)


def _megatron_grouped(record: dict, phase: str) -> int:
    """Megatron's device ops with its experts stage counted for one local expert."""
    experts = record["summary"][phase]["stages"]["experts"]
    return _device(record, phase) - experts + experts // record["local_instances"]


def test_megatron_offers_no_grouped_experts_without_te():
    """The baseline is SequentialMLP because megatron-core builds nothing else here: its
    local spec maps grouped GEMMs to SequentialMLP, and TEGroupedMLP needs TE."""
    from megatron.core.extensions.transformer_engine import HAVE_TE
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.transformer.moe.experts import SequentialMLP

    assert not HAVE_TE
    assert LocalSpecProvider().grouped_mlp_modules(True).func is SequentialMLP


def test_both_layers_ran_the_same_router(counts):
    """The two runs are comparable: Megatron's router, forward and backward, issued the
    same device ops in both layers, and each layer returned the input gradient."""
    megatron, lrmoe = counts["megatron"], counts["lrmoe inf"]
    assert megatron["experts"] == "SequentialMLP" and megatron["local_instances"] == 16
    for phase in PHASES:
        stages = [r["summary"][phase]["stages"] for r in (megatron, lrmoe)]
        assert stages[0]["router"] == stages[1]["router"] > 0, stages


@pytest.mark.parametrize("phase", PHASES)
def test_lrmoe_within_megatrons_grouped_count(counts, phase):
    megatron = counts["megatron"]
    baseline = _megatron_grouped(megatron, phase)
    lrmoe = _device(counts["lrmoe inf"], phase)
    retention = _device(counts["lrmoe 0.75 replicas"], phase)
    detail = (f"{phase}: LRMoE gamma inf {lrmoe}, gamma 0.75 with replicas {retention}; "
              f"Megatron SequentialMLP {_device(megatron, phase)}, one expert's ops "
              f"{baseline}; LRMoE stages {counts['lrmoe inf']['summary'][phase]['stages']}")
    assert lrmoe <= GOAL * baseline, detail
    assert retention <= RETENTION_CEILING * baseline, detail
    assert lrmoe < _device(megatron, phase), detail


@pytest.mark.parametrize("phase", PHASES)
def test_lrmoe_collectives_and_host_copies_within_megatrons(counts, phase):
    """At gamma = inf, no more collectives or device-to-host copies than Megatron's."""
    megatron, lrmoe = (counts[k]["summary"][phase]["kinds"] for k in ("megatron", "lrmoe inf"))
    for kind in ("collective", "to_host"):
        assert lrmoe.get(kind, 0) <= megatron.get(kind, 0), (kind, lrmoe, megatron)


def test_op_kinds():
    """``op_kind`` on CPU tensors, with the CPU as the device: outputs and in-place or
    out= writes count, allocations and views do not."""
    x = torch.ones(4, 3)
    y = torch.empty(3, 4)
    counter = DeviceOpCounter(device_type="cpu")
    with counter:
        counter.phase = "p"
        x.view(12)
        x.t()
        x.detach()
        torch.empty(5)
        x + 1
        x.add_(1)
        torch.mm(x.t(), x, out=torch.empty(3, 3))
        y.copy_(x.t())
        x.sum()
    got = [(r.op, r.kind) for r in counter.records]
    assert got == [("view", "metadata"), ("t", "metadata"), ("detach", "metadata"),
                   ("empty", "alloc"), ("add", "device"), ("add_", "device"),
                   ("t", "metadata"), ("empty", "alloc"), ("mm", "device"),
                   ("t", "metadata"), ("copy_", "device"), ("sum", "device")], got
    assert op_kind(torch.ops.aten.add.Tensor, (x, x), {}, x + x, "cuda") == "host"


def test_counting_reads_no_device_value():
    """The counter reads metadata only: under the host-read detector, with every tensor
    device data, counting ops adds no host read."""
    x = torch.randn(8, 4)
    with HostReadDetector() as detector:
        detector.taint(x)
        counter = DeviceOpCounter(device_type="cpu")
        with counter:
            counter.phase = "p"
            y = (x * 2).index_select(0, torch.arange(4))
            y.sum(0).add_(1)
    assert detector.reads == [], [r.where() for r in detector.reads]
    assert sum(r.kind == "device" for r in counter.records) >= 4
