#!/usr/bin/env bash
# Runs tests/kernels/cuda_kernels_test.cc on a machine WITHOUT a GPU, with the cuda kernels
# emulated on host threads. Opt-in, not part of ctest: it checks the logic of porter's kernels
# (indexing, warp/block reductions, dtype handling, the attention orchestration in
# kernels/cuda/cuda_kernels.cc, and the row-major -> cuBLASLt operand mapping against cuBLASLt's
# column-major definition), never nvcc's code, cuBLASLt itself, races, launch limits or speed.
#
# How: the .cu files are copied with each kernel<<<grid, block, 0, l.stream>>>(...) rewritten
# as emu_launch(kernel, grid, block, ...) and compiled by g++ against fake/cuda_runtime.h
# (one std::thread per CUDA thread, one block at a time, barriers for __syncthreads and the
# warp intrinsics). emu_support.cc provides a "cuda" device that is a cpu device, cuBLASLt
# by definition, and stubs for the runtime calls. Needs a release build (for the cpu kernels):
#   cmake --preset release && cmake --build --preset release --target porter_kernels
#   tests/kernels/cuda_emu/run.sh [gtest args]     # ~20 min on 2 busy cores; the 300001-element
#                                             # reductions take most: filter with --gtest_filter
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../../.." && pwd)
BUILD=${BUILD:-$ROOT/build/release}
WORK=${WORK:-$BUILD/cuda_emu}
mkdir -p "$WORK"
CUDA_INC=${CUDA_INC:-/usr/local/cuda/include}
FLAGS=(-std=c++20 -O1 -g -w -ffp-contract=off -I"$HERE/fake" -I"$ROOT" -I"$BUILD/generated" -isystem "$CUDA_INC"
       -DSPDLOG_COMPILED_LIB -DSPDLOG_FMT_EXTERNAL -DSPDLOG_SHARED_LIB -DFMT_SHARED)

python3 - "$ROOT" "$WORK" <<'PY'
import re, sys
root, work = sys.argv[1], sys.argv[2]
for f in ['elementwise', 'rowwise', 'attention', 'flash_attention', 'rmsnorm_rope_swiglu',
          'relu_silu_mse']:
    s = open(f'{root}/kernels/cuda/{f}.cu').read()
    def rep(m):
        parts = [p.strip() for p in m.group(2).split(',')]
        assert len(parts) == 4 and parts[2] == '0' and parts[3] == 'l.stream', parts
        return f'emu_launch({m.group(1)}, {parts[0]}, {parts[1]}, '
    s = re.sub(r'(\w+)<<<(.*?)>>>\(\s*', rep, s, flags=re.S)
    i = s.index('namespace porter::kernels::cuda {')
    s = (s[:i] + '#undef PORTER_GPU_CHECK_LAUNCH\n'
         '#define PORTER_GPU_CHECK_LAUNCH(w, d) do { } while (0)\n' + s[i:])
    open(f'{work}/{f}.cc', 'w').write(s)
PY

pids=()
for f in elementwise rowwise attention flash_attention rmsnorm_rope_swiglu relu_silu_mse; do
  g++ "${FLAGS[@]}" -c "$WORK/$f.cc" -o "$WORK/$f.o" & pids+=($!)
done
g++ "${FLAGS[@]}" -c "$HERE/emu_support.cc" -o "$WORK/emu_support.o" & pids+=($!)
g++ "${FLAGS[@]}" -c "$ROOT/kernels/cuda/cuda_kernels.cc" -o "$WORK/cuda_kernels.o" & pids+=($!)
g++ "${FLAGS[@]}" -c "$ROOT/tests/kernels/cuda_kernels_test.cc" -o "$WORK/test.o" & pids+=($!)
for p in "${pids[@]}"; do wait "$p"; done

# Our objects come first, so the archives' real cuda objects are never pulled in.
g++ -o "$WORK/cuda_kernels_emu_test" "$WORK/test.o" "$WORK/cuda_kernels.o" \
  "$WORK/elementwise.o" "$WORK/rowwise.o" "$WORK/attention.o" "$WORK/flash_attention.o" \
  "$WORK/rmsnorm_rope_swiglu.o" "$WORK/relu_silu_mse.o" \
  "$WORK/emu_support.o" "$BUILD/kernels/libporter_kernels.a" "$BUILD/tensor/libporter_tensor.a" \
  "$BUILD/config/libporter_config.a" "$BUILD/memory/libporter_memory.a" \
  "$BUILD/base/libporter_base.a" -ldnnl -lspdlog -lfmt -lgtest -lgtest_main -lgomp -lpthread
exec "$WORK/cuda_kernels_emu_test" "$@"
