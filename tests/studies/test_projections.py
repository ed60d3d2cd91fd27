"""Projections at recipe layouts (lrmoe_studies/projections.py): the FLOP count by hand, the
presets parse as the launcher parses them, and one small projection end to end."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from lrmoe_studies import fitting as F
from lrmoe_studies import projections as P
from megatron_lrmoe.planning.memory_account import GIB

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _world(monkeypatch):
    # Each preset parses for its own GPU count, never WORLD_SIZE's.
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def test_qwen3_outside_flops_by_hand():
    preset = P.PRESETS["qwen3-30b-a3b-16xh100"]
    args = P._parse(preset, P.base_flags(preset))
    parts = P.outside_flops(args, vocab_size=151936)
    # Per token, forward x 3: 48 layers of Q (2048 x 4096), K and V (2048 x 512 each),
    # output (4096 x 2048); the causal core 2 x 4096 x 4096 per layer; the head 2048 x V.
    assert parts["attention projections"] == 3 * 48 * 2 * 2048 * (4096 + 512 + 512 + 4096)
    assert parts["attention projections"] == pytest.approx(5.44e9, rel=1e-3)
    assert parts["attention core"] == pytest.approx(4.83e9, rel=1e-3)
    assert parts["LM head"] == 3 * 2 * 2048 * 151936 == pytest.approx(1.87e9, rel=2e-3)
    assert parts["dense layers"] == 0 and parts["shared experts"] == 0
    assert sum(parts.values()) == pytest.approx(12.14e9, rel=1e-3)
    # 16 GPUs, PP 1, TP 1: every GPU does 1/16 of 1024 x 4096 tokens' work.
    outside = P.outside_time(args, 151936, peak_flops=989e12, efficiency=0.45)
    assert outside.seconds == pytest.approx(
        sum(parts.values()) * 1024 * 4096 / 16 / (989e12 * 0.45))


def test_glm_dense_and_shared_expert_flops_and_the_stage_share():
    preset = P.PRESETS["glm45-air-32xh100"]
    args = P._parse(preset, P.base_flags(preset))
    parts = P.outside_flops(args, vocab_size=151552)
    assert parts["dense layers"] == 3 * 1 * 2 * 3 * 4096 * 10944       # one dense SwiGLU
    assert parts["shared experts"] == 3 * 43 * 2 * 3 * 4096 * 1408     # 43 MoE layers
    # PP 4, DP 8: a quarter of the layers plus the head, on 2048 x 4096 / 8 tokens.
    outside = P.outside_time(args, 151552, peak_flops=1e15, efficiency=0.5)
    per_token = (sum(parts.values()) - parts["LM head"]) / 4 + parts["LM head"]
    assert outside.seconds == pytest.approx(per_token * 2048 * 4096 / 8 / 5e14)


def test_from_flops_and_the_pipeline_factor():
    assert F.OutsideTime.from_flops(4e14, 1e15, 0.4).seconds == pytest.approx(1.0)
    with pytest.raises(ValueError):
        F.OutsideTime.from_flops(1.0, 1e15, 0.0)
    assert P.pipeline_factor(2, 16) == pytest.approx(17 / 16)
    assert P.pipeline_factor(1, 3) == 1.0
    assert P._bisect(1, 24, lambda n: n >= 7) == 7
    assert P._bisect(1, 24, lambda n: False) is None


@pytest.mark.parametrize("name", list(P.PRESETS))
def test_presets_parse_with_every_policy(name):
    from megatron_lrmoe.config.flags import tokens_per_rank

    preset = P.PRESETS[name]
    expected = {  # data parallel, micro-batches per step, tokens per rank per micro-batch
        "qwen3-30b-a3b-8xh100": (1, 16, 2 * 4096 // 4),
        "qwen3-30b-a3b-16xh100": (16, 64, 4096),
        "glm45-air-32xh100": (8, 256, 4096),
        "qwen3-30b-a3b-32xa100-40": (4, 128, 2 * 4096 // 2),
        "glm45-air-64xa100-40": (4, 512, 4096 // 4),
    }[name]
    for _label, flags, _ratio in P.POLICIES.values():
        args = P._parse(preset, [*P.base_flags(preset), *flags, *preset.recipe])
        assert (F._data_parallel(args), P._microbatches(args), tokens_per_rank(args)) == expected
        assert args.bf16 and args.moe_token_dispatcher_type == "alltoall"
        assert args.moe_lrmoe == ("--moe-lrmoe" in flags)
    assert all(s for s in preset.sources) and preset.vocab_size in (151936, 151552)


def _tiny_preset(device_gib: float) -> P.Preset:
    return P.Preset(
        "tiny", ROOT / "configs" / "time_to_loss.yaml", "h100", 2, device_gib,
        layout=("--expert-model-parallel-size", "2", "--seq-length", "64",
                "--max-position-embeddings", "64", "--micro-batch-size", "4",
                "--global-batch-size", "16"),
        recipe=("--recompute-granularity", "selective", "--recompute-modules", "moe"),
        model_flags=("--train-iters", "100", "--num-layers", "2", "--hidden-size", "64",
                     "--moe-ffn-hidden-size", "64", "--ffn-hidden-size", "128",
                     "--num-experts", "8", "--num-attention-heads", "4"),
        sources=("synthetic",))


def _skewed_traces(layers: int = 2, calls: int = 16, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    p = np.array([0.4, 0.25] + [0.35 / 6] * 6)
    return [rng.multinomial(256, p, size=(calls, 1)) for _ in range(layers)]


def test_a_small_projection_end_to_end():
    traces = _skewed_traces()
    ratios = {"dropless": 1.0, "capacity-drop": 1.2, "symi": 1.0, "lrmoe-ma": 0.9}
    # A CPU-sized model: a GPU's reserve (RESERVE_GIB) would swamp it.
    context, free = P.project(_tiny_preset(8.0), traces, steps=1, ratios=ratios,
                              largest_limit=2, planner_s=1e-4, reserve_gib=0.0)
    assert context["microbatches_per_step"] == 2 and context["pipeline_factor"] == 1.0
    assert [r.policy for r in free] == list(P.POLICIES)
    for r in free:     # a roomy device: every policy fits as it is
        assert r.choice is not None and r.choice.candidate.fitted == "none"
        assert r.recipe.fits and r.recipe.candidate.fitted == "recipe"
        assert r.choice_step_s == pytest.approx(r.choice.step_s)
        assert r.largest is not None and r.largest[0] == 2
    by = {r.policy: r for r in free}
    assert by[P.ma_policy("1.0")].ratio == 0.9 and free[1].ratio == 1.2
    _check_gamma_rows(context, free)

    # A device just below the dropless need: dropless gives something up to fit.
    dropless = free[0].choice
    device = (dropless.need / GIB) * 0.995
    _, tight = P.project(_tiny_preset(device), traces, steps=1, ratios=ratios,
                         policies=("megatron-dropless", "lrmoe-uniform-g1.0"),
                         largest_limit=0, planner_s=1e-4, reserve_gib=0.0)
    d, lrmoe = tight
    assert d.choice is not None and d.choice.candidate.fitted != "none"
    assert d.choice.need <= device * GIB
    assert all(p.fits == (p.need <= device * GIB) for p in d.tried if not p.error)
    # LRMoE's budget (the device less the rest of the account) holds its default as is.
    assert lrmoe.choice is not None and lrmoe.choice.candidate.fitted == "none"
    text = P.report_markdown(_tiny_preset(device), context, tight, "cmd", "code")
    assert P.DISPATCHER_CAVEAT in text and "Megatron dropless" in text
    assert "LRMoE uniform, gamma 1.0" in text
    assert not math.isnan(d.ratio)


def test_reserve_lowers_the_device():
    traces = _skewed_traces()
    context, _ = P.project(replace(_tiny_preset(8.0)), traces, steps=1,
                           policies=("megatron-dropless",), largest_limit=0, reserve_gib=1.5,
                           planner_s=1e-4)
    assert context["device_gib"] == pytest.approx(6.5)
    # By default the stated reserve, every preset and policy alike, shown beside each need.
    context, rows = P.project(_tiny_preset(8.0), traces, steps=1,
                              policies=("megatron-dropless",), largest_limit=0,
                              planner_s=1e-4)
    assert context["device_gib"] == pytest.approx(8.0 - P.RESERVE_GIB)
    assert rows[0].choice.need <= (8.0 - P.RESERVE_GIB) * GIB
    text = P.report_markdown(_tiny_preset(8.0), context, rows, "cmd", "code")
    need = f"{rows[0].choice.need / GIB:.1f} + {P.RESERVE_GIB:g}"
    assert f"| yes ({need}) |" in text and f"| {need} |" in text
    assert f"{P.RESERVE_GIB:g} GiB held back" in text


def test_a_given_vocabulary_enters_the_account_and_the_auto_budget():
    from megatron_lrmoe.launcher import builders
    from megatron_lrmoe.launcher.run_config import build_config

    preset = _tiny_preset(8.0)
    flags = [*P.base_flags(preset), *P.POLICIES["lrmoe-uniform-g1.0"][1],
             "--device-memory-gb", "8"]
    # The launcher's auto budget given the tokenizer's own vocabulary is its budget.
    args = P._parse(preset, flags)
    launcher = build_config(args).moe_lrmoe_memory_budget_gb
    tokenizer = builders.padded_vocab_size(
        builders.build_tokenizer_from_args(args).vocab_size, args)
    assert build_config(args, tokenizer).moe_lrmoe_memory_budget_gb == launcher
    assert build_config(args, tokenizer + 50000).moe_lrmoe_memory_budget_gb < launcher
    # A larger vocabulary: more weights outside the MoE layers, a smaller auto budget.
    traces, outside = _skewed_traces(), F.OutsideTime(0.5)
    candidate = F.Candidate("lrmoe", "none", P.POLICIES["lrmoe-uniform-g1.0"][1])
    small, large = (F.predict(P.base_flags(preset), candidate, 8.0, traces, None, outside,
                              steps=1, planner_s=1e-4, vocab_size=v, world_size=preset.gpus)
                    for v in (None, 50000))
    assert large.account.weights > small.account.weights
    assert large.account.outside_moe > small.account.outside_moe


def test_window_check_compares_a_window_with_its_double():
    """A window is long enough where doubling it moves nothing: steady routing moves
    nothing, a hot step after the window does (Megatron's static layer: a step's time is
    its routing's)."""
    level = np.zeros((12, 1, 8), dtype=np.int64)
    level[0::2, 0, 0] = 100       # source 0 -> expert 0 (rank 0)
    level[1::2, 0, 4] = 100       # source 1 -> expert 4 (rank 1)
    hot = level.copy()
    hot[8:] = 0
    hot[8:, 0, 0] = 100           # the third step (rows 8-11): both sources to rank 0
    rows = {}
    for name, trace in (("level", level), ("hot", hot)):
        [rows[name]] = P.window_check(_tiny_preset(8.0), [trace, trace], 1,
                                      policies=("megatron-dropless",), reserve_gib=0.0)
    steady, moved = rows["level"], rows["hot"]
    assert steady["time_change"] == pytest.approx(0.0, abs=1e-12) and steady["within"]
    # Window 1: the level step after the warm-up; doubled: it and the hot step.
    assert moved["moe_s"] == pytest.approx(steady["moe_s"])
    assert moved["time_change"] == pytest.approx(moved["moe_s_doubled"] / moved["moe_s"] - 1)
    # At this size the fixed costs outweigh the rows, so the time moves a little; the
    # memory (the most over every step) takes the hot rank once it is replayed.
    assert moved["time_change"] > 0
    assert moved["memory_change"] > P.WINDOW_TOLERANCE and not moved["within"]
    assert moved["moe_gib_doubled"] > 1.5 * steady["moe_gib_doubled"]


def _check_gamma_rows(context: dict, rows: list[P.Projection]) -> None:
    """The memory-aware rows: one per gamma, named by it; their parts add up to the simulator's
    MoE time; the per-step ratios are the quotients of the rows' own times; a gamma
    without a measured steps ratio says so and has no figure to target."""
    by = {r.policy: r for r in rows}
    labels = {r.label for r in rows}
    for g in ("inf", "1.0", "0.75", "0.5", "0.4"):
        assert f"LRMoE memory-aware, gamma {g}" in labels
        r = by[f"lrmoe-uniform-g{g}-ma"]
        # The backward keeps at most C = ceil(gamma x total / R) pairs per rank
        # (retention.capacity_for_factor): the retained fraction at most gamma plus the
        # rounding (R / total pairs of a call); gamma inf keeps every pair.
        if g == "inf":
            assert r.choice.retained == 1.0
        else:
            assert r.choice.retained <= float(g) + 1e-2
    assert by["lrmoe-uniform-g0.4-ma"].choice.retained < 1.0    # the skewed trace drops
    dropless, symi = by["megatron-dropless"].choice, by["symi"].choice
    ratios = P.per_step(rows)
    for r in rows:
        for p in (r.recipe, r.choice):      # the recipe runs `moe` recompute: forwards twice
            assert sum(p.parts_s.values()) == pytest.approx(p.moe_s, rel=1e-12)
            parts = P.part_columns(p)
            assert list(parts) == list(P.PART_COLUMNS)
            assert sum(parts.values()) == pytest.approx(p.moe_s, rel=1e-12)
            assert parts["all-to-all fwd"] > 0 and parts["GEMM bwd"] > 0
        assert r.recipe.moe_s > r.choice.moe_s     # the rerun forward costs time
        assert ratios[r.policy]["moe_vs_symi"] == r.choice.moe_s / symi.moe_s
        assert ratios[r.policy]["moe_vs_dropless"] == r.choice.moe_s / dropless.moe_s
        replicas = r.choice.replicas
        assert replicas == 0 if r.policy in ("megatron-dropless", "lrmoe-uniform-g1.0") \
            else replicas >= 0
    targets = P.to_target(rows, None)
    assert P.ma_policy("1.0") in targets and P.ma_policy("0.5") not in targets
    text = P.report_markdown(_tiny_preset(8.0), context, rows, "cmd", "code")
    main, by_part = text.split("by part")
    table = {line.split(" | ")[0][2:]: line for line in main.splitlines()
             if line.startswith("| ")}
    assert table["LRMoE memory-aware, gamma 0.5"].count(P.NO_STEPS_RATIO) == 5
    assert P.NO_STEPS_RATIO not in table["LRMoE memory-aware, gamma 1.0"]
    # The parts table: one row per policy after the main table's, its ratios printed.
    part_rows = [line for line in by_part.splitlines()
                 if line.startswith("| LRMoE memory-aware, gamma 0.4")]
    g04 = by[P.ma_policy("0.4")].choice
    assert len(part_rows) == 1 and part_rows[0].endswith(
        f"| {g04.moe_s / symi.moe_s:.3f} | {g04.moe_s / dropless.moe_s:.3f} |")


def test_the_per_step_goal_by_hand():
    def row(policy: str, moe_s: float | None) -> P.Projection:
        choice = None if moe_s is None else replace(
            F.Prediction(F.Candidate(policy, "none"), F.MemoryAccount(1.0, 0, 0, 0, 0, None),
                         moe_s, moe_s + 1.0))
        return P.Projection(policy, policy, choice, choice, math.nan, math.nan, None,
                            math.nan)

    rows = [row("megatron-dropless", 50.0), row("symi", 40.0), row(P.STEP_GOAL_POLICY, 30.0)]
    check = P.step_goal_check(rows)
    assert check["verdict"] == "met" and check["ratio"] == 0.75    # at the goal: met
    rows[2] = row(P.STEP_GOAL_POLICY, 30.5)
    check = P.step_goal_check(rows)
    assert check["verdict"] == "not met" and check["ratio"] == pytest.approx(30.5 / 40)
    assert "**not met**: 0.762 x (30.50 s against 40.00 s" in P.step_goal_markdown(check, 3.0)
    assert P.per_step(rows)[P.STEP_GOAL_POLICY] == {"moe_vs_dropless": 30.5 / 50,
                                                   "moe_vs_symi": 30.5 / 40}
    rows[1] = row("symi", None)
    assert P.step_goal_check(rows)["verdict"] == "not assessed (SYMI-style fits nothing)"
    assert "moe_vs_symi" not in P.per_step(rows)[P.STEP_GOAL_POLICY]
    rows[2] = row(P.STEP_GOAL_POLICY, None)
    assert P.step_goal_check(rows)["verdict"].startswith("not met (LRMoE")


def test_the_previous_run_beside_this_one(tmp_path):
    rows = [P.Projection(name, P.POLICIES[name][0], None, F.Prediction(
        F.Candidate(name, "recipe"), F.MemoryAccount(2 * GIB, 0, 0, 0, 0, None), moe_s,
        moe_s + 1.0, replicas=replicas), math.nan, math.nan, None, math.nan)
        for name, moe_s, replicas in (("symi", 30.0, 144.0), (P.ma_policy("1.0"), 24.0, 40.0),
                                      (P.ma_policy("0.5"), 20.0, 42.0))]
    old = {"code": "commit abc1234", "command": "python -m ... --steps 6",
           "context": {"reserve_gib": 0.0},
           "policies": [{"policy": "symi", "choice": {"fitted": "slots 17", "need_gib": 78.7,
                                                      "moe_s": 33.18}},
                        {"policy": P.ma_policy("1.0"), "choice": None},
                        {"policy": "megatron-dropless", "choice": None}]}
    (tmp_path / "projections_x.json").write_text(json.dumps(old))
    previous = P.read_previous(tmp_path, "x")
    assert P.read_previous(tmp_path, "y") is None and P.read_previous(None, "x") is None
    got = P.previous_rows(previous, rows)
    # Only the policies both runs projected, in this run's order; gamma 0.5 is new.
    assert [e["policy"] for e in got] == ["symi", P.ma_policy("1.0")]
    assert got[0]["before_moe_s"] == 33.18 and got[0]["now_moe_s"] == 30.0
    assert got[1]["before_fitted"] is None and got[1]["now_need_gib"] == 2.0
    text = P.previous_markdown(previous, rows, 3.0, "old/dir")
    assert "`old/dir`: commit abc1234" in text and "reserve 0 GiB" in text
    assert f"| SYMI-style | slots 17 | 78.7 | 33.18 | recipe | 2.0 + 3 | 30.00 | 144.0 | " \
        f"{30.0 / 33.18:.3f} |" in text
    assert "| nothing fits | - | - | recipe | 2.0 + 3 | 24.00 | 40.0 | - |" in text


def test_the_stored_previous_run_is_the_one_before_issue_46():
    # The "before" table reads these copies; they must name the run they came from.
    for name in P.PRESETS:
        previous = P.read_previous(P.PREVIOUS_DIR, name)
        assert previous is not None and previous["preset"] == name
        assert previous["code"] == "commit a6559e2"
