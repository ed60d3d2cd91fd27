"""Tests of the planner's cost model (docs/design.md, "Cost model") and the calibration tool."""

from __future__ import annotations

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

from megatron_lrmoe.lrmoe.cost_model import CostModel, MachineConstants, MoEShape
from megatron_lrmoe.lrmoe.machine import default_machine_constants
from megatron_lrmoe.lrmoe.retention import plan_retention

ROOT = Path(__file__).resolve().parents[1]
MACHINE = MachineConstants(gemm_flops_per_s=2e9, alltoall_bytes_per_s=1e8,
                           alltoall_latency_s=1e-5, source="test")


def test_shape_numbers_match_the_design_reference():
    # docs/design.md, "Reference shapes": Qwen3-30B-A3B per pair (bf16): 9.4 MFLOP forward, 18.9
    # backward, 4 KiB per all-to-all direction.
    qwen = MoEShape(2048, 768, 128, 8, gated=True, dtype_bytes=2, tokens_per_rank=4096)
    assert qwen.forward_flops_per_pair == 2 * 2048 * (1536 + 768) == 9_437_184
    assert qwen.backward_flops_per_pair == 2 * qwen.forward_flops_per_pair
    assert qwen.hidden_size * qwen.dtype_bytes == 4096
    assert qwen.instance_bytes == 2 * (1536 + 768) * 2048 * 2     # weights + grad buffer
    fp32_grads = MoEShape(2048, 768, 128, 8, True, 2, 4096, grad_dtype_bytes=4)
    assert fp32_grads.instance_bytes == (1536 + 768) * 2048 * (2 + 4)
    glm = MoEShape(4096, 1408, 128, 8, True, 2, 4096)
    assert round(glm.forward_flops_per_pair / 1e6, 1) == 34.6


def _model(layers: int = 3, in_flight: int = 2) -> CostModel:
    shape = MoEShape(hidden_size=8, ffn_hidden_size=4, num_experts=4, topk=2, gated=False,
                     dtype_bytes=2, tokens_per_rank=10, num_layers=layers,
                     microbatches_in_flight=in_flight)
    return CostModel(shape, MACHINE)


# Hand-computed constants of _model() (H=8, F=F1=4, b=2, P=10*2=20, Lyr=3, MiF=2):
#   instance   (F1 + F) * H * (b + b)                 = 8 * 8 * 4           = 256
#   fixed      MiF * P * (H b + 16) + P * 3 H b / Lyr = 2*20*32 + 20*48/3   = 1600
#   saved      MiF * (H + F1) * b                     = 2 * 12 * 2          = 48 per routed
#   fwd_t      (4H + F1) * b                          = 36 * 2              = 72 per routed
#   bwd_t      (4H + 2 F1 + 2F) * b                   = 48 * 2              = 96 per retained
def _hand_memory(replicas: int, routed: int, retained: int, layers: int = 3) -> Fraction:
    """Bytes of one layer on one rank by the documented formula, exactly."""
    fixed = 2 * 20 * 32 + Fraction(20 * 48, layers)
    return (256 * replicas + fixed + 48 * routed
            + Fraction(max(72 * routed, 96 * retained), layers))


def test_rank_memory_by_hand():
    cost = _model()
    memory = cost.rank_memory(np.array([1, 0]), np.array([30, 10]), np.array([5, 10]))
    # rank 0: 256 + 1600 + 48*30 + max(72*30, 96*5)/3 = 256 + 1600 + 1440 + 720
    # rank 1:   0 + 1600 + 48*10 + max(72*10, 96*10)/3 =       1600 +  480 + 320
    assert memory.dtype == np.float64
    assert memory.tolist() == [4016.0, 2400.0]
    assert [_hand_memory(1, 30, 5), _hand_memory(0, 10, 10)] == [4016, 2400]
    # Balanced dropless: routed = retained = P = 20, no replicas, times Lyr = 3 layers.
    # 1600 + 48*20 + max(72*20, 96*20)/3 = 1600 + 960 + 640 = 3200 per layer.
    assert cost.balanced_dropless_need() == 3 * 3200.0
    # Non-integer thirds (Lyr = 5): against the exact value.
    five = _model(layers=5)
    got = five.rank_memory(np.array([2]), np.array([7]), np.array([11]))[0]
    assert math.isclose(got, _hand_memory(2, 7, 11, layers=5), rel_tol=1e-15)
    plan = plan_retention(torch.tensor([[6, 0, 2, 2], [4, 0, 0, 6]]), 2, 0.5)
    # plan_memory reads the plan's loads: routed (10, 10), retained (5, 5).
    assert plan.routed_per_rank.tolist() == [10, 10]
    assert plan.retained_per_rank.tolist() == [5, 5]
    assert cost.plan_memory(plan, np.array([0, 1])).tolist() == [
        float(_hand_memory(0, 10, 5)), float(_hand_memory(1, 10, 5))]


def _largest(fits) -> int:
    """The largest n >= 0 with fits(n) (0 if none), by scanning: fits is monotone."""
    n = 0
    while fits(n + 1):
        n += 1
    return n


# share = 8850: room after the fixed bytes 7250 (no replica) and 6738 (two replicas).
# The third share puts rank 0's forward at exactly the share: 1600 + 72 * 100 = 8800.
@pytest.mark.parametrize("share", [8850, 8849.5, 8800, 1600, 2000])
def test_capacity_and_retained_limit_against_brute_force(share):
    cost = _model()
    assert cost.memory_share(3 * share) == share
    reps = np.array([0, 2])
    cap = cost.routing_capacity(share, reps)
    assert cap.dtype == np.int64
    # Most routed pairs whose forward fits with nothing retained (0 when even 0 does not).
    assert cap.tolist() == [_largest(lambda n, r=r: _hand_memory(r, n, 0) <= share)
                            for r in reps.tolist()]
    for routed in ([100, 10], [110, 0], [93, 93], [0, 0]):
        limit = cost.retained_limit(share, reps, np.array(routed))
        expected = []
        for r, n in zip(reps.tolist(), routed, strict=True):
            fwd_fits = _hand_memory(r, n, 0) <= share
            expected.append(_largest(lambda k, r=r, n=n: _hand_memory(r, n, k) <= share)
                            if fwd_fits else 0)
        assert limit.tolist() == expected, (routed, share)
    if share == 8850:       # the numbers by hand
        assert cap.tolist() == [100, 93]       # 7250 // 72, 6738 // 72
        # rank 0: room 8850 - 1600 - 48*100 = 2450, 2450 * 3 // 96 = 76
        # rank 1: room 8850 - 2112 - 48*10 = 6258, 6258 * 3 // 96 = 195
        assert cost.retained_limit(share, reps, np.array([100, 10])).tolist() == [76, 195]


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


def test_machine_constants_json_round_trip(tmp_path):
    path = tmp_path / "cal.json"
    MACHINE.to_json(path, details={"note": "x"})
    assert MachineConstants.from_json(path) == MACHINE
    assert [p.name for p in tmp_path.iterdir()] == ["cal.json"]     # no temporary left


@pytest.mark.parametrize("content, needle", [
    ("{not json", "not valid JSON"),
    ('{"alltoall_bytes_per_s": 1.0}', "gemm_flops_per_s"),
    ('{"gemm_flops_per_s": -1, "alltoall_bytes_per_s": 1.0}', "gemm_flops_per_s"),
    ('{"gemm_flops_per_s": 1, "alltoall_bytes_per_s": "fast"}', "alltoall_bytes_per_s"),
    ('{"gemm_flops_per_s": 1, "alltoall_bytes_per_s": 1, "alltoall_latency": 0}',
     "alltoall_latency"),
    ("[1, 2]", "JSON object"),
])
def test_bad_calibration_file_names_file_and_key(tmp_path, content, needle):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=needle) as info:
        MachineConstants.from_json(path)
    assert str(path) in str(info.value)


def test_calibrate_cli_writes_readable_json(tmp_path):
    out = tmp_path / "cal.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    result = subprocess.run(
        [sys.executable, "-m", "megatron_lrmoe.calibrate", "--output", str(out),
         "--hidden-size", "32", "--ffn-hidden-size", "16", "--rows", "32",
         "--local-experts", "1", "--repeats", "2", "--warmup", "0",
         "--alltoall", "copy", "--alltoall-mib", "0.25"],
        capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    constants = MachineConstants.from_json(out)
    assert constants.gemm_flops_per_s > 0 and constants.alltoall_bytes_per_s > 0
    assert "memory copy" in constants.source
    assert json.loads(out.read_text())["details"]["hidden_size"] == 32
    assert "expert GEMM rate" in result.stdout


def test_default_machine_constants_measure_and_say_so():
    constants = default_machine_constants("cpu")
    assert constants.gemm_flops_per_s > 0 and constants.alltoall_bytes_per_s > 0
    assert "default_machine_constants" in constants.source
    assert "no calibration file" in constants.source
