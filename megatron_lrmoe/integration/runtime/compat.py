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
    Idempotent. Megatron's internals are reached through ``megatron_privates``."""
    from megatron_lrmoe.integration.megatron_privates import (
        tensor_parallel_random_has_te,
        wrap_checkpoint_without_output_init,
    )

    if tensor_parallel_random_has_te():
        return False
    return wrap_checkpoint_without_output_init(_fp8_off)


def _fp8_off(checkpoint: object) -> None:
    checkpoint.fp8 = False  # type: ignore[attr-defined]   # no FP8 without Transformer Engine
