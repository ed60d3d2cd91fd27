"""The largest micro-batch each policy trains with on a device, measured.

    .venv/bin/python benchmarks/studies/largest_micro_batch.py --device-gib 0.4391 \\
        --out-dir benchmarks/results/largest_micro_batch/d2
    # from a git worktree: PYTHONPATH=. so that the package measured is the worktree's

(``benchmarks/studies/largest_micro_batch.py`` is this module's command line.)

The time-to-loss study's model and batch (the flags of its reference dropless run), every
policy held to the device (``--device-memory-gb``; LRMoE under the budget ``auto``), at
micro-batch 1, 2, 4, ... with the micro-batches per step unchanged (the global batch
grows with it), for ``--steps`` steps from initialisation on the study's corpus, seed 1.
Per policy: the largest micro-batch that trains every step without the launcher's
out-of-memory stop, its MoE time per 1k tokens (the median step after the first tenth,
forward + backward, the slowest rank per stage, over the tokens of both ranks), and the
first size that stopped, with its message. Beside: the prediction
(``fitting.largest_micro_batch``) from the reference run's routing, which is the routing
of 225 trained steps where the measurement sees the first ``--steps``.

2 ranks with one thread each: run it on a quiet machine. Resumable: a run with its
``done.json`` is not repeated (``time_to_loss.run_one``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
from pathlib import Path

from lrmoe_studies import fitting as F
from lrmoe_studies import time_to_loss as ttl
from lrmoe_studies.simulator_validation import reference_flags
from lrmoe_studies.time_to_loss_policies import policies, world_size
from megatron_lrmoe.tools import run_log
from megatron_lrmoe.tools.provenance import code_version

__all__ = ["main", "moe_ms_per_1k_tokens"]

ROOT = Path(__file__).resolve().parents[2]
REFERENCE_RUN = "benchmarks/results/time_to_loss/h384_f1024_mb4/confirm/runs/megatron-dropless-s1"
POLICIES = ("megatron-dropless", "megatron-capacity-1.0", "symi", "lrmoe-uniform-g1.0",
            "lrmoe-uniform-g1.0-ma")


def _shown(path: Path) -> str:
    """A path as the report names it: from the repository root when inside it."""
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def moe_ms_per_1k_tokens(log: Path, tokens_per_step: int) -> float:
    """Median MoE seconds of a step (after the first tenth) per 1000 tokens."""
    steps = [r for r in run_log.read_records(log) if "moe-forward-s" in r]
    steps = steps[len(steps) // 10:]
    median = statistics.median(r["moe-forward-s"] + r["moe-backward-s"] for r in steps)
    return 1e6 * median / tokens_per_step


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device-gib", type=float, required=True)
    ap.add_argument("--out-dir", type=Path, required=True)
    ap.add_argument("--run", type=Path, default=ROOT / REFERENCE_RUN,
                    help="the reference run: its model and batch, and its routing for the "
                         "prediction")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--limit", type=int, default=16, help="the largest micro-batch tried")
    ap.add_argument("--data-path", default="data/stdlib")
    ap.add_argument("--data-cache-path", default="data/cache")
    ap.add_argument("--port", type=int, default=29537)
    a = ap.parse_args(argv)
    os.chdir(ROOT)
    every = policies("auto")
    chosen = [p for p in a.policies.split(",") if p]
    if bad := [p for p in chosen if p not in every]:
        raise SystemExit(f"--policies: unknown {bad}; known: {', '.join(every)}")

    base = reference_flags(a.run)
    ranks = world_size(base)            # the reference run's: one per expert-parallel rank
    args = F._parse([*base, "--mock-data"], ranks)
    microbatches = args.num_microbatches

    def step_tokens(micro_batch: int) -> int:     # of every rank, in one optimizer step
        return micro_batch * args.seq_length * microbatches * ranks

    traces, outside = F.reference_run(a.run)
    calibration = json.loads((ROOT / ttl.CALIBRATION).read_text())
    run_only = ["--data-path", a.data_path, "--data-cache-path", a.data_cache_path,
                "--seed", "1", "--train-iters", str(a.steps), "--eval-iters", "0",
                "--log-interval", str(a.steps), "--no-progress-bar",
                "--device-memory-gb", f"{a.device_gib:g}"]

    rows = []
    for name in chosen:
        flags = ttl.on_device(every[name])
        predicted, p = F.largest_micro_batch([*base, "--mock-data"], name, flags, a.device_gib,
                                             traces, calibration, outside, limit=a.limit,
                                             world_size=ranks)
        measured, measured_ms, stopped, m = 0, None, None, 1
        while m <= a.limit:
            run_dir = a.out_dir / "runs" / f"{name}-mb{m}"
            done = ttl.run_one(run_dir, [*base, *flags, "--micro-batch-size", str(m),
                                         "--global-batch-size", str(m * microbatches * ranks),
                                         *run_only], a.port)
            print(f"[largest_micro_batch] {run_dir.name}: "
                  f"{done.get('failed', 'trained')}", flush=True)
            if "failed" in done:
                stopped = f"{m}: {done['failed']}"
                break
            measured, measured_ms = m, moe_ms_per_1k_tokens(run_dir / "log.jsonl", step_tokens(m))
            m *= 2
        rows.append({
            "policy": name, "predicted": predicted,
            "predicted_ms_per_1k_tokens": (1e6 * p.moe_s / step_tokens(predicted)
                                           if p is not None else None),
            "measured": measured, "measured_ms_per_1k_tokens": measured_ms,
            "stopped": stopped})

    command = shlex.join(["python", "benchmarks/studies/largest_micro_batch.py",
                          *(sys.argv[1:] if argv is None else argv)])
    lines = [
        f"# Largest micro-batch on a {a.device_gib:g} GiB device (measured)", "",
        f"Command: `{command}`  ", f"Code: {code_version()}  ",
        f"Model and batch: `{_shown(a.run)}`'s flags ({microbatches} micro-batches "
        f"per step on 2 ranks, sequence {args.seq_length}); {a.steps} steps per run from "
        f"initialisation, seed 1, `{a.data_path}`; micro-batch 1, 2, 4, ... up to "
        f"{a.limit}. Predicted: `fitting.largest_micro_batch` on the reference run's "
        "routing (225 trained steps).", "",
        "| policy | predicted micro-batch | predicted MoE ms / 1k tokens | measured "
        "micro-batch | measured MoE ms / 1k tokens | first size stopped (report.json: the whole "
        "message) |",
        "|---|---|---|---|---|---|"]
    for r in rows:
        pm = r["predicted_ms_per_1k_tokens"]
        mm = r["measured_ms_per_1k_tokens"]
        stop = (r["stopped"] or "-").split(";")[0]     # the need and the device; all in json
        lines.append(f"| {r['policy']} | {r['predicted'] or 'none fits'} | "
                     f"{'-' if pm is None else f'{pm:.1f}'} | {r['measured'] or 'none fits'} | "
                     f"{'-' if mm is None else f'{mm:.1f}'} | {stop} |")
    text = "\n".join(lines) + "\n"
    print(text)
    a.out_dir.mkdir(parents=True, exist_ok=True)
    (a.out_dir / "report.md").write_text(text)
    (a.out_dir / "report.json").write_text(json.dumps(
        {"command": command, "code": code_version(), "device_gib": a.device_gib,
         "steps": a.steps, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
