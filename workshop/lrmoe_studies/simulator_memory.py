"""The simulator's per-rank MoE memory against the layer's, measured on recorded calls: a
run's recorded routing replayed through the simulator (``simulator_counts.replay_calls``),
and chosen calls of it run through the run's MoE layer on gloo ranks with the routing
forced to the call's exact [R, E] counts.

    .venv/bin/python benchmarks/studies/simulator_memory.py RUN_DIR... [--out DIR]

What is compared, per rank, for each layer's call with the hottest rank (the largest
received-pairs max/mean under Megatron's expert layout, ``static_load``), its median call
(by the same figure) and, where the budget lowered gamma on some call, the one of those
with the largest model peak (``chosen_calls``):

- model: the simulator's bytes of one layer's forward+backward of that call before it
  composes a stage (``simulate.call_memory_levels`` as ``replay_calls`` prices the call:
  ``MegatronMoEMemory.rank_memory`` of the counts for Megatron's layer,
  ``CostModel.plan_levels`` of the replayed plan, with the replicas the replay placed,
  for LRMoE's), the saved bytes S and the peak, each above what exists before the call
  (the layer input, the routing, the weights and their gradient buffers, replicas'
  included).
- measured: ``layer_bench.measure_memory`` of one forward+backward of the layer at the
  run's shape and EP size, each source rank's tokens routed so that its per-expert
  counts are exactly its recorded row (``layer_bench.counts_routing``), the
  probabilities a leaf that requires grad (as a trained router's do): the bytes autograd
  saves and the allocator's peak (the smaller of two repeats, after an unmeasured one
  with the same routing).

Megatron's layer (Megatron-layer runs): MoELayer at the run's capacity factor. The
runs' recorded counts are after Megatron's capacity drop, so a capacity-drop run's calls
are forced as recorded (its router, which drops, is bypassed). The dispatcher's index of
the previous step (8 P bytes) is freed inside the span, as in a run, so the measured peak
can sit that much below the model's.

LRMoE's layer (LRMoE and SYMI-style runs): an LRMoELayer with the run's LRMoE options
(``RunReplay.lrmoe_options``: selection, metric, gamma, placement, budget, slots, ...) and
the run's planner settings (``RunReplay.layer_settings``: ``planner_settings`` of the
run's config on its machine constants), whose planner is brought to the call's state as
the run's was: every earlier step of the layer replayed through the layer's planner and
step boundary (its EP group's micro-batches observed and planned, then
``LRMoELayer.finish_step`` with the step's counts pooled over the EP groups, as
``step_hooks.finish_lrmoe_step`` pools them), then the call's whole step run through the
layer (forward+backward of each micro-batch), the call measured in it, and the step
undone (``LRMoELayer.load_step_state``) before the next repeat. The plan the layer made
(replicas placed, each source's kept pairs, each instance's routed and kept rows) must
equal the replay's (``plan_exact``). Replica weights and gradient buffers count as
existing before the call, as the simulator counts them (``CostModel.rank_memory`` adds
them per layer): the unmeasured first repeat allocates them, as the run's first step with
the same hosted replicas did. What the step's first micro-batch sends for the replica
refresh and what its last receives of the replicas' gradients are inside the span, as in
the run.

Recompute settings are not applied: the simulator composes a stage from these
no-recompute levels (``stage_moe_memory``).
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

from lrmoe_studies.layer_bench import (
    DTYPES,
    build_megatron_layer,
    counts_routing,
    measure_memory,
)
from megatron_lrmoe.tools.provenance import code_version

__all__ = ["chosen_calls", "compare", "layer_cfg", "lrmoe_history", "measure_calls",
           "passed", "plan_figures", "run_jobs", "static_load"]

TOLERANCE = 0.05
_DTYPE_NAMES = {4: "fp32", 2: "bf16"}


def measure_calls(cfg: dict, jobs: list[dict]) -> list[dict]:
    """On every rank of the EP group (a ``GlooPool`` task): for each job (``counts``
    [R, E], ``capacity_factor``; an LRMoE job its ``lrmoe`` history, ``lrmoe_history``)
    one untimed forward+backward of the job's layer with this rank's tokens routed to
    exactly its row of ``counts``. Megatron's MoELayer is built once per capacity factor,
    in the jobs' order; an LRMoELayer per job. Returns per job ``measure_memory``'s
    figures, whether the forced routing met the row (``forced_exact``) and, for LRMoE,
    the layer's plan of the call (``plan``, ``plan_figures``)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    dtype = DTYPES[cfg["dtype"]]
    g = torch.Generator().manual_seed(cfg["seed"] + 1000 + rank)
    x = torch.randn(cfg["tokens"], 1, cfg["hidden"], generator=g).to(dtype)
    dy = torch.randn(cfg["tokens"], 1, cfg["hidden"], generator=g).to(dtype)
    out, layer, built = [], None, object()
    for job in jobs:
        if "lrmoe" in job:
            layer = built = None    # its process groups go with the model-parallel state
            out.append(_measure_lrmoe_call(cfg, job, x, dy, rank))
            continue
        if job["capacity_factor"] != built:
            layer = None
            built = job["capacity_factor"]
            layer = build_megatron_layer(cfg, moe_expert_capacity_factor=built)
        row = np.asarray(job["counts"], dtype=np.int64)[rank]
        probs, routing_map = _force_routing(layer, cfg, row, rank)
        # A first step unmeasured: Megatron's dispatcher holds the last call's routing
        # (probs, with its gradient, and the map) until the next call replaces it; after
        # another job's call that frees up to 2 T x E x 4 bytes inside the measured span.
        # Then the smaller peak of two, as bench_moe_layer.py keeps it.
        memory = []
        for _ in range(3):
            probs.grad = None
            memory.append(measure_memory(cfg, layer, x, dy, _no_sync, dist.barrier))
        out.append({**min(memory[1:], key=lambda m: m["mem_peak"]),
                    "forced_exact": routing_map.sum(0).tolist() == row.tolist()})
    return out


def _no_sync() -> None:
    """CPU ops are done when they return."""


def _force_routing(layer: torch.nn.Module, cfg: dict, row: np.ndarray,
                   rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Make ``layer``'s router return a routing of this rank's tokens whose per-expert
    counts are ``row`` [E] (``counts_routing``); returns it: (probs, routing map) [T, E]."""
    probs, routing_map = counts_routing(row, cfg["tokens"], cfg["topk"], cfg["seed"], rank,
                                        DTYPES[cfg["dtype"]])
    probs.requires_grad_(True)   # a trained router's are: the layers save for them

    def forced_route(hidden_states, padding_mask=None, _r=(probs, routing_map)):
        return _r

    layer.route = forced_route
    return probs, routing_map


def _measure_lrmoe_call(cfg: dict, job: dict, x: torch.Tensor, dy: torch.Tensor,
                        rank: int) -> dict:
    """One LRMoE job on this rank (module docstring): the layer built with the run's
    options and planner settings, its planner brought to the call's step by the earlier
    steps, then the call's step run three times from its start, the call measured in
    each; the smaller measured peak of the last two, and the layer's plan of the call."""
    import torch.distributed as dist

    from lrmoe_studies.layer_bench import build_lrmoe_layer

    history = job["lrmoe"]
    layer = build_lrmoe_layer(cfg, **history["options"])
    layer.setup_planner(history["settings"], history["microbatches"])
    planner = layer.placement_planner
    for own, pooled, count in history["earlier"]:
        for counts in own:
            counts = counts.astype(np.int64)   # as the counts exchange gathers them
            planner.observe(counts)            # as the layer's forward plans a training call
            planner.plan(counts)
            layer.lrmoe_state.count_training_forward()
        layer.finish_step(None if pooled is None
                          else (torch.from_numpy(pooled.astype(np.float64)), count))
    start = layer.step_state()
    rows = [np.asarray(c, dtype=np.int64)[rank] for c in history["step"]]
    memory, forced, plans = [], True, []
    for _ in range(3):
        layer.load_step_state(start)
        for micro, row in enumerate(rows):
            _, routing_map = _force_routing(layer, cfg, row, rank)
            if micro != history["micro"]:
                _forward_backward(layer, x, dy)
                continue
            memory.append(measure_memory(cfg, layer, x, dy, _no_sync, dist.barrier,
                                         finish_step=False))
            forced = forced and routing_map.sum(0).tolist() == row.tolist()
            plans.append(plan_figures(layer.last_plan))
    # Each repeat plans from the same state: one plan, or none to report (not exact).
    return {**min(memory[1:], key=lambda m: m["mem_peak"]), "forced_exact": forced,
            "plan": plans[0] if all(p == plans[0] for p in plans) else None}


def _forward_backward(layer: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor) -> None:
    """One unmeasured training micro-batch of the layer."""
    out, _ = layer(x.detach().clone().requires_grad_(True))
    out.backward(dy)


def plan_figures(plan) -> dict[str, Any]:
    """What a plan of one call fixes (a ``MicroBatchPlan``, or the replay's ``CallCounts``):
    replicas placed, each source's kept pairs, each instance's rank, routed rows and kept
    rows."""
    if hasattr(plan, "retention"):       # the layer's MicroBatchPlan
        retention = plan.retention
        return {"replicas": len(plan.assignment.placement.replicas),
                "kept_per_source": retention.quotas.sum(1).tolist(),
                "instance_rank": list(retention.instance_rank),
                "rows_per_instance": retention.counts.sum(0).tolist(),
                "kept_rows_per_instance": retention.quotas.sum(0).tolist()}
    return {"replicas": plan.replicas,
            "kept_per_source": np.asarray(plan.kept_per_source).tolist(),
            "instance_rank": np.asarray(plan.instance_rank).tolist(),
            "rows_per_instance": np.asarray(plan.rows_per_instance).tolist(),
            "kept_rows_per_instance": np.asarray(plan.kept_rows_per_instance).tolist()}


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
    from lrmoe_studies.simulator_counts import max_over_mean

    counts = np.asarray(counts)
    return max_over_mean(counts.sum(0).reshape(counts.shape[0], -1).sum(1))


def chosen_calls(calls: list, layers: list[int] | None = None) -> list[tuple[str, object]]:
    """Per layer (all, or ``layers``): ("hottest", the call with the largest received
    pairs max/mean without replicas, ``static_load``), ("median", the call at the median
    of that figure, the lower one of an even count) and, where the budget lowered gamma
    on any call, ("budget-adjusted", the one of those with the largest model peak), in
    layer order; one entry where two are the same call."""
    out = []
    for number in sorted({c.layer for c in calls}):
        if layers is not None and number not in layers:
            continue
        mine = sorted((c for c in calls if c.layer == number),
                      key=lambda c: static_load(c.counts))
        chosen = [("hottest", mine[-1]), ("median", mine[(len(mine) - 1) // 2])]
        adjusted = [c for c in mine if c.adjusted]
        if adjusted:
            chosen.append(("budget-adjusted", max(adjusted, key=lambda c: float(c.peak.max()))))
        for which, call in chosen:
            if all(call is not c for _, c in out):
                out.append((which, call))
    return out


def run_jobs(run: Path, layers: list[int] | None, seed: int,
             flags_after: tuple[str, ...] = ()) -> tuple[dict, list[dict]]:
    """(the run's cfg, its jobs: the chosen calls with the simulator's per-rank levels
    and, for a run of LRMoE's layer, the replay's plan and the layer's history;
    ``flags_after``: ``run_replay``'s)."""
    from lrmoe_studies.simulator_counts import replay_calls, run_replay

    replay = run_replay(run, flags_after)
    cfg = layer_cfg(replay.cost.shape, replay.trace.ep, seed)
    lrmoe = replay.policy.runs_planner
    calls = replay_calls(replay)
    jobs = []
    for which, call in chosen_calls(calls, layers):
        job = {"run": str(run), "layer": call.layer, "iteration": call.iteration,
               "micro": call.micro, "which": which,
               "load_max_over_mean": static_load(call.counts), "counts": call.counts.tolist(),
               "capacity_factor": replay.policy.moe_expert_capacity_factor,
               "replicas": call.replicas, "budget_adjusted": call.adjusted,
               "model_saved": call.saved.tolist(), "model_peak": call.peak.tolist()}
        if lrmoe:
            job |= {"gamma": replay.policy.capacity_factor, "plan": plan_figures(call),
                    "lrmoe": lrmoe_history(replay, calls, call)}
        jobs.append(job)
    return cfg, jobs


def lrmoe_history(replay, calls: list, call) -> dict[str, Any]:
    """What the measured LRMoELayer needs to plan ``call`` as the run's layer did: the
    run's options and planner settings, the micro-batches per step, per earlier step of
    the layer (own: its EP group's [R, E] counts per micro-batch; pooled: their sum over
    the step's micro-batches and EP groups, None with one EP group, whose own
    observations stand as in ``step_hooks.finish_lrmoe_step``; and how many), and the
    counts of the call's step (its EP group's micro-batches; ``micro``: the call's)."""
    mine = [c for c in calls if c.layer == call.layer and c.iteration <= call.iteration]
    steps: dict[int, list] = {}
    for c in mine:
        steps.setdefault(c.iteration, []).append(c)
    pooling = len({c.group for c in mine}) > 1
    earlier = []
    for iteration, step in steps.items():
        if iteration == call.iteration:
            continue
        pooled = (np.sum([c.counts for c in step], axis=0, dtype=np.int64)
                  if pooling else None)
        # int32: the counts are at most tokens x top-k (the jobs travel to every rank).
        earlier.append(([np.asarray(c.counts, dtype=np.int32) for c in step
                         if c.group == call.group], pooled, len(step)))
    # The settings carry the run's machine constants: its calibration file is not read.
    options = {k: v for k, v in replay.lrmoe_options.items() if k != "moe_lrmoe_calibration"}
    return {"options": options, "settings": replay.layer_settings,
            "microbatches": replay.shape.microbatches_per_step, "earlier": earlier,
            "step": [np.asarray(c.counts, dtype=np.int64) for c in steps[call.iteration]
                     if c.group == call.group], "micro": call.micro}


def compare(jobs: list[dict], per_rank: list[list[dict]]) -> list[dict]:
    """Per job: measured per rank beside the model, max |model / measured - 1|, and for
    LRMoE whether every rank's layer planned the call as the replay did (``plan_exact``;
    None for Megatron's layer)."""
    rows = []
    for j, job in enumerate(jobs):
        measured = [r[j] for r in per_rank]
        peak = [m["mem_peak"] for m in measured]
        saved = [m["mem_saved"] for m in measured]
        plan_exact = (None if "plan" not in job
                      else all(m["plan"] == job["plan"] for m in measured))
        rows.append({k: v for k, v in job.items() if k not in ("counts", "lrmoe")} | {
            "measured_peak": peak, "measured_saved": saved,
            "forced_exact": all(m["forced_exact"] for m in measured),
            "plan_exact": plan_exact,
            "measured_plan": None if plan_exact in (None, True) else measured[0]["plan"],
            "peak_err": max(abs(p / m - 1.0) for p, m in zip(job["model_peak"], peak,
                                                              strict=True)),
            "saved_err": max(abs(p / m - 1.0) for p, m in zip(job["model_saved"], saved,
                                                               strict=True))})
    return rows


def report_lines(rows: list[dict]) -> list[str]:
    lines = ["| run | measured layer | EP | layer | call | iteration | load max/mean | model "
             "peak MiB (hot rank) | measured peak MiB | peak max err | model saved MiB | "
             "measured saved MiB | saved max err | counts forced exactly | plan exact |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        hot = int(np.argmax(r["measured_peak"]))
        measured = ("Megatron" if r.get("plan_exact") is None else
                    f"LRMoE gamma={r['gamma']:g}, the run's plan ({r['replicas']} replicas)")
        plan = {None: "-", True: "yes", False: "NO"}[r.get("plan_exact")]
        lines.append(
            f"| {Path(r['run']).name} | {measured} | {len(r['model_peak'])} | {r['layer']} "
            f"| {r['which']} "
            f"| {r['iteration']} | {r['load_max_over_mean']:.3f} "
            f"| {r['model_peak'][hot] / 2**20:.3f} | {r['measured_peak'][hot] / 2**20:.3f} "
            f"| {100 * r['peak_err']:.2f}% | {r['model_saved'][hot] / 2**20:.3f} "
            f"| {r['measured_saved'][hot] / 2**20:.3f} | {100 * r['saved_err']:.2f}% "
            f"| {'yes' if r['forced_exact'] else 'NO'} | {plan} |")
    worst_peak = max(r["peak_err"] for r in rows)
    worst_saved = max(r["saved_err"] for r in rows)
    ok = max(worst_peak, worst_saved) <= TOLERANCE
    lines += ["", f"Over {len(rows)} calls and every rank: max |model / measured - 1| = "
              f"{100 * worst_peak:.2f}% (peak), {100 * worst_saved:.2f}% (saved); median of "
              f"the per-call peak maxima {100 * statistics.median(r['peak_err'] for r in rows):.2f}"
              f"%. Tolerance {TOLERANCE:.0%}: {'met' if ok else 'NOT met'}. Plans of LRMoE's "
              f"layer equal to the replay's: {sum(r['plan_exact'] is True for r in rows)} of "
              f"{sum(r['plan_exact'] is not None for r in rows)}."]
    return lines


def passed(rows: list[dict]) -> bool:
    """Every call within ``TOLERANCE`` (peak and saved, every rank), its counts forced
    exactly and, for LRMoE's layer, planned as the replay planned it."""
    return (max(max(r["peak_err"], r["saved_err"]) for r in rows) <= TOLERANCE
            and all(r["forced_exact"] and r["plan_exact"] is not False for r in rows))


def main(argv: list[str] | None, make_pool: Callable[[int], Any]) -> int:
    """The command line of ``benchmarks/studies/simulator_memory.py``, which hands in
    ``make_pool(ranks)``: a started pool of gloo ranks with ``run(task, *args,
    timeout=)`` and ``close()`` (the test harness's ``GlooPool``, which the package's
    tools do not import)."""
    ap = argparse.ArgumentParser(prog="benchmarks/studies/simulator_memory.py",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("runs", type=Path, nargs="+", metavar="RUN_DIR",
                    help="runs with a routing record (routing/ or "
                         "trace/) and a run record")
    ap.add_argument("--layers", default=None,
                    help="comma-separated MoE layer numbers (default: every recorded one)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--selection", default=None,
                    help="replay LRMoE runs' routing under this --moe-lrmoe-selection (its "
                         "planner, layer and memory model), not the run's own")
    ap.add_argument("--out", type=Path, default=None, help="directory for report.md/.json")
    args = ap.parse_args(argv)

    layers = None if args.layers is None else [int(v) for v in args.layers.split(",")]
    groups: dict[str, tuple[dict, list[dict]]] = {}
    for run in args.runs:
        cfg, jobs = run_jobs(run, layers, args.seed, () if args.selection is None
                             else ("--moe-lrmoe-selection", args.selection))
        key = json.dumps(cfg, sort_keys=True)
        groups.setdefault(key, (cfg, []))[1].extend(jobs)
    rows = []
    for cfg, jobs in groups.values():
        # One Megatron layer per capacity factor, built in turn: the jobs grouped by it.
        jobs.sort(key=lambda j: ("lrmoe" in j, str(j["capacity_factor"])))
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
            "- what is compared: workshop/lrmoe_studies/simulator_memory.py's docstring; "
            "peak and saved per rank, MiB shown for the rank with the largest measured peak, "
            "errors the largest over the ranks", "", *lines, ""]))
        print(f"written to {args.out}/report.md and report.json")
    return 0 if passed(rows) else 1
