// Hugging Face checkpoints (io/hf_checkpoint.h): GPT-2 files written here in Hugging
// Face's layout (bare and "transformer." names, with the attention buffers, tied and untied,
// f32/bf16/f16, one file and shards) read into porter's layout with the Conv1D weights
// transposed; import -> export -> import bitwise; every malformed file, index and config.json
// refused with its own message; the Llama name map and its import into a layout built here.
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "base/error.h"
#include "config/parse.h"
#include "io/hf_checkpoint.h"
#include "io/weights_file.h"
#include "tensor/dtype.h"
#include "models/factory.h"
#include "models/transformer.h"

namespace porter::engine {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::testing::Not;
using Json = nlohmann::json;

template <typename E>
std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const E& e) {
    return e.what();
  }
  return "(no error)";
}

// A 2-layer GPT-2: C = 8, 2 heads, 16 positions (= seq_len), vocab 24.
config::ModelConfig tiny_gpt2(bool tied) {
  config::ModelConfig m;
  m.type = config::ModelType::kGpt;
  m.layers = 2;
  m.hidden = 8;
  m.heads = 2;
  m.seq_len = 16;
  m.max_positions = 16;
  m.vocab = 24;
  m.tie_embeddings = tied;
  m.kv_heads = 2;
  m.intermediate = 32;
  return m;
}

// The Hugging Face GPT-2 names and shapes, written out here (not taken from io::hf_param_map):
// porter name, bare Hugging Face name, porter's (out, in) shape, whether the file holds the
// transpose.
struct Expected {
  std::string porter, hf;
  std::vector<int64_t> shape;
  bool transposed;
};

std::vector<Expected> gpt2_expected(const config::ModelConfig& m) {
  const int64_t c = m.hidden, v = m.vocab, p = m.max_positions;
  std::vector<Expected> e = {{"wte", "wte.weight", {v, c}, false}, {"wpe", "wpe.weight", {p, c}, false}};
  for (int l = 0; l < m.layers; ++l) {
    const std::string h = "h." + std::to_string(l) + ".";
    std::vector<Expected> block = {
        {h + "ln1.weight", h + "ln_1.weight", {c}, false},
        {h + "ln1.bias", h + "ln_1.bias", {c}, false},
        {h + "qkv.weight", h + "attn.c_attn.weight", {3 * c, c}, true},
        {h + "qkv.bias", h + "attn.c_attn.bias", {3 * c}, false},
        {h + "proj.weight", h + "attn.c_proj.weight", {c, c}, true},
        {h + "proj.bias", h + "attn.c_proj.bias", {c}, false},
        {h + "ln2.weight", h + "ln_2.weight", {c}, false},
        {h + "ln2.bias", h + "ln_2.bias", {c}, false},
        {h + "fc1.weight", h + "mlp.c_fc.weight", {4 * c, c}, true},
        {h + "fc1.bias", h + "mlp.c_fc.bias", {4 * c}, false},
        {h + "fc2.weight", h + "mlp.c_proj.weight", {c, 4 * c}, true},
        {h + "fc2.bias", h + "mlp.c_proj.bias", {c}, false},
    };
    e.insert(e.end(), block.begin(), block.end());
  }
  e.push_back({"lnf.weight", "ln_f.weight", {c}, false});
  e.push_back({"lnf.bias", "ln_f.bias", {c}, false});
  if (!m.tie_embeddings) e.push_back({"head.weight", "lm_head.weight", {v, c}, false});
  return e;
}

int64_t numel(const std::vector<int64_t>& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

// Distinct values per parameter, multiples of 1/32 in [-1.5, 1.5]: exact in bf16 and f16.
std::vector<float> pattern(const std::string& name, int64_t n) {
  uint64_t h = 1469598103934665603ull;
  for (char ch : name) h = (h ^ static_cast<uint8_t>(ch)) * 1099511628211ull;
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    v[static_cast<size_t>(i)] = static_cast<float>(static_cast<int64_t>((h + static_cast<uint64_t>(i) * 37) % 97) - 48) / 32.0f;
  }
  return v;
}

std::vector<std::byte> encode(const std::vector<float>& v, tensor::DType dtype) {
  const size_t size = tensor::dtype_size(dtype);
  std::vector<std::byte> out(v.size() * size);
  for (size_t i = 0; i < v.size(); ++i) {
    if (dtype == tensor::DType::kF32) {
      std::memcpy(out.data() + 4 * i, &v[i], 4);
    } else {
      const uint16_t h = dtype == tensor::DType::kBF16 ? tensor::f32_to_bf16(v[i]) : tensor::f32_to_f16(v[i]);
      std::memcpy(out.data() + 2 * i, &h, 2);
    }
  }
  return out;
}

// porter's (out, in) values as the file's (in, out).
std::vector<float> transpose(const std::vector<float>& v, int64_t rows, int64_t cols) {
  std::vector<float> t(v.size());
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) t[static_cast<size_t>(c * rows + r)] = v[static_cast<size_t>(r * cols + c)];
  }
  return t;
}

struct Gpt2Files {
  std::vector<io::WeightTensor> tensors;
  std::map<std::string, std::vector<float>> porter;  // expected values, porter orientation
};

// The Hugging Face tensors of `m`: `prefix` before every name but lm_head.weight; with
// `buffers`, each layer's attn.bias and attn.masked_bias as GPT-2 checkpoints hold them.
Gpt2Files gpt2_files(const config::ModelConfig& m, const std::string& prefix, tensor::DType dtype,
                     bool buffers = true) {
  Gpt2Files f;
  for (const Expected& e : gpt2_expected(m)) {
    std::vector<float> v = pattern(e.porter, numel(e.shape));
    f.porter[e.porter] = v;
    std::vector<int64_t> shape = e.shape;
    if (e.transposed) {
      v = transpose(v, e.shape[0], e.shape[1]);
      shape = {e.shape[1], e.shape[0]};
    }
    const std::string name = e.hf == "lm_head.weight" ? e.hf : prefix + e.hf;
    f.tensors.push_back({name, shape, dtype, encode(v, dtype)});
  }
  if (buffers) {
    const int64_t p = m.max_positions;
    for (int l = 0; l < m.layers; ++l) {
      const std::string h = prefix + "h." + std::to_string(l) + ".attn.";
      f.tensors.push_back({h + "bias", {1, 1, p, p}, tensor::DType::kF32,
                           encode(std::vector<float>(static_cast<size_t>(p * p), 1.0f), tensor::DType::kF32)});
      f.tensors.push_back({h + "masked_bias", {}, tensor::DType::kF32,
                           encode(std::vector<float>{-1e4f}, tensor::DType::kF32)});
    }
  }
  return f;
}

Json gpt2_config(const config::ModelConfig& m) {
  return {{"architectures", {"GPT2LMHeadModel"}}, {"model_type", "gpt2"},
          {"n_layer", m.layers},                  {"n_embd", m.hidden},
          {"n_head", m.heads},                    {"n_positions", m.max_positions},
          {"vocab_size", m.vocab},                {"layer_norm_epsilon", 1e-5},
          {"n_inner", nullptr},                   {"activation_function", "gelu_new"},
          {"tie_word_embeddings", m.tie_embeddings}};
}

class HfCheckpoint : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("porter_hf_" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()) +
            "_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  fs::path model_dir(const std::string& name, const Json& config,
                     const std::vector<io::WeightTensor>& tensors) {
    const fs::path d = dir_ / name;
    fs::create_directories(d);
    std::ofstream(d / "config.json") << config.dump(2);
    if (!tensors.empty()) io::write_safetensors(d / "model.safetensors", tensors, {{"format", "pt"}});
    return d;
  }
  // A GPT-2 directory of `m` with one tensor replaced (by name) or removed (empty shape and
  // bytes with a name of "-" + the name).
  fs::path gpt2_dir(const std::string& name, const config::ModelConfig& m,
                    const std::function<void(std::vector<io::WeightTensor>&)>& edit = {}) {
    Gpt2Files f = gpt2_files(m, "transformer.", tensor::DType::kF32);
    if (edit) edit(f.tensors);
    return model_dir(name, gpt2_config(m), f.tensors);
  }
  std::string weights_error(const fs::path& d, const config::ModelConfig& m) {
    return error_of<IoError>([&] { io::read_hf_weights(d, m); });
  }

  fs::path dir_;
};

// Rewrites a safetensors file's header (the data stays as it is).
void rewrite_header(const fs::path& p, const std::function<void(nlohmann::ordered_json&)>& edit) {
  std::ifstream in(p, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  in.close();
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(static_cast<uint8_t>(bytes[static_cast<size_t>(i)])) << (8 * i);
  nlohmann::ordered_json header = nlohmann::ordered_json::parse(bytes.substr(8, n));
  edit(header);
  std::string text = header.dump();
  text.resize((text.size() + 7) / 8 * 8, ' ');
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  for (int i = 0; i < 8; ++i) out.put(static_cast<char>(static_cast<uint64_t>(text.size()) >> (8 * i)));
  out << text << bytes.substr(8 + n);
}

io::WeightTensor* find(std::vector<io::WeightTensor>& ts, const std::string& name) {
  for (io::WeightTensor& t : ts) {
    if (t.name == name) return &t;
  }
  ADD_FAILURE() << "no tensor " << name;
  return nullptr;
}

void erase_tensor(std::vector<io::WeightTensor>& ts, const std::string& name) {
  std::erase_if(ts, [&](const io::WeightTensor& t) { return t.name == name; });
}

// Every parameter's values at its layout offset are the expected ones, bitwise.
void expect_layout_values(const nn::ParamLayout& layout, const std::vector<float>& values,
                          const std::map<std::string, std::vector<float>>& expected) {
  ASSERT_EQ(static_cast<int64_t>(values.size()), layout.total_elems());
  ASSERT_EQ(layout.entries().size(), expected.size());
  for (const nn::ParamEntry& e : layout.entries()) {
    const std::vector<float>& want = expected.at(e.name);
    ASSERT_EQ(static_cast<int64_t>(want.size()), e.shape.numel()) << e.name;
    EXPECT_EQ(std::memcmp(values.data() + e.offset_elems, want.data(), want.size() * 4), 0) << e.name;
  }
}

// ---- GPT-2 import ------------------------------------------------------------------------

using ImportCase = std::tuple<std::string, bool, tensor::DType>;  // prefix, tied, dtype

class HfGpt2Import : public HfCheckpoint, public ::testing::WithParamInterface<ImportCase> {};

TEST_P(HfGpt2Import, GivesTheLayoutValuesWithConv1DTransposed) {
  const auto [prefix, tied, dtype] = GetParam();
  const config::ModelConfig m = tiny_gpt2(tied);
  Gpt2Files f = gpt2_files(m, prefix, dtype);
  const fs::path d = model_dir("gpt2", gpt2_config(m), f.tensors);
  const io::HfWeights w = io::read_hf_weights(d, m);
  const models::Transformer gpt(m);
  expect_layout_values(gpt.layout(), w.values, f.porter);
  EXPECT_EQ(w.tensors, static_cast<int64_t>(gpt.layout().entries().size()));
  EXPECT_EQ(w.skipped, 2 * m.layers);  // attn.bias and attn.masked_bias
  EXPECT_EQ(w.files, std::vector<fs::path>{d / "model.safetensors"});
  // The buffers are F32 whatever the weights' dtype; only the weights' dtype is reported.
  EXPECT_EQ(w.dtypes, std::vector<std::string>{std::string(io::safetensors_dtype_name(dtype))});

  // The Conv1D transposes, one element each: file (in, out) = porter (out, in).
  const io::SafetensorsFile file(d / "model.safetensors");
  auto file_value = [&](const std::string& name, int64_t a, int64_t b) {
    const io::SafetensorsEntry* e = file.find(prefix + name);
    EXPECT_NE(e, nullptr) << name;
    const int64_t i = a * e->shape[1] + b;
    const std::byte* p = file.bytes(*e).data() + i * static_cast<int64_t>(tensor::dtype_size(dtype));
    if (dtype == tensor::DType::kF32) {
      float x;
      std::memcpy(&x, p, 4);
      return x;
    }
    uint16_t h;
    std::memcpy(&h, p, 2);
    return dtype == tensor::DType::kBF16 ? tensor::bf16_to_f32(h) : tensor::f16_to_f32(h);
  };
  auto porter_value = [&](const std::string& name, int64_t r, int64_t c) {
    const nn::ParamEntry& e = gpt.layout().find(name);
    return w.values[static_cast<size_t>(e.offset_elems + r * e.shape[1] + c)];
  };
  // c_attn (C, 3C): column 5 of row 1 is qkv (3C, C) row 5, column 1.
  EXPECT_EQ(porter_value("h.0.qkv.weight", 5, 1), file_value("h.0.attn.c_attn.weight", 1, 5));
  EXPECT_EQ(porter_value("h.1.qkv.weight", 23, 7), file_value("h.1.attn.c_attn.weight", 7, 23));
  EXPECT_EQ(porter_value("h.0.proj.weight", 2, 6), file_value("h.0.attn.c_proj.weight", 6, 2));
  EXPECT_EQ(porter_value("h.1.fc1.weight", 31, 0), file_value("h.1.mlp.c_fc.weight", 0, 31));
  EXPECT_EQ(porter_value("h.0.fc2.weight", 3, 29), file_value("h.0.mlp.c_proj.weight", 29, 3));
  EXPECT_NE(file_value("h.0.attn.c_attn.weight", 1, 5), file_value("h.0.attn.c_attn.weight", 5, 1));
}

INSTANTIATE_TEST_SUITE_P(
    NamesTyingDtypes, HfGpt2Import,
    ::testing::Combine(::testing::Values(std::string(""), std::string("transformer.")),
                       ::testing::Bool(),
                       ::testing::Values(tensor::DType::kF32, tensor::DType::kBF16, tensor::DType::kF16)),
    [](const ::testing::TestParamInfo<ImportCase>& p) {
      return std::string(std::get<0>(p.param).empty() ? "Bare" : "Prefixed") +
             (std::get<1>(p.param) ? "Tied" : "Untied") +
             std::string(tensor::dtype_name(std::get<2>(p.param)));
    });

TEST_F(HfCheckpoint, WithoutBuffersAndWithATiedHeadThatIsTheEmbedding) {
  const config::ModelConfig m = tiny_gpt2(true);
  Gpt2Files f = gpt2_files(m, "", tensor::DType::kF32, /*buffers=*/false);
  io::WeightTensor head = *find(f.tensors, "wte.weight");
  head.name = "lm_head.weight";
  f.tensors.push_back(head);
  const fs::path d = model_dir("tied", gpt2_config(m), f.tensors);
  const io::HfWeights w = io::read_hf_weights(d, m);
  expect_layout_values(models::Transformer(m).layout(), w.values, f.porter);
  EXPECT_EQ(w.skipped, 1);  // lm_head.weight, equal to wte

  // One element off: refused, naming both tensors and the element.
  find(f.tensors, "lm_head.weight")->bytes[4 * 9] ^= std::byte{1};
  const fs::path bad = model_dir("tied-differs", gpt2_config(m), f.tensors);
  const std::string msg = weights_error(bad, m);
  EXPECT_THAT(msg, HasSubstr("tensor 'lm_head.weight' differs from 'wte.weight' at element 9 [1, 1]"));
  EXPECT_THAT(msg, HasSubstr("tie_word_embeddings true"));
}

TEST_F(HfCheckpoint, ShardedIndexGivesTheSameValues) {
  const config::ModelConfig m = tiny_gpt2(false);
  Gpt2Files f = gpt2_files(m, "transformer.", tensor::DType::kBF16);
  const fs::path d = dir_ / "sharded";
  fs::create_directories(d);
  std::ofstream(d / "config.json") << gpt2_config(m).dump();
  std::vector<io::WeightTensor> a(f.tensors.begin(), f.tensors.begin() + 10);
  std::vector<io::WeightTensor> b(f.tensors.begin() + 10, f.tensors.end());
  io::write_safetensors(d / "model-00001-of-00002.safetensors", a);
  io::write_safetensors(d / "model-00002-of-00002.safetensors", b);
  Json map = Json::object();
  for (const io::WeightTensor& t : a) map[t.name] = "model-00001-of-00002.safetensors";
  for (const io::WeightTensor& t : b) map[t.name] = "model-00002-of-00002.safetensors";
  std::ofstream(d / "model.safetensors.index.json")
      << Json{{"metadata", {{"total_size", 1234}}}, {"weight_map", map}}.dump();
  const io::HfWeights w = io::read_hf_weights(d, m);
  expect_layout_values(models::Transformer(m).layout(), w.values, f.porter);
  EXPECT_EQ(w.files.size(), 2u);

  // model.safetensors, when there is one too, is the one read (as transformers does).
  io::write_safetensors(d / "model.safetensors", gpt2_files(m, "", tensor::DType::kF32).tensors);
  EXPECT_EQ(io::read_hf_weights(d, m).files, std::vector<fs::path>{d / "model.safetensors"});
}

// ---- round trip --------------------------------------------------------------------------

TEST_F(HfCheckpoint, ImportExportImportIsBitwise) {
  for (const bool tied : {true, false}) {
    SCOPED_TRACE(tied ? "tied" : "untied");
    const config::ModelConfig m = tiny_gpt2(tied);
    const fs::path src = model_dir(tied ? "src-tied" : "src", gpt2_config(m),
                                   gpt2_files(m, "", tensor::DType::kF32).tensors);
    const models::Transformer gpt(m);
    const io::HfWeights first = io::read_hf_weights(src, m);
    const fs::path out = dir_ / (tied ? "out-tied" : "out");
    const io::HfExport x = io::write_hf_checkpoint(out, m, gpt.layout(), first.values, tensor::DType::kF32);
    EXPECT_EQ(x.tensors, static_cast<int64_t>(gpt.layout().entries().size()));
    EXPECT_EQ(x.num_params, gpt.layout().num_params());
    EXPECT_EQ(x.bytes, fs::file_size(out / "model.safetensors"));
    const io::HfWeights second = io::read_hf_weights(out, m);
    ASSERT_EQ(second.values.size(), first.values.size());
    EXPECT_EQ(std::memcmp(second.values.data(), first.values.data(), first.values.size() * 4), 0);
    EXPECT_EQ(second.skipped, 0);

    // The names save_pretrained writes: "transformer." before all but lm_head.weight, which
    // is there only untied; the metadata says PyTorch.
    io::WeightMetadata meta;
    const std::vector<io::WeightTensor> written = io::read_safetensors(out / "model.safetensors", &meta);
    EXPECT_EQ(meta, (io::WeightMetadata{{"format", "pt"}}));
    std::vector<std::string> names;
    for (const io::WeightTensor& t : written) names.push_back(t.name);
    std::vector<std::string> want;
    for (const Expected& e : gpt2_expected(m)) {
      want.push_back(e.hf == "lm_head.weight" ? e.hf : "transformer." + e.hf);
    }
    EXPECT_EQ(names, want);
    EXPECT_EQ(written[2].shape, (std::vector<int64_t>{8}));            // ln_1.weight
    EXPECT_EQ(written[4].shape, (std::vector<int64_t>{8, 24}));        // c_attn (C, 3C)
    EXPECT_EQ(written[10].shape, (std::vector<int64_t>{8, 32}));       // c_fc (C, 4C)
    EXPECT_EQ(written[12].shape, (std::vector<int64_t>{32, 8}));       // mlp.c_proj (4C, C)

    // config.json reads back as the same model.
    const io::HfConfig c = io::read_hf_config(out);
    EXPECT_EQ(c.model_keys, io::read_hf_config(src).model_keys);
    EXPECT_EQ(c.json["architectures"], Json::array({"GPT2LMHeadModel"}));
    EXPECT_EQ(c.json["torch_dtype"], "float32");
    EXPECT_EQ(c.json["tie_word_embeddings"], tied);
    EXPECT_EQ(c.json["activation_function"], "gelu_new");
    EXPECT_TRUE(c.json["n_inner"].is_null());
  }
}

TEST_F(HfCheckpoint, ExportInBf16AndF16RoundsToNearestEven) {
  const config::ModelConfig m = tiny_gpt2(true);
  const models::Transformer gpt(m);
  std::vector<float> values(static_cast<size_t>(gpt.layout().total_elems()), 0.0f);
  for (size_t i = 0; i < values.size(); ++i) values[i] = 1.0f + static_cast<float>(i) * 1e-4f;
  for (const tensor::DType dtype : {tensor::DType::kBF16, tensor::DType::kF16}) {
    SCOPED_TRACE(std::string(tensor::dtype_name(dtype)));
    const fs::path out = dir_ / std::string(tensor::dtype_name(dtype));
    io::write_hf_checkpoint(out, m, gpt.layout(), values, dtype);
    const std::vector<io::WeightTensor> written = io::read_safetensors(out / "model.safetensors");
    const io::WeightTensor& ln = written[2];  // transformer.h.0.ln_1.weight
    ASSERT_EQ(ln.name, "transformer.h.0.ln_1.weight");
    EXPECT_EQ(ln.dtype, dtype);
    const nn::ParamEntry& e = gpt.layout().find("h.0.ln1.weight");
    for (int64_t i = 0; i < 8; ++i) {
      uint16_t h;
      std::memcpy(&h, ln.bytes.data() + 2 * i, 2);
      const float v = values[static_cast<size_t>(e.offset_elems + i)];
      EXPECT_EQ(h, dtype == tensor::DType::kBF16 ? tensor::f32_to_bf16(v) : tensor::f32_to_f16(v)) << i;
    }
    EXPECT_EQ(io::read_hf_config(out).json["torch_dtype"], dtype == tensor::DType::kBF16 ? "bfloat16" : "float16");
    // And it imports as those rounded values.
    const io::HfWeights back = io::read_hf_weights(out, m);
    EXPECT_EQ(back.dtypes, std::vector<std::string>{std::string(io::safetensors_dtype_name(dtype))});
  }
}

TEST_F(HfCheckpoint, ExportRefusesNonFiniteValuesAndAWrongCount) {
  const config::ModelConfig m = tiny_gpt2(true);
  const models::Transformer gpt(m);
  std::vector<float> values(static_cast<size_t>(gpt.layout().total_elems()), 0.5f);
  values[static_cast<size_t>(gpt.layout().find("h.1.fc1.weight").offset_elems + 9)] =
      std::numeric_limits<float>::quiet_NaN();
  EXPECT_THAT(error_of<InvalidArgument>([&] {
                io::write_hf_checkpoint(dir_ / "nan", m, gpt.layout(), values, tensor::DType::kF32);
              }),
              HasSubstr("parameter 'h.1.fc1.weight' element 9 [1, 1] is nan"));
  EXPECT_FALSE(fs::exists(dir_ / "nan" / "model.safetensors"));
  values.pop_back();
  EXPECT_THAT(error_of<InvalidArgument>([&] {
                io::write_hf_checkpoint(dir_ / "short", m, gpt.layout(), values, tensor::DType::kF32);
              }),
              HasSubstr("values for a layout of"));
}

// ---- malformed weights -------------------------------------------------------------------

TEST_F(HfCheckpoint, MissingAndUnexpectedTensorsAreListedInOneMessage) {
  const config::ModelConfig m = tiny_gpt2(false);
  const fs::path d = gpt2_dir("missing", m, [](std::vector<io::WeightTensor>& ts) {
    erase_tensor(ts, "transformer.h.1.mlp.c_fc.bias");
    erase_tensor(ts, "lm_head.weight");
    io::WeightTensor extra = ts[0];
    extra.name = "transformer.h.2.ln_1.weight";
    ts.push_back(extra);
    extra.name = "score.weight";
    ts.push_back(extra);
  });
  const std::string msg = weights_error(d, m);
  EXPECT_THAT(msg, HasSubstr("2 tensor(s) of config.json's model missing: "
                             "transformer.h.1.mlp.c_fc.bias, lm_head.weight"));
  EXPECT_THAT(msg, HasSubstr("2 tensor(s) porter does not know: transformer.h.2.ln_1.weight, "
                             "score.weight"));
  EXPECT_THAT(msg, HasSubstr("model.safetensors"));
  // Untied, a file without lm_head.weight misses it.
  const fs::path untied = gpt2_dir("untied-no-head", m, [](std::vector<io::WeightTensor>& ts) {
    erase_tensor(ts, "lm_head.weight");
  });
  EXPECT_THAT(weights_error(untied, m), HasSubstr("1 tensor(s) of config.json's model missing: lm_head.weight"));
  EXPECT_THAT(weights_error(untied, m), Not(HasSubstr("does not know")));
}

TEST_F(HfCheckpoint, ATensorUnderBothNamesIsRefused) {
  const config::ModelConfig m = tiny_gpt2(true);
  const fs::path d = gpt2_dir("twice", m, [](std::vector<io::WeightTensor>& ts) {
    io::WeightTensor bare = *find(ts, "transformer.ln_f.bias");
    bare.name = "ln_f.bias";
    ts.push_back(bare);
  });
  EXPECT_THAT(weights_error(d, m), HasSubstr("tensor 'ln_f.bias' appears twice: as "
                                             "'transformer.ln_f.bias'"));
}

TEST_F(HfCheckpoint, AWrongShapeNamesTheTensorAndBothShapes) {
  const config::ModelConfig m = tiny_gpt2(true);
  // c_attn written in porter's orientation (3C, C), not Conv1D's (C, 3C).
  const fs::path d = gpt2_dir("shape", m, [](std::vector<io::WeightTensor>& ts) {
    find(ts, "transformer.h.1.attn.c_attn.weight")->shape = {24, 8};
  });
  const std::string msg = weights_error(d, m);
  EXPECT_THAT(msg, HasSubstr("tensor 'transformer.h.1.attn.c_attn.weight': shape (24, 8), but "
                             "the model's config.json gives (8, 24)"));
  EXPECT_THAT(msg, HasSubstr("porter's 'h.1.qkv.weight' (24, 8), stored transposed"));
}

TEST_F(HfCheckpoint, UnsupportedDtypesAreRefusedByName) {
  const config::ModelConfig m = tiny_gpt2(true);
  const fs::path i32 = gpt2_dir("i32", m, [](std::vector<io::WeightTensor>& ts) {
    find(ts, "transformer.wpe.weight")->dtype = tensor::DType::kI32;
  });
  EXPECT_THAT(weights_error(i32, m), HasSubstr("tensor 'transformer.wpe.weight': dtype I32: porter "
                                               "loads weights stored as F32, BF16 or F16"));
  // F64, which porter's writer cannot write: ln_f.weight's 8 floats (32 bytes) relabelled
  // in the header as 4 doubles, the same bytes.
  const fs::path f64 = gpt2_dir("f64", m);
  rewrite_header(f64 / "model.safetensors", [](nlohmann::ordered_json& h) {
    h["transformer.ln_f.weight"]["dtype"] = "F64";
    h["transformer.ln_f.weight"]["shape"] = {4};
  });
  EXPECT_THAT(weights_error(f64, m), HasSubstr("tensor 'transformer.ln_f.weight': dtype F64: "
                                               "porter loads weights stored as F32, BF16 or F16"));
}

TEST_F(HfCheckpoint, NonFiniteWeightsNameTheTensorAndTheFirstBadIndex) {
  const config::ModelConfig m = tiny_gpt2(true);
  for (const float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity()}) {
    const std::string tag = std::isnan(bad) ? "nan" : bad > 0 ? "inf" : "-inf";
    const fs::path d = gpt2_dir("nonfinite" + tag, m, [&](std::vector<io::WeightTensor>& ts) {
      io::WeightTensor& t = *find(ts, "transformer.h.0.mlp.c_fc.weight");  // (8, 32)
      std::memcpy(t.bytes.data() + 4 * 70, &bad, 4);
      std::memcpy(t.bytes.data() + 4 * 100, &bad, 4);
    });
    EXPECT_THAT(weights_error(d, m), HasSubstr("tensor 'transformer.h.0.mlp.c_fc.weight': element 70 "
                                               "[2, 6] is " + tag));
  }
  // In bf16 too.
  const fs::path d = dir_ / "bf16-nan";
  Gpt2Files f = gpt2_files(m, "", tensor::DType::kBF16);
  const uint16_t nan = tensor::f32_to_bf16(std::numeric_limits<float>::quiet_NaN());
  std::memcpy(find(f.tensors, "wte.weight")->bytes.data(), &nan, 2);
  model_dir("bf16-nan", gpt2_config(m), f.tensors);
  EXPECT_THAT(weights_error(d, m), HasSubstr("tensor 'wte.weight': element 0 [0, 0] is nan"));
}

TEST_F(HfCheckpoint, TruncatedAndLyingFilesAreRefused) {
  const config::ModelConfig m = tiny_gpt2(true);
  const fs::path d = gpt2_dir("truncated", m);
  const fs::path p = d / "model.safetensors";
  const uintmax_t full = fs::file_size(p);
  fs::resize_file(p, full - 5);
  EXPECT_THAT(weights_error(d, m), HasSubstr("are past the end of the data"));
  fs::resize_file(p, 6);
  EXPECT_THAT(weights_error(d, m), HasSubstr("truncated: 6 bytes, less than the 8-byte header length"));

  // Headers that lie about the offsets. wte (24, 8) f32 is [0, 768), wpe [768, 1280).
  auto wpe_at = [&](const std::string& name, uint64_t begin, uint64_t end) {
    const fs::path dd = gpt2_dir(name, m);
    rewrite_header(dd / "model.safetensors", [&](nlohmann::ordered_json& h) {
      h["transformer.wpe.weight"]["data_offsets"] = {begin, end};
    });
    return dd;
  };
  EXPECT_THAT(weights_error(wpe_at("range", 1u << 30, (1u << 30) + 512), m),
              HasSubstr("tensor 'transformer.wpe.weight': data_offsets [1073741824,1073742336] "
                        "are past the end of the data"));
  EXPECT_THAT(weights_error(wpe_at("overlap", 700, 1212), m),
              HasSubstr("tensors 'transformer.wte.weight' [0, 768) and 'transformer.wpe.weight' "
                        "[700, 1212) overlap"));
  EXPECT_THAT(weights_error(wpe_at("count", 768, 1276), m), HasSubstr("wrong byte count"));
  EXPECT_THAT(weights_error(wpe_at("gap", 772, 1284), m), HasSubstr("belong to no tensor"));
  const fs::path length = gpt2_dir("length", m);
  {
    std::fstream io(length / "model.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    const char huge[8] = {0, 0, 0, 0, 1, 0, 0, 0};
    io.write(huge, 8);
  }
  EXPECT_THAT(weights_error(length, m), HasSubstr("bad header length 4294967296"));
}

TEST_F(HfCheckpoint, NoWeightsFileIsRefusedWithAHint) {
  const config::ModelConfig m = tiny_gpt2(true);
  const fs::path d = model_dir("empty", gpt2_config(m), {});
  EXPECT_THAT(weights_error(d, m), HasSubstr("has neither model.safetensors nor model.safetensors.index.json"));
  std::ofstream(d / "pytorch_model.bin") << "x";
  EXPECT_THAT(weights_error(d, m), HasSubstr("porter reads safetensors only"));
}

TEST_F(HfCheckpoint, BadIndexesAreRefused) {
  const config::ModelConfig m = tiny_gpt2(true);
  Gpt2Files f = gpt2_files(m, "", tensor::DType::kF32);
  auto sharded = [&](const std::string& name, const std::string& index,
                     const std::function<void(const fs::path&)>& more = {}) {
    const fs::path d = model_dir(name, gpt2_config(m), {});
    io::write_safetensors(d / "a.safetensors", f.tensors);
    std::ofstream(d / "model.safetensors.index.json") << index;
    if (more) more(d);
    return weights_error(d, m);
  };
  Json full = Json::object();
  for (const io::WeightTensor& t : f.tensors) full[t.name] = "a.safetensors";
  EXPECT_THAT(sharded("json", "{\"weight_map\": "), HasSubstr("model.safetensors.index.json\": not valid JSON"));
  EXPECT_THAT(sharded("nomap", "{\"metadata\": {}}"), HasSubstr("needs \"weight_map\", an object"));
  EXPECT_THAT(sharded("emptymap", "{\"weight_map\": {}}"), HasSubstr("\"weight_map\" lists no tensor"));
  EXPECT_THAT(sharded("number", R"({"weight_map": {"wte.weight": 3}})"),
              HasSubstr("weight_map[\"wte.weight\"] is 3, not a file name"));
  EXPECT_THAT(sharded("escape", R"({"weight_map": {"wte.weight": "../a.safetensors"}})"),
              HasSubstr("is \"../a.safetensors\", not the name of a file beside the index"));
  EXPECT_THAT(sharded("absent", R"({"weight_map": {"wte.weight": "b.safetensors"}})"),
              HasSubstr("b.safetensors\": cannot read"));
  Json wrong = full;
  wrong["h.9.ln_1.weight"] = "a.safetensors";
  EXPECT_THAT(sharded("notheld", Json{{"weight_map", wrong}}.dump()),
              HasSubstr("maps 'h.9.ln_1.weight' to"));
  Json partial = full;
  partial.erase("wpe.weight");
  EXPECT_THAT(sharded("unlisted", Json{{"weight_map", partial}}.dump()),
              HasSubstr("holds 'wpe.weight', which the index does not list"));
  Json moved = full;
  moved["wpe.weight"] = "b.safetensors";
  EXPECT_THAT(sharded("moved", Json{{"weight_map", moved}}.dump(), [&](const fs::path& d) {
                io::write_safetensors(d / "b.safetensors", {*find(f.tensors, "wpe.weight")});
              }),
              HasSubstr("holds 'wpe.weight', which the index maps to \"b.safetensors\""));
}

TEST_F(HfCheckpoint, ALayoutOfAnotherModelIsABug) {
  const config::ModelConfig m = tiny_gpt2(true);
  const fs::path d = gpt2_dir("gpt2", m);
  config::ModelConfig longer = m;
  longer.seq_len = 8;  // models::Transformer's wpe then has 8 rows; config.json's 16
  longer.max_positions = 16;
  nn::ParamLayout layout;
  layout.add("", {{"wte", tensor::Shape{24, 8}}, {"wpe", tensor::Shape{8, 8}}});
  EXPECT_THAT(error_of<InvalidArgument>([&] { io::read_hf_weights(d, longer, layout); }),
              HasSubstr("porter's layout has 'wpe' (8, 8), config.json's model (16, 8)"));
  nn::ParamLayout other;
  other.add("", {{"embed_tokens.weight", tensor::Shape{24, 8}}});
  EXPECT_THAT(error_of<InvalidArgument>([&] { io::read_hf_weights(d, m, other); }),
              HasSubstr("parameter 'embed_tokens.weight' that the GPT2LMHeadModel name map does not know"));
}

// ---- config.json -------------------------------------------------------------------------

TEST_F(HfCheckpoint, Gpt2ConfigGivesPorterModelKeysWithTransformersDefaults) {
  const fs::path d = model_dir("cfg", {{"model_type", "gpt2"}, {"n_layer", 3}}, {});
  const io::HfConfig c = io::read_hf_config(d);
  EXPECT_EQ(c.arch, config::ModelType::kGpt);
  EXPECT_EQ(c.max_positions, 1024);
  EXPECT_EQ(c.model_keys, (nlohmann::ordered_json{{"arch", "gpt"}, {"layers", 3}, {"hidden", 768},
                                                  {"heads", 12}, {"vocab", 50257},
                                                  {"tie_embeddings", true}, {"kv_heads", 12},
                                                  {"intermediate", 3072}, {"norm_eps", 1e-5},
                                                  {"max_positions", 1024}}));
}

TEST_F(HfCheckpoint, LlamaConfigGivesPorterModelKeys) {
  const fs::path d = model_dir("llama", {{"model_type", "llama"}, {"hidden_size", 64},
                                         {"intermediate_size", 176}, {"num_hidden_layers", 2},
                                         {"num_attention_heads", 4}, {"num_key_value_heads", 2},
                                         {"rms_norm_eps", 1e-6}, {"rope_theta", 500000.0},
                                         {"vocab_size", 100}, {"max_position_embeddings", 256},
                                         {"hidden_act", "silu"}, {"rope_scaling", nullptr},
                                         {"attention_bias", false}, {"head_dim", 16}},
                               {});
  const io::HfConfig c = io::read_hf_config(d);
  EXPECT_EQ(c.arch, config::ModelType::kLlama);
  EXPECT_EQ(c.max_positions, 256);
  EXPECT_EQ(c.model_keys, (nlohmann::ordered_json{{"arch", "llama"}, {"layers", 2}, {"hidden", 64},
                                                  {"heads", 4}, {"vocab", 100},
                                                  {"tie_embeddings", false}, {"kv_heads", 2},
                                                  {"intermediate", 176}, {"norm_eps", 1e-6},
                                                  {"rope_theta", 500000.0},
                                                  {"max_positions", 256}}));
  // num_key_value_heads defaults to the heads.
  const fs::path mha = model_dir("mha", {{"model_type", "llama"}, {"num_attention_heads", 8}}, {});
  EXPECT_EQ(io::read_hf_config(mha).model_keys["kv_heads"], 8);
}

TEST_F(HfCheckpoint, ConfigJsonRefusalsNameTheFileKeyAndRule) {
  auto error = [&](const std::string& name, const Json& j) {
    return error_of<IoError>([&] { io::read_hf_config(model_dir(name, j, {})); });
  };
  EXPECT_THAT(error_of<IoError>([&] { io::read_hf_config(dir_ / "nothing"); }),
              HasSubstr("nothing/config.json\": cannot read"));
  fs::create_directories(dir_ / "bare");
  EXPECT_THAT(error_of<IoError>([&] { io::read_hf_config(dir_ / "bare"); }),
              HasSubstr("names a directory without a config.json"));
  {
    fs::create_directories(dir_ / "text");
    std::ofstream(dir_ / "text" / "config.json") << "{\"n_layer\": ";
    EXPECT_THAT(error_of<IoError>([&] { io::read_hf_config(dir_ / "text"); }), HasSubstr("not valid JSON"));
  }
  EXPECT_THAT(error("notype", {{"n_layer", 2}}), HasSubstr("model_type: missing; porter reads \"gpt2\""));
  EXPECT_THAT(error("mistral", {{"model_type", "mistral"}}),
              HasSubstr("config.json\": model_type: \"mistral\": porter reads \"gpt2\" "
                        "(GPT2LMHeadModel), \"llama\" (LlamaForCausalLM) and \"qwen2\" "
                        "(Qwen2ForCausalLM) models only"));
  EXPECT_THAT(error("sliding", {{"model_type", "qwen2"}, {"use_sliding_window", true}}),
              HasSubstr("use_sliding_window: true: porter's attention is fully causal"));
  EXPECT_THAT(error("layers", {{"model_type", "gpt2"}, {"n_layer", 2.5}}),
              HasSubstr("n_layer: 2.5 is not a positive integer"));
  EXPECT_THAT(error("zero", {{"model_type", "gpt2"}, {"n_head", 0}}),
              HasSubstr("n_head: 0 is not a positive integer"));
  EXPECT_THAT(error("inner", {{"model_type", "gpt2"}, {"n_embd", 16}, {"n_inner", 48}}),
              HasSubstr("n_inner: 48: porter's GPT MLP is 4 x n_embd = 64 wide"));
  EXPECT_THAT(error("gelu", {{"model_type", "gpt2"}, {"activation_function", "gelu"}}),
              HasSubstr("activation_function: \"gelu\": porter's GPT computes the tanh form"));
  EXPECT_THAT(error("scale", {{"model_type", "gpt2"}, {"scale_attn_by_inverse_layer_idx", true}}),
              HasSubstr("scale_attn_by_inverse_layer_idx: true"));
  EXPECT_THAT(error("eps", {{"model_type", "gpt2"}, {"layer_norm_epsilon", -1}}),
              HasSubstr("layer_norm_epsilon: -1 is not a positive number"));
  EXPECT_THAT(error("act", {{"model_type", "llama"}, {"hidden_act", "gelu"}}),
              HasSubstr("hidden_act: \"gelu\": porter's Llama MLP computes SiLU"));
  EXPECT_THAT(error("rope", {{"model_type", "llama"}, {"rope_scaling", {{"rope_type", "llama3"}, {"factor", 8.0}}}}),
              HasSubstr("rope_scaling: {\"factor\":8.0,\"rope_type\":\"llama3\"}: porter's rotary "
                        "embedding has no scaling"));
  EXPECT_THAT(error("abias", {{"model_type", "llama"}, {"attention_bias", true}}),
              HasSubstr("attention_bias: true: porter's Llama projections have no bias"));
  EXPECT_THAT(error("mbias", {{"model_type", "llama"}, {"mlp_bias", true}}),
              HasSubstr("mlp_bias: true: porter's Llama MLP has no bias"));
  EXPECT_THAT(error("headdim", {{"model_type", "llama"}, {"hidden_size", 64}, {"num_attention_heads", 4},
                                {"head_dim", 32}}),
              HasSubstr("head_dim: 32: porter's heads are hidden_size / num_attention_heads = 16 wide"));
  EXPECT_THAT(error("tie", {{"model_type", "llama"}, {"tie_word_embeddings", "yes"}}),
              HasSubstr("tie_word_embeddings: \"yes\" is not true or false"));
}

TEST_F(HfCheckpoint, UserKeysThatContradictConfigJsonAreErrorsNamingBoth) {
  const config::ModelConfig m = tiny_gpt2(true);
  const io::HfConfig hf = io::read_hf_config(model_dir("gpt2", gpt2_config(m), {}));
  auto error = [&](const Json& user) {
    return error_of<config::ConfigError>([&] { io::hf_model_overrides(hf, user); });
  };
  EXPECT_THAT(error({{"layers", 12}}),
              HasSubstr("porter.model.layers: 12 contradicts the model porter.model.from names: \"" +
                        hf.path.string() + "\" has n_layer 2 (porter.model.layers 2)"));
  EXPECT_THAT(error({{"arch", "llama"}}),
              HasSubstr("porter.model.arch: \"llama\" contradicts the model porter.model.from "
                        "names: \"" + hf.path.string() + "\" has model_type \"gpt2\" "
                        "(porter.model.arch \"gpt\")"));
  EXPECT_THAT(error({{"type", "llama"}}), HasSubstr("porter.model.type: \"llama\" contradicts"));
  EXPECT_THAT(error({{"tie_embeddings", false}}),
              HasSubstr("has tie_word_embeddings true (porter.model.tie_embeddings true)"));
  EXPECT_THAT(error({{"norm_eps", 1e-6}}), HasSubstr("has layer_norm_epsilon 1e-05"));
  EXPECT_THAT(error({{"intermediate", 16}}), HasSubstr("has 4 x n_embd = 32"));
  EXPECT_THAT(error({{"seq_len", 17}}),
              HasSubstr("porter.model.seq_len: 17 is longer than the model porter.model.from "
                        "names was made for: \"" + hf.path.string() + "\" has n_positions 16"));

  // Equal values, and the defaults that mean them, are fine; training keys stay the user's.
  const nlohmann::ordered_json ok = io::hf_model_overrides(
      hf, {{"type", "gpt"}, {"layers", 2}, {"hidden", 8}, {"norm_eps", 1e-5}, {"kv_heads", 0},
           {"intermediate", 0}, {"seq_len", 8}, {"dropout", 0.1}, {"tensor_parallel", 2}});
  EXPECT_EQ(ok["type"], "gpt");
  EXPECT_FALSE(ok.contains("arch"));
  EXPECT_EQ(ok["max_positions"], 16);
  EXPECT_FALSE(ok.contains("seq_len"));
  EXPECT_FALSE(ok.contains("dropout"));
  EXPECT_FALSE(ok.contains("tensor_parallel"));
  // No seq_len given, and porter's default 1024 is more than the 16 positions: 16.
  EXPECT_EQ(io::hf_model_overrides(hf, nullptr)["seq_len"], 16);
  EXPECT_EQ(io::hf_model_overrides(hf, nullptr)["arch"], "gpt");
}

TEST_F(HfCheckpoint, UserKeysApplyThroughTheConfigParser) {
  // The overrides give the same config as the keys written by hand.
  const config::ModelConfig m = tiny_gpt2(false);
  const io::HfConfig hf = io::read_hf_config(model_dir("gpt2", gpt2_config(m), {}));
  Json user = {{"from", (dir_ / "gpt2").string()}, {"seq_len", 12}};
  Json model = user;
  const nlohmann::ordered_json overrides = io::hf_model_overrides(hf, user);
  for (const auto& [k, v] : overrides.items()) model[k] = v;
  const config::Config c =
      config::parse_config_string(
          Json{{"train_micro_batch_size_per_gpu", 1}, {"porter", {{"model", model}}}}.dump())
          .config;
  EXPECT_EQ(c.porter.model.layers, 2);
  EXPECT_EQ(c.porter.model.hidden, 8);
  EXPECT_EQ(c.porter.model.vocab, 24);
  EXPECT_EQ(c.porter.model.seq_len, 12);
  EXPECT_EQ(c.porter.model.max_positions, 16);
  EXPECT_FALSE(c.porter.model.tie_embeddings);
  EXPECT_EQ(c.porter.model.from, (dir_ / "gpt2").string());

  // io::hf_model_config gives the same model from a ModelConfig built in code.
  config::ModelConfig base;
  base.seq_len = 12;
  base.dropout = 0.25;
  config::ModelConfig direct = io::hf_model_config(hf, base);
  EXPECT_EQ(direct.dropout, 0.25);
  direct.dropout = c.porter.model.dropout;
  EXPECT_EQ(direct, c.porter.model);
  base.seq_len = 17;
  EXPECT_THAT(error_of<InvalidArgument>([&] { io::hf_model_config(hf, base); }),
              HasSubstr("porter.model.seq_len 17 is longer than the 16 positions of"));
}

// ---- Llama -------------------------------------------------------------------------------

config::ModelConfig tiny_llama(bool tied) {
  config::ModelConfig m;
  m.type = config::ModelType::kLlama;
  m.layers = 2;
  m.hidden = 16;
  m.heads = 4;
  m.kv_heads = 2;
  m.intermediate = 40;
  m.seq_len = 32;
  m.vocab = 50;
  m.norm_eps = 1e-6;
  m.rope_theta = 500000.0;
  m.tie_embeddings = tied;
  return m;
}

// The Llama layout written out here: porter names = Hugging Face names without "model.".
std::vector<Expected> llama_expected(const config::ModelConfig& m) {
  const int64_t c = m.hidden, d = m.hidden / m.heads, kv = m.kv_heads, f = m.intermediate;
  std::vector<Expected> e = {{"embed_tokens.weight", "model.embed_tokens.weight", {m.vocab, c}, false}};
  for (int l = 0; l < m.layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    for (const Expected& x : std::vector<Expected>{
             {p + "input_layernorm.weight", "", {c}, false},
             {p + "self_attn.q_proj.weight", "", {m.heads * d, c}, false},
             {p + "self_attn.k_proj.weight", "", {kv * d, c}, false},
             {p + "self_attn.v_proj.weight", "", {kv * d, c}, false},
             {p + "self_attn.o_proj.weight", "", {c, m.heads * d}, false},
             {p + "post_attention_layernorm.weight", "", {c}, false},
             {p + "mlp.gate_proj.weight", "", {f, c}, false},
             {p + "mlp.up_proj.weight", "", {f, c}, false},
             {p + "mlp.down_proj.weight", "", {c, f}, false}}) {
      e.push_back({x.porter, "model." + x.porter, x.shape, false});
    }
  }
  e.push_back({"norm.weight", "model.norm.weight", {c}, false});
  if (!m.tie_embeddings) e.push_back({"lm_head.weight", "lm_head.weight", {m.vocab, c}, false});
  return e;
}

nn::ParamLayout layout_of(const std::vector<Expected>& expected) {
  nn::ParamLayout layout;
  std::vector<nn::ParamSpec> specs;
  for (const Expected& e : expected) specs.push_back({e.porter, tensor::Shape(e.shape)});
  layout.add("", specs);
  return layout;
}

TEST(HfLlamaMap, NamesAndShapesAreHuggingFacesWithGroupedQueryAttention) {
  for (const bool tied : {false, true}) {
    const config::ModelConfig m = tiny_llama(tied);
    const std::vector<io::HfParam> map = io::hf_param_map(m);
    const std::vector<Expected> want = llama_expected(m);
    ASSERT_EQ(map.size(), want.size());
    for (size_t i = 0; i < map.size(); ++i) {
      EXPECT_EQ(map[i].porter_name, want[i].porter) << i;
      EXPECT_EQ(map[i].hf_name, want[i].hf) << i;
      EXPECT_EQ(map[i].shape, want[i].shape) << want[i].porter;
      EXPECT_FALSE(map[i].transposed) << want[i].porter;  // q/k copied as they are
    }
  }
  // k_proj and v_proj are Hkv * D = 2 * 4 rows; q_proj H * D = 16.
  const std::vector<io::HfParam> map = io::hf_param_map(tiny_llama(false));
  EXPECT_EQ(map[3].hf_name, "model.layers.0.self_attn.k_proj.weight");
  EXPECT_EQ(map[3].shape, (std::vector<int64_t>{8, 16}));
  EXPECT_EQ(map[2].shape, (std::vector<int64_t>{16, 16}));
  // kv_heads 0 means the heads.
  config::ModelConfig mha = tiny_llama(false);
  mha.kv_heads = 0;
  EXPECT_EQ(io::hf_param_map(mha)[3].shape, (std::vector<int64_t>{16, 16}));
  // intermediate 0 means the width rule's, as the model itself is built (a config that gives
  // only the hidden size can be exported with --save-hf).
  config::ModelConfig derived = tiny_llama(false);
  derived.intermediate = 0;
  const std::vector<io::HfParam> dmap = io::hf_param_map(derived);
  const nn::ParamLayout built = models::build_model(derived)->layout();
  ASSERT_EQ(dmap.size(), built.entries().size());
  for (size_t i = 0; i < dmap.size(); ++i) {
    EXPECT_EQ(dmap[i].porter_name, built.entries()[i].name) << i;
    EXPECT_EQ(tensor::Shape(dmap[i].shape).numel(), built.entries()[i].shape.numel())
        << dmap[i].hf_name;
  }
}

TEST_F(HfCheckpoint, LlamaImportsIntoItsLayoutAndRoundTrips) {
  for (const std::string prefix : {"model.", ""}) {
    SCOPED_TRACE(prefix);
    const config::ModelConfig m = tiny_llama(false);
    const std::vector<Expected> expected = llama_expected(m);
    const nn::ParamLayout layout = layout_of(expected);
    std::map<std::string, std::vector<float>> values;
    std::vector<io::WeightTensor> tensors;
    for (const Expected& e : expected) {
      values[e.porter] = pattern(e.porter, numel(e.shape));
      const std::string name = e.hf == "lm_head.weight" ? e.hf : prefix + e.porter;
      tensors.push_back({name, e.shape, tensor::DType::kBF16, encode(values[e.porter], tensor::DType::kBF16)});
    }
    for (int l = 0; l < m.layers; ++l) {
      tensors.push_back({prefix + "layers." + std::to_string(l) + ".self_attn.rotary_emb.inv_freq",
                         {2}, tensor::DType::kF32, encode({1.0f, 0.5f}, tensor::DType::kF32)});
    }
    const Json config = {{"model_type", "llama"}, {"hidden_size", 16}, {"intermediate_size", 40},
                         {"num_hidden_layers", 2}, {"num_attention_heads", 4},
                         {"num_key_value_heads", 2}, {"vocab_size", 50}, {"rms_norm_eps", 1e-6},
                         {"rope_theta", 500000.0}, {"max_position_embeddings", 4096},
                         {"bos_token_id", 1}, {"eos_token_id", 2}};
    const fs::path src = model_dir("llama" + prefix, config, tensors);
    const io::HfWeights w = io::read_hf_weights(src, m, layout);
    expect_layout_values(layout, w.values, values);
    EXPECT_EQ(w.skipped, 2);

    const io::HfConfig read = io::read_hf_config(src);
    const fs::path out = dir_ / ("llama-out" + prefix);
    io::write_hf_checkpoint(out, m, layout, w.values, tensor::DType::kBF16, read.json);
    const io::HfWeights back = io::read_hf_weights(out, m, layout);
    EXPECT_EQ(std::memcmp(back.values.data(), w.values.data(), w.values.size() * 4), 0);
    std::vector<std::string> names;
    for (const io::WeightTensor& t : io::read_safetensors(out / "model.safetensors")) names.push_back(t.name);
    EXPECT_EQ(names.front(), "model.embed_tokens.weight");
    EXPECT_EQ(names.back(), "lm_head.weight");
    const io::HfConfig again = io::read_hf_config(out);
    EXPECT_EQ(again.model_keys, read.model_keys);
    EXPECT_EQ(again.json["architectures"], Json::array({"LlamaForCausalLM"}));
    EXPECT_EQ(again.json["torch_dtype"], "bfloat16");
    // Carried over from the source: the positions (at least seq_len) and the token ids.
    EXPECT_EQ(again.json["max_position_embeddings"], 4096);
    EXPECT_EQ(again.json["bos_token_id"], 1);
    EXPECT_EQ(again.json["eos_token_id"], 2);
    EXPECT_TRUE(again.json["rope_scaling"].is_null());
  }
  // Without a source the positions are seq_len.
  EXPECT_EQ(io::hf_config_json(tiny_llama(true), tensor::DType::kF32)["max_position_embeddings"], 32);
  EXPECT_EQ(io::hf_config_json(tiny_llama(true), tensor::DType::kF32)["tie_word_embeddings"], true);
}

TEST_F(HfCheckpoint, LlamaBuffersAndTiedHead) {
  const config::ModelConfig m = tiny_llama(true);
  const std::vector<Expected> expected = llama_expected(m);
  std::vector<io::WeightTensor> tensors;
  for (const Expected& e : expected) {
    tensors.push_back({e.hf, e.shape, tensor::DType::kF32, encode(pattern(e.porter, numel(e.shape)), tensor::DType::kF32)});
  }
  tensors.push_back({"model.rotary_emb.inv_freq", {2}, tensor::DType::kF32, encode({1.0f, 0.5f}, tensor::DType::kF32)});
  tensors.push_back({"model.layers.0.mlp.gate_proj.bias", {40}, tensor::DType::kF32,
                     encode(std::vector<float>(40, 0.0f), tensor::DType::kF32)});
  const fs::path d = model_dir("llama-bias", {{"model_type", "llama"}}, tensors);
  EXPECT_THAT(error_of<IoError>([&] { io::read_hf_weights(d, m, layout_of(expected)); }),
              HasSubstr("1 tensor(s) porter does not know: model.layers.0.mlp.gate_proj.bias"));
}

}  // namespace
}  // namespace porter::engine
