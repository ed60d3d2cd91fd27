"""Spec rewriting and the sequence-parallel torch norm."""

from __future__ import annotations

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.torch_norm import WrappedTorchNorm

from megatron_lrmoe.models.norms import SequenceParallelTorchNorm
from megatron_lrmoe.spec_utils import replace_module, spec_modules


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
