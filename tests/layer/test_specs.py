"""Spec rewriting and the sequence-parallel torch norm."""

from __future__ import annotations

import pytest
import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.torch_norm import WrappedTorchNorm

from megatron_lrmoe.launcher.norms import SequenceParallelTorchNorm
from megatron_lrmoe.layer.spec_utils import replace_module, spec_modules


def _config(**overrides) -> TransformerConfig:
    base = dict(num_layers=2, hidden_size=16, num_attention_heads=2, num_moe_experts=4,
                moe_router_topk=2, normalization="RMSNorm", add_bias_linear=False)
    return TransformerConfig(**{**base, **overrides})


def test_replace_module_rewrites_every_position_and_keeps_the_original():
    spec = get_gpt_decoder_block_spec(_config(), use_transformer_engine=False, pp_rank=0)
    before = spec_modules(spec)
    assert WrappedTorchNorm in before
    new = replace_module(spec, WrappedTorchNorm, SequenceParallelTorchNorm)
    after = spec_modules(new)
    assert WrappedTorchNorm not in after
    assert after.count(SequenceParallelTorchNorm) == before.count(WrappedTorchNorm)
    assert spec_modules(spec) == before, "the input spec must not change"
    # Everything else is untouched, in the same places.
    assert [m for m in after if m is not SequenceParallelTorchNorm] == [
        m for m in before if m is not WrappedTorchNorm
    ]


def test_sequence_parallel_norm_marks_its_parameters():
    config = _config(tensor_model_parallel_size=2, sequence_parallel=True)
    norm = SequenceParallelTorchNorm(config, 16, eps=1e-6)
    assert isinstance(norm, torch.nn.RMSNorm)
    assert norm.eps == 1e-6
    assert all(p.sequence_parallel for p in norm.parameters())
    assert config.sequence_parallel is True, "the caller's config is not modified"


def test_sequence_parallel_norm_without_sp_equals_megatron_norm():
    config = _config(normalization="LayerNorm")
    ours = SequenceParallelTorchNorm(config, 16)
    theirs = WrappedTorchNorm(config, 16)
    assert type(ours) is type(theirs) is torch.nn.LayerNorm
    assert not any(getattr(p, "sequence_parallel", False) for p in ours.parameters())
    x = torch.randn(3, 16)
    torch.testing.assert_close(ours(x), theirs(x))


# -----------------------------------------------------------------------------
# The LRMoE spec converter
# -----------------------------------------------------------------------------


def _moe_positions(spec):
    """(module, experts module) of every MoE position in a spec tree."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_lrmoe.layer.spec_utils import builder_class, builder_submodules, map_module_specs

    found = []

    def visit(node):
        cls = builder_class(node)
        if isinstance(cls, type) and issubclass(cls, MoELayer):
            submodules = builder_submodules(node)
            found.append((cls, builder_class(submodules.experts), submodules))
        return node

    map_module_specs(spec, visit)
    return found


def test_converter_on_block_spec_with_layer_freq_and_shared_experts():
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_lrmoe.layer.experts import LRMoESequentialMLP
    from megatron_lrmoe.layer.moe_layer import LRMoELayer
    from megatron_lrmoe.layer.spec import to_lrmoe_spec

    config = _config(num_layers=4, moe_layer_freq=[0, 1, 0, 1],
                     moe_shared_expert_intermediate_size=32)
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, pp_rank=0)
    before = _moe_positions(block)
    assert [m for m, _, _ in before] == [MoELayer, MoELayer]
    converted = to_lrmoe_spec(block)
    after = _moe_positions(converted)
    assert [(m, e) for m, e, _ in after] == [(LRMoELayer, LRMoESequentialMLP)] * 2
    # Shared experts stay Megatron's builder (0.19: a partial of its shared-expert factory).
    assert all(sub.shared_experts is bsub.shared_experts
               for (_, _, sub), (_, _, bsub) in zip(after, before, strict=True))
    assert all(sub.shared_experts is not None for _, _, sub in after)
    # Dense layers and everything outside the MoE positions are untouched.
    assert converted.layer_specs[0] == block.layer_specs[0]
    assert converted.layer_specs[2] == block.layer_specs[2]
    assert _moe_positions(block) == before, "the input spec must not change"


class _LayersWithDenseMTP(list):
    """A list of layer specs carrying one more spec, constructed only with it: the shape of
    Megatron-Bridge's EXAONE-MoE and Step-3.5 block specs (``_MTPDenseLayerSpecsList``)."""

    def __init__(self, layers, dense_mtp):
        super().__init__(layers)
        self.dense_mtp = dense_mtp


def test_converter_keeps_a_list_subclass_and_what_it_carries():
    from megatron_lrmoe.layer.moe_layer import LRMoELayer
    from megatron_lrmoe.layer.spec import to_lrmoe_spec

    config = _config(num_layers=3, moe_layer_freq=[0, 1, 1])
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, pp_rank=0)
    dense = block.layer_specs[0]
    block.layer_specs = _LayersWithDenseMTP(block.layer_specs, dense)
    converted = to_lrmoe_spec(block)
    layers = converted.layer_specs
    assert type(layers) is _LayersWithDenseMTP and layers.dense_mtp is dense
    assert [m for m, _, _ in _moe_positions(converted)] == [LRMoELayer, LRMoELayer]
    assert layers[0] is dense and layers is not block.layer_specs


def test_converter_on_te_flavoured_layer_spec():
    """A Transformer-Engine-flavoured MoE position (TEGroupedMLP experts) converts too;
    the TE spec functions need TE, so the position is built by hand as
    TESpecProvider.grouped_mlp_modules builds it (partials, as in Megatron-Core 0.19)."""
    from functools import partial

    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.moe.experts import GroupedMLPSubmodules, TEGroupedMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import (
        TransformerLayer,
        TransformerLayerSubmodules,
    )

    from megatron_lrmoe.layer.experts import LRMoESequentialMLP
    from megatron_lrmoe.layer.moe_layer import LRMoELayer
    from megatron_lrmoe.layer.spec import to_lrmoe_spec

    te_experts = partial(TEGroupedMLP, submodules=GroupedMLPSubmodules(
        linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear))
    layer = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        mlp=partial(MoELayer, submodules=MoESubmodules(router=TopKRouter, experts=te_experts))))
    converted = to_lrmoe_spec(layer)
    mlp = converted.submodules.mlp
    assert isinstance(mlp, partial) and mlp.func is LRMoELayer
    assert mlp.keywords["submodules"].experts.func is LRMoESequentialMLP
    assert mlp.keywords["submodules"].router is TopKRouter
    assert layer.submodules.mlp.func is MoELayer


def test_converter_leaves_dense_specs_alone():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_lrmoe.layer.spec import to_lrmoe_spec

    dense = get_gpt_layer_local_spec()
    assert to_lrmoe_spec(dense) == dense


def _mtp_conversion() -> dict:
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    from megatron_lrmoe.layer.spec import to_lrmoe_spec

    ps.initialize_model_parallel()  # the MTP spec asks for the pipeline stage
    config = _config(mtp_num_layers=1)
    last = get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                      pp_rank=0).layer_specs[-1]
    mtp = get_gpt_mtp_block_spec(config, last, use_transformer_engine=False, pp_rank=0)
    before = _moe_positions(mtp)
    converted = _moe_positions(to_lrmoe_spec(mtp))
    names = [(m.__name__, e.__name__) for m, e, _ in converted]
    return {"before": [(m.__name__, e.__name__) for m, e, _ in before], "after": names,
            "unchanged": _moe_positions(mtp) == before}


def test_converter_on_mtp_block_spec(gloo1):
    """Megatron-LM's gpt_builder builds an MTP block from the last decoder layer's spec
    (an MoE layer for these models): its MoE position converts like the decoder's."""
    (result,) = gloo1.run(_mtp_conversion, timeout=120)
    assert result["before"] == [("MoELayer", "SequentialMLP")]
    assert result["after"] == [("LRMoELayer", "LRMoESequentialMLP")]
    assert result["unchanged"], "the input spec must not change"


def test_converter_is_the_identity_without_moe():
    from megatron_lrmoe.layer.spec import to_lrmoe_spec

    dense_block = get_gpt_decoder_block_spec(_config(num_moe_experts=None),
                                             use_transformer_engine=False, pp_rank=0)
    assert to_lrmoe_spec(dense_block) == dense_block
    assert to_lrmoe_spec([dense_block, None]) == [dense_block, None]


def _build_both(layer_freq: list[int], shared: int | None) -> dict:
    """GPTModel from Megatron's local block spec and from its conversion: module classes."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_lrmoe.config.transformer_config import LRMoETransformerConfig
    from megatron_lrmoe.layer.spec import to_lrmoe_spec

    ps.initialize_model_parallel()
    model_parallel_cuda_manual_seed(1)
    base = dict(num_layers=len(layer_freq), hidden_size=16, num_attention_heads=2,
                num_moe_experts=4, moe_router_topk=2, normalization="RMSNorm",
                add_bias_linear=False, moe_layer_freq=layer_freq,
                moe_shared_expert_intermediate_size=shared,
                moe_token_dispatcher_type="alltoall")
    out = {}
    for name, lrmoe in (("megatron", False), ("lrmoe", True)):
        config = LRMoETransformerConfig(**base, moe_lrmoe=lrmoe)
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, pp_rank=0)
        model = GPTModel(config, to_lrmoe_spec(spec) if lrmoe else spec, vocab_size=64,
                         max_sequence_length=8)
        out[name] = [(n, type(m).__name__) for n, m in model.named_modules()]
    return out


@pytest.mark.parametrize("layer_freq, shared", [([1, 1], None), ([0, 1, 0, 1], 32)])
def test_converted_spec_builds_a_model_with_lrmoe_only_in_moe_positions(gloo1, layer_freq,
                                                                         shared):
    (built,) = gloo1.run(_build_both, layer_freq, shared, timeout=120)
    renamed = {"MoELayer": "LRMoELayer", "SequentialMLP": "LRMoESequentialMLP"}
    megatron, lrmoe = dict(built["megatron"]), dict(built["lrmoe"])
    assert sum(v == "LRMoELayer" for v in lrmoe.values()) == sum(layer_freq)
    # Same module tree; only the MoE layers and their expert containers change class
    # (the LRMoE dispatcher is not a module).
    assert megatron.keys() == lrmoe.keys()
    for name, cls in megatron.items():
        assert lrmoe[name] == renamed.get(cls, cls), name
    if shared:
        assert "SharedExpertMLP" in lrmoe.values()
