"""A pool of gloo worker processes kept alive across tests.

Importing torch and megatron.core costs about 4 s per process on the CI
machine; a suite that starts fresh process groups per test spends most of its
time starting. ``GlooPool(world_size)`` starts ``world_size`` processes once,
each with the CPU runtime enabled and one gloo process group over loopback, and
then runs test functions on all ranks:

    pool = GlooPool(2)
    results = pool.run(my_module.my_task, arg, timeout=120)   # one result per rank

Tasks are module-level functions (the workers import them by module name, so
they must live in an importable module: a test file under ``tests/`` is fine).
A task owns Megatron's parallel state: the pool destroys it after each task so
the next one starts clean, but the process group survives. Every process group a
task created is destroyed and released after it, with the gloo threads it holds
(``_cleanup_megatron_state`` says what would otherwise keep them alive).

Time is bounded: a task that exceeds its timeout (or a rank that dies, or a
rank that raises while the others wait in a collective) kills the pool; it is
restarted on the next ``run`` and the caller gets ``TaskFailed`` with every
traceback that arrived.

Each worker is set up by ``runtime.local_gloo.init_local_rank``, the production code's
own local-rank set-up (one-shot runs outside tests: ``runtime.local_gloo``); what is
here on top is for tests only: workers kept alive across tasks and the clean-up that
this takes.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import os
import queue
import sys
import time
import traceback
import weakref
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from megatron_lrmoe.integration.runtime.local_gloo import free_port, init_local_rank

__all__ = ["GlooPool", "TaskFailed", "free_port", "thread_count"]


class TaskFailed(RuntimeError):
    """A task raised on some rank, timed out, or a worker died."""


def thread_count() -> int:
    """This process's OS threads (``threading.active_count()`` misses C++ threads)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Threads:"):
                return int(line.split()[1])
    raise RuntimeError("no Threads: line in /proc/self/status")


def _resolve(module_name: str, qualname: str, search_paths: list[str]) -> Callable:
    for path in search_paths:
        if path not in sys.path:
            sys.path.insert(0, path)
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


# Megatron DDP wrappers built in this worker (weakly: the task's own references decide).
_ddp_instances: weakref.WeakSet = weakref.WeakSet()


def _track_ddp_instances() -> None:
    """Record every Megatron ``DistributedDataParallel`` built in this worker.

    Megatron's DDP registers a backward hook on each parameter's ``AccumulateGrad``
    node; the hook's closure holds the DDP, which holds the model, its buffers and
    its process groups. The model in turn keeps autograd graphs alive after a step
    (the alltoall dispatcher's ``probs``), and those graphs reach the same
    ``AccumulateGrad`` nodes: a reference cycle through C++ autograd nodes that the
    garbage collector cannot see. Without intervention every ``train()`` left its
    model and ~16 gloo groups (3 threads each) alive for the life of the worker.
    """
    from megatron.core.distributed import DistributedDataParallel

    init = DistributedDataParallel.__init__
    if getattr(init, "_gloo_pool_tracked", False):
        return

    def tracked_init(self, *args, **kwargs):
        _ddp_instances.add(self)
        init(self, *args, **kwargs)

    tracked_init._gloo_pool_tracked = True
    tracked_init.__wrapped__ = init
    DistributedDataParallel.__init__ = tracked_init


def _release_ddp_instances() -> None:
    """Break the hook cycle of every DDP a task built (see ``_track_ddp_instances``).

    The hooks stay registered on their ``AccumulateGrad`` nodes but now close over
    an empty object, so the model, optimizer state and groups are freed by reference
    counting as soon as the task's own references are gone. A DDP must not outlive
    its task anyway: its process groups are destroyed with the task's state.
    """
    for ddp in list(_ddp_instances):
        ddp.__dict__.clear()
    _ddp_instances.clear()


def _cleanup_megatron_state() -> None:
    """Forget Megatron's parallel state and destroy the groups it created.

    ``destroy_model_parallel`` only drops Megatron's references; every gloo group keeps
    its threads (one ``gloo_tcp_loop``, two ``pt_gloo_runloop``) until the last
    Python reference to it is gone, and a long-lived worker that initialises parallel
    state once per task would otherwise accumulate thousands of threads (about 2,100
    in one gloo2 worker by the end of the suite). Destroying a group removes it from
    ``pg_map`` but does not stop its threads; dropping every reference does. The
    references Megatron keeps past a task are released here:

    * the DDP hook cycle (``_release_ddp_instances``);
    * ``RotaryEmbedding.forward``'s class-level ``lru_cache`` (and its subclasses'),
      whose keys hold the module and its ``cp_group``: one group per ``train()``;
    * globals ``destroy_model_parallel`` does not reset
      (``_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP[_GLOO]`` in 0.16);
    * the MoE logging tracker's ``reduce_group`` entries.
    """
    import torch.distributed as dist
    from megatron.core import num_microbatches_calculator, parallel_state
    from megatron.core.models.common.embeddings import rotary_pos_embedding
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    _release_ddp_instances()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    for name, value in list(vars(parallel_state).items()):
        if name.startswith("_") and name.isupper() and isinstance(value, dist.ProcessGroup):
            setattr(parallel_state, name, None)
    classes = [rotary_pos_embedding.RotaryEmbedding]
    while classes:   # with its subclasses (YaRN has a cache of its own)
        cls = classes.pop()
        classes.extend(cls.__subclasses__())
        cached = cls.__dict__.get("forward")
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()
    moe_utils.get_moe_layer_wise_logging_tracker().clear()
    num_microbatches_calculator.destroy_num_microbatches_calculator()
    # Process-global in Megatron: a scale left by one task (a 0-d tensor when a bare
    # MoELayer ran backward) would clash with the next task's schedule ([1]).
    MoEAuxLossAutoScaler.main_loss_backward_scale = None
    world = dist.group.WORLD
    for group in list(dist.distributed_c10d._world.pg_map):
        if group is not world:
            dist.destroy_process_group(group)


def _worker(rank: int, world_size: int, port: int, tasks, results) -> None:
    import torch.distributed as dist

    init_local_rank(rank, world_size, port)
    _track_ddp_instances()
    # Threads that outlive a task (after the cleanup) are released by a full garbage
    # collection when they can be: some models leave their groups in plain reference
    # cycles. What survives one becomes the new baseline, so a task that leaves
    # nothing behind costs no collection.
    results.put((rank, "ready", None))   # (starts the queue's feeder thread)
    baseline = thread_count()
    # A task's changes to the environment are undone after it: Megatron-Bridge's training
    # exports its recipe's variables and the attention backend's NVTE_* flags, which the
    # next task's Megatron then reads (and refuses for another backend).
    environment = dict(os.environ)
    parent = os.getppid()
    while True:
        try:
            task = tasks.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent:  # the test process is gone: do not linger
                break
            continue
        if task is None:
            break
        task_id, module_name, qualname, search_paths, args, kwargs = task
        # A task's environment variables end with it: Megatron sets NVTE_* for the
        # attention backend it is given, Bridge its recipes' env_vars, and the next
        # task's Megatron checks them against its own choice.
        environment = dict(os.environ)
        try:
            fn = _resolve(module_name, qualname, search_paths)
            results.put((rank, task_id, (True, fn(*args, **kwargs))))
        except BaseException:  # noqa: BLE001 - every failure goes back to the caller
            results.put((rank, task_id, (False, traceback.format_exc())))
        finally:
            os.environ.clear()
            os.environ.update(environment)
            _cleanup_megatron_state()
            if os.environ != environment:
                os.environ.clear()
                os.environ.update(environment)
            if thread_count() > baseline:
                gc.collect()
                baseline = max(baseline, thread_count())
    dist.destroy_process_group()


class GlooPool:
    """``world_size`` long-lived gloo ranks that run module-level functions."""

    def __init__(self, world_size: int, start_timeout: float = 120.0) -> None:
        self.world_size = world_size
        self.start_timeout = start_timeout
        self._ctx = mp.get_context("spawn")
        self._procs: list = []
        self._task_queues: list = []
        self._results = None
        self._next_task = 0
        atexit.register(self.close)  # idempotent; workers also exit when we disappear

    # -- lifecycle -----------------------------------------------------------
    def _start(self) -> None:
        port = free_port()
        self._results = self._ctx.Queue()
        self._task_queues = [self._ctx.Queue() for _ in range(self.world_size)]
        self._procs = [
            self._ctx.Process(
                target=_worker,
                args=(rank, self.world_size, port, self._task_queues[rank], self._results),
                # Not daemonic: dist_checkpointing's writer starts a multiprocessing
                # Manager, which daemonic processes may not do. Workers exit on
                # close(), at interpreter exit, or when their parent disappears.
                daemon=False,
            )
            for rank in range(self.world_size)
        ]
        for proc in self._procs:
            proc.start()
        ready = self._collect("ready", self.start_timeout)
        failed = [r for r, v in ready.items() if v is not None]
        if failed or len(ready) != self.world_size:
            self.close()
            raise TaskFailed(f"gloo pool of {self.world_size} failed to start")

    def close(self) -> None:
        for q in self._task_queues:
            with contextlib.suppress(OSError, ValueError):
                q.put(None)
        deadline = time.monotonic() + 5
        for proc in self._procs:
            proc.join(timeout=max(deadline - time.monotonic(), 0.1))
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        self._procs, self._task_queues, self._results = [], [], None

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    # -- running tasks ---------------------------------------------------------
    def _collect(self, task_id: Any, timeout: float) -> dict[int, Any]:
        got: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while len(got) < self.world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, tid, payload = self._results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                if not all(p.is_alive() for p in self._procs):
                    break
                continue
            if tid == task_id:
                got[rank] = payload
                if isinstance(payload, tuple) and payload and payload[0] is False:
                    # One rank failed: give the others a moment to report, then stop.
                    deadline = min(deadline, time.monotonic() + 5)
        return got

    def run(self, fn: Callable, *args: Any, timeout: float = 300.0, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results by rank."""
        if not self.alive:
            self.close()
            self._start()
        self._next_task += 1
        task_id = self._next_task
        module = sys.modules.get(fn.__module__)
        search = [os.path.dirname(os.path.abspath(module.__file__))] if module else []
        for q in self._task_queues:
            q.put((task_id, fn.__module__, fn.__qualname__, search, args, kwargs))
        got = self._collect(task_id, timeout)
        errors = [f"--- rank {r} ---\n{v[1]}" for r, v in sorted(got.items()) if not v[0]]
        if errors or len(got) != self.world_size:
            missing = sorted(set(range(self.world_size)) - set(got))
            self.close()  # ranks may be stuck in a collective: restart on next use
            reason = f"ranks {missing} did not finish within {timeout:.0f} s\n" if missing else ""
            raise TaskFailed(f"{fn.__qualname__} failed on {self.world_size} ranks:\n"
                             f"{reason}" + "\n".join(errors))
        return [got[r][1] for r in range(self.world_size)]
