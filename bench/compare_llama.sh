#!/usr/bin/env bash
# The Llama training step (forward + backward, no optimizer) in porter and in PyTorch 1.13 on
# the same model, shapes and thread count, f32 and bf16: both medians, porter / PyTorch, and
# memory side by side.
# Usage: bench/compare_llama.sh [build-dir]   (default build/release; build llama_step_bench first)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build/release}
threads=${PORTER_BENCH_THREADS:-2}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

echo "== porter ($build/bench/llama_step_bench, $threads threads)"
PORTER_BENCH_THREADS=$threads "$build/bench/llama_step_bench" \
  --benchmark_out="$out/porter.json" --benchmark_out_format=json | grep -E "median|Benchmark|---"

# glibc malloc would mmap every large tensor and page-fault it in again each step (PyTorch's
# cpu allocator does not cache); MALLOC_MMAP_MAX_=0 and no trimming run PyTorch at its best,
# and keep its peak in the resident set that compare_llama_pytorch.py reads.
for dtype in f32 bf16; do
  echo "== PyTorch $dtype (/usr/bin/python3, OPENBLAS_CORETYPE=SkylakeX, $threads threads)"
  MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=68719476736 OPENBLAS_CORETYPE=SkylakeX \
    /usr/bin/python3 bench/compare_llama_pytorch.py --threads "$threads" --dtype "$dtype" \
    --steps "${PYTORCH_STEPS:-5}" | tee "$out/pytorch_$dtype.json"
done

/usr/bin/python3 - "$out" <<'PY'
import json, os, sys
out = sys.argv[1]
porter = json.load(open(os.path.join(out, "porter.json")))["benchmarks"]
med = {b["label"]: b for b in porter if b.get("aggregate_name") == "median"}
print()
print("dtype | porter step | PyTorch step | porter / PyTorch | porter tokens/s | PyTorch tokens/s"
      " | porter GFLOP/s (% of same-run gemm peak) | porter main-thread cpu / wall | PyTorch cpu"
      " / (wall x threads)")
rows = []
for dtype in ("f32", "bf16"):
    path = os.path.join(out, f"pytorch_{dtype}.json")
    if dtype not in med or not os.path.exists(path):
        continue
    b = med[dtype]
    t = json.loads(open(path).read().strip().splitlines()[-1])
    s = b["real_time"] / 1e3  # ms -> s
    tokens = b["tokens"]  # per step
    rate = b["model_TFLOP"] * 1e3 / s
    peak = b["sgemm_peak_GFLOP/s" if dtype == "f32" else "bf16_gemm_peak_GFLOP/s"]
    print(f"{dtype:5s} | {s:.3f} s | {t['median_s']:.3f} s | {s / t['median_s']:.2f}x | "
          f"{tokens / s:.0f} | {tokens / t['median_s']:.0f} | "
          f"{rate:.0f} ({100 * rate / peak:.0f}% of "
          f"{peak:.0f}) | {b['cpu_time'] / b['real_time']:.2f} | {t['cpu_util']:.2f}")
    rows.append((dtype, b, t))
print()
print("dtype | porter activation peak | PyTorch saved for backward (of it weight casts)"
      " | porter step peak - params (reserved) | PyTorch anon RSS growth (peak RSS growth)"
      " | params porter / PyTorch  (MiB)")
for dtype, b, t in rows:
    print(f"{dtype:5s} | {b['act_peak_MiB']:.1f} | {t['saved_MiB']:.1f} "
          f"({t['saved_weight_casts_MiB']:.1f})"
          f" | {b['peak_MiB'] - b['params_MiB']:.1f}"
          f" ({b['reserved_peak_MiB'] - b['params_MiB']:.1f})"
          f" | {t['anon_growth_MiB']:.1f}"
          f" ({t['rss_growth_MiB']:.1f})"
          f" | {b['params_MiB']:.1f} / {t['params_MiB']:.1f}")
PY
