"""Steps-to-target files from a time-to-loss study's report (lrmoe_studies/steps_to_target.py):
the fastest fitted run per family and seed, LRMoE's run, the errors."""

from __future__ import annotations

import json

import pytest

from lrmoe_studies import steps_to_target as S
from lrmoe_studies.projections import STEPS_KEYS
from megatron_lrmoe.tools.simulate import read_steps_to_target


def _study(tmp_path, rows, lrmoe="lrmoe-uniform-g1.0-ma"):
    """A held study's report.json per-seed rows (policy, seed, steps, moe_s) and each
    run's done.json."""
    study = tmp_path / "study"
    per_seed = [{"seed": seed, "policy": policy, "steps": steps, "moe_s": moe_s}
                for policy, seed, steps, moe_s in rows]
    (study / "runs").mkdir(parents=True)
    (study / "report.json").write_text(json.dumps({"per_seed": per_seed}))
    for policy, seed, _, _ in rows:
        if policy.startswith("unconstrained/"):
            continue
        run = study / "runs" / f"{policy}-s{seed}"
        run.mkdir()
        (run / "done.json").write_text(json.dumps({
            "command": f"torchrun x --data-path data/stdlib --expert-model-parallel-size "
                       f"16 --seed {seed}", "code": f"commit c{seed}"}))
    return study


ROWS = [
    # seed 1: dropless fastest by MoE s is @recompute_moe (steps 196), not full_4 (195)
    ("megatron-dropless@recompute_full_4", 1, 195, 418.5),
    ("megatron-dropless@recompute_moe", 1, 196, 402.6),
    ("unconstrained/megatron-dropless", 1, 150, 300.0),
    ("symi@recompute_full_2_+_slots_14", 1, 202, 367.9),
    ("symi@recompute_moe_+_slots_14", 1, 199, 380.0),
    ("megatron-capacity-1.0", 1, 235, 283.5),
    ("megatron-capacity-1.0@recompute_full_1", 1, 240, 415.0),
    ("lrmoe-uniform-g1.0-ma", 1, 210, 250.0),
    # seed 2: one fitted configuration each
    ("megatron-dropless@recompute_moe", 2, 180, 390.0),
    ("symi@recompute_full_2_+_slots_14", 2, 190, 350.0),
    ("megatron-capacity-1.0", 2, 220, 270.0),
    ("lrmoe-uniform-g1.0-ma", 2, 170, 240.0),
]


def test_pairs_take_each_seeds_fastest_fitted_run(tmp_path):
    doc = S.from_study(_study(tmp_path, ROWS))
    pairs = {name: [(p["seed"], p["steps"], p["dropless_steps"], p["run"])
                    for p in e["pairs"]] for name, e in doc["policies"].items()}
    assert pairs == {
        "capacity-drop": [(1, 235, 196, "runs/megatron-capacity-1.0-s1"),
                          (2, 220, 180, "runs/megatron-capacity-1.0-s2")],
        "symi": [(1, 202, 196, "runs/symi@recompute_full_2_+_slots_14-s1"),
                 (2, 190, 180, "runs/symi@recompute_full_2_+_slots_14-s2")],
        "lrmoe-ma": [(1, 210, 196, "runs/lrmoe-uniform-g1.0-ma-s1"),
                     (2, 170, 180, "runs/lrmoe-uniform-g1.0-ma-s2")]}
    first = doc["policies"]["symi"]["pairs"][0]
    assert first["dropless_run"] == "runs/megatron-dropless@recompute_moe-s1"
    assert first["corpus"] == "stdlib" and first["code"] == "c1" and doc["ep"] == 16
    assert doc["policies"]["lrmoe-ma"]["study_policy"] == "lrmoe-uniform-g1.0-ma"
    # The file the command writes is one the projections read.
    out = tmp_path / "steps.json"
    assert S.main([str(tmp_path / "study"), "--out", str(out)]) == 0
    steps = read_steps_to_target(out, "--steps-to-target", STEPS_KEYS)
    assert steps.pairs["lrmoe-ma"][1].steps == 170
    assert steps.pairs["symi"][0].seed == ("stdlib", 1)
    r = S.ratio_range(steps.pairs["lrmoe-ma"])
    assert (r.low, r.high) == pytest.approx((170 / 180, 210 / 196))


def test_the_lrmoe_policy_must_be_one(tmp_path):
    rows = [*ROWS, ("lrmoe-sample-g1.0-ma", 1, 205, 245.0)]
    with pytest.raises(ValueError, match="^--lrmoe: the study has LRMoE policies "
                                         "lrmoe-sample-g1.0-ma, lrmoe-uniform-g1.0-ma"):
        S.from_study(_study(tmp_path, rows))
    doc = S.from_study(tmp_path / "study", lrmoe="lrmoe-sample-g1.0-ma")
    assert [p["steps"] for p in doc["policies"]["lrmoe-ma"]["pairs"]] == [205]
    with pytest.raises(ValueError, match="^--lrmoe lrmoe-topk-g1.0: not among"):
        S.from_study(tmp_path / "study", lrmoe="lrmoe-topk-g1.0")
    with pytest.raises(SystemExit, match="^--lrmoe"):
        S.main([str(tmp_path / "study"), "--out", str(tmp_path / "x.json")])


def test_an_unreached_target_stops_unless_allowed(tmp_path):
    rows = [r if r[:2] != ("lrmoe-uniform-g1.0-ma", 2) else (r[0], 2, None, None)
            for r in ROWS]
    study = _study(tmp_path, rows)
    with pytest.raises(ValueError, match="lrmoe-uniform-g1.0-ma seed 2.*--allow-unreached"):
        S.from_study(study)
    doc = S.from_study(study, allow_unreached=True)
    assert [p["seed"] for p in doc["policies"]["lrmoe-ma"]["pairs"]] == [1]
    assert doc["unreached"] == ["lrmoe-uniform-g1.0-ma seed 2"]
    with pytest.raises(ValueError, match="^STUDY .*report.json"):
        S.from_study(tmp_path / "nowhere")
