"""The launcher with --moe-lrmoe: training under EP, EP x PP (1F1B), TP+SP x EP;
exact resume; checkpoints interchangeable with plain Megatron runs."""

from __future__ import annotations

import pytest

from tests.launcher.test_launcher import TINY, _decreased, _train

LRMOE = ["--moe-lrmoe", "--moe-lrmoe-bwd-capacity-factor", "0.75"]
NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0"]


def test_lrmoe_ep2_trains_and_reports(gloo2, corpus):
    results = gloo2.run(_train, TINY + LRMOE + [
        "--data-path", corpus, "--train-iters", "20", "--expert-model-parallel-size", "2",
        "--log-interval", "5",
    ], timeout=300)
    summary = results[0]
    assert _decreased(summary["losses"]), summary["losses"]
    assert results[1]["losses"] == summary["losses"]


def test_lrmoe_statistics_in_the_log(gloo2, corpus, tmp_path):
    import json

    log = tmp_path / "log.jsonl"
    gloo2.run(_train, TINY + LRMOE + [
        "--data-path", corpus, "--train-iters", "3", "--expert-model-parallel-size", "2",
        "--log-interval", "1", "--log-json", str(log),
    ], timeout=300)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    logged = [r for r in records if "lrmoe/retained-fraction" in r]
    assert [r["iteration"] for r in logged] == [1, 2, 3]
    for r in logged:
        assert 0.0 < r["lrmoe/retained-fraction"] < 1.0  # capacity 0.75 drops pairs
        assert 0.0 < r["lrmoe/dropped-contribution-fraction"] < 1.0
        assert r["lrmoe/backward-bytes-saved"] > 0
        ratios = []
        for n in (1, 2):
            assert 0.0 < r[f"lrmoe/layer{n}/retained-fraction"] < 1.0
            # Routed pairs per expert over all ranks, one step (one micro-batch per
            # rank, logged every step): 8 samples x 64 tokens x top-2.
            load = r[f"lrmoe/layer{n}/expert-load"]
            assert len(load) == 4 and sum(load) == 8 * 64 * 2
            # Static placement: experts 0, 1 on rank 0 and 2, 3 on rank 1. The logged
            # imbalance is that of the per-rank sums of the logged per-expert load.
            per_rank = [load[0] + load[1], load[2] + load[3]]
            ratio = max(per_rank) / (sum(per_rank) / 2)
            assert r[f"lrmoe/layer{n}/load-max-over-mean"] == pytest.approx(ratio, rel=1e-12)
            # One call per interval: the median call is that call.
            assert r[f"lrmoe/layer{n}/load-max-over-mean-median"] == pytest.approx(
                ratio, rel=1e-12)
            ratios.append(ratio)
        assert r["lrmoe/load-max-over-mean"] == pytest.approx(max(ratios), rel=1e-12)
        assert r["lrmoe/load-max-over-mean-median"] == pytest.approx(max(ratios), rel=1e-12)


def test_lrmoe_without_drops_matches_megatron_end_to_end(gloo2, corpus):
    base = TINY + NO_DROPOUT + ["--data-path", corpus, "--train-iters", "5",
                                "--expert-model-parallel-size", "2"]
    megatron = gloo2.run(_train, base, timeout=300)[0]["losses"]
    lrmoe = gloo2.run(_train, base + ["--moe-lrmoe", "--moe-lrmoe-bwd-capacity-factor", "inf"],
                      timeout=300)[0]["losses"]
    assert lrmoe == pytest.approx(megatron, rel=1e-5)


def test_lrmoe_ep2_pp2_1f1b_on_4_ranks(gloo4, corpus):
    results = gloo4.run(_train, TINY + LRMOE + [
        "--data-path", corpus, "--train-iters", "10", "--pipeline-model-parallel-size", "2",
        "--expert-model-parallel-size", "2", "--global-batch-size", "16",
    ], timeout=420)
    assert all(r["losses"] == results[0]["losses"] for r in results)
    assert _decreased(results[0]["losses"], margin=0.3), results[0]["losses"]


def test_lrmoe_tp2_sequence_parallel_ep2(gloo2, corpus):
    results = gloo2.run(_train, TINY + LRMOE + [
        "--data-path", corpus, "--train-iters", "15", "--tensor-model-parallel-size", "2",
        "--sequence-parallel", "--expert-model-parallel-size", "2",
        "--expert-tensor-parallel-size", "1",
    ], timeout=300)
    assert _decreased(results[0]["losses"]), results[0]["losses"]


def test_lrmoe_resume_with_dropout_is_bitwise_exact(gloo2, corpus, tmp_path):
    """With dropout the RNG state comes back too (placement policies, --no-load-rng and
    the final weights and planner states: tests/integration/test_step_state.py)."""
    selection = "uniform"
    base = TINY + LRMOE + ["--moe-lrmoe-selection", selection, "--data-path", corpus,
                           "--train-iters", "8", "--expert-model-parallel-size", "2",
                           "--use-distributed-optimizer"]
    straight = gloo2.run(_train, base, timeout=300)[0]["losses"]
    ckpt = str(tmp_path / "ckpt")
    gloo2.run(_train, base + ["--save", ckpt, "--exit-interval", "4"], timeout=300)
    resumed = gloo2.run(_train, base + ["--load", ckpt], timeout=300)[0]["losses"]
    assert resumed == straight[4:]


def test_checkpoints_move_between_megatron_and_lrmoe(gloo2, corpus, tmp_path):
    """Model and optimizer state of a plain Megatron run load into an LRMoE run and back.

    The LRMoE forward equals Megatron's, so after loading the same checkpoint both
    runs report the same loss on the same next batch (and, with nothing dropped, the
    same following steps).
    """
    base = TINY + NO_DROPOUT + ["--data-path", corpus, "--train-iters", "6",
                                "--expert-model-parallel-size", "2",
                                "--use-distributed-optimizer"]
    lrmoe = ["--moe-lrmoe", "--moe-lrmoe-bwd-capacity-factor", "inf"]
    plain_ckpt, lrmoe_ckpt = str(tmp_path / "plain"), str(tmp_path / "lrmoe")
    gloo2.run(_train, base + ["--save", plain_ckpt, "--exit-interval", "3"], timeout=300)
    megatron_next = gloo2.run(_train, base + ["--load", plain_ckpt], timeout=300)[0]["losses"]
    lrmoe_next = gloo2.run(_train, base + lrmoe + ["--load", plain_ckpt], timeout=300)[0]
    assert lrmoe_next["losses"] == pytest.approx(megatron_next, rel=1e-5)

    gloo2.run(_train, base + lrmoe + ["--save", lrmoe_ckpt, "--exit-interval", "3"],
              timeout=300)
    back = gloo2.run(_train, base + ["--load", lrmoe_ckpt], timeout=300)[0]["losses"]
    assert back == pytest.approx(megatron_next, rel=1e-5)
