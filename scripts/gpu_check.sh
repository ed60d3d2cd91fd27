#!/usr/bin/env bash
# GPU check for megatron-lrmoe, on one CUDA machine (written for an H200), in at most
# 7 minutes (GPU_CHECK_BUDGET_S):
#
#   1. environment. Offline (WHEELS=DIR, the GPU machine of this project: Python 3.12 with
#      its own CUDA torch, nothing else, no registry): install the wheels of DIR
#      (megatron-core 0.19.2 and the packages the check imports, prepared on a networked
#      machine by scripts/dev/prepare_gpu_wheels.sh into the git-ignored wheels/) into
#      .gpu_site/ with pip --no-index, and build megatron_lrmoe._kernels in place with the
#      machine's torch. Online (no WHEELS): LRMOE_GPU=1 bash scripts/setup.sh.
#   2. the CUDA backend of scatter_add_rows, select_rows, combine_rows and
#      combine_rows_backward against their pure-torch references on random inputs
#      (inline below: the kernel test files have no CUDA-parametrised cases)
#   3. scripts/dev/gpu_sync_check.py: the LRMoE forward after the counts exchange and the
#      whole LRMoE backward under torch.cuda.set_sync_debug_mode("error") (bf16 grouped
#      GEMMs and fp32 loop; gamma inf and 0.75; uniform, topk, sample), and the cost of
#      the grouped path's per-call weight stack against its GEMMs
#   4. benchmarks/bench_moe_layer.py on a Qwen3-30B-A3B-shaped MoE layer (H=2048, F=768,
#      128 experts, top-8, bf16, EP=1, one process): Megatron's MoELayer (SequentialMLP)
#      beside LRMoE at gamma inf, 1.0 and 0.75 with grouped GEMMs; memory and host reads
#      per layer call are in its table
#   5. python -m megatron_lrmoe.tools.calibrate on the GPU at the Qwen3-30B-A3B expert shape
#      (bf16, 16 local experts as at EP 8, GEMM rate tables at 64-8192 rows, memory rate,
#      median of 3 rounds) into benchmarks/results/calibration_h200_qwen3_<date>.json: the
#      node-local constants of the simulator's H200 column (issue 14; the projection runs
#      on any machine afterwards, docs/simulate.md, "A measured H200 column")
#   6. scripts/dev/region_at_scale_check.py (issue 25, part 5): the fake-CUDA test's
#      cases (tests/layer/test_region_fake_cuda.py: EP 8 plan from the qwen3 trace, gamma
#      inf/1.0/0.75, uniform/topk, static/replicas) on real CUDA tensors, rank 3's share as
#      a 1-rank region, 4096 tokens per rank, bf16 grouped GEMMs: the same checks (devices,
#      dtypes, host reads, grouped-GEMM rows) plus what only the GPU adds: numerics against
#      the CPU fp32 path (512 tokens per rank), syncs inside kernels (sync-debug "error"
#      over forward and backward), kernel speed (CUDA events, median of 10), real peak
#   7. with what is left of the budget, the kernel test files (CPU backend, nvcc check)
#
# Not measured here, and said so in the summary: expert parallelism across ranks (one GPU
# cannot run NCCL EP > 1), Transformer Engine (absent: no TEGroupedMLP baseline, no TE
# grouped linear), anything a step had no budget left for.
#
# Everything printed goes to benchmarks/results/gpu_check_<date>.txt (the benchmark's own
# markdown table also to benchmarks/results/bench_moe_layer_cuda_<date>.md). Every step
# runs even when an earlier one failed (except when there is no usable interpreter); the
# summary lists each step's exit status, and the script exits non-zero if any step failed.
#
#   WHEELS=wheels bash scripts/gpu_check.sh        # offline GPU machine (PY: its python3)
#   bash scripts/gpu_check.sh                      # networked: setup.sh makes .venv
#   PY=/path/to/python bash scripts/gpu_check.sh   # an interpreter that already has CUDA
#                                                  # torch and megatron-core 0.19.x
# Environment: TORCH_CUDA_ARCH_LIST (default 9.0: H100/H200), MAX_JOBS (compile jobs,
# default: the CPU count), GPU_CHECK_BUDGET_S (default 420: total seconds; each step gets
# at most what is left). Bring back benchmarks/results/gpu_check_*, bench_moe_layer_cuda_*
# and calibration_h200_qwen3_* (on the project's device machine: copy them under $OUT).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

STAMP=$(date +%Y%m%d-%H%M%S)
RESULTS=benchmarks/results
LOG=$RESULTS/gpu_check_$STAMP.txt
BENCH_MD=$RESULTS/bench_moe_layer_cuda_$STAMP.md
BUDGET_S=${GPU_CHECK_BUDGET_S:-420}
CALIBRATION=$RESULTS/calibration_h200_qwen3_$STAMP.json
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
SITE=$PWD/.gpu_site
START_S=$SECONDS
# Import the package from this checkout also when it is not pip-installed (PY=... mode).
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
SUMMARY=()
SKIPPED=()
FAILED=0

log() { printf '\n===== %s (t=%ds) =====\n' "$*" "$((SECONDS - START_S))"; }

# run_step NAME LIMIT_S CMD...: run CMD with at most LIMIT_S seconds (and never past the
# budget), record its exit status.
run_step() {
  local name=$1 limit=$2 left rc t0
  shift 2
  left=$((BUDGET_S - (SECONDS - START_S)))
  if ((left < 10)); then
    SUMMARY+=("$name: SKIPPED (budget of ${BUDGET_S}s spent)")
    SKIPPED+=("$name (no budget left)")
    FAILED=1
    return 1
  fi
  ((limit > left)) && limit=$left
  log "$name (limit ${limit}s)"
  t0=$SECONDS
  timeout --kill-after=15 "$limit" "$@"
  rc=$?
  if ((rc == 124 || rc == 137)); then
    SUMMARY+=("$name: TIMED OUT after ${limit}s")
  else
    SUMMARY+=("$name: rc=$rc ($((SECONDS - t0))s)")
  fi
  ((rc == 0)) || FAILED=1
  return "$rc"
}

# shellcheck disable=SC2329  # invoked through bash -c (export -f) under timeout
setup_env() {
  if [[ -n ${WHEELS:-} ]]; then
    echo "offline: installing $(find "$WHEELS" -name '*.whl' | wc -l) wheels of $WHEELS" \
         "into $SITE (no index, no dependency resolution: the folder is the resolution)"
    mkdir -p "$SITE"
    if "$PY" -m pip --version >/dev/null 2>&1; then
      "$PY" -m pip install --quiet --no-index --no-deps --disable-pip-version-check \
        --target "$SITE" --upgrade "$WHEELS"/*.whl || return 2
    else
      echo "no pip for $PY: unpacking the wheels instead (no console scripts)"
      "$PY" - "$SITE" "$WHEELS"/*.whl <<'PYEOF' || return 2
import sys, zipfile
for wheel in sys.argv[2:]:
    zipfile.ZipFile(wheel).extractall(sys.argv[1])
PYEOF
    fi
    echo "building megatron_lrmoe._kernels in place with $PY (MAX_JOBS=$MAX_JOBS)"
    "$PY" setup.py build_ext --inplace
    return
  fi
  if [[ -n ${PY:-} ]]; then
    echo "PY=$PY given: skipping setup.sh, building the kernels in place"
    "$PY" setup.py build_ext --inplace
    return
  fi
  if [[ -x .venv/bin/python ]] \
     && ! .venv/bin/python -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
    echo "error: .venv exists but its torch sees no CUDA (a CPU venv?). Move it aside" \
         "(mv .venv .venv-cpu) and rerun, or pass PY=/path/to/cuda/python." >&2
    return 2
  fi
  LRMOE_GPU=1 bash scripts/setup.sh
}

# shellcheck disable=SC2329  # invoked through bash -c (export -f) under timeout
cuda_kernel_check() {
  "$PY" - <<'PYEOF'
"""CUDA backend of the compaction and combine kernels vs their pure-torch references."""
import sys

import torch

from megatron_lrmoe.ops import (
    combine_rows, combine_rows_backward, combine_rows_backward_reference, combine_rows_reference,
    cuda_kernels_available, describe_backend, scatter_add_rows, scatter_add_rows_reference,
    select_rows, select_rows_reference,
)

assert torch.cuda.is_available(), "no CUDA device"
print(describe_backend("cuda", "cuda"))
if not cuda_kernels_available():
    sys.exit("megatron_lrmoe._kernels has no CUDA backend (built without CUDA_HOME/nvcc?)")
dev = torch.device("cuda")
g = torch.Generator().manual_seed(0)
failures = []
# Sizes: the references and inputs are built on the CPU, within the step's 45 s with the
# interpreter's and CUDA's start-up. The largest cases keep what the check proves at a
# fraction of the work: a realistic pair count (8192 tokens x top-8: P 65536, T 8192) and a
# full hidden width (2048, many warp strides per row) in separate cases, and row counts
# past the kernels' 65536-block grid cap (P 600000, T 540000; M 600000), where their
# grid-stride loops run. 134 M elements per case (P 65536 x H 2048, as before) took 12-23 s
# per dtype for its CPU reference on 2 busy cores here; these sizes take 17 s in all on one
# (issue 25, item 6), so a few seconds on the 16 cores of the device machine.


def check(name, ok, detail=""):
    print(f"{'ok  ' if ok else 'FAIL'} {name} {detail}")
    if not ok:
        failures.append(name)


# select_rows: bitwise for every rule (the recipes are fixed operation for operation).
for rule, fraction in (("topk", 0.5), ("sample", 0.5), ("uniform", 0.5), ("hybrid", 0.5),
                       ("hybrid", 0.29), ("hybrid", 1.0)):
    for seed in range(3):
        sizes = torch.randint(0, 300, (64,), generator=g)
        sizes[:3] = torch.tensor([0, 1, 5000])
        off = torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)])
        metric = torch.rand(int(off[-1]), generator=g)
        metric[::7] = 0.0
        metric[1::5] = metric[0]  # ties
        quotas = (sizes.double() * torch.rand(64, generator=g)).long()
        quotas[3], quotas[4] = 0, 10**6
        ref = select_rows_reference(metric, off, quotas, rule=rule, seed=seed,
                                    hybrid_fraction=fraction)
        got = select_rows(metric.to(dev), off.to(dev), quotas.to(dev), rule=rule, seed=seed,
                          backend="cuda", hybrid_fraction=fraction)
        same = all(a.is_cuda and torch.equal(a.cpu(), b.cpu()) for a, b in zip(got, ref))
        check(f"select_rows {rule} f={fraction} seed={seed} P={int(off[-1])}", same)
        # K given by the caller (the region's plan): the path without a host read.
        got = select_rows(metric.to(dev), off.to(dev), quotas.to(dev), rule=rule, seed=seed,
                          backend="cuda", hybrid_fraction=fraction, n_kept=int(ref[0].numel()))
        same = all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(got, ref))
        check(f"select_rows {rule} f={fraction} seed={seed} with n_kept", same)

# combine_rows: bitwise (no atomics; the CPU recipe's roundings, explicitly rounded).
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    for p, t, h in ((0, 3, 8), (5, 1, 3), (65536, 8192, 128), (2048, 1024, 2048),
                    (600000, 540000, 8), (1000, 997, 130)):
        src = torch.randn(p, h, generator=g).to(dtype)
        token = torch.randint(0, t, (p,), generator=g)
        order = torch.sort(token, stable=True).indices
        offsets = torch.searchsorted(token[order], torch.arange(t + 1))
        for scale in (torch.rand(p, generator=g), torch.rand(p, generator=g).to(dtype)):
            ref = combine_rows_reference(src, scale, order, offsets)
            out = combine_rows(src.to(dev), scale.to(dev), order.to(dev), offsets.to(dev),
                               backend="cuda")
            check(f"combine_rows {dtype} P={p} T={t} H={h} scale={scale.dtype}",
                  out.is_cuda and torch.equal(out.cpu(), ref))
        # Backward: the kept rows bitwise (one rounded product), the dot products close
        # (the warp's summation order is not the CPU's).
        dy = torch.randn(t, h, generator=g).to(dtype)
        prob = torch.rand(p, generator=g)
        kept = torch.randperm(p, generator=g)[: p // 2].sort().values
        slot = torch.full((p,), -1, dtype=torch.long)
        slot[kept] = torch.arange(kept.numel())
        w = torch.rand(kept.numel(), generator=g) + 0.5
        for s, ww, k in ((None, None, p), (slot, w, kept.numel())):
            d_ref, o_ref = combine_rows_backward_reference(dy, src, token, prob, s, ww, k)
            d_got, o_got = combine_rows_backward(
                dy.to(dev), src.to(dev), token.to(dev), prob.to(dev),
                None if s is None else s.to(dev), None if ww is None else ww.to(dev), k,
                backend="cuda")
            tol = 1e-4 if dtype == torch.float32 else 2e-2
            check(f"combine_rows_backward {dtype} P={p} K={k} H={h}",
                  torch.equal(o_got.cpu(), o_ref)
                  and torch.allclose(d_got.cpu(), d_ref, rtol=tol, atol=tol * h ** 0.5))

# scatter_add_rows: unique destinations are bitwise; repeated ones use atomics (order
# not fixed): fp32 close, 16-bit within the per-add rounding bound.
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    for n, m, h in ((8, 0, 4), (4096, 4096, 512), (2048, 16384, 512), (64, 600000, 8),
                    (3, 500, 33)):
        out0 = torch.randn(n, h, generator=g).to(dtype)
        src = torch.randn(m, h, generator=g).to(dtype)
        for unique in (True, False):
            if unique and m > n:
                continue
            idx = torch.randperm(n, generator=g)[:m] if unique else torch.randint(0, n, (m,), generator=g)
            for scale in (None, torch.rand(m, generator=g)):
                ref = scatter_add_rows_reference(out0, idx, src, scale)
                out = out0.to(dev)
                scatter_add_rows(out, idx.to(dev), src.to(dev),
                                 None if scale is None else scale.to(dev), backend="cuda")
                out = out.cpu()
                name = (f"scatter_add_rows {dtype} N={n} M={m} H={h} "
                        f"{'unique' if unique else 'repeated'} scale={scale is not None}")
                if unique:
                    check(name, torch.equal(out, ref))
                    continue
                terms = src.double().abs() * (1.0 if scale is None else scale.double()[:, None])
                mag = out0.double().abs().index_add(0, idx, terms)
                adds = torch.bincount(idx, minlength=n).double()[:, None] + 1
                eps = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
                bound = adds * eps[dtype] * mag + 1e-30
                err = (out.double() - ref.double()).abs()
                check(name, bool((err <= 2 * bound).all()),
                      f"(max err / bound {float((err / bound).max()):.3g})")

print(f"\n{len(failures)} failure(s)")
sys.exit(1 if failures else 0)
PYEOF
}

main() {
  log "gpu_check $STAMP"
  echo "host: $(hostname)  repo: $(git rev-parse --short HEAD 2>/dev/null || echo '?')" \
       "(uncommitted changes: $(git status --porcelain 2>/dev/null | wc -l))"
  echo "TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST  budget=${BUDGET_S}s  log=$LOG"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || true
  command -v nvcc >/dev/null && nvcc --version | tail -n 2
  # The toolkit the kernels build against: torch's rule (nvcc's folder) is wrong for a
  # wrapper nvcc on PATH, which leaves the extension without its CUDA backend.
  # shellcheck source=scripts/lib/cuda_home.sh
  source scripts/lib/cuda_home.sh
  lrmoe_export_cuda_home

  if [[ -n ${WHEELS:-} ]]; then
    WHEELS=$(cd "$WHEELS" && pwd) || { echo "error: WHEELS=$WHEELS is not a folder" >&2; return 1; }
    PY=${PY:-python3}
    # The installed wheels and their console scripts (ninja) for every later step.
    export PYTHONPATH=$SITE:$PYTHONPATH PATH=$SITE/bin:$SITE/ninja/data/bin:$PATH
    SETUP_NAME="1 setup (offline: wheels of $WHEELS, kernels built in place)"
  else
    SETUP_NAME="1 setup (LRMOE_GPU=1 scripts/setup.sh)"
  fi
  export WHEELS SITE PY
  export -f setup_env cuda_kernel_check
  run_step "$SETUP_NAME" 200 bash -c setup_env
  PY=${PY:-.venv/bin/python}
  export PY
  if ! "$PY" -c 'import torch, megatron.core' 2>/dev/null; then
    echo "error: $PY cannot import torch and megatron.core; nothing else can run" >&2
    SUMMARY+=("environment: UNUSABLE ($PY)")
    FAILED=1
    return 1
  fi
  "$PY" - <<'PYEOF'
import torch
import megatron.core as mc
from megatron_lrmoe.ops import cuda_kernels_available, describe_backend
print("torch", torch.__version__, "CUDA", torch.version.cuda, "megatron-core", mc.__version__)
print("device:", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "NO CUDA")
print(describe_backend("auto", "cuda"), "| CUDA kernels built:", cuda_kernels_available())
PYEOF

  run_step "2 CUDA kernels vs references" 45 bash -c cuda_kernel_check
  run_step "3 sync-free LRMoE region (sync-debug mode error) and weight-stack cost" 60 \
    "$PY" scripts/dev/gpu_sync_check.py
  run_step "4 layer benchmark (Qwen3-30B-A3B-shaped, bf16, EP=1, grouped GEMMs)" 150 \
    "$PY" benchmarks/bench_moe_layer.py --device cuda --ep 1 --hidden 2048 --ffn 768 \
      --experts 128 --topk 8 --dtype bf16 --tokens 8192 --capacities inf,1.0,0.75 \
      --grouped-gemm on --routings skewed,router --warmup 2 --reps 7 --out "$BENCH_MD"
  run_step "5 calibration at the Qwen3-30B-A3B expert shape (bf16, one GPU)" 90 \
    "$PY" -m megatron_lrmoe.tools.calibrate --device cuda --dtype bf16 --hidden-size 2048 \
      --ffn-hidden-size 768 --experts 128 --topk 8 --tokens 4096 --rows 2048 \
      --local-experts 16 --gemm-rows 64,128,256,512,1024,2048,4096,8192 --rounds 3 \
      --output "$CALIBRATION"
  run_step "6 region at scale on CUDA (EP 8 plan, rank 3's share, bf16; numerics vs CPU)" 90 \
    "$PY" scripts/dev/region_at_scale_check.py --device cuda --ep 8 --rank 3 --tokens 4096 \
      --check-tokens 512 --reps 10 --warmup 2
  # CPU-backend tests and the nvcc compile check, with what is left of the budget.
  run_step "7 kernel test files (CPU backend, nvcc compile check)" 120 \
    "$PY" -m pytest -q -x -p no:cacheprovider tests/ops/test_kernels.py tests/ops/test_compaction_kernels.py
}

mkdir -p "$RESULTS"
{
  main
  log "summary"
  printf '%s\n' "${SUMMARY[@]}"
  echo "step 6 adds to the fake-CUDA test (which checks shapes, dtypes, devices, host reads" \
       "and GEMM rows without a GPU) only what a GPU shows: numerics on the device, syncs" \
       "inside kernels, kernel speed, real memory"
  echo "not measured here: expert parallelism across ranks (one GPU cannot run NCCL EP > 1);" \
       "Transformer Engine (not installed: no TEGroupedMLP baseline, no TE grouped linear)"
  ((${#SKIPPED[@]})) && printf 'skipped: %s\n' "${SKIPPED[@]}"
  if ((FAILED == 0)); then
    echo "gpu_check: all steps passed"
  else
    echo "gpu_check: FAILED (see the steps above)"
  fi
  echo "output: $LOG"
  exit "$FAILED"
} 2>&1 | tee "$LOG"
exit "${PIPESTATUS[0]}"
