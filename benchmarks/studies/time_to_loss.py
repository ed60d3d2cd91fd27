"""Time to a fixed loss: Megatron dropless, Megatron capacity drop, SYMI-style, LRMoE.

    bash benchmarks/studies/time_to_loss.sh                        # the screen (one seed)
    bash benchmarks/studies/time_to_loss.sh --stage confirm --policies lrmoe-uniform-g1,...
    bash benchmarks/studies/time_to_loss.sh --stage ci --out-dir /tmp/ttl   # a few minutes
    bash benchmarks/studies/time_to_loss.sh --stage curve --config configs/ep_study.yaml --ep 8

The study's driver is ``lrmoe_studies.time_to_loss`` (what is measured and how:
its docstring; the policies: ``lrmoe_studies.time_to_loss_policies``), where the
tests and ``benchmarks/profile_moe_layer.py`` import it; this file is its command line,
which ``time_to_loss.sh`` runs once the corpora are prepared.
"""

from __future__ import annotations

import sys

from lrmoe_studies.time_to_loss import main

if __name__ == "__main__":
    sys.exit(main())
