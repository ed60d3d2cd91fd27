#!/usr/bin/env bash
# Run the test suite on CPU (bootstraps .venv first when needed).
#   bash scripts/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=1
.venv/bin/ruff check .
exec .venv/bin/python -m pytest "$@"
