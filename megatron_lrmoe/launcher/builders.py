"""Builders of the launcher: config, model, optimizer, scheduler, datasets.

Each is a thin call into megatron.core with the launcher's arguments mapped to
Megatron's config fields, the way Megatron-LM's ``pretrain_gpt.py`` and
``megatron/training`` do it, so a model built here is the model Megatron-LM
would build from the same flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.torch_norm import WrappedTorchNorm

from megatron_lrmoe.config.command_line.data import data_blend
from megatron_lrmoe.data.tokenizers import build_tokenizer
from megatron_lrmoe.launcher.norms import SequenceParallelTorchNorm
from megatron_lrmoe.layer.spec_utils import replace_module

# A layer-spec transform: Megatron spec in, spec out. The identity for plain
# Megatron runs; the LRMoE spec converter plugs in here.
SpecTransform = Callable[[object], object]


def params_dtype(args: argparse.Namespace) -> torch.dtype:
    if args.bf16:
        return torch.bfloat16
    if args.fp16:
        return torch.float16
    return torch.float32


def transformer_config_from_args(
    args: argparse.Namespace, config_class: type[TransformerConfig] | None = None
) -> TransformerConfig:
    """Map launcher flags to a (subclass of) Megatron's TransformerConfig.

    With ``--moe-lrmoe`` the class is LRMoETransformerConfig and every ``moe_lrmoe*``
    field takes the same-named flag, as Megatron-LM's config builder does.
    """
    if config_class is None:
        config_class = _lrmoe_config_class() if args.moe_lrmoe else TransformerConfig
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
    return config_class(**kwargs)


def _lrmoe_config_class() -> type[TransformerConfig]:
    # Imported only when asked for: without --moe-lrmoe nothing of LRMoE is loaded.
    from megatron_lrmoe.config.transformer_config import LRMoETransformerConfig

    return LRMoETransformerConfig


def lrmoe_spec_transform(args: argparse.Namespace) -> SpecTransform | None:
    """The LRMoE spec converter with --moe-lrmoe, else None (Megatron's spec untouched)."""
    if not args.moe_lrmoe:
        return None
    from megatron_lrmoe.layer.spec import to_lrmoe_spec

    return to_lrmoe_spec


def layer_spec_from_args(args: argparse.Namespace, config: TransformerConfig):
    """Megatron's own GPT decoder-block spec for these flags.

    The block spec honours ``--moe-layer-freq`` (dense layers where it says 0, and
    every layer for a dense model) and holds only this pipeline stage's layers.
    """
    use_te = args.transformer_impl == "transformer_engine"
    spec = get_gpt_decoder_block_spec(
        config, use_transformer_engine=use_te, normalization=args.normalization
    )
    if config.sequence_parallel and not use_te:
        spec = replace_module(spec, WrappedTorchNorm, SequenceParallelTorchNorm)
    return spec


def padded_vocab_size(vocab_size: int, args: argparse.Namespace) -> int:
    """Megatron-LM's padding: a multiple of make-vocab-size-divisible-by x TP."""
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    return int(math.ceil(vocab_size / multiple) * multiple)


def build_model(
    args: argparse.Namespace,
    config: TransformerConfig,
    vocab_size: int,
    spec_transform: SpecTransform | None = None,
) -> list[DistributedDataParallel]:
    """This pipeline stage's GPTModel, wrapped in Megatron's DDP (one model chunk)."""
    spec = layer_spec_from_args(args, config)
    if spec_transform is not None:
        spec = spec_transform(spec)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab_size(vocab_size, args),
        max_sequence_length=args.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
    )
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    if args.bf16 or args.fp16:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(config, model)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=args.bf16 or args.fp16,
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        use_distributed_optimizer=args.use_distributed_optimizer,
        check_for_nan_in_grad=True,
    )
    ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    # Identical initial weights on every data-parallel replica, as Megatron-LM does.
    ddp.broadcast_params()
    return [ddp]


def build_optimizer(args: argparse.Namespace, model: list[DistributedDataParallel]):
    config = OptimizerConfig(
        optimizer=args.optimizer,
        lr=args.lr,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        clip_grad=args.clip_grad,
        bf16=args.bf16,
        fp16=args.fp16,
        params_dtype=params_dtype(args),
        use_distributed_optimizer=args.use_distributed_optimizer,
        overlap_param_gather_with_optimizer_step=False,
    )
    return get_megatron_optimizer(config, model)


def build_scheduler(args: argparse.Namespace, optimizer) -> OptimizerParamScheduler:
    """Megatron's scheduler, stepped in samples as Megatron-LM does."""
    gbs = args.global_batch_size
    wsd_steps = args.lr_wsd_decay_iters * gbs if args.lr_wsd_decay_iters else None
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if args.lr_warmup_iters else args.lr,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters * gbs,
        lr_decay_steps=args.lr_decay_iters * gbs,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters * gbs,
        wd_incr_style="constant",
        wsd_decay_steps=wsd_steps,
        lr_wsd_decay_style="exponential" if wsd_steps else None,
    )


def dataset_sizes(args: argparse.Namespace) -> list[int]:
    """Samples needed for train, validation and test, as Megatron-LM sizes them."""
    gbs = args.global_batch_size
    evals = (args.train_iters // args.eval_interval + 1) * args.eval_iters
    return [args.train_iters * gbs, evals * gbs, args.eval_iters * gbs]


def build_tokenizer_from_args(args: argparse.Namespace):
    return build_tokenizer(args.tokenizer_type, args.tokenizer_model)


def build_datasets(args: argparse.Namespace, tokenizer):
    """Train/valid/test GPTDatasets (or Megatron's mock datasets with --mock-data)."""
    blend = None if args.mock_data else data_blend(args.data_path)
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        split=args.split,
        path_to_cache=args.data_cache_path,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
    )
    cls = MockGPTDataset if args.mock_data else GPTDataset
    train, valid, test = BlendedMegatronDatasetBuilder(
        cls, dataset_sizes(args), lambda: True, config
    ).build()
    return train, valid, test
