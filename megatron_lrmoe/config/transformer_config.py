"""``LRMoETransformerConfig``: Megatron's TransformerConfig plus one field per LRMoE option.

The fields are written out (for grep, IDEs and type checkers), but ``options.OPTIONS``
stays the one definition of every ``--moe-lrmoe*`` option: flag, type, default, choices,
check and help text. Each field repeats its option's type and default and carries the
option in its metadata; tests/launcher/test_arguments.py (``test_config_fields_equal_the_table``)
fails when a field and the table disagree (name, order, type, default), so an option is
added or changed in ``OPTIONS`` and here together. Same-named fields are how Megatron-LM's
``core_transformer_config_from_args`` fills a config class. ``__post_init__`` runs
``options.validate_lrmoe`` before and after Megatron's own: every option's check, and
with ``moe_lrmoe`` the checks of its combination with Megatron's settings
(options/megatron.py); errors name the flag.
"""

# No ``from __future__ import annotations``: the fields' types stay the objects the table
# declares (``int | None``, not the string), as dataclasses.fields() reported them when
# the class was generated from the table, and as the test compares them.

from dataclasses import dataclass, field
from typing import Any

from megatron.core.transformer import TransformerConfig

from megatron_lrmoe.options.lrmoe import AUTO, LRMoEConfigError, option, validate_lrmoe

__all__ = ["LRMoETransformerConfig"]


def _meta(name: str) -> dict[str, Any]:
    # What each field carries besides its default: the option it stands for (flag, check,
    # choices) and its help text; option() raises KeyError for a name not in the table.
    o = option(name)
    return {"option": o, "help": o.help}


@dataclass
class LRMoETransformerConfig(TransformerConfig):
    """TransformerConfig with the LRMoE options: one field per entry of
    ``options.OPTIONS`` (see its help texts), validated when built, errors naming the
    flag."""

    moe_lrmoe: bool = field(default=False, metadata=_meta("moe_lrmoe"))
    """--moe-lrmoe: use the LRMoE MoE layer (off: Megatron's own classes)."""

    moe_lrmoe_bwd_capacity_factor: float = field(
        default=1.0, metadata=_meta("moe_lrmoe_bwd_capacity_factor"))
    """--moe-lrmoe-bwd-capacity-factor: backward capacity gamma, > 0 or inf."""

    moe_lrmoe_min_retention: float = field(default=0.0,
                                           metadata=_meta("moe_lrmoe_min_retention"))
    """--moe-lrmoe-min-retention: share of every expert's pairs always kept, in [0, 1]."""

    moe_lrmoe_metric: str = field(default="grad_act", metadata=_meta("moe_lrmoe_metric"))
    """--moe-lrmoe-metric: per-pair contribution metric (grad_act, grad, prob, random)."""

    moe_lrmoe_selection: str = field(default="uniform", metadata=_meta("moe_lrmoe_selection"))
    """--moe-lrmoe-selection: how a cell keeps its quota (topk, sample, uniform, hybrid)."""

    moe_lrmoe_hybrid_fraction: float = field(default=0.5,
                                             metadata=_meta("moe_lrmoe_hybrid_fraction"))
    """--moe-lrmoe-hybrid-fraction: share of a quota hybrid keeps by top metric."""

    moe_lrmoe_kernels: str = field(default="auto", metadata=_meta("moe_lrmoe_kernels"))
    """--moe-lrmoe-kernels: compaction kernel backend (auto, cpu, cuda, torch)."""

    moe_lrmoe_log_interval: int | None = field(default=None,
                                               metadata=_meta("moe_lrmoe_log_interval"))
    """--moe-lrmoe-log-interval: steps between LRMoE statistics (None: --log-interval)."""

    moe_lrmoe_placement: str = field(default="static", metadata=_meta("moe_lrmoe_placement"))
    """--moe-lrmoe-placement: expert replicas (static, popularity, memory-aware)."""

    moe_lrmoe_slots_per_rank: int | None = field(default=None,
                                                 metadata=_meta("moe_lrmoe_slots_per_rank"))
    """--moe-lrmoe-slots-per-rank: instance slots per EP rank for popularity."""

    moe_lrmoe_memory_budget_gb: float | None = field(
        default=None, metadata=_meta("moe_lrmoe_memory_budget_gb"))
    """--moe-lrmoe-memory-budget-gb: per-rank MoE memory budget in GiB."""

    moe_lrmoe_load_smoothing: float = field(default=0.5,
                                            metadata=_meta("moe_lrmoe_load_smoothing"))
    """--moe-lrmoe-load-smoothing: EMA weight of the previous expert loads, in [0, 1)."""

    moe_lrmoe_calibration: str | None = field(default=None,
                                              metadata=_meta("moe_lrmoe_calibration"))
    """--moe-lrmoe-calibration: JSON of measured machine constants."""

    def __post_init__(self) -> None:
        # LRMoE's checks run on the values as given too, before Megatron's: an option that
        # --moe-lrmoe refuses is then refused by its own name, not by whatever Megatron's
        # validation of it says (the flex dispatcher's knobs, FP8 recipes ...). They run
        # again on what Megatron derives (expert TP from TP, deprecated spellings migrated).
        self.check_lrmoe()
        TransformerConfig.__post_init__(self)
        self.check_lrmoe()

    def check_lrmoe(self, view: Any = None) -> None:
        """Every LRMoE check (``options.validate_lrmoe``) on this config, or on ``view``
        of it (the Bridge provider hides the FP8 knobs of a run without FP8)."""
        if self.moe_lrmoe_memory_budget_gb == AUTO:
            # The flag's auto is resolved to GiB by the entry point from the device's size
            # and the memory account, before the config is built.
            raise LRMoEConfigError(
                "moe_lrmoe_memory_budget_gb",
                "auto is resolved by the entry point (--device-memory-gb and the memory "
                "account: config.planner_inputs.resolve_memory_budget); a config takes GiB")
        validate_lrmoe(self if view is None else view)
