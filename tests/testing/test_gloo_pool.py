"""The gloo test pool (workshop/lrmoe_testing/gloo_pool.py) releases what a task built.

Its workers live for the whole suite, so every process group a task leaves alive keeps
its gloo threads (one TCP loop and two run loops each, all polling) until the end: one
leaked ``train()`` per task once grew a gloo2 worker to about 2,100 threads. Threads
are counted from ``/proc`` (``threading.active_count()`` does not see C++ threads).
A task's changes to the environment are undone after it, too.
"""

from __future__ import annotations

import os

TINY = [
    "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
    "--ffn-hidden-size", "64", "--seq-length", "32", "--max-position-embeddings", "32",
    "--position-embedding-type", "rope", "--num-experts", "4", "--moe-router-topk", "2",
    "--moe-ffn-hidden-size", "32", "--moe-token-dispatcher-type", "alltoall",
    "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3",
    "--train-iters", "2", "--lr-warmup-iters", "0", "--eval-iters", "0", "--split", "95,5,0",
    "--log-interval", "1", "--no-progress-bar", "--expert-model-parallel-size", "2",
]


def _threads_and_groups() -> tuple[int, int]:
    import torch.distributed as dist

    from lrmoe_testing.gloo_pool import thread_count

    return thread_count(), len(dist.distributed_c10d._world.pg_map)


def _initialise_twice_and_train(argv: list[str]) -> int:
    """Initialise Megatron's parallel state, drop it, then train (which initialises it
    again and builds a DDP model, an optimizer and a rotary embedding)."""
    from megatron.core import parallel_state as ps

    from megatron_lrmoe.launcher.arguments import parse_args
    from megatron_lrmoe.launcher.distributed import initialize_distributed
    from megatron_lrmoe.launcher.pretrain import train

    args = parse_args(argv)
    initialize_distributed(args)
    ps.destroy_model_parallel()
    return len(train(args)["losses"])


def test_tasks_that_initialise_twice_leave_no_threads(gloo2, corpus):
    argv = TINY + ["--data-path", corpus]
    assert gloo2.run(_initialise_twice_and_train, argv, timeout=300) == [2, 2]
    before = gloo2.run(_threads_and_groups)      # after one run: one-time threads started
    for _ in range(2):
        gloo2.run(_initialise_twice_and_train, argv, timeout=300)
    after = gloo2.run(_threads_and_groups)
    pairs = zip(before, after, strict=True)
    for rank, ((threads_before, _), (threads_after, groups)) in enumerate(pairs):
        assert groups == 1, f"rank {rank}: {groups - 1} groups besides WORLD survived"
        assert threads_after <= threads_before, (
            f"rank {rank}: {threads_after - threads_before} threads leaked by 2 tasks")


def _set_environment():
    os.environ["LRMOE_POOL_PROBE"] = "set by a task"
    os.environ.pop("OMP_NUM_THREADS")


def _environment():
    return os.environ.get("LRMOE_POOL_PROBE"), os.environ.get("OMP_NUM_THREADS")


def test_a_tasks_environment_changes_are_undone(gloo2):
    gloo2.run(_set_environment)
    assert gloo2.run(_environment) == [(None, "1")] * 2
