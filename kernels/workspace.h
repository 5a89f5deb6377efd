// The layouts of the kernels' workspace buffers (Note [Kernel workspace] in kernels.h): one
// definition for the kernels that carve them and for the sizes kernels.h publishes.
#pragma once

#include <cstddef>
#include <cstdint>

#include "tensor/dtype.h"
#include "kernels/kernels.h"

namespace porter::kernels::workspace_layout {

// The cpu attention handles queries in blocks of this many rows (Note [Causal row blocks]).
inline constexpr int64_t kCpuAttentionRowBlock = 64;

// Whether a cpu attention call multiplies in bf16 on packed per-head copies (Note [Bf16
// attention] in kernels/cpu/attention.cc) or in f32, widening what is not f32 (Note [Attention
// scratch]). Forward needs bf16 qkv; backward bf16 qkv and dout (call.out).
inline bool cpu_attention_forward_bf16(const AttentionCall& c) { return c.qkv == DType::kBF16; }
inline bool cpu_attention_backward_bf16(const AttentionCall& c) {
  return c.qkv == DType::kBF16 && c.out == DType::kBF16;
}

// cpu attention_forward, in bytes, carved in this order: the f32 path (Note [Attention
// scratch]) uses the first two fields, the bf16 path (Note [Bf16 attention]) the other four.
// The f32 buffers come first and every size is a whole number of its elements, so each
// buffer is aligned to its element type. R = min(kCpuAttentionRowBlock, T).
struct CpuAttentionForward {
  bool bf16 = false;
  size_t qkv_bytes = 0;        // an f32 copy of qkv, when qkv is not f32
  size_t out_bytes = 0;        // an f32 out, narrowed into out at the end, when out is not f32
  size_t scores_bytes = 0;     // f32 scores of one row block, (B, heads, R, T)
  size_t out_block_bytes = 0;  // f32 out of one row block, (B, heads, R, hd)
  size_t probs16_bytes = 0;    // bf16 probabilities of one row block, (B, heads, R, T)
  size_t packed_bytes = 0;     // bf16 Q in row blocks of (B, heads, R, hd), K and V as
                               // (B, heads, T, hd): 3·N·C values
  size_t total_bytes() const {
    return qkv_bytes + out_bytes + scores_bytes + out_block_bytes + probs16_bytes + packed_bytes;
  }
};

// cpu attention_backward, in bytes, carved in this order (same rules as forward).
struct CpuAttentionBackward {
  bool bf16 = false;
  size_t dp_bytes = 0;        // f32 dP of one row block, (B, heads, R, T); the f32 path
                              // turns it into dS in place
  size_t qkv_bytes = 0;       // f32 path: f32 copies of the arguments that are not f32
  size_t dout_bytes = 0;
  size_t dqkv_bytes = 0;
  size_t dkv_bytes = 0;       // bf16 path: f32 dK and dV, (B, heads, T, hd) each
  size_t dq_block_bytes = 0;  // f32 dQ of one row block, (B, heads, R, hd)
  size_t probs16_bytes = 0;   // bf16 P, then dS, of one row block, (B, heads, R, T)
  size_t packed_bytes = 0;    // bf16 Q and dout in row blocks, K and V as (B, heads, T, hd):
                              // 4·N·C values
  size_t total_bytes() const {
    return dp_bytes + qkv_bytes + dout_bytes + dqkv_bytes + dkv_bytes + dq_block_bytes +
           probs16_bytes + packed_bytes;
  }
};

inline size_t f32_copy_bytes(DType dtype, int64_t numel) {
  return dtype == DType::kF32 ? 0 : static_cast<size_t>(numel) * 4;
}

inline int64_t cpu_attention_block_rows(const AttentionCall& c) {
  return c.seq < kCpuAttentionRowBlock ? c.seq : kCpuAttentionRowBlock;
}

inline CpuAttentionForward cpu_attention_forward(const AttentionCall& c) {
  const int64_t n = c.batch * c.seq * c.channels;
  const int64_t rows = cpu_attention_block_rows(c);
  CpuAttentionForward w;
  if (!cpu_attention_forward_bf16(c)) {
    w.qkv_bytes = f32_copy_bytes(c.qkv, 3 * n);
    w.out_bytes = f32_copy_bytes(c.out, n);
    return w;
  }
  const auto block = static_cast<size_t>(c.batch * c.heads * rows * c.seq);
  w.bf16 = true;
  w.scores_bytes = 4 * block;
  w.out_block_bytes = 4 * static_cast<size_t>(c.batch * rows * c.channels);
  w.probs16_bytes = 2 * block;
  w.packed_bytes = 2 * 3 * static_cast<size_t>(n);
  return w;
}

inline CpuAttentionBackward cpu_attention_backward(const AttentionCall& c) {
  const int64_t n = c.batch * c.seq * c.channels;
  const int64_t rows = cpu_attention_block_rows(c);
  const auto block = static_cast<size_t>(c.batch * c.heads * rows * c.seq);
  CpuAttentionBackward w;
  w.dp_bytes = 4 * block;
  if (!cpu_attention_backward_bf16(c)) {
    w.qkv_bytes = f32_copy_bytes(c.qkv, 3 * n);
    w.dout_bytes = f32_copy_bytes(c.out, n);
    w.dqkv_bytes = f32_copy_bytes(c.dqkv, 3 * n);
    return w;
  }
  w.bf16 = true;
  w.dkv_bytes = 4 * 2 * static_cast<size_t>(n);
  w.dq_block_bytes = 4 * static_cast<size_t>(c.batch * rows * c.channels);
  w.probs16_bytes = 2 * block;
  w.packed_bytes = 2 * 4 * static_cast<size_t>(n);
  return w;
}

// cpu matmul with f16 operands, in f32 elements, carved in this order (Note [Cpu f16 matmul]
// in kernels/cpu/matmul.cc). Other dtypes take none.
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
// (kernels/cuda/rowwise.cu's kMaxPartials; kernels/cuda/cuda_kernels.cc checks that they agree).
inline constexpr size_t kCudaReductionPartials = 1024;

}  // namespace porter::kernels::workspace_layout
