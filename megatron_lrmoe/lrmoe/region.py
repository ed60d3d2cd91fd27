"""The LRMoE region: dispatch -> experts -> combine as one autograd function.

Notation (docs/design.md, "Notation"), per MoE layer and micro-batch, on source rank s:
  R   ranks of the expert-parallel group; E experts, L = E / R local experts per rank
  T   tokens of this rank; H hidden size; F expert FFN size (2F rows of W1 when gated)
  P   routed pairs of this rank (sum of its routing map); pairs are kept in
      "expert-major" order: sorted by expert, then by token. Experts of a rank are
      contiguous, so this is also (destination rank, local expert) order.
  Pr  pairs this rank's experts receive, held "source-major" as they arrive
      (source rank, local expert, token) and "expert-major" for the GEMMs.
  n[s, e], q[s, e]  routed and retained pairs (the RetentionPlan)

Forward (exact): every pair is dispatched and computed; each expert returns its
unweighted output row o(t, e) and, riding along the combine all-to-all as one extra
column, the side statistic a(t, e) = ||h(t, e)||, h the input of the second linear
layer. The routing probability p is applied by the caller after the region
(y = sum_e p * o), so autograd gives the exact router gradient <dy, o> for every
pair and hands the region g = p * dy per pair.

Backward (recalibrated): on the source, the metric per pair, the selection of
q[s, e] pairs per (s, e) cell, compaction of the kept gradient rows (scaled by
the selection's scale for every rule but topk) with their int32 row positions;
one all-to-all with the retained split sizes for the rows and one for the
positions; the experts backward (dX, dW1, dW2) over the retained rows only; dX
back with the retained splits; scatter-add into the token gradients. A dropped
pair contributes nothing to dX or dW; its router gradient is untouched.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_lrmoe.lrmoe.comm import all_to_all_rows
from megatron_lrmoe.lrmoe.retention import RetentionPlan
from megatron_lrmoe.ops import compact_rows, scatter_add_rows, select_rows

__all__ = ["ExpertWeights", "RegionContext", "RegionStats", "lrmoe_region"]


@dataclass(frozen=True)
class ExpertWeights:
    """The local experts' weights and activation, as the region computes them.

    One entry per local instance, in the plan's instance order on this rank: the
    home experts (Megatron's parameters, the region's autograd inputs) first, then
    the replicas this rank hosts (plain tensors; their gradients go to
    ``RegionContext.on_replica_grads``). w1[l]: [F1, H] (F1 = 2F when gated),
    w2[l]: [H, F]; activation maps the fc1 output [N, F1] to h [N, F].
    """

    w1: tuple[torch.Tensor, ...]
    w2: tuple[torch.Tensor, ...]
    activation: Callable[[torch.Tensor], torch.Tensor]
    gradient_accumulation_fusion: bool = False
    num_home: int | None = None
    """How many leading entries are home experts (None: all)."""

    @property
    def homes(self) -> int:
        return len(self.w1) if self.num_home is None else self.num_home

    def with_replicas(self, w1: tuple[torch.Tensor, ...],
                      w2: tuple[torch.Tensor, ...]) -> ExpertWeights:
        """These home experts followed by replica weights ``w1``, ``w2``."""
        return dataclasses.replace(self, w1=self.w1[: self.homes] + tuple(w1),
                                   w2=self.w2[: self.homes] + tuple(w2), num_home=self.homes)


@dataclass
class RegionStats:
    """What one region call did, filled in forward (routing) and backward (drop)."""

    routed_pairs: int = 0
    retained_pairs: int = 0
    metric_total: float = 0.0
    metric_dropped: float = 0.0
    backward_bytes_sent: int = 0
    backward_bytes_dense: int = 0
    expert_backward_rows: int = 0
    routing_overflow: int = 0
    """Pairs routed beyond a rank's buffer capacity (to the home instance; forward exact)."""
    planner_s: float = 0.0
    """Host seconds the placement planner took for this call (routing + quotas)."""
    budget_adjusted: bool = False
    """The planner lowered quotas or could not fit the budget for this call (its notes)."""
    backward_done: bool = False


@dataclass
class RegionContext:
    """Everything the region needs besides tensors: the plan and the run's options."""

    plan: RetentionPlan
    group: dist.ProcessGroup | None
    rank: int
    metric: str = "grad_act"
    selection: str = "topk"
    hybrid_fraction: float = 0.5
    """Share of each cell's quota that ``selection="hybrid"`` keeps by top metric."""
    seed: int = 0
    kernels: str = "auto"
    grouped_gemm: bool | None = None
    stats: RegionStats = field(default_factory=RegionStats)
    on_replica_grads: ReplicaGradHook | None = None
    """Called in backward with the replicas' (dW1, dW2); returns additions to the home
    experts' gradients (empty lists: none this micro-batch). Required with replicas."""


# (replica dW1s, replica dW2s) -> (home dW1 additions, home dW2 additions)
ReplicaGradHook = Callable[[list[torch.Tensor], list[torch.Tensor]],
                           tuple[list[torch.Tensor], list[torch.Tensor]]]


def _local_instances(plan: RetentionPlan, rank: int) -> range:
    """This rank's instance columns: contiguous, since instances are rank-major."""
    return _rank_columns(plan.instance_rank, rank)


@functools.lru_cache(maxsize=256)
def _rank_columns(instance_rank: tuple[int, ...], rank: int) -> range:
    """Checked once per placement (and rank), not on every forward."""
    ids = [i for i, r in enumerate(instance_rank) if r == rank]
    ranks = list(instance_rank)
    if not ids or ranks != sorted(ranks):
        raise ValueError("the region needs instances in rank-major order with at least one "
                         f"on every rank (rank {rank} has instances {ids})")
    return range(ids[0], ids[-1] + 1)


# -----------------------------------------------------------------------------
# Layout helpers
# -----------------------------------------------------------------------------


def _source_to_expert_order(chunk_sizes: torch.Tensor) -> torch.Tensor:
    """Permutation from source-major to expert-major row order.

    chunk_sizes[s, l]: rows from source s for local expert l, stored source-major.
    Returns idx with expert_major = source_major[idx].
    """
    R, L = chunk_sizes.shape
    flat = chunk_sizes.reshape(-1)
    starts = torch.cumsum(flat, 0) - flat  # start of chunk (s, l) in source-major order
    order = starts.reshape(R, L).t().reshape(-1)  # chunk starts visited expert-major
    sizes = chunk_sizes.t().reshape(-1)
    if int(sizes.sum()) == 0:
        return torch.zeros(0, dtype=torch.long)
    offsets = torch.repeat_interleave(order - (torch.cumsum(sizes, 0) - sizes), sizes)
    return torch.arange(int(sizes.sum())) + offsets


def _pair_metric(name: str, g: torch.Tensor, a: torch.Tensor, p: torch.Tensor,
                 seed: int) -> torch.Tensor:
    """m(t, e) per pair, float32 (docs/design.md, "Selection rules")."""
    if name == "grad_act":
        return torch.linalg.vector_norm(g.float(), dim=1) * a.float()
    if name == "grad":
        return torch.linalg.vector_norm(g.float(), dim=1)
    if name == "prob":
        return p.float()
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(g.shape[0], generator=generator).to(g.device)


# -----------------------------------------------------------------------------
# The autograd region
# -----------------------------------------------------------------------------


class _LRMoERegion(torch.autograd.Function):
    """Inputs: tokens x [T, H], pair_token [P], pair_prob [P] (detached, for the prob
    metric), ctx_obj, then w1[0..L), w2[0..L). Outputs: o [P, H] (unweighted expert
    outputs, expert-major pair order) and a [P] (side statistic, no gradient)."""

    @staticmethod
    def forward(ctx, x, pair_token, pair_prob, rc: RegionContext, experts: ExpertWeights,
                *weights):
        plan, group, s = rc.plan, rc.group, rc.rank
        local = _local_instances(plan, s)
        if len(local) != len(experts.w1):
            raise ValueError(f"rank {s} hosts {len(local)} instances but got weights for "
                             f"{len(experts.w1)}")
        # ---- dispatch every pair ------------------------------------------------
        send, recv = plan.forward_send_splits(s), plan.forward_recv_splits(s)
        x_recv = all_to_all_rows(x[pair_token], send, recv, group)            # [Pr, H] src-major
        chunk_sizes = plan.counts[:, local.start:local.stop]              # [R, L]
        # Index tensors are built on the host from the plan, then moved to x's device.
        device = x.device
        to_expert = _source_to_expert_order(chunk_sizes).to(device)
        x_exp = x_recv[to_expert]                                         # [Pr, H] exp-major
        rows_per_expert = chunk_sizes.sum(0).tolist()

        # ---- experts on every pair -------------------------------------------------
        z_parts, o_parts, a_parts = [], [], []
        for e, x_l in enumerate(torch.split(x_exp, rows_per_expert)):
            z_l = x_l @ experts.w1[e].t()
            h_l = experts.activation(z_l)
            o_parts.append(h_l @ experts.w2[e].t())
            a_parts.append(torch.linalg.vector_norm(h_l.float(), dim=1))
            z_parts.append(z_l)
        o_exp = torch.cat(o_parts) if o_parts else x_exp.new_empty((0, x.shape[1]))
        a_exp = torch.cat(a_parts) if a_parts else x_exp.new_empty((0,), dtype=torch.float32)

        # ---- combine: back to the sources, a(t, e) riding as one extra column ------
        back = torch.empty_like(to_expert)
        back[to_expert] = torch.arange(to_expert.numel(), device=device)
        payload = torch.cat([o_exp, a_exp.to(o_exp.dtype).unsqueeze(1)], dim=1)[back]
        returned = all_to_all_rows(payload, recv, send, group)                # [P, H + 1]
        o, a = returned[:, :-1].contiguous(), returned[:, -1].float()

        ctx.rc, ctx.experts = rc, experts
        ctx.to_expert, ctx.rows_per_expert = to_expert, rows_per_expert
        ctx.save_for_backward(x_exp, torch.cat(z_parts) if z_parts else x_exp[:, :0],
                              pair_token, pair_prob, a)
        ctx.num_tokens = x.shape[0]
        rc.stats.routed_pairs = int(pair_token.numel())
        ctx.mark_non_differentiable(a)
        return o, a

    @staticmethod
    def backward(ctx, g, _grad_a):
        rc, experts = ctx.rc, ctx.experts
        plan, group, s, L = rc.plan, rc.group, rc.rank, len(experts.w1)
        x_exp, z_exp, pair_token, pair_prob, a = ctx.saved_tensors
        g = g.contiguous()
        device = g.device

        # ---- source side: metric, selection per (s, e) cell, compaction -----------
        metric = _pair_metric(rc.metric, g, a, pair_prob, rc.seed)
        counts_s = plan.counts[s]
        cell_offsets = torch.cat([counts_s.new_zeros(1), torch.cumsum(counts_s, 0)]).to(device)
        kept, scale, _ = select_rows(metric, cell_offsets, plan.quotas[s].to(device),
                                     rule=rc.selection, seed=rc.seed, backend=rc.kernels,
                                     hybrid_fraction=rc.hybrid_fraction)
        g_kept = compact_rows(g, kept, None if rc.selection == "topk" else scale,
                              backend=rc.kernels)
        # Row positions inside the destination's forward receive buffer: position within
        # this source's chunk there; the receiver adds where that chunk starts.
        fwd_send = plan.forward_send_splits(s)
        send_start = torch.tensor([0] + fwd_send[:-1], device=device).cumsum(0)
        dest_of_kept = torch.repeat_interleave(
            torch.arange(len(fwd_send), device=device),
            torch.tensor(plan.send_splits(s), device=device))
        pos_kept = (kept - send_start[dest_of_kept]).to(torch.int32)

        # ---- retained all-to-all: rows and their positions -------------------------
        send, recv = plan.send_splits(s), plan.recv_splits(s)
        g_recv = all_to_all_rows(g_kept, send, recv, group)                   # [Kr, H]
        pos_recv = all_to_all_rows(pos_kept.unsqueeze(1), send, recv, group).squeeze(1).long()
        fwd_recv = plan.forward_recv_splits(s)
        recv_start = torch.tensor([0] + fwd_recv[:-1], device=device).cumsum(0)
        src_of_row = torch.repeat_interleave(torch.arange(len(recv), device=device),
                                             torch.tensor(recv, device=device))
        src_major_pos = pos_recv + recv_start[src_of_row]
        expert_pos = torch.empty_like(ctx.to_expert)
        expert_pos[ctx.to_expert] = torch.arange(ctx.to_expert.numel(), device=device)
        rows = expert_pos[src_major_pos] if src_major_pos.numel() else src_major_pos
        order = torch.argsort(rows, stable=True)
        rows, g_rows = rows[order], g_recv[order]

        # ---- expert backward over retained rows only ------------------------------
        bounds = torch.tensor([0, *ctx.rows_per_expert], device=device).cumsum(0)
        kept_per_expert = torch.bucketize(rows, bounds[1:], right=True).bincount(
            minlength=L).tolist() if rows.numel() else [0] * L
        dx_rows, dw1, dw2 = _expert_backward(
            x_exp[rows], z_exp[rows], g_rows, kept_per_expert, experts,
            _use_grouped_mm(rc.grouped_gemm, g_rows, experts))
        unsort = torch.empty_like(order)
        unsort[order] = torch.arange(order.numel(), device=device)
        dx_back = all_to_all_rows(dx_rows[unsort], recv, send, group)        # [K, H] kept order

        # ---- source side: scatter-add into token gradients ------------------------
        dx = torch.zeros((ctx.num_tokens, g.shape[1]), dtype=g.dtype, device=g.device)
        scatter_add_rows(dx, pair_token[kept], dx_back, backend=rc.kernels)

        _record_backward_stats(rc, metric, kept, g, (g_kept, pos_kept), sum(kept_per_expert))
        homes = experts.homes
        extra1, extra2 = [], []
        if rc.on_replica_grads is not None:
            extra1, extra2 = rc.on_replica_grads(dw1[homes:], dw2[homes:])
        elif homes < L:
            raise RuntimeError("replicas need RegionContext.on_replica_grads")
        extra = (*extra1, *extra2) or (None,) * (2 * homes)
        weights = (*experts.w1[:homes], *experts.w2[:homes])
        grads = [_weight_grad(w, d, experts.gradient_accumulation_fusion, e)
                 for w, d, e in zip(weights, (*dw1[:homes], *dw2[:homes]), extra, strict=True)]
        return (dx, None, None, None, None, *grads)


def _use_grouped_mm(requested: bool | None, g: torch.Tensor, experts: ExpertWeights) -> bool:
    """grouped_mm needs 16-byte aligned rows (H, F, F1 multiples of 16 / element size).

    ``requested`` None picks it on CUDA where it applies (on CPU the per-expert loop is as
    fast and needs no stacked copy of the weights); True demands it; False uses the loop.
    """
    align = 16 // g.element_size()
    aligned = all(d % align == 0 for d in (*experts.w1[0].shape, *experts.w2[0].shape))
    applies = hasattr(torch.nn.functional, "grouped_mm") and aligned and g.dtype in (
        torch.float32, torch.bfloat16)
    if requested and not applies:
        raise ValueError("grouped_mm does not apply here (needs fp32/bf16 and dims that are "
                         f"multiples of {align}); use the per-expert loop")
    return applies and g.is_cuda if requested is None else requested


def _expert_backward(x, z, g, rows_per_expert: list[int], experts: ExpertWeights,
                     grouped: bool):
    """dX [K, H], dW1[l] [F1, H], dW2[l] [H, F] over the retained rows only.

    x, z, g: [K, .] rows grouped by local expert (rows_per_expert[l] rows each).
    """
    z = z.detach()
    with torch.enable_grad():
        z.requires_grad_(True)
        h = experts.activation(z)                                         # [K, F]
    if grouped:
        offs = torch.tensor(rows_per_expert, device=g.device).cumsum(0).to(torch.int32)
        w1, w2 = torch.stack(experts.w1), torch.stack(experts.w2)         # [L, F1, H], [L, H, F]
        grouped_mm = torch.nn.functional.grouped_mm
        dw2 = grouped_mm(g.t(), h.detach(), offs=offs)                    # [L, H, F]
        (dz,) = torch.autograd.grad(h, z, grouped_mm(g, w2, offs=offs))   # [K, F1]
        dw1 = grouped_mm(dz.t(), x, offs=offs)                            # [L, F1, H]
        return grouped_mm(dz, w1, offs=offs), list(dw1.unbind(0)), list(dw2.unbind(0))
    dh = torch.cat([g_l @ w for g_l, w in zip(torch.split(g, rows_per_expert), experts.w2,
                                              strict=True)])             # [K, F]
    (dz,) = torch.autograd.grad(h, z, dh)
    dx, dw1, dw2 = [], [], []
    for w1, x_l, dz_l, g_l, h_l in zip(
        experts.w1, *(torch.split(t, rows_per_expert) for t in (x, dz, g, h.detach())),
        strict=True,
    ):
        dw2.append(g_l.t() @ h_l)
        dw1.append(dz_l.t() @ x_l)
        dx.append(dz_l @ w1)
    return torch.cat(dx), dw1, dw2


def _weight_grad(weight: torch.Tensor, grad: torch.Tensor, fuse: bool,
                 extra: torch.Tensor | None = None):
    """Hand a weight gradient (plus its replicas' ``extra``) to Megatron the way its own
    linear layers do."""
    if fuse and hasattr(weight, "main_grad"):
        # gradient_accumulation_fusion: accumulate straight into the fp32 main grad.
        weight.main_grad.add_(grad.to(weight.main_grad.dtype))
        if extra is not None:
            weight.main_grad.add_(extra.to(weight.main_grad.dtype))
        if hasattr(weight, "grad_added_to_main_grad"):
            weight.grad_added_to_main_grad = True
            # DDP's hook needs a grad to fire; it skips the add when flagged.
            return torch.zeros_like(weight)
        return None
    return grad if extra is None else grad + extra.to(grad.dtype)


def _record_backward_stats(rc: RegionContext, metric, kept, g, sent: tuple[torch.Tensor, ...],
                           expert_rows: int) -> None:
    """Bytes are those of the buffers handed to the backward all-to-all (``sent``),
    against the dense gradient a dropless backward would send."""
    stats = rc.stats
    stats.retained_pairs = int(kept.numel())
    total = float(metric.sum())
    stats.metric_total = total
    stats.metric_dropped = total - float(metric[kept].sum())
    stats.backward_bytes_sent = sum(t.numel() * t.element_size() for t in sent)
    stats.backward_bytes_dense = g.numel() * g.element_size()
    stats.expert_backward_rows = expert_rows
    stats.backward_done = True


def lrmoe_region(
    x: torch.Tensor,
    pair_token: torch.Tensor,
    pair_prob: torch.Tensor,
    rc: RegionContext,
    experts: ExpertWeights,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unweighted expert outputs o [P, H] and side statistic a [P] for every routed pair.

    ``pair_token`` [P] lists each pair's token in expert-major order; ``pair_prob`` [P]
    is only read by the ``prob`` metric (the caller applies p after the region).
    """
    homes = experts.homes
    return _LRMoERegion.apply(x, pair_token, pair_prob.detach(), rc, experts,
                              *experts.w1[:homes], *experts.w2[:homes])
