"""Configurations that fit a device, found the way a Megatron user finds them.

A run that does not fit its device is made to fit with Megatron's own means (``MEANS``):
``moe`` recompute, full recompute of the first n layers (block), a smaller micro-batch
with more micro-batches per step at the same global batch, and for SYMI-style fewer
replica slots. For a base run (the launcher's flags), a policy and a device size, this
module lists every such configuration and predicts, per rank:

* its memory: the memory account (planning/memory_account.py) of everything outside the
  MoE layers under the configuration's recompute and micro-batch, plus the MoE peak of
  the hottest rank from the simulator's replay of a recorded routing trace through the
  same planner and cost model (``simulate``: Megatron's layer priced by
  ``MegatronMoEMemory``, LRMoE's by ``CostModel``, both composed by ``stage_moe_memory``
  step by step: the most over every step, the warm-up included, of that step's levels
  with that step's replicas, so SYMI-style's fitted slots are those every step holds);
* its time: the simulated MoE time per step over the steps after the warm-up
  (``simulate.WARMUP_STEPS``; a recomputed layer's forward counted twice)
  and the time outside the MoE layers (``OutsideTime``: measured once on a reference run,
  or counted in FLOPs where none can be measured, ``lrmoe_studies/projections.py``; a recomputed
  layer's share of its forward counted again).

The study driver measures the two best-predicted configurations of each baseline that
fit (``best_fitting``); ``feasibility_table`` is what it prints before any run.
"""

from __future__ import annotations

import argparse
import math
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from megatron_lrmoe.planning.memory_account import GIB, MemoryAccount
from megatron_lrmoe.tools import run_log

if TYPE_CHECKING:
    from megatron_lrmoe.planning.shapes import MoEShape

__all__ = ["Candidate", "MemoryAccount", "OutsideTime", "Prediction", "best_fitting",
           "binding_conditions", "binding_interval", "budget_slots", "candidates", "device_sizes",
           "distinct", "feasibility_table", "fits_only_by", "full_recompute",
           "largest_micro_batch", "means_of", "policy_predictions", "predict",
           "reference_run", "replace", "step_parts"]

NONE = "none"
ROUTING_FOLDERS = ("routing", "trace")
"""Where a reference run keeps its recorded routing: the time-to-loss driver's runs, the
EP regime's recordings (``lrmoe_studies/ep_regime.py``)."""
FORWARD_SHARE = 1 / 3
"""The forward's share of a layer's time outside the MoE layers (backward ~ 2 x forward:
two GEMMs per forward one); what a recomputed layer costs again."""


@dataclass(frozen=True)
class Candidate:
    """One way to run a policy: what it gave up to fit (``fitted``) and its flags."""

    policy: str
    fitted: str
    """``none``, ``recompute moe``, ``recompute full <n>``, ``micro-batch <m>``,
    ``slots <s>`` (the study's report column)."""
    flags: tuple[str, ...] = ()
    """Launcher flags added after the base run's and the policy's."""


@dataclass(frozen=True)
class OutsideTime:
    """Seconds per step outside the MoE layers (attention, dense layers, embeddings, the
    optimizer), from a measured run of the same model and global batch: the median of
    ``step-time-s`` less the MoE forward and backward over its steps after the first
    tenth. The micro-batch split leaves it unchanged (same tokens per step)."""

    seconds: float
    source: str = ""

    @classmethod
    def from_log(cls, log: Path) -> OutsideTime:
        rows = [r for r in run_log.read_records(log) if "step-time-s" in r]
        steady = rows[len(rows) // 10:] or rows
        if not steady:
            raise ValueError(f"{log}: no step records (step-time-s)")
        seconds = statistics.median(r["step-time-s"] - r["moe-forward-s"] - r["moe-backward-s"]
                                    for r in steady)
        return cls(float(seconds), str(log))

    @classmethod
    def from_flops(cls, flops: float, peak_flops: float, efficiency: float,
                   source: str = "") -> OutsideTime:
        """Where no run can be measured (a GPU layout projected from here): ``flops`` per
        GPU and step outside the MoE layers (forward and backward, no recompute) at
        ``efficiency`` of the GPU's ``peak_flops`` (an assumption the caller states)."""
        if not (0 < efficiency <= 1) or peak_flops <= 0:
            raise ValueError(f"efficiency {efficiency} must be in (0, 1] and peak_flops "
                             f"{peak_flops} positive")
        seconds = flops / (peak_flops * efficiency)
        return cls(float(seconds), source or (f"{flops / 1e12:.4g} TFLOP per GPU and step at "
                                              f"{efficiency:g} of {peak_flops / 1e12:.4g} "
                                              "TFLOP/s"))

    def step_seconds(self, recomputed_layers: int, num_layers: int) -> float:
        """With ``recomputed_layers`` of ``num_layers`` rerun in full: their share of the
        forward again."""
        share = min(recomputed_layers, num_layers) / max(num_layers, 1)
        return self.seconds * (1 + FORWARD_SHARE * share)


@dataclass(frozen=True)
class Prediction:
    """A candidate at a device size: the account with the predicted MoE peak of the
    hottest rank as its MoE part, and the predicted seconds per step."""

    candidate: Candidate
    account: MemoryAccount
    moe_s: float
    """MoE time per optimizer step (simulated)."""
    step_s: float
    """``moe_s`` plus the time outside the MoE layers."""
    error: str = ""
    """Why the configuration cannot start at all (e.g. ``auto`` below the floor)."""
    parts_s: dict[str, float] = field(default_factory=dict)
    """``moe_s`` by part (``step_parts``): ``forward_*`` and ``backward_*`` as
    ``CostModel.layer_time_parts`` names them, and ``refresh``; they sum to ``moe_s``."""
    replicas: float = math.nan
    """Mean replicas per simulated layer over the counted steps."""
    retained: float = math.nan
    """Fraction of the routed pairs the backward kept (1.0: nothing dropped)."""

    @property
    def need(self) -> float:
        return self.account.total

    @property
    def fits(self) -> bool:
        return not self.error and (self.account.device is None
                                   or self.account.total <= self.account.device)


def candidates(policy: str, policy_flags: list[str], args: argparse.Namespace,
               slots_max: int | None = None, combine: bool = False) -> list[Candidate]:
    """Every configuration of ``policy`` the means give, ``none`` first. ``args``: the
    base run's parsed launcher arguments; ``slots_max``: SYMI-style's slots at the
    device's budget (the candidates are fewer, down to E/R: no replica). ``combine``:
    also two means at once, as a user combines them: a smaller micro-batch with each
    recompute, and fewer slots with each other means."""
    base = Candidate(policy, NONE, tuple(policy_flags))
    out = [base, replace(base, fitted="recompute moe", flags=base.flags + (
        "--recompute-granularity", "selective", "--recompute-modules", "moe"))]
    for n in range(1, _stage_layers(args) + 1):
        out.append(full_recompute(base, n))
    per_step = args.global_batch_size // _data_parallel(args)
    m = args.micro_batch_size // 2
    while m >= 1:
        if per_step % m == 0:
            out.append(replace(base, fitted=f"micro-batch {m}",
                               flags=base.flags + ("--micro-batch-size", str(m))))
        m //= 2
    slots = []
    if slots_max is not None:
        per_rank = args.num_experts // args.expert_model_parallel_size
        slots = [replace(base, fitted=f"slots {k}", flags=base.flags + (
            "--moe-lrmoe-slots-per-rank", str(k))) for k in range(slots_max - 1, per_rank - 1, -1)]
    singles, out = out, out + slots
    if combine:
        def both(a: Candidate, b: Candidate) -> Candidate:
            return replace(base, fitted=f"{a.fitted} + {b.fitted}",
                           flags=a.flags + b.flags[len(base.flags):])

        micro = [c for c in singles if c.fitted.startswith("micro-batch")]
        recompute = [c for c in singles if c.fitted.startswith("recompute")]
        out += [both(mb, rc) for mb in micro for rc in recompute]
        out += [both(c, k) for c in singles[1:] for k in slots]
    return out


def distinct(predictions: list[Prediction]) -> list[Prediction]:
    """``predictions`` less those that predict exactly what an earlier one does (a slot
    count at or above what the budget holds changes nothing): the fewest changes kept."""
    seen, out = set(), []
    for p in predictions:
        key = (p.error, round(p.need), round(p.moe_s, 9) if p.moe_s == p.moe_s else None)
        if key not in seen:
            seen.add(key)
            out.append(p)
    return out


def full_recompute(base: Candidate, layers: int) -> Candidate:
    """``base`` with the first ``layers`` layers of each stage recomputed in full (block)."""
    return replace(base, fitted=f"recompute full {layers}", flags=base.flags + (
        "--recompute-granularity", "full", "--recompute-method", "block",
        "--recompute-num-layers", str(layers)))


def _stage_layers(args: argparse.Namespace) -> int:
    """Layers of one pipeline stage (what ``--recompute-num-layers`` counts under block)."""
    return max(1, args.num_layers // args.pipeline_model_parallel_size)


def _data_parallel(args: argparse.Namespace) -> int:
    """The data-parallel size: the world over TP x PP, as the launcher derives it (the
    world size the flags were parsed with)."""
    return max(1, int(args.data_parallel_size))


def _parse(flags: list[str], world_size: int) -> argparse.Namespace:
    """The launcher's parse of ``flags`` for ``world_size`` ranks (derived values and
    checks as the runs' would be)."""
    from megatron_lrmoe.launcher.arguments import parse_args

    return parse_args([f for f in flags if f != "--no-progress-bar"] + ["--no-progress-bar"],
                      world_size)


def _full_recompute_layers(args: argparse.Namespace) -> int:
    """Layers of a stage full recompute reruns (the time outside the MoE layers: the
    MoE layers' own recompute is the shape's, ``recomputed_moe_layers``)."""
    if args.recompute_granularity != "full":
        return 0
    if args.recompute_method == "block":
        return int(args.recompute_num_layers or 0)
    return args.num_layers      # uniform: every layer, chunk by chunk


def predict(base_flags: list[str], candidate: Candidate, device_gib: float,
            traces: list[np.ndarray], calibration: dict | None, outside: OutsideTime,
            steps: int = 20, cluster: str = "h100",
            overrides: dict | None = None, planner_s: float | None = None,
            vocab_size: int | None = None, *, world_size: int) -> Prediction:
    """The candidate's per-rank memory and step time at ``device_gib`` (module doc), the
    flags parsed for ``world_size`` ranks.

    ``steps``: the steps the MoE time is the mean of, replayed after the warm-up
    (``simulate``'s window). ``cluster``: the ``planning.clusters.CLUSTERS`` entry whose figures
    price the MoE layers (``calibration``, which may be None, overrides them).
    ``overrides``: parsed launcher arguments set after parsing, for settings of a GPU run
    the launcher's parser has no flag for (e.g. ``accumulate_allreduce_grads_in_fp32``:
    False for bf16 gradients, which the memory account reads). ``planner_s``: the
    planner's host time per call (None: measured here, as ``simulate`` does).
    ``vocab_size``: the run's tokenizer vocabulary where the launcher's tokenizers
    (byte-level, SentencePiece from a file) cannot give it (a Hugging Face tokenizer's),
    padded as the model pads it; None: the tokenizer's."""
    from lrmoe_studies.simulator_validation import run_setting
    from megatron_lrmoe.config.flags import ConfigError
    from megatron_lrmoe.integration.planner_inputs import device_memory_bytes, memory_account
    from megatron_lrmoe.launcher import builders
    from megatron_lrmoe.launcher.run_config import build_config
    from megatron_lrmoe.planning.clusters import CLUSTERS
    from megatron_lrmoe.planning.models import ModelSpec
    from megatron_lrmoe.tools.simulate import simulate

    flags = [*base_flags, *candidate.flags, "--device-memory-gb", f"{device_gib:.6g}"]
    args = _parse(flags, world_size)
    for name, value in (overrides or {}).items():
        setattr(args, name, value)
    vocab = builders.padded_vocab_size(
        vocab_size or builders.build_tokenizer_from_args(args).vocab_size, args)
    try:
        config = build_config(args, vocab)
    except ConfigError as exc:
        empty = MemoryAccount(0.0, 0.0, 0.0, 0.0, 0.0, device_gib * GIB)
        return Prediction(candidate, empty, math.nan, math.nan, error=str(exc))
    flags = [*flags]
    if "auto" in flags:   # the resolved budget, as the launcher plans with it
        flags[flags.index("auto")] = f"{config.moe_lrmoe_memory_budget_gb:.9g}"
    shape, policy, budget_gib, ep = run_setting(flags, world_size)   # with the recompute
    policy = replace(policy, slots_per_rank=getattr(args, "moe_lrmoe_slots_per_rank", None))
    model = ModelSpec("fit", shape.num_layers, shape.hidden_size, shape.ffn_hidden_size,
                      shape.num_experts, shape.topk, shape.gated, shape.tokens_per_rank, 1,
                      shape.microbatches_per_step * ep)
    [result] = simulate(model, CLUSTERS[cluster], ep, traces, policies=(policy,), steps=steps,
                        budget_gib=budget_gib, calibration=calibration, shape=shape,
                        resample=True, planner_s=planner_s)
    account = memory_account(config, args, vocab, shape.microbatches_per_step,
                             device_memory_bytes(device_gib))
    account = replace(account, moe=result.memory_gib * GIB)
    moe_s = result.step_moe_s
    # Block recompute counts layers of a stage; uniform (all layers) every one.
    step_s = moe_s + outside.step_seconds(_full_recompute_layers(args), _stage_layers(args))
    return Prediction(candidate, account, moe_s, step_s,
                      parts_s=step_parts(result.parts, result.refresh_s_per_step, shape),
                      replicas=result.replicas, retained=result.retained_fraction)


def step_parts(parts: dict[str, float], refresh_s: float, shape: MoEShape
               ) -> dict[str, float]:
    """Seconds per optimizer step of each part of the simulator's MoE time:
    ``parts`` (``PolicyResult.parts``, per layer and micro-batch) over the stage's
    layers and micro-batches, a forward part once more for each layer whose forward is
    rerun in backward (``shape.rerun_layers``), and ``refresh`` (``refresh_s``, per layer
    and step) over the layers: the terms of ``simulate``'s ``step_moe_s``, split."""
    calls = shape.num_layers * shape.microbatches_per_step
    rerun = shape.rerun_layers * shape.microbatches_per_step
    out = {k: v * (calls + (rerun if k.startswith("forward_") else 0))
           for k, v in parts.items()}
    out["refresh"] = shape.num_layers * refresh_s
    return out


def reference_run(run: Path) -> tuple[list[np.ndarray], OutsideTime]:
    """A measured run's recorded routing per layer (past its first tenth, as the
    simulator's validation replays it) and its time outside the MoE layers: what the
    predictions of a study of the same model are made from. The routing is the run's
    folder ``routing`` or ``trace`` (``ROUTING_FOLDERS``), the log its ``log.jsonl``."""
    from megatron_lrmoe.data.routing_traces import read_routing_trace

    # ``routing``: the time-to-loss driver's runs; ``trace``: the EP regime's recordings.
    folder = next((Path(run) / d for d in ROUTING_FOLDERS if (Path(run) / d).exists()),
                  Path(run) / ROUTING_FOLDERS[0])
    trace = read_routing_trace(folder)
    skip = len(trace.iterations) // 10
    return ([trace.layer(n)[skip:] for n in trace.layers],
            OutsideTime.from_log(Path(run) / "log.jsonl"))


def budget_slots(base_flags: list[str], policy_flags: list[str], device_gib: float,
                 calibration: dict | None, cluster: str = "h100", *,
                 world_size: int) -> int:
    """The instance slots per rank SYMI-style's ``auto`` budget holds at ``device_gib``
    (``PlannerSettings.popularity_slots`` of the budget the simulator plans with), the
    most over its configurations without fewer slots (full recompute leaves more of the
    device to the MoE layers); E/R where the budget is below its floor."""
    from lrmoe_studies.simulator_validation import run_setting
    from megatron_lrmoe.config.flags import ConfigError
    from megatron_lrmoe.planning.clusters import CLUSTERS, cluster_machine_constants
    from megatron_lrmoe.planning.cost_model import CostModel
    from megatron_lrmoe.planning.planner import PlannerSettings
    from megatron_lrmoe.tools.simulate import layer_shape

    args = _parse(base_flags, world_size)
    most = args.num_experts // args.expert_model_parallel_size
    for c in candidates("symi", policy_flags, args):
        if MICRO_BATCH in means_of(c.fitted):
            continue
        try:
            shape, _, budget_gib, ep = run_setting(
                [*base_flags, *c.flags, "--device-memory-gb", f"{device_gib:.6g}"], world_size)
            cost = CostModel(layer_shape(shape, True),
                             cluster_machine_constants(CLUSTERS[cluster], ep, calibration))
            settings = PlannerSettings("popularity", ep, shape.num_experts,
                                       budget_bytes=budget_gib * GIB, cost=cost)
        except (ConfigError, ValueError):      # below the floor: cannot start at all
            continue
        most = max(most, settings.popularity_slots())
    return most


def policy_predictions(base_flags: list[str], policy: str, policy_flags: list[str],
                       baseline: bool, device_gib: float, traces: list[np.ndarray],
                       calibration: dict | None, outside: OutsideTime,
                       slots_max: int | None = None, *, world_size: int,
                       **predict_options) -> list[Prediction]:
    """A policy's predictions at ``device_gib``: a baseline's every configuration (single
    means and pairs; SYMI-style's slots below ``slots_max``, default E: those at or
    above what its budget holds predict what it does as it is, ``budget_slots`` spares
    their cost), ``distinct``; any other policy as it is (one prediction)."""
    args = _parse(base_flags, world_size)
    cands = (candidates(policy, policy_flags, args, combine=True,
                        slots_max=(slots_max or args.num_experts) if policy == "symi" else None)
             if baseline else [Candidate(policy, NONE, tuple(policy_flags))])
    return distinct([predict(base_flags, c, device_gib, traces, calibration, outside,
                             world_size=world_size, **predict_options) for c in cands])


def best_fitting(predictions: list[Prediction], count: int = 2) -> list[Prediction]:
    """The ``count`` fitting predictions with the least predicted step time."""
    fitting = [p for p in predictions if p.fits]
    return sorted(fitting, key=lambda p: p.step_s)[:count]


def device_sizes(outside_gib: float, dropless_moe_gib: float, lrmoe_need_gib: float,
                 over: float = 1.15, margin: float = 1.03) -> tuple[float, float]:
    """(D1, D2) in GiB. D1: the dropless hot rank's MoE peak exceeds the MoE share the
    device leaves by ``over`` (at least 15%, about Qwen3-30B-A3B at EP 8).
    D2: the smallest device LRMoE's default fits with ``margin`` (no dropless
    configuration fits without giving something up there, checked by the table)."""
    d1 = outside_gib + dropless_moe_gib / over
    d2 = lrmoe_need_gib * margin
    return d1, d2


RECOMPUTE, MICRO_BATCH, FEWER_REPLICAS = "recompute", "micro-batch", "slots"


def means_of(fitted: str) -> frozenset[str]:
    """The means a candidate gave up to fit (``Candidate.fitted``): a subset of
    ``RECOMPUTE``, ``MICRO_BATCH``, ``FEWER_REPLICAS``; empty for ``none``."""
    if fitted == NONE:
        return frozenset()
    return frozenset(part.split()[0] for part in fitted.split(" + "))


def fits_only_by(predictions: list[Prediction], allowed: set[str]) -> bool:
    """The policy does not fit as it is (its ``none`` prediction, the first) but some
    configuration that gives up only ``allowed`` means does."""
    as_it_is, *others = predictions
    return (as_it_is.candidate.fitted == NONE and not as_it_is.fits
            and any(p.fits and means_of(p.candidate.fitted) <= allowed for p in others))


def binding_conditions(lrmoe: list[Prediction], dropless: list[Prediction],
                       symi: list[Prediction]) -> dict[str, bool]:
    """The device the EP study holds its runs to, where memory binds as on GPUs: every
    LRMoE default fits as it is (``lrmoe``: one prediction each), dropless only by
    recompute, SYMI-style only by recompute or fewer replicas (each list: the policy's
    predictions at one device size, ``none`` first)."""
    return {"LRMoE default fits as it is": all(p.fits for p in lrmoe),
            "dropless fits only by recompute": fits_only_by(dropless, {RECOMPUTE}),
            "SYMI-style fits only by recompute or fewer replicas":
                fits_only_by(symi, {RECOMPUTE, FEWER_REPLICAS})}


def binding_interval(lrmoe: list[Prediction], dropless: list[Prediction],
                     symi: list[Prediction]) -> tuple[float, float]:
    """[low, high) in bytes: the device sizes at which ``binding_conditions`` hold for
    these predictions' needs (a need that does not change with the device; empty where
    low >= high). low: the largest of the LRMoE defaults' needs and the least need of
    dropless by recompute and of SYMI-style by recompute or fewer replicas; high: the
    least of dropless's and SYMI-style's needs as they are. An ``error`` (a budget below
    its floor: the device decides it) counts as not fitting."""
    def least(preds: list[Prediction], allowed: set[str]) -> float:
        return min((p.need for p in preds[1:] if not p.error
                    and means_of(p.candidate.fitted) <= allowed), default=math.inf)

    if any(p.error for p in lrmoe):
        return math.inf, -math.inf
    low = max(*(p.need for p in lrmoe), least(dropless, {RECOMPUTE}),
              least(symi, {RECOMPUTE, FEWER_REPLICAS}))
    # One that cannot start (``auto`` below the floor) does not fit as it is either.
    high = min((p.need for p in (dropless[0], symi[0]) if not p.error), default=math.inf)
    return low, high


def feasibility_table(rows: list[tuple[float, Prediction]]) -> str:
    """Markdown: per device size and candidate, the per-rank account, whether it fits and
    the predicted seconds per step."""
    out = ["| device GiB | policy | fitted | weights+grads+opt MiB | activations MiB | "
           "MoE MiB | need MiB | fits | MoE s/step | step s |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    mib = 2**20
    for device, p in rows:
        a = p.account
        if p.error:
            out.append(f"| {device:.4g} | {p.candidate.policy} | {p.candidate.fitted} | "
                       f"- | - | - | - | no: {p.error.splitlines()[0][:80]} | - | - |")
            continue
        out.append(f"| {device:.4g} | {p.candidate.policy} | {p.candidate.fitted} | "
                   f"{(a.weights + a.gradients + a.optimizer) / mib:.1f} | "
                   f"{a.activations / mib:.1f} | {a.moe / mib:.1f} | {a.total / mib:.1f} | "
                   f"{'yes' if p.fits else 'no'} | {p.moe_s:.3f} | {p.step_s:.3f} |")
    return "\n".join(out)


def largest_micro_batch(base_flags: list[str], policy: str, policy_flags: list[str],
                        device_gib: float, traces: list[np.ndarray], calibration: dict,
                        outside: OutsideTime, limit: int = 64, *, world_size: int,
                        **predict_options) -> tuple[int, Prediction | None]:
    """The largest micro-batch size (powers of two up to ``limit``, micro-batches per step
    unchanged) at which ``policy`` fits ``device_gib``, and its prediction (0, None when
    even 1 does not fit). The global batch grows with the micro-batch.
    ``predict_options``: ``predict``'s keywords (``steps``, ``cluster``, ``overrides``,
    ``planner_s``, ``vocab_size``)."""
    args = _parse(base_flags, world_size)
    dp, microbatches = _data_parallel(args), args.num_microbatches
    best: tuple[int, Prediction | None] = (0, None)
    m = 1
    while m <= limit:
        flags = ("--micro-batch-size", str(m), "--global-batch-size", str(m * microbatches * dp))
        p = predict(base_flags, Candidate(policy, f"micro-batch {m}", (*policy_flags, *flags)),
                    device_gib, traces, calibration, outside, world_size=world_size,
                    **predict_options)
        if not p.fits:
            break
        best = (m, p)
        m *= 2
    return best
