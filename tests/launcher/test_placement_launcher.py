"""The launcher with each placement policy: training under EP=2 and EP=2 x PP=2, resume
under another policy, and replicas with nothing dropped (SYMI-style and memory-aware)
equal to Megatron with and without the distributed optimizer and overlapped grad reduce /
param gather, on 2 ranks and on 4 (two expert-data-parallel groups). Exact resume with
placement: tests/integration/test_step_state.py."""

from __future__ import annotations

import json
import math

import pytest

from tests.launcher.test_launcher import TINY, _decreased, _train

NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0"]
# 4 experts on 2 EP ranks: 2 homes per rank; 3 slots leave room for one replica each.
POLICIES = {
    "static": ["--moe-lrmoe-placement", "static"],
    "popularity": ["--moe-lrmoe-placement", "popularity", "--moe-lrmoe-slots-per-rank", "3"],
    "memory-aware": ["--moe-lrmoe-placement", "memory-aware",
                     "--moe-lrmoe-memory-budget-gb", "0.05"],
}


def _logged(path) -> list[dict]:
    return [r for r in map(json.loads, path.read_text().splitlines())
            if "lrmoe/replicas" in r]


@pytest.fixture(scope="module")
def compute_bound_calibration(tmp_path_factory) -> str:
    """Machine constants (instead of a noisy in-process measurement) under which expert
    compute is all that costs time: the memory-aware planner then adds a replica
    whenever one lowers the busiest rank's load and the budget has room."""
    path = tmp_path_factory.mktemp("calibration") / "compute_bound.json"
    path.write_text(json.dumps({"gemm_flops_per_s": 1e6, "alltoall_bytes_per_s": 1e18,
                                "alltoall_latency_s": 0.0, "source": "test: compute-bound"}))
    return str(path)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_each_policy_trains_at_ep2(gloo2, corpus, tmp_path, policy, compute_bound_calibration):
    log = tmp_path / "log.jsonl"
    extra = ["--moe-lrmoe-calibration", compute_bound_calibration]
    results = gloo2.run(_train, TINY + ["--moe-lrmoe", "--moe-lrmoe-bwd-capacity-factor", "0.75",
                                        *POLICIES[policy], *extra, "--data-path", corpus,
                                        "--train-iters", "12", "--expert-model-parallel-size", "2",
                                        "--log-interval", "1", "--log-json", str(log)],
                        timeout=300)
    assert results[0]["losses"] == results[1]["losses"]
    assert _decreased(results[0]["losses"], margin=0.3), results[0]["losses"]
    records = _logged(log)
    assert [r["iteration"] for r in records] == list(range(1, 13))
    assert all(r["lrmoe/routing-overflow-pairs"] == 0 for r in records)
    replicas, improved = [], 0
    for r in records:
        for n in (1, 2):
            # One micro-batch per rank and step, logged every step: the logged per-expert
            # load is this step's routing. Static layout: experts 0, 1 on rank 0, 2, 3 on
            # rank 1; replicas can only lower the busiest rank's load (routing minimises it,
            # and sending every pair home is one of the routings it chooses from).
            load = r[f"lrmoe/layer{n}/expert-load"]
            homes = [load[0] + load[1], load[2] + load[3]]
            static_ratio = max(homes) / (sum(homes) / 2)
            ratio = r[f"lrmoe/layer{n}/load-max-over-mean"]
            replicas.append(r[f"lrmoe/layer{n}/replicas"])
            if replicas[-1] == 0:
                assert ratio == pytest.approx(static_ratio, rel=1e-12), (r["iteration"], n)
            else:
                assert ratio <= static_ratio * (1 + 1e-12), (r["iteration"], n)
                improved += ratio < static_ratio * (1 - 1e-9)
    # replicas: per step, layer 1 then layer 2; the first step plans without loads.
    if policy == "static":
        assert replicas == [0] * 24
    if policy == "popularity":  # one spare slot per rank: at most 2, and both used at times
        assert all(1 <= n <= 2 for n in replicas[2:]) and 2 in replicas, replicas
    if policy == "memory-aware":
        # Replicas fit the budget (no call had its quotas lowered) and pay off.
        assert max(replicas) > 0 and improved > 0, (replicas, improved)
        assert all(r["lrmoe/budget-adjusted-calls"] == 0 for r in records)


@pytest.mark.parametrize("policy", ["popularity", "memory-aware"])
def test_policy_ep2_pp2_on_4_ranks(gloo4, corpus, policy):
    results = gloo4.run(_train, TINY + ["--moe-lrmoe", *POLICIES[policy], "--data-path", corpus,
                                        "--train-iters", "8", "--pipeline-model-parallel-size",
                                        "2", "--expert-model-parallel-size", "2",
                                        "--global-batch-size", "16"], timeout=420)
    assert all(r["losses"] == results[0]["losses"] for r in results)
    assert _decreased(results[0]["losses"], margin=0.2), results[0]["losses"]


def test_resume_with_another_placement_is_correct(gloo2, corpus, tmp_path):
    """Checkpoints hold home weights only: a popularity run resumed as static (nothing
    dropped) continues exactly like a static run resumed from the same checkpoint."""
    base = TINY + NO_DROPOUT + ["--moe-lrmoe", "--moe-lrmoe-bwd-capacity-factor", "inf",
                                "--data-path", corpus, "--train-iters", "6",
                                "--expert-model-parallel-size", "2"]
    ckpt = str(tmp_path / "ckpt")
    gloo2.run(_train, base + POLICIES["popularity"] + ["--save", ckpt, "--exit-interval", "3"],
              timeout=300)
    as_static = gloo2.run(_train, base + ["--load", ckpt], timeout=300)[0]["losses"]
    as_popularity = gloo2.run(_train, base + POLICIES["popularity"] + ["--load", ckpt],
                              timeout=300)[0]["losses"]
    assert as_popularity == pytest.approx(as_static, rel=1e-5)


DISTOPT_OVERLAP = ["--use-distributed-optimizer", "--overlap-grad-reduce",
                   "--overlap-param-gather"]


def _without_drops(calibration: str) -> dict[str, list[str]]:
    """Replica policies with nothing dropped: SYMI-style, and memory-aware with a budget
    far above the need (at gamma = inf no budget lowers gamma anyway)."""
    return {"popularity": POLICIES["popularity"],
            "memory-aware": ["--moe-lrmoe-placement", "memory-aware",
                             "--moe-lrmoe-memory-budget-gb", "1", "--moe-lrmoe-calibration",
                             calibration]}


def _replicas_equal_megatron(pool, base: list[str], calibration: str, tmp_path) -> None:
    megatron = pool.run(_train, base, timeout=420)[0]["losses"]
    for name, policy in _without_drops(calibration).items():
        log = tmp_path / f"{name}.jsonl"
        got = pool.run(_train, base + ["--moe-lrmoe", "--moe-lrmoe-bwd-capacity-factor", "inf",
                                       *policy, "--log-interval", "1", "--log-json", str(log)],
                       timeout=420)[0]["losses"]
        assert got == pytest.approx(megatron, rel=1e-5), name
        replicas = [r[f"lrmoe/layer{n}/replicas"] for r in _logged(log) for n in (1, 2)]
        assert max(replicas) > 0, (name, replicas)   # replicas computed pairs


@pytest.mark.parametrize("extra", [[], DISTOPT_OVERLAP], ids=["plain", "distopt-overlap"])
def test_symi_baseline_without_drops_equals_megatron(gloo2, corpus, extra, tmp_path,
                                                     compute_bound_calibration):
    """Replicas move where pairs are computed, nothing else: with gamma = inf the losses
    are Megatron's, with two micro-batches per step (replica gradients accumulate, and
    join the homes' before the overlapped reduction of the last backward starts)."""
    base = TINY + NO_DROPOUT + ["--data-path", corpus, "--train-iters", "6",
                                "--expert-model-parallel-size", "2", "--global-batch-size", "16",
                                *extra]
    _replicas_equal_megatron(gloo2, base, compute_bound_calibration, tmp_path)


def test_replicas_without_drops_equal_megatron_on_4_ranks_ep2(gloo4, corpus, tmp_path,
                                                              compute_bound_calibration):
    """The same with two expert-data-parallel groups (4 ranks, EP=2): each group routes
    its own tokens to replicas, the planners pool their counts over the groups."""
    base = TINY + NO_DROPOUT + ["--data-path", corpus, "--train-iters", "5",
                                "--expert-model-parallel-size", "2", "--global-batch-size", "32",
                                *DISTOPT_OVERLAP]
    _replicas_equal_megatron(gloo4, base, compute_bound_calibration, tmp_path)


def test_budget_below_the_floor_is_refused(gloo1, corpus):
    # The floor: balanced routing with nothing retained (planning.plan_types.budget_floor);
    # above it the planner lowers gamma instead (tests/integration/test_planner_inputs.py).
    from lrmoe_testing.gloo_pool import TaskFailed

    with pytest.raises(TaskFailed, match=r"ConfigError: --moe-lrmoe-memory-budget-gb 1e-06 is "
                                         r"below the floor of [0-9.e-]+ GiB per rank"):
        gloo1.run(_train, TINY + ["--moe-lrmoe", "--moe-lrmoe-placement", "memory-aware",
                                  "--moe-lrmoe-memory-budget-gb", "1e-6",
                                  "--data-path", corpus, "--train-iters", "3"], timeout=120)


def test_budget_between_floor_and_dropless_need_trains_with_gamma_lowered(
        gloo1, corpus, tmp_path, compute_bound_calibration):
    # TINY's MoE layers on one rank (fp32, 4 x 64 tokens per micro-batch): between the
    # floor and the balanced dropless need even balanced routing does not fit at gamma 1
    # (the default rule), so the run starts and every call's plan lowers gamma.
    from megatron_lrmoe.config.transformer_config import LRMoETransformerConfig
    from megatron_lrmoe.integration.planner_inputs import machine_constants, moe_shape
    from megatron_lrmoe.planning.cost_model import CostModel
    from megatron_lrmoe.planning.memory_account import GIB
    from megatron_lrmoe.planning.plan_types import budget_floor

    config = LRMoETransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
        num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64, gated_linear_unit=True,
        moe_token_dispatcher_type="alltoall", add_bias_linear=False, moe_lrmoe=True,
        moe_lrmoe_bwd_capacity_factor=1.0)
    cost = CostModel(moe_shape(config, 4 * 64, 1, 1),
                     machine_constants(compute_bound_calibration, "cpu"))
    floor, need = budget_floor(cost), cost.balanced_dropless_need()
    budget = (floor + need) / 2 / GIB
    log = tmp_path / "log.jsonl"
    results = gloo1.run(_train, TINY + [
        "--moe-lrmoe", "--moe-lrmoe-bwd-capacity-factor", "1.0",
        "--moe-lrmoe-placement", "memory-aware", "--moe-lrmoe-memory-budget-gb", f"{budget:.9g}",
        "--moe-lrmoe-calibration", compute_bound_calibration, "--data-path", corpus,
        "--train-iters", "3", "--log-interval", "1", "--log-json", str(log)], timeout=120)
    assert all(map(math.isfinite, results[0]["losses"]))
    records = _logged(log)
    assert [r["iteration"] for r in records] == [1, 2, 3]
    assert all(r["lrmoe/budget-adjusted-calls"] > 0 for r in records)
