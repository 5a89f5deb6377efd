// The layouts of the kernels' workspace buffers (Note [Kernel workspace] in kernels.h): one
// definition for the kernels that carve them and for the sizes kernels.h publishes.
#pragma once

#include <cstddef>
#include <cstdint>

#include "nn/dtype.h"
#include "nn/kernels.h"

namespace porter::nn::workspace_layout {

// The cpu attention handles queries in blocks of this many rows (Note [Causal row blocks]).
inline constexpr int64_t kCpuAttentionRowBlock = 64;

// cpu attention_forward, in f32 elements, carved in this order.
struct CpuAttentionForward {
  size_t qkv_elems = 0;  // an f32 copy of qkv, when qkv is not f32
  size_t out_elems = 0;  // an f32 out, narrowed into out at the end, when out is not f32
  size_t total_elems() const { return qkv_elems + out_elems; }
};

// cpu attention_backward, in f32 elements, carved in this order.
struct CpuAttentionBackward {
  size_t ds_elems = 0;    // dP, then dS, of one row block: (B, heads, rows, T)
  size_t qkv_elems = 0;   // f32 copies of the arguments that are not f32
  size_t dout_elems = 0;
  size_t dqkv_elems = 0;
  size_t total_elems() const { return ds_elems + qkv_elems + dout_elems + dqkv_elems; }
};

inline size_t f32_copy_elems(DType dtype, int64_t numel) {
  return dtype == DType::kF32 ? 0 : static_cast<size_t>(numel);
}

inline CpuAttentionForward cpu_attention_forward(const AttentionCall& c) {
  const int64_t n = c.batch * c.seq * c.channels;
  return {f32_copy_elems(c.qkv, 3 * n), f32_copy_elems(c.out, n)};
}

inline CpuAttentionBackward cpu_attention_backward(const AttentionCall& c) {
  const int64_t n = c.batch * c.seq * c.channels;
  const int64_t rows = c.seq < kCpuAttentionRowBlock ? c.seq : kCpuAttentionRowBlock;
  return {static_cast<size_t>(c.batch * c.heads * rows * c.seq), f32_copy_elems(c.qkv, 3 * n),
          f32_copy_elems(c.out, n), f32_copy_elems(c.dqkv, 3 * n)};
}

// cpu matmul with f16 operands, in f32 elements, carved in this order (Note [Cpu f16 matmul]
// in cpu_matmul.cc). Other dtypes take none.
struct CpuMatmul {
  size_t a_elems = 0;    // an f32 copy of a, same layout
  size_t b_elems = 0;    // an f32 copy of b, same layout
  size_t out_elems = 0;  // an f32 out, narrowed into out at the end, when out is f16
  size_t total_elems() const { return a_elems + b_elems + out_elems; }
};

inline CpuMatmul cpu_matmul(const MatmulCall& c) {
  if (c.ab != DType::kF16 || c.batch == 0 || c.m == 0 || c.n == 0 || c.k == 0) return {};
  return {static_cast<size_t>(c.batch * c.m * c.k), static_cast<size_t>(c.batch * c.k * c.n),
          c.out == DType::kF16 ? static_cast<size_t>(c.batch * c.m * c.n) : 0};
}

// cuda sub-buffers start on 256-byte boundaries (cuBLASLt's preferred alignment).
inline size_t cuda_padded_elems(size_t elems) { return (elems + 63) / 64 * 64; }

// cuda attention: f32 per-head matrices (B, heads, T, head_dim), padded, then (backward) dP.
// Forward carves q, k, v, o; backward q, k, v, dO, dQ, dK, dV, dP (Note [Cuda attention]).
inline constexpr size_t kCudaForwardHeadBuffers = 4;
inline constexpr size_t kCudaBackwardHeadBuffers = 7;

struct CudaAttention {
  size_t head_elems = 0;   // one per-head matrix: B * T * C, padded
  size_t probs_elems = 0;  // dP: B * heads * T * T, padded
};

inline CudaAttention cuda_attention(const AttentionCall& c) {
  return {cuda_padded_elems(static_cast<size_t>(c.batch * c.seq * c.channels)),
          cuda_padded_elems(static_cast<size_t>(c.batch * c.heads * c.seq * c.seq))};
}

// The cuda sum / squared_norm partials: one f32 per block, at most this many blocks
// (cuda_rowwise.cu's kMaxPartials; cuda_kernels.cc checks that they agree).
inline constexpr size_t kCudaReductionPartials = 1024;

}  // namespace porter::nn::workspace_layout
