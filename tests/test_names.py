"""Names the package defines once: a second definition under the same name is a second
meaning a reader has to tell apart (docs/decisions.md, "Layout")."""

from __future__ import annotations

import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "megatron_lrmoe"

ONCE = {
    "GIB": re.compile(r"^GIB\s*(?::[^=]+)?=", re.M),
    "machine_constants": re.compile(r"^def machine_constants\(", re.M),
}


def test_each_name_is_defined_once_in_the_package():
    for name, pattern in ONCE.items():
        where = [str(p.relative_to(PACKAGE)) for p in sorted(PACKAGE.rglob("*.py"))
                 if pattern.search(p.read_text())]
        assert len(where) == 1, (name, where)


def test_micro_batches_per_step_are_derived_in_one_place():
    """``launcher.arguments.fill_derived_args`` (``args.num_microbatches``) is the one place
    the package divides the global batch into micro-batches per step; the
    simulator's model presets (``planning/models.py``'s ``ModelSpec``), which are no flags,
    carry their own."""
    division = re.compile(r"global_batch_size\s*//\s*\(")
    where = [str(p.relative_to(PACKAGE)) for p in sorted(PACKAGE.rglob("*.py"))
             if division.search(p.read_text())]
    assert where == ["launcher/arguments.py", "planning/models.py"], where


def test_no_world_size_is_written_to_steer_a_parse():
    """The world size is an argument of every parse outside a launched rank
    (docs/decisions.md, "Launcher"): the package writes ``WORLD_SIZE`` only where it
    starts a rank the way torchrun does (a launched rank's default, the test harness's
    spawned ranks), never to steer a parse in the process itself."""
    write = re.compile(r"environ(?:\[\"WORLD_SIZE\"\]\s*=|\.setdefault\(\"WORLD_SIZE\")"
                       r"|WORLD_SIZE=str\(")
    roots = (PACKAGE, PACKAGE.parent / "benchmarks", PACKAGE.parent / "scripts")
    where = sorted(str(p.relative_to(PACKAGE.parent)) for root in roots
                   for p in root.rglob("*.py") if write.search(p.read_text()))
    assert where == ["megatron_lrmoe/integration/runtime/local_gloo.py",
                     "megatron_lrmoe/launcher/distributed.py"], where
