// The building blocks of porter's AVX-512 attention tiles, shared by the materialised head tiles
// (Note [Attention head tiles] in kernels/cpu/attention_heads.cc) and the flash attention
// (Note [Flash attention tiles] in kernels/cpu/attention_flash.cc): register tiles of f32 FMA or
// AVX512-BF16 dot products, a tiled product with causal limits over them, packing (transpose,
// bf16 pairs) and 16-lane exp, rounding and lane reductions. Internal to the cpu kernels.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <utility>

#include "kernels/cpu/isa.h"
#include "kernels/kernels.h"

namespace porter::kernels::cpu::tiles {

inline size_t round64(size_t bytes) { return (bytes + 63) / 64 * 64; }

// Carves consecutive 64-byte aligned arrays out of one scratch slice.
struct Carver {
  char* next;
  template <typename T>
  T* take(int64_t elems) {
    T* p = reinterpret_cast<T*>(next);
    next += round64(static_cast<size_t>(elems) * sizeof(T));
    return p;
  }
};

// rows x cols f32 values (row stride src_ld) rounded once into `dst` at element `offset`
// (row stride dst_ld), in dst's dtype.
void store_rows(const float* src, int64_t src_ld, int64_t rows, int64_t cols, Tensor& dst,
                int64_t offset, int64_t dst_ld);

// dst (ceil(n/2), cols) = rows of src in pairs: dst[j2 * cols + e] holds src[2 j2][e] and
// src[2 j2 + 1][e] (zero past row n - 1).
void pack_row_pairs(const uint16_t* src, int64_t src_ld, int64_t n, int64_t cols,
                    uint32_t* dst);

#if PORTER_CPU_X86


constexpr int kMr = 6;                // rows per tile
constexpr int kNv = 4;                // 16-lane column vectors per tile
constexpr int64_t kNb = 16 * kNv;     // columns per tile

// One tile: c (mr x 16 nv, the last vector masked by `tail`) = alpha * sum over steps of
// a(i, p) b(p, ·) (+ c). Element units are 4 bytes: an f32, or a pair of bf16.
struct Tile {
  int64_t steps;
  const void* a;
  int64_t a_ms, a_ps;  // a(i, p) at a[i * a_ms + p * a_ps]
  const void* b;
  int64_t ldb;  // step p's row of b at b + p * ldb
  float* c;
  int64_t ldc;
  __mmask16 tail;
  float alpha;
  bool accumulate;
};

template <int MR, int NV>
PORTER_CPU_TARGET(PORTER_ISA_TILES_F32)
__attribute__((always_inline)) inline void store_tile(__m512 (&acc)[MR][NV], const Tile& t) {
  const __m512 alpha = _mm512_set1_ps(t.alpha);
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      const __mmask16 m = v + 1 < NV ? __mmask16{0xFFFF} : t.tail;
      float* c = t.c + i * t.ldc + 16 * v;
      __m512 r = _mm512_mul_ps(alpha, acc[i][v]);
      if (t.accumulate) r = _mm512_add_ps(r, _mm512_maskz_loadu_ps(m, c));
      _mm512_mask_storeu_ps(c, m, r);
    }
  }
}

template <int MR, int NV>
PORTER_CPU_TARGET(PORTER_ISA_TILES_F32)
void tile_f32(const Tile& t) {
  const auto* a = static_cast<const float*>(t.a);
  const auto* b = static_cast<const float*>(t.b);
  __m512 acc[MR][NV];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_setzero_ps();
  }
  for (int64_t p = 0; p < t.steps; ++p) {
    const float* bp = b + p * t.ldb;
    const float* ap = a + p * t.a_ps;
    __m512 bv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      bv[v] = v + 1 < NV ? _mm512_loadu_ps(bp + 16 * v) : _mm512_maskz_loadu_ps(t.tail, bp + 16 * v);
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m512 av = _mm512_set1_ps(ap[i * t.a_ms]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_fmadd_ps(av, bv[v], acc[i][v]);
    }
  }
  store_tile<MR, NV>(acc, t);
}

template <int MR, int NV>
PORTER_CPU_TARGET(PORTER_ISA_TILES_BF16)
void tile_bf16(const Tile& t) {
  const auto* a = static_cast<const uint32_t*>(t.a);
  const auto* b = static_cast<const uint32_t*>(t.b);
  __m512 acc[MR][NV];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_setzero_ps();
  }
  for (int64_t p = 0; p < t.steps; ++p) {
    const uint32_t* bp = b + p * t.ldb;
    const uint32_t* ap = a + p * t.a_ps;
    __m512i bv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      bv[v] = v + 1 < NV ? _mm512_loadu_si512(bp + 16 * v)
                         : _mm512_maskz_loadu_epi32(t.tail, bp + 16 * v);
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m512i av = _mm512_set1_epi32(static_cast<int>(ap[i * t.a_ms]));
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) {
        acc[i][v] = _mm512_dpbf16_ps(acc[i][v], (__m512bh)av, (__m512bh)bv[v]);
      }
    }
  }
  store_tile<MR, NV>(acc, t);
}

using TileFn = void (*)(const Tile&);
using TileTable = std::array<TileFn, kMr * kNv>;

template <bool kBf16, size_t... I>
TileTable make_tiles(std::index_sequence<I...>) {
  if constexpr (kBf16) {
    return {&tile_bf16<static_cast<int>(I / kNv) + 1, static_cast<int>(I % kNv) + 1>...};
  } else {
    return {&tile_f32<static_cast<int>(I / kNv) + 1, static_cast<int>(I % kNv) + 1>...};
  }
}

template <bool kBf16>
TileFn tile_for(int64_t mr, int64_t nv) {
  static const TileTable table = make_tiles<kBf16>(std::make_index_sequence<kMr * kNv>{});
  return table[(mr - 1) * kNv + (nv - 1)];
}

// c (m x n) = alpha * a b (+ c), in tiles; element units as in Tile. Causal limits (negative:
// none): the rows [i, i_end) of a tile need only the columns below col_causal + i_end, and
// only the steps below ceil((step_causal + i_end) / step_elems).
struct Gemm {
  int64_t m, n, steps;
  const void* a;
  int64_t a_ms, a_ps;
  const void* b;
  int64_t ldb;
  float* c;
  int64_t ldc;
  float alpha = 1.0f;
  bool accumulate = false;
  int64_t col_causal = -1, step_causal = -1, step_elems = 1;
};

template <bool kBf16>
void run_gemm(const Gemm& g) {
  const auto* a = static_cast<const char*>(g.a);
  const auto* b = static_cast<const char*>(g.b);
  for (int64_t n0 = 0; n0 < g.n; n0 += kNb) {
    for (int64_t i = 0; i < g.m; i += kMr) {
      const int64_t mr = std::min<int64_t>(kMr, g.m - i), i_end = i + mr;
      const int64_t n_end = g.col_causal < 0 ? g.n : std::min(g.n, g.col_causal + i_end);
      if (n_end <= n0) continue;
      const int64_t cols = std::min(kNb, n_end - n0), nv = (cols + 15) / 16;
      int64_t steps = g.steps;
      if (g.step_causal >= 0) {
        steps = std::min(steps, (g.step_causal + i_end + g.step_elems - 1) / g.step_elems);
      }
      Tile t;
      t.steps = steps;
      t.a = a + i * g.a_ms * 4;
      t.a_ms = g.a_ms;
      t.a_ps = g.a_ps;
      t.b = b + n0 * 4;
      t.ldb = g.ldb;
      t.c = g.c + i * g.ldc + n0;
      t.ldc = g.ldc;
      t.tail = cols % 16 == 0 ? __mmask16{0xFFFF} : static_cast<__mmask16>((1u << (cols % 16)) - 1);
      t.alpha = g.alpha;
      t.accumulate = g.accumulate;
      tile_for<kBf16>(mr, nv)(t);
    }
  }
}

// dst[e * dst_ld + j] = src[j * src_ld + e] for rows j < n and columns e < cols of 32-bit
// elements (f32, or pairs of bf16): 16 rows at a time, one gather per output vector.
PORTER_CPU_TARGET(PORTER_ISA_TILES_F32)
void transpose32(const void* src, int64_t src_ld, int64_t n, int64_t cols, void* dst,
                 int64_t dst_ld);

// rows x cols f32 (row stride src_ld) into a dense (rows, cols) copy.
void copy_rows(const float* src, int64_t src_ld, int64_t rows, int64_t cols, float* dst);

PORTER_CPU_TARGET(PORTER_ISA_TILES_F32) inline __m512 exp16(__m512 x) {
  // fast_exp (kernels/cpu/cpu_kernels.h), 16 lanes.
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 round = _mm512_set1_ps(12582912.0f);
  const __m512 n =
      _mm512_sub_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), round), round);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  const __m512i bits =
      _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

// 16 f32 rounded to bf16 as f32_to_bf16 (tensor/dtype.h) does: to nearest even, NaN kept quiet.
PORTER_CPU_TARGET(PORTER_ISA_TILES_F32) inline __m256i to_bf16x16(__m512 v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r =
      _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7fff)), lsb), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(0x40)));
  return _mm512_cvtepi32_epi16(r);
}

inline __mmask16 first_lanes(int64_t n) {
  return n >= 16 ? __mmask16{0xFFFF} : static_cast<__mmask16>((1u << n) - 1);
}

// The sum and the largest of 16 lanes, in lane order (GCC 12's own reduce intrinsics warn
// about an uninitialised temporary in its headers).
PORTER_CPU_TARGET(PORTER_ISA_TILES_F32) inline float lane_sum(__m512 v) {
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, v);
  float s = 0.0f;
  for (float x : lanes) s += x;
  return s;
}

PORTER_CPU_TARGET(PORTER_ISA_TILES_F32) inline float lane_max(__m512 v) {
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, v);
  float m = lanes[0];
  for (float x : lanes) m = std::max(m, x);
  return m;
}

#endif  // PORTER_CPU_X86

}  // namespace porter::kernels::cpu::tiles
