#!/usr/bin/env bash
# The GPT training step (forward + backward, no optimizer) in porter and in PyTorch 1.13 on
# the same model, shapes and thread count, f32 and bf16 (PyTorch under autocast); prints the
# medians and porter / PyTorch per dtype.
# porter runs under each of $KERNEL_CHOICES (default "exact fastest": porter.device.kernel_choice,
# Note [Kernel table]) and each is set against the same PyTorch run.
# Usage: bench/compare_step.sh [build-dir]   (default build/release; build gpt_step_bench first)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build/release}
threads=${PORTER_BENCH_THREADS:-2}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

choices=${KERNEL_CHOICES:-exact fastest}
for choice in $choices; do
  echo "== porter ($build/bench/gpt_step_bench, $threads threads, kernel_choice $choice)"
  PORTER_BENCH_THREADS=$threads PORTER_BENCH_KERNEL_CHOICE=$choice "$build/bench/gpt_step_bench" \
    --benchmark_out="$out/porter_$choice.json" --benchmark_out_format=json | grep -E "median|Benchmark|---"
done

# glibc malloc would mmap every large tensor and page-fault it in again each step (PyTorch's
# cpu allocator does not cache); MALLOC_MMAP_MAX_=0 and no trimming run PyTorch at its best.
for dtype in f32 bf16; do
  echo "== PyTorch $dtype (/usr/bin/python3, OPENBLAS_CORETYPE=SkylakeX, $threads threads)"
  MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=68719476736 OPENBLAS_CORETYPE=SkylakeX \
    /usr/bin/python3 bench/compare_pytorch.py --threads "$threads" --dtype "$dtype" \
    --steps "${PYTORCH_STEPS:-5}" | tee "$out/pytorch_$dtype.json"
done

/usr/bin/python3 - "$out" $choices <<'PY'
import json, os, sys
out = sys.argv[1]
print()
for choice, dtype in [(c, d) for c in sys.argv[2:] for d in ("f32", "bf16")]:
    porter = json.load(open(os.path.join(out, f"porter_{choice}.json")))["benchmarks"]
    med = {b["label"]: b for b in porter if b.get("aggregate_name") == "median"}
    path = os.path.join(out, f"pytorch_{dtype}.json")
    if dtype not in med or not os.path.exists(path):
        continue
    torch = json.loads(open(path).read().strip().splitlines()[-1])
    t = torch["median_s"]
    b = med[dtype]
    s = b["real_time"] / 1e3  # ms -> s
    peak = b["sgemm_peak_GFLOP/s"]
    rate = b["model_TFLOP"] * 1e3 / s
    against = "PyTorch f32" if dtype == "f32" else "PyTorch autocast bf16"
    print(f"{choice:7s} {dtype:4s}: porter {s:.3f} s, {against} ({torch['framework']}) {t:.3f} s: "
          f"porter / PyTorch = {s / t:.2f}x  (porter {rate:.0f} GFLOP/s, {100 * rate / peak:.0f}% "
          f"of oneDNN f32 sgemm 2048^3 {peak:.0f} GFLOP/s)")
PY
