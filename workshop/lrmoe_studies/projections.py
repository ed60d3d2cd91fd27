"""Projections at published recipe layouts, where the device's memory binds.

    python -m lrmoe_studies.projections --preset qwen3-30b-a3b-8xh100 --out /tmp/projections
    python -m lrmoe_studies.projections --preset all --out /tmp/projections \
        --steps-to-target-by-ep 8=ep8_steps.json 16=ep16_steps.json

A preset (``PRESETS``) is a published Megatron-Bridge recipe's parallel layout as the
launcher's flags (TP, PP, EP, ETP, sequence parallelism, micro-batch, global batch,
recompute, bf16, distributed optimizer) with its GPU count (the world size) and device
size; every number's source is named beside it. For each policy (``POLICIES``: Megatron
dropless, Megatron capacity drop 1.0, SYMI-style, LRMoE uniform gamma 1.0 without replicas,
and LRMoE uniform with memory-aware placement at each gamma of ``GAMMAS``; the budgeted
ones at ``auto``: the device less the rest of the memory account) this module predicts,
with ``lrmoe_studies/fitting.py``:

* the recipe's own configuration (its recompute): whether it fits, its need per rank;
* the fitting choice: the best-predicted fitting configuration of Megatron's means
  (``fitting.candidates``: none, ``moe`` recompute, full recompute of n layers per stage,
  a smaller micro-batch, fewer SYMI slots; the recipe's own configuration too). Full
  recompute and SYMI's slots are searched by bisection (memory falls with n, rises with
  slots; time the other way), so the best fitting one of each is found without pricing
  every n;
* its MoE time and total step time per step, and to the target relative to dropless
  and SYMI-style: the per-step time ratio times the steps-to-target ratio measured by a
  time-to-loss study (an assumption at this scale), as the median and [min, max] over its
  seeds (``to_target``); one file for every preset, or one per EP size
  (``steps_for_ep``); at ``GOAL_PRESET`` the goal check (``goal_check``);
* the largest micro-batch that fits (``fitting.largest_micro_batch``),
  with the fitting choice's recompute, micro-batches per step unchanged;
* per step at the fitting choice: the MoE time by part (``part_columns``: all-to-all and
  GEMM of each phase, the replica refresh, the rest), replicas per layer, the retained
  fraction, and the MoE time over the fitted SYMI-style's and dropless's (``per_step``);
  at ``GOAL_PRESET`` the per-step goal (``step_goal_check``). A policy
  without a measured steps ratio (the gammas other than ``MEASURED_GAMMA``) has per-step
  figures only;
* beside them, an earlier run's figures where its JSON is given (``--previous``,
  default ``PREVIOUS_DIR``: the projections before the joint planner).

Every policy alike: the device less ``RESERVE_GIB`` (the CUDA context and NCCL's buffers,
which the memory account omits; ``--reserve-gib``); the MoE time the mean over
``WINDOW_STEPS`` simulated steps after the warm-up (``simulate.WARMUP_STEPS``), the MoE
memory the most over every step, each with its own replicas (``simulate``).

The time outside the MoE layers cannot be measured here: ``outside_flops`` counts it
(attention projections, causal attention core, dense layers, shared experts, LM head;
forward and backward = 3 x forward) and ``fitting.OutsideTime.from_flops`` prices it at
an assumed efficiency of the cluster's peak. The slowest pipeline stage sets the pace
(its layers plus the LM head); 1F1B's bubble multiplies the step by (m + PP - 1) / m for
m micro-batches per step. Ignored and said in the report: TP communication, the
optimizer step, memory-bound kernels outside the MoE layers, overlap of DP gradient
reduction.

The recipes use the flex dispatcher (DeepEP/HybridEP), CUDA graphs or shared-expert
overlap, which ``--moe-lrmoe`` refuses: every policy here is simulated with the
all-to-all dispatcher and without those features (``DISPATCHER_CAVEAT``, printed beside
every table).
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import yaml

from lrmoe_studies import fitting as F
from lrmoe_studies.paths import ROOT, STEPS_TO_TARGET_FILE
from lrmoe_studies.steps_to_target import Range, paired_range, ratio_range
from megatron_lrmoe.planning.clusters import CLUSTERS
from megatron_lrmoe.planning.memory_account import GIB
from megatron_lrmoe.tools.provenance import code_version
from megatron_lrmoe.tools.simulate import (
    WARMUP_STEPS,
    StepsPair,
    StepsToTarget,
    load_traces,
    read_steps_to_target,
)

__all__ = ["DISPATCHER_CAVEAT", "GAMMAS", "GOAL", "GOAL_PRESET", "NO_STEPS_RATIO",
           "PART_COLUMNS", "POLICIES", "PRESETS", "PREVIOUS_DIR", "RESERVE_GIB", "STEP_GOAL",
           "STEP_GOAL_POLICY", "WINDOW_STEPS", "WINDOW_TOLERANCE", "Preset", "base_flags",
           "config_flags", "goal_check", "lrmoe_flags", "ma_policy", "outside_flops",
           "outside_time", "parse_steps_by_ep", "part_columns", "per_step", "pipeline_factor",
           "previous_rows", "project", "read_previous", "report_markdown", "step_goal_check",
           "steps_for_ep", "to_target", "window_check"]

DISPATCHER_CAVEAT = (
    "All policies simulated with the all-to-all dispatcher and without the recipe's flex "
    "dispatcher (DeepEP/HybridEP), CUDA graphs or shared-expert overlap, which "
    "--moe-lrmoe refuses; the recipe's own Megatron runs would use them.")

BRIDGE = "NVIDIA-NeMo/Megatron-Bridge@067f987 "
QWEN_RECIPE = BRIDGE + "src/megatron/bridge/recipes/qwen/h100/qwen3_moe.py"
GLM_RECIPE = BRIDGE + "src/megatron/bridge/recipes/glm/h100/glm45.py"
COMMON_RECIPE = BRIDGE + "src/megatron/bridge/recipes/common.py (_pretrain_common)"

# Every preset runs the recipes' kernels where the launcher's parser takes them: bf16,
# Transformer Engine (flash attention: no scores saved), grouped expert GEMMs, the
# distributed optimizer, the all-to-all dispatcher.
COMMON_FLAGS = ("--mock-data", "--bf16", "--transformer-impl", "transformer_engine",
                "--moe-grouped-gemm", "--use-distributed-optimizer",
                "--moe-token-dispatcher-type", "alltoall")


@dataclass(frozen=True)
class Preset:
    """One recipe layout on one device type."""

    name: str
    config: Path
    """The model's recipe in ``configs/`` (its ``moe-lrmoe*`` keys are left out)."""
    cluster: str
    """``planning.clusters.CLUSTERS`` key: the MoE layers' machine and the peak FLOP/s."""
    gpus: int
    device_gib: float
    """The device's memory as CUDA reports it (GiB)."""
    layout: tuple[str, ...]
    """Launcher flags of the layout and batch (no recompute)."""
    recipe: tuple[str, ...] = ()
    """The recipe's own memory-saving flags (its recompute)."""
    trace: str = ""
    """Routing trace directory name under benchmarks/results/routing_traces/."""
    model_flags: tuple[str, ...] = ()
    """Flags replacing the config's (a workaround the launcher's parser needs)."""
    overrides: tuple[tuple[str, object], ...] = ()
    """Parsed arguments the launcher has no flag for (``fitting.predict``'s)."""
    vocab_size: int | None = None
    """The model's tokenizer vocabulary (the launcher's tokenizers cannot give a Hugging
    Face one); None: the launcher's tokenizer's."""
    sources: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()


CONFIGS: dict[str, Path] = {
    "qwen3-30b-a3b": ROOT / "configs" / "qwen3_30b_a3b.yaml",
    "glm45-air": ROOT / "configs" / "glm45_air.yaml",
}
"""The recipes' launcher configs (their model and batch flags) by model name (the names of
``planning.models.MODELS``)."""

# H100 SXM 80 GB: CUDA reports 81,559 MiB (79.6 GiB); A100 SXM 40 GB: 40,960 MiB (40 GiB).
H100_GIB = 81559 / 1024
A100_40_GIB = 40.0

# What a GPU holds besides the memory account (planning/memory_account.py names what it
# omits), the same for every policy and preset:
# - the CUDA context: about 400 MB with lazy module loading (CUDA >= 11.7, PyTorch's
#   default): a PyTorch maintainer in pytorch/pytorch#109888 (about 300 MB in #107667);
# - NCCL's buffers: 688 MB per communicator that ran a collective among NVLink-connected
#   GPUs (measured on 4 x A100 in NVIDIA/nccl#964; NCCL's memory grows with its channels
#   and connections, NVIDIA/nccl#986), for four communicators: the TP, PP, DP and EP
#   groups a Megatron MoE rank runs collectives over, at most;
# - the caching allocator's slack: no public figure found; only the rounding up below.
# (0.4 GB + 4 x 0.688 GB) = 2.94 GiB, rounded up.
RESERVE_GIB = 3.0
"""GiB per device held back from every preset's device (``--reserve-gib``'s default)."""
_TRACES = ROOT / "benchmarks" / "results" / "routing_traces"
# The Hugging Face configs' vocab_size (configs/qwen3_30b_a3b.yaml: 1187 x 128 = 151936;
# configs/glm45_air.yaml: 151552 = 1184 x 128); the launcher's tokenizers cannot give them.
QWEN3_VOCAB = 151936
GLM45_VOCAB = 151552

PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset(
        "qwen3-30b-a3b-8xh100", CONFIGS["qwen3-30b-a3b"], "h100", 8, H100_GIB,
        layout=("--tensor-model-parallel-size", "4", "--pipeline-model-parallel-size", "2",
                "--expert-model-parallel-size", "4", "--expert-tensor-parallel-size", "1",
                "--sequence-parallel", "--seq-length", "4096",
                "--micro-batch-size", "2", "--global-batch-size", "32"),
        recipe=("--recompute-granularity", "full", "--recompute-method", "uniform",
                "--recompute-num-layers", "1"),
        trace="qwen3", vocab_size=QWEN3_VOCAB,
        sources=(
            f"TP 4, PP 2, EP 4, ETP 1, sequence parallel, seq 4096, full recompute uniform 1, "
            f"distributed optimizer, fp32 grads: {QWEN_RECIPE} "
            "(qwen3_30b_a3b_pretrain_8gpu_h100_bf16_config)",
            f"micro-batch 2, global batch 32 (the recipe sets none): {COMMON_RECIPE}",
            "the recipe's dispatcher: flex (DeepEP) via apply_flex_dispatcher_backend",
        )),
    Preset(
        "qwen3-30b-a3b-16xh100", CONFIGS["qwen3-30b-a3b"], "h100", 16, H100_GIB,
        layout=("--expert-model-parallel-size", "16", "--expert-tensor-parallel-size", "1",
                "--seq-length", "4096", "--micro-batch-size", "1",
                "--global-batch-size", "1024"),
        trace="qwen3", vocab_size=QWEN3_VOCAB,
        # grad_reduce_in_fp32 False: bf16 gradient buffers (the launcher keeps fp32 with
        # --bf16 and has no flag for it).
        overrides=(("accumulate_allreduce_grads_in_fp32", False),),
        sources=(
            f"TP 1, PP 1, EP 16, ETP 1, no recompute ('fits without activation "
            f"recomputation'), micro-batch 1, global batch 1024, seq 4096, bf16 grads "
            f"(grad_reduce_in_fp32 False), distributed optimizer: {QWEN_RECIPE} "
            "(qwen3_30b_a3b_pretrain_16gpu_h100_bf16_config)",
            "the recipe's dispatcher: flex (HybridEP), TE CUDA graphs of the router and "
            "preprocess, TP comm overlap; precision-aware optimizer with fp32 states",
        )),
    Preset(
        "glm45-air-32xh100", CONFIGS["glm45-air"], "h100", 32, H100_GIB,
        layout=("--pipeline-model-parallel-size", "4", "--expert-model-parallel-size", "8",
                "--expert-tensor-parallel-size", "1", "--seq-length", "4096",
                "--micro-batch-size", "1", "--global-batch-size", "2048"),
        recipe=("--recompute-granularity", "selective"),
        trace="glm45", vocab_size=GLM45_VOCAB,
        model_flags=("--num-layers", "44", "--moe-layer-freq", "([0]*1+[1]*43)"),
        sources=(
            f"TP 1, PP 4 (first and last stage 11 layers), EP 8, ETP 1, micro-batch 1, "
            f"global batch 2048, seq 4096, selective recompute (modules None: core_attn), "
            f"fp32 grads, distributed optimizer, MTP 1 layer, 32 GPUs (the recipe's "
            f"name): {GLM_RECIPE} (glm45_air_106b_pretrain_32gpu_h100_bf16_config)",
            "the recipe's shared-expert overlap: on (moe_shared_expert_overlap True)",
        ),
        notes=(
            "The launcher refuses 46 layers over PP 4 (the recipe splits 11/12/12/11): the "
            "preset parses 44 layers, the first dense, i.e. 11 per stage, the recipe's "
            "first and last stage (the first holds PP micro-batches in flight). The "
            "recipe's middle stages hold 12 MoE layers with at most 3 in flight: one more "
            "layer's weights, gradients and optimizer state, fewer activations.",
            "The recipe sets sequence parallelism at TP 1, where Megatron turns it off and "
            "the launcher refuses it: left out.",
            "MTP (1 layer, on the last stage) is not modelled.",
        )),
    Preset(
        "qwen3-30b-a3b-32xa100-40", CONFIGS["qwen3-30b-a3b"], "a100-40", 32, A100_40_GIB,
        layout=("--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "4",
                "--expert-model-parallel-size", "8", "--expert-tensor-parallel-size", "1",
                "--sequence-parallel", "--seq-length", "4096",
                "--micro-batch-size", "2", "--global-batch-size", "1024"),
        recipe=("--recompute-granularity", "full", "--recompute-method", "uniform",
                "--recompute-num-layers", "1"),
        trace="qwen3", vocab_size=QWEN3_VOCAB,
        sources=(
            f"no A100 recipe: the 8 x H100 recipe's full recompute, ETP 1, micro-batch 2 and "
            f"seq 4096 ({QWEN_RECIPE}), the 16 x H100 recipe's global batch 1024",
            "layout: the fewest A100-40 GPUs whose memory account fits dropless at balanced "
            "routing with the recipe's recompute: 32 (TP <= 4: 4 query groups); of those, "
            "TP 2, PP 4, EP 8 (EP inside a node) is among the tightest (38.4 GiB of 40 at "
            "balanced routing; TP 4 layouts leave 6-13 GiB)",
        )),
    Preset(
        "glm45-air-64xa100-40", CONFIGS["glm45-air"], "a100-40", 64, A100_40_GIB,
        layout=("--tensor-model-parallel-size", "4", "--pipeline-model-parallel-size", "4",
                "--expert-model-parallel-size", "16", "--expert-tensor-parallel-size", "1",
                "--sequence-parallel", "--seq-length", "4096",
                "--micro-batch-size", "1", "--global-batch-size", "2048"),
        recipe=("--recompute-granularity", "full", "--recompute-method", "uniform",
                "--recompute-num-layers", "1"),
        trace="glm45", vocab_size=GLM45_VOCAB,
        model_flags=("--num-layers", "44", "--moe-layer-freq", "([0]*1+[1]*43)"),
        sources=(
            f"no A100 recipe: the H100 recipe's PP 4, ETP 1, micro-batch 1, global batch "
            f"2048, seq 4096 ({GLM_RECIPE}); full recompute instead of its selective one",
            "layout: the fewest A100-40 GPUs whose memory account fits dropless at balanced "
            "routing with full recompute: 64; TP 4, PP 4, EP 16 (38.7 GiB of 40 at "
            "balanced routing)",
        ),
        notes=("44 layers for the launcher's PP split, as glm45-air-32xh100.",
               "MTP (1 layer, on the last stage) is not modelled.")),
)}

# Policy name -> (label, flags, the steps-to-target ratio it is projected with; None: no
# measured run of that policy, so it has per-step figures only).
def lrmoe_flags(gamma: str) -> tuple[str, ...]:
    """LRMoE's uniform rule at backward capacity factor ``gamma`` under the ``auto``
    budget, without memory-aware placement."""
    return ("--moe-lrmoe", "--moe-lrmoe-selection", "uniform", "--moe-lrmoe-metric",
            "grad_act", "--moe-lrmoe-bwd-capacity-factor", gamma,
            "--moe-lrmoe-min-retention", "0.0", "--moe-lrmoe-memory-budget-gb", "auto")


LRMOE_FLAGS = lrmoe_flags("1.0")
GAMMAS = ("inf", "1.0", "0.75", "0.5", "0.4")
"""The backward capacity factors LRMoE memory-aware is projected at: inf
(placement alone, no drop), the default 1.0, and deeper drops (their steps, measured by
the deep-drop curve, are composed with per-step figures in
``lrmoe_studies/time_to_target_composed.py``)."""
MEASURED_GAMMA = "1.0"
"""The only gamma with a measured steps-to-target ratio (the EP studies' LRMoE run)."""
NO_STEPS_RATIO = "no measured steps ratio"


def ma_policy(gamma: str) -> str:
    """The policy name of LRMoE memory-aware at ``gamma`` (``GAMMAS``)."""
    return f"lrmoe-uniform-g{gamma}-ma"


POLICIES: dict[str, tuple[str, tuple[str, ...], str | None]] = {
    "megatron-dropless": ("Megatron dropless", (), "dropless"),
    "megatron-capacity-1.0": ("Megatron capacity drop, cf 1.0",
                              ("--moe-expert-capacity-factor", "1.0"), "capacity-drop"),
    # SYMI-style drops nothing: uniform at gamma inf keeps no bookkeeping of a drop.
    "symi": ("SYMI-style", ("--moe-lrmoe", "--moe-lrmoe-placement", "popularity",
                            "--moe-lrmoe-selection", "uniform",
                            "--moe-lrmoe-bwd-capacity-factor", "inf",
                            "--moe-lrmoe-memory-budget-gb", "auto"), "symi"),
    # No measured pair of uniform gamma 1.0 without replicas: the memory-aware run's ratio
    # (same rule and gamma) stands for it. Kept beside the memory-aware rows: what the
    # replicas buy at the same drop.
    "lrmoe-uniform-g1.0": ("LRMoE uniform, gamma 1.0", LRMOE_FLAGS, "lrmoe-ma"),
    **{ma_policy(g): (f"LRMoE memory-aware, gamma {g}",
                      (*lrmoe_flags(g), "--moe-lrmoe-placement", "memory-aware"),
                      "lrmoe-ma" if g == MEASURED_GAMMA else None) for g in GAMMAS},
}


def config_flags(path: Path) -> list[str]:
    """A ``configs/`` recipe as launcher flags, its ``moe-lrmoe*`` keys left out (the
    launcher has no switch to turn ``--moe-lrmoe`` off once given)."""
    out: list[str] = []
    for key, value in yaml.safe_load(Path(path).read_text()).items():
        if key.startswith("moe-lrmoe"):
            continue
        if isinstance(value, bool):
            out += [f"--{key}"] if value else []
        else:
            out += [f"--{key}", str(value)]
    return out


def base_flags(preset: Preset) -> list[str]:
    """The preset's launcher flags without recompute and without a policy's."""
    return [*config_flags(preset.config), *preset.model_flags, *COMMON_FLAGS, *preset.layout]


def _parse(preset: Preset, flags: list[str]) -> argparse.Namespace:
    args = F._parse(flags, preset.gpus)
    for name, value in preset.overrides:
        setattr(args, name, value)
    return args


TRACE_LAYERS = 2
"""Trace layers replayed per preset (``--layers``)."""
SKIP_FRACTION = 0.5
"""The share of a trace's first steps left out (``--skip-fraction``): the routing of
training's start is not the steady routing a projection is for."""


def preset_traces(preset: Preset, trace_dir: Path | None = None, layers: int = TRACE_LAYERS,
                  skip_fraction: float = SKIP_FRACTION) -> tuple[list, str]:
    """The routing ``preset`` is projected on (``load_traces``' traces and their source):
    its stored trace under benchmarks/results/routing_traces/ unless ``trace_dir``."""
    args = _parse(preset, base_flags(preset))
    return load_traces(trace_dir or _TRACES / preset.trace / "trace", args.num_experts,
                       layers, skip_fraction)


# ------------------------------------------------------------------ outside the MoE layers
def outside_flops(args: argparse.Namespace, vocab_size: int) -> dict[str, float]:
    """FLOPs per token of the whole model outside the MoE layers, forward and backward
    (3 x forward: two GEMMs in backward per forward one), by part: attention projections
    (Q, K, V, output), the causal attention core (QK^T and AV over half the sequence on
    average), dense MLP layers, shared experts, and the LM head. A GEMM of m x k by k x n
    is 2 m k n. The router is the simulator's; norms, rotary and other memory-bound work
    are left out."""
    from megatron_lrmoe.config.flags import moe_layer_freq
    from megatron_lrmoe.integration.planner_inputs import moe_layers_per_stage

    h, layers, s = args.hidden_size, args.num_layers, args.seq_length
    d = args.kv_channels or h // args.num_attention_heads
    q = args.num_attention_heads * d
    kv = (args.num_query_groups or args.num_attention_heads) * d
    moe = (moe_layers_per_stage(layers, moe_layer_freq(args.moe_layer_freq), 1)
           if args.num_experts else 0)
    gate = 3 if args.swiglu else 2
    shared = args.moe_shared_expert_intermediate_size or 0
    forward = {
        "attention projections": layers * 2 * h * (2 * q + 2 * kv),
        "attention core": layers * 2 * s * q,     # causal: 2 x (2 s q) / 2
        "dense layers": (layers - moe) * 2 * gate * h * args.ffn_hidden_size,
        "shared experts": moe * 2 * gate * h * shared,
        "LM head": 2 * h * vocab_size,
    }
    return {k: 3.0 * v for k, v in forward.items()}


def outside_time(args: argparse.Namespace, vocab_size: int, peak_flops: float,
                 efficiency: float) -> F.OutsideTime:
    """Seconds per step outside the MoE layers on one GPU of the slowest pipeline stage:
    its share of the layers' FLOPs (1 / PP) plus the LM head (the last stage's), over the
    tokens of its data-parallel replica, split over TP (``outside_flops``)."""
    parts = outside_flops(args, vocab_size)
    pp, tp = args.pipeline_model_parallel_size, args.tensor_model_parallel_size
    per_token = (sum(parts.values()) - parts["LM head"]) / pp + parts["LM head"]
    tokens = args.global_batch_size * args.seq_length / F._data_parallel(args)
    flops = per_token * tokens / tp
    return F.OutsideTime.from_flops(flops, peak_flops, efficiency, source=(
        f"FLOP count: {per_token / 1e9:.2f} GFLOP per token on the slowest stage x "
        f"{tokens:.0f} tokens per replica / TP {tp} = {flops / 1e12:.1f} TFLOP per GPU at "
        f"{efficiency:g} of {peak_flops / 1e12:.0f} TFLOP/s"))


def pipeline_factor(pipeline: int, microbatches: int) -> float:
    """1F1B's step over its busy time: (m + PP - 1) / m."""
    return (microbatches + pipeline - 1) / max(microbatches, 1)


# ------------------------------------------------------------------------- projections
WINDOW_STEPS = 16
"""Steps each configuration's MoE time is the mean of (the simulator's counted steps,
after its warm-up): doubling it moves no policy's MoE time or memory by
``WINDOW_TOLERANCE`` or more at the presets checked (``window_check``, run by
benchmarks/studies/simulator_window.py; the figures in docs/simulate.md). 8 steps did
not hold at qwen3-30b-a3b-8xh100, whose 16 micro-batches a step take 12.5 steps to pass
once through its trace."""
WINDOW_TOLERANCE = 0.01
"""The most a window's doubling may move a policy's MoE time or memory (relative)."""


@dataclass
class Projection:
    """One policy at one preset."""

    policy: str
    label: str
    recipe: F.Prediction
    choice: F.Prediction | None
    choice_step_s: float
    """The choice's step with the pipeline bubble (nan when nothing fits)."""
    recipe_step_s: float
    largest: tuple[int, F.Prediction | None] | None
    ratio: float
    tried: list[F.Prediction] = field(default_factory=list)


def _microbatches(args: argparse.Namespace) -> int:
    return max(1, args.num_microbatches)


def _bisect(lo: int, hi: int, fits: Callable[[int], bool]) -> int | None:
    """The smallest n in [lo, hi] with ``fits(n)`` for a ``fits`` false then true (None
    when ``fits(hi)`` is false)."""
    if not fits(hi):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid + 1, hi)
    return lo


def project(preset: Preset, traces: list[np.ndarray], steps: int | None = None,
            efficiency: float = 0.45, ratios: dict[str, float] | None = None,
            policies: tuple[str, ...] = tuple(POLICIES), largest_limit: int = 8,
            reserve_gib: float = RESERVE_GIB, planner_s: float | None = None,
            log: Callable[[str], None] = lambda _: None,
            table: Mapping[str, tuple[str, tuple[str, ...], str | None]] = POLICIES,
            ) -> tuple[dict, list[Projection]]:
    """Every policy of ``policies`` at ``preset`` (module doc): (the preset's context:
    outside time, micro-batches, the device size used; the projections).
    ``largest_limit``: micro-batch sizes tried for the largest that fits (0: skipped).
    ``steps``: the simulator's counted steps after its warm-up (``WINDOW_STEPS`` when
    None). ``reserve_gib``: held back from the device for what the memory account omits
    (``RESERVE_GIB``: CUDA context, NCCL buffers). ``planner_s``: the planner's host
    time per call (None: measured here per call). ``table``: the policies' labels, flags
    and steps-ratio keys (``POLICIES``'s form), for policies beyond ``POLICIES``."""
    from megatron_lrmoe.launcher import builders

    ratios = ratios or {}
    steps = WINDOW_STEPS if steps is None else steps
    base = base_flags(preset)
    args = _parse(preset, base)
    cluster = CLUSTERS[preset.cluster]
    vocab = builders.padded_vocab_size(
        preset.vocab_size or builders.build_tokenizer_from_args(args).vocab_size, args)
    outside = outside_time(args, vocab, cluster.peak_flops, efficiency)
    overrides = dict(preset.overrides)
    stage_layers = F._stage_layers(args)
    device_gib = preset.device_gib - reserve_gib

    def bubble(p: F.Prediction) -> float:
        flags = _parse(preset, [*base, *p.candidate.flags])
        return p.step_s * pipeline_factor(args.pipeline_model_parallel_size,
                                          _microbatches(flags))

    def one(name: str) -> Projection:
        label, flags, ratio_key = table[name]
        cache: dict[tuple[str, ...], F.Prediction] = {}

        def predict(c: F.Candidate) -> F.Prediction:
            if c.flags not in cache:
                started = time.perf_counter()
                p = F.predict(base, c, device_gib, traces, None, outside, steps=steps,
                              cluster=preset.cluster, overrides=overrides,
                              planner_s=planner_s, vocab_size=preset.vocab_size,
                              world_size=preset.gpus)
                cache[c.flags] = p
                log(f"  {preset.name} {name} {c.fitted}: need {p.need / GIB:.2f} GiB, "
                    f"{'fits' if p.fits else 'does not fit'}, step {p.step_s:.3f} s "
                    f"({time.perf_counter() - started:.1f} s)")
            return cache[c.flags]

        recipe = predict(F.Candidate(name, "recipe", (*flags, *preset.recipe)))
        cands = F.candidates(name, list(flags), args)
        none = cands[0]
        found = [recipe, *(predict(c) for c in cands
                           if c.fitted == "recompute moe" or c.fitted == "none"
                           or c.fitted.startswith("micro-batch"))]
        # Full recompute: the fewest layers that fit (memory falls with n, time rises);
        # none is faster where it fits.
        if not predict(none).fits:
            n = _bisect(1, stage_layers, lambda k: predict(F.full_recompute(none, k)).fits)
            if n is not None:
                found.append(predict(F.full_recompute(none, n)))
        # SYMI-style: the most slots that fit, when its own budget's replicas do not.
        if name == "symi" and not predict(none).fits and not predict(none).error:
            per_rank = args.num_experts // args.expert_model_parallel_size
            top = per_rank + args.num_experts // 2

            def slots(k: int) -> F.Candidate:
                return F.replace(none, fitted=f"slots {k}", flags=none.flags + (
                    "--moe-lrmoe-slots-per-rank", str(k)))

            k = _bisect(0, top - per_rank, lambda j: predict(slots(top - j)).fits)
            if k is not None:
                found.append(predict(slots(top - k)))
        fitting = [p for p in found if p.fits]
        choice = min(fitting, key=bubble) if fitting else None
        largest = None
        if largest_limit:    # under the choice's recompute (its micro-batch is replaced)
            means = list(choice.candidate.flags if choice else flags)
            largest = F.largest_micro_batch(base, name, means, device_gib, traces,
                                            None, outside, limit=largest_limit,
                                            world_size=preset.gpus, steps=steps,
                                            cluster=preset.cluster, overrides=overrides,
                                            planner_s=planner_s, vocab_size=preset.vocab_size)
        return Projection(
            policy=name, label=label, recipe=recipe, choice=choice,
            choice_step_s=bubble(choice) if choice else math.nan,
            recipe_step_s=bubble(recipe) if not recipe.error else math.nan,
            largest=largest,
            ratio=ratios.get(ratio_key, math.nan) if ratio_key else math.nan,
            tried=list(cache.values()))

    out = [one(name) for name in policies]
    context = {"outside_s": outside.seconds, "outside_source": outside.source,
               "outside_flops_per_token": outside_flops(args, vocab),
               "microbatches_per_step": _microbatches(args),
               "data_parallel": F._data_parallel(args),
               "pipeline_factor": pipeline_factor(args.pipeline_model_parallel_size,
                                                  _microbatches(args)),
               "stage_layers": stage_layers, "efficiency": efficiency, "vocab": vocab,
               "device_gib": device_gib, "reserve_gib": reserve_gib}
    return context, out


def window_check(preset: Preset, traces: list[np.ndarray], steps: int,
                 policies: tuple[str, ...] = tuple(POLICIES), reserve_gib: float = RESERVE_GIB,
                 planner_s: float | None = 1e-4,
                 log: Callable[[str], None] = lambda _: None) -> list[dict]:
    """Whether ``steps`` is a long enough window at ``preset``: each policy's recipe
    configuration predicted over ``steps`` counted steps and over twice as many, with
    its MoE seconds per step and MoE GiB per rank at both and their relative change
    (``time_change``, ``memory_change``; ``within`` when both are below
    ``WINDOW_TOLERANCE``). ``planner_s`` is fixed (default 0.1 ms per call): a measured
    host time would move with the machine, not with the window."""
    from megatron_lrmoe.launcher import builders

    base = base_flags(preset)
    args = _parse(preset, base)
    vocab = builders.padded_vocab_size(
        preset.vocab_size or builders.build_tokenizer_from_args(args).vocab_size, args)
    # Only the MoE time and memory are compared: the outside time is project()'s default.
    outside = outside_time(args, vocab, CLUSTERS[preset.cluster].peak_flops, 0.45)
    rows = []
    for name in policies:
        _, flags, _ = POLICIES[name]
        candidate = F.Candidate(name, "recipe", (*flags, *preset.recipe))
        found = []
        for n in (steps, 2 * steps):
            started = time.perf_counter()
            found.append(F.predict(base, candidate, preset.device_gib - reserve_gib, traces,
                                   None, outside, steps=n, cluster=preset.cluster,
                                   overrides=dict(preset.overrides), planner_s=planner_s,
                                   vocab_size=preset.vocab_size, world_size=preset.gpus))
            log(f"  {preset.name} {name} {n} steps: MoE {found[-1].moe_s:.4f} s/step, "
                f"{found[-1].account.moe / GIB:.3f} GiB ({time.perf_counter() - started:.1f} s)")
        one, two = found
        if one.error or two.error:
            rows.append({"policy": name, "steps": steps, "error": one.error or two.error})
            continue
        time_change = two.moe_s / one.moe_s - 1
        memory_change = two.account.moe / one.account.moe - 1
        rows.append({"policy": name, "steps": steps, "moe_s": one.moe_s,
                     "moe_s_doubled": two.moe_s, "time_change": time_change,
                     "moe_gib": one.account.moe / GIB, "moe_gib_doubled": two.account.moe / GIB,
                     "memory_change": memory_change,
                     "within": max(abs(time_change), abs(memory_change)) < WINDOW_TOLERANCE})
    return rows


# ------------------------------------------------------------------ steps to target
STEPS_KEYS = tuple(dict.fromkeys(key for _, _, key in POLICIES.values()
                                 if key and key != "dropless"))
"""The steps-to-target file's policies the projections read."""
BY_EP_FLAG = "--steps-to-target-by-ep"


def parse_steps_by_ep(items: list[str]) -> dict[int, StepsToTarget]:
    """``EP=FILE`` items of ``--steps-to-target-by-ep`` as read files by EP size. Raises
    ValueError naming the flag and the item at fault, or the file (it names the EP size
    it was measured at, ``"ep"``, and that is not the item's)."""
    out: dict[int, StepsToTarget] = {}
    for item in items:
        ep, sep, path = item.partition("=")
        if not (sep and ep.isdigit() and int(ep) >= 1 and path):
            raise ValueError(f"{BY_EP_FLAG} {item}: expected EP=FILE with EP a positive "
                             "integer (e.g. 16=steps_to_target.json)")
        if int(ep) in out:
            raise ValueError(f"{BY_EP_FLAG} {item}: EP {ep} given twice")
        steps = read_steps_to_target(Path(path), f"{BY_EP_FLAG} {ep}=", STEPS_KEYS)
        measured = json.loads(Path(path).read_text()).get("ep")
        if measured is not None and measured != int(ep):
            raise ValueError(f"{BY_EP_FLAG} {item}: the file's study ran at EP {measured} "
                             f"(its \"ep\"); give it as {measured}={path}")
        out[int(ep)] = steps
    return out


def steps_for_ep(by_ep: dict[int, StepsToTarget], ep: int) -> tuple[int, StepsToTarget]:
    """The file a preset at expert-parallel size ``ep`` is projected with: the largest
    EP's file at or above that EP, the smallest EP's at or below it, a given EP's at it.
    An EP strictly between two given sizes has no measured ratio: ValueError naming the
    flag (give a file for that EP)."""
    sizes = sorted(by_ep)
    if ep in by_ep:
        return ep, by_ep[ep]
    if ep > sizes[-1]:
        return sizes[-1], by_ep[sizes[-1]]
    if ep < sizes[0]:
        return sizes[0], by_ep[sizes[0]]
    below = max(s for s in sizes if s < ep)
    above = min(s for s in sizes if s > ep)
    raise ValueError(f"{BY_EP_FLAG}: a preset at EP {ep} lies between the files for EP "
                     f"{below} and EP {above}; give one for EP {ep} ({ep}=FILE)")


def _swap(pairs: tuple[StepsPair, ...]) -> tuple[StepsPair, ...]:
    return tuple(StepsPair(p.dropless_steps, p.steps, p.seed) for p in pairs)


def steps_vs(steps: StepsToTarget, a: str, b: str) -> tuple[Range, str]:
    """Steps to target of ratio key ``a`` over key ``b`` (``POLICIES``' third field;
    dropless is each pair's own dropless run) with how it was formed: per seed where the
    pairs name the same seeds, else the cross range (``paired_range``)."""
    if a == b:
        return Range(1.0, 1.0, 1.0), "same"
    if b == "dropless":
        return ratio_range(steps.pairs[a]), "per seed"
    if a == "dropless":
        return ratio_range(_swap(steps.pairs[b])), "per seed"
    return paired_range(steps.pairs[a], steps.pairs[b])


def to_target(rows: list[Projection], steps: StepsToTarget | None) -> dict[str, dict]:
    """Per policy with a fitting choice: its time to target relative to the fitting
    choice of dropless and of SYMI-style, in step seconds and in MoE-layer seconds,
    each the per-step time ratio x the steps ratio's median and [min, max] over seeds
    (``steps_vs``). Without a file (``steps`` None) each row's ``ratio`` stands alone
    (no spread). A policy without a measured steps ratio (``POLICIES``' third field
    None) has no entry."""
    by_policy = {r.policy: r for r in rows if r.choice is not None}
    out: dict[str, dict] = {}
    for r in by_policy.values():
        key = POLICIES[r.policy][2]
        if key is None:     # no measured steps: no figure to target (``per_step`` only)
            continue
        entry: dict = {"steps_ratio": Range(r.ratio, r.ratio, r.ratio)}
        if steps is not None and key != "dropless":
            entry["steps_ratio"] = ratio_range(steps.pairs[key])
        for base, name in (("megatron-dropless", "dropless"), ("symi", "symi")):
            ref = by_policy.get(base)
            if ref is None:
                continue
            if steps is None:
                rel, how = Range(*(r.ratio / ref.ratio,) * 3), "medians (no file)"
            else:
                rel, how = steps_vs(steps, key, POLICIES[base][2])
            entry[f"steps_vs_{name}"] = rel
            entry[f"steps_vs_{name}_how"] = how
            entry[f"step_vs_{name}"] = rel.scale(r.choice_step_s / ref.choice_step_s)
            entry[f"moe_vs_{name}"] = rel.scale(r.choice.moe_s / ref.choice.moe_s)
        out[r.policy] = entry
    return out


GOAL_PRESET = "qwen3-30b-a3b-16xh100"
GOAL = 0.70
"""LRMoE's cumulative MoE-layer time to target over the fastest fitted SYMI-style and
dropless configuration's, at ``GOAL_PRESET``: at most this over the ratio's range."""
GOAL_LEVELS = ("not met", "met at the best seed only", "met at the median only", "met")


def goal_level(r: Range, goal: float) -> int:
    """The index in ``GOAL_LEVELS`` of a time-to-target ratio's range ``r`` against
    ``goal``: met over the range, at the median only, at the best seed only, or not."""
    return 3 if r.high <= goal else 2 if r.median <= goal else 1 if r.low <= goal else 0


def goal_check(rows: list[Projection], steps: StepsToTarget | None,
               goal: float = GOAL) -> dict:
    """Whether LRMoE (the steps file's LRMoE run: with memory-aware replicas when its study
    policy ends in ``-ma``) projects to at most ``goal`` x the MoE-layer time to target of
    the fitting choice of SYMI-style and of dropless over the whole steps-ratio range.
    Per baseline: "met" (the range's high end at most ``goal``), "met at the median
    only", "met at the best seed only" (its low end), "not met"; overall the weaker of
    the two. A baseline that fits nothing is left out of the verdict (said)."""
    study = steps.study_policy.get("lrmoe-ma", "") if steps else ""
    policy = ("lrmoe-uniform-g1.0" if study and not study.endswith("-ma")
              else "lrmoe-uniform-g1.0-ma")
    found = {r.policy: r for r in rows}
    out: dict = {"goal": goal, "policy": policy, "study_policy": study or None}
    if policy not in found or found[policy].choice is None:
        why = "not projected" if policy not in found else "fits nothing"
        return out | {"verdict": f"not met (LRMoE {policy} {why})", "baselines": {}}
    ranges = to_target(rows, steps)[policy]
    baselines, levels = {}, []
    for base, name in (("symi", "symi"), ("megatron-dropless", "dropless")):
        if f"moe_vs_{name}" not in ranges:
            baselines[base] = {"verdict": "left out: " + (
                "not projected" if base not in found else "fits nothing")}
            continue
        r = ranges[f"moe_vs_{name}"]
        levels.append(goal_level(r, goal))
        baselines[base] = {"moe_vs": asdict(r), "how": ranges[f"steps_vs_{name}_how"],
                           "fitted": found[base].choice.candidate.fitted,
                           "verdict": GOAL_LEVELS[levels[-1]]}
    out["baselines"] = baselines
    out["verdict"] = GOAL_LEVELS[min(levels)] if levels else "not assessed (no baseline fits)"
    return out


def goal_markdown(check: dict) -> str:
    lines = [f"**Goal** (LRMoE's cumulative MoE-layer time to target at most "
             f"{check['goal']:.2f} x the fastest fitted SYMI-style and dropless, over the "
             f"steps ratio's range): **{check['verdict']}**. LRMoE: {check['policy']}"
             + (f" (the steps file's run: {check['study_policy']})"
                if check["study_policy"] else "") + "."]
    for base, b in check["baselines"].items():
        if "moe_vs" not in b:
            lines.append(f"- vs {base}: {b['verdict']}")
            continue
        r = Range(**b["moe_vs"])
        lines.append(f"- vs {base} ({b['fitted']}): {r.text()} (median [min, max], steps "
                     f"ratio {b['how']}): {b['verdict']}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- per step
BASELINES = (("megatron-dropless", "dropless"), ("symi", "symi"))
"""The fitted baselines every ratio is taken against: (policy, short name)."""
STEP_GOAL = 0.75
STEP_GOAL_POLICY = ma_policy("0.5")
"""At ``GOAL_PRESET``: LRMoE memory-aware at gamma 0.5 at most ``STEP_GOAL`` x the fitted
SYMI-style's MoE seconds per step, within the device. Per step only: no study
has measured the steps such a drop costs."""


def per_step(rows: list[Projection]) -> dict[str, dict[str, float]]:
    """Per policy with a fitting choice: its MoE seconds per step over the fitting
    choice's of dropless and of SYMI-style (``moe_vs_dropless``, ``moe_vs_symi``; absent
    where that baseline fits nothing). No steps ratio enters."""
    by_policy = {r.policy: r for r in rows if r.choice is not None}
    return {r.policy: {f"moe_vs_{name}": r.choice.moe_s / by_policy[base].choice.moe_s
                       for base, name in BASELINES if base in by_policy}
            for r in by_policy.values()}


PART_COLUMNS = ("all-to-all fwd", "all-to-all bwd", "GEMM fwd", "GEMM bwd", "refresh",
                "other")
"""The report's split of a prediction's MoE seconds per step (``part_columns``)."""


def part_columns(p: F.Prediction) -> dict[str, float]:
    """``p.parts_s`` grouped as ``PART_COLUMNS``: the all-to-all (bytes of the busiest
    link) and the expert GEMMs of each phase, the replica refresh (with the replicas'
    gradient reduction), and the rest (memory-bound row work, router, fixed cost per
    call, the planner's host time); they sum to ``p.moe_s``."""
    parts = dict(p.parts_s)
    out = {"all-to-all fwd": parts.pop("forward_alltoall", 0.0),
           "all-to-all bwd": parts.pop("backward_alltoall", 0.0),
           "GEMM fwd": parts.pop("forward_gemm", 0.0),
           "GEMM bwd": parts.pop("backward_gemm", 0.0),
           "refresh": parts.pop("refresh", 0.0)}
    out["other"] = sum(parts.values())
    return out


def step_goal_check(rows: list[Projection], goal: float = STEP_GOAL) -> dict:
    """Whether ``STEP_GOAL_POLICY``'s fitting choice takes at most ``goal`` x the fitted
    SYMI-style's MoE seconds per step: "met" or "not met" with the ratio; "not met" where
    LRMoE fits nothing, "not assessed" where SYMI-style fits nothing."""
    found = {r.policy: r for r in rows}
    out: dict = {"goal": goal, "policy": STEP_GOAL_POLICY}
    lrmoe, symi = found.get(STEP_GOAL_POLICY), found.get("symi")
    if lrmoe is None or lrmoe.choice is None:
        why = "not projected" if lrmoe is None else "fits nothing"
        return out | {"verdict": f"not met (LRMoE {STEP_GOAL_POLICY} {why})"}
    if symi is None or symi.choice is None:
        why = "not projected" if symi is None else "fits nothing"
        return out | {"verdict": f"not assessed (SYMI-style {why})"}
    ratio = lrmoe.choice.moe_s / symi.choice.moe_s
    return out | {"ratio": ratio, "moe_s": lrmoe.choice.moe_s,
                  "symi_moe_s": symi.choice.moe_s,
                  "fitted": lrmoe.choice.candidate.fitted,
                  "symi_fitted": symi.choice.candidate.fitted,
                  "need_gib": lrmoe.choice.need / GIB,
                  "verdict": "met" if ratio <= goal else "not met"}


def step_goal_markdown(check: dict, reserve_gib: float) -> str:
    head = (f"**Goal, per step** (LRMoE memory-aware at gamma 0.5 at most "
            f"{check['goal']:.2f} x the fitted SYMI-style's MoE seconds per step, within "
            f"the device): **{check['verdict']}**")
    if "ratio" not in check:
        return head + "."
    return head + (
        f": {check['ratio']:.3f} x ({check['moe_s']:.2f} s against {check['symi_moe_s']:.2f}"
        f" s, SYMI-style at {check['symi_fitted']}; LRMoE at {check['fitted']}, needing "
        f"{check['need_gib']:.1f} + {reserve_gib:g} GiB). Per step only: the steps such a "
        "drop costs are not measured.")


PREVIOUS_DIR = ROOT / "benchmarks" / "results" / "projections" / "previous"
"""The stored projections before the joint placement-and-retention planner (commit
5411dfd; the old planner and window, no reserve), read
for the "before" table (``--previous``)."""


def read_previous(directory: Path | None, preset: str) -> dict | None:
    """The earlier ``projections_<preset>.json`` under ``directory`` (None when absent)."""
    path = None if directory is None else Path(directory) / f"projections_{preset}.json"
    return json.loads(path.read_text()) if path is not None and path.exists() else None


def previous_rows(previous: dict, rows: list[Projection]) -> list[dict]:
    """Per policy of ``rows`` that ``previous`` projected too (same name, same flags):
    its fitting choice, need (GiB) and MoE seconds per step then and now."""
    before = {p["policy"]: p for p in previous.get("policies", [])}
    out = []
    for r in rows:
        old = before.get(r.policy)
        if old is None:
            continue
        then = old.get("choice")
        out.append({"policy": r.policy, "label": r.label,
                    "before_fitted": then["fitted"] if then else None,
                    "before_need_gib": then["need_gib"] if then else None,
                    "before_moe_s": then["moe_s"] if then else None,
                    "now_fitted": r.choice.candidate.fitted if r.choice else None,
                    "now_need_gib": r.choice.need / GIB if r.choice else None,
                    "now_moe_s": r.choice.moe_s if r.choice else None,
                    "now_replicas": r.choice.replicas if r.choice else None})
    return out


def previous_markdown(previous: dict, rows: list[Projection], reserve_gib: float,
                      source: str) -> str:
    """The "before" table: ``previous_rows`` beside each other, with the earlier run's
    code, command and reserve."""
    old_reserve = previous.get("context", {}).get("reserve_gib", 0.0)
    lines = [f"Before (`{source}`: {previous.get('code', '?')}, "
             f"`{previous.get('command', '?')}`; reserve {old_reserve:g} GiB, the warm-up "
             "step inside its time window, memory as the most saved bytes over all calls "
             "plus the most replica bytes, the greedy-prefix planner; its replicas per "
             "layer were not stored) and now, each at its fitting choice:", "",
             "| policy | before: fitting choice | need GiB | MoE s/step | now: fitting choice "
             "| need + reserve GiB | MoE s/step | replicas per layer | MoE now / before |",
             "|" + "---|" * 9]

    def cell(v: float | None, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    for e in previous_rows(previous, rows):
        change = ("-" if e["before_moe_s"] is None or e["now_moe_s"] is None
                  else f"{e['now_moe_s'] / e['before_moe_s']:.3f}")
        need_now = ("-" if e["now_need_gib"] is None
                    else f"{e['now_need_gib']:.1f} + {reserve_gib:g}")
        lines.append(
            f"| {e['label']} | {e['before_fitted'] or 'nothing fits'} | "
            f"{cell(e['before_need_gib'], '.1f')} | {cell(e['before_moe_s'], '.2f')} | "
            f"{e['now_fitted'] or 'nothing fits'} | {need_now} | "
            f"{cell(e['now_moe_s'], '.2f')} | {cell(e['now_replicas'], '.1f')} | {change} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ report
def _gib(p: F.Prediction | None, reserve_gib: float) -> str:
    """The need per rank and the reserve beside it, which the device must hold both of."""
    return "-" if p is None or p.error else f"{p.need / GIB:.1f} + {reserve_gib:g}"


def report_markdown(preset: Preset, context: dict, rows: list[Projection],
                    command: str, code: str, steps: StepsToTarget | None = None,
                    steps_ep: int | None = None, previous: dict | None = None,
                    previous_source: str = "") -> str:
    """The preset's tables; ``steps``: the steps-to-target file its ratios came from (the
    spread over its seeds in every to-target column), measured at EP ``steps_ep``;
    ``previous``: an earlier run's JSON (``read_previous``, from ``previous_source``),
    shown beside this one."""
    ranges = to_target(rows, steps)
    reserve = context["reserve_gib"]

    def rel(policy: str, key: str) -> str:
        if POLICIES[policy][2] is None:
            return NO_STEPS_RATIO
        r = ranges.get(policy, {}).get(key)
        return "-" if r is None else r.text()

    lines = [
        f"## {preset.name}: {preset.gpus} x {CLUSTERS[preset.cluster].gpu.split(' x ')[-1]}, "
        f"{preset.device_gib:.1f} GiB per device"
        + (f", {reserve:g} GiB held back (CUDA context, NCCL buffers: RESERVE_GIB)"
           if reserve else ""),
        "",
        f"**{DISPATCHER_CAVEAT}**", "",
        f"- command: `{command}`", f"- code: {code}",
        *(f"- source: {s}" for s in preset.sources),
        *(f"- note: {n}" for n in preset.notes),
        f"- layout flags: `{' '.join(preset.layout)}`; the recipe's own: "
        f"`{' '.join(preset.recipe) or 'no recompute'}`",
        f"- micro-batches per step {context['microbatches_per_step']} (DP "
        f"{context['data_parallel']}), layers per stage {context['stage_layers']}, 1F1B "
        f"factor {context['pipeline_factor']:.3f} applied to every step time",
        f"- outside the MoE layers: {context['outside_s']:.3f} s/step "
        f"({context['outside_source']}; TP communication, optimizer step, memory-bound "
        "kernels and DP reduction ignored)",
        *([] if steps is None else [
            f"- steps to target: `{steps.path}`"
            + (f" (measured at EP {steps_ep}; this preset's EP "
               f"{_parse(preset, base_flags(preset)).expert_model_parallel_size})"
               if steps_ep is not None else "")
            + "; runs: " + ", ".join(f"{k} {v}" for k, v in steps.study_policy.items())]),
        "", "| policy | recipe config fits (need + reserve GiB) | recipe step s | "
        "fitting choice | need + reserve GiB | MoE s/step | step s | steps ratio | "
        "to target vs dropless | vs SYMI-style | MoE to target vs dropless | MoE vs SYMI-style | "
        "largest micro-batch (choice's recompute) |", "|" + "---|" * 13]
    for r in rows:
        rec = r.recipe
        fits = ("cannot start (auto below the floor)" if "below the floor" in rec.error
                else "cannot start: " + rec.error.splitlines()[0][:60] if rec.error
                else ("yes" if rec.fits else "no") + f" ({_gib(rec, reserve)})")
        largest = ("-" if r.largest is None else
                   (str(r.largest[0]) if r.largest[1] is not None else "none fits"))
        recipe_step = "-" if math.isnan(r.recipe_step_s) else f"{r.recipe_step_s:.2f}"
        if r.choice is None:
            lines.append(f"| {r.label} | {fits} | {recipe_step} | nothing fits | - | "
                         f"- | - | - | - | - | - | - | {largest} |")
            continue
        lines.append(
            f"| {r.label} | {fits} | {recipe_step} | {r.choice.candidate.fitted} | "
            f"{_gib(r.choice, reserve)} | {r.choice.moe_s:.2f} | {r.choice_step_s:.2f} | "
            f"{rel(r.policy, 'steps_ratio')} | {rel(r.policy, 'step_vs_dropless')} | "
            f"{rel(r.policy, 'step_vs_symi')} | {rel(r.policy, 'moe_vs_dropless')} | "
            f"{rel(r.policy, 'moe_vs_symi')} | {largest} |")
    lines += ["", "Need + reserve: the predicted need per rank (the memory account, its MoE "
              "part the most over every simulated step, the warm-up included) and the "
              "reserve held back for what it omits; a configuration fits when their sum "
              "is at most the device. MoE s/step: the stage's MoE layers' busy time (no "
              "bubble), the mean over the steps after the warm-up; step s: MoE + "
              "outside, times the 1F1B factor. Steps ratio: steps to target over the same "
              "seed's dropless run's (time-to-loss study, an assumption at this scale; LRMoE "
              "without replicas takes the memory-aware run's), median [min, max] over the "
              "seeds. To target vs X: this policy's step s (MoE: MoE s/step) over X's "
              "fitting choice's, times the steps ratio to X per seed (both runs of one seed "
              "share its dropless run), median [min, max]; where the file's two policies "
              "do not name the same seeds, the cross range (lowest over highest to highest "
              "over lowest).", ""]
    lines += [parts_markdown(rows, reserve), ""]
    if preset.name == GOAL_PRESET:
        lines += [step_goal_markdown(step_goal_check(rows), reserve), "",
                  goal_markdown(goal_check(rows, steps)), ""]
    if previous is not None:
        lines += [previous_markdown(previous, rows, reserve, previous_source), ""]
    return "\n".join(lines)


def parts_markdown(rows: list[Projection], reserve_gib: float) -> str:
    """Per policy at its fitting choice: the MoE seconds per step and their parts
    (``part_columns``), replicas per layer, retained fraction, need + reserve and the
    per-step ratios to the fitted SYMI-style and dropless (``per_step``)."""
    ratios = per_step(rows)
    lines = ["Per step at the fitting choice, by part (seconds per optimizer step, the "
             "stage's MoE layers; the mean over the steps after the warm-up):", "",
             "| policy | fitting choice | MoE s/step | " + " | ".join(PART_COLUMNS)
             + " | replicas per layer | retained | need + reserve GiB | MoE per step vs "
             "SYMI-style | vs dropless |", "|" + "---|" * (len(PART_COLUMNS) + 8)]
    for r in rows:
        if r.choice is None:
            lines.append(f"| {r.label} | nothing fits |" + " - |" * (len(PART_COLUMNS) + 6))
            continue
        c, q = r.choice, ratios[r.policy]
        parts = part_columns(c)
        lines.append(
            f"| {r.label} | {c.candidate.fitted} | {c.moe_s:.2f} | "
            + " | ".join(f"{parts[k]:.2f}" for k in PART_COLUMNS)
            + f" | {c.replicas:.1f} | {c.retained:.3f} | {_gib(c, reserve_gib)} | "
            + " | ".join(f"{q[f'moe_vs_{name}']:.3f}" if f"moe_vs_{name}" in q else "-"
                         for name in ("symi", "dropless")) + " |")
    lines += ["", "Parts: the all-to-all (the busiest link's bytes) and the expert GEMMs of "
              "the forward (a recomputed layer's forward counted twice) and of the "
              "backward, the replica refresh with the replicas' gradient reduction, and "
              "the rest (memory-bound row work, router, fixed cost per call, the planner's "
              "host time); they sum to MoE s/step. Replicas and retained (the fraction of "
              "routed pairs the backward keeps): means over the counted steps and the "
              "simulated layers. Per-step ratios: this MoE s/step over the fitted "
              "baseline's, no steps ratio."]
    return "\n".join(lines)


def _range_json(entry: dict) -> dict:
    return {k: asdict(v) if isinstance(v, Range) else v for k, v in entry.items()}


def _prediction_json(p: F.Prediction | None) -> dict | None:
    if p is None:
        return None
    return {"fitted": p.candidate.fitted, "flags": list(p.candidate.flags), "fits": p.fits,
            "need_gib": p.need / GIB, "account_gib": {k: v / GIB for k, v in asdict(
                p.account).items() if isinstance(v, float)},
            "moe_s": p.moe_s, "step_s_no_bubble": p.step_s, "error": p.error,
            "moe_parts_s": part_columns(p) if p.parts_s else {}, "parts_s": p.parts_s,
            "replicas_per_layer": p.replicas, "retained": p.retained}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lrmoe_studies.projections",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--preset", nargs="+", required=True, choices=[*PRESETS, "all"])
    ap.add_argument("--policies", nargs="+", choices=list(POLICIES), default=list(POLICIES))
    ap.add_argument("--trace", type=Path, default=None,
                    help="a routing trace directory (default: the preset's under "
                         "benchmarks/results/routing_traces/)")
    ap.add_argument("--layers", type=int, default=TRACE_LAYERS, help="trace layers replayed")
    ap.add_argument("--steps", type=int, default=WINDOW_STEPS,
                    help="optimizer steps per layer the MoE time is the mean of, replayed "
                         "after the simulator's warm-up step (Megatron's placement, before "
                         "any measured load), which counts in the memory only")
    ap.add_argument("--skip-fraction", type=float, default=SKIP_FRACTION)
    ap.add_argument("--efficiency", type=float, default=0.45,
                    help="achieved over peak FLOP/s outside the MoE layers (assumption)")
    ap.add_argument("--largest-limit", type=int, default=8,
                    help="micro-batch sizes tried for the largest that fits (0: skip)")
    ap.add_argument("--reserve-gib", type=float, default=RESERVE_GIB,
                    help="GiB per device held back for what the memory account omits: the "
                         "CUDA context and NCCL's buffers (default: RESERVE_GIB, its "
                         "sources in docs/simulate.md)")
    ap.add_argument("--planner-ms", type=float, default=None,
                    help="the planner's host time per call (ms); default: measured here per "
                         "call (this CPU for the cluster's hosts)")
    steps_files = ap.add_mutually_exclusive_group()
    steps_files.add_argument("--steps-to-target", type=Path, default=None,
                             help="one steps-to-target file for every preset (default: "
                                  f"{STEPS_TO_TARGET_FILE.relative_to(ROOT)})")
    steps_files.add_argument(BY_EP_FLAG, nargs="+", metavar="EP=FILE", default=None,
                             help="steps-to-target files by the EP size they were measured "
                                  "at: a preset at or above the largest EP takes its file, "
                                  "at or below the smallest its file; between two: an "
                                  "error (e.g. 8=ep8.json 16=ep16.json)")
    ap.add_argument("--out", type=Path, default=None,
                    help="directory for projections_<preset>.md and .json")
    ap.add_argument("--previous", type=Path, default=PREVIOUS_DIR,
                    help="an earlier run's output directory, shown beside this one per "
                         "preset where it holds that preset's JSON (default: "
                         f"{PREVIOUS_DIR.relative_to(ROOT)}; 'none': no such table)")
    a = ap.parse_args(argv)
    previous_dir = None if str(a.previous) == "none" else a.previous
    names = list(PRESETS) if "all" in a.preset else a.preset
    try:
        by_ep = (parse_steps_by_ep(a.steps_to_target_by_ep) if a.steps_to_target_by_ep
                 else None)
        single = None if by_ep else read_steps_to_target(
            a.steps_to_target or STEPS_TO_TARGET_FILE, "--steps-to-target", STEPS_KEYS)
        chosen = {name: (steps_for_ep(by_ep, _parse(
            PRESETS[name], base_flags(PRESETS[name])).expert_model_parallel_size)
            if by_ep else (None, single)) for name in names}
    except ValueError as e:
        raise SystemExit(str(e)) from e
    command = shlex.join(["python", "-m", "lrmoe_studies.projections",
                          *(sys.argv[1:] if argv is None else argv)])
    code = code_version(("megatron_lrmoe", "configs"))
    for name in names:
        preset = PRESETS[name]
        steps_ep, steps = chosen[name]
        ratios = {"dropless": 1.0} | {key: ratio_range(pairs).median
                                      for key, pairs in steps.pairs.items()}
        started = time.perf_counter()
        traces, source = preset_traces(preset, a.trace, a.layers, a.skip_fraction)
        context, rows = project(preset, traces, steps=a.steps, efficiency=a.efficiency,
                                ratios=ratios, policies=tuple(a.policies),
                                largest_limit=a.largest_limit, reserve_gib=a.reserve_gib,
                                planner_s=None if a.planner_ms is None else a.planner_ms / 1e3,
                                log=lambda line: print(line, file=sys.stderr, flush=True))
        elapsed = time.perf_counter() - started
        previous = read_previous(previous_dir, name)
        shown = str(previous_dir.resolve().relative_to(ROOT) if previous_dir is not None
                    and previous_dir.resolve().is_relative_to(ROOT) else previous_dir)
        text = report_markdown(preset, context, rows, command, code, steps, steps_ep,
                               previous, shown) + (
            f"\nRouting: {source}; {a.layers} layer(s) x {a.steps} step(s) per "
            f"configuration after {WARMUP_STEPS} warm-up step(s). Projected in "
            f"{elapsed:.0f} s.\n")
        print(text)
        ranges = to_target(rows, steps)
        if a.out:
            a.out.mkdir(parents=True, exist_ok=True)
            (a.out / f"projections_{name}.md").write_text(text)
            (a.out / f"projections_{name}.json").write_text(json.dumps({
                "command": command, "code": code, "preset": name,
                "caveat": DISPATCHER_CAVEAT, "routing": source, "seconds": elapsed,
                "context": context,
                "steps_to_target": {"file": str(steps.path), "ep": steps_ep,
                                    "study_policy": steps.study_policy},
                "to_target": {policy: _range_json(entry) for policy, entry in ranges.items()},
                "per_step": per_step(rows),
                **({"goal": goal_check(rows, steps), "step_goal": step_goal_check(rows)}
                   if name == GOAL_PRESET else {}),
                "previous": None if previous is None else {
                    "dir": shown, "code": previous.get("code"),
                    "command": previous.get("command"),
                    "rows": previous_rows(previous, rows)},
                "policies": [{
                    "policy": r.policy, "label": r.label, "steps_ratio": r.ratio,
                    "recipe": _prediction_json(r.recipe), "recipe_step_s": r.recipe_step_s,
                    "choice": _prediction_json(r.choice), "choice_step_s": r.choice_step_s,
                    "largest_micro_batch": None if r.largest is None else r.largest[0],
                    "tried": [_prediction_json(p) for p in r.tried]} for r in rows]},
                indent=None, separators=(",", ":"), default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
