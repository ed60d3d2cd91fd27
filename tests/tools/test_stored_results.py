"""The repository stays light: the tracked tree (``git ls-files``, the working tree's
bytes) is at most 20 MB, and the runs under benchmarks/results are stored compacted
(``time_to_loss.compact``: logs and stdout LZMA-compressed, routing chunks in LZMA)."""

from __future__ import annotations

import os
import shutil
import subprocess
import zipfile
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 20_000_000


@pytest.fixture(scope="module")
def tracked() -> list[str]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                            check=True).stdout.decode()
    return [path for path in listed.split("\0") if path]


def test_tracked_tree_is_at_most_20_mb(tracked):
    sizes = {path: os.path.getsize(ROOT / path) for path in tracked
             if (ROOT / path).is_file()}          # a file deleted and not yet staged: gone
    total = sum(sizes.values())
    by_type = Counter()
    for path, size in sizes.items():
        by_type[Path(path).suffix or Path(path).name] += size
    heaviest = ", ".join(f"{kind} {size / 1e6:.1f} MB" for kind, size in by_type.most_common(5))
    assert total <= LIMIT, (f"the tracked tree holds {total / 1e6:.1f} MB, over "
                            f"{LIMIT / 1e6:.0f} MB ({heaviest}); store results compacted "
                            "(time_to_loss.compact, tools/figures.save_png)")


def test_stored_runs_are_compacted(tracked):
    results = [p for p in tracked if p.startswith("benchmarks/results/")]
    plain = [p for p in results if Path(p).name in ("log.jsonl", "stdout.txt")]
    assert not plain, f"run files stored plain (run_log.compress them): {plain[:5]}"
    gzipped = [p for p in results if p.endswith(".gz")]
    assert not gzipped, f"stored gzip-compressed, not LZMA (run_log.compress): {gzipped[:5]}"
    loose = []
    for path in (p for p in results if p.endswith(".npz")):
        with zipfile.ZipFile(ROOT / path) as packed:
            if any(i.compress_type != zipfile.ZIP_LZMA for i in packed.infolist()):
                loose.append(path)
    assert not loose, f"routing chunks not repacked (routing_traces.repack): {loose[:5]}"
