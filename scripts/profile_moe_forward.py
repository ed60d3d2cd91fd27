"""Where a training run's MoE forward time goes: expert GEMMs, waiting, the rest.

    .venv/bin/python scripts/profile_moe_forward.py --hidden-size 384 \
        --moe-ffn-hidden-size 1024 --microbatches 4 --steps 24 --skip 8 \
        --policies megatron-dropless,lrmoe-uniform-g0.75,lrmoe-uniform-g0.75-ma \
        --out benchmarks/results/moe_forward_profile.md

Each policy trains the time-to-loss study's model (``scripts/time_to_loss.py``: the
same config, shape flags, policies and budget) for ``--steps`` steps, EP = 2 on 2 ranks
with one thread each, with wall-clock timers on

- the MoE layer's forward: the span the launcher's ``moe-forward-s`` times;
- the expert computation inside it: Megatron's experts module, LRMoE's
  ``experts_forward`` (both: the two expert GEMMs and the activation);
- every ``torch.distributed`` collective called inside it, split into the first of
  each call and the others.

A collective's time includes waiting for the peer. The first one of a call waits for
the other rank to *arrive* at the layer: the peer's non-MoE work or previous backward
took longer, which says nothing of the layer but lands in its span (and, since the
launcher takes the slowest rank per step, in ``moe-forward-s``). The later ones wait
for the peer's expert work (routing imbalance) or move data. "Rest" is the span less
all of these: router, planner, permutations, combine, Python.

Per policy and rank the table gives ms per step (sums over the step's calls), averaged
over the steps after ``--skip``, and the expert GEMM rate achieved in training (rows
per ms, and FLOP/s from the SwiGLU FLOPs per row 6 H F): the number to set against the
calibration's, which is measured with one process on the machine.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import time_to_loss  # noqa: E402  (the study's policies, base flags and budget)

# -----------------------------------------------------------------------------
# Inside each rank: timers, then the launcher
# -----------------------------------------------------------------------------

_COLLECTIVES = ("all_to_all_single", "all_to_all", "all_gather_into_tensor", "all_gather",
                "all_reduce", "reduce_scatter_tensor", "broadcast")


def _rank_entry(out_path: str, launcher_flags: list[str]) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core.transformer.moe import experts as megatron_experts
    from megatron.core.transformer.moe.moe_layer import MoELayer

    import megatron_lrmoe.lrmoe.region as region
    import megatron_lrmoe.pretrain as pretrain
    from megatron_lrmoe.lrmoe.moe_layer import LRMoELayer

    calls: list[dict] = []
    current: list[dict] = []          # the open training call (at most one)

    def layer_forward(fn):
        @functools.wraps(fn)
        def wrapper(self, *args, **kwargs):
            if current or not (self.training and torch.is_grad_enabled()):
                return fn(self, *args, **kwargs)
            call = {"layer": self.layer_number, "experts_s": 0.0, "rows": 0,
                    "first_collective_s": None, "other_collectives_s": 0.0}
            current.append(call)
            start = time.perf_counter()
            try:
                return fn(self, *args, **kwargs)
            finally:
                call["total_s"] = time.perf_counter() - start
                current.clear()
                calls.append(call)
        return wrapper

    def inside_call(fn, record):
        # Time fn; inside an open training call, hand (call, seconds, args) to record.
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if current:
                    record(current[0], time.perf_counter() - start, args)
        return wrapper

    def expert_compute(fn, rows_of):
        def record(call, seconds, args):
            call["experts_s"] += seconds
            call["rows"] += rows_of(args)
        return inside_call(fn, record)

    def collective(fn):
        def record(call, seconds, args):
            if call["first_collective_s"] is None:
                call["first_collective_s"] = seconds
            else:
                call["other_collectives_s"] += seconds
        return inside_call(fn, record)

    MoELayer.forward = layer_forward(MoELayer.forward)
    if "forward" in LRMoELayer.__dict__:
        LRMoELayer.forward = layer_forward(LRMoELayer.forward)
    # Megatron's experts modules: forward(self, permuted_hidden_states, tokens_per_expert, ...)
    for name in ("SequentialMLP", "GroupedMLP", "TEGroupedMLP"):
        cls = getattr(megatron_experts, name, None)
        if cls is not None and "forward" in cls.__dict__:
            cls.forward = expert_compute(cls.forward, lambda a: int(a[1].shape[0]))
    # The region's expert forward: experts_forward(x_exp [rows, H], ...)
    region.experts_forward = expert_compute(region.experts_forward,
                                            lambda a: int(a[0].shape[0]))
    for name in _COLLECTIVES:
        setattr(dist, name, collective(getattr(dist, name)))
    try:
        pretrain.main(launcher_flags)
    finally:
        rank = int(os.environ.get("RANK", "0"))
        Path(f"{out_path}.rank{rank}.json").write_text(json.dumps(calls))


# -----------------------------------------------------------------------------
# The driver: one torchrun per policy, then the table
# -----------------------------------------------------------------------------


def _ms_per_step(calls: list[dict], key: str, steps: float) -> float:
    return 1e3 * sum(c[key] or 0.0 for c in calls) / steps


def summarise(calls_per_rank: list[list[dict]], steps: int, skip: int, flops_per_row: float
              ) -> list[dict]:
    """Per rank: ms per step of each part over the steps after ``skip`` (every step has
    the same number of training calls), and the achieved expert rate."""
    out = []
    for rank, calls in enumerate(calls_per_rank):
        per_step = len(calls) // steps
        if per_step == 0 or len(calls) % steps:
            raise RuntimeError(f"rank {rank}: {len(calls)} training calls in {steps} steps")
        kept = calls[skip * per_step:]
        n = len(kept) / per_step

        total, experts = _ms_per_step(kept, "total_s", n), _ms_per_step(kept, "experts_s", n)
        first = _ms_per_step(kept, "first_collective_s", n)
        other = _ms_per_step(kept, "other_collectives_s", n)
        rows = sum(c["rows"] for c in kept)
        seconds = sum(c["experts_s"] for c in kept)
        out.append({"rank": rank, "calls_per_step": per_step, "total": total,
                    "experts": experts, "arrival_wait": first, "other_collectives": other,
                    "rest": total - experts - first - other,
                    "rows_per_step": rows / n,
                    "expert_gflops": flops_per_row * rows / seconds / 1e9 if seconds else 0.0,
                    "median_call_ms": 1e3 * statistics.median(c["total_s"] for c in kept)})
    return out


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] == "--rank-entry":
        _rank_entry(argv[1], argv[2:])
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--policies", default="megatron-dropless,lrmoe-uniform-g0.75")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--skip", type=int, default=8, help="steps left out of the averages")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--hidden-size", type=int, default=384)
    p.add_argument("--moe-ffn-hidden-size", type=int, default=1024)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--budget-replicas", type=float, default=2.0)
    p.add_argument("--data-path", default="data/stdlib")
    p.add_argument("--data-cache-path", default="data/cache")
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/profile_moe_forward"))
    p.add_argument("--out", type=Path, default=None, help="write the table here (markdown)")
    p.add_argument("--port", type=int, default=29561)
    args = p.parse_args(argv)
    if not 0 <= args.skip < args.steps:
        raise SystemExit(f"--skip {args.skip} must be in [0, --steps {args.steps})")
    warmup = int(time_to_loss._config_value("lr-warmup-iters"))
    if args.steps <= warmup:
        raise SystemExit(f"--steps {args.steps} must exceed the config's --lr-warmup-iters "
                         f"({warmup})")

    micro_batch = int(time_to_loss._config_value("micro-batch-size"))
    base = ["--config", "configs/time_to_loss.yaml",
            "--hidden-size", str(args.hidden_size),
            "--moe-ffn-hidden-size", str(args.moe_ffn_hidden_size),
            "--global-batch-size", str(micro_batch * 2 * args.microbatches),
            "--data-path", args.data_path, "--data-cache-path", args.data_cache_path,
            "--train-iters", str(args.steps), "--eval-interval", str(10 * args.steps),
            "--eval-iters", "1", "--log-interval", str(args.steps), "--no-progress-bar",
            "--seed", str(args.seed)]
    table = time_to_loss.policies(time_to_loss.study_budget_gb(base, args.budget_replicas))
    chosen = [name for name in args.policies.split(",") if name]
    if bad := [name for name in chosen if name not in table]:
        raise SystemExit(f"unknown policies {bad}; scripts/time_to_loss.py --list shows them")
    flops_per_row = 6.0 * args.hidden_size * args.moe_ffn_hidden_size
    args.work_dir.mkdir(parents=True, exist_ok=True)

    rows = []
    for name in chosen:
        prefix = args.work_dir / name
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                   "--master-port", str(args.port), str(Path(__file__).resolve()),
                   "--rank-entry", str(prefix), *base, *table[name],
                   "--log-json", f"{prefix}.jsonl"]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        with open(f"{prefix}.stdout", "w") as log:
            code = subprocess.call(command, cwd=ROOT, env=env, stdout=log,
                                   stderr=subprocess.STDOUT)
        if code != 0:
            raise SystemExit(f"{name} failed ({code}); see {prefix}.stdout")
        per_rank = [json.loads(Path(f"{prefix}.rank{r}.json").read_text()) for r in (0, 1)]
        logged = [json.loads(line) for line in Path(f"{prefix}.jsonl").read_text().splitlines()
                  if line.strip()]
        launcher = [r["moe-forward-s"] for r in logged
                    if "moe-forward-s" in r and r["iteration"] > args.skip]
        parts = summarise(per_rank, args.steps, args.skip, flops_per_row)
        rows.append((name, 1e3 * statistics.mean(launcher) if launcher else float("nan"),
                     parts))
        print(f"[profile] {name}: done", flush=True)

    from megatron_lrmoe.provenance import code_version

    lines = [
        "# The MoE forward in training: expert GEMMs, waiting, the rest (CPU, EP = 2)", "",
        "- command: `" + " ".join([".venv/bin/python", "scripts/profile_moe_forward.py",
                                   *argv]) + "`",
        f"- code: {code_version()}",
        f"- model: the time-to-loss study's, hidden {args.hidden_size}, expert FFN "
        f"{args.moe_ffn_hidden_size}, {args.microbatches} micro-batches per step, seed "
        f"{args.seed}; {args.steps} steps, the first {args.skip} left out; 2 ranks x 1 "
        "thread (gloo)",
        "- ms per step, mean over the steps kept, per rank; launcher: `moe-forward-s` "
        "(slowest rank per step), mean over the same steps; arrival wait: the first "
        "collective of each call (the peer arriving late at the layer); without wait: "
        "the slowest rank's span less its arrival wait; expert rate: rows x 6 H F / "
        "expert seconds",
        "",
        "| policy | launcher fwd | rank | span | experts | arrival wait | other collectives"
        " | rest | span without wait | rows / step | expert GFLOP/s | median call ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, launcher_ms, parts in rows:
        without = max(p["total"] - p["arrival_wait"] for p in parts)
        for p in parts:
            lines.append(
                f"| {name} | {launcher_ms:.1f} | {p['rank']} | {p['total']:.1f} | "
                f"{p['experts']:.1f} | {p['arrival_wait']:.1f} | {p['other_collectives']:.1f}"
                f" | {p['rest']:.1f} | {without:.1f} | {p['rows_per_step']:.0f} | "
                f"{p['expert_gflops']:.1f} | {p['median_call_ms']:.1f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
        print(f"written: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
