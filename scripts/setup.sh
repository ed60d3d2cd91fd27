#!/usr/bin/env bash
# Idempotent environment bootstrap for megatron-lrmoe.
#
#   bash scripts/setup.sh            # .venv (Python 3.12) with requirements/lock.txt:
#                                    # megatron-core 0.19.2, torch 2.13.0 (its CUDA build,
#                                    # which runs on CPU machines too), hash-checked;
#                                    # then requirements/bridge.txt: Megatron-Bridge 0.6.2
#                                    # and what it imports, hash-checked, --no-deps
#   LRMOE_GPU=1 bash scripts/setup.sh
#                                    # GPU: .venv that sees the machine's CUDA torch
#                                    # (--system-site-packages), nothing of torch pinned;
#                                    # requirements/bridge.txt as above
#
# Then installs the package in editable mode, which compiles megatron_lrmoe._kernels
# against the torch in the environment: the CPU backend, plus the CUDA one when torch
# is a CUDA build and nvcc is found (for TORCH_CUDA_ARCH_LIST, default 9.0 when no GPU
# is visible); and the workshop (workshop/: the studies and the test harness), editable,
# which the product's wheel leaves out. A second run with nothing changed only checks
# and returns.
set -euo pipefail
cd "$(dirname "$0")/.."

# Python 3.12: $PYTHON, else python3.12 or python3 on PATH, else a pyenv 3.12.
is_py312() { "$1" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; }
if [ -z "${PYTHON:-}" ]; then
  for candidate in python3.12 python3 ~/.pyenv/versions/3.12*/bin/python3.12; do
    if command -v "$candidate" >/dev/null 2>&1 && is_py312 "$candidate"; then
      PYTHON=$candidate; break
    fi
  done
fi
if [ -z "${PYTHON:-}" ] || ! is_py312 "$PYTHON"; then
  echo "error: Python 3.12 is required (megatron-core 0.19 needs >= 3.12; the lock is" \
       "for 3.12); set PYTHON=/path/to/python3.12" >&2
  exit 2
fi

if [ -x .venv/bin/python ] && ! is_py312 .venv/bin/python; then
  echo "setup: .venv is not Python 3.12 (an environment of an earlier pin); making it anew"
  rm -rf .venv
fi
if [ ! -x .venv/bin/python ]; then
  if [ "${LRMOE_GPU:-0}" = 1 ]; then
    "$PYTHON" -m venv --system-site-packages .venv
  else
    "$PYTHON" -m venv .venv
  fi
fi
PY=.venv/bin/python

# Everything that decides what gets installed or compiled.
fingerprint=$(cat requirements/*.txt setup.py pyproject.toml workshop/pyproject.toml kernels/* \
  2>/dev/null | sha256sum | cut -c1-16)
stamp=.venv/.lrmoe-setup-${LRMOE_GPU:-0}
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$fingerprint" ] \
   && "$PY" -c 'import torch, megatron_lrmoe._kernels, lrmoe_studies, lrmoe_testing' 2>/dev/null; then
  exit 0
fi

echo "setup: installing into .venv (this happens once; later runs reuse it)"
if [ "${LRMOE_GPU:-0}" = 1 ]; then
  if ! "$PY" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())'; then
    echo "error: LRMOE_GPU=1 but no CUDA torch is visible; install your CUDA build of torch" \
         "(e.g. from your cluster's container) before running setup" >&2
    exit 2
  fi
  "$PY" -m pip install -q --upgrade pip setuptools wheel pybind11 ninja
  deps=(-e ".[dev]")
else
  "$PY" -m pip install -q --require-hashes -r requirements/lock.txt
  deps=(--no-deps -e .)   # the lock holds every dependency and the dev tools
fi
# Megatron-Bridge's declared requirements do not resolve from the registry; the file holds
# Bridge and exactly what it imports (its header says why and how to regenerate it).
"$PY" -m pip install -q --no-deps --require-hashes -r requirements/bridge.txt
if [ -z "${TORCH_CUDA_ARCH_LIST:-}" ] \
   && ! "$PY" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
  # No GPU to read the architecture from: build for Hopper (H100/H200).
  export TORCH_CUDA_ARCH_LIST=9.0
fi
# torch takes CUDA_HOME from nvcc's folder, wrong for a wrapper on PATH
# (/usr/local/bin/nvcc): ask nvcc for its toolkit (scripts/lib/cuda_home.sh).
# shellcheck source=scripts/lib/cuda_home.sh
source scripts/lib/cuda_home.sh
lrmoe_export_cuda_home "setup: "
# --no-build-isolation: compile against the torch installed above, never a second one.
"$PY" -m pip install -q --no-build-isolation "${deps[@]}"
"$PY" -m pip install -q --no-build-isolation --no-deps -e workshop
"$PY" -c 'import torch, megatron_lrmoe._kernels' || { echo "error: kernel extension did not build" >&2; exit 1; }
echo "$fingerprint" > "$stamp"
echo "setup: done ($("$PY" -W ignore -c 'import torch; from megatron.core import package_info as m; print("torch", torch.__version__, "megatron-core", m.__shortversion__)'))"
