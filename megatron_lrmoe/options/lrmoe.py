"""The LRMoE options, defined once: field, type, default, choices, check, help.

``OPTIONS`` is the one definition of every ``--moe-lrmoe*`` option: config field,
type, default, choices, check and help text. From it come

* the ``moe_lrmoe*`` fields of ``LRMoETransformerConfig``, Megatron's TransformerConfig
  plus one field per option, written out in ``config.py`` with the type and default
  given here (a test holds the two equal; same-named fields are how Megatron-LM's
  ``core_transformer_config_from_args`` fills a config class);
* the ``--moe-lrmoe*`` flags of both entry points (``flags.add_lrmoe_args``:
  the lean launcher's parser and Megatron-LM's argument provider);
* every check of an option's value (``Option.problem``), run by ``validate_lrmoe``
  on the config when it is built and on the parsed flags of either entry point.

Errors name the flag (``flag_of``: one mapping from config field to flag), e.g.
``--moe-lrmoe-bwd-capacity-factor: must be > 0 or inf, got -1``. What combines an
option with other settings (the all-to-all dispatcher, no expert biases, ...) is
checked in one function, ``check_combination``; what it accepts and refuses of
Megatron's own options is the table ``MEGATRON_OPTIONS`` (options/megatron.py).

This module imports neither torch nor Megatron: the launchers build their parsers and
the flag tools read configs from the table alone (``python -m megatron_lrmoe.integration.megatron_lm
flags`` runs before torchrun, where megatron.core may only be reachable through the
checkout). ``config.py``, which imports Megatron, holds the config class.

Defaults are those of docs/design.md, "Flags"; the backward capacity (1.0) and the
selection (uniform) were chosen by the time-to-loss studies (docs/benchmarks.md,
"Decision" and "Defaults at the GEMM-bound shape"). Defaults change only by measurement.
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megatron_lrmoe.options.megatron import MEGATRON_OPTIONS

__all__ = [
    "AUTO", "OPTIONS", "RECOMPUTE_MODULES", "LRMoEConfigError", "Option",
    "check_capacity_factor", "check_combination", "check_fraction", "check_load_smoothing",
    "check_memory_budget_gb", "check_options", "check_positive_int", "check_positive_number",
    "check_recompute", "flag_of", "memory_budget_gb", "option", "unused_options",
    "validate_lrmoe",
]


# -----------------------------------------------------------------------------
# Checks: each returns None when the value is fine, else the problem in words
# (the caller prefixes the flag, or its own argument name: PlannerSettings reuses them).
# -----------------------------------------------------------------------------


def _show(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    return repr(value) if isinstance(value, str) else str(value)


def _real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _integer(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_switch(value: Any) -> str | None:
    return None if isinstance(value, bool) else f"must be true or false, got {_show(value)}"


def check_capacity_factor(value: Any) -> str | None:
    """gamma > 0, inf allowed (drops nothing); NaN refused."""
    if _real(value) and value > 0:
        return None
    return f"must be > 0 or inf, got {_show(value)}"


def check_fraction(value: Any) -> str | None:
    """A share in [0, 1]; NaN refused."""
    if _real(value) and 0.0 <= value <= 1.0:
        return None
    return f"must be in [0, 1], got {_show(value)}"


def check_load_smoothing(value: Any) -> str | None:
    """An EMA weight in [0, 1): 1 would never take in new loads."""
    if _real(value) and 0.0 <= value < 1.0:
        return None
    return f"must be in [0, 1) (the weight of the previous loads), got {_show(value)}"


def check_positive_int(value: Any) -> str | None:
    if _integer(value) and value >= 1:
        return None
    return f"must be an integer >= 1, got {_show(value)}"


def check_positive_number(value: Any) -> str | None:
    """A positive finite number (any unit: GiB for the flag, bytes for the planner)."""
    if _real(value) and math.isfinite(value) and value > 0:
        return None
    return f"must be a positive finite number, got {_show(value)}"


AUTO = "auto"


def memory_budget_gb(text: str) -> float | str:
    """``--moe-lrmoe-memory-budget-gb``'s argparse type: GiB, or ``auto`` (the device's
    size less the rest of the memory account; resolved by the entry point before the
    config is built, ``config.planner_inputs.resolve_memory_budget``)."""
    text = str(text).strip()
    return AUTO if text.lower() == AUTO else float(text)


def check_memory_budget_gb(value: Any) -> str | None:
    """A positive finite number of GiB, or ``auto`` (of a flag; a config takes GiB)."""
    if value == AUTO:
        return None
    problem = check_positive_number(value)
    return None if problem is None else f"{problem} or auto"


def check_calibration_file(value: Any) -> str | None:
    if isinstance(value, str) and os.path.isfile(value):
        return None
    return (f"no such file: {_show(value)}; write one with "
            "python -m megatron_lrmoe.tools.calibrate")


# -----------------------------------------------------------------------------
# The table
# -----------------------------------------------------------------------------

# Config fields whose Megatron-LM flag is not the field name with dashes: the MoE switch,
# and those the Megatron option table names (options/megatron.py).
_FLAGS = {
    "num_moe_experts": "--num-experts",
    **{row.name: row.flag for row in MEGATRON_OPTIONS if row.flag is not None},
}


def flag_of(field: str) -> str:
    """The command-line flag that sets config field ``field`` (both entry points)."""
    return _FLAGS.get(field, "--" + field.replace("_", "-"))


class LRMoEConfigError(ValueError):
    """An LRMoE setting refused, in the words ``--flag: problem``."""

    def __init__(self, field: str, problem: str):
        self.field = field
        self.flag = flag_of(field)
        self.problem = problem
        super().__init__(f"{self.flag}: {problem}")


@dataclass(frozen=True)
class Option:
    """One LRMoE option: a config field and its ``--moe-lrmoe*`` flag.

    ``default`` None means "not set" (and None is then a valid value); ``choices``
    replaces ``check`` for the string options.
    """

    field: str
    type: type
    default: Any
    help: str
    choices: tuple[str, ...] | None = None
    check: Callable[[Any], str | None] | None = None
    parse: Callable[[str], Any] | None = None

    @property
    def arg_type(self) -> Callable[[str], Any]:
        """What argparse converts the flag's text with."""
        return self.parse or self.type

    @property
    def flag(self) -> str:
        return flag_of(self.field)

    @property
    def annotation(self) -> Any:
        return self.type if self.default is not None else self.type | None

    def problem(self, value: Any) -> str | None:
        """What is wrong with ``value`` for this option, or None."""
        if value is None and self.default is None:
            return None
        if self.choices is not None:
            if isinstance(value, str) and value in self.choices:
                return None
            return f"{_show(value)} is not one of {', '.join(self.choices)}"
        assert self.check is not None, self.field
        return self.check(value)


OPTIONS: tuple[Option, ...] = (
    Option("moe_lrmoe", bool, False, check=check_switch,
           help="use the LRMoE MoE layer: exact forward, metric-driven backward drop with "
                "compaction (off: Megatron's own classes, untouched)"),
    Option("moe_lrmoe_bwd_capacity_factor", float, 1.0, check=check_capacity_factor,
           help="backward capacity gamma, > 0: each EP rank keeps at most ceil(gamma x mean "
                "routed pairs per rank) pairs in backward; inf drops nothing"),
    Option("moe_lrmoe_min_retention", float, 0.0, check=check_fraction,
           help="share of every expert's pairs always kept in backward (protects hot experts), "
                "in [0, 1]"),
    Option("moe_lrmoe_metric", str, "grad_act", choices=("grad_act", "grad", "prob", "random"),
           help="per-pair contribution metric: grad_act (||g|| x ||h||), grad (||g||), prob, "
                "random"),
    Option("moe_lrmoe_selection", str, "uniform", choices=("topk", "sample", "uniform", "hybrid"),
           help="how each (source, expert) cell keeps its quota: topk, sample (1/pi-scaled), "
                "uniform (a uniform subset, n/q-scaled), hybrid (a share by top metric, the "
                "rest uniform and scaled to stay unbiased)"),
    Option("moe_lrmoe_hybrid_fraction", float, 0.5, check=check_fraction,
           help="share of each cell's quota that hybrid keeps by top metric (floor of f x q), "
                "in [0, 1]; 0 is uniform, 1 is topk"),
    Option("moe_lrmoe_kernels", str, "auto", choices=("auto", "cpu", "cuda", "torch"),
           help="compaction kernel backend"),
    Option("moe_lrmoe_log_interval", int, None, check=check_positive_int,
           help="steps between LRMoE statistics in the logs (default: --log-interval)"),
    Option("moe_lrmoe_placement", str, "static", choices=("static", "popularity", "memory-aware"),
           help="expert replicas: static (none, Megatron's layout), popularity (SYMI-style "
                "slots), memory-aware (replicas where the memory budget leaves room, chosen "
                "with the quotas; needs --moe-lrmoe-memory-budget-gb)"),
    Option("moe_lrmoe_slots_per_rank", int, None, check=check_positive_int,
           help="instance slots per EP rank for popularity (default: experts per rank, or what "
                "the memory budget converts to; with a budget, the smaller of the two)"),
    Option("moe_lrmoe_memory_budget_gb", float, None, check=check_memory_budget_gb,
           parse=memory_budget_gb,
           help="per-rank budget in GiB (2**30 bytes) for what the MoE layers hold at peak: "
                "replicas of every layer plus the execution buffers of every micro-batch in "
                "flight (docs/design.md, \"Memory budget\"); auto: the device's memory "
                "(--device-memory-gb) less the rest of the run's memory account"),
    Option("moe_lrmoe_load_smoothing", float, 0.5, check=check_load_smoothing,
           help="EMA weight of the previous smoothed expert loads when planning the next "
                "step's placement, in [0, 1)"),
    Option("moe_lrmoe_calibration", str, None, check=check_calibration_file,
           help="JSON of measured machine constants (python -m megatron_lrmoe.tools.calibrate)"),
)

_BY_FIELD = {o.field: o for o in OPTIONS}


def option(field: str) -> Option:
    """The option of config field ``field``."""
    return _BY_FIELD[field]


# -----------------------------------------------------------------------------
# Validation, in flag names
# -----------------------------------------------------------------------------

_ABSENT = object()

# Megatron's selective-recompute modules (``--recompute-modules``) and what implements
# each under --moe-lrmoe (docs/design.md, "Recompute"). Full recompute
# (``--recompute-granularity full``, uniform or block) needs no entry: Megatron's
# TransformerBlock checkpoints whole layers and the LRMoE layer's first pass (no
# autograd) only plans, so the recomputed pass is the micro-batch's training pass. A
# module not listed here (one a later Megatron adds) is refused by name, never
# accepted as a silent no-op.
RECOMPUTE_MODULES: dict[str, str] = {
    "core_attn": "Megatron's attention (outside the MoE layer)",
    "layernorm": "Megatron's TransformerLayer (input and pre-MLP norms, MoE layers included)",
    "mla_up_proj": "Megatron's multi-latent attention",
    "mlp": "Megatron's TransformerLayer, dense MLP layers only (as without --moe-lrmoe)",
    "moe": "LRMoELayer.forward under tensor_parallel.checkpoint, as MoELayer.forward does",
    "moe_act": "by construction: the LRMoE region saves the fc1 output and recomputes the "
               "activation in backward, for retained rows only",
    "shared_experts": "MoELayer.shared_experts_compute, which LRMoELayer.forward calls",
    "gdn_norm_out": "Megatron's GatedDeltaNet attention (its output norm, outside the MoE "
                    "layer)",
}
_DEFAULT_RECOMPUTE_MODULES = ("core_attn",)    # Megatron's default for "selective"


def check_recompute(c: Any) -> None:
    """With ``--recompute-granularity selective``: every module of ``--recompute-modules``
    (Megatron's default: core_attn) must be one LRMoE implements (``RECOMPUTE_MODULES``).
    Megatron validates the flags' own combinations (method, layer count)."""
    if getattr(c, "recompute_granularity", None) != "selective":
        return
    modules = getattr(c, "recompute_modules", None)
    modules = _DEFAULT_RECOMPUTE_MODULES if modules is None else modules
    unknown = [m for m in modules if m not in RECOMPUTE_MODULES]
    if unknown:
        raise LRMoEConfigError(
            "recompute_modules",
            f"{', '.join(map(repr, unknown))} not supported with --moe-lrmoe (it implements "
            f"{', '.join(RECOMPUTE_MODULES)}; docs/design.md, \"Recompute\")")


def check_options(c: Any) -> None:
    """Each option's own check on ``c`` (a config, or parsed flags under the config's
    field names); raises ``LRMoEConfigError`` naming the flag of the first bad one."""
    for o in OPTIONS:
        value = getattr(c, o.field, _ABSENT)
        if value is _ABSENT:
            continue
        problem = o.problem(value)
        if problem is not None:
            raise LRMoEConfigError(o.field, problem)


def check_combination(c: Any) -> None:
    """What ``--moe-lrmoe`` cannot run with: options that need each other, and Megatron
    settings the LRMoE region does not implement. ``c`` is a config, or a view of an
    entry point's parsed flags under the config's field names (what it lacks is skipped,
    and refused when the config is built)."""
    if getattr(c, "num_moe_experts", 1) is None:
        raise LRMoEConfigError("num_moe_experts", "--moe-lrmoe needs an MoE model: set "
                                                  "--num-experts")
    # Megatron's options, as the table classifies them (options/megatron.py), in its
    # order; the Megatron-LM-only ones where the checked object carries them.
    for row in MEGATRON_OPTIONS:
        value = getattr(c, row.name, _ABSENT)
        if row.refuse is not None and value is not _ABSENT and row.refuse(value):
            raise LRMoEConfigError(row.name, row.problem_for(value))
    check_recompute(c)
    if c.moe_lrmoe_placement == "memory-aware" and c.moe_lrmoe_memory_budget_gb is None:
        raise LRMoEConfigError("moe_lrmoe_memory_budget_gb",
                               "--moe-lrmoe-placement memory-aware needs a budget")


def validate_lrmoe(c: Any) -> None:
    """Every LRMoE check on ``c``: each option's value (always, so an invalid value is an
    error with or without ``--moe-lrmoe``), then with ``moe_lrmoe`` the combinations."""
    check_options(c)
    if getattr(c, "moe_lrmoe", False):
        check_combination(c)


def unused_options(c: Any) -> list[Option]:
    """Options set to a non-default value although ``moe_lrmoe`` is off (no effect)."""
    if getattr(c, "moe_lrmoe", False):
        return []
    return [o for o in OPTIONS[1:]
            if getattr(c, o.field, o.default) != o.default]
