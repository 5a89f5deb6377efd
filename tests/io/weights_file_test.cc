// Safetensors files (io/weights_file.h): f32/bf16/f16 round trips with metadata, the
// header's 8-byte alignment, the split of a flat buffer by its layout, and every error the
// reader and the writer give.
#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "base/error.h"
#include "io/weights_file.h"
#include "tensor/dtype.h"

namespace porter::engine {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

template <typename E>
std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const E& e) {
    return e.what();
  }
  return "(no error)";
}

class WeightsFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("porter_weights_" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()) +
            "_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // A file of the 8-byte length `n`, `header` and `data`.
  fs::path raw(const std::string& name, uint64_t n, const std::string& header,
               const std::string& data = "") {
    const fs::path p = dir_ / name;
    std::ofstream out(p, std::ios::binary);
    for (int i = 0; i < 8; ++i) out.put(static_cast<char>(n >> (8 * i)));
    out << header << data;
    return p;
  }
  fs::path raw(const std::string& name, const std::string& header, const std::string& data = "") {
    return raw(name, header.size(), header, data);
  }
  std::string read_error(const fs::path& p) {
    return error_of<IoError>([&] { io::read_safetensors(p); });
  }

  fs::path dir_;
};

template <typename T>
std::vector<std::byte> as_bytes(const std::vector<T>& v) {
  std::vector<std::byte> out(v.size() * sizeof(T));
  if (!v.empty()) std::memcpy(out.data(), v.data(), out.size());
  return out;
}

std::vector<io::WeightTensor> sample_tensors() {
  std::vector<float> f32 = {1.0f, -2.5f, 3.25f, 0.0f, -0.0f, 1e-30f};
  std::vector<uint16_t> bf16, f16;
  for (float x : {0.5f, -1.0f, 3.0f, 65504.0f}) {
    bf16.push_back(tensor::f32_to_bf16(x));
    f16.push_back(tensor::f32_to_f16(x));
  }
  return {
      {"wte", {2, 3}, tensor::DType::kF32, as_bytes(f32)},
      {"h.0.ln1.weight", {4}, tensor::DType::kBF16, as_bytes(bf16)},
      {"h.0.fc1.weight", {2, 2}, tensor::DType::kF16, as_bytes(f16)},
      {"scalar", {}, tensor::DType::kF32, as_bytes(std::vector<float>{42.0f})},
      {"empty", {0, 5}, tensor::DType::kBF16, {}},
  };
}

TEST_F(WeightsFileTest, RoundTripsEveryDtypeAndTheMetadata) {
  const std::vector<io::WeightTensor> tensors = sample_tensors();
  const fs::path p = dir_ / "sub" / "model.safetensors";  // the parent is created
  io::write_safetensors(p, tensors, {{"format", "pt"}, {"porter.step", "7"}});
  io::WeightMetadata meta;
  const std::vector<io::WeightTensor> back = io::read_safetensors(p, &meta);
  ASSERT_EQ(back.size(), tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    SCOPED_TRACE(tensors[i].name);
    EXPECT_EQ(back[i].name, tensors[i].name);  // written order = offset order
    EXPECT_EQ(back[i].shape, tensors[i].shape);
    EXPECT_EQ(back[i].dtype, tensors[i].dtype);
    EXPECT_EQ(back[i].bytes, tensors[i].bytes);
  }
  EXPECT_EQ(meta, (io::WeightMetadata{{"format", "pt"}, {"porter.step", "7"}}));
  // No temporary file is left beside it.
  int files = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator(dir_ / "sub")) ++files;
  EXPECT_EQ(files, 1);

  // The header: the u64 length, JSON with dtype names, space padding to 8.
  std::ifstream in(p, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(static_cast<unsigned char>(bytes[i])) << (8 * i);
  EXPECT_EQ((8 + n) % 8, 0u);
  const std::string header = bytes.substr(8, n);
  EXPECT_EQ(header.substr(0, 16), "{\"__metadata__\":");
  EXPECT_THAT(header, HasSubstr("\"wte\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,24]}"));
  EXPECT_THAT(header, HasSubstr("\"dtype\":\"BF16\""));
  EXPECT_THAT(header, HasSubstr("\"dtype\":\"F16\""));
  EXPECT_EQ(bytes.size(), 8 + n + 24 + 8 + 8 + 4);
}

TEST_F(WeightsFileTest, HeaderIsPaddedToEightBytesForEveryNameLength) {
  for (int len = 1; len <= 17; ++len) {
    SCOPED_TRACE(len);
    const fs::path p = dir_ / "a.safetensors";
    io::write_safetensors(p, {{std::string(static_cast<size_t>(len), 'x'), {1}, tensor::DType::kF16,
                           as_bytes(std::vector<uint16_t>{0x3c00})}});
    std::ifstream in(p, std::ios::binary);
    unsigned char length[8];
    in.read(reinterpret_cast<char*>(length), 8);
    const uint64_t n = length[0] | (uint64_t{length[1]} << 8);
    EXPECT_EQ(n % 8, 0u);
    std::string header(n, '\0');
    in.read(header.data(), static_cast<std::streamsize>(n));
    const size_t close = header.rfind('}');
    EXPECT_EQ(header.find_first_not_of(' ', close + 1), std::string::npos);  // spaces only
    EXPECT_LT(n - close - 1, 8u);
    EXPECT_EQ(io::read_safetensors(p)[0].bytes, as_bytes(std::vector<uint16_t>{0x3c00}));
  }
  // No metadata: no "__metadata__" key.
  io::write_safetensors(dir_ / "b.safetensors", {});
  std::ifstream in(dir_ / "b.safetensors", std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(bytes.size(), 16u);
  EXPECT_EQ(bytes.substr(8), "{}      ");
  EXPECT_TRUE(io::read_safetensors(dir_ / "b.safetensors").empty());
}

TEST_F(WeightsFileTest, LayoutTensorsSkipTheAlignmentPadding) {
  nn::ParamLayout layout;
  layout.add("h", {{"w", tensor::Shape{3, 5}}, {"b", tensor::Shape{5}}, {"s", tensor::Shape{}}});
  ASSERT_EQ(layout.total_elems(), 3 * nn::kParamAlignElems);
  // Element i holds i; the padding holds -1.
  std::vector<float> flat(static_cast<size_t>(layout.total_elems() + 64), -1.0f);
  for (const nn::ParamEntry& e : layout.entries()) {
    for (int64_t i = 0; i < e.shape.numel(); ++i) flat[static_cast<size_t>(e.offset_elems + i)] = float(i);
  }
  const std::vector<std::byte> bytes = as_bytes(flat);
  const std::vector<io::WeightTensor> t = io::layout_tensors(layout, tensor::DType::kF32, bytes);
  ASSERT_EQ(t.size(), 3u);
  EXPECT_EQ(t[0].name, "h.w");
  EXPECT_EQ(t[0].shape, (std::vector<int64_t>{3, 5}));
  EXPECT_EQ(t[1].name, "h.b");
  EXPECT_EQ(t[2].shape, std::vector<int64_t>{});
  for (const io::WeightTensor& w : t) {
    std::vector<float> v(w.bytes.size() / 4);
    std::memcpy(v.data(), w.bytes.data(), w.bytes.size());
    ASSERT_EQ(static_cast<int64_t>(v.size()), w.numel());
    for (size_t i = 0; i < v.size(); ++i) EXPECT_EQ(v[i], float(i)) << w.name;
  }
  // The same from meta.json's layout, and in bf16 (half the bytes per element).
  const nlohmann::json j = {{"total_elems", layout.total_elems()},
                            {"params", {{{"name", "h.w"}, {"shape", {3, 5}}, {"offset", 0}},
                                        {{"name", "h.b"}, {"shape", {5}}, {"offset", 64}},
                                        {{"name", "h.s"}, {"shape", nlohmann::json::array()}, {"offset", 128}}}}};
  const std::vector<io::FlatTensorSpec> specs = io::layout_specs(j, "meta.json");
  ASSERT_EQ(specs.size(), 3u);
  EXPECT_EQ(specs[2].offset_elems, 128);
  const std::vector<std::byte> half(static_cast<size_t>(layout.total_elems()) * 2, std::byte{1});
  const std::vector<io::WeightTensor> h = io::layout_tensors(specs, tensor::DType::kBF16, half);
  EXPECT_EQ(h[0].bytes.size(), 30u);
  EXPECT_EQ(h[2].bytes.size(), 2u);
  // Too short a buffer, and a layout that does not fit its total.
  EXPECT_THAT(error_of<InvalidArgument>([&] {
                io::layout_tensors(layout, tensor::DType::kF32, std::span(bytes).first(128 * 4));
              }),
              HasSubstr("'h.s' () at offset 128 does not fit in a flat buffer of 128 elements"));
  nlohmann::json bad = j;
  bad["total_elems"] = 100;
  EXPECT_THAT(error_of<IoError>([&] { io::layout_specs(bad, "m.json"); }),
              HasSubstr("m.json: layout: params[2] ('h.s'): shape [] at offset 128 ends past "
                        "total_elems 100"));
  EXPECT_THAT(error_of<IoError>([&] { io::layout_specs(nlohmann::json::object(), "m.json"); }),
              HasSubstr("needs \"total_elems\""));
}

TEST_F(WeightsFileTest, WidensBf16AndF16ToF32Exactly) {
  const std::vector<float> values = {0.5f, -1.0f, 3.0f, 2048.0f, 1.0f / 1024};
  std::vector<uint16_t> bf16, f16;
  for (float x : values) {
    bf16.push_back(tensor::f32_to_bf16(x));
    f16.push_back(tensor::f32_to_f16(x));
  }
  EXPECT_EQ(io::to_f32_bytes(tensor::DType::kBF16, as_bytes(bf16)), as_bytes(values));
  EXPECT_EQ(io::to_f32_bytes(tensor::DType::kF16, as_bytes(f16)), as_bytes(values));
  EXPECT_EQ(io::to_f32_bytes(tensor::DType::kF32, as_bytes(values)), as_bytes(values));
}

TEST_F(WeightsFileTest, ReaderNamesEveryProblem) {
  const std::string ok_entry = R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  const std::string eight(8, 'x');
  // The file itself.
  EXPECT_THAT(read_error(dir_ / "none.safetensors"), HasSubstr("none.safetensors\": cannot read"));
  {
    std::ofstream(dir_ / "short.safetensors", std::ios::binary) << "abc";
    EXPECT_THAT(read_error(dir_ / "short.safetensors"),
                HasSubstr("truncated: 3 bytes, less than the 8-byte header length"));
  }
  EXPECT_THAT(read_error(raw("long.st", 1000, "{}")),
              HasSubstr("bad header length 1000: the file has 2 bytes after it"));
  EXPECT_THAT(read_error(raw("huge.st", uint64_t{1} << 40, "{}")),
              HasSubstr("bad header length 1099511627776: above the limit of 100000000 bytes"));
  EXPECT_THAT(read_error(raw("text.st", "not json")), HasSubstr("does not start with '{'"));
  EXPECT_THAT(read_error(raw("json.st", "{\"a\": ")), HasSubstr("the header is not valid JSON"));
  // Metadata.
  EXPECT_THAT(read_error(raw("meta.st", R"({"__metadata__":{"step":3}})")),
              HasSubstr("metadata \"step\" is 3, not a string"));
  // Entries.
  EXPECT_THAT(read_error(raw("dtype.st", R"({"a":{"dtype":"F64","shape":[1],"data_offsets":[0,8]}})", eight)),
              HasSubstr("tensor 'a': unknown dtype \"F64\" (porter reads F32, BF16, F16, I32)"));
  EXPECT_THAT(read_error(raw("count.st", R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", eight)),
              HasSubstr("tensor 'a': wrong byte count: data_offsets [0,8] hold 8 bytes, shape (3) "
                        "of F32 needs 12"));
  EXPECT_THAT(read_error(raw("shape.st", R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", eight)),
              HasSubstr("tensor 'a': shape [-2] has a dimension that is not a non-negative integer"));
  EXPECT_THAT(read_error(raw("fields.st", R"({"a":{"dtype":"F32","shape":[2]}})", eight)),
              HasSubstr("tensor 'a': needs \"dtype\", \"shape\" and \"data_offsets\""));
  EXPECT_THAT(read_error(raw("reversed.st", R"({"a":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})", eight)),
              HasSubstr("end before they begin"));
  EXPECT_THAT(read_error(raw("range.st", "{" + ok_entry + "}", "1234")),
              HasSubstr("tensor 'a': data_offsets [0,8] are past the end of the data (4 bytes"));
  // Offsets against each other.
  EXPECT_THAT(read_error(raw("overlap.st",
                             "{" + ok_entry + R"(,"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                             eight + "1234")),
              HasSubstr("tensors 'a' [0, 8) and 'b' [4, 12) overlap"));
  EXPECT_THAT(read_error(raw("gap.st",
                             "{" + ok_entry + R"(,"b":{"dtype":"F32","shape":[1],"data_offsets":[12,16]}})",
                             eight + eight)),
              HasSubstr("bytes [8, 12) of the data belong to no tensor (a gap before 'b')"));
  EXPECT_THAT(read_error(raw("trailing.st", "{" + ok_entry + "}", eight + "12")),
              HasSubstr("the data has 10 bytes, the tensors end at 8"));
  // The same entries in either order, and a valid one, read.
  EXPECT_EQ(io::read_safetensors(raw("ok.st", "{" + ok_entry + "}  ", eight))[0].bytes.size(), 8u);
  const std::vector<io::WeightTensor> two = io::read_safetensors(
      raw("order.st", R"({"b":{"dtype":"BF16","shape":[2],"data_offsets":[8,12]},)" + ok_entry + "}",
          eight + "1234"));
  ASSERT_EQ(two.size(), 2u);
  EXPECT_EQ(two[0].name, "a");
  EXPECT_EQ(two[1].name, "b");

  // A written file cut short.
  const fs::path p = dir_ / "cut.safetensors";
  io::write_safetensors(p, sample_tensors());
  fs::resize_file(p, fs::file_size(p) - 3);
  EXPECT_THAT(read_error(p), HasSubstr("are past the end of the data"));
}

TEST_F(WeightsFileTest, WriterRefusesBadTensorsAndNamesThePath) {
  const fs::path p = dir_ / "w.safetensors";
  io::write_safetensors(p, sample_tensors());
  std::vector<io::WeightTensor> dup = sample_tensors();
  dup.push_back(dup[0]);
  EXPECT_THAT(error_of<InvalidArgument>([&] { io::write_safetensors(p, dup); }),
              HasSubstr("tensor \"wte\" appears twice"));
  std::vector<io::WeightTensor> short_bytes = sample_tensors();
  short_bytes[1].bytes.pop_back();
  EXPECT_THAT(error_of<InvalidArgument>([&] { io::write_safetensors(p, short_bytes); }),
              HasSubstr("tensor \"h.0.ln1.weight\" (4) BF16 has 7 bytes, its shape needs 8"));
  std::vector<io::WeightTensor> reserved = sample_tensors();
  reserved[0].name = "__metadata__";
  EXPECT_THAT(error_of<InvalidArgument>([&] { io::write_safetensors(p, reserved); }),
              HasSubstr("is reserved for the metadata"));
  // The refused writes left the file as it was.
  EXPECT_EQ(io::read_safetensors(p).size(), sample_tensors().size());
  // A parent that is a file.
  const std::string msg = error_of<IoError>([&] { io::write_safetensors(p / "x.safetensors", {}); });
  EXPECT_THAT(msg, HasSubstr("w.safetensors"));
  EXPECT_THAT(msg, HasSubstr("cannot create"));
}

TEST_F(WeightsFileTest, MappedFileGivesEveryTensorInPlace) {
  const fs::path p = dir_ / "m.safetensors";
  io::write_safetensors(p, sample_tensors(), {{"format", "pt"}});
  io::SafetensorsFile file(p);
  EXPECT_EQ(file.path(), p);
  EXPECT_EQ(file.file_bytes(), fs::file_size(p));
  EXPECT_EQ(file.metadata(), (io::WeightMetadata{{"format", "pt"}}));
  const std::vector<io::WeightTensor> want = sample_tensors();
  ASSERT_EQ(file.tensors().size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    const io::SafetensorsEntry& e = file.tensors()[i];
    EXPECT_EQ(e.name, want[i].name);
    EXPECT_EQ(e.shape, want[i].shape);
    EXPECT_EQ(e.dtype, io::safetensors_dtype_name(want[i].dtype));
    EXPECT_EQ(e.porter_dtype, want[i].dtype);
    EXPECT_EQ(e.numel, want[i].numel());
    const std::span<const std::byte> bytes = file.bytes(e);
    EXPECT_TRUE(std::equal(bytes.begin(), bytes.end(), want[i].bytes.begin(), want[i].bytes.end())) << e.name;
    EXPECT_EQ(file.find(e.name), &e);
  }
  EXPECT_EQ(file.find("nope"), nullptr);
  // Moved, the mapping goes with it.
  io::SafetensorsFile moved = std::move(file);
  EXPECT_EQ(moved.tensors().size(), want.size());
  EXPECT_EQ(moved.bytes(*moved.find("wte")).size(), 24u);
}

TEST_F(WeightsFileTest, MappedFileOpensEverySafetensorsDtypeAndRefusesTheRest) {
  const std::string eight(8, '\0');
  const fs::path p = raw("f64.st", R"({"a":{"dtype":"F64","shape":[1],"data_offsets":[0,8]},)"
                                   R"("m":{"dtype":"BOOL","shape":[2],"data_offsets":[8,10]}})",
                         eight + std::string("\1\0", 2));
  const io::SafetensorsFile file(p);
  ASSERT_EQ(file.tensors().size(), 2u);
  EXPECT_EQ(file.tensors()[0].dtype, "F64");
  EXPECT_FALSE(file.tensors()[0].porter_dtype.has_value());
  EXPECT_EQ(file.tensors()[1].dtype, "BOOL");
  // io::read_safetensors reads porter's dtypes only.
  EXPECT_THAT(read_error(p), HasSubstr("tensor 'a': unknown dtype \"F64\" (porter reads F32, BF16, F16, I32)"));
  auto open_error = [](const fs::path& path) {
    return error_of<IoError>([&] { io::SafetensorsFile f(path); });
  };
  EXPECT_THAT(open_error(raw("f33.st", R"({"a":{"dtype":"F33","shape":[1],"data_offsets":[0,4]}})", "1234")),
              HasSubstr("tensor 'a': unknown dtype \"F33\" (not a safetensors dtype)"));
  // Numel x dtype size past 2^64.
  EXPECT_THAT(open_error(raw("big.st", R"({"a":{"dtype":"F64","shape":[2147483648,2147483648],)"
                                       R"("data_offsets":[0,8]}})", eight)),
              HasSubstr("needs more than 2^64"));
  EXPECT_THAT(open_error(dir_), HasSubstr("cannot read: not a regular file"));
  EXPECT_THAT(open_error(dir_ / "none.st"), HasSubstr("none.st\": cannot read: No such file"));
  EXPECT_THAT(open_error(raw("empty.st", 0, "")), HasSubstr("the header does not start with"));
}

}  // namespace
}  // namespace porter::engine
