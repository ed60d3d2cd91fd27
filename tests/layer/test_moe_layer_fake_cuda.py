"""The whole LRMoELayer at Qwen3-30B-A3B's MoE size on fake CUDA tensors.

Where tests/layer/test_region_fake_cuda.py calls the region directly, this builds the
layer as a training run does: Megatron's ``parallel_state`` over a fake EP group of 8
(this process is rank 3), Megatron's RNG tracker seeded by its own
``model_parallel_cuda_manual_seed``, the converted GPT spec (``to_lrmoe_spec``) with
device-side initialisation (``use_cpu_initialization=False``,
``perform_initialization=True``), bf16, grouped GEMMs, the all-to-all dispatcher and
Megatron's TopKRouter (softmax top-8 in fp32, aux loss) computing the routing in the
forward. Counts come from the trace (``TraceCountsExchange``: a fake all-gather has
none); the backward runs through the region's node below the layer's output. What had
to be set up or worked around, and why: the harness's section "The layer at size"
(workshop/lrmoe_testing/cuda_harness.py).

One subprocess for all cases (the fake process group and the modes never enter this
process). The checks judge its record against what this process derives on its own: the
plan, re-planned here from the same counts, and the cost model's rows per instance.
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

from lrmoe_testing.cuda_harness import Case, case_counts, case_planner
from megatron_lrmoe.planning.shapes import InstanceRows

ROOT = Path(__file__).resolve().parents[2]
RANK = 3
CASES = [*(Case(8, gamma, "uniform", replicas)
           for gamma in (math.inf, 0.75) for replicas in (False, True)),
         Case(8, 0.75, "topk", True)]
TIMEOUT_S = 180
T, H, F, E, K, HOMES = 4096, 2048, 768, 128, 8, 16
SEQ, BATCH = 2048, 2
SEED = 123                    # megatron_fake_cuda's seed


def _arg(case: Case) -> str:
    gamma = "inf" if math.isinf(case.gamma) else f"{case.gamma:g}"
    return f"{case.ep}:{gamma}:{case.selection}:{int(case.replicas)}"


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    started = time.perf_counter()
    run = subprocess.run(
        [sys.executable, "-m", "lrmoe_testing.cuda_harness", "layer", str(RANK),
         *(_arg(c) for c in CASES)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert run.returncode == 0, run.stderr[-6000:]
    records = json.loads(run.stdout)
    print(f"{len(records)} layer cases in {time.perf_counter() - started:.1f} s")
    return {r["case"]: r for r in records}


def _plan(case: Case):
    """The plan the region test plans for the case (no fake tensors, no layer)."""
    counts = case_counts(case)
    planner = case_planner(case, counts, counts.shape[1])
    planner.observe(counts)
    return planner.plan(counts).retention


# What Megatron's TopKRouter (moe_router_dtype fp32, softmax, top-k, aux loss) makes on the
# device for T tokens, as (dtype, shape): the input cast to fp32 and the weight cast and
# transposed (router_gating_linear), logits, scores and probabilities [T, E] in fp32 (also
# as [S, B, E]), the top-k values and indices [T, K], the routing map as int32 then bool
# [T, E], the per-expert counts and the aux loss's sums; bf16 only as the input's [T, H]
# view. Megatron's metrics tracker makes its [num_layers] values at its first record (the
# measured forward is the layer's first without replicas; TRACKER_MADE).
ROUTER_MADE = {
    ("bfloat16", (T, H)), ("float32", (T, H)), ("float32", (E, H)), ("float32", (H, E)),
    ("float32", (T, E)), ("float32", (SEQ, BATCH, E)), ("float32", (T, K)),
    ("int64", (T, K)), ("int32", (T, E)), ("bool", (T, E)), ("int64", (E,)),
    ("float32", (E,)), ("float32", ()),
}
TRACKER_MADE = {("float32", (1,))}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_layer_at_size_on_fake_cuda(results, case):
    record = results[case.name]
    assert (record["hidden"], record["ffn"], record["tokens"]) == (H, F, T)
    assert record["input"] == [[SEQ, BATCH, H], "bfloat16", "cuda"]

    # Megatron's set-up: the RNG tracker got Megatron's seeds for rank 3 (tp rank 0,
    # ep rank 3) and every expert weight was initialised under the expert-parallel state;
    # the router's weight is Megatron's host initialisation, moved to the device.
    assert record["rng_seeds"] == {"data-parallel-rng": SEED, "model-parallel-rng": SEED + 2718,
                                   "expert-parallel-rng": SEED + 1024 + 100 * RANK}
    assert record["rng_forks"] == ["expert-parallel-rng"] * (2 * HOMES)
    assert record["moved"] == ["router.weight"]
    params = record["parameters"]
    assert params.pop("router.weight") == [[E, H], "bfloat16", "cuda"]
    assert params == {
        **{f"experts.local_experts.{j}.linear_fc1.weight": [[2 * F, H], "bfloat16", "cuda"]
           for j in range(HOMES)},
        **{f"experts.local_experts.{j}.linear_fc2.weight": [[H, F], "bfloat16", "cuda"]
           for j in range(HOMES)}}

    # The layer planned what the region test plans from the same counts (with replicas:
    # one step observed, then the next placement), and exercises what the case names.
    plan = _plan(case)
    assert torch.equal(plan.counts, torch.tensor(record["plan_counts"]))
    assert torch.equal(plan.quotas, torch.tensor(record["plan_quotas"]))
    assert list(plan.instance_rank) == record["instance_rank"]
    local = [i for i, r in enumerate(plan.instance_rank) if r == RANK]
    assert record["home_instances"] == HOMES and record["local_instances"] == len(local)
    assert (len(local) > HOMES) == case.replicas
    if case.gamma < 1:
        assert int(plan.quotas[:, local].sum()) < int(plan.counts[:, local].sum())

    # Forward and backward completed: the layer's output is a view of the region's, whose
    # node returned every gradient on the device in the design's dtypes.
    assert record["region_chain"] == ["ViewBackward0"]
    assert record["grouped_gemm"] is True
    out = record["outputs"]
    pairs = int(plan.counts[RANK].sum())
    assert out["y"] == [[SEQ, BATCH, H], "bfloat16", "cuda"]
    assert out["dx"] == [[T, H], "bfloat16", "cuda"]
    assert out["dpair_prob"] == [[pairs], "float32", "cuda"]
    for j in range(HOMES):
        assert out[f"dw1[{j}]"] == [[2 * F, H], "bfloat16", "cuda"]
        assert out[f"dw2[{j}]"] == [[H, F], "bfloat16", "cuda"]
    assert record["aux_losses"] == {"load_balancing_loss": [[1], "float32", "cuda"]}

    # Every tensor the layer makes is on the device but these, on the host in forward: the
    # counts exchange's host copy of the [R, E] counts (its read, below) and pinned staging
    # copies (made, then copied into) of the region's plan tables and, with replicas, first
    # of the layer's instance-order tables ([2, instances], _instance_order). The router makes
    # exactly ROUTER_MADE (fp32 by --moe-router-dtype fp32); the rest of the forward and
    # the backward follow the region's dtype rule (docs/design.md): bf16 rows and weights,
    # fp32 only per row or per pair, int64 indices, int32 offsets and positions.
    made = record["made"]
    assert {m["phase"] for m in made} == {"router", "forward", "backward"}
    off_device = [m for m in made if m["device"] != "cuda"]
    assert all(m["phase"] == "forward" for m in off_device), off_device
    read_copy = [m for m in off_device if not m["pinned_staging"]]
    assert [(m["op"], m["dtype"], m["shape"]) for m in read_copy] == [
        ("_to_copy", "int64", [case.ep, E])], off_device
    staging = [(m["op"], m["dtype"]) for m in off_device if m["pinned_staging"]]
    assert staging == [("empty", "int64"), ("copy_", "int64")] * (1 + case.replicas), off_device
    if case.replicas:
        assert off_device[1]["shape"] == [2, len(plan.instance_rank)], off_device
    router = {(m["dtype"], tuple(m["shape"])) for m in made if m["phase"] == "router"}
    want = ROUTER_MADE | (set() if case.replicas else TRACKER_MADE)
    assert router == want, router ^ want
    assert all(m["op"] == "view" for m in made
               if m["phase"] == "router" and m["dtype"] == "bfloat16")
    assert {"mm", "_softmax", "topk", "scatter"} <= {m["op"] for m in made
                                                     if m["phase"] == "router"}
    # Replicas add one more fp32 kind (docs/design.md, "Placement": a replica's gradient
    # buffer is fp32 for 16-bit weights): views of the flat buffers per weight, their
    # accumulation and the homes' additions, and the [senders, 2FH + HF] received buffer.
    replica_fp32 = {(2 * F, H), (H, F)}
    for m in made:
        if m["phase"] != "router":
            assert m["dtype"] in ("bfloat16", "float32", "int64", "int32", "bool"), m
            if m["dtype"] == "float32" and len(m["shape"]) > 1:
                shape = tuple(m["shape"])
                assert case.replicas and (shape in replica_fp32 or (
                    m["phase"] == "backward" and shape[1:] == (3 * F * H,))), m

    # Host reads: the forward's one documented read (the counts exchange's .cpu(), inside
    # routed_output); Megatron's router reads nothing and ran no data-dependent op (a fake
    # tensor raises on one); the backward reads nothing.
    reads = record["forward_reads"]
    assert len(reads) == 1, reads
    op, frames = reads[0]
    assert op == "cpu" and frames[:2] == ["cuda_harness.py:gather_counts",
                                          "moe_layer.py:routed_output"], reads
    assert record["backward_reads"] == []

    # Each grouped GEMM got the plan's rows on this rank: routed in forward, retained in
    # backward (the cost model's rows per instance).
    rows = InstanceRows.of_plan(plan)
    assert np.array_equal(np.flatnonzero(rows.rank == RANK), local)
    routed, retained = rows.routed[local].tolist(), rows.retained[local].tolist()
    gemms = record["gemms"]
    assert [g["phase"] for g in gemms] == ["forward"] * 2 + ["backward"] * 4
    for g in gemms:
        want = routed if g["phase"] == "forward" else retained
        assert g["offs_dtype"] == "int32" and g["group_rows"] == want, g
        assert g["grouped_rows"] == sum(want), g
    if math.isinf(case.gamma):
        assert retained == routed
    else:
        assert sum(retained) < sum(routed)
