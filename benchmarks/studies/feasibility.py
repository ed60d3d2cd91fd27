"""Which configurations fit a device: the feasibility table the memory study starts from.

    .venv/bin/python benchmarks/studies/feasibility.py   # -> benchmarks/results/feasibility/
    # from a git worktree: PYTHONPATH=. so that the package measured is the worktree's

For the time-to-loss study's GEMM-bound shape (hidden 384, expert FFN 1024, 4
micro-batches per step, EP 2), from one measured dropless run of it (its flags, its
recorded routing and its time outside the MoE layers), every policy's candidate
configurations (``lrmoe_studies.fitting``: Megatron's means) are predicted at two
device sizes chosen from the same predictions:

* D1: the dropless hot rank's MoE peak exceeds the MoE share the device leaves by 15%;
* D2: the smallest device LRMoE's default (uniform, gamma 1.0, no replicas) fits, +3%.

Per device: the per-rank account of every candidate, whether it fits, the predicted MoE
and total seconds per step, the two best-predicted fitting configurations of each
baseline (what the study measures), and the largest micro-batch each policy fits. All
numbers are predictions of the cost model and the memory account; nothing is timed here.

``--rule binding`` (the EP 8 / EP 16 study, micro-batch pinned at 1): one device D per
reference run (``--run``, repeatable; the EP regime's recordings serve), where memory
binds as it does on GPUs: LRMoE's defaults (uniform, gamma 1.0, with and without
memory-aware placement) fit as they are, dropless fits only by recompute and SYMI-style
only by recompute or fewer replicas (``fitting.binding_conditions``). D is chosen as D2
is (the LRMoE defaults' larger need + 3%); where the conditions do not all hold there,
the nearest D of the interval where the predicted needs say they do
(``fitting.binding_interval``), predicted again to check. Each run's ranks: its own
(``--world-size`` overrides).

    PYTHONPATH=. .venv/bin/python benchmarks/studies/feasibility.py --rule binding \
        --steps 20 --run benchmarks/results/ep_regime/ep8 \
        --run benchmarks/results/ep_regime/ep16 \
        --calibration benchmarks/results/calibration_cpu_ep_study.json \
        --out benchmarks/results/feasibility_ep_study
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
from pathlib import Path

from lrmoe_studies import fitting as F
from lrmoe_studies.simulator_validation import reference_flags
from lrmoe_studies.time_to_loss_policies import world_size
from megatron_lrmoe.planning.memory_account import GIB
from megatron_lrmoe.tools.provenance import code_version

ROOT = Path(__file__).resolve().parents[2]

REFERENCE_RUN = "benchmarks/results/time_to_loss/h384_f1024_mb4/confirm/runs/megatron-dropless-s1"
CALIBRATION = "benchmarks/results/calibration_cpu_h384_f1024.json"
BASELINES = {
    "megatron-dropless": [],
    "megatron-capacity-1.0": ["--moe-expert-capacity-factor", "1.0"],
    "symi": ["--moe-lrmoe", "--moe-lrmoe-placement", "popularity",
             "--moe-lrmoe-bwd-capacity-factor", "inf", "--moe-lrmoe-memory-budget-gb", "auto"],
}
LRMOE = {
    "lrmoe-uniform-g1.0": ["--moe-lrmoe", "--moe-lrmoe-memory-budget-gb", "auto"],
    "lrmoe-uniform-g1.0-ma": ["--moe-lrmoe", "--moe-lrmoe-placement", "memory-aware",
                              "--moe-lrmoe-memory-budget-gb", "auto"],
}


def _absolute(path: str) -> Path:
    return Path(path).resolve()


def _shown(path: Path) -> str:
    """``path`` as the report names it: relative to the checkout where it lies inside."""
    return str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # Resolved before the chdir to the checkout below, so paths relative to the caller work.
    ap.add_argument("--run", type=_absolute, action="append",
                    help="a measured dropless run of the study's model: its flags, routing "
                         "and time outside the MoE layers (a time-to-loss run or an EP "
                         f"regime recording; default {REFERENCE_RUN}); repeatable with "
                         "--rule binding")
    ap.add_argument("--calibration", type=_absolute, default=ROOT / CALIBRATION)
    ap.add_argument("--steps", type=int, default=40, help="optimizer steps replayed per layer")
    ap.add_argument("--world-size", type=int, default=None,
                    help="the study's ranks (default: each run's, EP x TP x PP of its flags)")
    ap.add_argument("--rule", choices=("d1-d2", "binding"), default="d1-d2",
                    help="d1-d2: the EP 2 study's two devices; binding: per run the device "
                         "where LRMoE fits as it is and the baselines only by their means")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "feasibility")
    a = ap.parse_args(argv)
    a.run = a.run or [ROOT / REFERENCE_RUN]
    os.chdir(ROOT)
    if a.rule == "binding":
        return binding(a)
    if len(a.run) != 1:
        raise SystemExit(f"--run given {len(a.run)} times: --rule d1-d2 takes one run")
    a.run = a.run[0]
    base = [*reference_flags(a.run), "--mock-data"]   # the data is not read
    ranks = a.world_size or world_size(base)
    traces, outside = F.reference_run(a.run)
    calibration = json.loads(a.calibration.read_text())
    args = F._parse(base, ranks)

    free = {name: F.predict(base, F.Candidate(name, F.NONE, tuple(flags)), 1024.0, traces,
                            calibration, outside, steps=a.steps, world_size=ranks)
            for name, flags in {**BASELINES, **LRMOE}.items()}
    outside_gib = free["megatron-dropless"].account.outside_moe / GIB
    d1, d2 = F.device_sizes(outside_gib, free["megatron-dropless"].account.moe / GIB,
                            free["lrmoe-uniform-g1.0"].need / GIB)
    rows, best, largest = [], {}, {}
    for label, device in (("D1", d1), ("D2", d2)):
        for name, flags in {**BASELINES, **LRMOE}.items():
            preds = F.policy_predictions(base, name, flags, name in BASELINES, device,
                                         traces, calibration, outside, steps=a.steps,
                                         world_size=ranks)
            rows += [(device, p) for p in preds]
            best[(label, name)] = F.best_fitting(preds)
            largest[(label, name)] = F.largest_micro_batch(base, name, flags, device, traces,
                                                           calibration, outside, limit=32,
                                                           world_size=ranks)
    command = shlex.join([sys.executable, *sys.argv]).replace(str(ROOT) + "/", "")
    lines = [
        "# Feasibility at two device sizes (predicted, nothing timed)", "",
        f"Command: `{command}`  ", f"Code: {code_version()}  ",
        f"Reference run: `{_shown(a.run)}` (flags, routing, time outside the MoE "
        f"layers {outside.seconds:.3f} s/step); calibration `{_shown(a.calibration)}`; "
        f"{a.steps} steps replayed per layer.", "",
        f"Unconstrained (1024 GiB): outside the MoE layers {outside_gib * 1024:.1f} MiB; "
        + "; ".join(f"{n} MoE {p.account.moe / 2**20:.1f} MiB" for n, p in free.items()), "",
        f"D1 = {d1:.4f} GiB (dropless hot rank 15% over its MoE share), "
        f"D2 = {d2:.4f} GiB (LRMoE default's need + 3%).", "",
        F.feasibility_table(rows), "",
        "## The two best-predicted fitting configurations per policy", "",
        "| device | policy | fitted | MoE s/step | step s | need MiB |",
        "|---|---|---|---|---|---|"]
    for (label, name), preds in best.items():
        for p in preds or [None]:
            if p is None:
                lines.append(f"| {label} | {name} | nothing fits | - | - | - |")
                continue
            lines.append(f"| {label} | {name} | {p.candidate.fitted} | {p.moe_s:.3f} | "
                         f"{p.step_s:.3f} | {p.need / 2**20:.1f} |")
    lines += ["", "## Predicted ratios: LRMoE over the fastest fitted baseline (MoE time)", "",
              "| device | LRMoE | vs dropless | vs capacity drop | vs SYMI-style |",
              "|---|---|---|---|---|"]
    for label in ("D1", "D2"):
        for name in LRMOE:
            mine = best[(label, name)]
            if not mine:
                lines.append(f"| {label} | {name} | does not fit | - | - |")
                continue
            cells = []
            for ref in BASELINES:
                theirs = best[(label, ref)]
                cells.append(f"{mine[0].moe_s / min(p.moe_s for p in theirs):.2f}"
                             if theirs else "-")
            lines.append(f"| {label} | {name} | " + " | ".join(cells) + " |")
    lines += ["", "## Largest micro-batch that fits (micro-batches per step unchanged)", "",
              "| device | policy | micro-batch | tokens per rank | MoE ms per 1k tokens |",
              "|---|---|---|---|---|"]
    for (label, name), (m, p) in largest.items():
        if p is None:
            lines.append(f"| {label} | {name} | none fits | - | - |")
            continue
        tokens = m * args.seq_length
        dp = args.data_parallel_size
        per_step_tokens = tokens * args.num_microbatches * dp
        lines.append(f"| {label} | {name} | {m} | {tokens} | "
                     f"{1e6 * p.moe_s / per_step_tokens:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "report.md").write_text(text)
    (a.out / "report.json").write_text(json.dumps({
        "command": command, "code": code_version(), "d1_gib": d1, "d2_gib": d2,
        "rows": [{"device_gib": d, "policy": p.candidate.policy, "fitted": p.candidate.fitted,
                  "fits": p.fits, "need_bytes": p.need, "moe_s": p.moe_s, "step_s": p.step_s,
                  "error": p.error} for d, p in rows]}, indent=1))
    return 0


def binding_device(base: list[str], traces, outside, calibration: dict, steps: int,
                   ranks: int) -> dict:
    """One run's device for ``--rule binding`` and every prediction at it (module doc),
    its flags parsed for ``ranks`` ranks."""
    def at(device: float) -> dict[str, list[F.Prediction]]:
        slots = F.budget_slots(base, BASELINES["symi"], device, calibration, world_size=ranks)
        return {name: F.policy_predictions(base, name, flags, name in BASELINES, device,
                                           traces, calibration, outside, steps=steps,
                                           slots_max=slots, world_size=ranks)
                for name, flags in {**BASELINES, **LRMOE}.items()}

    def held(preds: dict[str, list[F.Prediction]]) -> dict[str, bool]:
        return F.binding_conditions([preds[n][0] for n in LRMOE], preds["megatron-dropless"],
                                    preds["symi"])

    free = {name: F.predict(base, F.Candidate(name, F.NONE, tuple(flags)), 1024.0, traces,
                            calibration, outside, steps=steps, world_size=ranks)
            for name, flags in {**BASELINES, **LRMOE}.items()}
    device = max(free[n].need for n in LRMOE) * 1.03 / GIB    # as D2: + 3%
    tried = []
    for _ in range(3):
        preds = at(device)
        conditions = held(preds)
        tried.append((device, conditions))
        if all(conditions.values()):
            break
        low, high = F.binding_interval([preds[n][0] for n in LRMOE],
                                       preds["megatron-dropless"], preds["symi"])
        if not low < high:
            break
        # The nearest device of [low, high), on a 1e-4 GiB grid inside it.
        grid = 1e-4 * GIB
        nearest = (math.ceil(low / grid) if device * GIB < low
                   else math.floor(high / grid) - (high % grid == 0)) * grid
        if not low <= nearest < high:
            break
        device = nearest / GIB
    return {"free": free, "device": device, "preds": preds, "tried": tried}


def binding(a: argparse.Namespace) -> int:
    """``--rule binding``: per run, its device and the predictions at it (module doc)."""
    calibration = json.loads(a.calibration.read_text())
    command = shlex.join([sys.executable, *sys.argv]).replace(str(ROOT) + "/", "")
    lines = ["# Feasibility where memory binds as on GPUs (predicted, nothing timed)", "",
             f"Command: `{command}`  ", f"Code: {code_version()}  ",
             f"Calibration `{_shown(a.calibration)}`; {a.steps} steps replayed per layer.",
             "", "Per run the device D where LRMoE's defaults fit as they are, dropless only "
             "by recompute and SYMI-style only by recompute or fewer replicas: first the "
             "LRMoE defaults' larger need + 3% (as D2), else the nearest device where the "
             "predicted needs say the conditions hold.", ""]
    report = {"command": command, "code": code_version(),
              "calibration": _shown(a.calibration), "runs": []}
    for run in a.run:
        base = [*reference_flags(run), "--mock-data"]    # the data is not read
        ranks = a.world_size or world_size(base)
        traces, outside = F.reference_run(run)
        found = binding_device(base, traces, outside, calibration, a.steps, ranks)
        free, device, preds = found["free"], found["device"], found["preds"]
        mib = 2**20
        lines += [f"## {_shown(run)}: {ranks} ranks, D = {device:.4f} GiB", "",
                  f"Flags `{shlex.join(base)}`; time outside the MoE layers "
                  f"{outside.seconds:.3f} s/step (measured).", "",
                  f"Unconstrained (1024 GiB): outside the MoE layers "
                  f"{free['megatron-dropless'].account.outside_moe / mib:.1f} MiB; "
                  + "; ".join(f"{n} MoE {p.account.moe / mib:.1f} MiB (need "
                              f"{p.need / mib:.1f})" for n, p in free.items()), ""]
        for d, conditions in found["tried"]:
            lines.append(f"- at {d:.4f} GiB: " + "; ".join(
                f"{k}: {'yes' if v else 'no'}" for k, v in conditions.items()))
        lines += ["", "| policy | fits as it is | fits by | need as it is MiB |",
                  "|---|---|---|---|"]
        for name, ps in preds.items():
            by = sorted({m for p in ps[1:] if p.fits for m in F.means_of(p.candidate.fitted)})
            lines.append(f"| {name} | {'yes' if ps[0].fits else 'no'} | "
                         f"{', '.join(by) or '-'} | {ps[0].need / mib:.1f} |")
        rows = [(device, p) for ps in preds.values() for p in ps]
        lines += ["", F.feasibility_table(rows), "",
                  "Two best-predicted fitting configurations per baseline (LRMoE as it is):",
                  "", "| policy | fitted | MoE s/step | step s | need MiB |",
                  "|---|---|---|---|---|"]
        best = {}
        for name, ps in preds.items():
            best[name] = F.best_fitting(ps) if name in BASELINES else [p for p in ps if p.fits]
            for p in best[name] or [None]:
                lines.append(f"| {name} | nothing fits | - | - | - |" if p is None else
                             f"| {name} | {p.candidate.fitted} | {p.moe_s:.3f} | "
                             f"{p.step_s:.3f} | {p.need / mib:.1f} |")
        lines.append("")
        report["runs"].append({
            "run": _shown(run), "world_size": ranks, "device_gib": device,
            "outside_s": outside.seconds,
            "tried": [{"device_gib": d, **c} for d, c in found["tried"]],
            "free": {n: {"need_bytes": p.need, "moe_bytes": p.account.moe, "moe_s": p.moe_s}
                     for n, p in free.items()},
            "best": {n: [p.candidate.fitted for p in ps] for n, ps in best.items()},
            "rows": [{"device_gib": d, "policy": p.candidate.policy,
                      "fitted": p.candidate.fitted, "fits": p.fits, "need_bytes": p.need,
                      "moe_s": p.moe_s, "step_s": p.step_s, "error": p.error}
                     for d, p in rows]})
    text = "\n".join(lines)
    print(text)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "report.md").write_text(text)
    (a.out / "report.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
