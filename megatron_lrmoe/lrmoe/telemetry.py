"""Per-layer LRMoE statistics, reduced over all ranks for the launcher's logs.

Each LRMoELayer records what its region calls did (``LRMoELayerStats``); at a log
interval every rank contributes its raw sums per global layer number, one
all_reduce adds them up (pairs and bytes add over data-, tensor- and
expert-parallel ranks, each of which routes its own tokens) and one takes the
maximum routed-load imbalance. Host syncs happen here, off the training path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_lrmoe.lrmoe.region import RegionStats

__all__ = ["TOTAL_FIELDS", "LRMoELayerStats", "collect_lrmoe_stats", "lrmoe_layers", "summarize"]


@dataclass
class LRMoELayerStats:
    """Region statistics of one layer since the last ``reset()`` (host numbers)."""

    calls: list[RegionStats] = field(default_factory=list)
    load_max_over_mean: list[float] = field(default_factory=list)
    expert_load: torch.Tensor | None = None  # [E] pairs this rank routed to each expert
    replicas: int = 0                        # most replicas of any step since the reset

    def reset(self) -> None:
        self.calls.clear()
        self.load_max_over_mean.clear()
        self.expert_load = None
        self.replicas = 0

    def add_expert_load(self, routed: torch.Tensor) -> None:
        routed = routed.to(torch.float64)
        self.expert_load = routed if self.expert_load is None else self.expert_load + routed

    def totals(self) -> list[float]:
        """Raw sums over the completed calls, in ``TOTAL_FIELDS`` order (summable
        over ranks): routed and retained pairs, metric total and dropped, backward
        bytes sent and dense, expert backward rows, forward routing overflow, planner
        seconds, calls."""
        done = [c for c in self.calls if c.backward_done]
        return [float(len(done)) if name == "calls" else
                float(sum(getattr(c, name) for c in done)) for name in TOTAL_FIELDS]

    def summary(self) -> dict[str, float]:
        """This rank's figures since the last reset."""
        return summarize(self.totals(), max(self.load_max_over_mean, default=0.0),
                         self.replicas)


TOTAL_FIELDS = ("routed_pairs", "retained_pairs", "metric_total", "metric_dropped",
                "backward_bytes_sent", "backward_bytes_dense", "expert_backward_rows",
                "routing_overflow", "planner_s", "budget_adjusted", "calls")


def summarize(totals: list[float], load_max_over_mean: float,
              replicas: float = 0.0) -> dict[str, float]:
    """Logged figures from ``totals`` (possibly summed over ranks)."""
    (routed, retained, metric, dropped, sent, dense, rows, overflow, planner_s, adjusted,
     calls) = totals
    return {
        "load-max-over-mean": load_max_over_mean,
        "retained-fraction": retained / routed if routed else 1.0,
        "dropped-contribution-fraction": dropped / metric if metric > 0 else 0.0,
        "backward-bytes-saved": dense - sent,
        "expert-backward-rows": rows,
        "replicas": replicas,
        "routing-overflow-pairs": overflow,
        "planner-ms-per-call": 1e3 * planner_s / calls if calls else 0.0,
        "budget-adjusted-calls": adjusted,
    }


def lrmoe_layers(model_chunks) -> list:
    """The LRMoE layers of the model chunks (the modules that keep ``LRMoELayerStats``)."""
    return [m for chunk in model_chunks for m in chunk.modules()
            if isinstance(getattr(m, "lrmoe_stats", None), LRMoELayerStats)]


def collect_lrmoe_stats(model_chunks, num_layers: int, num_experts: int) -> dict[str, float]:
    """Reduce and reset every LRMoE layer's statistics; keys ``lrmoe/...`` for logging.

    Collective: every rank must call it at the same step.
    """
    width = len(TOTAL_FIELDS)
    layers = lrmoe_layers(model_chunks)
    totals = torch.zeros(num_layers + 1, width, dtype=torch.float64)
    load = torch.zeros(num_layers + 1, dtype=torch.float64)
    replicas = torch.zeros(num_layers + 1, dtype=torch.float64)
    # Same shapes on every rank, also on pipeline stages without LRMoE layers.
    expert_load = torch.zeros(num_layers + 1, num_experts, dtype=torch.float64)
    for layer in layers:
        n = layer.layer_number or 0
        stats = layer.lrmoe_stats
        totals[n] += torch.tensor(stats.totals(), dtype=torch.float64)
        load[n] = max(stats.load_max_over_mean, default=0.0)
        replicas[n] = stats.replicas
        if stats.expert_load is not None:
            expert_load[n] += stats.expert_load
        stats.reset()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(totals)
        dist.all_reduce(load, op=dist.ReduceOp.MAX)
        dist.all_reduce(replicas, op=dist.ReduceOp.MAX)
        dist.all_reduce(expert_load)
    out: dict[str, float] = {}
    present = [n for n in range(num_layers + 1) if totals[n, 0] > 0]
    for n in present:
        for key, value in summarize(totals[n].tolist(), float(load[n]),
                                    float(replicas[n])).items():
            out[f"lrmoe/layer{n}/{key}"] = value
        # Routed pairs per expert (all ranks): a list, kept in the JSON-lines log only;
        # scripts/bench_moe_layer.py replays it as a recorded routing popularity.
        out[f"lrmoe/layer{n}/expert-load"] = [int(v) for v in expert_load[n].tolist()]
    if present:
        for key, value in summarize(totals[present].sum(0).tolist(),
                                    float(load[present].max()),
                                    float(replicas[present].sum())).items():
            out[f"lrmoe/{key}"] = value
    return out
