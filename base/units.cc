// Formatting and parsing of byte quantities.
#include "base/units.h"

#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <string>

namespace porter {

std::string format_bytes(uint64_t bytes) {
  static constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  if (bytes < 1024) return std::to_string(bytes) + " B";
  double v = static_cast<double>(bytes);
  int unit = 0;
  while (v >= 1024.0 && unit < 5) {
    v /= 1024.0;
    ++unit;
  }
  char buf[48];
  std::snprintf(buf, sizeof(buf), "%.2f %s", v, kUnits[unit]);
  return buf;
}

std::optional<uint64_t> parse_bytes(std::string_view text) {
  size_t i = 0;
  auto skip_space = [&] {
    while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
  };
  skip_space();
  size_t num_begin = i;
  bool seen_digit = false, seen_dot = false;
  while (i < text.size()) {
    char c = text[i];
    if (std::isdigit(static_cast<unsigned char>(c))) {
      seen_digit = true;
    } else if (c == '.' && !seen_dot) {
      seen_dot = true;
    } else {
      break;
    }
    ++i;
  }
  if (!seen_digit) return std::nullopt;
  std::string number(text.substr(num_begin, i - num_begin));
  skip_space();
  std::string unit;
  while (i < text.size() && std::isalpha(static_cast<unsigned char>(text[i]))) {
    unit += static_cast<char>(std::tolower(static_cast<unsigned char>(text[i])));
    ++i;
  }
  skip_space();
  if (i != text.size()) return std::nullopt;

  double multiplier = 0;
  struct Unit {
    const char* name;
    double multiplier;
  };
  static constexpr Unit kUnitTable[] = {
      {"", 1},        {"b", 1},          {"k", 1024.0},     {"kib", 1024.0},
      {"kb", 1e3},    {"m", 1048576.0},  {"mib", 1048576.0}, {"mb", 1e6},
      {"g", 1073741824.0}, {"gib", 1073741824.0}, {"gb", 1e9},
      {"t", 1099511627776.0}, {"tib", 1099511627776.0}, {"tb", 1e12},
  };
  for (const Unit& u : kUnitTable) {
    if (unit == u.name) multiplier = u.multiplier;
  }
  if (multiplier == 0) return std::nullopt;
  // Exact integer path for plain integers, so large byte counts do not lose precision.
  if (!seen_dot) {
    uint64_t n = 0;
    for (char c : number) {
      uint64_t d = static_cast<uint64_t>(c - '0');
      if (n > (UINT64_MAX - d) / 10) return std::nullopt;
      n = n * 10 + d;
    }
    uint64_t m = static_cast<uint64_t>(multiplier);
    if (m != 0 && n > UINT64_MAX / m) return std::nullopt;
    return n * m;
  }
  // from_chars never throws: a fraction too long or too small for a double is an error.
  double parsed = 0;
  auto [end, ec] = std::from_chars(number.data(), number.data() + number.size(), parsed);
  if (ec != std::errc() || end != number.data() + number.size()) return std::nullopt;
  double v = parsed * multiplier;
  if (!std::isfinite(v) || v >= 1.8e19) return std::nullopt;
  if (v != std::floor(v)) return std::nullopt;  // "1.5" bytes is not a byte count
  return static_cast<uint64_t>(v);
}

}  // namespace porter
