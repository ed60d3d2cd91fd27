"""Is the projections' window long enough? Each policy's MoE time and memory over a window
of counted steps and over twice as many, at one preset.

    .venv/bin/python benchmarks/studies/simulator_window.py \
        --preset qwen3-30b-a3b-16xh100 --windows 2 4 8 [--out FILE.md]

Per window n and policy (``projections.window_check``: the recipe configuration, the
preset's trace, the reserve held back, the planner's host time fixed): MoE s/step and
MoE GiB per rank over n steps after the warm-up and over 2n, and their relative change.
A window is long enough where no policy moves by ``projections.WINDOW_TOLERANCE`` (1%)
or more; ``projections.WINDOW_STEPS`` is the one the projections use (docs/simulate.md).
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

from lrmoe_studies import projections as P
from megatron_lrmoe.tools.provenance import code_version
from megatron_lrmoe.tools.simulate import WARMUP_STEPS


def table(rows: list[dict]) -> list[str]:
    out = ["| window | policy | MoE s/step | doubled | change | MoE GiB | doubled | change | "
           "within 1% |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['steps']} | {r['policy']} | cannot start: "
                       f"{r['error'].splitlines()[0][:60]} | | | | | | |")
            continue
        out.append(f"| {r['steps']} | {r['policy']} | {r['moe_s']:.4f} | "
                   f"{r['moe_s_doubled']:.4f} | {r['time_change']:+.2%} | {r['moe_gib']:.3f} | "
                   f"{r['moe_gib_doubled']:.3f} | {r['memory_change']:+.2%} | "
                   f"{'yes' if r['within'] else 'no'} |")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", choices=list(P.PRESETS), default=P.GOAL_PRESET)
    ap.add_argument("--windows", type=int, nargs="+", default=[2, 4, 8],
                    help="counted steps n, each compared with 2n")
    ap.add_argument("--policies", nargs="+", choices=list(P.POLICIES), default=list(P.POLICIES))
    ap.add_argument("--layers", type=int, default=P.TRACE_LAYERS, help="trace layers replayed")
    ap.add_argument("--skip-fraction", type=float, default=P.SKIP_FRACTION)
    ap.add_argument("--planner-ms", type=float, default=0.1,
                    help="the planner's host time per call, fixed (a measured one moves "
                         "with the machine, not with the window)")
    ap.add_argument("--reserve-gib", type=float, default=P.RESERVE_GIB)
    ap.add_argument("--out", type=Path, default=None, help="markdown report")
    a = ap.parse_args(argv)
    preset = P.PRESETS[a.preset]
    traces, source = P.preset_traces(preset, layers=a.layers, skip_fraction=a.skip_fraction)
    started = time.perf_counter()
    rows = [r for n in a.windows for r in P.window_check(
        preset, traces, n, tuple(a.policies), a.reserve_gib, a.planner_ms / 1e3,
        log=lambda line: print(line, file=sys.stderr, flush=True))]
    long_enough = [n for n in a.windows
                   if all(r.get("within", False) for r in rows if r["steps"] == n)]
    command = shlex.join(["python", "benchmarks/studies/simulator_window.py",
                          *(sys.argv[1:] if argv is None else argv)])
    text = "\n".join([
        f"# Simulator window at {preset.name}", "",
        f"- command: `{command}`", f"- code: {code_version(('megatron_lrmoe', 'configs'))}",
        f"- routing: {source}; {a.layers} layer(s); {WARMUP_STEPS} warm-up step(s) before "
        f"each window; planner host time {a.planner_ms:g} ms per call; reserve "
        f"{a.reserve_gib:g} GiB; each policy's recipe configuration",
        f"- long enough (every change below {P.WINDOW_TOLERANCE:.0%}): "
        + (", ".join(str(n) for n in long_enough) or "none of the windows tried")
        + f"; the projections use {P.WINDOW_STEPS}",
        f"- checked in {time.perf_counter() - started:.0f} s", "", *table(rows), ""])
    print(text)
    if a.out:
        a.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
