"""The memory account from a config and an entry point's args, and
``--moe-lrmoe-memory-budget-gb auto`` (integration/planner_inputs.py; docs/design.md,
"Memory budget")."""

from __future__ import annotations

import types

import pytest
import torch

from megatron_lrmoe.config.transformer_config import (
    LRMoEMLATransformerConfig,
    LRMoETransformerConfig,
)
from megatron_lrmoe.integration.planner_inputs import (
    GIB,
    allocator_check,
    check_memory_budget,
    device_memory_bytes,
    memory_account,
    moe_shape,
    resolve_memory_budget,
    run_shape,
)
from megatron_lrmoe.options.lrmoe import (
    AUTO,
    LRMoEConfigError,
    check_memory_budget_gb,
    memory_budget_gb,
    option,
)
from megatron_lrmoe.planning.cost_model import CostModel
from megatron_lrmoe.planning.machine import MachineConstants
from megatron_lrmoe.planning.plan_types import budget_floor

CONFIG = dict(num_layers=2, hidden_size=64, num_attention_heads=2, num_moe_experts=4,
              moe_router_topk=2, moe_token_dispatcher_type="alltoall", add_bias_linear=False,
              moe_lrmoe=True, expert_model_parallel_size=2, bf16=True,
              params_dtype=torch.bfloat16, moe_ffn_hidden_size=64)


def _args(**changes) -> types.SimpleNamespace:
    args = dict(seq_length=32, micro_batch_size=2, tensor_model_parallel_size=1,
                sequence_parallel=False, data_parallel_size=2, optimizer="adam",
                use_distributed_optimizer=False, untie_embeddings_and_output_weights=True,
                position_embedding_type="rope", max_position_embeddings=32,
                transformer_impl="local")
    args.update(changes)
    return types.SimpleNamespace(**args)


def _need(config, tokens: int = 64) -> tuple[float, float]:
    cost = CostModel(moe_shape(config, tokens, 1),
                     MachineConstants(gemm_flops_per_s=1.0, alltoall_bytes_per_s=1.0))
    return budget_floor(cost), cost.balanced_dropless_need()


def test_the_flag_takes_gib_or_auto():
    assert option("moe_lrmoe_memory_budget_gb").arg_type is memory_budget_gb
    assert memory_budget_gb("auto") == memory_budget_gb(" AUTO ") == AUTO
    assert memory_budget_gb("2.5") == 2.5
    with pytest.raises(ValueError):
        memory_budget_gb("lots")
    assert check_memory_budget_gb(AUTO) is None and check_memory_budget_gb(1.0) is None
    assert "or auto" in check_memory_budget_gb(-1.0)


def test_a_config_takes_gib_not_auto():
    with pytest.raises(LRMoEConfigError) as err:
        LRMoETransformerConfig(**dict(CONFIG, moe_lrmoe_memory_budget_gb=AUTO))
    assert str(err.value).startswith("--moe-lrmoe-memory-budget-gb: auto is resolved")
    assert LRMoETransformerConfig(**dict(CONFIG, moe_lrmoe_memory_budget_gb=2.0))


def test_run_shape_reads_config_and_args():
    config = LRMoETransformerConfig(**CONFIG)
    shape = run_shape(config, _args(), vocab_size=128)
    assert (shape.param_bytes, shape.grad_bytes) == (2, 4)   # the launcher's fp32 main grads
    assert shape.moe_layers == 2 and shape.expert_parallel == 2 and shape.data_parallel == 2
    assert not shape.tied_embeddings and not shape.learned_positions
    megatron_lm = run_shape(config, _args(accumulate_allreduce_grads_in_fp32=False), 128)
    assert megatron_lm.grad_bytes == 2
    assert run_shape(config, _args(use_distributed_optimizer=True), 128).distributed_optimizer


def test_context_parallelism_counts_each_ranks_sequence_shard():
    """CP 2 (Megatron-LM's args count DP without it): the account's tokens, the MoE part
    and ``auto`` all follow the rank's S / CP tokens; ``auto`` is not refused."""
    config = LRMoETransformerConfig(**CONFIG, context_parallel_size=2)
    args = _args(context_parallel_size=2, data_parallel_size=1)
    shape = run_shape(config, args, vocab_size=128)
    assert (shape.context_parallel, shape.data_parallel, shape.tokens) == (2, 1, 32)
    account = memory_account(config, args, 128, device_bytes=GIB)
    assert account.moe == _need(config, tokens=32)[1] < _need(config)[1]
    whole = memory_account(LRMoETransformerConfig(**CONFIG), _args(data_parallel_size=1), 128,
                           device_bytes=GIB)
    assert account.activations < whole.activations and account.weights == whole.weights
    budget = resolve_memory_budget(account, config, args)
    assert budget == pytest.approx((GIB - account.outside_moe) / GIB)


def test_account_moe_part_is_what_the_planner_is_sized_with():
    config = LRMoETransformerConfig(**CONFIG)
    account = memory_account(config, _args(), 128, device_bytes=GIB)
    assert account.moe == _need(config)[1]
    assert account.device == GIB
    assert account.weights > 0 and account.optimizer > 0 and account.activations > 0


def test_auto_resolves_to_the_device_less_the_rest():
    config = LRMoETransformerConfig(**CONFIG)
    account = memory_account(config, _args(), 128, device_bytes=GIB)
    budget = resolve_memory_budget(account, config, _args())
    assert budget == pytest.approx((GIB - account.outside_moe) / GIB)
    assert budget * GIB >= _need(config)[0]


def test_auto_refuses_below_the_floor_naming_both_flags():
    config = LRMoETransformerConfig(**CONFIG)
    floor = _need(config)[0]
    probe = memory_account(config, _args(), 128, device_bytes=GIB)
    device = probe.outside_moe + 0.5 * floor
    account = memory_account(config, _args(), 128, device_bytes=device)
    with pytest.raises(ValueError) as err:
        resolve_memory_budget(account, config, _args())
    text = str(err.value)
    assert "--moe-lrmoe-memory-budget-gb auto" in text and "--device-memory-gb" in text
    assert "below the floor" in text
    # Just at the floor, it starts.
    at_floor = memory_account(config, _args(), 128, device_bytes=probe.outside_moe + floor)
    assert resolve_memory_budget(at_floor, config, _args()) * GIB == pytest.approx(floor)


def test_auto_needs_a_device_size():
    config = LRMoETransformerConfig(**CONFIG)
    account = memory_account(config, _args(), 128, device_bytes=None)
    with pytest.raises(ValueError, match="give --device-memory-gb"):
        resolve_memory_budget(account, config, _args())


def test_auto_is_refused_for_mla_and_a_budget_in_gib_works():
    """The account counts standard attention: for multi-latent attention ``auto`` is
    refused naming the flags, and a budget in GiB passes the start-up check."""
    mla = dict(q_lora_rank=32, kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8,
               v_head_dim=16)
    config = LRMoEMLATransformerConfig(**CONFIG, **mla)
    account = memory_account(config, _args(), 128, device_bytes=GIB)
    with pytest.raises(ValueError) as err:
        resolve_memory_budget(account, config, _args())
    text = str(err.value)
    assert text.startswith("--moe-lrmoe-memory-budget-gb auto: the memory account counts "
                           "standard attention's")
    assert "--multi-latent-attention" in text and "give the budget in GiB" in text
    fixed = LRMoEMLATransformerConfig(**CONFIG, **mla, moe_lrmoe_memory_budget_gb=1.0)
    assert check_memory_budget(fixed, 2, 64, 1, "cpu", 2).startswith(
        "--moe-lrmoe-memory-budget-gb 1: at balanced routing")


def test_device_size_from_the_flag_or_cuda():
    assert device_memory_bytes(40) == 40 * GIB
    if not torch.cuda.is_available():
        assert device_memory_bytes(None) is None


def test_allocator_check_line():
    config = LRMoETransformerConfig(**CONFIG)
    account = memory_account(config, _args(), 128, device_bytes=GIB)
    low = allocator_check(account, account.total * 0.5, GIB / 2)
    assert "allocator peak" in low and "-" in low and "account is low" not in low
    high = allocator_check(account, account.total * 2, GIB / 2)
    assert "the account is low" in high
    assert "exceeds the device size" in allocator_check(account, 2 * GIB, None)
