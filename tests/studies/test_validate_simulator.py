"""benchmarks/studies/validate_simulator.py's bookkeeping
(lrmoe_studies.simulator_validation): which runs it validates and how the
per-policy summary reads the errors (hand-made rows; the replay itself is the
simulator's, tested in test_simulate.py)."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import pytest

from lrmoe_studies import simulator_validation as vs
from megatron_lrmoe.launcher.arguments import parse_args
from megatron_lrmoe.tools import run_log


def _row(run: str, fwd: tuple[float, float], bwd: tuple[float, float]) -> dict:
    return {"run": run, "fwd_sim": fwd[0], "fwd_meas": fwd[1], "bwd_sim": bwd[0],
            "bwd_meas": bwd[1], "fwd_err": fwd[0] / fwd[1] - 1, "bwd_err": bwd[0] / bwd[1] - 1}


def test_phase_split_error_ignores_the_machine_speed():
    # A run measured on a day 20% slower in both phases: both errors -1/6, the split exact.
    row = _row("a/x-s1", (100.0, 120.0), (170.0, 204.0))
    assert row["fwd_err"] == pytest.approx(-1 / 6)
    assert vs.phase_split_error(row) == pytest.approx(0.0, abs=1e-12)
    # The backward modelled 10% heavier than the forward.
    assert vs.phase_split_error(_row("a/x-s1", (100.0, 100.0), (187.0, 170.0))) == (
        pytest.approx(0.10))


def test_summary_groups_seeds_and_counts_runs_within_target():
    rows = [_row("screen/pol-s1", (110.0, 100.0), (180.0, 150.0)),     # +10%, +20%
            _row("confirm/pol-s2", (90.0, 100.0), (150.0, 150.0)),     # -10%, 0%
            _row("confirm/pol-s3", (100.0, 100.0), (171.0, 150.0)),    # 0%, +14%
            _row("confirm/other-s1", (100.0, 80.0), (100.0, 100.0))]   # +25%, 0%
    lines = vs.summary_table(rows)
    [pol] = [line for line in lines if line.startswith("| pol |")]
    [other] = [line for line in lines if line.startswith("| other |")]
    cells = [c.strip() for c in pol.strip("|").split("|")]
    assert cells[:6] == ["pol", "3", "+0.0% (-10.0%..+10.0%)", "3/3",
                         "+14.0% (+0.0%..+20.0%)", "2/3"]
    # Phase splits: 1.8/1.5 / 1.1 - 1 = +9.1%, 1/0.9 = +11.1%, +14%: median +11.1%.
    assert cells[6] == "+11.1%"
    assert [c.strip() for c in other.strip("|").split("|")][3] == "0/1"


def test_distinct_runs_keeps_one_copy_of_a_shared_run(tmp_path: Path):
    def run(study: str, name: str, log: str, trace: bool = True) -> Path:
        d = tmp_path / study / "runs" / name
        (d / "routing").mkdir(parents=True)
        (d / "done.json").write_text("{}")
        (d / "log.jsonl").write_text(log)
        if trace:
            (d / "routing" / "header.json").write_text("{}")
        return d

    a = run("screen", "pol-s1", "same log")
    run("confirm", "pol-s1", "same log")                  # the copy: left out
    b = run("confirm", "pol-s2", "another log")
    run("confirm", "pol-s3", "a third log", trace=False)  # no trace: left out
    assert vs.distinct_runs([tmp_path / "screen", tmp_path / "confirm"]) == [a, b]


def test_run_flags_reads_recorded_runs_of_either_launcher_module(tmp_path):
    # A run recorded before the layout by role names megatron_lrmoe.pretrain.
    root = Path(__file__).resolve().parents[2]
    recorded = root / "benchmarks/results/time_to_loss/confirm/runs/lrmoe-hybrid-g0.75-s1/done.json"
    flags = vs.run_flags(recorded)
    assert flags[:2] == ["--config", "configs/time_to_loss.yaml"]
    # A run of today's launcher.
    done = tmp_path / "done.json"
    done.write_text('{"command": "torchrun --nproc-per-node 2 -m '
                    'megatron_lrmoe.launcher.pretrain --seed 3"}')
    assert vs.run_flags(done) == ["--seed", "3"]
    done.write_text('{"command": "torchrun -m something_else --seed 3"}')
    with pytest.raises(ValueError, match="no launcher module"):
        vs.run_flags(done)


def test_an_lrmoe_runs_flags_name_the_defaults_it_ran_under(tmp_path):
    # Oracle: the launcher's parser on the flags the runs were launched with.
    done = tmp_path / "done.json"
    config = str(Path(__file__).resolve().parents[2] / "configs" / "time_to_loss.yaml")
    launched = ["torchrun", "-m", "megatron_lrmoe.launcher.pretrain", "--config", config,
                "--train-iters", "100", "--moe-lrmoe", "--mock-data"]

    def ran(record: dict) -> dict:
        done.write_text(json.dumps({"command": " ".join(launched)} | record))
        args = parse_args(vs.run_flags(done), 2)
        return {"selection": args.moe_lrmoe_selection,
                "gamma": args.moe_lrmoe_bwd_capacity_factor}

    # A record from before the defaults moved: uniform at 1.0, as those runs ran.
    assert ran({}) == {"selection": "uniform", "gamma": 1.0}
    # A record since holds its defaults; the flags it names win over them.
    old = {"--moe-lrmoe-selection": "sample", "--moe-lrmoe-bwd-capacity-factor": "0.6"}
    assert ran({"defaults": old}) == {"selection": "sample", "gamma": 0.6}
    launched += ["--moe-lrmoe-selection", "topk"]
    assert ran({"defaults": old}) == {"selection": "topk", "gamma": 0.6}
    launched += ["--moe-lrmoe-bwd-capacity-factor=0.8"]       # argparse's = form
    assert ran({"defaults": old}) == {"selection": "topk", "gamma": 0.8}
    launched.pop()
    # A config that names a moved option (or LRMoE itself; either spelling of a key) is
    # read as it ran: not pinned.
    named = tmp_path / "named.yaml"
    named.write_text(Path(config).read_text() + "moe-lrmoe: true\nmoe_lrmoe_selection: hybrid\n")
    launched[launched.index(config)] = str(named)
    launched.remove("--moe-lrmoe")
    launched.remove("--moe-lrmoe-selection")
    launched.remove("topk")
    assert ran({}) == {"selection": "hybrid", "gamma": 1.0}
    # What a record written today holds: today's defaults, so it reads as today's parse.
    assert ran({"defaults": vs.recorded_defaults()})["gamma"] == parse_args(
        launched[3:], 2).moe_lrmoe_bwd_capacity_factor


def test_run_setting_resolves_a_held_runs_auto_budget_as_its_launcher_did(monkeypatch):
    # A run held to a device (--moe-lrmoe-memory-budget-gb auto --device-memory-gb) is
    # replayed at the budget its launcher resolved and logged while it trained.
    root = Path(__file__).resolve().parents[2]
    run = root / ("benchmarks/results/time_to_loss/h384_f1024_mb4/held_d1/manpages/runs/"
                  "lrmoe-uniform-g1.0-ma-s1")
    monkeypatch.chdir(root)   # the recorded flags name --config relative to the checkout
    flags = [*vs.reference_flags(run), "--mock-data"]   # as validate_run replays it
    assert flags[flags.index("--moe-lrmoe-memory-budget-gb") + 1] == "auto"
    logged = re.search(r"--moe-lrmoe-memory-budget-gb ([0-9.]+):",
                       run_log.read_text(run / "stdout.txt"))
    _, policy, budget_gib, ep = vs.run_setting(flags, 2)
    assert policy.budget and ep == 2
    assert budget_gib == pytest.approx(float(logged.group(1)), abs=1e-6)


def test_recompute_reruns_count_each_rerun_forward_in_the_phase_the_timer_sees():
    from dataclasses import replace

    from megatron_lrmoe.planning.shapes import MoEShape

    shape = MoEShape(num_layers=2, hidden_size=8, ffn_hidden_size=16, num_experts=4, topk=2,
                     tokens_per_rank=32, gated=True, dtype_bytes=4)
    assert vs.recompute_reruns(shape) == (0, 0)
    assert vs.recompute_reruns(replace(shape, recompute_moe=True)) == (0, 2)
    assert vs.recompute_reruns(replace(shape, full_recompute_layers=1)) == (1, 0)
    assert vs.recompute_reruns(replace(shape, full_recompute_layers=5)) == (2, 0)


def test_reference_flags_keep_the_model_and_batch_only(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    flags = ["--config", "c.yaml", "--seed", "3", "--hidden-size", "384", "--data-path",
             "data/x", "--record-routing", "run/routing", "--moe-lrmoe", "--log-interval", "15"]
    command = ["python", "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m",
               "megatron_lrmoe.launcher.pretrain", *flags, "--log-json", "run/log.jsonl"]
    (run / "done.json").write_text(json.dumps({"command": " ".join(command)}))
    assert vs.reference_flags(run) == ["--config", "c.yaml", "--hidden-size", "384",
                                       "--moe-lrmoe", *itertools.chain(*vs.MOVED_DEFAULTS.items())]
