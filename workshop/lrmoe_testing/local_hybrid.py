"""Megatron-Core's hybrid (Mamba) stack spec in a local flavour, for CPU runs of Bridge's
hybrid recipes (Transformer Engine cannot be installed there).

Megatron-Core 0.19.2 has no hybrid stack spec without TE: its local one (ModelOpt's,
``get_hybrid_stack_modelopt_spec``) builds its norms with TE (``modelopt.layers.Norm``),
and ``HybridStack`` builds its final norm with ``TENorm`` whatever the spec says.
``local_hybrid_stack_spec`` is that local spec with local attention
(``DotProductAttention``), Megatron's torch norms (``WrappedTorchNorm``, what its local GPT
spec uses without apex) in place of TE's, and ``LocalNormHybridStack`` as the stack. The
MoE layers are Megatron's local ones (``SequentialMLP`` experts), which LRMoE converts.

Mamba layers keep Megatron's ``MambaMixer``, which runs the GPU kernels of ``mamba_ssm``
and ``causal_conv1d`` and refuses to be built without ``mamba_ssm``: on CPU a pattern of
attention, MLP and MoE layers only.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from megatron.core.models.hybrid.hybrid_block import HybridStack
from megatron.core.post_training.modelopt.hybrid.model_specs import get_hybrid_stack_modelopt_spec
from megatron.core.post_training.modelopt.layers import Norm
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm

from megatron_lrmoe.layer.spec_utils import replace_module

__all__ = ["LocalNormHybridStack", "local_hybrid_stack_spec"]


class LocalNormHybridStack(HybridStack):
    """Megatron's ``HybridStack`` with its final norm a ``WrappedTorchNorm`` (Megatron's is
    ``TENorm``, hard-coded): the same module name, shape and parameters, built after the
    layers as Megatron builds it."""

    def __init__(self, config: Any, submodules: Any, *args: Any, post_layer_norm: bool = True,
                 post_process: bool = True, **kwargs: Any) -> None:
        super().__init__(config, submodules, *args, post_layer_norm=False,
                         post_process=post_process, **kwargs)
        self.post_layer_norm = post_layer_norm
        if post_process and post_layer_norm:
            self.final_norm = WrappedTorchNorm(config=config, hidden_size=config.hidden_size,
                                               eps=config.layernorm_epsilon)


def local_hybrid_stack_spec() -> ModuleSpec:
    """Megatron-Core's local hybrid stack spec (local attention) with torch norms and
    ``LocalNormHybridStack``; a function of nothing, as Bridge's
    ``transformer_engine_hybrid_stack_spec`` is."""
    spec = get_hybrid_stack_modelopt_spec(local_core_attention=True)
    spec = replace_module(spec, Norm, WrappedTorchNorm)
    return dataclasses.replace(spec, module=LocalNormHybridStack)
