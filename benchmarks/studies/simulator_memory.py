"""The simulator's per-rank MoE memory against the layer measured on recorded calls.

    .venv/bin/python benchmarks/studies/simulator_memory.py RUN_DIR... [--out DIR]

What is measured and compared: ``lrmoe_studies.simulator_memory`` (its docstring),
where the tests import it; this file is its command line and hands it the gloo ranks
(the test harness's ``GlooPool``, which the package's tools do not import).
"""

from __future__ import annotations

import sys

from lrmoe_studies.simulator_memory import main
from lrmoe_testing.gloo_pool import GlooPool


def make_pool(ranks: int) -> GlooPool:
    # 16 ranks start slowly on a loaded machine (each imports Megatron).
    return GlooPool(ranks, start_timeout=1800.0)


if __name__ == "__main__":
    sys.exit(main(None, make_pool))
