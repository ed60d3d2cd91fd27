"""The run's one TransformerConfig, built from the launcher's flags once per process.

``build_config(args)``: Megatron's ``TransformerConfig``, or with ``--moe-lrmoe``
``LRMoETransformerConfig``, whose every ``moe_lrmoe*`` field takes the same-named flag
(as Megatron-LM's ``core_transformer_config_from_args`` fills a config class). It is
built before any process group exists, so Megatron-Core's own refusals (its
``__post_init__`` checks) and LRMoE's surface as one ``ConfigError`` naming the flag;
the same object then builds the model.

``--moe-lrmoe-memory-budget-gb auto`` is resolved on that config, once: to the GiB the
device (``--device-memory-gb``, or the CUDA device's) leaves after everything but the MoE
part of the run's memory account (``integration.planner_inputs.resolve_memory_budget``);
refused naming both flags below the floor. ``args`` keeps ``auto``
(``budget_source`` says where the config's budget came from).
"""

from __future__ import annotations

import argparse
import dataclasses

import torch.nn.functional as F
from megatron.core.transformer import TransformerConfig

from megatron_lrmoe.config.flags import ConfigError
from megatron_lrmoe.config.transformer_config import LRMoETransformerConfig
from megatron_lrmoe.integration.planner_inputs import (
    AUTO_BUDGET_SOURCE,
    AUTO_STAND_IN_GIB,
    device_memory_bytes,
    memory_account,
    set_auto_budget,
)
from megatron_lrmoe.launcher.builders import (
    build_tokenizer_from_args,
    padded_vocab_size,
    params_dtype,
)
from megatron_lrmoe.options.lrmoe import AUTO, LRMoEConfigError

__all__ = ["budget_source", "build_config", "transformer_config_from_args"]

def build_config(args: argparse.Namespace, vocab_size: int | None = None) -> TransformerConfig:
    """The run's config (module doc); raises ``ConfigError`` naming the flag.

    ``vocab_size``: the padded vocabulary for an ``auto`` budget's memory account, where
    the tokenizer cannot give it (a projection of a run with a Hugging Face tokenizer,
    lrmoe_studies/fitting.py); None: the tokenizer's, padded as the model pads it."""
    auto = _auto_budget(args)
    try:
        config = transformer_config_from_args(
            args, **({"moe_lrmoe_memory_budget_gb": AUTO_STAND_IN_GIB} if auto else {}))
    except LRMoEConfigError as exc:  # ours: already names the flag
        raise ConfigError(str(exc)) from exc
    except (ValueError, AssertionError) as exc:
        raise ConfigError(f"Megatron-Core refuses this configuration: {exc}") from exc
    if auto:
        _resolve_auto_budget(config, args, vocab_size)
    return config


def budget_source(args: argparse.Namespace) -> str:
    """Where the config's ``--moe-lrmoe-memory-budget-gb`` came from, for the account line."""
    if _auto_budget(args):
        return AUTO_BUDGET_SOURCE
    return "--moe-lrmoe-memory-budget-gb"


def _auto_budget(args: argparse.Namespace) -> bool:
    return bool(args.moe_lrmoe) and args.moe_lrmoe_memory_budget_gb == AUTO


def _resolve_auto_budget(config: TransformerConfig, args: argparse.Namespace,
                         vocab_size: int | None) -> None:
    """The GiB the memory account leaves, into ``config`` (then checked as a given one)."""
    microbatches = args.num_microbatches
    try:
        account = memory_account(config, args, vocab_size or _vocab_size(args), microbatches,
                                 device_memory_bytes(getattr(args, "device_memory_gb", None)))
        set_auto_budget(config, account, args, microbatches)
    except LRMoEConfigError as exc:
        raise ConfigError(str(exc)) from exc
    except (ValueError, AssertionError) as exc:
        raise ConfigError(str(exc)) from exc


def _vocab_size(args: argparse.Namespace) -> int:
    """The padded vocabulary the model is built with (the tokenizer's, padded as
    ``builders.build_model`` pads it)."""
    try:
        vocab = build_tokenizer_from_args(args).vocab_size
    except Exception as exc:  # noqa: BLE001 - the tokenizer's own error, one line
        raise ConfigError(f"--tokenizer-type {args.tokenizer_type}: {exc}") from exc
    return padded_vocab_size(vocab, args)


def transformer_config_from_args(args: argparse.Namespace,
                                 config_class: type[TransformerConfig] | None = None,
                                 **fields: object) -> TransformerConfig:
    """Map launcher flags to a (subclass of) Megatron's TransformerConfig.

    With ``--moe-lrmoe`` the class is LRMoETransformerConfig and every ``moe_lrmoe*``
    field takes the same-named flag, as Megatron-LM's config builder does. ``fields``
    replace the flags' values (``build_config``'s stand-in budget).
    """
    if config_class is None:
        config_class = LRMoETransformerConfig if args.moe_lrmoe else TransformerConfig
    dtype = params_dtype(args)
    moe = args.num_experts is not None
    kwargs = dict(
        # Megatron-LM's parser default ([]): the dataclass default "full" is deprecated
        # and warns on every rank.
        cuda_graph_scope=[],
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        ffn_hidden_size=args.ffn_hidden_size,
        kv_channels=args.kv_channels,
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        normalization=args.normalization,
        layernorm_epsilon=args.norm_epsilon,
        gated_linear_unit=args.swiglu,
        activation_func=F.silu if args.swiglu else F.gelu,
        add_bias_linear=not args.disable_bias_linear,
        add_qkv_bias=args.add_qkv_bias,
        qk_layernorm=args.qk_layernorm,
        init_method_std=args.init_method_std,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        sequence_parallel=args.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=args.bf16,
        fp16=args.fp16,
        # Fusions need apex/TE kernels; the launcher keeps Megatron's unfused paths.
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
    )
    if args.recompute_modules is not None:
        kwargs["recompute_modules"] = args.recompute_modules
    if moe:
        kwargs.update(
            num_moe_experts=args.num_experts,
            moe_router_topk=args.moe_router_topk,
            moe_ffn_hidden_size=args.moe_ffn_hidden_size,
            moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
            moe_layer_freq=args.moe_layer_freq,
            moe_token_dispatcher_type=args.moe_token_dispatcher_type,
            moe_router_load_balancing_type=args.moe_router_load_balancing_type,
            moe_aux_loss_coeff=args.moe_aux_loss_coeff,
            moe_z_loss_coeff=args.moe_z_loss_coeff,
            moe_router_score_function=args.moe_router_score_function,
            moe_router_pre_softmax=args.moe_router_pre_softmax,
            moe_router_enable_expert_bias=args.moe_router_enable_expert_bias,
            moe_router_bias_update_rate=args.moe_router_bias_update_rate,
            moe_router_dtype=args.moe_router_dtype,
            moe_expert_capacity_factor=args.moe_expert_capacity_factor,
            moe_pad_expert_input_to_capacity=args.moe_pad_expert_input_to_capacity,
            moe_token_drop_policy=args.moe_token_drop_policy,
            moe_grouped_gemm=args.moe_grouped_gemm,
            moe_permute_fusion=args.moe_permute_fusion,
        )
    kwargs.update(
        (f.name, getattr(args, f.name))
        for f in dataclasses.fields(config_class)
        if f.name.startswith("moe_lrmoe") and hasattr(args, f.name)
    )
    kwargs.update(fields)
    return config_class(**kwargs)
