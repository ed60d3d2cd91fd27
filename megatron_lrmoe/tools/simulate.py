"""At-scale simulator: routing replayed through the project's planners and cost model.

    python -m megatron_lrmoe.tools.simulate --model qwen3-30b-a3b --cluster h100 --ep 8 16 32 64
    python -m megatron_lrmoe.tools.simulate --model glm45-air --cluster a100-40 \\
        --trace runs/glm/routing --out benchmarks/results/simulate

What it does, per EP size R and policy: builds R source ranks' routed counts per
micro-batch (from a recorded routing trace, or synthetic Zipf routing), feeds them to
the same ``LayerPlanner`` the layer runs (placement per step, capacity-aware routing
and retention quotas per micro-batch) and prices every plan with the same
``CostModel`` the planner uses, with machine constants derived from a named cluster.
Nothing here re-implements planning or pricing: the simulator only forms the inputs,
loops over steps and adds up.

Out, per policy: the critical-path MoE forward and backward time of one layer and
micro-batch (each phase paced by its slowest rank) and its parts (expert GEMM, memory-
bound row work, all-to-all bytes, router, fixed per-call cost, the planner's host time),
the replica refresh per step (means over the counted steps, after ``WARMUP_STEPS``), the
MoE memory per rank against the budget (the most over every step, the warm-up included,
of that step's own levels and replicas), the MoE time per optimizer step and, with
steps-to-target ratios measured by the time-to-loss study (an assumption, stated in the
report; the measured steps are read from ``--steps-to-target FILE``, e.g. the study's
benchmarks/results/time_to_loss/h384_f1024_mb4/steps_to_target.json in a checkout, or
given per policy by ``--steps-ratio``), the projected cumulative MoE time to the target
relative to dropless and to SYMI-style. docs/simulate.md describes the
assumptions.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
import yaml

from megatron_lrmoe.data.routing_traces import read_routing_trace, regroup_sources
from megatron_lrmoe.planning.clusters import CLUSTERS, ClusterSpec, cluster_machine_constants
from megatron_lrmoe.planning.cost_model import CostModel
from megatron_lrmoe.planning.megatron_baseline import (
    MegatronMoEMemory,
    megatron_kept_counts,
    steps_moe_memory,
)
from megatron_lrmoe.planning.memory_account import GIB
from megatron_lrmoe.planning.models import MODELS, ModelSpec
from megatron_lrmoe.planning.placement import Placement
from megatron_lrmoe.planning.planner import LayerPlanner, PlannerSettings
from megatron_lrmoe.planning.retention import RetentionPlan, retention_in_forward
from megatron_lrmoe.planning.shapes import InstanceRows, MoEShape
from megatron_lrmoe.tools.figures import FiguresUnavailable, pyplot, save_png
from megatron_lrmoe.tools.provenance import code_version

__all__ = ["POLICIES", "WARMUP_STEPS", "Policy", "StepsPair",
           "StepsToTarget", "call_memory_levels", "layer_shape", "load_steps_to_target",
           "model_from_config", "node_calibration", "policy_planner", "read_steps_to_target",
           "simulate", "source_batches", "steps_ratios"]

WARMUP_STEPS = 1
"""Steps replayed before the counted window: the planner's step 0 runs Megatron's static
placement with no smoothed counts; ``LayerPlanner.next_step`` folds step 0's loads, so
step 1 is the first whose placement is chosen from measured loads. Every policy alike:
the warm-up is left out of the times, never out of the memory."""


# What one machine measures of itself (``calibrate`` on one GPU): its expert GEMMs and
# memory-bound work. Its all-to-all there is a device memory copy, not the cluster's links.
_NODE_FIELDS = ("gemm_flops_per_s", "gemm_rows", "gemm_forward_flops_per_s",
                "gemm_backward_flops_per_s", "memory_bytes_per_s")
_FIXED_FIELDS = ("layer_forward_fixed_s", "layer_backward_fixed_s")
_MEGATRON_FIXED_FIELDS = ("megatron_forward_fixed_s", "megatron_backward_fixed_s")


def node_calibration(calibration: dict) -> dict:
    """The node-local part of a calibration file: GEMM rate and tables, memory rate, and
    the layers' fixed costs where measured (``calibrate`` writes 0 for the LRMoE layer's
    and null for Megatron's where it did not), with its ``source``; the interconnect is
    left to the cluster's figures."""
    kept = {k: calibration[k] for k in _NODE_FIELDS if k in calibration}
    kept |= {k: calibration[k] for k in _FIXED_FIELDS if calibration.get(k)}
    if calibration.get(_MEGATRON_FIXED_FIELDS[0]) is not None:    # a pair, kept together
        kept |= {k: calibration.get(k) for k in _MEGATRON_FIXED_FIELDS}
    if "gemm_flops_per_s" not in kept:
        raise ValueError("--calibration-scope node: the calibration has no gemm_flops_per_s")
    kept["source"] = calibration.get("source", "") + " (node-local fields only)"
    return kept


# ------------------------------------------------------------------------------- models
def model_from_config(name: str, path: Path) -> ModelSpec:
    """The ``ModelSpec`` of a launcher config (a flat YAML of flag names, as ``configs/``
    holds): ``--model-config``'s model."""
    with open(path) as f:
        c = yaml.safe_load(f)
    layers = int(c["num-layers"])
    return ModelSpec(name=name, num_layers=_moe_layer_count(c.get("moe-layer-freq", 1), layers),
                     hidden_size=int(c["hidden-size"]),
                     ffn_hidden_size=int(c["moe-ffn-hidden-size"]),
                     num_experts=int(c["num-experts"]), topk=int(c["moe-router-topk"]),
                     gated=bool(c.get("swiglu", False)), seq_length=int(c["seq-length"]),
                     micro_batch_size=int(c["micro-batch-size"]),
                     global_batch_size=int(c["global-batch-size"]))


def _moe_layer_count(freq: int | str, num_layers: int) -> int:
    """MoE layers of Megatron's ``--moe-layer-freq`` (an int, or a pattern such as
    ``([0]*1+[1]*45)``), parsed and counted as the launcher does."""
    from megatron_lrmoe.config.flags import moe_layer_freq
    from megatron_lrmoe.integration.planner_inputs import moe_layers_per_stage

    pattern = moe_layer_freq(freq)
    if isinstance(pattern, list) and len(pattern) != num_layers:
        raise ValueError(f"moe-layer-freq {freq!r} lists {len(pattern)} layers, the model "
                         f"has {num_layers}")
    return moe_layers_per_stage(num_layers, pattern, 1)


# ----------------------------------------------------------------------------- policies
SIMULATED_SELECTION = "uniform"
"""The selection rule of the simulator's LRMoE layer: its policies (``POLICIES``) name a
placement and gamma only, and were fitted and stored with this rule's shape (nothing
stored beyond the retained rows); the layer's default rule is ``two-stage``."""


@dataclass(frozen=True)
class Policy:
    """One way a Megatron user can run the MoE layers."""

    name: str
    placement: str = "static"
    capacity_factor: float = math.inf
    """LRMoE's backward capacity factor gamma (inf: nothing dropped in backward)."""
    budget: bool = False
    """Planned under the memory budget (routing capacities, gamma lowered to fit)."""
    moe_expert_capacity_factor: float | None = None
    """Megatron's --moe-expert-capacity-factor: forward and backward drop alike."""
    label: str = ""
    runs_planner: bool = True
    """The layer runs the LRMoE planner on the host every call (LRMoE and SYMI-style);
    False for Megatron's own layer, which the simulator plans only to form its loads
    and prices with ``MegatronMoEMemory``."""
    slots_per_rank: int | None = None
    """popularity: ``--moe-lrmoe-slots-per-rank`` (fewer replicas than the budget holds)."""

    def __post_init__(self) -> None:
        if self.budget and not self.runs_planner:
            raise ValueError(f"Policy {self.name!r}: a budget is planned by the LRMoE layer "
                             "(runs_planner=True)")


def layer_shape(shape: MoEShape, runs_planner: bool) -> MoEShape:
    """``shape`` as the policy's layer runs it. LRMoE's layer, as the simulator prices it
    (the uniform rule, whatever the layer's default), draws the retained set in forward and
    recomputes the activation in backward; Megatron's saved its output instead. Every
    budgeted policy runs LRMoE's layer, so ``layer_shape(shape, True)`` is the one shape
    that defines the budget."""
    return replace(shape, forward_retention=runs_planner
                   and retention_in_forward(SIMULATED_SELECTION, "grad_act"),
                   store_factor=shape.store_factor if runs_planner else None,
                   megatron_layer=not runs_planner)


POLICIES: tuple[Policy, ...] = (
    Policy("dropless", label="Megatron dropless", runs_planner=False),
    Policy("capacity-drop", moe_expert_capacity_factor=1.0,
           label="Megatron capacity drop, cf 1.0", runs_planner=False),
    Policy("symi", placement="popularity", budget=True, label="SYMI-style"),
    Policy("lrmoe-drop", capacity_factor=0.75, budget=True, label="LRMoE drop only, 0.75"),
    Policy("lrmoe-ma", placement="memory-aware", capacity_factor=1.0, budget=True,
           label="LRMoE memory-aware + drop, 1.0"),
)


def policy_planner(policy: Policy, ep_size: int, cost: CostModel,
                   budget_bytes: float) -> LayerPlanner:
    """One layer's planner as the simulator runs it for ``policy`` at ``ep_size`` ranks:
    ``budget_bytes`` per rank applies where the policy plans under a budget."""
    return LayerPlanner(PlannerSettings(
        policy.placement, ep_size, cost.shape.num_experts,
        capacity_factor=policy.capacity_factor, slots_per_rank=policy.slots_per_rank,
        budget_bytes=budget_bytes if policy.budget else None, cost=cost))


# ------------------------------------------------------------------------------ routing
def call_memory_levels(policy: Policy, cost: CostModel, megatron: MegatronMoEMemory,
                       plan: RetentionPlan, counts: np.ndarray, placement: Placement,
                       last: bool) -> tuple[np.ndarray, np.ndarray]:
    """([R] saved bytes, [R] peak bytes) of one MoE layer's forward+backward of one
    micro-batch on each rank, as the simulator prices it before composing a stage
    (``stage_moe_memory``): ``CostModel.plan_levels`` of the plan for policies that run
    the planner (with ``placement``'s replicas, their weights excluded, and when the
    call is its step's ``last`` micro-batch the replicas' gradients returned home), else
    ``MegatronMoEMemory.rank_memory`` of the [R, E] counts Megatron's layer moves."""
    if policy.runs_planner:
        replicas = np.asarray(placement.replicas_per_rank())
        returned = cost.returned_gradient_bytes(placement) if last else 0.0
        return cost.plan_levels(plan, replicas, returned)
    return megatron.rank_memory(counts)


def source_batches(trace: np.ndarray, ep_size: int, pairs_per_rank: int | None,
                   rng: np.random.Generator) -> Iterator[np.ndarray]:
    """[R, E] routed counts per micro-batch for R = ``ep_size`` sources, from a trace.

    ``trace`` [..., E]: one layer's recorded routed counts, rows in time order (a
    recorded trace's [steps, micro-batches, sources, E]). R sources are formed as
    ``routing_trace.regroup_sources`` forms them: every R consecutive non-empty rows
    are the ranks of one micro-batch. Each row is then resampled to
    ``pairs_per_rank`` pairs (multinomial over its own expert shares), so a small
    model's trace is replayed at the target's tokens per rank with the sampling noise
    of that size; ``pairs_per_rank=None`` keeps the recorded counts. The calls are
    cycled when exhausted.
    """
    rows = trace.reshape(-1, trace.shape[-1])
    rows = rows[rows.sum(1) > 0]
    calls = regroup_sources(rows, ep_size).astype(np.float64)         # [N, R, E]
    if not len(calls):
        raise ValueError(f"the trace has {len(rows)} non-empty source rows, fewer than one "
                         f"micro-batch at EP={ep_size}")
    if pairs_per_rank is None:
        while True:
            yield from calls.astype(np.int64)
    shares = calls / calls.sum(-1, keepdims=True)
    while True:
        for call in shares:
            yield np.stack([rng.multinomial(pairs_per_rank, p) for p in call]).astype(np.int64)


def synthetic_trace(num_calls: int, num_experts: int, pairs: int, zipf: float, drift: float,
                    rng: np.random.Generator) -> np.ndarray:
    """[N, 1, E] Zipf(``zipf``) routing over a random expert order whose log-popularity
    drifts by ``drift`` (a Gaussian random walk per call): a stand-in when no trace is
    given."""
    base = -zipf * np.log(np.arange(1, num_experts + 1))[rng.permutation(num_experts)]
    out = np.empty((num_calls, 1, num_experts), dtype=np.int64)
    logits = base.copy()
    for n in range(num_calls):
        p = np.exp(logits - logits.max())
        out[n, 0] = rng.multinomial(pairs, p / p.sum())
        logits += drift * rng.standard_normal(num_experts)
    return out


# --------------------------------------------------------------------------- simulation
@dataclass
class PolicyResult:
    """One policy at one EP size, per layer and micro-batch unless named otherwise."""

    policy: str
    label: str
    ep_size: int
    forward_s: float
    backward_s: float
    parts: dict[str, float]
    """Mean seconds of each part (``CostModel.layer_time_parts``' keys): forward/backward
    GEMM, memory, all-to-all, router, fixed, and the forward's planner."""
    refresh_s_per_step: float
    """Replica refresh + gradient reduction per layer and step."""
    step_moe_s: float
    """MoE time of one optimizer step, all layers (critical path)."""
    memory_gib: float
    """Peak MoE memory per rank, all layers of the stage (the cost model's): the most
    over every replayed step, the warm-up included, of that step's own levels and
    replicas (``steps_moe_memory``)."""
    budget_gib: float
    load_max_over_mean: float
    retained_fraction: float
    replicas: float
    """Mean replicas per layer."""
    memory_step: int = 0
    """The replayed step (0: the first warm-up step) whose memory is ``memory_gib``."""


def simulate(model: ModelSpec, cluster: ClusterSpec, ep_size: int, traces: list[np.ndarray],
             policies: tuple[Policy, ...] = POLICIES, steps: int = 8,
             warmup_steps: int = WARMUP_STEPS,
             budget_instances: float = 2.0, budget_gib: float | None = None,
             calibration: dict | None = None, pipeline: int = 1,
             seed: int = 0, shape: MoEShape | None = None,
             resample: bool = True, planner_s: float | None = None) -> list[PolicyResult]:
    """Replay ``traces`` (per simulated layer, its routed counts [..., E] with rows in
    time order, as ``load_traces`` returns them) at ``ep_size``.

    The budget, per rank for the stage's MoE layers, is ``budget_gib`` or the balanced
    dropless need plus ``budget_instances`` expert instances per layer (the
    time-to-loss study's setting), the need of the shape the budgeted policies are planned with
    (``layer_shape(shape, True)``). Layers beyond the simulated ones are assumed to
    behave like their mean.

    The window: ``warmup_steps`` steps are replayed first (``WARMUP_STEPS``: the steps
    before the first placement chosen from measured loads), then ``steps`` counted ones.
    Times, loads, retention and replicas are means over the counted steps only; the
    memory is the most over all of them, the warm-up included, each step's own saved
    bytes and peak with that step's replicas (``steps_moe_memory``): a plan must fit
    every step.
    ``shape`` replaces ``model.shape(ep_size, pipeline)`` (a measured run's own shape);
    ``resample=False`` replays the recorded counts as they are (they must already hold
    the shape's pairs per rank), as the validation against measured runs does.
    ``planner_s``: the planner's host time per call charged to the forward of policies
    that run it; None measures it here (wall time of each call's ``observe``, ``plan``
    and, with the compiled planner, the call layout of rank 0, as the layer times them),
    on this machine's CPU.
    """
    shape = shape or model.shape(ep_size, pipeline)
    if steps < 1 or warmup_steps < 0:
        raise ValueError(f"simulate: steps {steps} must be >= 1 and warmup_steps "
                         f"{warmup_steps} >= 0")
    if shape.num_experts % ep_size:
        raise ValueError(f"--ep {ep_size}: {shape.num_experts} experts are not a multiple")
    machine = cluster_machine_constants(cluster, ep_size, calibration)
    need = CostModel(layer_shape(shape, True), machine).balanced_dropless_need()
    budget = (budget_gib * GIB if budget_gib is not None
              else need + budget_instances * shape.instance_bytes * shape.num_layers)
    results = []
    for policy in policies:
        cost = CostModel(layer_shape(shape, policy.runs_planner), machine)
        megatron = MegatronMoEMemory(cost.shape, grouped=shape.grouped_gemm)
        totals = {"fwd": 0.0, "bwd": 0.0, "refresh": 0.0, "routed": 0.0,
                  "retained": 0.0, "load": 0.0, "replicas": 0.0}
        # [steps replayed][layer] -> (saved, peak, replica bytes), each [R]: the most
        # over the step's micro-batches, composed per step below.
        replayed = warmup_steps + steps
        step_levels = np.zeros((3, replayed, len(traces), ep_size))
        parts: dict[str, float] = {}
        calls = 0
        for layer, trace in enumerate(traces):
            rng = np.random.default_rng([seed, layer])
            batches = source_batches(trace, ep_size, shape.source_pairs if resample else None,
                                     rng)
            planner = policy_planner(policy, ep_size, cost, budget)
            for t in range(replayed):
                counted = t >= warmup_steps
                levels = step_levels[:, t, layer]
                for micro in range(shape.microbatches_per_step):
                    counts = next(batches)
                    if policy.moe_expert_capacity_factor is not None:
                        counts = megatron_kept_counts(
                            counts, shape.tokens_per_rank, shape.topk,
                            policy.moe_expert_capacity_factor).astype(counts.dtype)
                    counts_t = torch.from_numpy(counts)
                    started = time.perf_counter()
                    planner.observe(counts_t)
                    mb_plan = planner.plan(counts_t)
                    planner.native_layout(mb_plan, 0)   # the call layout, as the layer
                    plan = mb_plan.retention
                    host = time.perf_counter() - started if planner_s is None else planner_s
                    replicas = np.asarray(planner.placement.replicas_per_rank())
                    s_call, p_call = call_memory_levels(
                        policy, cost, megatron, plan, counts, planner.placement,
                        micro == shape.microbatches_per_step - 1)
                    np.maximum(levels[0], s_call, out=levels[0])
                    np.maximum(levels[1], p_call, out=levels[1])
                    np.maximum(levels[2], replicas * shape.instance_bytes, out=levels[2])
                    if not counted:     # warm-up: its memory only
                        continue
                    routed = plan.routed_matrix.numpy()
                    retained = plan.retained_matrix.numpy()
                    p = cost.layer_time_parts(routed, retained,
                                              host if policy.runs_planner else 0.0,
                                              InstanceRows.of_plan(plan))
                    for k, v in p.items():
                        parts[k] = parts.get(k, 0.0) + v
                    totals["fwd"] += sum(v for k, v in p.items() if k.startswith("forward_"))
                    totals["bwd"] += sum(v for k, v in p.items() if k.startswith("backward_"))
                    per_rank = plan.routed_per_rank.numpy().astype(np.float64)
                    totals["load"] += float(per_rank.max() / max(per_rank.mean(), 1e-12))
                    totals["routed"] += float(per_rank.sum())
                    totals["retained"] += float(plan.retained_per_rank.numpy().sum())
                    calls += 1
                if counted:
                    placement = planner.placement
                    totals["refresh"] += cost.replica_sync_time(
                        placement.replicas, ep_size, placement.experts_per_rank)
                    totals["replicas"] += len(placement.replicas)
                planner.next_step()
        n_layers = len(traces)
        per_call = {k: v / calls for k, v in parts.items()}
        fwd, bwd = totals["fwd"] / calls, totals["bwd"] / calls
        refresh = totals["refresh"] / (n_layers * steps)
        # Recompute reruns forwards in backward: every layer's (moe) or the block's (full).
        step = (shape.num_layers * (shape.microbatches_per_step * (fwd + bwd) + refresh)
                + shape.rerun_layers * shape.microbatches_per_step * fwd)
        # The stage's layers beyond the simulated ones repeat them in turn, step by step.
        stage = step_levels[:, :, [i % n_layers for i in range(shape.num_layers)]]
        by_step = steps_moe_memory(*stage, shape.output_bytes, shape.microbatches_in_flight,
                                   shape.recompute_moe, shape.full_recompute_layers)
        peak_step = int(np.argmax(by_step.max(axis=1)))
        results.append(PolicyResult(
            policy=policy.name, label=policy.label or policy.name, ep_size=ep_size,
            forward_s=fwd, backward_s=bwd, parts=per_call, refresh_s_per_step=refresh,
            step_moe_s=step, memory_gib=float(by_step[peak_step].max()) / GIB,
            budget_gib=budget / GIB, load_max_over_mean=totals["load"] / calls,
            retained_fraction=totals["retained"] / max(totals["routed"], 1.0),
            replicas=totals["replicas"] / (n_layers * steps), memory_step=peak_step))
    return results


# ------------------------------------------------------------------------------ report
# The steps-to-target figures are measured data, so they live with the study they come
# from, not in the package: a steps_to_target.json lists, per policy, (policy's steps, the
# same seed's dropless steps) to the dropless run's 100% loss target with the runs and the
# commit of each (docs/simulate.md, "Outputs"). A policy's ratio is the median of its
# per-pair ratios: an assumption at other scales; --steps-ratio sets single policies.


def _steps(value: object) -> bool:
    # bool is an int to Python, but true/false in the file is a typo, not a step count.
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True)
class StepsPair:
    """One seed's pair of a steps-to-target file: the policy's steps and the same seed's
    dropless run's steps to the target. ``seed``: (corpus, seed) where the file gives
    them (None otherwise): two policies' pairs of one seed share the dropless run."""

    steps: int
    dropless_steps: int
    seed: tuple[str | None, int] | None = None


@dataclass(frozen=True)
class StepsToTarget:
    """A steps-to-target file: per policy its pairs and the study's name of the run."""

    path: Path
    pairs: dict[str, tuple[StepsPair, ...]]
    study_policy: dict[str, str]


def read_steps_to_target(path: Path, flag: str = "--steps-to-target",
                         wanted: tuple[str, ...] | None = None) -> StepsToTarget:
    """A steps-to-target file (the time-to-loss study's: ``lrmoe_studies.steps_to_target``
    writes them; its ``"what"``
    and ``"fields"`` describe the format) with the policies of ``wanted`` (default: every
    simulator policy other than dropless), in that order; others of ``POLICIES`` may be
    present and are read too. Raises ValueError naming ``flag`` and the file when it is
    missing or malformed."""
    def bad(problem: str) -> ValueError:
        return ValueError(f"{flag} {path}: {problem}")

    try:
        doc = json.loads(Path(path).read_text())
    except OSError as e:
        raise bad(f"cannot read it ({e.strerror or e})") from e
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad(f"not JSON ({e})") from e
    policies = doc.get("policies") if isinstance(doc, dict) else None
    if not isinstance(policies, dict):
        raise bad('expected a JSON object with a "policies" object')
    known = [p.name for p in POLICIES if p.name != "dropless"]
    # Every policy the caller prices needs its figures: one left out would project
    # to NaN (or, for SYMI-style, silently to 1.0 in the "vs SYMI" column).
    wanted = tuple(known) if wanted is None else wanted
    unknown = sorted(set(policies) - set(known))
    missing = [name for name in wanted if name not in policies]
    if unknown or missing:
        need = ("exactly " if len(wanted) == len(known) else "") + ", ".join(wanted)
        raise bad(f"policies must be {need} (dropless is 1 by definition); unknown: "
                  f"{', '.join(unknown) or '-'}, missing: {', '.join(missing) or '-'}")
    pairs: dict[str, tuple[StepsPair, ...]] = {}
    study: dict[str, str] = {}
    for name in [*wanted, *(n for n in known if n in policies and n not in wanted)]:
        entry = policies[name]
        listed = entry.get("pairs") if isinstance(entry, dict) else None
        if not isinstance(listed, list) or not listed:
            raise bad(f'policy {name!r}: expected {{"pairs": [...]}} with at least one pair')
        for i, pair in enumerate(listed):
            if not (isinstance(pair, dict) and _steps(pair.get("steps"))
                    and _steps(pair.get("dropless_steps"))):
                raise bad(f'policy {name!r}, pair {i}: expected "steps" and "dropless_steps" '
                          f"as integers >= 1, got {pair!r}")
        pairs[name] = tuple(StepsPair(
            p["steps"], p["dropless_steps"],
            (p.get("corpus"), p["seed"]) if isinstance(p.get("seed"), int) else None)
            for p in listed)
        study[name] = str(entry.get("study_policy", name))
    return StepsToTarget(Path(path), pairs, study)


def load_steps_to_target(path: Path) -> dict[str, tuple[tuple[int, int], ...]]:
    """Per policy other than dropless (``POLICIES`` order), its (steps, the same seed's
    dropless steps) pairs from a steps-to-target file (``read_steps_to_target``; every
    policy required). Raises ValueError naming ``--steps-to-target`` and the file when
    it is missing or malformed."""
    return {name: tuple((p.steps, p.dropless_steps) for p in pairs)
            for name, pairs in read_steps_to_target(path).pairs.items()}


def steps_ratios(steps_to_target: dict[str, tuple[tuple[int, int], ...]]) -> dict[str, float]:
    """Steps to target relative to dropless per policy: dropless 1, every other policy the
    median of its pairs' steps / dropless steps."""
    return {"dropless": 1.0} | {
        name: statistics.median(steps / dropless for steps, dropless in pairs)
        for name, pairs in steps_to_target.items()}


PART_NAMES = ("gemm", "memory", "alltoall", "router", "fixed", "planner")


def parts_text(parts: dict[str, float], phase: str) -> str:
    """'a / b / ...' ms of one phase's parts in ``PART_NAMES`` order (those it has)."""
    return " / ".join(f"{parts[f'{phase}_{name}'] * 1e3:.2f}" for name in PART_NAMES
                      if f"{phase}_{name}" in parts)


def report_table(model: ModelSpec, cluster: ClusterSpec, by_ep: dict[int, list[PolicyResult]],
                 steps_ratio: dict[str, float]) -> str:
    lines = ["| EP | policy | fwd ms | bwd ms | fwd GEMM / memory / a2a / router / fixed / "
             "planner ms | bwd GEMM / memory / a2a / router / fixed ms | refresh ms/step | "
             "load max/mean | retained | replicas | MoE GiB/rank (budget) | MoE s/step | "
             "vs dropless | to target vs dropless | vs SYMI |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for ep, results in by_ep.items():
        base = {r.policy: r for r in results}
        dropless = base["dropless"].step_moe_s * steps_ratio.get("dropless", 1.0)
        symi = (base["symi"].step_moe_s * steps_ratio.get("symi", 1.0)
                if "symi" in base else math.nan)
        for r in results:
            to_target = r.step_moe_s * steps_ratio.get(r.policy, math.nan)
            lines.append(
                f"| {ep} | {r.label} | {r.forward_s * 1e3:.2f} | {r.backward_s * 1e3:.2f} | "
                f"{parts_text(r.parts, 'forward')} | {parts_text(r.parts, 'backward')} | "
                f"{r.refresh_s_per_step * 1e3:.2f} | {r.load_max_over_mean:.2f} | "
                f"{r.retained_fraction:.3f} | {r.replicas:.1f} | {r.memory_gib:.2f} "
                f"({r.budget_gib:.2f}) | {r.step_moe_s:.3f} | "
                f"{r.step_moe_s / base['dropless'].step_moe_s:.3f} | "
                f"{to_target / dropless:.3f} | {to_target / symi:.3f} |")
    return "\n".join(lines)


def plot(by_ep: dict[int, list[PolicyResult]], steps_ratio: dict[str, float], path: Path,
         title: str) -> None:
    plt = pyplot()

    eps = list(by_ep)
    policies = [r.policy for r in by_ep[eps[0]]]
    labels = {r.policy: r.label for r in by_ep[eps[0]]}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / len(policies)
    for i, name in enumerate(policies):
        xs = [j + i * width for j in range(len(eps))]
        rows = [{r.policy: r for r in by_ep[ep]}[name] for ep in eps]
        fwd = [r.step_moe_s * r.forward_s / (r.forward_s + r.backward_s) for r in rows]
        bwd = [r.step_moe_s - f for r, f in zip(rows, fwd, strict=True)]
        bars = axes[0].bar(xs, fwd, width, label=labels[name])
        axes[0].bar(xs, bwd, width, bottom=fwd, color=bars[0].get_facecolor(), alpha=0.5)
        dropless = [{r.policy: r for r in by_ep[ep]}["dropless"].step_moe_s for ep in eps]
        axes[1].plot(eps, [r.step_moe_s * steps_ratio.get(name, math.nan) / d
                           for r, d in zip(rows, dropless, strict=True)],
                     marker="o", label=labels[name])
    axes[0].set_xticks([j + 0.4 - width / 2 for j in range(len(eps))], [str(e) for e in eps])
    axes[0].set_xlabel("EP size")
    axes[0].set_ylabel("MoE s per step (solid: forward, light: backward)")
    axes[0].legend(fontsize=7)
    axes[1].set_xscale("log", base=2)
    axes[1].set_xticks(eps, [str(e) for e in eps])
    axes[1].axhline(1.0, color="grey", lw=0.8)
    axes[1].set_xlabel("EP size")
    axes[1].set_ylabel("projected MoE time to target / dropless")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    save_png(fig, path)
    plt.close(fig)


def load_traces(path: Path, num_experts: int, layers: int,
                skip_fraction: float) -> tuple[list[np.ndarray], str]:
    """Per-layer [steps, micro-batches, sources, E] counts of a trace recorded with
    ``--record-routing`` (``routing_trace.read_routing_trace``), the first
    ``skip_fraction`` of its steps left out (routing before the router has settled)."""
    trace = read_routing_trace(path)
    if trace.num_experts != num_experts:
        raise ValueError(f"--trace {path}: {trace.num_experts} experts, the model has "
                         f"{num_experts}")
    first = int(len(trace.iterations) * skip_fraction)
    if first >= len(trace.iterations):
        raise ValueError(f"--trace {path}: no recorded step left after --skip-fraction "
                         f"{skip_fraction:g}")
    chosen = trace.layers[:layers]
    source = (f"recorded trace {path} (layers {chosen}, steps {trace.iterations[first]}-"
              f"{trace.iterations[-1]}, {trace.header['parallel']['ep']} EP ranks recorded)")
    return [trace.layer(n)[first:] for n in chosen], source


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatron_lrmoe.tools.simulate",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="qwen3-30b-a3b",
                    help="a model the package ships (planning/models.py)")
    ap.add_argument("--model-config", type=Path, default=None, metavar="FILE",
                    help="another model: a launcher config (flat YAML of flag names, as "
                         "the repository's configs/ hold), instead of --model")
    ap.add_argument("--cluster", choices=sorted(CLUSTERS), default="h100")
    ap.add_argument("--ep", type=int, nargs="+", default=[8, 16, 32, 64])
    ap.add_argument("--trace", type=Path, default=None,
                    help="a routing trace directory written by --record-routing; default: "
                         "synthetic Zipf routing")
    ap.add_argument("--skip-fraction", type=float, default=0.5,
                    help="leading fraction of the trace's steps left out")
    ap.add_argument("--zipf", type=float, default=0.8, help="synthetic routing skew")
    ap.add_argument("--drift", type=float, default=0.02, help="synthetic popularity drift")
    ap.add_argument("--layers", type=int, default=4, help="layers simulated (of the trace)")
    ap.add_argument("--steps", type=int, default=6,
                    help="optimizer steps per layer counted in the times, after the warm-up")
    ap.add_argument("--warmup-steps", type=int, default=WARMUP_STEPS,
                    help="steps replayed first and left out of the times (not of the "
                         "memory): the steps before the first placement from measured "
                         "loads")
    ap.add_argument("--pipeline", type=int, default=1, help="PP size (micro-batches in flight)")
    ap.add_argument("--global-batch-size", type=int, default=None,
                    help="sequences per optimizer step, replacing the model config's (sets "
                         "the micro-batches per step: GBS / (micro-batch size x EP))")
    ap.add_argument("--budget-gib", type=float, default=None,
                    help="MoE memory budget per rank; default: balanced dropless need + "
                         "--budget-instances expert instances per layer")
    ap.add_argument("--budget-instances", type=float, default=2.0)
    ap.add_argument("--calibration", type=Path, default=None,
                    help="JSON overriding ClusterSpec or MachineConstants fields")
    ap.add_argument("--calibration-scope", choices=("all", "node"), default="all",
                    help="node: take only what one GPU measures of itself from --calibration "
                         "(GEMM rate and tables, memory rate, a measured layer fixed cost); "
                         "the interconnect stays the cluster's (a one-GPU calibration's "
                         "all-to-all is a memory copy)")
    ap.add_argument("--steps-to-target", type=Path, default=None, metavar="FILE",
                    help="JSON of measured steps to the loss target per policy and seed, "
                         "whose per-policy median ratio to dropless scales the projection "
                         "(in a checkout, the time-to-loss study's: benchmarks/results/"
                         "time_to_loss/h384_f1024_mb4/steps_to_target.json); without it "
                         "only --steps-ratio's policies get a time to target")
    ap.add_argument("--steps-ratio", nargs="*", default=[], metavar="POLICY=RATIO",
                    help="steps to target relative to dropless, replacing --steps-to-target's "
                         "for the policies given")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--planner-ms", type=float, default=None,
                    help="the planner's host time per call (ms) for the policies that run it; "
                         "default: measured here per call (this CPU for the cluster's hosts)")
    ap.add_argument("--out", type=Path, default=None,
                    help="directory for simulate_<model>_<cluster>.md and .png")
    args = ap.parse_args(argv)

    model = (MODELS[args.model] if args.model_config is None
             else model_from_config(args.model_config.stem, args.model_config))
    if args.global_batch_size is not None:
        if args.global_batch_size < 1:
            raise SystemExit(f"--global-batch-size {args.global_batch_size}: expected >= 1")
        model = replace(model, global_batch_size=args.global_batch_size)
    cluster = CLUSTERS[args.cluster]
    calibration = json.loads(args.calibration.read_text()) if args.calibration else None
    if calibration is not None and args.calibration_scope == "node":
        calibration = node_calibration(calibration)
    steps_ratio = {"dropless": 1.0}       # the reference, measured or not
    if args.steps_to_target is not None:
        try:
            steps_ratio = steps_ratios(load_steps_to_target(args.steps_to_target))
        except ValueError as e:
            raise SystemExit(str(e)) from e
    names = sorted(p.name for p in POLICIES)
    for item in args.steps_ratio:
        name, _, value = item.partition("=")
        if name not in names or not value:
            raise SystemExit(f"--steps-ratio {item!r}: expected POLICY=RATIO with POLICY in "
                             f"{names}")
        steps_ratio[name] = float(value)
    if args.trace is not None:
        traces, source = load_traces(args.trace, model.num_experts, args.layers,
                                      args.skip_fraction)
    else:
        rng = np.random.default_rng(args.seed)
        pairs = model.seq_length * model.micro_batch_size * model.topk
        traces = [synthetic_trace(512, model.num_experts, pairs, args.zipf, args.drift, rng)
                  for _ in range(args.layers)]
        source = (f"synthetic Zipf({args.zipf:g}) routing over a random expert order per "
                  f"layer, log-popularity drift {args.drift:g} per call")
    by_ep = {ep: simulate(model, cluster, ep, traces, steps=args.steps,
                          warmup_steps=args.warmup_steps,
                          budget_instances=args.budget_instances, budget_gib=args.budget_gib,
                          calibration=calibration, pipeline=args.pipeline, seed=args.seed,
                          planner_s=None if args.planner_ms is None else args.planner_ms / 1e3)
             for ep in args.ep}
    table = report_table(model, cluster, by_ep, steps_ratio)
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        stem = f"simulate_{model.name}_{args.cluster}"
        machine = {ep: asdict(cluster_machine_constants(cluster, ep, calibration))
                   for ep in args.ep}
        command = " ".join(shlex.quote(a) for a in
                           ["python", "-m", "megatron_lrmoe.tools.simulate",
                            *(sys.argv[1:] if argv is None else argv)])
        title = f"{model.name} on {cluster.gpu} nodes: projected MoE time ({source[:60]})"
        try:
            plot(by_ep, steps_ratio, args.out / f"{stem}.png", title)
        except FiguresUnavailable as exc:     # the tables are the result; the figure is extra
            print(f"note: no {stem}.png: {exc}", file=sys.stderr)
        (args.out / f"{stem}.md").write_text("\n".join([
            f"# Simulated MoE time: {model.name} on {cluster.gpu} nodes", "",
            f"- command: `{command}`", f"- code: {code_version(('megatron_lrmoe', 'configs'))}",
            f"- routing: {source}; {args.layers} layer(s) x {args.steps} step(s) per policy "
            f"after {args.warmup_steps} warm-up step(s) (left out of the times; the memory "
            "is the most over every step, each with its own replicas)",
            f"- model: {asdict(model)}",
            f"- cluster: {asdict(cluster)} (efficiencies and latencies are assumptions)",
            "- machine constants per EP size: " + "; ".join(
                f"EP {ep}: GEMM {m['gemm_flops_per_s'] / 1e12:.0f} TFLOP/s, all-to-all "
                f"{m['alltoall_bytes_per_s'] / 1e9:.1f} GB/s, latency "
                f"{m['alltoall_latency_s'] * 1e6:.0f} us, memory "
                f"{m['memory_bytes_per_s'] / 1e12:.2f} TB/s, fixed per call "
                f"{m['layer_forward_fixed_s'] * 1e6:.0f} / "
                f"{m['layer_backward_fixed_s'] * 1e6:.0f} us" for ep, m in machine.items()),
            ("- planner host time: measured per call on the machine that ran the simulation "
             "(its CPU stands for the cluster's hosts)" if args.planner_ms is None else
             f"- planner host time: {args.planner_ms:g} ms per call (--planner-ms)"),
            ("- steps to target relative to dropless (assumed, from the time-to-loss study): "
             + ", ".join(f"{k} {v:.3f}" for k, v in steps_ratio.items())
             if len(steps_ratio) > 1 else
             "- steps to target: none given (--steps-to-target, --steps-ratio); the "
             "table's to-target columns hold dropless's only"),
            "- all-to-all beyond 2 ranks is not validated against measurements "
            "(docs/simulate.md)", "", table, "", f"![plot]({stem}.png)", ""]))
        print(f"written to {args.out / stem}.md and .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
