"""Is memory-aware placement monotone in the memory budget? A search, not a timing.

    .venv/bin/python benchmarks/bench_budget_monotonicity.py \
        --out benchmarks/results/budget_monotonicity.md

For each case (seed, Zipf exponent, ranks, gamma) one layer's planner observes one
skewed count matrix and picks its placement at a ladder of budgets (multiples of the
balanced dropless need); the planner's own estimate of the layer time (forward +
backward + amortised replica refresh, the cost model's numbers) should never rise when
the budget grows. With a finite gamma a smaller budget may lower gamma (more drops,
a cheaper backward), so there plans are compared at an equal gamma; raw rises are
counted too, and whether the gamma used falls, for memory-aware and for static placement
(the budget rule's own behaviour). The mean estimate relative to
static placement at each budget shows what the replicas buy.
Machine constants are fixed (1 GFLOP/s, 1 GB/s, 1 us): the question is the search's,
not this machine's. Prints a table; ``--out`` writes it with the command and the code.
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
from pathlib import Path

import torch

from megatron_lrmoe.planning.cost_model import CostModel
from megatron_lrmoe.planning.machine import MachineConstants
from megatron_lrmoe.planning.planner import LayerPlanner, PlannerSettings
from megatron_lrmoe.planning.shapes import MoEShape
from megatron_lrmoe.tools.provenance import code_version

MACHINE = MachineConstants(gemm_flops_per_s=1e9, alltoall_bytes_per_s=1e9,
                           alltoall_latency_s=1e-6, source="fixed constants")
SLACKS = (1.0, 1.1, 1.2, 1.35, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0)


def skewed_counts(num_ranks: int, num_experts: int, pairs: int, seed: int,
                  zipf: float) -> torch.Tensor:
    """[R, E]: each rank draws ``pairs`` experts from Zipf(zipf) over a random order."""
    gen = torch.Generator().manual_seed(seed)
    popularity = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64) ** zipf
    popularity = popularity[torch.randperm(num_experts, generator=gen)]
    draws = torch.multinomial(popularity.expand(num_ranks, -1), pairs, replacement=True,
                              generator=gen)
    return torch.stack([torch.bincount(d, minlength=num_experts) for d in draws])


def estimated_time(cost: CostModel, planner: LayerPlanner, counts: torch.Tensor) -> float:
    retention = planner.plan(counts).retention
    fwd, bwd = cost.layer_time(retention.routed_matrix.numpy(),
                               retention.retained_matrix.numpy())
    p = planner.placement
    sync = cost.replica_sync_time(p.replicas, p.num_ranks, p.experts_per_rank)
    return fwd + bwd + sync / cost.shape.microbatches_per_step


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    rows, gains = [], []
    for gamma in (math.inf, 1.0):
        steps = rises = fell = static_fell = equal_rises = 0
        worst, example = 0.0, "-"
        ratios: dict[float, list[float]] = {slack: [] for slack in SLACKS}
        for seed in range(0, 3 * args.seeds, 3):
            for zipf in (0.5, 1.0, 1.5):
                for ranks in (2, 4, 8):
                    experts = 8 if ranks < 8 else 16
                    counts = skewed_counts(ranks, experts, 128, seed, zipf)
                    cost = CostModel(MoEShape(
                        hidden_size=64, ffn_hidden_size=32, num_experts=experts, topk=2,
                        gated=True, dtype_bytes=2, tokens_per_rank=64, num_layers=2,
                        microbatches_in_flight=1, microbatches_per_step=4,
                        # the default rule (uniform) draws the retained set in forward
                        forward_retention=True), MACHINE)
                    previous = None
                    for slack in SLACKS:
                        budget = cost.balanced_dropless_need() * slack
                        planner, static = (LayerPlanner(PlannerSettings(
                            policy, ranks, experts, capacity_factor=gamma,
                            budget_bytes=budget, cost=cost))
                            for policy in ("memory-aware", "static"))
                        planner.observe(counts)
                        planner.next_step()
                        t = estimated_time(cost, planner, counts)
                        g = planner.plan(counts).capacity_factor_used
                        g_static = static.plan(counts).capacity_factor_used
                        ratios[slack].append(t / estimated_time(cost, static, counts))
                        if previous is not None:
                            steps += 1
                            g_prev, t_prev, g_static_prev = previous
                            fell += g < g_prev
                            static_fell += g_static < g_static_prev
                            if t > t_prev * (1 + 1e-12):
                                rises += 1
                                equal_rises += g == g_prev
                                if t / t_prev - 1 > worst:
                                    worst = t / t_prev - 1
                                    example = (f"seed {seed}, zipf {zipf}, {ranks} ranks, "
                                               f"{slack}x need")
                        previous = (g, t, g_static)
        rows.append(f"| {gamma:g} | {steps} | {rises} | {100 * worst:.1f}% | {example} | "
                    f"{fell} | {static_fell} | {equal_rises} |")
        gains.append(f"| {gamma:g} | " + " | ".join(
            f"{sum(v) / len(v):.3f}" for v in ratios.values()) + " |")
    table = "\n".join([
        "| gamma | budget steps | estimate rose | largest rise | at | gamma used fell "
        "| static's gamma fell | rose at equal gamma |",
        "|---|---|---|---|---|---|---|---|", *rows, "",
        "Mean estimate relative to static placement, by budget (x the balanced need):", "",
        "| gamma | " + " | ".join(f"{s:g}x" for s in SLACKS) + " |",
        "|---|" + "---|" * len(SLACKS), *gains])
    print(table)
    if args.out:
        command = " ".join(shlex.quote(a) for a in [".venv/bin/python", *sys.argv])
        args.out.write_text("\n".join([
            "# Memory-aware placement: is the estimate monotone in the budget?", "",
            f"- command: `{command}`", f"- code: {code_version()}",
            f"- budgets: {', '.join(f'{s:g}' for s in SLACKS)} x the balanced dropless need;"
            f" seeds 0, 3, ..., {3 * args.seeds - 3}; Zipf 0.5/1.0/1.5; 2/4/8 ranks "
            "(8/8/16 experts), 128 pairs per rank, top-2", "", table, ""]))
        print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
