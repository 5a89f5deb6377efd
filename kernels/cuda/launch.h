// Host-side launchers for porter's own cuda kernels (kernels/cuda/elementwise.cu,
// kernels/cuda/rowwise.cu, kernels/cuda/attention.cu, kernels/cuda/flash_attention.cu,
// kernels/cuda/rmsnorm_rope_swiglu.cu). They take raw device pointers, so the nvcc-compiled
// files need neither Tensor nor the allocator headers; kernels/cuda/cuda_kernels.cc turns
// Tensors into these arguments.
//
// Note [Runtime dtypes in cuda kernels]
// Every floating tensor argument is a DevPtr: a pointer and its dtype (f32, bf16 or f16).
// Kernels load through ld() and store through st(), which switch on the dtype. The switch is
// uniform across a warp, so it costs a few instructions per element on memory-bound kernels,
// and in exchange each kernel is compiled once instead of once per dtype combination: compile
// time stays small (CI has 2 cores, two architectures) and any mix the validation accepts
// (bf16 activations with f32 parameters, ...) is handled by construction. Compute is f32.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "tensor/dtype.h"
#include "tensor/philox.h"

namespace porter::kernels::cuda {

using namespace porter::tensor;

struct DevPtr {
  void* data = nullptr;  // device memory, owned by the caller's tensor
  DType dtype = DType::kF32;
};

// Where a launch goes: the stream, and the device index for error messages.
struct Launch {
  cudaStream_t stream = nullptr;
  int device = 0;
};

// --- kernels/cuda/elementwise.cu -------------------------------------------------------------------
// x (rows, cols) += bias (cols).
void bias_add(const Launch& l, DevPtr x, DevPtr bias, int64_t rows, int64_t cols);
void gelu_forward(const Launch& l, DevPtr x, DevPtr y, int64_t n);
void gelu_backward(const Launch& l, DevPtr x, DevPtr dy, DevPtr dx, int64_t n);
// y = x * mask / (1 - p), mask_i = philox_uniform(key, i) >= p; dropped elements are +0.
// Also the backward (dx from dy, same mask).
void dropout(const Launch& l, DevPtr x, DevPtr y, int64_t n, float p, const PhiloxKey& key);
// out = a + b (out may alias a or b).
void add(const Launch& l, DevPtr a, DevPtr b, DevPtr out, int64_t n);
// acc += x.
void accumulate(const Launch& l, DevPtr acc, DevPtr x, int64_t n);
// y = x, converted.
void cast(const Launch& l, DevPtr x, DevPtr y, int64_t n);
void fill(const Launch& l, DevPtr x, float value, int64_t n);
void scale(const Launch& l, DevPtr x, float s, int64_t n);

// AdamW's per-step constants, computed on the host exactly as the host AdamW computes them
// (Note [Device AdamW bit identity] in kernels/cuda/elementwise.cu): bias corrections in double (as
// PyTorch does), then each constant rounded to float.
struct AdamWStep {
  float decay;            // 1 - lr * weight_decay (the product rounded first)
  float beta1;
  float one_minus_beta1;  // 1 - beta1
  float beta2;
  float one_minus_beta2;  // 1 - beta2
  float step_size;        // lr / (1 - beta1^step)
  float bc2_sqrt;         // sqrt(1 - beta2^step)
  float eps;
  float grad_scale;
};
// params, m, v f32; grad f32/bf16/f16; params_out optional (data == nullptr when absent).
void adamw(const Launch& l, float* params, DevPtr grad, float* m, float* v, DevPtr params_out,
           int64_t n, const AdamWStep& s);

// --- kernels/cuda/rmsnorm_rope_swiglu.cu -------------------------------------------------------------------------
// RMSNorm over rows (rows, cols): rstd (rows) f32 saved; backward overwrites dx and accumulates
// dgamma (deterministic).
void rmsnorm_forward(const Launch& l, DevPtr x, DevPtr gamma, DevPtr y, float* rstd,
                     int64_t rows, int64_t cols, float eps);
void rmsnorm_backward(const Launch& l, DevPtr dy, DevPtr x, DevPtr gamma, const float* rstd,
                      DevPtr dx, DevPtr dgamma, int64_t rows, int64_t cols);
// Note [Rotary qkv] in kernels.cc; rows = B * T, position = row % seq. group: the query heads
// sharing one key/value head in qkv's layout, heads / kv_heads when k and v are expanded
// (qkv's row 3 * heads * head_dim), 1 when they are packed ((heads + 2 kv_heads) head_dim).
void rope_qkv_forward(const Launch& l, DevPtr q, DevPtr k, DevPtr v, DevPtr qkv, int64_t rows,
                      int64_t seq, int64_t heads, int64_t kv_heads, int64_t head_dim,
                      int64_t group, double theta);
void rope_qkv_backward(const Launch& l, DevPtr dqkv, DevPtr dq, DevPtr dk, DevPtr dv,
                       int64_t rows, int64_t seq, int64_t heads, int64_t kv_heads,
                       int64_t head_dim, int64_t group, double theta);
void swiglu_forward(const Launch& l, DevPtr gate, DevPtr up, DevPtr y, int64_t n);
void swiglu_backward(const Launch& l, DevPtr gate, DevPtr up, DevPtr dy, DevPtr dgate,
                     DevPtr dup, int64_t n);

// --- kernels/cuda/rowwise.cu -----------------------------------------------------------------------
// dbias (cols) += column sums of dy (rows, cols). Deterministic (fixed summation order).
void bias_backward(const Launch& l, DevPtr dy, DevPtr dbias, int64_t rows, int64_t cols);
void layernorm_forward(const Launch& l, DevPtr x, DevPtr gamma, DevPtr beta, DevPtr y,
                       float* mean, float* rstd, int64_t rows, int64_t cols, float eps);
// dx overwritten; dgamma, dbeta accumulated (deterministic).
void layernorm_backward(const Launch& l, DevPtr dy, DevPtr x, DevPtr gamma, const float* mean,
                        const float* rstd, DevPtr dx, DevPtr dgamma, DevPtr dbeta, int64_t rows,
                        int64_t cols);
// out (B, T, C) = wte[tokens] + wpe[t]; a token outside [0, vocab) gives a NaN row.
void embedding_forward(const Launch& l, const int32_t* tokens, DevPtr wte, DevPtr wpe,
                       DevPtr out, int64_t batch, int64_t seq, int64_t channels, int64_t vocab);
// out (B, T, C) = (vocab_begin <= tok < vocab_begin + vocab ? wte[tok - vocab_begin] : 0) +
// (wpe.data ? wpe[t] : 0); wte holds `vocab` rows.
void embedding_forward_vocab_range(const Launch& l, const int32_t* tokens, DevPtr wte,
                                   int64_t vocab_begin, DevPtr wpe, DevPtr out, int64_t batch,
                                   int64_t seq, int64_t channels, int64_t vocab);
// dwte (vocab rows, ids [vocab_begin, vocab_begin + vocab)) += dout rows of its ids; dwpe +=
// every position when dwpe.data is set (deterministic: Note [Deterministic embedding
// backward]). The whole-vocabulary backward is vocab_begin 0.
void embedding_backward(const Launch& l, DevPtr dout, const int32_t* tokens, DevPtr dwte,
                        DevPtr dwpe, int64_t batch, int64_t seq, int64_t channels, int64_t vocab,
                        int64_t vocab_begin);
// losses (rows) f32; a target outside [0, vocab) gives NaN.
void cross_entropy_forward(const Launch& l, DevPtr logits, const int32_t* targets, float* losses,
                           int64_t rows, int64_t vocab);
void cross_entropy_backward(const Launch& l, DevPtr logits, const int32_t* targets,
                            DevPtr dlogits, int64_t rows, int64_t vocab, float scale);
// Vocabulary-parallel cross-entropy (Kernels::cross_entropy_partial, _combine,
// _backward_partial): logits (rows, cols) with the first `valid` columns real.
// stats (rows, 3) = (max, sum of exp(l - max), target logit or 0) per row.
void cross_entropy_partial(const Launch& l, DevPtr logits, const int32_t* targets,
                           int64_t vocab_begin, int64_t valid, float* stats, int64_t rows,
                           int64_t cols);
// gathered (ranks, rows, 3) -> losses (rows), lse (rows).
void cross_entropy_combine(const Launch& l, const float* gathered, float* losses, float* lse,
                           int64_t ranks, int64_t rows);
void cross_entropy_backward_partial(const Launch& l, DevPtr logits, const int32_t* targets,
                                    int64_t vocab_begin, int64_t valid, const float* lse,
                                    DevPtr dlogits, int64_t rows, int64_t cols, float scale);
// out[0] = sum of x, of x^2, or of 1 per inf or NaN element (a count, exact up to 2^24).
// `partials` holds reduction_partials_count() floats. Deterministic: the block count depends
// only on n, never on the device.
enum class SumOf : int { kValues, kSquares, kNonfinite };
int64_t reduction_partials_count();
void sum(const Launch& l, DevPtr x, int64_t n, SumOf what, float* partials, float* out);

// --- kernels/cuda/attention.cu ---------------------------------------------------------------------
// dst (B, H, T, hd) f32 = the head-split columns [col_offset, col_offset + H * hd) of src
// (B, T, row_stride).
void split_heads(const Launch& l, DevPtr src, int64_t row_stride, int64_t col_offset, float* dst,
                 int64_t batch, int64_t seq, int64_t heads, int64_t head_dim);
// The inverse: dst columns [col_offset, col_offset + H * hd) of (B, T, row_stride) = src.
void merge_heads(const Launch& l, const float* src, DevPtr dst, int64_t row_stride,
                 int64_t col_offset, int64_t batch, int64_t seq, int64_t heads, int64_t head_dim);
// In place on s (batch_heads, T, T) f32: causal softmax per row, zero above the diagonal.
void causal_softmax_forward(const Launch& l, float* s, int64_t batch_heads, int64_t seq);
// In place: dp (batch_heads, T, T) becomes dS = P * (dP - rowsum(dP * P)).
void softmax_backward(const Launch& l, const float* probs, float* dp, int64_t batch_heads,
                      int64_t seq);

// --- kernels/cuda/flash_attention.cu ---------------------------------------------------------------
// Note [Flash attention] in kernels.cc, Note [Cuda flash attention] in the .cu: qkv (B, T,
// (heads + 2 kv_heads) head_dim), out and dout (B, T, heads head_dim), lse (B, heads, T) f32.
// head_dim <= kFlashMaxHeadDim, and B * heads * T < 2^31 (one block per query block).
inline constexpr int64_t kFlashMaxHeadDim = 2048;
void flash_attention_forward(const Launch& l, DevPtr qkv, DevPtr out, float* lse, int64_t batch,
                             int64_t seq, int64_t heads, int64_t kv_heads, int64_t head_dim);
// dqkv overwritten. drow: B * heads * T floats of workspace, the rows' sum(dout * out).
void flash_attention_backward(const Launch& l, DevPtr dout, DevPtr qkv, DevPtr out,
                              const float* lse, float* drow, DevPtr dqkv, int64_t batch,
                              int64_t seq, int64_t heads, int64_t kv_heads, int64_t head_dim);

}  // namespace porter::kernels::cuda
