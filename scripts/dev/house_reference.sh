#!/usr/bin/env bash
# Behaviour references for changes of layout: three fixed-seed EP 2 runs of the lean
# launcher (30 steps each, 2 ranks x 1 thread), their --log-json logs written into OUTDIR.
#
#   bash scripts/dev/house_reference.sh OUTDIR                  # run all three
#   bash scripts/dev/house_reference.sh --compare BEFORE AFTER  # equal logs? (exit 1 if not)
#
# Runs: `lrmoe` (popularity placement, uniform selection, backward capacity factor 0.75),
# `memory_aware` (memory-aware placement, an `auto` budget under --device-memory-gb 0.17
# and a committed calibration, so that the placement does not depend on timings) and
# `megatron` (Megatron's own MoE layer); and one simulator projection
# (qwen3-30b-a3b-8xh100, 3 steps, the planner's host time fixed at 0.1 ms). A comparison
# takes every logged field but timings and the planner's own time, and the projection's
# figures (its `context` and `policies`). Needs .venv and the demo's corpus (data/stdlib.*).
set -euo pipefail
cd "$(dirname "$0")/../.."

if [[ "${1:-}" == "--compare" ]]; then
  before=$2 after=$3 status=0
  for run in lrmoe memory_aware megatron; do
    if .venv/bin/python - "$before/$run.jsonl" "$after/$run.jsonl" <<'EOF'
import json, sys
skip = ("time", "-s", "tokens-per-sec", "planner")
def fields(path):
    return [{k: v for k, v in json.loads(line).items() if not any(t in k for t in skip)}
            for line in open(path)]
a, b = fields(sys.argv[1]), fields(sys.argv[2])
sys.exit(0 if a == b and a else 1)
EOF
    then echo "$run: equal ($(wc -l < "$after/$run.jsonl") steps)"
    else echo "$run: DIFFERENT"; status=1
    fi
  done
  if .venv/bin/python - "$before/projection.json" "$after/projection.json" <<'EOF'
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:])
sys.exit(0 if [a[k] for k in ("context", "policies")] == [b[k] for k in ("context", "policies")]
         else 1)
EOF
  then echo "projection: equal"
  else echo "projection: DIFFERENT"; status=1
  fi
  exit $status
fi

out=${1:?usage: house_reference.sh OUTDIR | --compare BEFORE AFTER}
mkdir -p "$out"
[[ -f data/stdlib.bin ]] || .venv/bin/python -m megatron_lrmoe.data.prepare --output-prefix data/stdlib
common=(--config configs/tiny_moe.yaml --data-path "$PWD/data/stdlib"
        --data-cache-path "$out/cache" --train-iters 30 --lr-warmup-iters 5 --log-interval 1
        --eval-interval 1000 --seed 1234 --no-progress-bar)
lrmoe=(--moe-lrmoe --moe-lrmoe-selection uniform --moe-lrmoe-bwd-capacity-factor 0.75
       --moe-lrmoe-log-interval 1)
declare -A runs=(
  [lrmoe]="${lrmoe[*]} --moe-lrmoe-placement popularity"
  [memory_aware]="${lrmoe[*]} --moe-lrmoe-placement memory-aware --moe-lrmoe-memory-budget-gb auto
                  --device-memory-gb 0.17
                  --moe-lrmoe-calibration benchmarks/results/calibration_cpu_h384_f1024.json"
  [megatron]=""
)
for run in lrmoe memory_aware megatron; do
  # shellcheck disable=SC2086  # the run's flags split on purpose
  OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc-per-node 2 --master-port 29533 \
    -m megatron_lrmoe.launcher.pretrain "${common[@]}" ${runs[$run]} \
    --log-json "$out/$run.jsonl" > "$out/$run.log" 2>&1
  echo "$run: $(wc -l < "$out/$run.jsonl") steps logged ($out/$run.log)"
done
rm -rf "$out/cache"
OMP_NUM_THREADS=1 .venv/bin/python -m lrmoe_studies.projections \
  --preset qwen3-30b-a3b-8xh100 --steps 3 --planner-ms 0.1 --largest-limit 0 \
  --out "$out/projection" > "$out/projection.log" 2>&1
mv "$out/projection/projections_qwen3-30b-a3b-8xh100.json" "$out/projection.json"
rm -rf "$out/projection"
echo "projection: $out/projection.json"
