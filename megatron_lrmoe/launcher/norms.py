"""Torch LayerNorm/RMSNorm that work with Megatron's sequence parallelism.

Megatron-Core's ``WrappedTorchNorm`` (its norm when neither Transformer Engine
nor apex is installed) refuses ``sequence_parallel``: under sequence parallelism
each tensor-parallel rank normalises a different slice of the sequence, so the
norm's weight gradients are partial sums that must be all-reduced over the TP
group. Megatron does that in ``finalize_model_grads`` for every parameter marked
``sequence_parallel = True``, which TE's and apex's norms do and torch's do not.
This class is torch's norm plus that mark, so a local (no TE, no apex) spec can
run with ``--sequence-parallel``; without sequence parallelism it is exactly
``WrappedTorchNorm``.
"""

from __future__ import annotations

import copy

import torch
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.torch_norm import WrappedTorchNorm


class SequenceParallelTorchNorm:
    """Factory with ``WrappedTorchNorm``'s signature returning a marked torch norm."""

    def __new__(
        cls,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "LayerNorm",
    ) -> torch.nn.Module:
        # Build through Megatron's own wrapper (same checks, same classes), with the
        # one refusal we lift here switched off.
        unmarked = copy.copy(config)  # a shallow copy: no __post_init__ re-validation
        unmarked.sequence_parallel = False
        norm = WrappedTorchNorm(unmarked, hidden_size, eps, persist_layer_norm,
                                zero_centered_gamma, normalization)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm
