"""lrmoe_studies.simulator_counts: the simulator's replay of a recorded EP 2 run's
own routing against what the run logged (the layer's own figures, computed in the run
from its plans: independent of the replay), exactly; and a perturbed log is caught."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from lrmoe_studies import simulator_counts as sc
from lrmoe_studies import simulator_validation as vs
from megatron_lrmoe.tools import run_log

RUNS = Path(__file__).resolve().parents[2] / "benchmarks/results/time_to_loss/validate/runs"


def _run(name: str) -> Path:
    run = RUNS / name
    if not (run / "routing" / "header.json").is_file():
        pytest.skip(f"{run}: no committed routing record")
    return run


@pytest.mark.parametrize("name", ["megatron-dropless-s1", "megatron-capacity-1.0-s1"])
def test_megatron_layer_dispatch_matches_exactly(name: str):
    result = sc.compare_run(_run(name))
    assert result["mismatches"] == []
    # Every step's received-load figure of both layers, and the pairs sent per source.
    assert result["compared"]["routing/layer<N>/load-max-over-mean"] == 2 * 36
    assert sum(result["compared"].values()) == 4 * 36


def test_lrmoe_counts_match_exactly_but_the_positions_of_an_older_layer():
    # Recorded by a layer that drew the retained set in backward and sent its positions
    # there (4 bytes per kept pair to a dropping rank); today's draws it in forward. The
    # counts themselves (kept, rows, loads, replicas, overflow, notes) match exactly.
    result = sc.compare_run(_run("lrmoe-uniform-g0.75-s1"))
    assert result["compared"]["lrmoe/layer<N>/retained-fraction"] == 2 * 18
    assert result["compared"]["lrmoe/layer<N>/expert-backward-rows"] == 2 * 18
    assert {m["key"].split("/")[-1] for m in result["mismatches"]} == {"backward-bytes-saved"}
    for m in result["mismatches"]:
        extra = m["simulated"] - m["logged"]
        assert extra > 0 and extra % 4 == 0


def test_a_perturbed_count_is_reported():
    run = _run("megatron-dropless-s1")
    records = run_log.read_records(run / "log.jsonl")
    changed = copy.deepcopy(records)
    changed[5]["routing/layer2/load-max-over-mean"] += 2**-20
    result = sc.compare_run(run, changed)
    assert [(m["iteration"], m["key"]) for m in result["mismatches"]] == [
        (changed[5]["iteration"], "routing/layer2/load-max-over-mean")]


def test_a_perturbed_lrmoe_figure_is_reported():
    run = _run("lrmoe-uniform-g0.75-s1")
    records = run_log.read_records(run / "log.jsonl")
    i = next(i for i, r in enumerate(records) if "lrmoe/layer1/expert-backward-rows" in r)
    records[i]["lrmoe/layer1/expert-backward-rows"] += 1
    keys = {m["key"] for m in sc.compare_run(run, records)["mismatches"]
            if m["iteration"] == records[i]["iteration"]}
    assert "lrmoe/layer1/expert-backward-rows" in keys


def test_instance_rows_compare_across_zero_padding_only():
    # The log pads every layer to the widest layer's instances: zero columns only.
    assert sc._instance_rows_equal([[3, 1, 0], [2, 0, 0]], [[3, 1], [2, 0]])
    assert not sc._instance_rows_equal([[3, 1, 1], [2, 0, 0]], [[3, 1], [2, 0]])
    assert not sc._instance_rows_equal([[3, 2], [2, 0]], [[3, 1], [2, 0]])
    assert not sc._instance_rows_equal([[3, 1]], [[3, 1], [2, 0]])


def test_max_over_mean_is_the_float_of_the_integers():
    assert sc.max_over_mean([3, 1]) == 1.5
    assert sc.max_over_mean([0, 0]) == 0.0


# -----------------------------------------------------------------------------
# A fresh run of today's layers on 2 gloo ranks: the per-rank figures they log
# -----------------------------------------------------------------------------

@pytest.mark.parametrize("variant, families", [
    (["--moe-expert-capacity-factor", "1.0"], {"routing/layer<N>/instance-rows": 2 * 2}),
    (["--moe-lrmoe", "--moe-lrmoe-bwd-capacity-factor", "0.75", "--moe-lrmoe-placement",
      "popularity", "--moe-lrmoe-slots-per-rank", "5"],
     {f"lrmoe/layer<N>/{k}": 2 * 2 for k in ("rank-sent-pairs", "rank-kept-sent-pairs",
                                             "instance-rows", "instance-kept-rows")}),
], ids=["megatron-capacity", "lrmoe-drop-replicas"])
def test_a_fresh_runs_per_rank_dispatch_matches_the_replay(gloo2, corpus, tmp_path, variant,
                                                          families):
    import json
    import shlex

    from tests.launcher.test_routing_record import TINY

    run = tmp_path / "run"
    run.mkdir()
    # 4 steps, 2 log intervals; the routing and the log where the driver keeps them.
    flags = [*TINY, *variant, "--log-interval", "2", "--eval-iters", "0",
             "--data-path", corpus, "--record-routing", str(run / "routing"),
             "--log-json", str(run / "log.jsonl")]
    gloo2.run(_train, flags, timeout=300)
    # Recorded as the time-to-loss driver records: with the defaults it ran under.
    (run / "done.json").write_text(json.dumps({"command": shlex.join(
        ["python", "-m", "megatron_lrmoe.launcher.pretrain", *flags]),
        "defaults": vs.recorded_defaults()}))
    result = sc.compare_run(run)
    assert result["mismatches"] == []
    for family, count in families.items():          # 2 layers x 2 log intervals
        assert result["compared"][family] == count
    records = run_log.read_records(run / "log.jsonl")
    rows = [r[k] for r in records for k in r if k.endswith("/instance-rows")]
    assert rows and all(len(r) == 2 for r in rows)   # [W][L]: both ranks
    if "--moe-lrmoe" in variant:
        # A replica per rank (5 slots, 4 homes) and drops: the figures are not trivial.
        assert any(len(r[0]) == 5 and r[0][4] > 0 for r in rows)
        kept = [r[k] for r in records for k in r if k.endswith("/instance-kept-rows")]
        assert sum(map(sum, sum(kept, []))) < sum(map(sum, sum(rows, [])))
    # A changed per-rank count is caught.
    key = next(k for k in records[-1] if k.endswith("/instance-rows"))
    records[-1][key][1][0] += 1
    assert [m["key"] for m in sc.compare_run(run, records)["mismatches"]] == [key]


def _train(argv: list[str]) -> None:
    from megatron_lrmoe.launcher.arguments import parse_args
    from megatron_lrmoe.launcher.pretrain import train

    train(parse_args(argv))


def test_the_replay_reads_the_runs_machine_constants_exactly(tmp_path: Path):
    # The placement choice prices candidates with these; rounded to the printed 4 figures
    # a near tie can flip (an EP 16 run at gamma inf replayed one placement differently).
    from megatron_lrmoe.integration.step_hooks import machine_constants_line
    from megatron_lrmoe.planning.machine import MachineConstants

    machine = MachineConstants(gemm_flops_per_s=123456789012.34567,
                               alltoall_bytes_per_s=9876543210.987654,
                               alltoall_latency_s=1.2345678e-05, source="measured; at start")
    run = tmp_path / "run"
    run.mkdir()
    (run / "stdout.txt").write_text("before\n" + machine_constants_line(machine) + "\nafter\n")
    got = sc.run_machine(run)
    assert (got.gemm_flops_per_s, got.alltoall_bytes_per_s, got.alltoall_latency_s) == (
        machine.gemm_flops_per_s, machine.alltoall_bytes_per_s, machine.alltoall_latency_s)
    # An older run's line, without the exact part: its 4 figures.
    old = machine_constants_line(machine).split("; exact:")[0] + "\n"
    (run / "stdout.txt").write_text(old)
    got = sc.run_machine(run)
    assert got.gemm_flops_per_s == pytest.approx(123.5e9, rel=1e-12)
    assert got.alltoall_latency_s == pytest.approx(12.35e-6, rel=1e-12)
