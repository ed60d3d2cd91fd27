"""Tests of the planner's cost model (DESIGN.md 7) and the calibration tool."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_lrmoe.lrmoe.cost_model import CostModel, MachineConstants, MoEShape
from megatron_lrmoe.lrmoe.machine import default_machine_constants
from megatron_lrmoe.lrmoe.retention import plan_retention

ROOT = Path(__file__).resolve().parents[1]
MACHINE = MachineConstants(gemm_flops_per_s=2e9, alltoall_bytes_per_s=1e8,
                           alltoall_latency_s=1e-5, source="test")


def test_shape_numbers_match_the_design_reference():
    # DESIGN.md section 11: Qwen3-30B-A3B per pair (bf16): 9.4 MFLOP forward, 18.9
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


def test_rank_memory_by_hand():
    cost = _model()
    h, f, b, p = 8, 4, 2, 20                   # F1 = F (not gated); P = 10 tokens * top-2
    reps, routed, retained = torch.tensor([1, 0]), torch.tensor([30, 10]), torch.tensor([5, 10])
    memory = cost.rank_memory(reps, routed, retained)
    instance = (f * h + h * f) * (b + b)
    source = 2 * p * (h * b + 16) + p * 3 * h * b / 3
    fwd_t, bwd_t = (4 * h + f) * b, (4 * h + 2 * f + 2 * f) * b
    expected = [instance + source + 2 * 30 * (h + f) * b + max(30 * fwd_t, 5 * bwd_t) / 3,
                source + 2 * 10 * (h + f) * b + max(10 * fwd_t, 10 * bwd_t) / 3]
    assert memory.tolist() == pytest.approx(expected)


def test_balanced_need_and_capacities_are_consistent():
    cost = _model()
    p = cost.shape.source_pairs
    need = cost.balanced_dropless_need()
    layer = float(cost.rank_memory(torch.zeros(1), torch.tensor([p]), torch.tensor([p]))[0])
    assert need == pytest.approx(layer * cost.shape.num_layers)
    share = cost.memory_share(need * 1.5)
    reps = torch.tensor([0, 2])
    cap = cost.routing_capacity(share, reps)
    # At the capacity, with nothing retained, the forward buffers fit; one more does not.
    fits = cost.rank_memory(reps, cap, torch.zeros(2))
    over = cost.rank_memory(reps, cap + 1, torch.zeros(2))
    assert bool((fits <= share).all()) and bool((over > share).all())
    routed = torch.tensor([p, p])
    keep = cost.retained_limit(share, reps, routed)
    assert bool((cost.rank_memory(reps, routed, keep) <= share).all())
    assert bool((cost.rank_memory(reps, routed, keep + 1) > share).all())


def test_layer_time_by_hand():
    cost = _model()
    counts = torch.tensor([[6, 0, 2, 2], [4, 0, 0, 6]])    # R=2, E=4 (2 per rank)
    plan = plan_retention(counts, 2, capacity_factor=1.0)
    fwd, bwd = cost.layer_time(plan)
    s = cost.shape
    routed = plan.routed_per_rank.tolist()                  # [10, 10]
    retained = plan.retained_per_rank.tolist()
    off = plan.routed_matrix.tolist()                       # [[6, 4], [4, 6]]
    a2a = max(off[0][1], off[1][0])
    assert fwd == pytest.approx(max(routed) * 2 * (4 + 4) * 8 / 2e9
                                + a2a * (2 * 8 + 1) * 2 / 1e8 + 2e-5)
    kept = plan.retained_matrix.tolist()
    a2a_kept = max(kept[0][1], kept[1][0])      # R=2: rank 0 sends [0][1], receives [1][0]
    assert bwd == pytest.approx(max(retained) * s.backward_flops_per_pair / 2e9
                                + a2a_kept * (2 * 8 * 2 + 4) / 1e8 + 2e-5)
    # Dropping lowers the backward estimate, never the forward.
    no_drop = plan_retention(counts, 2, capacity_factor=math.inf)
    assert cost.layer_time(no_drop)[0] == fwd
    assert cost.layer_time(no_drop)[1] >= bwd


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
