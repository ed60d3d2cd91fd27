"""The EP regime statistic (lrmoe_studies.ep_regime): the hot rank's load per call,
contiguous and under SYMI-style placement, against hand arithmetic and brute force."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from lrmoe_studies import ep_regime
from megatron_lrmoe.data.routing_traces import RoutingTrace

# R = 2 ranks, E = 4 experts (0, 1 at home on rank 0; 2, 3 on rank 1), one micro-batch per
# step, 2 sources: [step, micro-batch, source, expert].
COUNTS = np.array([
    [[[5, 0, 0, 0], [5, 1, 1, 0]]],     # step 1: expert totals 10, 1, 1, 0
    [[[6, 0, 1, 1], [6, 2, 0, 1]]],     # step 2: 12, 2, 1, 2
])


def brute_force_max_over_mean(totals: list[int], ranks: int, replicas: list[tuple[int, int]]
                              ) -> float:
    """The least largest rank load over every split of each expert's pairs among its
    instances (home plus replicas), over the mean."""
    per_rank = len(totals) // ranks
    hosts = [[e // per_rank] + [r for x, r in replicas if x == e] for e in range(len(totals))]
    best = None
    # every way to give each pair of expert e to one of its hosts, counted per host
    choices = [[c for c in itertools.product(range(n + 1), repeat=len(h)) if sum(c) == n]
               for n, h in zip(totals, hosts, strict=True)]
    for split in itertools.product(*choices):
        load = [0] * ranks
        for part, h in zip(split, hosts, strict=True):
            for amount, r in zip(part, h, strict=True):
                load[r] += amount
        best = max(load) if best is None else min(best, max(load))
    return best / (sum(totals) / ranks)


def test_placed_load_is_the_best_split_over_the_replicas_of_the_earlier_steps():
    placed = ep_regime.popularity_max_over_mean(COUNTS, ranks=2, extra_slots=1)
    # Step 1 has no history: Megatron's layout, ranks 11 and 1.
    assert placed[0, 0] == pytest.approx(11 / 6)
    assert placed[0, 0] == pytest.approx(brute_force_max_over_mean([10, 1, 1, 0], 2, []))
    # Step 2: from step 1's loads (10, 1, 1, 0) the divisor method gives experts 0 and 1
    # a second instance; rank 1's one free slot takes expert 0's, expert 1's finds no rank
    # without it. Splitting expert 0's 12 pairs: ranks 2 + 7 and 3 + 5, max 9 of mean 8.5.
    assert placed[1, 0] == pytest.approx(9 / 8.5)
    assert placed[1, 0] == pytest.approx(brute_force_max_over_mean([12, 2, 1, 2], 2, [(0, 1)]))
    # No extra slot: nothing moves.
    static = ep_regime.popularity_max_over_mean(COUNTS, ranks=2, extra_slots=0)
    assert static[:, 0] == pytest.approx([11 / 6, 14 / 8.5])


def test_regime_reports_tokens_per_call_and_quantiles_over_the_calls():
    header = {"model": {"num_experts": 4, "topk": 2, "moe_layers": [1]},
              "parallel": {"ep": 2, "world_size": 2, "tokens_per_source": 6,
                           "microbatches_per_step": 1}}
    trace = RoutingTrace(header, np.array([1, 2]), COUNTS[:, None])
    row = ep_regime.regime(trace)
    assert (row["tokens_per_rank"], row["tokens_per_call"], row["calls"]) == (6, 12, 2)
    assert row["pairs_per_expert"] == pytest.approx(12 * 2 / 4)
    assert row["contiguous"]["median"] == pytest.approx(np.median([11 / 6, 14 / 8.5]))
    assert row["placed"]["median"] == pytest.approx(np.median([11 / 6, 9 / 8.5]))
    # linear interpolation between the two calls, 14 / 8.5 < 11 / 6
    assert row["contiguous"]["p90"] == pytest.approx(14 / 8.5 + 0.9 * (11 / 6 - 14 / 8.5))
    assert 1.0 <= row["uniform"]["median"] <= 2.0      # 2 ranks: max/mean is at most 2
    with pytest.raises(ValueError, match="3 sources per call, not the 2 ranks"):
        ep_regime.popularity_max_over_mean(np.zeros((1, 1, 3, 4), int), 2, 1)
