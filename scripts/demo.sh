#!/usr/bin/env bash
# The CPU demo: a tiny GPT-MoE (configs/tiny_moe.yaml) trained with Megatron-Core and
# the LRMoE layer (--moe-lrmoe with its defaults: backward capacity 1.0, uniform selection), expert parallel over 2 processes
# (gloo), on the CPython standard library sources.
#   bash scripts/demo.sh [extra launcher flags, e.g. --train-iters 50]
#                                    # (the LR warm-up is 10% of --train-iters: the config's
#                                    # --lr-warmup-fraction; --lr-warmup-iters N overrides it)
#   LRMOE=0 bash scripts/demo.sh     # the same run with Megatron's own MoE layer
# Bootstraps .venv and prepares the corpus (both once), trains for a few minutes, then
# writes the run's report (PNGs under runs/demo/report/) and prints its files.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=1   # one thread per rank: 2 ranks on 2 cores (see README, timing)

.venv/bin/python -m megatron_lrmoe.data.prepare --output-prefix data/stdlib

run=runs/demo
lrmoe=(--moe-lrmoe)
if [ "${LRMOE:-1}" = 0 ]; then lrmoe=(); run=runs/demo_megatron; fi
mkdir -p "$run"
# megatron_lrmoe.launcher checks the flags first (a refused one: one error line, exit 2),
# then runs torchrun ... -m megatron_lrmoe.launcher.pretrain with them.
.venv/bin/python -m megatron_lrmoe.launcher --nproc-per-node 2 --master-port "${MASTER_PORT:-29512}" \
  --config configs/tiny_moe.yaml \
  --data-path data/stdlib --data-cache-path data/cache \
  --tensorboard-dir "$run/tensorboard" --log-json "$run/log.jsonl" "${lrmoe[@]}" "$@"

# The run's report: loss, MoE time, LRMoE statistics and routed load as PNGs.
echo "report of $run (python -m megatron_lrmoe.tools.report):"
.venv/bin/python -m megatron_lrmoe.tools.report "$run" --out "$run/report"
