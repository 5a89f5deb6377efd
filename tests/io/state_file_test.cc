// Training-state files: the CRC-32C test vector, a round trip, and one test per read error,
// each checking that the message names the path and the reason.
#include "io/state_file.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <cstring>
#include <string>

#include "base/error.h"

namespace porter::engine {
namespace {

namespace fs = std::filesystem;

std::vector<std::byte> bytes_of(const std::string& s) {
  std::vector<std::byte> b(s.size());
  if (!s.empty()) std::memcpy(b.data(), s.data(), s.size());  // memcpy(nullptr, ..., 0) is UB
  return b;
}

std::string read_error(const fs::path& dir) {
  try {
    io::read_state(dir);
  } catch (const IoError& e) {
    return e.what();
  }
  return "(no IoError)";
}

class StateFile : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("porter_state_test_" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    fs::remove_all(dir_);
    io::write_state(dir_, {{"step", 7}, {"note", "hello"}},
                {{"params", bytes_of("0123456789abcdef")}, {"adam_m", bytes_of("xyz")},
                 {"empty", {}}});
  }
  void write_raw(const fs::path& p, const std::string& text) { std::ofstream(p, std::ios::binary) << text; }
  fs::path dir_;
};

TEST(Crc32c, KnownVectors) {
  EXPECT_EQ(io::crc32c(bytes_of("123456789")), 0xE3069283u);
  EXPECT_EQ(io::crc32c(bytes_of("")), 0u);
  // 32 zero bytes (RFC 3720, B.4).
  std::vector<std::byte> zeros(32, std::byte{0});
  EXPECT_EQ(io::crc32c(zeros), 0x8A9136AAu);
  // Chaining equals one pass.
  std::vector<std::byte> all = bytes_of("123456789");
  uint32_t part = io::crc32c(std::span(all).first(4));
  EXPECT_EQ(io::crc32c(std::span(all).subspan(4), part), 0xE3069283u);
}

TEST_F(StateFile, RoundTrip) {
  io::LoadedState s = io::read_state(dir_);
  EXPECT_EQ(s.meta["step"], 7);
  EXPECT_EQ(s.meta["note"], "hello");
  EXPECT_EQ(s.meta["format_version"], io::kStateFormatVersion);
  ASSERT_EQ(s.sections.size(), 3u);
  EXPECT_EQ(s.sections[0].name, "params");
  EXPECT_EQ(s.section("params").bytes, bytes_of("0123456789abcdef"));
  EXPECT_EQ(s.section("adam_m").bytes, bytes_of("xyz"));
  EXPECT_TRUE(s.section("empty").bytes.empty());
  EXPECT_EQ(s.meta["sections"][1]["bytes"], 3);
  EXPECT_EQ(s.meta["sections"][1]["crc32c"], io::crc32c(bytes_of("xyz")));
  EXPECT_THROW(s.section("nope"), IoError);
  // No temporary files are left behind.
  for (const auto& e : fs::directory_iterator(dir_)) {
    EXPECT_NE(e.path().filename().string()[0], '.') << e.path();
  }
}

TEST_F(StateFile, OverwriteReplacesTheCheckpoint) {
  io::write_state(dir_, {{"step", 8}}, {{"params", bytes_of("new")}});
  io::LoadedState s = io::read_state(dir_);
  EXPECT_EQ(s.meta["step"], 8);
  ASSERT_EQ(s.sections.size(), 1u);
  EXPECT_EQ(s.section("params").bytes, bytes_of("new"));
}

TEST_F(StateFile, BadSectionNamesAreRejected) {
  EXPECT_THROW(io::write_state(dir_, {}, {{"Bad-Name", {}}}), InvalidArgument);
  EXPECT_THROW(io::write_state(dir_, {}, {{"a", {}}, {"a", {}}}), InvalidArgument);
}

TEST_F(StateFile, MissingDirectory) {
  const fs::path d = dir_ / "nope";
  EXPECT_EQ(read_error(d), "training state \"" + d.string() + "\": no such directory");
}

TEST_F(StateFile, MissingMeta) {
  fs::remove(dir_ / "meta.json");
  EXPECT_EQ(read_error(dir_), "training state \"" + (dir_ / "meta.json").string() +
                                  "\": missing (not a training checkpoint, or a save that did "
                                  "not complete)");
}

TEST_F(StateFile, UnparsableMeta) {
  write_raw(dir_ / "meta.json", "{\"format_version\": 1,");
  std::string e = read_error(dir_);
  EXPECT_NE(e.find("training state \"" + (dir_ / "meta.json").string() + "\": unparsable JSON"),
            std::string::npos) << e;
}

TEST_F(StateFile, UnknownFormatVersion) {
  write_raw(dir_ / "meta.json", R"({"format_version": 99, "sections": []})");
  std::string e = read_error(dir_);
  EXPECT_NE(e.find("meta.json\": unknown format version 99 (this porter reads version 1)"),
            std::string::npos) << e;
  write_raw(dir_ / "meta.json", R"({"sections": []})");
  e = read_error(dir_);
  EXPECT_NE(e.find("no integer \"format_version\""), std::string::npos) << e;
}

TEST_F(StateFile, MissingSection) {
  fs::remove(dir_ / "adam_m.bin");
  std::string e = read_error(dir_);
  EXPECT_NE(e.find("training state \"" + (dir_ / "adam_m.bin").string() +
                   "\": section \"adam_m\" is missing"), std::string::npos) << e;
}

TEST_F(StateFile, TruncatedSection) {
  write_raw(dir_ / "params.bin", "0123");
  std::string e = read_error(dir_);
  EXPECT_NE(e.find("\"" + (dir_ / "params.bin").string() +
                   "\": truncated: 4 bytes, meta.json says 16"), std::string::npos) << e;
}

TEST_F(StateFile, OversizedSection) {
  write_raw(dir_ / "adam_m.bin", "xyzw");
  std::string e = read_error(dir_);
  EXPECT_NE(e.find("\"" + (dir_ / "adam_m.bin").string() +
                   "\": oversized: 4 bytes, meta.json says 3"), std::string::npos) << e;
}

TEST_F(StateFile, ChecksumMismatch) {
  write_raw(dir_ / "params.bin", "0123456789abcdeF");  // same size, one byte flipped
  std::string e = read_error(dir_);
  EXPECT_NE(e.find("\"" + (dir_ / "params.bin").string() + "\": checksum mismatch: crc32c 0x"),
            std::string::npos) << e;
  EXPECT_NE(e.find("(the file is corrupt)"), std::string::npos) << e;
}

}  // namespace
}  // namespace porter::engine
