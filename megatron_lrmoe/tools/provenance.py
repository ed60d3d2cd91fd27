"""Which code a recorded result came from (benchmarks and reports write it beside the
command that produced them)."""

from __future__ import annotations

import subprocess
from pathlib import Path

__all__ = ["code_version"]

ROOT = Path(__file__).resolve().parents[2]


CODE_PATHS = ("megatron_lrmoe", "kernels", "scripts", "benchmarks", ":(exclude)benchmarks/results")


def code_version(paths: tuple[str, ...] = CODE_PATHS) -> str:
    """The checkout measured: the commit, and the files under ``paths`` (git pathspecs)
    changed since (none when the results come from a clean commit)."""

    def git(*args: str) -> str:    # rstrip: porcelain lines start with a space
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                                  timeout=30, check=True).stdout.rstrip()
        except (OSError, subprocess.SubprocessError):
            return ""

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    changed = git("status", "--porcelain", "--", *paths).splitlines()
    files = ", ".join(line[3:] for line in changed)
    return f"commit {commit}" + (f" + uncommitted changes in {files}" if files else "")
