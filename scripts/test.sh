#!/usr/bin/env bash
# Run the test suite on CPU (bootstraps .venv first when needed).
#   bash scripts/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=1
# The suite starts many Python processes (torchrun ranks, gloo pools): let them
# share the package's compiled bytecode instead of each compiling it again.
unset PYTHONDONTWRITEBYTECODE
.venv/bin/ruff check .
exec .venv/bin/python -m pytest "$@"
