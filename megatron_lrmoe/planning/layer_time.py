"""Seconds of one LRMoE layer call on one rank, forward and backward, from measured machine
rates (``LayerTime``, the other half of ``CostModel``): expert GEMMs, the activation's
memory passes, all-to-alls, the router and the replicas' refresh and reduction.
docs/design.md, "Cost model".
"""

from __future__ import annotations

import numpy as np

from megatron_lrmoe.planning.machine import MachineConstants, interpolated_time
from megatron_lrmoe.planning.shapes import InstanceRows, MoEShape

__all__ = ["LayerTime"]

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


class LayerTime:
    """The time half of ``CostModel`` (which holds ``shape`` and ``machine``)."""

    shape: MoEShape
    machine: MachineConstants

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

    def layer_times(self, loads: np.ndarray,
                    gemm: tuple[np.ndarray, np.ndarray] | None = None
                    ) -> tuple[list[float], list[float]]:
        """``layer_time`` of K plans at once from their [K, 6, R] ``rank_loads`` (R >= 1,
        counts below 2**53), each to the bit: (forward_s, backward_s) lists of K; no
        planner time. GEMMs spread evenly, or ``gemm``: ([K, R] forward, [K, R] backward)
        seconds of each rank's GEMMs instance by instance (``instance_gemm_times``), which
        gives ``layer_time`` with ``instances``. A planner that judges several candidate
        placements prices them in one call."""
        loads = np.asarray(loads, dtype=np.float64)
        if loads.ndim != 3 or loads.shape[1] != 6 or loads.shape[2] < 1:
            raise ValueError(f"layer_times: loads of shape {loads.shape}, expected "
                             f"[K, 6, R] (CostModel.rank_loads of each plan, R >= 1)")
        routed, retained, sent, kept, own_routed, own_retained = loads.transpose(1, 0, 2)
        num_ranks = loads.shape[2]
        f_gemm, f_mem, b_gemm, b_mem = self._rank_times(routed, retained, sent, kept,
                                                        num_ranks)
        if gemm is not None:
            f_gemm, b_gemm = (np.asarray(g, dtype=np.float64) for g in gemm)
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

    def instance_gemm_times(self, instances: InstanceRows, num_ranks: int
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
            f_gemm, b_gemm = self.instance_gemm_times(instances, len(routed))
        else:
            f_gemm = self._gemm_time(routed, True, num_ranks)
            b_gemm = self._gemm_time(retained, False, num_ranks)
        if m.memory_bytes_per_s <= 0:
            zero = np.zeros_like(routed)
            return f_gemm, zero, b_gemm, zero
        h, t = s.hidden_size, s.tokens_per_rank
        routed_passes, retained_passes, gather = self._row_passes(num_ranks)
        # Where a rank drops, x and z of its retained rows are gathered (read and
        # written): in forward when the retained set is drawn there (compacted before
        # they are saved, layer/region.py), else in backward before the expert GEMMs;
        # two-stage compacts its stored rows in forward and gathers the retained ones
        # among them in backward.
        if s.store_factor is not None:
            stored = s.stored_rows(routed, retained)
            forward_gather = stored * np.where(stored < routed, gather, 0.0)
            backward_gather = retained * np.where(retained < stored, gather, 0.0)
        else:
            gathered = retained * np.where(retained < routed, gather, 0.0)
            forward_gather = gathered if s.forward_retention else 0.0
            backward_gather = 0.0 if s.forward_retention else gathered
        f_elems = routed * routed_passes + forward_gather + sent * 3 * h + t * h
        b_elems = (retained * retained_passes + backward_gather
                   + sent * 2 * h + kept * 4 * h + t * h)
        per_byte = s.dtype_bytes / m.memory_bytes_per_s
        return f_gemm, f_elems * per_byte, b_gemm, b_elems * per_byte

    def _row_passes(self, num_ranks: int | None) -> tuple[float, float, float]:
        """(elements per routed row in forward, per retained row in backward, per gathered
        row) of ``_rank_times``' memory passes: the reorders, the activation's passes
        over F, and x and z gathered (read and written) where a rank drops."""
        s = self.shape
        h, f, f1 = s.hidden_size, s.ffn_hidden_size, s.fc1_size
        ranks = num_ranks or s.expert_parallel_size or 2
        # Reorders between source-major and expert-major rows: only across ranks, and
        # only where a rank hosts more than one instance.
        reorder = 4.0 if ranks > 1 and self._local_instances(ranks) > 1 else 0.0
        act_f, act_b = (_ACT_PASSES_GATED if s.gated else _ACT_PASSES_PLAIN)
        if s.megatron_layer:
            act_b -= _ACT_RECOMPUTE_PASSES_GATED if s.gated else _ACT_RECOMPUTE_PASSES_PLAIN
        return reorder * h + act_f * f, reorder * h + act_b * f, 2.0 * (h + f1)

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
        return interpolated_time(num_bytes, m.alltoall_sizes, m.alltoall_size_bytes_per_s, 1.0)

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
        """Seconds per step of the refresh (parameters, home -> holder, weight dtype) and
        the gradient reduction (holder -> home, gradient dtype) when the busiest rank
        sends or receives ``busiest`` replicas in each."""
        s = self.shape
        refresh = busiest * s.parameter_elements * s.dtype_bytes
        reduction = busiest * s.parameter_elements * (s.grad_dtype_bytes or s.dtype_bytes)
        return float(self._transfer_time(refresh) + self._transfer_time(reduction)
                     + 2 * self.machine.alltoall_latency_s)


def _alltoall_pairs(matrix: np.ndarray) -> float:
    """max over ranks of max(pairs sent to, received from other ranks) of a numpy [R, R]
    matrix (source rank x destination rank); pairs to the rank itself cross no link."""
    if not matrix.size:
        return 0.0
    diagonal = np.diagonal(matrix)
    return float(max(np.maximum.reduce(np.add.reduce(matrix, axis=1) - diagonal),
                     np.maximum.reduce(np.add.reduce(matrix, axis=0) - diagonal)))
