"""Megatron-Bridge's Qwen3-30B-A3B (8 x H100) and GLM-4.5-Air pretraining recipes, shrunk in
width and depth by overrides, trained 20 steps by Bridge's own ``pretrain()`` with
``gpt_step`` at expert parallelism 2 on two gloo ranks (the test harness,
workshop/lrmoe_testing/bridge.py, on Megatron's MoE layer: no LRMoE here).
"""

from __future__ import annotations

import statistics

import pytest
import torch

from lrmoe_testing import bridge as harness


@pytest.mark.parametrize("recipe, mlps", [
    (harness.QWEN3_30B_A3B_8GPU, {"module.decoder.layers.0.mlp": "MoELayer",
                                  "module.decoder.layers.1.mlp": "MoELayer"}),
    # GLM-4.5-Air keeps its dense first layer and its MTP layer (an MoE one).
    (harness.GLM45_AIR, {"module.decoder.layers.0.mlp": "MLP",
                         "module.decoder.layers.1.mlp": "MoELayer",
                         "module.decoder.layers.2.mlp": "MoELayer",
                         "module.mtp.layers.0.mtp_model_layer.mlp": "MoELayer"}),
])
def test_recipe_trains_at_ep2(gloo2, recipe, mlps):
    runs = gloo2.run(harness.train, recipe, harness.EP2, timeout=600)
    for run in runs:
        assert run.iterations == list(range(20))
        assert run.mlps == mlps
    losses = runs[0].losses
    assert runs[1].losses == losses          # "lm loss" is reduced over the ranks
    assert statistics.fmean(losses[-5:]) < statistics.fmean(losses[:5]) - 0.02, losses
    # Expert parallelism 2: each rank holds half of the 4 experts of every MoE layer.
    experts = [n for n in runs[0].params if ".local_experts." in n and "linear_fc1" in n]
    assert len(experts) == 2 * sum(cls == "MoELayer" for cls in mlps.values())


def test_save_at_10_and_resume_to_20_is_bitwise(gloo2, tmp_path):
    recipe, ckpt = harness.QWEN3_30B_A3B_8GPU, str(tmp_path / "ckpt")
    whole = gloo2.run(harness.train, recipe, harness.EP2, timeout=600)
    first = gloo2.run(harness.train, recipe,
                      [*harness.EP2, "train.train_iters=10",
                       *harness.checkpoint_overrides(save=ckpt, interval=10)], timeout=600)
    second = gloo2.run(harness.train, recipe,
                       [*harness.EP2, *harness.checkpoint_overrides(load=ckpt)], timeout=600)
    for rank in range(2):
        assert first[rank].losses == whole[rank].losses[:10]
        assert second[rank].iterations == list(range(10, 20))
        assert second[rank].losses == whole[rank].losses[10:]
        assert second[rank].params.keys() == whole[rank].params.keys()
        for name, value in whole[rank].params.items():
            assert torch.equal(second[rank].params[name], value), name
