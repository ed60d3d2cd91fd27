"""Deterministic mode on a device: the LRMoE backward's reductions give the same bits twice.

    python scripts/dev/determinism_check.py [--device cuda] [--large-rows 600000]

Importable (scripts/gpu_check.sh runs it; ``check_determinism`` returns a
``DeterminismResult`` whose ``lines`` say what was checked and ``status`` is "ok", "FAIL"
or "no device").

1. ``scatter_add_rows``, the token gradient's scatter-add, in deterministic mode (the
   compiled kernels of the device; on CUDA the sorted segment sum): for each case, two
   runs on the same inputs are bitwise equal; with keys, the rows permuted with their
   keys give bitwise the same result; and the result equals the CPU kernel's bitwise
   (the two share one order and one rounding). On CUDA the first run is under
   ``torch.cuda.set_sync_debug_mode("error")`` with the debug checks off, as in
   training: the device-side sorts read nothing on the host. Cases: edge shapes (one destination,
   wide rows, no rows), every dtype, int32 and int64 indices, with and without scales
   and keys, Qwen3-30B-A3B's token gradient (4096 tokens, H 2048, bf16, 3/4 of the
   top-8 pairs kept) and a large case (``--large-rows`` rows, 8 per destination, H 2048,
   bf16). For information: whether the fast (atomic) path varied between two runs, and
   both paths' times (CUDA events, median of 5).
2. The expert GEMMs' backward (dX, dW1, dW2; grouped where the region would group,
   else the loop) twice on the same inputs: bitwise equal. The region relies on
   cuBLAS and torch's grouped GEMM being run-to-run deterministic for fixed shapes.
3. The LRMoE layer (needs megatron-core; "absent" without it): two fresh layers with
   the same weights, one training step each on the same tokens with forced routing
   (bf16 on CUDA, gamma 0.75, topk, 8 of 32 experts; shrunk with ``small``), in
   deterministic mode by Megatron's flag and by torch's: dx, the router gradient and
   every weight gradient bitwise equal. For information, how many elements of dx
   differ with the mode off (the atomic path).

Exit status 0 when every check passed, 1 when one failed, 2 without the device.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from megatron_lrmoe.layer.expert_gemms import experts_backward, use_grouped_mm
from megatron_lrmoe.ops import (
    cuda_kernels_available,
    kernels_available,
    scatter_add_rows,
    set_debug_checks,
)

_BITS = {torch.float32: torch.int32, torch.float64: torch.int64,
         torch.bfloat16: torch.int16, torch.float16: torch.int16}


@dataclass
class DeterminismResult:
    """What was checked: one line per case; ``ok`` when every check passed."""

    status: str = "ok"                      # "ok", "FAIL" or "no device"
    lines: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def record(self, passed: bool, line: str) -> None:
        self.lines.append(f"{'ok  ' if passed else 'FAIL'} {line}")
        if not passed:
            self.status = "FAIL"


@dataclass(frozen=True)
class ScatterCase:
    name: str
    n: int                                  # destinations (tokens)
    m: int                                  # rows (kept pairs)
    h: int
    dtype: torch.dtype = torch.bfloat16
    index_dtype: torch.dtype = torch.int64
    scale: str = "none"                     # "none", "same" (src's dtype) or "fp32"
    keyed: bool = True


def scatter_cases(large_rows: int, small: bool = False) -> list[ScatterCase]:
    """The cases; ``small`` shrinks the Qwen3 one (a CPU run of the script itself)."""
    tokens, hidden = (256, 256) if small else (4096, 2048)
    cases = [
        ScatterCase("one destination", 1, 257, 5, torch.float32, scale="fp32"),
        ScatterCase("wide rows", 300, 50, 700, torch.float16, torch.int32, "same"),
        ScatterCase("no rows", 5, 0, 8),
        ScatterCase("fp64, no key", 40, 900, 33, torch.float64, keyed=False),
        ScatterCase("bf16, int32, no key", 64, 4096, 1000, torch.bfloat16, torch.int32,
                    "fp32", keyed=False),
        ScatterCase("Qwen3-30B-A3B token gradient" + (" (shrunk)" if small else ""), tokens,
                    tokens * 8 * 3 // 4, hidden),
    ]
    if large_rows > 0:
        cases.append(ScatterCase("large", max(1, large_rows // 8), large_rows, hidden))
    return cases


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_BITS[t.dtype])


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _inputs(case: ScatterCase, device: torch.device, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    out = torch.randn(case.n, case.h, generator=g, device=device).to(case.dtype)
    src = torch.randn(case.m, case.h, generator=g, device=device).to(case.dtype)
    index = torch.randint(0, case.n, (case.m,), generator=g, device=device).to(case.index_dtype)
    scale = None
    if case.scale != "none":
        scale = torch.rand(case.m, generator=g, device=device)
        scale = scale.to(case.dtype) if case.scale == "same" else scale
    # Keys as the region's: distinct pair indices, here in a shuffled order.
    key = (torch.randperm(2 * case.m, generator=g, device=device)[:case.m]
           if case.keyed else None)
    return out, index, src, scale, key


def _run(out0, index, src, scale, key, backend: str, deterministic: bool) -> torch.Tensor:
    out = out0.clone()
    scatter_add_rows(out, index, src, scale, backend=backend, key=key,
                     deterministic=deterministic)
    return out


def _median_ms(fn: Callable[[], object], device: torch.device, repeats: int = 5) -> float:
    if device.type != "cuda":
        return float("nan")
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _without_host_sync(fn: Callable[[], torch.Tensor], device: torch.device
                       ) -> tuple[torch.Tensor | None, str | None]:
    """(fn(), None), run with host syncs refused on CUDA and the debug checks off; (None,
    why) when it synchronised."""
    if device.type != "cuda":
        return fn(), None
    checks = set_debug_checks(False)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        return fn(), None
    except RuntimeError as exc:
        return None, str(exc).splitlines()[0]
    finally:
        torch.cuda.set_sync_debug_mode("default")
        set_debug_checks(checks)


def _check_scatter_case(case: ScatterCase, device: torch.device, compare_cpu: bool,
                        result: DeterminismResult) -> None:
    backend = device.type
    out0, index, src, scale, key = _inputs(case, device)
    first, synced = _without_host_sync(
        lambda: _run(out0, index, src, scale, key, backend, True), device)
    if first is None:
        result.record(False, f"scatter_add_rows {case.name}: the deterministic path "
                             f"synchronised with the host: {synced}")
        return
    second = _run(out0, index, src, scale, key, backend, True)
    checks = [("twice", _same_bits(first, second))]
    if key is not None:
        perm = torch.randperm(case.m, generator=torch.Generator(device=device).manual_seed(1),
                              device=device)
        permuted = _run(out0, index[perm], src[perm], None if scale is None else scale[perm],
                        key[perm], backend, True)
        checks.append(("permuted", _same_bits(first, permuted)))
    if compare_cpu and device.type != "cpu":
        cpu = [None if t is None else t.cpu() for t in (out0, index, src, scale, key)]
        checks.append(("= cpu", _same_bits(first.cpu(), _run(*cpu, "cpu", True))))
    line = (f"scatter_add_rows {case.name}: {str(case.dtype).removeprefix('torch.')} "
            f"N {case.n} M {case.m} H {case.h} index {str(case.index_dtype)[-5:]} "
            f"scale {case.scale}{' key' if key is not None else ''}: deterministic "
            + ", ".join(f"{name} {'bitwise' if same else 'DIFFERS'}" for name, same in checks))
    if device.type == "cuda" and case.m > 0:
        fast = [_run(out0, index, src, scale, None, backend, False) for _ in range(2)]
        varied = int((_bits(fast[0]) != _bits(fast[1])).sum())
        gap = float((fast[0].double() - first.double()).abs().max())
        det_ms = _median_ms(lambda: _run(out0, index, src, scale, key, backend, True), device)
        fast_ms = _median_ms(lambda: _run(out0, index, src, scale, None, backend, False),
                             device)
        line += (f"; fast (atomic) path: {varied} elements varied between two runs, max "
                 f"|fast - deterministic| {gap:.3g}; {det_ms:.3f} ms deterministic vs "
                 f"{fast_ms:.3f} ms fast (incl. a clone of out)")
    result.record(all(same for _, same in checks), line)


def _check_expert_gemms(device: torch.device, dtype: torch.dtype, small: bool,
                        result: DeterminismResult) -> None:
    """The experts' backward twice on the same inputs: dX, dW1, dW2 bitwise equal."""
    g = torch.Generator(device=device).manual_seed(2)
    # Qwen3-30B-A3B at EP 8 (16 local experts), or a shrunk layer.
    local, h, f, lo, hi = (4, 64, 32, 20, 60) if small else (16, 2048, 768, 800, 2000)
    rows = [int(r) for r in torch.randint(lo, hi, (local,), generator=g, device=device).tolist()]
    n = sum(rows)
    x = torch.randn(n, h, generator=g, device=device).to(dtype)
    z = torch.randn(n, 2 * f, generator=g, device=device).to(dtype)
    dy = (torch.randn(n, h, generator=g, device=device) * 0.1).to(dtype)
    w1 = [(torch.randn(2 * f, h, generator=g, device=device) * 0.02).to(dtype)
          for _ in range(local)]
    w2 = [(torch.randn(h, f, generator=g, device=device) * 0.02).to(dtype)
          for _ in range(local)]

    def swiglu(t: torch.Tensor) -> torch.Tensor:
        a, b = t.chunk(2, dim=-1)
        return torch.nn.functional.silu(a) * b

    grouped = use_grouped_mm(None, x, w1[0], w2[0])
    offs = torch.tensor(rows, device=device).cumsum(0).to(torch.int32) if grouped else None
    runs = [experts_backward(x, z, dy, rows, offs, w1, w2, swiglu, grouped) for _ in range(2)]
    flat = [[runs[k][0], *runs[k][1], *runs[k][2]] for k in range(2)]
    same = all(_same_bits(a, b) for a, b in zip(*flat, strict=True))
    result.record(same, f"expert backward ({'grouped' if grouped else 'loop'}, "
                        f"{str(dtype).removeprefix('torch.')}, {local} experts, {n} rows, "
                        f"H {h}, F {f}): dX, dW1, dW2 twice "
                        f"{'bitwise' if same else 'DIFFER'}")


def _layer_grads(cfg: dict, gamma: float, megatron_flag: bool, torch_flag: bool
                 ) -> list[torch.Tensor]:
    """A fresh LRMoE layer's gradients after one training step (dx, router, weights)."""
    from lrmoe_studies.layer_bench import DTYPES, build_layers, skewed_routing

    _, lrmoe = build_layers(cfg)
    lrmoe.config.deterministic_mode = megatron_flag
    lrmoe.config.moe_lrmoe_bwd_capacity_factor = gamma
    lrmoe.config.moe_lrmoe_selection = "topk"
    from megatron_lrmoe.integration.step_hooks import setup_lrmoe_layers
    setup_lrmoe_layers([lrmoe], cfg["tokens"], 1)
    dev, dtype = torch.device(cfg["device"]), DTYPES[cfg["dtype"]]
    probs, routing_map = skewed_routing(cfg["tokens"], cfg["experts"], cfg["topk"], 1.2,
                                        cfg["seed"], 0, dtype)
    probs = probs.to(dev).float().requires_grad_(True)
    routing_map = routing_map.to(dev)
    lrmoe.route = lambda hidden_states, padding_mask=None, _r=(probs, routing_map): _r
    g = torch.Generator().manual_seed(7)
    x = torch.randn(cfg["tokens"], 1, cfg["hidden"], generator=g).to(dev, dtype)
    x.requires_grad_(True)
    dy = torch.randn(x.shape, generator=g).to(dev, dtype)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(torch_flag)
    try:
        out, _ = lrmoe(x)
        out.backward(dy)
    finally:
        torch.use_deterministic_algorithms(before)
    lrmoe.finish_step()
    return [x.grad, probs.grad, *(p.grad for p in lrmoe.parameters() if p.grad is not None)]


def check_layer_determinism(device: str = "cuda", small: bool = False,
                            result: DeterminismResult | None = None) -> DeterminismResult:
    """Check 3 of the module docstring; torch.distributed must be initialised (one rank)
    or is initialised here."""
    result = result if result is not None else DeterminismResult()
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        result.lines.append("absent layer: megatron-core is not installed")
        return result
    import torch.distributed as dist

    if not dist.is_initialized():
        from lrmoe_testing.gloo_pool import free_port

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        if device == "cuda":
            torch.cuda.set_device(0)
        dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
    shape = (dict(hidden=64, ffn=32, experts=8, topk=4, tokens=64) if small else
             dict(hidden=1024, ffn=512, experts=32, topk=8, tokens=2048))
    cfg = {"device": device, "ep": 1, "dtype": "bf16" if device == "cuda" else "fp32",
           "grouped_gemm": "auto", "seed": 1234, "kernels": "auto", **shape}
    name = (f"layer ({cfg['dtype']}, H {cfg['hidden']}, {cfg['experts']} experts, top-"
            f"{cfg['topk']}, {cfg['tokens']} tokens, gamma 0.75, topk)")
    for label, flags in (("Megatron's deterministic_mode", (True, False)),
                         ("torch.use_deterministic_algorithms", (False, True))):
        first, second = (_layer_grads(cfg, 0.75, *flags) for _ in range(2))
        same = len(first) == len(second) and all(
            _same_bits(a, b) for a, b in zip(first, second, strict=True))
        result.record(same, f"{name} with {label}: dx, router and {len(first) - 2} weight "
                            f"gradients of two runs {'bitwise' if same else 'DIFFER'}")
    first, second = (_layer_grads(cfg, 0.75, False, False) for _ in range(2))
    varied = int((_bits(first[0]) != _bits(second[0])).sum())
    result.lines.append(f"info {name} with the mode off: {varied} of {first[0].numel()} "
                        "elements of dx differ between two runs")
    return result


def check_determinism(device: str = "cuda", large_rows: int = 600_000,
                      compare_cpu: bool = True, small: bool = False,
                      layer: bool = True) -> DeterminismResult:
    """Run every check on ``device``; see the module docstring. ``small``: shrunk Qwen3
    shapes (for a CPU run of the script); ``layer``: run check 3."""
    # torch's deterministic algorithms refuse cuBLAS without it (the layer check sets
    # them); set before any GEMM, since torch sizes cuBLAS workspaces once.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    result = DeterminismResult()
    dev = torch.device(device)
    if dev.type == "cuda" and not (torch.cuda.is_available() and cuda_kernels_available()):
        result.status = "no device"
        result.lines.append("no CUDA device, or kernels built without CUDA: nothing checked")
        return result
    if not kernels_available():
        result.status = "FAIL"
        result.lines.append("megatron_lrmoe._kernels did not import: build it first")
        return result
    with torch.no_grad():
        for case in scatter_cases(large_rows, small):
            _check_scatter_case(case, dev, compare_cpu, result)
            if dev.type == "cuda":
                torch.cuda.empty_cache()            # the large case holds a few GB
        for dtype in (torch.bfloat16, torch.float32):
            _check_expert_gemms(dev, dtype, small, result)
    if layer:
        check_layer_determinism(device, small, result)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--large-rows", type=int, default=600_000,
                   help="rows of the large scatter case (0: skip it)")
    p.add_argument("--no-cpu-compare", action="store_true",
                   help="skip the comparison with the CPU kernel")
    p.add_argument("--small", action="store_true", help="shrunk Qwen3 shapes (CPU runs)")
    p.add_argument("--no-layer", action="store_true", help="skip the layer check")
    args = p.parse_args(argv)
    result = check_determinism(args.device, args.large_rows, not args.no_cpu_compare,
                               args.small, not args.no_layer)
    for line in result.lines:
        print(f"determinism: {line}")
    print(f"determinism: {result.status}")
    return {"ok": 0, "FAIL": 1}.get(result.status, 2)


if __name__ == "__main__":
    sys.exit(main())
