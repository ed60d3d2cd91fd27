# shellcheck shell=bash
# Shared body of the Megatron-Bridge launch scripts (scripts/*_bridge_lrmoe.sh; sourced, not
# run): runs `python -m megatron_lrmoe.bridge_launcher` (a Bridge recipe with LRMoE, trained by
# Bridge's own pretrain) under torchrun or srun, or prints the command.
#
# The calling script sets RECIPE (a recipe function of megatron.bridge.recipes),
# MODEL_NAME and the default NNODES (L_NNODES); the user's arguments are "$@".
#
# Variables (all optional):
#   LRMOE            1 (default): LRMoE; 0: the same adapted recipe with Megatron's MoE layer
#   ADAPT            1 (default): set the recipe settings LRMoE cannot run to what it needs
#                    (the launcher prints each change); 0: refuse them instead
#   CHECKPOINT_DIR   checkpoint.save and checkpoint.load (default runs/$RUN_NAME/checkpoints:
#                    a second launch resumes)
#   LOG_DIR          logger.tensorboard_dir (default runs/$RUN_NAME/tensorboard)
#   NNODES GPUS_PER_NODE   nodes (default: the recipe's layout) and GPUs per node (8)
#   LAUNCHER         torchrun (default outside SLURM) or srun (default inside an allocation)
#   MASTER_ADDR MASTER_PORT RDZV_ID   rendezvous of multi-node torchrun (run the same command
#                    on every node); under srun MASTER_ADDR is the allocation's first node
#   PYTHON           Python with megatron_lrmoe and megatron.bridge importable (default python)
# Arguments after the script name are Hydra-style overrides of the recipe, applied last
# (model.moe_lrmoe_bwd_capacity_factor=0.75 train.train_iters=1000 ...); --config-file FILE
# merges a YAML before them. --dry-run runs the launcher's own --dry-run here with PYTHON
# (the final config built and checked, printed on stderr; needs megatron.bridge and the
# models' Hub config.json, from the Hub or its cache), then prints the command instead of
# running it.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python}
LRMOE=${LRMOE:-1}
ADAPT=${ADAPT:-1}

die() { echo "error: $*" >&2; exit 2; }

DRY_RUN=0
USER_ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --config-file) [ $# -ge 2 ] || die "--config-file needs a file"; USER_ARGS+=("$1" "$2"); shift ;;
    *=*) USER_ARGS+=("$1") ;;
    *) die "$1: expected --dry-run, --config-file FILE or an override KEY=VALUE" ;;
  esac
  shift
done

case "$LRMOE" in 0|1) ;; *) die "LRMOE must be 0 or 1, got $LRMOE" ;; esac
case "$ADAPT" in 0|1) ;; *) die "ADAPT must be 0 or 1, got $ADAPT" ;; esac
NNODES=${NNODES:-${SLURM_NNODES:-${L_NNODES:?}}}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}

RUN_NAME=$MODEL_NAME-bridge
[ "$LRMOE" = 1 ] || RUN_NAME=$RUN_NAME-baseline
CHECKPOINT_DIR=${CHECKPOINT_DIR:-$REPO/runs/$RUN_NAME/checkpoints}
LOG_DIR=${LOG_DIR:-$REPO/runs/$RUN_NAME/tensorboard}

LAUNCHER_FLAGS=(--recipe "$RECIPE")
[ "$ADAPT" = 1 ] && LAUNCHER_FLAGS+=(--adapt)
[ "$LRMOE" = 1 ] || LAUNCHER_FLAGS+=(--no-lrmoe)
RUN_OVERRIDES=(
  "checkpoint.save=$CHECKPOINT_DIR"
  "checkpoint.load=$CHECKPOINT_DIR"
  "logger.tensorboard_dir=$LOG_DIR"
)

# shellcheck source=scripts/lib/launch_prefix.sh
source "$REPO/scripts/lib/launch_prefix.sh"
lrmoe_launch_prefix

CMD=("${LAUNCH[@]}" -m megatron_lrmoe.bridge_launcher "${LAUNCHER_FLAGS[@]}" "${RUN_OVERRIDES[@]}"
     "${USER_ARGS[@]}")
ENV_VARS=(CUDA_DEVICE_MAX_CONNECTIONS=1 "PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}")

echo "# $MODEL_NAME on Megatron-Bridge ($RECIPE): LRMOE=$LRMOE ADAPT=$ADAPT" \
     "nodes=$NNODES x $GPUS_PER_NODE GPUs, launcher=$LAUNCHER" >&2
cd "$REPO"
if [ "$DRY_RUN" = 1 ]; then
  # The launcher's own --dry-run, one process here: the recipe, enable_lrmoe, the YAML and
  # the overrides built and checked, not just a command printed. Its output goes to stderr,
  # so stdout stays the command alone; a refused launch exits with its status (set -e).
  env "${ENV_VARS[@]}" "$PYTHON" -m megatron_lrmoe.bridge_launcher "${LAUNCHER_FLAGS[@]}" \
      "${RUN_OVERRIDES[@]}" "${USER_ARGS[@]}" --dry-run >&2
  printf '%q ' env "${ENV_VARS[@]}" "${CMD[@]}"
  echo
  exit 0
fi
mkdir -p "$CHECKPOINT_DIR" "$LOG_DIR"
exec env "${ENV_VARS[@]}" "${CMD[@]}"
