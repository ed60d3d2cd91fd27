"""A full model with context parallelism on two GPUs: Qwen3-30B-A3B's Bridge recipe, shrunk.

Megatron's local attention refuses CP > 1, so a full model with CP trains only with
Transformer Engine's attention (and NCCL wants one rank per GPU): this runs where
scripts/gpu_check.sh finds two GPUs and TE (its step ``cp``), not on CPU. The MoE layer
alone is tested at EP 2 x CP 2 on CPU (tests/layer/test_context_parallel.py).

Three launches of the Bridge launcher (``python -m megatron_lrmoe.bridge_launcher --adapt``, under
torchrun, two ranks: CP 2 x EP 2, the recipe's bf16, 8 steps, mock data, the log every
step), then their losses compared (read from Bridge's log lines ``iteration N/ M | ...
lm loss: X |`` of the last rank):

* ``megatron``: ``--no-lrmoe``, Megatron's MoE layer in the same adapted recipe;
* ``inf``: LRMoE at gamma = inf: every step's loss within ``RTOL_STEP`` of megatron's,
  the first within ``RTOL_FIRST`` (bf16 GEMMs of other kernels, not bitwise);
* ``drop``: LRMoE at gamma 0.5: pairs dropped (the ``[LRMoE]`` lines' retained fraction
  below 1), the first loss equal to inf's to its printed digits (the forward is exact,
  drops act in backward: docs/design.md, "Exactness"), every loss finite.

    python scripts/dev/context_parallel_check.py [--logs DIR]   # the three runs (2 GPUs),
                                                     # their logs kept in DIR/<launch>.log
    python scripts/dev/context_parallel_check.py --compare DIR  # the checks on kept logs
    python scripts/dev/context_parallel_check.py --dry-run      # the launcher's --dry-run
                                                     # of each config, in this process

Run with the repository on ``PYTHONPATH`` (scripts/gpu_check.sh sets it). Exit status 0
when every check passes, 1 when one fails, 2 when a launch fails. The HF config of the
recipe comes from the shipped fixtures (offline, ``lrmoe_testing/hf_cache.py``).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from lrmoe_testing.hf_cache import offline_hf_environment, prefilled_hf_cache

REPO = Path(__file__).resolve().parents[2]

STEPS = 8
RTOL_FIRST = 5e-3
RTOL_STEP = 5e-2
#: The shrunk recipe (after the test harness's ``SMALL`` width) at CP 2 x EP 2 on two ranks
#: (DP 1: the expert grid TP x CP x DP = 2 is EP 2 x expert-DP 1, so the EP group is the CP
#: group).
OVERRIDES: list[str] = [
    "model.num_layers=2", f"train.train_iters={STEPS}",
    f"scheduler.lr_decay_iters={STEPS}", "logger.log_interval=1",
    "model.tensor_model_parallel_size=1", "model.pipeline_model_parallel_size=1",
    "model.pipeline_model_parallel_layout=null", "model.sequence_parallel=false",
    "model.context_parallel_size=2", "model.expert_model_parallel_size=2",
    "model.expert_tensor_parallel_size=1",
]
#: Each launch: launcher flags and LRMoE overrides.
LAUNCHES: dict[str, tuple[list[str], list[str]]] = {
    "megatron": (["--no-lrmoe"], []),
    "inf": ([], ["model.moe_lrmoe_bwd_capacity_factor=inf"]),
    "drop": ([], ["model.moe_lrmoe_bwd_capacity_factor=0.5",
                  "model.moe_lrmoe_selection=sample"]),
}

_LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.* lm loss: ([0-9.eE+-]+|nan|inf) \|")
_RETAINED = re.compile(r"\[LRMoE\] iteration\s+\d+ \| retained ([0-9.]+)")


def launcher_argv(name: str) -> list[str]:
    """The Bridge launcher's arguments of launch ``name``."""
    # The harness imports torch: not where only logs are compared (--compare).
    from lrmoe_testing.bridge import QWEN3_30B_A3B_8GPU, SMALL

    flags, lrmoe = LAUNCHES[name]
    return ["--recipe", QWEN3_30B_A3B_8GPU, "--adapt", *flags, *SMALL, *OVERRIDES, *lrmoe]


def losses(log: str) -> dict[int, float]:
    """Iteration -> lm loss, from Bridge's training log lines."""
    return {int(m.group(1)): float(m.group(2)) for m in _LOSS.finditer(log)}


def retained(log: str) -> list[float]:
    """The retained fractions of the ``[LRMoE]`` log lines."""
    return [float(m.group(1)) for m in _RETAINED.finditer(log)]


def compare(logs: dict[str, str]) -> list[str]:
    """The failed checks (empty when all pass), from the three launches' logs."""
    runs = {name: losses(log) for name, log in logs.items()}
    failed = [f"{name}: {len(run)} logged losses, expected {STEPS}"
              for name, run in runs.items() if sorted(run) != list(range(1, STEPS + 1))]
    if failed:
        return failed
    megatron, inf, drop = runs["megatron"], runs["inf"], runs["drop"]
    for step in range(1, STEPS + 1):
        rtol = RTOL_FIRST if step == 1 else RTOL_STEP
        if not math.isclose(inf[step], megatron[step], rel_tol=rtol):
            failed.append(f"step {step}: LRMoE at gamma inf {inf[step]:.6e}, Megatron's layer "
                          f"{megatron[step]:.6e} (rtol {rtol})")
    if drop[1] != inf[1]:
        failed.append(f"step 1: gamma 0.5 {drop[1]:.6e}, gamma inf {inf[1]:.6e}: the forward "
                      "is exact, the first loss must not change")
    if not all(math.isfinite(v) for v in drop.values()):
        failed.append(f"gamma 0.5: a loss is not finite: {drop}")
    kept = retained(logs["drop"])
    if not kept or min(kept) >= 1.0:
        failed.append(f"gamma 0.5 dropped no pair (retained fractions {kept})")
    return failed


def _run(name: str, env: dict[str, str], nproc: int) -> str:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", "-m", "megatron_lrmoe.bridge_launcher",
               *launcher_argv(name)]
    print(f"$ {' '.join(command)}", flush=True)
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    sys.stdout.write(done.stdout[-4000:])
    sys.stderr.write(done.stderr[-4000:])
    if done.returncode != 0:
        raise RuntimeError(f"launch {name} exited with {done.returncode}")
    return done.stdout


def _report(logs: dict[str, str]) -> int:
    failed = compare(logs)
    for line in failed:
        print(f"FAILED: {line}")
    print(f"context_parallel_check: {len(failed)} failure(s); losses "
          + "; ".join(f"{name} {losses(log)}" for name, log in logs.items()))
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true",
                      help="the launcher's --dry-run of each launch, in this process")
    mode.add_argument("--compare", metavar="DIR", default=None,
                      help="only the checks, on the logs DIR/<launch>.log of earlier runs")
    parser.add_argument("--logs", metavar="DIR", default=None,
                        help="keep each launch's output in DIR/<launch>.log")
    parser.add_argument("--nproc", type=int, default=2, help="ranks (GPUs); CP 2 x EP 2")
    args = parser.parse_args(argv)
    if args.compare is not None:
        return _report({name: (Path(args.compare) / f"{name}.log").read_text()
                        for name in LAUNCHES})
    cache = prefilled_hf_cache(tempfile.mkdtemp(prefix="lrmoe-hf-cache-"))
    env = {**os.environ, **offline_hf_environment(cache), "PYTHONUNBUFFERED": "1"}
    if args.dry_run:
        # huggingface_hub reads the variables at import: set before the launcher imports it.
        os.environ.update(offline_hf_environment(cache))
        from megatron_lrmoe.bridge_launcher.cli import main as launcher

        codes = {name: launcher([*launcher_argv(name), "--dry-run"]) for name in LAUNCHES}
        print(f"dry runs: {codes}")
        return 0 if not any(codes.values()) else 2
    try:
        logs = {name: _run(name, env, args.nproc) for name in LAUNCHES}
    except RuntimeError as exc:
        print(f"context_parallel_check: {exc}", file=sys.stderr)
        return 2
    if args.logs is not None:
        Path(args.logs).mkdir(parents=True, exist_ok=True)
        for name, log in logs.items():
            (Path(args.logs) / f"{name}.log").write_text(log)
    return _report(logs)


if __name__ == "__main__":
    raise SystemExit(main())
