#!/usr/bin/env bash
# GLM-4.5-Air (106B-A12B) pretraining with LRMoE on Megatron-LM (core_v0.19.0); model and
# training values from configs/glm45_air.yaml (the same file the lean launcher reads).
#
#   MEGATRON_LM=/path/to/Megatron-LM DATA_PATH=/data/corpus_text_document NNODES=4 \
#     MASTER_ADDR=node0 bash scripts/glm45_air_lrmoe.sh [--dry-run] [more pretrain_gpt.py flags]
#   LRMOE=0 ...                                   # Megatron baseline, same everything else
#   sbatch --nodes 4 --gpus-per-node 8 --wrap "bash scripts/glm45_air_lrmoe.sh"   # SLURM (srun)
#   MTP=1 ...                                     # GLM's one multi-token-prediction layer
# Every other variable is described in scripts/megatron_lm_launch.sh.
#
# Parallel layout (LAYOUT=80gb|40gb). Estimates from parameter counts, not measurements:
# 106.7 B parameters = 99.6 B in routed experts (45 layers x 128 x 17.3 M) + 0.8 B shared
# experts + 5.0 B attention (96 heads of 128, QKV bias) + 0.1 B dense FFN + 1.2 B embedding
# and output. bf16 weights alone are 213 GB, weights + fp32 gradients 640 GB: one 8 x 80 GB
# node cannot train it, whatever the layout. Adam's 12 B/param is offloaded to host memory
# (megatron_lm_launch.sh). The layouts assume no activation recompute (LRMoE accepts
# Megatron's: docs/design.md, "Recompute").
# * 8 x 80 GB nodes (LAYOUT=80gb, 4 nodes = 32 GPUs): TP=2 with sequence parallelism, PP=2
#   (23 layers per stage), EP=16 (8 experts per GPU), DP 8. Per GPU: experts 3.1 B + the
#   rest 1.8 B -> 30 GB of weights and gradients, activations (seq 4096, micro-batch 1, up to
#   two in flight) roughly 25-35 GB: about 55-65 GB. Host: ~60 GB of Adam state per GPU.
# * 8 x 40 GB nodes (LAYOUT=40gb, 8 nodes = 64 GPUs): TP=4 with sequence parallelism, PP=2,
#   EP=32 (4 experts per GPU), DP 8. Per GPU: experts 1.6 B + the rest 0.9 B -> 15 GB,
#   activations roughly 15-20 GB: about 30-35 GB.
set -euo pipefail
MODEL_NAME=glm45_air
CONFIG=configs/glm45_air.yaml
TOKENIZER_DEFAULT=zai-org/GLM-4.5-Air
L80_NNODES=4 L80_TP=2 L80_PP=2 L80_EP=16
L40_NNODES=8 L40_TP=4 L40_PP=2 L40_EP=32
# Megatron-LM-only model flags (not in the lean launcher).
MODEL_EXTRA=(--attention-softmax-in-fp32)
if [ "${MTP:-0}" = 1 ]; then
  MODEL_EXTRA+=(--mtp-num-layers 1 --mtp-loss-scaling-factor 0.3)
fi
# shellcheck source=scripts/megatron_lm_launch.sh
source "$(dirname "${BASH_SOURCE[0]}")/megatron_lm_launch.sh"
