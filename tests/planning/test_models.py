"""The model recipes the package ships (megatron_lrmoe.planning.models): each equal to the
repository's launcher config of that recipe (configs/*.yaml, read by the simulator's
``model_from_config``), and the MoE layer counts the recipes state."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_lrmoe.planning.models import MODELS
from megatron_lrmoe.tools.simulate import model_from_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("name, config", [("qwen3-30b-a3b", "qwen3_30b_a3b.yaml"),
                                          ("glm45-air", "glm45_air.yaml")])
def test_shipped_models_are_the_recipes_configs(name, config):
    assert MODELS[name] == model_from_config(name, CONFIGS / config)


def test_moe_layers_and_experts():
    qwen, glm = MODELS["qwen3-30b-a3b"], MODELS["glm45-air"]
    assert (glm.num_layers, qwen.num_layers) == (45, 48)   # GLM's first layer is dense
    assert (qwen.num_experts, qwen.topk, qwen.ffn_hidden_size) == (128, 8, 768)
    # One EP rank's shape at EP 16: 512 sequences per step over 16 data-parallel ranks.
    shape = qwen.shape(16)
    assert (shape.microbatches_per_step, shape.tokens_per_rank) == (32, 4096)
