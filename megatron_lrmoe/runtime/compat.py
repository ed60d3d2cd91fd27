"""Megatron-Core 0.16.1 without Transformer Engine, on any device.

``moe_utils`` imports ``te_general_gemm`` inside a try block that only succeeds with
TE, then refers to it unconditionally in ``RouterGatingLinearFunction``: without TE
the MoE router raises NameError, on GPUs as on CPUs. Defining the name as ``None``
selects Megatron's own torch path, which is what the code means to do. The launcher
applies this on every machine; the CPU runtime includes it.

``tensor_parallel.CheckpointWithoutOutput`` (selective recompute of ``layernorm`` and
``moe_act``) sets ``self.fp8 = fp8 is not None``, True for its default ``fp8=False``,
and then asks Transformer Engine's ``FP8GlobalStateManager``, a NameError without TE.
Without TE there is no FP8, so the flag is made False. The launcher applies this on
every machine; the CPU runtime includes it.
"""

from __future__ import annotations


def define_te_general_gemm_when_te_absent() -> bool:
    """Define ``moe_utils.te_general_gemm = None`` when TE did not provide it.

    Returns True when the placeholder was installed (TE absent), False otherwise.
    """
    from megatron.core.transformer.moe import moe_utils

    if hasattr(moe_utils, "te_general_gemm"):
        return False
    moe_utils.te_general_gemm = None
    return True


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
