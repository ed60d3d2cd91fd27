"""``LRMoETransformerConfig``: Megatron's TransformerConfig plus the LRMoE options.

The class inherits its ``moe_lrmoe*`` fields from ``options.LRMoEOptions``, their one
definition (type, default, docstring, flag metadata). ``LRMoEOptions`` is the first base,
so in ``dataclasses.fields()`` Megatron's fields come first and the LRMoE fields after
them. Same-named fields are how Megatron-LM's ``core_transformer_config_from_args`` fills
a config class. ``__post_init__`` runs ``options.validate_lrmoe`` before and after
Megatron's own: every option's check, and with ``moe_lrmoe`` the checks of its
combination with Megatron's settings (options/megatron.py); errors name the flag.
"""

from dataclasses import dataclass
from typing import Any

from megatron.core.transformer import TransformerConfig

from megatron_lrmoe.options.lrmoe import AUTO, LRMoEConfigError, LRMoEOptions, validate_lrmoe

__all__ = ["LRMoETransformerConfig"]


@dataclass
class LRMoETransformerConfig(LRMoEOptions, TransformerConfig):
    """TransformerConfig with the LRMoE options (``options.LRMoEOptions``' fields, after
    Megatron's), validated when built, errors naming the flag."""

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
                "account: integration.planner_inputs.resolve_memory_budget); a config takes GiB")
        validate_lrmoe(self if view is None else view)
