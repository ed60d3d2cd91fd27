"""The LRMoE options, defined once: the dataclass ``LRMoEOptions``.

``LRMoEOptions`` has one field per ``--moe-lrmoe*`` option: its name is the config field,
its annotation the type, its default the default, its attribute docstring what the option
means (the "meaning" of docs/design.md, "Flags"), and its metadata what the flag needs
(help text, check or choices, argparse parse function, the default as the table shows it;
``flag_field``). From it come

* the ``moe_lrmoe*`` fields of ``LRMoETransformerConfig`` (config/transformer_config.py),
  which inherits them: Megatron's TransformerConfig fields, then these (same-named fields
  are how Megatron-LM's ``core_transformer_config_from_args`` fills a config class);
* ``OPTIONS``, one ``Option`` per field (``options_of``: the field seen as its flag),
  from which come the ``--moe-lrmoe*`` flags of both entry points (``flags.add_lrmoe_args``:
  the lean launcher's parser and Megatron-LM's argument provider) and the Flags table of
  docs/design.md (``python -m megatron_lrmoe.config.flags_table``);
* every check of an option's value (``Option.problem``), run by ``validate_lrmoe``
  on the config when it is built and on the parsed flags of either entry point.

Errors name the flag (``flag_of``: one mapping from config field to flag), e.g.
``--moe-lrmoe-bwd-capacity-factor: must be > 0 or inf, got -1``. What combines an
option with other settings (the all-to-all dispatcher, no forward capacity, ...) is
checked in one function, ``check_combination``; what it accepts and refuses of
Megatron's own options is the table ``MEGATRON_OPTIONS`` (options/megatron.py).

This module imports neither torch nor Megatron: the launchers build their parsers and
the flag tools read configs from it alone (``python -m megatron_lrmoe.integration.megatron_lm
flags`` runs before torchrun, where megatron.core may only be reachable through the
checkout). ``config/transformer_config.py``, which imports Megatron, holds the config class.

The annotations are evaluated (no ``from __future__ import annotations``): the fields'
types are the objects (``int | None``), as the config class and Bridge's providers,
which inherit them, report them.

The backward capacity (1.0) and the selection (uniform) defaults were chosen by the
time-to-loss studies; the deep-drop curve's choice (two-stage at 0.45) did not confirm at
EP 16 (docs/decisions.md, "The LRMoE layer"). Defaults change only by measurement; stored
runs' replays name the defaults they ran under (``lrmoe_studies.simulator_validation``).
"""

import dataclasses
import math
import numbers
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, get_args, get_type_hints

from megatron_lrmoe.options.megatron import MEGATRON_OPTIONS

__all__ = [
    "AUTO", "OPTIONS", "RECOMPUTE_MODULES", "LRMoEConfigError", "LRMoEOptions", "Option",
    "check_capacity_factor", "check_combination", "check_fraction", "check_load_smoothing",
    "check_memory_budget_gb", "check_options", "check_positive_int", "check_positive_number",
    "check_recompute", "flag_field", "flag_of", "memory_budget_gb", "option", "options_of",
    "unused_options", "validate_lrmoe",
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


def check_store_factor(value: Any) -> str | None:
    """rho >= 1, finite: the stored superset is at least the quota."""
    if _real(value) and 1.0 <= value < math.inf:
        return None
    return f"must be a finite number >= 1 (stored pairs per retained pair), got {_show(value)}"


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
    config is built, ``integration.planner_inputs.resolve_memory_budget``)."""
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
# The options
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
    """A field of an options dataclass (``LRMoEOptions``, or an entry point's own flags)
    seen as its command-line flag: ``type`` is the annotation without None, the rest the
    field's default and ``flag_field`` metadata.

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
    shown: str | None = None

    @classmethod
    def of(cls, f: dataclasses.Field, annotation: Any) -> "Option":
        """The option of dataclass field ``f`` (made with ``flag_field``), whose annotation
        is ``annotation`` (evaluated)."""
        members = get_args(annotation)
        if (f.default is None) != (type(None) in members):
            raise TypeError(f"{f.name}: a default of None goes with an annotation 'X | None', "
                            f"and only it; got {annotation} = {f.default!r}")
        kind = next(m for m in members if m is not type(None)) if members else annotation
        meta: Mapping[str, Any] = f.metadata
        return cls(f.name, kind, f.default, meta["help"], meta.get("choices"),
                   meta.get("check"), meta.get("parse"), meta.get("shown"))

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


def flag_field(default: Any, *, help: str, check: Callable[[Any], str | None] | None = None,
               choices: tuple[str, ...] | None = None,
               parse: Callable[[str], Any] | None = None, shown: str | None = None) -> Any:
    """A field of an options dataclass, with what its flag needs as metadata: ``help``
    (argparse's help text), ``check`` (None when a value is fine, else the problem) or
    ``choices``, ``parse`` (argparse's type, when not the annotation's), ``shown`` (the
    default as the Flags table writes it, when not the value's own spelling)."""
    if (check is None) == (choices is None):
        raise TypeError("a flag field has a check or choices, one of the two")
    meta = {"help": help, "check": check, "choices": choices, "parse": parse, "shown": shown}
    return dataclasses.field(default=default,
                             metadata={k: v for k, v in meta.items() if v is not None})


def options_of(cls: type) -> tuple[Option, ...]:
    """The options of dataclass ``cls``'s fields, in their order (annotations evaluated,
    postponed or not)."""
    hints = get_type_hints(cls)
    return tuple(Option.of(f, hints[f.name]) for f in dataclasses.fields(cls))


@dataclass
class LRMoEOptions:
    """The LRMoE options: one field per ``--moe-lrmoe*`` flag. ``LRMoETransformerConfig``
    inherits them; each field's docstring is its meaning in docs/design.md, "Flags"."""

    moe_lrmoe: bool = flag_field(
        False, check=check_switch,
        help="use the LRMoE MoE layer: exact forward, metric-driven backward drop with "
             "compaction (off: Megatron's own classes, untouched)")
    """Use the LRMoE layer (needs the all-to-all dispatcher)."""

    moe_lrmoe_bwd_capacity_factor: float = flag_field(
        1.0, check=check_capacity_factor,
        help="backward capacity gamma, > 0: each EP rank keeps at most ceil(gamma x mean "
             "routed pairs per rank) pairs in backward; inf drops nothing")
    """Backward capacity gamma, > 0; ``inf`` drops nothing."""

    moe_lrmoe_min_retention: float = flag_field(
        0.0, check=check_fraction,
        help="share of every expert's pairs always kept in backward (protects hot experts), "
             "in [0, 1]")
    """m in [0, 1]: the share of every expert's pairs always kept in backward."""

    moe_lrmoe_metric: str = flag_field(
        "grad_act", choices=("grad_act", "grad", "prob", "random"),
        help="per-pair contribution metric: grad_act (||g|| x ||h||), grad (||g||), prob, "
             "random")
    """Per-pair contribution metric."""

    moe_lrmoe_selection: str = flag_field(
        "uniform", choices=("topk", "sample", "uniform", "hybrid", "two-stage"),
        help="how each (source, expert) cell keeps its quota: topk, sample (1/pi-scaled), "
             "uniform (a uniform subset, n/q-scaled), hybrid (a share by top metric, the "
             "rest uniform and scaled to stay unbiased), two-stage (forward stores a "
             "probability-sampled superset of --moe-lrmoe-store-factor x the quota, "
             "backward samples the quota from it by the metric; 1/(pi1 pi2)-scaled)")
    """How each (source, expert) cell keeps its quota."""

    moe_lrmoe_hybrid_fraction: float = flag_field(
        0.5, check=check_fraction,
        help="share of each cell's quota that hybrid keeps by top metric (floor of f x q), "
             "in [0, 1]; 0 is uniform, 1 is topk")
    """f in [0, 1]: the share of each cell's quota ``hybrid`` keeps by top metric."""

    moe_lrmoe_store_factor: float = flag_field(
        1.5, check=check_store_factor,
        help="rho >= 1: two-stage stores floor(rho x q) of each cell's pairs (at most the "
             "cell) in forward, drawn with probability proportional to the router "
             "probability; backward keeps q of them")
    """rho >= 1: ``two-stage`` stores floor(rho q) of a cell's n pairs (at most n) in
    forward; backward keeps its quota q among them."""

    moe_lrmoe_kernels: str = flag_field(
        "auto", choices=("auto", "cpu", "cuda", "torch"), help="compaction kernel backend")
    """Compaction kernel backend."""

    moe_lrmoe_log_interval: int | None = flag_field(
        None, check=check_positive_int, shown="`--log-interval`",
        help="steps between LRMoE statistics in the logs (default: --log-interval)")
    """Iterations between LRMoE statistics in the logs."""

    moe_lrmoe_placement: str = flag_field(
        "static", choices=("static", "popularity", "memory-aware"),
        help="expert replicas: static (none, Megatron's layout), popularity (SYMI-style "
             "slots), memory-aware (replicas where the memory budget leaves room, chosen "
             "with the quotas; needs --moe-lrmoe-memory-budget-gb)")
    """Expert replicas: none, by popularity, or where the memory budget leaves room."""

    moe_lrmoe_slots_per_rank: int | None = flag_field(
        None, check=check_positive_int, shown="E_loc",
        help="instance slots per EP rank for popularity (default: experts per rank, or what "
             "the memory budget converts to; with a budget, the smaller of the two)")
    """Instance slots per EP rank for ``popularity`` (with a budget, at most what the
    budget converts to)."""

    moe_lrmoe_memory_budget_gb: float | None = flag_field(
        None, check=check_memory_budget_gb, parse=memory_budget_gb,
        help="per-rank budget in GiB (2**30 bytes) for what the MoE layers hold at peak: "
             "replicas of every layer plus the execution buffers of every micro-batch in "
             "flight (docs/design.md, \"Memory budget\"); auto: the device's memory "
             "(--device-memory-gb) less the rest of the run's memory account")
    """Per-rank GiB, or ``auto`` (the device less the rest of the memory account);
    required by ``memory-aware``."""

    moe_lrmoe_load_smoothing: float = flag_field(
        0.5, check=check_load_smoothing,
        help="EMA weight of the previous smoothed expert loads when planning the next "
             "step's placement, in [0, 1)")
    """a in [0, 1): EMA weight of the old loads."""

    moe_lrmoe_calibration: str | None = flag_field(
        None, check=check_calibration_file,
        help="JSON of measured machine constants (python -m megatron_lrmoe.tools.calibrate)")
    """Machine-constants JSON from ``python -m megatron_lrmoe.tools.calibrate``."""


OPTIONS: tuple[Option, ...] = options_of(LRMoEOptions)

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
