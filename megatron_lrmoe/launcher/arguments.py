"""Command line of the lean launcher, with Megatron-LM's flag names.

The launcher accepts the subset of Megatron-LM's ``pretrain_gpt.py`` flags it
implements, spelled the same way, so one shell script's flags work with both.
A flag Megatron-LM knows but this launcher does not implement is an error
(Megatron-LM's parser is strict too), never silently ignored.

``--config FILE`` reads a flat YAML mapping of the same flag names (without the
leading dashes; ``num-layers`` and ``num_layers`` both work) to values; flags on
the command line override it. ``true``/``false`` switch store-true flags.

Every check that can be made before any process group exists lives in
``validate_args`` and raises ``ConfigError`` naming the flag and the fix. The
``--moe-lrmoe*`` flags and their checks are generated from the one option table,
``OPTIONS`` in ``megatron_lrmoe/config/options.py`` (``add_lrmoe_args``,
``validate_lrmoe_flags`` in ``megatron_lrmoe/config/flags.py``; the Megatron-LM entry
point uses the same two).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence
from typing import Any

import yaml

from megatron_lrmoe.config.flags import (
    ConfigError,
    add_lrmoe_args,
    lrmoe_view,
    moe_layer_freq,
    validate_lrmoe_flags,
)


def _str2float_or_none(value: str) -> float | None:
    return None if value.lower() in ("none", "null") else float(value)


def build_parser() -> argparse.ArgumentParser:
    """The launcher's parser. Defaults follow Megatron-LM's unless noted.

    One builder per ``--help`` group, in the order the groups (and so ``--help``) list
    them; each is named after Megatron-LM's builder of the same flags.
    """
    p = argparse.ArgumentParser(
        prog="python -m megatron_lrmoe.launcher.pretrain",
        description="Train a GPT(-MoE) model with Megatron-Core (Megatron-LM flag names).",
        allow_abbrev=False,
    )
    p.add_argument("--config", type=str, default=None, help="flat YAML of flag names to values")
    _add_network_size_args(p)
    _add_moe_args(p)
    add_lrmoe_args(p)   # generated from the option table (config/options.py)
    _add_distributed_args(p)
    _add_training_args(p)
    _add_data_args(p)
    _add_checkpointing_args(p)
    _add_logging_args(p)
    return p


def _add_network_size_args(p: argparse.ArgumentParser) -> None:
    """Model shape and layer options (Megatron-LM's "network size", with its
    dropout and initialisation flags)."""
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=None)
    g.add_argument("--hidden-size", type=int, default=None)
    g.add_argument("--num-attention-heads", type=int, default=None)
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="default 4 x hidden")
    g.add_argument("--kv-channels", type=int, default=None)
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int, default=None)
    g.add_argument("--seq-length", type=int, default=None)
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--position-embedding-type", default="learned_absolute",
                   choices=["learned_absolute", "rope", "none"])
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument("--rotary-percent", type=float, default=1.0)
    g.add_argument("--normalization", default="LayerNorm", choices=["LayerNorm", "RMSNorm"])
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--disable-bias-linear", action="store_true")
    g.add_argument("--add-qkv-bias", action="store_true",
                   help="bias in the QKV projection only (e.g. GLM-4.5)")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--qk-layernorm", action="store_true")
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--transformer-impl", default=None, choices=["local", "transformer_engine"],
                   help="default: transformer_engine when installed and on CUDA, else local")


def _add_moe_args(p: argparse.ArgumentParser) -> None:
    """Megatron-Core's MoE flags (Megatron-LM's "moe"); ``--moe-lrmoe*`` come from
    ``add_lrmoe_args``."""
    g = p.add_argument_group("mixture of experts")
    g.add_argument("--num-experts", type=int, default=None)
    g.add_argument("--moe-router-topk", type=int, default=2)
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None,
                   help="default --ffn-hidden-size")
    g.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None)
    g.add_argument("--moe-layer-freq", type=moe_layer_freq, default=1)
    g.add_argument("--moe-token-dispatcher-type", default="allgather",
                   help="allgather or alltoall (flex needs DeepEP and is not supported)")
    g.add_argument("--moe-router-load-balancing-type", default="aux_loss",
                   choices=["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"])
    g.add_argument("--moe-aux-loss-coeff", type=float, default=0.0)
    g.add_argument("--moe-z-loss-coeff", type=float, default=None)
    g.add_argument("--moe-router-score-function", default="softmax",
                   choices=["softmax", "sigmoid"])
    g.add_argument("--moe-router-pre-softmax", action="store_true")
    g.add_argument("--moe-router-enable-expert-bias", action="store_true")
    g.add_argument("--moe-router-bias-update-rate", type=float, default=1e-3)
    g.add_argument("--moe-router-dtype", default=None, choices=["fp32", "fp64"])
    g.add_argument("--moe-expert-capacity-factor", type=_str2float_or_none, default=None)
    g.add_argument("--moe-pad-expert-input-to-capacity", action="store_true")
    g.add_argument("--moe-token-drop-policy", default="probs", choices=["probs", "position"])
    g.add_argument("--moe-grouped-gemm", action="store_true")
    g.add_argument("--moe-permute-fusion", action="store_true")


def _add_distributed_args(p: argparse.ArgumentParser) -> None:
    """Parallel layout and gradient/parameter communication (Megatron-LM's
    "distributed")."""
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--expert-model-parallel-size", type=int, default=1)
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                   help="default --tensor-model-parallel-size")
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument("--overlap-param-gather", action="store_true")
    g.add_argument("--distributed-backend", default=None, choices=["nccl", "gloo"],
                   help="default nccl on CUDA, gloo on CPU")


def _add_training_args(p: argparse.ArgumentParser) -> None:
    """Batches, iterations, optimizer, learning rate, precision and recompute
    (Megatron-LM spreads these over "training", "learning rate", "regularization" and
    "mixed precision"; here they share one --help group)."""
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=None)
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="default micro-batch-size x data-parallel size")
    g.add_argument("--train-iters", type=int, default=None)
    g.add_argument("--optimizer", default="adam", choices=["adam", "sgd"])
    g.add_argument("--lr", type=float, default=None)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", default="linear",
                   choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"])
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-fraction", type=float, default=None,
                   help="warm-up as a fraction of --lr-decay-iters, rounded to whole "
                        "iterations (instead of --lr-warmup-iters, as in Megatron-LM)")
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default --train-iters")
    g.add_argument("--lr-wsd-decay-iters", type=int, default=None)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--recompute-granularity", default=None, choices=["full", "selective"],
                   help="activation recompute, as in Megatron-LM (with --moe-lrmoe too: "
                        "docs/design.md, \"Recompute\")")
    g.add_argument("--recompute-method", default=None, choices=["uniform", "block"],
                   help="with --recompute-granularity full: which layers")
    g.add_argument("--recompute-num-layers", type=int, default=None,
                   help="with --recompute-granularity full: layers per unit (uniform) or "
                        "recomputed per stage (block)")
    g.add_argument("--recompute-modules", nargs="*", default=None,
                   help="with --recompute-granularity selective: Megatron's module names "
                        "(default: core_attn)")


def _add_data_args(p: argparse.ArgumentParser) -> None:
    """Datasets and tokenizer (Megatron-LM's "data and dataloader" and "tokenizer")."""
    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="prefixes of Megatron indexed datasets, optionally with weights")
    g.add_argument("--split", default="969,30,1")
    g.add_argument("--mock-data", action="store_true")
    g.add_argument("--tokenizer-type", default="ByteLevelTokenizer")
    g.add_argument("--tokenizer-model", default=None)
    g.add_argument("--data-cache-path", default=None)


def _add_checkpointing_args(p: argparse.ArgumentParser) -> None:
    """Saving, loading and the exit interval (Megatron-LM's "checkpointing")."""
    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--exit-interval", type=int, default=None,
                   help="stop (after saving, with --save) when the iteration is a multiple")


def _add_logging_args(p: argparse.ArgumentParser) -> None:
    """Log and evaluation intervals, and the launcher's own sinks (Megatron-LM's
    "logging" and "validation")."""
    g = p.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--log-json", default=None,
                   help="(launcher) JSON-lines file with one record per step")
    g.add_argument("--no-progress-bar", action="store_true", help="(launcher) plain log lines")
    g.add_argument("--no-moe-timing", action="store_true",
                   help="(launcher) do not time MoE layers (avoids device syncs on GPU)")
    g.add_argument("--record-routing", default=None, metavar="DIR",
                   help="(launcher) record every MoE layer's routed counts per micro-batch and "
                        "source rank into DIR (format: megatron_lrmoe/data/routing_traces.py)")


def _flag_dests(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions if a.dest not in ("help", "config")}


def load_yaml_config(path: str, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """Read a flat YAML of flag names to values into parser defaults (by dest)."""
    if not os.path.isfile(path):
        raise ConfigError(f"--config {path}: file not found")
    with open(path) as f:
        raw = yaml.safe_load(f) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"--config {path}: expected a flat mapping of flag names to values")
    actions = _flag_dests(parser)
    defaults: dict[str, Any] = {}
    for key, value in raw.items():
        dest = str(key).lstrip("-").replace("-", "_")
        action = actions.get(dest)
        if action is None:
            raise ConfigError(f"--config {path}: unknown flag {key!r}")
        if isinstance(action, argparse._StoreTrueAction):
            if not isinstance(value, bool):
                raise ConfigError(f"--config {path}: {key} is a switch, give true or false")
        elif value is not None and action.type is not None:
            if action.nargs in ("*", "+"):
                items = value if isinstance(value, list) else str(value).split()
                value = [action.type(str(v)) for v in items]
            else:
                value = action.type(value if isinstance(value, int | list) else str(value))
        elif action.nargs in ("*", "+") and value is not None and not isinstance(value, list):
            value = str(value).split()
        if action.choices is not None and value is not None and value not in action.choices:
            raise ConfigError(
                f"--config {path}: {key}={value!r} is not one of {list(action.choices)}"
            )
        defaults[dest] = value
    return defaults


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
    _warmup_from_one_source(args, sys.argv[1:] if argv is None else argv)
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    fill_derived_args(args, world_size)
    validate_args(args, world_size)
    return args


def _warmup_from_one_source(args: argparse.Namespace, argv: Sequence[str]) -> None:
    """``--lr-warmup-iters`` and ``--lr-warmup-fraction`` are exclusive (Megatron-LM); one
    given on the command line replaces the other's value from ``--config``, as any
    command-line flag overrides the file (``--lr-warmup-iters 5`` with a config that sets
    a fraction)."""
    given = {flag for flag in ("--lr-warmup-iters", "--lr-warmup-fraction")
             if any(a == flag or a.startswith(flag + "=") for a in argv)}
    if given == {"--lr-warmup-iters"}:
        args.lr_warmup_fraction = None
    elif given == {"--lr-warmup-fraction"}:
        args.lr_warmup_iters = 0
    elif args.lr_warmup_fraction is not None and args.lr_warmup_iters:
        raise ConfigError(
            f"--lr-warmup-iters ({args.lr_warmup_iters}) and --lr-warmup-fraction "
            f"({args.lr_warmup_fraction}) are exclusive; give one of them"
        )


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
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    # Checked in validate_args; a fraction scales the warm-up with the run's length.
    if (args.lr_warmup_fraction is not None and 0 <= args.lr_warmup_fraction < 1
            and args.lr_decay_iters is not None):
        args.lr_warmup_iters = round(args.lr_warmup_fraction * args.lr_decay_iters)
    if args.transformer_impl is None:
        args.transformer_impl = "transformer_engine" if _te_usable() else "local"


def _te_usable() -> bool:
    import importlib.util

    import torch

    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


def _require(args: argparse.Namespace, *dests: str) -> None:
    for dest in dests:
        if getattr(args, dest) is None:
            raise ConfigError(f"--{dest.replace('_', '-')} is required")


def _positive(args: argparse.Namespace, *dests: str) -> None:
    for dest in dests:
        value = getattr(args, dest)
        if value is not None and value <= 0:
            raise ConfigError(f"--{dest.replace('_', '-')} must be positive, got {value}")


def validate_args(args: argparse.Namespace, world_size: int) -> None:
    """Refuse configurations that cannot run, naming the flag and the fix.

    The groups run in this order, and the checks within each in theirs: where one input
    fails two checks, the first message is the one users (and tests) see.
    """
    _check_required_and_ranges(args)
    _check_model_shape(args)
    _check_moe(args)
    validate_lrmoe_flags(lrmoe_view(args))   # --moe-lrmoe*, from the option table
    _check_parallelism(args, world_size)
    _check_batch_and_schedule(args)
    _check_precision(args)
    _check_data(args)
    _check_routing_record(args)
    _check_checkpointing(args)
    _check_tokenizer(args)


def _check_required_and_ranges(args: argparse.Namespace) -> None:
    """Flags without a default, and counts that must be positive."""
    _require(args, "num_layers", "hidden_size", "num_attention_heads", "seq_length",
             "micro_batch_size", "train_iters", "lr")
    _positive(args, "num_layers", "hidden_size", "num_attention_heads", "seq_length",
              "micro_batch_size", "train_iters", "global_batch_size", "log_interval",
              "eval_interval", "tensor_model_parallel_size", "pipeline_model_parallel_size",
              "expert_model_parallel_size", "num_experts", "moe_router_topk", "save_interval",
              "exit_interval")
    if args.eval_iters < 0:
        raise ConfigError(f"--eval-iters must be >= 0, got {args.eval_iters}")


def _check_model_shape(args: argparse.Namespace) -> None:
    """Heads, query groups and positions against the hidden size and sequence."""
    if args.kv_channels is None and args.hidden_size % args.num_attention_heads:
        raise ConfigError(
            f"--hidden-size ({args.hidden_size}) must be divisible by --num-attention-heads "
            f"({args.num_attention_heads}), or give --kv-channels (as Megatron-LM)"
        )
    if args.num_query_groups is not None:
        if not args.group_query_attention:
            raise ConfigError("--num-query-groups needs --group-query-attention (Megatron-LM)")
        if args.num_attention_heads % args.num_query_groups:
            raise ConfigError(
                f"--num-attention-heads ({args.num_attention_heads}) must be divisible by "
                f"--num-query-groups ({args.num_query_groups})"
            )
    if args.position_embedding_type == "learned_absolute" and (
        args.seq_length > args.max_position_embeddings
    ):
        raise ConfigError(
            f"--seq-length ({args.seq_length}) exceeds --max-position-embeddings "
            f"({args.max_position_embeddings}); raise it or use --position-embedding-type rope"
        )


def _check_moe(args: argparse.Namespace) -> None:
    """Megatron-Core's MoE flags (the ``--moe-lrmoe*`` ones are the option table's)."""
    if args.num_experts is not None:
        if args.moe_router_topk > args.num_experts:
            raise ConfigError(
                f"--moe-router-topk ({args.moe_router_topk}) exceeds --num-experts "
                f"({args.num_experts})"
            )
        if args.num_experts % args.expert_model_parallel_size:
            raise ConfigError(
                f"--num-experts ({args.num_experts}) must be divisible by "
                f"--expert-model-parallel-size ({args.expert_model_parallel_size})"
            )
        if args.moe_token_dispatcher_type not in ("allgather", "alltoall"):
            raise ConfigError(
                f"--moe-token-dispatcher-type {args.moe_token_dispatcher_type!r} is not "
                f"supported by this launcher; use allgather or alltoall (flex needs DeepEP "
                f"on GPUs: use Megatron-LM's pretrain_gpt.py)"
            )
        if isinstance(args.moe_layer_freq, list) and len(args.moe_layer_freq) != args.num_layers:
            raise ConfigError(
                f"--moe-layer-freq lists {len(args.moe_layer_freq)} layers but --num-layers is "
                f"{args.num_layers}"
            )
        # With --moe-lrmoe the flag means grouped GEMMs inside the LRMoE region (torch's
        # grouped_mm, on every device); without it, Megatron's TEGroupedMLP.
        if (args.moe_grouped_gemm and args.transformer_impl != "transformer_engine"
                and not args.moe_lrmoe):
            raise ConfigError(
                "--moe-grouped-gemm needs Transformer Engine on CUDA (TEGroupedMLP); drop the "
                "flag to use SequentialMLP (with --moe-lrmoe it selects the LRMoE region's "
                "grouped GEMMs on any device)"
            )
        if args.moe_permute_fusion and args.transformer_impl != "transformer_engine":
            raise ConfigError("--moe-permute-fusion needs Transformer Engine on CUDA")
    elif args.expert_model_parallel_size > 1 and not args.moe_lrmoe:
        raise ConfigError("--expert-model-parallel-size > 1 needs --num-experts")


def _check_parallelism(args: argparse.Namespace, world_size: int) -> None:
    """TP/PP/EP/ETP against the world size and the model, sequence parallelism, and the
    distributed optimizer's overlap."""
    tp, pp, ep = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                  args.expert_model_parallel_size)
    if world_size % (tp * pp):
        raise ConfigError(
            f"world size {world_size} must be divisible by --tensor-model-parallel-size ({tp}) "
            f"x --pipeline-model-parallel-size ({pp})"
        )
    expert_ranks = ep * args.expert_tensor_parallel_size
    if (world_size // pp) % expert_ranks:
        raise ConfigError(
            f"--expert-model-parallel-size ({ep}) x --expert-tensor-parallel-size "
            f"({args.expert_tensor_parallel_size}) must divide the ranks of a pipeline stage "
            f"({world_size // pp}); launch more processes or lower them"
        )
    if args.num_layers % pp:
        raise ConfigError(
            f"--num-layers ({args.num_layers}) must be divisible by "
            f"--pipeline-model-parallel-size ({pp})"
        )
    if args.num_attention_heads % tp:
        raise ConfigError(
            f"--num-attention-heads ({args.num_attention_heads}) must be divisible by "
            f"--tensor-model-parallel-size ({tp})"
        )
    if args.sequence_parallel and tp == 1:
        raise ConfigError("--sequence-parallel needs --tensor-model-parallel-size > 1")
    if args.num_experts is not None and tp > 1 and not args.sequence_parallel:
        raise ConfigError(
            "MoE with --tensor-model-parallel-size > 1 needs --sequence-parallel "
            "(Megatron-Core requires it)"
        )
    if args.sequence_parallel and args.seq_length % tp:
        raise ConfigError(
            f"--seq-length ({args.seq_length}) must be divisible by "
            f"--tensor-model-parallel-size ({tp}) with --sequence-parallel"
        )
    if args.overlap_param_gather and not args.use_distributed_optimizer:
        raise ConfigError("--overlap-param-gather needs --use-distributed-optimizer")


def _check_batch_and_schedule(args: argparse.Namespace) -> None:
    """Global batch against micro-batches x data parallel; warm-up and learning rates."""
    dp_batch = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size % dp_batch:
        raise ConfigError(
            f"--global-batch-size ({args.global_batch_size}) must be a multiple of "
            f"--micro-batch-size ({args.micro_batch_size}) x data-parallel size "
            f"({args.data_parallel_size})"
        )
    if args.lr_warmup_fraction is not None and not 0 <= args.lr_warmup_fraction < 1:
        raise ConfigError(
            f"--lr-warmup-fraction must be in [0, 1), got {args.lr_warmup_fraction}")
    if args.lr_warmup_iters and args.lr_warmup_iters >= args.train_iters:
        # Megatron's scheduler needs warm-up strictly shorter than the decay.
        if args.lr_warmup_fraction is not None:
            raise ConfigError(
                f"--lr-warmup-fraction ({args.lr_warmup_fraction}) x --lr-decay-iters "
                f"({args.lr_decay_iters}) gives {args.lr_warmup_iters} warm-up iterations, "
                f"not below --train-iters ({args.train_iters}); lower the fraction"
            )
        raise ConfigError(
            f"--lr-warmup-iters ({args.lr_warmup_iters}) must be below --train-iters "
            f"({args.train_iters}); lower it, or give --lr-warmup-fraction to scale the "
            f"warm-up with the run"
        )
    if args.min_lr > args.lr:
        raise ConfigError(f"--min-lr ({args.min_lr}) exceeds --lr ({args.lr})")


def _check_precision(args: argparse.Namespace) -> None:
    if args.bf16 and args.fp16:
        raise ConfigError("--bf16 and --fp16 are exclusive")
    if args.fp16 and not _cuda_available():
        raise ConfigError("--fp16 needs CUDA (loss scaling); use --bf16 or fp32 on CPU")


def _check_data(args: argparse.Namespace) -> None:
    """Dataset prefixes on disk, and ``--split`` (with the validation share it needs)."""
    if not args.mock_data and not args.data_path:
        raise ConfigError(
            "--data-path is required (or --mock-data); prepare one with "
            "python -m megatron_lrmoe.data.prepare"
        )
    if args.data_path:
        for prefix in _data_prefixes(args.data_path):
            if not (os.path.exists(prefix + ".bin") and os.path.exists(prefix + ".idx")):
                raise ConfigError(
                    f"--data-path {prefix}: {prefix}.bin/.idx not found; prepare it with "
                    f"python -m megatron_lrmoe.data.prepare --output-prefix {prefix}"
                )
    try:
        split = [float(s) for s in args.split.replace("/", ",").split(",")]
    except ValueError as exc:
        raise ConfigError(f"--split {args.split!r}: expected e.g. 969,30,1") from exc
    if len(split) != 3 or min(split) < 0 or sum(split) <= 0:
        raise ConfigError(f"--split {args.split!r}: expected three non-negative weights")
    if args.eval_iters > 0 and split[1] == 0 and not args.mock_data:
        raise ConfigError("--eval-iters > 0 needs a validation share in --split (e.g. 969,30,1)")


def _check_routing_record(args: argparse.Namespace) -> None:
    if args.record_routing is not None:
        if args.num_experts is None:
            raise ConfigError("--record-routing needs an MoE model (--num-experts)")
        if os.path.exists(args.record_routing) and not os.path.isdir(args.record_routing):
            raise ConfigError(f"--record-routing {args.record_routing}: exists and is not a "
                              f"directory")


def _check_checkpointing(args: argparse.Namespace) -> None:
    if args.save_interval is not None and not args.save:
        raise ConfigError("--save-interval needs --save DIR")


def _check_tokenizer(args: argparse.Namespace) -> None:
    if args.tokenizer_type == "SentencePieceTokenizer" and not args.tokenizer_model:
        raise ConfigError("--tokenizer-type SentencePieceTokenizer needs --tokenizer-model")


def _data_prefixes(data_path: list[str]) -> list[str]:
    """Prefixes of ``--data-path``, which may interleave weights: ``0.3 a 0.7 b``."""
    if len(data_path) % 2 == 0 and all(_is_number(w) for w in data_path[0::2]):
        return list(data_path[1::2])
    return list(data_path)


def data_blend(data_path: list[str]) -> tuple[list[str], list[float] | None]:
    """Split ``--data-path`` into prefixes and weights (None: equal weights)."""
    prefixes = _data_prefixes(data_path)
    if prefixes == list(data_path):
        return prefixes, None
    return prefixes, [float(w) for w in data_path[0::2]]


def _is_number(text: str) -> bool:
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
