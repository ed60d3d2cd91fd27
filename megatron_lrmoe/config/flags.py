"""The LRMoE flags both entry points share: their argparse definitions, their parse-time
checks, and the rules read from either entry point's parsed args.

The lean launcher (``megatron_lrmoe.config.command_line``) and the Megatron-LM wrapper
(``megatron_lrmoe.integration.megatron_lm``, as ``extra_args_provider``) add the same
flags and check them the same way: the ``--moe-lrmoe*`` flags, made from the fields of
``LRMoEOptions`` (``OPTIONS`` in ``megatron_lrmoe/options/lrmoe.py``), and the flags with
no config field, made from the fields of ``EntryPointOptions`` (``ENTRY_POINT_OPTIONS``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import warnings
from types import SimpleNamespace
from typing import Any

from megatron_lrmoe.options.lrmoe import (
    OPTIONS,
    LRMoEConfigError,
    Option,
    check_positive_number,
    flag_field,
    flag_of,
    options_of,
    unused_options,
    validate_lrmoe,
)
from megatron_lrmoe.options.megatron import MEGATRON_OPTIONS

__all__ = ["DEVICE_MEMORY_FLAG", "ENTRY_POINT_OPTIONS", "ConfigError", "EntryPointOptions",
           "UnusedLRMoEOptionWarning", "add_lrmoe_args", "lrmoe_view", "moe_layer_freq",
           "tokens_per_rank", "validate_lrmoe_flags"]


@dataclasses.dataclass
class EntryPointOptions:
    """The flags both entry points add that are no config field: the entry point reads
    them itself. Defined like ``LRMoEOptions``' fields (``flag_field``), so the parser and
    the Flags table of docs/design.md are made from them the same way."""

    device_memory_gb: float | None = flag_field(
        None, check=check_positive_number, shown="CUDA: the device's memory; CPU: none",
        help="the device's memory in GiB (2**30 bytes) for the memory account and "
             "--moe-lrmoe-memory-budget-gb auto (default on CUDA: the device's total "
             "memory; on CPU, required with auto; e.g. 40 for an A100-40). Given, it holds "
             "the run to that size (the lean launcher, with Megatron's MoE layer or "
             "--moe-lrmoe): after every step each rank's predicted peak (the memory account "
             "outside the MoE layers plus the step's MoE memory from its routing; on CUDA "
             "also torch.cuda.max_memory_allocated) must fit, else the run stops with an "
             "out-of-memory error naming the step, the rank, the need and the device size")
    """Device size in GiB: the memory account, ``auto``, and the out-of-memory hold of
    every step (lean launcher; not a config field)."""


ENTRY_POINT_OPTIONS: tuple[Option, ...] = options_of(EntryPointOptions)
# Sizes the memory account (planner_inputs.resolve_memory_budget).
DEVICE_MEMORY_FLAG = flag_of("device_memory_gb")


class ConfigError(ValueError):
    """A configuration the launcher refuses, with a message naming the flag."""


def moe_layer_freq(value: Any) -> int | list[int]:
    """``--moe-layer-freq``: an int N (every N-th layer is MoE) or a 0/1 list.

    Megatron-LM accepts a Python list expression such as ``([0]+[1]*23)``; it is
    evaluated with no builtins, as Megatron-LM does.
    """
    if isinstance(value, int | list):
        return value
    text = str(value).strip()
    if text.lstrip("-").isdigit():
        return int(text)
    try:
        pattern = eval(text, {"__builtins__": {}}, {})  # noqa: S307 - Megatron-LM's syntax
    except Exception as exc:  # noqa: BLE001 - report any parse failure the same way
        raise argparse.ArgumentTypeError(
            f"--moe-layer-freq {text!r}: expected an int or a list like ([0]+[1]*3)"
        ) from exc
    if not isinstance(pattern, list) or any(v not in (0, 1) for v in pattern):
        raise argparse.ArgumentTypeError(f"--moe-layer-freq {text!r}: expected a list of 0/1")
    return pattern


def add_lrmoe_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``--moe-lrmoe*`` flags and ``--device-memory-gb`` to ``parser``, made from
    ``OPTIONS`` and ``ENTRY_POINT_OPTIONS`` (docs/design.md, "Flags").

    Shared by this launcher and the Megatron-LM wrapper (as its
    ``extra_args_provider``): each flag fills the same-named field of
    ``LRMoETransformerConfig``. Values are checked by ``validate_lrmoe_flags``.
    """
    g = parser.add_argument_group("LRMoE (megatron_lrmoe)")
    for o in OPTIONS + ENTRY_POINT_OPTIONS:
        if o.type is bool:
            g.add_argument(o.flag, action="store_true", default=o.default, help=o.help)
            continue
        shown = "" if o.default is None else " (default: %(default)s)"
        g.add_argument(o.flag, type=o.arg_type, default=o.default, choices=o.choices,
                       help=o.help + shown)
    return parser


class UnusedLRMoEOptionWarning(UserWarning):
    """``--moe-lrmoe-*`` values given without ``--moe-lrmoe``: they have no effect."""


def validate_lrmoe_flags(view: Any) -> None:
    """Check the ``--moe-lrmoe*`` flags of either entry point, naming the flag.

    ``view`` holds the parsed flags under ``LRMoETransformerConfig``'s field names
    (``lrmoe_view``, which maps either entry point's namespace).
    The checks are the config's (``validate_lrmoe``): every option's value always, the
    combinations with ``--moe-lrmoe``. Valid values given without ``--moe-lrmoe`` only
    warn (rank 0): they have no effect, and dropping ``--moe-lrmoe`` alone is how a
    baseline run is made from an LRMoE command line (docs/decisions.md).
    """
    try:
        validate_lrmoe(view)
    except LRMoEConfigError as exc:
        raise ConfigError(str(exc)) from exc
    for o in ENTRY_POINT_OPTIONS:
        problem = o.problem(getattr(view, o.field, o.default))
        if problem is not None:
            raise ConfigError(f"{o.flag}: {problem}")
    unused = unused_options(view)
    if unused and os.environ.get("RANK", "0") == "0":
        warnings.warn(f"{', '.join(o.flag for o in unused)} given without --moe-lrmoe: no "
                      "effect (Megatron's own MoE layer runs)", UnusedLRMoEOptionWarning,
                      stacklevel=2)


def lrmoe_view(args: argparse.Namespace) -> SimpleNamespace:
    """The parsed args of either entry point (the launcher's, or Megatron-LM's) that LRMoE
    checks at parse time, under the config's field names: the LRMoE options, and every
    Megatron option of the option table (``MEGATRON_OPTIONS``; Megatron-LM-only dests
    such as ``--moe-use-upcycling`` or the deprecated ``--cuda-graph-scope`` included)
    that the namespace has, so a refused one is named before any process group. What
    the namespace lacks is left out, and checked on the config.

    ``--disable-bias-linear`` is the launcher's dest (Megatron-LM stores it as
    ``add_bias_linear``); ``--expert-tensor-parallel-size`` not given is
    ``--tensor-model-parallel-size``, as both entry points derive it (Megatron-LM's
    validate_args, the launcher's ``fill_derived_args``).
    """
    names = ([row.name for row in MEGATRON_OPTIONS] + [o.field for o in OPTIONS]
             + ["add_bias_linear"] + [o.field for o in ENTRY_POINT_OPTIONS])
    view = {name: getattr(args, name) for name in names if hasattr(args, name)}
    view["num_moe_experts"] = getattr(args, "num_experts", None)
    if hasattr(args, "disable_bias_linear"):
        view["add_bias_linear"] = not args.disable_bias_linear
    etp = getattr(args, "expert_tensor_parallel_size", None)
    view["expert_tensor_parallel_size"] = (
        etp if etp is not None else getattr(args, "tensor_model_parallel_size", 1))
    return SimpleNamespace(**view)


def tokens_per_rank(args: argparse.Namespace) -> int:
    """Tokens of one micro-batch on one rank, from either entry point's args: micro-batch
    size x sequence length, divided by the context-parallel size (each CP rank's MoE
    layers route its S / CP tokens) and by TP under sequence parallelism (what each LRMoE
    layer's planner and the memory budget are sized for, and what one recorded
    micro-batch of routing holds). The lean launcher has no context parallelism: args
    without ``context_parallel_size`` count 1."""
    tp = args.tensor_model_parallel_size if args.sequence_parallel else 1
    cp = getattr(args, "context_parallel_size", None) or 1
    return args.micro_batch_size * args.seq_length // (tp * cp)
