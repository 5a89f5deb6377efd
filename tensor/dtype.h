// Element types, and the bf16 <-> f32 and f16 <-> f32 conversions every device shares.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <string_view>

#if defined(__CUDACC__)
#define PORTER_HD __host__ __device__
#else
#define PORTER_HD
#endif

namespace porter::tensor {

// f32 everywhere; bf16 and f16 compute on both devices; i32 for token ids and class labels;
// i64 and bool (one byte, 0 or 1) for a batch's tensors as a data pipeline writes them (Note
// [Batch tensors] in io/data.h).
enum class DType : uint8_t { kF32, kBF16, kF16, kI32, kI64, kBool };

constexpr size_t dtype_size(DType t) {
  switch (t) {
    case DType::kBF16:
    case DType::kF16: return 2;
    case DType::kI64: return 8;
    case DType::kBool: return 1;
    case DType::kF32:
    case DType::kI32: return 4;
  }
  return 4;
}

constexpr std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::kF32: return "f32";
    case DType::kBF16: return "bf16";
    case DType::kF16: return "f16";
    case DType::kI32: return "i32";
    case DType::kI64: return "i64";
    case DType::kBool: return "bool";
  }
  return "?";
}

// bf16 is the top half of an f32. Conversion rounds to nearest, ties to even; NaN stays NaN.
PORTER_HD inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

PORTER_HD inline float bf16_to_f32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}

// Note [f16 conversion]
// IEEE binary16: 1 sign, 5 exponent (bias 15), 10 mantissa bits; largest finite 65504,
// smallest normal 2^-14, smallest subnormal 2^-24. The conversions are portable bit
// manipulation with no branches a compiler cannot turn into selects, so the cpu's
// `#pragma omp simd` loops vectorise them in every PORTER_CPU_CLONES clone (Note [Cpu ISA
// dispatch] in kernels/cpu/isa.h; F16C's vcvtps2ph would need the clones' target to include
// it, and the baseline clone cannot use it). They give the same bits as F16C and cuda's
// __float2half_rn / __half2float (tests/kernels/f16_test.cc checks all 65536 patterns and
// round-to-nearest-even ties):
// - f32 -> f16 rounds to nearest, ties to even; |x| >= 65520 (half an f16 ulp above 65504)
//   becomes inf; results below 2^-14 are subnormal (rounded by one f32 addition, which is
//   exact to the f16 grid there); NaN stays NaN (quiet, top payload bits kept).
// - f16 -> f32 is exact: the f16 bits shifted into an f32's place read as a number 2^112
//   times too small (the exponent biases differ by 112), subnormals included, so one exact
//   multiplication by 2^112 rescales them; inf and NaN (exponent 31) are set directly.
// Both assume the default floating-point environment (round to nearest, no flush to zero).
PORTER_HD inline uint16_t f32_to_f16(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  const uint32_t sign = (u >> 16) & 0x8000u;
  u &= 0x7fffffffu;
  uint32_t h;
  if (u >= 0x47800000u) {  // |f| >= 65536, inf or NaN
    h = u > 0x7f800000u ? 0x7e00u | ((u >> 13) & 0x3ffu) : 0x7c00u;
  } else if (u < 0x38800000u) {  // |f| < 2^-14: an f16 subnormal or zero
    // Adding 0.5 puts the f16 subnormal grid (2^-24) at the f32 ulp of [0.5, 1), so the
    // f32 addition rounds to nearest-even on that grid; the low bits are then the result.
    float a;
    __builtin_memcpy(&a, &u, 4);
    a += 0.5f;
    uint32_t au;
    __builtin_memcpy(&au, &a, 4);
    h = au - 0x3f000000u;
  } else {
    // Rebias the exponent, add just under half an f16 ulp plus the ulp's parity (ties to
    // even), truncate. A carry out of the mantissa bumps the exponent, up to inf.
    const uint32_t odd = (u >> 13) & 1u;
    h = (u - 0x38000000u + 0xfffu + odd) >> 13;
  }
  return static_cast<uint16_t>(h | sign);
}

PORTER_HD inline float f16_to_f32(uint16_t h) {
  const uint32_t em = h & 0x7fffu;
  uint32_t u = em << 13;
  float f;
  __builtin_memcpy(&f, &u, 4);
  f *= 0x1p112f;
  __builtin_memcpy(&u, &f, 4);
  if (em >= 0x7c00u) u = 0x7f800000u | (em << 13);
  u |= static_cast<uint32_t>(h & 0x8000u) << 16;
  __builtin_memcpy(&f, &u, 4);
  return f;
}

}  // namespace porter::tensor
