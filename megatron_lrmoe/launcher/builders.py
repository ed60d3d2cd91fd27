"""Builders of the launcher: model, optimizer, scheduler, tokenizer, datasets.

Each is a thin call into megatron.core with the launcher's arguments mapped to
Megatron's config fields, the way Megatron-LM's ``pretrain_gpt.py`` and
``megatron/training`` do it, so a model built here is the model Megatron-LM
would build from the same flags.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

import torch
from megatron.core import parallel_state
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.torch_norm import WrappedTorchNorm

from megatron_lrmoe.config.command_line.data import data_blend
from megatron_lrmoe.data.tokenizers import build_tokenizer
from megatron_lrmoe.launcher.norms import SequenceParallelTorchNorm
from megatron_lrmoe.layer.spec import to_lrmoe_spec
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


def lrmoe_spec_transform(args: argparse.Namespace) -> SpecTransform | None:
    """The LRMoE spec converter with --moe-lrmoe, else None (Megatron's spec untouched)."""
    return to_lrmoe_spec if args.moe_lrmoe else None


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
