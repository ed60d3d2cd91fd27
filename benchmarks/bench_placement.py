"""Placement under one memory budget: Megatron dropless vs SYMI-style replicas vs LRMoE.

    .venv/bin/python benchmarks/bench_placement.py            # CPU, EP=2 over 2 gloo ranks
    .venv/bin/python benchmarks/bench_placement.py --quick    # tiny smoke run

One MoE layer, skewed routing (Zipf popularity, hottest experts on the lowest ranks),
the same weights and inputs for every setting, measured side by side in one run:

  megatron       Megatron-Core's MoELayer (all-to-all dispatcher, dropless)
  symi           LRMoE layer, ``--moe-lrmoe-placement popularity``, capacity inf: the
                 SYMI-style baseline (replicas by popularity, the budget converted to
                 instance slots, nothing dropped)
  lrmoe-static   LRMoE layer, no replicas, backward capacity ``--gamma`` (drop only)
  lrmoe          LRMoE layer, ``memory-aware`` placement and backward capacity
                 ``--gamma``: replicas where the budget leaves room, chosen with the quotas

The budget (``--moe-lrmoe-memory-budget-gb``) is the same for symi and both lrmoe
settings: the balanced dropless need of this shape plus ``--budget-replicas`` expert
instances per rank. Each LRMoE layer first runs ``--warmup`` steps so its planner
has seen the routing (placement for step n+1 comes from the loads of step n).

Timing as ``bench_moe_layer.py``: per repetition the slowest rank's forward and
backward (barriers around each), median over repetitions, settings rotated every
repetition; one gloo process per rank, one thread each. Loads are exact counts from
the plans; "replica MiB" is what the layer's replicas hold (weights + gradient
buffers, measured tensors); "buffers MiB" is the cost model's execution-buffer
estimate at the routed and retained loads of the hottest rank (docs/design.md, "Cost model").
"""

from __future__ import annotations

import argparse
import datetime
import gc
import math
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from lrmoe_studies.layer_bench import (
    DTYPES,
    GLIBC_CACHING_TUNABLES,
    build_layers,
    gather_counts,
    layer_config_kwargs,
    one_step,
    skewed_routing,
)
from megatron_lrmoe.tools.provenance import code_version

ROOT = Path(__file__).resolve().parents[1]

SETTINGS = ("megatron", "symi", "lrmoe-static", "lrmoe")


def _variants(cfg: dict) -> dict[str, dict]:
    budget = dict(moe_lrmoe_memory_budget_gb=cfg["budget_gb"])
    return {
        "symi": dict(moe_lrmoe_placement="popularity", moe_lrmoe_bwd_capacity_factor=math.inf,
                     **budget),
        "lrmoe-static": dict(moe_lrmoe_placement="static",
                             moe_lrmoe_bwd_capacity_factor=cfg["gamma"]),
        "lrmoe": dict(moe_lrmoe_placement="memory-aware",
                      moe_lrmoe_bwd_capacity_factor=cfg["gamma"], **budget),
    }


def run_worker(cfg: dict) -> dict:
    """Every setting on this rank: per-repetition times, the last plan's loads, memory."""
    import torch.distributed as dist

    from megatron_lrmoe.planning.retention import plan_retention

    rank = dist.get_rank()
    megatron, _, extra = build_layers(cfg, _variants(cfg))
    layers = {"megatron": megatron, **extra}
    dtype = DTYPES[cfg["dtype"]]
    probs, routing_map = skewed_routing(cfg["tokens"], cfg["experts"], cfg["topk"], cfg["zipf"],
                                        cfg["seed"], rank, dtype)

    def fixed_route(hidden_states, padding_mask=None, _r=(probs, routing_map)):
        return _r

    for layer in layers.values():
        layer.route = fixed_route
    g = torch.Generator().manual_seed(cfg["seed"] + 1000 + rank)
    x = torch.randn(cfg["tokens"], 1, cfg["hidden"], generator=g, dtype=dtype)
    dy = torch.randn(cfg["tokens"], 1, cfg["hidden"], generator=g, dtype=dtype)
    gc.collect()
    gc.freeze()

    def barrier():
        dist.barrier()

    times = {name: ([], []) for name in SETTINGS}
    for rep in range(cfg["warmup"] + cfg["reps"]):
        shift = rep % len(SETTINGS)
        for name in SETTINGS[shift:] + SETTINGS[:shift]:
            t_f, t_b, *_ = one_step(layers[name], x, dy, lambda: None, barrier)
            if rep >= cfg["warmup"]:
                times[name][0].append(t_f)
                times[name][1].append(t_b)
    counts = gather_counts(routing_map, cfg["ep"])
    result = {"rank": rank, "times": times, "plans": {}, "replica_bytes": {}}
    for name, layer in layers.items():
        if name == "megatron":
            plan, replicas, placement = plan_retention(counts, cfg["ep"], math.inf), 0, ""
        else:
            plan = layer.last_plan.retention
            replicas = layer.replicas.memory_bytes()
            placement = layer.placement_planner.placement.describe()
        result["plans"][name] = {
            "routed": plan.routed_per_rank.tolist(), "retained": plan.retained_per_rank.tolist(),
            "replicas_per_rank": _replicas_per_rank(plan), "placement": placement,
        }
        result["replica_bytes"][name] = replicas
    gc.unfreeze()
    return result


def _replicas_per_rank(plan) -> list[int]:
    """Instances per rank beyond its E / R homes."""
    experts_per_rank = (max(plan.instance_expert) + 1) // plan.num_ranks
    per_rank = [0] * plan.num_ranks
    for r in plan.instance_rank:
        per_rank[r] += 1
    return [n - experts_per_rank for n in per_rank]


def _cost_model(cfg: dict):
    """The cost model of the benchmarked shape (memory estimates; no timing used)."""
    from megatron_lrmoe.integration.planner_inputs import machine_constants, moe_shape
    from megatron_lrmoe.planning.cost_model import CostModel

    config = _config(cfg)
    return CostModel(moe_shape(config, cfg["tokens"]), machine_constants(None, "cpu"))


def _config(cfg: dict):
    from megatron_lrmoe.config.transformer_config import LRMoETransformerConfig

    return LRMoETransformerConfig(**layer_config_kwargs(cfg), moe_lrmoe=True)


def summarize(cfg: dict, per_rank: list[dict]) -> list[dict]:
    cost = _cost_model(cfg)
    rows = []
    reference_bwd = None
    for name in SETTINGS:
        reps = len(per_rank[0]["times"][name][0])
        fwd = [max(r["times"][name][0][i] for r in per_rank) for i in range(reps)]
        bwd = [max(r["times"][name][1][i] for r in per_rank) for i in range(reps)]
        plan = per_rank[0]["plans"][name]
        routed = torch.tensor(plan["routed"], dtype=torch.float64)
        retained = torch.tensor(plan["retained"], dtype=torch.float64)
        replicas = torch.tensor(plan["replicas_per_rank"], dtype=torch.float64)
        buffers = torch.from_numpy(cost.rank_memory(
            torch.zeros_like(replicas).numpy(), routed.numpy(), retained.numpy()))
        row = {
            "setting": name, "fwd_ms": 1e3 * statistics.median(fwd),
            "bwd_ms": 1e3 * statistics.median(bwd), "fwd_reps": fwd, "bwd_reps": bwd,
            "fwd_load": float(routed.max() / routed.mean()),
            "bwd_load": float(retained.max() / routed.mean()),
            "retained": float(retained.sum() / routed.sum()),
            "replicas": int(replicas.sum()),
            "replica_mib": max(r["replica_bytes"][name] for r in per_rank) / 2**20,
            "buffer_mib": float(buffers.max()) / 2**20,
            "total_mib": float((buffers + replicas * cost.shape.instance_bytes).max()) / 2**20,
            "placement": plan["placement"],
        }
        rows.append(row)
        if name == "megatron":
            reference_bwd = row
    for row in rows:
        row["step_vs_megatron"] = statistics.median(
            (f + b) / (mf + mb) for f, b, mf, mb in zip(
                row["fwd_reps"], row["bwd_reps"], reference_bwd["fwd_reps"],
                reference_bwd["bwd_reps"], strict=True))
    return rows


def markdown(cfg: dict, rows: list[dict], command: str, wall: float) -> str:
    budget_mib = cfg["budget_gb"] * 2**30 / 2**20
    lines = [
        "# Placement under one memory budget (benchmarks/bench_placement.py)",
        "",
        f"Command: `{command}`",
        "",
        f"Code: {code_version()}",
        "",
        f"Date {datetime.date.today().isoformat()}; {cfg['ep']} EP ranks = {cfg['ep']} gloo "
        f"processes, one thread each, on {os.cpu_count()} cores; H={cfg['hidden']} "
        f"F={cfg['ffn']} E={cfg['experts']} top-{cfg['topk']} {cfg['dtype']}, "
        f"{cfg['tokens']} tokens per rank, Zipf({cfg['zipf']}) popularity, hottest experts "
        f"on rank 0. Budget {cfg['budget_gb']:.4f} GiB per rank ({budget_mib:.1f} MiB = "
        f"balanced dropless need + {cfg['budget_replicas']} expert instances); LRMoE "
        f"backward capacity gamma = {cfg['gamma']:g}. Medians over {cfg['reps']} repetitions "
        f"after {cfg['warmup']} warm-up steps; whole run {wall:.0f} s.",
        "",
        "| setting | fwd ms | bwd ms | fwd+bwd vs megatron | fwd load max/mean "
        "| bwd load max/mean | retained | replicas | replica MiB (max rank) "
        "| buffers MiB (hot rank, model) | replicas + buffers MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['setting']} | {r['fwd_ms']:.1f} | {r['bwd_ms']:.1f} "
            f"| {r['step_vs_megatron']:.2f} | {r['fwd_load']:.2f} | {r['bwd_load']:.2f} "
            f"| {r['retained']:.3f} | {r['replicas']} | {r['replica_mib']:.2f} "
            f"| {r['buffer_mib']:.1f} | {r['total_mib']:.1f} |")
    lines += ["", "Placements at the end of the run:", ""]
    lines += [f"- {r['setting']}: {r['placement'] or 'Megatron layout'}" for r in rows]
    lines += [
        "",
        "Loads are relative to the mean routed pairs per rank; \"bwd load\" counts the "
        "retained pairs of the busiest rank (so below 1 means backward work under the mean "
        "forward load). \"fwd+bwd vs megatron\" is the median over repetitions of the "
        "per-repetition ratio (settings run seconds apart in each repetition).",
    ]
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--quick", action="store_true", help="tiny smoke run (seconds)")
    p.add_argument("--ep", type=int, default=2)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="fp32")
    p.add_argument("--zipf", type=float, default=1.2)
    p.add_argument("--gamma", type=float, default=1.0, help="LRMoE backward capacity factor")
    p.add_argument("--budget-replicas", type=float, default=4.0,
                   help="budget = balanced dropless need + this many expert instances")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", type=Path, default=None,
                   help="markdown output (default benchmarks/results/bench_placement_cpu.md; "
                        "--quick writes nothing unless given)")
    args = p.parse_args(argv)
    if args.quick:
        args.hidden, args.ffn, args.experts, args.tokens = 64, 64, 8, 256
        args.warmup, args.reps = 2, 2
    if args.out is None and not args.quick:
        args.out = ROOT / "benchmarks" / "results" / "bench_placement_cpu.md"
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    cfg = {k: v for k, v in vars(args).items() if k not in ("out", "quick")}
    cfg.update(device="cpu", kernels="auto", grouped_gemm="auto")
    cost = _cost_model({**cfg, "budget_gb": 0.0})
    need = cost.balanced_dropless_need()
    cfg["budget_gb"] = (need + args.budget_replicas * cost.shape.instance_bytes) / 2**30
    command = " ".join(shlex.quote(a) for a in [".venv/bin/python", "benchmarks/bench_placement.py",
                                                 *(sys.argv[1:] if argv is None else argv)])
    tunables = [t for t in os.environ.get("GLIBC_TUNABLES", "").split(":") if t]
    os.environ["GLIBC_TUNABLES"] = ":".join([*tunables, *GLIBC_CACHING_TUNABLES])
    from lrmoe_testing.gloo_pool import GlooPool

    start = time.perf_counter()
    pool = GlooPool(args.ep)
    try:
        per_rank = pool.run(run_worker, cfg, timeout=3600)
    finally:
        pool.close()
    rows = summarize(cfg, per_rank)
    text = markdown(cfg, rows, command, time.perf_counter() - start)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
