"""``python -m megatron_lrmoe.launcher``: torchrun for the launcher, with its flags checked first.

    python -m megatron_lrmoe.launcher --nproc-per-node 2 --config configs/tiny_moe.yaml ...

The arguments are torchrun's options (``--nproc-per-node``, ``--nnodes``, ``--master-port``,
... exactly as torchrun spells them, ``--opt value`` or ``--opt=value``), then the
launcher's flags (``python -m megatron_lrmoe.launcher.pretrain --help``). It checks the launcher's
flags for the world size torchrun is about to start, with the launcher's own parser and
validation (``pretrain.parse_args_or_exit``), and only then replaces itself with
``torchrun <its options> -m megatron_lrmoe.launcher.pretrain <flags>``.

Why: a refusal inside torchrun's workers is printed once, and then torchrun's agent
reports the failed children with its ``ChildFailedError`` traceback. Checked here, a
refused flag is the launcher's one ``error:`` line and exit status 2, and no worker
starts. Plain ``torchrun ... -m megatron_lrmoe.launcher.pretrain`` still works (the workers run
the same checks). With an elastic ``--nnodes MIN:MAX`` the world size is not known
before the rendezvous; then only the workers check.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

USAGE = ("usage: python -m megatron_lrmoe.launcher [torchrun options] [launcher flags]\n"
         "  e.g. python -m megatron_lrmoe.launcher --nproc-per-node 2 "
         "--config configs/tiny_moe.yaml --data-path data/stdlib")

# torchrun options that choose what to run: this entry point always runs the launcher.
_NOT_HERE = {"training_script", "training_script_args", "module", "no_python", "run_path"}


def split_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """(torchrun's options, the launcher's flags): torchrun's options come first, each
    matched exactly against torchrun's own parser; the first other token starts the
    launcher's flags (an optional ``--`` in between is dropped)."""
    # deferred: torch takes seconds to import, and --help answers without it
    from torch.distributed.run import get_args_parser

    actions = get_args_parser()._option_string_actions
    torchrun, i = [], 0
    while i < len(argv):
        token = argv[i]
        if token == "--":
            return torchrun, list(argv[i + 1:])
        name, has_value, _ = token.partition("=")
        action = actions.get(name)
        if action is None or not name.startswith("-"):
            break
        if action.dest in _NOT_HERE:
            print(f"error: {name} is not for megatron_lrmoe.launcher, which always runs -m "
                  f"megatron_lrmoe.launcher.pretrain; give the launcher's flags after torchrun's "
                  f"options", file=sys.stderr)
            raise SystemExit(2)
        takes_value = action.nargs != 0 and not has_value
        torchrun.extend(argv[i:i + 1 + takes_value])
        i += 1 + takes_value
    return torchrun, list(argv[i:])


def world_size_of(torchrun: Sequence[str]) -> int | None:
    """The world size torchrun will start (None for an elastic node range)."""
    # deferred: torch, as in split_argv
    from torch.distributed.run import determine_local_world_size, get_args_parser

    args, _ = get_args_parser().parse_known_args([*torchrun, "megatron_lrmoe.launcher.pretrain"])
    low, _, high = str(args.nnodes).partition(":")
    if high and high != low:
        return None
    return int(low) * determine_local_world_size(str(args.nproc_per_node))


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        raise SystemExit(0 if argv else 2)
    torchrun, flags = split_argv(argv)
    world_size = world_size_of(torchrun)
    if world_size is not None:
        # deferred: they import torch, as in split_argv
        from megatron_lrmoe.integration.runtime.cpu import (
            quiet_known_warnings,
            skip_torch_compile_of_functions,
        )
        from megatron_lrmoe.launcher.pretrain import parse_args_or_exit

        quiet_known_warnings()  # the check imports megatron.core; the workers say the rest
        skip_torch_compile_of_functions()
        parse_args_or_exit(flags, world_size)
    command = [sys.executable, "-m", "torch.distributed.run", *torchrun,
               "-m", "megatron_lrmoe.launcher.pretrain", *flags]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, command)


if __name__ == "__main__":
    main()
