"""The MoE layer profile's bookkeeping: per-call records, ms per step of each part, and
what a calibration's GEMM rate tables give for the recorded rows.

``benchmarks/profile_moe_layer.py`` times a training run's MoE layers on every rank
(its docstring says what each span covers) and writes one record per training call
(``new_call``); the functions here turn those records into the table's figures. Pure:
records in, numbers out (the timers run only inside a training run).
"""

from __future__ import annotations

import statistics

from megatron_lrmoe.planning.machine import MachineConstants

PHASES = ("fwd", "bwd")


def new_call(layer: int) -> dict:
    """An empty record of one training call of MoE layer ``layer``: per phase its span
    (None until it closes), expert seconds, rows per instance of each expert
    computation, and the first and the other collectives' seconds."""
    call = {"layer": layer}
    for phase in PHASES:
        call.update({f"{phase}_total_s": None, f"{phase}_experts_s": 0.0,
                     f"{phase}_instance_rows": [], f"{phase}_first_collective_s": None,
                     f"{phase}_other_collectives_s": 0.0})
    return call


def _ms_per_step(calls: list[dict], key: str, steps: float) -> float:
    return 1e3 * sum(c[key] or 0.0 for c in calls) / steps


def table_gemm_seconds(instance_rows: list[list[int]], machine: MachineConstants,
                       flops_per_row: float, forward: bool) -> tuple[float, float]:
    """(instance by instance, spread evenly) seconds the calibration's rate tables give
    for expert computations with these rows per instance: the sum over instances of one
    instance's time at its rows (the cost model's, given a plan's instances); and L times
    the time at the computation's rows / L (L its instances; the cost model's without
    them)."""
    each = evenly = 0.0
    for rows in instance_rows:
        if not rows:
            continue
        each += float(machine.instance_gemm_seconds(rows, flops_per_row, forward).sum())
        evenly += len(rows) * float(machine.instance_gemm_seconds(
            sum(rows) / len(rows), flops_per_row, forward))
    return each, evenly


def summarise(calls_per_rank: list[list[dict]], steps: int, skip: int, flops_per_row: float,
              phase: str, machine: MachineConstants | None = None) -> list[dict]:
    """Per rank, for ``phase`` ("fwd" or "bwd"): ms per step of each part over the steps
    after ``skip`` (every step has the same number of training calls), the achieved
    expert rate (``flops_per_row`` FLOP per row) and, given the calibration's
    ``machine`` constants, the expert time its rate tables give for the same rows."""
    out = []
    for rank, calls in enumerate(calls_per_rank):
        per_step = len(calls) // steps
        if per_step == 0 or len(calls) % steps:
            raise RuntimeError(f"rank {rank}: {len(calls)} training calls in {steps} steps")
        kept = calls[skip * per_step:]
        if any(c[f"{phase}_total_s"] is None for c in kept):
            raise RuntimeError(f"rank {rank}: a training call without its {phase} span")
        n = len(kept) / per_step
        total = _ms_per_step(kept, f"{phase}_total_s", n)
        experts = _ms_per_step(kept, f"{phase}_experts_s", n)
        first = _ms_per_step(kept, f"{phase}_first_collective_s", n)
        other = _ms_per_step(kept, f"{phase}_other_collectives_s", n)
        instance_rows = [rows for c in kept for rows in c[f"{phase}_instance_rows"]]
        rows = sum(sum(r) for r in instance_rows)
        seconds = sum(c[f"{phase}_experts_s"] for c in kept)
        row = {"rank": rank, "calls_per_step": per_step, "total": total,
               "experts": experts, "arrival_wait": first, "other_collectives": other,
               "rest": total - experts - first - other, "rows_per_step": rows / n,
               "expert_gflops": flops_per_row * rows / seconds / 1e9 if seconds else 0.0,
               "median_call_ms": 1e3 * statistics.median(c[f"{phase}_total_s"] for c in kept)}
        if machine is not None:
            each, evenly = table_gemm_seconds(instance_rows, machine, flops_per_row,
                                              phase == "fwd")
            row["table_each"], row["table_even"] = 1e3 * each / n, 1e3 * evenly / n
        out.append(row)
    return out
