#!/usr/bin/env bash
# GLM-4.5-Air (106B-A12B) pretraining with LRMoE through Megatron-Bridge:
# glm45_air_106b_pretrain_config (32 H100 = 4 nodes: TP 1, PP 4, EP 8; one MTP layer, which
# LRMoE converts too). The recipe overlaps the shared expert inside Megatron's dispatcher and
# fuses its permutation, which the LRMoE region replaces: ADAPT=1 (default) turns both off
# and prints each change.
#
#   MASTER_ADDR=node0 bash scripts/glm45_air_bridge_lrmoe.sh [overrides...]   # on every node
#   bash scripts/glm45_air_bridge_lrmoe.sh --dry-run
# Variables: scripts/bridge_launch.sh.
set -euo pipefail
MODEL_NAME=glm45_air
RECIPE=glm45_air_106b_pretrain_config
L_NNODES=4
# shellcheck source=scripts/bridge_launch.sh
source "$(dirname "${BASH_SOURCE[0]}")/bridge_launch.sh"
