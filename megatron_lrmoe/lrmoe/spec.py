"""The one spec converter: Megatron GPT specs in, the same specs with LRMoE classes out.

Takes any layer spec (``ModuleSpec`` of a TransformerLayer), decoder-block spec
(``TransformerBlockSubmodules``, e.g. with ``--moe-layer-freq`` mixing dense and MoE
layers) or a list of them, in the local or Transformer Engine flavour, and returns a
copy in which every MoE position holds ``LRMoELayer`` with ``LRMoESequentialMLP``
experts. Dense MLPs, attention, norms and shared experts stay Megatron's. Every entry
point (the launcher's ``--moe-lrmoe``, the Megatron-LM wrapper, the patch) uses it.

Grouped GEMM is not dropped: with ``--moe-grouped-gemm`` Megatron's spec holds
TEGroupedMLP (or the legacy GroupedMLP), which this converter replaces like
SequentialMLP, since the region computes the experts itself; the flag stays in the
config (``moe_grouped_gemm``), and the region then runs its expert GEMMs grouped
(``torch.nn.functional.grouped_mm``, lrmoe/expert_gemms.py) on every device where they
apply. The checkpoint keys stay SequentialMLP's, which TEGroupedMLP's equal.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_lrmoe.lrmoe.experts import LRMoESequentialMLP
from megatron_lrmoe.lrmoe.moe_layer import LRMoELayer
from megatron_lrmoe.spec_utils import map_module_specs

# The region reads the expert weights directly (and groups the GEMMs itself when asked),
# so plain Megatron linears suffice in both flavours; their checkpoint keys are
# SequentialMLP's (= TEGroupedMLP's).
LRMOE_EXPERTS_SPEC = ModuleSpec(
    module=LRMoESequentialMLP,
    submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
)


def _convert(spec: ModuleSpec) -> ModuleSpec:
    module = spec.module
    if isinstance(module, type) and issubclass(module, MoELayer):
        submodules = dataclasses.replace(spec.submodules, experts=LRMOE_EXPERTS_SPEC)
        return dataclasses.replace(spec, module=LRMoELayer, submodules=submodules)
    return spec


def to_lrmoe_spec(spec: Any) -> Any:
    """Copy of a Megatron GPT layer/block spec with the LRMoE classes in its MoE positions."""
    return map_module_specs(spec, _convert)
