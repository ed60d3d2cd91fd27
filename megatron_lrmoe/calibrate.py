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

``default_machine_constants(device)`` is the fallback when the user gives no
calibration file: it measures in-process in well under a second (a small GEMM and a
memory copy) and says so in ``source``.
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch

from megatron_lrmoe.lrmoe.cost_model import MachineConstants

__all__ = ["default_machine_constants", "measure_copy_rate", "measure_gemm_rate", "main"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_time(fn: Callable[[], object], device: torch.device, repeats: int,
                 warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_gemm_rate(hidden_size: int, ffn_hidden_size: int, rows: int, experts: int = 1,
                      gated: bool = True, dtype: torch.dtype = torch.float32,
                      device: str | torch.device = "cpu", repeats: int = 5,
                      warmup: int = 1) -> float:
    """FLOP/s of the expert MLP (x @ W1^T, activation, h @ W2^T), looped over
    ``experts`` local experts of ``rows`` rows each; median of ``repeats``."""
    device = torch.device(device)
    fc1 = 2 * ffn_hidden_size if gated else ffn_hidden_size
    gen = torch.Generator(device="cpu").manual_seed(0)
    xs = [torch.randn(rows, hidden_size, generator=gen).to(device, dtype) for _ in range(experts)]
    w1 = [torch.randn(fc1, hidden_size, generator=gen).to(device, dtype) * 0.02
          for _ in range(experts)]
    w2 = [torch.randn(hidden_size, ffn_hidden_size, generator=gen).to(device, dtype) * 0.02
          for _ in range(experts)]

    def run() -> None:
        for x, a, b in zip(xs, w1, w2, strict=True):
            z = x @ a.t()
            if gated:
                g, u = z.chunk(2, dim=1)
                h = torch.nn.functional.silu(g) * u
            else:
                h = torch.nn.functional.gelu(z)
            h @ b.t()

    seconds = _median_time(run, device, repeats, warmup)
    flops = 2 * rows * hidden_size * (fc1 + ffn_hidden_size) * experts
    return flops / seconds


def measure_copy_rate(num_bytes: int, device: str | torch.device = "cpu", repeats: int = 5,
                      warmup: int = 1) -> float:
    """Bytes/s of a device memory copy (a stand-in for all-to-all bandwidth)."""
    device = torch.device(device)
    src = torch.empty(max(num_bytes, 1), dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    return src.numel() / _median_time(lambda: dst.copy_(src), device, repeats, warmup)


def default_machine_constants(device: str | torch.device = "cpu") -> MachineConstants:
    """Quick in-process measurement (well under a second after device start-up): the
    expert MLP at a small fp32 shape and a 16 MiB memory copy, labelled in ``source``.
    A stand-in for a calibration file; intra-device copy overstates network bandwidth."""
    device = torch.device(device)
    rows, hidden, ffn = (256, 512, 256) if device.type == "cpu" else (4096, 2048, 768)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    rate = measure_gemm_rate(hidden, ffn, rows, 1, True, dtype, device, repeats=3)
    copy = measure_copy_rate(16 << 20, device, repeats=3)
    return MachineConstants(
        gemm_flops_per_s=rate, alltoall_bytes_per_s=copy, alltoall_latency_s=0.0,
        source=(f"default_machine_constants({device.type}) on {platform.node()}: quick "
                f"in-process GEMM rows={rows} H={hidden} F={ffn} {str(dtype)[6:]} and a "
                f"16 MiB memory copy as bandwidth (no calibration file given)"))


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
            _sync(device)
            start = time.perf_counter()
            fn()
            _sync(device)
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
