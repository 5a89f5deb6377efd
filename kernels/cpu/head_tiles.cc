// The out-of-line parts of the attention tiles' building blocks (kernels/cpu/head_tiles.h).
#include "kernels/cpu/head_tiles.h"

#include <cstring>

#include "kernels/cpu/cpu_kernels.h"

namespace porter::kernels::cpu::tiles {

void store_rows(const float* src, int64_t src_ld, int64_t rows, int64_t cols, Tensor& dst,
                int64_t offset, int64_t dst_ld) {
  dispatch_float(dst.dtype(), [&](auto tag) {
    auto* out = static_cast<decltype(tag)*>(dst.data()) + offset;
    for (int64_t r = 0; r < rows; ++r) {
      const float* s = src + r * src_ld;
      auto* o = out + r * dst_ld;
#pragma omp simd
      for (int64_t j = 0; j < cols; ++j) store(o + j, s[j]);
    }
  });
}

void pack_row_pairs(const uint16_t* src, int64_t src_ld, int64_t n, int64_t cols,
                    uint32_t* dst) {
  for (int64_t j2 = 0; 2 * j2 < n; ++j2) {
    const uint16_t* lo = src + 2 * j2 * src_ld;
    const uint16_t* hi = 2 * j2 + 1 < n ? lo + src_ld : nullptr;
    uint32_t* out = dst + j2 * cols;
    if (hi != nullptr) {
#pragma omp simd
      for (int64_t e = 0; e < cols; ++e) out[e] = uint32_t{lo[e]} | uint32_t{hi[e]} << 16;
    } else {
#pragma omp simd
      for (int64_t e = 0; e < cols; ++e) out[e] = uint32_t{lo[e]};
    }
  }
}

#if PORTER_CPU_X86

PORTER_CPU_TARGET(PORTER_ISA_TILES_F32)
void transpose32(const void* src, int64_t src_ld, int64_t n, int64_t cols, void* dst,
                 int64_t dst_ld) {
  const auto* in = static_cast<const int*>(src);
  auto* out = static_cast<int*>(dst);
  const __m512i idx = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(static_cast<int>(src_ld)));
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int64_t w = std::min<int64_t>(16, n - j0);
    const __mmask16 m = w == 16 ? __mmask16{0xFFFF} : static_cast<__mmask16>((1u << w) - 1);
    const int* base = in + j0 * src_ld;
    for (int64_t e = 0; e < cols; ++e) {
      const __m512i v = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m, idx, base + e, 4);
      _mm512_mask_storeu_epi32(out + e * dst_ld + j0, m, v);
    }
  }
}

void copy_rows(const float* src, int64_t src_ld, int64_t rows, int64_t cols, float* dst) {
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(dst + r * cols, src + r * src_ld, static_cast<size_t>(cols) * 4);
  }
}

#endif  // PORTER_CPU_X86

}  // namespace porter::kernels::cpu::tiles
