"""The accepted Megatron-Bridge recipes beyond the ones the other Bridge tests train, each
shrunk (``lrmoe_testing/bridge.py``: its ``SHAPES`` entry, the local flavour of its layer spec),
converted with ``enable_lrmoe(cfg, adapt=True)`` and trained 10 steps by Bridge's own
``pretrain()`` on two gloo ranks at EP 2: with LRMoE at gamma = inf and, after the same
conversion, with Megatron's layer (``model.moe_lrmoe=false``), the same losses within the
layer tests' bars, every MoE layer LRMoE's in the one and Megatron's in the other.

What a shrunk recipe keeps of its model: its layer spec (GLM-4.5's QK norm, OLMoE's
attention, DeepSeek-V2's MLA, the hybrid stack, EXAONE-MoE's sliding-window layers), its
router (score function, top-k scaling, expert bias, expert groups fitted to 4 experts), its
dense first layer, shared expert and MTP layers where it has them. What a CPU run changes
for every recipe (``CPU_OVERRIDES``): precision, fusions, and parallelism but EP, so
Qwen3-235B-A22B and Nemotron-3.5 Lightning train at CP 1 (Megatron's local attention
refuses CP > 1; the MoE layer at CP 2 is tests/layer/test_context_parallel.py's).
"""

from __future__ import annotations

import math

import pytest
import torch

from lrmoe_testing import bridge as harness
from tests.integration.test_bridge_gpt_oss import _callbacks
from tests.integration.test_bridge_training import _enable
from tests.layer.test_lrmoe_layer import ATOL, RTOL

STEPS = ["train.train_iters=10", "scheduler.lr_decay_iters=10", "logger.log_interval=10",
         "train.global_batch_size=2"]          # one micro-batch per step per rank
#: The recipes without grouped-query attention (``harness.GROUP_PER_HEAD``).
NO_GQA = {harness.OLMOE_7B, harness.DEEPSEEK_V2}


@pytest.mark.parametrize("recipe", [
    harness.GLM45_355B, harness.QWEN3_235B_A22B, harness.OLMOE_7B, harness.DEEPSEEK_V2,
    harness.NEMOTRON_3_NANO_GB200, harness.NEMOTRON_3_5_LIGHTNING, harness.EXAONE_MOE,
])
def test_recipe_trains_with_lrmoe_equal_to_megatron_at_inf(gloo2, recipe):
    heads = harness.GROUP_PER_HEAD if recipe in NO_GQA else []
    lrmoe, megatron = (gloo2.run(harness.train, recipe, [*harness.EP2, *heads, *STEPS, extra],
                                 _enable, _callbacks, timeout=300)
                       for extra in ("model.moe_lrmoe_bwd_capacity_factor=inf",
                                     "model.moe_lrmoe=false"))
    for rank in range(2):
        ours, theirs = lrmoe[rank], megatron[rank]
        assert ours.iterations == list(range(10)), ours.iterations
        assert all(map(math.isfinite, ours.losses)), ours.losses
        torch.testing.assert_close(torch.tensor(ours.losses), torch.tensor(theirs.losses),
                                   rtol=RTOL, atol=ATOL)
        # The same modules but the MoE layers' class; the dense ones stay Megatron's MLP.
        assert ours.mlps.keys() == theirs.mlps.keys()
        moe = [name for name, cls in theirs.mlps.items() if cls == "MoELayer"]
        assert moe, theirs.mlps
        assert {ours.mlps[name] for name in moe} == {"LRMoELayer"}, ours.mlps
        assert {name: cls for name, cls in ours.mlps.items() if name not in moe} == {
            name: cls for name, cls in theirs.mlps.items() if name not in moe}
