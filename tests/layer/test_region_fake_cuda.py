"""The LRMoE region's CUDA path at Qwen3-30B-A3B's size, on fake CUDA tensors.

One subprocess (``python -m lrmoe_testing.cuda_harness``; the fake process group and
the fake-tensor modes never enter this process) runs every case as rank r of a fake EP
group of 8 and of 64: hidden 2048, 128 experts, top-8, expert FFN 768 (SwiGLU), 4096
tokens per rank, bf16, grouped GEMMs, the CUDA kernel backend; counts from the qwen3
routing trace formed as the simulator forms them; forward, then backward through the
region's node. What the harness sets up and what it replaces: its module docstring.

The checks judge what the subprocess recorded against what this process derives on its
own: the plan, re-planned here from the same counts, the cost model's rows per
instance (``InstanceRows.of_plan``) and its memory (``CostModel.plan_memory``).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from lrmoe_testing.cuda_harness import (
    Case,
    case_counts,
    case_planner,
    device_memory,
    node_grad,
    releasing_saved_tensors,
)
from megatron_lrmoe.options.lrmoe import option
from megatron_lrmoe.planning.cost_model import CostModel
from megatron_lrmoe.planning.machine import MachineConstants
from megatron_lrmoe.planning.shapes import InstanceRows, MoEShape

ROOT = Path(__file__).resolve().parents[2]
RANKS = {8: 3, 64: 37}
CASES = [Case(ep, gamma, selection, replicas)
         for ep in RANKS for gamma in (math.inf, 1.0, 0.75)
         for selection in ("uniform", "topk") for replicas in (False, True)]
# Expert biases (Megatron's add_bias_linear): their adds and gradient sums on the device,
# with replicas carrying them.
CASES.append(Case(8, 0.75, "uniform", True, bias=True))
# two-stage: the stored set drawn and compacted in forward, the final draw in backward.
CASES += [Case(8, 0.75, "two-stage", False), Case(64, 0.75, "two-stage", True)]
TIMEOUT_S = 240
MEMORY_TOLERANCE = 0.05
MIB = 1 << 20


def _arg(case: Case) -> str:
    gamma = "inf" if math.isinf(case.gamma) else f"{case.gamma:g}"
    return f"{case.ep}:{gamma}:{case.selection}:{int(case.replicas)}:{int(case.bias)}"


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    """Every case's record, from one subprocess per EP size (each its own fake group),
    started together (one thread each: they share the machine's cores)."""
    out: dict[str, dict] = {}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    started = time.perf_counter()
    runs = {ep: subprocess.Popen(
        [sys.executable, "-m", "lrmoe_testing.cuda_harness", str(rank),
         *(_arg(c) for c in CASES if c.ep == ep)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for ep, rank in RANKS.items()}
    for ep, run in runs.items():
        stdout, stderr = run.communicate(timeout=TIMEOUT_S)
        assert run.returncode == 0, stderr[-6000:]
        records = json.loads(stdout)
        print(f"EP {ep}: {len(records)} cases within {time.perf_counter() - started:.1f} s")
        out.update({r["case"]: r for r in records})
    return out


def _plan(case: Case):
    """The case's plan, planned here from the same trace counts (no fake tensors)."""
    counts = case_counts(case)
    planner = case_planner(case, counts, counts.shape[1])
    planner.observe(counts)
    return planner.plan(counts).retention


def _region_made(record: dict) -> list[dict]:
    return [m for m in record["made"] if m["phase"] in ("forward", "backward")]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_region_at_size_on_fake_cuda(results, case):
    record = results[case.name]
    rank, h, f, t = record["rank"], record["hidden"], record["ffn"], record["tokens"]
    assert (h, f, t) == (2048, 768, 4096)
    plan = _plan(case)
    assert torch.equal(plan.counts, torch.tensor(record["plan_counts"]))
    assert torch.equal(plan.quotas, torch.tensor(record["plan_quotas"]))
    local = [i for i, r in enumerate(plan.instance_rank) if r == rank]
    homes = record["home_instances"]
    assert record["local_instances"] == len(local) and homes == 128 // case.ep
    if case.replicas:   # the case exercises what it names
        assert len(local) > homes, "rank hosts no replica"
    if case.gamma < 1:
        assert int(plan.quotas[:, local].sum()) < int(plan.counts[:, local].sum()), \
            "nothing dropped on this rank"

    # Forward and backward completed, grouped, on the CUDA backend's fake implementations.
    assert record["grouped_gemm"] is True
    pairs = int(plan.counts[rank].sum())
    out = record["outputs"]
    assert out["y"] == [[t, h], "bfloat16", "cuda"]
    assert out["dx"] == [[t, h], "bfloat16", "cuda"]
    assert out["dpair_prob"] == [[pairs], "float32", "cuda"]
    kinds = {"w1": [2 * f, h], "w2": [h, f]}
    if case.bias:
        kinds.update(b1=[2 * f], b2=[h])
    for j in range(homes):
        for kind, dims in kinds.items():
            assert out[f"d{kind}[{j}]"] == [dims, "bfloat16", "cuda"], (kind, j)
    assert (f"db1[{homes - 1}]" in out) is case.bias
    replicas = len(local) - homes
    assert record["replica_grads"] == [[dims, "bfloat16", "cuda"] for dims in kinds.values()
                                       for _ in range(replicas)]

    # Every tensor the region makes is on the device, in the dtype the design says: rows,
    # weights and their gradients in bf16; fp32 only for per-row or per-pair values (a,
    # the metric, the router gradient, sums); int64 indices, int32 GEMM offsets and
    # positions. The one host tensor is forward's pinned staging copy of the plan's tables.
    made = _region_made(record)
    assert {m["phase"] for m in made} == {"forward", "backward"}
    off_device = [m for m in made if m["device"] != "cuda"]
    assert all(m["pinned_staging"] and m["phase"] == "forward" for m in off_device), off_device
    assert len(off_device) == 2            # the staging buffer and the copy into it
    for m in made:
        assert m["dtype"] in ("bfloat16", "float32", "int64", "int32", "bool"), m
        if m["dtype"] == "float32":
            assert len(m["shape"]) <= 1, m
    assert sum(len(m["shape"]) == 2 and m["dtype"] == "bfloat16" for m in made) > 0

    # Host reads: the forward's one documented read (the counts exchange, before the
    # region), none in the region, none in backward (which also ran no data-dependent
    # op: fake tensors raise on those).
    reads = record["forward_reads"]
    assert len(reads) == 1, reads
    op, frames = reads[0]
    assert op == "cpu" and "cuda_harness.py:gather_counts" in frames, reads
    assert not any(fr.startswith("region.py:") for _, fs in reads for fr in fs)
    assert record["backward_reads"] == []

    # Part 4: the rows each grouped GEMM receives, from its operands and offsets, against
    # the cost model's rows per instance of the plan: forward every routed pair, backward
    # exactly the retained rows.
    rows = InstanceRows.of_plan(plan)
    assert np.array_equal(np.flatnonzero(rows.rank == rank), local)
    routed, retained = rows.routed[local].tolist(), rows.retained[local].tolist()
    gemms = record["gemms"]
    # Backward: dH, dX, dW2, dW1, and with biases the two bias gradients' row sums.
    backward = 6 if case.bias else 4
    assert [g["phase"] for g in gemms] == ["forward"] * 2 + ["backward"] * backward
    for g in gemms:
        want = routed if g["phase"] == "forward" else retained
        assert g["offs_dtype"] == "int32"
        assert g["group_rows"] == want, g
        assert g["grouped_rows"] == sum(want), g
    # Every routed pair is computed once, on its instance's rank.
    assert int(rows.routed.sum()) == int(plan.counts.sum()) == sum(map(sum, record["counts"]))
    if math.isinf(case.gamma):
        assert retained == routed



def _swiglu_and_more(z: torch.Tensor) -> torch.Tensor:
    z_glu, z_linear = torch.chunk(z, 2, dim=-1)
    return torch.nn.functional.silu(z_glu) * z_linear + 0.5 * z_glu[:, :1]   # a broadcast


@pytest.mark.parametrize("activation", [_swiglu_and_more,
                                        lambda z: torch.nn.functional.gelu(z.chunk(2, -1)[0])],
                         ids=["swiglu-broadcast", "unused-chunk"])
def test_node_grad_matches_the_engine(activation):
    """The harness's stand-in for torch.autograd.grad (used on fake tensors, where the
    engine cannot run) gives the engine's gradient on real ones."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(7, 12, dtype=torch.float64, generator=g).requires_grad_(True)
    dh = torch.randn(activation(z).shape, dtype=torch.float64, generator=g)
    (want,) = torch.autograd.grad(activation(z), z, dh)
    (got,) = node_grad(activation(z), z, dh)
    torch.testing.assert_close(got, want)


def test_node_grad_frees_saved_tensors_as_the_engine_does():
    """The harness's autograd.grad frees what each node saved once it ran, so the memory
    levels (torch's MemTracker, as the at-size test measures them) are the engine's: the
    experts' activation recompute and its gradient, then a GEMM-sized output after it."""
    g = torch.Generator().manual_seed(0)
    z0 = torch.randn(256, 96, generator=g)
    dh = torch.randn(256, 48, generator=g)

    def levels(grad) -> tuple[int, int]:
        z = z0.clone().requires_grad_(True)
        mem = device_memory("cpu")
        with releasing_saved_tensors(), mem:
            mem.track_external(z, dh)
            base = mem.level()
            mem.phase = "backward"
            with torch.enable_grad():
                z_glu, z_linear = torch.chunk(z, 2, dim=-1)        # Qwen3's SwiGLU
                h = torch.nn.functional.silu(z_glu) * z_linear
            (dz,) = grad(h, z, dh)
            after = torch.empty(256, 128)
            mem.phase = ""
            assert dz.shape == z.shape and after.numel()
        return mem.level() - base, max(level for _, _, level in mem.timeline) - base

    engine = levels(torch.autograd.grad)
    assert levels(node_grad) == engine
    assert engine[0] == 4 * 256 * (48 + 96 + 128)      # h, dz and the output only


def _predicted_memory(case: Case, plan, rank: int, forward_retention: bool) -> tuple[float, float]:
    """(saved, peak) bytes of the region on ``rank`` by the cost model: grouped GEMMs, bf16,
    one layer, one micro-batch in flight, the plan's rows per instance (and two-stage's
    stored rows at the option's default rho); the replicas' weights and gradient buffers
    (they exist before the call) taken out of the peak."""
    two_stage = case.selection == "two-stage"
    shape = MoEShape(2048, 768, 128, 8, gated=True, dtype_bytes=2, tokens_per_rank=4096,
                     expert_parallel_size=case.ep, grouped_gemm=True,
                     forward_retention=forward_retention or two_stage, expert_bias=case.bias,
                     store_factor=option("moe_lrmoe_store_factor").default if two_stage
                     else None)
    # Memory needs no machine constants; these only satisfy the constructor.
    cost = CostModel(shape, MachineConstants(gemm_flops_per_s=1.0, alltoall_bytes_per_s=1.0))
    local = np.bincount(np.asarray(plan.instance_rank), minlength=plan.num_ranks)
    replicas = local - 128 // case.ep
    peak = cost.plan_memory(plan, replicas)[rank] - replicas[rank] * shape.instance_bytes
    saved, _ = cost.plan_levels(plan, replicas)
    return float(saved[rank]), float(peak)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_memory_at_size_against_the_cost_model(results, case):
    """Part 3: saved bytes and the forward+backward peak above the level before the
    forward, measured by torch's MemTracker on the fake device (harness docstring),
    against ``CostModel.plan_memory`` for the CUDA path: within 5%."""
    record = results[case.name]
    memory, rank = record["memory"], record["rank"]
    plan = _plan(case)
    saved, peak = _predicted_memory(case, plan, rank, record["forward_retention"])
    phases = {p: (round(b / MIB, 2), op) for p, (b, op) in memory["phase_peaks"].items()}
    detail = (f"{case.name} rank {rank}: saved measured {memory['saved'] / MIB:.2f} MiB, "
              f"predicted {saved / MIB:.2f}; peak measured {memory['peak'] / MIB:.2f} MiB, "
              f"predicted {peak / MIB:.2f}; phase peaks {phases}; "
              f"at backward {memory['at_backward'] / MIB:.2f}; rises {memory['rises']}")
    assert set(memory["phase_peaks"]) == {"forward", "backward"}, detail
    assert memory["peak"] == max(b for b, _ in memory["phase_peaks"].values()), detail
    assert 0 < memory["saved"] <= memory["at_backward"] <= memory["peak"], detail
    assert abs(saved / memory["saved"] - 1) <= MEMORY_TOLERANCE, detail
    assert abs(peak / memory["peak"] - 1) <= MEMORY_TOLERANCE, detail


# -----------------------------------------------------------------------------
# Part 5: the same cases on a real device (scripts/dev/region_at_scale_check.py)
# -----------------------------------------------------------------------------

SCALE_CHECK = ROOT / "scripts" / "dev" / "region_at_scale_check.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_region_at_scale_check_refuses_without_cuda():
    run = subprocess.run([sys.executable, str(SCALE_CHECK), "--ep", "8", "--tokens", "4096"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stdout + run.stderr
    assert "no CUDA device" in run.stderr


def test_region_at_scale_check_cpu_path_at_a_tiny_size():
    """The device script's code path on the CPU (``--device cpu``): every case's checks
    and the numerics comparison with the fp32 CPU reference, at a tiny width."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, str(SCALE_CHECK), "--device", "cpu", "--ep", "8", "--tokens", "64",
         "--check-tokens", "32", "--hidden", "64", "--ffn", "32", "--reps", "1",
         "--warmup", "0"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = [line for line in run.stdout.splitlines() if line.startswith("ep8-")]
    assert len(lines) == 13 and all(" ok " in line for line in lines), run.stdout
    assert sum("-bias " in line for line in lines) == 1, run.stdout
    assert "0 failing case(s)" in run.stdout


@pytest.mark.parametrize("case", [Case(8, 0.75, "uniform", True), Case(64, 1.0, "topk", False),
                                  Case(8, 0.75, "uniform", True, bias=True)],
                         ids=lambda c: c.name)
def test_real_device_mode_on_cpu_matches_the_plan(case):
    """``run_case_on_device`` (the device script's runner) on CPU tensors: rank r's share
    of the plan as a 1-rank region; its GEMMs get the plan's rows, ``check_device_record``
    passes, and a doctored record fails it."""
    from lrmoe_testing.cuda_harness import check_device_record, run_case_on_device

    rank = RANKS[case.ep]
    run = run_case_on_device(case, rank, "cpu", tokens=64, hidden=64, ffn=32)
    rows = InstanceRows.of_plan(run.plan)
    local = np.flatnonzero(rows.rank == rank)
    assert torch.equal(run.view.counts[0], torch.as_tensor(rows.routed[local]))
    assert torch.equal(run.view.quotas[0], torch.as_tensor(rows.retained[local]))
    record = run.record
    assert record["grouped_gemm"] is True
    assert check_device_record(record, run.plan) == []
    doctored = json.loads(json.dumps(record))
    doctored["gemms"][-1]["group_rows"][0] += 1
    doctored["sync_errors"]["backward"] = "an op synced"
    assert len(check_device_record(doctored, run.plan)) == 2
