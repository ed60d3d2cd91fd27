"""Scripts and tests share code through the package, not through each other.

Code that more than one script (or a test) needs lives in ``megatron_lrmoe`` or, for the
studies and the test harness, in the workshop's ``lrmoe_studies`` and ``lrmoe_testing``,
all installed (the workshop editable); no file under ``benchmarks/``, ``scripts/``,
``tests/`` or ``workshop/`` puts a directory on the module search path
to reach a sibling script, nor imports a script by its bare module name (which works
only while the importer happens to run from the script's directory). Every Python file
is parsed with ``ast`` (nothing is imported), so strings and comments never count.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("benchmarks", "scripts", "tests", "workshop")
SCRIPT_DIRS = ("benchmarks", "scripts")
# Recorded results are data, not code.
SKIPPED = (ROOT / "benchmarks" / "results",)

# Files that may change the search path -> why. An entry whose file no longer does is
# stale and fails the test too (remove it).
ALLOWED: dict[str, str] = {
    "scripts/pretrain_gpt_lrmoe.py": (
        "the Megatron-LM wrapper runs from a source tree without the package installed "
        "(next to a Megatron-LM checkout): it puts the repository root, not a sibling "
        "script, on the path so that `import megatron_lrmoe` resolves"),
    "workshop/lrmoe_testing/gloo_pool.py": (
        "a pool worker imports the caller's task by module name from the caller's search "
        "path (a test module under tests/), which the worker process did not start with"),
}

_PATH_METHODS = {"insert", "append", "extend"}


def _python_files(top: str) -> list[Path]:
    return sorted(p for p in (ROOT / top).rglob("*.py")
                  if not any(p.is_relative_to(s) for s in SKIPPED))


def _is_sys_path(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "path"
            and isinstance(node.value, ast.Name) and node.value.id == "sys")


def _changes_path(node: ast.AST) -> bool:
    """Does ``node`` add to the module search path: ``sys.path.insert/append/extend``,
    an assignment into ``sys.path`` (``sys.path[:0] = ...``, ``sys.path += ...``), or
    pytest's ``monkeypatch.syspath_prepend``?"""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        return node.func.attr == "syspath_prepend" or (
            node.func.attr in _PATH_METHODS and _is_sys_path(node.func.value))
    if isinstance(node, ast.AugAssign):
        return _is_sys_path(node.target)
    if isinstance(node, ast.Assign):
        return any(isinstance(t, ast.Subscript) and _is_sys_path(t.value) for t in node.targets)
    return False


def _path_changes(tree: ast.AST) -> list[int]:
    """Lines of ``tree`` that add to the module search path."""
    return sorted(node.lineno for node in ast.walk(tree) if _changes_path(node))


def _script_modules() -> set[str]:
    """Bare module names the scripts would have if imported by name."""
    return {p.stem for top in SCRIPT_DIRS for p in _python_files(top)
            if p.stem != "__init__"}


def _script_imports(tree: ast.AST, scripts: set[str]) -> list[tuple[int, str]]:
    """(line, name) of every absolute import of a script's bare module name, including
    ``importlib.import_module("name")`` and ``__import__("name")``."""
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [node.module]
        elif isinstance(node, ast.Call) and node.args and isinstance(
                node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            func = node.func
            dynamic = (isinstance(func, ast.Attribute) and func.attr == "import_module") or (
                isinstance(func, ast.Name) and func.id in ("__import__", "import_module"))
            if dynamic:
                names = [node.args[0].value]
        found += [(node.lineno, n) for n in names if n.split(".")[0] in scripts]
    return found


def test_no_file_puts_a_sibling_on_sys_path():
    offenders, used = [], set()
    for top in SCANNED:
        for path in _python_files(top):
            rel = path.relative_to(ROOT).as_posix()
            lines = _path_changes(ast.parse(path.read_text(), filename=rel))
            if not lines:
                continue
            if rel in ALLOWED:
                used.add(rel)
                continue
            offenders += [f"{rel}:{line}" for line in lines]
    assert not offenders, (
        "sys.path changed to reach sibling code; move the shared code into "
        "megatron_lrmoe (benchmark helpers: megatron_lrmoe/tools/) and import it from "
        "there: " + ", ".join(offenders))
    stale = sorted(set(ALLOWED) - used)
    assert not stale, f"ALLOWED entries that no longer change sys.path: {stale}"


def test_no_file_imports_a_script_by_module_name():
    scripts = _script_modules()
    offenders = []
    for top in SCANNED:
        for path in _python_files(top):
            rel = path.relative_to(ROOT).as_posix()
            offenders += [f"{rel}:{line} imports {name!r}" for line, name in
                          _script_imports(ast.parse(path.read_text(), filename=rel), scripts)]
    assert not offenders, (
        "a script imported as a module (it resolves only from the script's own "
        "directory); import the shared code from megatron_lrmoe instead: "
        + ", ".join(offenders))


def test_the_checks_see_what_they_forbid():
    # The detectors on hand-written sources, so a silent parser change cannot pass
    # everything.
    source = "\n".join([
        "import sys",
        "sys.path.insert(0, 'benchmarks')",
        "sys.path.append('x')",
        "sys.path[:0] = ['y']",
        "sys.path += ['z']",
        "monkeypatch.syspath_prepend('w')",
        "text = 'sys.path.insert(0, here)'",   # a string: not a change
    ])
    assert _path_changes(ast.parse(source)) == [2, 3, 4, 5, 6]
    imports = "\n".join([
        "import bench_moe_layer as bench",
        "from time_to_loss import policies",
        "import importlib",
        "rb = importlib.import_module('retention_bias')",
        "from lrmoe_studies import time_to_loss",   # the package's: fine
        "from .time_to_loss import x",                      # relative: fine
    ])
    scripts = {"bench_moe_layer", "time_to_loss", "retention_bias"}
    assert [n for _, n in _script_imports(ast.parse(imports), scripts)] == [
        "bench_moe_layer", "time_to_loss", "retention_bias"]
    assert {"bench_moe_layer", "time_to_loss", "pretrain_gpt_lrmoe"} <= _script_modules()
