"""Weights from Hugging Face through Megatron-Bridge's ``AutoBridge``: tiny random Qwen3-MoE
and GLM-4.5 (GLM-4 MoE) models built offline from transformers' own config classes are
imported into Bridge's plain Megatron model and into its LRMoE model (``enable_lrmoe``),
at expert parallelism 2 on two gloo ranks.

* the LRMoE model takes the same weights: Bridge's mappings fill it by the expert names
  ``local_experts.<i>.linear_fc{1,2}.weight``, with nothing left unfilled (for GLM-4.5 with
  ``register_local_expert_mappings``: Bridge 0.6.2's GLM mapping has grouped names only);
* export back to HF gives the original weights, bit for bit, from both models;
* the logits of the LRMoE model equal the plain model's (LRMoE's forward is exact at any
  gamma), and the plain model's equal the HF model's own within float32 rounding.
"""

from __future__ import annotations

import glob
import os
import types

import pytest
import safetensors.torch
import torch

from tests.layer.test_lrmoe_layer import ATOL, RTOL

SEQ = 16
VOCAB = 256
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts_per_tok=2,
             max_position_embeddings=128, tie_word_embeddings=False, norm_topk_prob=True)


def _hf_config(family: str):
    if family == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(**SMALL, num_hidden_layers=2, num_experts=4,
                              decoder_sparse_step=1, mlp_only_layers=[])
    from transformers import Glm4MoeConfig

    # GLM-4.5's shape: a dense first layer, a shared expert, partial rotary, qkv bias.
    return Glm4MoeConfig(**SMALL, num_hidden_layers=3, first_k_dense_replace=1,
                         n_routed_experts=4, n_shared_experts=1, n_group=1, topk_group=1,
                         routed_scaling_factor=1.0, partial_rotary_factor=0.5,
                         attention_bias=True, use_qk_norm=False, num_nextn_predict_layers=0)


def _cpu_provider(provider, lrmoe: bool):
    """Bridge's provider for this CPU test: local spec, fp32, EP 2, nothing fused."""
    from lrmoe_testing.bridge import use_local_spec
    from megatron_lrmoe.integration.bridge import enable_lrmoe

    holder = types.SimpleNamespace(model=provider, ddp=None, dist=None)
    use_local_spec(holder)
    for name, value in dict(
            tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
            expert_model_parallel_size=2, expert_tensor_parallel_size=1,
            sequence_parallel=False, bf16=False, fp16=False, params_dtype=torch.float32,
            pipeline_dtype=None, gradient_accumulation_fusion=False, moe_grouped_gemm=False,
            moe_permute_fusion=False, moe_token_dispatcher_type="alltoall",
            moe_flex_dispatcher_backend=None, apply_rope_fusion=False,
            bias_activation_fusion=False, masked_softmax_fusion=False,
            persist_layer_norm=False, cross_entropy_loss_fusion=False,
            moe_router_dtype="fp32").items():
        setattr(holder.model, name, value)
    if lrmoe:
        enable_lrmoe(holder, adapt=True)
    holder.model.finalize()
    return holder.model


def _round_trip(family: str, path: str) -> dict:
    """On each rank: the HF model, Bridge's plain and LRMoE models from its weights, their
    logits and their export."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator
    from transformers import AutoModelForCausalLM

    from megatron_lrmoe.integration.runtime.cpu import enable_bridge_cpu_runtime

    enable_bridge_cpu_runtime()
    from megatron.bridge import AutoBridge

    from megatron_lrmoe.integration.bridge_hf import register_local_expert_mappings

    register_local_expert_mappings()   # GLM-4.5: experts also by local_experts.<i> names

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(_hf_config(family), dtype=torch.float32).eval()
    if dist.get_rank() == 0:
        hf.save_pretrained(path)
    dist.barrier()
    tokens = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = {"hf_logits": hf(tokens).logits}
    # The checkpoint as written (transformers keeps experts fused in memory; the files hold
    # them one by one, the names Bridge's mappings read and write).
    out["hf"] = {}
    for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        out["hf"].update(safetensors.torch.load_file(file))
    auto = AutoBridge.from_hf_pretrained(path)
    # LRMoE's pre-wrap hook sizes its buffers by the micro-batch, which training sets.
    init_num_microbatches_calculator(dist.get_rank(), None, global_batch_size=2,
                                     micro_batch_size=1, data_parallel_size=2)
    for lrmoe in (False, True):
        provider = _cpu_provider(auto.to_megatron_provider(load_weights=True), lrmoe)
        provider.initialize_model_parallel(seed=0)
        model = provider.provide_distributed_model(wrap_with_ddp=False)
        key = "lrmoe" if lrmoe else "plain"
        module = model[0]
        with torch.no_grad():
            module.eval()
            positions = torch.arange(SEQ).unsqueeze(0)
            out[f"{key}_logits"] = module(tokens, positions, attention_mask=None)
        out[f"{key}_classes"] = sorted({type(m).__name__ for n, m in module.named_modules()
                                        if n.endswith(".mlp")})
        out[f"{key}_expert_names"] = sorted(n for n, _ in module.named_parameters()
                                            if ".experts." in n)
        out[f"{key}_export"] = {name: t.clone() for name, t in
                                auto.export_hf_weights(model, cpu=True, show_progress=False)}
        ps.destroy_model_parallel()
    return out


@pytest.mark.parametrize("family", ["qwen3_moe", "glm4_moe"])
def test_hf_weights_round_trip_through_plain_and_lrmoe_models(gloo2, tmp_path, family):
    runs = gloo2.run(_round_trip, family, str(tmp_path / family), timeout=600)
    for out in runs:
        assert "LRMoELayer" in out["lrmoe_classes"] and "MoELayer" in out["plain_classes"]
        assert "LRMoELayer" not in out["plain_classes"]
        # Bridge's mappings fill the same expert parameters by the same names.
        assert out["lrmoe_expert_names"] == out["plain_expert_names"]
        assert any(".local_experts.1.linear_fc2.weight" in n for n in out["lrmoe_expert_names"])
        for key in ("plain", "lrmoe"):
            exported = out[f"{key}_export"]
            assert sorted(exported) == sorted(out["hf"]), key
            for name, original in out["hf"].items():
                assert torch.equal(exported[name], original), (key, name)
        torch.testing.assert_close(out["lrmoe_logits"], out["plain_logits"], atol=ATOL, rtol=RTOL)
        plain = out["plain_logits"][..., :VOCAB]
        torch.testing.assert_close(plain, out["hf_logits"], atol=1e-4, rtol=1e-4)
