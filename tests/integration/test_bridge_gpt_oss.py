"""Megatron-Bridge's gpt-oss-20b recipe with ``enable_lrmoe(cfg, adapt=True)``, shrunk, on two
gloo ranks (EP 2): it builds and trains with LRMoE, expert biases and all, as Megatron's
own layer does at gamma = inf.

gpt-oss is the recipe family with expert biases (``add_bias_linear``). What is gpt-oss's
own and stays Megatron's, untouched by LRMoE: attention sinks (``softmax_type``
"learnable": a ``softmax_offset`` per head), the sliding window on every other layer,
YaRN positions, the router's bias; its clamped GLU expert activation is the LRMoE experts'
(tests/layer/test_expert_biases.py holds the layer against Megatron's). The recipe reads
its Hub ``config.json`` from the shipped offline cache (tests/fixtures/hf_configs).
"""

from __future__ import annotations

import inspect
import math

import torch

from lrmoe_testing import bridge as harness
from tests.layer.test_lrmoe_layer import ATOL, RTOL

GPT_OSS_20B = "gpt_oss_20b_pretrain_config"
GPT_OSS_120B = "gpt_oss_120b_pretrain_config"


def _enable(cfg) -> None:
    """``enable_lrmoe`` as a user calls it, and gpt-oss's facts checked before any override."""
    from megatron_lrmoe.integration.bridge import enable_lrmoe

    model = cfg.model
    before = (model.add_bias_linear, model.softmax_type, model.window_size,
              model.activation_func_clamp_value, model.glu_linear_offset)
    enable_lrmoe(cfg, adapt=True)
    after = (cfg.model.add_bias_linear, cfg.model.softmax_type, cfg.model.window_size,
             cfg.model.activation_func_clamp_value, cfg.model.glu_linear_offset)
    assert before == after == (True, "learnable", (127, 0), 7.0, 1.0), (before, after)
    # Megatron's quick_gelu is wrapped in torch.compile (on CPU deferred to its first call,
    # integration/runtime/cpu.py), which a CPU test would pay for in compile time; its
    # uncompiled function computes the same.
    act = cfg.model.activation_func
    cfg.model.activation_func = (getattr(act, "_torchdynamo_orig_callable", None)
                                 or inspect.unwrap(act))


def _callbacks():
    from megatron_lrmoe.integration.bridge import LRMoECallback

    return [LRMoECallback()]


def test_gpt_oss_recipe_trains_with_lrmoe_equal_to_megatron_at_inf(gloo2):
    """Three steps with LRMoE at gamma = inf and with Megatron's layer (``moe_lrmoe=false``
    after the same conversion): the same losses within the layer tests' bars. The warm-up
    gives the first step a learning rate of 0, so the third loss is the first after an
    update, from every gradient; the expert biases (zeros at the start, as Megatron
    initialises them) have moved by then."""
    overrides = [*harness.EP2, "train.train_iters=3", "train.global_batch_size=2",
                 "scheduler.lr_decay_iters=3", "scheduler.lr_warmup_iters=1"]
    lrmoe, megatron = (gloo2.run(harness.train, GPT_OSS_20B, [*overrides, extra], _enable,
                                 _callbacks, timeout=300)
                       for extra in ("model.moe_lrmoe_bwd_capacity_factor=inf",
                                     "model.moe_lrmoe=false"))
    for rank in range(2):
        ours, theirs = lrmoe[rank], megatron[rank]
        assert len(ours.losses) == 3 and all(map(math.isfinite, ours.losses)), ours.losses
        torch.testing.assert_close(torch.tensor(ours.losses), torch.tensor(theirs.losses),
                                   rtol=RTOL, atol=ATOL)
        assert set(ours.mlps.values()) == {"LRMoELayer"}, (rank, ours.mlps)
        assert set(theirs.mlps.values()) == {"MoELayer"}, (rank, theirs.mlps)
        for part in ("experts.local_experts.0.linear_fc1.bias",
                     "experts.local_experts.0.linear_fc2.bias", "mlp.router.bias",
                     "core_attention.softmax_offset"):
            assert any(part in name for name in ours.params), (rank, part)
        biases = [p for name, p in ours.params.items() if ".local_experts." in name
                  and name.endswith(".bias")]
        assert biases and all(bool(p.abs().sum() > 0) for p in biases), rank


def test_gpt_oss_120b_shrunk_is_the_model_trained_above(bridge):
    """gpt-oss-120b's recipe, shrunk as the training above shrinks gpt-oss-20b's, builds the
    same model: every field of the model provider equal but the Hub repository it names
    (the two differ in depth and experts, which the shrinking sets), so the training above
    trains it too."""
    import dataclasses

    def fields(recipe: str) -> dict[str, str]:
        model = harness.build_recipe(recipe, harness.EP2, _enable).model
        return {f.name: repr(getattr(model, f.name)) for f in dataclasses.fields(model)}

    small, large = fields(GPT_OSS_20B), fields(GPT_OSS_120B)
    differ = {name for name in small.keys() | large.keys() if small.get(name) != large.get(name)}
    assert differ == {"hf_model_id"}, {name: (small.get(name), large.get(name)) for name in differ}
