"""One MoE layer, forward and backward: Megatron's MoELayer vs LRMoE at several capacities.

    .venv/bin/python benchmarks/bench_moe_layer.py            # CPU, EP=2 over 2 gloo ranks
    .venv/bin/python benchmarks/bench_moe_layer.py --quick    # tiny smoke run
    python benchmarks/bench_moe_layer.py --device cuda --ep 1 --hidden 2048 --ffn 768 \\
        --experts 128 --topk 8 --dtype bf16 --capacities inf,0.75,0.5   # one GPU

Settings, measured side by side in one run on the same inputs and weights (the
LRMoE layer is built from the Megatron layer's state dict; the capacity factor is
switched between calls on that one layer): Megatron-Core's own MoELayer (all-to-all
dispatcher, SequentialMLP experts, dropless) and LRMoELayer at each backward
capacity factor (``inf`` = LRMoE dropless, the same code path as the drops).

Routing distributions:
  skewed   the layers' ``route`` is replaced by a fixed routing: each token picks
           top-k experts sampled without replacement, expert popularity Zipf(s),
           expert e having popularity (e+1)^-s (so the lowest EP ranks hold the
           hottest experts; ``--popularity shuffled`` permutes them), probs =
           softmax of random logits restricted to the chosen experts.
  router   Megatron's own (untrained, identical) router on Gaussian inputs: a
           near-uniform routing. Not a recorded routing of a trained model.

Timing: inside the workers with time.perf_counter; forward = the layer call,
backward = out.backward(dy), each started after a barrier; per repetition the
slowest rank's time (it sets the pace under expert parallelism), then the median
over repetitions; warm-up repetitions are excluded; the order of the settings
rotates every repetition. On CPU: one gloo process per rank, one thread each
(lrmoe_testing.gloo_pool.GlooPool). On CUDA: one process with a 1-rank
process group, and torch.cuda.synchronize() before every clock read.

CPU workers run with glibc malloc tunables that keep freed memory in the heap (like a
GPU caching allocator); with glibc's defaults, large transient buffers are unmapped
and faulted in again every step, which costs some settings far more kernel time than
others (``--system-malloc`` keeps the defaults). Each routing section reports the
CPU/wall ratio of the timed spans and the page faults per step, to show contention.

Byte figures are exact counts from the routing counts and the retention plan, not
profiler readings (see ``buffer_bytes``). The result table is printed and written as
markdown (``--out``). ``--profile`` appends torch.profiler tables of one step.

Memory and host reads, per setting, in untimed steps after the timed ones: the bytes
saved for backward (``saved_tensors_hooks``) and the allocator's peak over one
forward+backward (``layer_bench.measure_memory``), beside the cost model's predictions of
both (``CostModel`` for LRMoE, ``MegatronMoEMemory`` for Megatron's layer), checked within
5%;
and the host reads of device data in one forward and one backward
(``lrmoe_testing.host_reads``; on a GPU each is a stall).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import math
import os
import platform
import shlex
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from lrmoe_studies.layer_bench import (
    DTYPES,
    GLIBC_CACHING_TUNABLES,
    build_layers,
    end_step,
    gather_counts,
    measure_memory,
    one_step,
    popularity_routing,
    recorded_popularity,
    skewed_routing,
)
from megatron_lrmoe.tools.provenance import code_version

ROOT = Path(__file__).resolve().parents[1]
INDEX_BYTES = 4  # int32 row positions sent with the retained gradient rows
TARGET_SLACK = 0.05  # target: backward time <= (r + 0.05) x dropless backward time


# -----------------------------------------------------------------------------
# Worker side (runs on every rank; module-level so GlooPool workers can import it;
# the building blocks it shares with the other benchmarks: lrmoe_studies.layer_bench)
# -----------------------------------------------------------------------------


def _settings(cfg: dict) -> list[tuple[str, float | None]]:
    return [("megatron", None)] + [("lrmoe", g) for g in cfg["capacities"]]


def run_benchmark(cfg: dict) -> dict:
    """Every setting on every routing distribution on this rank; raw per-rank numbers."""
    import torch.distributed as dist

    device = torch.device(cfg["device"])
    if device.type == "cuda":
        torch.cuda.set_device(0)
    rank = dist.get_rank()
    megatron, lrmoe = build_layers({**cfg, "selection": SELECTION})
    dtype = DTYPES[cfg["dtype"]]
    gc.collect()
    gc.freeze()  # Megatron's import heap: a full collection would cost ~0.5 s per step

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    def barrier():
        sync()
        if cfg["ep"] > 1:
            dist.barrier()

    layers = {"megatron": megatron, "lrmoe": lrmoe}
    g = torch.Generator().manual_seed(cfg["seed"] + 1000 + rank)
    x = torch.randn(cfg["tokens"], 1, cfg["hidden"], generator=g).to(device, dtype)
    dy = torch.randn(cfg["tokens"], 1, cfg["hidden"], generator=g).to(device, dtype)
    settings = _settings(cfg)
    result = {"rank": rank, "routings": {}}
    for routing in cfg["routings"]:
        for layer in layers.values():
            layer.__dict__.pop("route", None)  # back to the class's route (Megatron's router)
        if routing in ("skewed", "recorded"):
            if routing == "skewed":
                probs, routing_map = skewed_routing(
                    cfg["tokens"], cfg["experts"], cfg["topk"], cfg["zipf"], cfg["seed"], rank,
                    dtype, cfg["popularity"] == "shuffled")
            else:
                probs, routing_map = popularity_routing(
                    cfg["tokens"], torch.tensor(cfg["recorded_popularity"]), cfg["topk"],
                    cfg["seed"], rank, dtype)
            probs, routing_map = probs.to(device), routing_map.to(device)

            def fixed_route(hidden_states, padding_mask=None, _r=(probs, routing_map)):
                return _r

            for layer in layers.values():
                layer.route = fixed_route
        else:
            with torch.no_grad():
                _, routing_map = megatron.route(x)
        counts = gather_counts(routing_map, cfg["ep"])
        fwd = {s: [] for s in settings}
        bwd = {s: [] for s in settings}
        faults = {s: [] for s in settings}
        stats, errors = {}, {}
        cpu_wall = [0.0, 0.0]  # process CPU time and wall time of the measured spans
        for rep in range(cfg["warmup"] + cfg["reps"]):
            shift = rep % len(settings)
            for name, gamma in settings[shift:] + settings[:shift]:
                if (name, gamma) in errors:
                    continue
                if gamma is not None:
                    lrmoe.config.moe_lrmoe_bwd_capacity_factor = gamma
                    from megatron_lrmoe.integration.step_hooks import setup_lrmoe_layers
                    setup_lrmoe_layers([lrmoe], cfg["tokens"], 1)   # rebuilt from the config
                try:
                    t_f, t_b, st, cpu, flt = one_step(layers[name], x, dy, sync, barrier)
                except Exception:
                    if cfg["ep"] > 1:
                        raise  # the other ranks may wait in a collective: fail the run
                    # One process: record the failure, keep measuring the other settings.
                    errors[(name, gamma)] = traceback.format_exc()
                    continue
                if rep >= cfg["warmup"]:
                    cpu_wall[0] += cpu
                    cpu_wall[1] += t_f + t_b
                    fwd[(name, gamma)].append(t_f)
                    bwd[(name, gamma)].append(t_b)
                    faults[(name, gamma)].append(flt)
                    stats[(name, gamma)] = st
        # Untimed: one step per setting measuring memory, one counting host reads.
        measured = {}
        for name, gamma in settings:
            if (name, gamma) in errors:
                continue
            if gamma is not None:
                lrmoe.config.moe_lrmoe_bwd_capacity_factor = gamma
                from megatron_lrmoe.integration.step_hooks import setup_lrmoe_layers
                setup_lrmoe_layers([lrmoe], cfg["tokens"], 1)
            # Twice, keeping the smaller peak: a guard against buffers freed late by
            # other threads (gloo's are waited for: layer_bench._PromptCollectiveFrees).
            memory = min((measure_memory(cfg, layers[name], x, dy, sync, barrier)
                          for _ in range(2)), key=lambda m: m["mem_peak"])
            measured[(name, gamma)] = {**memory,
                                       **_count_host_reads(layers[name], x, dy, barrier)}
        result["routings"][routing] = {
            "counts": counts.tolist(), "fwd": fwd, "bwd": bwd, "stats": stats,
            "errors": errors, "cpu_wall": cpu_wall, "faults": faults, "measured": measured,
        }
    if cfg["profile"]:
        result["profile"] = _profile(cfg, layers, x, dy, sync, barrier)
    gc.unfreeze()
    return result


def _count_host_reads(layer, x, dy, barrier) -> dict[str, int]:
    """Host reads of device data in one forward and one backward of the layer
    (lrmoe_testing.host_reads: the layer's input and weights are the device
    data; ops inside compiled kernels are not seen)."""
    from lrmoe_testing.host_reads import HostReadDetector

    for p in layer.parameters():
        p.grad = None
    x_in = x.detach().clone().requires_grad_(True)
    if hasattr(layer, "lrmoe_stats"):
        layer.lrmoe_stats.reset()
    barrier()
    fixed = layer.__dict__.get("route")
    route = layer.route

    def tainted_route(*args, **kwargs):
        # A forced routing is made outside the layer: in a run it is the router's
        # output, device data.
        out = route(*args, **kwargs)
        det.taint(*out)
        return out

    layer.route = tainted_route
    try:
        with HostReadDetector() as det:
            det.taint(x_in, *layer.parameters())
            out, _ = layer(x_in)
            forward = len(det.reads)
            det.clear()
            barrier()
            out.backward(dy)
            backward = len(det.reads)
    finally:
        if fixed is None:
            del layer.route
        else:
            layer.route = fixed
    end_step(layer)
    return {"reads_fwd": forward, "reads_bwd": backward}


def _profile(cfg, layers, x, dy, sync, barrier) -> dict:
    """torch.profiler tables of one forward and one backward per profiled setting."""
    tables = {}
    for name, gamma in [("megatron", None)] + [("lrmoe", g) for g in cfg["profile"]]:
        label = _label(name, gamma)
        try:
            tables[label] = _profile_one(cfg, layers[name], gamma, x, dy, sync, barrier)
        except Exception:
            if cfg["ep"] > 1:
                raise
            tables[label] = {"error": traceback.format_exc()}
    return tables


def _profile_one(cfg, layer, gamma, x, dy, sync, barrier) -> dict[str, str]:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if cfg["device"] == "cuda":
        activities.append(ProfilerActivity.CUDA)
    if gamma is not None:
        layer.config.moe_lrmoe_bwd_capacity_factor = gamma
    one_step(layer, x, dy, sync, barrier)  # warm
    for p in layer.parameters():
        p.grad = None
    x_in = x.detach().clone().requires_grad_(True)
    barrier()
    by_shape = cfg["profile_by_shape"]
    with profile(activities=activities, record_shapes=by_shape) as prof_f:
        out, _ = layer(x_in)
        sync()
    barrier()
    with profile(activities=activities, record_shapes=by_shape) as prof_b:
        out.backward(dy)
        sync()
    if hasattr(layer, "finish_step"):
        layer.finish_step()
    sort = "self_device_time_total" if cfg["device"] == "cuda" else "self_cpu_time_total"
    # By input shape, ops of one name split by what they move: e.g. the compaction of
    # x and z to the retained rows ([routed, H] and [routed, F1] read at [retained]).
    return {
        "forward": prof_f.key_averages(group_by_input_shape=by_shape).table(
            sort_by=sort, row_limit=30 if by_shape else 18),
        "backward": prof_b.key_averages(group_by_input_shape=by_shape).table(
            sort_by=sort, row_limit=40 if by_shape else 25),
    }


# -----------------------------------------------------------------------------
# Parent side: aggregation and report
# -----------------------------------------------------------------------------


def _label(name: str, gamma: float | None) -> str:
    return "Megatron MoELayer" if name == "megatron" else f"LRMoE gamma={gamma:g}"


def buffer_bytes(plan, rank: int, hidden: int, elem: int, positions: bool) -> int:
    """Exact bytes of the row buffers of the backward all-to-all path on ``rank``.

    Source side: the compacted output-gradient rows it sends (K_s x H) and their int32
    positions; expert side: the rows it receives (K_r x H) and their positions, the dX
    rows its experts compute over them (K_r x H); source side again: the dX rows that
    come back (K_s x H). K_s = pairs this rank keeps as a source, K_r = pairs its
    experts keep. Positions go only to receivers that drop rows (``positioned_pairs``).
    Dense (Megatron) is the same with K = routed pairs and no positions.
    Expert intermediates (gathered x, z, h, dh, dz) scale with K_r too but are not
    counted here.
    """
    quotas = plan.quotas if positions else plan.counts
    positions = positions and not bench_retention_in_forward()   # else sent in forward
    matrix = torch.zeros(plan.num_ranks, plan.num_ranks, dtype=torch.int64)
    matrix.index_add_(1, torch.tensor(plan.instance_rank), quotas)
    k_s, k_r = int(matrix[rank].sum()), int(matrix[:, rank].sum())
    row = hidden * elem
    pos_s, pos_r = positioned_pairs(plan, rank) if positions else (0, 0)
    return k_s * row + k_r * row + k_r * row + k_s * row + INDEX_BYTES * (pos_s + pos_r)


SELECTION = "uniform"
"""The LRMoE layer's rule here: the byte model (``backward_bytes``) is its, and the stored
results ran it."""


def bench_retention_in_forward() -> bool:
    """Whether the bench's LRMoE layers (``SELECTION``) draw the retained set in forward:
    then the positions travel in forward, not with the backward rows."""
    from megatron_lrmoe.planning.retention import retention_in_forward

    return retention_in_forward(SELECTION, "grad_act")


def positioned_pairs(plan, rank: int) -> tuple[int, int]:
    """(sent, received) retained rows of ``rank`` that carry an int32 position: those
    to or at receivers that drop some of their rows (docs/design.md, "Region")."""
    inst = torch.tensor(plan.instance_rank)
    drops = [bool((plan.quotas[:, inst == r] < plan.counts[:, inst == r]).any())
             for r in range(plan.num_ranks)]
    kept = plan.retained_matrix
    sent = sum(int(kept[rank, r]) for r in range(plan.num_ranks) if drops[r])
    return sent, int(kept[:, rank].sum()) if drops[rank] else 0


def summarize_routing(cfg: dict, per_rank: list[dict], routing: str) -> list[dict]:
    """One row per setting: medians of the slowest rank, exact counts, target check."""
    from megatron_lrmoe.layer.stats import TOTAL_FIELDS
    from megatron_lrmoe.planning.retention import plan_retention

    data = [r["routings"][routing] for r in per_rank]
    counts = torch.tensor(data[0]["counts"], dtype=torch.int64)
    ep, hidden = cfg["ep"], cfg["hidden"]
    elem = torch.tensor([], dtype=DTYPES[cfg["dtype"]]).element_size()
    rows = []
    for name, gamma in _settings(cfg):
        key = (name, gamma)
        failed = [d["errors"][key] for d in data if key in d.get("errors", {})]
        if failed:
            last = failed[0].strip().splitlines()[-1]
            rows.append({"setting": _label(name, gamma), "name": name, "gamma": gamma,
                         "error": last, "traceback": failed[0], "target_ok": None})
            continue
        reps = len(data[0]["fwd"][key])
        fwd_reps = [max(d["fwd"][key][i] for d in data) for i in range(reps)]
        bwd_reps = [max(d["bwd"][key][i] for d in data) for i in range(reps)]
        fwd, bwd = statistics.median(fwd_reps), statistics.median(bwd_reps)
        plan = plan_retention(counts, ep, math.inf if gamma is None else gamma)
        routed_rank = plan.routed_per_rank
        hot = int(torch.argmax(routed_rank))
        retained_rank = plan.retained_per_rank if name == "lrmoe" else routed_rank
        row = {
            "setting": _label(name, gamma), "name": name, "gamma": gamma,
            "fwd_ms": 1e3 * fwd, "bwd_ms": 1e3 * bwd, "bwd_reps": bwd_reps,
            "fwd_reps": fwd_reps,
            "bwd_spread": _half_iqr(bwd_reps) / bwd,
            "r_hot": float(retained_rank[hot]) / max(int(routed_rank[hot]), 1),
            "r_bwd_load": float(retained_rank.max()) / max(int(routed_rank.max()), 1),
            "load_max_over_mean": float(routed_rank.max()) / max(float(routed_rank.double()
                                                                       .mean()), 1e-9),
            "buffer_bytes": sum(buffer_bytes(plan, s, hidden, elem, name == "lrmoe")
                                for s in range(ep)),
            "buffer_bytes_dense": sum(buffer_bytes(plan, s, hidden, elem, False)
                                      for s in range(ep)),
        }
        routed = plan.routed
        dense = routed * hidden * elem
        if name == "lrmoe":
            totals = dict(zip(TOTAL_FIELDS, [sum(v) for v in zip(
                *(d["stats"][key] for d in data), strict=True)], strict=True))
            row.update(
                routed=int(totals["routed_pairs"]), retained=int(totals["retained_pairs"]),
                bytes_sent=int(totals["backward_bytes_sent"]),
                bytes_dense=int(totals["backward_bytes_dense"]),
                expert_rows=int(totals["expert_backward_rows"]),
                dropped_contribution=(totals["metric_dropped"] / totals["metric_total"]
                                      if totals["metric_total"] > 0 else 0.0),
            )
            if row["routed"] != routed or row["retained"] != plan.retained:
                raise RuntimeError(f"{row['setting']}: region stats disagree with the plan")
        else:
            # Megatron's combine backward sends every routed pair's H-wide gradient row,
            # and its experts run the backward over every routed pair they received.
            row.update(routed=routed, retained=routed, bytes_sent=dense, bytes_dense=dense,
                       expert_rows=routed, dropped_contribution=0.0)
        measured = [d.get("measured", {}).get(key) for d in data]
        if all(measured):
            for field in ("mem_saved", "mem_peak", "reads_fwd", "reads_bwd"):
                row[field] = max(m[field] for m in measured)   # the busiest rank's
            if name == "lrmoe":
                saved, peak = predicted_memory(cfg, plan, counts, elem)
            else:
                saved, peak = predicted_megatron_memory(cfg, counts, elem, routing)
            row["mem_model"] = max(peak)
            row["mem_model_err"] = max(abs(p / m["mem_peak"] - 1.0)
                                       for p, m in zip(peak, measured, strict=True))
            row["saved_model"] = max(saved)
            row["saved_model_err"] = max(abs(p / max(m["mem_saved"], 1) - 1.0)
                                         if p or m["mem_saved"] else 0.0
                                         for p, m in zip(saved, measured, strict=True))
        row["r_all"] = row["retained"] / max(row["routed"], 1)
        row["bytes_expected"] = row["retained"] * hidden * elem + (
            INDEX_BYTES * sum(positioned_pairs(plan, s)[0] for s in range(ep))
            if name == "lrmoe" and not bench_retention_in_forward() else 0)
        rows.append(row)
    dropless = next((r for r in rows if r["name"] == "lrmoe" and math.isinf(r["gamma"])
                     and "error" not in r), None)
    megatron = next((r for r in rows if r["name"] != "lrmoe" and "error" not in r), None)
    for row in rows:
        if "error" in row:
            continue
        # Paired against Megatron's MoELayer, forward and backward (the target for LRMoE
        # at gamma = inf: <= 1.02 each).
        for phase in ("fwd", "bwd"):
            row[f"{phase}_vs_megatron"] = statistics.median(
                a / b for a, b in zip(row[f"{phase}_reps"], megatron[f"{phase}_reps"],
                                      strict=True)) if megatron else math.nan
        # Paired estimate: each repetition's ratio to the dropless run of the same
        # repetition (measured seconds apart), then the median over repetitions.
        row["bwd_vs_dropless"] = statistics.median(
            b / d for b, d in zip(row["bwd_reps"], dropless["bwd_reps"], strict=True)
        ) if dropless else math.nan
        row["target_ok"] = (row["bwd_vs_dropless"] <= row["r_hot"] + TARGET_SLACK
                            if dropless and row["name"] == "lrmoe" else None)
        row["bytes_ok"] = row["bytes_sent"] == row["bytes_expected"]
    return rows


def predicted_memory(cfg: dict, plan, counts: torch.Tensor,
                     elem: int) -> tuple[list[float], list[float]]:
    """Per rank, the cost model's (saved bytes, bytes of one layer's forward+backward) at
    this plan (``CostModel.saved_memory`` and ``CostModel.plan_memory``: one layer, one
    micro-batch in flight, no replica, so its saved bytes plus the rest of its peak;
    planning/cost_model.py), with the region's GEMM path as this run asks for it: grouped
    with ``--grouped-gemm on`` or on CUDA unless off, else the per-expert loop (on CUDA a
    failed grouped_mm probe runs the loop, and the model then over-states the peak)."""
    import numpy as np

    from megatron_lrmoe.planning.cost_model import CostModel
    from megatron_lrmoe.planning.machine import MachineConstants
    from megatron_lrmoe.planning.shapes import MoEShape

    if plan.counts.tolist() != counts.tolist():
        raise ValueError("predicted_memory: the plan is not of these counts")
    grouped = cfg["grouped_gemm"] == "on" or (cfg["device"] == "cuda"
                                              and cfg["grouped_gemm"] == "auto")
    shape = MoEShape(hidden_size=cfg["hidden"], ffn_hidden_size=cfg["ffn"],
                     num_experts=cfg["experts"], topk=cfg["topk"], gated=True,
                     dtype_bytes=elem, tokens_per_rank=cfg["tokens"],
                     expert_parallel_size=cfg["ep"], grouped_gemm=grouped,
                     # The LRMoE layers run the default rule (drawn in forward or not).
                     forward_retention=bench_retention_in_forward())
    # Memory needs no machine constants; these only satisfy the constructor.
    cost = CostModel(shape, MachineConstants(gemm_flops_per_s=1.0, alltoall_bytes_per_s=1.0))
    saved = cost.saved_memory(plan.routed_per_rank.numpy(), plan.retained_per_rank.numpy())
    return saved.tolist(), cost.plan_memory(plan, np.zeros(plan.num_ranks)).tolist()


def predicted_megatron_memory(cfg: dict, counts: torch.Tensor, elem: int,
                              routing: str) -> tuple[list[float], list[float]]:
    """Per rank, the cost model's (saved bytes, peak bytes) of Megatron's MoELayer as
    the benchmark runs it (``MegatronMoEMemory``: all-to-all dispatcher, SequentialMLP,
    dropless, no recompute) from the routed counts; the probabilities require grad
    under Megatron's router, not under the forced routings (constant tensors)."""
    from megatron_lrmoe.planning.megatron_baseline import MegatronMoEMemory
    from megatron_lrmoe.planning.shapes import MoEShape

    shape = MoEShape(hidden_size=cfg["hidden"], ffn_hidden_size=cfg["ffn"],
                     num_experts=cfg["experts"], topk=cfg["topk"], gated=True,
                     dtype_bytes=elem, tokens_per_rank=cfg["tokens"],
                     expert_parallel_size=cfg["ep"])
    model = MegatronMoEMemory(shape, grouped=False, probs_require_grad=routing == "router")
    saved, peak = model.rank_memory(counts.numpy())
    return saved.tolist(), peak.tolist()


def _half_iqr(values: list[float]) -> float:
    if len(values) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return (q3 - q1) / 2


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def markdown_table(rows: list[dict]) -> str:
    head = ("| setting | fwd ms | bwd ms | bwd / dropless | r hot rank | r overall "
            "| target bwd <= (r+0.05) x dropless | bwd a2a MiB (sent/dense) "
            "| = r x dense + idx | expert bwd rows | dropped contrib. "
            "| bwd a2a buffers MiB (vs dense) | saved MiB | peak fwd+bwd MiB "
            "| cost model peak MiB (max err) | cost model saved MiB (max err) "
            "| host reads fwd/bwd |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['setting']} | FAILED: `{r['error']}` |" + " |" * 15)
            continue
        target = "n/a" if r["target_ok"] is None else (
            f"{'yes' if r['target_ok'] else 'NO'} ({r['bwd_vs_dropless']:.3f} vs "
            f"{r['r_hot'] + TARGET_SLACK:.3f})")
        lines.append(
            f"| {r['setting']} | {r['fwd_ms']:.1f} | {r['bwd_ms']:.1f} "
            f"±{100 * r['bwd_spread']:.0f}% "
            f"| {r['bwd_vs_dropless']:.3f} | {r['r_hot']:.3f} | {r['r_all']:.3f} | {target} "
            f"| {_mib(r['bytes_sent'])} / {_mib(r['bytes_dense'])} "
            f"| {'yes' if r['bytes_ok'] else 'NO'} | {r['expert_rows']} "
            f"| {r['dropped_contribution']:.3f} "
            f"| {_mib(r['buffer_bytes'])} ({r['buffer_bytes'] / r['buffer_bytes_dense']:.3f}) "
            f"| {_mib(r['mem_saved']) if 'mem_saved' in r else 'n/a'} "
            f"| {_mib(r['mem_peak']) if 'mem_peak' in r else 'n/a'} "
            f"| {_model_text(r, 'mem_model')} | {_model_text(r, 'saved_model')} "
            f"| {r.get('reads_fwd', 'n/a')}/{r.get('reads_bwd', 'n/a')} |")
    return "\n".join(lines)


def _model_text(row: dict, key: str) -> str:
    if key not in row:
        return "n/a"
    return f"{_mib(row[key])} ({100 * row[key + '_err']:.1f}%)"


MODEL_TOLERANCE = 0.05   # the cost model against the measured peak and saved bytes


ROUTING_TEXT = {
    "skewed": ("forced routing: each token picks top-{topk} of {experts} experts sampled "
               "without replacement, expert popularity Zipf(s={zipf}) ({popularity_text}), "
               "probs = softmax of random logits over the chosen experts; the router is "
               "bypassed in both layers"),
    "recorded": ("recorded routing: expert popularity of layer {recorded_layer} of a launcher "
                 "run ({recorded_log}), summed over the run, each recorded expert split into "
                 "equally popular benchmark experts; top-{topk} drawn without replacement by "
                 "popularity, probs = softmax of random logits over the chosen experts"),
    "router": ("untrained router (near-uniform): Megatron's own TopKRouter (softmax top-"
               "{topk}, no aux loss), same weights in both layers, on Gaussian inputs"),
}

POPULARITY_TEXT = {
    "index": "expert e has popularity (e+1)^-s: under Megatron's layout the lowest EP ranks "
             "hold the hottest experts",
    "shuffled": "popularity ranks assigned to experts by a seeded permutation",
}


def _machine(cfg: dict) -> str:
    if cfg["device"] == "cuda":
        return (f"{torch.cuda.get_device_name(0)}, 1 process (EP={cfg['ep']}), "
                f"torch {torch.__version__}, CUDA {torch.version.cuda}")
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f
                       if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (f"{cfg['ep']} ranks x 1 thread (torch.set_num_threads(1), OMP_NUM_THREADS=1) on "
            f"{os.cpu_count()} cores ({cpu}), gloo over loopback, torch {torch.__version__}")


def _allocator_text(cfg: dict) -> str:
    if cfg["device"] == "cuda":
        return "PyTorch's CUDA caching allocator"
    if cfg["system_malloc"]:
        return "glibc malloc defaults (--system-malloc)"
    return (f"glibc malloc with GLIBC_TUNABLES={':'.join(GLIBC_CACHING_TUNABLES)} in the "
            "workers: freed buffers stay in the heap and are reused, like a GPU caching "
            "allocator. With the defaults, large buffers are mmapped (or the heap top is "
            "trimmed) and their pages are faulted in again on the next step, which cost the "
            "LRMoE dropless backward 20k-65k faults and 60-160 ms of kernel time per step "
            "here and Megatron none (--system-malloc keeps the defaults)")


def report(cfg: dict, per_rank: list[dict], command: str) -> tuple[str, list[dict]]:
    from megatron.core import package_info

    out = [
        "# MoE layer benchmark: Megatron MoELayer vs LRMoE backward capacities",
        "",
        f"- command: `{command}`",
        f"- date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
        f"- machine: {_machine(cfg)}; megatron-core {package_info.__shortversion__}",
        f"- code: {code_version()}",
        f"- layer: H={cfg['hidden']}, expert FFN F={cfg['ffn']}, {cfg['experts']} experts, "
        f"top-{cfg['topk']}, SwiGLU, no bias, {cfg['dtype']}, EP={cfg['ep']}, "
        f"{cfg['tokens']} tokens per rank; LRMoE kernels={cfg['kernels']}, "
        f"grouped GEMM={cfg['grouped_gemm']}",
        f"- allocator: {_allocator_text(cfg)}",
        f"- timing: {cfg['warmup']} warm-up + {cfg['reps']} measured repetitions, settings "
        "interleaved (order rotated per repetition), same inputs and weights; per repetition "
        "the slowest rank's time, then the median; forward = the layer call, backward = "
        "`out.backward(dy)` (input gradient on), each after a barrier",
        "- bwd ms: median, ± half the interquartile range over repetitions; bwd / dropless: "
        "median over repetitions of the ratio to the dropless run of the same repetition",
        "- r hot rank = retained / routed pairs on the rank with the most routed pairs; "
        "r overall = retained / routed over all ranks; dropless = LRMoE gamma=inf",
        "- bwd a2a MiB: output-gradient rows (+ int32 positions for LRMoE) sent by the first "
        "backward all-to-all, summed over ranks (LRMoE: RegionStats.backward_bytes_sent; "
        "Megatron: routed pairs x H x dtype bytes, what its combine backward sends); "
        "'= r x dense + idx' checks sent == r_overall x dense + 4 bytes per kept row exactly "
        "(no index bytes when the retained set is drawn in forward: they travel in forward)",
        "- expert bwd rows: rows the expert backward GEMMs run over, summed over ranks "
        "(LRMoE: RegionStats.expert_backward_rows; Megatron: routed pairs received)",
        "- bwd a2a buffers: an exact count of the region's backward all-to-all buffers "
        "(sent and received gradient rows, their int32 positions on both sides, the dX rows "
        "the experts compute and the dX rows received back), from the retention plan, "
        "summed over ranks; not a profiler reading. Dense = the same buffers with every "
        "routed pair and no positions (Megatron's). Expert intermediates are not counted",
        "- saved MiB: bytes autograd keeps from forward to backward (saved_tensors_hooks, "
        "distinct storages, parameters and the layer input excluded); peak fwd+bwd MiB: the "
        "most bytes the allocator held above the level before the forward, over one "
        "forward+backward (torch.profiler memory events on CPU, max_memory_allocated on "
        "CUDA; weight gradients allocated beforehand, as a run's gradient buffers are, so "
        "only per-call temporaries count; the output and input gradient, 2 x T x H, are "
        "in it); the smaller of two untimed steps, in which (on CPU) each all-to-all "
        "returns once gloo's worker thread has released its input, which on a loaded "
        "machine it may otherwise do a scheduling slice late; the previous call's graph "
        "Megatron's dispatcher still holds (its router probabilities, and through them "
        "the previous input) is detached first; busiest rank. Cost model peak: LRMoE "
        "CostModel.plan_memory (saved bytes plus the rest of the phase-wise peak, from "
        "the plan's loads, each source's kept pairs and each instance's rows; the GEMM "
        "path this run uses), Megatron's MoELayer MegatronMoEMemory (its dispatcher, "
        "SequentialMLP and autograd's frees, phase by phase, from the routed counts); "
        "saved: CostModel.saved_memory and MegatronMoEMemory.saved_bytes; busiest rank, "
        "and the largest relative error against the measurement over the ranks "
        f"(checked: within {MODEL_TOLERANCE:.0%})",
        "- host reads fwd/bwd: reads of device data on the host in one forward and one "
        "backward of the layer (lrmoe_testing.host_reads: data flow from the "
        "layer's input and weights; syncs inside compiled kernels are not seen), busiest "
        "rank; on a GPU each one stalls the CPU until the device drains",
        "",
    ]
    all_rows = []
    for routing in cfg["routings"]:
        rows = summarize_routing(cfg, per_rank, routing)
        counts = torch.tensor(per_rank[0]["routings"][routing]["counts"])
        loads = counts.sum(0).view(cfg["ep"], -1).sum(1)
        experts = counts.sum(0)
        out += [
            f"## Routing: {routing}",
            "",
            ROUTING_TEXT[routing].format(**cfg, popularity_text=POPULARITY_TEXT[
                cfg["popularity"]]) + ".",
            f"Routed pairs per rank (forward load): {', '.join(map(str, loads.tolist()))}; "
            f"max/mean = {float(loads.max()) / float(loads.double().mean()):.3f}. "
            f"Per expert: max/mean = {float(experts.max()) / float(experts.double().mean()):.2f}"
            f", min = {int(experts.min())}.",
            _contention(cfg, per_rank, routing),
            _faults_line(cfg, per_rank, routing),
            "",
            markdown_table(rows),
            "",
        ]
        shown: dict[str, str] = {}
        for r in rows:
            if "traceback" not in r:
                continue
            if r["traceback"] in shown:
                out += [f"{r['setting']} failed on {routing} as {shown[r['traceback']]} did.", ""]
                continue
            shown[r["traceback"]] = r["setting"]
            out += [f"{r['setting']} failed on {routing}:", "", "```", r["traceback"].rstrip(),
                    "```", ""]
        all_rows += [dict(r, routing=routing) for r in rows]
    out += _verdict(all_rows)
    if any("profile" in r for r in per_rank):
        out += ["", f"## Profiles (rank 0, routing {cfg['routings'][-1]})", ""]
        for label, tables in per_rank[0].get("profile", {}).items():
            for phase, table in tables.items():
                out += [f"### {label}: {phase}", "", "```", table, "```", ""]
    return "\n".join(out) + "\n", all_rows


def _contention(cfg: dict, per_rank: list[dict], routing: str) -> str:
    """CPU time / wall time of the timed spans per rank: a rank that had its core to
    itself is near 1 while it computes; a clearly lower busiest-rank figure means other
    processes took the cores (or, on CUDA, that the host mostly waited)."""
    ratios = [r["routings"][routing]["cpu_wall"][0] / max(r["routings"][routing]["cpu_wall"][1],
                                                         1e-9) for r in per_rank]
    what = "host CPU time / wall time" if cfg["device"] == "cuda" else "CPU time / wall time"
    return (f"{what} of the timed spans per rank: "
            f"{', '.join(f'{v:.2f}' for v in ratios)} (the busiest rank near 1 = its core was "
            "its own; ranks waiting in all-to-alls sit lower).")


def _faults_line(cfg: dict, per_rank: list[dict], routing: str) -> str:
    """Median minor page faults per measured step (forward + backward), busiest rank."""
    parts = []
    for name, gamma in _settings(cfg):
        values = [max(r["routings"][routing]["faults"][(name, gamma)][i] for r in per_rank)
                  for i in range(len(per_rank[0]["routings"][routing]["faults"][(name, gamma)]))]
        if values:
            parts.append(f"{_label(name, gamma)} {statistics.median(values):.0f}")
    return ("Minor page faults per measured step (median, most on any rank): "
            + ", ".join(parts) + ".")


def _verdict(rows: list[dict]) -> list[str]:
    checked = [r for r in rows if r["target_ok"] is not None and not math.isinf(r["gamma"])]
    failed = [r for r in rows if "error" in r]
    missed = [r for r in checked if not r["target_ok"]]
    lines = ["## Target check", ""]
    lines.append("Target: backward time <= (r + 0.05) x dropless backward time, r on the "
                 "most loaded rank; backward bytes = r x dense + index overhead.")
    lines.append("")
    for r in checked:
        lines.append(f"- {r['routing']}, {r['setting']}: bwd {r['bwd_vs_dropless']:.3f} x "
                     f"dropless vs bound {r['r_hot'] + TARGET_SLACK:.3f}: "
                     f"{'met' if r['target_ok'] else 'MISSED'}; bytes "
                     f"{'exact' if r['bytes_ok'] else 'MISMATCH'} "
                     f"({r['bytes_sent'] / max(r['bytes_dense'], 1):.3f} x dense)")
    lines.append("")
    lines.append(f"Time target met in {len(checked) - len(missed)}/{len(checked)} LRMoE "
                 "settings with gamma < inf" + (": missed in " + ", ".join(
                     f"{r['routing']} {r['setting']}" for r in missed) if missed else "") + ".")
    exact = [r for r in rows if r.get("name") == "lrmoe" and math.isinf(r["gamma"])
             and "error" not in r]
    for r in exact:
        ok = r["fwd_vs_megatron"] <= 1.02 and r["bwd_vs_megatron"] <= 1.02
        lines.append(f"- {r['routing']}, {r['setting']} against Megatron's MoELayer (median of "
                     f"paired per-repetition ratios): forward {r['fwd_vs_megatron']:.3f}, "
                     f"backward {r['bwd_vs_megatron']:.3f} (target <= 1.02 each: "
                     f"{'met' if ok else 'MISSED'})")
    noise = [r for r in checked if r["r_hot"] == 1.0]
    if noise:
        lines.append("Settings that drop nothing on the hot rank (r = 1) do the dropless work; "
                     "their ratio to dropless measures the timing noise: " + ", ".join(
                         f"{r['routing']} {r['setting']} {r['bwd_vs_dropless']:.3f}"
                         for r in noise) + ".")
    modelled = [r for r in rows if "mem_model" in r]
    off = [r for r in modelled if max(r["mem_model_err"], r["saved_model_err"])
           > MODEL_TOLERANCE]
    if modelled:
        lines.append(f"Cost model within {MODEL_TOLERANCE:.0%} of the measured peak and "
                     f"saved bytes on every rank in {len(modelled) - len(off)}/"
                     f"{len(modelled)} settings" + (": off in " + ", ".join(
                         f"{r['routing']} {r['setting']} (peak {100 * r['mem_model_err']:.1f}"
                         f"%, saved {100 * r['saved_model_err']:.1f}%)" for r in off)
                         if off else "") + ".")
    if failed:
        names = ", ".join(f"{r['routing']} {r['setting']}" for r in failed)
        lines.append(f"FAILED settings: {names} (tracebacks above).")
    return lines


# -----------------------------------------------------------------------------
# Entry point
# -----------------------------------------------------------------------------


def _capacities(text: str) -> list[float]:
    values = [float(v) for v in text.split(",") if v.strip()]
    if any(not (v > 0) for v in values):
        raise argparse.ArgumentTypeError("capacities must be > 0 or inf")
    return values


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--quick", action="store_true", help="tiny smoke run (seconds)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--ep", type=int, default=None, help="EP ranks (default: 2 on cpu, 1 cuda)")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=512, help="expert FFN size F")
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="fp32")
    p.add_argument("--capacities", type=_capacities, default=_capacities("inf,1.5,1.0,0.75"),
                   help="LRMoE backward capacity factors, comma-separated (inf = dropless)")
    p.add_argument("--routings", default="skewed,router",
                   help="comma-separated subset of: skewed, router, recorded")
    p.add_argument("--recorded-log", default=None,
                   help="launcher JSON-lines log of a --moe-lrmoe run, for --routings recorded")
    p.add_argument("--recorded-layer", type=int, default=1)
    p.add_argument("--zipf", type=float, default=1.2, help="Zipf exponent of the skewed routing")
    p.add_argument("--popularity", choices=tuple(POPULARITY_TEXT), default="index",
                   help="skewed routing: hottest experts first (index) or shuffled")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=11)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--kernels", default="auto", choices=("auto", "cpu", "cuda", "torch"))
    p.add_argument("--grouped-gemm", default="auto", choices=("auto", "on", "off"),
                   help="LRMoE expert backward: torch grouped_mm (on), per-expert loop (off), "
                        "or the layer's default (auto)")
    p.add_argument("--profile", type=_capacities, default=None,
                   help="also profile one forward/backward of Megatron and of LRMoE at these "
                        "capacities (torch.profiler, rank 0), appended to the output")
    p.add_argument("--profile-by-shape", action="store_true",
                   help="--profile's tables grouped by input shape as well as op name")
    p.add_argument("--system-malloc", action="store_true",
                   help="CPU: leave glibc malloc at its defaults (big buffers are mmapped "
                        "and page-faulted in again every step)")
    p.add_argument("--out", type=Path, default=None,
                   help="markdown output (default: benchmarks/results/bench_moe_layer_<dev>.md;"
                        " --quick writes nothing unless given)")
    args = p.parse_args(argv)
    if args.ep is None:
        args.ep = 2 if args.device == "cpu" else 1
    if args.quick:
        args.hidden, args.ffn, args.experts, args.topk = 64, 32, 8, 2
        args.tokens, args.warmup, args.reps = 64, 1, 2
    args.routings = [r.strip() for r in args.routings.split(",") if r.strip()]
    args.recorded_popularity = None
    if "recorded" in args.routings:
        if not args.recorded_log:
            p.error("--routings recorded needs --recorded-log FILE")
        args.recorded_popularity = recorded_popularity(
            args.recorded_log, args.recorded_layer, args.experts).tolist()
    if bad := set(args.routings) - set(ROUTING_TEXT):
        p.error(f"unknown routing {sorted(bad)}; choose from {sorted(ROUTING_TEXT)}")
    if args.experts % args.ep:
        p.error("--experts must be a multiple of --ep")
    if args.device == "cuda" and args.ep != 1:
        p.error("--device cuda runs one process: use --ep 1")
    if args.out is None and not args.quick:
        args.out = ROOT / "benchmarks" / "results" / f"bench_moe_layer_{args.device}.md"
    return args


def _run_cuda(cfg: dict) -> list[dict]:
    """One process, one GPU: a 1-rank process group (the CPU runtime is not used)."""
    import torch.distributed as dist

    from lrmoe_testing.gloo_pool import free_port

    if not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device visible to torch")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        return [run_benchmark(cfg)]
    finally:
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        dist.destroy_process_group()


def _load(values: tuple[float, float, float]) -> str:
    return "/".join(f"{v:.2f}" for v in values)


def main(argv=None) -> int:
    args = parse_args(argv)
    cfg = {k: v for k, v in vars(args).items() if k not in ("out", "quick")}
    command = " ".join(shlex.quote(a) for a in [".venv/bin/python",
                                                 "benchmarks/bench_moe_layer.py",
                                                 *(sys.argv[1:] if argv is None else argv)])
    start = time.perf_counter()
    load_before = os.getloadavg()
    if args.device == "cpu" and not args.system_malloc:
        # Workers are new processes: glibc reads these at their start. Freed memory stays
        # in the heap and is reused (as a GPU caching allocator does) instead of being
        # unmapped and faulted in again, page by page, on the next step.
        tunables = [t for t in os.environ.get("GLIBC_TUNABLES", "").split(":") if t]
        os.environ["GLIBC_TUNABLES"] = ":".join([*tunables, *GLIBC_CACHING_TUNABLES])
    if args.device == "cpu":
        from lrmoe_testing.gloo_pool import GlooPool

        pool = GlooPool(args.ep)
        try:
            # The workers are spawned: they load this script as their __main__ too, so
            # the task resolves there by name (as bench_placement.py's does).
            per_rank = pool.run(run_benchmark, cfg, timeout=3600.0)
        finally:
            pool.close()
    else:
        per_rank = _run_cuda(cfg)
    text, _ = report(cfg, per_rank, command)
    load_after = os.getloadavg()
    text += (f"\nWall time of the whole run: {time.perf_counter() - start:.0f} s. "
             f"Load average (1/5/15 min) at start {_load(load_before)}, at end "
             f"{_load(load_after)} ({os.cpu_count()} cores): other processes on the machine "
             f"share the cores when it exceeds the rank count.\n")
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text, encoding="utf-8")
        print(f"written: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
