// Device-side helpers shared by the nn .cu files: dtype-dispatched loads and stores (Note
// [Runtime dtypes in cuda kernels] in kernels/cuda/launch.h), launch geometry and deterministic
// warp/block reductions.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "memory/cuda_check.h"
#include "kernels/cuda/launch.h"
#include "tensor/dtype.h"

namespace porter::kernels::cuda {

inline constexpr int kBlock = 256;
inline constexpr int kWarp = 32;

__device__ __forceinline__ float ld(const DevPtr& p, int64_t i) {
  switch (p.dtype) {
    case DType::kBF16: return bf16_to_f32(static_cast<const uint16_t*>(p.data)[i]);
    case DType::kF16: return __half2float(static_cast<const __half*>(p.data)[i]);
    default: return static_cast<const float*>(p.data)[i];
  }
}

// bf16 rounds to nearest-even with porter's own conversion, so it matches the cpu bit for bit.
__device__ __forceinline__ void st(const DevPtr& p, int64_t i, float v) {
  switch (p.dtype) {
    case DType::kBF16: static_cast<uint16_t*>(p.data)[i] = f32_to_bf16(v); break;
    case DType::kF16: static_cast<__half*>(p.data)[i] = __float2half_rn(v); break;
    default: static_cast<float*>(p.data)[i] = v; break;
  }
}

// Blocks for a grid-stride loop over n elements (n > 0).
inline unsigned grid_for(int64_t n, int block = kBlock) {
  int64_t blocks = (n + block - 1) / block;
  constexpr int64_t kMaxBlocks = int64_t{1} << 20;
  return static_cast<unsigned>(blocks < kMaxBlocks ? blocks : kMaxBlocks);
}

#define PORTER_GRID_STRIDE(i, n)                                                         \
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < (n); \
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)

// Butterfly reductions: every lane ends with the same value, in the same order on every run.
__device__ __forceinline__ float warp_sum(float v) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2)
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// Block-wide sum or max; every thread gets the result. `scratch` holds kWarp floats.
// blockDim.x must be a multiple of 32. Deterministic: warps reduce, then warp 0 reduces the
// warp results in a fixed order.
template <bool kMax>
__device__ float block_reduce(float v, float* scratch) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int warps = blockDim.x / kWarp;
  v = kMax ? warp_max(v) : warp_sum(v);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float r = lane < warps ? scratch[lane] : (kMax ? -INFINITY : 0.0f);
  r = kMax ? warp_max(r) : warp_sum(r);
  return r;
}

}  // namespace porter::kernels::cuda
