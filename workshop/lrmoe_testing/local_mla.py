"""Multi-latent attention (MLA) on megatron-core's local spec, for CPU tests.

megatron-core 0.19.2's local MLA spec cannot be built: ``get_gpt_layer_local_spec(
multi_latent_attention=True)`` gives ``MLASelfAttention`` the local ``DotProductAttention``
as its core attention, and ``MLASelfAttention.__init__``
(megatron/core/transformer/multi_latent_attention.py) passes it ``k_channels`` and
``v_channels`` (MLA's query/key and value head dims), which ``DotProductAttention.__init__``
(megatron/core/transformer/dot_product_attention.py) does not take: "TypeError:
DotProductAttention.__init__() got an unexpected keyword argument 'k_channels'". Only
Transformer Engine's ``TEDotProductAttention`` takes them, and TE cannot be installed
without CUDA.

``MLADotProductAttention`` is Megatron's local ``DotProductAttention`` taking those two
arguments: its forward is Megatron's, unchanged (scores from the query and key of
whatever head dim, softmax, then the values), and only the width it reshapes the context
to is MLA's ``v_channels x heads`` (Megatron's uses ``kv_channels``). MLA always passes its
own softmax scale (YaRN's mscale included), so ``k_channels``, which sets only the default
scale, is not needed. ``with_local_mla_attention(spec)`` puts it into the MLA positions of
a layer or block spec (ModuleSpec, block spec, or a function of the config returning one).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.spec_utils import ModuleSpec

__all__ = ["MLADotProductAttention", "with_local_mla_attention"]


class MLADotProductAttention(DotProductAttention):
    """Megatron's local ``DotProductAttention`` with MLA's head dims (module docstring)."""

    def __init__(self, *args: Any, k_channels: int | None = None,
                 v_channels: int | None = None, **kwargs: Any) -> None:
        if kwargs.get("softmax_scale") is None and k_channels is not None:
            raise ValueError("MLADotProductAttention needs the softmax scale with k_channels "
                             "(MLASelfAttention passes both)")
        super().__init__(*args, **kwargs)
        if v_channels is not None:
            # The context is [sq, b, heads, v_channels]; Megatron's reshape assumes
            # kv_channels per head.
            self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition


def with_local_mla_attention(spec: Any) -> Any:
    """``spec`` with ``MLADotProductAttention`` as the core attention of every
    ``MLASelfAttention`` whose core attention is Megatron's local ``DotProductAttention``;
    anything else unchanged. A function of the config gives a function returning the
    result."""
    if isinstance(spec, ModuleSpec) or hasattr(spec, "layer_specs") or not callable(spec):
        return _replace(spec)
    takes_vp_stage = "vp_stage" in inspect.signature(spec).parameters

    def spec_function(config: Any, vp_stage: int | None = None) -> Any:
        return _replace(spec(config, vp_stage=vp_stage) if takes_vp_stage else spec(config))

    return spec_function


def _replace(obj: Any) -> Any:
    if isinstance(obj, ModuleSpec):
        submodules = _replace(obj.submodules)
        if obj.module is MLASelfAttention and submodules.core_attention is DotProductAttention:
            submodules = dataclasses.replace(submodules, core_attention=MLADotProductAttention)
        return dataclasses.replace(obj, submodules=submodules)
    if isinstance(obj, list | tuple):
        return type(obj)(_replace(x) for x in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: _replace(getattr(obj, f.name))
                                           for f in dataclasses.fields(obj) if f.init})
    return obj
