"""What `pip wheel .` ships: the product (megatron_lrmoe) and nothing of the workshop, and
no shipped module reads a file above its package (so an installed package works outside
a checkout); the simulator runs a real preset from the package's own data."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "megatron_lrmoe"
USER_COMMANDS = ("calibrate", "simulate", "report")


def test_the_wheel_holds_the_product_and_its_user_commands_only(tmp_path):
    # setuptools' own account of what setup.py packs (egg_info compiles nothing).
    subprocess.run([sys.executable, "setup.py", "-q", "egg_info", "--egg-base", str(tmp_path)],
                   cwd=ROOT, check=True, capture_output=True, text=True, timeout=120)
    info = next(tmp_path.glob("*.egg-info"))
    assert (info / "top_level.txt").read_text().split() == ["megatron_lrmoe"]
    sources = set((info / "SOURCES.txt").read_text().split())
    shipped = {s for s in sources if s.endswith(".py") and s.startswith("megatron_lrmoe/")}
    assert {str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py")} == shipped
    assert {f"megatron_lrmoe/tools/{c}.py" for c in USER_COMMANDS} <= shipped
    # (The sdist's default top-level tests/test*.py are listed too; a wheel holds the
    # packages' files only, which top_level.txt and the set above pin.)
    workshop = sorted(s for s in sources
                      if s.startswith("workshop/") or re.search(r"lrmoe_(studies|testing)", s))
    assert not workshop, f"the wheel would ship the workshop: {workshop}"


# A read of the module's own file's folders: Path(__file__)...parents[k] or .parent chains.
_PARENTS = re.compile(r"__file__\)(?:\.resolve\(\))?\.parents\[(\d+)\]")
_PARENT_CHAIN = re.compile(r"__file__\)(?:\.resolve\(\))?((?:\.parent)+)")


def reads_above_package(path: Path, text: str, package: Path) -> list[str]:
    """The lines of module ``path`` (inside ``package``) that name a folder above
    ``package``: parents[k] with k past the package's own folder, or a .parent chain as
    long."""
    inside = len(path.relative_to(package).parts)   # parents[inside - 1] is the package
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        ks = [int(k) for k in _PARENTS.findall(line)]
        ks += [chain.count(".parent") - 1 for chain in _PARENT_CHAIN.findall(line)]
        if any(k > inside - 1 for k in ks):
            out.append(f"{path.relative_to(package.parent)}:{number}: {line.strip()}")
    return out


def test_no_shipped_module_reads_a_path_above_the_package():
    found = [hit for path in sorted(PACKAGE.rglob("*.py"))
             for hit in reads_above_package(path, path.read_text(), PACKAGE)]
    assert not found, "modules reading outside the package:\n  " + "\n  ".join(found)


def test_the_check_sees_a_read_above_the_package(tmp_path):
    package = tmp_path / "pkg"
    module = package / "tools" / "m.py"
    assert reads_above_package(module, "HERE = Path(__file__).resolve().parents[1]\n",
                               package) == []
    assert reads_above_package(module, "ROOT = Path(__file__).resolve().parents[2]\n",
                               package) == ["pkg/tools/m.py:1: ROOT = Path(__file__)"
                                            ".resolve().parents[2]"]
    assert reads_above_package(module, "x = Path(__file__).parent.parent.parent / 'c'\n",
                               package)
    assert not reads_above_package(module, "x = Path(__file__).parent.parent\n", package)


def test_simulate_runs_a_shipped_preset_outside_the_checkout(tmp_path):
    # From another folder: the model, the cluster and the routing come from the package.
    out = subprocess.run(
        [sys.executable, "-m", "megatron_lrmoe.tools.simulate", "--model", "qwen3-30b-a3b",
         "--cluster", "h100", "--ep", "8", "--layers", "1", "--steps", "1",
         "--warmup-steps", "1", "--planner-ms", "0.1", "--out", str(tmp_path / "out")],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, check=True).stdout
    rows = [line for line in out.splitlines() if line.startswith("| 8 |")]
    assert len(rows) == 5 and "| 8 | Megatron dropless |" in rows[0]
    report = (tmp_path / "out" / "simulate_qwen3-30b-a3b_h100.md").read_text()
    assert "steps to target: none given" in report
