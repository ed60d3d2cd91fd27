"""The cost model's time terms beyond GEMM FLOPs and all-to-all bytes: GEMM
rate by rows, memory-bound row work, router, fixed per call, the planner's host time;
each against hand arithmetic from the constants (``layer_time``; docs/design.md, "Cost model"),
and the calibration tool's measurements of them."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_lrmoe.planning.cost_model import CostModel
from megatron_lrmoe.planning.machine import (
    MachineConstants,
    interpolated_time,
    measure_gemm_table,
    measure_memory_rate,
)
from megatron_lrmoe.planning.retention import plan_retention
from megatron_lrmoe.planning.shapes import InstanceRows, MoEShape
from tests.planning.test_layer_memory import _model

ROOT = Path(__file__).resolve().parents[2]

# H = 4, F = 2 gated (F1 = 4), E = 4, top-2, 2 bytes, T = 6 tokens (P = 12), EP = 2 (L = 2).
# Weights (F1 + F) H = 24 elements: 48 FLOP per routed pair forward, 96 backward.
SHAPE = MoEShape(hidden_size=4, ffn_hidden_size=2, num_experts=4, topk=2, gated=True,
                 dtype_bytes=2, tokens_per_rank=6, expert_parallel_size=2)
# One instance's GEMMs: forward 2 rows in 2 us, 8 rows in 4 us (48 FLOP per row at
# 48 and 96 MFLOP/s); backward 2 rows in 2 us, 8 rows in 6 us (96 FLOP per row).
MACHINE = MachineConstants(
    gemm_flops_per_s=1e9, alltoall_bytes_per_s=1e8, alltoall_latency_s=1e-5, source="test",
    gemm_rows=(2, 8), gemm_forward_flops_per_s=(48e6, 96e6),
    gemm_backward_flops_per_s=(96e6, 128e6), memory_bytes_per_s=1e9,
    layer_forward_fixed_s=1e-4, layer_backward_fixed_s=2e-4)
ROUTED = np.array([[5, 3], [1, 7]])       # source x destination: rows N = (6, 10)
RETAINED = np.array([[4, 2], [1, 5]])     # K = (5, 7); each source keeps 6


def test_interpolated_time_interpolates_and_extends():
    rows, rates, flops = (2.0, 8.0), (48e6, 96e6), 48.0
    got = interpolated_time(np.array([1.0, 2.0, 3.0, 5.0, 8.0, 10.0]), rows, rates, flops)
    # Inside: 2 us + (n - 2) / 3 us; below: the first segment extended; above: 8 rows'
    # 4 us + (n - 8) x 48 / 96e6 s.
    want = [2 - 1 / 3, 2, 2 + 1 / 3, 3, 4, 4 + 1]
    assert got == pytest.approx(np.array(want) * 1e-6, rel=1e-12)
    # A steep first segment is cut at 0 s below it.
    steep = interpolated_time(np.array([1.0]), (2.0, 8.0), (96e6, 48e6 * 8 / 13), 48.0)
    assert steep[0] == 0.0
    # One point: its rate throughout.
    assert interpolated_time(np.array([5.0]), (4.0,), (48e6,), 48.0)[0] == pytest.approx(
        5e-6)


def test_layer_time_parts_by_hand():
    p = CostModel(SHAPE, MACHINE).layer_time_parts(ROUTED, RETAINED, planner_s=5e-5)
    # GEMM: rank 1's 10 rows over L = 2 instances: 5 rows each, 2 + 3 / 3 = 3 us each.
    # Memory (elements x 2 B / 1e9): forward 28 N + 120 (N (4H + 6F) + 8 x 3H + T H) ->
    # rank 1 400 -> 0.8 us, the slowest rank (6.8 us against rank 0's 4.67 + 0.58).
    assert p["forward_gemm"] == pytest.approx(6e-6, rel=1e-12)
    assert p["forward_memory"] == pytest.approx(0.8e-6, rel=1e-12)
    # All-to-all: off-diagonal sent (3, 1), received (1, 3) -> 3 pairs x (2H + 1) x 2 B.
    assert p["forward_alltoall"] == pytest.approx(54 / 1e8, rel=1e-12)
    # Router: T (2HE / gemm + (H + 4E) b / memory) = 6 x (32 + 40) ns.
    assert p["forward_router"] == pytest.approx(6 * 72e-9, rel=1e-12)
    assert p["forward_fixed"] == pytest.approx(2e-5 + 1e-4, rel=1e-12)
    assert p["forward_planner"] == 5e-5
    # Backward GEMM: rank 1's 7 rows, 3.5 per instance: 2 + 1.5 x 2 / 3 = 3 us each.
    # Memory: 68 K + 184 (K (4H + 18F) + 16 K gathered, both ranks drop, + 8 x 2H +
    # 6 kept x 4H + T H) -> rank 1 660 -> 1.32 us.
    assert p["backward_gemm"] == pytest.approx(6e-6, rel=1e-12)
    assert p["backward_memory"] == pytest.approx(1.32e-6, rel=1e-12)
    assert p["backward_alltoall"] == pytest.approx(2 * 20 / 1e8, rel=1e-12)
    assert p["backward_router"] == pytest.approx(6 * (64 + 48) * 1e-9, rel=1e-12)
    assert p["backward_fixed"] == pytest.approx(2e-5 + 2e-4, rel=1e-12)
    fwd, bwd = CostModel(SHAPE, MACHINE).layer_time(ROUTED, RETAINED, planner_s=5e-5)
    assert fwd == pytest.approx(sum(v for k, v in p.items() if k.startswith("forward_")))
    assert bwd == pytest.approx(sum(v for k, v in p.items() if k.startswith("backward_")))


def test_gather_is_priced_in_the_phase_where_it_runs():
    # Retention drawn in forward compacts x and z of the retained rows there (16 K
    # elements where the rank drops), not in backward: rank 1 forward 400 + 16 x 7 = 512
    # elements, backward 660 - 16 x 7 = 548 (test_layer_time_parts_by_hand); rank 1 stays
    # the slowest in both phases (rank 0: 4.67 + 0.74 and 4.67 + 0.89 us).
    shape = dataclasses.replace(SHAPE, forward_retention=True)
    p = CostModel(shape, MACHINE).layer_time_parts(ROUTED, RETAINED)
    assert p["forward_memory"] == pytest.approx(512 * 2 / 1e9, rel=1e-12)
    assert p["backward_memory"] == pytest.approx(548 * 2 / 1e9, rel=1e-12)
    # A rank that keeps every row gathers nothing, in either phase.
    kept_all = CostModel(shape, MACHINE).layer_time_parts(ROUTED, ROUTED)
    assert kept_all["forward_memory"] == pytest.approx(400 * 2 / 1e9, rel=1e-12)


def test_load_time_by_hand():
    # The busiest rank receives 10 and keeps 7; every source sends P = 12, keeps 7.
    got = CostModel(SHAPE, MACHINE).load_time(10, 7, 3, 2, num_ranks=2)
    fwd = 6e-6 + (28 * 10 + 12 * 12 + 24) * 2 / 1e9 + 54 / 1e8 + 6 * 72e-9 + 1.2e-4
    bwd = 6e-6 + (68 * 7 + 12 * 8 + 7 * 16 + 24) * 2 / 1e9 + 40 / 1e8 + 6 * 112e-9 + 2.2e-4
    assert got == pytest.approx(fwd + bwd, rel=1e-12)
    # Many estimates at once: each element the by-hand figure of its own loads (the
    # second keeps every row it receives, so the source keeps its 12 as well).
    both = CostModel(SHAPE, MACHINE).load_times(np.array([10.0, 10.0]), np.array([7.0, 10.0]),
                                                np.array([3.0, 3.0]), np.array([2.0, 0.0]),
                                                num_ranks=2)
    assert both[0] == pytest.approx(fwd + bwd, rel=1e-12)
    assert both[1] == CostModel(SHAPE, MACHINE).load_time(10, 10, 3, 0, num_ranks=2)
    assert both[1] > both[0]



def test_gemms_instance_by_instance_by_hand():
    # Rank 0's instances compute 6 and 0 rows (retain 5 and 0), rank 1's 1 and 9 (retain
    # 0 and 7): the column sums of ROUTED and RETAINED. Forward t(n) = 2 + (n - 2) / 3 us
    # (below 2 rows the first segment extended), above 8 rows 4 us + (n - 8) / 2 us.
    # Backward t(n) = 2 + (n - 2) 2 / 3 us. An instance without rows costs nothing.
    instances = InstanceRows(rank=np.array([0, 0, 1, 1]), routed=np.array([6, 0, 1, 9]),
                             retained=np.array([5, 0, 0, 7]))
    cost = CostModel(SHAPE, MACHINE)
    p = cost.layer_time_parts(ROUTED, RETAINED, 5e-5, instances)
    # Rank 1 is the slowest in both phases (rank 0: 10/3 us and 4 us of GEMMs, fewer
    # rows of memory work): forward 5/3 + 9/2 us, backward 16/3 us.
    assert p["forward_gemm"] == pytest.approx((5 / 3 + 9 / 2) * 1e-6, rel=1e-12)
    assert p["backward_gemm"] == pytest.approx(16 / 3 * 1e-6, rel=1e-12)
    # Spread evenly (no instances): 2 t(5) = 6 us forward, 2 t(3.5) = 6 us backward.
    even = cost.layer_time_parts(ROUTED, RETAINED, 5e-5)
    assert even["forward_gemm"] == pytest.approx(6e-6, rel=1e-12)
    assert even["backward_gemm"] == pytest.approx(6e-6, rel=1e-12)
    assert {k: v for k, v in p.items() if "gemm" not in k} == {
        k: v for k, v in even.items() if "gemm" not in k}
    # Rank 0 instance by instance: 6 rows (10/3 us) and an empty one, against 2 t(3)
    # = 14/3 us spread evenly; backward t(5) = 4 us against 2 t(2.5) = 14/3 us.
    fwd, bwd = cost.instance_gemm_times(instances, 2)
    assert fwd == pytest.approx(np.array([10 / 3, 5 / 3 + 9 / 2]) * 1e-6, rel=1e-12)
    assert bwd == pytest.approx(np.array([4, 16 / 3]) * 1e-6, rel=1e-12)
    # Read off a plan: its instances' hosts and column sums.
    plan = plan_retention(torch.tensor([[5, 0, 1, 2], [1, 0, 0, 7]]), 2, 0.75)
    got = InstanceRows.of_plan(plan)
    assert got.rank.tolist() == [0, 0, 1, 1]
    assert got.routed.tolist() == [6, 0, 1, 9]
    assert got.retained.tolist() == plan.quotas.sum(0).tolist()


def test_alltoall_size_table_by_hand():
    # Sizes 16 and 64 B at 1e8 and 2e8 B/s: 0.16 and 0.32 us, between them 0.16 us +
    # (b - 16) / 300 us. Forward: 3 pairs of dispatch (H b = 8 B) and combine (10 B):
    # 24 and 30 B. Backward: 2 pairs of gradient rows with a position (12 B) and dX
    # rows (8 B): 24 and 16 B.
    table = MachineConstants(**{**MACHINE.__dict__, "alltoall_sizes": (16, 64),
                                "alltoall_size_bytes_per_s": (1e8, 2e8)})
    p = CostModel(SHAPE, table).layer_time_parts(ROUTED, RETAINED)
    t = lambda b: (0.16 + (b - 16) / 300) * 1e-6  # noqa: E731
    assert p["forward_alltoall"] == pytest.approx(t(24) + t(30), rel=1e-12)
    assert p["backward_alltoall"] == pytest.approx(t(24) + t(16), rel=1e-12)
    assert CostModel(SHAPE, table).load_time(10, 7, 3, 2, num_ranks=2) == pytest.approx(
        CostModel(SHAPE, MACHINE).load_time(10, 7, 3, 2, num_ranks=2)
        - (54 + 40) / 1e8 + t(24) + t(30) + t(24) + t(16), rel=1e-12)
    # Replicas: one instance's weights and gradient, 24 elements x 2 B each.
    cost = CostModel(SHAPE, table)
    assert cost.replica_sync_time(((0, 1),), 2, 2) == pytest.approx(2 * t(48) + 2e-5)
    # A table of one point is the flat rate.
    flat = MachineConstants(**{**MACHINE.__dict__, "alltoall_sizes": (100,),
                               "alltoall_size_bytes_per_s": (1e8,)})
    assert CostModel(SHAPE, flat).layer_time_parts(ROUTED, RETAINED) == pytest.approx(
        CostModel(SHAPE, MACHINE).layer_time_parts(ROUTED, RETAINED), rel=1e-12)


def test_megatrons_layer_skips_the_activation_recompute_passes():
    # Megatron's expert MLP saved the activation's output: 5F fewer element passes per
    # retained row in backward (gated), nothing else changes (MACHINE has no Megatron
    # fixed cost: it pays the LRMoE layer's). Rank 1 keeps 7 rows, rank 0 5; with both
    # ranks' GEMMs alike per row, rank 1 stays the slowest.
    saved = dataclasses.replace(SHAPE, megatron_layer=True)
    p = CostModel(SHAPE, MACHINE).layer_time_parts(ROUTED, RETAINED)
    q = CostModel(saved, MACHINE).layer_time_parts(ROUTED, RETAINED)
    assert q["backward_memory"] == pytest.approx(p["backward_memory"] - 7 * 5 * 2 * 2 / 1e9,
                                                 rel=1e-12)
    assert {k: v for k, v in q.items() if k != "backward_memory"} == pytest.approx(
        {k: v for k, v in p.items() if k != "backward_memory"}, rel=1e-12)
    plain = dataclasses.replace(SHAPE, gated=False)
    p = CostModel(plain, MACHINE).layer_time_parts(ROUTED, RETAINED)
    q = CostModel(dataclasses.replace(plain, megatron_layer=True),
                  MACHINE).layer_time_parts(ROUTED, RETAINED)
    assert q["backward_memory"] == pytest.approx(p["backward_memory"] - 7 * 2 * 2 * 2 / 1e9,
                                                 rel=1e-12)


def test_megatrons_layer_pays_its_own_fixed_cost_where_measured():
    machine = dataclasses.replace(MACHINE, megatron_forward_fixed_s=3e-3,
                                  megatron_backward_fixed_s=5e-3)
    latencies = 2 * MACHINE.alltoall_latency_s
    megatron = dataclasses.replace(SHAPE, megatron_layer=True)
    p = CostModel(megatron, machine).layer_time_parts(ROUTED, RETAINED)
    assert (p["forward_fixed"], p["backward_fixed"]) == pytest.approx(
        (latencies + 3e-3, latencies + 5e-3), rel=1e-12)
    # The LRMoE layer keeps its own; load_time adds the same terms as layer_time_parts.
    q = CostModel(SHAPE, machine).layer_time_parts(ROUTED, RETAINED)
    assert (q["forward_fixed"], q["backward_fixed"]) == pytest.approx(
        (latencies + 1e-4, latencies + 2e-4), rel=1e-12)
    base = CostModel(megatron, MACHINE)
    assert CostModel(megatron, machine).load_time(10, 7, 4, 3) == pytest.approx(
        base.load_time(10, 7, 4, 3) + (3e-3 - 1e-4) + (5e-3 - 2e-4), rel=1e-12)


def test_one_rank_has_no_reorders_and_no_tables_means_the_flat_rate():
    machine = MachineConstants(gemm_flops_per_s=48e6, alltoall_bytes_per_s=1e8,
                               memory_bytes_per_s=1e9)
    shape = MoEShape(hidden_size=4, ffn_hidden_size=2, num_experts=4, topk=2, gated=True,
                     dtype_bytes=2, tokens_per_rank=6, expert_parallel_size=1)
    p = CostModel(shape, machine).layer_time_parts(np.array([[12]]), np.array([[12]]))
    assert p["forward_gemm"] == pytest.approx(12 * 48 / 48e6, rel=1e-12)
    # 12 x 6F + 12 x 3H + T H = 144 + 144 + 24 elements, no reorder at R = 1.
    assert p["forward_memory"] == pytest.approx(312 * 2 / 1e9, rel=1e-12)
    assert p["forward_fixed"] == 0.0 and p["backward_fixed"] == 0.0


def test_old_constants_price_only_the_old_terms():
    machine = MachineConstants(gemm_flops_per_s=1e9, alltoall_bytes_per_s=1e8,
                               alltoall_latency_s=1e-5)
    p = CostModel(SHAPE, machine).layer_time_parts(ROUTED, RETAINED, planner_s=0.0)
    for name in ("memory", "router"):
        assert p[f"forward_{name}"] == 0.0 and p[f"backward_{name}"] == 0.0
    assert p["forward_gemm"] == pytest.approx(10 * 48 / 1e9, rel=1e-12)
    assert p["backward_gemm"] == pytest.approx(7 * 96 / 1e9, rel=1e-12)
    assert p["forward_fixed"] == p["backward_fixed"] == pytest.approx(2e-5)


def test_machine_constants_new_fields_load_and_check(tmp_path):
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"gemm_flops_per_s": 1e9, "alltoall_bytes_per_s": 1e8,
                               "alltoall_latency_s": 1e-5, "source": "old"}))
    loaded = MachineConstants.from_json(old)
    assert loaded.gemm_rows == () and loaded.memory_bytes_per_s == 0.0
    assert loaded.layer_forward_fixed_s == loaded.layer_backward_fixed_s == 0.0
    assert loaded.megatron_forward_fixed_s is loaded.megatron_backward_fixed_s is None
    path = tmp_path / "new.json"
    MACHINE.to_json(path)
    assert MachineConstants.from_json(path) == MACHINE       # lists back to tuples
    measured = dataclasses.replace(MACHINE, megatron_forward_fixed_s=0.02,
                                   megatron_backward_fixed_s=0.0)
    measured.to_json(path)
    assert MachineConstants.from_json(path) == measured
    for bad, needle in ((dict(gemm_rows=(2,)), "same length"),
                        (dict(gemm_rows=(8, 2)), "ascending"),
                        (dict(gemm_forward_flops_per_s=(0.0, 1.0)), "positive"),
                        (dict(memory_bytes_per_s=-1.0), "memory_bytes_per_s"),
                        (dict(layer_backward_fixed_s=float("nan")), "layer_backward"),
                        (dict(megatron_forward_fixed_s=1e-3), "must both be set or both be None"),
                        (dict(megatron_forward_fixed_s=-1.0, megatron_backward_fixed_s=0.0),
                         "megatron_forward_fixed_s must be None or a finite"),
                        (dict(alltoall_sizes=(1.0,)), "same length"),
                        (dict(alltoall_sizes=(4.0, 2.0), alltoall_size_bytes_per_s=(1.0, 1.0)),
                         "alltoall_sizes must be strictly ascending")):
        fields = dict(gemm_flops_per_s=1.0, alltoall_bytes_per_s=1.0, gemm_rows=(2, 8),
                      gemm_forward_flops_per_s=(1.0, 1.0),
                      gemm_backward_flops_per_s=(1.0, 1.0)) | bad
        with pytest.raises(ValueError, match=needle):
            MachineConstants(**fields)


def test_measurements_return_rates():
    fwd, bwd = measure_gemm_table(8, 4, [2, 4], experts=2, repeats=1, warmup=0)
    assert len(fwd) == len(bwd) == 2 and min(fwd + bwd) > 0
    assert measure_memory_rate(8, 4, 16, repeats=1, warmup=0) > 0
    assert measure_memory_rate(8, 4, 16, gated=False, repeats=1, warmup=0) > 0


def test_calibrate_cli_writes_the_new_constants(tmp_path):
    out = tmp_path / "cal.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    result = subprocess.run(
        [sys.executable, "-m", "megatron_lrmoe.tools.calibrate", "--output", str(out),
         "--hidden-size", "32", "--ffn-hidden-size", "16", "--rows", "32",
         "--local-experts", "1", "--repeats", "2", "--warmup", "0", "--gemm-rows", "4,8",
         "--tokens", "8", "--topk", "2", "--alltoall", "copy", "--alltoall-mib", "0.25"],
        capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    constants = MachineConstants.from_json(out)
    assert constants.gemm_rows == (4.0, 8.0)
    assert len(constants.gemm_backward_flops_per_s) == 2
    assert constants.memory_bytes_per_s > 0
    # The layer's fixed cost is measured only beside a gloo all-to-all: not with a copy.
    assert constants.layer_forward_fixed_s == 0.0 and "not measured" in constants.source
    assert "memory rate" in result.stdout
    assert constants.gemm_flops_per_s > 0 and constants.alltoall_bytes_per_s > 0
    assert "memory copy" in constants.source
    assert json.loads(out.read_text())["details"]["hidden_size"] == 32
    assert "expert GEMM rate" in result.stdout


def test_calibrate_concurrency_measures_rates_with_the_machine_shared(tmp_path):
    out = tmp_path / "cal.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    common = [sys.executable, "-m", "megatron_lrmoe.tools.calibrate", "--output", str(out),
              "--hidden-size", "32", "--ffn-hidden-size", "16", "--rows", "32",
              "--local-experts", "1", "--repeats", "2", "--warmup", "0", "--gemm-rows", "4,8",
              "--tokens", "8", "--topk", "2", "--alltoall", "copy", "--alltoall-mib", "0.25"]
    result = subprocess.run(common + ["--concurrency", "2", "--rounds", "2"],
                            capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    constants = MachineConstants.from_json(out)
    assert "slowest of 2 local processes" in constants.source
    assert "median of 2 rounds" in constants.source
    assert len(constants.gemm_forward_flops_per_s) == len(constants.gemm_backward_flops_per_s) == 2
    assert min(constants.gemm_forward_flops_per_s) > 0 and constants.memory_bytes_per_s > 0
    assert constants.gemm_flops_per_s > 0
    assert json.loads(out.read_text())["details"]["concurrency"] == 2
    bad = subprocess.run(common + ["--concurrency", "0"], capture_output=True, text=True,
                         env=env, timeout=120, cwd=ROOT)
    assert bad.returncode != 0 and "--concurrency 0" in bad.stderr
    bad = subprocess.run(common + ["--rounds", "0"], capture_output=True, text=True,
                         env=env, timeout=120, cwd=ROOT)
    assert bad.returncode != 0 and "--rounds 0" in bad.stderr


def test_median_over_rounds_is_per_figure():
    from megatron_lrmoe.tools.calibrate import _median_over_rounds

    rounds = [[1.0, 9.0, 5.0], [3.0, 1.0, 4.0], [2.0, 5.0, 100.0]]
    assert _median_over_rounds(rounds) == [2.0, 5.0, 5.0]


def test_local_alltoall_measures_the_size_table():
    from megatron_lrmoe.tools.calibrate import _local_alltoall

    bandwidth, latency, table = _local_alltoall(2**16, repeats=2, warmup=0,
                                                table_bytes=(4096, 2**16))
    assert bandwidth > 0 and latency >= 0
    assert len(table) == 2 and min(table) > 0


def test_calibrate_refuses_a_size_table_without_an_alltoall(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    base = [sys.executable, "-m", "megatron_lrmoe.tools.calibrate", "--output",
            str(tmp_path / "cal.json"), "--hidden-size", "32", "--ffn-hidden-size", "16",
            "--rows", "32", "--local-experts", "1", "--repeats", "1", "--warmup", "0",
            "--gemm-rows", "", "--tokens", "8", "--topk", "2", "--alltoall", "copy"]
    for sizes, needle in (("0.25,1", "needs an all-to-all"), ("1,0.25", "strictly ascending"),
                          ("one", "expected comma-separated MiB")):
        bad = subprocess.run(base + ["--alltoall-sizes-mib", sizes], capture_output=True,
                             text=True, env=env, timeout=120, cwd=ROOT)
        assert bad.returncode != 0 and "--alltoall-sizes-mib" in bad.stderr
        assert needle in bad.stderr
    assert not (tmp_path / "cal.json").exists()


def test_the_fixed_cost_of_a_call_is_measured_for_both_layers():
    # Two local gloo ranks per layer at the tiny shape: each layer's call takes time in
    # both phases (latency 0: nothing subtracted but the LRMoE planner's own time).
    from megatron_lrmoe.tools.calibrate import measure_layer_fixed

    for layer in ("lrmoe", "megatron"):
        forward, backward = measure_layer_fixed(4, 2, True, 0.0, repeats=5, warmup=2,
                                                layer=layer)
        assert forward > 0 and backward > 0, layer
    with pytest.raises(ValueError, match="layer must be 'lrmoe' or 'megatron'"):
        measure_layer_fixed(4, 2, True, 0.0, repeats=5, warmup=2, layer="sequential")


@pytest.mark.parametrize("machine", [
    MACHINE,
    dataclasses.replace(MACHINE, alltoall_sizes=(16.0, 256.0),
                        alltoall_size_bytes_per_s=(1e7, 1e8)),
    MachineConstants(gemm_flops_per_s=1e9, alltoall_bytes_per_s=1e9, alltoall_latency_s=1e-6,
                     source="flat rates"),
], ids=["rate tables", "size table", "flat rates"])
@pytest.mark.parametrize("num_ranks", [1, 2, 3, 8])
def test_layer_times_equal_layer_time_bit_for_bit(machine, num_ranks):
    """``layer_times`` of K plans' ``rank_loads`` is ``layer_time`` of each (forward and
    backward to the bit), on random routed matrices with drops, empty ranks and ties."""
    shape = dataclasses.replace(SHAPE, num_experts=4 * num_ranks,
                                expert_parallel_size=num_ranks)
    cost = CostModel(shape, machine)
    gen = np.random.default_rng(num_ranks)
    routed = gen.integers(0, 40, (12, num_ranks, num_ranks))
    routed[1] = 0                                          # nothing routed
    routed[2, :, -1] = 0                                   # an idle rank
    routed[3] = 7                                          # every rank tied
    retained = np.minimum(routed, gen.integers(0, 40, routed.shape))
    retained[4] = routed[4]                                # nothing dropped
    loads = np.stack([CostModel.rank_loads(a, b) for a, b in zip(routed, retained,
                                                                     strict=True)])
    assert loads[0].tolist() == [routed[0].sum(0).tolist(), retained[0].sum(0).tolist(),
                                 routed[0].sum(1).tolist(), retained[0].sum(1).tolist(),
                                 routed[0].diagonal().tolist(),
                                 retained[0].diagonal().tolist()]
    fwd, bwd = cost.layer_times(loads)
    for k in range(len(routed)):
        assert (fwd[k], bwd[k]) == cost.layer_time(routed[k], retained[k])
    with pytest.raises(ValueError, match=r"\[K, 6, R\]"):
        cost.layer_times(loads[0])
    # GEMMs instance by instance: every plan's instances in one instance_gemm_times call
    # (ranks offset by plan) give layer_time with its instances, to the bit.
    instances = []
    for _ in range(len(routed)):
        rank = np.sort(gen.integers(0, num_ranks, 3 * num_ranks))
        rows = gen.integers(0, 60, len(rank))
        instances.append(InstanceRows(rank, rows,
                                      np.minimum(rows, gen.integers(0, 60, len(rank)))))
    gemm = cost.instance_gemm_times(InstanceRows(
        np.concatenate([i.rank + k * num_ranks for k, i in enumerate(instances)]),
        np.concatenate([i.routed for i in instances]),
        np.concatenate([i.retained for i in instances])), len(routed) * num_ranks)
    fwd, bwd = cost.layer_times(loads, tuple(g.reshape(len(routed), num_ranks) for g in gemm))
    for k in range(len(routed)):
        assert (fwd[k], bwd[k]) == cost.layer_time(routed[k], retained[k], 0.0, instances[k])


MATRIX_ROUTED = [[5, 2, 1], [0, 4, 6], [3, 0, 7]]     # source rank x destination rank
MATRIX_RETAINED = [[4, 1, 1], [0, 3, 2], [2, 0, 5]]


def test_layer_time_by_hand():
    cost = _model()
    # Per pair: weights (F1 + F) H = 64 elements, forward 2 * 64 = 128 FLOP, backward 256;
    # all-to-all forward (2H + 1) b = 34 bytes, backward 2 H b + 4 = 36 bytes.
    # Routed: columns (8, 6, 14) -> 14; off-diagonal sent (3, 6, 3), received (3, 2, 7) -> 7.
    # Retained: columns (6, 4, 8) -> 8; sent (2, 2, 2), received (2, 1, 3) -> 3.
    fwd, bwd = cost.layer_time(np.array(MATRIX_ROUTED), np.array(MATRIX_RETAINED))
    latency = Fraction(2, 10**5)                       # 2 * 1e-5
    want_fwd = Fraction(14 * 128, 2 * 10**9) + Fraction(7 * 34, 10**8) + latency
    want_bwd = Fraction(8 * 256, 2 * 10**9) + Fraction(3 * 36, 10**8) + latency
    assert math.isclose(fwd, want_fwd, rel_tol=1e-14)
    assert math.isclose(bwd, want_bwd, rel_tol=1e-14)
    # load_time from the same maxima is their sum.
    assert math.isclose(cost.load_time(14, 8, 7, 3), want_fwd + want_bwd, rel_tol=1e-14)
    # One rank: nothing crosses a link.
    one = cost.layer_time(np.array([[9]]), np.array([[4]]))
    assert math.isclose(one[0], Fraction(9 * 128, 2 * 10**9) + latency, rel_tol=1e-14)
    assert math.isclose(one[1], Fraction(4 * 256, 2 * 10**9) + latency, rel_tol=1e-14)
    # Dropping lowers the backward estimate, never the forward (a plan's matrices).
    counts = torch.tensor([[6, 0, 2, 2], [4, 0, 0, 6]])
    cut, full = plan_retention(counts, 2, 0.5), plan_retention(counts, 2, math.inf)
    t_cut = cost.layer_time(cut.routed_matrix.numpy(), cut.retained_matrix.numpy())
    t_full = cost.layer_time(full.routed_matrix.numpy(), full.retained_matrix.numpy())
    assert t_cut[0] == t_full[0] and t_cut[1] < t_full[1]


def test_replica_sync_time_by_hand():
    cost = _model()
    assert cost.replica_sync_time((), 2, 2) == 0.0
    # Experts 0, 1 (home rank 0) to rank 1 and expert 2 (home rank 1) to rank 0: rank 0
    # sends 2 and receives 1, rank 1 sends 1 and receives 2 -> busiest 2. Per replica:
    # weights 64 * 2 bytes + gradient 64 * 2 bytes = 256 bytes.
    got = cost.replica_sync_time(((0, 1), (1, 1), (2, 0)), 2, 2)
    assert math.isclose(got, Fraction(2 * 256, 10**8) + Fraction(2, 10**5), rel_tol=1e-14)
