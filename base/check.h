// Checks that throw: PORTER_CHECK for bad input, PORTER_ASSERT for bugs in porter.
//
//   PORTER_CHECK(cond, msg...)          throws InvalidArgument
//   PORTER_CHECK_EQ(a, b, msg...)       ... and NE/LT/LE/GT/GE: print both operands
//   PORTER_CHECK_T(Type, cond, msg...)  throws the given porter::Error subclass
//   PORTER_ASSERT(cond, msg...)         always on; throws InternalError ("bug in porter")
//   PORTER_DEBUG_ASSERT(cond, msg...)   only with PORTER_DEBUG_CHECKS (expensive walks)
#pragma once

#include <concepts>
#include <sstream>
#include <string>
#include <utility>

#include "base/error.h"

namespace porter {
namespace detail {

template <typename T>
concept Streamable = requires(std::ostream& os, const T& v) { os << v; };

template <typename T>
void append_operand(std::ostringstream& os, const T& v) {
  if constexpr (std::is_same_v<T, const char*> || std::is_same_v<T, char*>) {
    os << (v != nullptr ? v : "(null)");
  } else if constexpr (std::is_enum_v<T>) {
    os << static_cast<std::underlying_type_t<T>>(v);
  } else if constexpr (std::is_pointer_v<T>) {
    os << static_cast<const void*>(v);
  } else if constexpr (Streamable<T>) {
    os << v;
  } else {
    os << "<unprintable>";
  }
}

}  // namespace detail

// Concatenates anything printable with operator<<.
template <typename... Args>
std::string str_cat(const Args&... args) {
  std::ostringstream os;
  (detail::append_operand(os, args), ...);
  return os.str();
}

namespace detail {

template <typename E, typename... Args>
[[noreturn]] void throw_check(const char* kind, const char* expr, const char* file, int line,
                              const Args&... msg) {
  std::ostringstream os;
  if constexpr (sizeof...(msg) > 0) {
    (append_operand(os, msg), ...);
    os << " ";
  }
  os << "[" << kind << " " << expr << " at " << file << ":" << line << "]";
  throw E(os.str());
}

template <typename E, typename A, typename B, typename... Args>
[[noreturn]] void throw_check_op(const char* expr, const A& a, const B& b, const char* file,
                                 int line, const Args&... msg) {
  std::ostringstream os;
  if constexpr (sizeof...(msg) > 0) {
    (append_operand(os, msg), ...);
    os << " ";
  }
  os << "[check failed: " << expr << " (";
  append_operand(os, a);
  os << " vs ";
  append_operand(os, b);
  os << ") at " << file << ":" << line << "]";
  throw E(os.str());
}

}  // namespace detail
}  // namespace porter

#define PORTER_CHECK_T(ErrorType, cond, ...)                                                  \
  do {                                                                                        \
    if (!(cond)) [[unlikely]] {                                                               \
      ::porter::detail::throw_check<ErrorType>("check failed:", #cond, __FILE__, __LINE__,     \
                                               ##__VA_ARGS__);                                \
    }                                                                                         \
  } while (0)

#define PORTER_CHECK(cond, ...) PORTER_CHECK_T(::porter::InvalidArgument, cond, ##__VA_ARGS__)

#define PORTER_CHECK_OP_(op, a, b, ...)                                                         \
  do {                                                                                          \
    const auto& porter_check_a_ = (a);                                                          \
    const auto& porter_check_b_ = (b);                                                          \
    if (!(porter_check_a_ op porter_check_b_)) [[unlikely]] {                                   \
      ::porter::detail::throw_check_op<::porter::InvalidArgument>(                              \
          #a " " #op " " #b, porter_check_a_, porter_check_b_, __FILE__, __LINE__, ##__VA_ARGS__); \
    }                                                                                           \
  } while (0)

#define PORTER_CHECK_EQ(a, b, ...) PORTER_CHECK_OP_(==, a, b, ##__VA_ARGS__)
#define PORTER_CHECK_NE(a, b, ...) PORTER_CHECK_OP_(!=, a, b, ##__VA_ARGS__)
#define PORTER_CHECK_LT(a, b, ...) PORTER_CHECK_OP_(<, a, b, ##__VA_ARGS__)
#define PORTER_CHECK_LE(a, b, ...) PORTER_CHECK_OP_(<=, a, b, ##__VA_ARGS__)
#define PORTER_CHECK_GT(a, b, ...) PORTER_CHECK_OP_(>, a, b, ##__VA_ARGS__)
#define PORTER_CHECK_GE(a, b, ...) PORTER_CHECK_OP_(>=, a, b, ##__VA_ARGS__)

#define PORTER_ASSERT(cond, ...)                                                              \
  do {                                                                                        \
    if (!(cond)) [[unlikely]] {                                                               \
      ::porter::detail::throw_check<::porter::InternalError>("bug in porter: assertion", #cond, \
                                                             __FILE__, __LINE__, ##__VA_ARGS__); \
    }                                                                                         \
  } while (0)

#ifdef PORTER_DEBUG_CHECKS
#define PORTER_DEBUG_ASSERT(cond, ...) PORTER_ASSERT(cond, ##__VA_ARGS__)
#else
#define PORTER_DEBUG_ASSERT(cond, ...) \
  do {                                 \
  } while (0)
#endif
