"""The shapes that set one MoE layer's bytes and FLOPs on one EP rank (``MoEShape``), and
the rows of a planned call's expert instances (``InstanceRows``): what the memory and
time models (``layer_memory.py``, ``layer_time.py``) read. docs/design.md, "Cost model".
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from megatron_lrmoe.planning.retention import RetentionPlan

__all__ = ["InstanceRows", "MoEShape"]

# Saved per source pair besides o: the int64 (expert, token) pairs the token index is a
# view of (16), the probability (up to 4 in the dtypes trained), the side statistic a (4),
# the probability gather's int64 index (8).
_PAIR_METADATA_BYTES = 32
# Backward bookkeeping per source pair: metric fp32, kept row int64, router gradient fp32,
# kept index int64 and scale fp32 of a kept pair.
_SELECTION_BYTES_PER_PAIR = 28
_POSITION_BYTES = 4         # int32 row position sent with each retained gradient row
_KEPT_BYTES = 12            # kept index int64 + scale fp32 of a kept source pair


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

    expert_bias: bool = False
    """Each expert has biases b1 [F1] and b2 [H] (Megatron's ``add_bias_linear``): a
    replica carries them and their gradient buffer, and sends their gradients home."""

    forward_retention: bool = False
    """The retained set is drawn in forward (rules that do not read the backward
    gradient: ``retention.retention_in_forward``). x_exp and z are then saved for the
    retained rows only, and the source's kept index and scale live from forward on."""

    store_factor: float | None = None
    """rho of the ``two-stage`` rule (needs ``forward_retention``: its stored set is drawn
    in forward): x_exp and z are saved for the stored rows, min(n, floor(rho q)) per cell
    (at most rho x the retained rows and the routed ones), and backward draws the retained
    rows among them (gathered from the stored buffers). None: the rows saved are the
    retained ones (``forward_retention``) or every routed one."""

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
            if f.name in ("gated", "grouped_gemm", "megatron_layer", "expert_bias",
                          "forward_retention", "recompute_moe"):
                if not isinstance(value, bool):
                    raise ValueError(f"MoEShape.{f.name} must be a bool, got {value!r}")
                continue
            if f.name == "full_recompute_layers":
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise ValueError(f"MoEShape.full_recompute_layers must be an int >= 0, "
                                     f"got {value!r}")
                continue
            if value is None and f.name in ("grad_dtype_bytes", "expert_parallel_size",
                                            "store_factor"):
                continue
            if f.name == "store_factor":
                if (isinstance(value, bool) or not isinstance(value, (int, float))
                        or not 1.0 <= value < float("inf")):
                    raise ValueError(f"MoEShape.store_factor must be a finite number >= 1 or "
                                     f"None, got {value!r}")
                if not self.forward_retention:
                    raise ValueError("MoEShape.store_factor needs forward_retention (the "
                                     "two-stage rule draws its stored set in forward)")
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
    def bias_elements(self) -> int:
        """Elements of one expert's biases, b1 [F1] + b2 [H] (0 without)."""
        return self.fc1_size + self.hidden_size if self.expert_bias else 0

    @property
    def parameter_elements(self) -> int:
        """Elements of one expert's parameters: weights and biases."""
        return self.weight_elements + self.bias_elements

    @property
    def instance_bytes(self) -> int:
        """Bytes of one replica: parameters plus a same-shape gradient buffer."""
        grad = self.grad_dtype_bytes or self.dtype_bytes
        return self.parameter_elements * (self.dtype_bytes + grad)

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

    def stored_rows(self, routed: np.ndarray, retained: np.ndarray) -> np.ndarray:
        """[R] float64 rows whose x_exp and z are saved at ``routed`` and ``retained`` rows
        per rank: the retained ones with ``forward_retention``, at most min(routed, rho x
        retained) with ``store_factor`` (an upper bound of the per-cell floors), else the
        routed ones."""
        routed = np.asarray(routed, dtype=np.float64)
        retained = np.asarray(retained, dtype=np.float64)
        if not self.forward_retention:
            return routed
        if self.store_factor is None:
            return retained
        return np.minimum(routed, self.store_factor * retained)

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
        index and scale exist from forward on (``metadata_bytes_per_source_pair``), but
        for ``store_factor`` (two-stage), whose backward draws again."""
        drawn_before = self.forward_retention and self.store_factor is None
        return _SELECTION_BYTES_PER_PAIR - (_KEPT_BYTES if drawn_before else 0)

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
