// .npy reading and writing: round trips per dtype, NumPy-written bytes, malformed files.
#include "io/npy.h"

#include <cstring>
#include <filesystem>
#include <fstream>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "base/error.h"

namespace porter::nn {

using namespace porter::tensor;

namespace {

using ::testing::HasSubstr;

std::vector<std::byte> bytes_of(const std::string& s) {
  std::vector<std::byte> b(s.size());
  std::memcpy(b.data(), s.data(), s.size());
  return b;
}

// A v1.0 file as NumPy 1.x writes it: np.save(f, np.arange(6, dtype='<f4').reshape(2, 3)).
std::string numpy_file(const std::string& dict, size_t data_bytes, int major = 1) {
  std::string header = dict;
  size_t pre = major == 1 ? 10 : 12;
  while ((pre + header.size() + 1) % 64 != 0) header += ' ';
  header += '\n';
  std::string s = "\x93NUMPY";
  s += static_cast<char>(major);
  s += '\0';
  size_t n = header.size();
  for (size_t i = 0; i < pre - 8; ++i) s += static_cast<char>((n >> (8 * i)) & 0xff);
  s += header;
  s += std::string(data_bytes, '\0');
  return s;
}

TEST(NpyTest, ParsesNumpyWrittenHeader) {
  std::string f = numpy_file("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }", 24);
  auto b = bytes_of(f);
  io::NpyArray a = io::parse_npy(b.data(), b.size(), "a.npy");
  EXPECT_EQ(a.dtype, DType::kF32);
  EXPECT_EQ(a.shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(a.data.size(), 24u);
}

TEST(NpyTest, ParsesVersion2AndScalarAndOneDim) {
  auto b = bytes_of(numpy_file("{'descr': '<i4', 'fortran_order': False, 'shape': (), }", 4, 2));
  io::NpyArray a = io::parse_npy(b.data(), b.size(), "s.npy");
  EXPECT_TRUE(a.shape.empty());
  EXPECT_EQ(a.numel(), 1);
  b = bytes_of(numpy_file("{'descr': '<u2', 'fortran_order': False, 'shape': (5,), }", 10));
  a = io::parse_npy(b.data(), b.size(), "v.npy");
  EXPECT_EQ(a.dtype, DType::kBF16);
  EXPECT_EQ(a.shape, (std::vector<int64_t>{5}));
}

TEST(NpyTest, RoundTripsEachDtypeExactly) {
  const auto dir = std::filesystem::temp_directory_path();
  std::vector<float> f = {1.5f, -0.0f, 3.25e-20f, 7.0f, -1e30f, 0.1f};
  io::write_npy((dir / "porter_f.npy").string(), f.data(), DType::kF32, {2, 3});
  io::NpyArray a = io::read_npy((dir / "porter_f.npy").string());
  EXPECT_EQ(a.shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(std::memcmp(a.data.data(), f.data(), 24), 0);

  std::vector<int32_t> i = {-1, 0, 2147483647};
  io::write_npy((dir / "porter_i.npy").string(), i.data(), DType::kI32, {3});
  a = io::read_npy((dir / "porter_i.npy").string());
  EXPECT_EQ(a.dtype, DType::kI32);
  EXPECT_EQ(io::npy_to_f32(a)[0], -1.0f);

  std::vector<uint16_t> h = {tensor::f32_to_bf16(1.0f), tensor::f32_to_bf16(-2.5f)};
  io::write_npy((dir / "porter_h.npy").string(), h.data(), DType::kBF16, {1, 2});
  a = io::read_npy((dir / "porter_h.npy").string());
  EXPECT_EQ(a.dtype, DType::kBF16);
  EXPECT_EQ(io::npy_to_f32(a), (std::vector<float>{1.0f, -2.5f}));
}

TEST(NpyTest, HeaderIsPaddedTo64Bytes) {
  float x = 1.0f;
  auto b = io::encode_npy(&x, DType::kF32, {1});
  // NumPy's own dict for this array is 58 bytes, so preamble + dict + '\n' rounds up to 128.
  EXPECT_EQ(b.size(), 128u + 4u);
  EXPECT_EQ(static_cast<char>(b[127]), '\n');
}

void expect_malformed(const std::string& file, const std::string& needle) {
  auto b = bytes_of(file);
  try {
    io::parse_npy(b.data(), b.size(), "bad.npy");
    FAIL() << "no error for " << needle;
  } catch (const IoError& e) {
    EXPECT_THAT(e.what(), HasSubstr("bad.npy"));
    EXPECT_THAT(e.what(), HasSubstr(needle));
  }
}

TEST(NpyTest, MalformedFilesNameFileAndOffset) {
  expect_malformed("abc", "byte offset 0: file is 3 bytes");
  expect_malformed("\x89PNG\r\n\x1a\nxxxxxxxx", "byte offset 0: missing the \\x93NUMPY magic");
  expect_malformed(std::string("\x93NUMPY\x04\x00\x10\x00", 10) + std::string(16, ' '),
                   "byte offset 6: unsupported .npy version 4");
  expect_malformed(std::string("\x93NUMPY\x01\x00\xff\x00", 10) + "{}",
                   "byte offset 10: header of 255 bytes runs past the end");
  expect_malformed(numpy_file("{'descr': '>f4', 'fortran_order': False, 'shape': (2,), }", 8),
                   "dtype '>f4' is not supported");
  expect_malformed(numpy_file("{'descr': '<f8', 'fortran_order': False, 'shape': (2,), }", 16),
                   "dtype '<f8' is not supported");
  expect_malformed(numpy_file("{'descr': '<f4', 'fortran_order': True, 'shape': (2, 2), }", 16),
                   "fortran_order arrays are not supported");
  expect_malformed(numpy_file("{'descr': '<f4', 'fortran_order': False, 'shape': (2, x), }", 8),
                   "expected a non-negative integer dimension");
  expect_malformed(numpy_file("{'descr': '<f4', 'fortran_order': Maybe, 'shape': (2,), }", 8),
                   "expected True or False");
  expect_malformed(numpy_file("{'descr': '<f4', 'fortran_order': False}", 8),
                   "header lacks 'descr' or 'shape'");
  // Truncated data: the offset is where the data starts (128).
  expect_malformed(numpy_file("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }", 20),
                   "byte offset 128: data is 20 bytes, but shape (2,3,) of <f4 needs 24");
}

TEST(NpyTest, MissingFileIsIoError) {
  EXPECT_THROW(io::read_npy("/nonexistent/porter.npy"), IoError);
}

}  // namespace
}  // namespace porter::nn
