"""Planner speed: the host's planning per layer call, and per layer and step the step boundary's
``next_step`` and the placement choice it defers, one CPU core.

    .venv/bin/python benchmarks/bench_planner.py                       # EP 8, 16, 64
    .venv/bin/python benchmarks/bench_planner.py --repeats 300 \
        --out benchmarks/results/bench_planner.md

What is timed, per layer call ("call"): the host's work between the counts read and the
first dispatch all-to-all on one EP rank (rank 0), everything computed from the gathered
[R, E] counts to the tables the device ops use, run by the layer's own code
(``LRMoELayer._plan_micro_batch`` and ``_count_training_call`` on a stand-in for the
layer): ``observe`` (a training call), ``LayerPlanner.plan``, the region's ``CallLayout``
(split sizes and the packed index tables), this source's instance-order chunk tables, and
the call's host statistics. Not timed: the copies of the tables to the device and their
expansion there (device work). ``plan`` alone is timed too.

Paths: ``python`` is ``LayerPlanner(native=False)``, the Python planner (the reference),
``compiled`` the compiled one (``planning/native.py``); the layer code is the same.

Every tensor op the call dispatches (counted with a ``TorchDispatchMode``) is charged
``--op-us`` microseconds on top of its measured time: on a GPU host each is a dispatch
the CPU pays, so moving the work into many small tensor ops is not free. Per layer and
step: ``next_step`` (the step boundary: the step's loads folded into the smoothed ones)
and the choice of the next placement, which ``next_step`` defers to the first read of
``LayerPlanner.placement``, the layer's entry in its first forward of the next step
(before its counts read, while the device runs the work queued since the previous
layer's read), each timed on its own.

Goals: call <= 0.1 ms at EP 8 and 16, <= 0.2 ms at EP 64; ``next_step`` <= 0.5 ms at
EP 64, or its work done while the next step's first forward runs (medians). Every path
listed in ``--paths`` is measured in the same run, side by side, on the same count
matrices and placements.

Shape: Qwen3-30B-A3B's experts (H=2048, F=768, SwiGLU, bf16, E=128, top-8, 4096 tokens
per rank, 48 MoE layers, 8 micro-batches per step) with grouped GEMMs and the default
uniform retention (retained set drawn in forward), EP size R. Counts: each source rank
routes tokens * top-k pairs, expert popularity Zipf(s) over a random permutation of the
experts, multinomial draws per rank, ``--batches`` matrices cycled. Budget: each layer
gets the balanced dropless need plus ``--budget-replicas`` replicas' worth. Machine
constants: ``default_machine_constants('cpu')`` (they set the planner's choices, hardly
its speed). Timing: ``time.perf_counter`` around each call, ``torch.set_num_threads(1)``,
medians over ``--repeats`` calls after warm-up.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_lrmoe.layer.moe_layer import LRMoELayer
from megatron_lrmoe.layer.region import RegionStats
from megatron_lrmoe.layer.stats import LRMoELayerStats
from megatron_lrmoe.planning.cost_model import CostModel
from megatron_lrmoe.planning.machine import default_machine_constants
from megatron_lrmoe.planning.planner import LayerPlanner, PlannerSettings
from megatron_lrmoe.planning.retention import retention_in_forward
from megatron_lrmoe.planning.shapes import MoEShape
from megatron_lrmoe.tools.provenance import code_version

RANK = 0


def skewed_counts(num_ranks: int, num_experts: int, pairs: int, zipf: float,
                  gen: torch.Generator, perm: torch.Tensor) -> torch.Tensor:
    popularity = (1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64) ** zipf)[perm]
    draws = torch.multinomial(popularity.float().expand(num_ranks, -1), pairs,
                              replacement=True, generator=gen)
    return torch.stack([torch.bincount(d, minlength=num_experts) for d in draws])


class _OpCounter(TorchDispatchMode):
    """Counts the tensor ops dispatched inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


class _LayerStandIn:
    """What ``LRMoELayer._plan_micro_batch`` and ``_count_training_call`` read of the layer
    on rank ``RANK``: the layer's own code runs on it, without a model around it."""

    def __init__(self, planner: LayerPlanner) -> None:
        self.counts_exchange = SimpleNamespace(ep_rank=RANK)
        self.placement_planner = planner
        self.lrmoe_stats = LRMoELayerStats()
        self.lrmoe_state = SimpleNamespace(count_training_forward=lambda: None)
        self.last_plan = None

    def _log_notes(self, notes: tuple[str, ...]) -> None:
        pass


def layer_call(layer: _LayerStandIn, planner: LayerPlanner, counts: torch.Tensor) -> None:
    """The layer's host steps of one training call on rank ``RANK`` (module docstring)."""
    host = counts.numpy()                 # as LRMoELayer.routed_output reads them
    mb, _layout, order, _ = LRMoELayer._plan_micro_batch(layer, planner, host, True)
    if order is not None:              # the host tables _pairs_in_send_order sends
        torch.from_numpy(order)
    LRMoELayer._count_training_call(layer, SimpleNamespace(stats=RegionStats()), mb, host)
    if len(layer.lrmoe_stats.calls) > 1000:
        layer.lrmoe_stats.reset()


PLANNERS: dict[str, Callable[[PlannerSettings], LayerPlanner]] = {
    "python": lambda settings: LayerPlanner(settings, native=False),
    "compiled": lambda settings: LayerPlanner(settings, native=True),
}


def timed(fn: Callable[[int], object], repeats: int, warmup: int = 5) -> list[float]:
    """Seconds of fn(i) for i in range(repeats), after ``warmup`` calls."""
    for i in range(warmup):
        fn(i)
    times = []
    for i in range(repeats):
        start = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - start)
    return times


def measure(path: str, ranks: int, args, machine, batches_of) -> dict:
    shape = MoEShape(2048, 768, args.experts, args.topk, gated=True, dtype_bytes=2,
                     tokens_per_rank=args.tokens, num_layers=48, microbatches_in_flight=1,
                     microbatches_per_step=8, expert_parallel_size=ranks, grouped_gemm=True,
                     forward_retention=retention_in_forward("uniform", "grad_act"))
    cost = CostModel(shape, machine)
    per_layer = cost.balanced_dropless_need() / shape.num_layers
    budget = (per_layer + args.budget_replicas * shape.instance_bytes) * shape.num_layers
    settings = PlannerSettings(args.policy, ranks, args.experts, capacity_factor=args.gamma,
                               budget_bytes=budget, cost=cost)
    batches = batches_of(ranks)
    planner = PLANNERS[path](settings)
    for counts in batches[:2]:
        planner.observe(counts)
    planner.next_step()

    # next_step and the deferred choice are timed alone: observe runs between them.
    step_times, choice_times, choice_cpu = [], [], []
    for i in range(args.step_repeats + 3):
        planner.observe(batches[i % len(batches)])
        start = time.perf_counter()
        planner.next_step()
        boundary = time.perf_counter()
        cpu = time.process_time()
        planner.placement          # noqa: B018  (the read that chooses, as the layer's entry)
        if i >= 3:
            choice_times.append(time.perf_counter() - boundary)
            choice_cpu.append(time.process_time() - cpu)
            step_times.append(boundary - start)
    # Fix the placement for the per-call timings: the one the planner chose on the
    # batches' smoothed loads.
    placement = planner.placement
    layer = _LayerStandIn(planner)

    def call(planner: LayerPlanner, counts: torch.Tensor) -> None:
        layer_call(layer, planner, counts)

    ops = []
    for counts in batches:
        with _OpCounter() as counter:
            call(planner, counts)
        ops.append(counter.ops)
        planner.replace_observations(None, 0)
    call_times = timed(lambda i: call(planner, batches[i % len(batches)]), args.repeats)
    planner.replace_observations(None, 0)
    charged = [t + args.op_us * 1e-6 * ops[i % len(batches)] for i, t in enumerate(call_times)]
    plan_times = timed(lambda i: planner.plan(batches[i % len(batches)]), args.repeats)
    mb = planner.plan(batches[0])
    return {
        "path": path, "ranks": ranks, "replicas": len(placement.replicas),
        "call_ms": statistics.median(charged) * 1e3,
        "call_p90": sorted(charged)[int(0.9 * (len(charged) - 1))] * 1e3,
        "host_ms": statistics.median(call_times) * 1e3,
        "ops": statistics.median(ops),
        "plan_ms": statistics.median(plan_times) * 1e3,
        "step_ms": statistics.median(step_times) * 1e3,
        "choice_ms": statistics.median(choice_times) * 1e3,
        "choice_cpu_ms": statistics.median(choice_cpu) * 1e3,
        "notes": "; ".join(mb.notes) or "-",
    }


GOALS = {"call": lambda r: 0.2 if r >= 64 else 0.1, "step": lambda r: 0.5 if r >= 64 else None,
         "choice": lambda r: 2.0 if r >= 64 else (1.0 if r >= 16 else None)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 64])
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--zipf", type=float, default=1.0)
    p.add_argument("--policy", default="memory-aware",
                   choices=("static", "popularity", "memory-aware"))
    p.add_argument("--budget-replicas", type=float, default=3.0,
                   help="replicas' worth of memory per rank per layer above the need")
    p.add_argument("--gamma", type=float, default=1.0, help="LRMoE capacity factor")
    p.add_argument("--repeats", type=int, default=300, help="timed layer calls (>= 200)")
    p.add_argument("--step-repeats", type=int, default=30,
                   help="timed next_step calls and placement choices")
    p.add_argument("--batches", type=int, default=8, help="distinct count matrices")
    p.add_argument("--op-us", type=float, default=5.0,
                   help="microseconds charged per dispatched tensor op")
    p.add_argument("--paths", nargs="+", default=list(PLANNERS), choices=list(PLANNERS))
    p.add_argument("--note", default="", help="a line on the machine's state, for the results")
    p.add_argument("--out", default=None, help="markdown file for the results")
    args = p.parse_args()
    torch.set_num_threads(1)

    machine = default_machine_constants("cpu")
    cache: dict[int, list[torch.Tensor]] = {}

    def batches_of(ranks: int) -> list[torch.Tensor]:
        if ranks not in cache:
            gen = torch.Generator().manual_seed(ranks)
            perm = torch.randperm(args.experts, generator=gen)
            cache[ranks] = [skewed_counts(ranks, args.experts, args.tokens * args.topk,
                                          args.zipf, gen, perm) for _ in range(args.batches)]
        return cache[ranks]

    rows = [measure(path, ranks, args, machine, batches_of)
            for ranks in args.ranks for path in args.paths]

    def verdict(value: float, goal: float | None) -> str:
        return "-" if goal is None else ("met" if value <= goal else "not met")

    header = ("| EP | path | replicas | call ms (median, incl. ops) | call p90 | host ms "
              "| tensor ops | plan ms | next_step ms | choice ms (first forward) | choice CPU ms "
              "| call goal | next_step goal | choice goal | notes |")
    lines = [header, "|" + "---|" * 15]
    for r in rows:
        call_goal, step_goal = GOALS["call"](r["ranks"]), GOALS["step"](r["ranks"])
        choice_goal = GOALS["choice"](r["ranks"])
        lines.append(
            f"| {r['ranks']} | {r['path']} | {r['replicas']} | {r['call_ms']:.3f} | "
            f"{r['call_p90']:.3f} | {r['host_ms']:.3f} | {r['ops']:g} | {r['plan_ms']:.3f} | "
            f"{r['step_ms']:.3f} | {r['choice_ms']:.3f} | {r['choice_cpu_ms']:.3f} | "
            f"{call_goal:g}: {verdict(r['call_ms'], call_goal)} | "
            f"{'-' if step_goal is None else f'{step_goal:g}: ' + verdict(r['step_ms'], step_goal)}"
            f" | {'-' if choice_goal is None else f'{choice_goal:g}: '}"
            f"{'' if choice_goal is None else verdict(r['choice_ms'], choice_goal)}"
            f" | {r['notes']} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        command = " ".join(shlex.quote(a) for a in [".venv/bin/python", *sys.argv])
        budget_text = (f"per layer the balanced dropless need + {args.budget_replicas:g} "
                       f"replica(s)")
        text = "\n".join([
            "# Planner speed: host planning per layer call; next_step and the placement "
            "choice per layer",
            "",
            f"- command: `{command}`",
            f"- date: {datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')}",
            f"- machine: {platform.processor() or platform.machine()}, 1 thread "
            f"(torch.set_num_threads(1)), torch {torch.__version__}, python "
            f"{platform.python_version()}; code: {code_version()}",
            *([f"- machine state: {args.note}"] if args.note else []),
            f"- counts: R ranks x {args.experts} experts, {args.tokens} tokens per rank, "
            f"top-{args.topk}, Zipf({args.zipf:g}) popularity, {args.batches} matrices "
            f"cycled; policy {args.policy}, gamma {args.gamma:g}, uniform retention",
            f"- cost model: H=2048 F=768 SwiGLU bf16, grouped GEMMs, 48 layers, 8 micro-batches "
            f"per step, EP size R; machine: {machine.source}",
            f"- budget: {budget_text}",
            f"- call = the host's work from the gathered counts to the first dispatch "
            f"all-to-all on rank {RANK} (observe, plan, the layer's pair order tables, "
            f"CallLayout, call statistics), + {args.op_us:g} us per dispatched tensor op "
            f"(tensor ops column); median of {args.repeats} calls; plan = "
            f"LayerPlanner.plan alone; next_step (the boundary's fold) and the placement "
            f"choice it defers (the first read of LayerPlanner.placement, at the layer's "
            f"entry in the next step's first forward): medians of {args.step_repeats} (the "
            f"choice also in this process's CPU time, which other jobs disturb less)",
            "- goals: call <= 0.1 ms at EP 8 and 16, <= 0.2 ms at EP 64; next_step <= 0.5 ms "
            "at EP 64, or its work done while the next step's first forward runs; the "
            "placement choice <= 1 ms at EP 16, <= 2 ms at EP 64",
            "",
            table,
            "",
        ])
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
        print(f"written to {args.out}")


if __name__ == "__main__":
    main()
