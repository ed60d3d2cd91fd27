"""Lean GPT(-MoE) pretraining on megatron.core: ``python -m megatron_lrmoe.launcher.pretrain``.

For machines without a Megatron-LM checkout (the CPU demo, quick experiments).
It takes Megatron-LM's flag names (``config/command_line/``) and uses Megatron-Core
for everything that matters: GPTModel and its layer specs, the pipeline
schedules (``get_forward_backward_func``), DistributedDataParallel,
``get_megatron_optimizer``, OptimizerParamScheduler, dist_checkpointing and
GPTDataset. On a machine without CUDA it enables the CPU/gloo runtime.

Run it under torchrun, e.g. expert parallel over two CPU processes, through
``megatron_lrmoe.launcher``, which checks the flags before torchrun starts workers::

    python -m megatron_lrmoe.launcher --nproc-per-node 2 --config configs/tiny_moe.yaml

``main`` reads as the run goes:

1. the known import-time notices of megatron-core are hidden (before anything imports it);
2. the flags are parsed and checked, and the run's one config is built
   (``run_config.build_config``: Megatron-Core's checks, ``auto`` budget resolved);
   a refusal is one ``error:`` line and exit status 2;
3. ``train``: the runtime is switched on (the CPU/gloo runtime without CUDA), then the
   training module, which imports Megatron at its top, trains (``training.train``).

With ``--device-memory-gb`` the run is held to that device size: after every step each
rank's predicted peak (and on CUDA the allocator's) must fit, else every rank stops with
``DeviceOutOfMemory`` (``device_hold.py``) and exit status 1.
"""

from __future__ import annotations

import argparse
import atexit
import os
import sys
from typing import TYPE_CHECKING

from megatron_lrmoe.config.flags import ConfigError
from megatron_lrmoe.integration.runtime.cpu import (
    enable_cpu_runtime,
    quiet_known_warnings,
    skip_torch_compile_of_functions,
)
from megatron_lrmoe.launcher.arguments import parse_args
from megatron_lrmoe.planning.memory_account import DeviceOutOfMemory

if TYPE_CHECKING:   # Megatron is imported only after quiet_known_warnings
    from megatron.core.transformer import TransformerConfig

__all__ = ["exit_finished_run", "main", "parse_args_or_exit", "train"]


def main(argv: list[str] | None = None) -> dict:
    # Before anything imports megatron.core (most of its known benign warnings fire at
    # import): hide those; on CPU, say in one line what they were about.
    cpu_note = quiet_known_warnings()
    skip_torch_compile_of_functions()
    args, config = parse_args_or_exit(argv)
    if cpu_note and int(os.environ.get("RANK", "0")) == 0:
        print(cpu_note, flush=True)
    try:
        return train(args, config)
    except DeviceOutOfMemory as exc:   # every rank stops at the same step, with this line
        # One write per rank: print() writes the text and the newline separately, and the
        # ranks' lines interleave in a shared log.
        sys.stderr.write(f"error: {exc}\n")
        sys.stderr.flush()
        raise SystemExit(1) from None


def parse_args_or_exit(argv: list[str] | None = None, world_size: int | None = None
                       ) -> tuple[argparse.Namespace, TransformerConfig]:
    """The flags and the run's one config (``run_config.build_config``): every check that
    needs no process group, ours and Megatron-Core's; a refusal is one ``error:`` line on
    stderr (rank 0) and exit status 2. Also the pre-flight check of
    ``megatron_lrmoe.launcher``, before torchrun starts workers."""
    # The config is Megatron's: imported now, after quiet_known_warnings.
    from megatron_lrmoe.launcher.run_config import build_config

    try:
        args = parse_args(argv, world_size)
        config = build_config(args)
    except ConfigError as exc:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    return args, config


def train(args: argparse.Namespace, config: TransformerConfig | None = None) -> dict:
    """Switch the runtime on, then train (``training.train``; ``config``: the run's, built
    there when not given). Returns the summary, on every rank."""
    enable_cpu_runtime()   # no CUDA: Megatron on CPU and gloo; with CUDA nothing changes
    from megatron_lrmoe.launcher import training  # imports Megatron at its top

    return training.train(args, config)


def exit_finished_run() -> None:
    """End a rank whose run finished: every ``atexit`` handler runs (logging's, TensorBoard's,
    Megatron's) and the streams are flushed, then the process exits with status 0 without
    the interpreter's teardown of torch's and Megatron-Core's module graphs, which takes
    seconds per rank on CPU and has nothing left to write (the process group is destroyed
    and every file closed by then). A run that fails exits the ordinary way."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
    exit_finished_run()
