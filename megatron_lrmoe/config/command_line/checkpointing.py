"""The "checkpointing" ``--help`` group: saving, loading and the exit interval
(Megatron-LM's "checkpointing"), and their check."""

from __future__ import annotations

import argparse

from megatron_lrmoe.config.flags import ConfigError


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--exit-interval", type=int, default=None,
                   help="stop (after saving, with --save) when the iteration is a multiple")


def check(args: argparse.Namespace) -> None:
    if args.save_interval is not None and not args.save:
        raise ConfigError("--save-interval needs --save DIR")
