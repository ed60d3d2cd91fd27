"""The per-rank memory account (planning/memory_account.py) against hand-computed bytes,
written out independently of the module's formulas (docs/design.md, "Memory budget")."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from megatron_lrmoe.planning.cost_model import CostModel
from megatron_lrmoe.planning.machine import MachineConstants
from megatron_lrmoe.planning.memory_account import (
    GIB,
    DeviceOutOfMemory,
    MemoryAccount,
    RunShape,
    account_line,
    auto_budget_bytes,
    check_device,
    megatron_layer_levels,
    memory_account,
    moe_peak,
    out_of_memory_message,
    step_peak,
)
from megatron_lrmoe.planning.shapes import MoEShape

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


def test_context_parallelism_splits_every_sequence():
    """CP 2: the rank holds s b / CP = 4 tokens; the unfused scores' keys are still the
    whole sequence (s = 4). Weights and gradients do not change."""
    account = memory_account(dataclasses.replace(DENSE, context_parallel=2), 0.0)
    # One layer, N = 4: attention: norm input 4*8*4 = 128, QKV input 128, Q 4*2*4*4 = 128,
    # K and V 256, scores N s a (p + 1 + p) = 4*4*2*9 = 288, projection input 128, dropout
    # mask 32 (= 1088); MLP: norm input 128, fc1 input 128, fc1 output 4*16*4 = 256,
    # activation output 256, dropout mask 32 (= 800).
    layer = 1088 + 800
    logits = 2 * 4 * 8 * 4 + 4 * 32 * (4 + 4)
    assert account.activations == 2 * layer + 4 * 8 + logits == 5088
    assert account.weights == account.gradients == 1472 * 4


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
    # Context parallelism: dense parameters over DP x CP = 8, experts over expert-DP =
    # DP x CP x TP / (EP x ETP) = 4 (the expert grid is cut from TP x CP x DP).
    with_cp = memory_account(dataclasses.replace(MOE, distributed_optimizer=True,
                                                 context_parallel=2), 0.0)
    assert with_cp.optimizer == 12 * (MOE_DENSE / 8 + MOE_EXPERT / 4)
    sgd = memory_account(dataclasses.replace(MOE, optimizer="sgd"), 0.0)
    assert sgd.optimizer == params * (4 + 4)   # momentum + master weights
    fp16_grads = memory_account(dataclasses.replace(MOE, grad_bytes=2), 0.0)
    assert fp16_grads.gradients == params * 2


def test_expert_biases_are_counted():
    """Megatron's add_bias_linear on an MoE model: every local expert's b1 [F1] and b2 [H]
    (2 x (8 + 8) per layer here), the router's bias [E], and the attention's (QKV
    [(a + 2 g) d] = 24, projection [H] = 8) per layer."""
    plain = memory_account(MOE, 0.0)
    biased = memory_account(dataclasses.replace(MOE, linear_bias=True), 0.0)
    expert, dense = 2 * 2 * (8 + 8), 2 * (4 + 24 + 8)
    assert biased.weights - plain.weights == (expert + dense) * 2
    # Expert parameters shard over expert-DP under the distributed optimizer, dense over DP.
    sharded = [memory_account(dataclasses.replace(shape, distributed_optimizer=True), 0.0)
               for shape in (MOE, dataclasses.replace(MOE, linear_bias=True))]
    assert sharded[1].optimizer - sharded[0].optimizer == 12 * (dense / 4 + expert / 2)


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


# -----------------------------------------------------------------------------
# A run held to its device: the step's predicted peak and the out-of-memory stop
# -----------------------------------------------------------------------------


def test_step_peak_adds_each_ranks_layers_to_the_rest():
    rng = np.random.default_rng(0)
    layers = rng.uniform(0, 1e6, size=(3, 4))                  # [L, R]
    got = step_peak(123.0, layers)
    for r in range(4):
        assert got[r] == pytest.approx(123.0 + sum(layers[i, r] for i in range(3)))
    rest = np.array([1.0, 2.0, 3.0, 4.0])
    assert step_peak(rest, layers).tolist() == pytest.approx((rest + layers.sum(0)).tolist())
    assert step_peak(5.0, np.zeros((0, 2))).tolist() == [5.0, 5.0]   # a stage without MoE
    with pytest.raises(ValueError, match=r"\[L, R\]"):
        step_peak(0.0, np.zeros(4))


@pytest.mark.parametrize("capacity_factor,pad", [(None, False), (1.0, False), (0.5, True)])
def test_megatron_layer_levels_are_the_worst_micro_batch(capacity_factor, pad):
    """Brute force: each micro-batch's counts cut to the capacity C = ceil(T k / E x
    factor) by hand (or padded to exactly C), its ``MegatronMoEMemory`` levels, the most
    per rank over the micro-batches."""
    from megatron_lrmoe.planning.megatron_baseline import MegatronMoEMemory

    model = MegatronMoEMemory(_cost().shape, padded=pad)    # T 8, top-2, 4 experts, EP 2
    rng = np.random.default_rng(1)
    counts = np.stack([np.stack([rng.multinomial(16, [0.55, 0.15, 0.15, 0.15])
                                 for _ in range(2)]) for _ in range(3)])   # [M, R, E]
    saved, peak = megatron_layer_levels(model, counts, capacity_factor, pad)
    want_s, want_p = np.zeros(2), np.zeros(2)
    for m in range(3):
        routed = counts[m].astype(float)
        if capacity_factor is not None:
            capacity = math.ceil(8 * 2 / 4 * capacity_factor)
            routed = (np.full((2, 4), float(capacity)) if pad else
                      np.array([[min(v, capacity) for v in row] for row in routed]))
        s, p = model.rank_memory(routed)
        want_s, want_p = np.maximum(want_s, s), np.maximum(want_p, p)
    assert saved.tolist() == want_s.tolist() and peak.tolist() == want_p.tolist()
    assert (peak > saved).all()
    with pytest.raises(ValueError, match=r"\[M, R, E\]"):
        megatron_layer_levels(model, counts[0])


ACCOUNT = MemoryAccount(weights=GIB, gradients=GIB, optimizer=2 * GIB, activations=3 * GIB,
                        moe=0.5 * GIB, device=10 * GIB)


def test_check_device_passes_a_step_that_fits():
    check_device(7, ACCOUNT, np.array([2 * GIB, 2.5 * GIB]))
    check_device(7, ACCOUNT, np.array([3 * GIB, 3 * GIB]))            # exactly the device fits
    check_device(7, dataclasses.replace(ACCOUNT, device=None), np.array([99 * GIB]))


def test_check_device_stops_naming_the_rank_with_the_largest_need():
    with pytest.raises(DeviceOutOfMemory) as caught:
        check_device(7, ACCOUNT, np.array([3 * GIB, 5 * GIB, 4 * GIB]), lrmoe=True)
    exc = caught.value
    assert (exc.step, exc.rank, exc.need, exc.device) == (7, 1, 12 * GIB, 10 * GIB)
    assert isinstance(exc, RuntimeError)
    assert str(exc).startswith("out of memory at step 7 on rank 1: needs 12.00 GiB, the "
                               "device holds 10.00 GiB (--device-memory-gb 10); predicted "
                               "peak 12.00 GiB = weights 1.00 GiB, gradients 1.00 GiB, "
                               "optimizer 2.00 GiB, activations 3.00 GiB, MoE layers 5.00 GiB "
                               "(this step's routing); 2 of 3 ranks over, the largest need "
                               "shown. To fit: lower --micro-batch-size")
    for flag in ("--recompute-modules moe", "--moe-lrmoe-bwd-capacity-factor",
                 "--moe-lrmoe-memory-budget-gb auto", "--expert-model-parallel-size",
                 "a larger --device-memory-gb"):
        assert flag in str(exc), flag


def test_check_device_stops_on_the_allocators_peak_too():
    """CUDA: the measured peak is held to the device as well; the need is the larger."""
    moe = np.array([GIB, GIB])                                      # predicted 8 GiB: fits
    check_device(2, ACCOUNT, moe, np.array([9 * GIB, 0.0]))
    with pytest.raises(DeviceOutOfMemory) as caught:
        check_device(2, ACCOUNT, moe, np.array([9 * GIB, 10.5 * GIB]))
    exc = caught.value
    assert (exc.step, exc.rank, exc.need) == (2, 1, 10.5 * GIB)
    assert "needs 10.50 GiB" in str(exc) and "predicted peak 8.00 GiB" in str(exc)
    assert "allocator peak 10.50 GiB (torch.cuda.max_memory_allocated)" in str(exc)
    assert "1 of 2 ranks over" in str(exc)


def test_out_of_memory_message_in_mib_and_for_megatrons_layer():
    small = MemoryAccount(weights=2**20, gradients=2**20, optimizer=2**21, activations=2**22,
                          moe=1.5 * 2**20, device=0.001 * GIB)
    text = out_of_memory_message(3, 0, small)
    assert text.startswith("out of memory at step 3 on rank 0: needs 9.50 MiB, the device "
                           "holds 1.02 MiB (--device-memory-gb 0.001); predicted peak 9.50 "
                           "MiB = weights 1.00 MiB, gradients 1.00 MiB, optimizer 2.00 MiB, "
                           "activations 4.00 MiB, MoE layers 1.50 MiB (this step's routing). "
                           "To fit:"), text
    for flag in ("--micro-batch-size", "--recompute-modules moe", "--moe-lrmoe with "
                 "--moe-lrmoe-bwd-capacity-factor", "--moe-expert-capacity-factor",
                 "--device-memory-gb"):
        assert flag in text, flag
    with pytest.raises(ValueError, match="device size"):
        out_of_memory_message(1, 0, dataclasses.replace(small, device=None))
