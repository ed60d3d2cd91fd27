"""The per-rank memory account (planning/memory_account.py) against hand-computed bytes,
written out independently of the module's formulas (docs/design.md, "Memory budget")."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_lrmoe.planning.cost_model import CostModel, MachineConstants, MoEShape
from megatron_lrmoe.planning.memory_account import (
    GIB,
    MemoryAccount,
    RunShape,
    account_line,
    auto_budget_bytes,
    memory_account,
    moe_peak,
)

# Two dense layers, H 8, F 16, 2 heads of d 4, vocabulary 32, s 4, b 2 (N = 8 tokens), fp32,
# LayerNorm with biases, linear biases, tied embeddings, unfused attention, dropouts on.
DENSE = RunShape(num_layers=2, hidden_size=8, ffn_hidden_size=16, num_attention_heads=2,
                 vocab_size=32, seq_length=4, micro_batch_size=2, param_bytes=4, grad_bytes=4)

# Parameters: per layer QKV 8 x 24 = 192, projection 8 x 8 = 64, two LayerNorms 2 x 16 = 32,
# QKV bias 24, projection bias 8 (= 320); MLP 8 x 16 + 16 x 8 = 256, biases 16 + 8 (= 280).
# Two layers 1200, word embeddings 32 x 8 = 256, final LayerNorm 16: 1472.
DENSE_PARAMS = 2 * (192 + 64 + 32 + 24 + 8 + 256 + 16 + 8) + 256 + 16
# Activations of one layer (bytes, p = 4, N = 8): attention: norm input 8*8*4 = 256, QKV
# input 256, Q 8*2*4*4 = 256, K and V 512, scores N s a (p + 1 + p) = 8*4*2*9 = 576,
# projection input 256, dropout mask 64 (= 2176); MLP: norm input 256, fc1 input 256,
# fc1 output 8*16*4 = 512, activation output 512, dropout mask 64 (= 1600).
ATTENTION, SCORES, MLP = 2176, 576, 1600
LAYER = ATTENTION + MLP
EMBEDDING = 8 * 8                               # embedding dropout mask N H
LOGITS = 2 * 8 * 8 * 4 + 8 * 32 * (4 + 4)       # final norm and output inputs, logits + softmax


def test_dense_account_by_hand():
    account = memory_account(DENSE, 0.0)
    assert DENSE_PARAMS == 1472
    assert account.weights == 1472 * 4
    assert account.gradients == 1472 * 4
    assert account.optimizer == 1472 * 8            # Adam: two fp32 moments, no master copy
    assert account.activations == 2 * LAYER + EMBEDDING + LOGITS == 10176
    assert account.moe == 0.0
    assert account.total == 1472 * 16 + 10176 == 33728


@pytest.mark.parametrize("changes,layers", [
    (dict(recompute_granularity="selective"), 2 * (LAYER - SCORES)),  # Megatron's core_attn
    (dict(recompute_granularity="selective", recompute_modules=("layernorm", "mlp")),
     # layernorm: the QKV input (a norm output) goes; mlp: the dense MLP keeps only its
     # input (the pre-MLP norm's output, recomputed too), beside the norm's input 256.
     2 * (ATTENTION - 256 + 256)),
    (dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
     2 * 256 + LAYER),              # two units' inputs + one layer rebuilt in backward
    (dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
     256 + 2 * LAYER),
    (dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
     256 + LAYER),                  # the first layer's input, the second in full
])
def test_recompute_settings(changes, layers):
    account = memory_account(dataclasses.replace(DENSE, **changes), 0.0)
    assert account.activations == layers + EMBEDDING + LOGITS
    assert account.weights == 1472 * 4          # recompute changes activations only


def test_flash_attention_saves_statistics_not_scores():
    account = memory_account(dataclasses.replace(DENSE, attention_scores_saved=False), 0.0)
    lse = 8 * 2 * 4                             # fp32 log-sum-exp per token and head
    assert account.activations == 2 * (LAYER - SCORES + lse) + EMBEDDING + LOGITS


# MoE: two MoE layers, 4 experts of F 8 (not gated), EP 2, RMSNorm, no biases, untied
# embeddings, bf16 with fp32 main grads.
MOE = RunShape(num_layers=2, hidden_size=8, ffn_hidden_size=16, num_attention_heads=2,
               vocab_size=32, seq_length=4, micro_batch_size=2, num_experts=4,
               moe_ffn_hidden_size=8, moe_layers=2, layernorm_bias=False, linear_bias=False,
               tied_embeddings=False, expert_parallel=2, data_parallel=4, param_bytes=2,
               grad_bytes=4)
# Dense: per layer QKV 192 + projection 64 + two RMSNorms 16 + router 4 x 8 = 32 (= 304);
# two layers 608, word embeddings 256, final norm 8, output layer 256: 1128.
# Expert: 2 local experts x (8 + 8) x 8 = 256 per layer: 512.
MOE_DENSE, MOE_EXPERT = 1128, 512


def test_optimizer_state_and_its_sharding():
    plain = memory_account(MOE, 0.0)
    params = MOE_DENSE + MOE_EXPERT
    assert plain.weights == params * 2
    assert plain.gradients == params * 4       # Megatron's DDP: fp32 main grads
    assert plain.optimizer == params * 12      # 2 fp32 moments + fp32 master weights
    sharded = memory_account(dataclasses.replace(MOE, distributed_optimizer=True), 0.0)
    # Dense parameters over DP = 4; experts over expert-DP = DP x TP / (EP x ETP) = 2.
    assert sharded.optimizer == 12 * (MOE_DENSE / 4 + MOE_EXPERT / 2)
    assert sharded.weights == plain.weights and sharded.gradients == plain.gradients
    sgd = memory_account(dataclasses.replace(MOE, optimizer="sgd"), 0.0)
    assert sgd.optimizer == params * (4 + 4)   # momentum + master weights
    fp16_grads = memory_account(dataclasses.replace(MOE, grad_bytes=2), 0.0)
    assert fp16_grads.gradients == params * 2


def test_moe_layers_activations_leave_the_moe_part_out():
    account = memory_account(dataclasses.replace(MOE, hidden_dropout=False,
                                                 attention_dropout=False), 0.0)
    n, h, p = 8, 8, 2
    attention = (n * h * p * 2 + n * 2 * 4 * p * 2 + 2 * n * 2 * 4 * p
                 + n * 4 * 2 * p)                           # norm in/out, Q + proj, K V, scores
    outside = attention + n * h * p                         # the pre-MLP norm's input
    logits = 2 * n * h * p + n * 32 * (p + 4)
    assert account.activations == 2 * outside + logits


def test_pipeline_stage_with_the_most_to_hold():
    shape = dataclasses.replace(DENSE, num_layers=4, pipeline_parallel=2,
                                microbatches_in_flight=2)
    account = memory_account(shape, 0.0)
    # First stage: 2 layers, word embeddings, 2 micro-batches in flight. Last stage: 2
    # layers, the final norm and its own copy of the (tied) output layer, one micro-batch
    # and the logits. The account is the larger of the two.
    layers = 2 * 600
    first = (layers + 256) * 16 + 2 * (2 * LAYER + EMBEDDING)
    last = (layers + 16 + 256) * 16 + 2 * LAYER + LOGITS
    assert account.total == max(first, last)


def _cost(**changes) -> CostModel:
    shape = MoEShape(hidden_size=8, ffn_hidden_size=8, num_experts=4, topk=2, gated=False,
                     dtype_bytes=2, tokens_per_rank=8, num_layers=2, expert_parallel_size=2)
    return CostModel(dataclasses.replace(shape, **changes),
                     MachineConstants(gemm_flops_per_s=1.0, alltoall_bytes_per_s=1.0))


def test_moe_part_is_the_balanced_dropless_need():
    cost = _cost()
    assert moe_peak(cost) == cost.balanced_dropless_need() > 0
    assert moe_peak(None) == 0.0
    account = memory_account(MOE, moe_peak(cost), device_bytes=GIB)
    assert account.moe == cost.balanced_dropless_need()
    assert account.total == account.outside_moe + account.moe


def test_auto_budget_is_the_device_less_the_rest():
    account = MemoryAccount(weights=1.0, gradients=2.0, optimizer=3.0, activations=4.0,
                            moe=5.0, device=100.0)
    assert auto_budget_bytes(account) == 90.0
    with pytest.raises(ValueError, match="device size"):
        auto_budget_bytes(dataclasses.replace(account, device=None))


def test_account_line_names_every_part():
    account = MemoryAccount(weights=GIB, gradients=2 * GIB, optimizer=0.5 * GIB,
                            activations=0.25 * GIB, moe=0.125 * GIB, device=40 * GIB)
    line = account_line(account, 36.25 * GIB, "auto")
    for part in ("weights 1.000", "gradients 2.000", "optimizer 0.500", "activations 0.250",
                 "moe 0.125", "total 3.875", "device 40.000", "MoE budget 36.250 (auto)"):
        assert part in line, line


def test_run_shape_refuses_unknown_settings():
    with pytest.raises(ValueError, match="recompute_granularity"):
        dataclasses.replace(DENSE, recompute_granularity="some")
    with pytest.raises(ValueError, match="optimizer"):
        dataclasses.replace(DENSE, optimizer="lamb")
