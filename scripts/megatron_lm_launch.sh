# shellcheck shell=bash
# Shared body of scripts/qwen3_30b_a3b_lrmoe.sh and scripts/glm45_air_lrmoe.sh (sourced,
# not run): builds the Megatron-LM pretrain_gpt.py command and runs or prints it.
#
# The calling script sets MODEL_NAME, CONFIG (a flat flag YAML of configs/), TOKENIZER_DEFAULT,
# the layout defaults L_NNODES L_TP L_PP L_EP for LAYOUT=80gb|40gb, and the array MODEL_EXTRA
# (Megatron-LM-only model flags); the user's command-line arguments are "$@".
#
# Variables (all optional unless noted):
#   MEGATRON_LM      Megatron-LM checkout at core_v0.19.0 (required to run)
#   DATA_PATH        Megatron indexed dataset prefix(es) (required to run, or MOCK_DATA=1)
#   TOKENIZER_MODEL  HF tokenizer name or path (default: the model's)
#   CHECKPOINT_DIR   --save directory (default runs/$MODEL_NAME[-baseline]/checkpoints)
#   LOAD_DIR         --load directory (default CHECKPOINT_DIR: resumes when it holds one)
#   LOG_DIR          TensorBoard directory (default runs/$MODEL_NAME[-baseline]/tensorboard)
#   LRMOE            1 (default): LRMoE; 0: the Megatron baseline (no --moe-lrmoe* flag)
#   ENTRY            wrapper (default): scripts/pretrain_gpt_lrmoe.py, no patch needed;
#                    patched: $MEGATRON_LM/pretrain_gpt.py after scripts/apply_megatron_patch.sh
#   LAYOUT           80gb (default) or 40gb: parallel layout preset (see the calling script)
#   NNODES GPUS_PER_NODE TP PP EP   override the preset (GPUS_PER_NODE default 8)
#   LAUNCHER         torchrun (default outside SLURM) or srun (default inside an allocation)
#   MASTER_ADDR MASTER_PORT RDZV_ID rendezvous of multi-node torchrun (run the same command
#                    on every node); under srun MASTER_ADDR is the allocation's first node
#   PYTHON           Python with megatron_lrmoe importable (default python)
# Flags after the script name go to pretrain_gpt.py last (they override); --dry-run prints
# the full command instead of running it.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python}
LRMOE=${LRMOE:-1}
ENTRY=${ENTRY:-wrapper}
LAYOUT=${LAYOUT:-80gb}

DRY_RUN=0
USER_ARGS=()
for arg in "$@"; do
  if [ "$arg" = "--dry-run" ]; then DRY_RUN=1; else USER_ARGS+=("$arg"); fi
done

die() { echo "error: $*" >&2; exit 2; }

case "$LRMOE" in 0|1) ;; *) die "LRMOE must be 0 or 1, got $LRMOE" ;; esac
case "$LAYOUT" in 80gb|40gb) ;; *) die "LAYOUT must be 80gb or 40gb, got $LAYOUT" ;; esac
if [ "$LAYOUT" = 40gb ]; then
  L_NNODES=${L40_NNODES:?} L_TP=${L40_TP:?} L_PP=${L40_PP:?} L_EP=${L40_EP:?}
else
  L_NNODES=${L80_NNODES:?} L_TP=${L80_TP:?} L_PP=${L80_PP:?} L_EP=${L80_EP:?}
fi
NNODES=${NNODES:-${SLURM_NNODES:-$L_NNODES}}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
TP=${TP:-$L_TP}
PP=${PP:-$L_PP}
EP=${EP:-$L_EP}

MLM=${MEGATRON_LM:-}
if [ -z "$MLM" ]; then
  [ "$DRY_RUN" = 1 ] || die "set MEGATRON_LM=/path/to/Megatron-LM (a core_v0.19.0 checkout)"
  MLM="\$MEGATRON_LM"
fi
if [ -z "${DATA_PATH:-}" ] && [ "${MOCK_DATA:-0}" != 1 ] && [ "$DRY_RUN" = 0 ]; then
  die "set DATA_PATH=/path/to/prefix_text_document (Megatron indexed data), or MOCK_DATA=1"
fi

RUN_NAME=$MODEL_NAME
[ "$LRMOE" = 1 ] || RUN_NAME=$MODEL_NAME-baseline
CHECKPOINT_DIR=${CHECKPOINT_DIR:-$REPO/runs/$RUN_NAME/checkpoints}
LOAD_DIR=${LOAD_DIR:-$CHECKPOINT_DIR}
LOG_DIR=${LOG_DIR:-$REPO/runs/$RUN_NAME/tensorboard}
TOKENIZER_MODEL=${TOKENIZER_MODEL:-$TOKENIZER_DEFAULT}

# Model, MoE, LRMoE and training values: the same YAML the lean launcher reads.
config_args=(flags "$REPO/$CONFIG")
[ "$LRMOE" = 1 ] || config_args+=(--no-lrmoe)
mapfile -t MODEL_FLAGS < <(PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" \
  "$PYTHON" -m megatron_lrmoe.integration.megatron_lm "${config_args[@]}")
[ "${#MODEL_FLAGS[@]}" -gt 0 ] || die "could not read $CONFIG with $PYTHON (is PyYAML installed?)"

PARALLEL_FLAGS=(
  --tensor-model-parallel-size "$TP"
  --pipeline-model-parallel-size "$PP"
  --expert-model-parallel-size "$EP"
  --expert-tensor-parallel-size 1     # LRMoE's region needs ETP 1 (Megatron's default is TP)
  --use-distributed-optimizer
  --overlap-grad-reduce
  # Adam state (fp32 master + 2 moments, 12 B/param) in host memory: without it neither
  # model fits the layouts of the calling scripts (needs TE's fused Adam).
  --use-precision-aware-optimizer
  --optimizer-cpu-offload
  --optimizer-offload-fraction 1.0
)
[ "$TP" -gt 1 ] && PARALLEL_FLAGS+=(--sequence-parallel)   # MoE with TP needs SP

RUN_FLAGS=(
  --bf16
  --transformer-impl transformer_engine
  --tokenizer-type HuggingFaceTokenizer
  --tokenizer-model "$TOKENIZER_MODEL"
  --split "99,1,0"
  --save "$CHECKPOINT_DIR"
  --load "$LOAD_DIR"
  --save-interval 1000
  --ckpt-format torch_dist
  --log-interval 10
  --eval-interval 1000
  --eval-iters 10
  --tensorboard-dir "$LOG_DIR"
  --log-throughput
  --distributed-timeout-minutes 60
)
if [ "${MOCK_DATA:-0}" = 1 ]; then
  RUN_FLAGS+=(--mock-data)
else
  # Several prefixes (optionally weighted) separated by spaces.
  read -r -a data_prefixes <<< "${DATA_PATH:-\$DATA_PATH}"
  RUN_FLAGS+=(--data-path "${data_prefixes[@]}")
fi

if [ "$ENTRY" = patched ]; then
  ENTRY_SCRIPT=$MLM/pretrain_gpt.py
elif [ "$ENTRY" = wrapper ]; then
  ENTRY_SCRIPT=$REPO/scripts/pretrain_gpt_lrmoe.py
else
  die "ENTRY must be wrapper or patched, got $ENTRY"
fi

# Launcher: one torchrun per node (scripts/lib/launch_prefix.sh).
# shellcheck source=scripts/lib/launch_prefix.sh
source "$REPO/scripts/lib/launch_prefix.sh"
lrmoe_launch_prefix

CMD=("${LAUNCH[@]}" "$ENTRY_SCRIPT" "${MODEL_FLAGS[@]}" "${MODEL_EXTRA[@]}" "${PARALLEL_FLAGS[@]}"
     "${RUN_FLAGS[@]}" "${USER_ARGS[@]}")

# Megatron-LM's TP/SP communication overlap needs one CUDA connection; the wrapper finds the
# checkout through MEGATRON_LM, the patched pretrain_gpt.py finds megatron_lrmoe on PYTHONPATH.
ENV_VARS=(CUDA_DEVICE_MAX_CONNECTIONS=1 "MEGATRON_LM=$MLM"
          "PYTHONPATH=$MLM:$REPO${PYTHONPATH:+:$PYTHONPATH}")

echo "# $MODEL_NAME: LRMOE=$LRMOE LAYOUT=$LAYOUT nodes=$NNODES x $GPUS_PER_NODE GPUs," \
     "TP=$TP PP=$PP EP=$EP, entry=$ENTRY, launcher=$LAUNCHER" >&2
if [ "$DRY_RUN" = 1 ]; then
  printf '%q ' env "${ENV_VARS[@]}" "${CMD[@]}"
  echo
  exit 0
fi
mkdir -p "$CHECKPOINT_DIR" "$LOG_DIR"
exec env "${ENV_VARS[@]}" "${CMD[@]}"
