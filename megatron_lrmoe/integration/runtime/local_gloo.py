"""Local gloo ranks: one function run once on ``world_size`` processes of this machine.

For measurements that need several ranks at once without a launcher
(``calibrate --concurrency N``, the layer's fixed cost over two gloo processes):

    results = run_on_local_ranks(my_module.my_task, 2, arg, timeout=600)   # by rank

Each rank is a fresh spawned process with one thread (``OMP_NUM_THREADS=1``), the CPU
runtime enabled (``runtime.cpu``) and one gloo process group over loopback;
``fn`` must be a module-level function (the processes import it by module name). A
rank that raises, dies or outlives ``timeout`` ends the run: every rank is stopped and
``LocalRanksFailed`` carries the tracebacks that arrived.

``init_local_rank`` is the per-process set-up on its own, for callers that keep their
processes alive across tasks (the test harness's ``testing.gloo_pool``).
"""

from __future__ import annotations

import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_lrmoe.integration.runtime.cpu import enable_cpu_runtime

__all__ = ["LocalRanksFailed", "free_port", "init_local_rank", "run_on_local_ranks"]


class LocalRanksFailed(RuntimeError):
    """A function raised on some local rank, timed out, or a rank died."""


def free_port() -> int:
    """A TCP port free on the loopback interface now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_local_rank(rank: int, world_size: int, port: int) -> None:
    """Make this process rank ``rank`` of ``world_size`` local gloo ranks: the
    distributed environment variables, one thread, the CPU runtime, the process group."""
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    enable_cpu_runtime()
    dist.init_process_group("gloo", rank=rank, world_size=world_size)


def _rank_main(rank: int, world_size: int, port: int, fn: Callable, args: tuple,
               kwargs: dict, results) -> None:
    try:
        init_local_rank(rank, world_size, port)
        results.put((rank, True, fn(*args, **kwargs)))
    except BaseException:  # noqa: BLE001 - every failure goes back to the caller
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_on_local_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 300.0,
                       **kwargs: Any) -> list[Any]:
    """``fn(*args, **kwargs)`` on ``world_size`` fresh local gloo ranks; the results by
    rank (module doc)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main,
                         args=(rank, world_size, port, fn, args, kwargs, results))
             for rank in range(world_size)]
    for proc in procs:
        proc.start()
    got: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(got) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, ok, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                # A rank that ended without reporting died; one that reported may have
                # exited already while the others still run. A dead rank's last words may
                # still be in the pipe: read on briefly before giving up.
                if any(not p.is_alive() and r not in got for r, p in enumerate(procs)):
                    deadline = min(deadline, time.monotonic() + 2)
                continue
            got[rank] = (ok, value)
            if not ok:   # one rank failed: give the others a moment to report, then stop
                deadline = min(deadline, time.monotonic() + 5)
    finally:
        stop = time.monotonic() + 5
        for proc in procs:
            if len(got) == world_size and all(ok for ok, _ in got.values()):
                proc.join(timeout=max(stop - time.monotonic(), 0.1))
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=5)
    errors = [f"--- rank {r} ---\n{v}" for r, (ok, v) in sorted(got.items()) if not ok]
    if errors or len(got) != world_size:
        missing = sorted(set(range(world_size)) - set(got))
        reason = f"ranks {missing} did not finish within {timeout:.0f} s\n" if missing else ""
        raise LocalRanksFailed(f"{fn.__qualname__} failed on {world_size} local ranks:\n"
                               f"{reason}" + "\n".join(errors))
    return [got[r][1] for r in range(world_size)]
