"""The LRMoE region at Qwen3-30B-A3B's size on a real device: the fake-CUDA cases, real tensors.

    python scripts/dev/region_at_scale_check.py [--ep 8] [--rank 3] [--tokens 4096]
        [--check-tokens 512] [--reps 10] [--device cuda]       # (scripts/gpu_check.sh runs it)

The cases of tests/layer/test_region_fake_cuda.py (gamma inf, 1.0,
0.75; uniform and topk; static and with replicas; and its case with expert biases,
``--biased``), the same plan from the qwen3 routing
trace's counts, run on real tensors by ``lrmoe_testing.cuda_harness
.run_case_on_device``: rank r's share of the EP plan as a 1-rank region (one process
cannot be rank r of a real group of 8; why, in that module). What it checks:

- the fake-CUDA test's checks, where they apply on real tensors
  (``check_device_record``): shapes, dtypes and device of every output and of every
  tensor the region made, no host read in the region, each grouped GEMM's rows per
  instance equal to the plan's routed (forward) and retained (backward) rows;
- and what only a GPU adds: forward and backward under
  ``torch.cuda.set_sync_debug_mode("error")`` (a sync inside an op or kernel raises);
  numerics against the CPU path (the same call, same seeded inputs, fp32 on the CPU
  with the pure-torch backend and the per-expert loop) at ``--check-tokens`` per rank;
  kernel speed (CUDA events, median of ``--reps``); the allocator's real peak.

Numerics tolerance (bf16): relative Frobenius error ||got - ref|| / ||ref|| <= 2e-2 per
tensor (y, dx, the router gradient, every dW and db). bf16 keeps 8 significant bits (unit
roundoff 2^-9 ~ 2e-3); the GEMMs accumulate in fp32 and each stored intermediate (z,
h, o, the gradients) is rounded once, so a handful of roundings along the chain stay
well below 1%; 2e-2 leaves margin without hiding a wrong row (which errs by O(1)). fp32
on the device: 1e-4. dx and dW are compared only where the kept rows do not depend on
values (gamma inf, or the ``uniform`` rule): ``topk`` below capacity ranks a metric
that bf16 perturbs, so its kept set may differ from fp32's near ties; y and the router
gradient are compared always.

Exit status: 0 all checks held, 1 a check failed, 2 no CUDA device (``--device cuda``).
``--device cpu`` runs the same code path on the CPU (tests; no sync or speed check).
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch

from lrmoe_testing.cuda_harness import (
    Case,
    check_device_record,
    compare_values,
    run_case_on_device,
)

TOLERANCE = {"bfloat16": 2e-2, "float32": 1e-4}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
GPU_ONLY = ("what only the GPU adds here: numerics of the CUDA kernels and bf16 grouped "
            "GEMMs against the fp32 CPU path; syncs inside kernels and ops "
            "(set_sync_debug_mode 'error'); kernel speed (CUDA events); real allocator peak")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--ep", type=int, default=8, help="EP size of the plan (default 8)")
    p.add_argument("--rank", type=int, default=None, help="rank whose share runs (default 3)")
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank at scale")
    p.add_argument("--check-tokens", type=int, default=512,
                   help="tokens per rank of the numerics comparison (CPU time); 0: none")
    p.add_argument("--gammas", default="inf,1.0,0.75")
    p.add_argument("--selections", default="uniform,topk")
    p.add_argument("--replicas", default="0,1", help="0: static, 1: with replicas")
    p.add_argument("--biased", default="0.75:uniform:1",
                   help="cases with expert biases, GAMMA:SELECTION:REPLICAS[,...] "
                        "('' for none)")
    p.add_argument("--dtype", default="bf16", choices=tuple(DTYPES))
    p.add_argument("--kernels", default="auto", help="the region's kernel backend")
    p.add_argument("--hidden", type=int, default=None, help="override the model's hidden")
    p.add_argument("--ffn", type=int, default=None, help="override the model's expert FFN")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def _cases(args: argparse.Namespace) -> list[Case]:
    plain = [Case(args.ep, math.inf if g == "inf" else float(g), s, r == "1")
             for g in args.gammas.split(",") for s in args.selections.split(",")
             for r in args.replicas.split(",")]
    biased = [Case(args.ep, math.inf if g == "inf" else float(g), s, r == "1", bias=True)
              for g, s, r in (spec.split(":") for spec in args.biased.split(",") if spec)]
    return plain + biased


def _numerics(case: Case, args, rank: int, device: str, at_scale) -> tuple[bool, str]:
    """The device run at ``--check-tokens`` against the CPU fp32 torch-backend run."""
    common = dict(tokens=args.check_tokens, hidden=args.hidden, ffn=args.ffn, seed=args.seed)
    got = at_scale if args.check_tokens == args.tokens else run_case_on_device(
        case, rank, device, dtype=DTYPES[args.dtype], kernels=args.kernels, **common)
    ref = run_case_on_device(case, rank, "cpu", dtype=torch.float32, kernels="torch",
                             grouped_gemm=False, **common)
    names = ["y", "dpair_prob"]
    if math.isinf(case.gamma) or case.selection == "uniform":
        names += [n for n in ref.values if n not in names]
    if set(names) - set(got.values):
        return False, "missing outputs"
    errors = compare_values(got.values, ref.values, names)
    tol = TOLERANCE[str(DTYPES[args.dtype]).removeprefix("torch.")]
    worst = max(errors, key=lambda n: errors[n][0])
    ok = all(rel <= tol for rel, _ in errors.values())
    return ok, f"{len(names)} tensors, worst {worst} {errors[worst][0]:.1e} (tol {tol:g})"


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("region_at_scale_check: no CUDA device (torch.cuda.is_available() is False); "
              "nothing checked. Run it on a GPU machine, or --device cpu for the CPU path.",
              file=sys.stderr)
        return 2
    rank = args.rank if args.rank is not None else min(3, args.ep - 1)
    dtype = DTYPES[args.dtype]
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    print(f"region at scale on {name}: EP {args.ep} plan, rank {rank}'s share as a 1-rank "
          f"region, {args.tokens} tokens/rank, {args.dtype}, kernels {args.kernels}, "
          f"numerics at {args.check_tokens} tokens/rank vs CPU fp32 (torch backend)",
          flush=True)
    header = (f"{'case':40} {'rows fwd/bwd':>13} {'grp':>3} {'checks':>6} {'sync':>5} "
              f"{'fwd ms':>8} {'bwd ms':>8} {'peak MiB':>8}  numerics")
    print(header + "\n" + "-" * len(header), flush=True)
    failures = 0
    for case in _cases(args):
        t0 = time.perf_counter()
        try:
            run = run_case_on_device(case, rank, args.device, tokens=args.tokens, dtype=dtype,
                                     kernels=args.kernels, hidden=args.hidden, ffn=args.ffn,
                                     reps=args.reps, warmup=args.warmup, seed=args.seed)
            bad = check_device_record(run.record, run.plan)
            if args.check_tokens:
                ok, detail = _numerics(case, args, rank, args.device, run)
            else:
                ok, detail = True, "not compared"
        except Exception as exc:            # one case's failure must not hide the others
            print(f"{case.name:40} FAILED: {type(exc).__name__}: {exc}", flush=True)
            failures += 1
            continue
        rec = run.record
        sync = ("-" if args.device != "cuda" else
                "ok" if all(v is None for v in rec["sync_errors"].values()) else "SYNC")
        sec = rec["seconds"]
        peak = "-" if rec["peak_bytes"] is None else f"{rec['peak_bytes'] / 2**20:.0f}"
        rows = f"{sum(rec['routed'])}/{sum(rec['retained'])}"
        print(f"{case.name:40} {rows:>13} {'y' if rec['grouped_gemm'] else 'n':>3} "
              f"{'ok' if not bad else 'FAIL':>6} {sync:>5} "
              f"{sec.get('forward', math.nan) * 1e3:8.2f} "
              f"{sec.get('backward', math.nan) * 1e3:8.2f} {peak:>8}  "
              f"{'ok' if ok else 'FAIL'} {detail} ({time.perf_counter() - t0:.1f} s)",
              flush=True)
        for b in bad:
            print(f"    check failed: {b}")
        failures += bool(bad) or not ok
    print(GPU_ONLY if args.device == "cuda" else
          "--device cpu: the same code path; no sync, speed or numerics-on-device check")
    print(f"{failures} failing case(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
