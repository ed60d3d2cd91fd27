"""``runtime.local_gloo.run_on_local_ranks``: the production one-shot runner over local
gloo ranks (``calibrate --concurrency N`` and the layer's fixed cost use it)."""

from __future__ import annotations

import pytest

from megatron_lrmoe.integration.runtime.local_gloo import LocalRanksFailed, run_on_local_ranks


def _sum_of_ranks(offset: int) -> tuple[int, int, int]:
    import torch
    import torch.distributed as dist

    total = torch.tensor([dist.get_rank() + offset])
    dist.all_reduce(total)
    return dist.get_rank(), dist.get_world_size(), int(total)


def _rank_one_raises() -> None:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("rank one says no")


def test_runs_once_on_every_rank_and_returns_results_by_rank():
    assert run_on_local_ranks(_sum_of_ranks, 2, 10, timeout=120) == [(0, 2, 21), (1, 2, 21)]


def test_a_rank_that_raises_fails_the_run_with_its_traceback():
    with pytest.raises(LocalRanksFailed, match="rank one says no"):
        run_on_local_ranks(_rank_one_raises, 2, timeout=120)


def _rank_one_finishes_later(seconds: float) -> int:
    import time

    import torch.distributed as dist

    if dist.get_rank() == 1:
        time.sleep(seconds)
    return dist.get_rank()


def test_a_rank_that_finishes_first_and_exits_does_not_end_the_run():
    # Rank 0 reports and exits seconds before rank 1 reports: both results come back.
    assert run_on_local_ranks(_rank_one_finishes_later, 2, 4.0, timeout=120) == [0, 1]
