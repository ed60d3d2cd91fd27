"""benchmarks/studies/retention_bias.py's measurement (lrmoe_studies.retention_bias)
at a tiny shape: properties that hold whatever the numbers (docs/benchmarks.md, "Retention
bias", reads the full-size table).

- gamma = inf is the reference itself: zero bias, zero spread.
- The router weight gradient is exact under every rule (docs/design.md, "Exactness" 3).
- `uniform` is unbiased (w = n / q): its measured bias is noise, within a few standard
  errors sd / sqrt(seeds) of zero (4 here: the draws are fixed by the seeds, so the test
  is deterministic; the margin is for a change of the generator).
- `topk` is deterministic: zero spread over seeds. (Its norm ratio ||G_topk|| / ||G||
  is not bounded by 1: dropping terms of a sum can lengthen it when the dropped terms
  point against the kept ones, so no such bound is asserted.)
- The quotas are the plan's, not the rule's: every rule retains the same pairs per expert.
"""

from __future__ import annotations

import math

from lrmoe_studies import retention_bias as rb

SEEDS = 48


def _measure():
    cfg = rb.Config(hidden=16, ffn=24, experts=8, topk=2, tokens_per_rank=64, micro_batch=4,
                    ep=1, seeds=SEEDS, skew=1.7, batches=2,
                    settings=(rb.Setting("ref", math.inf), rb.Setting("topk", 0.5, "topk"),
                              rb.Setting("uniform", 0.5, "uniform")),
                    across=("topk", "uniform"))
    return cfg, rb.measure(cfg)


def test_retention_bias_properties(gloo1):
    [per_rank] = gloo1.run(_measure, timeout=300)
    cfg, result = per_rank
    summary = rb.summarize([result], cfg)
    assert rb.format_tables(summary, cfg)     # the report renders
    st = summary["settings"]
    assert result["skew"]["expert_skew"] >= 1.5   # routing is skewed as asked

    for row in st["ref"]["groups"].values():
        assert row["retained"] == 1.0, row
    for row in [*st["ref"]["groups"].values(), st["ref"]["router"], st["ref"]["dx"]]:
        assert row["bias"] == 0.0 and row["sd"] == 0.0, row

    for label in ("topk", "uniform"):
        router = st[label]["router"]
        assert router["bias"] < 1e-5 and router["sd"] < 1e-5, (label, router)

    hot = next(g for g in summary["groups"] if g.startswith("hot"))
    assert st["uniform"]["groups"][hot]["retained"] < 1.0     # drops happened
    assert st["uniform"]["seeds"] == SEEDS
    for group, row in st["uniform"]["groups"].items():
        if row["retained"] < 1.0:
            assert row["se"] > 0.0, (group, row)
        assert row["bias"] <= 4 * row["se"] + 1e-9, (group, row)

    for group, row in st["topk"]["groups"].items():
        assert row["sd"] == 0.0, (group, row)
    assert st["topk"]["groups"][hot]["bias"] > 0.0
    for e, row in st["topk"]["experts"].items():
        assert row["retained"] == st["uniform"]["experts"][e]["retained"], e
    assert summary["across"]["topk"][hot]["err"] > 0.0
