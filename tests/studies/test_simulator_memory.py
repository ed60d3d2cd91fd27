"""The recorded-call memory comparison: routing forced to exact counts, measured on gloo
ranks (workshop/lrmoe_studies/simulator_memory.py, layer_bench.counts_routing)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lrmoe_studies.layer_bench import counts_routing
from megatron_lrmoe.planning.megatron_baseline import MegatronMoEMemory, megatron_kept_counts
from megatron_lrmoe.planning.shapes import MoEShape

# TINY's MoE layers (tests/launcher/test_routing_record.py) at EP 2 need 0.00121 GiB per
# rank for balanced routing without drops: this budget leaves room for a replica on most
# calls and lowers gamma on some.
BUDGET_GIB = "0.00136"


def _random_counts(rng: np.random.Generator, tokens: int, experts: int, topk: int,
                   zipf: float) -> np.ndarray:
    """[E] column sums of a random top-k routing: Zipf-popular experts, no repeats."""
    popularity = np.arange(1, experts + 1, dtype=np.float64) ** -zipf
    popularity = rng.permutation(popularity / popularity.sum())
    counts = np.zeros(experts, dtype=np.int64)
    for _ in range(tokens):
        counts[rng.choice(experts, topk, replace=False, p=popularity)] += 1
    return counts


@pytest.mark.parametrize("seed", range(6))
def test_counts_routing_reproduces_the_counts_exactly(seed):
    rng = np.random.default_rng(seed)
    tokens, experts = int(rng.integers(1, 40)), int(rng.integers(2, 24))
    topk = int(rng.integers(1, experts + 1))
    rows = [_random_counts(rng, tokens, experts, topk, float(rng.uniform(0, 2.5))),
            # a capacity drop: some tokens keep fewer than top-k experts, some none
            megatron_kept_counts(_random_counts(rng, tokens, experts, topk, 2.0)[None],
                                 tokens, topk, 0.5)[0].astype(np.int64),
            # the extreme: top-k experts take every token
            np.array([tokens] * topk + [0] * (experts - topk))]
    for counts in rows:
        probs, routing_map = counts_routing(counts, tokens, topk, seed, 3, torch.float32)
        assert routing_map.sum(0).tolist() == counts.tolist()
        per_token = routing_map.sum(1)
        assert int(per_token.max()) <= topk
        if counts.sum() == tokens * topk:
            assert per_token.tolist() == [topk] * tokens
        routed = per_token > 0
        assert torch.allclose(probs[routed].sum(1), torch.ones(int(routed.sum())))
        assert (probs[~routing_map] == 0).all() and (probs[routing_map] > 0).all()


def test_counts_routing_refuses_counts_no_routing_has():
    with pytest.raises(ValueError, match="tokens=4"):
        counts_routing([5, 3], 4, 2, 0, 0, torch.float32)      # an expert above T
    with pytest.raises(ValueError, match="tokens x topk"):
        counts_routing([4, 4, 1], 4, 2, 0, 0, torch.float32)   # more pairs than T k


def test_measured_layers_receive_the_forced_counts(gloo2):
    # Two gloo ranks: each rank's routing forced to its row of a skewed [R, E], through
    # Megatron's MoELayer and an LRMoELayer (gamma = inf, static placement, a one-call
    # history); the measured saved bytes and peak beside the models' (MegatronMoEMemory
    # with probabilities that require grad, as measure_calls passes them;
    # CostModel.plan_levels of the plan).
    from lrmoe_studies.simulator_memory import measure_calls
    from megatron_lrmoe.planning.cost_model import CostModel
    from megatron_lrmoe.planning.machine import MachineConstants
    from megatron_lrmoe.planning.planner import PlannerSettings
    from megatron_lrmoe.planning.retention import plan_retention

    cfg = dict(device="cpu", dtype="fp32", ep=2, seed=7, hidden=32, ffn=16, experts=8,
               topk=2, tokens=64, kernels="auto", grouped_gemm="off")
    rng = np.random.default_rng(0)
    counts = np.stack([_random_counts(rng, cfg["tokens"], 8, 2, 1.5) for _ in range(2)])
    static = {"options": {"moe_lrmoe_bwd_capacity_factor": float("inf")},
              "settings": PlannerSettings("static", 2, 8, capacity_factor=float("inf")),
              "microbatches": 1, "earlier": [], "step": [counts], "micro": 0}
    jobs = [{"counts": counts.tolist(), "capacity_factor": None},
            {"counts": counts.tolist(), "capacity_factor": None, "lrmoe": static}]
    results = gloo2.run(measure_calls, cfg, jobs, timeout=300)
    shape = MoEShape(cfg["hidden"], cfg["ffn"], 8, 2, True, 4, cfg["tokens"],
                     expert_parallel_size=2, forward_retention=True)
    cost = CostModel(shape, MachineConstants(gemm_flops_per_s=1.0, alltoall_bytes_per_s=1.0))
    plan = plan_retention(torch.from_numpy(counts), 2, float("inf"))
    models = [MegatronMoEMemory(shape).rank_memory(counts), cost.plan_levels(plan, np.zeros(2))]
    for rank, measured in enumerate(results):
        for (saved, peak), m in zip(models, measured, strict=True):
            assert m["forced_exact"]
            assert abs(saved[rank] / m["mem_saved"] - 1) <= 0.05, (rank, saved, m)
            assert abs(peak[rank] / m["mem_peak"] - 1) <= 0.05, (rank, peak, m)
        assert measured[1]["plan"]["replicas"] == 0
        assert measured[1]["plan"]["kept_rows_per_instance"] == counts.sum(0).tolist()


def _threads_after_builds(cfg: dict, builds: int) -> list[int]:
    """This rank's OS threads after each of ``builds`` layers built in one task, as
    measure_calls builds one per job (gloo's threads are not Python threads)."""
    import os

    from lrmoe_studies.layer_bench import build_lrmoe_layer, build_megatron_layer

    counts = []
    for i in range(builds):
        layer = (build_megatron_layer(cfg) if i % 2 else
                 build_lrmoe_layer(cfg, moe_lrmoe_bwd_capacity_factor=1.0))
        del layer
        counts.append(len(os.listdir("/proc/self/task")))
    return counts


def test_a_layer_per_job_does_not_add_process_groups(gloo2):
    # A new model-parallel state per job left every earlier job's gloo groups running
    # (about 60 threads a job at EP 16): the EP 16 measurement slowed to a crawl.
    cfg = dict(device="cpu", dtype="fp32", ep=2, seed=7, hidden=32, ffn=16, experts=8,
               topk=2, tokens=64, kernels="auto", grouped_gemm="off")
    for counts in gloo2.run(_threads_after_builds, cfg, 4, timeout=300):
        assert counts[1:] == counts[:1] * 3, counts


# -----------------------------------------------------------------------------
# A fresh LRMoE run on 2 gloo ranks: memory-aware placement under a budget
# -----------------------------------------------------------------------------

def test_a_fresh_memory_aware_runs_calls_are_planned_and_measured_as_the_model_says(
        gloo2, corpus, tmp_path):
    # The oracle is the layer: an LRMoELayer with the run's options and planner settings,
    # its planner brought to each chosen call through its own step boundary, measured on
    # the allocator; the model is the simulator's replay of the same recorded counts.
    import copy
    import json
    import shlex

    from lrmoe_studies import simulator_memory as sm
    from megatron_lrmoe.integration.step_hooks import machine_constants_line
    from megatron_lrmoe.planning.machine import MachineConstants
    from tests.launcher.test_routing_record import TINY
    from tests.studies.test_simulator_counts import _train

    run = tmp_path / "run"
    run.mkdir()
    calibration = tmp_path / "compute_bound.json"
    machine = {"gemm_flops_per_s": 1e6, "alltoall_bytes_per_s": 1e18,
               "alltoall_latency_s": 0.0, "source": "test: compute-bound"}
    calibration.write_text(json.dumps(machine))
    # A budget between the balanced need without drops and with: memory-aware replicas
    # relieve the hot rank, and the budget lowers gamma on the hottest calls.
    flags = [*TINY, "--moe-lrmoe", "--moe-lrmoe-bwd-capacity-factor", "1.0",
             "--moe-lrmoe-placement", "memory-aware", "--moe-lrmoe-memory-budget-gb",
             BUDGET_GIB, "--moe-lrmoe-calibration", str(calibration),
             "--log-interval", "2", "--eval-iters", "0", "--data-path", corpus,
             "--record-routing", str(run / "routing"), "--log-json", str(run / "log.jsonl")]
    gloo2.run(_train, flags, timeout=300)
    (run / "done.json").write_text(json.dumps({"command": shlex.join(
        ["python", "-m", "megatron_lrmoe.launcher.pretrain", *flags])}))
    # What the run printed of its planner's machine constants (the replay reads them).
    (run / "stdout.txt").write_text(machine_constants_line(MachineConstants(**machine)) + "\n")

    cfg, jobs = sm.run_jobs(run, None, 1234)
    # Not trivial: the chosen calls hold replicas and drop, some by the budget.
    assert any(j["replicas"] > 0 for j in jobs), jobs
    assert any(sum(j["plan"]["kept_per_source"]) < np.sum(j["counts"]) for j in jobs)
    assert any(j["budget_adjusted"] for j in jobs), jobs
    per_rank = gloo2.run(sm.measure_calls, cfg, jobs, timeout=600)
    rows = sm.compare(jobs, per_rank)
    for row in rows:
        assert row["forced_exact"] and row["plan_exact"], row
        assert row["peak_err"] <= sm.TOLERANCE and row["saved_err"] <= sm.TOLERANCE, row
    assert sm.passed(rows)
    # A plan the layer did not make is caught: one kept pair more on one source.
    changed = copy.deepcopy(jobs)
    changed[0]["plan"]["kept_per_source"][1] += 1
    rows = sm.compare(changed, per_rank)
    assert [r["plan_exact"] for r in rows] == [False] + [True] * (len(rows) - 1)
    assert not sm.passed(rows)



def test_lrmoe_history_pools_a_steps_counts_over_the_ep_groups():
    # Host only: two EP groups of a layer, two steps of two micro-batches; the call is the
    # second group's second micro-batch of step 2. Its layer folds step 1's counts of
    # both groups (4 observations), plans step 2 from its own group's counts.
    from types import SimpleNamespace

    from lrmoe_studies.simulator_counts import CallCounts
    from lrmoe_studies.simulator_memory import lrmoe_history

    def call(iteration, micro, group, layer=1):
        counts = np.full((2, 4), 10 * iteration + 3 * micro + group)
        return CallCounts(iteration, layer, micro, group, [2 * group, 2 * group + 1], counts,
                          *[None] * 5, np.zeros(2), 0, 0, False, 0, None, None, None)

    calls = [call(i, m, g, n) for n in (1, 2) for i in (1, 2) for m in (0, 1) for g in (0, 1)]

    replay = SimpleNamespace(lrmoe_options={"moe_lrmoe_placement": "popularity"},
                             layer_settings="settings",
                             shape=SimpleNamespace(microbatches_per_step=2))
    chosen = next(c for c in calls if (c.layer, c.iteration, c.micro, c.group) == (1, 2, 1, 1))
    history = lrmoe_history(replay, calls, chosen)
    [(own, pooled, count)] = history["earlier"]
    assert [o[0, 0] for o in own] == [11, 14] and count == 4
    assert (pooled == 10 + 13 + 11 + 14).all()
    assert [s[0, 0] for s in history["step"]] == [21, 24] and history["micro"] == 1
    # One EP group: the layer's own observations stand (None).
    single = [c for c in calls if c.group == 1]
    assert lrmoe_history(replay, single, chosen)["earlier"][0][1] is None
