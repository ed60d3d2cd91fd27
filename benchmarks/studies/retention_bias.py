"""Bias and variance of LRMoE's retained backward against the dropless gradient.

    .venv/bin/python benchmarks/studies/retention_bias.py --out benchmarks/results/retention_bias.md

A measurement, not a timing (docs/benchmarks.md, "Retention bias" reads it). One LRMoE layer at the
time-to-loss study's shape (hidden 384, expert FFN 1024, 16 experts top-2, SwiGLU, no
bias, fp32) on EP gloo ranks in this process's worker pool (default EP=2 on 2 ranks, as
in the study: retention is planned per rank, so at EP=1 gamma 1.0 would drop nothing),
one micro-batch per rank. Every setting runs the same layer weights, inputs and output
gradient dy; only the backward retention differs. gamma = inf is the reference: its
gradients are Megatron's dropless ones (docs/design.md, "Exactness").

Inputs: x_t = s_t (z_t + mu), z_t ~ N(0, I), mu a fixed direction of norm
``Config.mean_norm`` (0.5) x sqrt(H) shared by all tokens, s_t ~ lognormal(0,
``Config.scale_sigma`` (0.5)).
Skew: the router's weight gets b_e mu/||mu|| added to expert e's row, b_e = beta x (a
linear grade from +1 at expert 0 to -1 at the last expert), with beta found by bisection
so that the routed load max/mean over ranks (over experts at EP=1) is ``--skew``; the
table reports both. dy: the gradient of the mean cross-entropy of a fixed random readout
y W_out [H, 256] against targets argmax(x_t W_teacher) (a fixed random teacher), so
dy depends on the tokens and on the layer output.

Draws: each seed of a random rule is one training step of the layer (``finish_step()``
between passes moves the step seed, as in training; docs/design.md, "Selection rules").
Deterministic settings run twice (their standard deviation must be 0).

Per setting and expert group (experts sorted by routed load: the 4 hottest, the next 4,
the other 8), with G the dropless gradient of the group's W1 and W2 (concatenated),
G_hat a setting's, E over seeds:
retained = kept / routed pairs; bias = ||E G_hat - G|| / ||G||; se = sd / sqrt(seeds),
the noise floor of that bias estimate (an unbiased rule's measured bias is about se);
sd = sqrt(E ||G_hat - E G_hat||^2) / ||G|| (unbiased over seeds); cos = cos(E G_hat, G);
norm = ||E G_hat|| / ||G||; par = <E G_hat, G> / ||G||^2 (the share of G that E G_hat
keeps: 1 - par is a shrink along G) and perp = ||E G_hat - par G|| / ||G|| (the error
orthogonal to G: a change of direction); bias^2 = (1 - par)^2 + perp^2. The router
weight gradient (summed over ranks, as DDP does) and dX get the same columns.
``batch`` is the dropless gradient of a second, independent micro-batch against the
first, ||G2 - G|| / ||G||: the sampling noise the optimizer already sees from one
micro-batch to the next.

Systematic or not: a per-batch bias that changes direction from one micro-batch to the
next averages out over steps like noise. Over ``--batches`` further micro-batches (one
pass and one draw each) the table "across" gives the error of the batch-averaged
gradient and the coherence of the errors (formulas in ``_across_ratios``).

``--sweep`` repeats topk 1.0, topk 0.75 and uniform 0.75 at further skews (default 1.3
and 1.9) and tabulates the hottest experts' figures against the skew. About 5 minutes
on 2 CPU cores with the defaults.
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path

# The measurement and its tables; the pool's workers import the task and unpickle its
# Config by this module name.
from lrmoe_studies import retention_bias as rb
from megatron_lrmoe.tools.provenance import code_version


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=rb.Config.seeds)
    ap.add_argument("--ep", type=int, default=rb.Config.ep)
    ap.add_argument("--tokens-per-rank", type=int, default=rb.Config.tokens_per_rank)
    ap.add_argument("--hidden", type=int, default=rb.Config.hidden)
    ap.add_argument("--ffn", type=int, default=rb.Config.ffn)
    ap.add_argument("--skew", type=float, default=rb.Config.skew,
                    help="routed load max/mean to reach: over ranks (over experts at EP=1)")
    ap.add_argument("--batches", type=int, default=rb.Config.batches,
                    help="further micro-batches for the systematic-error table (0: none)")
    ap.add_argument("--sweep", default="1.3,1.9",
                    help="further skews for the hot experts' summary (comma-separated; '' none)")
    ap.add_argument("--only", default=None,
                    help="comma-separated setting labels (default: all)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    from lrmoe_testing.gloo_pool import GlooPool

    settings = rb.SETTINGS if args.only is None else tuple(
        s for s in rb.SETTINGS if s.label in args.only.split(",") or math.isinf(s.gamma))
    cfg = rb.Config(hidden=args.hidden, ffn=args.ffn, tokens_per_rank=args.tokens_per_rank,
                    ep=args.ep, seeds=args.seeds, skew=args.skew, settings=settings,
                    batches=args.batches)

    started = time.perf_counter()
    pool = GlooPool(cfg.ep)
    try:
        per_rank = pool.run(rb.measure, cfg, timeout=3600)
        sweep = []
        for skew in [float(v) for v in args.sweep.split(",") if v]:
            sub = replace(cfg, skew=skew, seeds=min(cfg.seeds, 16), batches=min(cfg.batches, 8),
                          settings=tuple(s for s in rb.SETTINGS if s.label in rb.SWEEP_SETTINGS),
                          across=rb.SWEEP_SETTINGS)
            sweep.append((sub, rb.summarize(pool.run(rb.measure, sub, timeout=3600), sub)))
    finally:
        pool.close()
    summary = rb.summarize(per_rank, cfg)
    text = rb.format_tables(summary, cfg)
    if sweep:
        text += "\n\n" + rb.format_sweep([(cfg, summary), *sweep])
    print(rb.describe(summary, cfg))
    print(text)
    print(f"({time.perf_counter() - started:.0f} s)")
    if args.out:
        command = " ".join(shlex.quote(a) for a in [".venv/bin/python", *sys.argv])
        args.out.write_text("\n".join([
            "# Retention bias and variance: LRMoE's expert gradients against dropless", "",
            f"- command: `{command}`", f"- code: {code_version()}",
            f"- layer: {rb.describe(summary, cfg)}",
            "- columns: docstring of `benchmarks/studies/retention_bias.py`; reading: "
            "`docs/benchmarks.md`, \"Retention bias\"", "", text, ""]))
        print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
