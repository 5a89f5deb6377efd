#!/usr/bin/env bash
# The machine a benchmark table was measured on: the CPU model, its core count, the vector and
# matrix extensions that decide oneDNN's kernels, and the ISA oneDNN itself detected.
# Usage: bench/machine_info.sh [build-dir]   (default build/release; needs nn_kernels_bench)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build/release}
model=$(lscpu | sed -n 's/^Model name: *//p' | head -1)
family=$(lscpu | sed -n 's/^CPU family: *//p' | head -1)
model_id=$(lscpu | sed -n 's/^Model: *//p' | head -1)
cpus=$(nproc)
flags=$(lscpu | sed -n 's/^Flags: *//p')
has=()
for f in avx2 avx512f avx512_bf16 avx512_fp16 amx_tile amx_bf16; do
  [[ " $flags " == *" $f "* ]] && has+=("$f")
done
echo "cpu: $model (family $family, model $model_id), $cpus cpus, ${has[*]:-no AVX2}"
if [[ -x "$build/bench/nn_kernels_bench" ]]; then
  isa=$(ONEDNN_VERBOSE=1 "$build/bench/nn_kernels_bench" --benchmark_filter='BM_Matmul/m:2048/n:2304/k:768/ta:0/tb:0/bf16:0' \
          --benchmark_min_time=0.01 2>&1 | sed -n 's/^onednn_verbose,info,cpu,isa://p' | head -1)
  echo "oneDNN isa: ${isa:-unknown}"
else
  echo "oneDNN isa: unknown (build $build/bench/nn_kernels_bench first)"
fi
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
