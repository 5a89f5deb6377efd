// Memory-efficient causal attention on the cpu (Note [Flash attention] in kernels/kernels.cc):
// query blocks against key tiles with an online softmax, so no (T, T) array exists.
//
// Note [Flash attention tiles]
// - Tasks. Forward runs one (batch, query head) per task, backward one (batch, key/value
//   head) per task, the group's query heads in head order inside it, so dK and dV of a
//   key/value head are summed by one thread. Tasks go to `threads_` OpenMP threads; each
//   output element is computed by one thread in a fixed order, and the bits do not depend on
//   the thread count (Note [Cpu determinism]).
// - Tiling. Query rows go in blocks of kQueryBlock (64), keys in tiles of kKeyTile (256)
//   starting at multiples of kKeyTile; a block reads the tiles that start at or before its
//   first row (kKeyTile is a multiple of kQueryBlock, so each such tile has a key at or before
//   every row of the block), the last one cut at the block's last row. Entries above the
//   diagonal are never used: they are zero in P and dS, and the tiles' causal limits skip
//   most of them (Gemm::col_causal, step_causal in kernels/cpu/head_tiles.h).
// - Forward, per block: for each tile in key order, S = scale * Q K^T (f32), the tile's row
//   maximum m' = max(m, max S), alpha = exp(m - m'), P = exp(S - m'), l = alpha l + sum P (in
//   key order), acc = alpha acc + P V; after the last tile out = acc / l, rounded once into
//   out's dtype, and lse = m + log(l).
// - Backward: D = sum_e dout * out per row (in f32, e in order) into the workspace, then per
//   query head, block and tile: S as in forward, P = exp(S - lse), dP = dout V^T, dS = scale *
//   P * (dP - D), dQ(block) += dS K (tiles in key order), dK(tile) += dS^T Q, dV(tile) += P^T
//   dout. dQ is rounded once per block; dK and dV (f32, (T, D) per task) are summed over the
//   group's heads, blocks and rows in that order and rounded once at the end.
// - Paths. Where the cpu has the head tiles' instructions (kernels/cpu/head_tiles.h), the
//   products run on them: f32 qkv on the f32 FMA tiles (dout and out of any float dtype,
//   widened while packing); bf16 qkv with an even head size (and bf16 dout in backward) on the
//   AVX512-BF16 tiles, with the precision of Note [Bf16 attention] (kernels/cpu/attention.cc):
//   scores and dP are exact bf16 products summed in f32, P and dS are rounded to bf16 for the
//   products that take them (P V, P^T dout, dS K, dS^T Q), while l, dS's P and every
//   accumulator stay f32. Every other case (f16 qkv, odd bf16 head sizes, bf16 qkv with f32
//   dout, a cpu without AVX-512) runs the portable loops: the same tiling and order of tiles
//   in plain f32 loops, operands widened to f32 while packing. The paths differ in the last
//   bits; each gives the same bits on every thread count.
// - Packing and scratch (per thread, the TileScratch CpuKernels owns, host memory outside the
//   device's capacity like the head tiles' own): forward K^T and V of the head (T D f32 each,
//   or T D bf16 pairs), the scores of one tile (kQueryBlock x kKeyTile f32, and bf16 P) and
//   the block's f32 accumulator; backward K^T, K, V^T and the f32 dK and dV of the key/value
//   head (5 T D f32), the S/P and dP/dS tiles (f32, and bf16 with their row-pair copies), the
//   Q and dout blocks and the f32 dQ block. With T = 4096 and D = 64 that is 2.2 MiB per thread
//   forward and 5.3 MiB backward, O(T D); nothing is O(T^2). The only device workspace is
//   backward's D, (B, H, T) f32, one buffer of flash_attention_backward_workspace_bytes.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "base/check.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/head_tiles.h"
#include "kernels/cpu/isa.h"

namespace porter::kernels {
namespace {

using cpu::tiles::Carver;
using cpu::tiles::round64;

constexpr int64_t kQueryBlock = 64;
constexpr int64_t kKeyTile = 256;
static_assert(kKeyTile % kQueryBlock == 0, "a block's tiles must start at or before its rows");

// Sizes of one flash call: qkv (b, t, (h + 2 hkv) d).
struct FlashDims {
  int64_t b, t, h, hkv, d;
  int64_t ld() const { return (h + 2 * hkv) * d; }  // qkv's row
  int64_t group() const { return h / hkv; }
  int64_t k_col(int64_t g) const { return (h + g) * d; }
  int64_t v_col(int64_t g) const { return (h + hkv + g) * d; }
};

FlashDims dims_of(const Tensor& qkv, int heads, int kv_heads) {
  const int64_t d = qkv.dim(2) / (heads + 2 * int64_t{kv_heads});
  return {qkv.dim(0), qkv.dim(1), heads, kv_heads, d};
}

// The key tiles of the block starting at row i0 that ends at i1: [j0, j_end) for j0 = 0,
// kKeyTile, ... <= i0, the last cut at i1.
inline int64_t tile_end(int64_t j0, int64_t i1) { return std::min(j0 + kKeyTile, i1); }

// ---- The portable loops ----------------------------------------------------------------

// dst (rows, cols) f32 = src rows (stride ld) widened.
template <typename T>
void widen_rows(const T* src, int64_t ld, int64_t rows, int64_t cols, float* dst) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t e = 0; e < cols; ++e) dst[r * cols + e] = cpu::load(src + r * ld + e);
  }
}

// dst (cols, rows) f32 = the transpose of src rows (stride ld), widened.
template <typename T>
void widen_transposed(const T* src, int64_t ld, int64_t rows, int64_t cols, float* dst) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t e = 0; e < cols; ++e) dst[e * rows + r] = cpu::load(src + r * ld + e);
  }
}

// s[j] = scale * sum_e a[e] bt[e * ldb + j] for j < n, e in order.
inline void row_times_transposed(const float* a, const float* bt, int64_t ldb, int64_t dd,
                                 int64_t n, float scale, float* s) {
  for (int64_t j = 0; j < n; ++j) s[j] = 0.0f;
  for (int64_t e = 0; e < dd; ++e) {
    const float x = a[e];
    const float* b = bt + e * ldb;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) s[j] += x * b[j];
  }
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) s[j] *= scale;
}

// acc[e] += sum_j p[j] b[j * dd + e] for j < n in order.
inline void row_times_rows(const float* p, const float* b, int64_t n, int64_t dd, float* acc) {
  for (int64_t j = 0; j < n; ++j) {
    const float x = p[j];
    const float* bj = b + j * dd;
#pragma omp simd
    for (int64_t e = 0; e < dd; ++e) acc[e] += x * bj[e];
  }
}

template <typename TQ, typename TO>
void forward_portable(int threads, const FlashDims& fd, const TQ* x, TO* o, float* lse,
                      cpu::TileScratch& scratch) {
  const int64_t t = fd.t, dd = fd.d, ld = fd.ld(), rows_max = std::min(kQueryBlock, t);
  scratch.reserve(threads, 2 * round64(static_cast<size_t>(t * dd) * 4) +
                               round64(static_cast<size_t>(rows_max * dd) * 4) * 2 +
                               round64(static_cast<size_t>(kKeyTile) * 4) +
                               2 * round64(static_cast<size_t>(rows_max) * 4));
  const float scale = 1.0f / std::sqrt(static_cast<float>(dd));
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t bh = 0; bh < fd.b * fd.h; ++bh) {
    const int64_t b = bh / fd.h, h = bh % fd.h, g = h / fd.group();
    Carver carve{scratch.slice(omp_get_thread_num())};
    float* kt = carve.take<float>(dd * t);  // (d, t)
    float* vh = carve.take<float>(t * dd);  // (t, d)
    float* qb = carve.take<float>(rows_max * dd);
    float* acc = carve.take<float>(rows_max * dd);
    float* s = carve.take<float>(kKeyTile);
    float* m = carve.take<float>(rows_max);
    float* l = carve.take<float>(rows_max);
    const TQ* row0 = x + b * t * ld;
    widen_transposed(row0 + fd.k_col(g), ld, t, dd, kt);
    widen_rows(row0 + fd.v_col(g), ld, t, dd, vh);
    for (int64_t i0 = 0; i0 < t; i0 += kQueryBlock) {
      const int64_t rows = std::min(kQueryBlock, t - i0), i1 = i0 + rows;
      widen_rows(row0 + i0 * ld + h * dd, ld, rows, dd, qb);
      std::fill(acc, acc + rows * dd, 0.0f);
      std::fill(m, m + rows, -INFINITY);
      std::fill(l, l + rows, 0.0f);
      for (int64_t j0 = 0; j0 <= i0; j0 += kKeyTile) {
        const int64_t j1 = tile_end(j0, i1);
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t n = std::min(j1, i0 + r + 1) - j0;  // >= 1: j0 <= i0
          row_times_transposed(qb + r * dd, kt + j0, t, dd, n, scale, s);
          float mx = m[r];
          for (int64_t j = 0; j < n; ++j) mx = std::max(mx, s[j]);
          const float alpha = m[r] == -INFINITY ? 0.0f : cpu::fast_exp(m[r] - mx);
          float sum = 0.0f;
          for (int64_t j = 0; j < n; ++j) {
            s[j] = cpu::fast_exp(s[j] - mx);
            sum += s[j];
          }
          m[r] = mx;
          l[r] = alpha * l[r] + sum;
          float* a = acc + r * dd;
#pragma omp simd
          for (int64_t e = 0; e < dd; ++e) a[e] *= alpha;
          row_times_rows(s, vh + j0 * dd, n, dd, a);
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        const float inv = 1.0f / l[r];
        TO* out = o + (b * t + i0 + r) * fd.h * dd + h * dd;
        for (int64_t e = 0; e < dd; ++e) cpu::store(out + e, acc[r * dd + e] * inv);
        lse[bh * t + i0 + r] = m[r] + std::log(l[r]);
      }
    }
  }
}

// D = sum_e dout * out of the rows (b, [0, t)) of head h, e in order, into dsum (t).
template <typename TD, typename TO>
void row_dots(const FlashDims& fd, const TD* dy, const TO* o, int64_t b, int64_t h, float* dsum) {
  const int64_t c = fd.h * fd.d;
  for (int64_t i = 0; i < fd.t; ++i) {
    const TD* a = dy + (b * fd.t + i) * c + h * fd.d;
    const TO* y = o + (b * fd.t + i) * c + h * fd.d;
    float s = 0.0f;
    for (int64_t e = 0; e < fd.d; ++e) s += cpu::load(a + e) * cpu::load(y + e);
    dsum[i] = s;
  }
}

template <typename TQ, typename TD, typename TO, typename TX>
void backward_portable(int threads, const FlashDims& fd, const TD* dy, const TQ* x, const TO* o,
                       const float* lse, float* dsum, TX* dx, cpu::TileScratch& scratch) {
  const int64_t t = fd.t, dd = fd.d, ld = fd.ld(), rows_max = std::min(kQueryBlock, t);
  scratch.reserve(threads, 5 * round64(static_cast<size_t>(t * dd) * 4) +
                               3 * round64(static_cast<size_t>(rows_max * dd) * 4) +
                               2 * round64(static_cast<size_t>(kKeyTile) * 4));
  const float scale = 1.0f / std::sqrt(static_cast<float>(dd));
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t bg = 0; bg < fd.b * fd.hkv; ++bg) {
    const int64_t b = bg / fd.hkv, g = bg % fd.hkv;
    Carver carve{scratch.slice(omp_get_thread_num())};
    float* kt = carve.take<float>(dd * t);  // (d, t)
    float* kh = carve.take<float>(t * dd);  // (t, d)
    float* vt = carve.take<float>(dd * t);  // (d, t)
    float* dk = carve.take<float>(t * dd);
    float* dv = carve.take<float>(t * dd);
    float* qb = carve.take<float>(rows_max * dd);
    float* dyb = carve.take<float>(rows_max * dd);
    float* dqb = carve.take<float>(rows_max * dd);
    float* p = carve.take<float>(kKeyTile);
    float* ds = carve.take<float>(kKeyTile);
    const TQ* row0 = x + b * t * ld;
    widen_transposed(row0 + fd.k_col(g), ld, t, dd, kt);
    widen_rows(row0 + fd.k_col(g), ld, t, dd, kh);
    widen_transposed(row0 + fd.v_col(g), ld, t, dd, vt);
    std::fill(dk, dk + t * dd, 0.0f);
    std::fill(dv, dv + t * dd, 0.0f);
    for (int64_t h = g * fd.group(); h < (g + 1) * fd.group(); ++h) {
      const int64_t bh = b * fd.h + h;
      row_dots(fd, dy, o, b, h, dsum + bh * t);
      for (int64_t i0 = 0; i0 < t; i0 += kQueryBlock) {
        const int64_t rows = std::min(kQueryBlock, t - i0), i1 = i0 + rows;
        widen_rows(row0 + i0 * ld + h * dd, ld, rows, dd, qb);
        widen_rows(dy + (b * t + i0) * fd.h * dd + h * dd, fd.h * dd, rows, dd, dyb);
        std::fill(dqb, dqb + rows * dd, 0.0f);
        for (int64_t j0 = 0; j0 <= i0; j0 += kKeyTile) {
          const int64_t j1 = tile_end(j0, i1);
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t n = std::min(j1, i0 + r + 1) - j0;
            const float row_lse = lse[bh * t + i0 + r], row_d = dsum[bh * t + i0 + r];
            row_times_transposed(qb + r * dd, kt + j0, t, dd, n, scale, p);
#pragma omp simd
            for (int64_t j = 0; j < n; ++j) p[j] = cpu::fast_exp(p[j] - row_lse);
            row_times_transposed(dyb + r * dd, vt + j0, t, dd, n, 1.0f, ds);
#pragma omp simd
            for (int64_t j = 0; j < n; ++j) ds[j] = scale * p[j] * (ds[j] - row_d);
            row_times_rows(ds, kh + j0 * dd, n, dd, dqb + r * dd);
            for (int64_t j = 0; j < n; ++j) {
              float* dkj = dk + (j0 + j) * dd;
              float* dvj = dv + (j0 + j) * dd;
              const float* q = qb + r * dd;
              const float* a = dyb + r * dd;
              const float dsj = ds[j], pj = p[j];
#pragma omp simd
              for (int64_t e = 0; e < dd; ++e) {
                dkj[e] += dsj * q[e];
                dvj[e] += pj * a[e];
              }
            }
          }
        }
        for (int64_t r = 0; r < rows; ++r) {
          TX* out = dx + (b * t + i0 + r) * ld + h * dd;
          for (int64_t e = 0; e < dd; ++e) cpu::store(out + e, dqb[r * dd + e]);
        }
      }
    }
    for (int64_t j = 0; j < t; ++j) {
      TX* out = dx + (b * t + j) * ld;
      for (int64_t e = 0; e < dd; ++e) {
        cpu::store(out + fd.k_col(g) + e, dk[j * dd + e]);
        cpu::store(out + fd.v_col(g) + e, dv[j * dd + e]);
      }
    }
  }
}

template <typename T>
const T* typed(const Tensor& t) {
  return static_cast<const T*>(t.data());
}

// ---- The head tiles (AVX-512) -----------------------------------------------------------

#if PORTER_CPU_X86

using cpu::tiles::copy_rows;
using cpu::tiles::exp16;
using cpu::tiles::first_lanes;
using cpu::tiles::Gemm;
using cpu::tiles::lane_max;
using cpu::tiles::lane_sum;
using cpu::tiles::pack_row_pairs;
using cpu::tiles::run_gemm;
using cpu::tiles::store_rows;
using cpu::tiles::to_bf16x16;
using cpu::tiles::transpose32;

// One row of a tile's scores `s` (valid in [0, n)) through the online softmax: m' = max(m,
// max s), P = exp(s - m') written over s in f32, or rounded to bf16 into p16 when given, zeros
// in [n, width); l = alpha l + sum P (the f32 values, in lane order); m = m'. Returns alpha =
// exp(m - m'), 0 on the row's first tile.
PORTER_CPU_TARGET(PORTER_ISA_TILES_F32)
float online_softmax_row(float* s, int64_t n, int64_t width, float& m, float& l, uint16_t* p16) {
  __m512 mx = _mm512_set1_ps(-INFINITY);
  for (int64_t j = 0; j < n; j += 16) {
    mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(mx, first_lanes(n - j), s + j));
  }
  const float m_new = std::max(m, lane_max(mx));
  const float alpha = m == -INFINITY ? 0.0f : cpu::fast_exp(m - m_new);
  const __m512 vmx = _mm512_set1_ps(m_new);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < width; j += 16) {
    const __mmask16 valid = j < n ? first_lanes(n - j) : __mmask16{0};
    const __m512 e =
        _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(valid, s + j), vmx)));
    sum = _mm512_add_ps(sum, e);
    const __mmask16 w = first_lanes(width - j);
    if (p16 != nullptr) {
      _mm256_mask_storeu_epi16(p16 + j, w, to_bf16x16(e));
    } else {
      _mm512_mask_storeu_ps(s + j, w, e);
    }
  }
  l = alpha * l + lane_sum(sum);
  m = m_new;
  return alpha;
}

// P = exp(s - lse) over [0, n) in place, zeros in [n, width); rounded to bf16 into p16 too
// when given.
PORTER_CPU_TARGET(PORTER_ISA_TILES_F32)
void probs_row(float* s, int64_t n, int64_t width, float lse, uint16_t* p16) {
  const __m512 vl = _mm512_set1_ps(lse);
  for (int64_t j = 0; j < width; j += 16) {
    const __mmask16 valid = j < n ? first_lanes(n - j) : __mmask16{0};
    const __m512 e =
        _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(valid, s + j), vl)));
    const __mmask16 w = first_lanes(width - j);
    _mm512_mask_storeu_ps(s + j, w, e);
    if (p16 != nullptr) _mm256_mask_storeu_epi16(p16 + j, w, to_bf16x16(e));
  }
}

// dS = scale * P * (dP - D) over [0, n), zeros in [n, width): over dp in f32, or rounded to
// bf16 into ds16 when given.
PORTER_CPU_TARGET(PORTER_ISA_TILES_F32)
void dscores_row(const float* p, float* dp, int64_t n, int64_t width, float dsum, float scale,
                 uint16_t* ds16) {
  const __m512 vd = _mm512_set1_ps(dsum), vs = _mm512_set1_ps(scale);
  for (int64_t j = 0; j < width; j += 16) {
    const __mmask16 valid = j < n ? first_lanes(n - j) : __mmask16{0};
    const __m512 v = _mm512_maskz_mul_ps(
        valid, _mm512_mul_ps(vs, _mm512_maskz_loadu_ps(valid, p + j)),
        _mm512_sub_ps(_mm512_maskz_loadu_ps(valid, dp + j), vd));
    const __mmask16 w = first_lanes(width - j);
    if (ds16 != nullptr) {
      _mm256_mask_storeu_epi16(ds16 + j, w, to_bf16x16(v));
    } else {
      _mm512_mask_storeu_ps(dp + j, w, v);
    }
  }
}

// acc (rows, dd) row r *= alpha[r].
PORTER_CPU_TARGET(PORTER_ISA_TILES_F32)
void scale_rows(float* acc, int64_t dd, int64_t r, float alpha) {
  const __m512 va = _mm512_set1_ps(alpha);
  float* a = acc + r * dd;
  for (int64_t e = 0; e < dd; e += 16) {
    const __mmask16 w = first_lanes(dd - e);
    _mm512_mask_storeu_ps(a + e, w, _mm512_mul_ps(va, _mm512_maskz_loadu_ps(w, a + e)));
  }
}

// The forward on the tiles: kBf16 with bf16 qkv (pairs along D and along keys), else f32.
template <bool kBf16>
void forward_tiles(int threads, const FlashDims& fd, const void* qkv, Tensor& out, float* lse,
                   cpu::TileScratch& scratch) {
  const int64_t t = fd.t, dd = fd.d, ld = fd.ld(), tp = t + (t & 1);
  const int64_t rows_max = std::min(kQueryBlock, t);
  // K^T (dd, t) and V (t, dd) in f32; in bf16 K^T pairs (dd/2, tp) and V pairs (tp/2, dd).
  const size_t kv_bytes = round64(static_cast<size_t>(dd * tp) * 4);
  scratch.reserve(threads, 2 * kv_bytes + round64(static_cast<size_t>(rows_max * kKeyTile) * 4) +
                               round64(static_cast<size_t>(rows_max * kKeyTile) * 2) +
                               round64(static_cast<size_t>(rows_max * dd) * 4) +
                               2 * round64(static_cast<size_t>(rows_max) * 4));
  const float scale = 1.0f / std::sqrt(static_cast<float>(dd));
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t bh = 0; bh < fd.b * fd.h; ++bh) {
    const int64_t b = bh / fd.h, h = bh % fd.h, g = h / fd.group();
    Carver carve{scratch.slice(omp_get_thread_num())};
    auto* kt = carve.take<float>(dd * tp);
    auto* vv = carve.take<float>(dd * tp);
    auto* sb = carve.take<float>(rows_max * kKeyTile);
    auto* p16 = carve.take<uint16_t>(rows_max * kKeyTile);
    auto* acc = carve.take<float>(rows_max * dd);
    auto* m = carve.take<float>(rows_max);
    auto* l = carve.take<float>(rows_max);
    const void* q = nullptr;  // the head's first query row
    if constexpr (kBf16) {
      const auto* row0 = static_cast<const uint16_t*>(qkv) + b * t * ld;
      transpose32(row0 + fd.k_col(g), ld / 2, t, dd / 2, kt, tp);
      pack_row_pairs(row0 + fd.v_col(g), ld, t, dd, reinterpret_cast<uint32_t*>(vv));
      q = row0 + h * dd;
    } else {
      const auto* row0 = static_cast<const float*>(qkv) + b * t * ld;
      transpose32(row0 + fd.k_col(g), ld, t, dd, kt, t);
      copy_rows(row0 + fd.v_col(g), ld, t, dd, vv);
      q = row0 + h * dd;
    }
    const int64_t q_ms = kBf16 ? ld / 2 : ld;  // a query row, in 4-byte units
    for (int64_t i0 = 0; i0 < t; i0 += kQueryBlock) {
      const int64_t rows = std::min(kQueryBlock, t - i0), i1 = i0 + rows;
      std::memset(acc, 0, static_cast<size_t>(rows * dd) * 4);
      std::fill(m, m + rows, -INFINITY);
      std::fill(l, l + rows, 0.0f);
      for (int64_t j0 = 0; j0 <= i0; j0 += kKeyTile) {
        const int64_t j1 = tile_end(j0, i1), cols = j1 - j0, width = cols + (kBf16 ? cols & 1 : 0);
        const bool diagonal = j1 > i0;
        Gemm gs{rows, cols, kBf16 ? dd / 2 : dd, static_cast<const char*>(q) + i0 * q_ms * 4,
                q_ms, 1, kt + j0, kBf16 ? tp : t, sb, kKeyTile};
        gs.alpha = scale;
        if (diagonal) gs.col_causal = i0 - j0;
        run_gemm<kBf16>(gs);
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t n = std::min(j1, i0 + r + 1) - j0;
          const float alpha = online_softmax_row(sb + r * kKeyTile, n, width, m[r], l[r],
                                                 kBf16 ? p16 + r * kKeyTile : nullptr);
          if (j0 > 0) scale_rows(acc, dd, r, alpha);
        }
        Gemm pv;
        if constexpr (kBf16) {
          pv = Gemm{rows, dd, width / 2, p16, kKeyTile / 2, 1, vv + j0 / 2 * dd, dd, acc, dd};
          pv.step_elems = 2;
        } else {
          pv = Gemm{rows, dd, cols, sb, kKeyTile, 1, vv + j0 * dd, dd, acc, dd};
        }
        pv.accumulate = true;
        if (diagonal) pv.step_causal = i0 - j0;
        run_gemm<kBf16>(pv);
      }
      for (int64_t r = 0; r < rows; ++r) {
        scale_rows(acc, dd, r, 1.0f / l[r]);
        lse[bh * t + i0 + r] = m[r] + std::log(l[r]);
      }
      store_rows(acc, dd, rows, dd, out, (b * t + i0) * fd.h * dd + h * dd, fd.h * dd);
    }
  }
}

// The backward on the tiles, as forward_tiles.
template <bool kBf16, typename TD, typename TO>
void backward_tiles(int threads, const FlashDims& fd, const TD* dy, const void* qkv, const TO* o,
                    const float* lse, float* dsum, Tensor& dqkv, cpu::TileScratch& scratch) {
  const int64_t t = fd.t, dd = fd.d, ld = fd.ld(), c = fd.h * fd.d, tp = t + (t & 1);
  const int64_t rows_max = std::min(kQueryBlock, t), rp = rows_max + (rows_max & 1);
  const size_t kv_bytes = round64(static_cast<size_t>(dd * tp) * 4);
  const size_t tile_bytes = round64(static_cast<size_t>(rows_max * kKeyTile) * 4);
  const size_t tile16_bytes = round64(static_cast<size_t>(rp * kKeyTile) * 2);
  const size_t block_bytes = round64(static_cast<size_t>(rp * dd) * 4);
  scratch.reserve(threads, 5 * kv_bytes + 2 * tile_bytes + 4 * tile16_bytes + 3 * block_bytes);
  const float scale = 1.0f / std::sqrt(static_cast<float>(dd));
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t bg = 0; bg < fd.b * fd.hkv; ++bg) {
    const int64_t b = bg / fd.hkv, g = bg % fd.hkv;
    Carver carve{scratch.slice(omp_get_thread_num())};
    auto* kt = carve.take<float>(dd * tp);  // K^T; bf16: pairs (dd/2, tp)
    auto* kh = carve.take<float>(dd * tp);  // K; bf16: pairs (tp/2, dd)
    auto* vt = carve.take<float>(dd * tp);  // V^T; bf16: pairs (dd/2, tp)
    auto* dk = carve.take<float>(dd * tp);
    auto* dv = carve.take<float>(dd * tp);
    auto* sb = carve.take<float>(rows_max * kKeyTile);   // S, then P (f32)
    auto* dpb = carve.take<float>(rows_max * kKeyTile);  // dP, then dS (f32)
    auto* p16 = carve.take<uint16_t>(rp * kKeyTile);
    auto* ds16 = carve.take<uint16_t>(rp * kKeyTile);
    auto* pt = carve.take<uint32_t>(rp * kKeyTile / 2);   // P^T pairs along rows
    auto* dst = carve.take<uint32_t>(rp * kKeyTile / 2);  // dS^T pairs along rows
    auto* dyb = carve.take<float>(rp * dd);  // dout block; bf16: pairs (rp/2, dd)
    auto* qb = carve.take<float>(rp * dd);   // bf16: Q block pairs (rp/2, dd)
    auto* dqb = carve.take<float>(rp * dd);
    if constexpr (kBf16) {
      const auto* row0 = static_cast<const uint16_t*>(qkv) + b * t * ld;
      transpose32(row0 + fd.k_col(g), ld / 2, t, dd / 2, kt, tp);
      pack_row_pairs(row0 + fd.k_col(g), ld, t, dd, reinterpret_cast<uint32_t*>(kh));
      transpose32(row0 + fd.v_col(g), ld / 2, t, dd / 2, vt, tp);
    } else {
      const auto* row0 = static_cast<const float*>(qkv) + b * t * ld;
      transpose32(row0 + fd.k_col(g), ld, t, dd, kt, t);
      copy_rows(row0 + fd.k_col(g), ld, t, dd, kh);
      transpose32(row0 + fd.v_col(g), ld, t, dd, vt, t);
    }
    std::memset(dk, 0, static_cast<size_t>(t * dd) * 4);
    std::memset(dv, 0, static_cast<size_t>(t * dd) * 4);
    for (int64_t h = g * fd.group(); h < (g + 1) * fd.group(); ++h) {
      const int64_t bh = b * fd.h + h;
      row_dots(fd, dy, o, b, h, dsum + bh * t);
      for (int64_t i0 = 0; i0 < t; i0 += kQueryBlock) {
        const int64_t rows = std::min(kQueryBlock, t - i0), i1 = i0 + rows;
        const int64_t pairs = (rows + 1) / 2;
        // Q and dout of the block: in place (bf16 pairs along D) plus pairs along the rows;
        // f32 Q in place and dout widened.
        const void* qa;
        const void* da;
        int64_t q_ms, d_ms;
        if constexpr (kBf16) {
          const auto* q = static_cast<const uint16_t*>(qkv) + (b * t + i0) * ld + h * dd;
          const auto* a = reinterpret_cast<const uint16_t*>(dy) + (b * t + i0) * c + h * dd;
          pack_row_pairs(q, ld, rows, dd, reinterpret_cast<uint32_t*>(qb));
          pack_row_pairs(a, c, rows, dd, reinterpret_cast<uint32_t*>(dyb));
          qa = q;
          da = a;
          q_ms = ld / 2;
          d_ms = c / 2;
        } else {
          qa = static_cast<const float*>(qkv) + (b * t + i0) * ld + h * dd;
          widen_rows(dy + (b * t + i0) * c + h * dd, c, rows, dd, dyb);
          da = dyb;
          q_ms = ld;
          d_ms = dd;
        }
        for (int64_t j0 = 0; j0 <= i0; j0 += kKeyTile) {
          const int64_t j1 = tile_end(j0, i1), cols = j1 - j0, width = cols + (kBf16 ? cols & 1 : 0);
          const bool diagonal = j1 > i0;
          const int64_t steps = kBf16 ? dd / 2 : dd, kt_ld = kBf16 ? tp : t;
          // S = scale Q K^T and dP = dout V^T over the tile.
          Gemm gs{rows, cols, steps, qa, q_ms, 1, kt + j0, kt_ld, sb, kKeyTile};
          gs.alpha = scale;
          Gemm gp{rows, cols, steps, da, d_ms, 1, vt + j0, kt_ld, dpb, kKeyTile};
          if (diagonal) gs.col_causal = gp.col_causal = i0 - j0;
          run_gemm<kBf16>(gs);
          run_gemm<kBf16>(gp);
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t n = std::min(j1, i0 + r + 1) - j0;
            float* s = sb + r * kKeyTile;
            probs_row(s, n, width, lse[bh * t + i0 + r], kBf16 ? p16 + r * kKeyTile : nullptr);
            dscores_row(s, dpb + r * kKeyTile, n, width, dsum[bh * t + i0 + r], scale,
                        kBf16 ? ds16 + r * kKeyTile : nullptr);
          }
          Gemm gq, gk, gv;
          if constexpr (kBf16) {
            // dQ += dS K over key pairs; dK += dS^T Q, dV += P^T dout over row pairs.
            gq = Gemm{rows, dd, width / 2, ds16, kKeyTile / 2, 1, kh + j0 / 2 * dd, dd, dqb, dd};
            gq.step_elems = 2;
            pack_row_pairs(ds16, kKeyTile, rows, width, dst);
            pack_row_pairs(p16, kKeyTile, rows, width, pt);
            gk = Gemm{cols, dd, pairs, dst, 1, width, qb, dd, dk + j0 * dd, dd};
            gv = Gemm{cols, dd, pairs, pt, 1, width, dyb, dd, dv + j0 * dd, dd};
          } else {
            gq = Gemm{rows, dd, cols, dpb, kKeyTile, 1, kh + j0 * dd, dd, dqb, dd};
            gk = Gemm{cols, dd, rows, dpb, 1, kKeyTile, qa, ld, dk + j0 * dd, dd};
            gv = Gemm{cols, dd, rows, sb, 1, kKeyTile, dyb, dd, dv + j0 * dd, dd};
          }
          gq.accumulate = j0 > 0;
          if (diagonal) gq.step_causal = i0 - j0;
          gk.accumulate = gv.accumulate = true;
          run_gemm<kBf16>(gq);
          run_gemm<kBf16>(gk);
          run_gemm<kBf16>(gv);
        }
        store_rows(dqb, dd, rows, dd, dqkv, (b * t + i0) * ld + h * dd, ld);
      }
    }
    store_rows(dk, dd, t, dd, dqkv, b * t * ld + fd.k_col(g), ld);
    store_rows(dv, dd, t, dd, dqkv, b * t * ld + fd.v_col(g), ld);
  }
}

#endif  // PORTER_CPU_X86

}  // namespace

void CpuKernels::do_flash_attention_forward(const Tensor& qkv, Tensor& out, Tensor& lse,
                                            int heads, int kv_heads) {
  const FlashDims fd = dims_of(qkv, heads, kv_heads);
  if (fd.b == 0 || fd.t == 0 || fd.d == 0) return;
  float* l = lse.data_as<float>();
#if PORTER_CPU_X86
  if (qkv.dtype() == DType::kBF16 && cpu::attention_tiles_bf16_supported(fd.d)) {
    forward_tiles<true>(threads_, fd, qkv.data(), out, l, tile_scratch_);
    return;
  }
  if (qkv.dtype() == DType::kF32 && cpu::attention_tiles_f32_supported()) {
    forward_tiles<false>(threads_, fd, qkv.data(), out, l, tile_scratch_);
    return;
  }
#endif
  cpu::dispatch_float(qkv.dtype(), [&](auto tq) {
    cpu::dispatch_float(out.dtype(), [&](auto to) {
      forward_portable(threads_, fd, typed<decltype(tq)>(qkv), static_cast<decltype(to)*>(out.data()),
                       l, tile_scratch_);
    });
  });
}

void CpuKernels::do_flash_attention_backward(const Tensor& dout, const Tensor& qkv,
                                             const Tensor& out, const Tensor& lse, Tensor& dqkv,
                                             int heads, int kv_heads) {
  const FlashDims fd = dims_of(qkv, heads, kv_heads);
  if (fd.b == 0 || fd.t == 0 || fd.d == 0) return;
  const FlashAttentionCall call{fd.b, fd.t, fd.d, heads, kv_heads,
                                qkv.dtype(), out.dtype(), dqkv.dtype()};
  const memory::DeviceBuffer buffer =
      workspace(flash_attention_backward_workspace_bytes(memory::DeviceKind::kCpu, call),
                "flash_attention_backward");
  float* dsum = buffer.as<float>();
  const float* l = lse.data_as<float>();
#if PORTER_CPU_X86
  if (qkv.dtype() == DType::kBF16 && dout.dtype() == DType::kBF16 &&
      cpu::attention_tiles_bf16_supported(fd.d)) {
    cpu::dispatch_float(out.dtype(), [&](auto to) {
      backward_tiles<true>(threads_, fd, typed<uint16_t>(dout), qkv.data(),
                           typed<decltype(to)>(out), l, dsum, dqkv, tile_scratch_);
    });
    return;
  }
  if (qkv.dtype() == DType::kF32 && cpu::attention_tiles_f32_supported()) {
    cpu::dispatch_float(dout.dtype(), [&](auto td) {
      cpu::dispatch_float(out.dtype(), [&](auto to) {
        backward_tiles<false>(threads_, fd, typed<decltype(td)>(dout), qkv.data(),
                              typed<decltype(to)>(out), l, dsum, dqkv, tile_scratch_);
      });
    });
    return;
  }
#endif
  cpu::dispatch_float(qkv.dtype(), [&](auto tq) {
    cpu::dispatch_float(dout.dtype(), [&](auto td) {
      cpu::dispatch_float(out.dtype(), [&](auto to) {
        cpu::dispatch_float(dqkv.dtype(), [&](auto tx) {
          backward_portable(threads_, fd, typed<decltype(td)>(dout), typed<decltype(tq)>(qkv),
                            typed<decltype(to)>(out), l, dsum,
                            static_cast<decltype(tx)*>(dqkv.data()), tile_scratch_);
        });
      });
    });
  });
}

}  // namespace porter::kernels
