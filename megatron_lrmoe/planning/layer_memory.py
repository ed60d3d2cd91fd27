"""Bytes of one LRMoE layer on one rank, phase by phase (``LayerMemory``, one half of
``CostModel``), and what a share of the budget admits: receive limits and retained
limits. docs/design.md, "Cost model".

The levels follow the buffers the region (layer/region.py, layer/expert_gemms.py)
allocates and frees; tests/planning/test_layer_memory.py checks them against an independent
ledger of those allocations and against the allocator, and benchmarks/bench_moe_layer.py
against a measured EP=2 forward+backward. numpy on [R] arrays: the planner calls these
once per layer and micro-batch, where a torch op costs ~10 us and a numpy op ~1 us.

Expert biases (``MoEShape.expert_bias``) save nothing more (z holds fc1's bias; the adds
are in place); a replica's b1, b2 and their gradient buffer are in ``instance_bytes``,
their gradients sent home in ``returned_gradient_bytes``. Left out: the bias gradients'
temporaries in the expert backward, (F1 + H) elements per instance (with grouped GEMMs
16 bytes each, and a 16-byte row of ones per retained row), under 1% of one [K, H] row
buffer at H >= 2048 (tests/planning/test_layer_memory.py holds a biased layer with
replicas to the allocator).
"""

from __future__ import annotations

import functools

import numpy as np

from megatron_lrmoe.planning.machine import MachineConstants
from megatron_lrmoe.planning.megatron_baseline import MegatronMoEMemory
from megatron_lrmoe.planning.placement import Placement
from megatron_lrmoe.planning.retention import RetentionPlan, stored_counts
from megatron_lrmoe.planning.shapes import MoEShape

__all__ = ["LayerMemory"]


class LayerMemory:
    """The memory half of ``CostModel`` (which holds ``shape`` and ``machine``)."""

    shape: MoEShape
    machine: MachineConstants

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
        """([R] held during the expert backward, [R] held after it) bytes of the replicas'
        dW, which the region hands to the layer's hook only at the end of its backward.

        Grouped GEMMs: the replicas' dW are views of the stacks, so dW2 [I, H, F] lives
        through the dW1 GEMM and both stacks through the dX return and the token gradient
        (measured on the fake-CUDA region, tests/layer/test_region_fake_cuda.py). The
        per-expert loop (replicas after the homes): every replica's dW1 and dW2 after the
        loop; during it, a bound of what its levels see, the dW of all replicas but the
        last and the last one's dW2 (``_loop_activation`` counts them per instance)."""
        replicas = np.asarray(num_replicas, dtype=np.float64)
        with_replicas = (replicas > 0).astype(np.float64)
        if not self.shape.grouped_gemm:
            dw1, dw2, _ = self._grouped_terms(1.0)                # one expert's dW1, dW2
            return (with_replicas * ((replicas - 1) * (dw1 + dw2) + dw2),
                    replicas * (dw1 + dw2))
        w1, w2, _ = self._grouped_terms(local)
        return with_replicas * w2, with_replicas * (w1 + w2)

    def returned_gradient_bytes(self, placement: Placement) -> np.ndarray:
        """[R] bytes each rank receives, and the sums it makes, when the step's last
        backward sends the replicas' gradients home (``ExpertReplicas.reduce_into_home``,
        inside the region's backward, after the token gradient exists): one expert's
        dW1 and dW2 (and db1, db2 with expert biases) in the gradient dtype per replica
        of the rank's home experts, one more
        per home expert with two or more replicas (their sum), and one dW1 of the sum's
        temporary where an expert has three or more."""
        s = self.shape
        num_ranks = placement.num_ranks
        per_expert = np.bincount(np.array([e for e, _ in placement.replicas], dtype=np.int64),
                                 minlength=placement.num_experts)                 # [E]
        home = np.arange(placement.num_experts) // placement.experts_per_rank
        # counts of small integers, exact in float64 whichever order they add in
        served = np.bincount(home, weights=per_expert, minlength=num_ranks)
        multi = np.bincount(home, weights=per_expert >= 2, minlength=num_ranks)
        many = (np.bincount(home, weights=per_expert >= 3, minlength=num_ranks) > 0
                ).astype(np.float64)
        grad = s.grad_dtype_bytes or s.dtype_bytes
        return grad * ((served + multi) * s.parameter_elements
                       + many * s.fc1_size * s.hidden_size)

    def _grouped_terms(self, local: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
        """(L W1, L W2, D'): the stacked weights of the local instances, per call, and the
        gradient-dtype copy of one dW1."""
        s = self.shape
        w1 = s.fc1_size * s.hidden_size * s.dtype_bytes
        w2 = s.hidden_size * s.ffn_hidden_size * s.dtype_bytes
        return local * w1, local * w2, float(s.weight_gradient_temporary_bytes - w1)

    def _loop_backward_levels(self, gathered: float | np.ndarray,
                              own_dw2: float | np.ndarray = 0.0
                              ) -> list[tuple[float | np.ndarray, float | np.ndarray,
                                              float | np.ndarray]]:
        """The per-expert loop's backward levels above the gradient rows and dX, as
        (alpha, beta, const): alpha n + beta n' + const bytes for an instance of n
        retained rows after one of n' (``gathered`` 1 where the rank drops rows, so x
        and z are gathered per instance, else 0). In the loop's order: gathering x, then
        z, while the previous instance's x, z, h and dz live; the activation, while the
        previous h and dz live; the activation's backward (recomputed activation, dh and
        their gradients: 3 n F1 at its peak) with the previous dz; the dW GEMMs (with
        ``own_dw2``, a replica's dW2, which it holds through its dW1 GEMM)."""
        s = self.shape
        row, sr = s.row_bytes, s.saved_bytes_per_routed_pair
        f_b, f1_b = s.ffn_hidden_size * s.dtype_bytes, s.fc1_size * s.dtype_bytes
        held = f_b + f1_b                                  # one instance's h and dz per row
        return [(gathered * row, gathered * sr + held, 0.0),
                (gathered * sr, gathered * f1_b + held, 0.0),
                (gathered * sr + s.forward_activation_factor * f_b, held, 0.0),
                (gathered * sr + 3 * f1_b, f1_b, 0.0),
                (gathered * sr + held, 0.0, s.weight_gradient_temporary_bytes + own_dw2)]

    def _loop_activation(self, instance_routed: np.ndarray, instance_retained: np.ndarray,
                         rank_starts: np.ndarray, drops: np.ndarray
                         ) -> tuple[np.ndarray, np.ndarray]:
        """[R] bytes of the per-expert loop's activation temporaries at their forward and
        backward peaks, from the rows of each local instance (module docstring); in
        backward with the dW of the rank's earlier replicas, which the loop holds for the
        layer's hook (a replica's dW2 also through its dW1 GEMM)."""
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
        homes = s.num_experts // len(starts)                     # each rank's home experts
        replica = index - first - homes                          # >= 0 on a replica
        dw1, dw2, _ = self._grouped_terms(1.0)                   # one expert's dW1, dW2
        held = np.maximum(replica, 0) * (dw1 + dw2)
        bwd = held + _max(*(alpha * n_b + beta * before + const for alpha, beta, const
                            in self._loop_backward_levels(gathered, (replica >= 0) * dw2)))
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
                    rank_starts: np.ndarray | None = None,
                    returned: np.ndarray | float = 0.0,
                    stored: np.ndarray | None = None) -> np.ndarray:
        """[R] float64 bytes one layer holds on each rank: its replicas, the saved buffers
        of MiF micro-batches routed like this one, and 1/Lyr of the rest of its peak
        (module docstring); under recompute, kappa of the saved buffers and 1/Lyr of the
        rest with the rerun's output (``kept_layers_fraction``, ``rerun_output_bytes``).
        Compare with ``memory_share(budget)``.

        ``sent_kept`` [R]: pairs each rank keeps as a source (None: all P of them, an
        upper bound). ``instance_routed``, ``instance_retained`` [I] (rank-major) with
        ``rank_starts`` [R]: the rows of every instance, which set the per-expert loop's
        activation temporaries (None: bounded by the rank's totals; grouped GEMMs do
        not need them). ``returned`` [R]: ``returned_gradient_bytes`` of the placement
        when the call is its step's last micro-batch (0: none is returned). ``stored`` [R]:
        the rows whose x_exp and z are saved (None: ``MoEShape.stored_rows``, exact but for
        two-stage, which the plan gives exactly: ``plan_memory``)."""
        s = self.shape
        saved, peak = self.rank_levels(routed, retained, num_replicas, sent_kept,
                                       instance_routed, instance_retained, rank_starts,
                                       returned, stored)
        kappa = s.kept_layers_fraction
        return (np.asarray(num_replicas, dtype=np.float64) * s.instance_bytes
                + kappa * s.microbatches_in_flight * saved
                + (peak - kappa * saved + s.rerun_output_bytes) / s.num_layers)

    def rank_levels(self, routed: np.ndarray, retained: np.ndarray,
                    num_replicas: np.ndarray, sent_kept: np.ndarray | None = None,
                    instance_routed: np.ndarray | None = None,
                    instance_retained: np.ndarray | None = None,
                    rank_starts: np.ndarray | None = None,
                    returned: np.ndarray | float = 0.0,
                    stored: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
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
        # (with forward retention they are compacted in forward instead; two-stage does
        # both: the stored rows in forward, the retained ones among them in backward).
        fr = s.forward_retention
        stored = (s.stored_rows(routed, retained) if stored is None
                  else np.asarray(stored, dtype=np.float64))
        saved = stored * sr + p * s.saved_bytes_per_source_pair
        if s.store_factor is not None:
            gathered = (retained < stored).astype(np.float64)
        else:
            gathered = 0.0 * drops if fr else drops
        # The forward compacts to the stored rows (its levels' b K at K = stored; b = 0
        # without forward retention, whose stored rows are the routed ones).
        fdrops = (stored < routed).astype(np.float64)
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
                act_b = held_dw2 + _max(*(np.minimum(alpha, beta) * retained
                                          + np.abs(alpha - beta) * min_kn + const
                                          for alpha, beta, const
                                          in self._loop_backward_levels(gathered)))
            experts_bwd = retained * row + act_b
        forward = _max(*(a + b * stored for a, b
                         in self._forward_levels(routed, xc, rc, local, act_f, fdrops)))
        base = saved + s.output_bytes + p * s.backward_bytes_per_source_pair
        backward = base + _max(
            (xc * retained + kept) * row,               # gradient rows sent and received
            (1 + rc) * retained * row,                  # received and reordered; dX too
            retained * row + experts_bwd,               # the expert backward
            (retained + xc * kept) * row + held_dw,     # dX sent back and received
            kept * row + s.output_bytes + held_dw,      # dX received, token gradient
            s.output_bytes + held_dw + returned)        # replicas' gradients received home
        return saved, np.maximum(forward, backward)

    def plan_memory(self, plan: RetentionPlan, num_replicas: np.ndarray,
                    returned: np.ndarray | float = 0.0) -> np.ndarray:
        """[R] ``rank_memory`` at a retention plan: its routed and retained loads, each
        source's kept pairs and each instance's rows."""
        routed, retained, kw = self._plan_loads(plan)
        return self.rank_memory(num_replicas, routed, retained, returned=returned, **kw)

    def plan_levels(self, plan: RetentionPlan, num_replicas: np.ndarray,
                    returned: np.ndarray | float = 0.0) -> tuple[np.ndarray, np.ndarray]:
        """``rank_levels`` (saved, peak) [R] at a retention plan, as ``plan_memory``."""
        routed, retained, kw = self._plan_loads(plan)
        return self.rank_levels(routed, retained, num_replicas, returned=returned, **kw)

    def _plan_loads(self, plan: RetentionPlan) -> tuple[np.ndarray, np.ndarray, dict]:
        """(routed [R], retained [R], the per-source and per-instance keywords, with the
        stored rows exactly for two-stage) of a plan."""
        counts, quotas = plan.counts.numpy(), plan.quotas.numpy()
        starts = np.searchsorted(np.asarray(plan.instance_rank), np.arange(plan.num_ranks))
        inst_routed, inst_retained = np.add.reduce(counts, axis=0), np.add.reduce(quotas,
                                                                                    axis=0)
        return (np.add.reduceat(inst_routed, starts), np.add.reduceat(inst_retained, starts),
                dict(sent_kept=np.add.reduce(quotas, axis=1), instance_routed=inst_routed,
                     instance_retained=inst_retained, rank_starts=starts,
                     stored=self.stored_per_rank(counts, quotas, starts)))

    def stored_per_rank(self, counts: np.ndarray, quotas: np.ndarray,
                        rank_starts: np.ndarray) -> np.ndarray | None:
        """[R] rows whose x_exp and z two-stage saves, exactly (``stored_counts``), from a
        call's [R, I] cells and quotas (rank-major instances from ``rank_starts``); None
        for the other rules (``MoEShape.stored_rows`` is exact for them)."""
        if self.shape.store_factor is None:
            return None
        stored = stored_counts(counts, quotas, self.shape.store_factor)
        return np.add.reduceat(np.add.reduce(stored, axis=0), rank_starts)

    def receive_limit(self, share: float, num_replicas: np.ndarray,
                      returned: np.ndarray | float = 0.0) -> np.ndarray:
        """[R] int64: the most routed pairs a rank can receive within ``share`` when
        backward drops as much as it may (nothing retained; its pairs as a source all
        kept, and one instance's activation over all its rows: upper bounds), i.e. the
        largest N with ``rank_memory(num_replicas, N, 0, returned=returned) <= share``."""
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
            bwd_experts = s.weight_gradient_temporary_bytes + held_dw2
        base = p * s.saved_bytes_per_source_pair + s.output_bytes + \
            p * s.backward_bytes_per_source_pair
        phases += [(base + _max(kept * row + s.output_bytes + held_dw, bwd_experts,
                                s.output_bytes + held_dw + returned), sn)]
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
                       largest_routed: np.ndarray | None = None,
                       returned: np.ndarray | float = 0.0) -> np.ndarray:
        """[R] int64: the most retained pairs a rank can keep within ``share`` at its
        routed load, i.e. the largest K with ``rank_memory(num_replicas, routed, K,
        returned=returned) <= share`` (0 where not even K = 0 fits). Its pairs as a
        source count as all kept (an upper bound: the plan is not known yet);
        ``largest_routed`` [R], the routed rows of each rank's largest instance, tightens
        the per-expert loop's activation bound (None: the rank's routed rows)."""
        s = self.shape
        routed = np.asarray(routed, dtype=np.float64)
        xc, rc, local = self._layout(num_replicas)
        row, sr, p = s.row_bytes, s.saved_bytes_per_routed_pair, s.source_pairs
        f_b, f1_b = s.ffn_hidden_size * s.dtype_bytes, s.fc1_size * s.dtype_bytes
        largest = routed if largest_routed is None else np.minimum(
            np.asarray(largest_routed, dtype=np.float64), routed)
        fr = s.forward_retention
        # S = saved + K sk: x_exp and z of every routed row, or (forward retention) of the
        # retained ones, or (two-stage) of at most rho K stored ones.
        rho = 1.0 if s.store_factor is None else float(s.store_factor)
        sk = rho * sr if fr else 0.0
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
                  (base + a_s * row + s.output_bytes + held_dw, b_s * row + sk, 0.0),
                  (base + s.output_bytes + held_dw + returned, sk, 0.0)]
        limits = []
        for drop in (0.0, 1.0):            # the rank keeps every row / drops some
            # With forward retention the forward's levels depend on K (on the stored rows,
            # at most rho K); else they are checked once below. Backward gathers x and z
            # per instance without it, and from the stored rows with two-stage.
            gathered = drop if (s.store_factor is not None or not fr) else 0.0
            phases = list(common)
            if fr:
                phases += [(a, rho * b, 0.0) for a, b in
                           self._forward_levels(routed, xc, rc, local, act_f, drop)]
            if s.grouped_gemm:
                w1, w2, conv = self._grouped_terms(local)
                rows = row + gathered * sr
                phases += [(base + w2, rows + 2 * f1_b + sk, 0.0),
                           (base, rows + 3 * f1_b + sk, 0.0),
                           (base + w1 + conv + held_dw2,
                            rows + 2 * f_b + f1_b + row + sk, 0.0)]
            else:
                phases += [(base + const + held_dw2, 2 * row + min(alpha, beta) + sk,
                            abs(alpha - beta))
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
        rows = s.stored_rows(routed, retained)
        return (rows * s.saved_bytes_per_routed_pair
                + s.source_pairs * s.saved_bytes_per_source_pair)

    def megatron_rank_memory(self, counts: np.ndarray, recompute: bool = False,
                             probs_require_grad: bool = True, padded: bool = False,
                             grouped: bool | None = None) -> np.ndarray:
        """[R] float64 bytes Megatron's own MoELayer holds on each rank, in
        ``rank_memory``'s terms (no replicas): MiF saved buffers plus 1/Lyr of the rest
        of its peak (``MegatronMoEMemory``), from the [R, E] routed counts (source rank x
        expert; after a capacity drop or pad: ``megatron_kept_counts``).
        ``recompute``: ``--recompute-modules moe``; ``grouped``: TEGroupedMLP (an
        unvalidated model), default the shape's ``grouped_gemm``."""
        s = self.shape
        model = MegatronMoEMemory(
            s, grouped=s.grouped_gemm if grouped is None else grouped, recompute=recompute,
            probs_require_grad=probs_require_grad, padded=padded)
        saved, peak = model.rank_memory(counts)
        return s.microbatches_in_flight * saved + (peak - saved) / s.num_layers


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
