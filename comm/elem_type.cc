// Element types of collectives.
#include "base/check.h"
#include "comm/communicator.h"

namespace porter::comm {

size_t elem_size(ElemType t) {
  switch (t) {
    case ElemType::kF32: return 4;
    case ElemType::kF64: return 8;
    case ElemType::kBF16: return 2;
    case ElemType::kF16: return 2;
    case ElemType::kI32: return 4;
    case ElemType::kI64: return 8;
    case ElemType::kU8: return 1;
  }
  PORTER_CHECK(false, "unknown comm::ElemType ", static_cast<int>(t));
  return 0;
}

std::string_view elem_name(ElemType t) {
  switch (t) {
    case ElemType::kF32: return "f32";
    case ElemType::kF64: return "f64";
    case ElemType::kBF16: return "bf16";
    case ElemType::kF16: return "f16";
    case ElemType::kI32: return "i32";
    case ElemType::kI64: return "i64";
    case ElemType::kU8: return "u8";
  }
  return "?";
}

}  // namespace porter::comm
