"""The package's import graph: no cycles, the workshop (studies, test harness) stays out
of production, and the launcher's modules stay short.

Every module of ``megatron_lrmoe`` and of the workshop's packages (``lrmoe_studies``,
``lrmoe_testing``) is parsed with ``ast`` (nothing is imported), and
each import statement anywhere in it (module level, inside functions, under
``if TYPE_CHECKING:``: a cycle of type imports is still a cycle) adds an edge to the
package module it names: ``from a.b import c`` names ``a.b.c`` when that is a module,
else ``a.b``. Importing a submodule also runs its parents' ``__init__``; that is not an
edge here (``ops/__init__`` re-exporting ``ops.backend`` is no cycle with it), only a
package named on its own is.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "megatron_lrmoe"
REPO = Path(__file__).resolve().parents[1]
ROOT = REPO / PACKAGE
WORKSHOP = ("lrmoe_studies", "lrmoe_testing")
"""The workshop's packages (workshop/): above the whole product, which imports neither."""
PACKAGE_DIRS = (ROOT, *(REPO / "workshop" / w for w in WORKSHOP))

# Cycles tolerated for now (none today): frozenset of the cycle's modules -> why it is
# still there. A cycle listed here that is gone fails the test too (remove its entry).
KNOWN_CYCLES: dict[frozenset[str], str] = {}


def _module_name(path: Path, top: Path) -> str:
    parts = list(path.relative_to(top.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p, top): p for top in PACKAGE_DIRS for p in sorted(top.rglob("*.py"))}


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules that ``name`` (at ``path``) imports, anywhere in its code."""
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")
                anchor = anchor if is_package else anchor[:-1]
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                       for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:   # a name inside a module
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan),
    each as one cycle through all of its modules' order of discovery."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return components


def _path(graph: dict[str, set[str]], component: list[str]) -> str:
    """One cycle inside ``component`` as ``a -> b -> ... -> a``, for the message."""
    members = set(component)
    start = component[0]
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:   # breadth-first back to ``start``
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:
                    cycle = [start]
                    while v != start:
                        cycle.append(v)
                        v = previous[v]
                    return " -> ".join([start, *reversed(cycle[1:]), start])
                if w not in previous:
                    previous[w] = v
                    nxt.append(w)
        frontier = nxt
    return " <-> ".join(component)


def test_the_graph_sees_every_kind_of_import():
    graph = _graph()
    # A module-level import, a ``from package import module`` and a function-level one.
    assert f"{PACKAGE}.planning.placement" in graph[f"{PACKAGE}.planning.planner"]
    assert f"{PACKAGE}.ops.backend" in graph[f"{PACKAGE}.ops"]
    assert len(graph) > 40


def test_no_import_cycles():
    graph = _graph()
    found = {frozenset(c): c for c in _cycles(graph)}
    new = [c for key, c in found.items() if key not in KNOWN_CYCLES]
    assert not new, "import cycles among the package's modules:\n" + "\n".join(
        f"  {_path(graph, c)}   (modules: {', '.join(c)})" for c in new)
    gone = [sorted(key) for key in KNOWN_CYCLES if key not in found]
    assert not gone, f"known cycles no longer there (remove them from KNOWN_CYCLES): {gone}"


def test_production_code_does_not_import_the_workshop():
    graph = _graph()
    assert any(name.startswith("lrmoe_studies.") for name in graph)    # the workshop is seen
    offenders = sorted(
        f"{name} imports {target}"
        for name, targets in graph.items() if name.split(".")[0] == PACKAGE
        for target in targets if target.split(".")[0] in WORKSHOP)
    assert not offenders, "production modules import the workshop:\n  " + \
        "\n  ".join(offenders)


# What each layer may import from the package: planning stays pure (host-side values and
# the option table), the layer builds on planning and the ops, and nothing below the
# integration, the launcher and the tools reaches up into them: the integration (the
# Megatron-LM glue included) not into data or the launcher, the launcher not into the
# tools (the routing-trace format it writes is data's). megatron_privates, the module
# through which every Megatron private is touched, sits at the package root, below the
# layer that reaches Megatron's internals through it, and imports nothing of the package.
ALLOWED_IMPORTS: dict[str, tuple[str, ...]] = {
    "ops": ("ops", "_kernels"),
    "options": ("options",),
    "planning": ("planning", "options"),
    "config": ("config", "planning", "options"),
    "layer": ("layer", "config", "planning", "ops", "options", "megatron_privates"),
    "megatron_privates": (),
    "integration": ("integration", "layer", "config", "planning", "ops", "options",
                    "megatron_privates"),
    "data": ("data", "integration", "layer", "config", "planning", "ops", "options",
             "megatron_privates"),
    "launcher": ("launcher", "data", "integration", "layer", "config", "planning", "ops",
                 "options", "megatron_privates"),
}


def _allowed(target: str, prefixes: tuple[str, ...]) -> bool:
    rest = target.removeprefix(f"{PACKAGE}.")
    return target == PACKAGE or any(rest == p or rest.startswith(f"{p}.") for p in prefixes)


def test_layers_import_only_downward():
    offenders = sorted(
        f"{name} imports {target}"
        for name, targets in _graph().items()
        for layer, prefixes in ALLOWED_IMPORTS.items()
        if name.startswith(f"{PACKAGE}.{layer}.") or name == f"{PACKAGE}.{layer}"
        for target in targets
        if not _allowed(target, prefixes))
    assert not offenders, "imports against the layering:\n  " + "\n  ".join(offenders)


def test_the_layering_check_sees_an_upward_import():
    graph = _graph()
    graph[f"{PACKAGE}.planning.planner"] = {f"{PACKAGE}.layer.region"}
    bad = [t for t in graph[f"{PACKAGE}.planning.planner"]
           if not _allowed(t, ALLOWED_IMPORTS["planning"])]
    assert bad == [f"{PACKAGE}.layer.region"]


def test_megatron_privates_imports_nothing_of_the_package():
    graph = _graph()
    assert graph[f"{PACKAGE}.megatron_privates"] == set()
    # ... and the layer does reach Megatron's privates through it.
    assert f"{PACKAGE}.megatron_privates" in graph[f"{PACKAGE}.layer.experts"]
    graph[f"{PACKAGE}.megatron_privates"] = {f"{PACKAGE}.config.flags"}
    bad = [t for t in graph[f"{PACKAGE}.megatron_privates"]
           if not _allowed(t, ALLOWED_IMPORTS["megatron_privates"])]
    assert bad == [f"{PACKAGE}.config.flags"]


# Every module of the launcher reads whole: one over this many lines is two modules.
LAUNCHER_MAX_LINES = 400


def _long_modules(folder: Path, limit: int) -> list[str]:
    """The Python files under ``folder`` longer than ``limit`` lines, with their lengths."""
    lengths = {path: len(path.read_text().splitlines()) for path in sorted(folder.rglob("*.py"))}
    return [f"{path.relative_to(folder)}: {n} lines" for path, n in lengths.items() if n > limit]


def test_launcher_modules_are_short():
    launcher = ROOT / "launcher"
    assert len(list(launcher.glob("*.py"))) > 10
    long = _long_modules(launcher, LAUNCHER_MAX_LINES)
    assert not long, (f"launcher modules over {LAUNCHER_MAX_LINES} lines (split them):\n  "
                      + "\n  ".join(long))


def test_the_length_check_sees_a_long_module(tmp_path):
    (tmp_path / "short.py").write_text("x = 1\n" * LAUNCHER_MAX_LINES)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "long.py").write_text("x = 1\n" * (LAUNCHER_MAX_LINES + 1))
    assert _long_modules(tmp_path, LAUNCHER_MAX_LINES) == [
        f"sub/long.py: {LAUNCHER_MAX_LINES + 1} lines"]


# The floors, from the ground up (docs/implementation.md, "Package by role"): a package
# imports its own floor and the ones below. The ground floor holds the ops, the option
# definitions and checks (torch-free) and the one module of Megatron's privates; the
# Bridge entry point is a launcher.
FLOORS: tuple[tuple[str, ...], ...] = (
    ("ops", "_kernels", "options", "megatron_privates"), ("planning",), ("config",), ("layer",),
    ("integration",), ("data",), ("launcher", "bridge_launcher", "bridge"), ("tools",),
    ("lrmoe_testing",), ("lrmoe_studies",))
# Upward package imports still there: (from, to) -> why. Each must go; one that is gone
# fails the test too (remove its entry).
KNOWN_UPWARD: dict[tuple[str, str], str] = {}


def _floor(package: str) -> int:
    return next(i for i, floor in enumerate(FLOORS) if package in floor)


def _package(module: str) -> str | None:
    """The floor's package of ``module``: a sub-package of megatron_lrmoe, or a workshop
    package as a whole."""
    parts = module.split(".")
    if parts[0] in WORKSHOP:
        return parts[0]
    return parts[1] if len(parts) > 1 else None


def _package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for name, targets in graph.items():
        source = _package(name)
        if source is None:
            continue
        out.setdefault(source, set())
        out[source] |= {t for t in map(_package, targets) if t is not None and t != source}
    return out


def _upward(packages: dict[str, set[str]]) -> set[tuple[str, str]]:
    return {(a, b) for a, targets in packages.items() for b in targets
            if _floor(b) > _floor(a)}


def test_packages_import_only_their_floor_and_below():
    packages = _package_graph(_graph())
    assert set(packages) <= {p for floor in FLOORS for p in floor}, \
        f"a package on no floor: {sorted(set(packages) - {p for f in FLOORS for p in f})}"
    upward = _upward(packages)
    new = sorted(upward - KNOWN_UPWARD.keys())
    assert not new, "packages importing a higher floor:\n  " + "\n  ".join(
        f"{a} -> {b}" for a, b in new)
    gone = sorted(KNOWN_UPWARD.keys() - upward)
    assert not gone, f"upward imports no longer there (remove them from KNOWN_UPWARD): {gone}"
    cycles = [c for c in _cycles(packages)
              if not all((a, b) in KNOWN_UPWARD for a in c for b in c
                         if b in packages.get(a, ()) and _floor(b) > _floor(a))]
    assert not cycles, f"package cycles: {cycles}"


def test_the_package_check_sees_an_upward_import_and_a_cycle():
    packages = {"planning": {"layer"}, "layer": {"planning"}, "ops": set()}
    assert _upward(packages) == {("planning", "layer")}
    assert _cycles(packages) == [["layer", "planning"]]
