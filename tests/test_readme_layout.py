"""README's layout table against the tree: every path it names exists, and every
subpackage of the package is named (a map that says what is true now)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _layout_paths() -> list[str]:
    text = (ROOT / "README.md").read_text()
    table = text.split("## Layout", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    # The first cell of each row: one or more backticked paths.
    return [p for row in rows for p in re.findall(r"`([^`]+)`", row.split(" | ")[0])]


def test_every_path_in_the_layout_table_exists():
    paths = _layout_paths()
    assert paths
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert not missing, missing


def test_every_package_directory_is_in_the_layout_table():
    named = {p.rstrip("/") for p in _layout_paths()}
    package = ROOT / "megatron_lrmoe"
    subpackages = {f"megatron_lrmoe/{d.name}" for d in package.iterdir()
                   if d.is_dir() and (d / "__init__.py").exists()}
    assert subpackages <= named, sorted(subpackages - named)
