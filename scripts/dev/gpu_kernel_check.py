"""The compiled kernels of one device against their pure-torch references.

    python scripts/dev/gpu_kernel_check.py [--device cuda] [--edge] [--small]
                                                  # (scripts/gpu_check.sh runs it)

``select_rows`` (every rule; with and without ``n_kept``), ``combine_rows``,
``combine_rows_backward`` and ``scatter_add_rows`` on the device's backend ("cuda", or
"cpu" with ``--device cpu``) against ``*_reference`` on the CPU, on random inputs:

- select_rows and combine_rows bitwise (fixed recipes, no atomics); the backward's
  kept rows bitwise and its dot products close (a warp's summation order is not the
  CPU's); scatter_add_rows bitwise where destinations are unique, else within the
  per-add rounding bound (the CUDA kernel adds with atomics, in no fixed order).
- Shapes (the default): the edge shapes below, a realistic pair count (8192 tokens x
  top-8: P 65536), a full hidden width (2048) and 600,000 rows: past the CUDA kernels'
  65,536-block grid cap at narrow rows, where their grid-stride loops run. The CPU
  references of the large cases take a few seconds on 16 cores.
- int64 and int32 indices (scatter_add_rows' repeated destinations, combine_rows' order).
- ``--edge``: only the edge shapes (no rows, one row, one destination, H 1, odd H,
  rows one past a block, empty cells, quotas 0 and above the cell size, 600,000 narrow
  rows): what scripts/gpu_check.sh runs under compute-sanitizer's
  memcheck, where every kernel runs instrumented.
- ``--small``: the default set without its largest cases (a CPU run of this script).

Exit status 0 when every case passed, 1 when one failed, 2 without the device or
without the compiled kernels for it.
"""

from __future__ import annotations

import argparse
import sys

import torch

from megatron_lrmoe.ops import (
    combine_rows,
    combine_rows_backward,
    combine_rows_backward_reference,
    combine_rows_reference,
    cuda_kernels_available,
    describe_backend,
    kernels_available,
    scatter_add_rows,
    scatter_add_rows_reference,
    select_rows,
    select_rows_reference,
)

LARGE_ROWS = 600_000
# Relative rounding step of one add, per dtype (the atomic path's error bound).
EPS = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class Checker:
    """Runs the cases on one backend and counts failures."""

    def __init__(self, device: torch.device, mode: str) -> None:
        self.dev, self.mode = device, mode
        self.backend = device.type
        self.g = torch.Generator().manual_seed(0)
        self.failures: list[str] = []

    def check(self, name: str, ok: bool, detail: str = "") -> None:
        print(f"{'ok  ' if ok else 'FAIL'} {name} {detail}".rstrip(), flush=True)
        if not ok:
            self.failures.append(name)

    def on_device(self, t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(self.dev)

    # -- select_rows -------------------------------------------------------------------

    def select_sizes(self) -> list[torch.Tensor]:
        g = self.g
        edge = [torch.zeros(4, dtype=torch.long),              # no rows, four empty cells
                torch.tensor([1]),                               # one row, one cell
                torch.tensor([257, 0, 3])]                       # a block and a row past it
        if self.mode == "edge":
            return [*edge, torch.full((512,), LARGE_ROWS // 512)]
        mixed = []
        for _ in range(3):
            sizes = torch.randint(0, 300, (64,), generator=g)
            sizes[:3] = torch.tensor([0, 1, 5000])
            mixed.append(sizes)
        big = [] if self.mode == "small" else [torch.randint(0, 2 * LARGE_ROWS // 1024, (1024,),
                                                             generator=g)]
        return edge + mixed + big

    def select(self) -> None:
        g = self.g
        rules = (("topk", 0.5), ("sample", 0.5), ("uniform", 0.5), ("hybrid", 0.29),
                 ("hybrid", 1.0))
        for seed, sizes in enumerate(self.select_sizes()):
            off = torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)])
            p = int(off[-1])
            metric = torch.rand(p, generator=g)
            metric[::7] = 0.0
            if p:
                metric[1::5] = metric[0]                         # ties
            quotas = (sizes.double() * torch.rand(sizes.numel(), generator=g)).long()
            if sizes.numel() > 4:
                quotas[3], quotas[4] = 0, 10**6                  # none kept, all kept
            for rule, fraction in rules:
                ref = select_rows_reference(metric, off, quotas, rule=rule, seed=seed,
                                            hybrid_fraction=fraction)
                name = f"select_rows {rule} f={fraction} C={sizes.numel()} P={p}"
                for n_kept in (None, int(ref[0].numel())):
                    # n_kept given (the region's plan): the CUDA path without a host read.
                    got = select_rows(self.on_device(metric), self.on_device(off),
                                      self.on_device(quotas), rule=rule, seed=seed,
                                      backend=self.backend, hybrid_fraction=fraction,
                                      n_kept=n_kept)
                    same = all(a.device.type == self.dev.type and torch.equal(a.cpu(), b)
                               for a, b in zip(got, ref, strict=True))
                    self.check(name + (" with n_kept" if n_kept is not None else ""), same)

    # -- combine_rows and its backward -------------------------------------------------

    def combine_shapes(self) -> list[tuple[int, int, int]]:
        edge = [(0, 3, 8), (5, 1, 3), (1, 1, 1), (1000, 997, 33), (300, 40, 257),
                (LARGE_ROWS, 540_000, 1)]
        if self.mode == "edge":
            return edge
        full = [(65536, 8192, 128), (2048, 1024, 2048), (LARGE_ROWS, 540_000, 8),
                (1000, 997, 130)]
        return edge[:-1] + (full[-1:] if self.mode == "small" else full)

    def combine(self) -> None:
        g = self.g
        for dtype in DTYPES:
            for p, t, h in self.combine_shapes():
                src = torch.randn(p, h, generator=g).to(dtype)
                token = torch.randint(0, t, (p,), generator=g)
                order = torch.sort(token, stable=True).indices
                offsets = torch.searchsorted(token[order], torch.arange(t + 1))
                # fp32 scales with int64 order, src-dtype scales with int32 order.
                for scale, idx in ((torch.rand(p, generator=g), order),
                                   (torch.rand(p, generator=g).to(dtype), order.int())):
                    ref = combine_rows_reference(src, scale, order, offsets)
                    out = combine_rows(*map(self.on_device, (src, scale, idx, offsets)),
                                       backend=self.backend)
                    self.check(f"combine_rows {dtype} P={p} T={t} H={h} scale={scale.dtype} "
                               f"order {idx.dtype}",
                               out.device.type == self.dev.type and torch.equal(out.cpu(), ref))
                dy = torch.randn(t, h, generator=g).to(dtype)
                prob = torch.rand(p, generator=g)
                kept = torch.randperm(p, generator=g)[: p // 2].sort().values
                kept_row = torch.full((p,), -1, dtype=torch.long)
                kept_row[kept] = torch.arange(kept.numel())
                w = torch.rand(kept.numel(), generator=g) + 0.5
                for s, ww, k in ((None, None, p), (kept_row, w, kept.numel())):
                    d_ref, o_ref = combine_rows_backward_reference(dy, src, token, prob, s, ww, k)
                    d_got, o_got = combine_rows_backward(
                        *map(self.on_device, (dy, src, token, prob, s, ww)), k,
                        backend=self.backend)
                    tol = 1e-4 if dtype == torch.float32 else 2e-2
                    self.check(f"combine_rows_backward {dtype} P={p} K={k} H={h}",
                               torch.equal(o_got.cpu(), o_ref)
                               and torch.allclose(d_got.cpu(), d_ref, rtol=tol,
                                                  atol=tol * h ** 0.5))

    # -- scatter_add_rows --------------------------------------------------------------

    def scatter_shapes(self) -> list[tuple[int, int, int]]:
        edge = [(8, 0, 4), (1, 257, 5), (3, 500, 33), (300, 50, 700), (5, 1, 1),
                (64, LARGE_ROWS, 1)]
        if self.mode == "edge":
            return edge
        full = [(4096, 4096, 512), (2048, 16384, 512), (64, LARGE_ROWS, 8)]
        return edge[:-1] + ([] if self.mode == "small" else full)

    def scatter(self) -> None:
        g = self.g
        for dtype in DTYPES:
            for n, m, h in self.scatter_shapes():
                out0 = torch.randn(n, h, generator=g).to(dtype)
                src = torch.randn(m, h, generator=g).to(dtype)
                for unique in (True, False):
                    if unique and m > n:
                        continue
                    idx = (torch.randperm(n, generator=g)[:m] if unique
                           else torch.randint(0, n, (m,), generator=g))
                    if not unique:
                        idx = idx.int()                          # the int32 instantiation
                    for scale in (None, torch.rand(m, generator=g)):
                        ref = scatter_add_rows_reference(out0, idx.long(), src, scale)
                        out = out0.to(self.dev)
                        scatter_add_rows(out, *map(self.on_device, (idx, src, scale)),
                                         backend=self.backend)
                        out = out.cpu()
                        name = (f"scatter_add_rows {dtype} N={n} M={m} H={h} {idx.dtype} "
                                f"{'unique' if unique else 'repeated'} "
                                f"scale={scale is not None}")
                        if unique:
                            self.check(name, torch.equal(out, ref))
                            continue
                        terms = src.double().abs() * (1.0 if scale is None
                                                      else scale.double()[:, None])
                        mag = out0.double().abs().index_add(0, idx.long(), terms)
                        adds = torch.bincount(idx.long(), minlength=n).double()[:, None] + 1
                        bound = adds * EPS[dtype] * mag + 1e-30
                        err = (out.double() - ref.double()).abs()
                        self.check(name, bool((err <= 2 * bound).all()),
                                   f"(max err / bound {float((err / bound).max()):.3g})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--edge", action="store_true", help="edge shapes only (memcheck)")
    mode.add_argument("--small", action="store_true", help="without the largest cases")
    args = p.parse_args(argv)
    if args.device == "cuda" and not (torch.cuda.is_available() and cuda_kernels_available()):
        print("gpu_kernel_check: no CUDA device, or megatron_lrmoe._kernels built without "
              "CUDA: nothing checked", file=sys.stderr)
        return 2
    if not kernels_available():
        print("gpu_kernel_check: megatron_lrmoe._kernels did not import: build it first "
              "(python setup.py build_ext --inplace)", file=sys.stderr)
        return 2
    print(describe_backend(args.device, args.device), flush=True)
    checker = Checker(torch.device(args.device),
                      "edge" if args.edge else "small" if args.small else "full")
    with torch.no_grad():
        checker.select()
        checker.combine()
        checker.scatter()
    print(f"\n{len(checker.failures)} failure(s)")
    return 1 if checker.failures else 0


if __name__ == "__main__":
    sys.exit(main())
