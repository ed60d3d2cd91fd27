"""This machine's expert GEMM rate and memory-copy rate, measured in-process.

The cost model (``cost_model.py``) divides by measured numbers and holds no timing
constant of its own. ``default_machine_constants(device)`` is the fallback when the
user gives no calibration file (``python -m megatron_lrmoe.tools.calibrate`` writes one):
it measures in well under a second (a small GEMM and a memory copy) and says so in
``source``.
"""

from __future__ import annotations

import functools
import platform
import statistics
import time
from collections.abc import Callable

import torch

from megatron_lrmoe.planning.cost_model import MachineConstants

__all__ = ["default_machine_constants", "measure_copy_rate", "measure_gemm_rate",
           "measure_gemm_table", "measure_memory_rate", "median_time", "synchronize"]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_time(fn: Callable[[], object], device: torch.device, repeats: int,
                 warmup: int, clock: Callable[[], float] = time.perf_counter) -> float:
    """Median seconds of ``fn`` by ``clock``: wall time (``time.perf_counter``, the
    default), or this thread's CPU time (``time.thread_time``: on a CPU shared with
    other work, an estimate of the unshared time; never on CUDA, whose work is async)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = clock()
        fn()
        synchronize(device)
        times.append(clock() - start)
    return statistics.median(times)


def measure_gemm_rate(hidden_size: int, ffn_hidden_size: int, rows: int, experts: int = 1,
                      gated: bool = True, dtype: torch.dtype = torch.float32,
                      device: str | torch.device = "cpu", repeats: int = 5,
                      warmup: int = 1, clock: Callable[[], float] = time.perf_counter) -> float:
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

    seconds = median_time(run, device, repeats, warmup, clock)
    flops = 2 * rows * hidden_size * (fc1 + ffn_hidden_size) * experts
    return flops / seconds


def measure_gemm_table(hidden_size: int, ffn_hidden_size: int, rows: list[int],
                       experts: int = 4, gated: bool = True,
                       dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                       repeats: int = 5, warmup: int = 1,
                       clock: Callable[[], float] = time.perf_counter
                       ) -> tuple[list[float], list[float]]:
    """(forward FLOP/s, backward FLOP/s) of one expert instance's GEMMs at each of
    ``rows`` rows, looped over ``experts`` instances (each with its own weights, as a
    rank's local experts are); medians of ``repeats``. GEMMs only, no activation (the
    cost model prices that as memory traffic). Forward: x W1^T, h W2^T (2H(F1 + F) FLOP
    per row). Backward: dh = g W2, dW2 = g^T h, dX = dz W1, dW1 = dz^T x, and each dW
    added into an fp32 gradient buffer as Megatron's main_grad accumulation does (4H(F1 +
    F) FLOP per row counted; the accumulation is traffic per call, which is why few rows
    run at a lower rate)."""
    device = torch.device(device)
    fc1 = 2 * ffn_hidden_size if gated else ffn_hidden_size
    gen = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(device, dtype)

    w1 = [rand(fc1, hidden_size, scale=0.02) for _ in range(experts)]
    w2 = [rand(hidden_size, ffn_hidden_size, scale=0.02) for _ in range(experts)]
    g1 = [torch.zeros(fc1, hidden_size, device=device) for _ in range(experts)]
    g2 = [torch.zeros(hidden_size, ffn_hidden_size, device=device) for _ in range(experts)]

    def fwd(xs: list[torch.Tensor], hs: list[torch.Tensor]) -> None:
        for x, h, a, b in zip(xs, hs, w1, w2, strict=True):
            x @ a.t()
            h @ b.t()

    def bwd(xs: list[torch.Tensor], hs: list[torch.Tensor], gs: list[torch.Tensor],
            dzs: list[torch.Tensor]) -> None:
        for e in range(experts):
            gs[e] @ w2[e]
            g2[e].add_(gs[e].t() @ hs[e])
            dzs[e] @ w1[e]
            g1[e].add_(dzs[e].t() @ xs[e])

    forward, backward = [], []
    for n in rows:
        xs = [rand(n, hidden_size) for _ in range(experts)]
        hs = [rand(n, ffn_hidden_size) for _ in range(experts)]
        gs = [rand(n, hidden_size) for _ in range(experts)]
        dzs = [rand(n, fc1) for _ in range(experts)]
        flops = 2 * n * hidden_size * (fc1 + ffn_hidden_size) * experts
        forward.append(flops / median_time(functools.partial(fwd, xs, hs), device, repeats,
                                           warmup, clock))
        backward.append(2 * flops / median_time(functools.partial(bwd, xs, hs, gs, dzs), device,
                                                repeats, warmup, clock))
    return forward, backward


def measure_memory_rate(hidden_size: int, ffn_hidden_size: int, rows: int, gated: bool = True,
                        dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                        repeats: int = 5, warmup: int = 1,
                        clock: Callable[[], float] = time.perf_counter) -> float:
    """Bytes read plus written per second by the memory-bound work around the expert
    GEMMs, at the layer's buffer sizes: a row gather into a fresh buffer
    (``index_select`` of ``rows`` rows of H by a random permutation: 2H elements per
    row, as the dispatch, reorders and combine do) and the activation over [rows, F1]
    (gated: silu(z1) * z2, 5F elements per row; plain: silu, 2F), each timed as a whole
    (median of ``repeats``), the rate being their bytes over their summed times. Fresh
    output buffers, as the layer allocates them: what the allocator costs is in it."""
    device = torch.device(device)
    fc1 = 2 * ffn_hidden_size if gated else ffn_hidden_size
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(rows, hidden_size, generator=gen).to(device, dtype)
    perm = torch.randperm(rows, generator=gen).to(device)
    z = torch.randn(rows, fc1, generator=gen).to(device, dtype)

    def activation() -> torch.Tensor:
        if gated:
            a, b = z.chunk(2, dim=1)
            return torch.nn.functional.silu(a) * b
        return torch.nn.functional.silu(z)

    t_gather = median_time(lambda: x.index_select(0, perm), device, repeats, warmup, clock)
    t_act = median_time(activation, device, repeats, warmup, clock)
    elements = rows * (2 * hidden_size + (5 if gated else 2) * ffn_hidden_size)
    return elements * x.element_size() / (t_gather + t_act)


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
