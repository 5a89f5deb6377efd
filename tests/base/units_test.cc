// format_bytes and parse_bytes: exact values, units, and rejection of malformed input.
#include "base/units.h"

#include <string>

#include <gtest/gtest.h>

namespace porter {
namespace {

TEST(UnitsTest, FormatBytes) {
  EXPECT_EQ(format_bytes(0), "0 B");
  EXPECT_EQ(format_bytes(1023), "1023 B");
  EXPECT_EQ(format_bytes(1024), "1.00 KiB");
  EXPECT_EQ(format_bytes(3 * kMiB / 2), "1.50 MiB");
  EXPECT_EQ(format_bytes(80 * kGiB), "80.00 GiB");
}

TEST(UnitsTest, ParseBytes) {
  EXPECT_EQ(parse_bytes("123"), 123u);
  EXPECT_EQ(parse_bytes("2GiB"), 2 * kGiB);
  EXPECT_EQ(parse_bytes("2 GiB"), 2 * kGiB);
  EXPECT_EQ(parse_bytes("512MB"), 512000000u);
  EXPECT_EQ(parse_bytes("64k"), 64 * kKiB);
  EXPECT_EQ(parse_bytes("1.5GiB"), 3 * kGiB / 2);
  EXPECT_EQ(parse_bytes("1tb"), 1000000000000u);
  EXPECT_EQ(parse_bytes("18446744073709551615"), UINT64_MAX);
}

TEST(UnitsTest, ParseBytesRejects) {
  for (const char* bad : {"", "GiB", "-1", "1.5", "2 parsecs", "1e9", "18446744073709551616",
                          "99999999999TiB", "1..2MB", "3 GiB extra"}) {
    EXPECT_FALSE(parse_bytes(bad).has_value()) << bad;
  }
  // Very long fractions must be rejected, not throw (std::stod would throw out_of_range).
  for (std::string bad : {"0." + std::string(400, '0') + "1", "0." + std::string(400, '0') + "1GiB",
                          std::string(400, '9') + ".5"}) {
    EXPECT_FALSE(parse_bytes(bad).has_value()) << bad;
  }
}

TEST(UnitsTest, RoundUp) {
  EXPECT_EQ(round_up(0, 512), 0u);
  EXPECT_EQ(round_up(1, 512), 512u);
  EXPECT_EQ(round_up(512, 512), 512u);
  EXPECT_EQ(round_up(513, 512), 1024u);
}

}  // namespace
}  // namespace porter
