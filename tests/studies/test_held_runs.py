"""Named policies held to a device (lrmoe_studies.held_runs, run by
benchmarks/studies/held_runs.py): a name gives the flags the time-to-loss driver ran it
with, and a run's row is read from its log as documented."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from lrmoe_studies import held_runs as hr
from lrmoe_studies.simulator_validation import MOVED_DEFAULTS
from megatron_lrmoe.launcher.arguments import parse_args

ROOT = Path(__file__).resolve().parents[2]
SCREEN = Path("benchmarks/results/time_to_loss/ep_study_ep16/held/screen")


@pytest.mark.parametrize("name", ["symi@recompute_full_2_+_slots_14",
                                  "symi@recompute_moe_+_slots_17", "lrmoe-uniform-g1.0-ma"])
def test_a_named_run_gets_the_flags_the_drivers_run_of_that_name_had(name, corpus,
                                                                     monkeypatch):
    # Oracle: the command the time-to-loss driver ran for the EP 16 screen's run of that
    # name (its done.json), the corpus path aside, read by the launcher's parser with the
    # defaults it ran under (the options whose defaults moved since, at their old values).
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("WORLD_SIZE", raising=False)     # the flags' own world size
    run_dir = SCREEN / "runs" / f"{name}-s1"
    command = shlex.split(json.loads((run_dir / "done.json").read_text())["command"])
    ran = command[command.index("megatron_lrmoe.launcher.pretrain") + 1:
                  command.index("--log-json")]
    ran[ran.index("--data-path") + 1] = corpus
    ran += [word for flag, value in MOVED_DEFAULTS.items() if flag not in ran
            for word in (flag, value)]
    base = hr.base_flags("configs/ep_study.yaml", 16, 300, 50, 20, data_path=corpus)
    assert vars(parse_args(hr.run_flags(name, base, 1, 0.0457, run_dir), 16)) == vars(
        parse_args(ran, 16))


def test_a_name_the_fitting_has_no_configuration_for_is_refused(corpus, monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    base = hr.base_flags("configs/ep_study.yaml", 16, 60, 30, 10, data_path=corpus)
    with pytest.raises(SystemExit, match="slots 200"):
        hr.policy_flags("symi@slots_200", base)
    with pytest.raises(SystemExit, match="unknown policy .*selection 'unif'"):
        hr.policy_flags("lrmoe-unif-g0.3-ma", base)


def _step(i, fwd, bwd, peak, **lrmoe):
    return {"iteration": i, "lm-loss": 5.0 - 0.1 * i, "step-time-s": fwd + bwd + 0.5,
            "moe-forward-s": fwd, "moe-backward-s": bwd, "memory-predicted-peak-gib": peak,
            **lrmoe}


def _interval(replicas, median, worst, adjusted, retained):
    return {f"lrmoe/layer{n}/replicas": r for n, r in enumerate(replicas, 1)} | {
        "lrmoe/load-max-over-mean-median": median, "lrmoe/load-max-over-mean": worst,
        "lrmoe/budget-adjusted-calls": adjusted, "lrmoe/retained-fraction": retained,
        "lrmoe/backward-bytes-saved": 0.0}


def test_a_runs_row_is_read_from_its_log_as_documented():
    # 20 steps, log interval 5: steady steps 3-20 (past the first tenth), intervals past
    # the first: steps 10, 15, 20.
    lrmoe = {5: _interval([0, 0], 3.0, 5.0, 2, 0.8), 10: _interval([4, 7], 1.2, 2.0, 1, 0.9),
             15: _interval([6, 7], 1.1, 1.5, 0, 1.0), 20: _interval([5, 9], 1.4, 1.6, 0, 1.0)}
    records = [_step(i, 1.0 if i > 2 else 9.0, 0.5 if i % 2 else 0.7, 0.03 + 0.001 * (i == 4),
                     **lrmoe.get(i, {})) for i in range(1, 21)]
    stdout = ("planner: --moe-lrmoe-memory-budget-gb 0.0207767: at balanced routing the MoE "
              "layers fit\n")
    row = hr.summarize_run(records, stdout)
    assert row["steps"] == 20 and row["steady_from"] == 3
    assert row["replicas_per_layer"] == [5, 7]                 # medians of (4, 6, 5), (7, 7, 9)
    assert row["predicted_peak_gib"] == pytest.approx(0.031)    # step 4's, all steps
    assert row["moe_budget_gib"] == 0.0207767
    assert row["load_max_over_mean"] == 1.2 and row["load_worst"] == 5.0
    # Steps 3-20: 9 odd steps at 1.5 s, 9 even at 1.7 s; the median of each phase.
    assert row["moe_s_per_step"] == pytest.approx(1.6)
    assert row["moe_fwd_ms"] == pytest.approx(1000.0) and row["moe_bwd_ms"] == pytest.approx(600.0)
    assert row["other_s_per_step"] == pytest.approx(0.5)
    assert row["retained"] == pytest.approx(0.925) and row["budget_adjusted_calls"] == 3
    assert row["final_loss"] == pytest.approx(3.0)


def test_the_report_has_a_row_per_run_and_a_stopped_run_says_why(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)               # the base flags name the config from here
    base = hr.base_flags("configs/ep_study.yaml", 16, 20, 10, 5)
    ok = tmp_path / "runs" / "lrmoe-uniform-g1.0-ma-s1"
    stopped = tmp_path / "runs" / "lrmoe-uniform-ginf-ma-s1"
    for run, extra in ((ok, {}), (stopped, {"failed": "out of memory at step 1 on rank 4: "
                                                      "needs 49.10 MiB. To fit: lower it"})):
        run.mkdir(parents=True)
        (run / "done.json").write_text(json.dumps({"command": "c", "wall_s": 60.0,
                                                   "code": "commit abc"} | extra))
    records = [_step(i, 1.0, 0.5, 0.04, **(_interval([3], 1.1, 2.0, 0, 1.0) if i % 5 == 0
                                            else {})) for i in range(1, 21)]
    (ok / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (ok / "stdout.txt").write_text("no budget line\n")
    rows = hr.write_report(tmp_path, ["lrmoe-uniform-ginf-ma", "lrmoe-uniform-g1.0-ma"], 1,
                           "cmd", base, 0.0457)
    assert [r["run"] for r in rows] == ["lrmoe-uniform-ginf-ma-s1", "lrmoe-uniform-g1.0-ma-s1"]
    md = (tmp_path / "report.md").read_text()
    assert "| lrmoe-uniform-ginf-ma-s1 | stopped: out of memory at step 1 on rank 4: needs " \
           "49.10 MiB |" in md and "To fit" not in md
    assert "| lrmoe-uniform-g1.0-ma-s1 | 3 | 0.0400 / 0.0457 | - | 1.100 / 2.000 | 1.500 |" in md
    assert "16 ranks x 1 thread" in md and "Code of the runs: commit abc." in md
    assert json.loads((tmp_path / "report.json").read_text())["rows"][1]["replicas_per_layer"] \
        == [3]
