"""Which code a recorded result came from (benchmarks and reports write it beside the
command that produced them)."""

from __future__ import annotations

import subprocess
from pathlib import Path

__all__ = ["code_version"]

CODE_PATHS = ("megatron_lrmoe", "kernels", "scripts", "workshop", "benchmarks",
              ":(exclude)benchmarks/results")
"""The checkout's code (git pathspecs from its top), results left out."""


def code_version(paths: tuple[str, ...] = CODE_PATHS) -> str:
    """The checkout measured: the commit, and the files under ``paths`` (git pathspecs,
    from the checkout's top) changed since (none when the results come from a clean
    commit). The checkout is the git work tree the package is imported from (an editable
    install); an installed package outside one gives ``commit unknown``."""

    def git(*args: str) -> str:    # rstrip: porcelain lines start with a space
        try:
            return subprocess.run(["git", *args], cwd=Path(__file__).resolve().parent,
                                  capture_output=True, text=True, timeout=30,
                                  check=True).stdout.rstrip()
        except (OSError, subprocess.SubprocessError):
            return ""

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    changed = git("status", "--porcelain", "--", *(f":(top){p}" if not p.startswith(":(")
                                                   else p.replace(":(", ":(top,", 1)
                                                   for p in paths)).splitlines()
    files = ", ".join(line[3:] for line in changed)
    return f"commit {commit}" + (f" + uncommitted changes in {files}" if files else "")
