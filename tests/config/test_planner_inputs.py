"""The start-up budget check (``check_memory_budget``): one rule, ``budget_floor``
(docs/design.md, "Memory budget")."""

from __future__ import annotations

import json
import re

import pytest

from megatron_lrmoe.config.planner_inputs import (
    GIB,
    check_memory_budget,
    machine_constants,
    moe_shape,
)
from megatron_lrmoe.config.transformer_config import LRMoETransformerConfig
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
