#!/usr/bin/env bash
# The GPT training step (forward + backward, no optimizer) in porter and in PyTorch 1.13 on
# the same model, shapes and thread count; prints both medians and porter / PyTorch.
# Usage: bench/compare_step.sh [build-dir]   (default build/release; build gpt_step_bench first)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build/release}
threads=${PORTER_BENCH_THREADS:-2}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

echo "== porter ($build/bench/gpt_step_bench, $threads threads)"
PORTER_BENCH_THREADS=$threads "$build/bench/gpt_step_bench" \
  --benchmark_out="$out/porter.json" --benchmark_out_format=json | grep -E "median|Benchmark|---"

echo "== PyTorch (/usr/bin/python3, OPENBLAS_CORETYPE=SkylakeX, $threads threads)"
# glibc malloc would mmap every large tensor and page-fault it in again each step (PyTorch's
# cpu allocator does not cache); MALLOC_MMAP_MAX_=0 and no trimming run PyTorch at its best.
MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=68719476736 OPENBLAS_CORETYPE=SkylakeX /usr/bin/python3 bench/compare_pytorch.py --threads "$threads" \
  --steps "${PYTORCH_STEPS:-5}" | tee "$out/pytorch.json"

/usr/bin/python3 - "$out/porter.json" "$out/pytorch.json" <<'PY'
import json, sys
porter = json.load(open(sys.argv[1]))["benchmarks"]
torch = json.loads(open(sys.argv[2]).read().strip().splitlines()[-1])
med = {b["label"]: b for b in porter if b.get("aggregate_name") == "median"}
t = torch["median_s"]
print(f"\nPyTorch {torch['framework']} f32 median step: {t:.3f} s")
for dtype in ("f32", "bf16"):
    if dtype not in med:
        continue
    b = med[dtype]
    s = b["real_time"] / 1e3  # ms -> s
    peak = b["sgemm_peak_GFLOP/s"]
    rate = b["model_TFLOP"] * 1e3 / s
    print(f"porter {dtype:4s} median step: {s:.3f} s  = {s / t:.2f}x PyTorch f32  "
          f"({rate:.0f} GFLOP/s, {100 * rate / peak:.0f}% of oneDNN sgemm {peak:.0f} GFLOP/s)")
PY
