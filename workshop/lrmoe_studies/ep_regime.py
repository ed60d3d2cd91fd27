"""The routing regime of the EP 8 / EP 16 study model: tokens per call, hot-rank load.

    .venv/bin/python benchmarks/studies/ep_regime.py record --ep 16    # ~4 min (shared 2 cores)
    .venv/bin/python benchmarks/studies/ep_regime.py record --ep 8     # ~2.5 min
    .venv/bin/python benchmarks/studies/ep_regime.py table             # seconds

(``benchmarks/studies/ep_regime.py`` is this module's command line.)

``record`` trains the study model (``configs/ep_study.yaml``: Qwen3-30B-A3B's routing,
128 experts top-8, softmax, aux loss 1e-3, at small widths) at EP=N on N ranks x 1
thread (torchrun, gloo), with Megatron's own MoE layer (dropless) and the launcher's
``--record-routing``. While it trains, every rank's memory is sampled each second
(``/proc/<pid>/smaps_rollup``: RSS, and PSS, which splits the pages the ranks share
among them) and the machine's CPU time (``/proc/stat``) is set against the ranks' own,
so the record says how much of the cores other processes took (this machine is shared).
Output: ``benchmarks/results/ep_regime/ep<N>/`` (``trace/`` repacked, ``log.jsonl.xz``,
``stdout.txt.xz``, ``run.json``: command, code, wall time, memory, contention).

``table`` reads the recordings and writes ``report.md`` and ``report.json`` beside them.
A call is one micro-batch of one MoE layer: the N ranks' routed counts ([N, E], one row
per rank; the run has one expert-parallel group). Per EP size: tokens per call (per rank
and in all), and the hot rank's load, max over ranks / mean of the pairs each rank
receives, median and 90th percentile over the calls of the steps past the first 10%:

(a) Megatron's contiguous layout (expert e on rank e // (E / N));
(b) with the replicas SYMI-style placement adds in one extra instance slot per rank:
    the project's planner (``LayerPlanner``, policy ``popularity``, as
    ``--moe-lrmoe-placement popularity --moe-lrmoe-popularity-slots E/N+1`` runs it)
    fed the recorded counts step by step, so each step's placement comes from the
    smoothed loads of the steps before it (the first step is static), and each call's
    pairs are assigned to the instances as the layer's forward assigns them
    (``assign_instances``: the least largest rank load);
(c) a uniform router at the same tokens per call (per-expert counts Binomial(tokens,
    k/E), ``routing_traces.uniform_load_max_over_mean``), the part sampling alone gives.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from lrmoe_studies.simulator_validation import recorded_defaults
from megatron_lrmoe.data.routing_traces import (
    RoutingTrace,
    load_max_over_mean,
    read_routing_trace,
    repack,
    uniform_load_max_over_mean,
)
from megatron_lrmoe.tools import run_log
from megatron_lrmoe.tools.provenance import code_version

ROOT = Path(__file__).resolve().parents[2]
CONFIG = "configs/ep_study.yaml"
OUT = ROOT / "benchmarks" / "results" / "ep_regime"
EP_SIZES = (8, 16)
EXTRA_SLOTS = 1
WARMUP_FRACTION = 0.1
"""Calls of the first 10% of steps are left out (the router's start, and the static first
step of the placed layout)."""


# -----------------------------------------------------------------------------
# Recording
# -----------------------------------------------------------------------------


def record_command(ep: int, out: Path, train_iters: int, port: int, data_path: str
                   ) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ep),
            "--master-port", str(port), "-m", "megatron_lrmoe.launcher.pretrain",
            "--config", CONFIG, "--expert-model-parallel-size", str(ep),
            "--train-iters", str(train_iters), "--eval-interval", str(train_iters),
            "--log-interval", "10", "--no-progress-bar", "--data-path", data_path,
            "--data-cache-path", "data/cache", "--log-json", str(out / "log.jsonl"),
            "--record-routing", str(out / "trace")]


def _children() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                # the command name (field 2) may hold spaces: split after its ")"
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            out.setdefault(ppid, []).append(int(entry.name))
    return out


def _descendants(pid: int) -> list[int]:
    children, out, todo = _children(), [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def _cpu_seconds(pid: int) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _machine_busy_seconds() -> float:
    """CPU seconds all cores spent busy since boot (``/proc/stat``, not idle or iowait)."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(values) - values[3] - values[4]) / os.sysconf("SC_CLK_TCK")


def _memory_kib(pid: int) -> tuple[int, int] | None:
    """(RSS, PSS) in KiB of one process, or None once it is gone."""
    try:
        lines = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
    except OSError:
        return None
    fields = {line.split(":")[0]: int(line.split()[1]) for line in lines[1:]}
    return fields["Rss"], fields["Pss"]


def _is_rank(pid: int) -> bool:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"megatron_lrmoe.launcher.pretrain" in argv and b"torch.distributed.run" not in argv


class Sampler(threading.Thread):
    """Samples a process tree every ``interval`` seconds: each rank's peak RSS and PSS,
    and each process's CPU seconds (the last value seen before it exits)."""

    def __init__(self, pid: int, interval: float = 1.0):
        super().__init__(daemon=True)
        self.pid, self.interval = pid, interval
        self.peak: dict[int, tuple[int, int]] = {}
        self.cpu: dict[int, float] = {}
        self.loadavg: list[float] = []
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.interval):
            for pid in _descendants(self.pid):
                seconds = _cpu_seconds(pid)
                if seconds is not None:
                    self.cpu[pid] = seconds
                if _is_rank(pid) and (memory := _memory_kib(pid)) is not None:
                    rss, pss = self.peak.get(pid, (0, 0))
                    self.peak[pid] = (max(rss, memory[0]), max(pss, memory[1]))
            self.loadavg.append(os.getloadavg()[0])


def record(ep: int, train_iters: int, port: int, data_path: str, force: bool) -> Path:
    out = OUT / f"ep{ep}"
    if (out / "trace").exists():
        if not force:
            raise SystemExit(f"{out / 'trace'} exists; --force replaces it")
        import shutil

        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    command = record_command(ep, out.relative_to(ROOT), train_iters, port, data_path)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    busy, start = _machine_busy_seconds(), time.perf_counter()
    with open(out / "stdout.txt", "w") as stdout:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=stdout,
                                   stderr=subprocess.STDOUT)
        sampler = Sampler(process.pid)
        sampler.start()
        code = process.wait()
        sampler.stopped.set()
        sampler.join()
    wall = time.perf_counter() - start
    busy = _machine_busy_seconds() - busy
    if code:
        tail = (out / "stdout.txt").read_text().splitlines()[-15:]
        raise SystemExit(f"recording failed ({code}):\n" + "\n".join(tail))
    cores = os.cpu_count() or 1
    ours = sum(sampler.cpu.values())
    steps = [r["step-time-s"] for r in run_log.read_records(out / "log.jsonl")
             if "step-time-s" in r]
    rss = [v[0] / 1024 for v in sampler.peak.values()]
    pss = [v[1] / 1024 for v in sampler.peak.values()]
    display = [Path(command[0]).name, *command[1:]]
    record = {
        "command": shlex.join(display), "code": code_version(), "defaults": recorded_defaults(),
        "date": datetime.date.today().isoformat(), "ep": ep, "train_iters": train_iters,
        "wall_s": wall, "cores": cores,
        "step_s_median": statistics.median(steps[1:]),
        "step_s_p90": float(np.percentile(steps[1:], 90)),
        "ranks_sampled": len(sampler.peak),
        "rss_mib_max": max(rss), "rss_mib_median": statistics.median(rss),
        "pss_mib_max": max(pss), "pss_mib_median": statistics.median(pss),
        # Busy CPU time not spent by the run's own processes (each counted up to its last
        # sample, so this slightly overstates the others' share).
        "other_cpu_share": max(0.0, busy - ours) / (wall * cores),
        "run_cpu_share": ours / (wall * cores),
        "loadavg_1min_median": statistics.median(sampler.loadavg) if sampler.loadavg else None,
    }
    (out / "run.json").write_text(json.dumps(record, indent=1) + "\n")
    run_log.compress(out / "log.jsonl")
    run_log.compress(out / "stdout.txt")
    repack(out / "trace")
    return out


# -----------------------------------------------------------------------------
# Analysis (pure: a trace in, numbers out)
# -----------------------------------------------------------------------------


def popularity_max_over_mean(layer_counts: np.ndarray, ranks: int, extra_slots: int,
                             load_smoothing: float = 0.5) -> np.ndarray:
    """Hot-rank load max/mean of every call of one MoE layer under SYMI-style placement:
    counts [n steps, M, S, E] in step order -> [n, M].

    The project's planner (policy ``popularity``, ``E/R + extra_slots`` instance slots
    per rank, nothing dropped) sees the steps in order as the layer's does: each step's
    placement is chosen from the smoothed loads of the steps before it, each call's pairs
    go to the instances as ``assign_instances`` assigns them (the least largest rank
    load), and the step's calls are then observed."""
    from megatron_lrmoe.planning.instance_assignment import assign_checked
    from megatron_lrmoe.planning.plan_types import PlannerSettings
    from megatron_lrmoe.planning.planner import LayerPlanner

    n, m, sources, experts = layer_counts.shape
    if sources != ranks:
        raise ValueError(f"counts have {sources} sources per call, not the {ranks} ranks of "
                         "one expert-parallel group")
    planner = LayerPlanner(PlannerSettings(
        "popularity", ranks, experts, capacity_factor=math.inf,
        slots_per_rank=experts // ranks + extra_slots, load_smoothing=load_smoothing),
        native=False)
    out = np.empty((n, m))
    for i in range(n):
        placement = planner.placement
        for j in range(m):
            call = layer_counts[i, j]
            load = assign_checked(call, placement, None)[1].astype(np.float64)
            out[i, j] = load.max() / load.mean() if load.sum() else 1.0
            planner.observe(call)
        planner.next_step()
    return out


def _quantiles(values: np.ndarray) -> dict[str, float]:
    return {"median": float(np.median(values)), "p90": float(np.percentile(values, 90))}


def regime(trace: RoutingTrace, extra_slots: int = EXTRA_SLOTS, seed: int = 0) -> dict:
    """Tokens per call and the hot rank's load max/mean (median, p90 over the calls of the
    steps past the first ``WARMUP_FRACTION``): contiguous, placed, and uniform."""
    header = trace.header
    ranks, model, parallel = trace.ep, header["model"], header["parallel"]
    if parallel["world_size"] != ranks:
        raise ValueError(f"a trace of {parallel['world_size']} ranks at EP {ranks}: the "
                         "regime is measured on one expert-parallel group")
    tokens = int(parallel["tokens_per_source"])
    first = int(trace.iterations[0]) + int(WARMUP_FRACTION * len(trace.iterations))
    kept = trace.iterations >= first
    contiguous = load_max_over_mean(trace.counts, ranks)              # [n, L, M]
    placed = np.stack([popularity_max_over_mean(trace.layer(layer), ranks, extra_slots)
                       for layer in trace.layers], axis=1)             # [n, L, M]
    contiguous, placed = contiguous[kept].ravel(), placed[kept].ravel()
    uniform = uniform_load_max_over_mean(ranks * tokens, trace.num_experts, model["topk"],
                                         ranks, contiguous.size, seed)
    return {
        "ep": ranks, "experts": trace.num_experts, "topk": model["topk"],
        "layers": len(trace.layers), "steps": len(trace.iterations), "first_step": first,
        "microbatches_per_step": parallel["microbatches_per_step"],
        "calls": int(contiguous.size),
        "tokens_per_rank": tokens, "tokens_per_call": ranks * tokens,
        "pairs_per_expert": ranks * tokens * model["topk"] / trace.num_experts,
        "contiguous": _quantiles(contiguous), "placed": _quantiles(placed),
        "uniform": _quantiles(uniform),
    }


# -----------------------------------------------------------------------------
# Report
# -----------------------------------------------------------------------------


def _pair(q: dict[str, float]) -> str:
    return f"{q['median']:.2f} / {q['p90']:.2f}"


def markdown(rows: list[dict], runs: dict[int, dict], command: str) -> str:
    lines = [
        "# Routing regime of the EP 8 / EP 16 study model",
        "",
        f"- command: `{command}`",
        f"- code: {code_version()}",
        f"- date: {datetime.date.today().isoformat()}",
        "",
        f"Model: `{CONFIG}` (Qwen3-30B-A3B's routing at small widths). What is measured and "
        "how: `workshop/lrmoe_studies/ep_regime.py` (module docstring). Each EP size is one "
        "recording (`ep<N>/run.json`: its command and code), Megatron's dropless layer.",
        "",
        "Hot-rank load = max over ranks / mean of the pairs each rank receives in one call "
        "(one micro-batch of one MoE layer); median / p90 over the calls past the first "
        f"{WARMUP_FRACTION:.0%} of steps. Placed: SYMI-style (`popularity`) with "
        f"{EXTRA_SLOTS} extra instance slot per rank, chosen from the earlier steps' "
        "smoothed loads. Uniform: a uniform top-k router at the same tokens per call.",
        "",
        "| EP | tokens / rank / call | tokens / call | pairs / expert / call | calls "
        "| contiguous | placed (+1 slot) | uniform router |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['ep']} | {r['tokens_per_rank']} | {r['tokens_per_call']} | "
                     f"{r['pairs_per_expert']:.0f} | {r['calls']} | {_pair(r['contiguous'])} "
                     f"| {_pair(r['placed'])} | {_pair(r['uniform'])} |")
    lines += [
        "",
        "Runs: step time and memory per rank (the ranks' peak over 1 s samples of "
        "`/proc/<pid>/smaps_rollup`; PSS splits the pages the ranks share), and the share "
        "of the machine's CPU time other processes took while it ran.",
        "",
        "| EP | steps | step s median / p90 | wall s | RSS MiB per rank (max) "
        "| PSS MiB per rank (max) | all ranks' PSS GiB | other processes' CPU share "
        "| load avg (1 min, median) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for ep, run in sorted(runs.items()):
        lines.append(
            f"| {ep} | {run['train_iters']} | {run['step_s_median']:.2f} / "
            f"{run['step_s_p90']:.2f} | {run['wall_s']:.0f} | {run['rss_mib_max']:.0f} | "
            f"{run['pss_mib_max']:.0f} | {run['pss_mib_max'] * ep / 1024:.1f} | "
            f"{100 * run['other_cpu_share']:.0f}% of {run['cores']} cores | "
            f"{run['loadavg_1min_median']:.1f} |")
    return "\n".join(lines) + "\n"


def table(command: str) -> str:
    rows, runs = [], {}
    for ep in EP_SIZES:
        if (OUT / f"ep{ep}" / "trace").is_dir():
            rows.append(regime(read_routing_trace(OUT / f"ep{ep}" / "trace")))
            runs[ep] = json.loads((OUT / f"ep{ep}" / "run.json").read_text())
    if not rows:
        raise SystemExit(f"no recordings under {OUT}; run the record command first")
    text = markdown(rows, runs, command)
    (OUT / "report.md").write_text(text)
    (OUT / "report.json").write_text(json.dumps(
        {"command": command, "code": code_version(), "rows": rows, "runs": runs},
        indent=1) + "\n")
    return text


# -----------------------------------------------------------------------------
# Main
# -----------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    sub = p.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="train the study model at one EP size, recording")
    rec.add_argument("--ep", type=int, choices=EP_SIZES, required=True)
    rec.add_argument("--train-iters", type=int, default=60)
    rec.add_argument("--port", type=int, default=29581)
    rec.add_argument("--data-path", default="data/stdlib",
                     help="prepared corpus prefix (python -m megatron_lrmoe.data.prepare)")
    rec.add_argument("--force", action="store_true", help="replace an existing recording")
    sub.add_parser("table", help="write report.md and report.json from the recordings")
    args = p.parse_args(argv)
    if args.command == "record":
        out = record(args.ep, args.train_iters, args.port, args.data_path, args.force)
        print(f"recorded into {out}")
        return 0
    command = shlex.join([".venv/bin/python", "benchmarks/studies/ep_regime.py",
                          *(sys.argv[1:] if argv is None else argv)])
    print(table(command))
    return 0
