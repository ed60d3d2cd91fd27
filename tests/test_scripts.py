"""Shell logic of scripts/: the CUDA toolkit the kernels build against.

torch takes CUDA_HOME from the folder of ``which nvcc``; where nvcc on PATH is a wrapper
script that gives a folder without the CUDA headers. scripts/lib/cuda_home.sh asks nvcc
for its toolkit (``nvcc -v --dryrun``), and scripts/setup.sh and scripts/gpu_check.sh
export what it finds before they build. Oracles: a fake toolkit in a temporary folder
(a fake nvcc that prints a dry run's settings, the header torch needs), reached through a
wrapper nvcc elsewhere on PATH, and a fake Python that records the CUDA_HOME each build
command sees. The scripts run in a copy of the repository's layout, so nothing here
touches the checkout or its .venv.

scripts/gpu_check.sh on this CPU: its limits against the 6-minute budget and the issue's
order of steps; the real no-device path (this Python, no GPU: every CUDA step "no
device", no process started); and, with a fake Python and compute-sanitizer that log
their arguments and report a GPU machine's facts, the steps' commands in order, "absent"
steps, ``--only`` retries, a SIGTERM mid-step, the files in OUTDIR.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch

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


def test_setup_py_builds_against_nvccs_own_toolkit(tmp_path):
    # `pip install .` / `pip wheel .` run setup.py directly (no scripts/setup.sh): it sets
    # CUDA_HOME by the same rule before torch's extension module reads it.
    top, wrap = _toolkit(tmp_path)
    shown = ("import os, runpy, sys; sys.argv = ['setup.py', '--name']; "
             "runpy.run_path('setup.py', run_name='__main__'); "
             "print('result=' + os.environ.get('CUDA_HOME', ''))")
    done = subprocess.run([sys.executable, "-c", shown], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, check=True,
                          env=_env(f"{wrap}:{BASE_PATH}", TORCH_CUDA_ARCH_LIST="9.0"))
    assert f"result={top.resolve()}\n" in done.stdout
    assert (f"setup.py: CUDA_HOME={top.resolve()} (from `{wrap}/nvcc -v --dryrun`)"
            in done.stderr)
    given = subprocess.run([sys.executable, "-c", shown], cwd=ROOT, capture_output=True,
                           text=True, timeout=300, check=True,
                           env=_env(f"{wrap}:{BASE_PATH}", CUDA_HOME=str(top),
                                    TORCH_CUDA_ARCH_LIST="9.0"))
    assert "setup.py: CUDA_HOME" not in given.stderr       # a given CUDA_HOME is kept


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


def test_setup_builds_against_nvccs_toolkit(tmp_path):
    top, wrap = _toolkit(tmp_path)
    repo = _repo_copy(tmp_path, "scripts/setup.sh")
    for name in ("requirements/lock.txt", "requirements/bridge.txt", "setup.py",
                 "pyproject.toml", "workshop/pyproject.toml", "kernels/k.cu"):
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


# -----------------------------------------------------------------------------
# scripts/gpu_check.sh: steps, limits, OUTDIR, retries, signals
# -----------------------------------------------------------------------------

GPU_CHECK = "scripts/gpu_check.sh"
# The issue's order: environment, build, kernel correctness (and determinism), region at
# scale, host syncs, memcheck, and only then the benchmark and the calibration; last the
# full model at context parallelism, which needs two GPUs (outside the one-GPU budget).
ORDER = ["env", "build", "kernels", "determinism", "region", "sync", "sanitizer", "bench",
         "calibration", "cp"]
CUDA_STEPS = ORDER[2:]
MULTI_GPU_STEPS = ["cp"]
BUDGET_S = 360
MAX_FILES = 8
# What each step runs, as the fake Python sees it (its arguments).
STEP_MARKS = {"env": "env-facts", "build": "build_ext", "kernels": "gpu_kernel_check.py "
              "--device cuda", "determinism": "determinism_check.py",
              "region": "region_at_scale_check.py", "sync": "gpu_sync_check.py",
              "sanitizer": "--edge", "bench": "bench_moe_layer.py",
              "calibration": "megatron_lrmoe.tools.calibrate",
              "cp": "context_parallel_check.py"}

GPU_FAKE_PYTHON = """#!/bin/bash
echo "CUDA_HOME=${CUDA_HOME:-} NOCACHE=${PYTORCH_NO_CUDA_MEMORY_CACHING:-} ARGS=$*" >> "$FAKE_LOG"
case "$*" in
  *env-facts*) cat "$FAKE_FACTS"; [ -n "$FAKE_SLEEP" ] && sleep "$FAKE_SLEEP" ;;
  *build-check*) echo "cuda (fake build)" ;;
esac
case "$*" in *"$FAKE_FAIL"*) [ -n "$FAKE_FAIL" ] && exit 1 ;; esac
exit 0
"""
# Drops its own options, then runs the program (or refuses the device, as on gVisor).
FAKE_SANITIZER = """#!/bin/bash
[ "$1" = --version ] && { echo "Version 2025.3.1.0 (fake)"; exit 0; }
echo "SANITIZER $*" >> "$FAKE_LOG"
[ -n "$FAKE_REFUSE" ] && { echo "========= Error: Device not supported"; exit 1; }
while [ $# -gt 1 ] && [ "${1#--}" != "$1" ]; do shift 2; done
exec "$@"
"""
FACTS = {"python": "3.12.3 (fake)", "numpy": "2.5.2", "pytest": "absent",
         "hypothesis": "absent", "megatron_core": "0.19.2", "setuptools": "80.9.0",
         "ninja": "1.13.0", "torch": "2.11.0+cu130 (CUDA 13.0)",
         "device": "NVIDIA H200 (compute capability 9.0, 139 GiB)", "kernels": "cuda",
         "device_count": "2", "transformer_engine": "2.9.0", "megatron_bridge": "0.6.2"}


def _shellcheck() -> str | None:
    local = Path(sys.executable).parent / "shellcheck"
    return str(local) if local.exists() else shutil.which("shellcheck")


def _steps(summary: Path) -> dict[str, list[str]]:
    """The step table of summary.md: step -> [status, seconds, limit, run, what]."""
    text = summary.read_text()
    rows = {}
    for line in text[text.index("| step | status"):].splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] in ORDER:
            rows[cells[0]] = cells[1:]
    return rows


def _files(out: Path) -> list[Path]:
    return sorted(p for p in out.rglob("*") if p.is_file())


def _gpu_check(repo: Path, out: Path, *args: str, env: dict[str, str],
               timeout: int = 60) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", GPU_CHECK, str(out), *args], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _fake_gpu(tmp: Path, *, determinism: bool = True, sanitizer: bool = True,
              **facts: str) -> tuple[Path, dict[str, str], Path]:
    """A repository copy, an environment whose Python and compute-sanitizer are fakes
    that log their arguments (the facts: a GPU machine's), and the log."""
    top, wrap = _toolkit(tmp)
    repo = _repo_copy(tmp, GPU_CHECK)
    if determinism:
        _executable(repo / "scripts" / "dev" / "determinism_check.py", "")
    python = _executable(tmp / "fake" / "python", GPU_FAKE_PYTHON)
    if sanitizer:
        _executable(tmp / "fake" / "compute-sanitizer", FAKE_SANITIZER)
    facts_file = tmp / "facts.txt"
    facts_file.write_text("".join(f"{k}={v}\n" for k, v in {**FACTS, **facts}.items()))
    log = tmp / "python.log"
    env = _env(f"{tmp / 'fake'}:{wrap}:{BASE_PATH}", PY=str(python), FAKE_LOG=str(log),
               FAKE_FACTS=str(facts_file), FAKE_FAIL="", FAKE_SLEEP="", FAKE_REFUSE="",
               GPU_CHECK_SITE=str(tmp / "site"))
    return repo, env, log


def test_gpu_check_limits_sum_within_the_budget_in_the_issues_order(tmp_path):
    run = subprocess.run(["bash", GPU_CHECK, "--list"], cwd=ROOT, capture_output=True,
                         text=True, timeout=30, check=True)
    lines = run.stdout.splitlines()
    budget, grace = (int(w) for w in re.findall(r"(\d+) s", lines[0])[:2])
    steps = [line.split()[:2] for line in lines[1:]]
    assert budget == BUDGET_S and [name for name, _ in steps] == ORDER
    assert sum(int(limit) + grace for name, limit in steps
               if name not in MULTI_GPU_STEPS) <= BUDGET_S
    # The script refuses limits over the budget before it runs anything.
    repo = _repo_copy(tmp_path, GPU_CHECK)
    script = repo / GPU_CHECK
    script.write_text(script.read_text().replace("[build]=", "[build]=2", 1))
    over = subprocess.run(["bash", GPU_CHECK, str(tmp_path / "out")], cwd=repo,
                          capture_output=True, text=True, timeout=30)
    assert over.returncode == 2 and "over the" in over.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-device path")
def test_gpu_check_here_reports_no_device_and_installs_only_missing_wheels(tmp_path):
    """This checkout, this machine's Python and torch (no GPU), the build skipped; two
    carried wheels, one of a package this Python has (pytest), one it lacks."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for dist in ("pytest", "lrmoe_carried_probe"):
        _wheel(wheels, dist)
    site, out = tmp_path / "site", tmp_path / "out"
    env = _env(os.environ["PATH"], PY=sys.executable, WHEELS=str(wheels),
               GPU_CHECK_SITE=str(site))
    run = _gpu_check(ROOT, out, "--skip", "build", env=env, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = _steps(out / "summary.md")
    assert list(rows) == ORDER
    assert rows["env"][0] == "passed" and rows["build"][0] == "skipped (--skip)"
    assert all(rows[s][0] == "no device" for s in CUDA_STEPS), rows
    log = (out / "log.txt").read_text()
    assert all(f"===== {s}:" not in log for s in CUDA_STEPS)   # no process started
    summary = (out / "summary.md").read_text()
    assert f"| torch | {torch.__version__} " in summary and "| device | none |" in summary
    assert [p.name for p in _files(out)] == ["log.txt", "summary.md"]
    assert sorted(p.name for p in site.glob("*.dist-info")) == [
        "lrmoe_carried_probe-1.0.dist-info"]
    assert "| wheels | 1 installed" in summary and "pytest: already there" in log


def test_gpu_check_runs_the_steps_in_order_on_a_device(tmp_path):
    repo, env, log = _fake_gpu(tmp_path)
    out = tmp_path / "out"
    run = _gpu_check(repo, out, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = _steps(out / "summary.md")
    assert all(rows[s][0] == "passed" for s in ORDER), rows
    calls = log.read_text().splitlines()
    firsts = [next(i for i, c in enumerate(calls) if STEP_MARKS[s] in c) for s in ORDER]
    assert firsts == sorted(firsts), calls
    # Under memcheck: the edge shapes, our kernels only, torch's caching allocator off.
    sanitizer = [c for c in calls if c.startswith("SANITIZER ")]
    edge = [c for c in calls if c.startswith("CUDA_HOME=") and c.endswith("--edge")]
    assert len(sanitizer) == 1 and "--tool memcheck --kernel-name kns=lrmoe" in sanitizer[0]
    assert len(edge) == 1 and "NOCACHE=1" in edge[0]
    assert len(_files(out)) <= MAX_FILES and (out / "summary.md").exists()


def test_gpu_check_marks_missing_tools_absent_and_goes_on(tmp_path):
    repo, env, log = _fake_gpu(tmp_path, determinism=False, sanitizer=False,
                               megatron_core="absent", numpy="absent")
    env["FAKE_FAIL"] = "gpu_kernel_check.py --device cuda"
    out = tmp_path / "out"
    run = _gpu_check(repo, out, env=env)
    assert run.returncode == 1, run.stdout + run.stderr       # the kernels step failed
    rows = _steps(out / "summary.md")
    assert rows["kernels"][0] == "FAILED (rc 1)"
    assert rows["determinism"][0] == "absent: scripts/dev/determinism_check.py"
    assert rows["region"][0] == "absent: numpy"
    assert all(rows[s][0].startswith("absent: megatron-core") for s in ("sync", "bench"))
    assert rows["sanitizer"][0] == "absent: compute-sanitizer"
    assert rows["calibration"][0] == "passed"                 # needs no megatron-core
    assert "megatron_lrmoe.tools.calibrate" in log.read_text()


def test_gpu_check_runs_the_context_parallel_step_only_on_two_gpus_with_te(tmp_path):
    for facts, status in ((dict(device_count="1"), "absent: a second GPU (1 found"),
                          (dict(transformer_engine="absent"), "absent: transformer-engine"),
                          (dict(megatron_bridge="absent"), "absent: megatron-bridge")):
        repo, env, log = _fake_gpu(tmp_path / status.split()[-1], **facts)
        run = _gpu_check(repo, tmp_path / "out", env=env)
        assert run.returncode == 0, run.stdout + run.stderr
        rows = _steps(tmp_path / "out" / "summary.md")
        assert rows["cp"][0].startswith(status), rows["cp"]
        assert all(rows[s][0] == "passed" for s in ORDER if s != "cp"), rows
        assert "context_parallel_check.py" not in log.read_text()


def _bridge_log(values: list[float], kept: float | None = None) -> str:
    """Training log lines as Bridge 0.6.2's training_log writes them
    (megatron/bridge/training/utils/train_utils.py), with the LRMoE callback's line after
    each when ``kept`` (its retained fraction) is given."""
    from megatron_lrmoe.integration.step_hooks import format_lrmoe_line

    lines = []
    for i, value in enumerate(values, 1):
        lines.append(f" [2026-01-01 00:00:00] iteration {i:8d}/{len(values):8d} |"
                     f" consumed samples: {4 * i:12d} | lm loss: {value:.6E} |"
                     " loss scale: 1.0 |")
        if kept is not None:
            lines.append(format_lrmoe_line(i, {
                "lrmoe/retained-fraction": kept, "lrmoe/dropped-contribution-fraction": 0.1,
                "lrmoe/backward-bytes-saved": 2.0**20, "lrmoe/load-max-over-mean": 1.2}))
    return "\n".join(lines)


def test_context_parallel_check_compares_the_launches_logs(tmp_path):
    """The GPU step's checks (``--compare``) on logs written as Bridge and the LRMoE
    callback write them (the runs themselves need two GPUs): agreeing launches pass; LRMoE
    off Megatron's losses, a first loss changed by drops, or no drop fail, each named."""
    base = [5.5 - 0.1 * i for i in range(8)]
    near = [v * (1 + 1e-3) for v in base]
    runs = {"good": {"megatron": _bridge_log(base), "inf": _bridge_log(near, 1.0),
                     "drop": _bridge_log(near[:1] + base[1:], 0.6)},
            "bad": {"megatron": _bridge_log(base), "inf": _bridge_log([v * 1.1 for v in base],
                                                                      1.0),
                    "drop": _bridge_log(base, 1.0)}}
    out = {}
    for name, logs in runs.items():
        for launch, text in logs.items():
            (tmp_path / name).mkdir(exist_ok=True)
            (tmp_path / name / f"{launch}.log").write_text(text)
        out[name] = subprocess.run(
            [sys.executable, "scripts/dev/context_parallel_check.py", "--compare",
             str(tmp_path / name)], cwd=ROOT, capture_output=True, text=True, timeout=120,
            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out["good"].returncode == 0, out["good"].stdout + out["good"].stderr
    assert "0 failure(s); losses megatron {1: 5.5," in out["good"].stdout
    bad = out["bad"]
    assert bad.returncode == 1, bad.stdout + bad.stderr
    failed = [line for line in bad.stdout.splitlines() if line.startswith("FAILED: ")]
    assert failed[0].startswith("FAILED: step 1: LRMoE at gamma inf 6.05")
    assert len([f for f in failed if "LRMoE at gamma inf" in f]) == 8
    assert "the forward is exact" in failed[-2] and "dropped no pair" in failed[-1]


def test_gpu_check_only_reruns_the_named_steps_and_keeps_the_other_rows(tmp_path):
    repo, env, log = _fake_gpu(tmp_path)
    out = tmp_path / "out"
    assert _gpu_check(repo, out, "--skip", "bench", env=env).returncode == 0
    summary = out / "summary.md"
    before = _steps(summary)
    assert before["bench"][0] == "skipped (--skip)"
    # Stand in for an earlier run's failure: a retry must keep it.
    summary.write_text(summary.read_text()
                       .replace("| region | passed |", "| region | FAILED (rc 9) |")
                       .replace("| sync | passed |", "| sync | running (limit 35 s) |"))
    log.write_text("")
    env["FAKE_REFUSE"] = "1"
    run = _gpu_check(repo, out, "--only", "sanitizer,bench", env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = _steps(summary)
    assert rows["region"][0] == "FAILED (rc 9)" and rows["kernels"] == before["kernels"]
    assert rows["sync"][0] == "interrupted (its run was killed)"
    assert rows["bench"][0] == "passed"
    assert rows["sanitizer"][0].startswith("absent: compute-sanitizer refused the device")
    assert rows["env"][0] == "passed"                         # env runs with every retry
    ran = log.read_text()
    assert "bench_moe_layer.py" in ran and "region_at_scale_check.py" not in ran
    assert (out / "log.txt").read_text().count("##### gpu_check") == 2   # appended
    bad = _gpu_check(repo, out, "--only", "nosuch", env=env)
    assert bad.returncode == 2 and "unknown step 'nosuch'" in bad.stderr


def test_gpu_check_killed_keeps_partial_results(tmp_path):
    repo, env, _ = _fake_gpu(tmp_path)
    env["FAKE_SLEEP"] = "30"
    out = tmp_path / "out"
    proc = subprocess.Popen(["bash", GPU_CHECK, str(out)], cwd=repo, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    summary = out / "summary.md"
    for _ in range(200):                      # until the env step has started
        if summary.exists() and "running (limit" in summary.read_text():
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM, err
    rows = _steps(summary)
    assert rows["env"][0] == "killed (SIGTERM)" and rows["build"][0] == "not run"
    assert "state: killed by SIGTERM during env" in summary.read_text()
    assert len(_files(out)) <= MAX_FILES


def test_gpu_check_builds_against_nvccs_toolkit(tmp_path):
    repo, env, log = _fake_gpu(tmp_path)
    top = (tmp_path / "cuda-13.0").resolve()
    run = _gpu_check(repo, tmp_path / "out", "--only", "build", env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    builds = _build_lines(log, "build_ext")
    assert builds and all(b.startswith(f"CUDA_HOME={top} ") for b in builds), builds
    assert "--force" not in builds[0]
    # A build that does not load with this torch is redone whole.
    env["FAKE_FAIL"] = "kernels_available"
    log.write_text("")
    _gpu_check(repo, tmp_path / "out", "--only", "build", env=env)
    assert "--force" in _build_lines(log, "build_ext")[0]


def _wheel(folder: Path, dist: str) -> Path:
    """A minimal pure-Python wheel of ``dist`` 1.0 (one module)."""
    info = f"{dist}-1.0.dist-info"
    path = folder / f"{dist}-1.0-py3-none-any.whl"
    files = {f"{dist}_module.py": "",
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                              "Tag: py3-none-any\n"}
    record = "".join(f"{name},,\n" for name in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for name, text in {**files, f"{info}/RECORD": record}.items():
            z.writestr(name, text)
    return path


@pytest.mark.skipif(_shellcheck() is None, reason="shellcheck not installed (.[dev])")
def test_gpu_check_passes_shellcheck():
    out = subprocess.run([_shellcheck(), "-x", GPU_CHECK, "scripts/lib/cuda_home.sh",
                          "scripts/dev/prepare_gpu_wheels.sh"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_gpu_kernel_check_runs_on_the_cpu_backend():
    """The GPU step's script, on the CPU kernels at small sizes: its cases still match
    the ops' signatures and references (no GPU here to run it otherwise)."""
    run = subprocess.run([sys.executable, "scripts/dev/gpu_kernel_check.py", "--device", "cpu",
                          "--small"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr
    assert "0 failure(s)" in run.stdout
