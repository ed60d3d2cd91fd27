"""Megatron-Core 0.19 without Transformer Engine, on any device.

``tensor_parallel.CheckpointWithoutOutput`` (selective recompute of ``layernorm`` and
``moe_act``) sets ``self.fp8 = fp8 is not None`` (megatron/core/tensor_parallel/random.py:740
in 0.19.2), True for its default ``fp8=False``, and then asks Transformer Engine's
``FP8GlobalStateManager`` (random.py:693), a NameError without TE. Without TE there is no
FP8, so the flag is made False. The launcher applies this on every machine, the
Megatron-LM integration with ``--moe-lrmoe``; the CPU runtime includes it.
"""

from __future__ import annotations


def fp8_off_in_checkpoint_without_output_when_te_absent() -> bool:
    """Make ``CheckpointWithoutOutput`` objects non-FP8 when TE is absent.

    Returns True when the constructor was wrapped (TE absent), False otherwise.
    Idempotent."""
    from megatron.core.tensor_parallel import random as megatron_random

    cls = megatron_random.CheckpointWithoutOutput
    if megatron_random.HAVE_TE or getattr(cls.__init__, "_lrmoe_fp8_off", False):
        return False
    init = cls.__init__

    def __init__(self, fp8=False):
        init(self, fp8)
        self.fp8 = False      # no FP8 without Transformer Engine

    __init__._lrmoe_fp8_off = True  # type: ignore[attr-defined]
    cls.__init__ = __init__
    return True
