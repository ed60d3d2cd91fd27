"""Where the studies find the repository's files: they run from a checkout (the
workshop is installed editable from it), unlike the package, which reads none."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
"""The repository: workshop/lrmoe_studies/ is two levels below it."""
RESULTS = ROOT / "benchmarks" / "results"
STEPS_TO_TARGET_FILE = RESULTS / "time_to_loss" / "h384_f1024_mb4" / "steps_to_target.json"
"""The time-to-loss study's steps to the loss target per policy and seed (EP 2, the
h384_f1024_mb4 shape), which the projections scale by (``simulate --steps-to-target``)."""
