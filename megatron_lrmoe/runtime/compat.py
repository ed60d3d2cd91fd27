"""Megatron-Core 0.16.1 without Transformer Engine, on any device.

``moe_utils`` imports ``te_general_gemm`` inside a try block that only succeeds with
TE, then refers to it unconditionally in ``RouterGatingLinearFunction``: without TE
the MoE router raises NameError, on GPUs as on CPUs. Defining the name as ``None``
selects Megatron's own torch path, which is what the code means to do. The launcher
applies this on every machine; the CPU runtime includes it.
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
