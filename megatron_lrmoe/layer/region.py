"""The LRMoE region: dispatch -> experts -> weighted combine as one autograd function.

What it computes and why: docs/design.md, "Region" (the retention it applies:
"Retention", "Selection rules"). ``_LRMoERegion.forward`` runs Megatron's MoE stages,
dispatch, experts, combine; the forward is exact, and the retained set is drawn there
when the rule needs no backward gradient (``retention_in_forward``). ``backward`` runs
the stages in reverse (``_combine_backward``, ``_experts_backward``,
``_dispatch_backward``) over the retained pairs only; every pair's router gradient
stays exact.

Notation (docs/design.md, "Notation"), per MoE layer and micro-batch, on source rank s:
  R   ranks of the expert-parallel group; I instances, L of them local to this rank
  T   tokens of this rank; H hidden size; F expert FFN size (F1 = 2F rows of W1 when gated)
  P   routed pairs of this rank, in its send order: by instance (= destination rank,
      then local instance), then by token
  Pr  pairs this rank's instances receive: "src-major" (source, instance, token) as
      the all-to-all delivers them, "exp-major" (instance, source, token) for the GEMMs
  K   pairs this rank keeps as a source in backward; Kr rows its instances keep
  n[s, i], q[s, i]  routed and retained pairs of cell (s, i) (the RetentionPlan)

Host reads: none. Every size and index the host needs comes from the plan
(``CallLayout``), whose index tables go to the device in one non-blocking copy per call;
the layer's counts exchange, before the region, is the forward's one host read.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_lrmoe.layer.comm import all_to_all_rows
from megatron_lrmoe.layer.expert_gemms import (
    WeightStack,
    experts_backward,
    experts_forward,
    strided_weights_work,
    use_grouped_mm,
    weight_stack,
)
from megatron_lrmoe.layer.region_layout import CallLayout, chunk_permutation, chunk_permutations
from megatron_lrmoe.ops import (
    combine_rows,
    combine_rows_backward,
    deterministic_mode,
    scatter_add_rows,
    select_rows,
)
from megatron_lrmoe.ops.select import splitmix64, splitmix64_tensor
from megatron_lrmoe.planning.retention import (
    TWO_STAGE,
    RetentionPlan,
    retention_in_forward,
    rule_reads_metric,
    stored_quotas,
)

_LOG = logging.getLogger(__name__)

__all__ = ["PARAM_KINDS", "ExpertWeights", "KeptPairs", "KeptPairsLog", "RegionContext",
           "RegionStats", "local_instances", "lrmoe_region", "record_kept_pairs"]


@dataclass(frozen=True)
class ExpertWeights:
    """The local experts' weights and activation, as the region computes them.

    One entry per local instance, in the plan's instance order on this rank: the
    home experts (Megatron's parameters, the region's autograd inputs) first, then
    the replicas this rank hosts (plain tensors; their gradients go to
    ``RegionContext.on_replica_grads``). w1[l]: [F1, H] (F1 = 2F when gated),
    w2[l]: [H, F]; activation maps the fc1 output [N, F1] to h [N, F]. b1[l]: [F1],
    b2[l]: [H], the biases (Megatron's ``add_bias_linear``; empty: none).
    """

    w1: tuple[torch.Tensor, ...]
    w2: tuple[torch.Tensor, ...]
    activation: Callable[[torch.Tensor], torch.Tensor]
    gradient_accumulation_fusion: bool = False
    num_home: int | None = None
    """How many leading entries are home experts (None: all)."""
    stack: WeightStack | str | None = None
    """All entries' weights as one [L, ...] view each, for grouped GEMMs
    (``expert_gemms.weight_stack``); a str: why there is none (the grouped GEMMs then
    stack the weights per call, a copy); None: not derived (the region derives it)."""

    b1: tuple[torch.Tensor, ...] = ()
    b2: tuple[torch.Tensor, ...] = ()

    @property
    def homes(self) -> int:
        return len(self.w1) if self.num_home is None else self.num_home

    @property
    def biased(self) -> bool:
        return bool(self.b1)

    @property
    def params(self) -> tuple[tuple[torch.Tensor, ...], ...]:
        """Every instance's parameters by kind, in ``PARAM_KINDS`` order: (w1, w2), then
        (b1, b2) when biased. The region's autograd inputs are their home entries."""
        return (self.w1, self.w2, self.b1, self.b2) if self.biased else (self.w1, self.w2)

    def with_replicas(self, w1: tuple[torch.Tensor, ...], w2: tuple[torch.Tensor, ...],
                      b1: tuple[torch.Tensor, ...] = (),
                      b2: tuple[torch.Tensor, ...] = ()) -> ExpertWeights:
        """These home experts followed by replica weights ``w1``, ``w2`` (and biases
        ``b1``, ``b2``, which a biased layer's replicas must carry)."""
        if bool(b1) != self.biased or len(b1) != len(b2):
            raise ValueError("replicas must carry biases exactly when the home experts have them")
        homes = self.homes
        return dataclasses.replace(
            self, w1=self.w1[:homes] + tuple(w1), w2=self.w2[:homes] + tuple(w2),
            b1=self.b1[:homes] + tuple(b1), b2=self.b2[:homes] + tuple(b2),
            num_home=homes,
            stack="this rank hosts replicas this step: the home weights and the replicas' "
                  "live in separate buffers, and one grouped call reads one [L, ...] tensor")


@dataclass
class RegionStats:
    """What one region call did, filled in forward (routing) and backward (drop).

    Counts are host integers from the plan; the metric sums stay on the device
    (``metric_sums``) until the statistics are collected, once per log interval.
    """

    routed_pairs: int = 0
    retained_pairs: int = 0
    metric_sums: torch.Tensor | None = None
    """[2] fp32 on the device: (total metric, dropped metric) of this source's pairs;
    None when the call did not compute the metric (rule ignores it, call not measured)."""
    backward_bytes_sent: int = 0
    backward_bytes_dense: int = 0
    expert_backward_rows: int = 0
    rows_per_instance: tuple[int, ...] = ()
    """Rows each of this rank's expert instances received in forward (its homes, then its
    replicas): the dispatch's own split sizes, for the simulator's exact comparison."""
    kept_rows_per_instance: tuple[int, ...] = ()
    """The same in backward: the kept rows each local instance received."""
    routing_overflow: int = 0
    """Pairs routed beyond a rank's receive limit (to the home instance; forward exact)."""
    planner_s: float = 0.0
    """Host seconds the placement planner took for this call (routing + quotas)."""
    budget_adjusted: bool = False
    """The planner lowered quotas or could not fit the budget for this call (its notes)."""
    grouped_gemm: bool = False
    """The expert GEMMs ran grouped (grouped_mm), not as the per-expert loop."""
    weight_bytes_copied: int = 0
    """Bytes of expert weights the grouped GEMMs copied (stacked) in this call, forward
    and backward: 0 where they read zero-copy views (``ExpertWeights.stack``)."""
    backward_done: bool = False


@dataclass(frozen=True)
class KeptPairs:
    """One region backward's kept pairs on one source rank (the debug view).

    Pair indices refer to this source's pair list in send order (instance-major, then
    token): ``pair_token[i]`` and ``pair_expert[i]`` name pair i. ``kept`` [K] lists the
    kept pairs by cell in send order, ``scale`` [K] their weights w (1 for ``topk`` and
    for whole cells). Tensors are copies on the region's device.
    """

    layer: int
    call: int
    rank: int
    pair_token: torch.Tensor
    pair_expert: torch.Tensor
    kept: torch.Tensor
    scale: torch.Tensor


@dataclass
class KeptPairsLog:
    """Records of every region backward run while ``record_kept_pairs`` was active."""

    records: list[KeptPairs] = field(default_factory=list)

    def of_layer(self, layer: int) -> list[KeptPairs]:
        return [r for r in self.records if r.layer == layer]


_recording = threading.local()


@contextmanager
def record_kept_pairs() -> Iterator[KeptPairsLog]:
    """Opt-in debug view: record, per layer and call, the pairs each backward kept.

    Region calls whose forward runs inside the block record their backward (also
    when it runs after the block). Off (the default), a region pays one attribute
    read per forward.
    """
    log = KeptPairsLog()
    previous = getattr(_recording, "log", None)
    _recording.log = log
    try:
        yield log
    finally:
        _recording.log = previous


def active_kept_pairs_log() -> KeptPairsLog | None:
    """The log of the innermost active ``record_kept_pairs`` block, if any."""
    return getattr(_recording, "log", None)


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
    store_factor: float = 1.5
    """rho: ``selection="two-stage"`` stores floor(rho q) of each cell's pairs in forward."""
    seed: int = 0
    kernels: str = "auto"
    deterministic: bool = field(default_factory=deterministic_mode)
    """Order-invariant backward (``ops.deterministic_mode``: Megatron's deterministic mode
    or torch's deterministic algorithms; the layer reads it once per call). The only
    reduction whose order the hardware picks, the token gradient's scatter-add, then sums
    each token's rows in pair order."""
    grouped_gemm: bool | None = None
    """None: grouped GEMMs on CUDA where they apply, else the loop; True: grouped on
    every device where they apply (``--moe-grouped-gemm``); False: the loop."""
    measure: bool = True
    """Compute the metric (and a) for the statistics even when the rule ignores it."""
    layer: int = 0
    call: int = 0
    record: KeptPairsLog | None = None
    """Debug view (``record_kept_pairs``): where this call's backward records its kept pairs."""
    stats: RegionStats = field(default_factory=RegionStats)
    on_replica_grads: ReplicaGradHook | None = None
    """Called in backward with the replicas' gradients by kind (dW1s, dW2s[, db1s, db2s]:
    ``ExpertWeights.params``' order); returns additions to the home experts' gradients,
    by kind likewise (an empty tuple: none this micro-batch). Required with replicas."""
    layout: CallLayout | None = None
    """This call's host layout on ``rank`` when the caller planned it already (the
    compiled planner's); None: computed from ``plan`` in forward."""

    @property
    def needs_metric(self) -> bool:
        return rule_reads_metric(self.selection) or self.measure

    @property
    def forward_retention(self) -> bool:
        return retention_in_forward(self.selection, self.metric)

    @property
    def two_stage(self) -> bool:
        return self.selection == TWO_STAGE

    @property
    def needs_norm(self) -> bool:
        """Whether forward must return a = ||h|| (the grad_act metric reads it)."""
        return self.needs_metric and self.metric == "grad_act"


#: The kinds of an expert's parameters, in the order ``ExpertWeights.params`` lists them
#: (the biases only when the layer has them).
PARAM_KINDS = ("w1", "w2", "b1", "b2")

# (replica gradients by kind) -> (home additions by kind, None for an expert without
# replicas; () for none at all)
ReplicaGradHook = Callable[[tuple[list[torch.Tensor], ...]],
                           tuple[list[torch.Tensor | None], ...]]


def local_instances(plan: RetentionPlan, rank: int) -> range:
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


def _exchange(rows: torch.Tensor, send: list[int], recv: list[int],
              group: dist.ProcessGroup | None) -> torch.Tensor:
    """The all-to-all of rows; on one rank the rows themselves (no copy)."""
    if group is None or dist.get_world_size(group) == 1:
        return rows
    return all_to_all_rows(rows, send, recv, group)


def _pair_metric(name: str, dy: torch.Tensor | None, pair_token: torch.Tensor, p: torch.Tensor,
                 a: torch.Tensor | None, seed: int) -> torch.Tensor:
    """m(t, e) per pair, float32 (docs/design.md, "Selection rules").

    ||g(t, e)|| = p(t, e) ||dy(t)||: one norm per token, not per pair. ``random`` draws
    from the counter-based generator on the device (splitmix64 of seed and pair index).
    ``prob`` and ``random`` do not read ``dy`` (None in forward).
    """
    if name in ("grad_act", "grad"):
        norms = torch.linalg.vector_norm(dy, dim=1, dtype=torch.float32)   # [T]
        metric = p.float() * norms.index_select(0, pair_token)
        return metric * a if name == "grad_act" else metric
    if name == "prob":
        return p.detach().float()
    bits = splitmix64_tensor(torch.arange(p.shape[0], device=p.device) + seed)
    return ((bits >> 11) & ((1 << 53) - 1)).double().mul(2.0**-53).float()


# -----------------------------------------------------------------------------
# The autograd region
# -----------------------------------------------------------------------------


class _LRMoERegion(torch.autograd.Function):
    """Inputs: tokens x [T, H], pair_token [P] (int64), pair_prob [P] (differentiable:
    the router gradient), ctx_obj, experts, then w1[0..homes), w2[0..homes) and, when
    biased, b1[0..homes), b2[0..homes).
    Output: y [T, H] = sum over each token's pairs of p * o."""

    @staticmethod
    def forward(ctx, x, pair_token, pair_prob, rc: RegionContext, experts: ExpertWeights,
                *weights):
        """Megatron's stages (docs/design.md, "Region", Forward): dispatch every pair,
        (the retained set when drawn in forward), experts on every pair, combine."""
        plan, s = rc.plan, rc.rank
        local = local_instances(plan, s)
        if len(local) != len(experts.w1):
            raise ValueError(f"rank {s} hosts {len(local)} instances but got weights for "
                             f"{len(experts.w1)}")
        stages = _TwoStageLayouts(plan, rc.store_factor, s, local) if rc.two_stage else None
        if stages is not None:
            # Forward: the routed pairs, the stored set as "retained"; both layouts' tables
            # in one copy.
            lay = stages.stored
            (_, tables), (final_buffer, _) = CallLayout.joint_device_tables(
                (stages.stored, stages.final), x.device)
        else:
            lay = rc.layout if rc.layout is not None else CallLayout(plan, s, local)
            tables_buffer, tables = lay.device_tables(x.device)
        grouped = use_grouped_mm(rc.grouped_gemm, x, experts.w1[0], experts.w2[0])
        stack = _weight_stack(experts, rc.stats, x) if grouped else None
        # The weights lie last expert first: every exp-major row order runs reversed
        # ("GEMM order"), folded into the reorders the rows take anyway.
        rev = stack is not None and stack.reversed
        offs = _offsets(tables.offs_fwd, lay.received, rev) if grouped else None

        x_exp, back = _dispatch(rc, lay, tables, x, pair_token, rev)
        kept = scale = keep_rows = None
        if rc.forward_retention:
            kept, scale, keep_rows = _retain_in_forward(rc, lay, tables, pair_token,
                                                        pair_prob, x.device)
        elif stages is not None:    # stage one: the stored set, by router probability
            kept, scale, keep_rows = _retain_in_forward(rc, lay, tables, pair_token,
                                                        pair_prob, x.device, rule="sample",
                                                        metric="prob")
        z, out = _experts_forward(experts, lay, grouped, x_exp, offs, stack, rev,
                                  rc.needs_norm)
        if keep_rows is not None:
            # Only the retained rows' x and z are needed in backward: compact them now,
            # in the exp-major order the retained gradient rows will arrive in.
            if rev:
                keep_rows = _reversed_rows(keep_rows, lay.received)
            x_exp = x_exp.index_select(0, keep_rows)
            z = z.index_select(0, keep_rows)
        y, o, a = _combine(rc, lay, out, back, x.shape[0], pair_token, pair_prob, rev)

        if stages is not None:      # backward: the stored set as "routed"
            # Its own copy: a view would keep the stored layout's tables alive too.
            lay, tables_buffer = stages.final, final_buffer.clone()
        ctx.rc, ctx.experts, ctx.layout, ctx.grouped = rc, experts, lay, grouped
        ctx.save_for_backward(x_exp, z, o, pair_token, pair_prob, a, tables_buffer, kept,
                              scale)
        rc.stats.routed_pairs = pair_token.shape[0]
        rc.stats.rows_per_instance = tuple((stages.stored if stages is not None
                                            else lay).rows_fwd)
        rc.stats.grouped_gemm = grouped
        ctx.stack, ctx.rev = stack, rev
        return y

    @staticmethod
    def backward(ctx, dy):
        """Forward's stages in reverse (docs/design.md, "Region", Backward): combine,
        experts, dispatch; then the gradients autograd receives."""
        rc, experts, lay = ctx.rc, ctx.experts, ctx.layout
        x_exp, z, o, pair_token, pair_prob, a, tables_buffer, kept, scale = ctx.saved_tensors
        tables = lay.views(tables_buffer)
        dy = dy.contiguous()

        if rc.two_stage:
            metric, kept, scale, kept_row, stored_kept = _select_from_stored(
                rc, lay, tables, dy, pair_token, pair_prob, a, kept, scale)
        else:
            metric, kept, scale, kept_row = _select_kept_pairs(rc, lay, tables, dy, pair_token,
                                                               pair_prob, a, kept, scale)
            stored_kept = kept
        dprob, g_exp, rows, back = _combine_backward(rc, lay, tables, dy, o, pair_token,
                                                     pair_prob, kept, scale, kept_row, ctx.rev,
                                                     stored_kept)
        # Frozen home experts and no replica: no weight gradient to compute (the dW GEMMs
        # are local, so skipping them keeps every rank's collectives in step).
        weight_grads = any(ctx.needs_input_grad[5:]) or experts.homes < len(experts.w1)
        expert_grads = _experts_backward(experts, lay, tables, ctx.grouped, x_exp, z, g_exp,
                                         rows, weight_grads, ctx.stack, rc.stats)
        del g_exp, rows      # freed before dX travels back
        dx = _dispatch_backward(rc, lay, back, expert_grads, dy, pair_token, kept, ctx.rev)

        _record_backward(rc, lay, metric, kept, scale, pair_token, dy)
        home_grads = _home_weight_grads(rc, experts, expert_grads, weight_grads)
        # dx and dprob are computed whatever needs_input_grad says: the collectives
        # above must run on every rank alike.
        return (dx if ctx.needs_input_grad[0] else None, None,
                dprob.to(pair_prob.dtype) if ctx.needs_input_grad[2] else None,
                None, None, *home_grads)



def _dispatch(rc: RegionContext, lay: CallLayout, tables, x: torch.Tensor,
              pair_token: torch.Tensor, rev: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Every pair's token row to its instance, then exp-major: (x_exp [Pr, H], back: the
    reverse reorder for the combine, None when both are identities). ``rev``: in GEMM
    order (reversed: a copy of the rows when no reorder runs)."""
    x_recv = _exchange(x.index_select(0, pair_token), lay.send_fwd, lay.recv_fwd, rc.group)
    if lay.fwd_identity:
        return (x_recv.flip(0) if rev else x_recv), None
    # Both reorders (to the experts and back) expanded at once.
    to_expert, back = chunk_permutations(*tables.fwd_pair, lay.received)
    if rev:
        to_expert, back = to_expert.flip(0), (lay.received - 1) - back
    return x_recv.index_select(0, to_expert), back


def _experts_forward(experts: ExpertWeights, lay: CallLayout, grouped: bool,
                     x_exp: torch.Tensor, offs: torch.Tensor | None,
                     stack: WeightStack | None, rev: bool, need_norm: bool
                     ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """The expert GEMMs on every received row: (z [Pr, F1], [o_exp [Pr, H], a_exp [Pr] or
    None]); the list goes to ``_combine``, which empties it, so that nothing else holds
    the exp-major output once it is reordered."""
    (w1, w2, *biases), rows_fwd = _in_gemm_order(rev, experts.params, lay.rows_fwd)
    z, o_exp, a_exp = experts_forward(x_exp, rows_fwd, offs, w1, w2, experts.activation,
                                      need_norm, grouped, stack, *biases)
    return z, [o_exp, a_exp]


def _combine(rc: RegionContext, lay: CallLayout, out: list[torch.Tensor | None],
             back: torch.Tensor | None, num_tokens: int, pair_token: torch.Tensor,
             pair_prob: torch.Tensor, rev: bool
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The expert rows back to their sources and the weighted sum per token: (y [T, H],
    o [P, H] and a [P] or None in source order, saved for backward). ``out``: [o_exp,
    a_exp] from ``_experts_forward``, taken (emptied) here."""
    o_exp, a_exp = out
    out.clear()
    if back is not None:
        o_exp = o_exp.index_select(0, back)
        a_exp = None if a_exp is None else a_exp.index_select(0, back)
    elif rev:
        o_exp = o_exp.flip(0)
        a_exp = None if a_exp is None else a_exp.flip(0)
    o = _exchange(o_exp, lay.recv_fwd, lay.send_fwd, rc.group)              # [P, H]
    a = None if a_exp is None else _exchange(a_exp, lay.recv_fwd, lay.send_fwd, rc.group)
    del o_exp, a_exp
    sorted_token, by_token = torch.sort(pair_token, stable=True)
    token_offsets = torch.searchsorted(
        sorted_token, torch.arange(num_tokens + 1, device=pair_token.device))
    return combine_rows(o, pair_prob, by_token, token_offsets, backend=rc.kernels), o, a


def _select_kept_pairs(rc: RegionContext, lay: CallLayout, tables, dy: torch.Tensor,
                       pair_token: torch.Tensor, pair_prob: torch.Tensor,
                       a: torch.Tensor | None, kept: torch.Tensor | None,
                       scale: torch.Tensor | None
                       ) -> tuple[torch.Tensor | None, torch.Tensor | None,
                                  torch.Tensor | None, torch.Tensor | None]:
    """Source side, before the combine's backward: (metric [P] or None, kept [K], scale
    [K], kept_row [P]: each pair's row in the kept send buffer, -1 if dropped). kept and scale
    come from forward when drawn there, else from the rule's draw here; all but metric
    are None when the source keeps every pair."""
    metric = (_pair_metric(rc.metric, dy, pair_token, pair_prob, a, rc.seed)
              if rc.needs_metric else None)
    kept_row = None
    if not lay.source_keeps_all:
        if not rc.forward_retention:
            kept, scale = _select(rc, lay, tables, metric)
        kept_row = _kept_rows(kept, lay.num_pairs, lay.num_kept)
    return metric, kept, scale, kept_row


def _kept_rows(kept: torch.Tensor, num_pairs: int, num_kept: int) -> torch.Tensor:
    """kept_row [P]: each pair's row in the kept send buffer, -1 if dropped."""
    kept_row = torch.full((num_pairs,), -1, dtype=torch.int64, device=kept.device)
    return kept_row.index_copy_(0, kept, torch.arange(num_kept, device=kept.device))


@dataclass(frozen=True)
class _TwoStageLayouts:
    """``two-stage``'s two host layouts of one call. ``stored``: the plan with the stored
    quotas q1 = ``stored_quotas`` as its retained set (forward: dispatch, the stage-one
    draw and the compaction of x_exp and z to the stored rows). ``final``: the stored set
    as the routed pairs and the plan's quotas q as the retained ones (backward: the
    stage-two draw among the stored pairs, whose row positions are those of the
    compacted buffers, and every backward split size, which are the plan's)."""

    stored: CallLayout
    final: CallLayout

    def __init__(self, plan: RetentionPlan, store_factor: float, rank: int,
                 local: range) -> None:
        q1 = stored_quotas(plan.counts, plan.quotas, store_factor)
        object.__setattr__(self, "stored",
                           CallLayout(dataclasses.replace(plan, quotas=q1), rank, local))
        object.__setattr__(self, "final",
                           CallLayout(dataclasses.replace(plan, counts=q1), rank, local))


def _stage_two_seed(seed: int) -> int:
    """The stage-two draw's seed: another stream than stage one's (``seed``) and than
    the next calls' (``step_state._mix_seed`` gives consecutive calls seeds that can
    differ by small integers, so seed + 1 could be another call's stage one)."""
    return splitmix64(seed ^ 0x7F4A7C159E3779B9)


def _select_from_stored(rc: RegionContext, lay: CallLayout, tables, dy: torch.Tensor,
                        pair_token: torch.Tensor, pair_prob: torch.Tensor,
                        a: torch.Tensor | None, stored: torch.Tensor | None,
                        stored_scale: torch.Tensor | None
                        ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None,
                                   torch.Tensor | None, torch.Tensor | None]:
    """``two-stage``'s backward draw (docs/design.md, "Selection rules"): (metric [P],
    kept [K] as pair indices, scale [K], kept_row [P], kept [K] as indices into the stored
    set). ``stored`` [K1] and ``stored_scale`` = 1/pi1 come from forward (None: every pair
    stored, pi1 = 1); ``lay`` is ``_TwoStageLayouts.final``. The quota of each cell is
    drawn by systematic sampling among its stored pairs with pi2 proportional to the
    metric over pi1 (each stored pair's term in the stage-one estimate), and a kept pair
    is weighted 1/(pi1 pi2): E[sum over kept] = E[sum over stored of x/pi1] = sum of x."""
    metric = _pair_metric(rc.metric, dy, pair_token, pair_prob, a, rc.seed)
    num_pairs = pair_token.shape[0]
    kept2 = scale2 = None
    if not lay.source_keeps_all:
        values = metric if stored is None else metric.index_select(0, stored) * stored_scale
        kept2, scale2 = _select(rc, lay, tables, values, "sample", _stage_two_seed(rc.seed))
    if stored is None:
        kept, scale = kept2, scale2
    elif kept2 is None:
        kept, scale = stored, stored_scale
    else:
        kept, scale = stored.index_select(0, kept2), stored_scale.index_select(0, kept2) * scale2
    kept_row = None if kept is None else _kept_rows(kept, num_pairs, lay.num_kept)
    return metric, kept, scale, kept_row, kept2


def _combine_backward(rc: RegionContext, lay: CallLayout, tables, dy: torch.Tensor,
                      o: torch.Tensor, pair_token: torch.Tensor, pair_prob: torch.Tensor,
                      kept: torch.Tensor | None, scale: torch.Tensor | None,
                      kept_row: torch.Tensor | None, rev: bool = False,
                      stored_kept: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                                 torch.Tensor | None]:
    """The weighted combine's backward and its all-to-all reversed: (dprob [P], g_exp
    [Kr, H], rows, back). One pass over dy per pair gives every pair's router gradient
    <dy, o> (kept or dropped) and the kept rows p w dy in send order; they travel to their
    instances with the retained split sizes and are reordered exp-major. ``rows``: the
    kept rows' positions in x_exp and z, or None when they are those rows in order
    (every row kept, or compacted in forward). ``back``: the reverse reorder, for the
    dispatch backward (expanded with this one; None when both are identities). ``rev``:
    in GEMM order (reversed). ``stored_kept``: the kept pairs as indices into the pairs
    ``lay`` counts as routed (``kept`` but for ``two-stage``, whose are the stored set's)."""
    group, device = rc.group, dy.device
    in_forward = rc.forward_retention
    dprob, g_kept = combine_rows_backward(
        dy, o, pair_token, pair_prob, kept_row,
        None if rc.selection == "topk" else scale, lay.num_kept, backend=rc.kernels)
    g_recv = _exchange(g_kept, lay.send_bwd, lay.recv_bwd, group)        # [Kr, H]
    del g_kept
    positions = None
    if lay.positions_exchanged and not in_forward:
        positions = _exchanged_positions(rc, lay, tables, stored_kept, device)
    if lay.bwd_identity:
        g_exp, back = (g_recv.flip(0) if rev else g_recv), None
        if rev and positions is not None:
            positions = positions.flip(0)
    else:
        to_expert, back = chunk_permutations(*tables.bwd_pair, lay.received_kept)
        if rev:
            to_expert, back = to_expert.flip(0), (lay.received_kept - 1) - back
        g_exp = g_recv.index_select(0, to_expert)
        if positions is not None and not lay.receiver_keeps_all:
            positions = positions.index_select(0, to_expert)
    del g_recv
    rows = None if lay.receiver_keeps_all or in_forward else positions.long()
    if rev and rows is not None:
        rows = (lay.received - 1) - rows      # exp-major rows of x_exp, z: GEMM order
    return dprob, g_exp, rows, back


@dataclass
class _ExpertGrads:
    """The experts' backward: dX rows [Kr, H] exp-major (taken, then freed, by the
    dispatch backward) and, by kind (``ExpertWeights.params``' order), each local
    instance's gradient (None where already accumulated, see ``_accumulate_now``); no
    kinds when no weight gradient was computed."""

    dx_rows: torch.Tensor | None
    grads: tuple[list[torch.Tensor | None], ...]


def _experts_backward(experts: ExpertWeights, lay: CallLayout, tables, grouped: bool,
                      x_exp: torch.Tensor, z: torch.Tensor, g_exp: torch.Tensor,
                      rows: torch.Tensor | None, weight_grads: bool, stack: WeightStack | None,
                      stats: RegionStats) -> _ExpertGrads:
    """The expert GEMMs' backward over the retained rows only (h recomputed from z).
    ``stack``: the forward's zero-copy views (None: the weights are stacked again, and
    counted in ``stats``); reversed ones take the rows in GEMM order."""
    rev = stack is not None and stack.reversed
    offs = _offsets(tables.offs_bwd, lay.received_kept, rev) if grouped else None
    if grouped and stack is None:
        _count_stacked(experts, stats)
    homes = experts.homes
    fuse = experts.gradient_accumulation_fusion
    by_kind = dict(zip(PARAM_KINDS, experts.params, strict=False))

    last = len(experts.w1) - 1

    def sink(kind: str, e: int, grad: torch.Tensor) -> bool:
        # Home experts' dW and db go where they end up as soon as each exists
        # (replicas' go to the replica hook, ``_home_weight_grads``).
        e = last - e if rev else e
        return e < homes and _accumulate_now(by_kind[kind][e], grad, fuse)

    (w1, w2, *_), rows_bwd = _in_gemm_order(rev, experts.params, lay.rows_bwd)
    dx_rows, *grads = experts_backward(x_exp, z, g_exp, rows_bwd, offs, w1, w2,
                                       experts.activation, grouped, weight_grads, sink,
                                       rows, stack, biases=experts.biased)
    grads = tuple(g if not rev else g[::-1] for g in grads[:len(experts.params)]
                  if g is not None)
    return _ExpertGrads(dx_rows, grads)


_unstacked_logged: set[str] = set()


def _weight_stack(experts: ExpertWeights, stats: RegionStats,
                  x: torch.Tensor) -> WeightStack | None:
    """The weights as grouped_mm reads them without a copy, or None: the grouped GEMMs
    stack them per call (counted in ``stats``, the reason logged once per process)."""
    stack = experts.stack if experts.stack is not None else weight_stack(experts.w1,
                                                                         experts.w2)
    if not isinstance(stack, str):
        stack = strided_weights_work(x) or stack
    if isinstance(stack, str):
        if stack not in _unstacked_logged:
            _unstacked_logged.add(stack)
            _LOG.warning("LRMoE: the grouped expert GEMMs copy (stack) the local experts' "
                         "weights in every call: %s", stack)
        _count_stacked(experts, stats)
        return None
    return stack


def _offsets(offs: torch.Tensor, total: int, rev: bool) -> torch.Tensor:
    """grouped_mm's int32 cumulative rows per group: the plan's (``offs`` [L], inclusive),
    or those of the groups in reverse order (GEMM order), derived on the device."""
    if rev:
        offs = total - torch.nn.functional.pad(offs[:-1], (1, 0)).flip(0)
    return offs.to(torch.int32)


def _reversed_rows(index: torch.Tensor, total: int) -> torch.Tensor:
    """Row indices into an exp-major buffer of ``total`` rows, listed in order, as
    indices into the reversed buffer, listed in reverse order."""
    return (total - 1) - index.flip(0)


def _in_gemm_order(rev: bool, params: tuple[tuple, ...], rows: list[int]) -> tuple:
    """(params by kind, rows per instance), each listed in GEMM order."""
    return (tuple(p[::-1] for p in params), rows[::-1]) if rev else (params, rows)


def _count_stacked(experts: ExpertWeights, stats: RegionStats) -> None:
    # Weights only: the biases are never stacked (added per instance).
    stats.weight_bytes_copied += sum(w.numel() * w.element_size()
                                     for w in (*experts.w1, *experts.w2))


def _dispatch_backward(rc: RegionContext, lay: CallLayout, back: torch.Tensor | None,
                       expert_grads: _ExpertGrads, dy: torch.Tensor, pair_token: torch.Tensor,
                       kept: torch.Tensor | None, rev: bool = False) -> torch.Tensor:
    """The dispatch reversed: dX rows back to source order (``back``: the exp-major to
    src-major reorder, None when it is the identity; ``rev``: the rows are in GEMM order)
    and to their sources, then scatter-added into the token gradients dx [T, H] at the kept
    pairs' tokens."""
    dx_rows, expert_grads.dx_rows = expert_grads.dx_rows, None    # freed once sent
    if back is not None:
        dx_rows = dx_rows.index_select(0, back)
    elif rev:
        dx_rows = dx_rows.flip(0)
    dx_back = _exchange(dx_rows, lay.recv_bwd, lay.send_bwd, rc.group)     # [K, H]
    del dx_rows
    dx = torch.zeros((dy.shape[0], dy.shape[1]), dtype=dy.dtype, device=dy.device)
    kept_token = pair_token if kept is None else pair_token.index_select(0, kept)
    # Deterministic mode: each token's rows summed in pair order (the kept pairs' indices
    # are the keys; without a drop the positions are), not in the order the rows arrive
    # in or the device's threads run.
    scatter_add_rows(dx, kept_token, dx_back, backend=rc.kernels,
                     key=kept if rc.deterministic else None, deterministic=rc.deterministic)
    return dx


def _home_weight_grads(rc: RegionContext, experts: ExpertWeights, expert_grads: _ExpertGrads,
                       weight_grads: bool) -> tuple[torch.Tensor | None, ...]:
    """What autograd receives for the home parameters, kind by kind (W1s, W2s, then b1s,
    b2s when biased): with replicas, the replica hook's additions
    (``RegionContext.on_replica_grads``) joined in; none when no weight gradient was
    computed."""
    homes = experts.homes
    params = experts.params
    if not weight_grads:
        return (None,) * (len(params) * homes)
    grads = expert_grads.grads
    extra: tuple = ()
    if rc.on_replica_grads is not None:
        extra = tuple(rc.on_replica_grads(tuple(g[homes:] for g in grads)))
    elif homes < len(experts.w1):
        raise RuntimeError("replicas need RegionContext.on_replica_grads")
    extra = tuple(e for kind in extra for e in kind) or (None,) * (len(params) * homes)
    home_params = tuple(w for kind in params for w in kind[:homes])
    home_grads = tuple(d for kind in grads for d in kind[:homes])
    fuse = experts.gradient_accumulation_fusion
    return tuple(_weight_grad(w, d, fuse, e)
                 for w, d, e in zip(home_params, home_grads, extra, strict=True))


def _select(rc: RegionContext, lay: CallLayout, tables, metric: torch.Tensor | None,
            rule: str | None = None, seed: int | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(kept [K], scale [K]): the rule's draw of q[s, i] pairs per cell of this source
    (``rule``, ``seed``: the context's unless given)."""
    rule = rc.selection if rule is None else rule
    kept, scale, _ = select_rows(
        metric if rule_reads_metric(rule) else None, tables.cell_offsets,
        tables.quotas, rule=rule, seed=rc.seed if seed is None else seed,
        backend=rc.kernels, hybrid_fraction=rc.hybrid_fraction, n_kept=lay.num_kept,
        num_rows=lay.num_pairs)
    return kept, scale


def _retain_in_forward(rc: RegionContext, lay: CallLayout, tables, pair_token: torch.Tensor,
                       pair_prob: torch.Tensor, device: torch.device,
                       rule: str | None = None, metric: str | None = None
                       ) -> tuple[torch.Tensor | None, torch.Tensor | None,
                                  torch.Tensor | None]:
    """The retained set drawn in forward (``retention_in_forward``; or ``two-stage``'s
    stored set, with ``rule`` and ``metric`` in place of the context's): (kept, scale) of
    this source (None: it keeps every pair), and the exp-major rows this rank's instances
    keep (None: every row). The exp-major positions of the kept rows go to the receivers
    that drop, in one small all-to-all (collective: every rank calls it alike)."""
    rule = rc.selection if rule is None else rule
    metric = rc.metric if metric is None else metric
    kept = scale = keep_rows = None
    if not lay.source_keeps_all:
        values = (_pair_metric(metric, None, pair_token, pair_prob, None, rc.seed)
                  if rule_reads_metric(rule) else None)
        kept, scale = _select(rc, lay, tables, values, rule)
    if lay.positions_exchanged:
        positions = _exchanged_positions(rc, lay, tables, kept, device)
        if not lay.receiver_keeps_all:
            if not lay.bwd_identity:
                positions = positions.index_select(0, chunk_permutation(
                    tables.bwd[0], tables.bwd[1], lay.received_kept))
            keep_rows = positions.long()
    return kept, scale, keep_rows


def _exchanged_positions(rc: RegionContext, lay: CallLayout, tables,
                         kept: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """The kept rows' int32 exp-major positions (``_positions``) sent to their receivers,
    as received (send order of each source; collective: every rank calls it alike)."""
    return _exchange(_positions(lay, tables, kept, device), lay.send_pos, lay.recv_pos,
                     rc.group)


def _positions(lay: CallLayout, tables, kept: torch.Tensor | None,
               device: torch.device) -> torch.Tensor:
    """int32 exp-major row at its receiver of every kept row sent to a receiver that
    does not keep all its rows (the others need none), in send order."""
    base = kept if kept is not None else torch.arange(lay.num_pairs, device=device)
    quotas = tables.quotas
    rows = (base + torch.repeat_interleave(tables.pos_delta, quotas,
                                           output_size=lay.num_kept)).to(torch.int32)
    if lay.send_pos == lay.send_bwd:
        return rows
    parts, start = [], 0
    for sent, count in zip(lay.send_pos, lay.send_bwd, strict=True):
        if sent:
            parts.append(rows[start:start + count])
        start += count
    return torch.cat(parts) if parts else rows[:0]


def _accumulate_now(weight: torch.Tensor, grad: torch.Tensor, fuse: bool) -> bool:
    """Add one expert's weight gradient where it ends up, now: the region then never holds
    every expert's dW at once (L x the expert weights of temporaries).

    Destinations: Megatron's ``main_grad`` under its DDP (which sets
    ``grad_added_to_main_grad`` and skips its own add when it is flagged, as with its
    linear layers' gradient accumulation fusion) or with fusion; else an existing
    ``.grad``. False: no destination yet (a plain run's first accumulation): the gradient
    is returned to autograd instead.
    """
    main = getattr(weight, "main_grad", None)
    if main is not None and (fuse or hasattr(weight, "grad_added_to_main_grad")):
        main.add_(grad.to(main.dtype))
        if hasattr(weight, "grad_added_to_main_grad"):
            weight.grad_added_to_main_grad = True
        return True
    if (weight.grad is not None and weight.grad.layout == torch.strided
            and weight.grad.shape == grad.shape):
        weight.grad.add_(grad.to(weight.grad.dtype))
        return True
    return False


def _weight_grad(weight: torch.Tensor, grad: torch.Tensor | None, fuse: bool,
                 extra: torch.Tensor | None = None):
    """What autograd receives for a home weight: its gradient plus the replicas' ``extra``,
    or, when ``_accumulate_now`` took the gradient (``grad`` None), a zero that costs no
    memory (an expanded scalar), so the hooks that wait for a gradient still fire
    (Megatron DDP's skips the add, as flagged); None under fusion without the flag,
    as Megatron's own linear layers return then."""
    if grad is not None:
        return grad if extra is None else grad + extra.to(grad.dtype)
    if extra is not None and not _accumulate_now(weight, extra, fuse):
        raise RuntimeError("a weight gradient was accumulated but its destination is gone")
    if (fuse and getattr(weight, "main_grad", None) is not None
            and not hasattr(weight, "grad_added_to_main_grad")):
        return None
    return weight.new_zeros(()).expand_as(weight)


def _record_backward(rc: RegionContext, lay: CallLayout, metric: torch.Tensor | None,
                     kept: torch.Tensor | None, scale: torch.Tensor | None,
                     pair_token: torch.Tensor, dy: torch.Tensor) -> None:
    """Statistics (host counts from the plan; metric sums stay on the device) and,
    when recording, the debug view. Bytes are those handed to the backward
    all-to-alls (rows + int32 positions), against the dense gradient rows."""
    stats = rc.stats
    row_bytes = dy.shape[1] * dy.element_size()
    num_pairs = pair_token.shape[0]     # P (``lay`` counts two-stage's stored set as routed)
    stats.retained_pairs = lay.num_kept
    # Positions travel in forward when the retained set is drawn there.
    positions = 0 if rc.forward_retention else 4 * sum(lay.send_pos)
    stats.backward_bytes_sent = lay.num_kept * row_bytes + positions
    stats.backward_bytes_dense = num_pairs * row_bytes
    stats.expert_backward_rows = lay.received_kept
    stats.kept_rows_per_instance = tuple(lay.rows_bwd)
    if metric is not None:
        total = metric.sum()
        dropped = total - metric.index_select(0, kept).sum() if kept is not None else \
            torch.zeros_like(total)
        stats.metric_sums = torch.stack([total, dropped])
    stats.backward_done = True
    if rc.record is not None:
        device = pair_token.device
        instances = torch.repeat_interleave(
            torch.arange(lay.num_instances, device=device),
            rc.plan.counts[rc.rank].to(device), output_size=num_pairs)
        expert_of = torch.tensor(rc.plan.instance_expert, device=device)
        rc.record.records.append(KeptPairs(
            layer=rc.layer, call=rc.call, rank=rc.rank, pair_token=pair_token.clone(),
            pair_expert=expert_of.index_select(0, instances),
            kept=(torch.arange(num_pairs, device=device) if kept is None else kept.clone()),
            scale=(torch.ones(lay.num_kept, device=device) if scale is None or
                   rc.selection == "topk" else scale.clone())))


def lrmoe_region(
    x: torch.Tensor,
    pair_token: torch.Tensor,
    pair_prob: torch.Tensor,
    rc: RegionContext,
    experts: ExpertWeights,
) -> torch.Tensor:
    """y [T, H] = sum over every routed pair of p * o (the routed part of the layer).

    ``pair_token`` [P] lists each pair's token in send order (instance-major, then
    token); ``pair_prob`` [P] their routing probabilities, differentiable: the router
    gradient <dy, o> comes back through it.
    """
    homes = experts.homes
    return _LRMoERegion.apply(x, pair_token, pair_prob, rc, experts,
                              *(w for kind in experts.params for w in kind[:homes]))
