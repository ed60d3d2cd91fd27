"""From Megatron's config to the pure planner's inputs (PlannerSettings, MoEShape, machine).

The planner is a function of plain numbers; this module is the one place that reads
them off an ``LRMoETransformerConfig`` and the run's layout: each layer's settings at
model setup (``integration/step_hooks.py``, which hands them to the layer), the
launchers' start-up budget check, and the run's memory account.

Budget unit: ``--moe-lrmoe-memory-budget-gb`` is in GiB (2**30 bytes), the unit
``torch.cuda.memory_allocated`` and ``nvidia-smi`` figures are usually read in.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import torch
import torch.distributed as dist

from megatron_lrmoe.config.flags import DEVICE_MEMORY_FLAG, tokens_per_rank
from megatron_lrmoe.options.lrmoe import option
from megatron_lrmoe.planning.cost_model import CostModel
from megatron_lrmoe.planning.machine import MachineConstants, default_machine_constants
from megatron_lrmoe.planning.memory_account import (
    GIB,
    MemoryAccount,
    RunShape,
    auto_budget_bytes,
    moe_peak,
)
from megatron_lrmoe.planning.memory_account import memory_account as account_of
from megatron_lrmoe.planning.plan_types import budget_floor
from megatron_lrmoe.planning.planner import PlannerSettings
from megatron_lrmoe.planning.retention import TWO_STAGE, stored_in_forward
from megatron_lrmoe.planning.shapes import MoEShape

__all__ = ["account_gap", "agreed_machine_constants", "allocator_check",
           "check_memory_budget", "device_memory_bytes", "fitting_micro_batch_size",
           "hybrid_stages", "machine_constants", "memory_account", "moe_layers_per_stage",
           "moe_shape", "needs_cost_model", "planner_settings", "recomputed_moe_layers",
           "resolve_memory_budget", "run_shape", "stage_moe_layers"]



def moe_layers_per_stage(num_layers: int, moe_layer_freq, pipeline_size: int) -> int:
    """MoE layers one pipeline stage holds (the most of any stage, with an even split)."""
    if isinstance(moe_layer_freq, int):
        moe = sum(1 for i in range(num_layers) if i % moe_layer_freq == 0)
    else:
        moe = sum(1 for flag in moe_layer_freq if flag)
    return max(1, -(-moe // max(1, pipeline_size)))


def hybrid_stages(config) -> list[str] | None:
    """The layer symbols of each pipeline stage of a hybrid (Mamba) model's main decoder
    (``|`` separates stages, as in Megatron's HybridModel; a pattern without one is cut
    evenly here, whatever uneven first or last stage Megatron is given; MTP layers, after
    ``/``, are not the decoder's); None for other models."""
    pattern = (getattr(config, "hybrid_layer_pattern", None)
               or getattr(config, "hybrid_override_pattern", None))
    if not pattern:
        return None
    from megatron.core.models.hybrid.hybrid_layer_allocation import Symbols, parse_hybrid_pattern

    main = parse_hybrid_pattern(pattern).main_pattern or ""
    stages = main.split(Symbols.PIPE)
    pp = config.pipeline_model_parallel_size or 1
    if len(stages) == 1 and pp > 1:
        size = -(-len(main) // pp)
        stages = [main[i:i + size] for i in range(0, len(main), size)]
    return stages


def stage_moe_layers(config) -> int:
    """MoE layers one pipeline stage of ``config``'s model holds (the most of any stage):
    the MoE layers (``E``) of a hybrid model's pattern, else by ``moe_layer_freq``."""
    stages = hybrid_stages(config)
    if stages is None:
        return moe_layers_per_stage(config.num_layers, config.moe_layer_freq,
                                    config.pipeline_model_parallel_size or 1)
    from megatron.core.models.hybrid.hybrid_layer_allocation import Symbols

    return max(1, max(stage.count(Symbols.MOE) for stage in stages))


def recomputed_moe_layers(config) -> tuple[bool, int]:
    """(``moe`` recompute, MoE layers rerun by full recompute) of the stage with the most
    MoE layers, from Megatron's recompute settings: ``--recompute-granularity selective
    --recompute-modules moe`` reruns every MoE layer; ``full`` with the uniform method
    every layer (chunk by chunk), with the block method the MoE layers among the first
    ``--recompute-num-layers`` layers of the stage (the first stage's pattern)."""
    if config.recompute_granularity == "selective":
        return "moe" in (config.recompute_modules or ()), 0
    if config.recompute_granularity != "full":
        return False, 0
    pp = config.pipeline_model_parallel_size or 1
    layers = stage_moe_layers(config)
    if config.recompute_method != "block":
        return False, layers
    stages = hybrid_stages(config)
    if stages is not None:
        from megatron.core.models.hybrid.hybrid_layer_allocation import Symbols

        first_layers = stages[0][:config.recompute_num_layers or 0]
        return False, min(layers, first_layers.count(Symbols.MOE))
    first = range(min(config.recompute_num_layers or 0, config.num_layers // pp))
    freq = config.moe_layer_freq
    moe = (sum(1 for i in first if i % freq == 0) if isinstance(freq, int)
           else sum(1 for i in first if freq[i]))
    return False, min(layers, moe)


def moe_shape(config, tokens_per_rank: int, microbatches_per_step: int = 1,
              ep_size: int | None = None) -> MoEShape:
    """The MoE layer's shape on one EP rank for the cost model (``ep_size``: the EP group's
    size, default the config's)."""
    dtype = config.params_dtype
    pp = config.pipeline_model_parallel_size or 1
    ep = ep_size or config.expert_model_parallel_size or 1
    recompute_moe, full_recompute_layers = recomputed_moe_layers(config)
    # A plain Megatron config (the simulator's baselines) has no LRMoE fields: the option
    # table's defaults then.
    def lrmoe(field: str):
        return getattr(config, field, option(field).default)

    selection, metric = lrmoe("moe_lrmoe_selection"), lrmoe("moe_lrmoe_metric")
    return MoEShape(
        hidden_size=config.hidden_size,
        ffn_hidden_size=config.moe_ffn_hidden_size or config.ffn_hidden_size,
        num_experts=config.num_moe_experts,
        topk=config.moe_router_topk,
        gated=bool(config.gated_linear_unit),
        dtype_bytes=torch.empty(0, dtype=dtype).element_size(),
        tokens_per_rank=max(1, int(tokens_per_rank)),
        num_layers=stage_moe_layers(config),
        # 1F1B keeps up to PP micro-batches' activations alive on the first stage.
        microbatches_in_flight=pp,
        microbatches_per_step=max(1, int(microbatches_per_step)),
        grad_dtype_bytes=4 if dtype in (torch.bfloat16, torch.float16) else None,
        expert_parallel_size=ep,
        expert_bias=bool(config.add_bias_linear),
        # The region's GEMMs run grouped on request and, by default, on CUDA (where a
        # failed probe falls back to the loop, which holds less: the model errs safe).
        grouped_gemm=bool(config.moe_grouped_gemm) or torch.cuda.is_available(),
        forward_retention=stored_in_forward(selection, metric),
        store_factor=(float(lrmoe("moe_lrmoe_store_factor")) if selection == TWO_STAGE
                      else None),
        recompute_moe=recompute_moe,
        full_recompute_layers=full_recompute_layers,
    )


# Memory needs read no machine constant: cost models that only price memory (a held
# run's planners, the memory account) get these.
_MEMORY_ONLY = MachineConstants(gemm_flops_per_s=1.0, alltoall_bytes_per_s=1.0,
                                source="memory only")


@functools.lru_cache(maxsize=8)
def machine_constants(calibration: str | None, device_type: str) -> MachineConstants:
    """Measured constants: the calibration JSON if given, else a quick in-process
    measurement (labelled as such in ``source``); cached per process."""
    if calibration:
        return MachineConstants.from_json(calibration)
    return default_machine_constants(device_type)


def agreed_machine_constants(calibration: str | None, device: torch.device,
                             group=None) -> MachineConstants:
    """``machine_constants``, identical on every rank of ``group``.

    Every rank that plans a layer must plan from the same numbers (the planners' outputs
    must agree without communication, within an EP group and, since the expert-data-
    parallel replicas of a layer share one planner state, across EP groups too). A
    calibration file is the same everywhere; an in-process measurement is not, so the
    ranks average theirs (one all-reduce over ``group``, once at model setup).
    """
    constants = machine_constants(calibration, device.type)
    if calibration or group is None or dist.get_world_size(group) == 1:
        return constants
    values = torch.tensor([constants.gemm_flops_per_s, constants.alltoall_bytes_per_s,
                           constants.alltoall_latency_s], dtype=torch.float64, device=device)
    dist.all_reduce(values, group=group)
    gemm, bandwidth, latency = (values / dist.get_world_size(group)).tolist()
    return dataclasses.replace(constants, gemm_flops_per_s=gemm, alltoall_bytes_per_s=bandwidth,
                               alltoall_latency_s=latency,
                               source=constants.source + " (averaged over all ranks)")


def needs_cost_model(config) -> bool:
    """Whether the layer's planner needs the cost model (and so the machine constants and
    the tokens per micro-batch): with a memory budget or memory-aware placement."""
    return (config.moe_lrmoe_memory_budget_gb is not None
            or config.moe_lrmoe_placement == "memory-aware")


def planner_settings(config, ep_size: int, tokens_per_rank: int | None = None,
                     microbatches_per_step: int = 1,
                     machine: MachineConstants | None = None,
                     hold_memory: bool = False) -> PlannerSettings:
    """PlannerSettings of one LRMoE layer (raises ValueError naming the setting).

    ``tokens_per_rank`` and ``machine`` are needed when ``needs_cost_model(config)``;
    ``tokens_per_rank`` also with ``hold_memory`` (the run is held to its device: the
    planner prices every plan's [R] memory, which reads no machine constant). Pure: no
    measurement, no communication (``agreed_machine_constants`` is the caller's, once
    for all layers)."""
    cost = None
    priced = needs_cost_model(config)
    if priced and (tokens_per_rank is None or machine is None):
        raise ValueError("the planner of this configuration (--moe-lrmoe-memory-budget-gb "
                         "or --moe-lrmoe-placement memory-aware) needs the tokens per "
                         "micro-batch and the machine constants")
    if hold_memory and tokens_per_rank is None:
        raise ValueError("a run held to its device (--device-memory-gb) prices each "
                         "plan's memory: the planner needs the tokens per micro-batch")
    if priced or hold_memory:
        cost = CostModel(moe_shape(config, tokens_per_rank, microbatches_per_step, ep_size),
                         machine if priced else _MEMORY_ONLY)
    budget = config.moe_lrmoe_memory_budget_gb
    return PlannerSettings(
        policy=config.moe_lrmoe_placement,
        num_ranks=ep_size,
        num_experts=config.num_moe_experts,
        capacity_factor=config.moe_lrmoe_bwd_capacity_factor,
        min_retention=config.moe_lrmoe_min_retention,
        slots_per_rank=config.moe_lrmoe_slots_per_rank,
        budget_bytes=None if budget is None else budget * GIB,
        load_smoothing=config.moe_lrmoe_load_smoothing,
        cost=cost,
    )


def check_memory_budget(config, ep_size: int, tokens_per_rank: int,
                        microbatches_per_step: int = 1, device_type: str = "cpu",
                        micro_batch_size: int | None = None) -> str | None:
    """Start-up check of ``--moe-lrmoe-memory-budget-gb`` against ``budget_floor`` of the
    configured shapes: balanced routing with nothing retained in backward
    (docs/design.md, "Memory budget"); raises ValueError naming the flag, the budget and
    the floor. A budget between the floor and the balanced dropless need is accepted:
    the planner lowers gamma. Returns the line to print: the largest micro-batch sizes
    the budget holds at balanced routing, dropless and at the configured retention
    (``micro_batch_size``: the run's, whose tokens are ``tokens_per_rank``). None
    without a budget."""
    budget = config.moe_lrmoe_memory_budget_gb
    if not config.moe_lrmoe or budget is None:
        return None
    shape = moe_shape(config, tokens_per_rank, microbatches_per_step, ep_size)
    cost = CostModel(shape, machine_constants(config.moe_lrmoe_calibration, device_type))
    floor = budget_floor(cost)
    if budget * GIB < floor:
        raise ValueError(
            f"--moe-lrmoe-memory-budget-gb {budget:g} is below the floor of "
            f"{floor / GIB:.4g} GiB per rank: what the MoE layers need even with perfectly "
            f"balanced routing and nothing retained in backward ({shape.num_layers} MoE "
            f"layer(s) x {shape.microbatches_in_flight} micro-batch(es) in flight, "
            f"{shape.tokens_per_rank} tokens x top-{shape.topk} per rank); raise it to at "
            "least that (between the floor and the balanced dropless need, "
            f"{cost.balanced_dropless_need() / GIB:.4g} GiB, the planner lowers gamma)")
    if micro_batch_size is None:
        return None
    gamma = config.moe_lrmoe_bwd_capacity_factor
    retention = min(1.0, max(gamma, config.moe_lrmoe_min_retention))
    per_sequence = tokens_per_rank / micro_batch_size
    dropless = fitting_micro_batch_size(cost, budget * GIB, per_sequence, 1.0)
    lrmoe = fitting_micro_batch_size(cost, budget * GIB, per_sequence, retention)
    where = ("retention drawn in backward: x and z saved for every routed row"
             if not shape.forward_retention
             else "x and z saved for retained rows only" if shape.store_factor is None
             else f"x and z saved for {shape.store_factor:g} x the retained rows")
    return (f"--moe-lrmoe-memory-budget-gb {budget:g}: at balanced routing the MoE layers fit "
            f"micro-batch size <= {dropless} dropless, <= {lrmoe} at retention "
            f"{retention:g} ({where}); this run uses {micro_batch_size}")


def fitting_micro_batch_size(cost: CostModel, budget_bytes: float, tokens_per_sequence: float,
                             retention: float, limit: int = 1 << 16) -> int:
    """The largest micro-batch size whose MoE layers fit ``budget_bytes`` per rank at
    perfectly balanced routing with ``retention`` of each rank's rows kept (0 if none;
    at most ``limit``). Memory grows with the micro-batch size, so a bisection over it
    on ``CostModel.balanced_need`` finds it."""
    def fits(size: int) -> bool:
        tokens = max(1, round(size * tokens_per_sequence))
        resized = CostModel(dataclasses.replace(cost.shape, tokens_per_rank=tokens),
                            cost.machine)
        return resized.balanced_need(retention) <= budget_bytes

    low, high = 0, 1
    while high <= limit and fits(high):
        low, high = high, 2 * high
    high = min(high, limit + 1)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


# -----------------------------------------------------------------------------
# The memory account (planning/memory_account.py) and --moe-lrmoe-memory-budget-gb auto
# -----------------------------------------------------------------------------

def device_memory_bytes(device_memory_gb: float | None) -> float | None:
    """The device's size: ``--device-memory-gb`` when given, else on CUDA the total memory
    of this process's device (``LOCAL_RANK``), else None (CPU)."""
    if device_memory_gb is not None:
        return float(device_memory_gb) * GIB
    if torch.cuda.is_available():
        index = int(os.environ.get("LOCAL_RANK", "0")) % max(1, torch.cuda.device_count())
        return float(torch.cuda.get_device_properties(index).total_memory)
    return None


def run_shape(config, args, vocab_size: int) -> RunShape:
    """``RunShape`` of either entry point: the model (and its parallel sizes, context
    parallelism's included) from ``config``, the rest (sequence, micro-batch, data
    parallel as Megatron-LM counts it, without CP; optimizer, embeddings) from ``args``
    (the launcher's or Megatron-LM's; the same dest names), ``vocab_size`` padded as the
    model is built."""
    dtype_bytes = torch.empty(0, dtype=config.params_dtype).element_size()
    pp = config.pipeline_model_parallel_size or 1
    half = dtype_bytes < 4
    # Megatron's DDP keeps fp32 main grads when it reduces in fp32: Megatron-LM's
    # --accumulate-allreduce-grads-in-fp32; the launcher does so with bf16/fp16.
    fp32_grads = getattr(args, "accumulate_allreduce_grads_in_fp32", None)
    fp32_grads = half if fp32_grads is None else bool(fp32_grads) or not half
    moe = config.num_moe_experts is not None
    modules = config.recompute_modules
    return RunShape(
        num_layers=config.num_layers,
        hidden_size=config.hidden_size,
        ffn_hidden_size=config.ffn_hidden_size,
        num_attention_heads=config.num_attention_heads,
        vocab_size=int(vocab_size),
        seq_length=int(args.seq_length),
        micro_batch_size=int(args.micro_batch_size),
        kv_channels=config.kv_channels,
        num_query_groups=config.num_query_groups,
        num_experts=config.num_moe_experts,
        moe_ffn_hidden_size=config.moe_ffn_hidden_size,
        moe_layers=(moe_layers_per_stage(config.num_layers, config.moe_layer_freq, pp)
                    if moe else 0),
        shared_expert_size=config.moe_shared_expert_intermediate_size,
        gated=bool(config.gated_linear_unit),
        layernorm_bias=config.normalization == "LayerNorm",
        linear_bias=bool(config.add_bias_linear),
        qkv_bias=bool(getattr(config, "add_qkv_bias", False)),
        qk_layernorm=bool(config.qk_layernorm),
        tied_embeddings=not getattr(args, "untie_embeddings_and_output_weights", False),
        learned_positions=getattr(args, "position_embedding_type", "") == "learned_absolute",
        max_position_embeddings=getattr(args, "max_position_embeddings", None),
        tensor_parallel=config.tensor_model_parallel_size or 1,
        pipeline_parallel=pp,
        expert_parallel=config.expert_model_parallel_size or 1,
        expert_tensor_parallel=config.expert_tensor_parallel_size or 1,
        data_parallel=max(1, int(getattr(args, "data_parallel_size", 1) or 1)),
        context_parallel=config.context_parallel_size or 1,
        sequence_parallel=bool(config.sequence_parallel),
        param_bytes=dtype_bytes,
        grad_bytes=4 if fp32_grads else dtype_bytes,
        optimizer=getattr(args, "optimizer", "adam"),
        distributed_optimizer=bool(getattr(args, "use_distributed_optimizer", False)),
        recompute_granularity=config.recompute_granularity,
        recompute_modules=tuple(("core_attn",) if modules is None else modules),
        recompute_method=config.recompute_method,
        recompute_num_layers=config.recompute_num_layers,
        # Megatron's local attention is unfused (saves the scores); Transformer Engine's
        # is fused/flash.
        attention_scores_saved=getattr(args, "transformer_impl", "local") == "local",
        attention_dropout=bool(config.attention_dropout),
        hidden_dropout=bool(config.hidden_dropout),
        microbatches_in_flight=pp,
    )


def memory_account(config, args, vocab_size: int, microbatches_per_step: int = 1,
                   device_bytes: float | None = None) -> MemoryAccount:
    """The run's per-rank memory account (planning/memory_account.py); the MoE part is
    the balanced dropless need of ``moe_shape`` (what the planner is sized with)."""
    cost = None
    if config.num_moe_experts is not None:
        cost = CostModel(moe_shape(config, tokens_per_rank(args), microbatches_per_step),
                         _MEMORY_ONLY)
    return account_of(run_shape(config, args, vocab_size), moe_peak(cost), device_bytes)


def account_gap(config) -> str | None:
    """What of ``config``'s model the memory account does not cover, in words, or None.
    The account (planning/memory_account.py) counts standard attention: multi-latent
    attention's projections, latent norms and head dims differ in weights and
    activations. A budget in GiB needs no account and works for these models."""
    if getattr(config, "multi_latent_attention", False):
        return ("the memory account counts standard attention's weights and activations, "
                "not those of multi-latent attention (--multi-latent-attention)")
    return None


def resolve_memory_budget(account: MemoryAccount, config, args,
                          microbatches_per_step: int = 1) -> float:
    """``--moe-lrmoe-memory-budget-gb auto`` in GiB: the device's size less everything but
    the MoE part of ``account``. Raises ValueError naming both flags without a device
    size (CPU without --device-memory-gb) or when it leaves less than ``budget_floor``,
    and naming the flag for a model the account does not cover (a hybrid (Mamba) model,
    ``account_gap``)."""
    if hybrid_stages(config) is not None or getattr(config, "is_hybrid_model", False):
        raise ValueError("--moe-lrmoe-memory-budget-gb auto is not supported for hybrid "
                         "(Mamba) models: the memory account covers Transformer layers only, "
                         "not the Mamba layers' weights, states and activations; give the "
                         "budget in GiB")
    gap = account_gap(config)
    if gap is not None:
        raise ValueError(f"--moe-lrmoe-memory-budget-gb auto: {gap}, so it cannot size the "
                         "MoE budget; give the budget in GiB "
                         "(--moe-lrmoe-memory-budget-gb N)")
    if account.device is None:
        raise ValueError(f"--moe-lrmoe-memory-budget-gb auto needs the device's size: give "
                         f"{DEVICE_MEMORY_FLAG} (on CUDA it defaults to the device's memory)")
    budget = auto_budget_bytes(account)
    cost = CostModel(moe_shape(config, tokens_per_rank(args), microbatches_per_step),
                     _MEMORY_ONLY)
    floor = budget_floor(cost)
    if budget < floor:
        raise ValueError(
            f"--moe-lrmoe-memory-budget-gb auto: {DEVICE_MEMORY_FLAG} "
            f"{account.device / GIB:g} leaves {budget / GIB:.4g} GiB per rank for the MoE "
            f"layers after {account.outside_moe / GIB:.4g} GiB of weights, gradients, "
            f"optimizer state and activations, below the floor of {floor / GIB:.4g} GiB; "
            f"give a larger {DEVICE_MEMORY_FLAG} (the device's real size), or shrink the "
            "run (micro-batch, layers per stage, recompute, distributed optimizer)")
    return budget / GIB


# The budget an ``auto`` run's config is built with until the account resolves it
# (``set_auto_budget``): any GiB its checks accept, since nothing the memory account reads
# depends on the budget.
AUTO_STAND_IN_GIB = 1.0
# Where an auto budget came from, in the account line.
AUTO_BUDGET_SOURCE = "auto: the device less the rest of the account"


def set_auto_budget(config, account: MemoryAccount, args,
                    microbatches_per_step: int = 1) -> None:
    """``--moe-lrmoe-memory-budget-gb auto`` resolved on the run's one config (built with
    ``AUTO_STAND_IN_GIB``): ``resolve_memory_budget`` into its field, then its checks run
    again as for a given budget. Raises ValueError / ``LRMoEConfigError`` naming the flags."""
    config.moe_lrmoe_memory_budget_gb = resolve_memory_budget(account, config, args,
                                                              microbatches_per_step)
    config.check_lrmoe()


def allocator_check(account: MemoryAccount, max_allocated_bytes: float,
                    budget_bytes: float | None) -> str:
    """After the first steps on CUDA: ``torch.cuda.max_memory_allocated`` against the
    account (which the planner's budget came from), as one log line."""
    diff = max_allocated_bytes - account.total
    text = (f"memory account check after the first steps: allocator peak "
            f"{max_allocated_bytes / GIB:.3f} GiB, account total {account.total / GIB:.3f} "
            f"GiB ({'+' if diff >= 0 else '-'}{abs(diff) / GIB:.3f} GiB, "
            f"{100 * diff / max(account.total, 1.0):+.1f}%)")
    if account.device is not None and max_allocated_bytes > account.device:
        text += "; the peak exceeds the device size"
    elif diff > 0 and budget_bytes is not None:
        text += (f"; the account is low: the MoE budget {budget_bytes / GIB:.3f} GiB may not "
                 "fit, lower it or --device-memory-gb")
    return text
