"""Named policies held to a device, side by side (e.g. the planner's runs at EP 16,
benchmarks/results/planner_ep16_cpu/).

    .venv/bin/python benchmarks/studies/held_runs.py --ep 16 --train-iters 60 \
        --device-gib 0.0457 --out-dir DIR --policies lrmoe-uniform-g1.0-ma,symi@slots_14

What is run and tabulated: ``lrmoe_studies.held_runs`` (its docstring), where the
tests import it; this file is its command line. The corpus: prepare it first
(``python -m megatron_lrmoe.data.prepare --output-prefix data/stdlib``).
"""

from __future__ import annotations

import sys

from lrmoe_studies.held_runs import main

if __name__ == "__main__":
    sys.exit(main())
