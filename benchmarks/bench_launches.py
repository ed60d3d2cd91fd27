"""Device ops per MoE layer call: LRMoE's layer beside Megatron's MoELayer, on fake CUDA.

Usage:
    python benchmarks/bench_launches.py --out benchmarks/results/bench_launches.md

Qwen3-30B-A3B's MoE layer (H 2048, F 768, E 128, top-8, bf16, 4096 tokens per rank) as
rank 3 of a fake EP group of 8, counts from the recorded routing trace
(workshop/lrmoe_testing/device_ops.py: what a device op is, how ops are attributed to
stages, and why Megatron's baseline is SequentialMLP). A count, not a timing: the table
does not depend on the machine's load. Runs the harness in its own process.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import torch

from megatron_lrmoe.tools.provenance import code_version

ROOT = Path(__file__).resolve().parents[1]

RANK = 3
CASES = (("Megatron MoELayer, SequentialMLP", "megatron:8:inf:uniform:0"),
         ("LRMoE gamma inf", "lrmoe:8:inf:uniform:0"),
         ("LRMoE gamma inf, replicas", "lrmoe:8:inf:uniform:1"),
         ("LRMoE gamma 0.75", "lrmoe:8:0.75:uniform:0"),
         ("LRMoE gamma 0.75, replicas", "lrmoe:8:0.75:uniform:1"))
STAGES = ("router", "plan", "dispatch", "select", "experts", "weight stack", "combine",
          "replicas", "statistics", "other")
PHASES = ("forward", "backward")


def measure() -> list[dict]:
    run = subprocess.run(
        [sys.executable, "-m", "lrmoe_testing.device_ops", str(RANK),
         *(spec for _, spec in CASES)],
        cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
        capture_output=True, text=True, timeout=900)
    if run.returncode != 0:
        raise SystemExit(run.stderr[-4000:])
    return json.loads(run.stdout)


def _device(record: dict, phase: str) -> int:
    return record["summary"][phase]["kinds"].get("device", 0)


def one_expert(record: dict, phase: str) -> int:
    """Megatron's count with its experts stage counted for one local expert."""
    experts = record["summary"][phase]["stages"].get("experts", 0)
    return _device(record, phase) - experts + experts // record["local_instances"]


def table(records: list[dict]) -> list[str]:
    megatron = records[0]
    base = {p: one_expert(megatron, p) for p in PHASES}
    lines = ["| layer | instances | forward | backward | total | x Megatron SequentialMLP "
             "| x Megatron, one expert's ops | collectives fwd/bwd | device-to-host fwd |",
             "|---|---|---|---|---|---|---|---|---|"]
    rows = [("Megatron, one expert's ops (grouped baseline)", None)] + list(
        zip((name for name, _ in CASES), records, strict=True))
    seq_total = sum(_device(megatron, p) for p in PHASES)
    for name, r in rows:
        if r is None:
            fwd, bwd = base["forward"], base["backward"]
            extra = ["16 (counted once)", "-", "-"]
        else:
            fwd, bwd = _device(r, "forward"), _device(r, "backward")
            kinds = [r["summary"][p]["kinds"] for p in PHASES]
            extra = [str(r["local_instances"]),
                     f"{kinds[0].get('collective', 0)}/{kinds[1].get('collective', 0)}",
                     str(kinds[0].get("to_host", 0))]
        total = fwd + bwd
        lines.append(f"| {name} | {extra[0]} | {fwd} | {bwd} | {total} | "
                     f"{total / seq_total:.2f} | {total / sum(base.values()):.2f} | "
                     f"{extra[1]} | {extra[2]} |")
    lines += ["", "Device ops by stage (forward / backward):", "",
              "| layer | " + " | ".join(STAGES) + " |", "|---|" + "---|" * len(STAGES)]
    for (name, _), r in zip(CASES, records, strict=True):
        cells = []
        for stage in STAGES:
            f, b = (r["summary"][p]["stages"].get(stage, 0) for p in PHASES)
            cells.append(f"{f} / {b}" if f or b else "-")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None, help="write the markdown table here")
    args = p.parse_args()
    records = measure()
    lines = table(records)
    command = shlex.join([Path(sys.executable).name, *sys.argv])
    head = [
        "# Device ops per MoE layer call (fake CUDA, Qwen3-30B-A3B MoE, EP 8, rank 3)", "",
        f"- command: `{command}`",
        f"- date: {datetime.now(UTC).isoformat(timespec='seconds')}",
        f"- machine: {platform.machine()}, torch {torch.__version__}, python "
        f"{platform.python_version()}; code: {code_version()}",
        "- H 2048, F 768 (SwiGLU), E 128, top-8, bf16, 4096 tokens per rank; counts from "
        "benchmarks/results/routing_traces/qwen3; one training call: forward, then the whole "
        "backward (router included) from the output to the input and parameters",
        "- device op: a dispatched op that writes device memory (workshop/lrmoe_testing/"
        "device_ops.py, op_kind); views, metadata and allocations excluded; collectives and "
        "device-to-host copies counted apart",
        "- Megatron: MoELayer from its local GPT spec, all-to-all dispatcher, SequentialMLP "
        "(megatron-core 0.19.2 builds no grouped-GEMM experts without Transformer Engine); "
        "its grouped baseline counts its experts stage for one of its 16 local experts",
        "- LRMoE: grouped GEMMs; 'weight stack' is the per-call torch.stack of the expert "
        "weights; replica rows: a step's first call (replica refresh in forward, replica "
        "gradients sent home in backward, one micro-batch per step)", ""]
    text = "\n".join(head + lines) + "\n"
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
