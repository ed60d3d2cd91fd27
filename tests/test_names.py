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
