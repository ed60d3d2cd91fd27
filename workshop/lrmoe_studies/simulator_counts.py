"""The simulator's deterministic counts against a run's own logs: each run's recorded
routing replayed, call by call, through the simulator's planner at the run's flags, and
every logged figure that is a function of the routing alone compared exactly.

    python -m lrmoe_studies.simulator_counts RUN_DIR... [--out DIR]

Notation: R EP ranks, E experts, I expert instances (homes, then replicas), M
micro-batches per step. The replay of one MoE layer feeds the recorded [R, E] counts of
each micro-batch, in step order, to ``simulate.policy_planner`` (the planner the simulator
prices), observing each and ending each step as the layer does; the planner is built
from the run's flags as the simulator builds it (``simulator_validation.run_setting``),
on the machine constants the run's planner printed where its placement reads them
(memory-aware placement prices plans in time).

What is compared, per logged record (exact: integers equal; a logged fraction of integer
sums equal to the same float division of the replayed integers):

- Megatron's layer (``routing/layer<N>/load-max-over-mean``, every step): the most, over
  the step's micro-batches, of the pairs received per rank max/mean, from the
  simulator's dispatch of the recorded counts (static placement, Megatron's layout);
  and the pairs sent per source rank: tokens x top-k each (dropless), or, with a
  capacity factor, the recorded counts unchanged by the simulator's capacity drop;
  and at each log interval ``routing/layer<N>/instance-rows`` ([W][L], summed over the
  interval): the rows the dispatcher handed each rank's local experts, against the
  simulator's dispatch of the recorded counts after its capacity drop.
- LRMoE's layer (``lrmoe/layer<N>/...``, every LRMoE log interval, summed over ranks
  and the interval's calls): ``expert-load`` (pairs sent per expert),
  ``retained-fraction`` (kept pairs over routed), ``expert-backward-rows`` (kept rows
  received, over all instances), ``backward-bytes-saved`` (bytes of the dropped
  gradient rows less the positions sent), ``replicas`` (replicas placed),
  ``routing-overflow-pairs``, ``budget-adjusted-calls``, ``load-max-over-mean`` and its
  median (pairs received per rank, max/mean), and the same over all layers; per rank
  ([W], by global rank, summed over the interval) ``rank-sent-pairs`` and
  ``rank-kept-sent-pairs``, and ``instance-rows`` and ``instance-kept-rows`` ([W][L]:
  the rows each local instance of each rank received in forward and in backward, as
  the region's layout handed them to its all-to-alls and grouped GEMMs).

The planner settings the simulator derives are compared with the layer's own
(``integration.planner_inputs.planner_settings`` of the run's config) as well: a
difference there is a mismatch of the model, whatever the counts do.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shlex
import statistics
import sys
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np

from lrmoe_studies.simulator_validation import reference_flags, run_record, run_setting
from megatron_lrmoe.data.routing_traces import RoutingTrace, read_routing_trace
from megatron_lrmoe.planning.cost_model import CostModel
from megatron_lrmoe.planning.machine import MachineConstants
from megatron_lrmoe.planning.megatron_baseline import MegatronMoEMemory, megatron_kept_counts
from megatron_lrmoe.planning.planner import PlannerSettings
from megatron_lrmoe.planning.retention import retention_in_forward
from megatron_lrmoe.planning.shapes import MoEShape
from megatron_lrmoe.tools import run_log
from megatron_lrmoe.tools.provenance import code_version
from megatron_lrmoe.tools.simulate import (
    Policy,
    call_memory_levels,
    layer_shape,
    policy_planner,
)

__all__ = ["CallCounts", "Mismatch", "compare_run", "replay_calls", "routing_dir", "run_machine"]

# What the run's planner printed of its machine constants (step_hooks.machine_constants_line):
# 4 figures, then (runs since the exact part was added) the three exactly.
_MACHINE_LINE = re.compile(r"LRMoE planner machine constants: expert GEMM ([0-9.e+]+) GFLOP/s, "
                           r"all-to-all ([0-9.e+]+) GB/s, latency ([0-9.e+]+) us")
_MACHINE_EXACT = re.compile(r"; exact: ([0-9.e+-]+) FLOP/s, ([0-9.e+-]+) B/s, ([0-9.e+-]+) s$",
                            re.MULTILINE)
# Figures of the planner settings the layer and the simulator must agree on.
_SETTINGS = ("policy", "num_ranks", "num_experts", "capacity_factor", "min_retention",
             "slots_per_rank", "budget_bytes", "load_smoothing")


@dataclass(frozen=True)
class Mismatch:
    """One logged figure the replay does not reproduce."""

    iteration: int
    """The log record's iteration (0: the run's settings, before any step)."""
    key: str
    logged: object
    simulated: object


@dataclass(frozen=True)
class CallCounts:
    """What the replay planned for one micro-batch of one layer and EP group."""

    iteration: int
    layer: int
    micro: int
    """The micro-batch's ordinal in its step."""
    group: int
    """The EP group's index in ``RoutingTrace.ep_groups(layer)``."""
    ranks: list[int]
    """[R] the global rank of each EP rank of the group (the counts' rows)."""
    counts: np.ndarray
    """[R, E] the recorded routed counts (pairs each source rank sent to each expert)."""
    received: np.ndarray
    """[R] pairs each rank receives (the dispatch: the planner's rank load)."""
    rows_per_instance: np.ndarray
    """[I] pairs each expert instance receives."""
    kept_rows_per_instance: np.ndarray
    """[I] kept rows each expert instance receives in backward."""
    instance_rank: np.ndarray
    """[I] the EP rank holding each instance (instances rank-major)."""
    kept_per_source: np.ndarray
    """[R] pairs each source rank keeps for backward (its quotas)."""
    kept_received: np.ndarray
    """[R] kept rows each rank receives in backward."""
    replicas: int
    overflow: int
    adjusted: bool
    positions: int
    """int32 positions the sources send in backward (0 when drawn in forward)."""
    memory: np.ndarray | None
    """[R] the planner's bytes per rank of this plan (None without a cost model)."""
    saved: np.ndarray
    """[R] bytes the layer saves for backward in this call, as the simulator prices them
    (``simulate.call_memory_levels``)."""
    peak: np.ndarray
    """[R] the layer's peak bytes over this call's forward+backward, likewise."""


def run_machine(run: Path) -> MachineConstants | None:
    """The machine constants the run's planner used, as its stdout printed them: exactly
    where the line has its exact part, else to 4 significant figures (older runs: a
    choice between near-equal candidates may then replay differently); None where it
    printed none (no cost model needed them)."""
    stdout = run_log.stored(Path(run) / "stdout.txt")
    text = run_log.read_text(stdout) if stdout.is_file() else ""
    found = _MACHINE_LINE.search(text)
    if found is None:
        return None
    exact = _MACHINE_EXACT.search(text, found.end())
    if exact is not None:
        gemm, bandwidth, latency = (float(v) for v in exact.groups())
        return MachineConstants(gemm_flops_per_s=gemm, alltoall_bytes_per_s=bandwidth,
                                alltoall_latency_s=latency, source=f"{stdout} (as printed)")
    gemm, bandwidth, latency = (float(v) for v in found.groups())
    return MachineConstants(gemm_flops_per_s=gemm * 1e9, alltoall_bytes_per_s=bandwidth * 1e9,
                            alltoall_latency_s=latency * 1e-6, source=f"{stdout} (as printed)")


def routing_dir(run: Path) -> Path:
    """The run's routing record: ``routing/`` (the study runs) or ``trace/`` (the regime
    runs, benchmarks/results/ep_regime)."""
    run = Path(run)
    return next((run / d for d in ("routing", "trace") if (run / d).is_dir()), run / "routing")


@dataclass(frozen=True)
class RunReplay:
    """A run's setting as the simulator replays it."""

    shape: MoEShape
    policy: Policy
    budget_bytes: float
    cost: CostModel
    trace: RoutingTrace
    settings_mismatches: list[Mismatch]
    layer_settings: PlannerSettings | None = None
    """The planner settings the run's LRMoE layer was built with
    (``planner_inputs.planner_settings`` of the run's config, on ``cost``'s machine
    constants); None for a run of Megatron's layer."""
    lrmoe_options: dict[str, object] = dataclasses.field(default_factory=dict)
    """The run's config's LRMoE options (``options.LRMoEOptions`` fields); empty for a
    run of Megatron's layer."""


def run_replay(run: Path, flags_after: tuple[str, ...] = ()) -> RunReplay:
    """The run's shape, policy, budget and the simulator's cost model (on the run's
    machine constants where printed), and where the simulator's planner settings differ
    from the layer's. ``flags_after``: flags appended to the run's (the last of a flag
    wins), e.g. another selection rule replayed on the run's routing."""
    from megatron_lrmoe.config.flags import tokens_per_rank
    from megatron_lrmoe.integration.planner_inputs import planner_settings
    from megatron_lrmoe.launcher.arguments import parse_args
    from megatron_lrmoe.launcher.run_config import build_config
    from megatron_lrmoe.options.lrmoe import LRMoEOptions

    run = Path(run)
    trace = read_routing_trace(routing_dir(run))
    flags = [*reference_flags(run), "--mock-data", *flags_after]
    # The launcher's checks read the world size: the recorded run's.
    shape, policy, budget_gib, ep = run_setting(flags, trace.world_size)
    args = parse_args([f for f in flags if f != "--no-progress-bar"] + ["--no-progress-bar"],
                      trace.world_size)
    config = build_config(args)
    machine = run_machine(run) or MachineConstants(gemm_flops_per_s=1e12,
                                                   alltoall_bytes_per_s=1e11,
                                                   alltoall_latency_s=0.0,
                                                   source="unused: memory only")
    shape = dataclasses.replace(shape, expert_parallel_size=ep)
    modelled = layer_shape(shape, policy.runs_planner)
    if args.moe_lrmoe:      # the rows the run's rule saves (moe_shape's, not the simulator's)
        modelled = dataclasses.replace(modelled, forward_retention=shape.forward_retention,
                                       store_factor=shape.store_factor)
    cost = CostModel(modelled, machine)
    budget = 0.0 if budget_gib is None else budget_gib * 2**30   # 0: no budget
    mismatches = []
    layer, options = None, {}
    if args.moe_lrmoe:
        options = {f.name: getattr(config, f.name) for f in dataclasses.fields(LRMoEOptions)}
        layer = planner_settings(config, ep, tokens_per_rank(args), shape.microbatches_per_step,
                                 machine)
        simulated = policy_planner(policy, ep, cost, budget).settings
        for name in _SETTINGS:
            if getattr(layer, name) != getattr(simulated, name):
                mismatches.append(Mismatch(0, f"settings/{name}", getattr(layer, name),
                                           getattr(simulated, name)))
        if layer.cost is not None and layer.cost.shape != cost.shape:
            diff = {f.name: (getattr(layer.cost.shape, f.name), getattr(cost.shape, f.name))
                    for f in dataclasses.fields(MoEShape)
                    if getattr(layer.cost.shape, f.name) != getattr(cost.shape, f.name)}
            mismatches.append(Mismatch(0, "settings/cost-shape", {k: v[0] for k, v in diff.items()},
                                       {k: v[1] for k, v in diff.items()}))
    return RunReplay(shape, policy, budget, cost, trace, mismatches, layer, options)



def replay_calls(replay: RunReplay) -> list[CallCounts]:
    """Every recorded training call, layer by layer and step by step, planned as the
    layer plans it: per micro-batch and EP group ``observe`` then ``plan`` (the EP
    groups of a layer share one planner state: their pooled observations), and
    ``next_step`` at each step's end."""
    trace, shape = replay.trace, replay.shape
    # Where the run's rule draws its kept pairs in backward, the kept positions are sent
    # there (a run of Megatron's layer sends none).
    options = replay.lrmoe_options
    forward_retention = not options or retention_in_forward(options["moe_lrmoe_selection"],
                                                            options["moe_lrmoe_metric"])
    megatron = MegatronMoEMemory(replay.cost.shape, grouped=shape.grouped_gemm)
    out = []
    for number in trace.layers:
        planner = policy_planner(replay.policy, trace.ep, replay.cost, replay.budget_bytes)
        groups = trace.ep_groups(number)
        sources = trace.header["sources"][str(number)]
        for iteration, step in zip(trace.iterations.tolist(), trace.layer(number), strict=True):
            for ordinal, micro in enumerate(step):                    # [S, E]
                for index, group in enumerate(groups):
                    counts = micro[group]
                    planner.observe(counts)
                    plan = planner.plan(counts)
                    retention = plan.retention
                    quotas = retention.quotas.numpy()
                    cells = retention.counts.numpy()
                    rank_of = np.asarray(retention.instance_rank)
                    # [R, R] kept pairs source -> rank, and the ranks that drop any.
                    to_rank = np.zeros((len(group), len(group)), dtype=np.int64)
                    np.add.at(to_rank.T, rank_of, quotas.T)
                    drops = np.zeros(len(group), dtype=bool)
                    np.logical_or.at(drops, rank_of, (quotas != cells).any(0))
                    load = (plan.rank_load if plan.rank_load is not None
                            else retention.routed_per_rank.numpy())
                    saved, peak = call_memory_levels(replay.policy, replay.cost, megatron,
                                                     retention, counts, planner.placement,
                                                     ordinal == len(step) - 1)
                    out.append(CallCounts(
                        iteration=iteration, layer=number, micro=ordinal, group=index,
                        ranks=[sources[row]["rank"] for row in group], counts=counts,
                        received=np.asarray(load, dtype=np.int64),
                        rows_per_instance=retention.routed_per_instance.numpy(),
                        kept_rows_per_instance=retention.retained_per_instance.numpy(),
                        instance_rank=rank_of,
                        kept_per_source=quotas.sum(1),
                        kept_received=retention.retained_per_rank.numpy(),
                        replicas=len(planner.placement.replicas),
                        overflow=int(plan.assignment.overflow), adjusted=bool(plan.notes),
                        positions=0 if forward_retention else int(to_rank[:, drops].sum()),
                        memory=None if planner.last_memory is None
                        else planner.last_memory.copy(), saved=saved, peak=peak))
            planner.next_step()
    return out


def max_over_mean(per_rank: np.ndarray) -> float:
    """max / mean of [R] loads in float64, as the layer and the routing record compute it
    (max, then the sum over R: both exact, each division rounded once); 0 for no load."""
    per_rank = np.asarray(per_rank, dtype=np.float64)
    mean = float(per_rank.sum()) / len(per_rank)
    return float(per_rank.max()) / mean if mean > 0 else 0.0


def _megatron_step(calls: list[CallCounts], replay: RunReplay) -> dict[str, object]:
    """What a step of Megatron's layer logs and records, from the replay of its calls."""
    out: dict[str, object] = {}
    s = replay.shape
    for number in replay.trace.layers:
        mine = [c for c in calls if c.layer == number]
        out[f"routing/layer{number}/load-max-over-mean"] = max(
            max_over_mean(c.received) for c in mine)
        sent = np.stack([c.counts.sum(1) for c in mine])
        factor = replay.policy.moe_expert_capacity_factor
        if factor is None:
            # Dropless: every source sends each of its tokens to top-k experts.
            out[f"sent/layer{number}/pairs-per-source"] = sorted(set(sent.ravel().tolist()))
        else:
            kept = [megatron_kept_counts(c.counts, s.tokens_per_rank, s.topk, factor)
                    for c in mine]
            out[f"sent/layer{number}/changed-by-capacity-drop"] = int(sum(
                int((k != c.counts).sum()) for k, c in zip(kept, mine, strict=True)))
    return out


def _megatron_interval(calls: list[CallCounts], replay: RunReplay) -> dict[str, object]:
    """``routing/layer<N>/instance-rows`` of Megatron's layer over an interval's calls:
    [W][L] rows each rank's local experts received (Megatron's contiguous layout), the
    recorded counts after the simulator's capacity drop where the run drops."""
    s, world = replay.shape, replay.trace.header["parallel"]["world_size"]
    local = s.num_experts // replay.trace.ep
    factor = replay.policy.moe_expert_capacity_factor
    out: dict[str, object] = {}
    for number in replay.trace.layers:
        rows = np.zeros((world, local), dtype=np.int64)
        for c in (c for c in calls if c.layer == number):
            kept = (c.counts if factor is None else   # float64 of integers: exact
                    megatron_kept_counts(c.counts, s.tokens_per_rank, s.topk, factor))
            rows[c.ranks] += kept.sum(0).astype(np.int64).reshape(len(c.ranks), local)
        if rows.any():
            out[f"routing/layer{number}/instance-rows"] = rows.tolist()
    return out


def _per_rank(calls: list[CallCounts], world: int) -> dict[str, object]:
    """One layer's ``rank-sent-pairs``, ``rank-kept-sent-pairs`` [W] and ``instance-rows``,
    ``instance-kept-rows`` [W][L] over calls, as ``stats.LRMoELayerStats.dispatch_counts``
    sums them: instance j of a rank is its j-th instance in the call's order, L the most
    any rank held in any call."""
    sent = np.zeros(world, dtype=np.int64)
    kept = np.zeros(world, dtype=np.int64)
    width = max(int(np.bincount(c.instance_rank).max()) for c in calls)
    rows = np.zeros((2, world, width), dtype=np.int64)
    for c in calls:
        sent[c.ranks] += c.counts.sum(1)
        kept[c.ranks] += c.kept_per_source
        for ep_rank, rank in enumerate(c.ranks):
            mine = c.instance_rank == ep_rank
            rows[0, rank, :mine.sum()] += c.rows_per_instance[mine]
            rows[1, rank, :mine.sum()] += c.kept_rows_per_instance[mine]
    return {"rank-sent-pairs": sent.tolist(), "rank-kept-sent-pairs": kept.tolist(),
            "instance-rows": rows[0].tolist(), "instance-kept-rows": rows[1].tolist()}


def _lrmoe_interval(calls: list[CallCounts], replay: RunReplay) -> dict[str, object]:
    """What ``collect_lrmoe_stats`` logs of an interval's calls (its deterministic keys),
    from the replay: per layer and over all layers."""
    row_bytes = replay.shape.hidden_size * replay.shape.dtype_bytes
    ranks = replay.trace.ep
    totals: dict[int, dict[str, int]] = {}
    out: dict[str, object] = {}
    for number in replay.trace.layers:
        mine = [c for c in calls if c.layer == number]
        if not mine:
            continue
        routed = sum(int(c.counts.sum()) for c in mine)
        kept = sum(int(c.kept_per_source.sum()) for c in mine)
        loads = [max_over_mean(c.received) for c in mine]
        t = totals[number] = {
            "routed": routed, "kept": kept,
            "rows": sum(int(c.kept_received.sum()) for c in mine),
            "saved": (routed - kept) * row_bytes - 4 * sum(c.positions for c in mine),
            # Every rank of a group records its plan's overflow and notes: summed over ranks.
            "overflow": ranks * sum(c.overflow for c in mine),
            "adjusted": ranks * sum(c.adjusted for c in mine),
            "replicas": max(c.replicas for c in mine)}
        prefix = f"lrmoe/layer{number}/"
        out |= {prefix + "expert-load": np.sum([c.counts.sum(0) for c in mine], 0).tolist(),
                prefix + "retained-fraction": Fraction(kept, routed) if routed else Fraction(1),
                prefix + "expert-backward-rows": t["rows"],
                prefix + "backward-bytes-saved": t["saved"], prefix + "replicas": t["replicas"],
                prefix + "routing-overflow-pairs": t["overflow"],
                prefix + "budget-adjusted-calls": t["adjusted"],
                prefix + "load-max-over-mean": max(loads),
                prefix + "load-max-over-mean-median": statistics.median(loads),
                **{prefix + k: v for k, v in _per_rank(
                    mine, replay.trace.header["parallel"]["world_size"]).items()}}
    if totals:
        routed = sum(t["routed"] for t in totals.values())
        kept = sum(t["kept"] for t in totals.values())
        out |= {"lrmoe/retained-fraction": Fraction(kept, routed) if routed else Fraction(1),
                **{f"lrmoe/{key}": sum(t[name] for t in totals.values()) for key, name in (
                    ("expert-backward-rows", "rows"), ("backward-bytes-saved", "saved"),
                    ("replicas", "replicas"), ("routing-overflow-pairs", "overflow"),
                    ("budget-adjusted-calls", "adjusted"))},
                "lrmoe/load-max-over-mean": max(out[f"lrmoe/layer{n}/load-max-over-mean"]
                                                for n in totals),
                "lrmoe/load-max-over-mean-median": max(
                    out[f"lrmoe/layer{n}/load-max-over-mean-median"] for n in totals)}
    return out


def _equal(logged: object, simulated: object) -> bool:
    """Exact: a fraction against the logged float is the float division of its integers
    (both sums are exact in float64 below 2**53); lists element by element."""
    if isinstance(simulated, Fraction):
        return logged == simulated.numerator / simulated.denominator
    if isinstance(simulated, list):
        return (isinstance(logged, list) and len(logged) == len(simulated)
                and all(_equal(a, b) for a, b in zip(logged, simulated, strict=True)))
    return logged == simulated


def _instance_rows_equal(logged: object, simulated: list[list[int]]) -> bool:
    """[W][L] rows per local instance, exact, where the widths may differ: the log pads
    every layer to the widest layer's L (one tensor for all layers,
    ``stats._dispatch_per_rank``), the replay sizes each layer by its own; a column past
    the other's width must be all zeros."""
    if not (isinstance(logged, list) and len(logged) == len(simulated)):
        return False
    for got, want in zip(logged, simulated, strict=True):
        width = max(len(got), len(want))
        if [*got, *[0] * (width - len(got))] != [*want, *[0] * (width - len(want))]:
            return False
    return True


def compare_run(run: Path, records: list[dict] | None = None) -> dict:
    """The run's replay against its log (``records``: the log's records, default read
    from ``run``): the keys compared, how many values, and the mismatches."""
    run = Path(run)
    replay = run_replay(run)
    records = run_log.read_records(run / "log.jsonl") if records is None else records
    calls = replay_calls(replay)
    by_iteration: dict[int, list[CallCounts]] = {}
    for c in calls:
        by_iteration.setdefault(c.iteration, []).append(c)
    mismatches = list(replay.settings_mismatches)
    compared: dict[str, int] = {}
    not_logged: set[str] = set()
    lrmoe = replay.policy.runs_planner
    start = 0            # the last iteration before the current log interval
    for record in records:
        iteration = record["iteration"]
        if not lrmoe and any(k.endswith("/instance-rows") for k in record):
            window = [c for i in range(start + 1, iteration + 1)
                      for c in by_iteration.get(i, [])]
            start = iteration
            record_rows = _megatron_interval(window, replay)
        else:
            record_rows = {}
        if lrmoe:
            if "lrmoe/retained-fraction" not in record:
                continue
            window = [c for i in range(start + 1, iteration + 1)
                      for c in by_iteration.get(i, [])]
            start = iteration
            expected = _lrmoe_interval(window, replay)
        else:
            expected = _megatron_step(by_iteration.get(iteration, []), replay)
            tokens = replay.trace.header["parallel"]["tokens_per_source"] * replay.shape.topk
            for key in [k for k in expected if k.endswith("/pairs-per-source")]:
                record = {**record, key: [tokens]}
            for key in [k for k in expected if k.endswith("/changed-by-capacity-drop")]:
                record = {**record, key: 0}
            expected |= record_rows
        for key, value in expected.items():
            family = re.sub(r"layer\d+/", "layer<N>/", key)
            if key not in record:        # a figure this run's code did not log
                not_logged.add(family)
                continue
            compared[family] = compared.get(family, 0) + 1
            logged = record[key]
            same = (_instance_rows_equal(logged, value) if key.endswith("instance-rows")
                    or key.endswith("instance-kept-rows") else _equal(logged, value))
            if not same:
                mismatches.append(Mismatch(iteration, key, logged, _plain(value)))
    if not lrmoe and not any(k.endswith("/instance-rows") for r in records for k in r):
        not_logged.add("routing/layer<N>/instance-rows")
    memory = [c.memory for c in calls if c.memory is not None]
    return {"run": str(run), "policy": replay.policy.name,
            "placement": replay.policy.placement, "ep": replay.trace.ep,
            "steps": len(replay.trace.iterations), "layers": replay.trace.layers,
            "calls": len(calls), "compared": compared,
            "not_logged": sorted(not_logged - set(compared)),
            "machine": replay.cost.machine.source,
            "memory_mib_max": (float(np.max(memory)) / 2**20 if memory else None),
            "mismatches": [dataclasses.asdict(m) | {"simulated": _plain(m.simulated),
                                                    "logged": _plain(m.logged)}
                           for m in mismatches]}


def _plain(value: object) -> object:
    """JSON-friendly: a fraction as its float and its integers."""
    if isinstance(value, Fraction):
        return {"float": value.numerator / value.denominator,
                "fraction": f"{value.numerator}/{value.denominator}"}
    if isinstance(value, np.generic):
        return value.item()
    return value


NOT_LOGGED = (
    "Runs whose code logged no per-rank figures (the key families a run lacks are listed "
    "per run) are compared on their sums and maxima over ranks only. Memory is not in the "
    "runs' logs (on CPU there is no allocator peak; memory-predicted-peak-gib of a held "
    "run is the launcher's model, not a measurement): the simulator's per-rank memory is "
    "compared with the layer benchmark's measurement separately.")


def report_lines(results: list[dict]) -> list[str]:
    """One row per run, then the mismatches (the first 20 of each run)."""
    lines = ["| run | policy | placement | EP | steps | calls | values compared | mismatches |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['run']} | {r['policy']} | {r['placement']} | {r['ep']} | "
                     f"{r['steps']} | {r['calls']} | {sum(r['compared'].values())} | "
                     f"{len(r['mismatches'])} |")
    for r in results:
        lines += ["", f"{r['run']}: compared " + ", ".join(
            f"{k} x{n}" for k, n in sorted(r["compared"].items()))]
        for m in r["mismatches"][:20]:
            lines.append(f"- iteration {m['iteration']}, {m['key']}: logged {m['logged']}, "
                         f"simulated {m['simulated']}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lrmoe_studies.simulator_counts",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("runs", type=Path, nargs="+", metavar="RUN_DIR",
                    help="finished runs with a routing record (routing/) and a log")
    ap.add_argument("--out", type=Path, default=None,
                    help="directory for report.md and report.json")
    args = ap.parse_args(argv)
    results = []
    for run in args.runs:
        if not run_record(run).is_file():
            raise SystemExit(f"{run}: no {run_record(run).name}; not a finished run")
        results.append(compare_run(run))
    lines = report_lines(results)
    print("\n".join(lines))
    if args.out:
        command = " ".join(shlex.quote(a) for a in ["python", "-m",
                                                      "lrmoe_studies.simulator_counts",
                                                      *(sys.argv[1:] if argv is None else argv)])
        code = code_version()
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "report.json").write_text(json.dumps(
            {"command": command, "code": code, "runs": results}, indent=1, default=_plain))
        (args.out / "report.md").write_text("\n".join([
            "# The simulator's deterministic counts against the runs' logs", "",
            f"- command: `{command}`", f"- code: {code}",
            "- what is compared: workshop/lrmoe_studies/simulator_counts.py's docstring", "",
            *lines, "", NOT_LOGGED, ""]))
        print(f"written to {args.out}/report.md and report.json")
    return 1 if any(r["mismatches"] for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
