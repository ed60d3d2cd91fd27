"""This machine's expert GEMM rate and memory-copy rate, measured in-process.

The cost model (``cost_model.py``) divides by measured numbers and holds no timing
constant of its own. ``default_machine_constants(device)`` is the fallback when the
user gives no calibration file (``python -m megatron_lrmoe.calibrate`` writes one):
it measures in well under a second (a small GEMM and a memory copy) and says so in
``source``.
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable

import torch

from megatron_lrmoe.lrmoe.cost_model import MachineConstants

__all__ = ["default_machine_constants", "measure_copy_rate", "measure_gemm_rate", "median_time",
           "synchronize"]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_time(fn: Callable[[], object], device: torch.device, repeats: int,
                 warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
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

    seconds = median_time(run, device, repeats, warmup)
    flops = 2 * rows * hidden_size * (fc1 + ffn_hidden_size) * experts
    return flops / seconds


def measure_copy_rate(num_bytes: int, device: str | torch.device = "cpu", repeats: int = 5,
                      warmup: int = 1) -> float:
    """Bytes/s of a device memory copy (a stand-in for all-to-all bandwidth)."""
    device = torch.device(device)
    src = torch.empty(max(num_bytes, 1), dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    return src.numel() / median_time(lambda: dst.copy_(src), device, repeats, warmup)


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
