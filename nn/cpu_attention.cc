// Causal softmax attention on cpu: oneDNN batched matmuls over (batch, head) on row blocks,
// skipping the masked upper triangle, with vectorised softmax loops in between.
//
// Note [Causal row blocks]
// Rows are processed in blocks of kRowBlock queries. Block [i0, i1) attends to keys [0, i1),
// so its scores are one (i1 - i0) x i1 matmul per (batch, head), all heads in one oneDNN
// call. Only the triangle's diagonal blocks compute masked entries (then zeroed), so with
// T = 512 the matmuls do 56% of the full T x T work. Each block size is its own cached
// oneDNN primitive.
//
// Note [Attention scratch]
// Backward needs dP / dS for one row block, (B, heads, kRowBlock, T) f32 (6 MiB for B = 4,
// 12 heads, T = 512). Tensors that are not f32 (bf16, f16) are widened to f32 copies first,
// and a bf16 or f16 result is computed in f32 and narrowed at the end, since oneDNN cannot
// multiply the f32 probabilities by 16-bit values. All of it is one workspace buffer per
// call from the kernels' allocator (Note [Kernel workspace] in kernels.h), laid out as
// workspace_layout::CpuAttentionForward / CpuAttentionBackward (kernel_workspace.h): f32
// forward takes none, bf16 or f16 forward 16·N·C bytes (N = B·T), backward
// B·heads·min(64, T)·T·4 bytes plus 28·N·C in bf16 or f16. The buffer is freed when the call
// returns; the allocator keeps the block cached, so the next call reuses it without touching
// the device.
#include <cmath>
#include <cstdint>

#include "nn/cpu_kernels.h"
#include "nn/cpu_matmul.h"
#include "nn/kernel_workspace.h"

namespace porter::nn {
namespace {

constexpr int64_t kRowBlock = workspace_layout::kCpuAttentionRowBlock;

// Sizes of one attention call.
struct Dims {
  int64_t b, t, c, heads, hd;
};

Dims dims_of(const Tensor& qkv, int heads) {
  Dims d{qkv.dim(0), qkv.dim(1), qkv.dim(2) / 3, heads, 0};
  d.hd = d.c / heads;
  return d;
}

// An operand in (batch, head, row, column) element strides.
struct Operand {
  const float* data;
  int64_t strides[4];
};

Operand op(const float* data, const int64_t (&strides)[4]) {
  return Operand{data, {strides[0], strides[1], strides[2], strides[3]}};
}

void run_batched(DnnlMatmul& mm, const Dims& d, int64_t m, int64_t n, int64_t k, const Operand& a,
                 const Operand& b, float* out, const int64_t (&out_strides)[4], float alpha,
                 float beta) {
  MatmulProblem p;
  p.batch0 = d.b;
  p.batch1 = d.heads;
  p.m = m;
  p.n = n;
  p.k = k;
  for (int i = 0; i < 4; ++i) {
    p.a_strides[i] = a.strides[i];
    p.b_strides[i] = b.strides[i];
    p.out_strides[i] = out_strides[i];
  }
  p.alpha = alpha;
  p.beta = beta;
  mm.run(p, a.data, b.data, out);
}

// Row i of the causal scores: softmax over [0, i], zeros after (up to `width`).
PORTER_CPU_CLONES void softmax_causal_row(float* row, int64_t i, int64_t width) {
  float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
  for (int64_t j = 0; j <= i; ++j) mx = std::max(mx, row[j]);
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t j = 0; j <= i; ++j) {
    float e = cpu::fast_exp(row[j] - mx);
    row[j] = e;
    s += e;
  }
  const float inv = 1.0f / s;
#pragma omp simd
  for (int64_t j = 0; j <= i; ++j) row[j] *= inv;
  for (int64_t j = i + 1; j < width; ++j) row[j] = 0.0f;
}

// dS = scale * P * (dP - sum_j P dP) over [0, i]; zeros in (i, width).
PORTER_CPU_CLONES void softmax_backward_row(const float* p, float* ds, int64_t i, int64_t width,
                                            float scale) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t j = 0; j <= i; ++j) s += p[j] * ds[j];
#pragma omp simd
  for (int64_t j = 0; j <= i; ++j) ds[j] = scale * p[j] * (ds[j] - s);
  for (int64_t j = i + 1; j < width; ++j) ds[j] = 0.0f;
}

// f32 view of a float tensor: the tensor itself, or a widened copy at `scratch`.
const float* as_f32(int threads, const Tensor& t, float* scratch) {
  if (t.dtype() == DType::kF32) return static_cast<const float*>(t.data());
  cpu::widen_to_f32(threads, t, scratch);
  return scratch;
}

AttentionCall call_of(const Dims& d, DType qkv, DType out, DType dqkv) {
  return AttentionCall{d.b, d.t, d.c, static_cast<int>(d.heads), qkv, out, dqkv};
}

}  // namespace

void CpuKernels::do_attention_forward(const Tensor& qkv, Tensor& out, Tensor& probs, int heads) {
  const Dims d = dims_of(qkv, heads);
  if (d.b == 0 || d.t == 0 || d.c == 0) return;
  // Scratch layout (Note [Attention scratch]): f32 qkv, then f32 out, each when needed.
  const workspace_layout::CpuAttentionForward layout =
      workspace_layout::cpu_attention_forward(call_of(d, qkv.dtype(), out.dtype(), DType::kF32));
  const memory::DeviceBuffer buffer =
      workspace(layout.total_elems() * sizeof(float), "attention_forward");
  float* scratch = buffer.as<float>();
  const float* x = as_f32(threads_, qkv, scratch);
  float* o = layout.out_elems ? scratch + layout.qkv_elems : out.data_as<float>();
  float* pr = probs.data_as<float>();

  const int64_t c3 = 3 * d.c, t = d.t;
  const int64_t qkv_str[4] = {t * c3, d.hd, c3, 1};
  const int64_t qkv_t_str[4] = {t * c3, d.hd, 1, c3};  // K^T: (hd, keys)
  const int64_t probs_str[4] = {d.heads * t * t, t * t, t, 1};
  const int64_t out_str[4] = {t * d.c, d.hd, d.c, 1};
  const float scale = 1.0f / std::sqrt(static_cast<float>(d.hd));
  for (int64_t i0 = 0; i0 < t; i0 += kRowBlock) {
    const int64_t i1 = std::min(t, i0 + kRowBlock), rows = i1 - i0;
    // Scores S = scale * Q[i0:i1] K[0:i1]^T (Note [Causal row blocks]).
    run_batched(*dnnl_, d, rows, i1, d.hd, op(x + i0 * c3, qkv_str), op(x + d.c, qkv_t_str),
                pr + i0 * t, probs_str, scale, 0.0f);
    cpu::parallel_rows(threads_, d.b * d.heads * rows, [&](int64_t r) {
      const int64_t bh = r / rows, i = i0 + r % rows;
      softmax_causal_row(pr + bh * t * t + i * t, i, t);
    });
    // out[i0:i1] = P[i0:i1, 0:i1] V[0:i1].
    run_batched(*dnnl_, d, rows, d.hd, i1, op(pr + i0 * t, probs_str), op(x + 2 * d.c, qkv_str),
                o + i0 * d.c, out_str, 1.0f, 0.0f);
  }
  if (layout.out_elems) cpu::narrow_from_f32(threads_, o, out);
}

void CpuKernels::do_attention_backward(const Tensor& dout, const Tensor& qkv, const Tensor& probs,
                                       Tensor& dqkv, int heads) {
  const Dims d = dims_of(qkv, heads);
  if (d.b == 0 || d.t == 0 || d.c == 0) return;
  const int64_t c3 = 3 * d.c, t = d.t;
  const int64_t block_rows = std::min(kRowBlock, t);
  // Scratch layout: the dS block, then the f32 copies of the arguments that are not f32
  // (Note [Attention scratch]).
  const workspace_layout::CpuAttentionBackward layout =
      workspace_layout::cpu_attention_backward(call_of(d, qkv.dtype(), dout.dtype(), dqkv.dtype()));
  PORTER_ASSERT(layout.ds_elems == static_cast<size_t>(d.b * d.heads * block_rows * t),
                "attention_backward scratch layout disagrees with the row blocks");
  const memory::DeviceBuffer buffer =
      workspace(layout.total_elems() * sizeof(float), "attention_backward");
  float* scratch = buffer.as<float>();
  const size_t ds_elems = layout.ds_elems, qkv_elems = layout.qkv_elems;
  const size_t dout_elems = layout.dout_elems, dqkv_elems = layout.dqkv_elems;
  float* ds = scratch;
  const float* x = as_f32(threads_, qkv, scratch + ds_elems);
  const float* dy = as_f32(threads_, dout, scratch + ds_elems + qkv_elems);
  float* dx = dqkv_elems ? scratch + ds_elems + qkv_elems + dout_elems : dqkv.data_as<float>();
  const float* pr = probs.data_as<float>();

  const int64_t qkv_str[4] = {t * c3, d.hd, c3, 1};
  const int64_t qkv_t_str[4] = {t * c3, d.hd, 1, c3};
  const int64_t probs_t_str[4] = {d.heads * t * t, t * t, 1, t};  // P^T: (keys, queries)
  const int64_t out_str[4] = {t * d.c, d.hd, d.c, 1};
  const int64_t ds_str[4] = {d.heads * block_rows * t, block_rows * t, t, 1};
  const int64_t ds_t_str[4] = {d.heads * block_rows * t, block_rows * t, 1, t};
  const float scale = 1.0f / std::sqrt(static_cast<float>(d.hd));

  // Last block first: it covers every key row, so it initialises dK and dV (beta = 0) and
  // earlier blocks accumulate into a prefix of them in a fixed order.
  const int64_t n_blocks = (t + kRowBlock - 1) / kRowBlock;
  for (int64_t blk = n_blocks - 1; blk >= 0; --blk) {
    const int64_t i0 = blk * kRowBlock, i1 = std::min(t, i0 + kRowBlock), rows = i1 - i0;
    const float beta = blk == n_blocks - 1 ? 0.0f : 1.0f;
    // dP = dout[i0:i1] V[0:i1]^T.
    run_batched(*dnnl_, d, rows, i1, d.hd, op(dy + i0 * d.c, out_str), op(x + 2 * d.c, qkv_t_str),
                ds, ds_str, 1.0f, 0.0f);
    cpu::parallel_rows(threads_, d.b * d.heads * rows, [&](int64_t r) {
      const int64_t bh = r / rows, ri = r % rows;
      softmax_backward_row(pr + bh * t * t + (i0 + ri) * t, ds + bh * block_rows * t + ri * t,
                           i0 + ri, i1, scale);
    });
    // dQ[i0:i1] = dS K[0:i1]; every row block of dQ is written once.
    run_batched(*dnnl_, d, rows, d.hd, i1, op(ds, ds_str), op(x + d.c, qkv_str), dx + i0 * c3,
                qkv_str, 1.0f, 0.0f);
    // dK[0:i1] (+)= dS^T Q[i0:i1];  dV[0:i1] (+)= P[i0:i1, 0:i1]^T dout[i0:i1].
    run_batched(*dnnl_, d, i1, d.hd, rows, op(ds, ds_t_str), op(x + i0 * c3, qkv_str),
                dx + d.c, qkv_str, 1.0f, beta);
    run_batched(*dnnl_, d, i1, d.hd, rows, op(pr + i0 * t, probs_t_str), op(dy + i0 * d.c, out_str),
                dx + 2 * d.c, qkv_str, 1.0f, beta);
  }
  if (dqkv_elems) cpu::narrow_from_f32(threads_, dx, dqkv);
}

}  // namespace porter::nn
