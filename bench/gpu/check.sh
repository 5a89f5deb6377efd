#!/usr/bin/env bash
# The one script a GPU machine runs: builds the release preset with CUDA, runs every test
# (the cuda kernel tests compare against the cpu kernels only when a GPU is visible), runs
# the GPU benchmarks that exist, and leaves logs and results in $OUT (default ./gpu-out).
# Each stage is time-boxed so the whole run stays under ~7.5 minutes; a failing stage is
# recorded in summary.txt and the later stages still run where they can.
#
#   OUT=/some/dir bench/gpu/check.sh        # exit status: 0 only if every stage passed
set -euo pipefail

cd "$(dirname "$0")/../.."
ROOT=$(pwd)
OUT=${OUT:-$ROOT/gpu-out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
START=$(date +%s)
BUDGET_S=${CHECK_BUDGET_S:-450}
JOBS=${JOBS:-$(nproc)}
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
FAILED=0

[[ -d /usr/local/cuda/bin ]] && export PATH="/usr/local/cuda/bin:$PATH"

log() { echo "[check $(date -u +%H:%M:%S)] $*" | tee -a "$SUMMARY"; }

# Seconds left of the budget, minus a reserve for the stages after this one.
left() { echo $((BUDGET_S - ($(date +%s) - START) - ${1:-0})); }

# stage NAME RESERVE_S CMD...: runs CMD under a timeout, teeing into $OUT/NAME.log.
stage() {
  local name=$1 reserve=$2
  shift 2
  local limit
  limit=$(left "$reserve")
  if ((limit < 10)); then
    log "SKIP $name: out of time budget"
    FAILED=1
    return 1
  fi
  log "START $name (limit ${limit}s): $*"
  local rc=0
  timeout --signal=TERM --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1 || rc=$?
  tail -n 40 "$OUT/$name.log" || true
  if ((rc == 0)); then
    log "PASS $name ($(($(date +%s) - START))s elapsed)"
  else
    log "FAIL $name: exit $rc ($(($(date +%s) - START))s elapsed; 124 means timed out)"
    FAILED=1
  fi
  return $rc
}

# --- the machine ----------------------------------------------------------------------------
{
  echo "date: $(date -u)"
  echo "host: $(hostname)"
  echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown)"
  echo "nproc: $(nproc)"
  command -v nvcc >/dev/null && nvcc --version | tail -n 2
  cmake --version | head -n 1
  g++ --version | head -n 1
} >"$OUT/machine.txt" 2>&1 || true
if command -v nvidia-smi >/dev/null; then
  nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1 || log "nvidia-smi failed"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv \
    >>"$OUT/nvidia-smi.txt" 2>&1 || true
else
  log "nvidia-smi not found"
fi

# --- build ----------------------------------------------------------------------------------
launcher_args=()
if ! command -v ccache >/dev/null; then
  launcher_args=(-DCMAKE_CXX_COMPILER_LAUNCHER= -DCMAKE_CUDA_COMPILER_LAUNCHER=)
fi
stage configure 240 cmake --preset release -DPORTER_CUDA=ON "${launcher_args[@]}" || true
built=0
if [[ -f build/release/build.ninja ]]; then
  if stage build 150 cmake --build --preset release -j "$JOBS"; then built=1; fi
  cp build/release/.ninja_log "$OUT/ninja_log.txt" 2>/dev/null || true
fi

# --- tests ----------------------------------------------------------------------------------
if ((built)); then
  # The cuda kernel tests first and alone, so their result is there even if the full suite
  # runs out of time.
  if [[ -x build/release/tests/kernels/kernels_cuda_kernels_test ]]; then
    stage cuda_kernels_test 120 build/release/tests/kernels/kernels_cuda_kernels_test \
      --gtest_output="xml:$OUT/cuda_kernels_test.xml" || true
  else
    log "FAIL kernels_cuda_kernels_test was not built"
    FAILED=1
  fi
  stage ctest 45 ctest --preset release -j "$JOBS" --timeout 120 \
    --output-junit "$OUT/ctest.xml" || true
fi

# --- the engine on the GPU: the demo run on the cuda device --------------------------------
if ((built)); then
  sed 's/"type": "cpu", "memory_limit": "80MiB", "threads": 1/"type": "cuda", "memory_limit": "80MiB"/' \
    examples/gpt-tiny.json >"$OUT/gpt-tiny-cuda.json"
  stage train_cuda 30 build/release/cli/porter train --config "$OUT/gpt-tiny-cuda.json" \
    --steps 100 --report "$OUT/train-cuda-report.json" --trace "$OUT/train-cuda-trace.json" || true
fi

# --- GPU benchmarks -------------------------------------------------------------------------
if ((built)); then
  found=0
  for b in build/release/bench/cuda_*_bench; do
    [[ -x $b ]] || continue
    found=1
    name=$(basename "$b")
    stage "$name" 5 "$b" --benchmark_min_time=0.05 --benchmark_out="$OUT/$name.json" \
      --benchmark_out_format=json || true
  done
  ((found)) || log "no GPU benchmarks built"
fi

log "total $(($(date +%s) - START))s; overall $( ((FAILED)) && echo FAIL || echo PASS)"
exit $FAILED
