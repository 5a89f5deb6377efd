// Element types, and the bf16 <-> f32 conversions every device shares.
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

namespace porter::nn {

// f32 everywhere; bf16 compute on both devices; f16 on cuda only; i32 for token ids.
enum class DType : uint8_t { kF32, kBF16, kF16, kI32 };

constexpr size_t dtype_size(DType t) {
  return t == DType::kBF16 || t == DType::kF16 ? 2 : 4;
}

constexpr std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::kF32: return "f32";
    case DType::kBF16: return "bf16";
    case DType::kF16: return "f16";
    case DType::kI32: return "i32";
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

}  // namespace porter::nn
