"""The planner's memory and time model: bytes and seconds of one LRMoE layer on one rank.

The model is specified in docs/design.md, "Cost model" (notation in "Notation"); this
module implements it.
Pure: a model shape and measured machine constants in, bytes and seconds out. No timing
constant lives here: GEMM rate, memory rate and all-to-all bandwidth come from a
calibration file (``python -m megatron_lrmoe.tools.calibrate``) or, without one, from
``megatron_lrmoe.planning.machine.default_machine_constants``, which measures quickly.

The memory levels follow the buffers the region (layer/region.py, layer/expert_gemms.py)
allocates and frees, phase by phase; tests/planning/test_cost_model.py checks them
against an independent ledger of those allocations and against the allocator, and
benchmarks/bench_moe_layer.py against a measured EP=2 forward+backward.
"""

from __future__ import annotations

import functools
import json
import math
import os
import tempfile
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np

from megatron_lrmoe.planning.retention import RetentionPlan

__all__ = ["CostModel", "InstanceRows", "MachineConstants", "MegatronMoEMemory", "MoEShape",
           "megatron_capacity_counts", "stage_moe_memory"]

# Saved per source pair besides o: the int64 (expert, token) pairs the token index is a
# view of (16), the probability (up to 4 in the dtypes trained), the side statistic a (4),
# the probability gather's int64 index (8).
_PAIR_METADATA_BYTES = 32
# Backward bookkeeping per source pair: metric fp32, slot int64, router gradient fp32,
# kept index int64 and scale fp32 of a kept pair.
_SELECTION_BYTES_PER_PAIR = 28
_POSITION_BYTES = 4         # int32 row position sent with each retained gradient row
# Element passes (reads + writes, in units of F) of the activation per expert row, (forward,
# backward). Gated (SwiGLU): forward silu(z1) (read F, write F), silu(z1) * z2 (read 2F,
# write F), the row norm a (read F) = 6; backward recomputes the forward (5), the two
# products' gradients (read 2F, write F each = 6), silu's backward (read 2F, write F = 3),
# dz assembled from its halves (read 2F, write 2F = 4) = 18. Plain: forward act (2) + norm
# (1) = 3; backward recompute (2) + act backward (read 2F, write F = 3) = 5.
_ACT_PASSES_GATED = (6.0, 18.0)
_ACT_PASSES_PLAIN = (3.0, 5.0)
# Of the backward passes, the recompute of the forward (gated 5, plain 2): a layer that
# saved the activation's output instead (Megatron's expert MLP) skips them.
_ACT_RECOMPUTE_PASSES_GATED = 5.0
_ACT_RECOMPUTE_PASSES_PLAIN = 2.0
_KEPT_BYTES = 12            # kept index int64 + scale fp32 of a kept source pair


@dataclass(frozen=True)
class MachineConstants:
    """Measured rates of this machine: what the time model divides by."""

    gemm_flops_per_s: float
    """Expert GEMM rate of one rank (FLOP/s) at the model's shape and dtype."""
    alltoall_bytes_per_s: float
    """All-to-all bandwidth per rank (bytes one rank sends per second)."""
    alltoall_latency_s: float = 0.0
    """Fixed cost of one all-to-all call (s)."""
    source: str = ""
    """Where the numbers came from (calibration file, machine, method)."""
    gemm_rows: tuple[float, ...] = ()
    """Rows per expert GEMM at which the two tables below were measured, ascending. Empty
    (old calibration files, the GPU presets): every expert GEMM runs at
    ``gemm_flops_per_s`` whatever its rows."""
    gemm_forward_flops_per_s: tuple[float, ...] = ()
    """Forward expert GEMMs of one instance (x W1^T, h W2^T), FLOP/s at each of
    ``gemm_rows`` (2H(F1 + F) FLOP per row). The time of n rows is interpolated linearly
    in n between the measured points (``CostModel`` module doc, "Time")."""
    gemm_backward_flops_per_s: tuple[float, ...] = ()
    """Backward expert GEMMs of one instance (dh, dW2, dz W1, dW1, and both dW added into
    the gradient buffers), FLOP/s at each of ``gemm_rows`` (4H(F1 + F) FLOP per row)."""
    memory_bytes_per_s: float = 0.0
    """Rate of the memory-bound work around the GEMMs (row gathers and reorders, the
    combine and its backward, the activation, the router's elementwise work), bytes read
    plus written per second on one rank. 0 (old calibration files): not priced."""
    layer_forward_fixed_s: float = 0.0
    """Fixed cost of one layer call's forward besides the two all-to-all latencies (s):
    op dispatch and Python of the layer, the counts exchange, small collectives. 0 (old
    calibration files): not priced."""
    layer_backward_fixed_s: float = 0.0
    """Fixed cost of one layer call's backward besides the two all-to-all latencies (s)."""
    megatron_forward_fixed_s: float | None = None
    """The same for one call of Megatron's MoELayer (``MoEShape.megatron_layer``): its
    dispatcher's host work and its expert MLP's per-expert loop cost more per call than
    the LRMoE layer's. None (old calibration files, the GPU presets): not measured, priced
    as ``layer_forward_fixed_s``."""
    megatron_backward_fixed_s: float | None = None
    """Backward counterpart of ``megatron_forward_fixed_s``; None exactly when it is."""
    alltoall_sizes: tuple[float, ...] = ()
    """Bytes one rank sends to the other ranks in one all-to-all, at which
    ``alltoall_size_bytes_per_s`` was measured, ascending. Empty (old calibration files,
    the GPU presets): every message moves at ``alltoall_bytes_per_s`` whatever its size."""
    alltoall_size_bytes_per_s: tuple[float, ...] = ()
    """All-to-all bandwidth per rank at each of ``alltoall_sizes`` (bytes over the time
    less ``alltoall_latency_s``). A layer's messages are a few MB, a replica refresh's
    tens, and a rate measured at one size need not hold at another. The time of b bytes
    is interpolated linearly in b between the measured points, as the GEMM tables are
    in rows."""

    def __post_init__(self) -> None:
        for name in ("gemm_rows", "gemm_forward_flops_per_s", "gemm_backward_flops_per_s",
                     "alltoall_sizes", "alltoall_size_bytes_per_s"):
            value = getattr(self, name)
            if not isinstance(value, list | tuple) or any(
                    isinstance(v, bool) or not isinstance(v, int | float)
                    or not (math.isfinite(v) and v > 0) for v in value):
                raise ValueError(f"MachineConstants.{name} must be a list of positive finite "
                                 f"numbers, got {value!r}")
            object.__setattr__(self, name, tuple(float(v) for v in value))
        if not (len(self.gemm_rows) == len(self.gemm_forward_flops_per_s)
                == len(self.gemm_backward_flops_per_s)):
            raise ValueError("MachineConstants.gemm_rows, gemm_forward_flops_per_s and "
                             "gemm_backward_flops_per_s must have the same length")
        if len(self.alltoall_sizes) != len(self.alltoall_size_bytes_per_s):
            raise ValueError("MachineConstants.alltoall_sizes and alltoall_size_bytes_per_s "
                             "must have the same length")
        for name in ("gemm_rows", "alltoall_sizes"):
            points = getattr(self, name)
            if any(b <= a for a, b in zip(points[:-1], points[1:], strict=True)):
                raise ValueError(f"MachineConstants.{name} must be strictly ascending, got "
                                 f"{points!r}")
        for name in ("memory_bytes_per_s", "layer_forward_fixed_s", "layer_backward_fixed_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not (
                    math.isfinite(value) and value >= 0):
                raise ValueError(f"MachineConstants.{name} must be a finite number >= 0, "
                                 f"got {value!r}")
        megatron = (self.megatron_forward_fixed_s, self.megatron_backward_fixed_s)
        if (megatron[0] is None) != (megatron[1] is None):
            raise ValueError("MachineConstants.megatron_forward_fixed_s and "
                             "megatron_backward_fixed_s must both be set or both be None, got "
                             f"{megatron!r}")
        for name in ("megatron_forward_fixed_s", "megatron_backward_fixed_s"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(
                    value, int | float) or not (math.isfinite(value) and value >= 0)):
                raise ValueError(f"MachineConstants.{name} must be None or a finite number "
                                 f">= 0, got {value!r}")
        for name in ("gemm_flops_per_s", "alltoall_bytes_per_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not (
                    math.isfinite(value) and value > 0):
                raise ValueError(f"MachineConstants.{name} must be a positive finite number, "
                                 f"got {value!r}")
        lat = self.alltoall_latency_s
        if isinstance(lat, bool) or not isinstance(lat, int | float) or not (
                math.isfinite(lat) and lat >= 0):
            raise ValueError(f"MachineConstants.alltoall_latency_s must be a finite number "
                             f">= 0, got {lat!r}")
        if not isinstance(self.source, str):
            raise ValueError(f"MachineConstants.source must be a string, got {self.source!r}")

    def instance_gemm_seconds(self, rows, flops_per_row: float, forward: bool) -> np.ndarray:
        """Seconds of one expert instance's forward (or backward) GEMMs at each of
        ``rows`` rows, ``flops_per_row`` FLOP per row: from the rate tables where measured
        (interpolated linearly in rows, ``CostModel`` module doc, "Time"), else at
        ``gemm_flops_per_s``; 0 at 0 rows (no GEMM runs. Both layers still call an empty
        instance, whose backward zero-fills and accumulates a weight gradient: 0.45 ms on
        this project's CPU at the study's shape against 3.2 ms at 16 rows, left out)."""
        rows = np.asarray(rows, dtype=np.float64)
        if not self.gemm_rows:
            return rows * flops_per_row / self.gemm_flops_per_s
        rates = self.gemm_forward_flops_per_s if forward else self.gemm_backward_flops_per_s
        return np.where(rows > 0, _interpolated_time(rows, self.gemm_rows, rates,
                                                     flops_per_row), 0.0)

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> MachineConstants:
        """Read a calibration file; errors name the file and the offending key.

        Keys: the fields above, plus an optional ``details`` object that is ignored
        (the calibration tool records its measurement settings there).
        """
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except OSError as err:
            raise ValueError(f"{path}: cannot read calibration file: {err}") from err
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not valid JSON: {err}") from err
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known - {"details"})
        if unknown:
            raise ValueError(f"{path}: unknown key(s) {unknown}; expected {sorted(known)}")
        for key in ("gemm_flops_per_s", "alltoall_bytes_per_s"):
            if key not in data:
                raise ValueError(f"{path}: missing key {key!r}")
        try:
            return cls(**{k: v for k, v in data.items() if k in known})
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from err

    def to_json(self, path: str | os.PathLike, details: dict | None = None) -> None:
        """Write atomically (temporary file in the same folder, then ``os.replace``)."""
        path = Path(path)
        payload = asdict(self)
        if details:
            payload["details"] = details
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(payload, f, indent=2)
                f.write("\n")
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


@dataclass(frozen=True)
class MoEShape:
    """The shapes that set bytes and FLOPs of one MoE layer on one EP rank."""

    hidden_size: int
    ffn_hidden_size: int
    """Expert FFN size F (Megatron's moe_ffn_hidden_size)."""
    num_experts: int
    topk: int
    gated: bool
    """SwiGLU/GLU first layer (F1 = 2F)."""
    dtype_bytes: int
    """Bytes per element of parameters and activations (2 for bf16)."""
    tokens_per_rank: int
    """Tokens one EP rank routes per micro-batch (micro_batch_size * seq_length, divided
    by the tensor-parallel size with sequence parallel)."""
    num_layers: int = 1
    """MoE layers this rank holds (its pipeline stage, all virtual chunks)."""
    microbatches_in_flight: int = 1
    """Peak micro-batches with live activations (1 without PP; PP size under 1F1B)."""
    microbatches_per_step: int = 1
    """Micro-batches per optimizer step (amortises the per-step replica refresh)."""
    grad_dtype_bytes: int | None = None
    """Bytes per element of a replica's gradient buffer (None: ``dtype_bytes``)."""
    expert_parallel_size: int | None = None
    """R, ranks of the expert-parallel group. It sets the local experts E / R (whose
    weights grouped GEMMs stack per call, and over which balanced routing spreads) and
    whether rows cross ranks at all (R = 1: no exchange or reorder copies). None: more
    than one rank, E / R unknown (not allowed with ``grouped_gemm``)."""
    grouped_gemm: bool = False
    """The region's expert GEMMs run grouped (grouped_mm: activation temporaries over
    all of a rank's rows at once, stacked weights); False: the per-expert loop (one
    instance's rows at a time), the CPU default (docs/design.md, "Region")."""

    megatron_layer: bool = False
    """The layer is Megatron's MoELayer (its all-to-all dispatcher and expert MLP), not the
    LRMoE region. Its expert MLP saved the activation's output in forward, so its
    backward skips the region's recompute of the activation (element passes), and a call
    pays Megatron's own fixed cost (``MachineConstants.megatron_forward_fixed_s``). Time
    only: the memory of Megatron's layer is ``MegatronMoEMemory``'s."""

    forward_retention: bool = False
    """The retained set is drawn in forward (rules that do not read the backward
    gradient: ``retention.retention_in_forward``). x_exp and z are then saved for the
    retained rows only, and the source's kept index and scale live from forward on."""

    recompute_moe: bool = False
    """Megatron reruns every MoE layer's forward in backward (``--recompute-granularity
    selective --recompute-modules moe``): no layer keeps its saved buffers between its
    forward and backward; the rerun holds them beside the first pass's output y."""
    full_recompute_layers: int = 0
    """Of the ``num_layers`` MoE layers, those Megatron's full recompute reruns in
    backward (``--recompute-granularity full``: uniform, all; block, those among the
    first ``--recompute-num-layers`` of the stage); they keep nothing between forward
    and backward either. ``rank_memory`` composes both (``kept_layers_fraction``) as
    ``stage_moe_memory`` does for a stage of like layers."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("gated", "grouped_gemm", "megatron_layer",
                          "forward_retention", "recompute_moe"):
                if not isinstance(value, bool):
                    raise ValueError(f"MoEShape.{f.name} must be a bool, got {value!r}")
                continue
            if f.name == "full_recompute_layers":
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise ValueError(f"MoEShape.full_recompute_layers must be an int >= 0, "
                                     f"got {value!r}")
                continue
            if value is None and f.name in ("grad_dtype_bytes", "expert_parallel_size"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MoEShape.{f.name} must be a positive int, got {value!r}")
        if self.topk > self.num_experts:
            raise ValueError(f"MoEShape.topk={self.topk} exceeds num_experts={self.num_experts}")
        ep = self.expert_parallel_size
        if ep is not None and self.num_experts % ep:
            raise ValueError(f"MoEShape.num_experts={self.num_experts} is not a multiple of "
                             f"expert_parallel_size={ep}")
        if self.grouped_gemm and ep is None:
            raise ValueError("MoEShape.grouped_gemm needs expert_parallel_size (grouped GEMMs "
                             "stack the weights of the E / R local experts per call)")

    @property
    def fc1_size(self) -> int:
        """F1: rows of W1 (2F when gated)."""
        return 2 * self.ffn_hidden_size if self.gated else self.ffn_hidden_size

    @property
    def weight_elements(self) -> int:
        """Elements of one expert's weights, W1 [F1, H] + W2 [H, F]."""
        return (self.fc1_size + self.ffn_hidden_size) * self.hidden_size

    @property
    def instance_bytes(self) -> int:
        """Bytes of one replica: weights plus a same-shape gradient buffer."""
        grad = self.grad_dtype_bytes or self.dtype_bytes
        return self.weight_elements * (self.dtype_bytes + grad)

    @property
    def source_pairs(self) -> int:
        """P: pairs one rank sends per micro-batch (tokens_per_rank * topk)."""
        return self.tokens_per_rank * self.topk

    @property
    def forward_flops_per_pair(self) -> int:
        """2H(F1 + F): the two expert GEMMs of one routed pair."""
        return 2 * self.weight_elements

    @property
    def backward_flops_per_pair(self) -> int:
        """Twice the forward: dX and dW of both GEMMs for one retained pair."""
        return 4 * self.weight_elements

    @property
    def forward_alltoall_messages(self) -> tuple[int, int]:
        """Bytes per pair of the forward's two all-to-alls: the dispatch row (H) and the
        combine row with the side statistic (H + 1)."""
        return self.row_bytes, self.row_bytes + self.dtype_bytes

    @property
    def backward_alltoall_messages(self) -> tuple[int, int]:
        """Bytes per pair of the backward's two all-to-alls: the gradient row with its
        int32 position, and the dX row sent back."""
        return self.row_bytes + _POSITION_BYTES, self.row_bytes

    # ---------------------------------------------------------------- memory terms
    @property
    def row_bytes(self) -> int:
        """One row of H elements: what every exchange, reorder and gradient buffer holds
        per pair (x, o, g, dX)."""
        return self.hidden_size * self.dtype_bytes

    @property
    def saved_bytes_per_routed_pair(self) -> int:
        """x_exp [H] + z [F1] kept from forward to backward on the expert side."""
        return (self.hidden_size + self.fc1_size) * self.dtype_bytes

    @property
    def saved_bytes_per_source_pair(self) -> int:
        """Unweighted expert output o [H] kept for the router gradient, plus metadata."""
        return self.row_bytes + self.metadata_bytes_per_source_pair

    @property
    def metadata_bytes_per_source_pair(self) -> int:
        """Pair metadata, alive from before the region's forward to the end of its
        backward: the int64 (expert, token) pairs the token index is a view of, the
        probability, the side statistic a, the probability gather's int64 index; with
        ``forward_retention`` also the kept index (int64) and scale (fp32) of a kept pair."""
        return _PAIR_METADATA_BYTES + (_KEPT_BYTES if self.forward_retention else 0)

    @property
    def output_bytes(self) -> int:
        """T x H: the layer output y (in a run's backward, its gradient dy), and the token
        gradient dX the backward returns."""
        return self.tokens_per_rank * self.row_bytes

    @property
    def rerun_layers(self) -> int:
        """Of the stage's ``num_layers`` MoE layers, those whose forward runs again in
        backward: every one under ``recompute_moe``, the first ``full_recompute_layers``
        under full recompute."""
        if self.recompute_moe:
            return self.num_layers
        return min(self.full_recompute_layers, self.num_layers)

    @property
    def kept_layers_fraction(self) -> float:
        """kappa: the share of the stage's MoE layers that keep their saved buffers S from
        forward to backward (1 without recompute, 0 with ``recompute_moe``, (Lyr - n) / Lyr
        with n = ``full_recompute_layers``). A layer answers for kappa MiF S of kept
        bytes (``rank_memory``), so that Lyr like layers sum to ``stage_moe_memory``."""
        return (self.num_layers - self.rerun_layers) / self.num_layers

    @property
    def rerun_output_bytes(self) -> int:
        """What a rerun holds beside its transient peak: the first pass's output y under
        ``recompute_moe`` (the recomputed module's output is kept for the next layer);
        none under full recompute, which rebuilds the whole layer."""
        return self.output_bytes if self.recompute_moe else 0

    @property
    def backward_bytes_per_source_pair(self) -> int:
        """The source's per-pair bookkeeping in backward (metric, selection, slots,
        router gradient): at most 28 bytes; 16 with ``forward_retention``, whose kept
        index and scale exist from forward on (``metadata_bytes_per_source_pair``)."""
        return _SELECTION_BYTES_PER_PAIR - (_KEPT_BYTES if self.forward_retention else 0)

    @property
    def weight_gradient_temporary_bytes(self) -> int:
        """D: one expert's dW1 [F1, H] as the expert backward computes it, plus its copy
        in the gradient dtype when that differs (the add into a wider main_grad)."""
        elements = self.fc1_size * self.hidden_size
        grad = self.grad_dtype_bytes or self.dtype_bytes
        return elements * (self.dtype_bytes + (grad if grad != self.dtype_bytes else 0))

    @property
    def forward_activation_factor(self) -> int:
        """c: [n, F] tensors one instance's activation holds at once in forward: silu(z1),
        z2 + offset and h when gated; h otherwise."""
        return 3 if self.gated else 1


@dataclass(frozen=True)
class InstanceRows:
    """The rows of every expert instance of one layer call: ``rank`` [I] the rank hosting
    each, ``routed`` [I] the rows it computes in forward, ``retained`` [I] in backward."""

    rank: np.ndarray
    routed: np.ndarray
    retained: np.ndarray

    @classmethod
    def of_plan(cls, plan: RetentionPlan) -> InstanceRows:
        """Every instance's host rank and routed and retained rows of ``plan``."""
        return cls(np.asarray(plan.instance_rank, dtype=np.int64),
                   plan.routed_per_instance.numpy(), plan.retained_per_instance.numpy())


@dataclass(frozen=True)
class CostModel:
    """Memory (bytes) and time (seconds) of one MoE layer, per rank; see the module doc."""

    shape: MoEShape
    machine: MachineConstants

    # ----------------------------------------------------------------- memory
    def memory_share(self, budget_bytes: float) -> float:
        """One layer's share of a per-rank budget covering all Lyr layers."""
        return float(budget_bytes) / self.shape.num_layers

    # numpy on [R] arrays: the planner calls these once per layer and micro-batch,
    # where a torch op costs ~10 us and a numpy op ~1 us. Torch CPU tensors are accepted
    # too (``np.asarray`` reads them), but callers should pass ``tensor.numpy()``.
    def _layout(self, num_replicas: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
        """(xc, [R] rc, [R] L): 1.0 where the exchange copies exist (R > 1), 1.0 where
        the reorder copies exist too (the rank hosts more than one instance), and the
        local instances (NaN when the EP size is unknown: only grouped GEMMs read it)."""
        ep = self.shape.expert_parallel_size
        replicas = np.asarray(num_replicas, dtype=np.float64)
        if ep is None:
            return 1.0, np.ones_like(replicas), np.full_like(replicas, np.nan)
        local = self.shape.num_experts // ep + replicas
        xc = 0.0 if ep == 1 else 1.0
        return xc, xc * (local > 1), local

    def _held_weight_grads(self, num_replicas: np.ndarray,
                           local: np.ndarray) -> tuple[np.ndarray | float, np.ndarray | float]:
        """(dW2 stack, dW1 + dW2 stacks) [R] that grouped GEMMs hold past their GEMMs on a
        rank with replicas: the replicas' dW are views of the stacks, handed to the layer's
        hook at the end of the backward, so dW2 [I, H, F] lives through the dW1 GEMM and
        both through the dX return and the token gradient (measured on the fake-CUDA
        region, tests/layer/test_region_fake_cuda.py). (0, 0) for the per-expert loop."""
        if not self.shape.grouped_gemm:
            return 0.0, 0.0
        w1, w2, _ = self._grouped_terms(local)
        with_replicas = (np.asarray(num_replicas) > 0).astype(np.float64)
        return with_replicas * w2, with_replicas * (w1 + w2)

    def _grouped_terms(self, local: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
        """(L W1, L W2, D'): the stacked weights of the local instances, per call, and the
        gradient-dtype copy of one dW1."""
        s = self.shape
        w1 = s.fc1_size * s.hidden_size * s.dtype_bytes
        w2 = s.hidden_size * s.ffn_hidden_size * s.dtype_bytes
        return local * w1, local * w2, float(s.weight_gradient_temporary_bytes - w1)

    def _loop_backward_levels(self, gathered: float | np.ndarray
                              ) -> list[tuple[float | np.ndarray, float | np.ndarray, float]]:
        """The per-expert loop's backward levels above the gradient rows and dX, as
        (alpha, beta, const): alpha n + beta n' + const bytes for an instance of n
        retained rows after one of n' (``gathered`` 1 where the rank drops rows, so x
        and z are gathered per instance, else 0). In the loop's order: gathering x, then
        z, while the previous instance's x, z, h and dz live; the activation, while the
        previous h and dz live; the activation's backward (recomputed activation, dh and
        their gradients: 3 n F1 at its peak) with the previous dz; the dW GEMMs."""
        s = self.shape
        row, sr = s.row_bytes, s.saved_bytes_per_routed_pair
        f_b, f1_b = s.ffn_hidden_size * s.dtype_bytes, s.fc1_size * s.dtype_bytes
        held = f_b + f1_b                                  # one instance's h and dz per row
        return [(gathered * row, gathered * sr + held, 0.0),
                (gathered * sr, gathered * f1_b + held, 0.0),
                (gathered * sr + s.forward_activation_factor * f_b, held, 0.0),
                (gathered * sr + 3 * f1_b, f1_b, 0.0),
                (gathered * sr + held, 0.0, float(s.weight_gradient_temporary_bytes))]

    def _loop_activation(self, instance_routed: np.ndarray, instance_retained: np.ndarray,
                         rank_starts: np.ndarray, drops: np.ndarray
                         ) -> tuple[np.ndarray, np.ndarray]:
        """[R] bytes of the per-expert loop's activation temporaries at their forward and
        backward peaks, from the rows of each local instance (module docstring)."""
        s = self.shape
        f_b = s.ffn_hidden_size * s.dtype_bytes
        n_f = np.asarray(instance_routed, dtype=np.float64)
        n_b = np.asarray(instance_retained, dtype=np.float64)
        starts = np.asarray(rank_starts, dtype=np.int64)
        count = n_f.shape[0]
        index = np.arange(count)
        sizes = np.diff(np.append(starts, count))
        first = np.repeat(starts, sizes)                                  # [I] rank's first
        # Backward: the instance before e on its rank (an empty one replaces the buffers
        # too). Forward: the last one before e with rows (a skipped one leaves h as it was).
        before = np.where(index > first, n_b[np.maximum(index - 1, 0)], 0.0)
        last = np.maximum.accumulate(np.where(n_f > 0, index, -1))
        prev = np.append(-1, last[:-1])
        before_f = np.where(prev >= first, n_f[np.maximum(prev, 0)], 0.0)
        fwd = (s.forward_activation_factor * n_f + before_f) * f_b
        gathered = np.repeat(np.asarray(drops, dtype=np.float64), sizes)
        bwd = _max(*(alpha * n_b + beta * before + const
                     for alpha, beta, const in self._loop_backward_levels(gathered)))
        return np.maximum.reduceat(fwd, starts), np.maximum.reduceat(bwd, starts)

    def _forward_levels(self, routed: np.ndarray, xc: float, rc: np.ndarray,
                        local: np.ndarray, act_f: np.ndarray | None,
                        drops: np.ndarray | float) -> list[tuple]:
        """The forward's levels (module docstring) as (a, b): a + b K bytes at K retained
        rows (b = 0 but with ``forward_retention``); ``act_f``: the per-expert loop's
        activation bytes (unused with grouped GEMMs); ``drops``: 1 where the rank keeps
        fewer rows than it receives (then, with ``forward_retention``, x_exp and z are
        compacted to the retained rows at the end of the experts' forward)."""
        s = self.shape
        row, sr, p = s.row_bytes, s.saved_bytes_per_routed_pair, s.source_pairs
        meta = p * s.metadata_bytes_per_source_pair
        if s.grouped_gemm:
            f_b = s.ffn_hidden_size * s.dtype_bytes
            w1, w2, _ = self._grouped_terms(local)
            experts = _max(w1, s.forward_activation_factor * routed * f_b,
                           routed * (f_b + row) + w2)
        else:
            experts = routed * row + act_f
        levels = [(meta + xc * (p + routed) * row, 0.0),    # dispatch: x[pair_token], received
                  (meta + (1 + rc) * routed * row, 0.0),    # received and expert-major
                  (meta + routed * sr + experts, 0.0)]      # x_exp, z and the experts' buffers
        if not s.forward_retention:
            return levels + [
                (meta + rc * routed * (sr + 2 * row), 0.0),  # o and its source-major reorder
                (meta + xc * (routed * (sr + row) + p * row), 0.0)]  # o reordered, received
        hb, f1_b = s.hidden_size * s.dtype_bytes, s.fc1_size * s.dtype_bytes
        return levels + [
            # compaction beside o: x_exp, z and x_exp's kept rows; then z and both kept
            (drops * (meta + routed * (row + f1_b + hb)), drops * hb),
            (drops * (meta + routed * (row + f1_b)), drops * (hb + f1_b)),
            (meta + rc * 2 * routed * row, rc * sr),      # the saved rows, o and its reorder
            (meta + xc * (routed + p) * row, xc * sr)]    # the saved rows, o sent and received

    def rank_memory(self, num_replicas: np.ndarray, routed: np.ndarray,
                    retained: np.ndarray, sent_kept: np.ndarray | None = None,
                    instance_routed: np.ndarray | None = None,
                    instance_retained: np.ndarray | None = None,
                    rank_starts: np.ndarray | None = None) -> np.ndarray:
        """[R] float64 bytes one layer holds on each rank: its replicas, the saved buffers
        of MiF micro-batches routed like this one, and 1/Lyr of the rest of its peak
        (module docstring); under recompute, kappa of the saved buffers and 1/Lyr of the
        rest with the rerun's output (``kept_layers_fraction``, ``rerun_output_bytes``).
        Compare with ``memory_share(budget)``.

        ``sent_kept`` [R]: pairs each rank keeps as a source (None: all P of them, an
        upper bound). ``instance_routed``, ``instance_retained`` [I] (rank-major) with
        ``rank_starts`` [R]: the rows of every instance, which set the per-expert loop's
        activation temporaries (None: bounded by the rank's totals; grouped GEMMs do
        not need them)."""
        s = self.shape
        saved, peak = self.rank_levels(routed, retained, num_replicas, sent_kept,
                                       instance_routed, instance_retained, rank_starts)
        kappa = s.kept_layers_fraction
        return (np.asarray(num_replicas, dtype=np.float64) * s.instance_bytes
                + kappa * s.microbatches_in_flight * saved
                + (peak - kappa * saved + s.rerun_output_bytes) / s.num_layers)

    def rank_levels(self, routed: np.ndarray, retained: np.ndarray,
                    num_replicas: np.ndarray, sent_kept: np.ndarray | None = None,
                    instance_routed: np.ndarray | None = None,
                    instance_retained: np.ndarray | None = None,
                    rank_starts: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """([R] saved bytes S, [R] peak bytes) of one micro-batch of one layer, above what
        exists before the call, replicas excluded: what ``rank_memory`` composes (its
        arguments) and ``stage_moe_memory`` composes under recompute, as
        ``MegatronMoEMemory.rank_memory`` gives them for Megatron's layer."""
        s = self.shape
        routed = np.asarray(routed, dtype=np.float64)
        retained = np.asarray(retained, dtype=np.float64)
        xc, rc, local = self._layout(num_replicas)
        kept = (np.asarray(sent_kept, dtype=np.float64) if sent_kept is not None
                else (s.source_pairs if xc else retained))
        row, sr, p = s.row_bytes, s.saved_bytes_per_routed_pair, s.source_pairs
        f_b, f1_b = s.ffn_hidden_size * s.dtype_bytes, s.fc1_size * s.dtype_bytes
        drops = (retained < routed).astype(np.float64)
        # Rows whose x_exp and z are saved, and whether backward gathers them per instance
        # (with forward retention they are compacted in forward instead).
        fr = s.forward_retention
        saved = (retained if fr else routed) * sr + p * s.saved_bytes_per_source_pair
        gathered = 0.0 * drops if fr else drops
        held_dw2, held_dw = self._held_weight_grads(num_replicas, local)
        if s.grouped_gemm:
            w1, w2, conv = self._grouped_terms(local)
            act_f = None
            experts_bwd = gathered * retained * sr + _max(
                2 * retained * f1_b + w2, 3 * retained * f1_b,
                retained * (2 * f_b + f1_b + row) + w1 + conv + held_dw2)
        else:
            if instance_routed is not None:
                act_f, act_b = self._loop_activation(instance_routed, instance_retained,
                                                     rank_starts, gathered)
            else:
                # n, n' <= min(K, N) and n + n' <= K: alpha n + beta n' is at most
                # min(alpha, beta) K + |alpha - beta| min(K, N).
                min_kn = np.minimum(retained, routed)
                act_f = s.forward_activation_factor * routed * f_b
                act_b = _max(*(np.minimum(alpha, beta) * retained
                               + np.abs(alpha - beta) * min_kn + const for alpha, beta, const
                               in self._loop_backward_levels(gathered)))
            experts_bwd = retained * row + act_b
        forward = _max(*(a + b * retained for a, b
                         in self._forward_levels(routed, xc, rc, local, act_f, drops)))
        base = saved + s.output_bytes + p * s.backward_bytes_per_source_pair
        backward = base + _max(
            (xc * retained + kept) * row,               # gradient rows sent and received
            (1 + rc) * retained * row,                  # received and reordered; dX too
            retained * row + experts_bwd,               # the expert backward
            (retained + xc * kept) * row + held_dw,     # dX sent back and received
            kept * row + s.output_bytes + held_dw)      # dX received, token gradient
        return saved, np.maximum(forward, backward)

    def plan_memory(self, plan: RetentionPlan, num_replicas: np.ndarray) -> np.ndarray:
        """[R] ``rank_memory`` at a retention plan: its routed and retained loads, each
        source's kept pairs and each instance's rows."""
        routed, retained, kw = self._plan_loads(plan)
        return self.rank_memory(num_replicas, routed, retained, **kw)

    def plan_levels(self, plan: RetentionPlan, num_replicas: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray]:
        """``rank_levels`` (saved, peak) [R] at a retention plan, as ``plan_memory``."""
        routed, retained, kw = self._plan_loads(plan)
        return self.rank_levels(routed, retained, num_replicas, **kw)

    @staticmethod
    def _plan_loads(plan: RetentionPlan) -> tuple[np.ndarray, np.ndarray, dict]:
        """(routed [R], retained [R], the per-source and per-instance keywords) of a plan."""
        counts, quotas = plan.counts.numpy(), plan.quotas.numpy()
        starts = np.searchsorted(np.asarray(plan.instance_rank), np.arange(plan.num_ranks))
        inst_routed, inst_retained = np.add.reduce(counts, axis=0), np.add.reduce(quotas,
                                                                                    axis=0)
        return (np.add.reduceat(inst_routed, starts), np.add.reduceat(inst_retained, starts),
                dict(sent_kept=np.add.reduce(quotas, axis=1), instance_routed=inst_routed,
                     instance_retained=inst_retained, rank_starts=starts))

    def assignment_capacity(self, share: float, num_replicas: np.ndarray) -> np.ndarray:
        """[R] int64: the most routed pairs a rank can receive within ``share`` when
        backward drops as much as it may (nothing retained; its pairs as a source all
        kept, and one instance's activation over all its rows: upper bounds), i.e. the
        largest N with ``rank_memory(num_replicas, N, 0) <= share``."""
        s = self.shape
        xc, rc, local = self._layout(num_replicas)
        row, sr, p = s.row_bytes, s.saved_bytes_per_routed_pair, s.source_pairs
        f_b = s.ffn_hidden_size * s.dtype_bytes
        kept = xc * p
        meta = p * s.metadata_bytes_per_source_pair
        # sn: saved bytes per routed row (with forward retention nothing is saved at K = 0).
        sn = 0.0 if s.forward_retention else sr
        # Levels a + b N at retained = 0 (module docstring), forward then backward.
        phases = [(meta + xc * p * row, xc * row), (meta, (1 + rc) * row),
                  (meta, rc * (sn + 2 * row)), (meta + xc * p * row, xc * (sn + row))]
        if s.forward_retention:
            phases.append((meta, sr + row))                 # x_exp and z beside o, compacted
        held_dw2, held_dw = self._held_weight_grads(num_replicas, local)
        if s.grouped_gemm:
            w1, w2, conv = self._grouped_terms(local)
            phases += [(meta + w1, sr), (meta, sr + s.forward_activation_factor * f_b),
                       (meta + w2, sr + f_b + row)]
            bwd_experts = np.maximum(w2, w1 + conv + held_dw2)
        else:
            phases.append((meta, sr + row + s.forward_activation_factor * f_b))
            bwd_experts = s.weight_gradient_temporary_bytes
        base = p * s.saved_bytes_per_source_pair + s.output_bytes + \
            p * s.backward_bytes_per_source_pair
        phases += [(base + np.maximum(kept * row + s.output_bytes + held_dw, bwd_experts), sn)]
        # fixed + k MiF S + (level - k S + y') / Lyr <= share, S = N sn + P ss,
        # level = a + b N (k: kept_layers_fraction, y': rerun_output_bytes).
        mif, lyr, k = s.microbatches_in_flight, s.num_layers, s.kept_layers_fraction
        fixed = np.asarray(num_replicas, dtype=np.float64) * s.instance_bytes
        saved_p = p * s.saved_bytes_per_source_pair
        a, b = (_stack(values, rc.shape) for values in zip(*phases, strict=True))
        coef = k * mif * sn + (b - k * sn) / lyr
        rhs = (share - fixed - k * mif * saved_p
               - (a - k * saved_p + s.rerun_output_bytes) / lyr)
        return _to_count(np.minimum.reduce(_solve(rhs, coef), axis=0))

    def retained_limit(self, share: float, num_replicas: np.ndarray, routed: np.ndarray,
                       largest_routed: np.ndarray | None = None) -> np.ndarray:
        """[R] int64: the most retained pairs a rank can keep within ``share`` at its
        routed load, i.e. the largest K with ``rank_memory(num_replicas, routed, K) <=
        share`` (0 where not even K = 0 fits). Its pairs as a source count as all kept
        (an upper bound: the plan is not known yet); ``largest_routed`` [R], the routed
        rows of each rank's largest instance, tightens the per-expert loop's activation
        bound (None: the rank's routed rows)."""
        s = self.shape
        routed = np.asarray(routed, dtype=np.float64)
        xc, rc, local = self._layout(num_replicas)
        row, sr, p = s.row_bytes, s.saved_bytes_per_routed_pair, s.source_pairs
        f_b, f1_b = s.ffn_hidden_size * s.dtype_bytes, s.fc1_size * s.dtype_bytes
        largest = routed if largest_routed is None else np.minimum(
            np.asarray(largest_routed, dtype=np.float64), routed)
        fr = s.forward_retention
        # S = saved + K sk: x_exp and z of every routed row, or (forward retention) of the
        # retained ones.
        sk = sr if fr else 0.0
        saved = (0.0 if fr else routed * sr) + p * s.saved_bytes_per_source_pair
        fixed = np.asarray(num_replicas, dtype=np.float64) * s.instance_bytes
        mif, lyr, k = s.microbatches_in_flight, s.num_layers, s.kept_layers_fraction
        # fixed + k MiF S + (level - k S + y') / Lyr <= share (``rank_memory``): a level
        # may reach room - K sk k (MiF Lyr - 1). So every level's slope gains
        # k sk (MiF Lyr - 1) against ``room``.
        room = (share - fixed - k * mif * saved) * lyr + k * saved - s.rerun_output_bytes
        extra = k * sk * (mif * lyr - 1)
        # c n_e + n_e' <= (c - 1) * largest + routed for the loop's forward activation.
        act_f = ((s.forward_activation_factor - 1) * largest + routed) * f_b
        base = saved + s.output_bytes + p * s.backward_bytes_per_source_pair
        # Ks = P (a_s = P, b_s = 0) across ranks; Ks = K with one rank. Every backward
        # level holds S, so its slope has sk too.
        a_s, b_s = xc * p, 1.0 - xc
        # Levels a + b K + c min(K, largest), c = 0 but for the loop's activation.
        held_dw2, held_dw = self._held_weight_grads(num_replicas, local)
        common = [(base + a_s * row, (xc + b_s) * row + sk, 0.0),
                  (base, (1 + rc) * row + sk, 0.0),
                  (base + xc * a_s * row + held_dw, (1 + xc * b_s) * row + sk, 0.0),
                  (base + a_s * row + s.output_bytes + held_dw, b_s * row + sk, 0.0)]
        limits = []
        for drop in (0.0, 1.0):            # the rank keeps every row / drops some
            # With forward retention the forward's levels depend on K; else they are
            # checked once below. Backward gathers x and z per instance only without it.
            gathered = 0.0 if fr else drop
            phases = list(common)
            if fr:
                phases += [(a, b, 0.0) for a, b in
                           self._forward_levels(routed, xc, rc, local, act_f, drop)]
            if s.grouped_gemm:
                w1, w2, conv = self._grouped_terms(local)
                rows = row + gathered * sr
                phases += [(base + w2, rows + 2 * f1_b + sk, 0.0),
                           (base, rows + 3 * f1_b + sk, 0.0),
                           (base + w1 + conv + held_dw2,
                            rows + 2 * f_b + f1_b + row + sk, 0.0)]
            else:
                phases += [(base + const, 2 * row + min(alpha, beta) + sk, abs(alpha - beta))
                           for alpha, beta, const in self._loop_backward_levels(gathered)]
            a, b, c = (_stack(values, routed.shape) for values in zip(*phases, strict=True))
            limits.append(np.minimum.reduce(
                _solve_piecewise(room - a, b + extra, c, largest), axis=0))
        keep_all, drop = limits
        limit = np.where(keep_all >= routed, keep_all, drop)
        # The forward must fit at all (the backward's levels at K = 0 are in the phases;
        # with forward retention the forward's too).
        fits = fr or _max(*(a for a, _ in self._forward_levels(
            routed, xc, rc, local, act_f, 0.0))) <= room
        return np.where(fits, _to_count(limit), 0).astype(np.int64)

    def balanced_dropless_need(self) -> float:
        """Bytes per rank for all layers and micro-batches in flight when every rank
        receives exactly its P source pairs (spread evenly over its E / R experts when
        the EP size is known; else bounded as without per-instance rows), with no
        replicas and no drop. A budget below this cannot hold even perfectly balanced
        routing: refuse it at start-up."""
        return self.balanced_need(1.0)

    def balanced_need(self, retention: float) -> float:
        """``balanced_dropless_need`` with a fraction ``retention`` in [0, 1] of every
        instance's rows retained (and of every rank's pairs kept as a source)."""
        s = self.shape
        p = np.array([float(s.source_pairs)])
        kept = p * min(1.0, max(0.0, float(retention)))
        ep = s.expert_parallel_size
        extra = {}
        if ep is not None and not s.grouped_gemm:
            local = s.num_experts // ep
            rows = np.full(local, float(s.source_pairs) / local)
            extra = dict(instance_routed=rows, instance_retained=rows * kept[0] / p[0],
                         rank_starts=np.zeros(1, dtype=np.int64))
        per_layer = self.rank_memory(np.zeros(1), p, kept, sent_kept=kept, **extra)
        return float(per_layer[0]) * s.num_layers

    def saved_memory(self, routed: np.ndarray, retained: np.ndarray) -> np.ndarray:
        """[R] float64 S, the bytes one micro-batch of this layer keeps from forward to
        backward on each rank (what ``rank_memory`` holds MiF times): x_exp and z of the
        routed rows (of the retained ones with ``forward_retention``), and each source
        pair's o and metadata."""
        s = self.shape
        rows = np.asarray(retained if s.forward_retention else routed, dtype=np.float64)
        return (rows * s.saved_bytes_per_routed_pair
                + s.source_pairs * s.saved_bytes_per_source_pair)

    def megatron_rank_memory(self, counts: np.ndarray, recompute: bool = False,
                             probs_require_grad: bool = True, padded: bool = False,
                             grouped: bool | None = None) -> np.ndarray:
        """[R] float64 bytes Megatron's own MoELayer holds on each rank, in
        ``rank_memory``'s terms (no replicas): MiF saved buffers plus 1/Lyr of the rest
        of its peak (``MegatronMoEMemory``), from the [R, E] routed counts (source rank x
        expert; after a capacity drop or pad: ``megatron_capacity_counts``).
        ``recompute``: ``--recompute-modules moe``; ``grouped``: TEGroupedMLP (an
        unvalidated model), default the shape's ``grouped_gemm``."""
        s = self.shape
        model = MegatronMoEMemory(
            s, grouped=s.grouped_gemm if grouped is None else grouped, recompute=recompute,
            probs_require_grad=probs_require_grad, padded=padded)
        saved, peak = model.rank_memory(counts)
        return s.microbatches_in_flight * saved + (peak - saved) / s.num_layers

    # ------------------------------------------------------------------- time
    def layer_time(self, routed_matrix: np.ndarray, retained_matrix: np.ndarray,
                   planner_s: float = 0.0, instances: InstanceRows | None = None
                   ) -> tuple[float, float]:
        """Estimated (forward_s, backward_s) of one layer and micro-batch from a plan's
        [R, R] routed and retained matrices (source rank x destination rank), numpy
        arrays: ``plan.routed_matrix.numpy()``, ``plan.retained_matrix.numpy()``.
        ``planner_s``: the planner's host time per call, added to the forward (0 where
        no planner runs, or where every alternative pays it alike). ``instances``: the
        rows of every expert instance (``InstanceRows.of_plan``), which prices the GEMMs
        instance by instance; without them a rank's rows are spread evenly over its
        instances (module doc, "Time")."""
        p = self.layer_time_parts(routed_matrix, retained_matrix, planner_s, instances)
        return (sum(v for k, v in p.items() if k.startswith("forward_")),
                sum(v for k, v in p.items() if k.startswith("backward_")))

    def layer_time_parts(self, routed_matrix: np.ndarray, retained_matrix: np.ndarray,
                         planner_s: float = 0.0, instances: InstanceRows | None = None
                         ) -> dict[str, float]:
        """``layer_time`` split into its terms (seconds), per phase (``forward_*``,
        ``backward_*``): ``gemm`` (expert GEMMs) and ``memory`` (the memory-bound row
        work) of the slowest rank (the one with the largest sum of the two),
        ``alltoall`` (bytes of the busiest link), ``router``, ``fixed`` (the two
        all-to-all latencies plus the measured fixed cost of a call) and, in forward,
        ``planner`` (``planner_s``)."""
        routed = np.asarray(routed_matrix, dtype=np.float64)
        retained = np.asarray(retained_matrix, dtype=np.float64)
        if routed.size:
            num_ranks = routed.shape[1]
            routed_rows, retained_rows = routed.sum(axis=0), retained.sum(axis=0)
            sent, kept = routed.sum(axis=1), retained.sum(axis=1)
        else:
            num_ranks = 1
            routed_rows = retained_rows = sent = kept = np.zeros(1)
        f_gemm, f_mem, b_gemm, b_mem = self._rank_times(routed_rows, retained_rows, sent,
                                                        kept, num_ranks, instances)
        f, b = int(np.argmax(f_gemm + f_mem)), int(np.argmax(b_gemm + b_mem))
        f_router, b_router = self._router_times()
        f_fixed, b_fixed = self._fixed_times()
        return {
            "forward_gemm": float(f_gemm[f]),
            "forward_memory": float(f_mem[f]),
            "forward_alltoall": float(self._alltoall_time(_alltoall_pairs(routed_matrix),
                                                          forward=True)),
            "forward_router": f_router,
            "forward_fixed": f_fixed,
            "forward_planner": float(planner_s),
            "backward_gemm": float(b_gemm[b]),
            "backward_memory": float(b_mem[b]),
            "backward_alltoall": float(self._alltoall_time(_alltoall_pairs(retained_matrix),
                                                           forward=False)),
            "backward_router": b_router,
            "backward_fixed": b_fixed,
        }

    @staticmethod
    def rank_loads(routed_matrix: np.ndarray, retained_matrix: np.ndarray) -> np.ndarray:
        """[6, R] what ``layer_time`` reads of a plan's [R, R] routed and retained
        matrices: the pairs each rank receives routed and retained (column sums), sends
        and keeps as a source (row sums), and the two diagonals (pairs that cross no
        link). ``layer_times`` prices a stack of them."""
        routed, retained = np.asarray(routed_matrix), np.asarray(retained_matrix)
        return np.stack([routed.sum(axis=0), retained.sum(axis=0), routed.sum(axis=1),
                         retained.sum(axis=1), np.diagonal(routed), np.diagonal(retained)])

    def layer_times(self, loads: np.ndarray) -> tuple[list[float], list[float]]:
        """``layer_time`` of K plans at once from their [K, 6, R] ``rank_loads`` (R >= 1,
        counts below 2**53), each to the bit: (forward_s, backward_s) lists of K; GEMMs
        spread evenly, no planner time. A planner that judges several candidate
        placements prices them in one call."""
        loads = np.asarray(loads, dtype=np.float64)
        if loads.ndim != 3 or loads.shape[1] != 6 or loads.shape[2] < 1:
            raise ValueError(f"layer_times: loads of shape {loads.shape}, expected "
                             f"[K, 6, R] (CostModel.rank_loads of each plan, R >= 1)")
        routed, retained, sent, kept, own_routed, own_retained = loads.transpose(1, 0, 2)
        num_ranks = loads.shape[2]
        f_gemm, f_mem, b_gemm, b_mem = self._rank_times(routed, retained, sent, kept,
                                                        num_ranks)
        rows = np.arange(len(loads))
        f, b = np.argmax(f_gemm + f_mem, axis=1), np.argmax(b_gemm + b_mem, axis=1)
        # _alltoall_pairs: the most pairs a rank sends to or receives from other ranks
        f_a2a = self._alltoall_time(np.maximum((sent - own_routed).max(axis=1),
                                               (routed - own_routed).max(axis=1)), True)
        b_a2a = self._alltoall_time(np.maximum((kept - own_retained).max(axis=1),
                                               (retained - own_retained).max(axis=1)), False)
        f_router, b_router = self._router_times()
        f_fixed, b_fixed = self._fixed_times()
        # layer_time's own sums (the builtin's float summation), term by term in its order
        forward = [sum([g, m, a, f_router, f_fixed, 0.0]) for g, m, a in zip(
            f_gemm[rows, f].tolist(), f_mem[rows, f].tolist(), f_a2a.tolist(), strict=True)]
        backward = [sum([g, m, a, b_router, b_fixed]) for g, m, a in zip(
            b_gemm[rows, b].tolist(), b_mem[rows, b].tolist(), b_a2a.tolist(), strict=True)]
        return forward, backward

    def load_time(self, max_routed: float, max_retained: float, alltoall_routed: float,
                  alltoall_retained: float, num_ranks: int | None = None) -> float:
        """Forward + backward seconds from the per-rank maxima ``layer_time`` uses (for
        planners that estimate loads without building a plan): the busiest rank receives
        ``max_routed`` rows and keeps ``max_retained``, every source sends its P pairs and
        keeps min(P, ``max_retained``). ``num_ranks``: the EP size (default: the shape's)."""
        return float(self.load_times(np.array([float(max_routed)]),
                                     np.array([float(max_retained)]),
                                     np.array([float(alltoall_routed)]),
                                     np.array([float(alltoall_retained)]), num_ranks)[0])

    def load_times(self, max_routed: np.ndarray, max_retained: np.ndarray,
                   alltoall_routed: np.ndarray, alltoall_retained: np.ndarray,
                   num_ranks: int | None = None) -> np.ndarray:
        """``load_time`` of many load estimates at once (float64 arrays of one shape),
        element by element the same arithmetic: a planner that judges a sequence of
        candidates prices them in one call."""
        p = float(self.shape.source_pairs)
        max_routed = np.asarray(max_routed, dtype=np.float64)
        max_retained = np.asarray(max_retained, dtype=np.float64)
        f_gemm, f_mem, b_gemm, b_mem = self._rank_times(
            max_routed, max_retained, np.full_like(max_routed, p),
            np.minimum(p, max_retained), num_ranks)
        f_fixed, b_fixed = self._fixed_times()
        return ((f_gemm + f_mem + b_gemm + b_mem) + sum(self._router_times())
                + self._alltoall_time(alltoall_routed, forward=True)
                + self._alltoall_time(alltoall_retained, forward=False) + f_fixed + b_fixed)

    def _local_instances(self, num_ranks: int | None) -> float:
        """L, instances per rank for the rows-per-GEMM of the rate tables: E / R (replicas
        not counted); 1 when the EP size is unknown."""
        ranks = num_ranks or self.shape.expert_parallel_size
        return max(1.0, self.shape.num_experts / ranks) if ranks else 1.0

    def _gemm_time(self, rows: np.ndarray, forward: bool, num_ranks: int | None
                   ) -> np.ndarray:
        """[R] seconds of the expert GEMMs of ranks with ``rows`` rows each, spread evenly
        over their L instances: L times one instance's time at rows / L rows
        (``MachineConstants.instance_gemm_seconds``; without rate tables that is rows x
        FLOP per row / ``gemm_flops_per_s`` whatever L)."""
        s = self.shape
        flops = s.forward_flops_per_pair if forward else s.backward_flops_per_pair
        local = self._local_instances(num_ranks)
        return local * self.machine.instance_gemm_seconds(rows / local, flops, forward)

    def _instance_gemm_times(self, instances: InstanceRows, num_ranks: int
                             ) -> tuple[np.ndarray, np.ndarray]:
        """([R] forward, [R] backward) seconds of the expert GEMMs, instance by instance:
        a rank's is the sum over its instances of one instance's time at that instance's
        rows (0 for an instance without rows: ``MachineConstants.instance_gemm_seconds``)."""
        s, m = self.shape, self.machine
        rank = np.asarray(instances.rank, dtype=np.int64)
        fwd = m.instance_gemm_seconds(instances.routed, s.forward_flops_per_pair, True)
        bwd = m.instance_gemm_seconds(instances.retained, s.backward_flops_per_pair, False)
        return (np.bincount(rank, weights=fwd, minlength=num_ranks),
                np.bincount(rank, weights=bwd, minlength=num_ranks))

    def _rank_times(self, routed: np.ndarray, retained: np.ndarray, sent: np.ndarray,
                    kept: np.ndarray, num_ranks: int | None,
                    instances: InstanceRows | None = None
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """([R] forward GEMM s, forward memory s, backward GEMM s, backward memory s) of
        ranks receiving ``routed`` rows and keeping ``retained`` of them, sending ``sent``
        pairs as sources and keeping ``kept``; the GEMMs instance by instance where
        ``instances`` are given, else spread evenly. Memory: the element passes of the
        module doc ("Time") times dtype bytes over ``memory_bytes_per_s`` (0 when
        unmeasured)."""
        s, m = self.shape, self.machine
        if instances is not None:
            f_gemm, b_gemm = self._instance_gemm_times(instances, len(routed))
        else:
            f_gemm = self._gemm_time(routed, True, num_ranks)
            b_gemm = self._gemm_time(retained, False, num_ranks)
        if m.memory_bytes_per_s <= 0:
            zero = np.zeros_like(routed)
            return f_gemm, zero, b_gemm, zero
        h, f, f1, t = s.hidden_size, s.ffn_hidden_size, s.fc1_size, s.tokens_per_rank
        ranks = num_ranks or s.expert_parallel_size or 2
        # Reorders between source-major and expert-major rows: only across ranks, and
        # only where a rank hosts more than one instance.
        reorder = 4.0 if ranks > 1 and self._local_instances(ranks) > 1 else 0.0
        act_f, act_b = (_ACT_PASSES_GATED if s.gated else _ACT_PASSES_PLAIN)
        if s.megatron_layer:
            act_b -= _ACT_RECOMPUTE_PASSES_GATED if s.gated else _ACT_RECOMPUTE_PASSES_PLAIN
        gathered = np.where(retained < routed, 2.0 * (h + f1), 0.0)   # x, z per instance
        f_elems = routed * (reorder * h + act_f * f) + sent * 3 * h + t * h
        b_elems = (retained * (reorder * h + act_b * f) + retained * gathered
                   + sent * 2 * h + kept * 4 * h + t * h)
        per_byte = s.dtype_bytes / m.memory_bytes_per_s
        return f_gemm, f_elems * per_byte, b_gemm, b_elems * per_byte

    def _router_times(self) -> tuple[float, float]:
        """(forward s, backward s) of the router over T tokens: the gate GEMM (2HE FLOP
        per token forward, 4HE backward) at ``gemm_flops_per_s`` and its elementwise work
        (reading x and writing the gradient of x, plus four passes over the E scores) at
        ``memory_bytes_per_s``; 0 when that is unmeasured."""
        s, m = self.shape, self.machine
        if m.memory_bytes_per_s <= 0:
            return 0.0, 0.0
        t, h, e, b = s.tokens_per_rank, s.hidden_size, s.num_experts, s.dtype_bytes
        return (t * (2 * h * e / m.gemm_flops_per_s + (h + 4 * e) * b / m.memory_bytes_per_s),
                t * (4 * h * e / m.gemm_flops_per_s
                     + (2 * h + 4 * e) * b / m.memory_bytes_per_s))

    def _transfer_time(self, num_bytes) -> np.ndarray:
        """Seconds, besides the latency, of one all-to-all in which the busiest rank sends
        or receives ``num_bytes`` over its links: at ``alltoall_bytes_per_s``, or from the
        size table where the calibration measured one."""
        m = self.machine
        num_bytes = np.asarray(num_bytes, dtype=np.float64)
        if not m.alltoall_sizes:
            return num_bytes / m.alltoall_bytes_per_s
        return _interpolated_time(num_bytes, m.alltoall_sizes, m.alltoall_size_bytes_per_s, 1.0)

    def _alltoall_time(self, pairs, forward: bool) -> np.ndarray:
        """Seconds, besides the latencies, of a phase's two all-to-alls when the busiest
        link carries ``pairs`` pairs (``MoEShape.forward_alltoall_messages``,
        ``backward_alltoall_messages``)."""
        s = self.shape
        messages = s.forward_alltoall_messages if forward else s.backward_alltoall_messages
        pairs = np.asarray(pairs, dtype=np.float64)
        return sum(self._transfer_time(pairs * size) for size in messages)

    def _fixed_times(self) -> tuple[float, float]:
        """(forward s, backward s) fixed per call: two all-to-all latencies each, plus the
        measured fixed cost of the layer's call (Megatron's own where ``megatron_layer``
        and measured, else the LRMoE layer's)."""
        m = self.machine
        forward, backward = m.layer_forward_fixed_s, m.layer_backward_fixed_s
        if self.shape.megatron_layer and m.megatron_forward_fixed_s is not None:
            forward, backward = m.megatron_forward_fixed_s, m.megatron_backward_fixed_s
        return (2 * m.alltoall_latency_s + forward, 2 * m.alltoall_latency_s + backward)

    def replica_sync_time(self, replicas: tuple[tuple[int, int], ...], num_ranks: int,
                          experts_per_rank: int) -> float:
        """Seconds per step to refresh replicas (home -> host weights) and reduce their
        gradients (host -> home), each phase paced by its busiest rank; 0 without
        replicas. Divide by ``shape.microbatches_per_step`` to compare with a layer time."""
        if not replicas:
            return 0.0
        sent = [0] * num_ranks      # per phase, a rank's traffic = max(sent, received)
        received = [0] * num_ranks
        for e, r in replicas:
            sent[e // experts_per_rank] += 1
            received[r] += 1
        return self._replica_transfer_time(
            max(max(a, b) for a, b in zip(sent, received, strict=True)))

    def replica_cost_per_microbatch(self, busiest: int) -> float:
        """What replicas cost per micro-batch in transfers (seconds), to weigh against the
        time they save per micro-batch: once per step the refresh (weights, home ->
        holder, in the weight dtype) and the gradient reduction (holder -> home, in the
        gradient dtype), two all-to-alls each paced by the rank that sends or receives
        the most replicas (``busiest``), amortised over ``shape.microbatches_per_step``;
        0 without replicas. A replica's memory is not a time: the planner's budget
        qualification weighs it."""
        if busiest <= 0:
            return 0.0
        return self._replica_transfer_time(busiest) / self.shape.microbatches_per_step

    def _replica_transfer_time(self, busiest: int) -> float:
        """Seconds per step of the refresh (weights, home -> holder, weight dtype) and
        the gradient reduction (holder -> home, gradient dtype) when the busiest rank
        sends or receives ``busiest`` replicas in each."""
        s = self.shape
        refresh = busiest * s.weight_elements * s.dtype_bytes
        reduction = busiest * s.weight_elements * (s.grad_dtype_bytes or s.dtype_bytes)
        return float(self._transfer_time(refresh) + self._transfer_time(reduction)
                     + 2 * self.machine.alltoall_latency_s)


_INDEX_BYTES = 8            # int64 permutation indices of Megatron's dispatcher


@dataclass(frozen=True)
class MegatronMoEMemory:
    """Bytes of Megatron-Core 0.19.2's own MoELayer on one EP rank over one forward and
    backward, phase by phase as its code allocates and frees them: the all-to-all
    dispatcher with the unfused permute (``moe_utils.permute``: an index_select of the
    tokens in expert-major order; ``sort_chunks_by_idxs``: split + cat), no shared
    experts, no expert bias, TP = 1. The expert MLP is ``SequentialMLP`` (one
    ``MLP`` per local expert, torch autograd over Megatron's linear function and the
    unfused activation: ``bias_activation_fusion`` off, as on CPU) or, with ``grouped``,
    ``TEGroupedMLP`` (see below). Levels are above what exists before the call (the
    layer input, the routing, weights and their gradient buffers); the output y [T, H]
    is in them, as it is in the LRMoE layer's (``CostModel.rank_memory``).

    Inputs: the rows each local expert of the rank receives (``expert_rows``, in
    local-expert order; after a capacity drop or pad: ``megatron_capacity_counts``),
    the rows the rank sends (``sent``, its P pairs after any drop, or capacity x E
    padded) and the EP size. b = dtype bytes, a row = H b; x = 1 with more than one rank
    (the all-to-all makes a new buffer; with one rank it returns its input), r = 1 with
    more than one local expert (the chunk sort and unsort copy), g = 1 where the
    router's probabilities require grad (training; the benchmark's forced routing
    passes constant ones).

    Saved for backward, per received row: the expert input (H, one buffer: fc1 saves
    views of it), z [F1] (silu's input, a view of fc1's output), silu(z1), z2 + offset
    and the activation product's output (3F, gated; plain: the activation output h,
    F), its product with the probability when g (F), and the probability; plus the
    int64 indices of the permutation (P), and with g the full argsort [E, T] the
    probability gather keeps. S = N (H + F1 + (c + g) F) b + N b + 8 P (+ 8 E T g),
    c = 3 gated, 1 plain. With ``recompute`` (``--recompute-modules moe``: the whole
    layer under ``tensor_parallel.checkpoint``) nothing but the layer input is saved,
    the first forward runs without autograd (lower levels), and backward reruns the
    forward with autograd beside the first call's output y: every level below gains
    T H b, so the peak is the dropless one plus one output.

    Forward levels (each holds the index bytes; from the sort on, the probability
    copies (1 + r) N b; A = P + x N + r N rows alive to the end of the call: the
    permuted tokens, the received ones and the sorted ones, all referenced by the
    layer's locals): permute P rows; dispatch P + x N rows; sort A rows; expert e of
    n rows after C rows: A rows + C (H + a) b + n max(F1 + 4F, a + H) b (gated; plain
    F1 + 2F), a = the saved activation bytes per row; the outputs' concatenation
    (r): A rows + N a b + 2 N rows; combine: A rows + N a b + N rows + x P rows;
    unpermute: A rows + N a b + (x P + (1 - x) N) rows + T rows.

    Backward levels, each + S + y: the unpermute's gather P rows; the combine's
    all-to-all P + x N rows; the unsort N + r N rows. Then the experts from the last
    one: the output gradient G = N rows stays until the first expert's fc2 backward
    is done, the input gradients of finished experts wait for the split's backward
    (n' H b each), an expert's saved activations go as its nodes finish. Per expert of
    n rows, above S + y + G + finished dX less its own saved activations: fc2 n (a +
    F) b + H F b (the dW2 temporary); the probability product n (a + F + g F) b;
    silu(z1) (z2 + o)'s product n (F1 + 5F) b; silu n (F1 + 3F) b; the chunk's cat
    n (F1 + 2F) b; fc1 n (F1 + H) b + F1 H b (dW1). (Plain: fc2 and the product as
    gated; the activation n (2 F1 + F) b; fc1 as gated.) After the experts (S down
    to the indices): the split's cat 2 N rows (r); the sort's 2 N rows (r); the
    dispatch's all-to-all N + x P rows; the token gradient P + T rows.

    ``grouped`` (TEGroupedMLP with TE's GroupedLinear and Megatron's fused weighted
    SwiGLU, the simulator's GPU layer): NOT VALIDATED, no GPU with Transformer Engine
    has measured it. From the code: fc1 and fc2 write one [N, F1] and one [N, H]
    tensor, the GroupedLinear saves its input as split views (no copy, bf16/fp32) and
    the weights; the activation saves z and the probabilities; so S = N (H + F1 + F)
    b + N b + indices. Forward: A rows + N (F1 + F + F) b at the activation (one [N,
    F] temporary of swiglu(z) before the weighting) and A rows + N (F1 + F) b + N rows
    after fc2 (no concatenation; the unsort as the sequential one's). Backward: fc2's
    dgrad N F b beside G; then, G gone, the activation's backward N (2F + F1 + g F) b
    above z (dh, dh x w, dz, swiglu(z) x dh); fc1's dgrad N (F1 + H) b. Weight gradients: none with
    ``wgrad_accumulation_fused`` (TE accumulates into main_grad, Megatron's default
    on GPU); else all L local experts' dW at once (TE allocates the list), L H F b at
    fc2 and L F1 H b at fc1. Shared with the sequential model: the dispatcher, the
    combine and the token gradient.
    """

    shape: MoEShape
    grouped: bool = False
    """TEGroupedMLP (unvalidated model) instead of SequentialMLP."""
    recompute: bool = False
    """``--recompute-modules moe``: the whole MoE layer checkpointed."""
    probs_require_grad: bool = True
    """The routing probabilities require grad (a trained router; False: forced
    constant probabilities, as the benchmark's skewed routing passes them)."""
    wgrad_accumulation_fused: bool = True
    """TE grouped only: weight gradients accumulate into main_grad (no temporaries)."""
    padded: bool = False
    """``--moe-pad-expert-input-to-capacity``: the permute's drop-and-pad branch, whose
    probability gather keeps a [P] index instead of the [E, T] argsort."""

    def phase_levels(self, expert_rows, sent: float, num_ranks: int
                     ) -> dict[str, float]:
        """Bytes held at each phase's highest point (class doc), in the code's order:
        ``forward/...`` then ``backward/...`` (with ``recompute`` the forward ones are
        those of the forward rerun inside backward)."""
        s = self.shape
        n = np.asarray(expert_rows, dtype=np.float64).reshape(-1)
        big_n, p, t = float(n.sum()), float(sent), float(s.tokens_per_rank)
        b, row = float(s.dtype_bytes), float(s.row_bytes)
        f, f1 = s.ffn_hidden_size * b, s.fc1_size * b
        xc = 1.0 if num_ranks > 1 else 0.0
        rc = 1.0 if n.size > 1 else 0.0
        pg = 1.0 if self.probs_require_grad else 0.0
        y = t * row
        index = self._index_bytes(p)
        act = self.activation_bytes_per_row
        # S of the call's own autograd graph (with recompute: the rerun's, in backward).
        saved = big_n * (row + act + b) + index
        alive = index + (p + xc * big_n + rc * big_n) * row + (1 + rc) * big_n * b
        levels: dict[str, float] = {
            "forward/permute": index + p * (row + b),
            "forward/dispatch": index + (p + xc * big_n) * (row + b),
            "forward/sort": alive,
        }
        if self.grouped:
            levels["forward/experts"] = alive + big_n * max(f1 + 2 * f, f1 + f + row)
            if rc:
                levels["forward/unsort"] = alive + big_n * act + 2 * big_n * row
        else:
            peak_row = (f1 + 4 * f) if s.gated else (f1 + 2 * f)
            before = np.concatenate(([0.0], np.cumsum(n)[:-1])) * (act + row)
            levels["forward/experts"] = alive + float(np.max(
                before + n * max(peak_row, act + row))) if n.size else alive
            if rc:
                levels["forward/concat"] = alive + big_n * act + 2 * big_n * row
        levels["forward/combine"] = alive + big_n * act + (big_n + xc * p) * row
        levels["forward/unpermute"] = (alive + big_n * act
                                       + (xc * p + (1 - xc) * big_n) * row + y)
        base = saved + y
        levels["backward/unpermute"] = base + p * row
        levels["backward/combine"] = base + (p + xc * big_n) * row
        if rc:
            levels["backward/unsort"] = base + (1 + rc) * big_n * row
        g_o = big_n * row
        w1, w2 = s.fc1_size * s.hidden_size * b, s.hidden_size * s.ffn_hidden_size * b
        if self.grouped:
            wg = 0.0 if self.wgrad_accumulation_fused else float(n.size)
            levels["backward/experts"] = max(
                base + g_o + big_n * f + wg * w2,
                base - big_n * f + big_n * (2 * f + f1 + pg * f),
                base - big_n * (f + f1) + big_n * (f1 + row) + wg * w1)
        else:
            steps = self._sequential_backward_steps()
            best = 0.0
            for e in range(n.size - 1, -1, -1):
                done = float(n[e + 1:].sum())
                b0 = base - float(n[e:].sum()) * act + g_o + done * row
                for k, (coef, const) in enumerate(steps):
                    freed = g_o if (e == 0 and k > 0) else 0.0
                    best = max(best, b0 - freed + n[e] * coef + const * (w2 if k == 0
                                                                         else w1))
            levels["backward/experts"] = best
            if rc:
                levels["backward/concat"] = y + index + 2 * big_n * row
        if rc:
            levels["backward/sort"] = y + index + 2 * big_n * row
        levels["backward/dispatch"] = y + index + (big_n + xc * p) * row
        levels["backward/token_gradient"] = y + index + (p + t) * row
        if self.recompute:
            levels = {k: v + y for k, v in levels.items()}
        return levels

    def _sequential_backward_steps(self) -> list[tuple[float, float]]:
        """One expert's backward levels as (bytes per row, weight temporaries: 1 at the
        first (dW2) and last (dW1) step, else 0), above the base less its own saved
        activations (class doc)."""
        s = self.shape
        b = float(s.dtype_bytes)
        f, f1, row = s.ffn_hidden_size * b, s.fc1_size * b, float(s.row_bytes)
        act, pg = self.activation_bytes_per_row, float(self.probs_require_grad)
        head = [(act + f, 1.0), (act + f + pg * f, 0.0)]
        if s.gated:
            middle = [(f1 + 5 * f, 0.0), (f1 + 3 * f, 0.0), (f1 + 2 * f, 0.0)]
        else:
            middle = [(2 * f1 + f, 0.0)]
        return head + middle + [(f1 + row, 1.0)]

    @property
    def activation_bytes_per_row(self) -> float:
        """a: bytes the expert MLP saves per received row besides its input and the
        probability (class doc)."""
        s = self.shape
        b = float(s.dtype_bytes)
        f, f1 = s.ffn_hidden_size * b, s.fc1_size * b
        if self.grouped:
            return f1 + f
        return f1 + ((3 if s.gated else 1) + float(self.probs_require_grad)) * f

    def saved_bytes(self, expert_rows, sent: float) -> float:
        """S: bytes autograd keeps from forward to backward besides the layer input (0
        with ``recompute``: the checkpoint saves the input only)."""
        if self.recompute:
            return 0.0
        s = self.shape
        big_n = float(np.asarray(expert_rows, dtype=np.float64).sum())
        return float(big_n * (s.row_bytes + self.activation_bytes_per_row + s.dtype_bytes)
                     + self._index_bytes(float(sent)))

    def _index_bytes(self, sent: float) -> float:
        """The permutation's int64 indices [P] (saved by the token gather and the
        unpermute's scatter), and with probabilities that require grad the index their
        gather saves: the full argsort [E, T], or [P] when padded."""
        s = self.shape
        if not self.probs_require_grad:
            return _INDEX_BYTES * sent
        return _INDEX_BYTES * (sent + (sent if self.padded
                                       else s.num_experts * s.tokens_per_rank))

    def peak_bytes(self, expert_rows, sent: float, num_ranks: int) -> float:
        """The most bytes the layer holds over one forward and backward on this rank."""
        return max(self.phase_levels(expert_rows, sent, num_ranks).values())

    def rank_memory(self, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """([R] saved bytes, [R] peak bytes) of every rank from the [R, E] routed counts
        (source rank x expert; after a capacity drop or pad,
        ``megatron_capacity_counts``), rank r hosting experts r L .. r L + L - 1."""
        counts = np.asarray(counts, dtype=np.float64)
        ranks, experts = counts.shape
        local = experts // ranks
        received = np.add.reduce(counts, axis=0).reshape(ranks, local)
        sent = np.add.reduce(counts, axis=1)
        saved = np.array([self.saved_bytes(received[r], sent[r]) for r in range(ranks)])
        peak = np.array([self.peak_bytes(received[r], sent[r], ranks) for r in range(ranks)])
        return saved, peak


def stage_moe_memory(saved: np.ndarray, peak: np.ndarray, replica_bytes: np.ndarray,
                     output_bytes: float, microbatches_in_flight: int = 1,
                     recompute_moe: bool = False, full_recompute_layers: int = 0
                     ) -> np.ndarray:
    """[R] bytes the MoE layers of a pipeline stage hold at their peak, under Megatron's
    recompute settings, from each layer's one-micro-batch levels: the sum over layers of
    what each keeps between its forward and backward, plus the mean over layers of the
    transient above it (the planner's convention: each layer answers for 1/Lyr of the
    stage's one transient peak, ``CostModel.rank_memory``).

    ``saved``, ``peak`` [Lyr, R]: S and the peak of each MoE layer in stage order
    (``CostModel.rank_levels`` or ``MegatronMoEMemory.rank_memory``); ``replica_bytes``
    [Lyr, R] (zeros for Megatron's layer); ``output_bytes``: the layer's output y, T H b.
    MiF = ``microbatches_in_flight``. What the layers' inputs cost is the memory
    account's (activations), in every case alike.

    * nothing recomputed: a layer keeps MiF S, its transient is peak - S. With no
      recompute the sum is that of ``rank_memory`` over the layers, exactly.
    * ``recompute_moe`` (``--recompute-modules moe``): no layer keeps anything; each is
      rerun in backward beside the first pass's output y: transient peak + y (one layer:
      ``MegatronMoEMemory(recompute=True)``'s peak).
    * ``full_recompute_layers`` n (``--recompute-granularity full --recompute-method
      block --recompute-num-layers n``; uniform is n = Lyr): the first n layers keep
      nothing, their transient is the rebuilt layer's peak; the rest as without.
    """
    saved, peak = np.asarray(saved, dtype=np.float64), np.asarray(peak, dtype=np.float64)
    layers = saved.shape[0]
    replicas = np.add.reduce(np.asarray(replica_bytes, dtype=np.float64), axis=0)
    mif = max(1, int(microbatches_in_flight))
    if recompute_moe:
        return replicas + np.add.reduce(peak + output_bytes, axis=0) / layers
    n = min(max(0, int(full_recompute_layers)), layers)
    kept = np.add.reduce(mif * saved[n:], axis=0)
    transient = np.concatenate([peak[:n], peak[n:] - saved[n:]])
    return replicas + kept + np.add.reduce(transient, axis=0) / layers


def megatron_capacity_counts(counts: np.ndarray, tokens: int, topk: int,
                             capacity_factor: float, pad: bool = False) -> np.ndarray:
    """[R, E] rows Megatron's MoELayer moves after ``--moe-expert-capacity-factor`` from
    the [R, E] routed counts before it (``apply_router_token_dropping``, per source rank
    over its ``tokens``: capacity C = ceil(T k / E x factor); the ``probs`` and
    ``position`` policies both keep min(count, C) of an expert's tokens, none dropped
    when C exceeds T) and, with ``--moe-pad-expert-input-to-capacity``, exactly C rows
    per source and expert (the dispatcher's capacity)."""
    counts = np.asarray(counts, dtype=np.float64)
    capacity = math.ceil(tokens * topk / counts.shape[1] * capacity_factor)
    if pad:
        return np.full_like(counts, float(capacity))
    if capacity > tokens:
        return counts.copy()
    return np.minimum(counts, float(capacity))


def _interpolated_time(rows: np.ndarray, table_rows: tuple[float, ...],
                       rates: tuple[float, ...], flops: float) -> np.ndarray:
    """Seconds of work of ``rows`` units (an instance's GEMM rows, an all-to-all's bytes)
    from rates measured at ``table_rows`` units, ``flops`` of work per unit: the measured
    times rows_i x flops / rate_i, interpolated linearly in rows; below the first point
    extended along the first segment (down to 0 s), above the last at the last point's
    rate (a single point: that rate throughout)."""
    rows = np.asarray(rows, dtype=np.float64)
    xs = np.asarray(table_rows)
    ts = xs * flops / np.asarray(rates)
    inside = np.interp(rows, xs, ts)
    above = ts[-1] + (rows - xs[-1]) * flops / rates[-1]
    if len(xs) > 1:
        slope = (ts[1] - ts[0]) / (xs[1] - xs[0])
        below = np.maximum(ts[0] + (rows - xs[0]) * slope, 0.0)
    else:
        below = rows * flops / rates[0]
    return np.where(rows < xs[0], below, np.where(rows > xs[-1], above, inside))


def _max_column_sum(matrix: np.ndarray) -> float:
    """max over destination ranks of the pairs they receive (0 for an empty matrix)."""
    return float(np.maximum.reduce(np.add.reduce(matrix, axis=0))) if matrix.size else 0.0


def _alltoall_pairs(matrix: np.ndarray) -> float:
    """max over ranks of max(pairs sent to, received from other ranks) of a numpy [R, R]
    matrix (source rank x destination rank); pairs to the rank itself cross no link."""
    if not matrix.size:
        return 0.0
    diagonal = np.diagonal(matrix)
    return float(max(np.maximum.reduce(np.add.reduce(matrix, axis=1) - diagonal),
                     np.maximum.reduce(np.add.reduce(matrix, axis=0) - diagonal)))


def _max(*values) -> np.ndarray:
    """Elementwise maximum of arrays and scalars (broadcast)."""
    return functools.reduce(np.maximum, values)


def _stack(values, shape: tuple[int, ...]) -> np.ndarray:
    """[len(values), *shape] float64 of scalars and arrays broadcast to ``shape``."""
    out = np.empty((len(values), *shape))
    for i, value in enumerate(values):
        out[i] = value
    return out


def _solve(rhs: np.ndarray, coef: np.ndarray) -> np.ndarray:
    """The largest real x with coef * x <= rhs (coef >= 0): +inf where any x fits, -inf
    where none does."""
    positive = coef > 0
    return np.where(positive, rhs / np.where(positive, coef, 1.0),
                    np.where(rhs >= 0, np.inf, -np.inf))


def _solve_piecewise(rhs: np.ndarray, b: np.ndarray, c: float | np.ndarray,
                     bend: np.ndarray) -> np.ndarray:
    """The largest real K with b K + c min(K, bend) <= rhs (b, c >= 0): the slope is b + c
    up to ``bend`` and b beyond it."""
    below = _solve(rhs, b + c)
    return np.where(below < bend, below, _solve(rhs - c * bend, b))


def _to_count(values: np.ndarray) -> np.ndarray:
    """floor, at least 0, as int64 (unbounded: 2**62)."""
    return np.floor(np.clip(values, 0.0, 2.0**62)).astype(np.int64)
