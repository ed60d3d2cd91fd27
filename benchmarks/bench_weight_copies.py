"""Expert weight bytes the grouped GEMMs copy per LRMoE layer call, on fake CUDA.

One LRMoELayer of Qwen3-30B-A3B's MoE shape (H 2048, 128 experts, top-8, F 768 SwiGLU,
4096 tokens per rank, bf16, grouped GEMMs) as rank 3 of a fake EP group of 8
(``lrmoe_testing.cuda_harness.run_weight_copy_case``), forward then backward; a
dispatch mode adds up the bytes every copy op (stack, cat, clone, copy_, ``.to``, ...)
writes from a tensor that aliases an expert weight's storage. One subprocess per way of
holding the experts (the fake process group is process-wide): as built (one buffer per
layer), under Megatron's DDP without and with the distributed optimizer, and with every
weight in a storage of its own (the layout every parameter had before the layer shared
one buffer: the grouped GEMMs stack the weights per call, as they all did then).

    .venv/bin/python benchmarks/bench_weight_copies.py \\
        --out benchmarks/results/bench_weight_copies.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from megatron_lrmoe.tools.provenance import code_version

ROOT = Path(__file__).resolve().parents[1]

WRAPS = {"separate": "weights in storages of their own (stacked per call)",
         "module": "as built: one buffer per layer",
         "ddp": "Megatron DDP",
         "distopt": "Megatron DDP + distributed optimizer"}
CASES = {"8:inf:uniform:0": "gamma inf, static", "8:0.75:uniform:1": "gamma 0.75, replicas"}
MB = 1e6


def measure(wrap: str, cases: list[str]) -> list[dict]:
    run = subprocess.run(
        [sys.executable, "-m", "lrmoe_testing.cuda_harness", "weights", "3", wrap,
         *cases], cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True, text=True, timeout=1200, check=False)
    if run.returncode:
        raise SystemExit(run.stderr[-4000:])
    return json.loads(run.stdout)


def markdown(rows: list[dict], command: str) -> str:
    lines = [
        "# Expert weight bytes copied per layer call (benchmarks/bench_weight_copies.py)",
        "",
        f"Command: `{command}`",
        "",
        f"Code: {code_version()}",
        "",
        f"Date {datetime.date.today().isoformat()}. Qwen3-30B-A3B's MoE layer, EP 8, rank 3 "
        "(16 home experts: 151.0 MB of bf16 weights), fake CUDA; bytes written by copy "
        "ops reading an expert weight's storage (``cuda_harness.WeightCopyCounter``), and the "
        "region's own count (``RegionStats.weight_bytes_copied``).",
        "",
        "| experts held | call | forward MB | backward MB | copy ops | region's count MB |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        ops = "; ".join(f"{phase}: {', '.join(names)}" for phase, names in r["ops"].items())
        lines.append(
            f"| {WRAPS[r['wrap']]} | {r['label']} | {r['bytes'].get('forward', 0) / MB:.1f} "
            f"| {r['bytes'].get('backward', 0) / MB:.1f} | {ops or 'none'} "
            f"| {r['weight_bytes_copied'] / MB:.1f} |")
    lines += [
        "",
        "With replicas the grouped GEMMs read homes and replicas as one [L, ...] tensor, "
        "so they stack both per call; the forward's `cat` is the replica refresh's send "
        "buffer (the home weights sent to the replica holders), once per step.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--out", type=Path, default=None, help="markdown output (default: print)")
    args = p.parse_args(argv)
    command = " ".join(shlex.quote(a) for a in [
        ".venv/bin/python", "benchmarks/bench_weight_copies.py",
        *(sys.argv[1:] if argv is None else argv)])
    rows = []
    for wrap in WRAPS:
        for case, record in zip(CASES, measure(wrap, list(CASES)), strict=True):
            rows.append({**record, "label": CASES[case]})
    text = markdown(rows, command)
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
