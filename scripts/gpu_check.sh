#!/usr/bin/env bash
# GPU check for megatron-lrmoe: one CUDA GPU (written for an H200), no network, at most
# 6 minutes from a checkout, results in OUTDIR; with two GPUs, one step more (cp).
#
#   bash scripts/gpu_check.sh OUTDIR                     # every step
#   bash scripts/gpu_check.sh OUTDIR --only sanitizer    # retry steps (env runs first)
#   bash scripts/gpu_check.sh OUTDIR --skip build        # all but these
#   bash scripts/gpu_check.sh --list                     # steps, limits, what each needs
#
# Environment: PY (the interpreter with CUDA torch; default python3), WHEELS (a folder of
# wheels for what the image lacks, made by scripts/dev/prepare_gpu_wheels.sh: installed
# into .gpu_site/ without an index, each only where its package is missing; GPU_CHECK_SITE
# names another folder),
# TORCH_CUDA_ARCH_LIST (default 9.0: H100/H200), MAX_JOBS (compile jobs; default the CPUs).
#
# Steps, in this order, each under a hard limit (timeout), the limits summing within the
# 6-minute budget (checked before anything runs):
#   env          environment facts: python, torch (version, CUDA), the device, numpy,
#                pytest, hypothesis, megatron-core, setuptools, ninja, nvcc,
#                compute-sanitizer, the kernels' state; installs WHEELS first
#   build        megatron_lrmoe._kernels in place against this torch (forced where the
#                present build does not load with it), CUDA_HOME from nvcc's own report
#   kernels      scripts/dev/gpu_kernel_check.py: the CUDA kernels against their
#                references (edge shapes, empty inputs, 600,000 rows)
#   determinism  scripts/dev/determinism_check.py, where the checkout has it: the
#                deterministic scatter-add run twice, bitwise
#   region       scripts/dev/region_at_scale_check.py: the fake-CUDA test's region cases
#                at Qwen3-30B-A3B's size on the device, numerics against the CPU twin
#   sync         scripts/dev/gpu_sync_check.py: the region under sync-debug mode "error"
#   sanitizer    compute-sanitizer memcheck over the kernels at edge shapes
#   bench        benchmarks/bench_moe_layer.py, Qwen3-30B-A3B-shaped layer, bf16
#   calibration  megatron_lrmoe.tools.calibrate: the simulator's H200 column's constants
#   cp           scripts/dev/context_parallel_check.py: a shrunk Qwen3-30B-A3B Bridge
#                recipe at context parallelism 2 x EP 2 on two GPUs (Transformer Engine's
#                attention, NCCL), LRMoE at gamma inf against Megatron's layer, gamma 0.5
#                exact in forward; needs two GPUs, TE and Megatron-Bridge, and its limit
#                is outside the one-GPU budget (a one-GPU machine reports it absent)
# A step whose tool or package is missing is "absent", a CUDA step without a device "no
# device"; neither fails the run. Every step runs even when an earlier one failed.
#
# OUTDIR gets at most 4 files: summary.md (written first, rewritten as each step starts
# and ends, and on SIGINT/SIGTERM/SIGHUP, so a killed run leaves its partial results),
# log.txt (every step's output), bench_moe_layer_cuda.md, calibration_h200_qwen3.json.
# A full run starts them afresh; --only keeps the other steps' rows of the summary and
# appends to the log. Exit status: 0 when no step failed, 1 when one failed or timed out,
# 2 for bad arguments, 128+N when killed by signal N.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
REPO=$PWD

BUDGET_S=360
KILL_AFTER_S=2                 # a step's grace between SIGTERM and SIGKILL at its limit
STEPS=(env build kernels determinism region sync sanitizer bench calibration cp)
declare -A LIMIT=([env]=15 [build]=85 [kernels]=35 [determinism]=25 [region]=50 [sync]=35
                  [sanitizer]=35 [bench]=35 [calibration]=25 [cp]=180)
# Steps that need two GPUs: never run on the one-GPU machine the budget is for, so their
# limits are not in it.
MULTI_GPU=" cp "
# What each step needs (checked in this order; the first missing one is reported).
declare -A NEEDS=([env]="" [build]="torch setuptools nvcc" [kernels]="torch device kernels"
                  [determinism]="torch device kernels determinism_check"
                  [region]="torch device numpy megatron_core" [sync]="torch device megatron_core"
                  [sanitizer]="torch device kernels compute_sanitizer"
                  [bench]="torch device megatron_core" [calibration]="torch device"
                  [cp]="torch device devices2 megatron_core transformer_engine megatron_bridge")
declare -A TITLE=(
  [env]="environment facts (and WHEELS installed where missing)"
  [build]="megatron_lrmoe._kernels built in place against this torch"
  [kernels]="CUDA kernels vs references: edge shapes, empty, 600,000 rows"
  [determinism]="deterministic scatter-add twice, bitwise (scripts/dev/determinism_check.py)"
  [region]="region at scale (EP 8 plan, rank 3's share, bf16) vs the CPU fp32 twin"
  [sync]="no host sync in the region (sync-debug mode error), weight-stack cost"
  [sanitizer]="compute-sanitizer memcheck on the kernels at edge shapes"
  [bench]="layer benchmark (Qwen3-30B-A3B-shaped, bf16, EP 1, grouped GEMMs)"
  [calibration]="calibration at the Qwen3-30B-A3B expert shape (bf16, 16 local experts)"
  [cp]="full model at context parallelism 2 x EP 2 (two GPUs): gamma inf vs Megatron's layer")

usage() {
  sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'
}

limits_sum() {  # the one-GPU steps' limits with their kill grace
  local s=0 step
  for step in "${STEPS[@]}"; do
    [[ $MULTI_GPU == *" $step "* ]] || s=$((s + LIMIT[$step] + KILL_AFTER_S))
  done
  echo "$s"
}

# The budget: each one-GPU step's limit plus its kill grace, all together.
if (($(limits_sum) > BUDGET_S)); then
  echo "gpu_check: the step limits sum to $(limits_sum) s with their kill grace, over the" \
       "${BUDGET_S} s budget: lower a LIMIT in $0" >&2
  exit 2
fi

pick() {  # pick LIST: validate a comma-separated list of step names, print them
  local name names out=()
  IFS=, read -r -a names <<<"$1"
  for name in "${names[@]}"; do
    [[ -n ${LIMIT[$name]+x} ]] || {
      echo "gpu_check: unknown step '$name' (steps: ${STEPS[*]})" >&2; return 2; }
    out+=("$name")
  done
  ((${#out[@]})) || { echo "gpu_check: an empty step list (steps: ${STEPS[*]})" >&2; return 2; }
  echo "${out[*]}"
}

OUT="" ONLY="" SKIP="" ARGV="scripts/gpu_check.sh $*"
while (($#)); do
  case $1 in
    -h|--help) usage; exit 0 ;;
    --list)
      echo "budget ${BUDGET_S} s; each one-GPU step's limit plus ${KILL_AFTER_S} s kill grace:" \
           "$(limits_sum) s in all (two-GPU steps:${MULTI_GPU% }, outside it)"
      for step in "${STEPS[@]}"; do
        printf '%-12s %4d s  needs: %-40s %s\n' "$step" "${LIMIT[$step]}" \
          "${NEEDS[$step]:-nothing}" "${TITLE[$step]}"
      done
      exit 0 ;;
    --only|--skip)
      (($# > 1)) || { echo "gpu_check: $1 needs a step list (steps: ${STEPS[*]})" >&2; exit 2; }
      list=$(pick "$2") || exit 2
      if [[ $1 == --only ]]; then ONLY=" $list "; else SKIP=" $list "; fi
      shift ;;
    -*) echo "gpu_check: unknown option '$1' (see --help)" >&2; exit 2 ;;
    *) [[ -z $OUT ]] || { echo "gpu_check: one OUTDIR, got '$OUT' and '$1'" >&2; exit 2; }
       OUT=$1 ;;
  esac
  shift
done
[[ -n $OUT ]] || { echo "usage: scripts/gpu_check.sh OUTDIR [--only|--skip STEP,...] (--help)" >&2
                   exit 2; }
if ! mkdir -p "$OUT" || ! OUT=$(cd "$OUT" && pwd); then
  echo "gpu_check: cannot make OUTDIR $OUT" >&2
  exit 2
fi

SUMMARY=$OUT/summary.md
LOG=$OUT/log.txt
BENCH_MD=$OUT/bench_moe_layer_cuda.md
CALIBRATION=$OUT/calibration_h200_qwen3.json
STAMP=$(date -u +%Y%m%dT%H%M%SZ)
START_S=$SECONDS
STATE=$(mktemp -d) || exit 2
trap 'rm -rf "$STATE"' EXIT
export PY=${PY:-python3} SITE=${GPU_CHECK_SITE:-$REPO/.gpu_site} STATE
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-$(nproc)}
export PYTHONUNBUFFERED=1
# The checkout's package, and the wheels installed from WHEELS with their console scripts
# (ninja), for every step.
export PYTHONPATH=$REPO:$SITE${PYTHONPATH:+:$PYTHONPATH}
export PATH=$SITE/bin:$SITE/ninja/data/bin:$PATH
declare -A STATUS SECS RUN FACT
CURRENT="" CHILD="" STEP_T0=0 STATE_LINE=running FAILED=0

# -- summary ----------------------------------------------------------------------------

if [[ -n $ONLY && -f $SUMMARY ]]; then
  # A retry keeps the other steps' rows of the last summary.
  while IFS='|' read -r _ step status secs _ run _; do
    step=${step// /}
    [[ -n ${LIMIT[$step]+x} ]] || continue
    STATUS[$step]=$(echo "$status" | sed 's/^ *//; s/ *$//; s/^running .*/interrupted (its run was killed)/')
    SECS[$step]=${secs// /} RUN[$step]=${run// /}
  done < <(grep '^| [a-z]' "$SUMMARY")
else
  rm -f "$SUMMARY" "$SUMMARY.tmp" "$LOG" "$BENCH_MD" "$CALIBRATION"
fi

write_summary() {
  local step what name
  {
    echo "# GPU check $STAMP"
    echo
    echo "- command: \`${ARGV% }\`"
    echo "- checkout: $(git rev-parse --short HEAD 2>/dev/null || echo '?') (uncommitted" \
         "changes: $(git status --porcelain 2>/dev/null | wc -l)); host $(hostname)"
    echo "- budget ${BUDGET_S} s; limits with kill grace $(limits_sum) s; elapsed" \
         "$((SECONDS - START_S)) s; state: $STATE_LINE"
    echo
    echo "| what | found |"
    echo "| --- | --- |"
    for what in python torch device device_count nvidia_smi numpy pytest hypothesis megatron_core \
                transformer_engine megatron_bridge setuptools ninja nvcc compute_sanitizer \
                kernels wheels; do
      # A fact's name never equals a step's: a retry reads the steps' rows by name.
      name=${what//_/-}
      [[ $what == kernels ]] && name="kernels (compiled)"
      echo "| $name | ${FACT[$what]:-not probed} |"
    done
    echo
    echo "| step | status | seconds | limit s | run | what |"
    echo "| --- | --- | --- | --- | --- | --- |"
    for step in "${STEPS[@]}"; do
      echo "| $step | ${STATUS[$step]:-not run} | ${SECS[$step]:--} | ${LIMIT[$step]} |" \
           "${RUN[$step]:--} | ${TITLE[$step]} |"
    done
    echo
    echo "Not measured on one GPU: expert and context parallelism across ranks (NCCL runs one"
    echo "rank per GPU; step cp needs two GPUs and Transformer Engine); Transformer Engine"
    echo "otherwise (no TEGroupedMLP baseline, no TE grouped linear). Files: log.txt (every"
    echo "step's output), bench_moe_layer_cuda.md, calibration_h200_qwen3.json."
  } >"$SUMMARY.tmp" && mv -f "$SUMMARY.tmp" "$SUMMARY"
}

set_status() {  # set_status STEP STATUS [SECONDS]
  STATUS[$1]=$2 SECS[$1]=${3:--} RUN[$1]=$STAMP
  echo "gpu_check: $1: $2${3:+ (${3} s)}"
}

# shellcheck disable=SC2329  # the traps below call it
on_signal() {
  local sig=$1 num=$2
  trap - INT TERM HUP
  if [[ -n $CHILD ]]; then
    kill -TERM "$CHILD" 2>/dev/null
    wait "$CHILD" 2>/dev/null
  fi
  [[ -n $CURRENT ]] && set_status "$CURRENT" "killed (SIG$sig)" "$((SECONDS - STEP_T0))"
  STATE_LINE="killed by SIG$sig${CURRENT:+ during $CURRENT}"
  write_summary
  echo "gpu_check: killed by SIG$sig; partial results in $SUMMARY" >&2
  exit $((128 + num))
}
trap 'on_signal INT 2' INT
trap 'on_signal TERM 15' TERM
trap 'on_signal HUP 1' HUP

# -- steps ------------------------------------------------------------------------------

# shellcheck disable=SC2329  # run through bash -c (export -f) under timeout
env_step() {
  if [[ -n ${WHEELS:-} ]]; then
    local wheel dist install=()
    [[ -d $WHEELS ]] || { echo "WHEELS=$WHEELS is not a folder"; return 1; }
    for wheel in "$WHEELS"/*.whl; do
      [[ -f $wheel ]] || continue
      dist=$(basename "$wheel"); dist=${dist%%-*}
      if "$PY" -c 'import importlib.metadata as m, sys; m.version(sys.argv[1])' "$dist" \
           2>/dev/null; then
        echo "wheel $dist: already there, not installed"
      else
        install+=("$wheel")
      fi
    done
    if ((${#install[@]})); then
      echo "installing into $SITE without an index: ${install[*]##*/}"
      mkdir -p "$SITE"
      if "$PY" -m pip --version >/dev/null 2>&1; then
        "$PY" -m pip install --quiet --no-index --no-deps --no-compile \
          --disable-pip-version-check --target "$SITE" --upgrade "${install[@]}" || return 1
      else
        echo "no pip for $PY: unpacking the wheels instead (no console scripts)"
        "$PY" -c 'import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]' \
          "$SITE" "${install[@]}" || return 1
      fi
    fi
    echo "wheels=${#install[@]} installed from $WHEELS: ${install[*]##*/}" >>"$STATE/facts"
  fi
  {
    echo "nvcc=$(command -v nvcc >/dev/null && nvcc --version | sed -n 's/.*release \([^,]*\).*/\1/p' \
                 | head -n 1) (CUDA_HOME=${CUDA_HOME:-unset})"
    if command -v compute-sanitizer >/dev/null; then
      echo "compute_sanitizer=$(compute-sanitizer --version 2>&1 | sed -n 's/.*Version //p' \
                                | head -n 1) ($(command -v compute-sanitizer))"
    fi
    echo "ninja_bin=$(command -v ninja || true)"
  } >>"$STATE/facts"
  "$PY" - env-facts >>"$STATE/facts" <<'PYEOF'
import importlib.metadata as md
import platform
import sys


def version(dist: str) -> str:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "absent"


print(f"python={platform.python_version()} ({sys.executable})")
for key, dist in (("numpy", "numpy"), ("pytest", "pytest"), ("hypothesis", "hypothesis"),
                  ("megatron_core", "megatron-core"), ("setuptools", "setuptools"),
                  ("ninja", "ninja"), ("transformer_engine", "transformer-engine"),
                  ("megatron_bridge", "megatron-bridge")):
    print(f"{key}={version(dist)}")
try:
    import torch
except Exception as exc:  # any import failure: the torch steps are absent
    print(f"torch=absent ({type(exc).__name__})")
    sys.exit(0)
print(f"torch={torch.__version__} (CUDA {torch.version.cuda or 'none'})")
print(f"device_count={torch.cuda.device_count() if torch.cuda.is_available() else 0}")
if torch.cuda.is_available():
    cap = torch.cuda.get_device_capability(0)
    mem = torch.cuda.get_device_properties(0).total_memory / 2**30
    print(f"device={torch.cuda.get_device_name(0)} (compute capability {cap[0]}.{cap[1]}, "
          f"{mem:.0f} GiB)")
else:
    print("device=none")
try:
    from megatron_lrmoe.ops import cuda_kernels_available, kernels_available
    state = "cuda" if cuda_kernels_available() else "cpu" if kernels_available() else "none"
except Exception as exc:  # the package itself does not import: no kernels to use
    state = f"none (megatron_lrmoe.ops: {type(exc).__name__})"
print(f"kernels={state} (as loaded with torch {torch.__version__})")
PYEOF
  local rc=$?
  if command -v nvidia-smi >/dev/null; then
    echo "nvidia_smi=$(nvidia-smi --query-gpu=name,memory.total,driver_version \
                         --format=csv,noheader 2>&1 | head -n 1)" >>"$STATE/facts"
  fi
  cat "$STATE/facts"
  return "$rc"
}

# shellcheck disable=SC2329  # run through bash -c (export -f) under timeout
build_step() {
  local force=() state
  # A build that does not load with this torch (built against another) is redone whole.
  if ! "$PY" -c 'import sys; from megatron_lrmoe.ops import kernels_available as k; sys.exit(not k())' \
       2>/dev/null; then
    force=(--force)
  fi
  echo "building megatron_lrmoe._kernels in place ${force[*]} (TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST," \
       "MAX_JOBS=$MAX_JOBS, CUDA_HOME=${CUDA_HOME:-unset})"
  "$PY" setup.py build_ext --inplace "${force[@]}" || return 1
  "$PY" - build-check >"$STATE/kernels" <<'PYEOF'
import torch

from megatron_lrmoe.ops import cuda_kernels_available, kernels_available

state = "cuda" if cuda_kernels_available() else "cpu" if kernels_available() else "none"
print(f"{state} (built against torch {torch.__version__}, CUDA {torch.version.cuda})")
PYEOF
  state=$(cat "$STATE/kernels")
  echo "kernels: ${state:-none}"
  [[ $state == cuda* ]] || { echo "the build has no CUDA backend"; return 1; }
}
export -f env_step build_step

# shellcheck disable=SC2054  # commas inside arguments (lists of values), not between elements
step_command() {  # the command of STEP, into CMD
  case $1 in
    env) CMD=(bash -c env_step) ;;
    build) CMD=(bash -c build_step) ;;
    kernels) CMD=("$PY" scripts/dev/gpu_kernel_check.py --device cuda) ;;
    determinism) CMD=("$PY" scripts/dev/determinism_check.py --device cuda) ;;
    region) CMD=("$PY" scripts/dev/region_at_scale_check.py --device cuda --ep 8 --rank 3
                 --tokens 4096 --check-tokens 512 --reps 5 --warmup 1) ;;
    sync) CMD=("$PY" scripts/dev/gpu_sync_check.py) ;;
    # Only the kernels of namespace lrmoe are instrumented (torch's run as they are), and
    # without torch's caching allocator every tensor is its own allocation, so a read
    # past a tensor's end is out of bounds for memcheck too.
    sanitizer) CMD=(env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck
                    --kernel-name kns=lrmoe --error-exitcode 3 --print-limit 20
                    "$PY" scripts/dev/gpu_kernel_check.py --device cuda --edge) ;;
    bench) CMD=("$PY" benchmarks/bench_moe_layer.py --device cuda --ep 1 --hidden 2048
                --ffn 768 --experts 128 --topk 8 --dtype bf16 --tokens 4096
                --capacities inf,0.75 --grouped-gemm on --routings skewed --warmup 1 --reps 5
                --out "$BENCH_MD") ;;
    cp) CMD=("$PY" scripts/dev/context_parallel_check.py) ;;
    calibration) CMD=("$PY" -m megatron_lrmoe.tools.calibrate --device cuda --dtype bf16
                      --hidden-size 2048 --ffn-hidden-size 768 --experts 128 --topk 8
                      --tokens 4096 --rows 2048 --local-experts 16
                      --gemm-rows 64,128,256,512,1024,2048,4096,8192 --rounds 1
                      --output "$CALIBRATION") ;;
  esac
}

missing() {  # the first thing STEP needs that is not here ("" when none)
  local need
  for need in ${NEEDS[$1]}; do
    case $need in
      torch) [[ ${FACT[torch]:-absent} != absent* ]] || { echo "absent: torch ($PY)"; return; } ;;
      device) [[ ${FACT[device]:-none} != none ]] || { echo "no device"; return; } ;;
      devices2) ((${FACT[device_count]:-0} >= 2)) \
                  || { echo "absent: a second GPU (${FACT[device_count]:-0} found; NCCL runs" \
                            "one rank per GPU)"; return; } ;;
      transformer_engine|megatron_bridge)
        [[ ${FACT[$need]:-absent} != absent ]] \
          || { echo "absent: ${need//_/-}"; return; } ;;
      numpy|setuptools)
        [[ ${FACT[$need]:-absent} != absent ]] || { echo "absent: $need"; return; } ;;
      megatron_core)
        [[ ${FACT[megatron_core]:-absent} == 0.19.* ]] \
          || { echo "absent: megatron-core 0.19 (${FACT[megatron_core]:-absent}; carry its" \
                    "wheel: WHEELS=DIR)"; return; } ;;
      nvcc) command -v nvcc >/dev/null || { echo "absent: nvcc"; return; } ;;
      compute_sanitizer)
        command -v compute-sanitizer >/dev/null || { echo "absent: compute-sanitizer"; return; } ;;
      kernels) [[ ${FACT[kernels]:-none} == cuda* ]] \
                 || { echo "absent: CUDA kernels (${FACT[kernels]:-none})"; return; } ;;
      determinism_check)
        [[ -f scripts/dev/determinism_check.py ]] \
          || { echo "absent: scripts/dev/determinism_check.py"; return; } ;;
    esac
  done
}

load_facts() {
  local key value
  while IFS='=' read -r key value; do
    [[ -n $key ]] && FACT[$key]=$value
  done <"$STATE/facts"
  FACT[ninja]="${FACT[ninja]:-absent} (python package); binary: ${FACT[ninja_bin]:-absent}"
  [[ -n ${FACT[ninja_bin]:-} ]] || FACT[ninja]+=" (the build then compiles one file at a time)"
  FACT[nvcc]=${FACT[nvcc]#" "}
  [[ ${FACT[nvcc]} == "("* ]] && FACT[nvcc]="absent ${FACT[nvcc]}"
  FACT[compute_sanitizer]=${FACT[compute_sanitizer]:-absent}
  FACT[nvidia_smi]=${FACT[nvidia_smi]:-absent}
  FACT[wheels]=${FACT[wheels]:-none carried (WHEELS unset)}
  for key in pytest hypothesis; do
    FACT[$key]+=" (used by no step)"
  done
}

run_step() {
  local step=$1 limit left rc why offset secs
  # env always runs: every other step is decided on its facts.
  if [[ $step != env && -n $ONLY && $ONLY != *" $step "* ]]; then
    return                                    # a retry of other steps: this row stays
  fi
  if [[ $step != env && $SKIP == *" $step "* ]]; then
    set_status "$step" "skipped (--skip)"
    write_summary
    return
  fi
  why=$(missing "$step")
  if [[ -n $why ]]; then
    set_status "$step" "$why"
    write_summary
    return
  fi
  left=$((BUDGET_S - (SECONDS - START_S) - KILL_AFTER_S))
  limit=${LIMIT[$step]}
  # A two-GPU step runs under its own limit, after the budgeted ones.
  [[ $MULTI_GPU == *" $step "* ]] || ((limit <= left)) || limit=$left
  if ((limit < 5)); then
    set_status "$step" "skipped (budget of ${BUDGET_S} s spent)"
    FAILED=1
    write_summary
    return
  fi
  step_command "$step"
  CURRENT=$step STEP_T0=$SECONDS
  STATUS[$step]="running (limit $limit s)" SECS[$step]=- RUN[$step]=$STAMP
  write_summary
  offset=$(stat -c %s "$LOG" 2>/dev/null || echo 0)
  printf '\n===== %s: %s (limit %d s, t=%d s) =====\n$ %s\n' "$step" "${TITLE[$step]}" \
    "$limit" "$((SECONDS - START_S))" "${CMD[*]}" >>"$LOG"
  timeout --kill-after="$KILL_AFTER_S" "$limit" "${CMD[@]}" >>"$LOG" 2>&1 </dev/null &
  CHILD=$!
  wait "$CHILD"
  rc=$?
  CHILD="" CURRENT=""
  secs=$((SECONDS - STEP_T0))
  echo "----- $step: rc=$rc after $secs s" >>"$LOG"
  if ((rc == 0)); then
    set_status "$step" passed "$secs"
  elif [[ $step == sanitizer ]] && tail -c +"$((offset + 1))" "$LOG" | grep -q "Device not supported"; then
    set_status "$step" "absent: compute-sanitizer refused the device (Device not supported)" "$secs"
  elif ((rc == 124 || rc == 137)); then
    set_status "$step" "TIMED OUT at $limit s" "$secs"
    FAILED=1
  else
    set_status "$step" "FAILED (rc $rc)" "$secs"
    FAILED=1
  fi
  if ((rc != 0)); then
    tail -c +"$((offset + 1))" "$LOG" | tail -n 15 | sed "s/^/  $step| /"
  fi
  if [[ $step == env ]]; then
    load_facts
  elif [[ $step == build && -s $STATE/kernels ]]; then
    FACT[kernels]=$(cat "$STATE/kernels")
  fi
  write_summary
}

{
  echo "gpu_check $STAMP: $ARGV"
  echo "summary: $SUMMARY (rewritten as each step starts and ends); log: $LOG"
} >&2
: >"$STATE/facts"
write_summary
printf '\n##### gpu_check %s: %s (host %s) #####\n' "$STAMP" "$ARGV" "$(hostname)" >>"$LOG"
# The toolkit the kernels build against: torch's rule (nvcc's folder) is wrong for a
# wrapper nvcc on PATH, which leaves the extension without its CUDA backend.
# shellcheck source=scripts/lib/cuda_home.sh
source scripts/lib/cuda_home.sh
lrmoe_export_cuda_home "gpu_check: " >>"$LOG" 2>&1
for step in "${STEPS[@]}"; do
  run_step "$step"
done
STATE_LINE="finished in $((SECONDS - START_S)) s"
write_summary
if ((FAILED)); then
  echo "gpu_check: FAILED (see $SUMMARY)" >&2
else
  echo "gpu_check: no step failed (see $SUMMARY for absent and no-device steps)" >&2
fi
exit "$FAILED"
