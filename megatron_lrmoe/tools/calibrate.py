"""Measure this machine's expert GEMM rate, memory rate, all-to-all bandwidth and the
fixed cost of a layer call for the planner's cost model.

    python -m megatron_lrmoe.tools.calibrate --output calibration.json \\
        --hidden-size 2048 --ffn-hidden-size 768 --dtype bf16 --device cuda
    torchrun --nproc-per-node 8 -m megatron_lrmoe.tools.calibrate --device cuda --output cal.json

The planner's cost model (``megatron_lrmoe.planning.cost_model``) divides by these
numbers and holds no timing constant of its own. GEMM: the two expert GEMMs
(x @ W1^T, act, h @ W2^T) of a few local experts at the model's shape, timed as a
whole, median of the repeats, FLOPs 2 * rows * H * (F1 + F). All-to-all: under
torchrun with more than one rank, ``all_to_all_single`` over the world group (gloo
on CPU, nccl on CUDA); bandwidth = bytes each rank sends to the others per second,
latency = the time of a tiny all-to-all. With one process: two local gloo processes
(``--alltoall local``, the default on CPU: it measures loopback, not a network) or a
device memory copy (``--alltoall copy``); ``source`` in the JSON says which.
``--alltoall-sizes-mib`` adds a size table (``alltoall_sizes``,
``alltoall_size_bytes_per_s``): the bandwidth at each of those bytes sent to the other
ranks: a layer's messages are a few MB, and a rate measured at one size need not hold
at another.

What the time model adds around the GEMMs and the all-to-all (``cost_model`` module doc,
"Time"), each measured here:

- GEMM rate by rows (``gemm_rows``, ``gemm_forward_flops_per_s``,
  ``gemm_backward_flops_per_s``): one instance's forward GEMMs and backward GEMMs (with
  the weight-gradient accumulation) at each of ``--gemm-rows`` rows, over
  ``--local-experts`` instances. Few rows run at a lower rate (weights streamed, weight
  gradients written and accumulated per call whatever the rows).
- memory rate (``memory_bytes_per_s``): a row gather and the activation at the
  layer's buffer sizes (``--tokens`` x ``--topk`` rows), bytes read plus written per
  second.
- fixed cost of a layer call (``layer_forward_fixed_s``, ``layer_backward_fixed_s``;
  ``--layer-fixed``): the LRMoE layer's forward and backward at EP = 2 over two local
  gloo processes, at a tiny shape (hidden = FFN = 64, 16 tokens per rank) with the
  model's experts and top-k, so that GEMMs and row work are negligible: the slowest
  rank's time, median over repetitions, minus the two all-to-all latencies of each
  phase and, in forward, the planner's own host time (the simulator adds the planner
  where a policy runs it). Measured where the all-to-all is (two local gloo processes:
  a single process on CPU, ``--alltoall local``); elsewhere 0, not priced. Megatron's
  MoELayer (all-to-all dispatcher, SequentialMLP) the same way, with the same
  configuration (``megatron_forward_fixed_s``, ``megatron_backward_fixed_s``; null where
  not measured: the cost model then prices it as the LRMoE layer's): its dispatcher's
  host work and its loop over the local experts cost more per call.

The measurements themselves live in ``megatron_lrmoe.planning.machine``, which the
planner also uses (without a calibration file) at model set-up.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time

import torch

from megatron_lrmoe.integration.runtime.local_gloo import run_on_local_ranks
from megatron_lrmoe.planning.machine import (
    MachineConstants,
    measure_copy_rate,
    measure_gemm_rate,
    measure_gemm_table,
    measure_memory_rate,
    synchronize,
)

__all__ = ["main"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


# ---------------------------------------------------------------------------
# All-to-all
# ---------------------------------------------------------------------------


def _alltoall_worker(num_bytes: int, device: torch.device, repeats: int, warmup: int,
                     table_bytes: tuple[int, ...] = ()) -> tuple[float, float, list[float]]:
    """(bytes/s sent to other ranks per rank, latency s, the same rate at each of
    ``table_bytes`` bytes sent to the other ranks), inside an initialised group. Each
    repetition's time is the slowest rank's (a max all-reduce)."""
    import torch.distributed as dist

    world = dist.get_world_size()
    tiny_send = torch.ones(world, dtype=torch.uint8, device=device)
    tiny_recv = torch.empty_like(tiny_send)

    def timed(fn) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(repeats):
            dist.barrier()
            synchronize(device)
            start = time.perf_counter()
            fn()
            synchronize(device)
            t = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            times.append(float(t))
        return statistics.median(times)

    def rate(per_peer: int) -> float:
        send = torch.ones(per_peer * world, dtype=torch.uint8, device=device)
        recv = torch.empty_like(send)
        seconds = timed(lambda: dist.all_to_all_single(recv, send))
        return per_peer * (world - 1) / max(seconds - latency, 1e-12)

    latency = timed(lambda: dist.all_to_all_single(tiny_recv, tiny_send))
    bandwidth = rate(max(num_bytes // world, 1))
    return bandwidth, latency, [rate(max(n // (world - 1), 1)) for n in table_bytes]


def _spawned(rank: int, world: int, init_file: str, num_bytes: int, repeats: int, warmup: int,
             table_bytes: tuple[int, ...], result_file: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        values = _alltoall_worker(num_bytes, torch.device("cpu"), repeats, warmup, table_bytes)
        if rank == 0:
            bandwidth, latency, table = values
            with open(result_file, "w") as f:
                f.write(" ".join(map(str, (bandwidth, latency, *table))))
    finally:
        dist.destroy_process_group()


def _local_alltoall(num_bytes: int, repeats: int, warmup: int, table_bytes: tuple[int, ...] = ()
                    ) -> tuple[float, float, list[float]]:
    """``_alltoall_worker`` over two local gloo processes (torch.multiprocessing.spawn)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        init, result = os.path.join(tmp, "init"), os.path.join(tmp, "result")
        mp.spawn(_spawned, args=(2, init, num_bytes, repeats, warmup, table_bytes, result),
                 nprocs=2)
        with open(result) as f:
            bandwidth, latency, *table = (float(v) for v in f.read().split())
    return bandwidth, latency, table


# ---------------------------------------------------------------------------
# Compute rates with the machine shared
# ---------------------------------------------------------------------------


def _compute_rates(cfg: dict, device: torch.device, sync=lambda: None) -> list[float]:
    """[GEMM rate, memory rate, forward table..., backward table...] at ``cfg``'s shape;
    ``sync`` runs before each measurement (a barrier when several processes measure)."""
    clock = time.thread_time if cfg["clock"] == "cpu" else time.perf_counter
    common = dict(gated=cfg["gated"], dtype=cfg["dtype"], device=device,
                  repeats=cfg["repeats"], warmup=cfg["warmup"], clock=clock)
    sync()
    rate = measure_gemm_rate(cfg["hidden"], cfg["ffn"], cfg["rows"], cfg["local_experts"],
                             **common)
    sync()
    fwd, bwd = measure_gemm_table(cfg["hidden"], cfg["ffn"], cfg["gemm_rows"],
                                  cfg["local_experts"], **common) if cfg["gemm_rows"] else ([], [])
    sync()
    memory = measure_memory_rate(cfg["hidden"], cfg["ffn"], cfg["memory_rows"], **common)
    return [rate, memory, *fwd, *bwd]


def _compute_rate_rounds(cfg: dict, device: torch.device, sync=lambda: None
                         ) -> list[list[float]]:
    """``_compute_rates`` ``cfg["rounds"]`` times, one list per round."""
    return [_compute_rates(cfg, device, sync) for _ in range(cfg["rounds"])]


def _median_over_rounds(rounds: list[list[float]]) -> list[float]:
    """Per figure, the median over the rounds: a shared machine's rates drift by 10-20%
    between measurements seconds apart, more than within one round's repeats."""
    return [statistics.median(values) for values in zip(*rounds, strict=True)]


def _rates_task(cfg: dict) -> list[list[float]]:
    """``_compute_rate_rounds`` on each local gloo rank (``run_on_local_ranks``), every
    measurement started together on all ranks."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    return _compute_rate_rounds(cfg, torch.device("cpu"), dist.barrier)


def measure_rates_concurrently(processes: int, cfg: dict) -> list[float]:
    """``_rates_task`` on ``processes`` local processes at once (one thread each); per
    figure the slowest process's: EP ranks that share a CPU machine also share its
    caches, memory bandwidth and, with SMT, its cores, so one process alone on the
    machine measures a rate that training does not reach."""
    from megatron_lrmoe.tools import calibrate as this  # the ranks import tasks by module name

    per_rank = run_on_local_ranks(this._rates_task, processes, cfg,
                                  timeout=1800.0 * cfg["rounds"])
    # Per round the slowest process's figure, then the median over the rounds.
    slowest = [[min(values) for values in zip(*ranks, strict=True)]
               for ranks in zip(*per_rank, strict=True)]
    return _median_over_rounds(slowest)


# ---------------------------------------------------------------------------
# Fixed cost of a layer call
# ---------------------------------------------------------------------------


def _layer_fixed_task(cfg: dict) -> dict[str, list[float]]:
    """On each local gloo rank (``run_on_local_ranks``): forward and backward seconds of
    one call of ``cfg["layer"]`` (``"lrmoe"``: the LRMoE layer; ``"megatron"``: Megatron's
    MoELayer, all-to-all dispatcher and SequentialMLP) at ``cfg``'s tiny shape, per
    repetition, and the planner's host time per forward (0 for Megatron's layer)."""
    import gc
    import math

    import torch.distributed as dist
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    from megatron_lrmoe.config.transformer_config import LRMoETransformerConfig
    from megatron_lrmoe.integration.step_hooks import setup_lrmoe_layers
    from megatron_lrmoe.layer.spec import to_lrmoe_spec

    torch.set_num_threads(1)
    ep = dist.get_world_size()
    ps.initialize_model_parallel(expert_model_parallel_size=ep)
    model_parallel_cuda_manual_seed(1234)
    size = cfg["hidden"]
    # One configuration for both layers: they differ only in the module.
    common = dict(
        num_layers=1, hidden_size=size, num_attention_heads=4, ffn_hidden_size=size,
        moe_ffn_hidden_size=size, num_moe_experts=cfg["experts"],
        moe_router_topk=cfg["topk"], moe_token_dispatcher_type="alltoall",
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-3,
        expert_model_parallel_size=ep, add_bias_linear=False, bias_activation_fusion=False,
        gated_linear_unit=cfg["gated"], activation_func=F.silu, params_dtype=torch.float32)
    spec = get_gpt_layer_local_spec(num_experts=cfg["experts"]).submodules.mlp
    if cfg["layer"] == "megatron":
        layer = spec(config=TransformerConfig(**common)).train()
    else:
        layer = to_lrmoe_spec(spec)(config=LRMoETransformerConfig(
            **common, moe_lrmoe=True, moe_lrmoe_bwd_capacity_factor=math.inf)).train()
        setup_lrmoe_layers([layer], cfg["tokens"], 1)
    stats = getattr(layer, "lrmoe_stats", None)
    gen = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(cfg["tokens"], 1, size, generator=gen)
    dy = torch.randn(cfg["tokens"], 1, size, generator=gen)
    out: dict[str, list[float]] = {"forward": [], "backward": [], "planner": []}
    clock = time.thread_time if cfg.get("clock") == "cpu" else time.perf_counter
    for rep in range(cfg["warmup"] + cfg["repeats"]):
        for param in layer.parameters():
            param.grad = None
        x_in = x.clone().requires_grad_(True)
        if stats is not None:
            stats.reset()
        gc.disable()
        try:
            dist.barrier()
            t0 = clock()
            y, _ = layer(x_in)
            t1 = clock()
            dist.barrier()
            t2 = clock()
            y.backward(dy)
            t3 = clock()
        finally:
            gc.enable()
        planner = 0.0
        if stats is not None:
            planner = float(getattr(stats.calls[-1], "planner_s", 0.0)) if stats.calls else 0.0
            layer.finish_step()
        if rep >= cfg["warmup"]:
            out["forward"].append(t1 - t0)
            out["backward"].append(t3 - t2)
            out["planner"].append(planner)
    return out


def measure_layer_fixed(experts: int, topk: int, gated: bool, latency: float,
                        repeats: int, warmup: int, clock: str = "wall",
                        layer: str = "lrmoe") -> tuple[float, float]:
    """(forward s, backward s): the fixed cost of one layer call per phase besides the
    two all-to-all latencies (``latency`` each) and, in forward, the planner's host time;
    from the layer at a tiny shape over two local gloo processes (module doc).
    ``layer``: ``"lrmoe"`` (the LRMoE layer) or ``"megatron"`` (Megatron's MoELayer, which
    runs no planner). ``clock="cpu"``: each rank's main-thread CPU time, which leaves out
    the waits in collectives (so the latencies are not subtracted) but not the planner's
    time."""
    from megatron_lrmoe.tools import calibrate as this  # the ranks import tasks by module name

    if layer not in ("lrmoe", "megatron"):
        raise ValueError(f"measure_layer_fixed: layer must be 'lrmoe' or 'megatron', got "
                         f"{layer!r}")
    cfg = dict(hidden=64, tokens=16, experts=experts, topk=topk, gated=gated,
               repeats=max(repeats, 5), warmup=max(warmup, 2), clock=clock, layer=layer)
    per_rank = run_on_local_ranks(this._layer_fixed_task, 2, cfg, timeout=600.0)
    # Each repetition's time is its slowest rank's; then the median over repetitions.
    cpu = clock == "cpu"
    fwd = statistics.median(max(r["forward"][i] - (0.0 if cpu else r["planner"][i])
                                for r in per_rank) for i in range(cfg["repeats"]))
    bwd = statistics.median(max(r["backward"][i] for r in per_rank)
                            for i in range(cfg["repeats"]))
    waits = 0.0 if cpu else 2 * latency
    return max(fwd - waits, 0.0), max(bwd - waits, 0.0)


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m megatron_lrmoe.tools.calibrate",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--output", default="lrmoe_calibration.json", help="JSON to write")
    p.add_argument("--hidden-size", type=int, default=2048)
    p.add_argument("--ffn-hidden-size", type=int, default=768, help="expert FFN size F")
    p.add_argument("--no-gated", dest="gated", action="store_false",
                   help="plain (not SwiGLU) first layer")
    p.add_argument("--rows", type=int, default=4096,
                   help="rows per expert GEMM of gemm_flops_per_s")
    p.add_argument("--gemm-rows", default="16,32,64,128,256,512,1024,2048",
                   help="rows per expert GEMM of the rate tables (comma-separated; empty: "
                        "no tables)")
    p.add_argument("--experts", type=int, default=128,
                   help="experts of the model (the layer's fixed cost is measured with them)")
    p.add_argument("--topk", type=int, default=8, help="top-k of the model")
    p.add_argument("--tokens", type=int, default=4096,
                   help="tokens per rank and micro-batch (the memory rate is measured at "
                        "tokens x top-k rows)")
    p.add_argument("--layer-fixed", choices=("auto", "off"), default="auto",
                   help="measure the fixed cost of a layer call (auto: where the all-to-all "
                        "runs over 2 local gloo processes; off: 0, not priced)")
    p.add_argument("--local-experts", type=int, default=4, help="experts looped per timing")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default=None,
                   help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--alltoall", choices=("auto", "local", "copy"), default="auto",
                   help="single process: 2 local gloo processes (local) or a memory copy")
    p.add_argument("--alltoall-mib", type=float, default=64.0,
                   help="bytes each rank sends per all-to-all (MiB)")
    p.add_argument("--alltoall-sizes-mib", default="",
                   help="all-to-all size table: bytes each rank sends to the other ranks "
                        "per all-to-all (MiB, comma-separated, ascending), measured by the "
                        "all-to-all methods (not --alltoall copy); the cost model times "
                        "each of a layer's messages at its own size. Empty: no table")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="time the single-process measurements (GEMMs, memory rate, the "
                        "layer's fixed cost) by wall time, or, on CPU only, by the thread's "
                        "CPU time: an estimate of an unshared machine's time where other "
                        "work shares the cores (all-to-alls always by wall time)")
    p.add_argument("--concurrency", type=int, default=1,
                   help="CPU, one process: measure the GEMM and memory rates in this many "
                        "local processes at once and keep the slowest (set it to the EP "
                        "ranks that share the machine in training: the study's 2)")
    p.add_argument("--rounds", type=int, default=1,
                   help="measure the GEMM and memory rates this many times over and keep "
                        "each figure's median (a shared machine drifts between rounds)")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> MachineConstants:
    args = _parse(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        device = torch.device("cuda", torch.cuda.current_device())
    dtype = _DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    a2a_bytes = int(args.alltoall_mib * 2**20)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))

    if args.clock == "cpu" and device.type != "cpu":
        raise SystemExit("--clock cpu: only on --device cpu (CUDA work is asynchronous)")
    if args.rounds < 1:
        raise SystemExit(f"--rounds {args.rounds}: must be at least 1")
    if args.concurrency < 1:
        raise SystemExit(f"--concurrency {args.concurrency}: must be at least 1")
    if args.concurrency > 1 and (device.type != "cpu" or world > 1):
        raise SystemExit("--concurrency: only on --device cpu in one process (under torchrun "
                         "every rank measures at once already)")
    gemm_rows = [int(v) for v in args.gemm_rows.split(",") if v.strip()]
    try:
        a2a_sizes = [int(float(v) * 2**20) for v in args.alltoall_sizes_mib.split(",")
                     if v.strip()]
    except ValueError:
        raise SystemExit(f"--alltoall-sizes-mib {args.alltoall_sizes_mib!r}: expected "
                         "comma-separated MiB, e.g. 0.25,1,4,16") from None
    if any(b <= a for a, b in zip(a2a_sizes[:-1], a2a_sizes[1:], strict=True)) or any(
            n < 1 for n in a2a_sizes):
        raise SystemExit(f"--alltoall-sizes-mib {args.alltoall_sizes_mib!r}: sizes must be "
                         "positive and strictly ascending")
    copy = world == 1 and (args.alltoall == "copy"
                           or (args.alltoall == "auto" and device.type == "cuda"))
    if a2a_sizes and copy:
        raise SystemExit("--alltoall-sizes-mib: needs an all-to-all (a memory copy has no "
                         "message sizes); run under torchrun or with --alltoall local")
    cfg = dict(hidden=args.hidden_size, ffn=args.ffn_hidden_size, rows=args.rows,
               local_experts=args.local_experts, gemm_rows=gemm_rows, gated=args.gated,
               dtype=dtype, memory_rows=args.tokens * args.topk, repeats=args.repeats,
               warmup=args.warmup, clock=args.clock, rounds=args.rounds)
    if args.concurrency > 1:
        rate, memory, *rest = measure_rates_concurrently(args.concurrency, cfg)
    else:
        rate, memory, *rest = _median_over_rounds(_compute_rate_rounds(cfg, device))
    fwd_rates, bwd_rates = rest[:len(gemm_rows)], rest[len(gemm_rows):]
    if world > 1:
        import torch.distributed as dist

        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend)
        bandwidth, latency, a2a_rates = _alltoall_worker(a2a_bytes, device, args.repeats,
                                                         args.warmup, tuple(a2a_sizes))
        rates = torch.tensor([rate, memory, *fwd_rates, *bwd_rates], dtype=torch.float64,
                             device=device)
        dist.all_reduce(rates, op=dist.ReduceOp.MIN)      # the slowest rank sets the pace
        rate, memory, *rest = rates.tolist()
        fwd_rates, bwd_rates = rest[:len(gemm_rows)], rest[len(gemm_rows):]
        dist.destroy_process_group()
        method = f"all_to_all_single over {world} ranks ({backend})"
    elif copy:
        bandwidth, latency = measure_copy_rate(a2a_bytes, device, args.repeats, args.warmup), 0.0
        a2a_rates = []
        method = f"single process: {device.type} memory copy as bandwidth (no all-to-all)"
    else:
        bandwidth, latency, a2a_rates = _local_alltoall(a2a_bytes, args.repeats, args.warmup,
                                                        tuple(a2a_sizes))
        method = "single process: 2 local gloo processes over loopback (not a network)"

    fixed_f = fixed_b = 0.0
    megatron_f = megatron_b = None
    fixed_method = "not measured"
    if args.layer_fixed == "auto" and method.startswith("single process: 2 local gloo"):
        fixed_f, fixed_b, megatron_f, megatron_b = (
            *measure_layer_fixed(args.experts, args.topk, args.gated, latency, args.repeats,
                                 args.warmup, args.clock),
            *measure_layer_fixed(args.experts, args.topk, args.gated, latency, args.repeats,
                                 args.warmup, args.clock, layer="megatron"))
        fixed_method = (f"LRMoE layer and Megatron's MoELayer (all-to-all dispatcher, "
                        f"SequentialMLP), each at hidden = FFN = 64, 16 tokens per rank, "
                        f"{args.experts} experts top-{args.topk}, EP = 2 over 2 local gloo "
                        f"processes")
    if args.clock == "cpu":
        method += "; GEMMs, memory rate and layer fixed cost timed by thread CPU time"
    if args.concurrency > 1:
        method += (f"; GEMM and memory rates: the slowest of {args.concurrency} local "
                   "processes measuring at once")
    if args.rounds > 1:
        method += f"; GEMM and memory rates: median of {args.rounds} rounds"
    gated = "SwiGLU" if args.gated else "plain"
    source = (f"python -m megatron_lrmoe.tools.calibrate on {socket.gethostname()} ({device}): "
              f"GEMM "
              f"H={args.hidden_size} F={args.ffn_hidden_size} {gated} {str(dtype)[6:]}, "
              f"{args.local_experts} experts x {args.rows} rows; all-to-all: {method}, "
              f"{args.alltoall_mib:g} MiB per rank"
              + (f", size table at {args.alltoall_sizes_mib} MiB sent to the other ranks"
                 if a2a_sizes else "")
              + f"; GEMM rate tables at rows {gemm_rows}; "
              f"memory rate: row gather + activation at {args.tokens * args.topk} rows; "
              f"layer fixed cost: {fixed_method}")
    constants = MachineConstants(rate, bandwidth, latency, source, gemm_rows=tuple(gemm_rows),
                                 gemm_forward_flops_per_s=tuple(fwd_rates),
                                 gemm_backward_flops_per_s=tuple(bwd_rates),
                                 memory_bytes_per_s=memory, layer_forward_fixed_s=fixed_f,
                                 layer_backward_fixed_s=fixed_b,
                                 megatron_forward_fixed_s=megatron_f,
                                 megatron_backward_fixed_s=megatron_b,
                                 alltoall_sizes=tuple(a2a_sizes),
                                 alltoall_size_bytes_per_s=tuple(a2a_rates))
    details = {k: v for k, v in vars(args).items() if k != "output"} | {"dtype": str(dtype)[6:]}
    details.update(world_size=world, torch=torch.__version__, python=sys.version.split()[0])
    if rank == 0:
        constants.to_json(args.output, details)
        rows = [("expert GEMM rate", f"{rate / 1e12:.4g} TFLOP/s"),
                ("all-to-all bandwidth per rank", f"{bandwidth / 1e9:.4g} GB/s"),
                ("all-to-all latency", f"{latency * 1e6:.4g} us"),
                *((f"expert GEMM rate at {n} rows (fwd / bwd)",
                   f"{f / 1e12:.4g} / {b / 1e12:.4g} TFLOP/s")
                  for n, f, b in zip(gemm_rows, fwd_rates, bwd_rates, strict=True)),
                *((f"all-to-all bandwidth at {n / 2**20:g} MiB sent", f"{r / 1e9:.4g} GB/s")
                  for n, r in zip(a2a_sizes, a2a_rates, strict=True)),
                ("memory rate", f"{memory / 1e9:.4g} GB/s"),
                ("layer fixed cost (fwd / bwd)",
                 f"{fixed_f * 1e3:.4g} / {fixed_b * 1e3:.4g} ms"),
                ("Megatron layer fixed cost (fwd / bwd)",
                 "not measured" if megatron_f is None
                 else f"{megatron_f * 1e3:.4g} / {megatron_b * 1e3:.4g} ms"),
                ("method", method), ("written to", args.output)]
        width = max(len(k) for k, _ in rows)
        for key, value in rows:
            print(f"{key:<{width}}  {value}")
    return constants


if __name__ == "__main__":
    main()
