"""LRMoELayer: Megatron's MoELayer whose dispatch -> experts -> combine is the LRMoE region.

Routing (Megatron's router, aux losses included) and shared experts are Megatron's.
What changes is the span from dispatch to combine, which must be one autograd
region (docs/design.md, "Region"), so ``forward`` is the unit overridden here; the
dispatcher is chosen by config inside ``MoELayer.__init__``, so it is swapped right
after. The step state (planner, draw seeds, step boundaries, checkpoints) is a
``step_state.LayerStepState``, ``lrmoe_state``. Shapes: hidden_states [S, B, H] in and
out (S the local sequence shard: S / CP under context parallelism, over TP as well under
sequence parallelism); T = S x B tokens; E experts; P routed pairs.
"""

from __future__ import annotations

import functools
import logging
import re
import time
from typing import Any

import numpy as np
import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

from megatron_lrmoe.config.transformer_config import LRMoETransformerConfig
from megatron_lrmoe.layer.counts_exchange import RoutedCountsExchange
from megatron_lrmoe.layer.region import (
    ExpertWeights,
    RegionContext,
    active_kept_pairs_log,
    local_instances,
    lrmoe_region,
)
from megatron_lrmoe.layer.region_layout import CallLayout, chunk_permutation, to_device
from megatron_lrmoe.layer.replicas import ExpertReplicas
from megatron_lrmoe.layer.stats import LRMoELayerStats
from megatron_lrmoe.layer.step_state import (
    STEP_STATE_FLAG,
    STEP_STATE_FORMAT,
    STEP_STATE_VERSION,
    LayerStepState,
    MicrobatchesPerStep,
    carries_step_state,
)
from megatron_lrmoe.ops import deterministic_mode
from megatron_lrmoe.planning.placement import Placement
from megatron_lrmoe.planning.planner import LayerPlanner, MicroBatchPlan, PlannerSettings

__all__ = ["STEP_STATE_FLAG", "STEP_STATE_FORMAT", "STEP_STATE_VERSION", "LRMoELayer",
           "MicrobatchesPerStep"]

_LOG = logging.getLogger(__name__)

_EXTRA_STATE_KEY = "_extra_state"     # torch's key for a module's get_extra_state()


class LRMoELayer(MoELayer):
    """MoELayer with an exact forward and a metric-driven, compacted backward.

    Placement (docs/design.md, "Placement"): a ``LayerPlanner`` (pure, identical on every
    rank that holds the layer) chooses the expert instances of each step and, per
    micro-batch, the routing of pairs to instances and the retention quotas.

    Step boundaries are explicit (docs/design.md, "Step state"): whoever drives the layer
    tells it how many micro-batches a step has (``microbatches_per_step``) and calls
    ``finish_step()`` once per optimizer step taken (``integration/step_hooks.py`` does
    both for a model). The state itself is ``lrmoe_state``, the module's extra state.
    """

    def __init__(self, config: LRMoETransformerConfig, submodules: MoESubmodules | None = None,
                 layer_number: int | None = None, pg_collection=None,
                 is_mtp_layer: bool = False, name: str | None = None) -> None:
        if not getattr(config, "moe_lrmoe", False):
            raise ValueError("LRMoELayer needs an LRMoETransformerConfig with moe_lrmoe=True")
        pg_collection = pg_collection or get_default_pg_collection()
        super().__init__(config, submodules, layer_number, pg_collection,
                         is_mtp_layer=is_mtp_layer, name=name)
        # The region dispatches and combines itself: Megatron's dispatcher is replaced by
        # the counts exchange (Megatron code that reads token_dispatcher serves options
        # --moe-lrmoe refuses: CUDA graphs of the MoE stages, the fine-grained A2A overlap).
        self.token_dispatcher = None
        self.counts_exchange = RoutedCountsExchange(self.ep_group)
        # The planner state is pooled over this group at each step end (integration/step_hooks.py).
        self.expert_data_parallel_group = getattr(pg_collection, "expt_dp", None)
        self.lrmoe_stats = LRMoELayerStats()
        # Expert backward GEMMs: None = grouped_mm wherever it applies, else the loop.
        self.grouped_gemm: bool | None = None
        ep_size = self.ep_group.size()
        self.replicas = ExpertReplicas(self.counts_exchange.ep_rank,
                                       self.ep_group if ep_size > 1 else None)
        self.lrmoe_state = LayerStepState(config, ep_size)
        self.last_plan: MicroBatchPlan | None = None
        self._noted: set[str] = set()

    # ------------------------------------------------------------------ planner
    @property
    def placement_planner(self) -> LayerPlanner:
        """This layer's planner; an error before ``setup_planner``."""
        return self.lrmoe_state.require_planner(self.layer_number)

    def setup_planner(self, settings: PlannerSettings,
                      microbatches_per_step: MicrobatchesPerStep) -> LayerPlanner:
        """Build the planner from ``settings`` (integration derives them from the config:
        ``step_hooks.setup_lrmoe_layers``) and tell the layer the micro-batches of a step.
        No measurement and no communication here.

        A planner state already held (an earlier planner, or one loaded from a checkpoint
        before this call) carries over."""
        return self.lrmoe_state.setup_planner(settings, microbatches_per_step)

    @property
    def microbatches_per_step(self) -> MicrobatchesPerStep | None:
        """Micro-batches of a training step (an int, or a function such as Megatron's
        ``get_num_microbatches``); set by ``setup_planner``, or by hand."""
        return self.lrmoe_state.microbatches_per_step

    @microbatches_per_step.setter
    def microbatches_per_step(self, value: MicrobatchesPerStep | None) -> None:
        self.lrmoe_state.microbatches_per_step = value

    @property
    def planner_state_origin(self) -> str:
        """Where the planner state came from: "fresh", "checkpoint", or "fresh: <why>"."""
        return self.lrmoe_state.planner_state_origin

    # -------------------------------------------------------------- step boundary
    def finish_step(self, observations: tuple[torch.Tensor | None, int, list[torch.Tensor]]
                    | None = None) -> None:
        """End of one training step (the optimizer step, taken or skipped): fold the step's
        observed counts into the planner (``observations``: the pooled (sum, micro-batches)
        of all replicas of this layer, else this rank's own), choose the next placement,
        mark the replicas for refresh and advance the draw seeds. A call after a step
        without training micro-batches (e.g. only evaluation) changes nothing.

        Raises if the step's replica gradients were not added to the homes (the step had
        fewer backward passes than ``microbatches_per_step``)."""
        self.lrmoe_state.finish_step(observations, self.replicas.has_grads, self.layer_number)

    def step_state(self) -> dict[str, Any]:
        """Everything a step changes, to undo it (Megatron's re-run of a step): a copy."""
        return {**self.lrmoe_state.snapshot(self.layer_number),
                "stats": self.lrmoe_stats.mark()}

    def load_step_state(self, state: dict[str, Any]) -> None:
        """Undo what happened since ``step_state()`` returned ``state``."""
        self.lrmoe_state.restore(state, self.layer_number)
        self.lrmoe_stats.rewind(state["stats"])

    # -------------------------------------------------------------- checkpoints
    def get_extra_state(self) -> dict[str, Any]:
        """The step state saved with the model (docs/design.md, "Step state")."""
        return self.lrmoe_state.extra_state()

    def set_extra_state(self, state: Any) -> None:
        self.lrmoe_state.set_extra_state(state)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs) -> None:
        """torch's, except that a state dict without this layer's step state (a plain
        Megatron checkpoint, or one loaded without it) is not an error: the planner
        starts fresh. The layer chosen at setup logs where the state came from."""
        key = prefix + _EXTRA_STATE_KEY
        present = key in state_dict
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        if not present:
            while key in missing_keys:
                missing_keys.remove(key)
            self.lrmoe_state.load_without_state()
        self.lrmoe_state.report_origin(self.layer_number)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: dict | None = None):
        """Megatron's, whose extra state (the step state) becomes one ShardedObject per layer
        with the layer offsets (EP-invariant key; replica_id non-zero on every rank but
        one tensor- and data-parallel (with context-parallel) rank 0, which all hold the
        same state).

        The state is in the dict only when ``metadata`` carries ``STEP_STATE_FLAG``
        (docs/design.md, "Step state"): on load Megatron passes the checkpoint's own
        content metadata, so a plain Megatron checkpoint is never asked for it."""
        state = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        if not carries_step_state(metadata):
            state.pop(f"{prefix}{_EXTRA_STATE_KEY}", None)
        return state

    # ------------------------------------------------------------------ forward
    def forward(self, hidden_states: torch.Tensor, intermediate_tensors=None,
                padding_mask: torch.Tensor | None = None):
        if intermediate_tensors is not None:
            raise ValueError("LRMoELayer does not support partial CUDA-graph capture")
        if self.training and self.attn_tp_group.size() > 1 and not self.config.sequence_parallel:
            raise ValueError("MoE with tensor parallelism needs sequence parallelism")
        if padding_mask is not None:
            padding_mask = padding_mask.transpose(0, 1).bool()
        if self.moe_layer_recompute:
            # Megatron's selective "moe" recompute, wrapped as ``MoELayer.forward`` wraps
            # its stages: only the layer input is kept (docs/design.md, "Recompute").
            output = tensor_parallel.checkpoint(self._layer_output, False, hidden_states,
                                                padding_mask)
        else:
            output = self._layer_output(hidden_states, padding_mask)
        return output, None

    def _layer_output(self, hidden_states: torch.Tensor,
                      padding_mask: torch.Tensor | None) -> torch.Tensor:
        """Shared experts (Megatron's, with their own selective recompute) plus the routed
        experts: [S, B, H] in and out (``padding_mask`` [S, B] goes to Megatron's router).

        The step's replica refresh starts first (asynchronously: the placement is known
        from the step's start) and overlaps the shared experts, the router and the
        counts exchange; ``routed_output`` waits for it right before the region."""
        experts = self.experts.expert_weights()
        self._start_refresh(experts)
        shared_output = self.shared_experts_compute(hidden_states)
        probs, routing_map = self.route(hidden_states, padding_mask)
        output = self.routed_output(hidden_states, probs, routing_map, experts)
        if shared_output is not None:
            output = output + shared_output
        return output

    def routed_output(self, hidden_states: torch.Tensor, probs: torch.Tensor,
                      routing_map: torch.Tensor, experts: ExpertWeights | None = None
                      ) -> torch.Tensor:
        """y(t) = sum_e p(t, e) o(t, e), the routed experts' output, from the region (which
        applies p itself: its backward returns the router gradient <dy, o> with the rest).
        ``experts``: this forward's ``expert_weights()`` when the caller read them (and
        started the replica refresh), else read here.

        Host reads: the counts exchange, and nothing after it: the plan gives every size
        (docs/design.md, "Region", "Host reads")."""
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])                          # [T, H]
        counts = self.counts_exchange.gather_counts(routing_map)         # [R, E] on the host
        # Autograd on marks the training pass (observe, count, draw); a recomputed layer's
        # first pass runs without it and only plans (docs/design.md, "Recompute").
        training = self.training and torch.is_grad_enabled()
        planner = self.placement_planner      # an error here, before any work, if not set up
        if experts is None:
            experts = self.experts.expert_weights()
            self._start_refresh(experts)
        host = counts.numpy()      # the gathered counts (host int64), read once
        mb_plan, layout, order, planner_s = self._plan_micro_batch(planner, host, training)
        experts = self._region_experts(experts)
        pair_token, pair_prob = self._pairs_in_send_order(routing_map, probs, layout, order,
                                                          x.device)
        rc = self._region_context(mb_plan, counts, training, planner_s)
        rc.layout = layout
        if training:
            self._count_training_call(rc, mb_plan, host)
        return lrmoe_region(x, pair_token, pair_prob, rc, experts).view(shape)

    def _plan_micro_batch(self, planner: LayerPlanner, host: np.ndarray, training: bool
                          ) -> tuple[MicroBatchPlan, CallLayout, np.ndarray | None, float]:
        """The host's planning of this call, from the gathered counts to the tables the
        device ops use: the planner's routing and quotas (observed first when training),
        the region's ``CallLayout`` on this rank and this source's instance-order chunk
        tables ([2, I], None without replicas); and the host seconds it all took.
        ``host``: the gathered [R, E] counts as a host array."""
        started = time.perf_counter()
        rank = self.counts_exchange.ep_rank
        if training:
            planner.observe(host)
        mb_plan = planner.plan(host)
        self.last_plan = mb_plan   # routing and quotas of the latest call (for tools)
        local = local_instances(mb_plan.retention, rank)
        native = planner.native_layout(mb_plan, rank)
        if native is not None:
            sizes, tables, order = native
            layout = CallLayout.from_native(rank, local, sizes, tables)
        else:
            layout = CallLayout(mb_plan.retention, rank, local)
            order = _instance_order_tables(mb_plan.assignment.counts[rank], planner.placement)
        return mb_plan, layout, order, time.perf_counter() - started

    def _region_experts(self, experts: ExpertWeights) -> ExpertWeights:
        """The home experts followed by this step's replicas, once their refresh is done."""
        self.replicas.finish_refresh()     # the region needs the replica weights now
        if self.replicas.experts:
            experts = experts.with_replicas(*self.replicas.params)
        return experts

    def _pairs_in_send_order(self, routing_map: torch.Tensor, probs: torch.Tensor,
                             layout: CallLayout, order: np.ndarray | None,
                             device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(pair_token [P], pair_prob [P]) of this rank's pairs in the region's send order.

        Pairs to instances: within each expert's pairs (token order) the routing's counts
        for this source, instance by instance; then instance-major order, which is
        destination-rank order since instances are rank-major. ``order``: the chunk
        tables of that reorder (``_instance_order_tables``), None without replicas."""
        index = None
        if order is not None:
            tables = to_device(torch.from_numpy(order), device)
            index = chunk_permutation(tables[0], tables[1], layout.num_pairs)
        return _expert_major_pairs(routing_map, probs, layout.num_pairs, index)

    def _region_context(self, mb_plan: MicroBatchPlan, counts: torch.Tensor, training: bool,
                        planner_s: float) -> RegionContext:
        """The region's plan, group, options and draw seed for this micro-batch."""
        state = self.lrmoe_state
        rc = RegionContext(
            plan=mb_plan.retention,
            group=self.ep_group if counts.shape[0] > 1 else None,
            rank=self.counts_exchange.ep_rank,
            metric=self.config.moe_lrmoe_metric,
            selection=self.config.moe_lrmoe_selection,
            hybrid_fraction=self.config.moe_lrmoe_hybrid_fraction,
            store_factor=self.config.moe_lrmoe_store_factor,
            seed=state.draw_seed(self.layer_number or 0),
            kernels=self.config.moe_lrmoe_kernels,
            deterministic=deterministic_mode(self.config.deterministic_mode),
            grouped_gemm=(self.grouped_gemm if self.grouped_gemm is not None
                          else (True if self.config.moe_grouped_gemm else None)),
            # A rule that ignores the metric computes it only for the statistics: on
            # the first step's micro-batches after each collection (log interval).
            measure=training and len(self.lrmoe_stats.calls) < state.microbatches_told(),
            layer=self.layer_number or 0,
            call=state.calls,
            record=active_kept_pairs_log(),
            on_replica_grads=self._after_backward,
        )
        rc.stats.planner_s = planner_s
        rc.stats.routing_overflow = mb_plan.assignment.overflow
        rc.stats.budget_adjusted = bool(mb_plan.notes)
        return rc

    def _count_training_call(self, rc: RegionContext, mb_plan: MicroBatchPlan,
                             counts: np.ndarray) -> None:
        """A training micro-batch: log the planner's new notes, take the next draw
        ordinal and record the call's statistics (host figures from the plan)."""
        if mb_plan.notes:
            self._log_notes(mb_plan.notes)
        self.lrmoe_state.count_training_forward()
        stats = self.lrmoe_stats
        stats.calls.append(rc.stats)
        # Host arrays, not tensors: no tensor op per call for the statistics.
        stats.add_expert_load(counts[self.counts_exchange.ep_rank])
        stats.replicas = max(stats.replicas, len(self.placement_planner.placement.replicas))
        per_rank = (mb_plan.rank_load if mb_plan.rank_load is not None
                    else mb_plan.retention.routed_per_rank.numpy())
        mean = float(np.add.reduce(per_rank)) / len(per_rank)
        if mean > 0:
            stats.load_max_over_mean.append(float(np.maximum.reduce(per_rank)) / mean)

    def _start_refresh(self, experts: ExpertWeights) -> None:
        """Start this step's replica refresh if it is due (the layer's first forward after
        a step ended): a collective over the EP group, started at the same point on every
        rank; ``replicas.finish_refresh`` waits for it."""
        state = self.lrmoe_state
        if state.needs_refresh:
            self.replicas.start_refresh(self.placement_planner.placement, experts.params)
            state.needs_refresh = False

    def _log_notes(self, notes: tuple[str, ...]) -> None:
        """What the planner did to fit the budget or capacity, once per kind of note
        (the statistics count every call: ``lrmoe/budget-adjusted-calls``)."""
        if self.counts_exchange.ep_rank != 0:
            return
        for note in notes:
            kind = re.sub(r"[0-9][0-9.]*", "#", note)   # the same note with other numbers
            if kind not in self._noted:
                self._noted.add(kind)
                _LOG.warning("LRMoE layer %s: %s (repeats are counted in "
                             "lrmoe/budget-adjusted-calls, not logged)", self.layer_number, note)

    # ----------------------------------------------------------------- backward
    def _after_backward(self, grads: tuple[list[torch.Tensor], ...]
                        ) -> tuple[list[torch.Tensor | None], ...]:
        """Region backward hook: accumulate the replicas' gradients (by kind: dW1s, dW2s,
        then db1s, db2s with expert biases); in the step's last backward (the
        ``microbatches_per_step``-th) send them home and return the homes' additions by
        kind (None for a home expert without replicas), so that they are in the home
        gradients before Megatron's DDP hooks of this backward launch the (possibly
        overlapped) expert gradient reduction."""
        self.replicas.accumulate(grads)
        placement = self.replicas.placement
        if placement is None or not placement.replicas:
            return ()            # nothing to reduce: no count of backwards is needed
        if not self.lrmoe_state.count_backward(self.layer_number):
            return ()
        return self.replicas.reduce_into_home(self.num_local_experts)


@functools.lru_cache(maxsize=64)
def _cell_instances(placement: Placement) -> torch.Tensor:
    """Instances expert by expert (home first): the cell order of a source's pairs.
    Per placement (fixed for a step), not per forward."""
    cells = [i for e in range(placement.num_experts) for i in placement.instances_of(e)]
    return torch.tensor(cells, dtype=torch.int64)


def _expert_major_pairs(routing_map: torch.Tensor, probs: torch.Tensor, num_pairs: int,
                        order: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(pair_token [P], pair_prob [P]) of this rank's routed pairs, by expert then token,
    then reordered by ``order`` [P] (from ``_instance_order_tables``) when given.

    P comes from the counts exchange (host), so ``nonzero_static`` needs no sync (plain
    ``nonzero`` reads its output size from the device). pair_prob is a differentiable
    gather from probs [T, E] (index_select, whose backward is an index_add), made after
    the reorder: one gather and one index_add."""
    pairs = torch.nonzero_static(routing_map.t(), size=num_pairs).t()   # [2, P] expert, token
    if order is not None:
        # Along P of the [2, P] view: each row stays contiguous (the kernels take
        # pair_token as it is, a strided one they would copy).
        pairs = pairs.index_select(1, order)
    pair_expert, pair_token = pairs[0], pairs[1]
    flat = pair_expert.add(pair_token, alpha=routing_map.shape[1])   # one op: t E + e
    return pair_token, probs.reshape(-1).index_select(0, flat)


def _instance_order_tables(source_counts: torch.Tensor, placement: Placement
                          ) -> np.ndarray | None:
    """Chunk tables [2, I] of the permutation of this source's expert-major pairs into
    instance-major order (None without replicas: instance i is expert i): per instance,
    the shift from its chunk's instance-major start to its expert-major start, and the
    chunk's size.

    source_counts: [I] pairs this source sends to each instance (host). The pairs of a
    cell are contiguous in both orders, so the permutation is a reorder of chunks whose
    sizes the host knows: per-chunk shifts go to the device, which expands them."""
    if not placement.replicas:
        return None
    cell_instance = _cell_instances(placement)
    sizes = source_counts[cell_instance]                      # chunks in expert-major order
    start_now = torch.cumsum(sizes, 0) - sizes
    start_of = torch.empty_like(start_now)
    start_of[cell_instance] = start_now                       # by instance
    start_new = torch.cumsum(source_counts, 0) - source_counts
    return torch.stack([start_of - start_new, source_counts]).numpy()
