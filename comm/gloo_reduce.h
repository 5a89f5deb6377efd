// The element-wise reductions the Gloo ring applies, and the 16-bit float conversions they
// need (comm sits below nn/, so it has its own).
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>

#include "comm/communicator.h"

namespace porter::comm {

inline float bf16_bits_to_f32(uint16_t h) { return std::bit_cast<float>(uint32_t{h} << 16); }

// Round to nearest, ties to even; NaN stays a (quiet) NaN.
inline uint16_t f32_to_bf16_bits(float f) {
  uint32_t u = std::bit_cast<uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float f16_bits_to_f32(uint16_t h) {
  return static_cast<float>(std::bit_cast<_Float16>(h));
}

// Round to nearest, ties to even (the compiler's conversion), with subnormals and infinity.
inline uint16_t f32_to_f16_bits(float f) {
  return std::bit_cast<uint16_t>(static_cast<_Float16>(f));
}

// dst[i] = a[i] op b[i] for i < count. dst may alias a or b exactly. Sums of bf16/f16 are
// computed in f32 and rounded back; integer sums wrap around.
void reduce_into(void* dst, const void* a, const void* b, size_t count, ElemType type,
                 ReduceOp op);

}  // namespace porter::comm
