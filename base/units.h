// Byte quantities: printing them for people and parsing them from configs ("2GiB", "512MB").
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace porter {

inline constexpr size_t kKiB = size_t{1} << 10;
inline constexpr size_t kMiB = size_t{1} << 20;
inline constexpr size_t kGiB = size_t{1} << 30;

// "1.50 GiB", "512 B". Binary units, two decimals above bytes.
std::string format_bytes(uint64_t bytes);

// Parses "123", "2GiB", "1.5 GB", "512MiB", "64k". Decimal units (kB, MB, GB, TB) are powers
// of 1000; binary ones (KiB, MiB, GiB, TiB, and the bare K/M/G/T) powers of 1024. Returns
// nullopt for anything else, for negative numbers, for fractional byte counts, and on overflow.
std::optional<uint64_t> parse_bytes(std::string_view text);

constexpr size_t round_up(size_t n, size_t multiple) {
  return (n + multiple - 1) / multiple * multiple;
}

}  // namespace porter
