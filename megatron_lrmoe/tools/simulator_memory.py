"""The simulator's per-rank MoE memory against the layer's, measured on recorded calls: a
run's recorded routing replayed through the simulator (``simulator_counts.replay_calls``),
and chosen calls of it run through Megatron's MoELayer on gloo ranks with the routing
forced to the call's exact [R, E] counts.

    .venv/bin/python benchmarks/studies/simulator_memory.py RUN_DIR... [--out DIR]

What is compared, per rank, for each layer's call with the hottest rank (the largest
received-pairs max/mean under Megatron's expert layout, ``static_load``) and its median
call (by the same figure):

- model: the simulator's bytes of one layer's forward+backward of that call before it
  composes a stage (``simulate.call_memory_levels``): ``MegatronMoEMemory.rank_memory``
  of the call's counts (LRMoE's layer: ``CostModel.plan_levels``, below), the saved
  bytes S and the peak, each above what exists before the call (the layer input, the
  routing, the weights and their gradient buffers).
- measured: ``layer_bench.measure_memory`` of one forward+backward of Megatron's
  MoELayer at the run's shape, EP size and capacity factor, each source rank's tokens
  routed so that its per-expert counts are exactly its recorded row
  (``layer_bench.counts_routing``), the probabilities a leaf that requires grad (as a
  trained router's do): the bytes autograd saves and the allocator's peak (the smaller
  of two steps, after an unmeasured one with the same routing). The dispatcher's index
  of the previous step (8 P bytes) is freed inside the span, as in a run, so the
  measured peak can sit that much below the model's.

The runs' recorded counts are after Megatron's capacity drop, so a capacity-drop run's
calls are forced as recorded into a layer built with its capacity factor (its router,
which drops, is bypassed). Recompute settings are not applied: the simulator composes a
stage from these no-recompute levels (``stage_moe_memory``).

Runs of LRMoE's layer (LRMoE, SYMI-style): their plans depend on the replicas the run's
planner placed, which the layer built here cannot take. For them the same counts are
planned without replicas (static placement, no budget, the run's gamma; the option
table's default selection, as the simulator models the layer) and an LRMoELayer with
that plan is measured against ``CostModel.plan_levels`` of it: the cost model on the
recorded counts, not the run's replicated plans.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megatron_lrmoe.tools.layer_bench import (
    DTYPES,
    build_megatron_layer,
    counts_routing,
    measure_memory,
)
from megatron_lrmoe.tools.provenance import code_version

__all__ = ["chosen_calls", "layer_cfg", "measure_calls", "run_jobs", "static_load"]

TOLERANCE = 0.05
_DTYPE_NAMES = {4: "fp32", 2: "bf16"}


def measure_calls(cfg: dict, jobs: list[dict]) -> list[dict]:
    """On every rank of the EP group (a ``GlooPool`` task): for each job (``counts``
    [R, E], ``capacity_factor``) one untimed forward+backward of Megatron's MoELayer with
    this rank's tokens routed to exactly its row of ``counts``; the layer is built once
    per capacity factor, in the jobs' order. Returns per job ``measure_memory``'s
    figures and whether the forced routing met the row (``forced_exact``)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    dtype = DTYPES[cfg["dtype"]]
    g = torch.Generator().manual_seed(cfg["seed"] + 1000 + rank)
    x = torch.randn(cfg["tokens"], 1, cfg["hidden"], generator=g).to(dtype)
    dy = torch.randn(cfg["tokens"], 1, cfg["hidden"], generator=g).to(dtype)

    def barrier():
        dist.barrier()

    out, layer, built = [], None, object()
    for job in jobs:
        key = (job.get("gamma"), job["capacity_factor"])
        if key != built:
            layer = None    # its process groups go with the model-parallel state
            built = key
            layer = _build_layer(cfg, *key)
        row = np.asarray(job["counts"], dtype=np.int64)[rank]
        probs, routing_map = counts_routing(row, cfg["tokens"], cfg["topk"], cfg["seed"],
                                            rank, dtype)
        probs.requires_grad_(True)   # a trained router's are: Megatron saves for them

        def forced_route(hidden_states, padding_mask=None, _r=(probs, routing_map)):
            return _r

        layer.route = forced_route
        memory = []
        # A first step unmeasured: Megatron's dispatcher holds the last call's routing
        # (probs, with its gradient, and the map) until the next call replaces it; after
        # another job's call that frees up to 2 T x E x 4 bytes inside the measured span.
        # Then the smaller peak of two, as bench_moe_layer.py keeps it.
        for _ in range(3):
            probs.grad = None
            memory.append(measure_memory(cfg, layer, x, dy, lambda: None, barrier))
        out.append({**min(memory[1:], key=lambda m: m["mem_peak"]),
                    "forced_exact": routing_map.sum(0).tolist() == row.tolist()})
    return out


def _build_layer(cfg: dict, gamma: float | None,
                 capacity_factor: float | None) -> torch.nn.Module:
    """Megatron's MoELayer (``gamma`` None) at ``capacity_factor``, or an LRMoELayer with
    the same weights at backward capacity ``gamma``, static placement and no budget (its
    planner rebuilt from the config, as bench_moe_layer.py switches gamma)."""
    if gamma is None:
        return build_megatron_layer(cfg, moe_expert_capacity_factor=capacity_factor)
    from megatron_lrmoe.integration.step_hooks import setup_lrmoe_layers
    from megatron_lrmoe.tools.layer_bench import build_layers

    _, lrmoe = build_layers(cfg)
    lrmoe.config.moe_lrmoe_bwd_capacity_factor = gamma
    setup_lrmoe_layers([lrmoe], cfg["tokens"], 1)
    return lrmoe


def layer_cfg(shape, ep: int, seed: int) -> dict:
    """The ``layer_bench`` cfg of a run's MoE layer shape at ``ep`` ranks (CPU)."""
    if not shape.gated or shape.grouped_gemm:
        raise SystemExit("simulator_memory: the benchmarked layer is gated (SwiGLU) with "
                         f"SequentialMLP experts; this run has gated={shape.gated}, "
                         f"grouped_gemm={shape.grouped_gemm}")
    if shape.dtype_bytes not in _DTYPE_NAMES:
        raise SystemExit(f"simulator_memory: dtype of {shape.dtype_bytes} bytes not supported")
    return {"device": "cpu", "dtype": _DTYPE_NAMES[shape.dtype_bytes], "ep": ep, "seed": seed,
            "hidden": shape.hidden_size, "ffn": shape.ffn_hidden_size,
            "experts": shape.num_experts, "topk": shape.topk,
            "tokens": shape.tokens_per_rank, "kernels": "auto", "grouped_gemm": "off"}


def static_load(counts: np.ndarray) -> float:
    """max/mean over ranks of the pairs each receives under Megatron's expert layout (no
    replicas: what the measured layer receives) from [R, E] counts."""
    from megatron_lrmoe.tools.simulator_counts import max_over_mean

    counts = np.asarray(counts)
    return max_over_mean(counts.sum(0).reshape(counts.shape[0], -1).sum(1))


def chosen_calls(calls: list, layers: list[int] | None = None) -> list[tuple[str, object]]:
    """Per layer (all, or ``layers``): ("hottest", the call with the largest received
    pairs max/mean without replicas, ``static_load``) and ("median", the call at the
    median of that figure, the lower one of an even count), in layer order; one entry
    where both are the same call."""
    out = []
    for number in sorted({c.layer for c in calls}):
        if layers is not None and number not in layers:
            continue
        mine = sorted((c for c in calls if c.layer == number),
                      key=lambda c: static_load(c.counts))
        hottest, median = mine[-1], mine[(len(mine) - 1) // 2]
        out.append(("hottest", hottest))
        if median is not hottest:
            out.append(("median", median))
    return out


def run_jobs(run: Path, layers: list[int] | None, seed: int) -> tuple[dict, list[dict]]:
    """(the run's cfg, its jobs: the chosen calls with the simulator's per-rank levels)."""
    from megatron_lrmoe.tools.simulate import Policy, call_memory_levels, policy_planner
    from megatron_lrmoe.tools.simulator_counts import replay_calls, run_replay

    replay = run_replay(run)
    cfg = layer_cfg(replay.cost.shape, replay.trace.ep, seed)
    policy = replay.policy
    if policy.runs_planner:
        # The run's replicas cannot be placed in the measured layer: the no-replica plan
        # of the same counts at the run's gamma (static placement, no budget), priced by
        # the same function.
        policy = Policy("lrmoe-static", capacity_factor=policy.capacity_factor)
        planner = policy_planner(policy, replay.trace.ep, replay.cost, 0.0)
    jobs = []
    for which, call in chosen_calls(replay_calls(replay), layers):
        saved, peak, replicas = call.saved, call.peak, call.replicas
        if policy.runs_planner:
            planner.observe(call.counts)
            plan = planner.plan(call.counts).retention
            saved, peak = call_memory_levels(policy, replay.cost, None, plan, call.counts,
                                             np.zeros(replay.trace.ep))
        jobs.append({"run": str(run), "layer": call.layer, "iteration": call.iteration,
                     "which": which, "load_max_over_mean": static_load(call.counts),
                     "counts": call.counts.tolist(),
                     "capacity_factor": policy.moe_expert_capacity_factor,
                     "gamma": policy.capacity_factor if policy.runs_planner else None,
                     "run_replicas": replicas,
                     "model_saved": saved.tolist(), "model_peak": peak.tolist()})
    return cfg, jobs


def compare(jobs: list[dict], per_rank: list[list[dict]]) -> list[dict]:
    """Per job: measured per rank beside the model, and max |model / measured - 1|."""
    rows = []
    for j, job in enumerate(jobs):
        measured = [r[j] for r in per_rank]
        peak = [m["mem_peak"] for m in measured]
        saved = [m["mem_saved"] for m in measured]
        rows.append({k: v for k, v in job.items() if k != "counts"} | {
            "measured_peak": peak, "measured_saved": saved,
            "forced_exact": all(m["forced_exact"] for m in measured),
            "peak_err": max(abs(p / m - 1.0) for p, m in zip(job["model_peak"], peak,
                                                              strict=True)),
            "saved_err": max(abs(p / m - 1.0) for p, m in zip(job["model_saved"], saved,
                                                               strict=True))})
    return rows


def report_lines(rows: list[dict]) -> list[str]:
    lines = ["| run | measured layer | EP | layer | call | iteration | load max/mean | model "
             "peak MiB (hot rank) | measured peak MiB | peak max err | model saved MiB | "
             "measured saved MiB | saved max err | counts forced exactly |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        hot = int(np.argmax(r["measured_peak"]))
        measured = ("Megatron" if r.get("gamma") is None else
                    f"LRMoE gamma={r['gamma']:g}, no replicas (the run placed "
                    f"{r['run_replicas']})")
        lines.append(
            f"| {Path(r['run']).name} | {measured} | {len(r['model_peak'])} | {r['layer']} "
            f"| {r['which']} "
            f"| {r['iteration']} | {r['load_max_over_mean']:.3f} "
            f"| {r['model_peak'][hot] / 2**20:.3f} | {r['measured_peak'][hot] / 2**20:.3f} "
            f"| {100 * r['peak_err']:.2f}% | {r['model_saved'][hot] / 2**20:.3f} "
            f"| {r['measured_saved'][hot] / 2**20:.3f} | {100 * r['saved_err']:.2f}% "
            f"| {'yes' if r['forced_exact'] else 'NO'} |")
    worst_peak = max(r["peak_err"] for r in rows)
    worst_saved = max(r["saved_err"] for r in rows)
    ok = max(worst_peak, worst_saved) <= TOLERANCE
    lines += ["", f"Over {len(rows)} calls and every rank: max |model / measured - 1| = "
              f"{100 * worst_peak:.2f}% (peak), {100 * worst_saved:.2f}% (saved); median of "
              f"the per-call peak maxima {100 * statistics.median(r['peak_err'] for r in rows):.2f}"
              f"%. Tolerance {TOLERANCE:.0%}: {'met' if ok else 'NOT met'}."]
    return lines


def main(argv: list[str] | None, make_pool: Callable[[int], Any]) -> int:
    """The command line of ``benchmarks/studies/simulator_memory.py``, which hands in
    ``make_pool(ranks)``: a started pool of gloo ranks with ``run(task, *args,
    timeout=)`` and ``close()`` (the test harness's ``GlooPool``, which the package's
    tools do not import)."""
    ap = argparse.ArgumentParser(prog="benchmarks/studies/simulator_memory.py",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("runs", type=Path, nargs="+", metavar="RUN_DIR",
                    help="runs of Megatron's MoELayer with a routing record (routing/ or "
                         "trace/) and a run record")
    ap.add_argument("--layers", default=None,
                    help="comma-separated MoE layer numbers (default: every recorded one)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--out", type=Path, default=None, help="directory for report.md/.json")
    args = ap.parse_args(argv)

    layers = None if args.layers is None else [int(v) for v in args.layers.split(",")]
    groups: dict[str, tuple[dict, list[dict]]] = {}
    for run in args.runs:
        cfg, jobs = run_jobs(run, layers, args.seed)
        key = json.dumps(cfg, sort_keys=True)
        groups.setdefault(key, (cfg, []))[1].extend(jobs)
    rows = []
    for cfg, jobs in groups.values():
        # One layer per capacity factor, built in turn: the jobs grouped by it.
        jobs.sort(key=lambda j: (str(j["gamma"]), str(j["capacity_factor"])))
        pool = make_pool(cfg["ep"])
        try:
            per_rank = pool.run(measure_calls, cfg, jobs, timeout=3600.0)
        finally:
            pool.close()
        rows += compare(jobs, per_rank)
    lines = report_lines(rows)
    print("\n".join(lines))
    if args.out:
        command = " ".join(shlex.quote(a) for a in [
            "python", "benchmarks/studies/simulator_memory.py",
            *(sys.argv[1:] if argv is None else argv)])
        code = code_version()
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "report.json").write_text(json.dumps(
            {"command": command, "code": code, "tolerance": TOLERANCE, "calls": rows}))
        (args.out / "report.md").write_text("\n".join([
            "# The simulator's per-rank MoE memory against the layer's, on recorded calls",
            "", f"- command: `{command}`", f"- code: {code}",
            "- what is compared: megatron_lrmoe/tools/simulator_memory.py's docstring; "
            "peak and saved per rank, MiB shown for the rank with the largest measured peak, "
            "errors the largest over the ranks", "", *lines, ""]))
        print(f"written to {args.out}/report.md and report.json")
    worst = max(max(r["peak_err"], r["saved_err"]) for r in rows)
    return 0 if worst <= TOLERANCE and all(r["forced_exact"] for r in rows) else 1
