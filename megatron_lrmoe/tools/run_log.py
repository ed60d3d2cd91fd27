"""Run logs: the launcher's JSON-lines ``--log-json``, stored gzip-compressed once the
run is finished.

A run writes its ``log.jsonl`` plain, one line per logged step; the study drivers
compress it to ``log.jsonl.gz`` when the run is done (``compress``), so finished runs
stay small in the repository. Readers name the plain path and get the same text either
way: ``stored`` finds the form that exists, and ``read_text`` decompresses a file that
starts with gzip's magic bytes (whatever its name).
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

__all__ = ["compress", "read_records", "read_text", "stored"]

SUFFIX = ".gz"
_GZIP_MAGIC = b"\x1f\x8b"


def stored(path: str | os.PathLike) -> Path:
    """The file holding the log named ``path``: ``path`` itself if it exists, else its
    compressed form ``path.gz`` if that exists, else ``path`` (a reader's error names it)."""
    path = Path(path)
    packed = path.with_name(path.name + SUFFIX)
    return packed if not path.exists() and packed.exists() else path


def read_text(path: str | os.PathLike) -> str:
    """The log's text, decompressed where it is stored compressed."""
    data = stored(path).read_bytes()
    return (gzip.decompress(data) if data[:2] == _GZIP_MAGIC else data).decode()


def read_records(path: str | os.PathLike) -> list[dict]:
    """The log's records, one per non-blank line."""
    return [json.loads(line) for line in read_text(path).splitlines() if line.strip()]


def compress(path: str | os.PathLike) -> Path:
    """Store the plain log ``path`` as ``path.gz`` and remove the plain file; returns the
    stored file (a no-op where there is no plain log). The bytes depend on the text only
    (no name or time in the gzip header), so recompressing a log changes nothing."""
    path = Path(path)
    if not path.exists() or path.name.endswith(SUFFIX):
        return stored(path)
    packed = path.with_name(path.name + SUFFIX)
    tmp = packed.with_name(packed.name + ".tmp")
    tmp.write_bytes(gzip.compress(path.read_bytes(), compresslevel=9, mtime=0))
    os.replace(tmp, packed)     # a half-written file never stands for the log
    path.unlink()
    return packed
