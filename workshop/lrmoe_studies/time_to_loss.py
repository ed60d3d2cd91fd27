"""Time to a fixed loss: Megatron dropless, Megatron capacity drop, SYMI-style, LRMoE.

    bash benchmarks/studies/time_to_loss.sh                        # the screen (one seed)
    bash benchmarks/studies/time_to_loss.sh --stage confirm --policies lrmoe-uniform-g1,...
    bash benchmarks/studies/time_to_loss.sh --stage ci --out-dir /tmp/ttl   # a few minutes
    bash benchmarks/studies/time_to_loss.sh --stage curve --config configs/ep_study.yaml \
        --ep 8 --policies lrmoe-uniform-g0.6-ma      # one point of the curve (3 seeds)

(``benchmarks/studies/time_to_loss.sh`` prepares the corpora, then runs ``main`` here
through ``benchmarks/studies/time_to_loss.py``; the policies and the study's model config:
``lrmoe_studies.time_to_loss_policies``.)

Every policy trains the same model (configs/time_to_loss.yaml) on the demo corpus
(the CPython stdlib, prepared by the project's own tool) with the same seed and so
the same data order, EP=2 on 2 ranks with one thread each (torchrun, gloo), for
1.5 x ``--steps`` steps. Another model config and expert-parallel size: ``--config``
(e.g. configs/ep_study.yaml, Qwen3-30B-A3B's routing at small widths) and ``--ep N``
(N ranks, one per expert-parallel rank; default: the config's
``expert-model-parallel-size``). The dropless run of each seed defines that seed's targets:
its smoothed training loss at 50%, 75% and 100% of ``--steps``. For every run the
report gives the steps and the cumulative measured MoE-layer time (forward +
backward, the sum of the launcher's per-step ``moe-forward-s`` and ``moe-backward-s``:
slowest rank per stage) at which its smoothed loss first reaches each target, the
validation loss at equal tokens (the last evaluation at or before ``--steps``) and at
the end, the retained fraction and the backward bytes saved, and the step's seconds
outside the MoE layers ("other s / step": the same work for every run of one
micro-batch size and recompute setting, so a machine whose speed drifts shows there).

The curve (``--stage curve``): steps to the 100% target against the measured
retained fraction, per selection rule (``CURVE_POLICIES``: uniform and router-probability
sampling, memory-aware, gammas ``CURVE_GAMMAS``), seeds 1-3, every run paired with its
seed's dropless run; runs train 2 x ``--steps`` (200), so that "not reached by 2 x
dropless's steps" is decided inside every run; their logs keep only what the reports read
(``CURVE_LOG_KEYS``) and no routing is recorded. The report adds the curve's points and
pairing table (``lrmoe_studies.time_to_loss_curve``). ``--stage curve-ci``: the
same rules at the CI shape, two 5-step policies.

Rounds (``--rounds K``): each seed's runs train K equal segments in turn, every run
resumed from its checkpoint (the launcher's bitwise resume), the order reversed in every
other round, so that drift in the machine's speed reaches every run alike instead of the
runs that happened to train while it was slow. The losses are those of one
uninterrupted run; each restart adds one first step's costs to the run's MoE time.

Smoothing: the trailing mean of the per-step training loss over ``--steps / 8``
steps (at least 1): per-step losses of a small model on varied batches are noisy, and
a shorter window made the 100% target easier to reach than the 75% one. A target
counts as reached at the first step whose smoothed loss is at or below it.

Held to a device (``--device-gib D --unconstrained-dir U``): every run gets
``--device-memory-gb D`` (the launcher stops a step over it, out of memory); the
baselines run as their two best-predicted fitting configurations (``fitted_policies``,
``lrmoe_studies.fitting``: ``policy@fitted``), the LRMoE policies under the budget
``auto``; U's dropless runs set the targets (beside them: the validation loss of U's
dropless run at ``--steps``) and its rows stay in the report; ratios are to the seed's
fastest fitted run of dropless and of SYMI-style, at the 100% training target and at the
validation target, with the total step seconds beside the MoE seconds. The screen
measures both fitted configurations; the confirmation names the faster one of each
baseline (``--policies symi@micro-batch_2_+_slots_10,...``) and runs only it.

Runs are resumable: each finishes by writing ``runs/<policy>-s<seed>/done.json``, and
a run with that file is never repeated; a finished run's log and stdout are then stored
compressed (``log.jsonl.xz``, ``stdout.txt.xz``, ``megatron_lrmoe.tools.run_log``) and its
routing record repacked
(``routing_traces.repack``); the report (``report.md``, ``report.json``,
``loss_vs_moe_time.png``, and the run report ``report/*.png`` of
``megatron_lrmoe.tools.report``) is rewritten after every finished run, so a study can span
several sessions. The exact command of every run is in its ``done.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from lrmoe_studies import time_to_loss_curve
from lrmoe_studies.simulator_validation import recorded_defaults
from lrmoe_studies.time_to_loss_policies import (
    LRMOE_NAME,
    REFERENCE,
    STUDY_CONFIG,
    Policies,
    flag_or_config,
    policies,
    study_budget_gb,
    world_size,
)
from megatron_lrmoe.config.flags import ConfigError
from megatron_lrmoe.launcher.arguments import parse_args as parse_run_flags
from megatron_lrmoe.tools import run_log
from megatron_lrmoe.tools.figures import pyplot, save_png

ROOT = Path(__file__).resolve().parents[2]
CALIBRATION = "benchmarks/results/calibration_cpu_h384_f1024.json"
"""The CPU machine constants the fitted configurations are predicted with."""
TARGET_FRACTIONS = (0.5, 0.75, 1.0)
OOM_LINE = "error: out of memory at step"
"""How the launcher's out-of-memory stop of a run held to its device starts."""
CHECKPOINT = "checkpoint"
"""A run's checkpoint between rounds (``--rounds``), removed when the run finishes."""
UNCONSTRAINED = "unconstrained/"
"""Prefix of the rows of a device-held study's unconstrained runs (kept for comparison)."""


# -----------------------------------------------------------------------------
# Running
# -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Stage:
    steps: int                       # the dropless run's: targets at 50/75/100% of them
    seeds: tuple[int, ...]
    shape: tuple[str, ...] = ()      # launcher flags overriding the config's shape
    eval_interval: int | None = None
    run_factor: float = 1.5          # every run trains run_factor x steps
    log_interval: int | None = None  # default steps / 10
    policies: tuple[str, ...] = ()   # run without --policies (empty: every listed one)
    record_routing: bool = True      # runs/<run>/routing, for the simulator's validation
    log_keys: tuple[str, ...] | None = None   # a finished run's log keeps these (None: all)
    curve: bool = False              # the report adds the curve (time_to_loss_curve)
    budget_replicas: float = 2.0     # memory budget: balanced dropless + these instances

    @property
    def total(self) -> int:
        """The steps every run of the stage trains."""
        return round(self.run_factor * self.steps)


CI_SHAPE = ("--num-layers", "1", "--hidden-size", "32", "--moe-ffn-hidden-size", "32",
            "--ffn-hidden-size", "64", "--seq-length", "64", "--max-position-embeddings", "64",
            "--micro-batch-size", "2", "--global-batch-size", "4", "--num-experts", "4",
            "--lr-warmup-iters", "1", "--eval-iters", "1")

# The curve's gammas. Below 1 the retained fraction is about gamma: memory-aware placement
# levels the ranks' loads above gamma x the mean, so each keeps its capacity exactly
# (stored, memory-aware: gamma 0.75 retained 0.748-0.749 at EP 2, 0.5 retained 0.484 at
# EP 16; at 1.0 the ranks under the mean keep all, 0.97 at EP 8).
CURVE_GAMMAS = {"uniform": ("0.9", "0.75", "0.6", "0.45", "0.3"),
                "sample-prob": ("0.6", "0.45", "0.3"),
                "two-stage": ("0.6", "0.45", "0.3")}
CURVE_POLICIES = tuple(f"lrmoe-{rule}-g{gamma}-ma"
                       for rule, gammas in CURVE_GAMMAS.items() for gamma in gammas)
CURVE_LOG_KEYS = (
    "iteration", "lm-loss", "validation-loss", "moe-forward-s", "moe-backward-s",
    "step-time-s", "lrmoe/retained-fraction", "lrmoe/dropped-contribution-fraction",
    "lrmoe/backward-bytes-saved", "lrmoe/load-max-over-mean",
    "lrmoe/load-max-over-mean-median", "lrmoe/budget-adjusted-calls")
"""What the reports read of a curve run's log (``analyse_run``, the curve, the run
report); per-layer statistics and the routed loads are dropped to keep the curve small."""
# The curve's runs train 2 x steps: the cap of "not reached" (2 x dropless's steps) lies
# inside every run. LRMoE statistics every 5 steps: the retained fraction's median. A
# budget that does not bind, so that the drop is what gamma asks: the EP 8 model's first
# 30 steps (placed load max/mean up to 2.5) at gamma 0.9 lowered gamma in 512 calls with
# room for 2 instances per layer and rank, in 24 with 16, in none with 48 (0.0496 GiB).
_CURVE = dict(run_factor=2.0, log_interval=5, policies=CURVE_POLICIES, record_routing=False,
              log_keys=CURVE_LOG_KEYS, curve=True, budget_replicas=48.0)

STAGES = {
    "screen": Stage(steps=150, seeds=(1,)),
    "confirm": Stage(steps=150, seeds=(1, 2, 3)),
    "ci": Stage(steps=4, seeds=(1,), shape=CI_SHAPE, eval_interval=2),
    # The curve: the seeds of every point, each paired with its dropless run;
    # the EP 8 study model's stored runs reach their targets near 200 steps.
    "curve": Stage(steps=200, seeds=(1, 2, 3), **_CURVE),
    # The curve's rules on the CI shape: two 5-step policies and their pairing, in seconds.
    "curve-ci": Stage(steps=5, seeds=(1,), shape=CI_SHAPE, eval_interval=5,
                      **{**_CURVE, "log_interval": 1,
                         "policies": ("lrmoe-uniform-g0.45-ma", "lrmoe-sample-prob-g0.45-ma")}),
}


def run_command(run_dir: Path, flags: list[str], port: int) -> list[str]:
    """The torchrun of one run: as many ranks as its flags' parallel layout has
    (``world_size``: the expert-parallel size in the study)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
            str(world_size(flags)),
            "--master-port", str(port), "-m", "megatron_lrmoe.launcher.pretrain", *flags,
            "--log-json", str(run_dir / "log.jsonl")]


def run_one(run_dir: Path, flags: list[str], port: int, segment: int | None = None,
            total: int | None = None, until: int | None = None,
            log_keys: tuple[str, ...] | None = None) -> dict | None:
    """Train one (policy, seed) unless ``done.json`` exists; return its record.

    With ``segment`` (steps per round, ``--rounds``): train from the run's checkpoint
    (``run_dir/checkpoint``, the launcher's ``--save``/``--load``) to the next multiple of
    ``segment`` (``--exit-interval``) and return None until the segment that reaches
    ``total``; the log keeps the steps up to the checkpoint (a segment stopped midway
    leaves steps that its rerun logs again), the record the walls of every segment. A run
    already at ``until`` (its round's end: ahead of the others after an interrupted study)
    waits for the next round. ``log_keys``: what the finished run's log keeps
    (``compact``)."""
    from megatron_lrmoe.launcher.checkpointing import read_tracker

    done = run_dir / "done.json"
    if done.exists():
        compact(run_dir, log_keys)   # a study stopped between the two steps of finishing
        return json.loads(done.read_text())
    run_dir.mkdir(parents=True, exist_ok=True)
    checkpoint = run_dir / CHECKPOINT
    resumed = (read_tracker(str(checkpoint)) or 0) if segment else 0
    if segment and until is not None and resumed >= until:
        return None
    _truncate_log(run_dir / "log.jsonl", resumed)
    walls_file = run_dir / "segments.json"
    walls = json.loads(walls_file.read_text())["wall_s"] if resumed and walls_file.exists() \
        else []
    command = run_command(run_dir, flags, port)
    resume = [] if not segment else ["--save", str(checkpoint), "--load", str(checkpoint),
                                     "--exit-interval", str(segment)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    from megatron_lrmoe.tools.provenance import code_version

    launched = code_version()     # the code the run imports: the tree at its launch
    start = time.perf_counter()
    with open(run_dir / "stdout.txt", "a" if resumed else "w") as out:
        code = subprocess.call(command + resume, cwd=ROOT, env=env, stdout=out,
                               stderr=subprocess.STDOUT)
    walls.append(time.perf_counter() - start)
    if segment and code == 0:
        reached = read_tracker(str(checkpoint))
        if reached != min(resumed + segment, total):
            raise RuntimeError(f"run {run_dir.name}: its segment from step {resumed} ended "
                               f"with the checkpoint at {reached}, not {resumed + segment}")
        if reached < total:
            _keep_latest(checkpoint, reached)
            _write_atomic(walls_file, {"wall_s": walls})
            return None
    record = {"command": shlex.join(command), "wall_s": sum(walls), "code": launched,
              "defaults": recorded_defaults()}
    if segment:
        record["rounds"] = {"steps_per_round": segment, "wall_s": walls}
    if code != 0:
        lines = (run_dir / "stdout.txt").read_text().splitlines()
        # A run held to its device that stops out of memory is a result (the launcher's
        # DeviceOutOfMemory line), recorded and not retried; any other failure is not.
        oom = next((line.removeprefix("error: ") for line in lines
                    if line.startswith(OOM_LINE)), None)
        if oom is None:
            raise RuntimeError(f"run {run_dir.name} failed ({code}):\n" + "\n".join(lines[-15:]))
        record["failed"] = oom
    _write_atomic(done, record)    # a half-written done.json never marks a run done
    shutil.rmtree(checkpoint, ignore_errors=True)
    walls_file.unlink(missing_ok=True)
    compact(run_dir, log_keys)
    return record


def compact(run_dir: Path, log_keys: tuple[str, ...] | None = None) -> None:
    """Store a finished run small: its log (only ``log_keys`` of each record, when given)
    and stdout compressed, its routing record repacked. After ``done.json``: a run
    stopped while it trained keeps its plain files to resume."""
    from megatron_lrmoe.data.routing_traces import repack

    log = run_dir / "log.jsonl"
    if log_keys is not None and log.exists():
        kept = [{k: v for k, v in r.items() if k in log_keys} for r in run_log.read_records(log)]
        tmp = log.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        os.replace(tmp, log)     # an interrupted trim leaves the whole log, never half
    run_log.compress(log)
    run_log.compress(run_dir / "stdout.txt")
    if (run_dir / "routing").is_dir():
        repack(run_dir / "routing")


def _write_atomic(path: Path, record: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, path)


def _truncate_log(path: Path, iteration: int) -> None:
    """Keep the records of the steps up to ``iteration`` (none: remove the log, and the
    compressed one of an earlier attempt)."""
    if not iteration:
        path.unlink(missing_ok=True)
        run_log.stored(path).unlink(missing_ok=True)
    elif path.exists():
        kept = [line for line in path.read_text().splitlines()
                if line.strip() and json.loads(line)["iteration"] <= iteration]
        path.write_text("".join(line + "\n" for line in kept))


def _keep_latest(checkpoint: Path, iteration: int) -> None:
    """Remove the checkpoints older than the tracker's (each is the whole training state)."""
    from megatron_lrmoe.launcher.checkpointing import checkpoint_dir

    keep = Path(checkpoint_dir(str(checkpoint), iteration))
    for old in checkpoint.glob("iter_*"):
        if old != keep:
            shutil.rmtree(old, ignore_errors=True)


def schedule(names: list[str], rounds: int) -> list[tuple[int, str]]:
    """The order a seed's runs train in, as (round, name): every run once per round, the
    order reversed in every other round, so that a machine whose speed drifts over the
    study (this CPU's did, by ~40% within one run) slows every run alike."""
    return [(r, name) for r in range(rounds)
            for name in (names if r % 2 == 0 else names[::-1])]


# -----------------------------------------------------------------------------
# Analysis (pure: JSON-lines records in, numbers out)
# -----------------------------------------------------------------------------


def smoothed(values: list[float], window: int) -> list[float]:
    """Trailing mean over ``window`` values (fewer at the start): the run report's."""
    from megatron_lrmoe.tools.report import trailing_mean

    return trailing_mean(values, window)


def analyse_run(records: list[dict], targets: dict[float, float], steps: int,
                window: int, val_target: float | None = None) -> dict:
    """A run's figures against its seed's targets: per training-loss target the first step
    whose smoothed loss reaches it, with the cumulative MoE and step seconds there; the
    same for ``val_target`` over the evaluations (``reached_val``)."""
    train = [r for r in records if "lm-loss" in r]
    loss = smoothed([r["lm-loss"] for r in train], window)
    # Summed from the steps (a run resumed in rounds restarts the launcher's own total).
    moe = list(itertools.accumulate(r["moe-forward-s"] + r["moe-backward-s"] for r in train))
    step_s = list(itertools.accumulate(r.get("step-time-s", 0.0) for r in train))
    at = {r["iteration"]: i for i, r in enumerate(train)}
    reached = {}
    for fraction, target in targets.items():
        hit = next((i for i, v in enumerate(loss) if v <= target), None)
        reached[fraction] = None if hit is None else {
            "step": train[hit]["iteration"], "moe_s": moe[hit], "step_s": step_s[hit]}
    val = {r["iteration"]: r["validation-loss"] for r in records if "validation-loss" in r}
    val_hit = None if val_target is None else next(
        (i for i in sorted(val) if val[i] <= val_target and i in at), None)
    lrmoe = [r for r in records if "lrmoe/retained-fraction" in r]
    steady = train[len(train) // 10:] or train     # past warm-up and first-call costs
    return {
        "moe_fwd_ms": 1e3 * statistics.median(r["moe-forward-s"] for r in steady)
        if steady else None,
        "moe_bwd_ms": 1e3 * statistics.median(r["moe-backward-s"] for r in steady)
        if steady else None,
        # The step outside the MoE layers: the same model work in every run of one
        # micro-batch size and recompute setting, so it shows the machine's speed.
        "other_s_per_step": statistics.median(map(other_s, steady))
        if steady and all("step-time-s" in r for r in steady) else None,
        "steps_run": len(train),
        "reached": reached,
        "reached_val": None if val_hit is None else {
            "step": val_hit, "moe_s": moe[at[val_hit]], "step_s": step_s[at[val_hit]]},
        "val_at_steps": val[max(i for i in val if i <= steps)] if any(
            i <= steps for i in val) else None,
        "val_final": val[max(val)] if val else None,
        "moe_s_per_step": moe[-1] / len(moe) if moe else None,
        "moe_s_total": moe[-1] if moe else None,
        "retained": statistics.fmean(r["lrmoe/retained-fraction"] for r in lrmoe)
        if lrmoe else 1.0,
        "bwd_bytes_saved": sum(r["lrmoe/backward-bytes-saved"] for r in lrmoe),
        # The typical call's placed load (median over the run's log intervals of each
        # interval's median call, past the first interval, whose step 1 is always
        # static), beside the worst call of the run.
        "load_max_over_mean": statistics.median(
            r.get("lrmoe/load-max-over-mean-median", r["lrmoe/load-max-over-mean"])
            for r in (lrmoe[1:] or lrmoe)) if lrmoe else None,
        "load_worst": max((r["lrmoe/load-max-over-mean"] for r in lrmoe), default=None),
        "curve": {"moe_s": moe, "loss": loss},
    }


def other_s(record: dict) -> float:
    """A step's seconds outside the MoE layers."""
    return record["step-time-s"] - record["moe-forward-s"] - record["moe-backward-s"]


def speed_blocks(records: list[dict], block: int) -> list[tuple[int, float, float]]:
    """The machine's speed over a run: per ``block`` steps, (its last step, the median
    ``other_s``, the median MoE seconds per step) (``benchmarks/studies/machine_drift.py``)."""
    steps = [r for r in records if "moe-forward-s" in r and "step-time-s" in r]
    return [(part[-1]["iteration"], statistics.median(map(other_s, part)),
             statistics.median(r["moe-forward-s"] + r["moe-backward-s"] for r in part))
            for part in (steps[i:i + block] for i in range(0, len(steps), block))]


def val_target_from(reference: list[dict], steps: int) -> float | None:
    """The reference's validation loss at ``steps`` (its last evaluation at or before)."""
    val = {r["iteration"]: r["validation-loss"] for r in reference if "validation-loss" in r}
    before = [i for i in val if i <= steps]
    return val[max(before)] if before else None


def family(name: str) -> str:
    """A run's policy without its fitted configuration (``symi@slots_9`` -> ``symi``)."""
    return name.split("@", 1)[0]


def fitted_name(policy: str, fitted: str) -> str:
    """The run name of ``policy`` in a fitted configuration (``symi@slots_9``)."""
    return policy if fitted == "none" else f"{policy}@{fitted.replace(' ', '_')}"


def fitted_of(name: str) -> str:
    """What a run gave up to fit (``x@micro-batch_2`` -> ``micro-batch 2``; ``none``)."""
    return name.split("@", 1)[1].replace("_", " ") if "@" in name else "none"


def fastest(per_run: dict[tuple[str, int], dict], policy: str, seed: int,
            key: str = "reached") -> dict | None:
    """The seed's fastest run of ``policy``'s family to the 100% target (its reached entry):
    the reference a fitted study compares with (every fitted configuration of a baseline
    is that baseline at its best)."""
    hits = []
    for (name, s), a in per_run.items():
        if s == seed and family(name) == policy and not name.startswith(UNCONSTRAINED):
            hit = a[key][1.0] if key == "reached" else a[key]
            if hit:
                hits.append(hit)
    return min(hits, key=lambda h: h["moe_s"]) if hits else None


def dropless_run(per_run: dict[tuple[str, int], dict], seed: int) -> dict | None:
    """The seed's dropless run that validation losses are compared with: the plain one;
    in a held study its fastest fitted configuration (the same training: the global
    batch and the data are dropless's, the code the study's); else the unconstrained
    study's."""
    if plain := per_run.get((REFERENCE, seed)):
        return plain
    fitted = [(a["reached"][1.0]["moe_s"] if a["reached"][1.0] else math.inf, name, a)
              for (name, s), a in per_run.items()
              if s == seed and family(name) == REFERENCE and not name.startswith(UNCONSTRAINED)]
    if fitted:
        return min(fitted, key=lambda f: f[:2])[2]
    return per_run.get((UNCONSTRAINED + REFERENCE, seed))


def targets_from(reference: list[dict], steps: int, window: int) -> dict[float, float]:
    loss = smoothed([r["lm-loss"] for r in reference if "lm-loss" in r], window)
    if len(loss) < steps:
        raise ValueError(f"the reference run has {len(loss)} steps, fewer than --steps {steps}")
    return {f: loss[max(1, round(f * steps)) - 1] for f in TARGET_FRACTIONS}


def summarize(per_run: dict[tuple[str, int], dict]) -> list[dict]:
    """One row per policy: medians over its seeds (of the seeds that reached a target)."""
    names = sorted({name for name, _ in per_run}, key=_policy_order)
    ref = {seed: a for (name, seed), a in per_run.items() if name == REFERENCE}
    rows = []
    for name in names:
        runs = [(seed, a) for (n, seed), a in sorted(per_run.items()) if n == name]
        row = {"policy": name, "seeds": len(runs)}
        for fraction in TARGET_FRACTIONS:
            hits = [(seed, a["reached"][fraction]) for seed, a in runs if a["reached"][fraction]]
            row[f"reached_{fraction}"] = len(hits)
            row[f"steps_{fraction}"] = _median([h["step"] for _, h in hits])
            row[f"moe_s_{fraction}"] = _median([h["moe_s"] for _, h in hits])
            ratios = [h["moe_s"] / ref[seed]["reached"][fraction]["moe_s"] for seed, h in hits
                      if seed in ref and ref[seed]["reached"][fraction]]
            row[f"moe_vs_dropless_{fraction}"] = _median(ratios)
            row[f"step_s_{fraction}"] = _median([h["step_s"] for _, h in hits])
        row["fitted"] = fitted_of(name)
        val_hits = [(seed, a["reached_val"]) for seed, a in runs if a.get("reached_val")]
        row["reached_val"] = len(val_hits)
        row["moe_s_val"] = _median([h["moe_s"] for _, h in val_hits])
        for base, key in ((REFERENCE, "moe_vs_dropless"), ("symi", "moe_vs_symi")):
            # Against the seed's fastest fitted configuration of the baseline (with nothing
            # fitted, its one run), at the 100% training-loss target and at the val target.
            hits = [(seed, a["reached"][1.0]) for seed, a in runs if a["reached"][1.0]]
            row[f"{key}_1.0"] = _median([h["moe_s"] / b["moe_s"] for seed, h in hits
                                         if (b := fastest(per_run, base, seed))])
            row[f"{key}_val"] = _median([h["moe_s"] / b["moe_s"] for seed, h in val_hits
                                         if (b := fastest(per_run, base, seed, "reached_val"))])
        for key in ("val_at_steps", "val_final", "moe_s_per_step", "moe_fwd_ms", "moe_bwd_ms",
                    "other_s_per_step",
                    "retained", "bwd_bytes_saved", "load_max_over_mean", "load_worst",
                    "wall_s"):
            row[key] = _median([a[key] for _, a in runs if a.get(key) is not None])
        rows.append(row)
    return rows


BASELINES = (REFERENCE, "symi", "megatron-capacity-1.0")


def per_seed(per_run: dict[tuple[str, int], dict]) -> list[dict]:
    """One row per (seed, policy): steps and MoE seconds to the 100% target, the MoE
    seconds relative to the same seed's run of each baseline (None where either did not
    reach the target or the baseline did not run), and the validation loss at equal steps
    relative to that seed's dropless run. The issue's goal figures are per-seed ratios
    to the three baselines; the summary table's medians hide their spread."""
    rows = []
    for (name, seed), a in sorted(per_run.items(), key=lambda kv: (kv[0][1],
                                                                    _policy_order(kv[0][0]))):
        hit = a["reached"][1.0]
        row = {"seed": seed, "policy": name, "steps": hit and hit["step"],
               "moe_s": hit and hit["moe_s"]}
        for base in BASELINES:
            other_hit = fastest(per_run, base, seed)
            row[f"vs_{base}"] = (hit["moe_s"] / other_hit["moe_s"]
                                 if hit and other_hit else None)
        ref = dropless_run(per_run, seed)
        row["val_vs_dropless"] = (a["val_at_steps"] / ref["val_at_steps"] - 1.0
                                  if ref and ref["val_at_steps"] and a["val_at_steps"]
                                  else None)
        rows.append(row)
    return rows


def per_seed_table(rows: list[dict]) -> str:
    def fmt(v, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    lines = ["| seed | policy | steps to 100% | MoE s to 100% | vs dropless | vs SYMI-style "
             "| vs capacity drop | val loss @ steps vs dropless |", "|" + "---|" * 8]
    for r in rows:
        lines.append("| " + " | ".join([
            str(r["seed"]), r["policy"], fmt(r["steps"], "d"), fmt(r["moe_s"], ".1f"),
            *(fmt(r[f"vs_{b}"], ".2f") for b in BASELINES),
            fmt(None if r["val_vs_dropless"] is None else 100 * r["val_vs_dropless"], "+.2f")
            + ("%" if r["val_vs_dropless"] is not None else "")]) + " |")
    return "\n".join(lines)


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _policy_order(name: str) -> tuple[int, str]:
    return (0 if name.startswith("megatron") else 1 if name == "symi" else 2, name)


# -----------------------------------------------------------------------------
# Report
# -----------------------------------------------------------------------------

COLUMNS = ("policy", "seeds", "steps to 50/75/100%", "MoE s to 50/75/100%",
           "MoE s vs dropless at 100%", "val loss @ steps", "val loss @ end",
           "MoE s / step", "MoE fwd/bwd ms per step", "other s / step", "wall s / run",
           "retained",
           "bwd MiB saved", "load max/mean median call / worst")


def markdown_table(rows: list[dict]) -> str:
    def fmt(v, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        steps = "/".join(fmt(r[f"steps_{f}"], ".0f") for f in TARGET_FRACTIONS)
        moe = "/".join(fmt(r[f"moe_s_{f}"], ".1f") for f in TARGET_FRACTIONS)
        lines.append("| " + " | ".join([
            r["policy"], str(r["seeds"]), steps, moe, fmt(r["moe_vs_dropless_1.0"], ".2f"),
            fmt(r["val_at_steps"], ".4f"), fmt(r["val_final"], ".4f"),
            fmt(r["moe_s_per_step"], ".3f"),
            fmt(r["moe_fwd_ms"], ".1f") + "/" + fmt(r["moe_bwd_ms"], ".1f"),
            fmt(r.get("other_s_per_step"), ".3f"), fmt(r.get("wall_s"), ".0f"),
            fmt(r["retained"], ".3f"),
            fmt(None if r["bwd_bytes_saved"] is None else r["bwd_bytes_saved"] / 2**20, ".1f"),
            fmt(r["load_max_over_mean"], ".2f") + " / " + fmt(r.get("load_worst"), ".2f"),
        ]) + " |")
    return "\n".join(lines)


def fitted_table(rows: list[dict]) -> str:
    """Per policy: what it gave up to fit, MoE and total step seconds to the 100% training
    target and MoE seconds to the validation target, and its ratios to the fastest fitted
    dropless and SYMI-style runs (per seed, then medians)."""
    def fmt(v, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    lines = ["| policy | fitted | MoE s / step s to 100% | vs dropless | vs SYMI-style | "
             "val target reached | MoE s to val | vs dropless (val) | vs SYMI-style (val) |",
             "|" + "---|" * 9]
    for r in rows:
        lines.append("| " + " | ".join([
            r["policy"], r["fitted"],
            fmt(r["moe_s_1.0"], ".1f") + " / " + fmt(r["step_s_1.0"], ".1f"),
            fmt(r["moe_vs_dropless_1.0"], ".2f"), fmt(r["moe_vs_symi_1.0"], ".2f"),
            f"{r['reached_val']}/{r['seeds']}", fmt(r["moe_s_val"], ".1f"),
            fmt(r["moe_vs_dropless_val"], ".2f"), fmt(r["moe_vs_symi_val"], ".2f")]) + " |")
    return "\n".join(lines)


def plot(per_run: dict[tuple[str, int], dict], targets: dict[int, dict[float, float]],
         path: Path) -> None:
    plt = pyplot()

    seed = min(seed for _, seed in per_run)
    fig, ax = plt.subplots(figsize=(9, 6))
    for (name, s), a in sorted(per_run.items(), key=lambda kv: _policy_order(kv[0][0])):
        if s != seed:
            continue
        style = "-" if name.startswith("lrmoe") else "--"
        ax.plot(a["curve"]["moe_s"], a["curve"]["loss"], style, label=name, linewidth=1.2)
    for fraction, target in targets.get(seed, {}).items():
        ax.axhline(target, color="grey", linewidth=0.6, linestyle=":")
        ax.annotate(f"{fraction:.0%} target", (0, target), fontsize=7, color="grey")
    ax.set_xlabel("cumulative MoE-layer time, forward + backward (s, slowest rank)")
    ax.set_ylabel("training loss (trailing mean)")
    ax.set_title(f"Loss vs MoE time, seed {seed}")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    save_png(fig, path)
    plt.close(fig)


def plot_curve(points: list[dict], cap_factor: float, path: Path) -> None:
    """The curve (``time_to_loss_curve.points``): steps to target and validation loss at
    equal steps relative to dropless against the measured retained fraction, one line per
    rule, each point's median with its range over seeds."""
    plt = pyplot()

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharex=True)
    rules = sorted({p["rule"] for p in points if p["policy"] != REFERENCE})
    for i, rule in enumerate(rules):
        mine = sorted((p for p in points if p["rule"] == rule),
                      key=lambda p: p["retained"]["median"])
        for ax, key, scale in ((axes[0], "steps_vs_dropless", 1.0),
                               (axes[1], "val_vs_dropless", 100.0)):
            shown = [p for p in mine if p[key]]
            x = [p["retained"]["median"] for p in shown]
            median = [p[key]["median"] * scale for p in shown]
            ax.errorbar(x, median, yerr=[[m - p[key]["min"] * scale for m, p in
                                          zip(median, shown, strict=True)],
                                         [p[key]["max"] * scale - m for m, p in
                                          zip(median, shown, strict=True)]],
                        fmt="o-", color=f"C{i}", capsize=3, label=rule)
    axes[0].axhline(1.0, color="k", linewidth=0.8)
    axes[0].set_ylabel(f"steps to the 100% target / dropless's (cap {cap_factor:g} x)")
    axes[1].axhline(0.0, color="k", linewidth=0.8)
    axes[1].set_ylabel("validation loss at equal steps vs dropless (%)")
    for ax in axes:
        ax.set_xlabel("retained fraction (measured, steady state)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("The curve: median and range over seeds, each run against its seed's "
                 "dropless run", fontsize=10)
    fig.tight_layout()
    save_png(fig, path)
    plt.close(fig)


@dataclass(frozen=True)
class Device:
    """A device-held study: the device, the MoE budget it leaves the dropless
    configuration, whether the dropless hot rank needs more (``binding``), the
    feasibility table, and the unconstrained study whose dropless runs set the targets."""

    gib: float
    budget_gib: float
    binding: bool
    feasibility: str
    unconstrained_dir: Path


def _finished_runs(out_dir: Path, prefix: str = "") -> tuple[dict, dict, dict]:
    """(logs, done records, failures) of the runs under ``out_dir``/runs, keyed
    (prefix + policy, seed); a run stopped out of memory is finished, not analysed."""
    logs, finished, failed = {}, {}, {}
    for done in sorted((out_dir / "runs").glob("*/done.json")):
        name, _, seed = done.parent.name.rpartition("-s")
        key = (prefix + name, int(seed))
        record = json.loads(done.read_text())
        if record.get("failed"):
            failed[key] = record["failed"]
            continue
        logs[key] = run_log.read_records(done.parent / "log.jsonl")
        finished[key] = record
    return logs, finished, failed


@dataclass(frozen=True)
class Analysis:
    """A study's finished runs, keyed (policy, seed): their records, ``done.json``
    records and out-of-memory stops, the seeds' targets, and each run's figures."""

    logs: dict[tuple[str, int], list[dict]]
    finished: dict[tuple[str, int], dict]
    failed: dict[tuple[str, int], str]
    targets: dict[int, dict[float, float]]
    val_targets: dict[int, float | None]
    per_run: dict[tuple[str, int], dict]


def analyse_study(out_dir: Path, stage: Stage,
                  unconstrained_dir: Path | None = None) -> Analysis:
    """Every finished run under ``out_dir`` (with ``unconstrained_dir``: that study's
    runs of the same seeds beside them, ``unconstrained/...``) against its seed's
    targets."""
    window = max(1, stage.steps // 8)
    logs, finished, failed = _finished_runs(out_dir)
    if unconstrained_dir is not None:
        seeds = {seed for _, seed in logs} | {seed for _, seed in failed}
        more, more_done, _ = _finished_runs(unconstrained_dir, UNCONSTRAINED)
        logs.update({k: v for k, v in more.items() if k[1] in seeds})
        finished.update({k: v for k, v in more_done.items() if k[1] in seeds})
    references = {seed: records for (name, seed), records in logs.items()
                  if name in (REFERENCE, UNCONSTRAINED + REFERENCE)}
    targets = {seed: targets_from(records, stage.steps, window)
               for seed, records in references.items()}
    val_targets = {seed: val_target_from(records, stage.steps)
                   for seed, records in references.items()}
    per_run = {key: analyse_run(records, targets[key[1]], stage.steps, window,
                                val_targets[key[1]])
               for key, records in logs.items() if key[1] in targets}
    for key, analysed in per_run.items():   # end-to-end wall time beside MoE time
        analysed["wall_s"] = finished[key]["wall_s"]
    return Analysis(logs, finished, failed, targets, val_targets, per_run)


def write_plots(out_dir: Path, analysis: Analysis,
                unconstrained_dir: Path | None = None) -> None:
    """The study's figures: ``loss_vs_moe_time.png`` and the run report ``report/``
    (``megatron_lrmoe.tools.report``) over every run."""
    if analysis.per_run:
        plot(analysis.per_run, analysis.targets, out_dir / "loss_vs_moe_time.png")
    if analysis.logs:
        from megatron_lrmoe.tools.report import build_report
        from megatron_lrmoe.tools.report import write_report as write_run_report

        def run_dir(name: str, seed: int) -> Path:
            if name.startswith(UNCONSTRAINED):
                assert unconstrained_dir is not None
                return (unconstrained_dir / "runs"
                        / f"{name.removeprefix(UNCONSTRAINED)}-s{seed}")
            return out_dir / "runs" / f"{name}-s{seed}"

        write_run_report(build_report([run_dir(n, s) for n, s in analysis.logs]),
                         out_dir / "report")


def write_report(out_dir: Path, stage: Stage, stage_name: str, command: str,
                 base_flags: list[str], budget_gb: float | str,
                 device: Device | None = None, plots: bool = True) -> list[dict]:
    """Analyse every finished run under ``out_dir`` and rewrite the report files (the
    figures too unless ``plots`` is False)."""
    window = max(1, stage.steps // 8)
    analysis = analyse_study(out_dir, stage, device and device.unconstrained_dir)
    logs, finished, failed = analysis.logs, analysis.finished, analysis.failed
    targets, val_targets, per_run = analysis.targets, analysis.val_targets, analysis.per_run
    rows = summarize(per_run) if per_run else []
    seeds = per_seed(per_run)
    done = list(finished.values())
    machine = sum(d["wall_s"] for d in done)
    # The code each run ran (a study resumed across sessions may span commits).
    codes = sorted({d.get("code", "not recorded") for d in done})
    text = "\n".join([
        f"# Time to a fixed loss ({stage_name})",
        "",
        f"Command: `{command}`",
        "",
        f"Runs finished: {len(logs)}; machine time of the finished runs {machine / 60:.1f} min "
        f"({world_size(base_flags)} ranks x 1 thread on {os.cpu_count()} cores, gloo). "
        "Each run: "
        f"{stage.total} steps; targets = the dropless run's trailing-mean "
        f"training loss (window {window}) at 50/75/100% of {stage.steps} steps, per seed: "
        + ", ".join(f"seed {s}: " + "/".join(f"{v:.4f}" for v in t.values())
                    for s, t in sorted(targets.items())) + ".",
        f"Study parameters: {study_parameters(base_flags)}.",
        f"Code of the runs: {'; '.join(codes) or '-'}.",
        f"Base flags: `{shlex.join(base_flags)}`. SYMI-style and memory-aware budget: "
        + (budget_gb if isinstance(budget_gb, str) else f"{budget_gb:.5f} GiB") + " per rank.",
        *([] if device is None else [
            "",
            f"Device: {device.gib:g} GiB per rank (every run held to it, "
            f"`--device-memory-gb`); the MoE budget it leaves the dropless configuration: "
            f"{device.budget_gib:.4f} GiB, {'binding' if device.binding else 'not binding'} "
            "(the dropless hot rank's predicted need on the reference routing "
            f"{'exceeds' if device.binding else 'is within'} it). Baselines ran as their "
            "two best-predicted fitting configurations (`policy@fitted`); ratios are to the "
            "seed's fastest fitted run of SYMI-style and of dropless. Rows "
            f"`{UNCONSTRAINED}...`: the unconstrained study "
            f"(`{device.unconstrained_dir}`), for comparison; its dropless runs set the "
            "targets.",
            "",
            *(f"- `{n}-s{s}` stopped: {msg}" for (n, s), msg in sorted(failed.items())),
        ]),
        "",
        markdown_table(rows),
        "",
        fitted_table(rows),
        "",
        "Steps and MoE seconds are medians over the seeds that reached the target (`-`: "
        "none did within the run); \"MoE s vs dropless\" is the median of the per-seed "
        "ratio to that seed's dropless run; \"other s / step\": the median step's seconds "
        "outside the MoE layers (the machine's speed, for runs of one micro-batch size and "
        "recompute setting). Plot: `loss_vs_moe_time.png`; run report "
        "(loss, MoE time, LRMoE statistics, routed load; `python -m megatron_lrmoe.tools.report`): "
        "`report/`.",
        "",
        "Per seed: MoE seconds to the 100% target relative to the same seed's run of each "
        "baseline (`-`: one of the two did not reach it, or the baseline did not run), and "
        "the validation loss at equal steps relative to the seed's dropless run (held to a "
        "device: its fastest fitted configuration, the same training in the same code).",
        "",
        per_seed_table(seeds),
    ]) + "\n"
    curve = {}
    if stage.curve:
        paired = time_to_loss_curve.pairs(logs, per_run, targets, window, stage.run_factor)
        text += "\n## The curve\n\nPlot: `curve.png`.\n\n" + time_to_loss_curve.markdown(
            paired, stage.run_factor) + "\n"
        curve = {"curve": {
            "cap_factor": stage.run_factor, "points": time_to_loss_curve.points(paired),
            "pairs": [{"seed": seed, "policy": name, **p}
                      for (name, seed), p in time_to_loss_curve.ordered(paired)]}}
    (out_dir / "report.md").write_text(text)
    held = {} if device is None else {
        "device_gib": device.gib, "budget_gib": device.budget_gib, "binding": device.binding,
        "failed": {f"{n}-s{s}": msg for (n, s), msg in failed.items()}}
    (out_dir / "report.json").write_text(json.dumps(
        {**held, "rows": rows, "per_seed": seeds, **curve,
         "targets": {str(k): v for k, v in targets.items()},
         "val_targets": {str(k): v for k, v in val_targets.items()}}, indent=1))
    if device is not None:
        text += "\n## Feasibility (predicted before the runs)\n\n" + device.feasibility + "\n"
        (out_dir / "report.md").write_text(text)
    if plots:
        write_plots(out_dir, analysis, device and device.unconstrained_dir)
        if curve:
            plot_curve(curve["curve"]["points"], stage.run_factor, out_dir / "curve.png")
    return rows


# -----------------------------------------------------------------------------
# Main
# -----------------------------------------------------------------------------


def study_parameters(base_flags: list[str]) -> str:
    """Model shape and micro-batches per step of a study's runs (flags over the config)."""
    def value(name: str):
        return flag_or_config(base_flags, name)

    ranks = world_size(base_flags)
    micro = int(value("global-batch-size")) // (int(value("micro-batch-size")) * ranks)
    return (f"hidden {value('hidden-size')}, expert FFN {value('moe-ffn-hidden-size')}, "
            f"{value('num-experts')} experts top-{value('moe-router-topk')}, "
            f"{value('num-layers')} layers, sequence {value('seq-length')}, micro-batch "
            f"{value('micro-batch-size')}, {micro} micro-batch(es) per step on {ranks} ranks")


def on_device(flags: list[str]) -> list[str]:
    """A policy's flags on a device: LRMoE plans under the budget the device leaves
    (``auto``: gamma lowered to fit) unless the policy names its own."""
    if "--moe-lrmoe" in flags and "--moe-lrmoe-memory-budget-gb" not in flags:
        return [*flags, "--moe-lrmoe-memory-budget-gb", "auto"]
    return flags


def fitted_policies(base: list[str], device_gib: float, unconstrained_dir: Path, seed: int,
                    chosen: str | None, calibration: Path = ROOT / CALIBRATION
                    ) -> tuple[dict[str, list[str]], Device]:
    """The runs of a device-held study: each baseline's two best-predicted fitting
    configurations (``fitted_name``) and the chosen LRMoE policies as they are, every one
    under the budget ``auto``, predicted from the unconstrained study's dropless run of
    ``seed`` (its routing and its time outside the MoE layers); and the ``Device`` for
    the report. A chosen ``policy@fitted`` (``symi@micro-batch_2_+_slots_10``; ``@none``
    for the configuration as it is) runs just that fitting configuration: the one the
    screen measured faster, confirmed over the seeds. ``calibration``: the machine
    constants the predictions price the MoE layers with."""
    from lrmoe_studies import fitting
    from megatron_lrmoe.planning.memory_account import GIB

    reference = unconstrained_dir / "runs" / f"{REFERENCE}-s{seed}"
    traces, outside = fitting.reference_run(reference)
    constants = json.loads(Path(calibration).read_text())
    every = policies("auto")
    requested = [p for p in (chosen or "").split(",") if p] or list(every)
    pinned: dict[str, list[str]] = {}    # policy -> the fitted run names asked for
    for p in requested:
        if "@" in p:
            policy = p.split("@", 1)[0]
            pinned.setdefault(policy, []).append(fitted_name(policy, fitted_of(p)))
    names = list(dict.fromkeys([REFERENCE, *(p.split("@", 1)[0] for p in requested)]))
    if bad := [p for p in names if p not in every]:
        raise SystemExit(f"unknown policies {bad}; --list shows them")
    table, rows, dropless = {}, [], None
    for name in names:
        flags = on_device(every[name])
        # SYMI-style's slots from what its budget holds down (more predict the same).
        slots = (fitting.budget_slots(base, flags, device_gib, constants,
                                      world_size=world_size(base))
                 if name == "symi" else None)
        preds = fitting.policy_predictions(base, name, flags, name in BASELINES, device_gib,
                                           traces, constants, outside, slots_max=slots,
                                           world_size=world_size(base))
        dropless = preds[0] if name == REFERENCE else dropless
        rows += [(device_gib, p) for p in preds]
        if name in pinned:
            fits = {fitted_name(name, p.candidate.fitted): p for p in preds if p.fits}
            if bad := [n for n in pinned[name] if n not in fits]:
                raise SystemExit(f"--policies {','.join(bad)}: not a configuration of {name} "
                                 f"that fits {device_gib:g} GiB; those that do: "
                                 f"{', '.join(fits) or 'none'}")
            runs = [fits[n] for n in pinned[name]]
        else:
            runs = fitting.best_fitting(preds) if name in BASELINES else preds[:1]
        for p in runs:
            table[fitted_name(name, p.candidate.fitted)] = list(p.candidate.flags)
    assert dropless is not None
    budget = device_gib - dropless.account.outside_moe / GIB
    device = Device(device_gib, budget, dropless.account.moe / GIB > budget,
                    f"Predicted from `{reference}` (routing, {outside.seconds:.3f} s per step "
                    f"outside the MoE layers):\n\n" + fitting.feasibility_table(rows),
                    unconstrained_dir)
    return table, device


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--stage", choices=tuple(STAGES), default="screen")
    p.add_argument("--steps", type=int, default=None,
                   help="the dropless run's steps (targets at 50/75/100%%); runs go to "
                        "1.5x (the curve: 2x)")
    p.add_argument("--seeds", default=None, help="comma-separated seeds (default: the stage's)")
    p.add_argument("--policies", default=None,
                   help="comma-separated policy names (default: the stage's, else every "
                        "listed one; LRMoE policies by their flags: "
                        + LRMOE_NAME.replace("%", "%%") + "); the dropless reference "
                        "is always included; with --device-gib, policy@fitted (a run name "
                        "of the screen) runs only that fitting configuration")
    p.add_argument("--budget-replicas", type=float, default=None,
                   help="budget = balanced dropless need + this many expert instances per "
                        "layer and rank (default: the stage's; 2, the curve 48)")
    p.add_argument("--out-dir", type=Path, default=None,
                   help="default benchmarks/results/time_to_loss/<stage>")
    p.add_argument("--data-path", default="data/stdlib",
                   help="prepared corpus prefix (the demo's; bench_time_to_loss.sh prepares it)")
    p.add_argument("--data-cache-path", default="data/cache")
    p.add_argument("--hidden-size", type=int, default=None,
                   help="model shape (study parameter): hidden size (default: the config's)")
    p.add_argument("--moe-ffn-hidden-size", type=int, default=None,
                   help="model shape (study parameter): expert FFN size (default: the config's)")
    p.add_argument("--microbatches", type=int, default=None,
                   help="micro-batches per optimizer step (study parameter): the global batch "
                        "becomes micro-batch size x ranks x this (default: the config's)")
    p.add_argument("--config", default=STUDY_CONFIG,
                   help="the study's model config (flat Megatron-LM flag names, relative to "
                        "the repository root; e.g. configs/ep_study.yaml)")
    p.add_argument("--ep", type=int, default=None,
                   help="expert-parallel size, one rank each (default: the config's "
                        "expert-model-parallel-size)")
    p.add_argument("--no-record-routing", action="store_true",
                   help="do not record each run's routing (runs/<run>/routing, which the "
                        "simulator's validation replays)")
    p.add_argument("--device-gib", type=float, default=None,
                   help="hold every run to a device of this many GiB per rank "
                        "(--device-memory-gb); the baselines run as their two best-predicted "
                        "fitting configurations (lrmoe_studies.fitting), SYMI-style's "
                        "and memory-aware's budget is auto (benchmarks/results/feasibility: "
                        "D1, D2)")
    p.add_argument("--unconstrained-dir", type=Path, default=None,
                   help="with --device-gib (required): the unconstrained study of the same "
                        "shape and seeds; its dropless runs set the targets, its rows stay in "
                        "the report")
    p.add_argument("--calibration", type=Path, default=ROOT / CALIBRATION,
                   help="with --device-gib: the machine constants (python -m "
                        "megatron_lrmoe.tools.calibrate) the fitted configurations are "
                        "predicted with; e.g. benchmarks/results/calibration_cpu_ep_study.json "
                        "for configs/ep_study.yaml")
    p.add_argument("--rounds", type=int, default=1,
                   help="train each seed's runs in this many rounds of equal steps, each run "
                        "resumed from its checkpoint in turn, the order reversed every other "
                        "round: a machine whose speed drifts slows every run alike "
                        "(docs/decisions.md); 1: each run start to end")
    p.add_argument("--no-plots", action="store_true",
                   help="write the report's tables only, not its figures (a rerun without "
                        "this flag draws them from the stored logs)")
    p.add_argument("--port", type=int, default=29531)
    p.add_argument("--list", action="store_true", help="print the policies and exit")
    return p.parse_args(argv)


def study_setup(args: argparse.Namespace) -> tuple[Stage, list[str]]:
    """The stage (steps, seeds) and the flags every run of the study shares."""
    stage = STAGES[args.stage]
    if args.steps:
        stage = dataclasses.replace(stage, steps=args.steps)
    if args.seeds:
        stage = dataclasses.replace(stage, seeds=tuple(int(s) for s in args.seeds.split(",")))
    eval_interval = stage.eval_interval or max(1, stage.steps // 4)
    study_shape = []       # the study parameters, recorded in the report with the flags
    if args.hidden_size:
        study_shape += ["--hidden-size", str(args.hidden_size)]
    if args.moe_ffn_hidden_size:
        study_shape += ["--moe-ffn-hidden-size", str(args.moe_ffn_hidden_size)]
    if args.ep:
        study_shape += ["--expert-model-parallel-size", str(args.ep)]
    if args.microbatches:
        shape = ["--config", args.config, *stage.shape, *study_shape]
        micro_batch = int(flag_or_config(shape, "micro-batch-size"))
        study_shape += ["--global-batch-size",
                        str(micro_batch * world_size(shape) * args.microbatches)]
    return stage, ["--config", args.config, *stage.shape, *study_shape,
                   "--data-path", args.data_path, "--data-cache-path", args.data_cache_path,
                   "--train-iters", str(stage.total), "--eval-interval", str(eval_interval),
                   "--log-interval", str(stage.log_interval or max(1, stage.steps // 10)),
                   "--no-progress-bar"]


def main(argv: list[str] | None = None) -> int:
    """The driver; a flag the runs' launcher refuses (a corpus not prepared, say) is one
    ``error:`` line naming the flag and the fix, status 2, before any run starts."""
    try:
        return _drive(argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _drive(argv: list[str] | None) -> int:
    args = parse_args(argv)
    stage, base = study_setup(args)
    out_dir = args.out_dir or ROOT / "benchmarks" / "results" / "time_to_loss" / (
        args.stage if args.config == STUDY_CONFIG and not args.ep
        else f"{Path(args.config).stem}_ep{world_size(base)}/{args.stage}")
    total = stage.total
    if args.rounds < 1 or total % args.rounds:
        raise SystemExit(f"--rounds {args.rounds}: a run's {total} steps must split into that "
                         "many equal rounds; choose one of "
                         + ", ".join(str(k) for k in range(1, total + 1) if total % k == 0))
    device = None
    asked = args.policies or ",".join(stage.policies)     # none: every listed policy
    # Flags are validated as the runs' (one rank per expert-parallel rank), before any run.
    parse_run_flags(base, world_size(base))
    if args.device_gib is not None:
        if args.unconstrained_dir is None:
            raise SystemExit("--device-gib needs --unconstrained-dir (the unconstrained study "
                             "whose dropless runs set the targets)")
        budget_gb, (table, device) = "auto", fitted_policies(
            base, args.device_gib, args.unconstrained_dir, stage.seeds[0], asked,
            args.calibration)
    else:
        budget_gb = study_budget_gb(base, args.budget_replicas or stage.budget_replicas)
        table = policies(budget_gb)
    chosen = list(table) if not asked or device else [REFERENCE] + [
        p for p in asked.split(",") if p and p != REFERENCE]
    if args.list:     # the listed policies, and the stage's or the asked ones
        for name in dict.fromkeys([*table, *chosen]):
            print(f"{name}: {shlex.join(table[name])}")
        return 0
    if bad := [p for p in chosen if p not in table]:
        raise SystemExit("--policies: " + "; ".join(
            Policies.problem(p) or f"{p!r}: not a configuration of this study" for p in bad)
            + " (--list shows the listed policies)")
    command = shlex.join(["bash", "benchmarks/studies/time_to_loss.sh", *(
        sys.argv[1:] if argv is None else argv)])
    out_dir.mkdir(parents=True, exist_ok=True)
    reported = False     # the report covers every finished run
    segment = None if args.rounds == 1 else total // args.rounds
    for seed in stage.seeds:
        for round_, name in schedule(chosen, args.rounds):
            run_dir = out_dir / "runs" / f"{name}-s{seed}"
            started = time.perf_counter()
            record = [] if args.no_record_routing or not stage.record_routing else [
                "--record-routing", str(run_dir / "routing")]
            ran = not (run_dir / "done.json").exists()
            held = [] if device is None else ["--device-memory-gb", f"{device.gib:g}"]
            finished = run_one(run_dir, base + ["--seed", str(seed), *table[name], *held,
                                                *record], args.port, segment, total,
                               until=(round_ + 1) * (segment or total),
                               log_keys=stage.log_keys)
            took = f"{time.perf_counter() - started:.0f} s"
            if not ran and round_:     # done before this invocation: said in round 1
                continue
            if finished is None:
                print(f"[time_to_loss] {run_dir.name}: round {round_ + 1} of {args.rounds} "
                      f"({took})", flush=True)
                continue
            print(f"[time_to_loss] {run_dir.name}: done ({took})", flush=True)
            if ran:    # after every new run, so that an interrupted study has its report
                write_report(out_dir, stage, args.stage, command, base, budget_gb, device,
                             plots=not args.no_plots)
                reported = True
    if not reported:     # nothing new ran: rewrite it once (with today's analysis)
        write_report(out_dir, stage, args.stage, command, base, budget_gb, device,
                     plots=not args.no_plots)
    print((out_dir / "report.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
