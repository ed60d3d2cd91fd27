"""``runtime.local_gloo.run_on_local_ranks``: the production one-shot runner over local
gloo ranks (``calibrate --concurrency N`` and the layer's fixed cost use it)."""

from __future__ import annotations

import pytest

from megatron_lrmoe.runtime.local_gloo import LocalRanksFailed, run_on_local_ranks


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
