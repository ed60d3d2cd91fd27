"""The one spec converter: Megatron specs in, the same specs with LRMoE classes out.

Takes any layer spec (the builder of a TransformerLayer), decoder-block spec
(``TransformerBlockSubmodules``, e.g. with ``--moe-layer-freq`` mixing dense and MoE
layers), hybrid (Mamba) stack spec (``HybridStackSubmodules``, whose ``moe_layer`` builds
the pattern's MoE layers) or a list of them, in the local or Transformer Engine flavour,
and returns a copy in which every MoE position holds ``LRMoELayer`` with
``LRMoESequentialMLP`` experts. Dense MLPs, attention, Mamba layers, norms and shared
experts stay Megatron's. Every entry point (the launcher's ``--moe-lrmoe``, the
Megatron-LM wrapper, the patch, the Bridge providers) uses it.

Megatron-Core 0.19 builds the MoE position as ``functools.partial(MoELayer,
submodules=MoESubmodules(...))``, its experts as a partial too; the converter keeps the
kind of builder node it finds (``spec_utils.rebuild``).

Grouped GEMM is not dropped: with ``--moe-grouped-gemm`` Megatron's spec holds
TEGroupedMLP, which this converter replaces like SequentialMLP, since the region
computes the experts itself; the flag stays in the config (``moe_grouped_gemm``), and
the region then runs its expert GEMMs grouped (``torch.nn.functional.grouped_mm``,
layer/expert_gemms.py) on every device where they apply. The checkpoint keys stay
SequentialMLP's, which TEGroupedMLP's equal.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe.moe_layer import MoELayer

from megatron_lrmoe.layer.experts import LRMoESequentialMLP
from megatron_lrmoe.layer.moe_layer import LRMoELayer
from megatron_lrmoe.layer.spec_utils import (
    Builder,
    builder_class,
    builder_submodules,
    map_module_specs,
    rebuild,
)

# The region reads the expert weights directly (and groups the GEMMs itself when asked),
# so plain Megatron linears suffice in both flavours; their checkpoint keys are
# SequentialMLP's (= TEGroupedMLP's).
# Megatron's experts builder interface: (num_local_experts, config, *, pg_collection, name).
LRMOE_EXPERTS = functools.partial(
    LRMoESequentialMLP,
    submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
)


def _convert(node: Builder) -> Builder:
    module = builder_class(node)
    if isinstance(module, type) and issubclass(module, MoELayer):
        submodules = dataclasses.replace(builder_submodules(node), experts=LRMOE_EXPERTS)
        return rebuild(node, LRMoELayer, submodules)
    return node


def to_lrmoe_spec(spec: Any) -> Any:
    """Copy of a Megatron layer, block or hybrid stack spec with the LRMoE classes in its
    MoE positions."""
    return map_module_specs(spec, _convert)
