"""The lean launcher's command line, with Megatron-LM's flag names.

The launcher accepts the subset of Megatron-LM's ``pretrain_gpt.py`` flags it
implements, spelled the same way, so one shell script's flags work with both.
A flag Megatron-LM knows but this launcher does not implement is an error
(Megatron-LM's parser is strict too), never silently ignored.

One module per ``--help`` group holds the group's flags (``add_args``) and their
checks: ``model``, ``moe`` ("mixture of experts"), ``parallelism``, ``training``,
``data``, ``checkpointing``, ``logs`` ("logging"); the ``--moe-lrmoe*`` group is
generated from the option table (``add_lrmoe_args`` and ``validate_lrmoe_flags`` in
``config/flags.py``, which the Megatron-LM entry point uses too). ``build_parser``
composes the groups in ``--help`` order and ``validate_args`` runs every check that can
be made before any process group exists, raising ``ConfigError`` naming the flag and the
fix. ``--config FILE`` is read by ``yaml_config.load_yaml_config``.

This package lives in config, below the launcher, because the Megatron-LM glue reads a
launcher config with the same parser (``integration/megatron_lm.config_to_flags``). It
imports neither torch nor Megatron (the glue loads it before Megatron-LM's checkout is
on ``sys.path``); the launcher's parse is ``launcher/arguments.parse_args``.
"""

from __future__ import annotations

import argparse

from megatron_lrmoe.config.command_line import (
    checkpointing,
    data,
    logs,
    model,
    moe,
    parallelism,
    training,
)
from megatron_lrmoe.config.flags import (
    ConfigError,
    add_lrmoe_args,
    lrmoe_view,
    validate_lrmoe_flags,
)

__all__ = ["build_parser", "validate_args"]


def build_parser() -> argparse.ArgumentParser:
    """The launcher's parser. Defaults follow Megatron-LM's unless noted; one group per
    module, in the order the groups (and so ``--help``) list them."""
    p = argparse.ArgumentParser(
        prog="python -m megatron_lrmoe.launcher.pretrain",
        description="Train a GPT(-MoE) model with Megatron-Core (Megatron-LM flag names).",
        allow_abbrev=False,
    )
    p.add_argument("--config", type=str, default=None, help="flat YAML of flag names to values")
    model.add_args(p)
    moe.add_args(p)
    add_lrmoe_args(p)   # generated from the option table (options/lrmoe.py)
    parallelism.add_args(p)
    training.add_args(p)
    data.add_args(p)
    checkpointing.add_args(p)
    logs.add_args(p)
    return p


def validate_args(args: argparse.Namespace, world_size: int) -> None:
    """Refuse configurations that cannot run, naming the flag and the fix.

    The checks run in this order: where one input fails two checks, the first message
    is the one users (and tests) see.
    """
    _check_required_and_ranges(args)
    model.check_shape(args)
    moe.check(args)
    validate_lrmoe_flags(lrmoe_view(args))   # --moe-lrmoe*, from the option table
    parallelism.check(args, world_size)
    training.check_batch_and_schedule(args)
    training.check_precision(args)
    data.check(args)
    logs.check_routing_record(args)
    checkpointing.check(args)
    data.check_tokenizer(args)


def _check_required_and_ranges(args: argparse.Namespace) -> None:
    """Flags without a default, and counts that must be positive (of every group)."""
    _require(args, "num_layers", "hidden_size", "num_attention_heads", "seq_length",
             "micro_batch_size", "train_iters", "lr")
    _positive(args, "num_layers", "hidden_size", "num_attention_heads", "seq_length",
              "micro_batch_size", "train_iters", "global_batch_size", "log_interval",
              "eval_interval", "tensor_model_parallel_size", "pipeline_model_parallel_size",
              "expert_model_parallel_size", "num_experts", "moe_router_topk", "save_interval",
              "exit_interval")
    if args.eval_iters < 0:
        raise ConfigError(f"--eval-iters must be >= 0, got {args.eval_iters}")


def _require(args: argparse.Namespace, *dests: str) -> None:
    for dest in dests:
        if getattr(args, dest) is None:
            raise ConfigError(f"--{dest.replace('_', '-')} is required")


def _positive(args: argparse.Namespace, *dests: str) -> None:
    for dest in dests:
        value = getattr(args, dest)
        if value is not None and value <= 0:
            raise ConfigError(f"--{dest.replace('_', '-')} must be positive, got {value}")
