"""Measure this machine's expert GEMM rate and all-to-all bandwidth for the planner.

    python -m megatron_lrmoe.calibrate --output calibration.json \\
        --hidden-size 2048 --ffn-hidden-size 768 --dtype bf16 --device cuda
    torchrun --nproc-per-node 8 -m megatron_lrmoe.calibrate --device cuda --output cal.json

The planner's cost model (``megatron_lrmoe.lrmoe.cost_model``) divides by these
numbers and holds no timing constant of its own. GEMM: the two expert GEMMs
(x @ W1^T, act, h @ W2^T) of a few local experts at the model's shape, timed as a
whole, median of the repeats, FLOPs 2 * rows * H * (F1 + F). All-to-all: under
torchrun with more than one rank, ``all_to_all_single`` over the world group (gloo
on CPU, nccl on CUDA); bandwidth = bytes each rank sends to the others per second,
latency = the time of a tiny all-to-all. With one process: two local gloo processes
(``--alltoall local``, the default on CPU: it measures loopback, not a network) or a
device memory copy (``--alltoall copy``); ``source`` in the JSON says which.

The measurements themselves live in ``megatron_lrmoe.lrmoe.machine``, which the
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

from megatron_lrmoe.lrmoe.cost_model import MachineConstants
from megatron_lrmoe.lrmoe.machine import (
    measure_copy_rate,
    measure_gemm_rate,
    synchronize,
)

__all__ = ["main"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


# ---------------------------------------------------------------------------
# All-to-all
# ---------------------------------------------------------------------------


def _alltoall_worker(num_bytes: int, device: torch.device, repeats: int,
                     warmup: int) -> tuple[float, float]:
    """(bytes/s sent to other ranks per rank, latency s), inside an initialised group.
    Each repetition's time is the slowest rank's (a max all-reduce)."""
    import torch.distributed as dist

    world = dist.get_world_size()
    per_peer = max(num_bytes // world, 1)
    send = torch.ones(per_peer * world, dtype=torch.uint8, device=device)
    recv = torch.empty_like(send)
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

    latency = timed(lambda: dist.all_to_all_single(tiny_recv, tiny_send))
    seconds = timed(lambda: dist.all_to_all_single(recv, send))
    return per_peer * (world - 1) / max(seconds - latency, 1e-12), latency


def _spawned(rank: int, world: int, init_file: str, num_bytes: int, repeats: int, warmup: int,
             result_file: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        bandwidth, latency = _alltoall_worker(num_bytes, torch.device("cpu"), repeats, warmup)
        if rank == 0:
            with open(result_file, "w") as f:
                f.write(f"{bandwidth} {latency}")
    finally:
        dist.destroy_process_group()


def _local_alltoall(num_bytes: int, repeats: int, warmup: int) -> tuple[float, float]:
    """Two local gloo processes (torch.multiprocessing.spawn)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        init, result = os.path.join(tmp, "init"), os.path.join(tmp, "result")
        mp.spawn(_spawned, args=(2, init, num_bytes, repeats, warmup, result), nprocs=2)
        with open(result) as f:
            bandwidth, latency = (float(v) for v in f.read().split())
    return bandwidth, latency


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m megatron_lrmoe.calibrate",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--output", default="lrmoe_calibration.json", help="JSON to write")
    p.add_argument("--hidden-size", type=int, default=2048)
    p.add_argument("--ffn-hidden-size", type=int, default=768, help="expert FFN size F")
    p.add_argument("--no-gated", dest="gated", action="store_false",
                   help="plain (not SwiGLU) first layer")
    p.add_argument("--rows", type=int, default=4096, help="rows per expert GEMM")
    p.add_argument("--local-experts", type=int, default=4, help="experts looped per timing")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default=None,
                   help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--alltoall", choices=("auto", "local", "copy"), default="auto",
                   help="single process: 2 local gloo processes (local) or a memory copy")
    p.add_argument("--alltoall-mib", type=float, default=64.0,
                   help="bytes each rank sends per all-to-all (MiB)")
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

    rate = measure_gemm_rate(args.hidden_size, args.ffn_hidden_size, args.rows,
                             args.local_experts, args.gated, dtype, device, args.repeats,
                             args.warmup)
    if world > 1:
        import torch.distributed as dist

        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend)
        bandwidth, latency = _alltoall_worker(a2a_bytes, device, args.repeats, args.warmup)
        rate_t = torch.tensor([rate], dtype=torch.float64, device=device)
        dist.all_reduce(rate_t, op=dist.ReduceOp.MIN)      # the slowest rank sets the pace
        rate = float(rate_t)
        dist.destroy_process_group()
        method = f"all_to_all_single over {world} ranks ({backend})"
    elif args.alltoall == "copy" or (args.alltoall == "auto" and device.type == "cuda"):
        bandwidth, latency = measure_copy_rate(a2a_bytes, device, args.repeats, args.warmup), 0.0
        method = f"single process: {device.type} memory copy as bandwidth (no all-to-all)"
    else:
        bandwidth, latency = _local_alltoall(a2a_bytes, args.repeats, args.warmup)
        method = "single process: 2 local gloo processes over loopback (not a network)"

    gated = "SwiGLU" if args.gated else "plain"
    source = (f"python -m megatron_lrmoe.calibrate on {socket.gethostname()} ({device}): GEMM "
              f"H={args.hidden_size} F={args.ffn_hidden_size} {gated} {str(dtype)[6:]}, "
              f"{args.local_experts} experts x {args.rows} rows; all-to-all: {method}, "
              f"{args.alltoall_mib:g} MiB per rank")
    constants = MachineConstants(rate, bandwidth, latency, source)
    details = {k: v for k, v in vars(args).items() if k != "output"} | {"dtype": str(dtype)[6:]}
    details.update(world_size=world, torch=torch.__version__, python=sys.version.split()[0])
    if rank == 0:
        constants.to_json(args.output, details)
        rows = [("expert GEMM rate", f"{rate / 1e12:.4g} TFLOP/s"),
                ("all-to-all bandwidth per rank", f"{bandwidth / 1e9:.4g} GB/s"),
                ("all-to-all latency", f"{latency * 1e6:.4g} us"),
                ("method", method), ("written to", args.output)]
        width = max(len(k) for k, _ in rows)
        for key, value in rows:
            print(f"{key:<{width}}  {value}")
    return constants


if __name__ == "__main__":
    main()
