"""Stored run files: the launcher's JSON-lines ``--log-json`` and a run's ``stdout.txt``,
kept LZMA-compressed once the run is finished.

A run writes its ``log.jsonl`` and ``stdout.txt`` plain, appending as it trains; the
study drivers compress them to ``log.jsonl.xz`` and ``stdout.txt.xz`` when the run is
done (``compress``), so finished runs stay small in the repository. Readers name the
plain path and get the same text either way: ``stored`` finds the form that exists, and
``read_text`` decompresses a file that starts with the xz magic bytes (whatever its name).
"""

from __future__ import annotations

import json
import lzma
import os
from pathlib import Path

__all__ = ["compress", "read_records", "read_text", "stored"]

SUFFIX = ".xz"
_XZ_MAGIC = b"\xfd7zXZ\x00"
# LZMA at its densest: these files are written once and read rarely; a run's log packs
# in well under a second at this preset.
_PRESET = 9 | lzma.PRESET_EXTREME


def stored(path: str | os.PathLike) -> Path:
    """The file holding the text named ``path``: ``path`` itself if it exists, else its
    compressed form ``path.xz`` if that exists, else ``path`` (a reader's error names it)."""
    path = Path(path)
    packed = path.with_name(path.name + SUFFIX)
    return packed if not path.exists() and packed.exists() else path


def read_text(path: str | os.PathLike) -> str:
    """The file's text, decompressed where it is stored compressed."""
    data = stored(path).read_bytes()
    return (lzma.decompress(data) if data[:len(_XZ_MAGIC)] == _XZ_MAGIC else data).decode()


def read_records(path: str | os.PathLike) -> list[dict]:
    """The log's records, one per non-blank line."""
    return [json.loads(line) for line in read_text(path).splitlines() if line.strip()]


def compress(path: str | os.PathLike) -> Path:
    """Store the plain file ``path`` as ``path.xz`` and remove the plain file; returns the
    stored file (a no-op where there is no plain file). The bytes depend on the text only
    (the xz container holds no name or time), so recompressing a file changes nothing."""
    path = Path(path)
    if not path.exists() or path.name.endswith(SUFFIX):
        return stored(path)
    packed = path.with_name(path.name + SUFFIX)
    tmp = packed.with_name(packed.name + ".tmp")
    tmp.write_bytes(lzma.compress(path.read_bytes(), preset=_PRESET))
    os.replace(tmp, packed)     # a half-written file never stands for the text
    path.unlink()
    return packed
