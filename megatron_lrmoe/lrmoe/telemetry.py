"""Per-layer LRMoE statistics, reduced over all ranks for the launcher's logs.

Each LRMoELayer records what its region calls did (``LRMoELayerStats``); at a log
interval every rank contributes its raw sums per global layer number, one
all_reduce adds them up (pairs and bytes add over data-, tensor- and
expert-parallel ranks, each of which routes its own tokens) and one takes the
maximum routed-load imbalance. Host syncs happen here, off the training path.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_lrmoe.lrmoe.moe_layer import TOTAL_FIELDS, LRMoELayer, summarize


def lrmoe_layers(model_chunks) -> list[LRMoELayer]:
    return [m for chunk in model_chunks for m in chunk.modules() if isinstance(m, LRMoELayer)]


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
