"""The per-rank memory account of a run, and the MoE budget it leaves (``auto``).

Pure: plain numbers of the configuration in (``RunShape``: model, layout, precision,
optimizer, recompute), bytes per part out (``MemoryAccount``). No torch.distributed, no
Megatron; ``integration.planner_inputs.memory_account`` fills ``RunShape`` from a config and
the entry point's arguments. docs/design.md, "Memory budget" states the formulas; this
module implements them. Every part is an estimate of what the rank holds at its peak:

* **weights**: the stage's parameters (TP-sharded attention, dense MLP, word embeddings
  and output layer; EP/ETP-sharded experts; replicated norms, router and row biases)
  x the parameter bytes.
* **gradients**: the same elements x the gradient buffer's bytes (Megatron's DDP keeps
  fp32 main grads when it reduces in fp32; the buffer is full size, also under the
  distributed optimizer).
* **optimizer state**: Adam's two fp32 moments (SGD: one momentum) plus an fp32 master
  copy of bf16/fp16 parameters; divided by DP x CP (dense parameters) and the
  expert-data-parallel size (expert parameters) under the distributed optimizer.
* **activations** outside the MoE layers, of the rank's s b / CP tokens (context
  parallelism splits every sequence): the tensors Megatron's layers save for backward
  (norm inputs, linear inputs, Q/K/V, attention scores unless flash/fused, dense MLP,
  dropout masks, embedding dropout, the output layer's logits and its fp32 softmax), per
  micro-batch, x the micro-batches in flight, under the recompute setting.
* **moe**: the MoE peak, ``CostModel.balanced_dropless_need()``: what the rank's MoE
  layers hold (every micro-batch in flight) at balanced routing with nothing dropped,
  under the run's recompute (the shape's ``recompute_moe``, ``full_recompute_layers``).

The budget ``auto`` is ``device - (weights + gradients + optimizer + activations)``
(``auto_budget_bytes``). What the account omits: the CUDA context and the caching
allocator's fragmentation and reserve, communication buffers (NCCL, the all-to-all's
and the distributed optimizer's gather buckets beyond the grad buffer, context
parallelism's key/value blocks in flight), temporaries of
the optimizer step and of gradient clipping, and the router's and the dispatcher's
tensors outside the LRMoE region.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import numpy as np

from megatron_lrmoe.planning.cost_model import CostModel
from megatron_lrmoe.planning.megatron_baseline import MegatronMoEMemory, megatron_kept_counts

__all__ = ["GIB", "DeviceOutOfMemory", "MemoryAccount", "RunShape", "account_line",
           "auto_budget_bytes", "check_device", "layer_activation_bytes",
           "megatron_layer_levels", "memory_account", "moe_peak", "out_of_memory_message",
           "parameter_counts", "step_peak"]

GIB = 2**30

RECOMPUTE_GRANULARITIES = (None, "selective", "full")


@dataclass(frozen=True)
class RunShape:
    """The configuration numbers the account reads (one rank of one pipeline stage)."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    """Dense MLP size F (layers that are not MoE)."""
    num_attention_heads: int
    vocab_size: int
    """Padded vocabulary (a multiple of TP, as Megatron pads it)."""
    seq_length: int
    micro_batch_size: int
    kv_channels: int | None = None
    """Head dim d (None: hidden / heads)."""
    num_query_groups: int | None = None
    """Key/value heads (None: one per attention head)."""
    num_experts: int | None = None
    moe_ffn_hidden_size: int | None = None
    moe_layers: int = 0
    """MoE layers of the stage (``planner_inputs.moe_layers_per_stage``)."""
    shared_expert_size: int | None = None
    gated: bool = False
    """SwiGLU/GLU first linear (2F rows)."""
    layernorm_bias: bool = True
    """LayerNorm (weight and bias) or RMSNorm (weight only)."""
    linear_bias: bool = True
    qkv_bias: bool = False
    qk_layernorm: bool = False
    tied_embeddings: bool = True
    learned_positions: bool = False
    max_position_embeddings: int | None = None
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    expert_parallel: int = 1
    expert_tensor_parallel: int = 1
    data_parallel: int = 1
    """DP as Megatron counts it: world / (TP x PP x CP)."""
    context_parallel: int = 1
    """CP: each rank holds S / CP tokens of every sequence (attention exchanges keys and
    values); dense parameters shard their optimizer state over DP x CP."""
    sequence_parallel: bool = False
    param_bytes: int = 4
    grad_bytes: int = 4
    optimizer: str = "adam"
    distributed_optimizer: bool = False
    recompute_granularity: str | None = None
    recompute_modules: tuple[str, ...] = ("core_attn",)
    """With ``selective``; Megatron's default is core_attn."""
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    attention_scores_saved: bool = True
    """Unfused attention (Megatron's local DotProductAttention) saves the b a s^2 scores;
    flash/fused attention (Transformer Engine) saves its output statistics instead."""
    attention_dropout: bool = True
    hidden_dropout: bool = True
    microbatches_in_flight: int = 1
    """Micro-batches whose activations the first stage holds (PP size under 1F1B)."""

    def __post_init__(self) -> None:
        if self.recompute_granularity not in RECOMPUTE_GRANULARITIES:
            raise ValueError(f"RunShape.recompute_granularity must be one of "
                             f"{RECOMPUTE_GRANULARITIES}, got {self.recompute_granularity!r}")
        if self.optimizer not in ("adam", "sgd"):
            raise ValueError(f"RunShape.optimizer must be adam or sgd, got {self.optimizer!r}")
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, int) and not isinstance(value, bool) and value < 0:
                raise ValueError(f"RunShape.{f.name} must be >= 0, got {value}")

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def kv_heads(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch on one rank, s b / CP (the rank's sequence shard),
        before sequence parallelism's split over TP."""
        return self.seq_length * self.micro_batch_size // max(1, self.context_parallel)

    @property
    def dense_data_parallel(self) -> int:
        """Ranks holding the same dense parameters: DP x CP (Megatron's DDP and distributed
        optimizer work over the data-parallel group with context parallelism)."""
        return max(1, self.data_parallel * self.context_parallel)

    @property
    def expert_data_parallel(self) -> int:
        """Ranks holding the same expert shard: DP x CP x TP / (EP x ETP), as Megatron groups
        them (world / (PP x EP x ETP): the expert grid is cut from TP x CP x DP)."""
        ranks = self.dense_data_parallel * self.tensor_parallel
        return max(1, ranks // (self.expert_parallel * self.expert_tensor_parallel))


@dataclass(frozen=True)
class MemoryAccount:
    """Bytes per rank by part, at the rank's peak (module doc)."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    moe: float
    """The MoE peak (balanced dropless need of the rank's MoE layers)."""
    device: float | None = None
    """The device's size in bytes (None: not known)."""

    PARTS = ("weights", "gradients", "optimizer", "activations", "moe")

    @property
    def outside_moe(self) -> float:
        """Everything but the MoE part."""
        return self.weights + self.gradients + self.optimizer + self.activations

    @property
    def total(self) -> float:
        return self.outside_moe + self.moe


def _norm(shape: RunShape, size: int) -> int:
    return size * (2 if shape.layernorm_bias else 1)


def parameter_counts(shape: RunShape, first_stage: bool, last_stage: bool
                     ) -> tuple[float, float]:
    """(dense, expert) parameter elements one rank of a stage holds.

    Per layer: input norm, QKV [H, (a + 2 g) d / t] (+bias), projection [(a d) / t, H]
    (+bias H), QK norms (2 d), pre-MLP norm; a dense layer's MLP [H, F1 / t] + [F / t, H]
    (+biases F1 / t, H); an MoE layer's router [E, H], its E / EP local experts
    ((F1 + F) H / ETP each, +biases F1 + H: Megatron allows them at ETP 1 only) and
    shared experts ((S1 + S) H / t; Megatron refuses biases there); with biases also the
    router's [E]. First stage: word
    embeddings V H / t (+ positions P H); last stage: final norm, output layer V H / t
    (untied, or tied with PP > 1: the last stage holds its own copy).
    """
    h, t = shape.hidden_size, shape.tensor_parallel
    d, a, g = shape.head_dim, shape.num_attention_heads, shape.kv_heads
    qkv_out = (a + 2 * g) * d
    attention = h * qkv_out / t + a * d * h / t + _norm(shape, h) * 2
    if shape.linear_bias or shape.qkv_bias:
        attention += qkv_out / t
    if shape.linear_bias:
        attention += h
    if shape.qk_layernorm:
        attention += _norm(shape, d) * 2
    f = shape.ffn_hidden_size
    f1 = 2 * f if shape.gated else f
    dense_mlp = (f1 + f) * h / t + ((f1 / t + h) if shape.linear_bias else 0)
    layers = shape.num_layers // max(1, shape.pipeline_parallel)
    moe_layers = min(shape.moe_layers, layers) if shape.num_experts else 0
    dense = layers * attention + (layers - moe_layers) * dense_mlp
    expert = 0.0
    if moe_layers:
        fe = shape.moe_ffn_hidden_size or f
        fe1 = 2 * fe if shape.gated else fe
        local = shape.num_experts / shape.expert_parallel
        expert = moe_layers * local * ((fe1 + fe) * h / shape.expert_tensor_parallel
                                       + ((fe1 + h) if shape.linear_bias else 0))
        dense += moe_layers * shape.num_experts * (h + (1 if shape.linear_bias else 0))
        if shape.shared_expert_size:
            s = shape.shared_expert_size
            dense += moe_layers * ((2 * s if shape.gated else s) + s) * h / t
    vocab = shape.vocab_size * h / t
    if first_stage:
        dense += vocab
        if shape.learned_positions:
            dense += (shape.max_position_embeddings or shape.seq_length) * h
    if last_stage:
        dense += _norm(shape, h)
        if not shape.tied_embeddings or not first_stage:
            dense += vocab
    return dense, expert


def layer_activation_bytes(shape: RunShape, moe_layer: bool) -> float:
    """Bytes one transformer layer saves for backward per micro-batch, outside the MoE
    layer, without recompute (Korthikanti et al. 2022, generalised: p = activation bytes,
    N = s b / CP tokens of the rank, r = 1 / t with sequence parallelism, else 1; the
    scores' s is the whole sequence, the keys each query meets):

    * attention: input norm's input N H p r; QKV input N H p r; Q N a d p / t, K and V
      2 N g d p / t; unfused scores: softmax output N s a p / t, with attention dropout
      its mask N s a / t and output N s a p / t (flash/fused: the fp32 log-sum-exp
      N a 4 / t); projection input N a d p / t; hidden dropout mask N H r;
    * pre-MLP norm's input N H p r;
    * dense MLP: fc1 input N H p r, fc1 output N F1 p / t, activation output N F p / t,
      dropout mask N H r; an MoE layer: its output's dropout mask N H r (the rest is the
      MoE part).
    """
    n, h, p, t = shape.tokens, shape.hidden_size, shape.param_bytes, shape.tensor_parallel
    r = 1 / t if shape.sequence_parallel else 1.0
    a, d, g = shape.num_attention_heads, shape.head_dim, shape.kv_heads
    selective = (set(shape.recompute_modules) if shape.recompute_granularity == "selective"
                 else set())
    mask = 1 if shape.hidden_dropout else 0
    norm_out = 0.0 if "layernorm" in selective else n * h * p * r   # recomputed norm outputs
    scores = 0.0
    if "core_attn" not in selective:
        if shape.attention_scores_saved:
            scores = n * shape.seq_length * a * (p + ((1 + p) if shape.attention_dropout
                                                      else 0)) / t
        else:
            scores = n * a * 4 / t
    attention = (n * h * p * r + norm_out + n * a * d * p / t + 2 * n * g * d * p / t
                 + scores + n * a * d * p / t + n * h * mask * r)
    mlp = n * h * p * r                                                # pre-MLP norm input
    if moe_layer:
        mlp += n * h * mask * r
    else:
        f = shape.ffn_hidden_size
        f1 = 2 * f if shape.gated else f
        if "mlp" in selective:
            mlp += norm_out                                            # its input only
        else:
            mlp += norm_out + n * f1 * p / t + n * f * p / t + n * h * mask * r
    return attention + mlp


def _stage_layer_activations(shape: RunShape) -> float:
    """One micro-batch's saved activations of the stage's layers under the recompute
    setting. Full recompute (n = ``recompute_num_layers``, at most the stage's layers;
    m = the stage's mean layer activations): ``uniform`` keeps the input N H p r of each
    of ceil(L / n) units, plus one unit's n layers while it is recomputed in backward;
    ``block`` keeps the inputs of its first n layers and the other L - n layers in full
    (at least one layer's m: the recomputed one in backward)."""
    layers = shape.num_layers // max(1, shape.pipeline_parallel)
    moe = min(shape.moe_layers, layers) if shape.num_experts else 0
    per_moe = layer_activation_bytes(shape, True)
    per_dense = layer_activation_bytes(shape, False)
    full_all = moe * per_moe + (layers - moe) * per_dense
    if shape.recompute_granularity != "full":
        return full_all
    r = 1 / shape.tensor_parallel if shape.sequence_parallel else 1.0
    layer_input = shape.tokens * shape.hidden_size * shape.param_bytes * r
    mean = full_all / layers if layers else 0.0
    n = min(layers, max(1, shape.recompute_num_layers or 1))
    if shape.recompute_method == "block":
        # The first n layers keep their inputs; the rest keep everything, and are done
        # with in backward before one recomputed layer's activations are rebuilt.
        return n * layer_input + max(layers - n, 1) * mean
    return math.ceil(layers / n) * layer_input + n * mean


def _embedding_activations(shape: RunShape) -> float:
    """Embedding dropout's mask N H r (first stage)."""
    r = 1 / shape.tensor_parallel if shape.sequence_parallel else 1.0
    return shape.tokens * shape.hidden_size * r if shape.hidden_dropout else 0.0


def _logits_activations(shape: RunShape) -> float:
    """Last stage: the final norm's input N H p r, the output layer's input N H p (it is
    gathered over TP with sequence parallelism: r), the logits N V p / t and the
    vocab-parallel cross entropy's fp32 softmax N V 4 / t."""
    n, h, p, t = shape.tokens, shape.hidden_size, shape.param_bytes, shape.tensor_parallel
    r = 1 / t if shape.sequence_parallel else 1.0
    return 2 * n * h * p * r + n * shape.vocab_size * (p + 4) / t


def _optimizer_bytes_per_param(shape: RunShape) -> int:
    moments = 8 if shape.optimizer == "adam" else 4
    master = 4 if shape.param_bytes < 4 else 0
    return moments + master


def memory_account(shape: RunShape, moe_peak_bytes: float,
                   device_bytes: float | None = None) -> MemoryAccount:
    """The account of the rank with the most to hold: the first pipeline stage (word
    embeddings, ``microbatches_in_flight`` micro-batches of activations) or the last
    (output layer, one micro-batch and the logits), the larger; the same stage with
    PP = 1. ``moe_peak_bytes``: ``CostModel.balanced_dropless_need()`` of the rank's
    MoE layers (``moe_peak``)."""
    pp = max(1, shape.pipeline_parallel)
    stages = [(True, pp == 1)] + ([(False, True)] if pp > 1 else [])
    best = None
    layer_act = _stage_layer_activations(shape)
    for first, last in stages:
        dense, expert = parameter_counts(shape, first, last)
        params = dense + expert
        dp = shape.dense_data_parallel if shape.distributed_optimizer else 1
        edp = shape.expert_data_parallel if shape.distributed_optimizer else 1
        per_param = _optimizer_bytes_per_param(shape)
        in_flight = max(1, shape.microbatches_in_flight) if first else 1
        act = in_flight * layer_act
        if first:
            act += in_flight * _embedding_activations(shape)
        if last:
            act += _logits_activations(shape)
        account = MemoryAccount(
            weights=params * shape.param_bytes,
            gradients=params * shape.grad_bytes,
            optimizer=per_param * (dense / dp + expert / edp),
            activations=act,
            moe=float(moe_peak_bytes),
            device=device_bytes,
        )
        if best is None or account.total > best.total:
            best = account
    assert best is not None
    return best


def moe_peak(cost: CostModel | None) -> float:
    """The MoE part: the balanced dropless need of the rank's MoE layers (0 without)."""
    return 0.0 if cost is None else float(cost.balanced_dropless_need())


def auto_budget_bytes(account: MemoryAccount) -> float:
    """``--moe-lrmoe-memory-budget-gb auto``: the device's size less everything but the
    MoE part (may be <= 0: the caller compares it with ``budget_floor``)."""
    if account.device is None:
        raise ValueError("the device size is not known")
    return account.device - account.outside_moe


def account_line(account: MemoryAccount, budget_bytes: float | None = None,
                 source: str = "") -> str:
    """The start-up print: each part in GiB, the total, the device, the MoE budget."""
    parts = ", ".join(f"{name} {getattr(account, name) / GIB:.3f}"
                      for name in MemoryAccount.PARTS)
    text = f"memory account per rank (GiB, estimate): {parts}; total {account.total / GIB:.3f}"
    if account.device is not None:
        text += f"; device {account.device / GIB:.3f}"
    if budget_bytes is not None:
        text += f"; MoE budget {budget_bytes / GIB:.3f}"
        if source:
            text += f" ({source})"
    return text


# -----------------------------------------------------------------------------
# A run held to its device (--device-memory-gb): the predicted peak of every step
# -----------------------------------------------------------------------------


class DeviceOutOfMemory(RuntimeError):
    """A rank's peak in a step exceeds the device's size (``--device-memory-gb``): the
    out-of-memory stop of a run held to its device, as a device of that size would stop
    it. ``step``, ``rank``, ``need`` and ``device`` (bytes) name where and by how much."""

    def __init__(self, message: str, step: int, rank: int, need: float, device: float):
        super().__init__(message)
        self.step, self.rank, self.need, self.device = step, rank, need, device


def step_peak(outside_moe: float | np.ndarray, layer_bytes: np.ndarray) -> np.ndarray:
    """[R] predicted peak of each rank in a step: the account's part outside the MoE
    layers (a number, or [R]) plus the step's MoE bytes summed over the rank's MoE
    layers. ``layer_bytes`` [L, R]: each layer's bytes per rank in ``rank_memory``'s terms
    (MiF saved buffers plus 1/Lyr of the transient peak; the most of the step's
    micro-batches), so that the sum over the stage's layers is its MoE peak, as
    ``MemoryAccount.moe`` is at balanced routing."""
    layers = np.asarray(layer_bytes, dtype=np.float64)
    if layers.ndim != 2:
        raise ValueError(f"layer_bytes must be [L, R], got shape {layers.shape}")
    return np.asarray(outside_moe, dtype=np.float64) + layers.sum(axis=0)


def megatron_layer_levels(model: MegatronMoEMemory, counts: np.ndarray,
                          capacity_factor: float | None = None, pad: bool = False
                          ) -> tuple[np.ndarray, np.ndarray]:
    """([R] saved, [R] peak) of one of Megatron's own MoE layers in a step: the most over
    the step's micro-batches of ``MegatronMoEMemory.rank_memory`` of its routed counts
    ``counts`` [M, R, E] (micro-batch x source rank of one EP group x expert), after the
    capacity drop (or pad) of ``--moe-expert-capacity-factor`` when given. The stage
    composes its layers' levels with ``megatron_baseline.stage_moe_memory`` (recompute there)."""
    counts = np.asarray(counts, dtype=np.float64)
    if counts.ndim != 3:
        raise ValueError(f"counts must be [M, R, E], got shape {counts.shape}")
    s = model.shape
    saved = peak = np.zeros(counts.shape[1], dtype=np.float64)
    for routed in counts:
        if capacity_factor is not None:
            routed = megatron_kept_counts(routed, s.tokens_per_rank, s.topk,
                                              capacity_factor, pad)
        s_call, p_call = model.rank_memory(routed)
        saved, peak = np.maximum(saved, s_call), np.maximum(peak, p_call)
    return saved, peak


def _size(nbytes: float) -> str:
    """Bytes as the CUDA allocator's messages write them: GiB from 1 GiB on, else MiB."""
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / 2**20:.2f} MiB"


def out_of_memory_message(step: int, rank: int, account: MemoryAccount,
                          measured: float | None = None, ranks_over: int = 1,
                          world_size: int = 1, lrmoe: bool = False) -> str:
    """The out-of-memory stop's message: the step, the rank, its need, the device's size,
    the parts of the need, and what to change. ``account``: the rank's account of the
    step (its ``moe`` the step's MoE bytes; ``device`` set); ``measured``: the caching
    allocator's peak (CUDA), when read; the need is the larger of the two."""
    device = account.device
    if device is None:
        raise ValueError("the device size is not known")
    need = max(account.total, measured or 0.0)
    parts = ", ".join(f"{name} {_size(getattr(account, name))}"
                      for name in ("weights", "gradients", "optimizer", "activations"))
    text = (f"out of memory at step {step} on rank {rank}: needs {_size(need)}, the device "
            f"holds {_size(device)} (--device-memory-gb {device / GIB:g}); predicted peak "
            f"{_size(account.total)} = {parts}, MoE layers {_size(account.moe)} (this "
            f"step's routing)")
    if measured is not None:
        text += f"; allocator peak {_size(measured)} (torch.cuda.max_memory_allocated)"
    if world_size > 1:
        text += f"; {ranks_over} of {world_size} ranks over, the largest need shown"
    if lrmoe:
        advice = ("a lower --moe-lrmoe-bwd-capacity-factor (fewer rows kept for backward) "
                  "or --moe-lrmoe-memory-budget-gb auto (the planner lowers it to fit), ")
    else:
        advice = ("--moe-lrmoe with --moe-lrmoe-bwd-capacity-factor below 1 (fewer rows "
                  "kept for backward), --moe-expert-capacity-factor (drops tokens), ")
    return (text + ". To fit: lower --micro-batch-size, recompute the MoE layers "
            "(--recompute-granularity selective --recompute-modules moe), " + advice
            + "a larger --expert-model-parallel-size or --pipeline-model-parallel-size, "
            "or a larger --device-memory-gb if the device has it")


def check_device(step: int, account: MemoryAccount, moe: np.ndarray,
                 measured: np.ndarray | None = None, lrmoe: bool = False) -> None:
    """Hold a step to the device: ``moe`` [W] is each rank's MoE bytes of the step (the
    sum over its layers), ``measured`` [W] each rank's allocator peak (CUDA; None or 0
    where not read). Raises ``DeviceOutOfMemory`` for the rank with the largest need when
    any rank's predicted or measured peak exceeds ``account.device``; nothing otherwise
    (or without a device size)."""
    device = account.device
    if device is None:
        return
    moe = np.asarray(moe, dtype=np.float64)
    predicted = step_peak(account.outside_moe, moe[None, :])
    need = predicted if measured is None else np.maximum(
        predicted, np.asarray(measured, dtype=np.float64))
    over = need > device
    if not over.any():
        return
    rank = int(np.argmax(need))
    read = None if measured is None or not measured[rank] else float(measured[rank])
    message = out_of_memory_message(step, rank, replace(account, moe=float(moe[rank])),
                                    read, int(over.sum()), len(need), lrmoe)
    raise DeviceOutOfMemory(message, step, rank, float(need[rank]), float(device))
