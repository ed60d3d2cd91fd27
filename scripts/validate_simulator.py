"""The simulator against measured runs: replay each run's own routing, compare MoE times.

    .venv/bin/python -m megatron_lrmoe.calibrate --output /tmp/cpu.json   # this machine
    .venv/bin/python scripts/validate_simulator.py --calibration /tmp/cpu.json \
        benchmarks/results/time_to_loss/validate --out benchmarks/results/simulator_validation.md

For every finished run under the study directories given (``runs/<policy>-s<seed>/``
with ``done.json``, ``log.jsonl`` and the ``routing/`` trace the time-to-loss driver
records), the run's own flags (from its command in ``done.json``) give the model shape,
the micro-batches per step and the policy; ``megatron_lrmoe.simulate.simulate`` replays
the run's recorded routing, as recorded (no resampling), through the planner and cost
model with this machine's calibration, at the run's EP size. Its per-step MoE forward
and backward times (all MoE layers and micro-batches of a step, replica refresh with
the forward) are set beside the run's measured ones (the launcher's ``moe-forward-s`` /
``moe-backward-s``: slowest rank, medians over the steps after the first tenth). The
error per policy is simulated / measured - 1; the target is within +-15%.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_lrmoe.provenance import code_version  # noqa: E402
from megatron_lrmoe.routing_trace import read_routing_trace  # noqa: E402
from megatron_lrmoe.simulate import CLUSTERS, ModelSpec, Policy, simulate  # noqa: E402


def run_flags(done: Path) -> list[str]:
    """The launcher flags of a finished run (after ``-m megatron_lrmoe.pretrain``)."""
    command = shlex.split(json.loads(done.read_text())["command"])
    return command[command.index("megatron_lrmoe.pretrain") + 1:]


def run_setting(flags: list[str]) -> tuple:
    """(``MoEShape`` of a layer, ``Policy``, budget GiB or None, EP size) of a run's
    flags."""
    import os

    from megatron_lrmoe.arguments import parse_args
    from megatron_lrmoe.lrmoe.planner_config import moe_shape
    from megatron_lrmoe.training.builders import transformer_config_from_args

    os.environ.setdefault("WORLD_SIZE", "2")
    args = parse_args([f for f in flags if f != "--no-progress-bar"] + ["--no-progress-bar"])
    config = transformer_config_from_args(args)
    data_parallel = int(os.environ["WORLD_SIZE"]) // args.pipeline_model_parallel_size
    shape = moe_shape(config, args.micro_batch_size * args.seq_length,
                      args.global_batch_size // (args.micro_batch_size * data_parallel))
    if args.moe_lrmoe:
        policy = Policy("lrmoe", placement=args.moe_lrmoe_placement,
                        capacity_factor=args.moe_lrmoe_bwd_capacity_factor,
                        budget=args.moe_lrmoe_memory_budget_gb is not None)
    else:
        policy = Policy("megatron", forward_capacity_factor=args.moe_expert_capacity_factor)
    return shape, policy, args.moe_lrmoe_memory_budget_gb, args.expert_model_parallel_size


def measured(log: Path) -> tuple[float, float, int]:
    """(forward s, backward s) per step, medians after the first tenth; steps used."""
    rows = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    train = [r for r in rows if "moe-forward-s" in r]
    steady = train[len(train) // 10:] or train
    return (statistics.median(r["moe-forward-s"] for r in steady),
            statistics.median(r["moe-backward-s"] for r in steady), len(steady))


def validate_run(run: Path, calibration: dict) -> dict:
    flags = run_flags(run / "done.json")
    shape, policy, budget_gib, ep = run_setting(flags)
    trace = read_routing_trace(run / "routing")
    skip = len(trace.iterations) // 10
    traces = [trace.layer(n)[skip:] for n in trace.layers]
    steps = max(1, (len(trace.iterations) - skip))
    model = ModelSpec(run.name, shape.num_layers, shape.hidden_size, shape.ffn_hidden_size,
                      shape.num_experts, shape.topk, shape.gated, shape.tokens_per_rank, 1,
                      shape.microbatches_per_step * ep)
    [result] = simulate(model, CLUSTERS["h100"], ep, traces, policies=(policy,), steps=steps,
                        budget_gib=budget_gib, calibration=calibration, shape=shape,
                        resample=False)
    # The replica sync splits into the refresh (weights, in forward) and the gradient
    # reduction (in the last backward), in proportion to their bytes.
    grad_bytes = shape.grad_dtype_bytes or shape.dtype_bytes
    refresh_share = shape.dtype_bytes / (shape.dtype_bytes + grad_bytes)
    sync = shape.num_layers * result.refresh_s_per_step
    per_step = shape.num_layers * shape.microbatches_per_step
    fwd_sim = per_step * result.forward_s + refresh_share * sync
    bwd_sim = per_step * result.backward_s + (1 - refresh_share) * sync
    fwd_meas, bwd_meas, used = measured(run / "log.jsonl")
    return {"run": run.name, "steps": used, "fwd_sim": fwd_sim, "fwd_meas": fwd_meas,
            "bwd_sim": bwd_sim, "bwd_meas": bwd_meas,
            "fwd_err": fwd_sim / fwd_meas - 1, "bwd_err": bwd_sim / bwd_meas - 1,
            "parts": result.parts, "load": result.load_max_over_mean,
            "retained": result.retained_fraction}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("studies", nargs="+", type=Path, help="time-to-loss output directories")
    ap.add_argument("--calibration", type=Path, required=True,
                    help="this machine's constants (python -m megatron_lrmoe.calibrate)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    calibration = {k: v for k, v in json.loads(args.calibration.read_text()).items()
                   if k in ("gemm_flops_per_s", "alltoall_bytes_per_s", "alltoall_latency_s")}
    runs = sorted(d.parent for study in args.studies for d in study.glob("runs/*/done.json")
                  if (d.parent / "routing" / "header.json").is_file())
    if not runs:
        raise SystemExit("no finished run with a routing trace under " +
                         ", ".join(map(str, args.studies)))
    rows = [validate_run(run, calibration) for run in runs]
    lines = ["| run | steps | fwd ms simulated / measured | error | bwd ms simulated / "
             "measured | error | simulated parts ms (fwd GEMM, a2a, fixed / bwd GEMM, a2a, "
             "fixed; per layer and micro-batch) | load max/mean | retained |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        p = {k: v * 1e3 for k, v in r["parts"].items()}
        lines.append(
            f"| {r['run']} | {r['steps']} | {r['fwd_sim'] * 1e3:.1f} / {r['fwd_meas'] * 1e3:.1f} "
            f"| {r['fwd_err']:+.0%} | {r['bwd_sim'] * 1e3:.1f} / {r['bwd_meas'] * 1e3:.1f} | "
            f"{r['bwd_err']:+.0%} | {p['forward_gemm']:.2f}, {p['forward_alltoall']:.2f}, "
            f"{p['forward_fixed']:.2f} / {p['backward_gemm']:.2f}, {p['backward_alltoall']:.2f}, "
            f"{p['backward_fixed']:.2f} | {r['load']:.2f} | {r['retained']:.3f} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        command = " ".join(shlex.quote(a) for a in
                           [".venv/bin/python", "scripts/validate_simulator.py",
                            *(sys.argv[1:] if argv is None else argv)])
        args.out.write_text("\n".join([
            "# Simulator against measured runs (CPU, EP = 2)", "",
            f"- command: `{command}`", f"- code: {code_version()}",
            f"- calibration: {json.loads(args.calibration.read_text())}", "",
            table, ""]))
        print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
