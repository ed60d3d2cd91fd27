"""The largest micro-batch each policy trains with on a device, measured.

    .venv/bin/python benchmarks/studies/largest_micro_batch.py --device-gib 0.4391 \\
        --out-dir benchmarks/results/largest_micro_batch/d2

What is measured and how: ``lrmoe_studies.largest_micro_batch`` (its docstring),
where the tests import it; this file is its command line.
"""

from __future__ import annotations

import sys

from lrmoe_studies.largest_micro_batch import main

if __name__ == "__main__":
    sys.exit(main())
