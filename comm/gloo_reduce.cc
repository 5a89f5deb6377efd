// Element-wise reductions for the Gloo ring (Note [Collective semantics]).
#include "comm/gloo_reduce.h"

#include <cmath>
#include <type_traits>

#include "base/check.h"

namespace porter::comm {
namespace {

template <typename T>
T max_of(T a, T b) {
  if constexpr (std::is_floating_point_v<T>) {
    if (std::isnan(a)) return a;
    if (std::isnan(b)) return b;
  }
  return a < b ? b : a;
}

template <typename T>
T sum_of(T a, T b) {
  if constexpr (std::is_integral_v<T>) {
    using U = std::make_unsigned_t<T>;  // wrap around instead of overflowing
    return static_cast<T>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
  } else {
    return a + b;
  }
}

template <typename T>
void reduce_typed(T* dst, const T* a, const T* b, size_t n, ReduceOp op) {
  if (op == ReduceOp::kSum) {
    for (size_t i = 0; i < n; ++i) dst[i] = sum_of(a[i], b[i]);
  } else {
    for (size_t i = 0; i < n; ++i) dst[i] = max_of(a[i], b[i]);
  }
}

template <float (*ToF32)(uint16_t), uint16_t (*FromF32)(float)>
void reduce_half(uint16_t* dst, const uint16_t* a, const uint16_t* b, size_t n, ReduceOp op) {
  if (op == ReduceOp::kSum) {
    for (size_t i = 0; i < n; ++i) dst[i] = FromF32(ToF32(a[i]) + ToF32(b[i]));
  } else {
    // Rounding back is exact: the larger operand is already representable.
    for (size_t i = 0; i < n; ++i) dst[i] = FromF32(max_of(ToF32(a[i]), ToF32(b[i])));
  }
}

}  // namespace

void reduce_into(void* dst, const void* a, const void* b, size_t count, ElemType type,
                 ReduceOp op) {
  switch (type) {
    case ElemType::kF32:
      return reduce_typed(static_cast<float*>(dst), static_cast<const float*>(a),
                          static_cast<const float*>(b), count, op);
    case ElemType::kF64:
      return reduce_typed(static_cast<double*>(dst), static_cast<const double*>(a),
                          static_cast<const double*>(b), count, op);
    case ElemType::kI32:
      return reduce_typed(static_cast<int32_t*>(dst), static_cast<const int32_t*>(a),
                          static_cast<const int32_t*>(b), count, op);
    case ElemType::kI64:
      return reduce_typed(static_cast<int64_t*>(dst), static_cast<const int64_t*>(a),
                          static_cast<const int64_t*>(b), count, op);
    case ElemType::kU8:
      return reduce_typed(static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(a),
                          static_cast<const uint8_t*>(b), count, op);
    case ElemType::kBF16:
      return reduce_half<bf16_bits_to_f32, f32_to_bf16_bits>(
          static_cast<uint16_t*>(dst), static_cast<const uint16_t*>(a),
          static_cast<const uint16_t*>(b), count, op);
    case ElemType::kF16:
      return reduce_half<f16_bits_to_f32, f32_to_f16_bits>(
          static_cast<uint16_t*>(dst), static_cast<const uint16_t*>(a),
          static_cast<const uint16_t*>(b), count, op);
  }
  PORTER_ASSERT(false, "unknown comm::ElemType ", static_cast<int>(type));
}

}  // namespace porter::comm
