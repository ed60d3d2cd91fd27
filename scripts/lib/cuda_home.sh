# shellcheck shell=bash
# The CUDA toolkit to build megatron_lrmoe._kernels against, for scripts/setup.sh and
# scripts/gpu_check.sh (sourced by both; defines functions only).
#
# torch.utils.cpp_extension takes CUDA_HOME, when unset, from the folder of `which nvcc`
# (its parent). Where nvcc on PATH is a wrapper script (/usr/local/bin/nvcc running
# /usr/local/cuda-13.0/bin/nvcc), that gives /usr/local: the extension then compiles with
# WITH_CUDA but cannot find cuda_runtime_api.h. nvcc itself knows its toolkit: a dry run
# (`nvcc -v --dryrun`, which compiles nothing) prints its settings, among them
#   #$ _HERE_=/usr/local/cuda-13.0/bin
#   #$ TOP=/usr/local/cuda-13.0/bin/..
# (CUDA 11 to 13 print both).

# lrmoe_cuda_home: set LRMOE_CUDA_HOME to the toolkit root nvcc on PATH belongs to, and
# LRMOE_CUDA_HOME_HOW to how it was found. In order: TOP of nvcc's dry run, else the
# parent of its _HERE_, each taken only when it has include/cuda_runtime_api.h; else
# torch's own rule (the parent of nvcc's folder). Status 1 when there is no nvcc on PATH.
lrmoe_cuda_home() {
  local nvcc report top root
  LRMOE_CUDA_HOME="" LRMOE_CUDA_HOME_HOW=""
  nvcc=$(command -v nvcc 2>/dev/null) || return 1
  report=$("$nvcc" -v --dryrun -c -x cu /dev/null -o /dev/null 2>&1) || true
  for top in "$(sed -n 's/^#\$ TOP=//p' <<<"$report" | head -n 1)" \
             "$(sed -n 's/^#\$ _HERE_=//p' <<<"$report" | head -n 1)/.."; do
    [[ -n $top && $top != /.. && -d $top ]] || continue
    root=$(cd "$top" && pwd -P) || continue
    if [[ -f $root/include/cuda_runtime_api.h ]]; then
      LRMOE_CUDA_HOME=$root
      LRMOE_CUDA_HOME_HOW="from \`$nvcc -v --dryrun\`"
      return 0
    fi
  done
  LRMOE_CUDA_HOME=$(dirname "$(dirname "$nvcc")")
  LRMOE_CUDA_HOME_HOW="the parent of $nvcc's folder, torch's rule: its dry run named no"
  LRMOE_CUDA_HOME_HOW+=" toolkit with include/cuda_runtime_api.h"
}

# lrmoe_export_cuda_home [PREFIX]: export CUDA_HOME from lrmoe_cuda_home unless it is set,
# and print which it is (after PREFIX). Call it directly, not in $(...): the export must
# reach the caller. Never fails (no nvcc: CUDA_HOME stays unset, the kernels build
# without CUDA).
lrmoe_export_cuda_home() {
  local prefix=${1:-}
  if [[ -n ${CUDA_HOME:-} ]]; then
    echo "${prefix}CUDA_HOME=$CUDA_HOME (given)"
  elif lrmoe_cuda_home; then
    export CUDA_HOME=$LRMOE_CUDA_HOME
    echo "${prefix}CUDA_HOME=$CUDA_HOME ($LRMOE_CUDA_HOME_HOW)"
  else
    echo "${prefix}CUDA_HOME unset (no nvcc on PATH: the kernels build without CUDA)"
  fi
}
