"""The "training" ``--help`` group: batches, iterations, optimizer, learning rate,
precision and recompute (Megatron-LM spreads these over "training", "learning rate",
"regularization" and "mixed precision"), and their checks."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from megatron_lrmoe.config.flags import ConfigError


def add_args(p: argparse.ArgumentParser) -> None:
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


def warmup_from_one_source(args: argparse.Namespace, argv: Sequence[str]) -> None:
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


def check_batch_and_schedule(args: argparse.Namespace) -> None:
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


def check_precision(args: argparse.Namespace) -> None:
    if args.bf16 and args.fp16:
        raise ConfigError("--bf16 and --fp16 are exclusive")
    if args.fp16 and not _cuda_available():
        raise ConfigError("--fp16 needs CUDA (loss scaling); use --bf16 or fp32 on CPU")


def _cuda_available() -> bool:
    # torch only when asked: the Megatron-LM glue imports this package before it puts
    # Megatron-LM's checkout on sys.path, and loads neither torch nor Megatron then.
    import torch

    return torch.cuda.is_available()
