"""Per-layer LRMoE statistics, reduced over all ranks for the launcher's logs.

Each LRMoELayer records what its region calls did (``LRMoELayerStats``); at a log
interval every rank contributes its raw sums per global layer number, one
all_reduce adds them up (pairs and bytes add over data-, context-, tensor- and
expert-parallel ranks, each of which routes its own tokens) and one takes the
maximum routed-load imbalance. Host syncs happen here, off the training path: the
counts are host numbers from the plans, and the metric sums, which live on the
device, are read once per collection for all layers together.

When the selection rule does not read the metric (``uniform``), the region computes
it only on measured calls: the first step's micro-batches after each collection, i.e.
the first step of each log interval. ``dropped-contribution-fraction`` is then the
figure of those steps, and ``metric-measured-calls`` says how many calls it covers.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from megatron_lrmoe.layer.region import RegionStats

__all__ = ["TOTAL_FIELDS", "LRMoELayerStats", "collect_lrmoe_stats", "format_lrmoe_stats",
           "lrmoe_layers", "summarize"]


@dataclass
class LRMoELayerStats:
    """Region statistics of one layer since the last ``reset()`` (host numbers)."""

    calls: list[RegionStats] = field(default_factory=list)
    load_max_over_mean: list[float] = field(default_factory=list)
    replicas: int = 0                        # most replicas of any step since the reset
    # [E] float64 pairs this rank routed to each expert, summed in numpy: a layer call
    # then pays no tensor op for it (``expert_load`` is the tensor view).
    _load: np.ndarray | None = None

    @property
    def expert_load(self) -> torch.Tensor | None:
        """[E] float64 pairs this rank routed to each expert since the reset."""
        return None if self._load is None else torch.from_numpy(self._load)

    def reset(self) -> None:
        self.calls.clear()
        self.load_max_over_mean.clear()
        self._load = None
        self.replicas = 0

    def mark(self) -> tuple[int, int, torch.Tensor | None, int]:
        """Where the records stand now, for ``rewind`` (a re-run step's undo)."""
        load = None if self._load is None else torch.from_numpy(self._load.copy())
        return len(self.calls), len(self.load_max_over_mean), load, self.replicas

    def rewind(self, mark: tuple[int, int, torch.Tensor | None, int]) -> None:
        """Forget what was recorded since ``mark()`` returned ``mark``."""
        calls, loads, expert_load, replicas = mark
        del self.calls[calls:]
        del self.load_max_over_mean[loads:]
        self._load = None if expert_load is None else expert_load.numpy().copy()
        self.replicas = replicas

    def add_expert_load(self, routed: np.ndarray | torch.Tensor) -> None:
        """Add [E] pairs this rank routed to each expert (host values): in numpy, so a
        layer call pays no tensor op for it."""
        routed = np.asarray(routed, dtype=np.float64)
        self._load = routed.copy() if self._load is None else self._load + routed

    def metric_sums(self) -> torch.Tensor | None:
        """[3] on the device: (total metric, dropped metric, measured calls) over the
        completed calls that computed the metric; None if none did. No host read."""
        sums = [c.metric_sums for c in self.calls if c.backward_done and c.metric_sums is not None]
        if not sums:
            return None
        total = torch.stack(sums).sum(0)
        return torch.cat([total, total.new_tensor([float(len(sums))])])

    def totals(self, metric: list[float] | None = None) -> list[float]:
        """Raw sums over the completed calls, in ``TOTAL_FIELDS`` order (summable
        over ranks): routed and retained pairs, metric total and dropped, backward
        bytes sent and dense, expert backward rows, forward routing overflow, planner
        seconds, calls, calls that measured the metric.

        ``metric``: ``metric_sums()`` already read on the host (collectors read every
        layer's in one go); None reads this layer's here (one host read)."""
        done = [c for c in self.calls if c.backward_done]
        if metric is None:
            sums = self.metric_sums()
            metric = [0.0, 0.0, 0.0] if sums is None else sums.tolist()  # host read
        host = dict(zip(("metric_total", "metric_dropped", "metric_calls"), metric,
                        strict=True))
        return [float(len(done)) if name == "calls" else host[name] if name in host else
                float(sum(getattr(c, name) for c in done)) for name in TOTAL_FIELDS]

    def dispatch_counts(self) -> tuple[list[int], np.ndarray]:
        """This rank's dispatch since the reset, over the completed calls: [2] (pairs it
        sent, kept pairs it sent) and [2, L] (rows each of its expert instances received in
        forward, kept rows in backward; instance j is the call's j-th local instance, its
        homes then its replicas; L the most local instances of any call)."""
        done = [c for c in self.calls if c.backward_done]
        width = max((len(c.rows_per_instance) for c in done), default=0)
        rows = np.zeros((2, width), dtype=np.int64)
        for c in done:
            rows[0, :len(c.rows_per_instance)] += c.rows_per_instance
            rows[1, :len(c.kept_rows_per_instance)] += c.kept_rows_per_instance
        return [sum(c.routed_pairs for c in done), sum(c.retained_pairs for c in done)], rows

    def load_median(self) -> float:
        """Median over the calls since the reset of their routed load max/mean over EP
        ranks (0 without calls): the typical call, where the maximum shows the worst."""
        return statistics.median(self.load_max_over_mean) if self.load_max_over_mean else 0.0

    def summary(self) -> dict[str, float]:
        """This rank's figures since the last reset."""
        return summarize(self.totals(), max(self.load_max_over_mean, default=0.0),
                         self.replicas, self.load_median())


TOTAL_FIELDS = ("routed_pairs", "retained_pairs", "metric_total", "metric_dropped",
                "backward_bytes_sent", "backward_bytes_dense", "expert_backward_rows",
                "routing_overflow", "planner_s", "budget_adjusted", "calls", "metric_calls")


def _read_metric_sums(layers) -> list[list[float] | None]:
    """Every layer's ``metric_sums()`` on the host, with one device read for all."""
    sums = [layer.lrmoe_stats.metric_sums() for layer in layers]
    present = [s for s in sums if s is not None]
    if not present:
        return [[0.0, 0.0, 0.0]] * len(sums)
    host = iter(torch.stack([s.to(present[0].device) for s in present]).tolist())  # host read
    return [next(host) if s is not None else [0.0, 0.0, 0.0] for s in sums]


def summarize(totals: list[float], load_max_over_mean: float,
              replicas: float = 0.0, load_median: float = 0.0) -> dict[str, float]:
    """Logged figures from ``totals`` (possibly summed over ranks); the loads: the worst
    call's max/mean and the median call's."""
    (routed, retained, metric, dropped, sent, dense, rows, overflow, planner_s, adjusted,
     calls, metric_calls) = totals
    return {
        "load-max-over-mean": load_max_over_mean,
        "load-max-over-mean-median": load_median,
        "retained-fraction": retained / routed if routed else 1.0,
        # Over the calls that measured the metric (all of them when the rule reads it).
        "dropped-contribution-fraction": dropped / metric if metric > 0 else 0.0,
        "metric-measured-calls": metric_calls,
        "backward-bytes-saved": dense - sent,
        "expert-backward-rows": rows,
        "replicas": replicas,
        "routing-overflow-pairs": overflow,
        # To the microsecond, as the launcher logs its timings.
        "planner-ms-per-call": round(1e3 * planner_s / calls, 3) if calls else 0.0,
        "budget-adjusted-calls": adjusted,
    }


def lrmoe_layers(model_chunks: Iterable[torch.nn.Module]) -> list[torch.nn.Module]:
    """The LRMoE layers of the model chunks, in chunk then module order (the same on
    every rank of a pipeline stage, which the pooled all-reduces of the step state and
    of these statistics rely on). An LRMoE layer is a module that keeps
    ``LRMoELayerStats`` (``LRMoELayer`` does, and only it; matched by that attribute
    because ``moe_layer`` imports this module). The one definition:
    ``megatron_lrmoe.integration.step_hooks`` re-exports it."""
    return [m for chunk in model_chunks for m in chunk.modules()
            if isinstance(getattr(m, "lrmoe_stats", None), LRMoELayerStats)]


def format_lrmoe_stats(stats: Mapping[str, float]) -> str:
    """The words of the LRMoE log line, from ``collect_lrmoe_stats``' figures: both entry
    points print them after their own iteration prefix (the lean launcher's
    ``lrmoe_log_line``, Megatron-LM's ``megatron_lm.format_lrmoe_line``)."""
    return (f"retained {stats['lrmoe/retained-fraction']:.3f}"
            f" | dropped contribution {stats['lrmoe/dropped-contribution-fraction']:.3f}"
            f" | backward bytes saved {stats['lrmoe/backward-bytes-saved'] / 2**20:.2f} MiB"
            f" | routed load max/mean {stats['lrmoe/load-max-over-mean']:.2f}")


def _collective_device() -> torch.device:
    """Where this process group's collectives take tensors: NCCL's only device tensors."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _dispatch_per_rank(layers, num_layers: int) -> dict[str, list]:
    """Every layer's dispatch counts per global rank (``LRMoELayerStats.dispatch_counts``),
    summed over the interval's calls: ``lrmoe/layer<N>/rank-sent-pairs`` and
    ``rank-kept-sent-pairs`` [W], ``instance-rows`` and ``instance-kept-rows`` [W][L]
    (L: the most local instances of any layer's call, fewer zero-padded).
    What the region handed its all-to-alls, for the simulator's exact per-rank
    comparison (``lrmoe_studies.simulator_counts``). Collective."""
    counts = {layer.layer_number or 0: layer.lrmoe_stats.dispatch_counts() for layer in layers}
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    device = _collective_device()
    width = torch.tensor([max((rows.shape[1] for _, rows in counts.values()), default=0)],
                         device=device)
    if world > 1:
        dist.all_reduce(width, op=dist.ReduceOp.MAX)
    width = int(width.item())                     # host read: off the training path
    pairs = torch.zeros(num_layers + 1, world, 2, dtype=torch.int64)
    rows = torch.zeros(num_layers + 1, world, 2, width, dtype=torch.int64)
    for n, (sent, layer_rows) in counts.items():
        pairs[n, rank] += torch.tensor(sent)
        rows[n, rank, :, :layer_rows.shape[1]] += torch.from_numpy(layer_rows)
    if world > 1:                                 # each rank fills its own row: a gather
        pairs, rows = pairs.to(device), rows.to(device)
        dist.all_reduce(pairs)
        dist.all_reduce(rows)
    pairs, rows = pairs.cpu(), rows.cpu()
    out: dict[str, list] = {}
    for n in range(num_layers + 1):
        if pairs[n].any():
            prefix = f"lrmoe/layer{n}/"
            out[prefix + "rank-sent-pairs"] = pairs[n, :, 0].tolist()
            out[prefix + "rank-kept-sent-pairs"] = pairs[n, :, 1].tolist()
            out[prefix + "instance-rows"] = rows[n, :, 0].tolist()
            out[prefix + "instance-kept-rows"] = rows[n, :, 1].tolist()
    return out


def collect_lrmoe_stats(model_chunks, num_layers: int, num_experts: int) -> dict[str, float]:
    """Reduce and reset every LRMoE layer's statistics; keys ``lrmoe/...`` for logging.

    Collective: every rank must call it at the same step.
    """
    width = len(TOTAL_FIELDS)
    layers = lrmoe_layers(model_chunks)
    dispatch = _dispatch_per_rank(layers, num_layers)
    totals = torch.zeros(num_layers + 1, width, dtype=torch.float64)
    load = torch.zeros(num_layers + 1, dtype=torch.float64)
    median = torch.zeros(num_layers + 1, dtype=torch.float64)
    replicas = torch.zeros(num_layers + 1, dtype=torch.float64)
    # Same shapes on every rank, also on pipeline stages without LRMoE layers.
    expert_load = torch.zeros(num_layers + 1, num_experts, dtype=torch.float64)
    for layer, metric in zip(layers, _read_metric_sums(layers), strict=True):
        n = layer.layer_number or 0
        stats = layer.lrmoe_stats
        totals[n] += torch.tensor(stats.totals(metric), dtype=torch.float64)
        load[n] = max(stats.load_max_over_mean, default=0.0)
        median[n] = stats.load_median()
        replicas[n] = stats.replicas
        if stats.expert_load is not None:
            expert_load[n] += stats.expert_load
        stats.reset()
    if dist.is_initialized() and dist.get_world_size() > 1:
        device = _collective_device()
        totals, load, median, replicas, expert_load = (
            t.to(device) for t in (totals, load, median, replicas, expert_load))
        dist.all_reduce(totals)
        dist.all_reduce(load, op=dist.ReduceOp.MAX)
        dist.all_reduce(median, op=dist.ReduceOp.MAX)
        dist.all_reduce(replicas, op=dist.ReduceOp.MAX)
        dist.all_reduce(expert_load)
        totals, load, median, replicas, expert_load = (
            t.cpu() for t in (totals, load, median, replicas, expert_load))
    out: dict[str, float] = {}
    present = [n for n in range(num_layers + 1) if totals[n, 0] > 0]
    for n in present:
        for key, value in summarize(totals[n].tolist(), float(load[n]),
                                    float(replicas[n]), float(median[n])).items():
            out[f"lrmoe/layer{n}/{key}"] = value
        # Routed pairs per expert (all ranks): a list, kept in the JSON-lines log only;
        # benchmarks/bench_moe_layer.py replays it as a recorded routing popularity.
        out[f"lrmoe/layer{n}/expert-load"] = [int(v) for v in expert_load[n].tolist()]
    if present:
        for key, value in summarize(totals[present].sum(0).tolist(),
                                    float(load[present].max()),
                                    float(replicas[present].sum()),
                                    float(median[present].max())).items():
            out[f"lrmoe/{key}"] = value
    return out | dispatch
