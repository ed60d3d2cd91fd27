"""The recorded-call memory comparison: routing forced to exact counts, measured on gloo
ranks (megatron_lrmoe/tools/simulator_memory.py, layer_bench.counts_routing)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_lrmoe.planning.megatron_baseline import MegatronMoEMemory, megatron_kept_counts
from megatron_lrmoe.planning.shapes import MoEShape
from megatron_lrmoe.tools.layer_bench import counts_routing


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
    # Megatron's MoELayer and an LRMoELayer (gamma = inf, no replicas); the measured saved
    # bytes and peak beside the models' (MegatronMoEMemory with probabilities that
    # require grad, as measure_calls passes them; CostModel.plan_levels of the plan).
    from megatron_lrmoe.planning.cost_model import CostModel
    from megatron_lrmoe.planning.machine import MachineConstants
    from megatron_lrmoe.planning.retention import default_retention_in_forward, plan_retention
    from megatron_lrmoe.tools.simulator_memory import measure_calls

    cfg = dict(device="cpu", dtype="fp32", ep=2, seed=7, hidden=32, ffn=16, experts=8,
               topk=2, tokens=64, kernels="auto", grouped_gemm="off")
    rng = np.random.default_rng(0)
    counts = np.stack([_random_counts(rng, cfg["tokens"], 8, 2, 1.5) for _ in range(2)])
    jobs = [{"counts": counts.tolist(), "capacity_factor": None, "gamma": gamma}
            for gamma in (None, float("inf"))]
    results = gloo2.run(measure_calls, cfg, jobs, timeout=300)
    shape = MoEShape(cfg["hidden"], cfg["ffn"], 8, 2, True, 4, cfg["tokens"],
                     expert_parallel_size=2, forward_retention=default_retention_in_forward())
    cost = CostModel(shape, MachineConstants(gemm_flops_per_s=1.0, alltoall_bytes_per_s=1.0))
    models = [MegatronMoEMemory(shape).rank_memory(counts),
              cost.plan_levels(plan_retention(torch.from_numpy(counts), 2, float("inf")),
                               np.zeros(2))]
    for rank, measured in enumerate(results):
        for (saved, peak), m in zip(models, measured, strict=True):
            assert m["forced_exact"]
            assert abs(saved[rank] / m["mem_saved"] - 1) <= 0.05, (rank, saved, m)
            assert abs(peak[rank] / m["mem_peak"] - 1) <= 0.05, (rank, peak, m)
