"""``LRMoETransformerConfig``: Megatron's TransformerConfig plus one field per LRMoE option.

The fields are generated from ``options.OPTIONS`` (the one definition of every
``--moe-lrmoe*`` option), so a field, its flag, default, choices, check and help text
cannot drift apart. Same-named fields are how Megatron-LM's
``core_transformer_config_from_args`` fills a config class. ``__post_init__`` runs
``options.validate_lrmoe`` before and after Megatron's own: every option's check, and
with ``moe_lrmoe`` the checks of its combination with Megatron's settings
(lrmoe/megatron_options.py); errors name the flag.
"""

from __future__ import annotations

import dataclasses

from megatron.core.transformer import TransformerConfig

from megatron_lrmoe.lrmoe.options import OPTIONS, validate_lrmoe

__all__ = ["LRMoETransformerConfig"]


def _post_init(self) -> None:
    # LRMoE's checks run on the values as given too, before Megatron's: an option that
    # --moe-lrmoe refuses is then refused by its own name, not by whatever Megatron's
    # validation of it says (the flex dispatcher's knobs, FP8 recipes ...). They run again
    # on what Megatron derives (expert TP from TP, deprecated spellings migrated).
    validate_lrmoe(self)
    TransformerConfig.__post_init__(self)
    validate_lrmoe(self)


LRMoETransformerConfig = dataclasses.make_dataclass(
    "LRMoETransformerConfig",
    [(o.field, o.annotation,
      dataclasses.field(default=o.default, metadata={"option": o, "help": o.help}))
     for o in OPTIONS],
    bases=(TransformerConfig,),
    namespace={
        "__module__": __name__,
        "__doc__": "TransformerConfig with the LRMoE options: one field per entry of "
                   "``options.OPTIONS`` (see its help texts), validated when built, errors "
                   "naming the flag.",
        "__post_init__": _post_init,
    },
)
