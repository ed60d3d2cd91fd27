#!/usr/bin/env bash
# Compile every kernels/*.cu with nvcc (no link, no GPU needed) to catch CUDA
# compile errors on machines without a GPU or a CUDA build of torch.
#
# The .cu files include only CUDA headers (see shared notes: torch headers in a
# .cu cost ~74 s and do not compile against the CPU torch wheel), so this is
# fast. Flags mirror torch.utils.cpp_extension's CUDA build: its include
# directories and its __CUDA_NO_HALF*/BFLOAT16 conversion macros.
#
# Usage: bash scripts/dev/check_cuda_sources.sh [FILE.cu ...]   (default: kernels/*.cu)
# Env:   NVCC           nvcc to use (default: nvcc on PATH, else $CUDA_HOME/bin/nvcc)
#        PYTHON         interpreter with torch (default: .venv/bin/python, else python3)
#        CUDA_ARCHS     compute capabilities (default: "80 90")
#        CUDA_STDS      C++ standards (default: "c++17 c++20": torch < 2.10 builds
#                       extensions as C++17, newer torch as C++20)
#        CHECK_BINDINGS 1 (default) also syntax-checks kernels/bindings.cpp with
#                       -DWITH_CUDA using the host compiler; 0 skips it
#        CUDA_CHECK_JOBS compiles run at once (default: the CPUs this process may use)
#        CUDA_CHECK_CACHE folder remembering compiles that passed (default:
#                       ${XDG_CACHE_HOME:-~/.cache}/megatron-lrmoe/check_cuda_sources, shared
#                       by the machine's checkouts, like ccache: a key names every input
#                       of a compile, so a hit is that very compile passing before); set
#                       it empty to compile everything
# A compile that passed is not repeated while its inputs are unchanged: the cache key
# hashes the source, every header beside it and in kernels/, this script, the exact
# flags and include paths, `nvcc --version`, the host compiler's version and torch's
# version. Only passes are cached: a failure is compiled again on every run.
# Exit:  0 when all compile or nvcc is absent (skip), non-zero on any error.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
SELF="$ROOT/scripts/dev/$(basename "${BASH_SOURCE[0]}")"
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
# torch's and Python's versions, then torch's include directories, one a line.
TORCH_INFO="$("$PYTHON" -c 'import sys, torch
from torch.utils.cpp_extension import include_paths
print(torch.__version__, sys.version.split()[0]); print("\n".join(include_paths()))')" || {
  echo "check_cuda_sources: FAIL: cannot import torch with $PYTHON (set PYTHON)"
  exit 1
}
mapfile -t TORCH_INCLUDES <<<"$TORCH_INFO"
TORCH_VERSION="${TORCH_INCLUDES[0]}"
TORCH_INCLUDES=("${TORCH_INCLUDES[@]:1}")

shopt -s nullglob
# Largest first: the longest compiles start first when they run in parallel.
if [[ $# -gt 0 ]]; then SOURCES=("$@"); else mapfile -t SOURCES < <(ls -S kernels/*.cu 2>/dev/null); fi
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
NVCC_FLAGS=(-O3 "${GENCODE[@]}" "${INCLUDES[@]}"
  -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__
  -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__
  --expt-relaxed-constexpr -Xcompiler -fPIC -Xcompiler -Wall)

TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

NVCC_VERSION="$("$NVCC" --version)"
echo "check_cuda_sources: $(tail -n 1 <<<"$NVCC_VERSION")"
# nproc alone would honour OMP_NUM_THREADS=1 (set by the test runner): one job.
JOBS="${CUDA_CHECK_JOBS:-$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc 2>/dev/null || echo 2)}"
CACHE="${CUDA_CHECK_CACHE-${XDG_CACHE_HOME:-$HOME/.cache}/megatron-lrmoe/check_cuda_sources}"
if [[ -n "$CACHE" ]]; then
  mkdir -p "$CACHE"
  find "$CACHE" -name '*.ok' -mtime +30 -delete 2>/dev/null || true   # unused for a month
fi
CXX="${CXX:-c++}"
# What every key shares: this script, the tools and torch.
COMMON_KEY="$({
  cat "$SELF"
  printf '%s\n' "$NVCC" "$NVCC_VERSION" "$TORCH_VERSION" "${TORCH_INCLUDES[@]//"$ROOT"/ROOT}" "$CXX"
  "$CXX" --version 2>&1 || true
  gcc --version 2>&1 || true
} | sha256sum | cut -d' ' -f1)"

# cache_key FILE ARG... : the key of compiling FILE with the given arguments.
cache_key() {
  local src="$1"; shift
  local dir headers=()
  dir="$(dirname "$src")"
  headers=("$dir"/*.cuh "$dir"/*.h "$dir"/*.hpp kernels/*.cuh kernels/*.h)
  {
    echo "$COMMON_KEY"
    # the scratch folder differs every run, the checkout's folder from clone to clone
    local args=("${@//"$TMP"/TMP}")
    printf '%s\n' "${args[@]//"$ROOT"/ROOT}"
    sha256sum "$src" "${headers[@]}" | sort -k2 -u | cut -d' ' -f1
  } | sha256sum | cut -d' ' -f1
}

# Each check is a job: its label, its cache key, and its command (in $TMP/N.cmd).
LABELS=(); KEYS=(); CACHED=()
add_job() {   # add_job LABEL SRC CMD...
  local label="$1" src="$2"; shift 2
  local n=${#LABELS[@]} key=""
  if [[ -n "$CACHE" ]]; then key="$(cache_key "$src" "$@")"; fi
  LABELS+=("$label"); KEYS+=("$key")
  if [[ -n "$key" && -f "$CACHE/$key.ok" ]]; then touch "$CACHE/$key.ok"; CACHED+=(1); return; fi
  CACHED+=(0)
  printf '%q ' "$@" >"$TMP/$n.cmd"
}

# The binding's WITH_CUDA branch is otherwise never compiled without a GPU
# machine. A CPU torch wheel lacks c10/cuda/impl/cuda_cmake_macros.h (generated
# at torch's build); an empty stand-in is enough for a syntax-only check.
# Queued first: it takes about as long as the largest .cu file.
if [[ "${CHECK_BINDINGS:-1}" == "1" && $# -eq 0 && -f kernels/bindings.cpp ]]; then
  # Ask nvcc for its toolkit root: `nvcc` may be a wrapper script elsewhere.
  CUDA_TOP="$("$NVCC" --dryrun -c -x cu /dev/null -o "$TMP/null.o" 2>&1 | sed -n 's/^#\$ TOP=//p')"
  CUDA_INCLUDE="${CUDA_TOP:-${CUDA_HOME:-/usr/local/cuda}}/include"
  PY_INCLUDE="$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
  mkdir -p "$TMP/stub/c10/cuda/impl"
  : >"$TMP/stub/c10/cuda/impl/cuda_cmake_macros.h"
  # The stub directory comes last, so a real generated header wins.
  add_job "kernels/bindings.cpp (-DWITH_CUDA, syntax only" kernels/bindings.cpp \
    "$CXX" -fsyntax-only -std=c++20 -DWITH_CUDA -DTORCH_EXTENSION_NAME=_kernels \
    "${INCLUDES[@]}" -I "$CUDA_INCLUDE" -I "$PY_INCLUDE" -I "$TMP/stub" kernels/bindings.cpp
fi

# Each source (largest first) under every standard.
for src in "${SOURCES[@]}"; do
  for std in ${CUDA_STDS:-c++17 c++20}; do
    obj="$TMP/$(basename "$src" .cu).${std}.o"
    add_job "$src (-std=$std" "$src" "$NVCC" -c "$src" -o "$obj" -std="$std" "${NVCC_FLAGS[@]}"
  done
done

# Run the jobs that are not cached, JOBS at a time; each records its status and time.
run_job() {
  local n="$1" start=$SECONDS rc=0
  bash -c "$(cat "$TMP/$n.cmd")" >"$TMP/$n.log" 2>&1 || rc=$?
  echo "$rc $((SECONDS - start))" >"$TMP/$n.rc"
}
running=0
for n in "${!LABELS[@]}"; do
  [[ "${CACHED[$n]}" == 1 ]] && continue
  if (( running >= JOBS )); then wait -n || true; running=$((running - 1)); fi
  run_job "$n" &
  running=$((running + 1))
done
wait

failed=0
for n in "${!LABELS[@]}"; do
  label="${LABELS[$n]}"
  if [[ "${CACHED[$n]}" == 1 ]]; then
    echo "check_cuda_sources: ok   $label, cached)"
    continue
  fi
  read -r rc secs <"$TMP/$n.rc" || { rc=1; secs=0; }
  [[ -s "$TMP/$n.log" ]] && cat "$TMP/$n.log" >&2
  if [[ "$rc" == 0 ]]; then
    echo "check_cuda_sources: ok   $label, $secs s)"
    if [[ -n "$CACHE" ]]; then : >"$CACHE/${KEYS[$n]}.ok"; fi
  else
    echo "check_cuda_sources: FAIL $label)"
    failed=1
  fi
done
exit "$failed"
