#!/usr/bin/env bash
# Checkpoint-policy overhead in porter (bench/checkpoint_bench) and in PyTorch 1.13
# (torch.utils.checkpoint, bench/compare_checkpoint_pytorch.py) on the same GPT step; prints
# each policy's median step time relative to `none`, and porter's activation peaks.
# Usage: bench/compare_checkpoint.sh [build-dir]   (default build/release)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build/release}
threads=${PORTER_BENCH_THREADS:-2}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

echo "== porter ($build/bench/checkpoint_bench, $threads threads)"
PORTER_BENCH_THREADS=$threads "$build/bench/checkpoint_bench" \
  --benchmark_out="$out/porter.json" --benchmark_out_format=json | grep -E "median|Benchmark|---|Interleaved"

# glibc malloc would mmap every large tensor and page-fault it in again each step (PyTorch's
# cpu allocator does not cache); without mmap and trimming PyTorch's step is 2.7x faster here.
echo "== PyTorch (/usr/bin/python3, $threads threads, MALLOC_MMAP_MAX_=0)"
MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=68719476736 /usr/bin/python3 bench/compare_checkpoint_pytorch.py --threads "$threads" \
  --rounds "${PYTORCH_ROUNDS:-3}" | tee "$out/pytorch.json"

/usr/bin/python3 - "$out/porter.json" "$out/pytorch.json" <<'PY'
import json, sys
porter = json.load(open(sys.argv[1]))["benchmarks"]
torch = json.loads(open(sys.argv[2]).read().strip().splitlines()[-1])
med = {b["run_name"].split("/")[1]: b for b in porter if b.get("aggregate_name") == "median"}
base = med["none"]["real_time"]
print(f"\n{'policy':16s} {'step s':>8s} {'x none':>7s} {'peak act MiB':>13s} "
      f"{'predicted':>10s} {'recompute s':>12s} {'predicted':>10s}")
for name, b in med.items():
    print(f"{name:16s} {b['real_time'] / 1e3:8.3f} {b['real_time'] / base:7.2f} "
          f"{b['peak_act_MiB']:13.1f} {b['predicted_act_MiB']:10.1f} "
          f"{b['recompute_s']:12.3f} {b['predicted_recompute_s']:10.3f}   {b.get('label', '')}")
inter = [b for b in porter if b["name"].startswith("BM_Interleaved")]
if inter:
    c = inter[0]
    names = [k[:-2] for k in c if k.endswith("_x")]
    print(f"\ninterleaved ({c['iterations']} rounds, one step per policy per round):")
    for name in names:
        print(f"  {name:16s} {c[name + '_s']:8.3f} s  {c[name + '_x']:5.2f}x none (median of per-round ratios)")
print(f"\nPyTorch {torch['framework']}:")
for m, r in torch["ratio_to_none"].items():
    print(f"  {m:6s} {torch['median_s'][m]:8.3f} s  {r:5.2f}x none")
PY
