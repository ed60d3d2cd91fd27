"""The time-to-loss curve (lrmoe_studies.time_to_loss_curve, the driver's ``curve``
stage): policy names for any gamma and metric, the pairing of every run with its seed's
dropless run, and a smoke run of two 5-step policies whose pairing table is checked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lrmoe_studies import time_to_loss as ttl
from lrmoe_studies import time_to_loss_curve as curve
from lrmoe_studies import time_to_loss_policies as ttp
from megatron_lrmoe.tools import run_log

ROOT = Path(__file__).resolve().parents[2]


def test_a_policy_name_spells_its_flags():
    table = ttp.policies(0.5)
    assert table["lrmoe-sample-prob-g0.45-ma"] == [
        "--moe-lrmoe", "--moe-lrmoe-selection", "sample", "--moe-lrmoe-metric", "prob",
        "--moe-lrmoe-bwd-capacity-factor", "0.45", "--moe-lrmoe-placement", "memory-aware",
        "--moe-lrmoe-memory-budget-gb", "0.5"]
    # The stored studies' names keep their flags (no metric flag: the launcher's default).
    assert table["lrmoe-uniform-g0.75-m0.25"] == [
        "--moe-lrmoe", "--moe-lrmoe-selection", "uniform", "--moe-lrmoe-bwd-capacity-factor",
        "0.75", "--moe-lrmoe-min-retention", "0.25"]
    for name in ("lrmoe-uniform-g0.3-ma", "lrmoe-hybrid-grad_act-g0.6-m0.1-ma",
                 "lrmoe-topk-ginf", *ttl.CURVE_POLICIES):
        assert ttp.LRMoEPolicy.parse(name).name == name and name in table
    # Iteration is the listed policies only; a parsed name is found, not listed.
    assert "lrmoe-uniform-g0.3-ma" not in list(table) and "symi" in list(table)
    assert len(ttl.CURVE_POLICIES) == 11
    # A selection with a hyphen in it, with and without a metric.
    assert table["lrmoe-two-stage-g0.3-ma"][:4] == [
        "--moe-lrmoe", "--moe-lrmoe-selection", "two-stage", "--moe-lrmoe-bwd-capacity-factor"]
    assert ttp.LRMoEPolicy.parse("lrmoe-two-stage-prob-g0.3").metric == "prob"


@pytest.mark.parametrize("name, problem", [
    ("lrmoe-unif-g0.4", "selection 'unif' is not one of topk, sample, uniform, hybrid, "
                        "two-stage (--moe-lrmoe-selection)"),
    ("lrmoe-sample-foo-g0.4", "metric 'foo' is not one of"),
    ("lrmoe-uniform-g0", "--moe-lrmoe-bwd-capacity-factor: must be > 0 or inf, got 0"),
    ("lrmoe-uniform-g0.4-m1.5", "--moe-lrmoe-min-retention: must be in [0, 1], got 1.5"),
    ("lrmoe-uniform-g1..0", "--moe-lrmoe-bwd-capacity-factor: not a number"),
    ("capacity-drop", "neither a baseline"),
])
def test_a_wrong_policy_name_says_what_is_wrong(name, problem):
    assert problem in ttp.Policies.problem(name)
    assert name not in ttp.policies(0.5)
    with pytest.raises(KeyError):
        ttp.policies(0.5)[name]


def _records(losses, retained=None, adjusted=0.0, val=None):
    """Per-step records; LRMoE statistics every step from ``retained``."""
    out = []
    for i, loss in enumerate(losses, start=1):
        r = {"iteration": i, "lm-loss": loss, "moe-forward-s": 0.1, "moe-backward-s": 0.2,
             "step-time-s": 0.5}
        if retained is not None:
            r.update({"lrmoe/retained-fraction": retained[i - 1],
                      "lrmoe/budget-adjusted-calls": adjusted,
                      "lrmoe/backward-bytes-saved": 1.0, "lrmoe/load-max-over-mean": 1.0})
        if val and i in val:
            r["validation-loss"] = val[i]
        out.append(r)
    return out


def test_each_run_pairs_with_its_seeds_dropless_run(tmp_path):
    dropless = _records([9, 8, 7, 6, 5, 5, 5, 5], val={4: 6.0})
    targets = {1: ttl.targets_from(dropless, steps=4, window=1)}
    assert targets[1][1.0] == 6
    logs = {
        ("megatron-dropless", 1): dropless,
        # Reaches 6 at step 6: within the cap (2 x 4 steps); step 1 (static) retains all.
        ("lrmoe-uniform-g0.5-ma", 1): _records([9, 8.5, 8, 7, 6.5, 6, 5, 5],
                                                retained=[1.0, 0.5, 0.48, 0.5, 0.52, 0.5,
                                                          0.5, 0.5], val={4: 6.6}),
        # Never reaches 6: not reached, its gap at the cap (step 8) 6.25 - 6.
        ("lrmoe-uniform-g0.3-ma", 1): _records([9, 9, 8, 8, 7, 7, 6.5, 6.25],
                                                retained=[1.0] + [0.3] * 7, adjusted=1.0),
        # A seed without its dropless run pairs with nothing.
        ("lrmoe-uniform-g0.5-ma", 2): _records([1, 1, 1, 1, 1, 1, 1, 1], retained=[0.5] * 8),
    }
    per_run = {k: ttl.analyse_run(r, targets.get(k[1], targets[1]), 4, 1)
               for k, r in logs.items()}
    paired = curve.pairs(logs, per_run, targets, window=1, cap_factor=2.0)
    assert set(paired) == {("megatron-dropless", 1), ("lrmoe-uniform-g0.5-ma", 1),
                           ("lrmoe-uniform-g0.3-ma", 1)}
    half = paired["lrmoe-uniform-g0.5-ma", 1]
    assert (half["dropless_steps"], half["cap"], half["steps"]) == (4, 8, 6)
    assert half["steps_vs_dropless"] == 1.5 and half["loss_gap"] is None
    assert half["retained"] == 0.5       # the median after the first interval, not 1.0
    assert half["val_vs_dropless"] == pytest.approx(0.1) and half["val_at_steps"] == 6.6
    assert half["first_loss_diff"] == 0.0
    deep = paired["lrmoe-uniform-g0.3-ma", 1]
    assert deep["steps"] is None and deep["steps_vs_dropless"] is None
    assert deep["loss_gap"] == pytest.approx(0.25) and deep["gap_at"] == 8
    assert deep["loss_gap_rel"] == pytest.approx(0.25 / 6)
    assert deep["budget_adjusted_calls"] == 8 and deep["val_vs_dropless"] is None
    assert paired["megatron-dropless", 1]["retained"] == 1.0
    # A target reached after the cap is not reached (cap 1.5 x 4 = 6 steps; it took 6: in).
    tight = curve.pairs(logs, per_run, targets, window=1, cap_factor=1.25)
    assert tight["lrmoe-uniform-g0.5-ma", 1]["steps"] is None
    assert tight["lrmoe-uniform-g0.5-ma", 1]["loss_gap"] == pytest.approx(0.5)   # 6.5 at 5

    points = {p["policy"]: p for p in curve.points(paired)}
    assert [p["policy"] for p in curve.points(paired)] == [
        "megatron-dropless", "lrmoe-uniform-g0.5-ma", "lrmoe-uniform-g0.3-ma"]
    assert points["lrmoe-uniform-g0.3-ma"]["reached"] == 0
    assert points["lrmoe-uniform-g0.3-ma"]["not_reached"][1]["loss_gap"] == pytest.approx(0.25)
    assert points["lrmoe-uniform-g0.5-ma"]["steps_vs_dropless"] == {
        "median": 1.5, "min": 1.5, "max": 1.5}
    assert (points["lrmoe-uniform-g0.5-ma"]["rule"], points["lrmoe-uniform-g0.5-ma"]["gamma"],
            points["lrmoe-uniform-g0.5-ma"]["min_retention"]) == ("uniform", 0.5, 0.0)
    text = curve.markdown(paired, 2.0)
    assert "| 1 | lrmoe-uniform-g0.3-ma | 4 | 8 | not reached | - | +0.2500 | 0.300 |" in text
    assert "seed 1: +0.2500 (+4.17%)" in text and curve.SEEDS_RESOLVE in text
    pytest.importorskip("matplotlib")
    from PIL import Image

    ttl.plot_curve(curve.points(paired), 2.0, tmp_path / "curve.png")
    assert Image.open(tmp_path / "curve.png").size[0] > 400


def test_curve_stage_trains_twice_the_steps_and_keeps_its_logs_small(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("WORLD_SIZE", raising=False)     # the driver never reads it
    stage, base = ttl.study_setup(ttl.parse_args(
        ["--stage", "curve", "--config", "configs/ep_study.yaml", "--ep", "8"]))
    assert (stage.steps, stage.total, stage.seeds) == (200, 400, (1, 2, 3))
    assert base[base.index("--train-iters") + 1] == "400"
    assert base[base.index("--log-interval") + 1] == "5"
    assert stage.budget_replicas == 48 and ttl.STAGES["confirm"].budget_replicas == 2
    run = tmp_path / "run"
    run.mkdir()
    (run / "log.jsonl").write_text(json.dumps(
        {"iteration": 1, "lm-loss": 2.0, "lrmoe/layer1/expert-load": [1, 2],
         "routing/layer1/load-max-over-mean": 1.5, "lrmoe/retained-fraction": 0.5}) + "\n")
    ttl.compact(run, stage.log_keys)
    assert run_log.read_records(run / "log.jsonl") == [
        {"iteration": 1, "lm-loss": 2.0, "lrmoe/retained-fraction": 0.5}]
    assert not (run / "log.jsonl").exists()      # stored compressed


def test_curve_smoke_two_policies_pair_with_dropless(tmp_path, corpus, monkeypatch):
    # The curve stage at the CI shape: dropless and two 5-step policies (10 steps each,
    # the cap), each a real 2-rank torchrun of the launcher; the pairing table is checked.
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("WORLD_SIZE", raising=False)     # the driver never reads it
    out = tmp_path / "curve"
    assert ttl.main(["--stage", "curve-ci", "--out-dir", str(out), "--data-path",
                     str(Path(corpus)), "--data-cache-path", str(tmp_path / "cache"),
                     "--port", "29551", "--no-plots"]) == 0
    report = json.loads((out / "report.json").read_text())["curve"]
    assert report["cap_factor"] == 2.0
    pairs = {p["policy"]: p for p in report["pairs"]}
    assert list(pairs) == ["megatron-dropless", "lrmoe-sample-prob-g0.45-ma",
                           "lrmoe-uniform-g0.45-ma"]
    dropless = pairs["megatron-dropless"]
    assert 1 <= dropless["dropless_steps"] <= 5 and dropless["steps_vs_dropless"] == 1.0
    for name in ttl.STAGES["curve-ci"].policies:
        p = pairs[name]
        assert p["seed"] == 1 and p["dropless_steps"] == dropless["dropless_steps"]
        assert p["cap"] == 2 * p["dropless_steps"]
        assert (p["steps"] is None) == (p["loss_gap"] is not None)
        if p["steps"] is not None:
            assert p["steps"] <= p["cap"]
            assert p["steps_vs_dropless"] == pytest.approx(p["steps"] / p["dropless_steps"])
        assert 0.3 < p["retained"] <= 0.46        # gamma 0.45 drops; step 1 left out
        assert p["val_vs_dropless"] is not None
        # Paired: the same seed, initialisation and data, and an exact forward.
        assert abs(p["first_loss_diff"]) < 1e-5
        assert p["budget_adjusted_calls"] == 0
        command = json.loads((out / "runs" / f"{name}-s1" / "done.json").read_text())["command"]
        assert "--train-iters 10" in command and "--record-routing" not in command
        assert ("--moe-lrmoe-metric prob" in command) == ("prob" in name)
        keys = set().union(*run_log.read_records(out / "runs" / f"{name}-s1" / "log.jsonl"))
        assert keys <= set(ttl.CURVE_LOG_KEYS) and "lrmoe/retained-fraction" in keys
    points = {p["policy"]: p for p in report["points"]}
    assert points["lrmoe-sample-prob-g0.45-ma"]["rule"] == "sample + prob"
    assert points["lrmoe-uniform-g0.45-ma"]["gamma"] == 0.45
    table = (out / "report.md").read_text().split("## The curve")[1]
    rows = [line for line in table.splitlines() if line.startswith("| 1 |")]
    assert [row.split(" | ")[1] for row in rows] == list(pairs)
