// Whole-array reductions over host memory that give the cpu device's bits.
#pragma once

#include <cstdint>

#include "tensor/dtype.h"

namespace porter::kernels {

// The cpu device's squared_norm and nonfinite_count over n values of `dtype` (f32, bf16 or
// f16) in host memory, on up
// to `threads` threads: the same chunks, lanes and order as the kernels (Note [Cpu
// determinism] in kernels/cpu/reduce.cc), so the same bits as the cpu device's
// Kernels::squared_norm and nonfinite_count of the same values. The host-side reductions of
// streamed gradients (Note [Streamed gradients] in zero/host_grads.h).
float host_squared_norm(const void* x, tensor::DType dtype, int64_t n, int threads);
float host_nonfinite_count(const void* x, tensor::DType dtype, int64_t n, int threads);

}  // namespace porter::kernels
