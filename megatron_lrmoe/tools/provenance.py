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

    def git(cwd: Path | str, *args: str) -> str:    # rstrip: porcelain lines start with a space
        try:
            return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True,
                                  timeout=30, check=True).stdout.rstrip()
        except (OSError, subprocess.SubprocessError):
            return ""

    top = git(Path(__file__).resolve().parent, "rev-parse", "--show-toplevel")
    if not top:
        return "commit unknown"
    commit = git(top, "rev-parse", "--short", "HEAD") or "unknown"
    changed = git(top, "status", "--porcelain", "--", *paths).splitlines()
    files = ", ".join(line[3:] for line in changed)
    return f"commit {commit}" + (f" + uncommitted changes in {files}" if files else "")
