"""Projections' steps-to-target files by EP size, the spread of their ratios and the goal
check (lrmoe_studies/projections.py), with tiny synthetic files and rows: no simulation."""

from __future__ import annotations

import json
import math
import statistics
from types import SimpleNamespace

import pytest

from lrmoe_studies import projections as P
from lrmoe_studies.paths import STEPS_TO_TARGET_FILE
from megatron_lrmoe.tools.simulate import read_steps_to_target

SYMI = ((100, 100), (90, 100), (110, 100))       # ratios 1.0, 0.9, 1.1
LRMOE = ((80, 100), (99, 100), (88, 100))        # ratios 0.8, 0.99, 0.88
CAPACITY = ((120, 100), (130, 100), (125, 100))


@pytest.fixture(autouse=True)
def _world(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)     # presets parse for their GPUs


def _file(tmp_path, name="steps.json", seeds=True, ep=None, lrmoe_policy="lrmoe-x-ma",
          **policies):
    def pairs(values):
        return [{"steps": s, "dropless_steps": d, **({"corpus": "c", "seed": i + 1}
                                                     if seeds else {})}
                for i, (s, d) in enumerate(values)]

    body = {"capacity-drop": CAPACITY, "symi": SYMI, "lrmoe-ma": LRMOE} | policies
    doc = {"policies": {k: {"study_policy": lrmoe_policy if k == "lrmoe-ma" else k,
                            "pairs": pairs(v)} for k, v in body.items()}}
    if ep is not None:
        doc["ep"] = ep
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return path


def _row(policy: str, moe_s: float | None, step_s: float = 10.0) -> P.Projection:
    choice = None if moe_s is None else SimpleNamespace(
        moe_s=moe_s, need=2**30, error="", candidate=SimpleNamespace(fitted="none"),
        parts_s={"forward_alltoall": moe_s}, replicas=0.0, retained=1.0)
    recipe = SimpleNamespace(error="", fits=True, need=2**30)
    return P.Projection(policy=policy, label=policy, recipe=recipe, choice=choice,
                        choice_step_s=step_s if choice else math.nan,
                        recipe_step_s=math.nan, largest=None, ratio=math.nan)


def _rows(lrmoe_moe: float, symi_moe: float = 4.0, dropless_moe: float = 5.0):
    return [_row("megatron-dropless", dropless_moe, 10.0), _row("symi", symi_moe, 8.0),
            _row("lrmoe-uniform-g1.0-ma", lrmoe_moe, 6.0)]


# ----------------------------------------------------------------------- EP rule
def test_each_preset_takes_the_file_of_its_ep(tmp_path):
    by_ep = P.parse_steps_by_ep([f"8={_file(tmp_path, 'a.json')}",
                                 f"16={_file(tmp_path, 'b.json', ep=16)}"])
    expected = {"qwen3-30b-a3b-8xh100": 8, "qwen3-30b-a3b-16xh100": 16,
                "glm45-air-32xh100": 8, "qwen3-30b-a3b-32xa100-40": 8,
                "glm45-air-64xa100-40": 16}
    for name, preset in P.PRESETS.items():
        ep = P._parse(preset, P.base_flags(preset)).expert_model_parallel_size
        assert P.steps_for_ep(by_ep, ep)[0] == expected[name]
        assert P.steps_for_ep(by_ep, ep)[1] is by_ep[expected[name]]
    assert [P.steps_for_ep(by_ep, ep)[0] for ep in (1, 4, 8, 16, 32, 64)] == [
        8, 8, 8, 16, 16, 16]
    with pytest.raises(ValueError, match="^--steps-to-target-by-ep: a preset at EP 12 "
                                         "lies between .* EP 8 and EP 16; give one for EP 12"):
        P.steps_for_ep(by_ep, 12)
    one = {16: by_ep[16]}
    assert P.steps_for_ep(one, 4) == (16, by_ep[16])


@pytest.mark.parametrize("item, problem", [
    ("16", "expected EP=FILE"),
    ("x={f}", "expected EP=FILE"),
    ("0={f}", "expected EP=FILE"),
    ("16=", "expected EP=FILE"),
    ("8={ep16}", "ran at EP 16 .*give it as 16="),
    ("8={missing}", "^--steps-to-target-by-ep 8= .*cannot read it"),
    ("8={nosymi}", "^--steps-to-target-by-ep 8= .*missing: symi"),
])
def test_bad_by_ep_items_name_the_flag(tmp_path, item, problem):
    good = _file(tmp_path)
    nosymi = _file(tmp_path, "nosymi.json")
    doc = json.loads(nosymi.read_text())
    del doc["policies"]["symi"]
    nosymi.write_text(json.dumps(doc))
    item = item.format(f=good, ep16=_file(tmp_path, "e.json", ep=16),
                       missing=tmp_path / "none.json", nosymi=nosymi)
    with pytest.raises(ValueError, match=problem) as info:
        P.parse_steps_by_ep([item])
    assert str(info.value).startswith("--steps-to-target-by-ep")
    with pytest.raises(SystemExit, match="--steps-to-target-by-ep"):
        P.main(["--preset", "qwen3-30b-a3b-16xh100", "--steps-to-target-by-ep", item])


def test_a_twice_given_ep_and_both_flags_are_refused(tmp_path, capsys):
    f = _file(tmp_path)
    with pytest.raises(ValueError, match="EP 8 given twice"):
        P.parse_steps_by_ep([f"8={f}", f"8={f}"])
    with pytest.raises(SystemExit):
        P.main(["--preset", "qwen3-30b-a3b-16xh100", "--steps-to-target", str(f),
                "--steps-to-target-by-ep", f"16={f}"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_the_shipped_file_still_loads_for_projections():
    steps = read_steps_to_target(STEPS_TO_TARGET_FILE, "--steps-to-target", P.STEPS_KEYS)
    assert list(steps.pairs)[:3] == ["capacity-drop", "symi", "lrmoe-ma"]
    assert steps.study_policy["lrmoe-ma"] == "lrmoe-uniform-g1.0-ma"
    # Its pairs name corpus and seed: LRMoE over SYMI-style per seed is steps over steps.
    per_seed = [141 / 143, 135 / 142, 119 / 108, 162 / 139]
    r, how = P.steps_vs(steps, "lrmoe-ma", "symi")
    assert how == "per seed"
    assert (r.median, r.low, r.high) == pytest.approx(
        (statistics.median(per_seed), min(per_seed), max(per_seed)))


# ------------------------------------------------------------------------ ranges
def test_ranges_by_hand(tmp_path):
    steps = read_steps_to_target(_file(tmp_path), "f", P.STEPS_KEYS)
    got = P.to_target(_rows(2.0), steps)["lrmoe-uniform-g1.0-ma"]
    # LRMoE's ratios 0.8, 0.99, 0.88: median 0.88.
    assert (got["steps_ratio"].median, got["steps_ratio"].low,
            got["steps_ratio"].high) == pytest.approx((0.88, 0.8, 0.99))
    # Per seed over SYMI-style: 0.8 / 1.0, 0.99 / 0.9, 0.88 / 1.1 = 0.8, 1.1, 0.8.
    assert got["steps_vs_symi_how"] == "per seed"
    r = got["steps_vs_symi"]
    assert (r.median, r.low, r.high) == pytest.approx((0.8, 0.8, 1.1))
    # MoE seconds per step 2.0 against 4.0 (SYMI) and 5.0 (dropless).
    r = got["moe_vs_symi"]
    assert (r.median, r.low, r.high) == pytest.approx((0.4, 0.4, 0.55))
    r = got["moe_vs_dropless"]
    assert (r.median, r.low, r.high) == pytest.approx((0.352, 0.32, 0.396))
    # Step seconds 6 against 8 and 10.
    r = got["step_vs_symi"]
    assert (r.median, r.low, r.high) == pytest.approx((0.6, 0.6, 0.825))
    # Dropless against SYMI-style: per seed 1 / 1.0, 1 / 0.9, 1 / 1.1; times 5 / 4.
    d = P.to_target(_rows(2.0), steps)["megatron-dropless"]["moe_vs_symi"]
    assert (d.median, d.low, d.high) == pytest.approx((1.25, 1.25 / 1.1, 1.25 / 0.9))


def test_without_common_seeds_the_cross_range(tmp_path):
    path = _file(tmp_path)
    doc = json.loads(path.read_text())
    for pair in doc["policies"]["lrmoe-ma"]["pairs"]:
        pair.pop("seed")
    path.write_text(json.dumps(doc))
    steps = read_steps_to_target(path, "f", P.STEPS_KEYS)
    got = P.to_target(_rows(2.0), steps)["lrmoe-uniform-g1.0-ma"]
    assert got["steps_vs_symi_how"] == "cross"
    r = got["steps_vs_symi"]
    assert (r.median, r.low, r.high) == pytest.approx((0.88 / 1.0, 0.8 / 1.1, 0.99 / 0.9))


# -------------------------------------------------------------------------- goal
@pytest.mark.parametrize("lrmoe_moe, verdict, symi, dropless", [
    # vs SYMI 0.5 x [0.8, 0.8, 1.1], vs dropless 0.4 x [0.88, 0.8, 0.99]
    (2.0, "met", "met", "met"),
    # vs SYMI 0.8 x: 0.64 [0.64, 0.88]; vs dropless 0.64 x: 0.563 [0.512, 0.634]
    (3.2, "met at the median only", "met at the median only", "met"),
    # vs SYMI 1.0 x: 0.8 [0.8, 1.1]; vs dropless 0.8 x: 0.704 [0.64, 0.792]
    (4.0, "not met", "not met", "met at the best seed only"),
])
def test_the_goal_verdict(tmp_path, lrmoe_moe, verdict, symi, dropless):
    steps = read_steps_to_target(_file(tmp_path), "f", P.STEPS_KEYS)
    check = P.goal_check(_rows(lrmoe_moe), steps)
    assert check["verdict"] == verdict and check["study_policy"] == "lrmoe-x-ma"
    assert check["policy"] == "lrmoe-uniform-g1.0-ma"
    assert check["baselines"]["symi"]["verdict"] == symi
    assert check["baselines"]["megatron-dropless"]["verdict"] == dropless
    text = P.goal_markdown(check)
    assert f"**{verdict}**" in text and "lrmoe-x-ma" in text


def test_the_goal_when_something_does_not_fit(tmp_path):
    steps = read_steps_to_target(_file(tmp_path), "f", P.STEPS_KEYS)
    rows = [_row("megatron-dropless", 5.0), _row("symi", None),
            _row("lrmoe-uniform-g1.0-ma", 2.0)]
    check = P.goal_check(rows, steps)
    assert check["verdict"] == "met"
    assert check["baselines"]["symi"]["verdict"] == "left out: fits nothing"
    rows[2] = _row("lrmoe-uniform-g1.0-ma", None)
    assert P.goal_check(rows, steps)["verdict"].startswith("not met (LRMoE")
    # A study policy without replicas: the projection without them is LRMoE's.
    steps = read_steps_to_target(_file(tmp_path, lrmoe_policy="lrmoe-x"), "f", P.STEPS_KEYS)
    assert P.goal_check(_rows(2.0), steps)["policy"] == "lrmoe-uniform-g1.0"


def test_the_report_carries_the_ranges_and_the_goal(tmp_path):
    steps = read_steps_to_target(_file(tmp_path), "f", P.STEPS_KEYS)
    context = {"reserve_gib": 0.0, "microbatches_per_step": 64, "data_parallel": 16,
               "stage_layers": 48, "pipeline_factor": 1.0, "outside_s": 1.0,
               "outside_source": "s"}
    text = P.report_markdown(P.PRESETS[P.GOAL_PRESET], context, _rows(2.0), "cmd", "code",
                             steps, 16)
    row = next(line for line in text.splitlines() if line.startswith("| lrmoe-uniform"))
    assert ("| 0.880 [0.800, 0.990] |" in row and "| 0.400 [0.400, 0.550] |" in row
            and "| 0.352 [0.320, 0.396] |" in row)
    assert "measured at EP 16; this preset's EP 16" in text and "**met**" in text
    # The per-step goal names its own policy (gamma 0.5), not projected here.
    assert f"**not met (LRMoE {P.STEP_GOAL_POLICY} not projected)**" in text
    other = P.report_markdown(P.PRESETS["qwen3-30b-a3b-8xh100"], context, _rows(2.0),
                              "cmd", "code", steps, 8)
    assert "**Goal**" not in other
