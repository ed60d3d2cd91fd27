#!/usr/bin/env bash
# Compile every kernels/*.cu with nvcc (no link, no GPU needed) to catch CUDA
# compile errors on machines without a GPU or a CUDA build of torch.
#
# The .cu files include only CUDA headers (see shared notes: torch headers in a
# .cu cost ~74 s and do not compile against the CPU torch wheel), so this is
# fast. Flags mirror torch.utils.cpp_extension's CUDA build: its include
# directories and its __CUDA_NO_HALF*/BFLOAT16 conversion macros.
#
# Usage: bash scripts/check_cuda_sources.sh [FILE.cu ...]   (default: kernels/*.cu)
# Env:   NVCC           nvcc to use (default: nvcc on PATH, else $CUDA_HOME/bin/nvcc)
#        PYTHON         interpreter with torch (default: .venv/bin/python, else python3)
#        CUDA_ARCHS     compute capabilities (default: "80 90")
#        CUDA_STDS      C++ standards (default: "c++17 c++20": torch < 2.10 builds
#                       extensions as C++17, newer torch as C++20)
#        CHECK_BINDINGS 1 (default) also syntax-checks kernels/bindings.cpp with
#                       -DWITH_CUDA using the host compiler; 0 skips it
# Exit:  0 when all compile or nvcc is absent (skip), non-zero on any error.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

# NVCC, when set, names the compiler to use (a path that does not exist means
# "no nvcc", which is how the skip path is tested).
if [[ -n "${NVCC:-}" ]]; then
  if [[ ! -x "$NVCC" ]]; then
    echo "check_cuda_sources: SKIP: NVCC=$NVCC is not an executable"
    exit 0
  fi
elif command -v nvcc >/dev/null 2>&1; then
  NVCC="$(command -v nvcc)"
elif [[ -x "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" ]]; then
  NVCC="${CUDA_HOME:-/usr/local/cuda}/bin/nvcc"
else
  echo "check_cuda_sources: SKIP: nvcc not found (install the CUDA toolkit, or set NVCC or CUDA_HOME)"
  exit 0
fi

if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
TORCH_INCLUDE_LIST="$("$PYTHON" -c \
  'from torch.utils.cpp_extension import include_paths; print("\n".join(include_paths()))')" || {
  echo "check_cuda_sources: FAIL: cannot import torch with $PYTHON (set PYTHON)"
  exit 1
}
mapfile -t TORCH_INCLUDES <<<"$TORCH_INCLUDE_LIST"

shopt -s nullglob
if [[ $# -gt 0 ]]; then SOURCES=("$@"); else SOURCES=(kernels/*.cu); fi
if [[ ${#SOURCES[@]} -eq 0 ]]; then
  echo "check_cuda_sources: no kernels/*.cu files"
  exit 0
fi

GENCODE=()
for arch in ${CUDA_ARCHS:-80 90}; do
  GENCODE+=(-gencode "arch=compute_${arch},code=sm_${arch}")
done
INCLUDES=(-I "$ROOT/kernels")
for dir in "${TORCH_INCLUDES[@]}"; do INCLUDES+=(-I "$dir"); done

TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

echo "check_cuda_sources: $("$NVCC" --version | tail -n 1)"
failed=0
for std in ${CUDA_STDS:-c++17 c++20}; do
  for src in "${SOURCES[@]}"; do
    obj="$TMP/$(basename "$src" .cu).${std}.o"
    start=$SECONDS
    if "$NVCC" -c "$src" -o "$obj" -std="$std" -O3 "${GENCODE[@]}" "${INCLUDES[@]}" \
      -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ \
      -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__ \
      --expt-relaxed-constexpr -Xcompiler -fPIC -Xcompiler -Wall; then
      echo "check_cuda_sources: ok   $src (-std=$std, $((SECONDS - start)) s)"
    else
      echo "check_cuda_sources: FAIL $src (-std=$std)"
      failed=1
    fi
  done
done

# The binding's WITH_CUDA branch is otherwise never compiled without a GPU
# machine. A CPU torch wheel lacks c10/cuda/impl/cuda_cmake_macros.h (generated
# at torch's build); an empty stand-in is enough for a syntax-only check.
if [[ "${CHECK_BINDINGS:-1}" == "1" && $# -eq 0 && -f kernels/bindings.cpp ]]; then
  CXX="${CXX:-c++}"
  # Ask nvcc for its toolkit root: `nvcc` may be a wrapper script elsewhere.
  CUDA_TOP="$("$NVCC" --dryrun -c -x cu /dev/null -o "$TMP/null.o" 2>&1 | sed -n 's/^#\$ TOP=//p')"
  CUDA_INCLUDE="${CUDA_TOP:-${CUDA_HOME:-/usr/local/cuda}}/include"
  PY_INCLUDE="$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
  mkdir -p "$TMP/stub/c10/cuda/impl"
  : >"$TMP/stub/c10/cuda/impl/cuda_cmake_macros.h"
  start=$SECONDS
  # The stub directory comes last, so a real generated header wins.
  if "$CXX" -fsyntax-only -std=c++20 -DWITH_CUDA -DTORCH_EXTENSION_NAME=_kernels \
    "${INCLUDES[@]}" -I "$CUDA_INCLUDE" -I "$PY_INCLUDE" -I "$TMP/stub" kernels/bindings.cpp; then
    echo "check_cuda_sources: ok   kernels/bindings.cpp (-DWITH_CUDA, syntax only, $((SECONDS - start)) s)"
  else
    echo "check_cuda_sources: FAIL kernels/bindings.cpp (-DWITH_CUDA, syntax only)"
    failed=1
  fi
fi
exit "$failed"
