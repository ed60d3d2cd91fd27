"""Every repository path cited in code, docs and tests exists.

A citation is a token with a slash and a file suffix (``layer/region.py``,
``docs/design.md``, ``benchmarks/results/bench_planner.md``) in a doc, a script, a config,
or a Python file's comments and docstrings (its other strings are data: the paths a test
creates, a file it reads). It resolves against the
repository root, the package (``megatron_lrmoe/``: the docs name its modules by role,
``planning/planner.py``), or the citing file's folder. Not checked: the recorded outputs
under ``benchmarks/results`` (they cite what existed when they were made), paths of other
projects (``megatron/core/...``, ``src/megatron/bridge/...``, torch's), and paths a run
creates (``runs/``, the corpus under ``data/``, checkpoints, folders a command is given,
placeholders in capitals).
Every ``docs/*.md`` cited must exist, whatever the suffix rules say.
"""

from __future__ import annotations

import ast
import io
import re
import subprocess
import tokenize
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "megatron_lrmoe"
SCANNED = {".py", ".md", ".sh", ".yaml", ".yml", ".cpp", ".cu", ".h", ".cuh", ".toml", ".cfg",
           ".txt"}
SUFFIXES = ("py", "md", "sh", "yaml", "yml", "json", "jsonl", "cpp", "cu", "h", "cuh", "txt",
            "toml", "patch", "npz", "png", "csv")
TOKEN = re.compile(r"(?<![\w./$<{-])((?:\.\./)?[A-Za-z0-9_.-]+(?:/[A-Za-z0-9_.-]+)+\.(?:"
                   + "|".join(SUFFIXES) + r"))(?![\w/])")
# First components of paths that are not this repository's files: other projects'
# sources, and what runs, builds and users create.
FOREIGN = {"megatron", "src", "torch", "aten", "ATen", "c10", "include", "numpy",
           "transformer_engine", "apex", "site-packages", "nvidia_resiliency_ext",
           "transformers", "examples", "lib", "usr", "tmp", "runs", "ckpt", "checkpoints",
           "build", "dist", ".venv", "venv", "out", "wheels", "hf_cache", "cache", "logs"}


def _tracked() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [ROOT / line for line in out.splitlines()
            if Path(line).suffix in SCANNED and not line.startswith("benchmarks/results/")]


def _resolves(token: str, citing: Path) -> bool:
    candidates = [ROOT / token, PACKAGE / token, ROOT / "workshop" / token, citing.parent / token]
    return any(c.exists() for c in candidates)


def _skipped(token: str) -> bool:
    first = token.split("/")[0]
    if first in FOREIGN or first == ".." or first.isupper():
        return True
    # The corpus a run prepares (data/stdlib.*) is not the package's data/ folder.
    return first == "data" and not token.endswith(".py")


def _prose(path: Path, text: str) -> list[tuple[int, str]]:
    """(line number, text) of what may cite: all of a non-Python file; a Python file's
    comments and docstrings."""
    if path.suffix != ".py":
        return list(enumerate(text.splitlines(), start=1))
    out = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(
        io.StringIO(text).readline) if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                    and isinstance(body[0].value.value, str)):
                first = body[0].value.lineno
                out += [(first + k, line)
                        for k, line in enumerate(body[0].value.value.splitlines())]
    return out


def _prose_lines() -> Iterator[tuple[Path, int, str]]:
    """(file, line number, text) of every line that may cite, in every tracked file."""
    for path in _tracked():
        try:
            text = path.read_text()
        except (UnicodeDecodeError, FileNotFoundError):
            continue
        for number, line in sorted(_prose(path, text)):
            yield path, number, line


def missing_citations() -> list[str]:
    """``file:line: token`` for each cited path that does not exist."""
    out = []
    for path, number, line in _prose_lines():
        for match in TOKEN.finditer(line):
            token = match.group(1)
            if (token.startswith("docs/") or not _skipped(token)) and not _resolves(token, path):
                out.append(f"{path.relative_to(ROOT)}:{number}: {token}")
    return out


def test_every_cited_path_exists():
    missing = missing_citations()
    assert not missing, "cited paths that do not exist:\n" + "\n".join(missing)


def test_the_check_sees_a_missing_citation(tmp_path):
    citing = tmp_path / "note.md"
    assert not _resolves("docs/no_such_page.md", citing)
    assert _resolves("docs/design.md", citing) and _resolves("planning/planner.py", citing)
    assert TOKEN.findall("see docs/lrmoe.md and layer/region.py, not megatron/core/x.py") == [
        "docs/lrmoe.md", "layer/region.py", "megatron/core/x.py"]
    assert _skipped("megatron/core/transformer/moe/moe_layer.py") and _skipped("SAVE/x.txt")
    assert not _skipped("docs/lrmoe.md")
    code = '''"""Module doc citing docs/lrmoe.md."""\nx = "notes/data.txt"  # see layer/nope.py\n'''
    cited = [token for _, line in _prose(Path("m.py"), code) for token in TOKEN.findall(line)]
    assert sorted(cited) == ["docs/lrmoe.md", "layer/nope.py"]   # not the data string


ISSUE_NUMBER = re.compile(r"\b(?:issue|item)s? ?#?\d+", re.IGNORECASE)


def test_no_issue_numbers_in_code_or_docs():
    """Code and docs say what is true; which issue asked for it lives in git."""
    found = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
             for path, number, line in _prose_lines() if ISSUE_NUMBER.search(line)]
    assert not found, "issue numbers in code or docs:\n" + "\n".join(found)
    assert ISSUE_NUMBER.search("as item 9 said") and not ISSUE_NUMBER.search("issues show")
