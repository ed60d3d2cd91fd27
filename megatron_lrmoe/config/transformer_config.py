"""``LRMoETransformerConfig``: Megatron's TransformerConfig plus the LRMoE options, and
``LRMoEMLATransformerConfig``: the same for Megatron's MLATransformerConfig (multi-latent
attention, which Megatron configures by a config class of its own).

The classes inherit their ``moe_lrmoe*`` fields from ``options.LRMoEOptions``, their one
definition (type, default, docstring, flag metadata). ``LRMoEOptions`` comes before
TransformerConfig among the bases, so in ``dataclasses.fields()`` Megatron's
TransformerConfig fields come first and the LRMoE fields after them (the MLA class: then
MLA's own fields). Same-named fields are how Megatron-LM's
``core_transformer_config_from_args`` fills a config class. ``__post_init__`` runs
``options.validate_lrmoe`` before and after TransformerConfig's: every option's check, and
with ``moe_lrmoe`` the checks of its combination with Megatron's settings
(options/megatron.py); errors name the flag.

``LRMoEMLATransformerConfig`` subclasses ``MLATransformerConfig`` first and
``LRMoETransformerConfig`` second: MLA's field defaults (``multi_latent_attention`` true,
RMSNorm, YaRN rope) win over TransformerConfig's, MLA's post-init runs the LRMoE one (its
``super()``) and then MLA's own checks, and whatever asks "is this an LRMoE config" asks
``isinstance(config, LRMoETransformerConfig)`` for both.
"""

import dataclasses
from dataclasses import dataclass
from typing import Any

from megatron.core.transformer import MLATransformerConfig, TransformerConfig

from megatron_lrmoe.options.lrmoe import AUTO, LRMoEConfigError, LRMoEOptions, validate_lrmoe

__all__ = ["LRMoEMLATransformerConfig", "LRMoETransformerConfig"]


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


@dataclass
class LRMoEMLATransformerConfig(MLATransformerConfig, LRMoETransformerConfig):
    """MLATransformerConfig (multi-latent attention) with the LRMoE options. LRMoE replaces
    the MoE layer only, so nothing of it depends on the attention; the class exists because
    Megatron describes MLA by its config class (``multi_latent_attention`` true, the latent
    ranks and head dims as fields). Its post-init is MLATransformerConfig's, whose
    ``super().__post_init__()`` is ``LRMoETransformerConfig``'s (module docstring)."""

    @classmethod
    def from_mla_config(cls, config: MLATransformerConfig,
                        **lrmoe: Any) -> "LRMoEMLATransformerConfig":
        """The LRMoE config of ``config`` (a built MLATransformerConfig: every init field
        kept) with the LRMoE options ``lrmoe`` by field name; ``__post_init__`` runs again,
        LRMoE's checks around Megatron's. Megatron-LM builds an MLA run's config with its
        own class whatever class it is asked for, so its entry point converts the result.
        Megatron's post-init is idempotent on its own derived values (Megatron-Bridge
        finalizes a config repeatedly, relying on it)."""
        if not isinstance(config, MLATransformerConfig):
            raise TypeError(f"expected an MLATransformerConfig, got {type(config).__name__}")
        kept = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
        return cls(**{**kept, **lrmoe})
