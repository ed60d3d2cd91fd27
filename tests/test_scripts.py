"""Shell logic of scripts/: the CUDA toolkit the kernels build against (issue 25, item 3).

torch takes CUDA_HOME from the folder of ``which nvcc``; where nvcc on PATH is a wrapper
script that gives a folder without the CUDA headers. scripts/lib/cuda_home.sh asks nvcc
for its toolkit (``nvcc -v --dryrun``), and scripts/setup.sh and scripts/gpu_check.sh
export what it finds before they build. Oracles: a fake toolkit in a temporary folder
(a fake nvcc that prints a dry run's settings, the header torch needs), reached through a
wrapper nvcc elsewhere on PATH, and a fake Python that records the CUDA_HOME each build
command sees. The scripts run in a copy of the repository's layout, so nothing here
touches the checkout or its .venv.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIB = ROOT / "scripts" / "lib" / "cuda_home.sh"
BASE_PATH = "/usr/bin:/bin"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _executable(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


def _toolkit(tmp: Path, dryrun: str = "both") -> tuple[Path, Path]:
    """(toolkit root, folder of a wrapper nvcc that runs the toolkit's nvcc)."""
    top = tmp / "cuda-13.0"
    (top / "include").mkdir(parents=True)
    (top / "include" / "cuda_runtime_api.h").write_text("")
    lines = {"both": ['#$ _HERE_=$here', '#$ TOP=$here/..'],
             "here": ['#$ _HERE_=$here'],
             "none": []}[dryrun]
    body = "\n".join(f'echo "{line}" >&2' for line in lines)
    _executable(top / "bin" / "nvcc", f"""#!/bin/bash
here=$(cd "$(dirname "$0")" && pwd)
case " $* " in
  *" --dryrun "*) echo '#$ _NVVM_BRANCH_=nvvm' >&2
{body}
    echo '#$ INCLUDES="-I'"$here"'/../targets/x86_64-linux/include"' >&2 ;;
  *) echo "nvcc: fake, release 13.0" ;;
esac
""")
    wrap = tmp / "wrap" / "bin"
    _executable(wrap / "nvcc", f'#!/bin/sh\nexec "{top}/bin/nvcc" "$@"\n')
    return top, wrap


def _env(path: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_HOME", "CUDA_PATH")}
    env.update(PATH=path, **extra)
    return env


def _cuda_home(env: dict[str, str]) -> subprocess.CompletedProcess:
    script = f'set -euo pipefail; source "{LIB}"; lrmoe_export_cuda_home "log: "; ' \
             'echo "result=${CUDA_HOME:-}"'
    return subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True,
                          timeout=60, check=True)


@pytest.mark.parametrize("dryrun", ["both", "here"])
def test_cuda_home_is_nvccs_own_toolkit_not_the_wrappers_folder(tmp_path, dryrun):
    top, wrap = _toolkit(tmp_path, dryrun)
    out = _cuda_home(_env(f"{wrap}:{BASE_PATH}")).stdout
    assert f"result={top.resolve()}\n" in out
    assert f"log: CUDA_HOME={top.resolve()} (from `{wrap}/nvcc -v --dryrun`)" in out


def test_cuda_home_falls_back_to_torchs_rule(tmp_path):
    _, wrap = _toolkit(tmp_path, "none")
    out = _cuda_home(_env(f"{wrap}:{BASE_PATH}")).stdout
    assert f"result={wrap.parent}\n" in out and "torch's rule" in out


def test_cuda_home_given_is_kept(tmp_path):
    _, wrap = _toolkit(tmp_path)
    out = _cuda_home(_env(f"{wrap}:{BASE_PATH}", CUDA_HOME="/opt/mine")).stdout
    assert "result=/opt/mine\n" in out and "(given)" in out


def test_cuda_home_without_nvcc_stays_unset():
    if shutil.which("nvcc", path=BASE_PATH):
        pytest.skip(f"an nvcc on {BASE_PATH}")
    out = _cuda_home(_env(BASE_PATH)).stdout
    assert "result=\n" in out and "no nvcc" in out


# -----------------------------------------------------------------------------
# The scripts that build: what CUDA_HOME their build commands see
# -----------------------------------------------------------------------------

FAKE_PYTHON = """#!/bin/bash
echo "CUDA_HOME=${CUDA_HOME:-} ARGS=$*" >> "$FAKE_LOG"
if [ "$1" = -m ] && [ "$2" = venv ]; then
  mkdir -p "${@: -1}/bin" && cp "$0" "${@: -1}/bin/python"
fi
case "$*" in *"$FAKE_FAIL"*) [ -n "$FAKE_FAIL" ] && exit 1 ;; esac
exit 0
"""


def _repo_copy(tmp: Path, *scripts: str) -> Path:
    repo = tmp / "repo"
    for name in (*scripts, "scripts/lib/cuda_home.sh"):
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, repo / name)
    return repo


def _build_lines(log: Path, marker: str) -> list[str]:
    return [line for line in log.read_text().splitlines() if marker in line]


def test_gpu_check_builds_against_nvccs_toolkit(tmp_path):
    top, wrap = _toolkit(tmp_path)
    repo = _repo_copy(tmp_path, "scripts/gpu_check.sh")
    python = _executable(tmp_path / "fake" / "python", FAKE_PYTHON)
    log = tmp_path / "python.log"
    env = _env(f"{wrap}:{BASE_PATH}", PY=str(python), FAKE_LOG=str(log),
               FAKE_FAIL="megatron.core", GPU_CHECK_BUDGET_S="60")
    run = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=repo, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stdout + run.stderr   # the fake torch is unusable
    builds = _build_lines(log, "build_ext")
    assert builds and all(b.startswith(f"CUDA_HOME={top.resolve()} ") for b in builds), builds
    assert f"CUDA_HOME={top.resolve()} (from" in run.stdout


def test_setup_builds_against_nvccs_toolkit(tmp_path):
    top, wrap = _toolkit(tmp_path)
    repo = _repo_copy(tmp_path, "scripts/setup.sh")
    for name in ("requirements/lock.txt", "setup.py", "pyproject.toml", "kernels/k.cu"):
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text("")
    python = _executable(tmp_path / "fake" / "python", FAKE_PYTHON)
    log = tmp_path / "python.log"
    env = _env(f"{wrap}:{BASE_PATH}", PYTHON=str(python), FAKE_LOG=str(log), FAKE_FAIL="",
               TORCH_CUDA_ARCH_LIST="9.0")
    run = subprocess.run(["bash", "scripts/setup.sh"], cwd=repo, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    builds = _build_lines(log, "--no-build-isolation")
    assert builds and all(b.startswith(f"CUDA_HOME={top.resolve()} ") for b in builds), builds
    assert f"setup: CUDA_HOME={top.resolve()} (from" in run.stdout
