"""The time-to-loss study driver (lrmoe_studies.time_to_loss, run by
benchmarks/studies/time_to_loss.py) and its policies: its analysis, and a CI-sized
run whose table must be well formed (its numbers are not checked: tiny and noisy)."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import zipfile
from pathlib import Path

import pytest

from lrmoe_studies import fitting
from lrmoe_studies import largest_micro_batch as lmb
from lrmoe_studies import time_to_loss as ttl
from lrmoe_studies import time_to_loss_policies as ttp
from lrmoe_studies.simulator_validation import reference_flags
from megatron_lrmoe.tools import run_log

ROOT = Path(__file__).resolve().parents[2]


def test_smoothed_is_a_trailing_mean():
    assert ttl.smoothed([4.0, 2.0, 6.0, 0.0], 2) == [4.0, 3.0, 4.0, 3.0]
    assert ttl.smoothed([1.0, 2.0], 5) == [1.0, 1.5]


def _records(losses, moe_per_step=0.5, val=None):
    out = []
    for i, loss in enumerate(losses, start=1):
        r = {"iteration": i, "lm-loss": loss, "moe-cumulative-s": moe_per_step * i,
             "moe-forward-s": moe_per_step / 3, "moe-backward-s": 2 * moe_per_step / 3,
             "step-time-s": 2 * moe_per_step}
        if val and i in val:
            r["validation-loss"] = val[i]
        out.append(r)
    return out


def test_targets_and_time_to_target():
    reference = _records([8, 7, 6, 5, 4, 3])
    targets = ttl.targets_from(reference, steps=4, window=1)
    assert targets == {0.5: 7, 0.75: 6, 1.0: 5}
    slower = ttl.analyse_run(_records([9, 8, 7, 6, 5, 4], moe_per_step=0.25, val={4: 6.5}),
                             targets, steps=4, window=1)
    assert slower["reached"][0.5] == {"step": 3, "moe_s": 0.75, "step_s": 1.5}
    assert slower["reached"][1.0] == {"step": 5, "moe_s": 1.25, "step_s": 2.5}
    assert slower["val_at_steps"] == 6.5
    assert slower["moe_fwd_ms"] == pytest.approx(1e3 * 0.25 / 3)
    assert slower["moe_bwd_ms"] == pytest.approx(2e3 * 0.25 / 3)
    never = ttl.analyse_run(_records([9, 9, 9, 9, 9, 9]), targets, steps=4, window=1)
    assert never["reached"][1.0] is None
    rows = ttl.summarize({("megatron-dropless", 1): ttl.analyse_run(reference, targets, 4, 1),
                          ("lrmoe-x", 1): slower, ("lrmoe-never", 1): never})
    by_name = {r["policy"]: r for r in rows}
    assert by_name["lrmoe-x"]["moe_vs_dropless_1.0"] == pytest.approx(1.25 / 2.0)
    assert by_name["lrmoe-never"]["steps_1.0"] is None
    assert rows[0]["policy"] == "megatron-dropless"
    seeds = {r["policy"]: r for r in ttl.per_seed({
        ("megatron-dropless", 1): ttl.analyse_run(reference, targets, 4, 1,),
        ("lrmoe-x", 1): slower, ("lrmoe-never", 1): never})}
    # 1.25 s against dropless's 2.0 s to the 100% target; no SYMI-style run of the seed.
    assert seeds["lrmoe-x"]["vs_megatron-dropless"] == pytest.approx(0.625)
    assert seeds["lrmoe-x"]["vs_symi"] is None and seeds["lrmoe-never"]["moe_s"] is None
    assert seeds["lrmoe-never"]["vs_megatron-dropless"] is None
    assert seeds["megatron-dropless"]["vs_megatron-dropless"] == 1.0


def test_fitted_runs_compare_with_the_fastest_fitted_baseline():
    """A device-held study: each baseline ran as fitted configurations; ratios are to the
    seed's fastest of them, at the training-loss and the validation-loss targets."""
    reference = _records([8, 7, 6, 5, 4, 3], val={2: 7.5, 4: 5.5})
    targets = ttl.targets_from(reference, steps=4, window=1)
    val_target = ttl.val_target_from(reference, steps=4)
    assert val_target == 5.5

    def run(moe, losses=(9, 7, 6, 5, 4, 3), val=None):
        return ttl.analyse_run(_records(list(losses), moe_per_step=moe,
                                        val=val or {2: 7.0, 4: 5.4}), targets, 4, 1,
                               val_target)

    per_run = {
        ("megatron-dropless@micro-batch_2", 1): run(1.0),
        ("megatron-dropless@recompute_moe", 1): run(1.5),
        ("symi@slots_9", 1): run(0.8),
        ("lrmoe-x", 1): run(0.4, val={2: 6.0, 4: 5.0}),
        ("unconstrained/megatron-dropless", 1): run(0.1),
    }
    # Its evaluations: 6.0 at step 2 (above 5.5), 5.0 at step 4.
    assert per_run[("lrmoe-x", 1)]["reached_val"] == {"step": 4, "moe_s": 1.6, "step_s": 3.2}
    assert ttl.fastest(per_run, "megatron-dropless", 1)["moe_s"] == 4.0   # not 6.0, not 0.4
    rows = {r["policy"]: r for r in ttl.summarize(per_run)}
    lrmoe = rows["lrmoe-x"]
    assert lrmoe["moe_vs_dropless_1.0"] == pytest.approx(1.6 / 4.0)
    assert lrmoe["moe_vs_symi_1.0"] == pytest.approx(1.6 / 3.2)
    assert lrmoe["moe_vs_dropless_val"] == pytest.approx(1.6 / 4.0)
    assert lrmoe["step_s_1.0"] == pytest.approx(3.2)
    assert rows["megatron-dropless@micro-batch_2"]["fitted"] == "micro-batch 2"
    assert lrmoe["fitted"] == "none"
    assert ttl.fitted_name("symi", "slots 9") == "symi@slots_9"
    assert ttl.fitted_name("symi", "none") == "symi"
    seeds = {r["policy"]: r for r in ttl.per_seed(per_run)}
    assert seeds["lrmoe-x"]["vs_megatron-dropless"] == pytest.approx(0.4)
    # Validation loss at equal steps against the fastest fitted dropless run (the same
    # training as dropless, in the study's code: 5.0 vs 5.2), else the unconstrained one.
    per_run[("megatron-dropless@micro-batch_2", 1)] = run(1.0, val={2: 7.0, 4: 5.2})
    seeds = {r["policy"]: r for r in ttl.per_seed(per_run)}
    assert seeds["lrmoe-x"]["val_vs_dropless"] == pytest.approx(5.0 / 5.2 - 1)
    del per_run[("megatron-dropless@micro-batch_2", 1)], per_run[
        ("megatron-dropless@recompute_moe", 1)]
    seeds = {r["policy"]: r for r in ttl.per_seed(per_run)}
    assert seeds["lrmoe-x"]["val_vs_dropless"] == pytest.approx(5.0 / 5.4 - 1)


def test_speed_blocks_are_medians_of_each_block():
    records = _records([5, 4, 3, 2, 1], moe_per_step=0.5)     # steps of 1.0 s, MoE 0.5
    records[1]["step-time-s"] = 3.0                            # one slow step outside MoE
    records[4]["moe-forward-s"] += 1.0
    records[4]["step-time-s"] += 1.0
    assert ttl.speed_blocks(records, 2) == [
        (2, pytest.approx(1.5), pytest.approx(0.5)),           # median of 0.5 and 2.5
        (4, pytest.approx(0.5), pytest.approx(0.5)),
        (5, pytest.approx(0.5), pytest.approx(1.5))]


def test_rounds_alternate_the_order_of_the_runs():
    assert ttl.schedule(["a", "b", "c"], 3) == [
        (0, "a"), (0, "b"), (0, "c"), (1, "c"), (1, "b"), (1, "a"),
        (2, "a"), (2, "b"), (2, "c")]
    assert ttl.schedule(["a", "b"], 1) == [(0, "a"), (0, "b")]


def test_a_segment_stopped_midway_keeps_the_log_up_to_its_checkpoint(tmp_path):
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in _records([5, 4, 3, 2])))
    ttl._truncate_log(log, 2)
    assert [r["iteration"] for r in run_log.read_records(log)] == [1, 2]
    ttl._truncate_log(log, 0)
    assert not log.exists()


def test_a_run_ahead_of_its_round_waits(tmp_path, monkeypatch):
    # An interrupted study resumes with one run a segment ahead: it trains nothing in the
    # round it has already finished (no launcher starts) and keeps its log.
    from megatron_lrmoe.launcher.checkpointing import TRACKER_FILE

    run = tmp_path / "run-s1"
    (run / ttl.CHECKPOINT).mkdir(parents=True)
    (run / ttl.CHECKPOINT / TRACKER_FILE).write_text("3")
    (run / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _records([5, 4, 3])))
    monkeypatch.setattr(ttl.subprocess, "call", lambda *a, **k: pytest.fail("a run started"))
    assert ttl.run_one(run, [], 29599, segment=3, total=6, until=3) is None
    assert len(run_log.read_records(run / "log.jsonl")) == 3
    assert (run / "log.jsonl").is_file()         # a run in progress keeps its log plain


def test_a_studys_report_renders_again_from_its_stored_logs(tmp_path, monkeypatch):
    # The study held to D1 on the man pages: its runs' compressed logs (copied alone) and
    # those of the unconstrained study beside it give the committed report.md and
    # report.json again. What the logs do not hold comes from the committed report: the
    # command, the machine's core count, and the device's predictions made before the
    # runs (budget, binding, feasibility table: the cost model's, which moved since).
    study = ROOT / "benchmarks/results/time_to_loss/h384_f1024_mb4/held_d1/manpages"
    md, committed = (study / "report.md").read_text(), (study / "report.json").read_text()
    command = re.search(r"^Command: `(.*)`$", md, re.MULTILINE).group(1)
    cores = int(re.search(r"on (\d+) cores", md).group(1))
    feasibility = md.split("\n## Feasibility (predicted before the runs)\n\n")[1]
    args = ttl.parse_args(shlex.split(command)[2:])
    stage, base = ttl.study_setup(args)
    predicted = json.loads(committed)
    device = ttl.Device(args.device_gib, predicted["budget_gib"], predicted["binding"],
                        feasibility.removesuffix("\n"), args.unconstrained_dir)
    out = tmp_path / "study"
    for done in sorted(study.glob("runs/*/done.json")):
        (out / "runs" / done.parent.name).mkdir(parents=True)
        for name in ("done.json", "log.jsonl.xz"):
            shutil.copy(done.parent / name, out / "runs" / done.parent.name)
    monkeypatch.chdir(ROOT)           # the command names the unconstrained study from here
    monkeypatch.setattr(ttl.os, "cpu_count", lambda: cores)
    rows = ttl.write_report(out, stage, args.stage, command, base, "auto", device, plots=False)
    assert len(rows) == 9 and not (out / "report").exists()
    assert (out / "report.md").read_text() == md
    assert (out / "report.json").read_text() == committed


def test_every_policy_has_the_flags_it_names():
    table = ttp.policies(0.5)
    assert table["megatron-dropless"] == []
    assert "--moe-lrmoe" not in table["megatron-capacity-1.0"]
    symi = table["symi"]
    assert symi[symi.index("--moe-lrmoe-placement") + 1] == "popularity"
    assert symi[symi.index("--moe-lrmoe-bwd-capacity-factor") + 1] == "inf"
    for selection in ttp.SELECTIONS:
        flags = table[f"lrmoe-{selection}-g0.75-ma"]
        assert flags[flags.index("--moe-lrmoe-selection") + 1] == selection
        assert flags[flags.index("--moe-lrmoe-placement") + 1] == "memory-aware"
        assert flags[flags.index("--moe-lrmoe-memory-budget-gb") + 1] == "0.5"
    for gamma in ("inf", "1.0", "0.75", "0.5"):     # the planner's range, memory-aware
        flags = table[f"lrmoe-uniform-g{gamma}-ma"]
        assert flags[flags.index("--moe-lrmoe-bwd-capacity-factor") + 1] == gamma
        assert flags[flags.index("--moe-lrmoe-selection") + 1] == "uniform"
        assert flags[flags.index("--moe-lrmoe-placement") + 1] == "memory-aware"
        assert flags[flags.index("--moe-lrmoe-memory-budget-gb") + 1] == "0.5"


def test_ci_sized_study_writes_a_well_formed_table(tmp_path, corpus, monkeypatch, capsys):
    # The driver runs in this process (its interpreter start is not what is tested); each
    # of its runs is still a real torchrun of the launcher on 2 ranks, as in the study.
    monkeypatch.chdir(ROOT)                     # the driver names configs/ relative to it
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("WORLD_SIZE", raising=False)     # the driver never reads it
    out = tmp_path / "study"
    argv = ["--stage", "ci", "--out-dir", str(out), "--policies", "lrmoe-uniform-g0.75",
            "--data-path", str(Path(corpus)), "--data-cache-path", str(tmp_path / "cache"),
            "--port", "29547", "--microbatches", "2"]
    assert ttl.main(argv) == 0
    report = json.loads((out / "report.json").read_text())
    assert [r["policy"] for r in report["rows"]] == ["megatron-dropless", "lrmoe-uniform-g0.75"]
    for row in report["rows"]:
        assert row["seeds"] == 1
        assert 0.0 < row["retained"] <= 1.0
        assert row["moe_s_per_step"] > 0
        assert row["val_at_steps"] is not None
    assert report["rows"][1]["retained"] < 1.0          # capacity 0.75 drops
    summary, seeds = (out / "report.md").read_text().split("Per seed:")
    main_table, fitted_table = [[line for line in block.splitlines() if line.startswith("|")]
                                for block in summary.split("\n\n") if block.startswith("|")]
    assert len(main_table) == 2 + 2 and len(fitted_table) == 2 + 2
    assert all(line.count("|") == len(ttl.COLUMNS) + 1 for line in main_table)
    assert [line.split(" | ")[1] for line in fitted_table[2:]] == ["none", "none"]
    by_seed = [line for line in seeds.splitlines() if line.startswith("| 1 |")]
    assert [line.split(" | ")[1] for line in by_seed] == ["megatron-dropless",
                                                         "lrmoe-uniform-g0.75"]
    assert (out / "loss_vs_moe_time.png").stat().st_size > 0
    # Study parameters in the report; each run's routing recorded for the simulator.
    assert "2 micro-batch(es) per step on 2 ranks" in (out / "report.md").read_text()
    for run in ("megatron-dropless-s1", "lrmoe-uniform-g0.75-s1"):
        assert (out / "runs" / run / "routing" / "header.json").is_file()
        # Finished: its log stored compressed, its routing record repacked.
        assert (out / "runs" / run / "log.jsonl.xz").is_file()
        assert not (out / "runs" / run / "log.jsonl").exists()
        for chunk in (out / "runs" / run / "routing").glob("counts_*.npz"):
            with zipfile.ZipFile(chunk) as packed:
                assert {i.compress_type for i in packed.infolist()} == {zipfile.ZIP_LZMA}
    # The stage's run report, over both runs (the LRMoE run logs its statistics).
    for name in ("loss.png", "moe_time.png", "lrmoe.png", "routed_load.png", "index.md"):
        assert (out / "report" / name).stat().st_size > 0
    assert "| lrmoe-uniform-g0.75-s1 |" in (out / "report" / "index.md").read_text()
    for run in ("megatron-dropless-s1", "lrmoe-uniform-g0.75-s1"):   # the torchrun commands
        assert "torch.distributed.run" in json.loads(
            (out / "runs" / run / "done.json").read_text())["command"]
    # Resumable: a second invocation finds both runs done and only rewrites the report.
    # (From here on without plots: their drawing is checked above and costs seconds.)
    argv = [*argv, "--no-plots"]
    capsys.readouterr()
    assert ttl.main(argv) == 0
    assert capsys.readouterr().out.count("done (0 s)") == 2

    # In rounds (--rounds 2: 3 of the 6 steps per round, each run resumed from its
    # checkpoint): the same training as the uninterrupted runs above, step for step.
    rounds = tmp_path / "rounds"
    argv_rounds = [*argv[:2], "--out-dir", str(rounds), *argv[4:], "--rounds", "2"]
    capsys.readouterr()
    assert ttl.main(argv_rounds) == 0
    printed = [line for line in capsys.readouterr().out.splitlines()
               if line.startswith("[time_to_loss]")]
    assert [line.split(":")[0].split()[1] for line in printed] == [
        "megatron-dropless-s1", "lrmoe-uniform-g0.75-s1",      # round 1
        "lrmoe-uniform-g0.75-s1", "megatron-dropless-s1"]      # round 2, reversed
    for run in ("megatron-dropless-s1", "lrmoe-uniform-g0.75-s1"):
        whole, in_rounds = (run_log.read_records(d / "runs" / run / "log.jsonl")
                            for d in (out, rounds))
        assert [r["iteration"] for r in in_rounds] == list(range(1, 7))
        assert [r["lm-loss"] for r in in_rounds] == [r["lm-loss"] for r in whole]
        done = json.loads((rounds / "runs" / run / "done.json").read_text())
        assert done["rounds"]["steps_per_round"] == 3 and len(done["rounds"]["wall_s"]) == 2
        assert not (rounds / "runs" / run / ttl.CHECKPOINT).exists()
    assert json.loads((rounds / "report.json").read_text())["rows"][1]["other_s_per_step"] > 0
    with pytest.raises(SystemExit, match="--rounds 4: a run's 6 steps must split"):
        ttl.main([*argv_rounds[:-1], "4"])

    # Held to a device (the fitted driver): the unconstrained study above sets the
    # targets and stays in the report; dropless runs as its two best-predicted fitting
    # configurations. A device this large binds nothing, so every candidate fits.
    held = tmp_path / "held"
    argv_held = [*argv[:2], "--out-dir", str(held), *argv[4:], "--device-gib", "64",
                 "--unconstrained-dir", str(out)]
    assert ttl.main(argv_held) == 0
    report = json.loads((held / "report.json").read_text())
    assert report["device_gib"] == 64 and report["binding"] is False
    assert 0 < report["budget_gib"] < 64
    rows = {r["policy"]: r for r in report["rows"]}
    fitted = [name for name in rows if name.startswith("megatron-dropless")]
    assert len(fitted) == 2 and {rows[n]["fitted"] for n in fitted} <= {
        "none", "recompute moe", "recompute full 1", "micro-batch 1"}
    assert rows["lrmoe-uniform-g0.75"]["fitted"] == "none"
    lrmoe_run = held / "runs" / "lrmoe-uniform-g0.75-s1" / "done.json"    # under auto
    assert "--moe-lrmoe-memory-budget-gb auto" in json.loads(lrmoe_run.read_text())["command"]
    # The unconstrained rows compare with the held runs too (what fitting cost).
    assert rows["unconstrained/megatron-dropless"]["moe_vs_dropless_1.0"] > 0
    for name in [*fitted, "lrmoe-uniform-g0.75"]:
        run = held / "runs" / f"{ttl.fitted_name('x', 'none').replace('x', name)}-s1"
        command = json.loads((run / "done.json").read_text())["command"]
        assert "--device-memory-gb 64" in command
    text = (held / "report.md").read_text()
    assert "## Feasibility (predicted before the runs)" in text and "| 64 |" in text

    # The confirmation names the configuration the screen measured faster: only it runs
    # (here listed, not run); one that does not fit the device is refused by name.
    capsys.readouterr()
    pick = fitted[1]
    pinned = pick if "@" in pick else f"{pick}@none"
    assert argv_held[4] == "--policies"
    argv_list = [*argv_held[:5], pinned, *argv_held[6:], "--list"]
    assert ttl.main(argv_list) == 0
    listed = [line.split(":", 1)[0] for line in capsys.readouterr().out.splitlines()]
    assert listed == [pick]
    tiny = [*argv_list[:argv_list.index("--device-gib") + 1], "0.000001",
            *argv_list[argv_list.index("--device-gib") + 2:]]
    with pytest.raises(SystemExit, match=f"--policies {pinned}: not a configuration"):
        ttl.main(tiny)

    # The largest micro-batch held to a device, measured, on the reference run above: on
    # a device between the model's needs at micro-batches 1 and 2 (the prediction the
    # tool reports, from the reference run's routing), 1 trains and 2 stops out of memory,
    # which is the measurement; what it logged agrees with the model's side of the device.
    def peak(run: Path) -> float:
        rows = run_log.read_records(run / "log.jsonl")
        return max(r["memory-predicted-peak-gib"] for r in rows if "memory-predicted-peak-gib" in r)

    reference = out / "runs" / "megatron-dropless-s1"
    traces, outside = fitting.reference_run(reference)
    calibration = json.loads((ROOT / ttl.CALIBRATION).read_text())
    flags = ttl.on_device(ttp.policies("auto")["megatron-dropless"])
    one, two = (fitting.largest_micro_batch(
        [*reference_flags(reference), "--mock-data"], "megatron-dropless", flags, 64.0, traces,
        calibration, outside, limit=m, world_size=2)[1].need / 2**30 for m in (1, 2))
    assert one < two
    device = (one + two) / 2
    common = ["--run", str(reference), "--policies", "megatron-dropless", "--steps", "2",
              "--limit", "2", "--data-path", str(Path(corpus)), "--data-cache-path",
              str(tmp_path / "cache"), "--port", "29549"]
    tight = tmp_path / "largest_tight"
    assert lmb.main(["--device-gib", f"{device:.6f}", "--out-dir", str(tight), *common]) == 0
    row = json.loads((tight / "report.json").read_text())["rows"][0]
    assert row["measured"] == 1 and row["stopped"].startswith("2: out of memory at step")
    assert row["predicted"] == 1 and row["measured_ms_per_1k_tokens"] > 0
    assert peak(tight / "runs" / "megatron-dropless-mb1") < device
    table = (tight / "report.md").read_text()
    assert "| megatron-dropless |" in table
    # the table shows the stop's need and device; the whole message is in report.json
    assert "2: out of memory at step" in table and "predicted peak" not in table
    assert "predicted peak" in row["stopped"]


def test_the_runs_start_one_rank_per_expert_parallel_rank(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("WORLD_SIZE", raising=False)     # the driver never reads it
    _, base = ttl.study_setup(ttl.parse_args(["--stage", "ci"]))
    # The EP 2 study as before: its config's EP, no EP flag, the 2-rank torchrun.
    assert base[:2] == ["--config", "configs/time_to_loss.yaml"]
    assert "--expert-model-parallel-size" not in base
    assert ttl.run_command(tmp_path, base, 29500)[:9] == [
        ttl.sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-port", "29500", "-m", "megatron_lrmoe.launcher.pretrain"]
    assert ttl.run_command(tmp_path, [], 29500)[4] == "2"     # no flags: the study's config
    _, base4 = ttl.study_setup(ttl.parse_args(["--stage", "ci", "--ep", "4",
                                               "--microbatches", "3"]))
    command = ttl.run_command(tmp_path, base4, 29500)
    assert command[command.index("--nproc-per-node") + 1] == "4"
    assert command[command.index("--expert-model-parallel-size") + 1] == "4"
    assert ttp.flag_or_config(base4, "global-batch-size") == str(2 * 4 * 3)
    assert "3 micro-batch(es) per step on 4 ranks" in ttl.study_parameters(base4)
    # The memory budget validates the flags at 4 ranks (at 2, EP 4 is refused).
    assert ttp.study_budget_gb(base4, 2.0) > 0
    # Another config: its values, and the EP the command line gives.
    _, base16 = ttl.study_setup(ttl.parse_args(["--config", "configs/ep_study.yaml",
                                                "--ep", "16"]))
    assert ttp.flag_or_config(base16, "num-experts") == 128
    assert ttl.run_command(tmp_path, base16, 29500)[4] == "16"
    assert "1 micro-batch(es) per step on 16 ranks" in ttl.study_parameters(base16)
    with pytest.raises(SystemExit, match="--expert-model-parallel-size: .* give it .*--ep"):
        ttp.world_size(["--config", "configs/ep_study.yaml"])


def test_a_corpus_not_prepared_is_one_error_line_before_any_run(tmp_path, capsys, monkeypatch):
    """The driver on a --data-path that was never prepared: one ``error:`` line naming the
    flag and the command that prepares it, status 2, nothing launched."""
    monkeypatch.setattr(ttl, "run_one", lambda *a, **k: pytest.fail("a run was launched"))
    missing = tmp_path / "corpus"
    status = ttl.main(["--stage", "curve-ci", "--out-dir", str(tmp_path / "out"),
                       "--data-path", str(missing)])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2
    assert len(err) == 1 and err[0].startswith("error: --data-path "), err
    assert f"data.prepare --output-prefix {missing}" in err[0]
    assert not (tmp_path / "out").exists()
