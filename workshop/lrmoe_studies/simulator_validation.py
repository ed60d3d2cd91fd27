"""The simulator against measured runs: each run's own routing replayed at its own flags,
simulated MoE times beside the measured ones, and the per-policy summary.

``benchmarks/studies/validate_simulator.py`` is the command line and the report (its
docstring says what is compared and why the phase split is reported); the replay is
``megatron_lrmoe.tools.simulate``'s.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
import statistics
from pathlib import Path

import yaml

from lrmoe_studies.time_to_loss_policies import without_flags
from megatron_lrmoe.data.routing_traces import read_routing_trace
from megatron_lrmoe.options.lrmoe import option
from megatron_lrmoe.planning.clusters import CLUSTERS
from megatron_lrmoe.planning.models import ModelSpec
from megatron_lrmoe.planning.shapes import MoEShape
from megatron_lrmoe.tools import run_log
from megatron_lrmoe.tools.simulate import Policy, simulate

# The launcher's worker module; runs recorded before the package was laid out by role
# name it ``megatron_lrmoe.pretrain``.
LAUNCHER_MODULES = ("megatron_lrmoe.launcher.pretrain", "megatron_lrmoe.pretrain")


MOVED_DEFAULTS = {"--moe-lrmoe-selection": "uniform", "--moe-lrmoe-bwd-capacity-factor": "1.0"}
"""The LRMoE options whose defaults may move (docs/decisions.md, "The LRMoE layer"), at
the values every run recorded without a ``defaults`` field ran under; a record with one
holds its own (``recorded_defaults``)."""


def _dest(name: str) -> str:
    """A flag or config key as the launcher's parser names it (``--moe-lrmoe`` and
    ``moe_lrmoe`` are both ``moe_lrmoe``)."""
    return name.split("=", 1)[0].lstrip("-").replace("-", "_")


def recorded_defaults() -> dict[str, str]:
    """Today's defaults of the moved options (``MOVED_DEFAULTS``' flags), for a run's record:
    its command, replayed later, then reads as it ran whatever the defaults are by then."""
    out = {}
    for flag in MOVED_DEFAULTS:
        default = option(_dest(flag)).default
        out[flag] = f"{default:g}" if isinstance(default, float) else str(default)
    return out


def _named(flags: list[str]) -> dict[str, object]:
    """What the flags and the ``--config`` they name (the last; relative to the working
    folder, as the launcher reads it) set, by parser name; a flag with a value maps to
    True. A config not found here reads as none: the launcher's parse names it."""
    configs = [Path(flags[i + 1]) for i, f in enumerate(flags[:-1]) if f == "--config"]
    named = {}
    if configs and configs[-1].is_file():
        named = {_dest(str(k)): v for k, v in (yaml.safe_load(configs[-1].read_text())
                                                or {}).items()}
    return named | {_dest(f): True for f in flags if f.startswith("--")}


def run_flags(done: Path) -> list[str]:
    """The launcher flags of a finished run (after ``-m <the launcher's worker module>``).
    An LRMoE run's command gets the moved options that neither it nor its ``--config``
    names, at the defaults it ran under (its record's ``defaults``; ``MOVED_DEFAULTS``
    for a record written before)."""
    record = json.loads(done.read_text())
    command = shlex.split(record["command"])
    module = next((m for m in LAUNCHER_MODULES if m in command), None)
    if module is None:
        raise ValueError(f"{done}: no launcher module ({' or '.join(LAUNCHER_MODULES)}) "
                         "in its command")
    flags = command[command.index(module) + 1:]
    named = _named(flags)
    if named.get("moe_lrmoe"):
        defaults = record.get("defaults", MOVED_DEFAULTS)
        flags += [word for flag, value in defaults.items() if _dest(flag) not in named
                  for word in (flag, value)]
    return flags


# Flags of a recorded run that are not the model's or the batch's.
RUN_ONLY = ("--seed", "--record-routing", "--log-json", "--eval-interval", "--log-interval",
            "--data-path", "--data-cache-path")


RUN_RECORDS = ("done.json", "run.json")
"""The file of a finished run that holds its command: the time-to-loss driver's runs', the
EP regime's recordings' (``lrmoe_studies/ep_regime.py``)."""


def run_record(run: Path) -> Path:
    """The record of ``run`` (``RUN_RECORDS``, the first that exists; else ``done.json``,
    which a reader's error then names)."""
    return next((Path(run) / r for r in RUN_RECORDS if (Path(run) / r).exists()),
                Path(run) / RUN_RECORDS[0])


def reference_flags(run: Path) -> list[str]:
    """A measured run's launcher flags less its per-run ones (``RUN_ONLY``): the model and
    the batch that predictions, and runs compared with it, are made of."""
    return without_flags(run_flags(run_record(run)), RUN_ONLY)


def run_setting(flags: list[str], world_size: int
                ) -> tuple[MoEShape, Policy, float | None, int]:
    """(``MoEShape`` of a layer, ``Policy``, budget GiB or None, EP size) of a run's
    flags on ``world_size`` ranks; an ``auto`` budget resolved from
    ``--device-memory-gb`` as the launcher does."""
    from megatron_lrmoe.config.flags import tokens_per_rank
    from megatron_lrmoe.integration.planner_inputs import moe_shape
    from megatron_lrmoe.launcher.arguments import parse_args
    from megatron_lrmoe.launcher.run_config import build_config

    args = parse_args([f for f in flags if f != "--no-progress-bar"] + ["--no-progress-bar"],
                      world_size)
    # A run held to a device (``--moe-lrmoe-memory-budget-gb auto``) planned with the
    # budget its memory account left, resolved here as the launcher resolved it.
    config = build_config(args)
    # The rank's tokens (micro-batch x sequence, / TP under sequence parallelism) and the
    # micro-batches per step over the data-parallel size, as the launcher derives them.
    shape = moe_shape(config, tokens_per_rank(args), args.num_microbatches)
    if args.moe_lrmoe:
        policy = Policy("lrmoe", placement=args.moe_lrmoe_placement,
                        capacity_factor=args.moe_lrmoe_bwd_capacity_factor,
                        budget=args.moe_lrmoe_memory_budget_gb is not None,
                        slots_per_rank=args.moe_lrmoe_slots_per_rank)
    else:
        policy = Policy("megatron", moe_expert_capacity_factor=args.moe_expert_capacity_factor,
                        runs_planner=False)
    # With --moe-lrmoe the config's budget (an auto one resolved); without it, as given.
    budget = (config.moe_lrmoe_memory_budget_gb if args.moe_lrmoe
              else args.moe_lrmoe_memory_budget_gb)
    return shape, policy, budget, args.expert_model_parallel_size


def measured(log: Path) -> tuple[float, float, int, float | None]:
    """(forward s, backward s) per step, medians after the first tenth; steps used; the
    planner's logged host time per call (s, median; None where no planner ran)."""
    train = [r for r in run_log.read_records(log) if "moe-forward-s" in r]
    steady = train[len(train) // 10:] or train
    planner = [r["lrmoe/planner-ms-per-call"] / 1e3 for r in steady
               if "lrmoe/planner-ms-per-call" in r]
    return (statistics.median(r["moe-forward-s"] for r in steady),
            statistics.median(r["moe-backward-s"] for r in steady), len(steady),
            statistics.median(planner) if planner else None)


def recompute_reruns(shape: MoEShape) -> tuple[int, int]:
    """(layers, layers) whose MoE forward a recomputing run reruns per micro-batch, in the
    phase where the launcher's MoE timer counts the rerun (``launcher.moe_timing``): full
    recompute reruns the whole transformer layer, so the MoE layer's forward hooks fire
    again (forward); ``moe`` recompute reruns inside the layer's own backward interval
    (backward)."""
    if shape.recompute_moe:
        return 0, shape.rerun_layers
    return shape.rerun_layers, 0


def validate_run(run: Path, calibration: dict, budget_scale: float = 1.0) -> dict:
    """One run: its recorded routing replayed at its flags, simulated beside measured
    forward and backward seconds per step, the error of each and the simulated parts."""
    # The replay needs the run's shapes, not its corpus: mock data stands in for it, so a
    # checkout without the prepared data validates too.
    trace = read_routing_trace(run / "routing")
    shape, policy, budget_gib, ep = run_setting([*reference_flags(run), "--mock-data"],
                                                trace.world_size)
    skip = len(trace.iterations) // 10
    traces = [trace.layer(n)[skip:] for n in trace.layers]
    steps = max(1, (len(trace.iterations) - skip))
    model = ModelSpec(run.name, shape.num_layers, shape.hidden_size, shape.ffn_hidden_size,
                      shape.num_experts, shape.topk, shape.gated, shape.tokens_per_rank, 1,
                      shape.microbatches_per_step * ep)
    [result] = simulate(model, CLUSTERS["h100"], ep, traces, policies=(policy,), steps=steps,
                        budget_gib=None if budget_gib is None else budget_gib * budget_scale,
                        calibration=calibration, shape=shape, resample=False)
    # The replica sync splits into the refresh (weights, in forward) and the gradient
    # reduction (in the last backward), in proportion to their bytes.
    grad_bytes = shape.grad_dtype_bytes or shape.dtype_bytes
    refresh_share = shape.dtype_bytes / (shape.dtype_bytes + grad_bytes)
    sync = shape.num_layers * result.refresh_s_per_step
    per_step = shape.num_layers * shape.microbatches_per_step
    rerun_fwd, rerun_bwd = recompute_reruns(shape)
    fwd_sim = (per_step * result.forward_s + refresh_share * sync
               + rerun_fwd * shape.microbatches_per_step * result.forward_s)
    bwd_sim = (per_step * result.backward_s + (1 - refresh_share) * sync
               + rerun_bwd * shape.microbatches_per_step * result.forward_s)
    fwd_meas, bwd_meas, used, planner_logged = measured(run / "log.jsonl")
    return {"run": f"{run.parents[1].name}/{run.name}", "steps": used,
            "fwd_sim": fwd_sim, "fwd_meas": fwd_meas, "planner_logged": planner_logged,
            "bwd_sim": bwd_sim, "bwd_meas": bwd_meas,
            "fwd_err": fwd_sim / fwd_meas - 1, "bwd_err": bwd_sim / bwd_meas - 1,
            "parts": result.parts, "load": result.load_max_over_mean,
            "retained": result.retained_fraction}


def distinct_runs(studies: list[Path]) -> list[Path]:
    """Finished runs with a routing trace under ``studies``, each once: a stage that
    reuses another's runs (the confirmation keeps the screen's seed 1) holds copies,
    recognised by identical logs; the first study given keeps its copy."""
    runs, seen = [], set()
    for study in studies:
        for done in sorted(study.glob("runs/*/done.json")):
            run = done.parent
            if not (run / "routing" / "header.json").is_file():
                continue
            digest = hashlib.sha256(run_log.read_text(run / "log.jsonl").encode()).hexdigest()
            if digest not in seen:
                seen.add(digest)
                runs.append(run)
    return runs


def phase_split_error(row: dict) -> float:
    """The error of the backward-to-forward ratio, simulated over measured, minus 1: how
    the simulator splits a step between the phases, free of how fast the machine ran
    while the run was measured (a run measured on a faster or slower day moves both
    phases alike)."""
    return (row["bwd_sim"] / row["fwd_sim"]) / (row["bwd_meas"] / row["fwd_meas"]) - 1


def summary_table(rows: list[dict]) -> list[str]:
    """Per policy (runs of all seeds and studies): the median error and its range, and
    how many runs are within the +-15% target, forward and backward; and the median
    error of the phase split (``phase_split_error``)."""
    by_policy: dict[str, list[dict]] = {}
    for r in rows:
        by_policy.setdefault(re.sub(r"-s\d+$", "", r["run"].split("/")[-1]), []).append(r)

    def cell(errs: list[float]) -> str:
        inside = sum(abs(e) <= 0.15 for e in errs)
        return (f"{statistics.median(errs):+.1%} ({min(errs):+.1%}..{max(errs):+.1%}) | "
                f"{inside}/{len(errs)}")

    out = ["Per policy: median error over its runs (range), and runs within +-15%; bwd/fwd: "
           "the median error of the backward-to-forward ratio (free of the machine's speed "
           "on the day a run was measured).", "",
           "| policy | runs | fwd error | fwd within | bwd error | bwd within | bwd/fwd error |",
           "|---|---|---|---|---|---|---|"]
    for policy, group in sorted(by_policy.items()):
        split = statistics.median(phase_split_error(r) for r in group)
        out.append(f"| {policy} | {len(group)} | {cell([r['fwd_err'] for r in group])} | "
                   f"{cell([r['bwd_err'] for r in group])} | {split:+.1%} |")
    return out
