"""One MoE layer on this rank, for the benchmarks: builders, forced routings, measured steps.

The worker-side part shared by ``benchmarks/bench_moe_layer.py``, ``bench_placement.py``
and ``scripts/dev/gpu_sync_check.py`` (``bench_moe_layer.py``'s docstring says what is
measured and how). A benchmark's settings travel as one ``cfg`` dict (it crosses to the
gloo workers by pickle); the fields read here: ``device``, ``dtype`` (a ``DTYPES`` key),
``ep``, ``seed``, ``hidden``, ``ffn``, ``experts``, ``topk``, ``tokens`` (per rank),
``kernels`` and ``grouped_gemm`` (``auto``/``on``/``off``).

Nothing here imports the test harness (``lrmoe_testing``): the scripts bring
their own process pool and host-read detector.
"""

from __future__ import annotations

import gc
import json
import math
import time
from collections.abc import Callable

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# glibc malloc: never hand big buffers to mmap and never trim the heap (CPU workers only).
GLIBC_CACHING_TUNABLES = ("glibc.malloc.mmap_max=0", "glibc.malloc.trim_threshold=68719476736")


def layer_config_kwargs(cfg: dict) -> dict:
    """TransformerConfig fields of the benchmarked MoE layer (every benchmark builds this one)."""
    import torch.nn.functional as F

    dtype = DTYPES[cfg["dtype"]]
    return dict(
        num_layers=1, hidden_size=cfg["hidden"], num_attention_heads=16,
        ffn_hidden_size=cfg["ffn"], moe_ffn_hidden_size=cfg["ffn"],
        num_moe_experts=cfg["experts"], moe_router_topk=cfg["topk"],
        moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=0.0,
        moe_router_load_balancing_type="none", expert_model_parallel_size=cfg["ep"],
        add_bias_linear=bool(cfg.get("bias", False)), bias_activation_fusion=False,
        gated_linear_unit=True, activation_func=F.silu, params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
    )


def build_layers(cfg: dict, variants: dict[str, dict] | None = None) -> tuple:
    """Megatron's MoELayer and an LRMoELayer with the same weights, on this rank
    (collective: every rank of the EP group calls it, the variants in the same order).
    The LRMoE layer runs the default rule unless ``cfg["selection"]`` names another.

    ``variants``: more LRMoE layers (name -> extra LRMoETransformerConfig fields), same
    weights, returned as a third value (a dict) when given."""
    from megatron.core.transformer import TransformerConfig

    from megatron_lrmoe.config.transformer_config import LRMoETransformerConfig
    from megatron_lrmoe.integration.step_hooks import setup_lrmoe_layers
    from megatron_lrmoe.layer.spec import to_lrmoe_spec

    spec = _fresh_layer_spec(cfg)
    common = layer_config_kwargs(cfg)
    megatron = spec(config=TransformerConfig(**common))
    # cfg["selection"]: a rule other than the default (a benchmark's byte model is one rule's).
    rule = {"moe_lrmoe_selection": cfg["selection"]} if "selection" in cfg else {}
    lrmoe = to_lrmoe_spec(spec)(config=LRMoETransformerConfig(
        **common, moe_lrmoe=True, moe_lrmoe_bwd_capacity_factor=math.inf,
        moe_lrmoe_kernels=cfg["kernels"], **rule))
    lrmoe.load_state_dict(megatron.state_dict())  # same keys: interchangeable experts
    lrmoe.grouped_gemm = {"auto": None, "on": True, "off": False}[cfg["grouped_gemm"]]
    # Planners built at setup; one micro-batch per step (one_step ends each step).
    setup_lrmoe_layers([lrmoe], cfg["tokens"], 1)
    device = torch.device(cfg["device"])
    if variants is None:
        return megatron.to(device).train(), lrmoe.to(device).train()
    extra = {}
    for name, fields in variants.items():
        layer = to_lrmoe_spec(spec)(config=LRMoETransformerConfig(
            **common, moe_lrmoe=True, moe_lrmoe_kernels=cfg["kernels"], **fields))
        layer.load_state_dict(megatron.state_dict())
        layer.grouped_gemm = lrmoe.grouped_gemm
        setup_lrmoe_layers([layer], cfg["tokens"], 1)   # collective: same order everywhere
        extra[name] = layer.to(device).train()
    return megatron.to(device).train(), lrmoe.to(device).train(), extra


def build_megatron_layer(cfg: dict, **config_fields) -> torch.nn.Module:
    """Megatron's MoELayer alone on this rank (collective: every rank of the EP group
    calls it), with extra TransformerConfig fields (``recompute_granularity`` and
    ``recompute_modules``, ``moe_expert_capacity_factor``, ...), in training mode."""
    from megatron.core.transformer import TransformerConfig

    spec = _fresh_layer_spec(cfg)
    layer = spec(config=TransformerConfig(**layer_config_kwargs(cfg), **config_fields))
    return layer.to(torch.device(cfg["device"])).train()


def build_lrmoe_layer(cfg: dict, **options) -> torch.nn.Module:
    """An LRMoELayer alone on this rank (collective, as ``build_megatron_layer``) with the
    LRMoE config fields ``options`` (``moe_lrmoe_*``), in training mode, without a
    planner: the caller hands it its settings (``LRMoELayer.setup_planner``)."""
    from megatron_lrmoe.config.transformer_config import LRMoETransformerConfig
    from megatron_lrmoe.layer.spec import to_lrmoe_spec

    spec = to_lrmoe_spec(_fresh_layer_spec(cfg))
    layer = spec(config=LRMoETransformerConfig(**layer_config_kwargs(cfg),
                                               **{**options, "moe_lrmoe": True}))
    return layer.to(torch.device(cfg["device"])).train()


def _fresh_layer_spec(cfg: dict):
    """The MoE layer's spec, with the model-parallel state initialised at ``cfg``'s EP
    size (kept when it already is: a layer per job reuses the groups) and seeded by its
    seed."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    initialized = ps.model_parallel_is_initialized()
    if initialized and ps.get_expert_model_parallel_world_size() != cfg["ep"]:
        ps.destroy_model_parallel()
        initialized = False
    # destroy_model_parallel only drops Megatron's references: every group made anew
    # would keep its gloo threads (about 60 per initialisation at EP 16) for the process's
    # life, and a 16-rank measurement of 20 layers ran at a load average of 2,500.
    if not initialized:
        ps.initialize_model_parallel(expert_model_parallel_size=cfg["ep"])
    model_parallel_cuda_manual_seed(cfg["seed"])
    return get_gpt_layer_local_spec(num_experts=cfg["experts"]).submodules.mlp


def popularity_routing(tokens: int, popularity: torch.Tensor, topk: int, seed: int,
                       rank: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(probs, routing_map) with top-k experts drawn without replacement by popularity."""
    experts = popularity.numel()
    g = torch.Generator().manual_seed(seed + 7919 * (rank + 1))
    chosen = torch.multinomial(popularity.expand(tokens, experts), topk, replacement=False,
                               generator=g)
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool)
    routing_map.scatter_(1, chosen, True)
    logits = torch.randn(tokens, experts, generator=g).masked_fill(~routing_map, -math.inf)
    return torch.softmax(logits, dim=1).to(dtype), routing_map


def counts_routing(counts, tokens: int, topk: int, seed: int, rank: int,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(probs [T, E], routing_map [T, E] bool) whose per-expert token counts are exactly
    ``counts`` [E] (one source rank's row of a recorded call), each token routed to at
    most ``topk`` distinct experts (exactly ``topk`` when the counts sum to T x topk, as
    in a dropless call; fewer after a capacity drop). probs = softmax of random logits
    over each token's experts, 0 elsewhere.

    The experts' counts are laid end to end and position j goes to token j mod T: an
    expert's run of at most T positions meets T distinct tokens, and a token gets at most
    ceil(sum / T) positions. The tokens are then shuffled (seeded)."""
    import numpy as np

    counts = np.asarray(counts, dtype=np.int64).reshape(-1)
    experts = counts.size
    total = int(counts.sum())
    if (counts < 0).any() or (counts > tokens).any() or total > tokens * topk:
        raise ValueError(f"counts_routing: counts must lie in [0, tokens={tokens}] and sum "
                         f"to at most tokens x topk = {tokens * topk} (got min "
                         f"{int(counts.min())}, max {int(counts.max())}, sum {total}); "
                         "pass the row of one source rank of a recorded call")
    g = torch.Generator().manual_seed(seed + 7919 * (rank + 1))
    expert_of = torch.from_numpy(np.repeat(np.arange(experts), counts))
    token_of = torch.randperm(tokens, generator=g)[torch.arange(total) % tokens]
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool)
    routing_map[token_of, expert_of] = True
    logits = torch.randn(tokens, experts, generator=g).masked_fill(~routing_map, -math.inf)
    # A token a capacity drop left without experts has no softmax: all zeros.
    probs = torch.softmax(logits, dim=1).nan_to_num(0.0)
    return probs.to(dtype), routing_map


def skewed_routing(tokens: int, experts: int, topk: int, zipf_s: float, seed: int,
                   rank: int, dtype: torch.dtype,
                   shuffle: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(probs [T, E], routing_map [T, E] bool): top-k experts per token drawn without
    replacement with Zipf(s) popularity, probs = softmax of random logits over them.

    Popularity of expert e is (e + 1)^-s (so under Megatron's layout the lowest ranks
    hold the hottest experts), or, with ``shuffle``, of a seeded permutation of e."""
    order = torch.arange(experts)
    if shuffle:
        order = torch.randperm(experts, generator=torch.Generator().manual_seed(seed))
    popularity = torch.empty(experts)
    popularity[order] = torch.arange(1, experts + 1, dtype=torch.float32).pow(-zipf_s)
    return popularity_routing(tokens, popularity, topk, seed, rank, dtype)


def recorded_popularity(log_path: str, layer: int, experts: int) -> torch.Tensor:
    """Per-expert popularity [experts] from a launcher JSON-lines log (``--moe-lrmoe``
    runs record ``lrmoe/layer<N>/expert-load``), summed over the whole run. A log with
    fewer experts than the benchmark is stretched: each recorded expert becomes
    experts / recorded equally popular benchmark experts (same per-rank shape)."""
    key = f"lrmoe/layer{layer}/expert-load"
    total = None
    with open(log_path) as f:
        for line in f:
            loads = json.loads(line).get(key)
            if loads is not None:
                t = torch.tensor(loads, dtype=torch.float64)
                total = t if total is None else total + t
    if total is None:
        raise SystemExit(f"--recorded-log {log_path}: no {key!r} records (run with --moe-lrmoe)")
    if experts % total.numel():
        raise SystemExit(f"--experts {experts} must be a multiple of the recorded experts "
                         f"({total.numel()})")
    return (total / total.sum()).repeat_interleave(experts // total.numel()).float()



def gather_counts(routing_map: torch.Tensor, ep: int) -> torch.Tensor:
    import torch.distributed as dist

    local = routing_map.sum(0).to(torch.int64).cpu()
    if ep == 1:
        return local.unsqueeze(0)
    out = [torch.empty_like(local) for _ in range(ep)]
    dist.all_gather(out, local)
    return torch.stack(out)


def one_step(layer: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor,
             sync: Callable[[], None],
             barrier: Callable[[], None]) -> tuple[float, float, list | None, float, int]:
    """(forward s, backward s, layer stats or None, process CPU s, minor page faults)."""
    for p in layer.parameters():
        p.grad = None
    x_in = x.detach().clone().requires_grad_(True)
    if hasattr(layer, "lrmoe_stats"):
        layer.lrmoe_stats.reset()
    gc.collect()  # cheap: the long-lived heap was frozen after the build
    gc.disable()  # no collector pauses inside the timed spans
    try:
        barrier()
        f0 = minor_faults()
        c0, t0 = time.process_time(), time.perf_counter()
        out, _ = layer(x_in)
        sync()
        c1, t1 = time.process_time(), time.perf_counter()
        barrier()
        c2, t2 = time.process_time(), time.perf_counter()
        out.backward(dy)
        sync()
        c3, t3 = time.process_time(), time.perf_counter()
        faults = minor_faults() - f0
    finally:
        gc.enable()
    if hasattr(layer, "finish_step"):
        layer.finish_step()   # the step boundary, outside the timed spans
    stats = None
    if hasattr(layer, "lrmoe_stats") and layer.lrmoe_stats.calls:
        stats = layer.lrmoe_stats.totals()
    return t1 - t0, t3 - t2, stats, (c1 - c0) + (c3 - c2), faults


def minor_faults() -> int:
    """Minor page faults of this process so far (fresh pages the kernel had to zero)."""
    try:
        import resource
    except ImportError:  # not POSIX
        return 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def end_step(layer: torch.nn.Module) -> None:
    """Close the layer's step (LRMoE: its planner and statistics), outside the timed spans."""
    if hasattr(layer, "finish_step"):
        layer.finish_step()


class _CpuAllocations:
    """Peak and net bytes the CPU allocator handed out during a span (torch.profiler's
    memory events: every allocation and free, whichever op or C++ code made it)."""

    def __enter__(self):
        from torch.profiler import ProfilerActivity, profile

        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()
        return self

    def __exit__(self, *exc):
        self._prof.__exit__(*exc)
        events = sorted((e.start_ns(), e.nbytes()) for e in
                        self._prof.profiler.kineto_results.events()
                        if e.name() == "[memory]" and e.device_type().name == "CPU")
        level = self.peak = 0
        for _, nbytes in events:
            level += nbytes
            self.peak = max(self.peak, level)
        self.net = level


class _PromptCollectiveFrees:
    """While active, each blocking ``all_to_all_single``, and the ``wait()`` of each
    asynchronous one (the replicas' refresh), returns only once the process group has
    dropped its reference to the input (an untimed wait; allocations and their order are
    the code's own).

    gloo runs a collective on a worker thread, which releases the work, and with it the
    input tensor, only after the caller has been woken; on a loaded machine that can be
    a scheduling slice later, and the input then counts at whatever peak the caller
    reaches meanwhile (a P x H buffer or more in one run, none in the next). NCCL's
    inputs follow stream order instead, so this is a CPU measurement artifact, removed
    for both layers alike (Megatron's dispatcher calls the same function)."""

    def __enter__(self):
        import torch.distributed as dist

        self._dist, self._original = dist, dist.all_to_all_single
        original = self._original

        def all_to_all_single(output, input, *args, **kwargs):
            before = input._use_count()
            work = original(output, input, *args, **kwargs)
            if not kwargs.get("async_op", False):
                _released(input, before)
                return work
            return _PromptWork(work, input, input._use_count() - before)

        dist.all_to_all_single = all_to_all_single
        return self

    def __exit__(self, *exc):
        self._dist.all_to_all_single = self._original


def _released(input: torch.Tensor, before: int) -> None:
    """Wait (at most 2 s) until ``input``'s use count is back to ``before``."""
    deadline = time.perf_counter() + 2.0
    while input._use_count() > before and time.perf_counter() < deadline:
        time.sleep(1e-4)


class _PromptWork:
    """An asynchronous collective's work whose ``wait()`` also lets go of the process
    group's work and waits until the references it held to the input (``taken``, counted
    when the collective started) are gone (``_PromptCollectiveFrees``); the caller's own
    references, such as the send buffer it keeps until the wait, stay. Before the wait,
    everything is the work's own."""

    def __init__(self, work, input: torch.Tensor, taken: int) -> None:
        self._work, self._input, self._taken = work, input, taken

    def wait(self, *args, **kwargs):
        done = self._work.wait(*args, **kwargs)
        if self._input is not None:
            target = self._input._use_count() - self._taken
            self._work = None          # the work holds the input until it is destroyed
            _released(self._input, target)
            self._input = None
        return done

    def __getattr__(self, name: str):
        return getattr(self._work, name)


def _drop_previous_graph(layer: torch.nn.Module) -> None:
    """Megatron's all-to-all dispatcher keeps the last call's router probabilities
    (``token_dispatcher.probs``) and through their autograd graph the last call's layer
    input, until the next call's ``dispatch_preprocess`` replaces them: inside the
    measured span that frees a T x H buffer of the previous step and understates the
    call's own peak by as much (with a router whose probabilities require grad). Detach
    them first, so that the span counts only this call's buffers."""
    dispatcher = getattr(layer, "token_dispatcher", None)
    probs = getattr(dispatcher, "probs", None)
    if isinstance(probs, torch.Tensor) and probs.grad_fn is not None:
        dispatcher.probs = probs.detach()


def measure_memory(cfg: dict, layer: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor,
                   sync: Callable[[], None], barrier: Callable[[], None],
                   finish_step: bool = True) -> dict[str, int]:
    """Memory of one forward+backward of the layer on this rank, measured.

    saved: bytes of the tensors autograd keeps from forward to backward
    (``torch.autograd.graph.saved_tensors_hooks``), distinct storages, without the
    parameters and the layer input (they exist anyway). peak: the most bytes allocated
    above the level before the forward, over forward and backward (the allocator's own
    figures: torch.profiler memory events on CPU, max_memory_allocated on CUDA). The
    weight gradients exist beforehand, as Megatron's gradient buffers do in a run, so
    only per-call temporaries count: peak = saved + transient buffers (activations,
    exchange buffers, weight-gradient temporaries) + the output and the input gradient
    (2 x T x H). On CPU the all-to-alls wait until gloo has released their inputs
    (``_PromptCollectiveFrees``), so that scheduling delays on a loaded machine do not
    add a buffer to the peak; the previous call's graph a layer still references is
    dropped first (``_drop_previous_graph``). ``finish_step``: end the layer's step after
    the backward (``end_step``); False for a call measured inside a step of several
    micro-batches, whose caller ends the step.
    """
    _drop_previous_graph(layer)
    params = list(layer.parameters())
    for p in params:
        p.grad = torch.zeros_like(p)
    keep = {p.untyped_storage().data_ptr() for p in params}
    x_in = x.detach().clone().requires_grad_(True)
    keep.add(x_in.untyped_storage().data_ptr())
    saved: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in keep:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    if hasattr(layer, "lrmoe_stats"):
        layer.lrmoe_stats.reset()
    gc.collect()   # the previous steps' garbage, so none of it is freed inside the spans
    barrier()
    if cfg["device"] == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out, _ = layer(x_in)
        sync()
        at_backward = torch.cuda.memory_allocated()
        fwd_peak = torch.cuda.max_memory_allocated() - base
        torch.cuda.reset_peak_memory_stats()
        barrier()
        out.backward(dy)
        sync()
        bwd_peak = torch.cuda.max_memory_allocated() - at_backward
        at_backward -= base
        peak = max(fwd_peak, at_backward + bwd_peak)
    else:
        with _PromptCollectiveFrees():
            with _CpuAllocations() as fwd, torch.autograd.graph.saved_tensors_hooks(
                    pack, lambda t: t):
                out, _ = layer(x_in)
            barrier()
            with _CpuAllocations() as bwd:
                out.backward(dy)
        fwd_peak, at_backward, bwd_peak = fwd.peak, fwd.net, bwd.peak
        peak = max(fwd_peak, at_backward + bwd_peak)
    if finish_step:
        end_step(layer)
    for p in params:
        p.grad = None
    return {"mem_saved": sum(saved.values()), "mem_peak": int(peak),
            "mem_fwd_peak": int(fwd_peak), "mem_at_backward": int(at_backward),
            "mem_bwd_peak": int(bwd_peak)}


