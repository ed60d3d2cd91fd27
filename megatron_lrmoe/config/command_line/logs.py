"""The "logging" ``--help`` group: log and evaluation intervals, and the launcher's own
sinks (Megatron-LM's "logging" and "validation"), and the check of ``--record-routing``."""

from __future__ import annotations

import argparse
import os

from megatron_lrmoe.config.flags import ConfigError


def add_args(p: argparse.ArgumentParser) -> None:
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


def check_routing_record(args: argparse.Namespace) -> None:
    if args.record_routing is not None:
        if args.num_experts is None:
            raise ConfigError("--record-routing needs an MoE model (--num-experts)")
        if os.path.exists(args.record_routing) and not os.path.isdir(args.record_routing):
            raise ConfigError(f"--record-routing {args.record_routing}: exists and is not a "
                              f"directory")
