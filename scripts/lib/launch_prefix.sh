# shellcheck shell=bash
# The launcher prefix both launch bodies share (scripts/megatron_lm_launch.sh,
# scripts/bridge_launch.sh; sourced, defines functions only): one torchrun per node;
# SLURM's srun starts those torchruns on every node.

# lrmoe_launch_prefix: set the array LAUNCH to the command that starts GPUS_PER_NODE
# processes on each of NNODES nodes (LAUNCHER torchrun or srun; default srun inside a
# multi-node SLURM job). Reads NNODES, GPUS_PER_NODE, MODEL_NAME, DRY_RUN, MASTER_ADDR,
# MASTER_PORT, RDZV_ID; calls the caller's `die` on a setting it cannot use.
# shellcheck disable=SC2034  # LAUNCH is this function's output, read by the caller
lrmoe_launch_prefix() {
  local default_launcher
  if [ -n "${SLURM_JOB_ID:-}" ] && [ "$NNODES" -gt 1 ]; then default_launcher=srun; else default_launcher=torchrun; fi
  LAUNCHER=${LAUNCHER:-$default_launcher}
  MASTER_PORT=${MASTER_PORT:-29500}
  RDZV_ID=${RDZV_ID:-${SLURM_JOB_ID:-lrmoe-$MODEL_NAME}}
  case "$LAUNCHER" in
    torchrun)
      if [ "$NNODES" -eq 1 ]; then
        LAUNCH=(torchrun --standalone --nnodes 1 --nproc-per-node "$GPUS_PER_NODE")
      else
        [ -n "${MASTER_ADDR:-}" ] || [ "$DRY_RUN" = 1 ] \
          || die "multi-node torchrun: set MASTER_ADDR (a host all nodes reach) and run this on every node"
        LAUNCH=(torchrun --nnodes "$NNODES" --nproc-per-node "$GPUS_PER_NODE"
                --rdzv-backend c10d --rdzv-endpoint "${MASTER_ADDR:-\$MASTER_ADDR}:$MASTER_PORT"
                --rdzv-id "$RDZV_ID")
      fi
      ;;
    srun)
      if [ -z "${MASTER_ADDR:-}" ]; then
        if [ -n "${SLURM_JOB_NODELIST:-}" ]; then
          MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
        else
          [ "$DRY_RUN" = 1 ] || die "LAUNCHER=srun needs a SLURM allocation (sbatch/salloc)"
          MASTER_ADDR="\$MASTER_ADDR"
        fi
      fi
      LAUNCH=(srun --nodes "$NNODES" --ntasks-per-node 1 --kill-on-bad-exit=1
              torchrun --nnodes "$NNODES" --nproc-per-node "$GPUS_PER_NODE"
              --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$RDZV_ID")
      ;;
    *) die "LAUNCHER must be torchrun or srun, got $LAUNCHER" ;;
  esac
}
