// Checked integer arithmetic for byte and element counts: sums and products that refuse to wrap
// (Note [Checked sizes]), written once for every layer that sizes something from user input.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <string>
#include <string_view>
#include <type_traits>

#include "base/error.h"

namespace porter {

// Note [Checked sizes]
// A size computed from a config (a model's shape, a batch, a layer count) can exceed what a
// 64-bit count holds long before any allocation is tried: seq_len 2^24 with 2^16 heads makes
// one attention-probability tensor of 2^66 bytes. Unsigned arithmetic would wrap and print a
// small, wrong figure, so every such sum and product goes through these helpers, and one that
// does not fit is a typed InvalidArgument naming the config keys whose values made it. The
// bound is what a signed 64-bit count holds (INT64_MAX, 8 EiB), not SIZE_MAX: byte figures
// are also carried as int64_t (peaks, deltas, JSON), and every figure below the bound
// converts between the two exactly.
inline constexpr uint64_t kMaxCheckedSize = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());

// One factor of a size: the config key (or the quantity) it comes from, and its value.
struct SizeFactor {
  std::string_view name;
  uint64_t value;
};

namespace detail {

[[noreturn]] inline void throw_overflow(std::string_view what, std::string_view terms) {
  std::string msg;
  if (!what.empty()) {
    msg.append(what);
    msg.append(": ");
  }
  msg.append(terms);
  msg.append(" overflows 64-bit byte counts (more than 8 EiB); lower one of them");
  throw InvalidArgument(msg);
}

inline std::string join_factors(std::initializer_list<SizeFactor> factors, std::string_view sep) {
  std::string out;
  for (const SizeFactor& f : factors) {
    if (!out.empty()) out.append(sep);
    out.append(f.name);
    out.push_back(' ');
    out.append(std::to_string(f.value));
  }
  return out;
}

}  // namespace detail

// a * b and a + b, or false where the result leaves [0, kMaxCheckedSize]. Unsigned operands.
template <typename T>
bool try_mul(T a, T b, T& out) {
  static_assert(std::is_unsigned_v<T>, "checked sizes are unsigned");
  return !__builtin_mul_overflow(a, b, &out) && static_cast<uint64_t>(out) <= kMaxCheckedSize;
}
template <typename T>
bool try_add(T a, T b, T& out) {
  static_assert(std::is_unsigned_v<T>, "checked sizes are unsigned");
  return !__builtin_add_overflow(a, b, &out) && static_cast<uint64_t>(out) <= kMaxCheckedSize;
}

// a * b; InvalidArgument "<what>: <terms> overflows 64-bit byte counts ..." when it does not
// fit. `what` names the figure, `terms` how it is made ("porter.model.layers 100000 x ...").
inline size_t checked_mul(size_t a, size_t b, std::string_view what, std::string_view terms) {
  size_t out = 0;
  if (!try_mul(a, b, out)) detail::throw_overflow(what, terms);
  return out;
}
inline size_t checked_add(size_t a, size_t b, std::string_view what, std::string_view terms) {
  size_t out = 0;
  if (!try_add(a, b, out)) detail::throw_overflow(what, terms);
  return out;
}

// The product of named factors; when it does not fit, InvalidArgument naming every factor:
// "<what>: porter.model.seq_len 16777216 x porter.model.heads 65536 x ... overflows 64-bit
// byte counts ...".
inline size_t checked_product(std::initializer_list<SizeFactor> factors, std::string_view what = {}) {
  uint64_t out = 1;
  for (const SizeFactor& f : factors) {
    if (!try_mul<uint64_t>(out, f.value, out)) detail::throw_overflow(what, detail::join_factors(factors, " x "));
  }
  return static_cast<size_t>(out);
}

// A running sum that stays checked: add() what may not fit, then value().
class CheckedSum {
 public:
  explicit CheckedSum(std::string_view what) : what_(what) {}
  // Adds `bytes`; `terms` says where they come from, for the message.
  CheckedSum& add(size_t bytes, std::string_view terms = "the sum of its parts") {
    total_ = checked_add(total_, bytes, what_, terms);
    return *this;
  }
  size_t value() const { return total_; }

 private:
  std::string_view what_;
  size_t total_ = 0;
};

}  // namespace porter
