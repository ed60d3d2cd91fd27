"""The routing regime of the EP 8 / EP 16 study model: tokens per call, hot-rank load.

    .venv/bin/python benchmarks/studies/ep_regime.py record --ep 16    # ~4 min (shared 2 cores)
    .venv/bin/python benchmarks/studies/ep_regime.py record --ep 8     # ~2.5 min
    .venv/bin/python benchmarks/studies/ep_regime.py table             # seconds

What is measured and how: ``lrmoe_studies.ep_regime`` (its docstring), where the
tests import it; this file is its command line.
"""

from __future__ import annotations

import sys

from lrmoe_studies.ep_regime import main

if __name__ == "__main__":
    sys.exit(main())
