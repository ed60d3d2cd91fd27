#!/usr/bin/env bash
# Download the wheels scripts/gpu_check.sh installs on a GPU machine that cannot reach a
# package registry: what that machine's image lacks, for CPython 3.12 on x86-64 Linux,
# binary wheels only, no dependency resolution (the list is the resolution).
#
#   bash scripts/dev/prepare_gpu_wheels.sh                 # megatron-core into wheels/
#   bash scripts/dev/prepare_gpu_wheels.sh DIR [NAME...]   # more packages, e.g. numpy
#
# The project's GPU image (torch 2.11.0+cu130, numpy, packaging, setuptools, ninja, PyYAML,
# pytest, hypothesis, nvcc 13.0, compute-sanitizer) lacks only megatron-core 0.19.2: one
# cp312 wheel (it ships a compiled helper) of 2.4 MB, whose requirements (torch, numpy,
# packaging) the image has. Name more packages for an image that lacks them; gpu_check.sh
# installs a carried wheel only where its package is missing. Versions come from
# requirements/lock.txt (one pin per package). Then carry DIR beside the checkout and run
#   WHEELS=DIR bash scripts/gpu_check.sh OUTDIR
set -euo pipefail
cd "$(dirname "$0")/../.."
DEST=${1:-wheels}
shift || true
PIP=${PIP:-.venv/bin/pip}
[[ -x $PIP ]] || PIP="python3 -m pip"
mkdir -p "$DEST"

NAMES=(megatron-core "$@")
WHEELS=()
for name in "${NAMES[@]}"; do
  pin=$(grep -iE "^${name}==[^ ]+" requirements/lock.txt | cut -d' ' -f1)
  [[ -n $pin ]] || { echo "error: $name is not pinned in requirements/lock.txt" >&2; exit 2; }
  WHEELS+=("$pin")
done
# shellcheck disable=SC2086  # PIP may be "python3 -m pip"
$PIP download --dest "$DEST" --only-binary=:all: --no-deps --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any "${WHEELS[@]}"
ls -l "$DEST"
du -sh "$DEST"
