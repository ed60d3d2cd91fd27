"""HF weights for LRMoE models through Megatron-Bridge's ``AutoBridge``.

The LRMoE layer keeps Megatron's per-expert parameter names,
``mlp.experts.local_experts.<i>.linear_fc{1,2}.weight``. Bridge 0.6.2's Qwen3-MoE mapping
(megatron/bridge/models/qwen/qwen3_moe_bridge.py) maps both those and the grouped-GEMM
names (``mlp.experts.linear_fc{1,2}.weight<i>``, TE's grouped MLP); its GLM-4.5 mapping
(megatron/bridge/models/glm/glm45_bridge.py) the grouped names only, so a GLM-4.5
checkpoint does not load into a model with per-expert names (Bridge leaves those parameters
without a conversion task). ``register_local_expert_mappings()`` registers, for GLM-4.5,
Bridge's own bridge class with every per-expert grouped mapping also given under the
per-expert name, the way Bridge's registry aliases layer-norm names. Checkpoints with fused HF
experts (``gate_up_proj`` as one tensor) keep Bridge's grouped mapping only.
"""

from __future__ import annotations

from typing import Any

_GROUPED = {".experts.linear_fc1.weight*": ".experts.local_experts.*.linear_fc1.weight",
            ".experts.linear_fc2.weight*": ".experts.local_experts.*.linear_fc2.weight"}

_registered: list[type] = []


def local_expert_aliases(mappings: list[Any]) -> list[Any]:
    """For each per-expert grouped mapping (Bridge's ``GatedMLPMapping`` or ``AutoMapping``
    of ``...experts.linear_fc{1,2}.weight*``), the same mapping under the per-expert name."""
    from megatron.bridge.models.conversion.param_mapping import AutoMapping, GatedMLPMapping

    names = {m.megatron_param for m in mappings}
    out = []
    for mapping in mappings:
        for grouped, local in _GROUPED.items():
            if not mapping.megatron_param.endswith(grouped):
                continue
            name = mapping.megatron_param[: -len(grouped)] + local
            if name in names:
                continue
            if type(mapping) is GatedMLPMapping:
                hf = mapping.hf_param
                out.append(GatedMLPMapping(megatron_param=name, gate=hf["gate"], up=hf["up"]))
            elif type(mapping) is AutoMapping:
                out.append(AutoMapping(megatron_param=name, hf_param=mapping.hf_param))
    return out


def register_local_expert_mappings() -> tuple[type, ...]:
    """Register, for GLM-4.5 (``Glm4MoeForCausalLM``), a subclass of Bridge's ``GLM45Bridge``
    whose mapping registry adds ``local_expert_aliases``; ``AutoBridge`` objects made after
    the call use it. Returns the classes registered. Idempotent."""
    if _registered:
        return tuple(_registered)
    from megatron.bridge.models.conversion.mapping_registry import MegatronMappingRegistry
    from megatron.bridge.models.conversion.model_bridge import MegatronModelBridge
    from megatron.bridge.models.glm.glm45_bridge import GLM45Bridge
    from megatron.core.models.gpt.gpt_model import GPTModel
    from transformers import Glm4MoeForCausalLM

    class GLM45LocalExpertsBridge(GLM45Bridge):
        """Bridge's GLM-4.5 bridge, its experts also mapped by per-expert name."""

        def mapping_registry(self) -> MegatronMappingRegistry:
            mappings = list(super().mapping_registry().mappings)
            return MegatronMappingRegistry(*mappings, *local_expert_aliases(mappings))

    MegatronModelBridge.register_bridge(source=Glm4MoeForCausalLM, target=GPTModel,
                                        model_type="glm4_moe")(GLM45LocalExpertsBridge)
    _registered.append(GLM45LocalExpertsBridge)
    return tuple(_registered)
