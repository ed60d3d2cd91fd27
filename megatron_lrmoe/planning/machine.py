"""The machine the cost model divides by: ``MachineConstants`` (measured rates, saved as a
calibration file) and their quick in-process measurement.

The cost model (``cost_model.py``) holds no timing constant of its own.
``default_machine_constants(device)`` is the fallback when the user gives no calibration
file (``python -m megatron_lrmoe.tools.calibrate`` writes one): it measures in well under
a second (a small GEMM and a memory copy) and says so in ``source``.
"""

from __future__ import annotations

import functools
import json
import math
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import torch

__all__ = ["MachineConstants", "default_machine_constants", "interpolated_time",
           "measure_copy_rate", "measure_gemm_rate", "measure_gemm_table", "measure_memory_rate",
           "median_time", "synchronize"]


@dataclass(frozen=True)
class MachineConstants:
    """Measured rates of this machine: what the time model divides by."""

    gemm_flops_per_s: float
    """Expert GEMM rate of one rank (FLOP/s) at the model's shape and dtype."""
    alltoall_bytes_per_s: float
    """All-to-all bandwidth per rank (bytes one rank sends per second)."""
    alltoall_latency_s: float = 0.0
    """Fixed cost of one all-to-all call (s)."""
    source: str = ""
    """Where the numbers came from (calibration file, machine, method)."""
    gemm_rows: tuple[float, ...] = ()
    """Rows per expert GEMM at which the two tables below were measured, ascending. Empty
    (old calibration files, the GPU presets): every expert GEMM runs at
    ``gemm_flops_per_s`` whatever its rows."""
    gemm_forward_flops_per_s: tuple[float, ...] = ()
    """Forward expert GEMMs of one instance (x W1^T, h W2^T), FLOP/s at each of
    ``gemm_rows`` (2H(F1 + F) FLOP per row). The time of n rows is interpolated linearly
    in n between the measured points (``CostModel`` module doc, "Time")."""
    gemm_backward_flops_per_s: tuple[float, ...] = ()
    """Backward expert GEMMs of one instance (dh, dW2, dz W1, dW1, and both dW added into
    the gradient buffers), FLOP/s at each of ``gemm_rows`` (4H(F1 + F) FLOP per row)."""
    memory_bytes_per_s: float = 0.0
    """Rate of the memory-bound work around the GEMMs (row gathers and reorders, the
    combine and its backward, the activation, the router's elementwise work), bytes read
    plus written per second on one rank. 0 (old calibration files): not priced."""
    layer_forward_fixed_s: float = 0.0
    """Fixed cost of one layer call's forward besides the two all-to-all latencies (s):
    op dispatch and Python of the layer, the counts exchange, small collectives. 0 (old
    calibration files): not priced."""
    layer_backward_fixed_s: float = 0.0
    """Fixed cost of one layer call's backward besides the two all-to-all latencies (s)."""
    megatron_forward_fixed_s: float | None = None
    """The same for one call of Megatron's MoELayer (``MoEShape.megatron_layer``): its
    dispatcher's host work and its expert MLP's per-expert loop cost more per call than
    the LRMoE layer's. None (old calibration files, the GPU presets): not measured, priced
    as ``layer_forward_fixed_s``."""
    megatron_backward_fixed_s: float | None = None
    """Backward counterpart of ``megatron_forward_fixed_s``; None exactly when it is."""
    alltoall_sizes: tuple[float, ...] = ()
    """Bytes one rank sends to the other ranks in one all-to-all, at which
    ``alltoall_size_bytes_per_s`` was measured, ascending. Empty (old calibration files,
    the GPU presets): every message moves at ``alltoall_bytes_per_s`` whatever its size."""
    alltoall_size_bytes_per_s: tuple[float, ...] = ()
    """All-to-all bandwidth per rank at each of ``alltoall_sizes`` (bytes over the time
    less ``alltoall_latency_s``). A layer's messages are a few MB, a replica refresh's
    tens, and a rate measured at one size need not hold at another. The time of b bytes
    is interpolated linearly in b between the measured points, as the GEMM tables are
    in rows."""

    def __post_init__(self) -> None:
        for name in ("gemm_rows", "gemm_forward_flops_per_s", "gemm_backward_flops_per_s",
                     "alltoall_sizes", "alltoall_size_bytes_per_s"):
            value = getattr(self, name)
            if not isinstance(value, list | tuple) or any(
                    isinstance(v, bool) or not isinstance(v, int | float)
                    or not (math.isfinite(v) and v > 0) for v in value):
                raise ValueError(f"MachineConstants.{name} must be a list of positive finite "
                                 f"numbers, got {value!r}")
            object.__setattr__(self, name, tuple(float(v) for v in value))
        if not (len(self.gemm_rows) == len(self.gemm_forward_flops_per_s)
                == len(self.gemm_backward_flops_per_s)):
            raise ValueError("MachineConstants.gemm_rows, gemm_forward_flops_per_s and "
                             "gemm_backward_flops_per_s must have the same length")
        if len(self.alltoall_sizes) != len(self.alltoall_size_bytes_per_s):
            raise ValueError("MachineConstants.alltoall_sizes and alltoall_size_bytes_per_s "
                             "must have the same length")
        for name in ("gemm_rows", "alltoall_sizes"):
            points = getattr(self, name)
            if any(b <= a for a, b in zip(points[:-1], points[1:], strict=True)):
                raise ValueError(f"MachineConstants.{name} must be strictly ascending, got "
                                 f"{points!r}")
        for name in ("memory_bytes_per_s", "layer_forward_fixed_s", "layer_backward_fixed_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not (
                    math.isfinite(value) and value >= 0):
                raise ValueError(f"MachineConstants.{name} must be a finite number >= 0, "
                                 f"got {value!r}")
        megatron = (self.megatron_forward_fixed_s, self.megatron_backward_fixed_s)
        if (megatron[0] is None) != (megatron[1] is None):
            raise ValueError("MachineConstants.megatron_forward_fixed_s and "
                             "megatron_backward_fixed_s must both be set or both be None, got "
                             f"{megatron!r}")
        for name in ("megatron_forward_fixed_s", "megatron_backward_fixed_s"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(
                    value, int | float) or not (math.isfinite(value) and value >= 0)):
                raise ValueError(f"MachineConstants.{name} must be None or a finite number "
                                 f">= 0, got {value!r}")
        for name in ("gemm_flops_per_s", "alltoall_bytes_per_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not (
                    math.isfinite(value) and value > 0):
                raise ValueError(f"MachineConstants.{name} must be a positive finite number, "
                                 f"got {value!r}")
        lat = self.alltoall_latency_s
        if isinstance(lat, bool) or not isinstance(lat, int | float) or not (
                math.isfinite(lat) and lat >= 0):
            raise ValueError(f"MachineConstants.alltoall_latency_s must be a finite number "
                             f">= 0, got {lat!r}")
        if not isinstance(self.source, str):
            raise ValueError(f"MachineConstants.source must be a string, got {self.source!r}")

    def instance_gemm_seconds(self, rows, flops_per_row: float, forward: bool) -> np.ndarray:
        """Seconds of one expert instance's forward (or backward) GEMMs at each of
        ``rows`` rows, ``flops_per_row`` FLOP per row: from the rate tables where measured
        (interpolated linearly in rows, ``CostModel`` module doc, "Time"), else at
        ``gemm_flops_per_s``; 0 at 0 rows (no GEMM runs. Both layers still call an empty
        instance, whose backward zero-fills and accumulates a weight gradient: 0.45 ms on
        this project's CPU at the study's shape against 3.2 ms at 16 rows, left out)."""
        rows = np.asarray(rows, dtype=np.float64)
        if not self.gemm_rows:
            return rows * flops_per_row / self.gemm_flops_per_s
        rates = self.gemm_forward_flops_per_s if forward else self.gemm_backward_flops_per_s
        return np.where(rows > 0, interpolated_time(rows, self.gemm_rows, rates,
                                                     flops_per_row), 0.0)

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> MachineConstants:
        """Read a calibration file; errors name the file and the offending key.

        Keys: the fields above, plus an optional ``details`` object that is ignored
        (the calibration tool records its measurement settings there).
        """
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except OSError as err:
            raise ValueError(f"{path}: cannot read calibration file: {err}") from err
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not valid JSON: {err}") from err
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known - {"details"})
        if unknown:
            raise ValueError(f"{path}: unknown key(s) {unknown}; expected {sorted(known)}")
        for key in ("gemm_flops_per_s", "alltoall_bytes_per_s"):
            if key not in data:
                raise ValueError(f"{path}: missing key {key!r}")
        try:
            return cls(**{k: v for k, v in data.items() if k in known})
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from err

    def to_json(self, path: str | os.PathLike, details: dict | None = None) -> None:
        """Write atomically (temporary file in the same folder, then ``os.replace``)."""
        path = Path(path)
        payload = asdict(self)
        if details:
            payload["details"] = details
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(payload, f, indent=2)
                f.write("\n")
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def interpolated_time(rows: np.ndarray, table_rows: tuple[float, ...],
                       rates: tuple[float, ...], flops: float) -> np.ndarray:
    """Seconds of work of ``rows`` units (an instance's GEMM rows, an all-to-all's bytes)
    from rates measured at ``table_rows`` units, ``flops`` of work per unit: the measured
    times rows_i x flops / rate_i, interpolated linearly in rows; below the first point
    extended along the first segment (down to 0 s), above the last at the last point's
    rate (a single point: that rate throughout)."""
    rows = np.asarray(rows, dtype=np.float64)
    xs = np.asarray(table_rows)
    ts = xs * flops / np.asarray(rates)
    inside = np.interp(rows, xs, ts)
    above = ts[-1] + (rows - xs[-1]) * flops / rates[-1]
    if len(xs) > 1:
        slope = (ts[1] - ts[0]) / (xs[1] - xs[0])
        below = np.maximum(ts[0] + (rows - xs[0]) * slope, 0.0)
    else:
        below = rows * flops / rates[0]
    return np.where(rows < xs[0], below, np.where(rows > xs[-1], above, inside))


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
