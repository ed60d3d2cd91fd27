#!/usr/bin/env bash
# Qwen3-30B-A3B pretraining with LRMoE through Megatron-Bridge's own recipe and pretrain:
# qwen3_30b_a3b_pretrain_8gpu_h100_bf16_config (one node of 8 H100: TP 4, PP 2, EP 4; mock
# data unless overridden). The recipe asks for DeepEP (the flex dispatcher) on Hopper, which
# LRMoE replaces with its all-to-all region: ADAPT=1 (default) sets it and prints each change.
#
#   bash scripts/qwen3_30b_a3b_bridge_lrmoe.sh [--dry-run] [overrides...]
#   bash scripts/qwen3_30b_a3b_bridge_lrmoe.sh model.moe_lrmoe_bwd_capacity_factor=0.75
#   LRMOE=0 bash scripts/qwen3_30b_a3b_bridge_lrmoe.sh ...     # Megatron's MoE layer, same recipe
# Variables: scripts/bridge_launch.sh.
set -euo pipefail
MODEL_NAME=qwen3_30b_a3b
RECIPE=qwen3_30b_a3b_pretrain_8gpu_h100_bf16_config
L_NNODES=1
# shellcheck source=scripts/bridge_launch.sh
source "$(dirname "${BASH_SOURCE[0]}")/bridge_launch.sh"
