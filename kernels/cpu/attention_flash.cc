// Memory-efficient causal attention on the cpu (Note [Flash attention] in kernels/kernels.cc):
// query blocks against key tiles with an online softmax, so no (T, T) array exists.
//
// Note [Flash attention tiles]
// - Tasks. Forward runs one (batch, query head) per task, backward one (batch, key/value
//   head) per task, the group's query heads in head order inside it, so dK and dV of a
//   key/value head are summed by one thread. Tasks go to `threads_` OpenMP threads; each
//   output element is computed by one thread in a fixed order, and the bits do not depend on
//   the thread count (Note [Cpu determinism]).
// - Tiling. Query rows go in blocks of kQueryBlock (64), keys in tiles of kKeyTile (128)
//   starting at multiples of kKeyTile; a block reads the tiles that start at or before its
//   first row (kKeyTile is a multiple of kQueryBlock, so each such tile has a key at or before
//   every row of the block), the last one cut at the block's last row. Entries above the
//   diagonal are never used: they are zero in P and dS.
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
// - Packing and scratch (per thread, TileScratch owned by CpuKernels, not device memory):
//   forward K^T and V of the head, (T, D) each (pairs of bf16 in the bf16 path), a Q block,
//   the scores of one tile (kQueryBlock x kKeyTile f32) and the block's accumulator; backward
//   K, K^T, V^T, f32 dK and dV ((T, D) each), Q and dout blocks, S/P and dP/dS tiles and the
//   dQ block. With T = 4096 and D = 64 that is about 5 MiB per thread in backward, O(T D); the
//   only device workspace is backward's D, (B, H, T) f32.
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
constexpr int64_t kKeyTile = 128;
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

}  // namespace

void CpuKernels::do_flash_attention_forward(const Tensor& qkv, Tensor& out, Tensor& lse,
                                            int heads, int kv_heads) {
  const FlashDims fd = dims_of(qkv, heads, kv_heads);
  if (fd.b == 0 || fd.t == 0 || fd.d == 0) return;
  float* l = lse.data_as<float>();
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
