"""Bridge's DeepSeek-V3 recipe (multi-latent attention, a dense first layer, a shared
expert, a sigmoid router with expert bias over expert groups, the recipe's one MTP layer),
shrunk by overrides (on CPU also the local spec), trained by Bridge's own ``pretrain()`` on
two gloo ranks at EP 2. Three runs of 6 steps on one pool:

* LRMoE (``enable_lrmoe(adapt=True)``, popularity placement, gamma = inf), saving at step 3:
  every MoE layer, the MTP layer's included, is an LRMoE layer, the first layer dense;
* the recipe without LRMoE (no ``enable_lrmoe``): the same losses within the layer tests'
  bars;
* a run resumed from the first one's step 3: bitwise its losses, parameters and LRMoE step
  state.
"""

from __future__ import annotations

import functools

import torch

from lrmoe_testing import bridge as harness
from tests.integration.test_bridge_training import _enable, _equal, _recorder
from tests.layer.test_lrmoe_layer import ATOL, RTOL

# Six steps; MLA's keys have a head per query head (the recipe's query groups equal its
# heads: SMALL's GQA groups do not apply).
STEPS = ["train.train_iters=6", "scheduler.lr_decay_iters=6", "logger.log_interval=3",
         "model.num_query_groups=4"]
LRMOE = ["model.moe_lrmoe_placement=popularity", "model.moe_lrmoe_bwd_capacity_factor=inf"]


def train(overrides: list[str], lrmoe: bool) -> dict:
    """A pool task: the shrunk DeepSeek-V3 recipe, converted with ``enable_lrmoe`` when
    ``lrmoe``, trained on this rank (what ``test_bridge_training._recorder`` records)."""
    from megatron_lrmoe.integration.bridge import LRMoECallback
    from megatron_lrmoe.integration.runtime.cpu import enable_bridge_cpu_runtime

    enable_bridge_cpu_runtime()
    out: dict = {"losses": []}
    cfg = harness.build_recipe(harness.DEEPSEEK_V3, [*harness.EP2, *STEPS, *overrides],
                               convert=_enable if lrmoe else None)
    harness.run_pretrain(cfg, [LRMoECallback(), _recorder(out)] if lrmoe else [_recorder(out)])
    return out


def test_deepseek_v3_trains_with_lrmoe_exact_at_inf_and_resumes_bitwise(gloo2, tmp_path):
    run = functools.partial(gloo2.run, train, timeout=600)
    full = run([*LRMOE, *harness.checkpoint_overrides(save=str(tmp_path), interval=3)], True)
    plain = run([], False)
    resumed = run([*LRMOE, *harness.checkpoint_overrides(load=str(tmp_path)),
                   "checkpoint.ckpt_step=3"], True)
    for rank in range(2):
        names = [name for name, _ in full[rank]["moe"]]
        assert {cls for _, cls in full[rank]["moe"]} == {"LRMoELayer"}
        assert "module.decoder.layers.0.mlp" not in names
        assert "module.mtp.layers.0.mtp_model_layer.mlp" in names and len(names) == 3
        assert [cls for _, cls in plain[rank]["moe"]] == ["MoELayer"] * 3
        assert len(full[rank]["losses"]) == 6
        torch.testing.assert_close(torch.tensor(full[rank]["losses"]),
                                   torch.tensor(plain[rank]["losses"]), rtol=RTOL, atol=ATOL)
        assert resumed[rank]["losses"] == full[rank]["losses"][3:]
        assert resumed[rank]["origin"] == "checkpoint"
        assert _equal(resumed[rank]["params"], full[rank]["params"])
        assert _equal(resumed[rank]["state"], full[rank]["state"])
        assert full[rank]["state"][0]["planner"]["smoothed_counts"] is not None
