#!/usr/bin/env bash
# Qwen3-30B-A3B pretraining with LRMoE on Megatron-LM (core_v0.19.0); model and training values
# from configs/qwen3_30b_a3b.yaml (the same file the lean launcher reads).
#
#   MEGATRON_LM=/path/to/Megatron-LM DATA_PATH=/data/corpus_text_document \
#     bash scripts/qwen3_30b_a3b_lrmoe.sh [--dry-run] [more pretrain_gpt.py flags]
#   LRMOE=0 bash scripts/qwen3_30b_a3b_lrmoe.sh ...       # Megatron baseline, same everything else
#   NNODES=2 MASTER_ADDR=node0 bash scripts/qwen3_30b_a3b_lrmoe.sh ...   # on every node (torchrun)
#   sbatch --nodes 2 --gpus-per-node 8 --wrap "bash scripts/qwen3_30b_a3b_lrmoe.sh"   # SLURM (srun)
# Every variable is described in scripts/megatron_lm_launch.sh.
#
# Parallel layout (LAYOUT=80gb|40gb). Estimates from parameter counts, not measurements:
# 30.5 B parameters = 29.0 B in experts (48 layers x 128 x 4.7 M) + 1.5 B elsewhere
# (attention 0.9 B, embedding and output 0.6 B). Training state per parameter: bf16 weight
# 2 B + fp32 gradient 4 B on the GPU; Adam's 12 B/param offloaded to host memory (see
# megatron_lm_launch.sh; keeping it on the GPU would need 46 GB per GPU at EP=8 on one node,
# since the expert optimizer state is sharded only over expert-data-parallel ranks).
# The layouts assume no activation recompute (LRMoE accepts Megatron's: docs/design.md,
# "Recompute"); with it, activations shrink and smaller layouts may fit (not measured).
# * 8 x 80 GB (LAYOUT=80gb, one node): TP=1 PP=1 EP=8 (16 experts per GPU).
#   Per GPU: experts 3.6 B + the rest 1.5 B = 5.2 B params -> 31 GB of weights and gradients,
#   activations at seq 4096 / micro-batch 1 roughly 25-30 GB: about 60 GB, with room for
#   LRMoE's and the all-to-all buffers. Host: ~45 GB of Adam state per GPU (~370 GB per node).
# * 8 x 40 GB (LAYOUT=40gb, two such nodes = 16 GPUs): TP=2 with sequence parallelism, PP=2,
#   EP=8 (DP 4). Per GPU: 24 layers, experts 1.8 B + rest 0.4 B -> 13 GB, activations halved
#   by PP and (outside the experts) by SP, two micro-batches in flight on the first stage:
#   about 30-35 GB. One 8 x 40 GB node does not fit at seq 4096 without recompute; there,
#   add recompute (e.g. --recompute-granularity full --recompute-method uniform
#   --recompute-num-layers 1; not measured), or use LAYOUT=40gb NNODES=1 PP=1 TP=2 with
#   --seq-length 2048 as a smaller run.
set -euo pipefail
MODEL_NAME=qwen3_30b_a3b
CONFIG=configs/qwen3_30b_a3b.yaml
TOKENIZER_DEFAULT=Qwen/Qwen3-30B-A3B
L80_NNODES=1 L80_TP=1 L80_PP=1 L80_EP=8
L40_NNODES=2 L40_TP=2 L40_PP=2 L40_EP=8
# Megatron-LM-only model flags (not in the lean launcher): from Megatron-LM's Qwen3 examples.
MODEL_EXTRA=(--attention-softmax-in-fp32)
# shellcheck source=scripts/megatron_lm_launch.sh
source "$(dirname "${BASH_SOURCE[0]}")/megatron_lm_launch.sh"
