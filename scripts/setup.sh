#!/usr/bin/env bash
# Idempotent environment bootstrap for megatron-lrmoe.
#
#   bash scripts/setup.sh            # CPU: .venv (Python 3.11) with requirements/cpu.txt
#   LRMOE_GPU=1 bash scripts/setup.sh
#                                    # GPU: .venv that sees the machine's CUDA torch
#                                    # (--system-site-packages), nothing of torch pinned
#
# Then installs the package in editable mode, which compiles megatron_lrmoe._kernels
# against the torch in the environment (CPU backend; plus CUDA when torch has it).
# A second run with nothing changed only checks and returns.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
  echo "error: Python 3.11 is required (megatron-core 0.16.1 pin); set PYTHON=/path/to/python3.11" >&2
  exit 2
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
fingerprint=$(cat requirements/*.txt setup.py pyproject.toml kernels/* 2>/dev/null | sha256sum | cut -c1-16)
stamp=.venv/.lrmoe-setup-${LRMOE_GPU:-0}
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$fingerprint" ] \
   && "$PY" -c 'import torch, megatron_lrmoe._kernels' 2>/dev/null; then
  exit 0
fi

echo "setup: installing into .venv (this happens once; later runs reuse it)"
"$PY" -m pip install -q --upgrade pip setuptools wheel
if [ "${LRMOE_GPU:-0}" = 1 ]; then
  if ! "$PY" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())'; then
    echo "error: LRMOE_GPU=1 but no CUDA torch is visible; install your CUDA build of torch" \
         "(e.g. from your cluster's container) before running setup" >&2
    exit 2
  fi
  "$PY" -m pip install -q pybind11 ninja
else
  "$PY" -m pip install -q -r requirements/cpu.txt
fi
# --no-build-isolation: compile against the torch installed above, never a second one.
"$PY" -m pip install -q --no-build-isolation -e ".[dev]"
"$PY" -c 'import torch, megatron_lrmoe._kernels' || { echo "error: kernel extension did not build" >&2; exit 1; }
echo "$fingerprint" > "$stamp"
echo "setup: done ($("$PY" -c 'import torch, megatron.core as m; print("torch", torch.__version__, "megatron-core", m.__version__)'))"
