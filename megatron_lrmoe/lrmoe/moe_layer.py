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

import torch
from megatron.core import num_microbatches_calculator
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

from megatron_lrmoe.lrmoe.config import LRMoETransformerConfig
from megatron_lrmoe.lrmoe.counts_exchange import RoutedCountsExchange
from megatron_lrmoe.lrmoe.placement import Placement
from megatron_lrmoe.lrmoe.planner import LayerPlanner, MicroBatchPlan
from megatron_lrmoe.lrmoe.planner_config import planner_settings
from megatron_lrmoe.lrmoe.region import RegionContext, lrmoe_region
from megatron_lrmoe.lrmoe.replicas import ExpertReplicas
from megatron_lrmoe.lrmoe.telemetry import LRMoELayerStats

_LOG = logging.getLogger(__name__)


class LRMoELayer(MoELayer):
    """MoELayer with an exact forward and a metric-driven, compacted backward.

    Placement (docs/design.md, "Placement"): a ``LayerPlanner`` (pure, identical on every EP rank)
    chooses the expert instances of each step from the smoothed routed counts and,
    per micro-batch, the capacity-aware routing of pairs to instances and the
    retention quotas. Replicas are refreshed at the layer's first forward of a step
    and their gradients reduced into the homes in the step's last backward.
    """

    def __init__(self, config: LRMoETransformerConfig, submodules: MoESubmodules | None = None,
                 layer_number: int | None = None, pg_collection=None) -> None:
        if not getattr(config, "moe_lrmoe", False):
            raise ValueError("LRMoELayer needs an LRMoETransformerConfig with moe_lrmoe=True")
        pg_collection = pg_collection or get_default_pg_collection()
        super().__init__(config, submodules, layer_number, pg_collection)
        self.token_dispatcher = RoutedCountsExchange(
            self.num_local_experts, self.local_expert_indices, config=self.config,
            pg_collection=pg_collection,
        )
        # Random rules draw from (base seed, layer, call): torch's seed is set from
        # --seed by Megatron's setup; reading it consumes no random numbers.
        self._seed_base = torch.initial_seed()
        self._calls = 0
        self.lrmoe_stats = LRMoELayerStats()
        # Expert backward GEMMs: None = grouped_mm wherever it applies, else the loop.
        self.grouped_gemm: bool | None = None
        ep_size = self.ep_group.size()
        self.replicas = ExpertReplicas(self.token_dispatcher.ep_rank,
                                       self.ep_group if ep_size > 1 else None)
        # Built now unless the cost model needs the tokens per micro-batch (a budget or
        # memory-aware placement): then at the first forward.
        self.placement_planner: LayerPlanner | None = None
        self._pending_planner_state: dict | None = None
        if (config.moe_lrmoe_memory_budget_gb is None
                and config.moe_lrmoe_placement != "memory-aware"):
            self._build_planner(tokens_per_rank=1)
        self._needs_refresh = True       # replicas must be refreshed before the next forward
        self.last_plan: MicroBatchPlan | None = None
        self._noted: set[str] = set()
        self._backwards_in_step = 0

    def _build_planner(self, tokens_per_rank: int) -> LayerPlanner:
        ep_size = self.ep_group.size()
        settings = planner_settings(
            self.config, ep_size, tokens_per_rank, _microbatches_per_step(),
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
            else torch.device("cpu"), self.ep_group if ep_size > 1 else None)
        self.placement_planner = LayerPlanner(settings)
        if self._pending_planner_state is not None:
            self._load_planner_state(self._pending_planner_state)
            self._pending_planner_state = None
        return self.placement_planner

    # -------------------------------------------------------------- checkpoints
    def rank_local_state(self) -> dict:
        """Saved per rank by the launcher's checkpoints: the draw counter and the
        planner's state (smoothed loads, step, placement), so a resume is exact."""
        planner = self.placement_planner
        state = planner.state_dict() if planner is not None else self._pending_planner_state
        return {"calls": self._calls, "planner": state}

    def load_rank_local_state(self, state: dict) -> None:
        self._calls = int(state["calls"])
        if state.get("planner") is not None:
            if self.placement_planner is None:
                self._pending_planner_state = state["planner"]
            else:
                self._load_planner_state(state["planner"])
        self._needs_refresh = True
        self._backwards_in_step = 0

    def _load_planner_state(self, state: dict) -> None:
        planner = self.placement_planner
        planner.load_state_dict(state)
        if self.config.moe_lrmoe_placement == "static" and planner.placement.replicas:
            # Checkpoints hold home weights only: a run resumed with another policy
            # simply starts from its own layout.
            planner.placement = Placement.static(planner.placement.num_ranks,
                                                 self.config.num_moe_experts)

    # ------------------------------------------------------------------ forward
    def forward(self, hidden_states: torch.Tensor, intermediate_tensors=None,
                padding_mask: torch.Tensor | None = None):
        if intermediate_tensors is not None:
            raise ValueError("LRMoELayer does not support partial CUDA-graph capture")
        if self.training and self.attn_tp_group.size() > 1 and not self.config.sequence_parallel:
            raise ValueError("MoE with tensor parallelism needs sequence parallelism")
        if padding_mask is not None:
            padding_mask = padding_mask.transpose(0, 1).bool()
        shared_output = self.shared_experts_compute(hidden_states)
        probs, routing_map = self.route(hidden_states, padding_mask)
        output = self.routed_output(hidden_states, probs, routing_map)
        if shared_output is not None:
            output = output + shared_output
        return output, None

    def routed_output(self, hidden_states: torch.Tensor, probs: torch.Tensor,
                      routing_map: torch.Tensor) -> torch.Tensor:
        """y(t) = sum_e p(t, e) o(t, e) with o from the region (p applied here, after it)."""
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])                          # [T, H]
        # Pairs in expert-major order (by expert, then token).
        pair_expert, pair_token = routing_map.t().nonzero(as_tuple=True)   # [P], [P]
        pair_prob = probs[pair_token, pair_expert]                        # [P]
        counts = self.token_dispatcher.gather_counts(routing_map)         # [R, E]
        training = self.training and torch.is_grad_enabled()
        planner = self.placement_planner or self._build_planner(x.shape[0])
        experts = self.experts.expert_weights()
        if self._needs_refresh:
            self.replicas.refresh(planner.placement, experts.w1, experts.w2)
            self._needs_refresh = False
        started = time.perf_counter()
        if training:
            planner.observe(counts)
        mb_plan = planner.plan(counts)
        self.last_plan = mb_plan   # routing and quotas of the latest call (for tools)
        planner_s = time.perf_counter() - started
        plan, rank = mb_plan.retention, self.token_dispatcher.ep_rank
        if self.replicas.experts:
            experts = experts.with_replicas(self.replicas.w1, self.replicas.w2)
        # Pairs to instances: within each expert's pairs (token order) the routing's
        # counts for that source, instance by instance; then instance-major order,
        # which is destination-rank order since instances are rank-major.
        order = _instance_order(mb_plan.routing.counts[rank], planner.placement, pair_expert)
        if order is not None:
            pair_token, pair_prob = pair_token[order], pair_prob[order]
        rc = RegionContext(
            plan=plan,
            group=self.ep_group if counts.shape[0] > 1 else None,
            rank=rank,
            metric=self.config.moe_lrmoe_metric,
            selection=self.config.moe_lrmoe_selection,
            hybrid_fraction=self.config.moe_lrmoe_hybrid_fraction,
            seed=_mix_seed(self._seed_base, self.layer_number or 0, self._calls),
            kernels=self.config.moe_lrmoe_kernels,
            grouped_gemm=self.grouped_gemm,
            on_replica_grads=self._after_backward,
        )
        rc.stats.planner_s = planner_s
        rc.stats.routing_overflow = mb_plan.routing.overflow
        rc.stats.budget_adjusted = bool(mb_plan.notes)
        if mb_plan.notes and training:
            self._log_notes(mb_plan.notes)
        if training:
            self._calls += 1
            stats = self.lrmoe_stats
            stats.calls.append(rc.stats)
            stats.add_expert_load(counts[rank])
            stats.replicas = max(stats.replicas, len(planner.placement.replicas))
            per_rank = plan.routed_per_rank.double()
            if float(per_rank.mean()) > 0:
                stats.load_max_over_mean.append(float(per_rank.max() / per_rank.mean()))
        o, _a = lrmoe_region(x, pair_token, pair_prob, rc, experts)
        weighted = o * pair_prob.unsqueeze(1).to(o.dtype)
        y = torch.zeros_like(x).index_add(0, pair_token, weighted)
        return y.view(shape)

    def _log_notes(self, notes: tuple[str, ...]) -> None:
        """What the planner did to fit the budget or capacity, once per kind of note
        (the statistics count every call: ``lrmoe/budget-adjusted-calls``)."""
        if self.token_dispatcher.ep_rank != 0:
            return
        for note in notes:
            kind = re.sub(r"[0-9][0-9.]*", "#", note)   # the same note with other numbers
            if kind not in self._noted:
                self._noted.add(kind)
                _LOG.warning("LRMoE layer %s: %s (repeats are counted in "
                             "lrmoe/budget-adjusted-calls, not logged)", self.layer_number, note)

    # ----------------------------------------------------------------- backward
    def _after_backward(self, dw1: list[torch.Tensor], dw2: list[torch.Tensor]
                        ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Region backward hook: accumulate replica gradients; in the step's last
        backward reduce them into the homes, close the step and plan the next one."""
        self.replicas.accumulate(dw1, dw2)
        self._backwards_in_step += 1
        if self._backwards_in_step < _microbatches_per_step():
            return [], []
        additions = self.replicas.reduce_into_home(self.num_local_experts)
        self.placement_planner.next_step()
        self._backwards_in_step = 0
        self._needs_refresh = True
        return additions


def _microbatches_per_step() -> int:
    """Megatron's micro-batches per step; 1 (every backward ends a step) without the
    calculator, e.g. a layer driven by hand."""
    if num_microbatches_calculator._GLOBAL_NUM_MICROBATCHES_CALCULATOR is None:
        return 1
    return num_microbatches_calculator.get_num_microbatches()


@functools.lru_cache(maxsize=64)
def _cell_instances(placement: Placement) -> torch.Tensor:
    """Instances expert by expert (home first): the cell order of a source's pairs.
    Per placement (fixed for a step), not per forward."""
    cells = [i for e in range(placement.num_experts) for i in placement.instances_of(e)]
    return torch.tensor(cells, dtype=torch.int64)


def _instance_order(source_counts: torch.Tensor, placement: Placement,
                    pair_expert: torch.Tensor) -> torch.Tensor | None:
    """Permutation of this source's expert-major pairs into instance-major order
    (None without replicas: instance i is expert i).

    source_counts: [I] pairs this source sends to each instance.
    """
    if not placement.replicas:
        return None
    cell_instance = _cell_instances(placement)
    sizes = source_counts[cell_instance]
    pair_instance = torch.repeat_interleave(cell_instance, sizes).to(pair_expert.device)
    return torch.sort(pair_instance, stable=True).indices


def _mix_seed(base: int, layer: int, call: int) -> int:
    """A 63-bit seed from (base, layer, call), different for every triple."""
    value = (base * 0x9E3779B97F4A7C15 + layer * 0xBF58476D1CE4E5B9 + call) & (2**64 - 1)
    value ^= value >> 31
    return value & (2**63 - 1)
