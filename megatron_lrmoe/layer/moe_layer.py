"""LRMoELayer: Megatron's MoELayer whose dispatch -> experts -> combine is the LRMoE region.

Routing (Megatron's router, aux losses included) and shared experts are Megatron's.
What changes is the span from dispatch to combine, which must be one autograd
region (docs/design.md, "Region"), so ``forward`` is the unit overridden here; the
dispatcher is chosen by config inside ``MoELayer.__init__``, so it is swapped right
after. Shapes: hidden_states [S, B, H] in and out (S the local sequence shard under
sequence parallelism); T = S x B tokens; E experts; P routed pairs.
"""

from __future__ import annotations

import functools
import logging
import re
import time
from collections.abc import Callable
from typing import Any

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

from megatron_lrmoe.config.planner_inputs import needs_cost_model, planner_settings
from megatron_lrmoe.config.transformer_config import LRMoETransformerConfig
from megatron_lrmoe.layer.counts_exchange import RoutedCountsExchange
from megatron_lrmoe.layer.region import (
    ExpertWeights,
    RegionContext,
    active_kept_pairs_log,
    lrmoe_region,
)
from megatron_lrmoe.layer.region_layout import chunk_permutation, to_device
from megatron_lrmoe.layer.replicas import ExpertReplicas
from megatron_lrmoe.layer.telemetry import LRMoELayerStats
from megatron_lrmoe.planning.cost_model import MachineConstants
from megatron_lrmoe.planning.placement import Placement
from megatron_lrmoe.planning.planner import LayerPlanner, MicroBatchPlan

_LOG = logging.getLogger(__name__)

# The checkpointed step state (docs/design.md, "Step state"): the module's extra state.
PLANNER_STATE_FORMAT = "megatron-lrmoe layer step state"
PLANNER_STATE_VERSION = 1
# Content-metadata flag of a checkpoint whose LRMoE layers saved their step state; the
# sharded state dict holds the state's key only when it is set (docs/design.md, "Step state").
PLANNER_STATE_FLAG = "lrmoe_planner_state"
_EXTRA_STATE_KEY = "_extra_state"     # torch's key for a module's get_extra_state()

MicrobatchesPerStep = int | Callable[[], int]


class LRMoELayer(MoELayer):
    """MoELayer with an exact forward and a metric-driven, compacted backward.

    Placement (docs/design.md, "Placement"): a ``LayerPlanner`` (pure, identical on every
    rank that holds the layer) chooses the expert instances of each step from the
    smoothed routed counts and, per micro-batch, the capacity-aware routing of pairs to
    instances and the retention quotas. Replicas are refreshed at the layer's first
    forward after a step ended and their gradients reduced into the homes in the step's
    last backward.

    Step boundaries are explicit (docs/design.md, "Step state"): whoever drives the layer
    tells it how many micro-batches a step has (``microbatches_per_step``; the entry
    points set Megatron's ``get_num_microbatches``) and calls ``finish_step()`` once per
    optimizer step taken (``integration/step_hooks.py`` does both for a model). The planner, the
    step count and the draw ordinal are the module's extra state, so they travel in the
    model's checkpoint.
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
        # The planner state is pooled over this group at each step end (lrmoe/step.py).
        self.expert_data_parallel_group = getattr(pg_collection, "expt_dp", None)
        # Random rules draw from (step seed, layer, micro-batch ordinal): the step seed
        # mixes torch's seed (set from --seed by Megatron's setup; reading it consumes no
        # random numbers) with the training steps this layer finished; ``_calls`` counts
        # the current step's training forwards. Both restart at a step's end.
        self._run_seed = torch.initial_seed()
        self._step = 0
        self._calls = 0
        self._seed_base = _step_seed(self._run_seed, self._step)
        self.lrmoe_stats = LRMoELayerStats()
        # Expert backward GEMMs: None = grouped_mm wherever it applies, else the loop.
        self.grouped_gemm: bool | None = None
        ep_size = self.ep_group.size()
        self.replicas = ExpertReplicas(self.counts_exchange.ep_rank,
                                       self.ep_group if ep_size > 1 else None)
        self.microbatches_per_step: MicrobatchesPerStep | None = None
        """Micro-batches of a training step (an int, or a function such as Megatron's
        ``get_num_microbatches``): how the layer finds the step's last backward, where
        replica gradients join the homes'. Set by ``setup_planner``; None = not told,
        which is an error once replicas exist."""
        # Built now unless the cost model needs the tokens per micro-batch and the
        # machine constants (a budget or memory-aware placement): then by setup_planner,
        # which both entry points run right after building the model.
        self._planner: LayerPlanner | None = None
        self._pending_state: dict | None = None     # loaded before setup_planner ran
        self.planner_state_origin = "fresh"
        """Where the planner state came from: "fresh", "checkpoint", or "fresh: <why>"."""
        self.reports_checkpoint_state = False       # the one layer that logs it (setup)
        if not needs_cost_model(config):
            self._planner = LayerPlanner(planner_settings(config, ep_size))
        self._needs_refresh = True       # replicas must be refreshed before the next forward
        self.last_plan: MicroBatchPlan | None = None
        self._noted: set[str] = set()
        self._backwards_in_step = 0

    # ------------------------------------------------------------------ planner
    @property
    def placement_planner(self) -> LayerPlanner:
        """This layer's planner; an error before ``setup_planner`` where it is needed."""
        if self._planner is None:
            raise RuntimeError(
                f"LRMoE layer {self.layer_number}: the planner of this configuration "
                "(--moe-lrmoe-memory-budget-gb or --moe-lrmoe-placement memory-aware) is built "
                "at model setup: call megatron_lrmoe.integration.step_hooks.setup_lrmoe_layers("
                "model, ...) (both entry points do) or layer.setup_planner(...) before the first "
                "forward")
        return self._planner

    def setup_planner(self, tokens_per_rank: int, microbatches_per_step: MicrobatchesPerStep,
                      machine: MachineConstants | None = None) -> LayerPlanner:
        """Build the planner from the tokens of one micro-batch on this rank and the
        machine constants (needed with a budget or memory-aware placement), and tell the
        layer the micro-batches of a step. No measurement and no communication here.

        A planner state already held (an earlier planner, or one loaded from a checkpoint
        before this call) carries over."""
        self.microbatches_per_step = microbatches_per_step
        # The count is read now only where the cost model amortises over it.
        count = self._step_microbatches() if needs_cost_model(self.config) else 1
        settings = planner_settings(self.config, self.ep_group.size(), tokens_per_rank,
                                    count, machine)
        previous = self._planner.state_dict() if self._planner is not None else None
        self._planner = LayerPlanner(settings)
        if previous is not None:
            self._planner.load_state_dict(previous)
        elif self._pending_state is not None:
            self._apply_state(self._pending_state)
        self._pending_state = None
        return self._planner

    # -------------------------------------------------------------- step boundary
    def finish_step(self, observations: tuple[torch.Tensor | None, int] | None = None) -> None:
        """End of one training step (the optimizer step, taken or skipped): fold the step's
        observed counts into the planner (``observations``: the pooled (sum, micro-batches)
        of all replicas of this layer, else this rank's own), choose the next placement,
        mark the replicas for refresh and advance the draw seeds. A call after a step
        without training micro-batches (e.g. only evaluation) changes nothing.

        Raises if the step's replica gradients were not added to the homes (the step had
        fewer backward passes than ``microbatches_per_step``)."""
        if self._backwards_in_step or self.replicas.has_grads:
            raise RuntimeError(
                f"LRMoE layer {self.layer_number}: the step ended after {self._backwards_in_step} "
                f"backward pass(es) of the {self._step_microbatches()} it was told a step has; "
                "the replica gradients never reached the home experts")
        if not self._calls:
            return
        planner = self.placement_planner
        if observations is not None:
            planner.replace_observations(*observations)
        planner.next_step()
        self._step += 1
        self._calls = 0
        self._seed_base = _step_seed(self._run_seed, self._step)
        self._needs_refresh = True

    def step_state(self) -> dict[str, Any]:
        """Everything a step changes, to undo it (Megatron's re-run of a step): a copy."""
        return {"planner": self.placement_planner.state_dict(), "step": self._step,
                "calls": self._calls, "backwards": self._backwards_in_step,
                "needs_refresh": self._needs_refresh, "stats": self.lrmoe_stats.mark()}

    def load_step_state(self, state: dict[str, Any]) -> None:
        """Undo what happened since ``step_state()`` returned ``state``."""
        self.placement_planner.load_state_dict(state["planner"])
        self._step, self._calls = state["step"], state["calls"]
        self._seed_base = _step_seed(self._run_seed, self._step)
        self._backwards_in_step = state["backwards"]
        self._needs_refresh = state["needs_refresh"]
        self.lrmoe_stats.rewind(state["stats"])

    def _step_microbatches(self) -> int:
        told = self.microbatches_per_step
        if told is None:
            raise RuntimeError(
                f"LRMoE layer {self.layer_number} holds replicas but was never told how many "
                "micro-batches a training step has, so it cannot find the step's last "
                "backward (where replica gradients must join the homes'): run "
                "megatron_lrmoe.integration.step_hooks.setup_lrmoe_layers(model, ...) "
                "(both entry points do), or set layer.microbatches_per_step when driving the layer "
                "by hand")
        count = told() if callable(told) else told
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"LRMoE layer {self.layer_number}: microbatches_per_step gave "
                             f"{count!r}, expected a positive int")
        return count

    # -------------------------------------------------------------- checkpoints
    def get_extra_state(self) -> dict[str, Any]:
        """The step state saved with the model (docs/design.md, "Step state"): planner
        (smoothed loads, step, placement), the finished steps that seed the draws, and
        what the planner is valid for (EP size, experts, policy)."""
        if self._planner is None and self._pending_state is not None:
            return self._pending_state       # loaded before setup_planner: saved unchanged
        return {"format": PLANNER_STATE_FORMAT, "version": PLANNER_STATE_VERSION,
                "ep_size": self.ep_group.size(), "num_experts": self.config.num_moe_experts,
                "policy": self.config.moe_lrmoe_placement, "step": self._step,
                "planner": None if self._planner is None else self._planner.state_dict()}

    def set_extra_state(self, state: Any) -> None:
        if self._planner is None:
            self._pending_state = state     # applied by setup_planner
            self._reset_step_progress()
            if isinstance(state, dict) and "step" in state:
                self._step = int(state["step"])
                self._seed_base = _step_seed(self._run_seed, self._step)
            return
        self._apply_state(state)

    def _apply_state(self, state: Any) -> None:
        """Load a saved step state, or start the planner fresh (and say why) when it does
        not apply to this run: another EP size, expert count or placement policy."""
        self._reset_step_progress()
        if not isinstance(state, dict) or state.get("format") != PLANNER_STATE_FORMAT:
            self._start_fresh("the checkpoint's state of this layer is not an LRMoE step state")
            return
        if state.get("version") != PLANNER_STATE_VERSION:
            self._start_fresh(f"step state version {state.get('version')!r}, this code reads "
                              f"{PLANNER_STATE_VERSION}")
            return
        self._step = int(state["step"])
        self._seed_base = _step_seed(self._run_seed, self._step)
        saved = (state.get("ep_size"), state.get("num_experts"), state.get("policy"))
        here = (self.ep_group.size(), self.config.num_moe_experts,
                self.config.moe_lrmoe_placement)
        if saved != here or state.get("planner") is None:
            self._start_fresh(f"the checkpoint's planner is for (EP, experts, placement) = "
                              f"{saved}, this run has {here}")
            return
        self.placement_planner.load_state_dict(state["planner"])
        self.planner_state_origin = "checkpoint"

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
            self._reset_step_progress()
            self._pending_state = None
            self._step = 0
            self._seed_base = _step_seed(self._run_seed, self._step)
            self._start_fresh("the checkpoint holds no LRMoE step state (saved without "
                              "--moe-lrmoe, or before LRMoE saved it)")
        if self.reports_checkpoint_state:
            origin = self.planner_state_origin
            if origin == "checkpoint":
                _LOG.info("LRMoE: planner and draw state loaded from the checkpoint")
            else:
                _LOG.warning("LRMoE layer %s (and the others of this pipeline stage): the planner "
                             "starts %s", self.layer_number, origin)

    def _start_fresh(self, why: str) -> None:
        if self._planner is not None:
            self._planner = LayerPlanner(self._planner.settings)
        self.planner_state_origin = f"fresh: {why}"

    def _reset_step_progress(self) -> None:
        self._calls = 0
        self._backwards_in_step = 0
        self._needs_refresh = True

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: dict | None = None):
        """Megatron's, whose extra state (the step state) becomes one ShardedObject per layer
        with the layer offsets (EP-invariant key; replica_id non-zero on every rank but
        one tensor- and data-parallel rank 0, which all hold the same state).

        The state is in the dict only when ``metadata`` carries ``PLANNER_STATE_FLAG``: on
        save the entry points set it; on load Megatron passes the checkpoint's own
        content metadata, so a checkpoint without the state (a plain Megatron run) is
        never asked for it, whatever ``--dist-ckpt-strictness`` says."""
        state = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        if not (metadata or {}).get(PLANNER_STATE_FLAG):
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
            # Megatron's selective "moe" recompute (``MoELayer.forward`` wraps its stages
            # the same way): only the layer input is kept, and backward runs the layer
            # again. The first pass runs without autograd, so, like an evaluation pass,
            # it plans and computes the exact forward but neither observes, counts nor
            # draws; the recomputed pass in backward is the micro-batch's training pass
            # (docs/design.md, "Recompute").
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
        rank = self.counts_exchange.ep_rank
        # A training pass is one with autograd on: it observes, counts and draws. The first
        # pass of a recomputed layer (full or "moe" recompute) runs without autograd and
        # only plans, like an evaluation pass; its recomputed pass in backward is then the
        # micro-batch's training pass, with the same counts, hence the same plan, and the
        # ordinal of the micro-batch's backward, which Megatron's schedules run in forward
        # order (docs/design.md, "Recompute").
        training = self.training and torch.is_grad_enabled()
        planner = self.placement_planner
        if experts is None:
            experts = self.experts.expert_weights()
            self._start_refresh(experts)
        started = time.perf_counter()
        if training:
            planner.observe(counts)
        mb_plan = planner.plan(counts)
        self.last_plan = mb_plan   # routing and quotas of the latest call (for tools)
        planner_s = time.perf_counter() - started
        plan = mb_plan.retention
        self.replicas.finish_refresh()     # the region needs the replica weights now
        if self.replicas.experts:
            experts = experts.with_replicas(self.replicas.w1, self.replicas.w2)
        pair_token, pair_prob = _expert_major_pairs(routing_map, probs, int(counts[rank].sum()))
        # Pairs to instances: within each expert's pairs (token order) the routing's
        # counts for that source, instance by instance; then instance-major order,
        # which is destination-rank order since instances are rank-major.
        order = _instance_order(mb_plan.routing.counts[rank], planner.placement, x.device)
        if order is not None:
            pair_token, pair_prob = pair_token.index_select(0, order), pair_prob.index_select(
                0, order)
        stats = self.lrmoe_stats
        rc = RegionContext(
            plan=plan,
            group=self.ep_group if counts.shape[0] > 1 else None,
            rank=rank,
            metric=self.config.moe_lrmoe_metric,
            selection=self.config.moe_lrmoe_selection,
            hybrid_fraction=self.config.moe_lrmoe_hybrid_fraction,
            seed=_mix_seed(self._seed_base, self.layer_number or 0, self._calls),
            kernels=self.config.moe_lrmoe_kernels,
            grouped_gemm=(self.grouped_gemm if self.grouped_gemm is not None
                          else (True if self.config.moe_grouped_gemm else None)),
            # A rule that ignores the metric computes it only for the statistics: on
            # the first step's micro-batches after each collection (log interval).
            measure=training and len(stats.calls) < _microbatches_told(self),
            layer=self.layer_number or 0,
            call=self._calls,
            record=active_kept_pairs_log(),
            on_replica_grads=self._after_backward,
        )
        rc.stats.planner_s = planner_s
        rc.stats.routing_overflow = mb_plan.routing.overflow
        rc.stats.budget_adjusted = bool(mb_plan.notes)
        if mb_plan.notes and training:
            self._log_notes(mb_plan.notes)
        if training:
            self._calls += 1
            stats.calls.append(rc.stats)
            stats.add_expert_load(counts[rank])
            stats.replicas = max(stats.replicas, len(planner.placement.replicas))
            per_rank = plan.routed_per_rank.double()
            if float(per_rank.mean()) > 0:
                stats.load_max_over_mean.append(float(per_rank.max() / per_rank.mean()))
        return lrmoe_region(x, pair_token, pair_prob, rc, experts).view(shape)

    def _start_refresh(self, experts: ExpertWeights) -> None:
        """Start this step's replica refresh if it is due (the layer's first forward after
        a step ended): a collective over the EP group, started at the same point on every
        rank; ``replicas.finish_refresh`` waits for it."""
        if self._needs_refresh:
            self.replicas.start_refresh(self.placement_planner.placement, experts.w1,
                                        experts.w2)
            self._needs_refresh = False

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
    def _after_backward(self, dw1: list[torch.Tensor], dw2: list[torch.Tensor]
                        ) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
        """Region backward hook: accumulate replica gradients; in the step's last
        backward (the ``microbatches_per_step``-th) send them home and return the homes'
        additions (None for a home expert without replicas), so that they are in the home
        gradients before Megatron's DDP hooks of this backward launch the (possibly
        overlapped) expert gradient reduction."""
        self.replicas.accumulate(dw1, dw2)
        placement = self.replicas.placement
        if placement is None or not placement.replicas:
            return [], []        # nothing to reduce: no count of backwards is needed
        self._backwards_in_step += 1
        if self._backwards_in_step < self._step_microbatches():
            return [], []
        self._backwards_in_step = 0
        return self.replicas.reduce_into_home(self.num_local_experts)


@functools.lru_cache(maxsize=64)
def _cell_instances(placement: Placement) -> torch.Tensor:
    """Instances expert by expert (home first): the cell order of a source's pairs.
    Per placement (fixed for a step), not per forward."""
    cells = [i for e in range(placement.num_experts) for i in placement.instances_of(e)]
    return torch.tensor(cells, dtype=torch.int64)


def _expert_major_pairs(routing_map: torch.Tensor, probs: torch.Tensor,
                        num_pairs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pair_token [P], pair_prob [P]) of this rank's routed pairs, by expert then token.

    P comes from the counts exchange (host), so ``nonzero_static`` needs no sync (plain
    ``nonzero`` reads its output size from the device). pair_prob is a differentiable
    gather from probs [T, E] (index_select, whose backward is an index_add)."""
    pairs = torch.nonzero_static(routing_map.t(), size=num_pairs)     # [P, 2] (expert, token)
    pair_expert, pair_token = pairs[:, 0], pairs[:, 1]
    flat = pair_token * routing_map.shape[1] + pair_expert
    return pair_token, probs.reshape(-1).index_select(0, flat)


def _instance_order(source_counts: torch.Tensor, placement: Placement,
                    device: torch.device) -> torch.Tensor | None:
    """Permutation of this source's expert-major pairs into instance-major order
    (None without replicas: instance i is expert i).

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
    tables = to_device(torch.stack([start_of - start_new, source_counts]), device)
    return chunk_permutation(tables[0], tables[1], int(source_counts.sum()))


def _microbatches_told(layer: LRMoELayer) -> int:
    """Micro-batches of a step as the layer was told (1 when driven by hand)."""
    told = layer.microbatches_per_step
    if told is None:
        return 1
    return told() if callable(told) else told


def _step_seed(run_seed: int, step: int) -> int:
    """A 63-bit seed of one training step of the run, a different one for each step
    (``_mix_seed`` then mixes in the layer and the micro-batch ordinal)."""
    value = (run_seed * 0xD6E8FEB86659FD93 + step * 0x94D049BB133111EB + 0x5EED) & (2**64 - 1)
    value ^= value >> 29
    return value & (2**63 - 1)


def _mix_seed(base: int, layer: int, call: int) -> int:
    """A 63-bit seed from (base, layer, call), different for every triple."""
    value = (base * 0x9E3779B97F4A7C15 + layer * 0xBF58476D1CE4E5B9 + call) & (2**64 - 1)
    value ^= value >> 31
    return value & (2**63 - 1)
