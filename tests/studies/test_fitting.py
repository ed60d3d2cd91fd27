"""Configurations fitted to a device (lrmoe_studies/fitting.py): the candidates Megatron's means
give, and their predictions against the account, the simulator and hand arithmetic."""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import numpy as np
import pytest

from lrmoe_studies import fitting as F
from megatron_lrmoe.planning.memory_account import GIB

ROOT = Path(__file__).resolve().parents[2]
BASE = ["--config", str(ROOT / "configs" / "time_to_loss.yaml"), "--train-iters", "100",
        "--mock-data", "--num-layers", "2", "--hidden-size", "64",
        "--moe-ffn-hidden-size", "64", "--ffn-hidden-size", "128", "--seq-length", "64",
        "--max-position-embeddings", "64", "--micro-batch-size", "4",
        "--global-batch-size", "16", "--num-experts", "8"]
CALIBRATION = {"gemm_flops_per_s": 2e9, "alltoall_bytes_per_s": 1e8,
               "alltoall_latency_s": 1e-5, "memory_bytes_per_s": 1e9,
               "layer_forward_fixed_s": 1e-3, "layer_backward_fixed_s": 1e-3}
SYMI = ["--moe-lrmoe", "--moe-lrmoe-placement", "popularity",
        "--moe-lrmoe-bwd-capacity-factor", "inf", "--moe-lrmoe-memory-budget-gb", "auto"]


# BASE runs on 2 ranks: the tools take the world size as an argument.
predict = functools.partial(F.predict, world_size=2)
budget_slots = functools.partial(F.budget_slots, world_size=2)


@pytest.fixture(autouse=True)
def _no_world_size_in_the_environment(monkeypatch):
    # Nothing reads WORLD_SIZE: a parse that did would see 1 rank and differ.
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def _skewed_traces(layers: int = 2, calls: int = 16, seed: int = 0) -> list[np.ndarray]:
    """Per layer [calls, 1, E] counts: 256 pairs per call, most of them to 2 experts."""
    rng = np.random.default_rng(seed)
    p = np.array([0.4, 0.25] + [0.35 / 6] * 6)
    return [rng.multinomial(256, p, size=(calls, 1)) for _ in range(layers)]


def test_candidates_are_megatrons_means():
    args = F._parse(BASE, 2)
    got = {c.fitted: c.flags for c in F.candidates("symi", SYMI, args, slots_max=7)}
    assert list(got) == ["none", "recompute moe", "recompute full 1", "recompute full 2",
                         "micro-batch 2", "micro-batch 1", "slots 6", "slots 5", "slots 4"]
    assert got["recompute moe"][-4:] == ("--recompute-granularity", "selective",
                                         "--recompute-modules", "moe")
    assert got["recompute full 2"][-6:] == ("--recompute-granularity", "full",
                                            "--recompute-method", "block",
                                            "--recompute-num-layers", "2")
    assert got["slots 4"][-2:] == ("--moe-lrmoe-slots-per-rank", "4")
    assert all(flags[:len(SYMI)] == tuple(SYMI) for flags in got.values())


def test_outside_time_is_the_median_step_less_moe(tmp_path):
    log = tmp_path / "log.jsonl"
    rows = [{"step-time-s": 3.0, "moe-forward-s": 1.0, "moe-backward-s": 1.5}] + [
        {"step-time-s": 2.0 + k / 10, "moe-forward-s": 0.5, "moe-backward-s": 0.5}
        for k in range(9)] + [{"iteration": 10, "val-loss": 1.0}]
    log.write_text("\n".join(json.dumps(r) for r in rows))
    outside = F.OutsideTime.from_log(log)
    assert outside.seconds == pytest.approx(1.4)       # the first tenth dropped, median
    assert outside.step_seconds(1, 2) == pytest.approx(1.4 * (1 + 1 / 6))
    assert outside.step_seconds(0, 2) == pytest.approx(1.4)


def test_device_sizes_by_hand():
    d1, d2 = F.device_sizes(outside_gib=1.0, dropless_moe_gib=0.46, lrmoe_need_gib=1.2)
    assert d1 == pytest.approx(1.4)
    assert d2 == pytest.approx(1.236)


@pytest.mark.parametrize("policy", ["dropless", "symi"])
def test_predictions_follow_the_means(policy):
    flags = [] if policy == "dropless" else SYMI
    traces, outside = _skewed_traces(), F.OutsideTime(0.5)
    args = F._parse(BASE, 2)
    preds = {c.fitted: predict(BASE, c, 4.0, traces, CALIBRATION, outside, steps=2)
             for c in F.candidates(policy, flags, args)}
    none = preds["none"]
    assert none.fits and not none.error
    # moe recompute: the MoE peak falls, the forward runs twice; nothing outside changes.
    moe = preds["recompute moe"]
    assert moe.account.moe < none.account.moe
    assert moe.account.outside_moe == none.account.outside_moe
    assert moe.moe_s > none.moe_s and moe.step_s - moe.moe_s == pytest.approx(0.5)
    # Full recompute of both layers: activations outside fall too, and the time outside
    # grows by the forward's share.
    full = preds["recompute full 2"]
    assert full.account.activations < none.account.activations
    assert full.step_s - full.moe_s == pytest.approx(0.5 * (1 + F.FORWARD_SHARE))
    # A smaller micro-batch: fewer activations, the same weights.
    half = preds["micro-batch 2"]
    assert half.account.activations < none.account.activations
    assert half.account.weights == none.account.weights
    assert half.account.moe < none.account.moe


def test_a_device_below_the_need_does_not_fit():
    traces, outside = _skewed_traces(), F.OutsideTime(0.5)
    [none] = F.candidates("dropless", [], F._parse(BASE, 2))[:1]
    big = predict(BASE, none, 4.0, traces, CALIBRATION, outside, steps=2)
    small = predict(BASE, none, big.need / GIB * 0.99, traces, CALIBRATION, outside, steps=2)
    assert big.fits and not small.fits
    assert small.need == pytest.approx(big.need)
    # SYMI-style's ``auto`` budget below the floor: it cannot start; said, not raised.
    [symi] = F.candidates("symi", SYMI, F._parse(BASE, 2))[:1]
    refused = predict(BASE, symi, big.account.outside_moe / GIB, traces, CALIBRATION,
                        outside, steps=2)
    assert not refused.fits and "--device-memory-gb" in refused.error
    assert math.isnan(refused.step_s)


def test_best_fitting_orders_by_predicted_step_time():
    account = F.MemoryAccount(1.0, 1.0, 1.0, 1.0, 1.0, device=10.0)
    big = F.replace(account, moe=100.0)

    def pred(name, step, acc):
        return F.Prediction(F.Candidate("p", name), acc, step / 2, step)

    preds = [pred("a", 3.0, account), pred("b", 1.0, big), pred("c", 2.0, account),
             pred("d", 2.5, account)]
    assert [p.candidate.fitted for p in F.best_fitting(preds)] == ["c", "d"]


def test_combined_means_pair_a_micro_batch_with_recompute_and_slots_with_the_rest():
    args = F._parse(BASE, 2)
    single = F.candidates("symi", SYMI, args, slots_max=6)
    combined = F.candidates("symi", SYMI, args, slots_max=6, combine=True)
    assert combined[:len(single)] == single
    extra = {c.fitted: c.flags for c in combined[len(single):]}
    micro, recompute = ["micro-batch 2", "micro-batch 1"], [
        "recompute moe", "recompute full 1", "recompute full 2"]
    slots = ["slots 5", "slots 4"]
    assert list(extra) == ([f"{m} + {r}" for m in micro for r in recompute]
                           + [f"{c} + {k}" for c in recompute + micro for k in slots])
    flags = extra["micro-batch 1 + slots 4"]
    assert flags[:len(SYMI)] == tuple(SYMI)
    assert flags[len(SYMI):] == ("--micro-batch-size", "1", "--moe-lrmoe-slots-per-rank", "4")


def test_distinct_drops_what_an_earlier_prediction_already_predicts():
    account = F.MemoryAccount(1.0, 1.0, 1.0, 1.0, 1.0, device=10.0)

    def pred(name, step, acc=account):
        return F.Prediction(F.Candidate("p", name), acc, step / 2, step)

    preds = [pred("none", 2.0), pred("slots 9", 2.0), pred("slots 8", 2.5),
             pred("micro-batch 2", 2.0, F.replace(account, moe=2.0))]
    assert [p.candidate.fitted for p in F.distinct(preds)] == ["none", "slots 8",
                                                               "micro-batch 2"]


def test_means_of_each_fitted_name():
    assert F.means_of("none") == frozenset()
    assert F.means_of("recompute full 3") == {F.RECOMPUTE}
    assert F.means_of("micro-batch 2 + recompute moe") == {F.MICRO_BATCH, F.RECOMPUTE}
    assert F.means_of("recompute moe + slots 9") == {F.RECOMPUTE, F.FEWER_REPLICAS}
    # Every name the candidates give maps onto the three means.
    for c in F.candidates("symi", SYMI, F._parse(BASE, 2), slots_max=6, combine=True):
        assert F.means_of(c.fitted) <= {F.RECOMPUTE, F.MICRO_BATCH, F.FEWER_REPLICAS}


def test_micro_batch_one_has_no_smaller_micro_batch():
    args = F._parse([*BASE, "--micro-batch-size", "1"], 2)
    names = [c.fitted for c in F.candidates("symi", SYMI, args, slots_max=6, combine=True)]
    assert names and not any(F.MICRO_BATCH in F.means_of(n) for n in names)


def _at(device: float, needs: dict[str, float], policy: str) -> list:
    """A policy's predictions at ``device`` bytes with fixed needs (``none`` first)."""
    return [F.Prediction(F.Candidate(policy, fitted),
                         F.MemoryAccount(0.0, 0.0, 0.0, 0.0, need, device), 1.0, 1.0)
            for fitted, need in needs.items()]


@pytest.mark.parametrize("seed", range(20))
def test_binding_interval_is_where_the_conditions_hold(seed):
    """Against a scan of device sizes: the conditions hold exactly on [low, high)."""
    rng = np.random.default_rng(seed)
    lrmoe = [{"none": float(v)} for v in rng.integers(40, 90, size=2)]
    dropless = {"none": float(rng.integers(60, 120)),
                **{f"recompute full {n}": float(rng.integers(30, 100)) for n in (1, 2)},
                "micro-batch 1": float(rng.integers(10, 60))}     # not allowed: ignored
    symi = {"none": float(rng.integers(60, 120)), "slots 9": float(rng.integers(30, 110)),
            "recompute moe + slots 8": float(rng.integers(30, 110)),
            "micro-batch 1 + recompute moe": float(rng.integers(10, 60))}
    low, high = F.binding_interval([_at(0, n, "l")[0] for n in lrmoe],
                                   _at(0, dropless, "d"), _at(0, symi, "s"))
    assert low == max(*(n["none"] for n in lrmoe), min(dropless["recompute full 1"],
                      dropless["recompute full 2"]),
                      min(symi["slots 9"], symi["recompute moe + slots 8"]))
    for device in np.arange(0.0, 130.0, 0.5):
        held = F.binding_conditions([_at(device, n, "l")[0] for n in lrmoe],
                                    _at(device, dropless, "d"), _at(device, symi, "s"))
        assert all(held.values()) == (low <= device < high), (device, held)


def test_binding_conditions_name_what_fails():
    lrmoe = [_at(100.0, {"none": 90.0}, "l")[0]]
    as_is = _at(100.0, {"none": 95.0, "recompute moe": 50.0}, "d")
    only_smaller = _at(100.0, {"none": 120.0, "micro-batch 1": 50.0}, "s")
    held = F.binding_conditions(lrmoe, as_is, only_smaller)
    assert held == {"LRMoE default fits as it is": True,
                    "dropless fits only by recompute": False,
                    "SYMI-style fits only by recompute or fewer replicas": False}


def test_budget_slots_are_what_the_simulated_budget_holds():
    """At a device whose budget holds some replicas but not every expert: SYMI-style
    with that many slots (or all E) predicts what it does as it is, so the candidates
    with fewer slots start below it; the slots grow with the device."""
    traces, outside = _skewed_traces(), F.OutsideTime(0.5)
    per_rank = 4
    assert budget_slots(BASE, SYMI, 4.0, CALIBRATION) == 8           # all experts
    device, slots = next((d, s) for d in np.arange(0.003, 0.02, 0.0005)
                         if per_rank < (s := budget_slots(BASE, SYMI, d, CALIBRATION)) < 8)
    [none] = F.candidates("symi", SYMI, F._parse(BASE, 2))[:1]

    def need(candidate):    # the planner's host time fixed: equal plans, equal figures
        p = predict(BASE, candidate, device, traces, CALIBRATION, outside, steps=8,
                      planner_s=0.0)
        return p.need, p.moe_s

    def with_slots(k):
        return F.replace(none, fitted=f"slots {k}",
                         flags=none.flags + ("--moe-lrmoe-slots-per-rank", str(k)))

    assert need(with_slots(slots)) == need(none)
    assert need(with_slots(8)) == need(none)
    grid = [budget_slots(BASE, SYMI, d, CALIBRATION) for d in np.arange(0.002, 0.01, 0.001)]
    assert grid == sorted(grid) and grid[0] == per_rank
