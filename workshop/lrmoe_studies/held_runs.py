"""Named policies held to a device, side by side: each trained once, at the configuration
its name pins, as the time-to-loss driver trains a run, without that study's dropless
reference, targets and fitting.

    .venv/bin/python benchmarks/studies/held_runs.py --config configs/ep_study.yaml --ep 16 \\
        --train-iters 60 --device-gib 0.0457 --out-dir DIR --policies \\
        lrmoe-uniform-ginf-ma,lrmoe-uniform-g1.0-ma,lrmoe-uniform-g0.5-ma,symi@recompute_full_2_+_slots_14

Names: a policy of ``time_to_loss_policies.policies``, then optionally ``@`` and a
configuration of the time-to-loss driver's fitting (``fitting.candidates``:
``recompute_moe``, ``recompute_full_N``, ``micro-batch_M``, ``slots_K``, two joined by
``_+_``), as the driver names its runs (``time_to_loss.fitted_name``). The driver picks a
configuration from predictions on its reference run's routing; here the name gives it.
A run's flags are the driver's for that name: the base flags, ``--seed``, the policy's
under the budget ``auto`` (``time_to_loss.on_device``) with the configuration's,
``--device-memory-gb``, ``--record-routing``.

Runs: ``time_to_loss.run_one``, one after another, each in ``DIR/runs/<name>-s<seed>/``:
``done.json`` (the exact command and the code), the log and stdout compressed, and the
routing record that ``python -m lrmoe_studies.simulator_counts`` and
``benchmarks/studies/simulator_memory.py`` replay. A run with ``done.json`` is not
repeated (rerun the command to rewrite the report); a run the device hold stopped is
recorded as the driver records it.

The table (``DIR/report.md``, ``report.json``), one row per run; steady steps: those past
the run's first tenth, as ``time_to_loss.analyse_run`` takes them:

- replicas per layer: each layer's ``lrmoe/layer<N>/replicas`` (the replicas of a log
  interval's last call), the median over the log intervals past the first;
- predicted step peak: the most ``memory-predicted-peak-gib`` over all steps, the
  launcher's model of the hottest rank's step (the memory account outside the MoE layers
  plus the planners' MoE bytes), against the device, beside the MoE budget the run
  planned with (its stdout). On CPU nothing measures a run's own peak;
  ``simulator_memory`` measures the layer on the run's recorded calls;
- hot rank's load: pairs received per rank, max/mean, of each log interval's median call
  (the worst layer), the median over the intervals past the first; and the worst call;
- MoE seconds per step: the median over the steady steps of ``moe-forward-s`` +
  ``moe-backward-s`` (each the slowest rank's), and the median of each;
- the retained fraction (mean over the log intervals), the budget-adjusted calls (all),
  the seconds per step outside the MoE layers (median, steady steps).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import sys
import time
from pathlib import Path

from lrmoe_studies import time_to_loss as ttl
from lrmoe_studies.time_to_loss_policies import Policies, policies, world_size
from megatron_lrmoe.tools import run_log

__all__ = ["base_flags", "policy_flags", "run_flags", "summarize_run", "write_report"]

_BUDGET_LINE = re.compile(r"--moe-lrmoe-memory-budget-gb ([0-9.e+-]+):")
_REPLICAS = re.compile(r"lrmoe/layer(\d+)/replicas")


def base_flags(config: str, ep: int, train_iters: int, eval_interval: int,
               log_interval: int, data_path: str = "data/stdlib",
               data_cache_path: str = "data/cache") -> list[str]:
    """The flags every run shares, in the time-to-loss driver's order."""
    return ["--config", config, "--expert-model-parallel-size", str(ep),
            "--data-path", data_path, "--data-cache-path", data_cache_path,
            "--train-iters", str(train_iters), "--eval-interval", str(eval_interval),
            "--log-interval", str(log_interval), "--no-progress-bar"]


def policy_flags(name: str, base: list[str]) -> list[str]:
    """The flags of run ``name`` (the module doc) under the budget ``auto``, without the
    device. The flags are parsed as the runs' (``world_size``: one rank per
    expert-parallel rank of the base flags)."""
    from lrmoe_studies import fitting
    from megatron_lrmoe.launcher.arguments import parse_args

    policy = ttl.family(name)
    every = policies("auto")
    if policy not in every:
        raise SystemExit(f"{name}: unknown policy ({Policies.problem(policy)}); listed: "
                         f"{', '.join(every)}")
    flags = ttl.on_device(every[policy])
    wanted = ttl.fitted_of(name)
    if wanted == "none":
        return flags
    args = parse_args(base, world_size(base))
    slots_max = args.num_experts + 1 if policy == "symi" else None
    found = {c.fitted: c for c in fitting.candidates(policy, flags, args, slots_max=slots_max,
                                                     combine=True)}
    if wanted not in found:
        raise SystemExit(f"{name}: {wanted!r} is not a configuration of {policy}; those are: "
                         + ", ".join(ttl.fitted_name(policy, f) for f in found))
    return list(found[wanted].flags)


def run_flags(name: str, base: list[str], seed: int, device_gib: float, run_dir: Path,
              record_routing: bool = True) -> list[str]:
    """The launcher flags of run ``name`` in ``run_dir`` (the driver's order)."""
    record = ["--record-routing", str(run_dir / "routing")] if record_routing else []
    return [*base, "--seed", str(seed), *policy_flags(name, base),
            "--device-memory-gb", f"{device_gib:g}", *record]


def summarize_run(records: list[dict], stdout: str) -> dict:
    """A run's row (the module doc) from its log records and its stdout."""
    train = [r for r in records if "moe-forward-s" in r]
    steady = train[len(train) // 10:] or train
    last = max((r["iteration"] for r in records), default=0)
    analysed = ttl.analyse_run(records, {}, last, 1)
    lrmoe = [r for r in records if "lrmoe/retained-fraction" in r]
    intervals = lrmoe[1:] or lrmoe
    layers = sorted({int(m.group(1)) for r in lrmoe for k in r
                     if (m := _REPLICAS.fullmatch(k))})
    peaks = [r["memory-predicted-peak-gib"] for r in records
             if "memory-predicted-peak-gib" in r]
    budget = _BUDGET_LINE.search(stdout)
    return {
        "steps": len(train),
        "steady_from": steady[0]["iteration"] if steady else None,
        "replicas_per_layer": [statistics.median(r[f"lrmoe/layer{n}/replicas"]
                                                 for r in intervals) for n in layers],
        "predicted_peak_gib": max(peaks) if peaks else None,
        "moe_budget_gib": float(budget.group(1)) if budget else None,
        "load_max_over_mean": analysed["load_max_over_mean"],
        "load_worst": analysed["load_worst"],
        "moe_s_per_step": statistics.median(r["moe-forward-s"] + r["moe-backward-s"]
                                            for r in steady) if steady else None,
        "moe_fwd_ms": analysed["moe_fwd_ms"],
        "moe_bwd_ms": analysed["moe_bwd_ms"],
        "other_s_per_step": analysed["other_s_per_step"],
        "retained": analysed["retained"],
        "budget_adjusted_calls": sum(r.get("lrmoe/budget-adjusted-calls", 0.0) for r in lrmoe),
        "final_loss": train[-1]["lm-loss"] if train else None,
    }


COLUMNS = ("run", "replicas per layer", "predicted step peak GiB / device",
           "MoE budget GiB", "load max/mean median call / worst", "MoE s / step (CPU)",
           "MoE fwd/bwd ms (CPU)", "other s / step (CPU)", "retained",
           "budget-adjusted calls", "loss at end", "wall s")


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table_lines(rows: list[dict], device_gib: float) -> list[str]:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        if r.get("failed"):     # the launcher's stop, less its advice
            lines.append(f"| {r['run']} | stopped: {r['failed'].split('. To fit:')[0]} |"
                         + " - |" * (len(COLUMNS) - 2))
            continue
        lines.append("| " + " | ".join([
            r["run"], "/".join(f"{v:g}" for v in r["replicas_per_layer"]) or "-",
            f"{_fmt(r['predicted_peak_gib'], '.4f')} / {device_gib:g}",
            _fmt(r["moe_budget_gib"], ".4f"),
            f"{_fmt(r['load_max_over_mean'], '.3f')} / {_fmt(r['load_worst'], '.3f')}",
            _fmt(r["moe_s_per_step"], ".3f"),
            f"{_fmt(r['moe_fwd_ms'], '.1f')}/{_fmt(r['moe_bwd_ms'], '.1f')}",
            _fmt(r["other_s_per_step"], ".3f"), _fmt(r["retained"], ".3f"),
            f"{r['budget_adjusted_calls']:.0f}", _fmt(r["final_loss"], ".4f"),
            f"{r['wall_s']:.0f}"]) + " |")
    return lines


def write_report(out_dir: Path, names: list[str], seed: int, command: str,
                 base: list[str], device_gib: float) -> list[dict]:
    """Rows of the finished runs of ``names``; writes ``report.md`` and ``report.json``."""
    rows, codes, machine = [], set(), 0.0
    for name in names:
        run_dir = out_dir / "runs" / f"{name}-s{seed}"
        if not (run_dir / "done.json").exists():
            continue
        done = json.loads((run_dir / "done.json").read_text())
        codes.add(done.get("code", "not recorded"))
        machine += done["wall_s"]
        row = {"run": run_dir.name, "wall_s": done["wall_s"]}
        if done.get("failed"):
            rows.append(row | {"failed": done["failed"]})
            continue
        records = run_log.read_records(run_dir / "log.jsonl")
        rows.append(row | summarize_run(records, run_log.read_text(run_dir / "stdout.txt")))
    ranks = world_size(base)
    text = "\n".join([
        "# Policies held to a device, side by side", "",
        f"Command: `{command}`", "",
        f"Code of the runs: {'; '.join(sorted(codes)) or '-'}. Machine time of the runs "
        f"{machine / 60:.1f} min ({ranks} ranks x 1 thread on {os.cpu_count()} cores, gloo: "
        "CPU timings). Each run's exact command: its `done.json`.",
        f"Base flags: `{shlex.join(base)}`; seed {seed}; device {device_gib:g} GiB per rank "
        "(`--device-memory-gb`), LRMoE's and SYMI-style's budget `auto`.", "",
        *table_lines(rows, device_gib), "",
        "What each column is: `workshop/lrmoe_studies/held_runs.py`'s docstring. Steady steps "
        "(MoE and other seconds): those past each run's first tenth; replicas and load: the "
        "log intervals past the first. The step peak is the launcher's model (on CPU no "
        "allocator measures a run); the measured layer peaks are the memory comparison's.",
        ""])
    (out_dir / "report.md").write_text(text)
    (out_dir / "report.json").write_text(json.dumps(
        {"command": command, "base_flags": base, "seed": seed, "device_gib": device_gib,
         "codes": sorted(codes), "rows": rows}, indent=1))
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="benchmarks/studies/held_runs.py",
                                description=__doc__.split("\n", 1)[0])
    p.add_argument("--policies", required=True,
                   help="comma-separated run names: policy[@fitted configuration]")
    p.add_argument("--device-gib", type=float, required=True,
                   help="hold every run to a device of this many GiB per rank")
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--config", default="configs/ep_study.yaml",
                   help="the model config (relative to the repository root)")
    p.add_argument("--ep", type=int, required=True, help="expert-parallel size, one rank each")
    p.add_argument("--train-iters", type=int, required=True)
    p.add_argument("--eval-interval", type=int, default=None,
                   help="default: half of --train-iters")
    p.add_argument("--log-interval", type=int, default=10)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--data-path", default="data/stdlib")
    p.add_argument("--data-cache-path", default="data/cache")
    p.add_argument("--no-record-routing", action="store_true")
    p.add_argument("--port", type=int, default=29531)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    base = base_flags(args.config, args.ep, args.train_iters,
                      args.eval_interval or max(1, args.train_iters // 2), args.log_interval,
                      args.data_path, args.data_cache_path)
    names = [p for p in args.policies.split(",") if p]
    runs = {name: run_flags(name, base, args.seed, args.device_gib,
                            args.out_dir / "runs" / f"{name}-s{args.seed}",
                            not args.no_record_routing) for name in names}   # all, first
    command = shlex.join(["python", "benchmarks/studies/held_runs.py",
                          *(sys.argv[1:] if argv is None else argv)])
    for name, flags in runs.items():
        run_dir = args.out_dir / "runs" / f"{name}-s{args.seed}"
        started = time.perf_counter()
        ttl.run_one(run_dir, flags, args.port)
        print(f"[held_runs] {run_dir.name}: done ({time.perf_counter() - started:.0f} s)",
              flush=True)
    write_report(args.out_dir, names, args.seed, command, base, args.device_gib)
    print((args.out_dir / "report.md").read_text())
    return 0
