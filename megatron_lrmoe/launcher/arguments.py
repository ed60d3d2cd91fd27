"""The lean launcher's parse: flags (with ``--config`` defaults), derived values, checks.

The flags, their ``--help`` groups and their checks are in ``config/command_line/``
(one module per group), shared with the Megatron-LM glue; ``--config FILE`` is read by
``config/command_line/yaml_config.py``. This module adds what only the launcher does:
the values Megatron-LM derives from other flags, for the world size torchrun starts.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from collections.abc import Sequence

import torch

from megatron_lrmoe.config.command_line import build_parser, validate_args
from megatron_lrmoe.config.command_line.training import warmup_from_one_source
from megatron_lrmoe.config.command_line.yaml_config import load_yaml_config

__all__ = ["fill_derived_args", "parse_args"]


def parse_args(argv: Sequence[str] | None = None,
               world_size: int | None = None) -> argparse.Namespace:
    """Parse flags (with ``--config`` defaults), fill derived values, validate.

    ``world_size`` defaults to ``WORLD_SIZE`` (torchrun's); the pre-flight check of
    ``megatron_lrmoe.launcher`` passes the one torchrun is about to start.
    """
    parser = build_parser()
    pre, _ = parser.parse_known_args(argv)
    if pre.config:
        parser.set_defaults(**load_yaml_config(pre.config, parser))
    args = parser.parse_args(argv)
    warmup_from_one_source(args, sys.argv[1:] if argv is None else argv)
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    fill_derived_args(args, world_size)
    validate_args(args, world_size)
    return args


def fill_derived_args(args: argparse.Namespace, world_size: int) -> None:
    """Defaults that depend on other flags, as Megatron-LM derives them."""
    if args.hidden_size is not None and args.ffn_hidden_size is None:
        args.ffn_hidden_size = 4 * args.hidden_size
    if args.num_experts is not None and args.moe_ffn_hidden_size is None:
        args.moe_ffn_hidden_size = args.ffn_hidden_size
    if args.expert_tensor_parallel_size is None:
        args.expert_tensor_parallel_size = args.tensor_model_parallel_size
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    model_parallel = args.tensor_model_parallel_size * args.pipeline_model_parallel_size
    args.world_size = world_size
    args.data_parallel_size = max(world_size // max(model_parallel, 1), 1)
    if args.global_batch_size is None and args.micro_batch_size is not None:
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size is not None and args.micro_batch_size is not None:
        # Micro-batches per step on each data-parallel rank, derived here only: every tool
        # reads args.num_microbatches (check_batch_and_schedule refuses a global batch the
        # micro-batch x data-parallel size does not divide).
        args.num_microbatches = args.global_batch_size // (
            args.micro_batch_size * args.data_parallel_size)
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    # Checked in validate_args; a fraction scales the warm-up with the run's length.
    if (args.lr_warmup_fraction is not None and 0 <= args.lr_warmup_fraction < 1
            and args.lr_decay_iters is not None):
        args.lr_warmup_iters = round(args.lr_warmup_fraction * args.lr_decay_iters)
    if args.transformer_impl is None:
        args.transformer_impl = "transformer_engine" if _te_usable() else "local"


def _te_usable() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None
