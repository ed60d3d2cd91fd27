#!/usr/bin/env bash
# Download the wheels scripts/gpu_check.sh installs on a GPU machine that cannot reach a
# package registry (Python 3.12, its own CUDA torch, nothing else): megatron-core 0.19.2
# (a cp312 wheel: it ships a compiled helper) and the packages the check imports, for CPython 3.12 on x86-64 Linux, binary wheels
# only, no dependency resolution (the list is the resolution; torch is the machine's).
#
#   bash scripts/dev/prepare_gpu_wheels.sh            # into wheels/ (git-ignored)
#   bash scripts/dev/prepare_gpu_wheels.sh DIR
#
# Then carry the folder to the GPU machine and run  WHEELS=wheels bash scripts/gpu_check.sh.
# Versions are read from requirements/lock.txt (one pin per package). About 25 MB in all.
set -euo pipefail
cd "$(dirname "$0")/../.."
DEST=${1:-wheels}
PIP=${PIP:-.venv/bin/pip}
[[ -x $PIP ]] || PIP="python3 -m pip"
mkdir -p "$DEST"

# megatron-core and its run-time requirements (numpy, packaging); setuptools and ninja to
# build the kernels in place; PyYAML (the launcher's config module, imported by the
# layer's option table users); pytest, its plugins and hypothesis for the kernel tests.
NAMES=(megatron-core numpy packaging setuptools ninja PyYAML pytest pluggy iniconfig Pygments
       hypothesis sortedcontainers)
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
