// Causal attention on the cpu one (batch, head) at a time, on porter's own AVX-512 tiles: f32
// with FMA, bf16 with AVX512-BF16 dot products, only the causal triangle.
//
// Note [Attention head tiles]
// oneDNN 2.6 runs the batched calls of Note [Causal row blocks] (kernels/cpu/attention.cc), whose
// operands are strided views of qkv, on its gemm:jit kernel, and the packed bf16 calls of Note
// [Bf16 attention] on brgemm over the full T x T. On a 2-core AMD EPYC (Zen 5, AVX512-BF16) the
// sweep (bench/matmul_sweep_bench.cc) measured those calls at 0.73-0.92 of sgemm in f32 and
// 0.45-0.61 of oneDNN's bf16 peak in bf16: per-head matrices of 64 x i1 x 64 are too small for
// oneDNN's per-call blocking and threading. So where the cpu has the instructions, attention
// runs here instead:
// - Threads take whole (batch, head) pairs (B * heads tasks), so every output element is
//   computed by one thread in a fixed order: bits do not depend on the thread count.
// - Per head, rows go in blocks of kCpuAttentionRowBlock as before. A block's scores are one
//   tiled product over keys [0, i1) that skips the tiles right of the diagonal; softmax runs
//   on the block's rows while they are in cache; P V and the backward products stop at the
//   diagonal too. The saved probabilities, their zeros above the diagonal included, are the
//   same tensor as before, so the memory model does not change.
// - A tile is kMr rows x 64 columns of f32 accumulators (24 of the 32 zmm registers), fed by
//   one broadcast per row and one 16-lane load per column vector per step. A step is one f32
//   (FMA) or one pair of bf16 values (vdpbf16ps: two products summed into each f32 lane,
//   exact products, f32 accumulation). bf16 operands are therefore packed with pairs adjacent
//   along the reduced dimension: K^T and V^T as (hd/2, T) pairs, V and K as (T/2, hd) pairs,
//   and in backward dS^T, P^T, Q and dout of a row block as (rows/2, ·) pairs. Odd lengths are
//   padded with zeros. Q and dout rows already hold pairs along hd and are read in place.
// - The packed copies are per-thread host scratch (TileScratch, owned by CpuKernels), like
//   oneDNN's own scratchpad: kernel-internal packing, under 1 MiB per thread at GPT-2's
//   T = 512 and head_dim 64 (0.75 MiB in f32 backward), not a tensor. The dP block goes in the device workspace's dP region (one
//   (R, T) slice per head), as in the oneDNN path; the bf16 path leaves the rest of its
//   workspace, which the oneDNN path needs, unused, so the workspace (and the analytic memory
//   model) stays a function of the call alone, the same on every cpu.
// - f32 operands that are strided views of qkv or dout (V, K, Q, dout) are copied per head into
//   dense (T, hd) arrays first, so that a product's B rows are contiguous.
// - Precision is that of Note [Bf16 attention]: scores and dP exact products summed in f32;
//   P and dS rounded once to bf16 for the products that take them; dQ, dK, dV and out summed
//   in f32 and rounded once into their tensors.
// Which of the two runs is recorded in the kernel table (CpuKernels::attention_on_tiles in
// kernels/cpu/attention.cc, Note [Kernel table] in kernels/kernel_table.cc): the tiles run on AVX-512F /
// AVX512-BF16 dot products, while oneDNN's packed bf16 calls use AMX where the cpu has it, over
// the full T x T, and the relative cost of the two differs by cpu. The two sum in different
// orders, so by default (kernel_choice "exact") the tiles run wherever the cpu has them,
// unmeasured, and every process computes the same bits; under kernel_choice "fastest" the
// first call of each shape (dtypes, direction and thread count included) above 2^27 FLOPs
// times both on its own tensors and keeps the tiles unless oneDNN is at least 10% faster.
// PORTER_CPU_ATTENTION=tiles (or onednn) forces the choice. Without AVX-512F (f32) or
// AVX512-BF16 (bf16), or with an odd bf16 head size, the oneDNN path runs.
#include "kernels/cpu/attention_heads.h"

#include <omp.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#include <utility>

#include "base/check.h"
#include "base/error.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/head_tiles.h"
#include "kernels/cpu/isa.h"
#include "kernels/workspace.h"


namespace porter::kernels::cpu {

AttentionImpl attention_impl_from_env() {
  const char* v = std::getenv("PORTER_CPU_ATTENTION");
  if (v == nullptr || *v == '\0') return AttentionImpl::kAuto;
  const std::string_view s(v);
  if (s == "auto") return AttentionImpl::kAuto;
  if (s == "tiles") return AttentionImpl::kTiles;
  if (s == "onednn") return AttentionImpl::kOneDnn;
  throw InvalidArgument("PORTER_CPU_ATTENTION is \"" + std::string(s) +
                        "\"; use auto (the default: as porter.device.kernel_choice says), "
                        "tiles or onednn");
}

void TileScratch::reserve(int threads, size_t bytes) {
  slice_bytes_ = (bytes + 63) / 64 * 64;
  base_ = aligned_bytes(storage_, slice_bytes_ * static_cast<size_t>(threads));
}

namespace {

constexpr int64_t kRowBlock = workspace_layout::kCpuAttentionRowBlock;

using namespace tiles;

#if PORTER_CPU_X86

// Row i of a block's scores `s` (valid in [0, i]) to probabilities: written to pr_row [0, t)
// with zeros after i, by streaming stores where pr_row is 64-byte aligned (the saved
// probabilities are written once and not read again in forward); and to the block's operand
// for P V: in bf16 into p16 [0, width) when p16 is given, else in f32 back into s [0, width),
// zeros after i. Each range is its own loop, so the zeros cost a store per vector.
PORTER_CPU_TARGET(PORTER_ISA_TILES_F32)
void softmax_row(float* s, int64_t i, float* pr_row, int64_t t, uint16_t* p16, int64_t width) {
  const int64_t n = i + 1, full = n / 16 * 16;
  __m512 mx = _mm512_set1_ps(-INFINITY);
  for (int64_t j = 0; j < full; j += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + j));
  if (full < n) {
    mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(mx, first_lanes(n - full), s + full));
  }
  const __m512 vmx = _mm512_set1_ps(lane_max(mx));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < full; j += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), vmx));
    _mm512_storeu_ps(s + j, e);
    sum = _mm512_add_ps(sum, e);
  }
  if (full < n) {
    const __mmask16 m = first_lanes(n - full);
    const __m512 e = _mm512_maskz_mov_ps(m, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + full), vmx)));
    _mm512_mask_storeu_ps(s + full, m, e);
    sum = _mm512_add_ps(sum, e);
  }
  const __m512 inv = _mm512_set1_ps(1.0f / lane_sum(sum));
  const bool stream = reinterpret_cast<uintptr_t>(pr_row) % 64 == 0;
  // [0, n) rounded up to whole vectors: the probabilities, then zeros (masked loads past n).
  int64_t j = 0;
  for (; j < n; j += 16) {
    const __mmask16 m = first_lanes(n - j);
    const __m512 p = _mm512_maskz_mul_ps(m, _mm512_maskz_loadu_ps(m, s + j), inv);
    if (stream && j + 16 <= t) {
      _mm512_stream_ps(pr_row + j, p);
    } else {
      _mm512_mask_storeu_ps(pr_row + j, first_lanes(t - j), p);
    }
    if (p16 != nullptr) {
      if (j < width) _mm256_mask_storeu_epi16(p16 + j, first_lanes(width - j), to_bf16x16(p));
    } else if (j < width) {
      _mm512_mask_storeu_ps(s + j, first_lanes(width - j), p);
    }
  }
  // The zeros after them: in probs up to t, in the operand up to width.
  const __m512 zero = _mm512_setzero_ps();
  int64_t k = j;
  if (stream) {
    for (; k + 16 <= t; k += 16) _mm512_stream_ps(pr_row + k, zero);
  }
  for (; k < t; k += 16) _mm512_mask_storeu_ps(pr_row + k, first_lanes(t - k), zero);
  for (k = j; k < width; k += 16) {
    if (p16 != nullptr) {
      _mm256_mask_storeu_epi16(p16 + k, first_lanes(width - k), _mm256_setzero_si256());
    } else {
      _mm512_mask_storeu_ps(s + k, first_lanes(width - k), zero);
    }
  }
}

// Row i of a block in the f32 backward: dS = scale * P * (dP - sum_j P dP) over [0, i], in
// place over dP (`ds`), zeros in (i, width).
PORTER_CPU_TARGET(PORTER_ISA_TILES_F32)
void softmax_backward_row_f32(const float* p, float* ds, int64_t i, int64_t width, float scale) {
  const int64_t n = i + 1;
  __m512 acc = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = first_lanes(n - j);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, p + j), _mm512_maskz_loadu_ps(m, ds + j), acc);
  }
  const __m512 sum = _mm512_set1_ps(lane_sum(acc));
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t j = 0; j < width; j += 16) {
    const __mmask16 m = j < n ? first_lanes(n - j) : __mmask16{0};
    const __m512 v = _mm512_maskz_mul_ps(m, _mm512_mul_ps(vscale, _mm512_maskz_loadu_ps(m, p + j)),
                                         _mm512_sub_ps(_mm512_maskz_loadu_ps(m, ds + j), sum));
    _mm512_mask_storeu_ps(ds + j, first_lanes(width - j), v);
  }
}

// Row i of a block in the bf16 backward: dS = scale * P * (dP - sum_j P dP) over [0, i] and P,
// both rounded to bf16 into ds16 and p16 [0, width), zeros after i.
PORTER_CPU_TARGET(PORTER_ISA_TILES_F32)
void softmax_backward_row_tiles(const float* p, const float* dp, uint16_t* ds16, uint16_t* p16,
                                int64_t i, int64_t width, float scale) {
  const int64_t n = i + 1;
  __m512 acc = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = first_lanes(n - j);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, p + j), _mm512_maskz_loadu_ps(m, dp + j), acc);
  }
  const __m512 sum = _mm512_set1_ps(lane_sum(acc));
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t j = 0; j < width; j += 16) {
    const __mmask16 m = j < n ? first_lanes(n - j) : __mmask16{0};
    const __m512 pv = _mm512_maskz_loadu_ps(m, p + j);
    const __m512 ds = _mm512_maskz_mul_ps(m, _mm512_mul_ps(vscale, pv),
                                          _mm512_sub_ps(_mm512_maskz_loadu_ps(m, dp + j), sum));
    const __mmask16 w = first_lanes(width - j);
    _mm256_mask_storeu_epi16(ds16 + j, w, to_bf16x16(ds));
    _mm256_mask_storeu_epi16(p16 + j, w, to_bf16x16(pv));
  }
}

#endif  // PORTER_CPU_X86

}  // namespace

#if PORTER_CPU_X86

bool attention_tiles_f32_supported() { return cpu_runs(PORTER_ISA_TILES_F32); }

bool attention_tiles_bf16_supported(int64_t head_dim) {
  return head_dim % 2 == 0 && cpu_runs(PORTER_ISA_TILES_BF16);
}

void attention_forward_tiles_f32(int threads, const HeadDims& d, const float* x, float* o,
                                 float* pr, TileScratch& scratch) {
  const int64_t t = d.t, hd = d.hd, c3 = 3 * d.c;
  const int64_t block_rows = std::min(kRowBlock, t);
  scratch.reserve(threads, 2 * round64(static_cast<size_t>(hd * t) * 4) +   // K^T, V
                               round64(static_cast<size_t>(block_rows * t) * 4));  // S, P
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t bh = 0; bh < d.b * d.heads; ++bh) {
    const int64_t b = bh / d.heads, h = bh % d.heads;
    Carver carve{scratch.slice(omp_get_thread_num())};
    auto* kt = carve.take<float>(hd * t);  // (hd, t)
    auto* vh = carve.take<float>(t * hd);  // (t, hd)
    auto* sb = carve.take<float>(block_rows * t);
    const float* q = x + b * t * c3 + h * hd;
    transpose32(q + d.c, c3, t, hd, kt, t);
    copy_rows(q + 2 * d.c, c3, t, hd, vh);
    float* p = pr + bh * t * t;
    for (int64_t i0 = 0; i0 < t; i0 += kRowBlock) {
      const int64_t rows = std::min(kRowBlock, t - i0), i1 = i0 + rows;
      Gemm gs{rows, i1, hd, q + i0 * c3, c3, 1, kt, t, sb, t};
      gs.alpha = scale;
      gs.col_causal = i0;
      run_gemm<false>(gs);
      for (int64_t r = 0; r < rows; ++r) {
        softmax_row(sb + r * t, i0 + r, p + (i0 + r) * t, t, nullptr, i1);
      }
      Gemm pv{rows, hd, i1, sb, t, 1, vh, hd, o + (b * t + i0) * d.c + h * hd, d.c};
      pv.step_causal = i0;
      run_gemm<false>(pv);
    }
    _mm_sfence();  // the streamed probabilities, before another thread may read them
  }
}

void attention_backward_tiles_f32(int threads, const HeadDims& d, const float* x, const float* dy,
                                  const float* pr, float* ds, float* dx, TileScratch& scratch) {
  const int64_t t = d.t, hd = d.hd, c3 = 3 * d.c;
  const int64_t block_rows = std::min(kRowBlock, t);
  scratch.reserve(threads, 6 * round64(static_cast<size_t>(hd * t) * 4));
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const int64_t n_blocks = (t + kRowBlock - 1) / kRowBlock;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t bh = 0; bh < d.b * d.heads; ++bh) {
    const int64_t b = bh / d.heads, h = bh % d.heads;
    Carver carve{scratch.slice(omp_get_thread_num())};
    auto* vt = carve.take<float>(hd * t);  // (hd, t)
    auto* kh = carve.take<float>(t * hd);  // (t, hd), and Q, dout, dK, dV alike
    auto* qh = carve.take<float>(t * hd);
    auto* dyh = carve.take<float>(t * hd);
    auto* dk = carve.take<float>(t * hd);
    auto* dv = carve.take<float>(t * hd);
    const float* q = x + b * t * c3 + h * hd;
    transpose32(q + 2 * d.c, c3, t, hd, vt, t);
    copy_rows(q + d.c, c3, t, hd, kh);
    copy_rows(q, c3, t, hd, qh);
    copy_rows(dy + b * t * d.c + h * hd, d.c, t, hd, dyh);
    float* dq = dx + b * t * c3 + h * hd;
    float* dsb = ds + bh * block_rows * t;  // (R, t)
    const float* p = pr + bh * t * t;
    // Last block first: it covers every key, so it initialises dK and dV, and earlier blocks
    // add to a prefix of them in a fixed order.
    for (int64_t blk = n_blocks - 1; blk >= 0; --blk) {
      const int64_t i0 = blk * kRowBlock, rows = std::min(kRowBlock, t - i0), i1 = i0 + rows;
      const bool first = blk == n_blocks - 1;
      // dP = dout[i0:i1] V[0:i1]^T, then dS in place.
      Gemm gp{rows, i1, hd, dyh + i0 * hd, hd, 1, vt, t, dsb, t};
      gp.col_causal = i0;
      run_gemm<false>(gp);
      for (int64_t r = 0; r < rows; ++r) {
        softmax_backward_row_f32(p + (i0 + r) * t, dsb + r * t, i0 + r, i1, scale);
      }
      // dQ[i0:i1] = dS K[0:i1].
      Gemm gq{rows, hd, i1, dsb, t, 1, kh, hd, dq + i0 * c3, c3};
      gq.step_causal = i0;
      run_gemm<false>(gq);
      // dK[0:i1] (+)= dS^T Q[i0:i1];  dV[0:i1] (+)= P[i0:i1, 0:i1]^T dout[i0:i1].
      Gemm gk{i1, hd, rows, dsb, 1, t, qh + i0 * hd, hd, dk, hd};
      gk.accumulate = !first;
      run_gemm<false>(gk);
      Gemm gv{i1, hd, rows, p + i0 * t, 1, t, dyh + i0 * hd, hd, dv, hd};
      gv.accumulate = !first;
      run_gemm<false>(gv);
    }
    for (int64_t j = 0; j < t; ++j) {
      std::memcpy(dq + j * c3 + d.c, dk + j * hd, static_cast<size_t>(hd) * 4);
      std::memcpy(dq + j * c3 + 2 * d.c, dv + j * hd, static_cast<size_t>(hd) * 4);
    }
  }
}

void attention_forward_tiles_bf16(int threads, const HeadDims& d, const uint16_t* x, Tensor& out,
                                  float* pr, TileScratch& scratch) {
  const int64_t t = d.t, hd = d.hd, c3 = 3 * d.c, tp = t + (t & 1);
  const int64_t block_rows = std::min(kRowBlock, t);
  const size_t bytes = round64(static_cast<size_t>(hd / 2 * tp) * 4) +     // K^T pairs
                       round64(static_cast<size_t>(tp / 2 * hd) * 4) +     // V pairs
                       round64(static_cast<size_t>(block_rows * t) * 4) +  // S, f32
                       round64(static_cast<size_t>(block_rows * tp) * 2) +  // P, bf16
                       round64(static_cast<size_t>(block_rows * hd) * 4);   // out, f32
  scratch.reserve(threads, bytes);
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t bh = 0; bh < d.b * d.heads; ++bh) {
    const int64_t b = bh / d.heads, h = bh % d.heads;
    Carver carve{scratch.slice(omp_get_thread_num())};
    auto* kt = carve.take<uint32_t>(hd / 2 * tp);
    auto* vv = carve.take<uint32_t>(tp / 2 * hd);
    auto* sb = carve.take<float>(block_rows * t);
    auto* p16 = carve.take<uint16_t>(block_rows * tp);
    auto* ob = carve.take<float>(block_rows * hd);
    const uint16_t* q = x + b * t * c3 + h * hd;
    transpose32(q + d.c, c3 / 2, t, hd / 2, kt, tp);
    pack_row_pairs(q + 2 * d.c, c3, t, hd, vv);
    float* p = pr + bh * t * t;
    for (int64_t i0 = 0; i0 < t; i0 += kRowBlock) {
      const int64_t rows = std::min(kRowBlock, t - i0), i1 = i0 + rows;
      const int64_t width = i1 + (i1 & 1);
      // Scores, then the probabilities: f32 into probs, bf16 for P V (zero to an even width).
      Gemm gs{rows, i1, hd / 2, q + i0 * c3, c3 / 2, 1, kt, tp, sb, t};
      gs.alpha = scale;
      gs.col_causal = i0;
      run_gemm<true>(gs);
      for (int64_t r = 0; r < rows; ++r) {
        softmax_row(sb + r * t, i0 + r, p + (i0 + r) * t, t, p16 + r * tp, width);
      }
      // out[i0:i1] = P V, over the key pairs up to the diagonal.
      Gemm pv{rows, hd, width / 2, p16, tp / 2, 1, vv, hd, ob, hd};
      pv.step_causal = i0;
      pv.step_elems = 2;
      run_gemm<true>(pv);
      store_rows(ob, hd, rows, hd, out, (b * t + i0) * d.c + h * hd, d.c);
    }
    _mm_sfence();  // the streamed probabilities, before another thread may read them
  }
}

void attention_backward_tiles_bf16(int threads, const HeadDims& d, const uint16_t* x,
                                   const uint16_t* dy, const float* pr, float* dp, Tensor& dqkv,
                                   TileScratch& scratch) {
  const int64_t t = d.t, hd = d.hd, c3 = 3 * d.c, tp = t + (t & 1);
  const int64_t block_rows = std::min(kRowBlock, t), rp = block_rows + (block_rows & 1);
  const size_t bytes = 2 * round64(static_cast<size_t>(hd / 2 * tp) * 4) +  // V^T, K pairs
                       2 * round64(static_cast<size_t>(rp * tp) * 2) +       // dS, P in bf16
                       2 * round64(static_cast<size_t>(rp / 2 * tp) * 4) +   // dS^T, P^T pairs
                       2 * round64(static_cast<size_t>(rp / 2 * hd) * 4) +   // Q, dout pairs
                       round64(static_cast<size_t>(block_rows * hd) * 4) +   // dQ block
                       2 * round64(static_cast<size_t>(t * hd) * 4);         // dK, dV
  scratch.reserve(threads, bytes);
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t bh = 0; bh < d.b * d.heads; ++bh) {
    const int64_t b = bh / d.heads, h = bh % d.heads;
    Carver carve{scratch.slice(omp_get_thread_num())};
    auto* vt = carve.take<uint32_t>(hd / 2 * tp);
    auto* kv = carve.take<uint32_t>(tp / 2 * hd);
    auto* ds16 = carve.take<uint16_t>(rp * tp);
    auto* p16 = carve.take<uint16_t>(rp * tp);
    auto* dst = carve.take<uint32_t>(rp / 2 * tp);
    auto* pt = carve.take<uint32_t>(rp / 2 * tp);
    auto* qv = carve.take<uint32_t>(rp / 2 * hd);
    auto* dov = carve.take<uint32_t>(rp / 2 * hd);
    auto* dqb = carve.take<float>(block_rows * hd);
    auto* dk = carve.take<float>(t * hd);
    auto* dv = carve.take<float>(t * hd);
    const uint16_t* q = x + b * t * c3 + h * hd;
    const uint16_t* dyh = dy + b * t * d.c + h * hd;
    const float* p = pr + bh * t * t;
    float* dpb = dp + bh * block_rows * t;  // (R, t)
    transpose32(q + 2 * d.c, c3 / 2, t, hd / 2, vt, tp);
    pack_row_pairs(q + d.c, c3, t, hd, kv);
    std::memset(dk, 0, static_cast<size_t>(t * hd) * 4);
    std::memset(dv, 0, static_cast<size_t>(t * hd) * 4);
    for (int64_t i0 = 0; i0 < t; i0 += kRowBlock) {
      const int64_t rows = std::min(kRowBlock, t - i0), i1 = i0 + rows;
      const int64_t width = i1 + (i1 & 1), pairs = (rows + 1) / 2;
      // dP = dout[i0:i1] V[0:i1]^T.
      Gemm gp{rows, i1, hd / 2, dyh + i0 * d.c, d.c / 2, 1, vt, tp, dpb, t};
      gp.col_causal = i0;
      run_gemm<true>(gp);
      // dS and P in bf16, zero to an even width; a zero row pads an odd row count.
      for (int64_t r = 0; r < rows; ++r) {
        softmax_backward_row_tiles(p + (i0 + r) * t, dpb + r * t, ds16 + r * tp, p16 + r * tp,
                                   i0 + r, width, scale);
      }
      if (rows & 1) {
        std::memset(ds16 + rows * tp, 0, static_cast<size_t>(width) * 2);
        std::memset(p16 + rows * tp, 0, static_cast<size_t>(width) * 2);
      }
      // dQ[i0:i1] = dS K, over the key pairs up to the diagonal.
      Gemm gq{rows, hd, width / 2, ds16, tp / 2, 1, kv, hd, dqb, hd};
      gq.step_causal = i0;
      gq.step_elems = 2;
      run_gemm<true>(gq);
      store_rows(dqb, hd, rows, hd, dqkv, (b * t + i0) * c3 + h * hd, c3);
      // dK[0:i1] += dS^T Q[i0:i1];  dV[0:i1] += P^T dout[i0:i1], pairs along the block's rows.
      pack_row_pairs(ds16, tp, 2 * pairs, width, dst);
      pack_row_pairs(p16, tp, 2 * pairs, width, pt);
      pack_row_pairs(q + i0 * c3, c3, rows, hd, qv);
      pack_row_pairs(dyh + i0 * d.c, d.c, rows, hd, dov);
      Gemm gk{i1, hd, pairs, dst, 1, width, qv, hd, dk, hd};
      gk.accumulate = true;
      run_gemm<true>(gk);
      Gemm gv{i1, hd, pairs, pt, 1, width, dov, hd, dv, hd};
      gv.accumulate = true;
      run_gemm<true>(gv);
    }
    store_rows(dk, hd, t, hd, dqkv, b * t * c3 + d.c + h * hd, c3);
    store_rows(dv, hd, t, hd, dqkv, b * t * c3 + 2 * d.c + h * hd, c3);
  }
}

#else  // !PORTER_CPU_X86

bool attention_tiles_f32_supported() { return false; }
bool attention_tiles_bf16_supported(int64_t) { return false; }

void attention_forward_tiles_f32(int, const HeadDims&, const float*, float*, float*,
                                 TileScratch&) {
  PORTER_ASSERT(false, "attention head tiles called on a cpu without them");
}
void attention_backward_tiles_f32(int, const HeadDims&, const float*, const float*, const float*,
                                  float*, float*, TileScratch&) {
  PORTER_ASSERT(false, "attention head tiles called on a cpu without them");
}
void attention_forward_tiles_bf16(int, const HeadDims&, const uint16_t*, Tensor&, float*,
                                  TileScratch&) {
  PORTER_ASSERT(false, "attention head tiles called on a cpu without them");
}
void attention_backward_tiles_bf16(int, const HeadDims&, const uint16_t*, const uint16_t*,
                                   const float*, float*, Tensor&, TileScratch&) {
  PORTER_ASSERT(false, "attention head tiles called on a cpu without them");
}

#endif  // PORTER_CPU_X86

}  // namespace porter::kernels::cpu
