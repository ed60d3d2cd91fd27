#!/usr/bin/env bash
# Time to a fixed loss, every policy side by side (benchmarks/studies/time_to_loss.py says
# what is measured and how). Resumable: rerun the same command to continue a study.
#   bash benchmarks/studies/time_to_loss.sh                   # screen: one seed, every policy
#   bash benchmarks/studies/time_to_loss.sh --stage confirm --policies symi,lrmoe-uniform-g1.0
#   bash benchmarks/studies/time_to_loss.sh --list            # the policies and their flags
#   bash benchmarks/studies/time_to_loss.sh --stage curve --config configs/ep_study.yaml --ep 8
#       # steps to target against retained fraction (docs/benchmarks.md, "Time to a fixed loss")
#   bash benchmarks/studies/time_to_loss.sh --data-path data/manpages --out-dir ...  # 2nd corpus
set -euo pipefail
cd "$(dirname "$0")/../.."
bash scripts/setup.sh
export OMP_NUM_THREADS=1   # 2 ranks on 2 cores, one thread each (fair EP timing)
.venv/bin/python -m megatron_lrmoe.data.prepare --output-prefix data/stdlib
# The second corpus: the system-call, device, file-format, overview and
# administration manual pages of this machine image (English prose in groff markup,
# ~21 M byte tokens), for --data-path data/manpages.
.venv/bin/python -m megatron_lrmoe.data.prepare --extensions .gz --output-prefix data/manpages \
    --input /usr/share/man/man2 /usr/share/man/man4 /usr/share/man/man5 /usr/share/man/man7 \
    /usr/share/man/man8
exec .venv/bin/python benchmarks/studies/time_to_loss.py "$@"
