"""The at-scale simulator: its inputs formed as documented, its sums checked by hand."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from lrmoe_studies.paths import STEPS_TO_TARGET_FILE
from megatron_lrmoe.data import routing_traces as rt
from megatron_lrmoe.planning.clusters import CLUSTERS, cluster_machine_constants
from megatron_lrmoe.planning.cost_model import CostModel
from megatron_lrmoe.planning.models import ModelSpec
from megatron_lrmoe.tools.simulate import (
    POLICIES,
    Policy,
    layer_shape,
    load_steps_to_target,
    load_traces,
    main,
    node_calibration,
    simulate,
    source_batches,
    steps_ratios,
)

H100 = CLUSTERS["h100"]


def test_machine_constants_by_hand():
    inside = cluster_machine_constants(H100, 8)
    assert inside.gemm_flops_per_s == pytest.approx(989e12 * 0.6)
    # NVLink only, one direction: an all-to-all's rank sends and receives at once.
    assert inside.alltoall_bytes_per_s == pytest.approx(450e9 * 0.7)
    assert inside.alltoall_latency_s == pytest.approx(15e-6)
    # EP 16 over two nodes: 7 of a rank's 15 peers share its node, 8 do not.
    two_nodes = cluster_machine_constants(H100, 16)
    per_byte = max(7 / 15 / (450e9 * 0.7), 8 / 15 / (50e9 * 0.8))
    assert two_nodes.alltoall_bytes_per_s == pytest.approx(1 / per_byte)
    assert two_nodes.alltoall_latency_s == pytest.approx(30e-6)
    # A calibration file replaces cluster fields and derived constants alike.
    tuned = cluster_machine_constants(H100, 8, {"gemm_efficiency": 0.5, "alltoall_latency_s": 1e-5})
    assert tuned.gemm_flops_per_s == pytest.approx(989e12 * 0.5)
    assert tuned.alltoall_latency_s == 1e-5
    with pytest.raises(ValueError, match="--calibration"):
        cluster_machine_constants(H100, 8, {"gemm_rate": 1.0})


def test_cluster_links_are_per_direction_datasheet_figures():
    """``nvlink_bytes_per_s`` is one direction (an all-to-all's rank
    sends and receives at once), but the presets held the vendors' bidirectional totals
    (H100/H200 SXM: 900 GB/s = 18 NVLink 4 links x 2 x 25 GB/s; A100 SXM: 600 GB/s = 12
    NVLink 3 links x 2 x 25 GB/s), so every NVLink byte was priced at twice the rate.
    The InfiniBand figure was already one direction (400 Gb/s NDR per H100/H200, 200 Gb/s
    HDR per A100, one NIC per GPU)."""
    per_direction = {"h100": 450e9, "h200": 450e9, "a100-40": 300e9}
    network = {"h100": 400e9 / 8, "h200": 400e9 / 8, "a100-40": 200e9 / 8}
    for name, cluster in CLUSTERS.items():
        assert cluster.nvlink_bytes_per_s == pytest.approx(per_direction[name]), name
        assert cluster.network_bytes_per_s == pytest.approx(network[name]), name
        one_node = cluster_machine_constants(cluster, cluster.gpus_per_node)
        assert one_node.alltoall_bytes_per_s == pytest.approx(
            per_direction[name] * cluster.nvlink_efficiency), name


def test_node_calibration_keeps_the_clusters_links():
    # A one-GPU calibration: GEMM table and memory rate measured, the all-to-all a memory
    # copy, no layer fixed cost (0: calibrate measures it only over local gloo).
    one_gpu = {"gemm_flops_per_s": 7e14, "alltoall_bytes_per_s": 4e12,
               "alltoall_latency_s": 0.0, "source": "calibrate on one H200",
               "gemm_rows": [128, 1024], "gemm_forward_flops_per_s": [3e14, 6e14],
               "gemm_backward_flops_per_s": [2e14, 5e14], "memory_bytes_per_s": 4e12,
               "layer_forward_fixed_s": 0.0, "layer_backward_fixed_s": 0.0,
               "details": {"device": "cuda"}}
    node = node_calibration(one_gpu)
    assert set(node) == {"gemm_flops_per_s", "gemm_rows", "gemm_forward_flops_per_s",
                         "gemm_backward_flops_per_s", "memory_bytes_per_s", "source"}
    h200 = CLUSTERS["h200"]
    for ep in (8, 16):
        derived = cluster_machine_constants(h200, ep)
        calibrated = cluster_machine_constants(h200, ep, node)
        assert calibrated.alltoall_bytes_per_s == derived.alltoall_bytes_per_s
        assert calibrated.alltoall_latency_s == derived.alltoall_latency_s
        assert calibrated.layer_forward_fixed_s == derived.layer_forward_fixed_s == 200e-6
        assert calibrated.gemm_flops_per_s == 7e14
        assert calibrated.gemm_rows == (128, 1024)
        assert calibrated.memory_bytes_per_s == 4e12
    # The whole file would have taken the copy for the links.
    assert cluster_machine_constants(h200, 16, one_gpu).alltoall_bytes_per_s == 4e12
    # A measured fixed cost is node-local and kept.
    measured = node_calibration({**one_gpu, "layer_forward_fixed_s": 3e-4})
    assert measured["layer_forward_fixed_s"] == 3e-4
    assert "layer_backward_fixed_s" not in measured
    # Megatron's layer's pair is kept together, a measured 0 included; null: not measured.
    megatron = node_calibration({**one_gpu, "megatron_forward_fixed_s": 2e-3,
                                 "megatron_backward_fixed_s": 0.0})
    assert (megatron["megatron_forward_fixed_s"], megatron["megatron_backward_fixed_s"]) == (
        2e-3, 0.0)
    assert cluster_machine_constants(h200, 8, megatron).megatron_backward_fixed_s == 0.0
    unmeasured = node_calibration({**one_gpu, "megatron_forward_fixed_s": None,
                                   "megatron_backward_fixed_s": None})
    assert "megatron_forward_fixed_s" not in unmeasured
    with pytest.raises(ValueError, match="gemm_flops_per_s"):
        node_calibration({"alltoall_bytes_per_s": 1e9})


def test_sources_are_consecutive_trace_rows():
    # Trace of 3 calls x 2 sources over 8 experts; row j routes only to expert j, so the
    # resampling is exact and shows which rows became which source rank.
    trace = np.zeros((3, 2, 8), dtype=np.int64)
    for j in range(6):
        trace[j // 2, j % 2, j] = 5
    batches = source_batches(trace, 4, 100, np.random.default_rng(0))
    first, second = next(batches), next(batches)
    assert first.argmax(1).tolist() == [0, 1, 2, 3]
    assert (first.sum(1) == 100).all()
    assert second.argmax(1).tolist() == [0, 1, 2, 3]      # 6 rows: cycled, not split
    with pytest.raises(ValueError, match="fewer than one micro-batch"):
        next(source_batches(trace, 8, 100, np.random.default_rng(0)))


def _local_trace(num_sources: int, num_experts: int, calls: int) -> np.ndarray:
    """Source s routes every pair to the first expert of rank s (at EP = sources)."""
    trace = np.zeros((calls, num_sources, num_experts), dtype=np.int64)
    per_rank = num_experts // num_sources
    for s in range(num_sources):
        trace[:, s, s * per_rank] = 1
    return trace


def test_simulated_times_by_hand():
    """Every part against hand arithmetic from the constants (the memory, router and fixed
    terms of CostModel's module doc "Time"; this test asserted the old three-part formula
    before those terms existed)."""
    model = ModelSpec("tiny", num_layers=4, hidden_size=64, ffn_hidden_size=32,
                      num_experts=16, topk=2, gated=True, seq_length=32, micro_batch_size=1,
                      global_batch_size=16)
    ep = 4
    results = {r.policy: r for r in simulate(model, H100, ep, [_local_trace(ep, 16, 8)],
                                             steps=2, budget_gib=1.0, planner_s=0.0)}
    m = cluster_machine_constants(H100, ep)
    g, mem = 989e12 * 0.6, 3.35e12 * 0.7           # GEMM FLOP/s; memory bytes/s (bf16: 2 B)
    assert m.gemm_flops_per_s == pytest.approx(g) and m.memory_bytes_per_s == pytest.approx(mem)
    weights = (2 * 32 + 32) * 64                    # W1 [2F, H] + W2 [H, F]
    pairs = 32 * 2                                  # every pair stays on its own rank
    # Element passes, H = 64, F = 32, T = 32, 4 local experts (reorders counted):
    # forward  routed 64 x (4H + 6F = 448) + source 64 x 3H (192) + T H (2048) = 43008;
    # backward retained 64 x (4H + 18F = 832) + source 64 x 2H + kept 64 x 4H + T H = 79872
    # in the LRMoE layer; Megatron's saved the activation's output, so its backward has no
    # recompute (5F fewer per row): 64 x (4H + 13F = 672) + ... = 69632.
    router_f = 32 * (2 * 64 * 16 / g + (64 + 4 * 16) * 2 / mem)
    router_b = 32 * (4 * 64 * 16 / g + (2 * 64 + 4 * 16) * 2 / mem)
    fixed_f, fixed_b = 2 * 15e-6 + 200e-6, 2 * 15e-6 + 100e-6
    dropless = results["dropless"]
    p = dropless.parts
    assert p["forward_gemm"] == pytest.approx(pairs * 2 * weights / g)
    assert p["forward_memory"] == pytest.approx(43008 * 2 / mem)
    assert p["forward_alltoall"] == 0.0
    assert p["forward_router"] == pytest.approx(router_f)
    assert p["forward_fixed"] == pytest.approx(fixed_f)
    assert p["forward_planner"] == 0.0
    assert dropless.backward_s == pytest.approx(pairs * 4 * weights / g + 69632 * 2 / mem
                                                + router_b + fixed_b)
    assert dropless.load_max_over_mean == pytest.approx(1.0)
    # Megatron's forward capacity: ceil(32 * 2 / 16) = 4 pairs per expert and source.
    capped = results["capacity-drop"]
    assert capped.parts["forward_gemm"] == pytest.approx(4 * 2 * weights / g)
    # LRMoE at 0.75 (uniform, drawn in forward): balanced routing, so each rank keeps
    # 0.75 of its 64 pairs (48), and gathers x and z of those rows in forward, before
    # saving them (2(H + F1) = 256 more per retained row): forward 43008 + 48 x 256 =
    # 55296; backward 48 x 832 + 64 x 128 + 48 x 256 + 2048 = 62464.
    drop = results["lrmoe-drop"]
    assert drop.parts["forward_memory"] == pytest.approx(55296 * 2 / mem)
    assert drop.forward_s - drop.parts["forward_memory"] == pytest.approx(
        dropless.forward_s - p["forward_memory"])                # planner_s = 0 here
    assert drop.retained_fraction == pytest.approx(48 / 64)
    assert drop.parts["backward_gemm"] == pytest.approx(48 * 4 * weights / g)
    assert drop.parts["backward_memory"] == pytest.approx(62464 * 2 / mem)
    # Balanced routing: no replica pays (nothing to relieve).
    assert results["symi"].load_max_over_mean == pytest.approx(1.0)
    assert results["lrmoe-ma"].replicas == 0
    # A step: 16 / (1 * 4) = 4 micro-batches per layer, all 4 layers.
    assert dropless.step_moe_s == pytest.approx(4 * 4 * (dropless.forward_s + dropless.backward_s))
    assert {r.policy for r in results.values()} == {p.name for p in POLICIES}


def test_megatron_policies_are_priced_by_megatrons_memory_model():
    """Megatron's layer is priced by MegatronMoEMemory (not the LRMoE region's levels),
    and recompute changes memory and time as Megatron's means do."""
    from megatron_lrmoe.planning.megatron_baseline import MegatronMoEMemory

    model = ModelSpec("tiny", num_layers=2, hidden_size=64, ffn_hidden_size=32,
                      num_experts=16, topk=2, gated=True, seq_length=32, micro_batch_size=1,
                      global_batch_size=4)
    ep = 4
    trace = _local_trace(ep, 16, 8)
    # The run's recompute is the shape's (as moe_shape reads it from the config).
    base, moe, full = (
        simulate(model, H100, ep, [trace], steps=1, planner_s=0.0,
                 shape=dataclasses.replace(model.shape(ep, 1), **recompute),
                 policies=(Policy("dropless", runs_planner=False),))[0]
        for recompute in (dict(), dict(recompute_moe=True), dict(full_recompute_layers=1)))
    shape = layer_shape(model.shape(ep, 1), False)
    counts = next(source_batches(trace, ep, shape.source_pairs, np.random.default_rng([0, 0])))
    assert shape.grouped_gemm      # the simulator's GPU layer: TEGroupedMLP's model
    saved, peak = MegatronMoEMemory(shape, grouped=True).rank_memory(counts)
    # Both stage layers replay the one simulated layer: 2 S + (2 (peak - S)) / 2.
    assert base.memory_gib * 2**30 == pytest.approx(float((saved + peak).max()))
    _, rerun = MegatronMoEMemory(shape, grouped=True, recompute=True).rank_memory(counts)
    assert moe.memory_gib * 2**30 == pytest.approx(float(rerun.max()))
    # Block of 1: the second layer keeps S; transients: the first rebuilt (peak), the
    # second's peak - S, each for half.
    assert full.memory_gib * 2**30 == pytest.approx(float((saved + (2 * peak - saved) / 2)
                                                          .max()))
    micro = shape.microbatches_per_step
    assert moe.step_moe_s == pytest.approx(base.step_moe_s + 2 * micro * base.forward_s)
    assert full.step_moe_s == pytest.approx(base.step_moe_s + micro * base.forward_s)


def test_planner_time_only_where_the_policy_runs_it():
    model = ModelSpec("tiny", num_layers=1, hidden_size=64, ffn_hidden_size=32,
                      num_experts=16, topk=2, gated=True, seq_length=32, micro_batch_size=1,
                      global_batch_size=4)
    trace = [_local_trace(4, 16, 4)]
    given = {r.policy: r for r in simulate(model, H100, 4, trace, steps=1, budget_gib=1.0,
                                           planner_s=1e-3)}
    assert given["dropless"].parts["forward_planner"] == 0.0
    assert given["capacity-drop"].parts["forward_planner"] == 0.0
    for name in ("symi", "lrmoe-drop", "lrmoe-ma"):
        assert given[name].parts["forward_planner"] == pytest.approx(1e-3)
    # Measured (planner_s=None): a positive host time for the planner's policies only.
    measured = {r.policy: r for r in simulate(model, H100, 4, trace, steps=1, budget_gib=1.0)}
    assert measured["dropless"].parts["forward_planner"] == 0.0
    assert measured["lrmoe-ma"].parts["forward_planner"] > 0.0


def test_default_budget_is_the_planned_shapes_need():
    """One shape defines the budget: the default (balanced dropless need + instances) is
    that of the shape the budgeted policies are planned with (forward retention), not
    Megatron's layer's (--budget-instances 0 once died on 12 bytes a pair)."""
    model = ModelSpec("tiny", num_layers=2, hidden_size=64, ffn_hidden_size=32,
                      num_experts=16, topk=2, gated=True, seq_length=32, micro_batch_size=1,
                      global_batch_size=4)
    ep = 4
    planned = layer_shape(model.shape(ep, 1), True)
    need = CostModel(planned, cluster_machine_constants(H100, ep)).balanced_dropless_need()
    assert need > CostModel(layer_shape(model.shape(ep, 1), False),
                            cluster_machine_constants(H100, ep)).balanced_dropless_need()
    for instances in (0.0, 1.5):
        results = simulate(model, H100, ep, [_local_trace(ep, 16, 4)], steps=1,
                           budget_instances=instances, planner_s=0.0)
        budget = need + instances * planned.instance_bytes * planned.num_layers
        assert {r.budget_gib for r in results} == {budget / 2**30}
    with pytest.raises(ValueError, match="runs_planner"):
        Policy("megatron-budget", budget=True, runs_planner=False)


def test_cli_budget_at_the_balanced_need(tmp_path, capsys):
    # The command in small: a recorded trace, the default model and cluster,
    # --budget-instances 0.
    rng = np.random.default_rng(2)
    counts = rng.integers(0, 40, size=(2, 1, 2, 2, 128))
    sources = {1: [{"rank": r, "ep_rank": r, "ep_group": 0} for r in range(2)]}
    rt.write_header(tmp_path, rt.make_header(
        {"num_experts": 128, "moe_layers": [1], "topk": 8},
        {"microbatches_per_step": 2, "ep": 2, "tokens_per_source": 64, "world_size": 2},
        sources))
    rt.write_chunk(tmp_path, 1, np.arange(1, 3), counts)
    assert main(["--model", "qwen3-30b-a3b", "--cluster", "h100", "--trace", str(tmp_path),
                 "--budget-instances", "0", "--skip-fraction", "0", "--ep", "8",
                 "--steps", "1"]) == 0
    assert "LRMoE memory-aware" in capsys.readouterr().out


def test_calibration_file_overrides_the_new_constants():
    cal = {"gemm_flops_per_s": 1e11, "alltoall_bytes_per_s": 1e9, "memory_bytes_per_s": 5e9,
           "layer_forward_fixed_s": 0.004, "layer_backward_fixed_s": 0.003,
           "gemm_rows": [16, 256], "gemm_forward_flops_per_s": [1e10, 5e10],
           "gemm_backward_flops_per_s": [1e10, 4e10], "source": "cal", "details": {"x": 1}}
    m = cluster_machine_constants(H100, 2, cal)
    assert m.memory_bytes_per_s == 5e9 and m.layer_forward_fixed_s == 0.004
    assert m.gemm_rows == (16.0, 256.0) and "cal" in m.source
    # Without a calibration, the presets' assumptions: HBM x 0.7 and the fixed costs.
    preset = cluster_machine_constants(CLUSTERS["a100-40"], 8)
    assert preset.memory_bytes_per_s == pytest.approx(1.6e12 * 0.7)
    assert (preset.layer_forward_fixed_s, preset.layer_backward_fixed_s) == (200e-6, 100e-6)
    assert preset.gemm_rows == ()


def test_cli_writes_table_and_plot(tmp_path, capsys):
    assert main(["--model", "qwen3-30b-a3b", "--cluster", "a100-40", "--ep", "8",
                 "--layers", "1", "--steps", "1", "--out", str(tmp_path)]) == 0
    md = (tmp_path / "simulate_qwen3-30b-a3b_a100-40.md").read_text()
    assert "command: `python -m megatron_lrmoe.tools.simulate --model qwen3-30b-a3b" in md
    assert md.count("| 8 | ") == len(POLICIES)
    png = (tmp_path / "simulate_qwen3-30b-a3b_a100-40.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert "Megatron dropless" in capsys.readouterr().out
    assert not math.isnan(float(md.split("| 8 | Megatron dropless |")[1].split("|")[1]))


def test_global_batch_size_sets_the_step(tmp_path, capsys):
    """--global-batch-size replaces the config's (512 for Qwen3-30B-A3B) so a step can be
    compared with a measured run's (a 1024-sequence step): twice the
    sequences, twice the micro-batches per rank, twice the MoE time per step."""
    args = ["--model", "qwen3-30b-a3b", "--cluster", "h100", "--ep", "16", "--layers", "1",
            "--steps", "1", "--zipf", "0", "--drift", "0", "--planner-ms", "0"]
    rows = {}
    for gbs in (512, 1024):
        out = tmp_path / str(gbs)
        assert main([*args, "--global-batch-size", str(gbs), "--out", str(out)]) == 0
        md = (out / "simulate_qwen3-30b-a3b_h100.md").read_text()
        assert f"'global_batch_size': {gbs}" in md
        row = md.split("| 16 | Megatron dropless |")[1].split("|")
        rows[gbs] = (float(row[0]), float(row[1]), float(row[9]))   # fwd, bwd ms; s/step
    capsys.readouterr()
    for gbs, (fwd, bwd, step) in rows.items():
        # 48 layers x GBS / 16 micro-batches x (fwd + bwd), as printed (2 decimals).
        assert step == pytest.approx(48 * gbs / 16 * (fwd + bwd) / 1e3, rel=2e-3)
    assert rows[1024][2] == pytest.approx(2 * rows[512][2], rel=0.02)
    with pytest.raises(SystemExit, match="--global-batch-size"):
        main([*args, "--global-batch-size", "0"])


def test_recorded_trace_is_replayed(tmp_path, capsys):
    # A trace directory as --record-routing writes it: 4 steps x 2 micro-batches x 2
    # sources over 128 experts; the second half (steps 3, 4) is replayed.
    rng = np.random.default_rng(1)
    counts = rng.integers(0, 40, size=(4, 1, 2, 2, 128))
    sources = {1: [{"rank": r, "ep_rank": r, "ep_group": 0} for r in range(2)]}
    rt.write_header(tmp_path, rt.make_header(
        {"num_experts": 128, "moe_layers": [1], "topk": 8},
        {"microbatches_per_step": 2, "ep": 2, "tokens_per_source": 64, "world_size": 2},
        sources))
    rt.write_chunk(tmp_path, 1, np.arange(1, 5), counts)
    traces, source = load_traces(tmp_path, 128, layers=4, skip_fraction=0.5)
    assert len(traces) == 1 and np.array_equal(traces[0], counts[2:, 0])
    assert "steps 3-4" in source
    with pytest.raises(ValueError, match="--trace"):
        load_traces(tmp_path, 64, layers=1, skip_fraction=0.5)
    # 2 steps x 2 micro-batches x 2 sources = 8 rows: one call at EP 8.
    out = tmp_path / "out"
    assert main(["--trace", str(tmp_path), "--ep", "8", "--steps", "1", "--out", str(out)]) == 0
    assert "recorded trace" in (out / "simulate_qwen3-30b-a3b_h100.md").read_text()


def test_another_model_from_its_launcher_config(tmp_path):
    # --model-config: a model the package does not ship, from a launcher config.
    config = tmp_path / "small_moe.yaml"
    config.write_text("num-layers: 4\nmoe-layer-freq: \"([0]*1+[1]*3)\"\nhidden-size: 64\n"
                      "moe-ffn-hidden-size: 32\nnum-experts: 16\nmoe-router-topk: 2\n"
                      "swiglu: true\nseq-length: 128\nmicro-batch-size: 1\n"
                      "global-batch-size: 16\n")
    out = tmp_path / "out"
    assert main(["--model-config", str(config), "--ep", "4", "--steps", "1", "--layers", "1",
                 "--out", str(out)]) == 0
    text = (out / "simulate_small_moe_h100.md").read_text()
    assert "'num_layers': 3" in text and "'num_experts': 16" in text


# The time-to-loss study's steps to the 100% target as simulate.py held them before they
# moved to STEPS_TO_TARGET_FILE (commit 5857613): data, so written out here as the
# independent check that the stored file still says the same.
STUDY_STEPS = {
    "capacity-drop": ((171, 150), (165, 145), (108, 128), (189, 141)),
    "symi": ((143, 150), (142, 145), (108, 128), (139, 141)),
    "lrmoe-drop": ((169, 150),),
    "lrmoe-ma": ((141, 150), (135, 145), (119, 128), (162, 141)),
}


def test_shipped_steps_to_target_are_the_studys():
    steps = load_steps_to_target(STEPS_TO_TARGET_FILE)
    assert steps == STUDY_STEPS
    ratios = steps_ratios(steps)
    assert list(ratios) == [p.name for p in POLICIES]
    # The ratios simulate.STEPS_RATIO held before the move, to the last bit (the middle
    # two of each policy's four sorted per-pair ratios, averaged), and as the report
    # prints them (docs/simulate.md, "Outputs").
    assert ratios == {"dropless": 1.0, "capacity-drop": 1.1389655172413793,
                      "symi": 0.9663218390804598, "lrmoe-drop": 1.1266666666666667,
                      "lrmoe-ma": 0.9355172413793102}
    assert ratios["symi"] == (143 / 150 + 142 / 145) / 2
    assert [round(r, 3) for r in ratios.values()] == [1.0, 1.139, 0.966, 1.127, 0.936]


def test_shipped_steps_to_target_match_the_run_reports():
    # Every pair names the two runs it comes from: their report's per-seed steps and the
    # code commit each run recorded must be the file's.
    doc = json.loads(STEPS_TO_TARGET_FILE.read_text())
    root = STEPS_TO_TARGET_FILE.parents[4] / doc["root"]
    assert root == STEPS_TO_TARGET_FILE.parent
    for entry in doc["policies"].values():
        for pair in entry["pairs"]:
            stage = pair["run"].split("/")[0]
            per_seed = json.loads((root / stage / "report.json").read_text())["per_seed"]
            steps = {(r["policy"], r["seed"]): r["steps"] for r in per_seed}
            assert steps[(entry["study_policy"], pair["seed"])] == pair["steps"]
            assert steps[("megatron-dropless", pair["seed"])] == pair["dropless_steps"]
            for run in (pair["run"], pair["dropless_run"]):
                done = json.loads((root / run / "done.json").read_text())
                assert done["code"] == f"commit {pair['code']}"


def _steps_file(tmp_path, policies) -> str:
    path = tmp_path / "steps.json"
    path.write_text(json.dumps({"policies": policies}))
    return str(path)


def _pairs(*pairs):
    return {"pairs": [{"steps": s, "dropless_steps": d} for s, d in pairs]}


@pytest.mark.parametrize("change, problem", [
    (lambda p: p.pop("symi"), "missing: symi"),
    (lambda p: p.update(dropless=_pairs((1, 1))), "unknown: dropless"),
    (lambda p: p.update(symi={"pairs": []}), "policy 'symi': expected"),
    (lambda p: p.update(symi=_pairs((0, 150))), "policy 'symi', pair 0"),
    (lambda p: p.update(symi=_pairs((140, 150.0))), "policy 'symi', pair 0"),
    (lambda p: p.update(symi=_pairs((140, 150), (True, 150))), "policy 'symi', pair 1"),
])
def test_malformed_steps_to_target_names_the_option(tmp_path, change, problem):
    policies = {name: _pairs(*pairs) for name, pairs in STUDY_STEPS.items()}
    assert load_steps_to_target(_steps_file(tmp_path, policies)) == STUDY_STEPS
    change(policies)
    path = _steps_file(tmp_path, policies)
    with pytest.raises(ValueError, match=f"^--steps-to-target {path}: .*{problem}"):
        load_steps_to_target(path)
    # The command line stops with the same words, before simulating anything.
    with pytest.raises(SystemExit, match=f"^--steps-to-target {path}: .*{problem}"):
        main(["--steps-to-target", path, "--ep", "8", "--layers", "1", "--steps", "1"])


def test_missing_or_unparsable_steps_to_target_names_the_option(tmp_path):
    missing = tmp_path / "none.json"
    with pytest.raises(SystemExit, match=f"^--steps-to-target {missing}: cannot read it"):
        main(["--steps-to-target", str(missing), "--ep", "8"])
    for text, problem in (("{", "not JSON"), ("[]", '"policies" object'),
                          ('{"policies": []}', '"policies" object')):
        bad = tmp_path / "bad.json"
        bad.write_text(text)
        with pytest.raises(ValueError, match=f"^--steps-to-target {bad}: .*{problem}"):
            load_steps_to_target(bad)


def test_steps_to_target_file_scales_the_projection(tmp_path, capsys):
    # Another file's medians reach the report: capacity drop at twice dropless's steps
    # projects to twice its per-step ratio.
    policies = {name: _pairs(*pairs) for name, pairs in STUDY_STEPS.items()}
    policies["capacity-drop"] = _pairs((300, 150), (200, 100), (1, 1))
    args = ["--ep", "8", "--layers", "1", "--steps", "1", "--planner-ms", "1", "--out"]
    assert main([*args, str(tmp_path / "a"), "--steps-to-target",
                 _steps_file(tmp_path, policies)]) == 0
    capsys.readouterr()
    md = (tmp_path / "a" / "simulate_qwen3-30b-a3b_h100.md").read_text()
    row = md.split("| 8 | Megatron capacity drop, cf 1.0 |")[1].split("|")
    vs_dropless, to_target = float(row[10]), float(row[11])
    assert to_target == pytest.approx(2 * vs_dropless, abs=2e-3)
    assert "capacity-drop 2.000" in md


# ----------------------------------------------------------------------------- window
_TINY = ModelSpec("tiny", num_layers=1, hidden_size=64, ffn_hidden_size=32, num_experts=16,
                  topk=2, gated=True, seq_length=32, micro_batch_size=1, global_batch_size=8)


def _routed_to(experts_by_source: list[int], calls: int, pairs: int = 64) -> np.ndarray:
    """[calls, R, 16]: source s sends all its ``pairs`` pairs (_TINY: 32 tokens x top-2)
    to expert ``experts_by_source[s]`` in every call (exact: nothing to resample)."""
    trace = np.zeros((calls, len(experts_by_source), 16), dtype=np.int64)
    for s, e in enumerate(experts_by_source):
        trace[:, s, e] = pairs
    return trace


def test_warmup_steps_are_left_out_of_the_times():
    """Megatron's layer (static, no budget): a step's time depends on its routing only,
    so the window's time is that of its own steps, whatever ran before."""
    # Qwen3-sized experts, so that a hot step costs visibly more than the fixed costs.
    model = dataclasses.replace(_TINY, hidden_size=2048, ffn_hidden_size=768,
                                seq_length=1024)
    ep, shape = 4, model.shape(4, 1)
    assert shape.microbatches_per_step == 2 and shape.source_pairs == 2048
    hot = _routed_to([0, 0, 0, 0], 2, 2048)     # every pair to rank 0: one step's calls
    level = _routed_to([0, 4, 8, 12], 2, 2048)  # every source to its own rank's expert
    dropless = (Policy("dropless", runs_planner=False),)

    def run(trace: np.ndarray, **window) -> object:
        return simulate(model, H100, ep, [trace], policies=dropless, shape=shape,
                        resample=False, planner_s=0.0, **window)[0]

    windowed = run(np.concatenate([hot, level]), steps=1, warmup_steps=1)
    alone = run(level, steps=1, warmup_steps=0)
    both = run(np.concatenate([hot, level]), steps=2, warmup_steps=0)
    hot_alone = run(hot, steps=1, warmup_steps=0)
    assert windowed.step_moe_s == pytest.approx(alone.step_moe_s)
    assert windowed.forward_s == pytest.approx(alone.forward_s)
    assert windowed.load_max_over_mean == pytest.approx(1.0)
    # Counted, the hot step would have raised the mean: the window is what matters.
    assert both.step_moe_s == pytest.approx((alone.step_moe_s + hot_alone.step_moe_s) / 2)
    assert hot_alone.step_moe_s > 1.5 * alone.step_moe_s, (hot_alone, alone)
    # The warm-up's memory is counted: its hot rank is the run's peak.
    assert windowed.memory_gib == pytest.approx(hot_alone.memory_gib)
    assert windowed.memory_step == 0 and windowed.memory_gib > alone.memory_gib
    with pytest.raises(ValueError, match="steps 0 must be >= 1"):
        run(level, steps=0)


def test_memory_is_the_most_over_steps_of_each_steps_levels_and_replicas():
    """SYMI-style on one hot expert: the warm-up step (Megatron's placement) loads rank 0
    alone, the next steps place replicas everywhere. The memory is the most over the
    steps of each step's own levels plus its replicas, brute force from the per-call
    levels; the maxima taken over different steps would give more than any step holds."""
    from megatron_lrmoe.planning.megatron_baseline import MegatronMoEMemory
    from megatron_lrmoe.tools.simulate import call_memory_levels, policy_planner

    model = dataclasses.replace(_TINY, seq_length=128)      # 256 pairs per source
    ep, shape = 4, model.shape(4, 1)
    # Two hot experts on ranks 0 and 1: each of those ranks then hosts a replica of the
    # other's (and ranks 2, 3 of both).
    trace = _routed_to([0, 0, 4, 4], 2, 256)
    symi = Policy("symi", placement="popularity", budget=True, slots_per_rank=6)
    [result] = simulate(model, H100, ep, [trace], policies=(symi,), steps=2, warmup_steps=1,
                        budget_gib=1.0, shape=shape, resample=False, planner_s=0.0)
    cost = CostModel(layer_shape(shape, True), cluster_machine_constants(H100, ep))
    planner = policy_planner(symi, ep, cost, 1.0 * 2**30)
    megatron = MegatronMoEMemory(cost.shape, grouped=True)
    by_step, peaks, replica_bytes = [], [], []
    for _ in range(3):
        levels = []
        for micro in range(2):
            counts = trace[micro]
            planner.observe(counts)
            plan = planner.plan(counts).retention
            levels.append(call_memory_levels(symi, cost, megatron, plan, counts,
                                             planner.placement, micro == 1)[1])
        replicas = np.asarray(planner.placement.replicas_per_rank()) * shape.instance_bytes
        peak = np.max(levels, axis=0)
        # One layer, nothing recomputed: a rank holds its replicas and the layer's peak.
        by_step.append(float((replicas + peak).max()))
        peaks.append(peak)
        replica_bytes.append(replicas)
        planner.next_step()
    assert replica_bytes[0].sum() == 0 and (replica_bytes[1] > 0).all(), replica_bytes
    assert result.memory_gib * 2**30 == pytest.approx(max(by_step))
    assert result.memory_step == int(np.argmax(by_step))
    joined = float((np.max(peaks, axis=0) + np.max(replica_bytes, axis=0)).max())
    # Here the warm-up's hot rank binds (the case), and the joined maxima add
    # the later steps' replicas to it.
    assert result.memory_step == 0
    assert joined > max(by_step) * 1.05
