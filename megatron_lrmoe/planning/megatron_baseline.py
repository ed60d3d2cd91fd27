"""Megatron-Core's own MoELayer as a baseline: its bytes per rank phase by phase
(``MegatronMoEMemory``), a pipeline stage's MoE memory (``stage_moe_memory``; step by step
over a run, ``steps_moe_memory``) and the rows its forward capacity factor keeps
(``megatron_kept_counts``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from megatron_lrmoe.planning.shapes import MoEShape

__all__ = ["MegatronMoEMemory", "megatron_kept_counts", "stage_moe_memory",
           "steps_moe_memory"]

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
    local-expert order; after a capacity drop or pad: ``megatron_kept_counts``),
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
        ``megatron_kept_counts``), rank r hosting experts r L .. r L + L - 1."""
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


def steps_moe_memory(saved: np.ndarray, peak: np.ndarray, replica_bytes: np.ndarray,
                     output_bytes: float, microbatches_in_flight: int = 1,
                     recompute_moe: bool = False, full_recompute_layers: int = 0
                     ) -> np.ndarray:
    """[N, R] bytes of a stage's MoE layers at each of N steps: ``stage_moe_memory`` of
    each step's own levels. ``saved``, ``peak``, ``replica_bytes`` [N, Lyr, R]: per step,
    each layer's S and peak (the most over the step's micro-batches) and the replicas it
    hosted in that step. A run must fit every step, so its need is the maximum of this
    over the steps; levels and replicas are never taken from different steps (a warm-up
    step's hot rank, before any replica, beside a later step's replicas is no step's
    memory)."""
    saved = np.asarray(saved, dtype=np.float64)
    peak = np.asarray(peak, dtype=np.float64)
    replica_bytes = np.asarray(replica_bytes, dtype=np.float64)
    if not saved.shape == peak.shape == replica_bytes.shape or saved.ndim != 3:
        raise ValueError(f"steps_moe_memory: expected three [N, Lyr, R] arrays, got "
                         f"{saved.shape}, {peak.shape}, {replica_bytes.shape}")
    return np.stack([stage_moe_memory(s, p, r, output_bytes, microbatches_in_flight,
                                      recompute_moe, full_recompute_layers)
                     for s, p, r in zip(saved, peak, replica_bytes, strict=True)])


def megatron_kept_counts(counts: np.ndarray, tokens: int, topk: int,
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
