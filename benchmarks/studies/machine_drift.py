"""The machine's speed over a time-to-loss study's runs, from their logs.

    .venv/bin/python benchmarks/studies/machine_drift.py --block 25 \
        benchmarks/results/time_to_loss/h384_f1024_mb4/held_d1/screen \
        --out benchmarks/results/time_to_loss/h384_f1024_mb4/held_d1/drift.md

Per run (by name; the study's README says the order they ran in) and per block of
steps: the median step's seconds outside the MoE layers (the same model work for every
run of one micro-batch size and recompute setting, so it follows the machine's speed)
and the median MoE seconds per step. A jump in both inside one run, with nothing else on
the machine, is the machine, not the policy (docs/decisions.md, rounds).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from lrmoe_studies.time_to_loss import speed_blocks
from megatron_lrmoe.tools import run_log
from megatron_lrmoe.tools.provenance import code_version


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("studies", nargs="+", type=Path, help="study folders (with runs/*/)")
    p.add_argument("--block", type=int, default=25, help="steps per block")
    p.add_argument("--out", type=Path, default=None, help="write the tables here too")
    a = p.parse_args(argv)
    command = shlex.join(["python", "benchmarks/studies/machine_drift.py",
                          *(sys.argv[1:] if argv is None else argv)])
    lines = [f"Command: `{command}`", f"Code: {code_version()}", ""]
    for study in a.studies:
        logs = [run / "log.jsonl" for run in sorted((study / "runs").iterdir())]
        runs = {log.parent.name: speed_blocks(run_log.read_records(log), a.block)
                for log in logs if run_log.stored(log).is_file()}
        width = max((len(b) for b in runs.values()), default=0)
        lines += [f"## {study}", "",
                  f"Per block of {a.block} steps: other s / MoE s per step (medians).", "",
                  "| run | " + " | ".join(f"block {i + 1}" for i in range(width)) + " |",
                  "|" + "---|" * (width + 1)]
        for name, rows in runs.items():
            lines.append(f"| {name} | " + " | ".join(f"{o:.2f} / {m:.2f}" for _, o, m in rows)
                         + " |")
        lines.append("")
    text = "\n".join(lines)
    print(text)
    if a.out:
        a.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
