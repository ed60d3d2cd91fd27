"""The planner's memory and time model (docs/design.md, "Cost model").

Pure: a model shape and measured machine constants in, bytes and seconds out. No
timing constant lives here: GEMM rate and all-to-all bandwidth come from a
calibration file (``python -m megatron_lrmoe.calibrate``) or, without one, from
``megatron_lrmoe.lrmoe.machine.default_machine_constants``, which measures quickly.

Notation (docs/design.md, "Notation"): H hidden size, F expert FFN size, F1 = 2F with a
gated (SwiGLU) first layer else F, k top-k, b bytes per element of the parameters and
activations, P = tokens_per_rank * k pairs each rank sends per micro-batch (its
source pairs), Lyr the MoE layers of this rank, MiF micro-batches in flight.

Memory accounting of one layer on one rank (``rank_memory``), bytes:

  replicas   num_replicas * instance_bytes: each replica is W1 [F1, H] + W2 [H, F]
             in b bytes plus a gradient buffer of the same shape in
             ``grad_dtype_bytes`` (b unless set; a replica has no optimizer state)
  saved      MiF * (routed * (H + F1) * b + P * (H * b + 16)): what the region keeps
             from forward to backward per micro-batch in flight: x_exp [H] and z [F1]
             per routed pair received (expert side), the unweighted expert outputs o
             [H] per source pair that the combine keeps for the router gradient, and
             16 bytes of pair metadata (token index, probability, side statistic).
             Every micro-batch in flight is assumed to route like this one.
  transient  (max(routed * (4H + F1) * b, retained * (4H + 2 F1 + 2F) * b)
              + P * 3H * b) / Lyr: the working buffers while one micro-batch's layer
             computes. Forward per routed pair: the dispatch receive buffer, the
             expert output, two combine payload copies (4H) and the z concatenation
             (F1). Backward per retained pair: received gradient, gathered x, dX rows
             and their reorder (4H), gathered z and dz (2 F1), h and dh (2F). Source
             side per pair: send, receive and reorder copies (3H). Only one layer
             computes at a time, so each layer is charged 1/Lyr of its own: summed
             over layers that is the mean transient, which equals the peak when the
             layers are alike.

A per-rank budget covers all layers (docs/design.md, "Memory budget"); one layer's planner compares
``rank_memory`` with its share, budget / Lyr. ``balanced_dropless_need`` is Lyr times
the layer's memory at perfectly balanced routing (every rank receives P pairs), no
replicas, nothing dropped.

Time of one layer and micro-batch (``layer_time``), seconds. Expert-parallel phases
are separated by all-to-alls, so each phase takes its slowest rank's time:

  forward   max_r routed_r * 2H(F1 + F) / gemm_rate
            + (max_r a2a pairs_r) * (2H + 1) * b / bandwidth + 2 * latency
  backward  max_r retained_r * 4H(F1 + F) / gemm_rate
            + (max_r a2a pairs_r) * (2H * b + 4) / bandwidth + 2 * latency

where a2a pairs_r = max(pairs rank r sends to, receives from other ranks) of the
routed (forward: dispatch H, combine H + 1 values) or retained (backward: gradient
rows with an int32 position, dX rows) matrix; pairs to the rank itself cross no link.
The activation recompute of backward (a few percent of the GEMM work) is ignored.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np

from megatron_lrmoe.lrmoe.retention import RetentionPlan

__all__ = ["CostModel", "MachineConstants", "MoEShape"]

_PAIR_METADATA_BYTES = 16   # int64 token index + fp32 probability + fp32 side statistic
_POSITION_BYTES = 4         # int32 row position sent with each retained gradient row


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

    def __post_init__(self) -> None:
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

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "gated":
                if not isinstance(value, bool):
                    raise ValueError(f"MoEShape.gated must be a bool, got {value!r}")
                continue
            if value is None and f.name == "grad_dtype_bytes":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MoEShape.{f.name} must be a positive int, got {value!r}")
        if self.topk > self.num_experts:
            raise ValueError(f"MoEShape.topk={self.topk} exceeds num_experts={self.num_experts}")

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
    def forward_alltoall_bytes_per_pair(self) -> int:
        """Dispatch row (H) plus combine row with the side statistic (H + 1)."""
        return (2 * self.hidden_size + 1) * self.dtype_bytes

    @property
    def backward_alltoall_bytes_per_pair(self) -> int:
        """Gradient row with its int32 position, plus the dX row sent back."""
        return 2 * self.hidden_size * self.dtype_bytes + _POSITION_BYTES

    @property
    def saved_bytes_per_routed_pair(self) -> int:
        """x_exp [H] + z [F1] kept from forward to backward on the expert side."""
        return (self.hidden_size + self.fc1_size) * self.dtype_bytes

    @property
    def saved_bytes_per_source_pair(self) -> int:
        """Unweighted expert output o [H] kept for the router gradient, plus metadata."""
        return self.hidden_size * self.dtype_bytes + _PAIR_METADATA_BYTES

    @property
    def forward_transient_bytes_per_routed_pair(self) -> int:
        """Dispatch receive, expert output, two combine payloads (4H), z concat (F1)."""
        return (4 * self.hidden_size + self.fc1_size) * self.dtype_bytes

    @property
    def backward_transient_bytes_per_retained_pair(self) -> int:
        """Gradient, gathered x, dX and its reorder (4H); z, dz (2 F1); h, dh (2F)."""
        return (4 * self.hidden_size + 2 * self.fc1_size
                + 2 * self.ffn_hidden_size) * self.dtype_bytes

    @property
    def source_transient_bytes_per_pair(self) -> int:
        """Source side send, receive and reorder copies (3H)."""
        return 3 * self.hidden_size * self.dtype_bytes


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
    def _fixed_bytes(self, num_replicas: np.ndarray) -> np.ndarray:
        s = self.shape
        return (np.asarray(num_replicas, dtype=np.float64) * s.instance_bytes
                + s.microbatches_in_flight * s.source_pairs * s.saved_bytes_per_source_pair
                + s.source_pairs * s.source_transient_bytes_per_pair / s.num_layers)

    def rank_memory(self, num_replicas: np.ndarray, routed: np.ndarray,
                    retained: np.ndarray) -> np.ndarray:
        """[R] float64 bytes one layer holds on each rank: its replicas, the saved
        buffers of MiF micro-batches routed like this one, and 1/Lyr of its transient
        buffers (module docstring). Compare with ``memory_share(budget)``."""
        s = self.shape
        routed = np.asarray(routed, dtype=np.float64)
        retained = np.asarray(retained, dtype=np.float64)
        transient = np.maximum(routed * s.forward_transient_bytes_per_routed_pair,
                               retained * s.backward_transient_bytes_per_retained_pair)
        return (self._fixed_bytes(num_replicas)
                + s.microbatches_in_flight * s.saved_bytes_per_routed_pair * routed
                + transient / s.num_layers)

    def plan_memory(self, plan: RetentionPlan, num_replicas: np.ndarray) -> np.ndarray:
        """[R] ``rank_memory`` at a retention plan's routed and retained loads."""
        return self.rank_memory(num_replicas, plan.routed_per_rank.numpy(),
                                plan.retained_per_rank.numpy())

    def routing_capacity(self, share: float, num_replicas: np.ndarray) -> np.ndarray:
        """[R] int64: the most routed pairs a rank can receive within ``share`` when
        backward drops as much as it may (the forward buffers set the limit)."""
        s = self.shape
        per_pair = (s.microbatches_in_flight * s.saved_bytes_per_routed_pair
                    + s.forward_transient_bytes_per_routed_pair / s.num_layers)
        room = share - self._fixed_bytes(num_replicas)
        return np.maximum(np.floor(room / per_pair), 0.0).astype(np.int64)

    def retained_limit(self, share: float, num_replicas: np.ndarray,
                       routed: np.ndarray) -> np.ndarray:
        """[R] int64: the most retained pairs a rank can keep within ``share`` at its
        routed load (0 where the forward buffers alone do not fit)."""
        s = self.shape
        routed = np.asarray(routed, dtype=np.float64)
        room = (share - self._fixed_bytes(num_replicas)
                - s.microbatches_in_flight * s.saved_bytes_per_routed_pair * routed)
        limit = np.floor(room * s.num_layers / s.backward_transient_bytes_per_retained_pair)
        fwd_fits = routed * s.forward_transient_bytes_per_routed_pair <= room * s.num_layers
        return np.maximum(np.where(fwd_fits, limit, 0.0), 0.0).astype(np.int64)

    def balanced_dropless_need(self) -> float:
        """Bytes per rank for all layers and micro-batches in flight when every rank
        receives exactly its P source pairs, with no replicas and no drop. A budget
        below this cannot hold even perfectly balanced routing: refuse it at start-up."""
        p = np.array([float(self.shape.source_pairs)])
        per_layer = self.rank_memory(np.zeros(1), p, p)
        return float(per_layer[0]) * self.shape.num_layers

    # ------------------------------------------------------------------- time
    def layer_time(self, routed_matrix: np.ndarray,
                   retained_matrix: np.ndarray) -> tuple[float, float]:
        """Estimated (forward_s, backward_s) of one layer and micro-batch from a plan's
        [R, R] routed and retained matrices (source rank x destination rank), numpy
        arrays: ``plan.routed_matrix.numpy()``, ``plan.retained_matrix.numpy()``."""
        p = self.layer_time_parts(routed_matrix, retained_matrix)
        return (p["forward_gemm"] + p["forward_alltoall"] + p["forward_fixed"],
                p["backward_gemm"] + p["backward_alltoall"] + p["backward_fixed"])

    def layer_time_parts(self, routed_matrix: np.ndarray,
                         retained_matrix: np.ndarray) -> dict[str, float]:
        """``layer_time`` split into its terms (seconds): forward and backward expert
        GEMMs of the slowest rank, all-to-all bytes of the busiest link, and the fixed
        per-call latency of the two all-to-alls of each phase."""
        routed_matrix = np.asarray(routed_matrix)
        retained_matrix = np.asarray(retained_matrix)
        s, m = self.shape, self.machine
        return {
            "forward_gemm": _max_column_sum(routed_matrix) * s.forward_flops_per_pair
            / m.gemm_flops_per_s,
            "forward_alltoall": _alltoall_pairs(routed_matrix)
            * s.forward_alltoall_bytes_per_pair / m.alltoall_bytes_per_s,
            "forward_fixed": 2 * m.alltoall_latency_s,
            "backward_gemm": _max_column_sum(retained_matrix) * s.backward_flops_per_pair
            / m.gemm_flops_per_s,
            "backward_alltoall": _alltoall_pairs(retained_matrix)
            * s.backward_alltoall_bytes_per_pair / m.alltoall_bytes_per_s,
            "backward_fixed": 2 * m.alltoall_latency_s,
        }

    def load_time(self, max_routed: float, max_retained: float, alltoall_routed: float,
                  alltoall_retained: float) -> float:
        """Forward + backward seconds from the per-rank maxima ``layer_time`` uses (for
        planners that estimate loads without building a plan)."""
        s, m = self.shape, self.machine
        return ((max_routed * s.forward_flops_per_pair
                 + max_retained * s.backward_flops_per_pair) / m.gemm_flops_per_s
                + (alltoall_routed * s.forward_alltoall_bytes_per_pair
                   + alltoall_retained * s.backward_alltoall_bytes_per_pair)
                / m.alltoall_bytes_per_s + 4 * m.alltoall_latency_s)

    def replica_sync_time(self, replicas: tuple[tuple[int, int], ...], num_ranks: int,
                          experts_per_rank: int) -> float:
        """Seconds per step to refresh replicas (home -> host weights) and reduce their
        gradients (host -> home), each phase paced by its busiest rank; 0 without
        replicas. Divide by ``shape.microbatches_per_step`` to compare with a layer time."""
        if not replicas:
            return 0.0
        s, m = self.shape, self.machine
        weight = s.weight_elements * s.dtype_bytes
        grad = s.weight_elements * (s.grad_dtype_bytes or s.dtype_bytes)
        sent = [0] * num_ranks      # per phase, a rank's traffic = max(sent, received)
        received = [0] * num_ranks
        for e, r in replicas:
            sent[e // experts_per_rank] += 1
            received[r] += 1
        busiest = max(max(a, b) for a, b in zip(sent, received, strict=True))
        return busiest * (weight + grad) / m.alltoall_bytes_per_s + 2 * m.alltoall_latency_s


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
