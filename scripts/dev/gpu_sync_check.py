"""On one CUDA GPU: the LRMoE region runs without host syncs, and what the weight stack costs.

    python scripts/dev/gpu_sync_check.py        # (scripts/gpu_check.sh runs it)

0. Grouped-GEMM choice: for bf16, fp16 and fp32 on this GPU, the rule
   (``grouped_mm_rule``: torch's CUDA grouped_mm has its kernel only for bf16 on compute
   capability 9.x/10.x, elsewhere a fallback that reads the offsets on the host) beside
   the start-up probe, whose grouped calls run in sync-debug mode "error": where the rule
   says the fallback syncs, the probe must fail; where it says grouped, pass.
1. Sync check. For each setting (bf16 with grouped GEMMs, fp32 with the per-expert
   loop; gamma inf and 0.75; rules uniform, topk, sample; then, at gamma 0.75 and
   uniform only, bf16 with the default choice and fp32 with grouped GEMMs requested,
   which must run the loop) one warm-up step, then one
   step in which the layer's forward after the counts exchange (the one documented host
   read: ``RoutedCountsExchange.gather_counts`` is wrapped to switch the mode on as it
   returns) and its whole backward run under ``torch.cuda.set_sync_debug_mode("error")``:
   any device-to-host read, blocking copy or stream synchronisation there raises, naming
   the op. The routing is forced (the router is bypassed, its probabilities a leaf that
   requires grad), so the backward is the region's and the pair gather's, not Megatron's
   router (whose code reads values on the host elsewhere). Debug checks are off, as in
   training (``MEGATRON_LRMOE_DEBUG_CHECKS`` unset).
2. Weight stack cost (docs/implementation.md, "Choices inside the layer"): ``torch.stack``
   of the local experts' W1 and W2 (what the grouped path does per call in forward and
   again in backward when it cannot read them in place: a rank hosting replicas) against
   the grouped forward GEMMs it feeds, Qwen3-30B-A3B shapes (H 2048,
   F 768, bf16) with 128 local experts (EP=1) and 16 (EP=8), 8192 tokens x top-8 spread
   over the experts; CUDA events, median of 20.

Exit status 1 if any choice or sync check failed. EP > 1 is not exercised: one GPU, one rank.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import traceback

import torch

from lrmoe_studies.layer_bench import DTYPES, build_layers, skewed_routing


def _cfg(dtype: str, grouped: str) -> dict:
    """The layer_bench fields of one checked layer: bench_moe_layer.py's layer at
    ``--device cuda --ep 1 --hidden 1024 --ffn 512 --experts 32 --topk 4 --tokens 2048``,
    its default seed and kernels."""
    return {"device": "cuda", "ep": 1, "hidden": 1024, "ffn": 512, "experts": 32, "topk": 4,
            "tokens": 2048, "dtype": dtype, "grouped_gemm": grouped, "seed": 1234,
            "kernels": "auto"}


SETTINGS = (  # dtype, grouped (layer_bench's on/off/auto), gammas, selection rules
    ("bf16", "on", (math.inf, 0.75), ("uniform", "topk", "sample")),
    ("fp32", "off", (math.inf, 0.75), ("uniform", "topk", "sample")),
    ("bf16", "auto", (0.75,), ("uniform",)),
    ("fp32", "on", (0.75,), ("uniform",)),     # would sync in torch: the loop, warned
)


def _expected_grouped(dtype: str, grouped: str) -> bool:
    from megatron_lrmoe.layer.expert_gemms import grouped_mm_rule

    rule = grouped_mm_rule("cuda", DTYPES[dtype], torch.cuda.get_device_capability())
    return {"on": not rule.syncs, "off": False, "auto": rule.grouped}[grouped]


def _choice_check(failures: list[str]) -> None:
    from megatron_lrmoe.layer import expert_gemms

    cap = torch.cuda.get_device_capability()
    dev = torch.device("cuda")
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        rule = expert_gemms.grouped_mm_rule("cuda", dtype, cap)
        probe = expert_gemms._probe(dev, dtype)
        ok = not (rule.syncs and probe is None) and not (rule.grouped and probe is not None)
        print(f"{'ok  ' if ok else 'FAIL'} grouped_mm choice {dtype} on compute capability "
              f"{cap[0]}.{cap[1]}: rule grouped={rule.grouped} syncs={rule.syncs} "
              f"({rule.reason}); probe: {probe or 'passed'}", flush=True)
        if not ok:
            failures.append(f"grouped_mm choice {dtype}")


def _sync_check(failures: list[str]) -> None:
    from megatron_lrmoe.layer import counts_exchange

    original = counts_exchange.RoutedCountsExchange.gather_counts

    def gather_then_strict(self, routing_map):
        counts = original(self, routing_map)          # the documented host read
        torch.cuda.set_sync_debug_mode("error")       # everything after it: no sync
        return counts

    for dtype, grouped, gammas, selections in SETTINGS:
        expected = _expected_grouped(dtype, grouped)
        cfg = _cfg(dtype, grouped)
        _, lrmoe = build_layers(cfg)
        dev = torch.device("cuda")
        probs, routing_map = skewed_routing(cfg["tokens"], cfg["experts"], cfg["topk"], 1.2,
                                            cfg["seed"], 0, DTYPES[dtype])
        probs = probs.to(dev).float().requires_grad_(True)
        routing_map = routing_map.to(dev)
        lrmoe.route = lambda hidden_states, padding_mask=None, _r=(probs, routing_map): _r
        g = torch.Generator().manual_seed(7)
        x = torch.randn(cfg["tokens"], 1, cfg["hidden"], generator=g).to(dev, DTYPES[dtype])
        dy = torch.randn_like(x)
        for gamma in gammas:
            for selection in selections:
                name = f"{dtype} grouped={grouped} gamma={gamma:g} {selection}"
                lrmoe.config.moe_lrmoe_bwd_capacity_factor = gamma
                lrmoe.config.moe_lrmoe_selection = selection
                from megatron_lrmoe.integration.step_hooks import setup_lrmoe_layers
                setup_lrmoe_layers([lrmoe], cfg["tokens"], 1)
                try:
                    for strict in (False, True):   # a warm-up step, then the checked one
                        x_in = x.detach().clone().requires_grad_(True)
                        for p in lrmoe.parameters():
                            p.grad = None
                        if strict:
                            counts_exchange.RoutedCountsExchange.gather_counts = \
                                gather_then_strict
                        try:
                            out, _ = lrmoe(x_in)
                        finally:
                            torch.cuda.set_sync_debug_mode("default")
                            counts_exchange.RoutedCountsExchange.gather_counts = original
                        if strict:
                            torch.cuda.set_sync_debug_mode("error")
                        try:
                            out.backward(dy)
                        finally:
                            torch.cuda.set_sync_debug_mode("default")
                        lrmoe.finish_step()
                    torch.cuda.synchronize()
                    finite = bool(torch.isfinite(x_in.grad).all()) and all(
                        bool(torch.isfinite(p.grad).all()) for p in lrmoe.parameters()
                        if p.grad is not None)
                    grouped_ran = lrmoe.lrmoe_stats.calls[-1].grouped_gemm
                    ok = finite and grouped_ran == expected
                    print(f"{'ok  ' if ok else 'FAIL'} sync-free {name} (grouped_mm ran: "
                          f"{grouped_ran}, expected {expected}; gradients finite: "
                          f"{finite})", flush=True)
                    if not ok:
                        failures.append(name)
                except Exception:
                    torch.cuda.set_sync_debug_mode("default")
                    failures.append(name)
                    print(f"FAIL sync-free {name}:\n{traceback.format_exc()}", flush=True)
                lrmoe.lrmoe_stats.reset()
        del lrmoe
        torch.cuda.empty_cache()


def _median_ms(fn, reps: int = 20) -> float:
    times = []
    for _ in range(reps + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[3:])


def _stack_cost_one(local: int) -> None:
    """One EP layout: ``local`` experts per rank, the rank's share of 8192 x 8 pairs."""
    from megatron_lrmoe.layer.expert_gemms import _GROUPED_MM

    dev, dtype = torch.device("cuda"), torch.bfloat16
    h, f, tokens, topk, experts = 2048, 768, 8192, 8, 128
    w1 = [torch.randn(2 * f, h, device=dev, dtype=dtype) * 0.02 for _ in range(local)]
    w2 = [torch.randn(h, f, device=dev, dtype=dtype) * 0.02 for _ in range(local)]
    rows = tokens * topk * local // experts
    x = torch.randn(rows, h, device=dev, dtype=dtype)
    offs = torch.full((local,), rows // local, device=dev).cumsum(0).to(torch.int32)
    w1s, w2s = torch.stack(w1), torch.stack(w2)

    def stack():
        torch.stack(w1)
        torch.stack(w2)

    def gemms():
        z = _GROUPED_MM(x, w1s.transpose(1, 2), offs=offs)
        _GROUPED_MM(z[:, :f], w2s.transpose(1, 2), offs=offs)

    t_stack, t_gemm = _median_ms(stack), _median_ms(gemms)
    weight_mib = sum(t.numel() for t in (*w1, *w2)) * 2 / 2**20
    print(f"stack of {local} experts' W1+W2 ({weight_mib:.0f} MiB bf16): {t_stack:.3f} ms; "
          f"grouped forward GEMMs over {rows} rows: {t_gemm:.3f} ms; stack / GEMMs = "
          f"{t_stack / t_gemm:.2f} (the grouped path stacks in forward and again in backward)",
          flush=True)


def _stack_cost() -> None:
    for local in (128, 16):
        _stack_cost_one(local)
        torch.cuda.empty_cache()


def main() -> int:
    import torch.distributed as dist

    from lrmoe_testing.gloo_pool import free_port

    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 1
    os.environ.pop("MEGATRON_LRMOE_DEBUG_CHECKS", None)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    failures: list[str] = []
    try:
        _choice_check(failures)
        _sync_check(failures)
        try:
            _stack_cost()
        except Exception:
            print(f"stack cost measurement failed:\n{traceback.format_exc()}", flush=True)
    finally:
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        dist.destroy_process_group()
    print(f"\n{len(failures)} choice/sync check failure(s)" + (f": {failures}" if failures else ""))
    print("not exercised: EP > 1 (one GPU cannot run NCCL expert parallelism across ranks)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
