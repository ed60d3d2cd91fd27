"""The simulator against measured runs: replay each run's own routing, compare MoE times.

    # this machine, at the runs' shape (8 local experts, 16 experts top-2, 1024 tokens)
    .venv/bin/python -m megatron_lrmoe.tools.calibrate --hidden-size 384 --ffn-hidden-size 1024 \
        --rows 1024 --local-experts 8 --experts 16 --topk 2 --tokens 1024 --output /tmp/cpu.json
    .venv/bin/python benchmarks/studies/validate_simulator.py --calibration /tmp/cpu.json \
        benchmarks/results/time_to_loss/validate --out benchmarks/results/simulator_validation.md

For every finished run under the study directories given (``runs/<policy>-s<seed>/``
with ``done.json``, ``log.jsonl`` and the ``routing/`` trace the time-to-loss driver
records), the run's own flags (from its command in ``done.json``) give the model shape,
the micro-batches per step, the recompute and the policy (a run held to a device gets the
MoE budget its launcher resolved); ``megatron_lrmoe.tools.simulate.simulate`` replays
the run's recorded routing, as recorded (no resampling), through the planner and cost
model with this machine's calibration, at the run's EP size. Its per-step MoE forward
and backward times (all MoE layers and micro-batches of a step, replica refresh with
the forward; a recomputed layer's forward again, in the phase the launcher's timer
counts it: forward under full recompute, backward under ``moe`` recompute) are set
beside the run's measured ones (the launcher's ``moe-forward-s`` /
``moe-backward-s``: slowest rank, medians over the steps after the first tenth). The
error per run is simulated / measured - 1; the target is within +-15%. A run that
several studies hold (the confirmation keeps the screen's seed-1 runs) is validated
once, as the first study given holds it. Below the runs, a table per policy: the median
error over its runs (seeds, corpora), its range, how many runs are within target, and
the median error of the backward-to-forward ratio: the runs were measured on different
days of a shared VM whose speed moves both phases alike (five calibrations of it spread
63-83 GFLOP/s), so a policy whose phases err apart is modelled wrong in structure, not
in the machine's speed.

The parts (per layer and micro-batch, ``CostModel.layer_time_parts``) are reported per
run: expert GEMM, memory-bound row work, all-to-all, router, fixed per call and, in
forward, the planner's host time. The planner runs only in the LRMoE layer (the
SYMI-style and LRMoE runs); the simulator measures its host time per call on this
machine, shown beside what the run logged (``lrmoe/planner-ms-per-call``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
from pathlib import Path

from lrmoe_studies.simulator_validation import distinct_runs, summary_table, validate_run
from megatron_lrmoe.planning.machine import MachineConstants
from megatron_lrmoe.tools.provenance import code_version
from megatron_lrmoe.tools.simulate import PART_NAMES


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("studies", nargs="+", type=Path, help="time-to-loss output directories")
    ap.add_argument("--calibration", type=Path, required=True,
                    help="this machine's constants (python -m megatron_lrmoe.tools.calibrate)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--budget-scale", type=float, default=1.0,
                    help="replay with each run's memory budget times this (a what-if: what "
                         "the planner places with more memory; the measured times stay "
                         "those of the run's own budget)")
    args = ap.parse_args(argv)
    # Every measured constant of the file; one it lacks (an old file) keeps the
    # MachineConstants default, which prices nothing (not the GPU preset's assumption).
    fields = {f.name: f.default for f in dataclasses.fields(MachineConstants)
              if f.name != "source" and f.default is not dataclasses.MISSING}
    calibration = fields | {k: v for k, v in json.loads(args.calibration.read_text()).items()
                            if k in fields or k in ("gemm_flops_per_s", "alltoall_bytes_per_s")}
    if not args.budget_scale > 0:
        raise SystemExit(f"--budget-scale {args.budget_scale}: must be > 0")
    runs = distinct_runs(args.studies)
    if not runs:
        raise SystemExit("no finished run with a routing trace under " +
                         ", ".join(map(str, args.studies)))
    rows = [validate_run(run, calibration, args.budget_scale) for run in runs]
    fwd_names = ", ".join(n for n in PART_NAMES)
    bwd_names = ", ".join(n for n in PART_NAMES if n != "planner")
    lines = ["| run | steps | fwd ms simulated / measured | error | bwd ms simulated / "
             f"measured | error | simulated parts ms (fwd {fwd_names} / bwd {bwd_names}; "
             "per layer and micro-batch) | planner ms per call simulated / logged | "
             "load max/mean | retained |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        p = r["parts"]
        fwd = ", ".join(f"{p.get(f'forward_{n}', 0.0) * 1e3:.2f}" for n in PART_NAMES)
        bwd = ", ".join(f"{p.get(f'backward_{n}', 0.0) * 1e3:.2f}" for n in PART_NAMES
                        if n != "planner")
        logged = r["planner_logged"]
        planner = (f"{p.get('forward_planner', 0.0) * 1e3:.2f} / "
                   + ("-" if logged is None else f"{logged * 1e3:.2f}"))
        lines.append(
            f"| {r['run']} | {r['steps']} | {r['fwd_sim'] * 1e3:.1f} / {r['fwd_meas'] * 1e3:.1f} "
            f"| {r['fwd_err']:+.1%} | {r['bwd_sim'] * 1e3:.1f} / {r['bwd_meas'] * 1e3:.1f} | "
            f"{r['bwd_err']:+.1%} | {fwd} / {bwd} | {planner} | {r['load']:.2f} | "
            f"{r['retained']:.3f} |")
    table = "\n".join(lines + ["", *summary_table(rows)])
    print(table)
    if args.out:
        command = " ".join(shlex.quote(a) for a in
                           [".venv/bin/python", "benchmarks/studies/validate_simulator.py",
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
