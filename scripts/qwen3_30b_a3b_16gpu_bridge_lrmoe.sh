#!/usr/bin/env bash
# Qwen3-30B-A3B pretraining with LRMoE through Megatron-Bridge: qwen3_30b_a3b_pretrain_config,
# Bridge's alias of qwen3_30b_a3b_pretrain_16gpu_h100_bf16_config (two nodes of 8 H100: EP 16).
# The recipe sets HybridEP and Transformer Engine CUDA graphs of the router, which LRMoE cannot
# run: ADAPT=1 (default) turns them off (the all-to-all region, no CUDA graphs) and prints each
# change; ADAPT=0 refuses them by name.
#
#   MASTER_ADDR=node0 bash scripts/qwen3_30b_a3b_16gpu_bridge_lrmoe.sh   # on both nodes
#   sbatch --nodes 2 --gpus-per-node 8 --wrap "bash scripts/qwen3_30b_a3b_16gpu_bridge_lrmoe.sh"
#   bash scripts/qwen3_30b_a3b_16gpu_bridge_lrmoe.sh --dry-run
# Variables: scripts/bridge_launch.sh.
set -euo pipefail
MODEL_NAME=qwen3_30b_a3b_16gpu
RECIPE=qwen3_30b_a3b_pretrain_config
L_NNODES=2
# shellcheck source=scripts/bridge_launch.sh
source "$(dirname "${BASH_SOURCE[0]}")/bridge_launch.sh"
