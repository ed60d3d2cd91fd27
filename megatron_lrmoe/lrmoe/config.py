"""``LRMoETransformerConfig``: Megatron's TransformerConfig plus the ``moe_lrmoe*`` fields.

Each field maps to the same-named command-line flag (dashes for underscores), which is
how Megatron-LM's ``core_transformer_config_from_args`` fills a config class. Defaults
are DESIGN section 8's, except the backward capacity (0.75) and the selection (uniform),
which the time-to-loss study chose (docs/benchmarks.md, "Decision"); they change only
by measurement.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron.core.transformer import TransformerConfig

LRMOE_METRICS = ("grad_act", "grad", "prob", "random")
LRMOE_SELECTIONS = ("topk", "sample", "uniform", "hybrid")
LRMOE_KERNELS = ("auto", "cpu", "cuda", "torch")
LRMOE_PLACEMENTS = ("static", "popularity", "memory-aware")


@dataclass
class LRMoETransformerConfig(TransformerConfig):
    """TransformerConfig with the LRMoE (load-recalibrated MoE) options."""

    moe_lrmoe: bool = False
    """Use the LRMoE MoE layer: exact forward, metric-driven backward drop with compaction."""

    moe_lrmoe_bwd_capacity_factor: float = 0.75
    """gamma: each EP rank keeps at most ceil(gamma x mean routed pairs per rank) pairs in
    backward; ``inf`` drops nothing."""

    moe_lrmoe_min_retention: float = 0.0
    """Fraction of every expert's pairs always kept in backward (protects hot experts)."""

    moe_lrmoe_metric: str = "grad_act"
    """Per-pair contribution metric: grad_act (||g|| x ||h||), grad (||g||), prob, random."""

    moe_lrmoe_selection: str = "uniform"
    """How each (source, expert) cell keeps its quota: topk, sample (1/pi-scaled),
    uniform (a uniform subset, n/q-scaled) or hybrid (a share by top metric, the rest
    uniform and scaled to stay unbiased)."""

    moe_lrmoe_hybrid_fraction: float = 0.5
    """Share of each cell's quota that ``hybrid`` keeps by top metric (floor of f x q);
    0 is ``uniform``, 1 is ``topk``."""

    moe_lrmoe_kernels: str = "auto"
    """Compaction kernel backend: auto, cpu, cuda, torch."""

    moe_lrmoe_log_interval: int | None = None
    """Steps between LRMoE statistics in the logs (None: the launcher's log interval)."""

    moe_lrmoe_placement: str = "static"
    """Expert replicas: static (none, Megatron's layout), popularity (SYMI-style slots),
    memory-aware (replicas where the memory budget leaves room, chosen with the quotas)."""

    moe_lrmoe_slots_per_rank: int | None = None
    """Instance slots per EP rank for ``popularity`` (None: experts per rank, no replicas
    beyond what the budget converts to)."""

    moe_lrmoe_memory_budget_gb: float | None = None
    """Per-rank budget (GB) for what the MoE layers hold at peak: replicas of every layer
    plus the execution buffers of every micro-batch in flight (DESIGN section 7)."""

    moe_lrmoe_load_smoothing: float = 0.5
    """EMA weight of the previous smoothed loads when planning the next step's placement."""

    moe_lrmoe_calibration: str | None = None
    """JSON of measured machine constants (``python -m megatron_lrmoe.calibrate``)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.moe_lrmoe:
            return
        _validate_lrmoe(self)


def _fail(field: str, message: str) -> None:
    raise ValueError(f"{field}: {message}")


def _validate_lrmoe(c: LRMoETransformerConfig) -> None:
    """Refuse what the LRMoE region does not implement, naming the field."""
    gamma = c.moe_lrmoe_bwd_capacity_factor
    if not (gamma > 0 or math.isinf(gamma)) or math.isnan(gamma):
        _fail("moe_lrmoe_bwd_capacity_factor", f"must be > 0 or inf, got {gamma}")
    if not 0.0 <= c.moe_lrmoe_min_retention <= 1.0:
        _fail("moe_lrmoe_min_retention", f"must be in [0, 1], got {c.moe_lrmoe_min_retention}")
    if c.moe_lrmoe_metric not in LRMOE_METRICS:
        _fail("moe_lrmoe_metric", f"{c.moe_lrmoe_metric!r} is not one of {LRMOE_METRICS}")
    if c.moe_lrmoe_selection not in LRMOE_SELECTIONS:
        _fail("moe_lrmoe_selection",
              f"{c.moe_lrmoe_selection!r} is not one of {LRMOE_SELECTIONS}")
    if not 0.0 <= c.moe_lrmoe_hybrid_fraction <= 1.0:  # NaN fails too
        _fail("moe_lrmoe_hybrid_fraction",
              f"must be in [0, 1], got {c.moe_lrmoe_hybrid_fraction}")
    if c.moe_lrmoe_kernels not in LRMOE_KERNELS:
        _fail("moe_lrmoe_kernels", f"{c.moe_lrmoe_kernels!r} is not one of {LRMOE_KERNELS}")
    if c.moe_lrmoe_log_interval is not None and c.moe_lrmoe_log_interval <= 0:
        _fail("moe_lrmoe_log_interval", "must be positive")
    if c.moe_lrmoe_placement not in LRMOE_PLACEMENTS:
        _fail("moe_lrmoe_placement",
              f"{c.moe_lrmoe_placement!r} is not one of {LRMOE_PLACEMENTS}")
    if c.moe_lrmoe_slots_per_rank is not None and c.moe_lrmoe_slots_per_rank < 1:
        _fail("moe_lrmoe_slots_per_rank", "must be >= 1")
    budget = c.moe_lrmoe_memory_budget_gb
    if budget is not None and not (budget > 0 and math.isfinite(budget)):
        _fail("moe_lrmoe_memory_budget_gb", f"must be a positive number, got {budget}")
    if c.moe_lrmoe_placement == "memory-aware" and budget is None:
        _fail("moe_lrmoe_memory_budget_gb", "memory-aware placement needs a budget")
    if not 0.0 <= c.moe_lrmoe_load_smoothing < 1.0:
        _fail("moe_lrmoe_load_smoothing", f"must be in [0, 1), got {c.moe_lrmoe_load_smoothing}")
    if c.num_moe_experts is None:
        _fail("moe_lrmoe", "needs an MoE model (num_moe_experts)")
    unsupported = {
        "moe_token_dispatcher_type": (c.moe_token_dispatcher_type != "alltoall",
                                      "LRMoE's region is an all-to-all dispatcher; use alltoall"),
        "moe_expert_capacity_factor": (c.moe_expert_capacity_factor is not None,
                                       "a forward capacity drops pairs in forward; LRMoE keeps "
                                       "the forward exact (drop it)"),
        "expert_tensor_parallel_size": (c.expert_tensor_parallel_size not in (None, 1),
                                        "expert tensor parallelism is not supported yet; set 1"),
        "add_bias_linear": (c.add_bias_linear,
                            "expert biases are not supported; use --disable-bias-linear"),
        "moe_apply_probs_on_input": (c.moe_apply_probs_on_input,
                                     "LRMoE applies probabilities after the combine"),
        "overlap_moe_expert_parallel_comm": (c.overlap_moe_expert_parallel_comm,
                                             "not supported with the LRMoE region"),
        "delay_wgrad_compute": (c.delay_wgrad_compute, "not supported with the LRMoE region"),
        "moe_shared_expert_overlap": (c.moe_shared_expert_overlap,
                                      "not supported with the LRMoE region"),
        "cuda_graph_impl": (c.cuda_graph_impl != "none",
                            "CUDA graphs over the MoE layer are not supported"),
        "context_parallel_size": (c.context_parallel_size != 1,
                                  "context parallelism is not supported yet"),
        "moe_latent_size": (c.moe_latent_size is not None, "not supported"),
        "recompute_granularity": (c.recompute_granularity is not None,
                                  "recompute would re-plan the region; not supported yet"),
        "fp8": (bool(c.fp8), "FP8 experts are not supported yet"),
    }
    for field, (bad, why) in unsupported.items():
        if bad:
            _fail(field, f"{why} (with moe_lrmoe)")
