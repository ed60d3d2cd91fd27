"""The start-up budget check (``check_memory_budget``): one rule, ``budget_floor``
(docs/design.md, "Memory budget")."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from megatron_lrmoe.config.transformer_config import LRMoETransformerConfig
from megatron_lrmoe.integration.planner_inputs import (
    GIB,
    check_memory_budget,
    machine_constants,
    moe_shape,
    recomputed_moe_layers,
)
from megatron_lrmoe.planning.cost_model import CostModel
from megatron_lrmoe.planning.plan_types import budget_floor

TOKENS = 64


def _config(tmp_path, budget_gb: float) -> LRMoETransformerConfig:
    calibration = tmp_path / "machine.json"
    calibration.write_text(json.dumps({"gemm_flops_per_s": 1e9, "alltoall_bytes_per_s": 1e9,
                                       "alltoall_latency_s": 1e-6, "source": "test"}))
    return LRMoETransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=1,
                                  num_moe_experts=4, moe_router_topk=2,
                                  moe_token_dispatcher_type="alltoall", add_bias_linear=False,
                                  moe_lrmoe=True, moe_lrmoe_memory_budget_gb=budget_gb,
                                  moe_lrmoe_calibration=str(calibration))


def _floor_and_need(config) -> tuple[float, float]:
    cost = CostModel(moe_shape(config, TOKENS, 1, 2),
                     machine_constants(config.moe_lrmoe_calibration, "cpu"))
    return budget_floor(cost), cost.balanced_dropless_need()


def test_budget_between_floor_and_dropless_need_is_accepted(tmp_path):
    floor, need = _floor_and_need(_config(tmp_path, 1.0))
    assert floor < need
    budget = (floor + need) / 2 / GIB
    line = check_memory_budget(_config(tmp_path, budget), 2, TOKENS, micro_batch_size=1)
    # Not even balanced routing fits dropless: the planner lowers gamma, no refusal.
    assert line is not None and "fit micro-batch size <= 0 dropless" in line


def test_budget_below_the_floor_names_the_flag_and_both_numbers(tmp_path):
    floor, _ = _floor_and_need(_config(tmp_path, 1.0))
    budget = floor * 0.99 / GIB
    with pytest.raises(ValueError) as info:
        check_memory_budget(_config(tmp_path, budget), 2, TOKENS)
    message = str(info.value)
    assert message.startswith(f"--moe-lrmoe-memory-budget-gb {budget:g} is below the floor of "
                              f"{floor / GIB:.4g} GiB per rank")
    assert re.search("nothing retained", message)
    assert check_memory_budget(_config(tmp_path, floor / GIB), 2, TOKENS) is None


def _recompute_config(tmp_path, **recompute) -> LRMoETransformerConfig:
    base = _config(tmp_path, 1.0)
    return LRMoETransformerConfig(**{**{k: getattr(base, k) for k in (
        "num_layers", "hidden_size", "num_attention_heads", "num_moe_experts",
        "moe_router_topk", "moe_token_dispatcher_type", "add_bias_linear", "moe_lrmoe",
        "moe_lrmoe_calibration")}, "num_layers": 4, **recompute})


@pytest.mark.parametrize("recompute, want", [
    (dict(), (False, 0)),
    (dict(recompute_granularity="selective", recompute_modules=["moe"]), (True, 0)),
    (dict(recompute_granularity="selective", recompute_modules=["core_attn"]), (False, 0)),
    (dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
     (False, 4)),
    (dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=3),
     (False, 3)),
    # Every other layer MoE: of the first 3 layers, layers 0 and 2 are.
    (dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=3,
          moe_layer_freq=2), (False, 2)),
    (dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=3,
          moe_layer_freq=[0, 1, 1, 1]), (False, 2)),
])
def test_recompute_of_the_moe_layers_from_megatrons_settings(tmp_path, recompute, want):
    config = _recompute_config(tmp_path, **recompute)
    assert recomputed_moe_layers(config) == want
    shape = moe_shape(config, TOKENS, 1, 2)
    assert (shape.recompute_moe, shape.full_recompute_layers) == want


def test_recompute_lowers_the_floor_a_budget_is_checked_against(tmp_path):
    # Full recompute of every layer: no layer keeps its saved buffers, so a budget below
    # the floor without recompute can hold the layers (the floor under
    # recompute).
    plain = _recompute_config(tmp_path)
    full = _recompute_config(tmp_path, recompute_granularity="full",
                             recompute_method="uniform", recompute_num_layers=1)
    floors = [budget_floor(CostModel(moe_shape(c, TOKENS, 1, 2),
                                     machine_constants(c.moe_lrmoe_calibration, "cpu")))
              for c in (plain, full)]
    assert floors[1] < floors[0]
    budget = (floors[0] + floors[1]) / 2 / GIB
    with pytest.raises(ValueError, match="below the floor"):
        check_memory_budget(dataclasses.replace(plain, moe_lrmoe_memory_budget_gb=budget),
                            2, TOKENS)
    assert check_memory_budget(dataclasses.replace(full, moe_lrmoe_memory_budget_gb=budget),
                               2, TOKENS) is None
