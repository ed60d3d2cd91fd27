"""LRMoELayer: Megatron's MoELayer whose dispatch -> experts -> combine is the LRMoE region.

Routing (Megatron's router, aux losses included) and shared experts are Megatron's.
What changes is the span from dispatch to combine, which must be one autograd
region (DESIGN section 4), so ``forward`` is the unit overridden here; the
dispatcher is chosen by config inside ``MoELayer.__init__``, so it is swapped right
after. Shapes: hidden_states [S, B, H] in and out (S the local sequence shard under
sequence parallelism); T = S x B tokens; E experts; P routed pairs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

from megatron_lrmoe.lrmoe.config import LRMoETransformerConfig
from megatron_lrmoe.lrmoe.dispatcher import LRMoEAlltoAllTokenDispatcher
from megatron_lrmoe.lrmoe.planner import plan_retention
from megatron_lrmoe.lrmoe.region import RegionContext, RegionStats, lrmoe_region


@dataclass
class LRMoELayerStats:
    """Region statistics of one layer since the last ``reset()`` (host numbers)."""

    calls: list[RegionStats] = field(default_factory=list)
    load_max_over_mean: list[float] = field(default_factory=list)
    expert_load: torch.Tensor | None = None  # [E] pairs this rank routed to each expert

    def reset(self) -> None:
        self.calls.clear()
        self.load_max_over_mean.clear()
        self.expert_load = None

    def add_expert_load(self, routed: torch.Tensor) -> None:
        routed = routed.to(torch.float64)
        self.expert_load = routed if self.expert_load is None else self.expert_load + routed

    def totals(self) -> list[float]:
        """Raw sums over the completed calls, in ``TOTAL_FIELDS`` order (summable
        over ranks): routed and retained pairs, metric total and dropped, backward
        bytes sent and dense, expert backward rows."""
        done = [c for c in self.calls if c.backward_done]
        return [float(sum(getattr(c, name) for c in done)) for name in TOTAL_FIELDS]

    def summary(self) -> dict[str, float]:
        """This rank's figures since the last reset."""
        return summarize(self.totals(), max(self.load_max_over_mean, default=0.0))


TOTAL_FIELDS = ("routed_pairs", "retained_pairs", "metric_total", "metric_dropped",
                "backward_bytes_sent", "backward_bytes_dense", "expert_backward_rows")


def summarize(totals: list[float], load_max_over_mean: float) -> dict[str, float]:
    """Logged figures from ``totals`` (possibly summed over ranks)."""
    routed, retained, metric, dropped, sent, dense, rows = totals
    return {
        "load-max-over-mean": load_max_over_mean,
        "retained-fraction": retained / routed if routed else 1.0,
        "dropped-contribution-fraction": dropped / metric if metric > 0 else 0.0,
        "backward-bytes-saved": dense - sent,
        "expert-backward-rows": rows,
    }


class LRMoELayer(MoELayer):
    """MoELayer with an exact forward and a metric-driven, compacted backward."""

    def __init__(self, config: LRMoETransformerConfig, submodules: MoESubmodules | None = None,
                 layer_number: int | None = None, pg_collection=None) -> None:
        if not getattr(config, "moe_lrmoe", False):
            raise ValueError("LRMoELayer needs an LRMoETransformerConfig with moe_lrmoe=True")
        pg_collection = pg_collection or get_default_pg_collection()
        super().__init__(config, submodules, layer_number, pg_collection)
        self.token_dispatcher = LRMoEAlltoAllTokenDispatcher(
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

    def rank_local_state(self) -> dict[str, int]:
        """Saved per rank by the launcher's checkpoints: the draw counter."""
        return {"calls": self._calls}

    def load_rank_local_state(self, state: dict[str, int]) -> None:
        self._calls = int(state["calls"])

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
        # Pairs in expert-major order (by expert, then token): destination-rank order.
        pair_expert, pair_token = routing_map.t().nonzero(as_tuple=True)   # [P], [P]
        pair_prob = probs[pair_token, pair_expert]                        # [P]
        counts = self.token_dispatcher.gather_counts(routing_map)         # [R, E]
        config = self.config
        plan = plan_retention(counts, counts.shape[0], config.moe_lrmoe_bwd_capacity_factor,
                              config.moe_lrmoe_min_retention)
        rc = RegionContext(
            plan=plan,
            group=self.ep_group if counts.shape[0] > 1 else None,
            rank=self.token_dispatcher.ep_rank,
            num_local_experts=self.num_local_experts,
            metric=config.moe_lrmoe_metric,
            selection=config.moe_lrmoe_selection,
            seed=_mix_seed(self._seed_base, self.layer_number or 0, self._calls),
            kernels=config.moe_lrmoe_kernels,
            grouped_gemm=self.grouped_gemm,
        )
        if self.training and torch.is_grad_enabled():
            self._calls += 1
            self.lrmoe_stats.calls.append(rc.stats)
            self.lrmoe_stats.add_expert_load(counts[rc.rank])
            per_rank = plan.routed_per_rank.double()
            if float(per_rank.mean()) > 0:
                self.lrmoe_stats.load_max_over_mean.append(
                    float(per_rank.max() / per_rank.mean()))
        o, _a = lrmoe_region(x, pair_token, pair_prob, rc, self.experts.expert_weights())
        weighted = o * pair_prob.unsqueeze(1).to(o.dtype)
        y = torch.zeros_like(x).index_add(0, pair_token, weighted)
        return y.view(shape)


def _mix_seed(base: int, layer: int, call: int) -> int:
    """A 63-bit seed from (base, layer, call), different for every triple."""
    value = (base * 0x9E3779B97F4A7C15 + layer * 0xBF58476D1CE4E5B9 + call) & (2**64 - 1)
    value ^= value >> 31
    return value & (2**63 - 1)
