// Causal softmax attention on cpu: oneDNN batched matmuls over (batch, head) on row blocks,
// skipping the masked upper triangle in f32, with vectorised softmax loops in between. Where
// the cpu has AVX-512 (AVX512-BF16 for bf16), the calls run on porter's own head tiles instead
// (Note [Attention head tiles] in kernels/cpu/attention_heads.cc); this path serves the other cpus,
// odd bf16 head sizes and PORTER_CPU_ATTENTION=onednn.
//
// Note [Causal row blocks]
// Rows are processed in blocks of kRowBlock queries. Block [i0, i1) attends to keys [0, i1),
// so in f32 its scores are one (i1 - i0) x i1 matmul per (batch, head), all heads in one
// oneDNN call. Only the triangle's diagonal blocks compute masked entries (then zeroed), so
// with T = 512 the matmuls do 56% of the full T x T work. Each block size is its own cached
// oneDNN primitive. The bf16 path keeps the row blocks but multiplies each against all T keys
// (Note [Bf16 attention]).
//
// Note [Attention scratch]
// The f32 path's backward needs dP / dS for one row block, (B, heads, kRowBlock, T) f32
// (6 MiB for B = 4, 12 heads, T = 512). Tensors that are not f32 are widened to f32 copies
// first, and a 16-bit result is computed in f32 and narrowed at the end, since oneDNN cannot
// multiply f32 by 16-bit values and has no f16 matmul on most cpus (Note [Cpu f16 matmul] in
// kernels/cpu/matmul.cc). That is the path for f16, and for bf16 mixed with f32 where the bf16 path
// does not apply. All of it is one workspace buffer per call from the kernels' allocator
// (Note [Kernel workspace] in kernels.h), laid out as workspace_layout::CpuAttentionForward /
// CpuAttentionBackward (kernels/workspace.h): f32 forward takes none, f16 forward 16·N·C bytes
// (N = B·T), backward B·heads·min(64, T)·T·4 bytes plus 28·N·C in f16; bf16 in Note [Bf16
// attention]. The buffer is freed when the call returns; the allocator keeps the block
// cached, so the next call reuses it without touching the device.
//
// Note [Bf16 attention]
// With bf16 qkv (forward) or bf16 qkv and dout (backward) the matmuls multiply bf16 by bf16
// into f32, which oneDNN runs on AMX (brg:avx512_core_amx_bf16), or on AVX512-BF16 without
// AMX. oneDNN 2.6's brgemm matmul takes only dense operands, plain or transposed: the strided
// views of qkv and out, and row blocks of larger tensors, all go to its gemm:jit, which here
// multiplied bf16 no faster than f32. So the call first packs per-head bf16 copies: Q and
// dout in row blocks, each block a dense (B, heads, rows, hd) tensor, and K and V as
// (B, heads, T, hd). The keys [0, i1) of a row block are not a dense tensor (each head's
// stride stays T·hd), so a block multiplies against all T keys: the full T x T work instead
// of the triangle's (1.8x at T = 512), where the masked entries are exact zeros in P and dS,
// and each block has one primitive shape. A non-finite K or V value therefore reaches every
// row (0 · inf), not only the later ones.
// - Precision. The scores and dP are sums of bf16 products, exact in f32, accumulated in f32.
//   The probabilities stay f32 in probs; a row block of them is rounded to a bf16 copy for
//   P V and P^T dout, and dS is rounded to bf16 for dS K and dS^T Q (2^-9 relative each).
//   Softmax, its statistics and its backward run in f32. dQ (per block), dK and dV (summed
//   over the blocks in order, beta = 1) and out are f32 results rounded once, to nearest
//   even, into out / dqkv's dtype as they are copied back. The bf16 dot products of AMX and
//   AVX512-BF16 treat subnormal inputs as zero.
// - Scratch (workspace_layout::CpuAttentionForward / CpuAttentionBackward), R = min(64, T):
//   forward 6·N·C bytes of packed Q, K, V, B·heads·R·T·6 of f32 scores and bf16 P for a row
//   block, and B·R·C·4 of its f32 out; backward 8·N·C of packed Q, dout, K, V, 8·N·C of f32
//   dK and dV, B·heads·R·T·6 of f32 dP and bf16 P, then dS, and B·R·C·4 of a block's f32 dQ.
//   With head_dim 64 that is 12·N·C + B·R·C·4 forward and 22·N·C + B·R·C·4 backward (the
//   f32 path's widening took 16·N·C and 32·N·C).
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <spdlog/fmt/fmt.h>
#include <string>

#include "base/log.h"
#include "kernels/cpu/attention_heads.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/matmul.h"
#include "kernels/kernel_table.h"
#include "kernels/workspace.h"

namespace porter::kernels {
namespace {

constexpr int64_t kRowBlock = workspace_layout::kCpuAttentionRowBlock;

// Sizes of one attention call.
using Dims = cpu::HeadDims;

Dims dims_of(const Tensor& qkv, int heads) {
  Dims d{qkv.dim(0), qkv.dim(1), qkv.dim(2) / 3, heads, 0};
  d.hd = d.c / heads;
  return d;
}

// An operand in (batch, head, row, column) element strides, f32 or bf16.
struct Operand {
  const void* data;
  DType dtype;
  int64_t strides[4];
};

Operand op(const float* data, const int64_t (&strides)[4]) {
  return Operand{data, DType::kF32, {strides[0], strides[1], strides[2], strides[3]}};
}

Operand op(const uint16_t* data, const int64_t (&strides)[4]) {
  return Operand{data, DType::kBF16, {strides[0], strides[1], strides[2], strides[3]}};
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
  p.a_dtype = a.dtype;
  p.b_dtype = b.dtype;
  p.alpha = alpha;
  p.beta = beta;
  mm.run(p, a.data, b.data, out);
}

// The largest of x[0, n), as the sequential loop `mx = std::max(mx, x[j])` finds it (max is
// exact and skips NaNs in any order), in 16 lanes, since GCC does not vectorise that loop's
// reduction without -ffast-math.
PORTER_CPU_CLONES float row_max(const float* x, int64_t n) {
  constexpr int kLanes = 16;
  float lane[kLanes];
  for (float& m : lane) m = -INFINITY;
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
#pragma omp simd
    for (int k = 0; k < kLanes; ++k) lane[k] = lane[k] < x[j + k] ? x[j + k] : lane[k];
  }
  float mx = -INFINITY;
  for (float m : lane) mx = std::max(mx, m);
  for (; j < n; ++j) mx = std::max(mx, x[j]);
  return mx;
}

// Row i of the causal scores: softmax over [0, i], zeros after (up to `width`).
PORTER_CPU_CLONES void softmax_causal_row(float* row, int64_t i, int64_t width) {
  const float mx = row_max(row, i + 1);
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

// Row i of the causal probabilities in the bf16 path: softmax_causal_row of the f32 scores
// `s` into `row`, and `row` rounded to bf16 into `p16`, both zero after i (up to `width`).
PORTER_CPU_CLONES void softmax_causal_row_bf16(const float* s, float* row, uint16_t* p16,
                                               int64_t i, int64_t width) {
  const float mx = row_max(s, i + 1);
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j <= i; ++j) {
    float e = cpu::fast_exp(s[j] - mx);
    row[j] = e;
    sum += e;
  }
  const float inv = 1.0f / sum;
#pragma omp simd
  for (int64_t j = 0; j <= i; ++j) row[j] *= inv;
  for (int64_t j = i + 1; j < width; ++j) row[j] = 0.0f;
#pragma omp simd
  for (int64_t j = 0; j < width; ++j) cpu::store(p16 + j, row[j]);
}

// softmax_backward_row of the f32 P and dP rows, rounded to bf16 into `ds16`.
PORTER_CPU_CLONES void softmax_backward_row_bf16(const float* p, const float* dp, uint16_t* ds16,
                                                 int64_t i, int64_t width, float scale) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t j = 0; j <= i; ++j) s += p[j] * dp[j];
#pragma omp simd
  for (int64_t j = 0; j <= i; ++j) cpu::store(ds16 + j, scale * p[j] * (dp[j] - s));
  for (int64_t j = i + 1; j < width; ++j) ds16[j] = 0;
}

// Row i of the probabilities rounded to bf16: P[0, i], then the zeros after it up to `width`
// (not read from probs, which hold zeros there too).
PORTER_CPU_CLONES void round_probs_row_bf16(const float* p, uint16_t* dst, int64_t i,
                                            int64_t width) {
#pragma omp simd
  for (int64_t j = 0; j <= i; ++j) cpu::store(dst + j, p[j]);
  for (int64_t j = i + 1; j < width; ++j) dst[j] = 0;
}

template <typename T>
PORTER_CPU_CLONES void store_row(const float* src, T* dst, int64_t n) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) cpu::store(dst + j, src[j]);
}

// Rows in one row block of a packed tensor and where the block starts (Note [Bf16 attention]):
// block k holds rows [k * block_rows, ...) of every (batch, head) as one dense
// (B, heads, rows, hd) tensor, so a block starts after k * block_rows * B * C elements.
struct PackedBlock {
  int64_t rows, offset;
};

PackedBlock packed_block(const Dims& d, int64_t block_rows, int64_t blk) {
  return {std::min(block_rows, d.t - blk * block_rows), blk * block_rows * d.b * d.c};
}

// Copies the heads of the bf16 rows at `src` ((B, T) rows of `ld` elements, head h in
// columns [h * hd, (h + 1) * hd)) into `dst`, packed in blocks of `block_rows` rows; with
// block_rows = T that is (B, heads, T, hd).
void pack_heads(int threads, const Dims& d, const uint16_t* src, int64_t ld, int64_t block_rows,
                uint16_t* dst) {
  cpu::parallel_rows(threads, d.b * d.t, [&](int64_t row) {
    const int64_t b = row / d.t, t = row % d.t;
    const PackedBlock blk = packed_block(d, block_rows, t / block_rows);
    uint16_t* base = dst + blk.offset + (b * d.heads * blk.rows + t % block_rows) * d.hd;
    const uint16_t* in = src + row * ld;
    for (int64_t h = 0; h < d.heads; ++h) {
      std::memcpy(base + h * blk.rows * d.hd, in + h * d.hd, d.hd * sizeof(uint16_t));
    }
  });
}

// The inverse for an f32 (B, heads, rows, hd) result holding rows [i0, i0 + rows): written
// into the rows of `dst` (a (B, T, ·) tensor, head h at columns col + [h * hd, (h + 1) * hd)),
// each value rounded once to dst's dtype.
void unpack_heads(int threads, const Dims& d, const float* src, int64_t i0, int64_t rows,
                  Tensor& dst, int64_t col) {
  const int64_t ld = dst.dim(2);
  cpu::dispatch_float(dst.dtype(), [&](auto tag) {
    auto* out = static_cast<decltype(tag)*>(dst.data());
    cpu::parallel_rows(threads, d.b * rows, [&](int64_t row) {
      const int64_t b = row / rows, r = row % rows;
      auto* o = out + (b * d.t + i0 + r) * ld + col;
      for (int64_t h = 0; h < d.heads; ++h) {
        store_row(src + ((b * d.heads + h) * rows + r) * d.hd, o + h * d.hd, d.hd);
      }
    });
  });
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

// Strides of a dense (B, heads, rows, cols) tensor, as itself and as its transpose.
struct Dense {
  int64_t plain[4], trans[4];
};

Dense dense(const Dims& d, int64_t rows, int64_t cols) {
  const int64_t head = rows * cols;
  return {{d.heads * head, head, cols, 1}, {d.heads * head, head, 1, cols}};
}

// The bf16 forward (Note [Bf16 attention]).
void forward_bf16(DnnlMatmul& mm, int threads, const Dims& d,
                  const workspace_layout::CpuAttentionForward& layout, char* scratch,
                  const Tensor& qkv, Tensor& out, float* pr) {
  const int64_t t = d.t, n = d.b * d.t * d.c;
  float* scores = reinterpret_cast<float*>(scratch);
  float* o = reinterpret_cast<float*>(scratch + layout.scores_bytes);
  char* half = scratch + layout.scores_bytes + layout.out_block_bytes;
  uint16_t* p16 = reinterpret_cast<uint16_t*>(half);
  uint16_t* q = reinterpret_cast<uint16_t*>(half + layout.probs16_bytes);
  uint16_t* k = q + n;
  uint16_t* v = k + n;
  const auto* x = static_cast<const uint16_t*>(qkv.data());
  pack_heads(threads, d, x, 3 * d.c, kRowBlock, q);
  pack_heads(threads, d, x + d.c, 3 * d.c, t, k);
  pack_heads(threads, d, x + 2 * d.c, 3 * d.c, t, v);

  const Dense kv = dense(d, t, d.hd);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d.hd));
  for (int64_t blk = 0; blk * kRowBlock < t; ++blk) {
    const PackedBlock pb = packed_block(d, kRowBlock, blk);
    const int64_t i0 = blk * kRowBlock, rows = pb.rows;
    const Dense qb = dense(d, rows, d.hd), sb = dense(d, rows, t);
    // Scores S = scale * Q[i0:i1] K^T over every key; the masked ones are discarded.
    run_batched(mm, d, rows, t, d.hd, op(q + pb.offset, qb.plain), op(k, kv.trans), scores,
                sb.plain, scale, 0.0f);
    cpu::parallel_rows(threads, d.b * d.heads * rows, [&](int64_t r) {
      const int64_t bh = r / rows, ri = r % rows;
      softmax_causal_row_bf16(scores + r * t, pr + bh * t * t + (i0 + ri) * t, p16 + r * t,
                              i0 + ri, t);
    });
    // out[i0:i1] = P[i0:i1] V, the zeros above the diagonal included.
    run_batched(mm, d, rows, d.hd, t, op(p16, sb.plain), op(v, kv.plain), o, qb.plain, 1.0f, 0.0f);
    unpack_heads(threads, d, o, i0, rows, out, 0);
  }
}

// The bf16 backward (Note [Bf16 attention]).
void backward_bf16(DnnlMatmul& mm, int threads, const Dims& d,
                   const workspace_layout::CpuAttentionBackward& layout, char* scratch,
                   const Tensor& dout, const Tensor& qkv, const float* pr, Tensor& dqkv) {
  const int64_t t = d.t, n = d.b * d.t * d.c;
  float* dp = reinterpret_cast<float*>(scratch);
  float* dk = reinterpret_cast<float*>(scratch + layout.dp_bytes);
  float* dv = dk + n;
  float* dq = reinterpret_cast<float*>(scratch + layout.dp_bytes + layout.dkv_bytes);
  char* half = scratch + layout.dp_bytes + layout.dkv_bytes + layout.dq_block_bytes;
  uint16_t* s16 = reinterpret_cast<uint16_t*>(half);
  uint16_t* q = reinterpret_cast<uint16_t*>(half + layout.probs16_bytes);
  uint16_t* dy = q + n;
  uint16_t* k = dy + n;
  uint16_t* v = k + n;
  const auto* x = static_cast<const uint16_t*>(qkv.data());
  pack_heads(threads, d, x, 3 * d.c, kRowBlock, q);
  pack_heads(threads, d, static_cast<const uint16_t*>(dout.data()), d.c, kRowBlock, dy);
  pack_heads(threads, d, x + d.c, 3 * d.c, t, k);
  pack_heads(threads, d, x + 2 * d.c, 3 * d.c, t, v);

  const Dense kv = dense(d, t, d.hd);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d.hd));
  for (int64_t blk = 0; blk * kRowBlock < t; ++blk) {
    const PackedBlock pb = packed_block(d, kRowBlock, blk);
    const int64_t i0 = blk * kRowBlock, rows = pb.rows;
    const float beta = blk == 0 ? 0.0f : 1.0f;
    const Dense qb = dense(d, rows, d.hd), sb = dense(d, rows, t);
    // dP = dout[i0:i1] V^T.
    run_batched(mm, d, rows, t, d.hd, op(dy + pb.offset, qb.plain), op(v, kv.trans), dp,
                sb.plain, 1.0f, 0.0f);
    // dV (+)= P[i0:i1]^T dout[i0:i1], with P rounded to bf16 first.
    cpu::parallel_rows(threads, d.b * d.heads * rows, [&](int64_t r) {
      const int64_t bh = r / rows, ri = r % rows;
      round_probs_row_bf16(pr + bh * t * t + (i0 + ri) * t, s16 + r * t, i0 + ri, t);
    });
    run_batched(mm, d, t, d.hd, rows, op(s16, sb.trans), op(dy + pb.offset, qb.plain), dv,
                kv.plain, 1.0f, beta);
    // dS in bf16, over the P copy dV no longer needs.
    cpu::parallel_rows(threads, d.b * d.heads * rows, [&](int64_t r) {
      const int64_t bh = r / rows, ri = r % rows;
      softmax_backward_row_bf16(pr + bh * t * t + (i0 + ri) * t, dp + r * t, s16 + r * t, i0 + ri,
                                t, scale);
    });
    // dQ[i0:i1] = dS K, written once;  dK (+)= dS^T Q[i0:i1].
    run_batched(mm, d, rows, d.hd, t, op(s16, sb.plain), op(k, kv.plain), dq, qb.plain, 1.0f, 0.0f);
    unpack_heads(threads, d, dq, i0, rows, dqkv, 0);
    run_batched(mm, d, t, d.hd, rows, op(s16, sb.trans), op(q + pb.offset, qb.plain), dk,
                kv.plain, 1.0f, beta);
  }
  unpack_heads(threads, d, dk, 0, t, dqkv, d.c);
  unpack_heads(threads, d, dv, 0, t, dqkv, 2 * d.c);
}

// f32 forward through oneDNN's batched calls (Note [Causal row blocks]).
void forward_f32(DnnlMatmul& mm, int threads, const Dims& d, const float* x, float* o, float* pr) {
  const int64_t c3 = 3 * d.c, t = d.t;
  const int64_t qkv_str[4] = {t * c3, d.hd, c3, 1};
  const int64_t qkv_t_str[4] = {t * c3, d.hd, 1, c3};  // K^T: (hd, keys)
  const int64_t probs_str[4] = {d.heads * t * t, t * t, t, 1};
  const int64_t out_str[4] = {t * d.c, d.hd, d.c, 1};
  const float scale = 1.0f / std::sqrt(static_cast<float>(d.hd));
  for (int64_t i0 = 0; i0 < t; i0 += kRowBlock) {
    const int64_t i1 = std::min(t, i0 + kRowBlock), rows = i1 - i0;
    // Scores S = scale * Q[i0:i1] K[0:i1]^T (Note [Causal row blocks]).
    run_batched(mm, d, rows, i1, d.hd, op(x + i0 * c3, qkv_str), op(x + d.c, qkv_t_str),
                pr + i0 * t, probs_str, scale, 0.0f);
    cpu::parallel_rows(threads, d.b * d.heads * rows, [&](int64_t r) {
      const int64_t bh = r / rows, i = i0 + r % rows;
      softmax_causal_row(pr + bh * t * t + i * t, i, t);
    });
    // out[i0:i1] = P[i0:i1, 0:i1] V[0:i1].
    run_batched(mm, d, rows, d.hd, i1, op(pr + i0 * t, probs_str), op(x + 2 * d.c, qkv_str),
                o + i0 * d.c, out_str, 1.0f, 0.0f);
  }
}

// f32 backward through oneDNN's batched calls; ds is the (B, heads, R, T) dS block.
void backward_f32(DnnlMatmul& mm, int threads, const Dims& d, const float* x, const float* dy,
                  const float* pr, float* ds, float* dx) {
  const int64_t c3 = 3 * d.c, t = d.t;
  const int64_t block_rows = std::min(kRowBlock, t);
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
    run_batched(mm, d, rows, i1, d.hd, op(dy + i0 * d.c, out_str), op(x + 2 * d.c, qkv_t_str),
                ds, ds_str, 1.0f, 0.0f);
    cpu::parallel_rows(threads, d.b * d.heads * rows, [&](int64_t r) {
      const int64_t bh = r / rows, ri = r % rows;
      softmax_backward_row(pr + bh * t * t + (i0 + ri) * t, ds + bh * block_rows * t + ri * t,
                           i0 + ri, i1, scale);
    });
    // dQ[i0:i1] = dS K[0:i1]; every row block of dQ is written once.
    run_batched(mm, d, rows, d.hd, i1, op(ds, ds_str), op(x + d.c, qkv_str), dx + i0 * c3,
                qkv_str, 1.0f, 0.0f);
    // dK[0:i1] (+)= dS^T Q[i0:i1];  dV[0:i1] (+)= P[i0:i1, 0:i1]^T dout[i0:i1].
    run_batched(mm, d, i1, d.hd, rows, op(ds, ds_t_str), op(x + i0 * c3, qkv_str),
                dx + d.c, qkv_str, 1.0f, beta);
    run_batched(mm, d, i1, d.hd, rows, op(pr + i0 * t, probs_t_str), op(dy + i0 * d.c, out_str),
                dx + 2 * d.c, qkv_str, 1.0f, beta);
  }
}

// Calls smaller than this many FLOPs (of the causal triangle's products) run on the tiles
// unmeasured: timing them would cost more than a choice could win back, and it keeps small
// problems (every test's) deterministic across processes.
constexpr double kMinMeasuredAttentionFlops = double{1 << 27};

// The call as the kernel table keys it (Note [Kernel table]), readable.
std::string choice_key(const AttentionCall& call, bool backward, int threads) {
  return fmt::format("{} B {} T {} C {} heads {} qkv {} out {} dqkv {} threads {}",
                     backward ? "backward" : "forward", call.batch, call.seq, call.channels,
                     call.heads, dtype_name(call.qkv), dtype_name(call.out),
                     backward ? dtype_name(call.dqkv) : std::string_view("-"), threads);
}

constexpr std::string_view kAttentionKind = "attention";

double seconds_of(const std::function<void()>& fn) {
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

namespace cpu {

std::optional<bool> attention_choice(const KernelTable& table, const AttentionCall& call,
                                     bool backward, int threads) {
  const std::optional<KernelTable::Entry> e =
      table.find(kAttentionKind, choice_key(call, backward, threads));
  if (!e) return std::nullopt;
  return e->choice != "onednn";
}

}  // namespace cpu

bool CpuKernels::attention_on_tiles(const AttentionCall& call, bool backward, bool supported,
                                    const std::function<void(bool)>& run) {
  if (!supported) return false;
  KernelTable& table = kernel_table();
  const std::string key = choice_key(call, backward, threads_);
  if (attention_impl_ != cpu::AttentionImpl::kAuto) {
    const bool tiles = attention_impl_ == cpu::AttentionImpl::kTiles;
    table.replace(kAttentionKind, key,
                  {tiles ? "tiles" : "onednn", KernelTable::Source::kEnv,
                   tiles ? "PORTER_CPU_ATTENTION=tiles" : "PORTER_CPU_ATTENTION=onednn"});
    return tiles;
  }
  if (std::optional<KernelTable::Entry> known = table.find(kAttentionKind, key)) {
    return known->choice != "onednn";
  }
  const double flops = (backward ? 4.0 : 2.0) * static_cast<double>(call.batch) *
                       static_cast<double>(call.channels) * static_cast<double>(call.seq) *
                       static_cast<double>(call.seq + 1);
  // Note [Kernel table]: the tiles and oneDNN sum in different orders, so only kernel_choice
  // "fastest" times them against each other.
  if (flops < kMinMeasuredAttentionFlops || table.mode() != KernelChoice::kFastest) {
    table.record(kAttentionKind, key,
                 {"tiles", KernelTable::Source::kFixed,
                  flops < kMinMeasuredAttentionFlops ? "under 2^27 flops"
                                                     : "kernel_choice exact: no other candidate"});
    return true;
  }
  const std::lock_guard lock(KernelTable::measurement_mutex());
  if (std::optional<KernelTable::Entry> known = table.find(kAttentionKind, key)) {
    return known->choice != "onednn";
  }
  // Both on the call's own tensors (the caller runs the chosen one again last): a warm-up
  // each, then the best of two, interleaved. The tiles are kept unless oneDNN is at least
  // 10% faster.
  run(true);
  run(false);
  double tiles_s = 1e30, onednn_s = 1e30;
  for (int r = 0; r < 2; ++r) {
    tiles_s = std::min(tiles_s, seconds_of([&] { run(true); }));
    onednn_s = std::min(onednn_s, seconds_of([&] { run(false); }));
  }
  const bool tiles = onednn_s * 1.1 > tiles_s;
  const std::string timings =
      fmt::format("tiles {:.3f} ms, onednn {:.3f} ms", tiles_s * 1e3, onednn_s * 1e3);
  table.record(kAttentionKind, key,
               {tiles ? "tiles" : "onednn", KernelTable::Source::kMeasured, timings});
  PORTER_LOG_DEBUG("cpu attention {}: {}; runs on {}", key, timings,
                   tiles ? "the tiles" : "oneDNN");
  return tiles;
}

void CpuKernels::do_attention_forward(const Tensor& qkv, Tensor& out, Tensor& probs, int heads) {
  const Dims d = dims_of(qkv, heads);
  if (d.b == 0 || d.t == 0 || d.c == 0) return;
  const AttentionCall call = call_of(d, qkv.dtype(), out.dtype(), DType::kF32);
  const workspace_layout::CpuAttentionForward layout = workspace_layout::cpu_attention_forward(call);
  const memory::DeviceBuffer buffer = workspace(layout.total_bytes(), "attention_forward");
  float* pr = probs.data_as<float>();
  const auto run = [&](bool tiles) {
    if (layout.bf16) {
      if (tiles) {
        cpu::attention_forward_tiles_bf16(threads_, d,
                                          static_cast<const uint16_t*>(qkv.data()), out, pr,
                                          tile_scratch_);
      } else {
        forward_bf16(*dnnl_, threads_, d, layout, buffer.as<char>(), qkv, out, pr);
      }
      return;
    }
    // f32 scratch (Note [Attention scratch]): f32 qkv, then f32 out, each when needed.
    float* scratch = buffer.as<float>();
    const float* x = as_f32(threads_, qkv, scratch);
    float* o =
        layout.out_bytes ? scratch + layout.qkv_bytes / sizeof(float) : out.data_as<float>();
    if (tiles) {
      cpu::attention_forward_tiles_f32(threads_, d, x, o, pr, tile_scratch_);
    } else {
      forward_f32(*dnnl_, threads_, d, x, o, pr);
    }
    if (layout.out_bytes) cpu::narrow_from_f32(threads_, o, out);
  };
  const bool supported = layout.bf16 ? cpu::attention_tiles_bf16_supported(d.hd)
                                     : cpu::attention_tiles_f32_supported();
  run(attention_on_tiles(call, false, supported, run));
}

void CpuKernels::do_attention_backward(const Tensor& dout, const Tensor& qkv, const Tensor& probs,
                                       Tensor& dqkv, int heads) {
  const Dims d = dims_of(qkv, heads);
  if (d.b == 0 || d.t == 0 || d.c == 0) return;
  const int64_t block_rows = std::min(kRowBlock, d.t);
  const AttentionCall call = call_of(d, qkv.dtype(), dout.dtype(), dqkv.dtype());
  const workspace_layout::CpuAttentionBackward layout =
      workspace_layout::cpu_attention_backward(call);
  PORTER_ASSERT(layout.dp_bytes == static_cast<size_t>(d.b * d.heads * block_rows * d.t) * 4,
                "attention_backward scratch layout disagrees with the row blocks");
  const memory::DeviceBuffer buffer = workspace(layout.total_bytes(), "attention_backward");
  const float* pr = probs.data_as<float>();
  const auto run = [&](bool tiles) {
    if (layout.bf16) {
      if (tiles) {
        cpu::attention_backward_tiles_bf16(
            threads_, d, static_cast<const uint16_t*>(qkv.data()),
            static_cast<const uint16_t*>(dout.data()), pr, buffer.as<float>(), dqkv,
            tile_scratch_);
      } else {
        backward_bf16(*dnnl_, threads_, d, layout, buffer.as<char>(), dout, qkv, pr, dqkv);
      }
      return;
    }
    // f32 scratch: the dS block, then the f32 copies of the arguments that are not f32
    // (Note [Attention scratch]).
    float* scratch = buffer.as<float>();
    const size_t ds_elems = layout.dp_bytes / 4, qkv_elems = layout.qkv_bytes / 4;
    const size_t dout_elems = layout.dout_bytes / 4, dqkv_elems = layout.dqkv_bytes / 4;
    float* ds = scratch;
    const float* x = as_f32(threads_, qkv, scratch + ds_elems);
    const float* dy = as_f32(threads_, dout, scratch + ds_elems + qkv_elems);
    float* dx = dqkv_elems ? scratch + ds_elems + qkv_elems + dout_elems : dqkv.data_as<float>();
    if (tiles) {
      cpu::attention_backward_tiles_f32(threads_, d, x, dy, pr, ds, dx, tile_scratch_);
    } else {
      backward_f32(*dnnl_, threads_, d, x, dy, pr, ds, dx);
    }
    if (dqkv_elems) cpu::narrow_from_f32(threads_, dx, dqkv);
  };
  const bool supported = layout.bf16 ? cpu::attention_tiles_bf16_supported(d.hd)
                                     : cpu::attention_tiles_f32_supported();
  run(attention_on_tiles(call, true, supported, run));
}

}  // namespace porter::kernels
