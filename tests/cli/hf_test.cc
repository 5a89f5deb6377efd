// porter.model.from and `porter train --save-hf` through the command line: config.json applied
// to config check, estimate and train (contradictions naming both sources), the weights
// loaded instead of the init, and the trained model written back in Hugging Face's layout,
// bitwise the input after no step on one rank, on 2 x 2 launched ranks at ZeRO stage 3 and
// on 2 ranks reading their shards of a checkpoint sharded over two files.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli/app.h"
#include "io/hf_checkpoint.h"
#include "io/weights_file.h"
#include "models/transformer.h"
#include "io/npy.h"
#include "tests/cli/cli_test_util.h"

namespace porter::cli {
namespace {

using ::testing::HasSubstr;
using testing::CliRun;
using testing::porter;
namespace fs = std::filesystem;
using Json = nlohmann::json;

// A 2-layer GPT-2 of hidden 32, 2 heads, 16 positions and vocab 64, untied.
config::ModelConfig tiny_model() {
  config::ModelConfig m;
  m.layers = 2;
  m.hidden = 32;
  m.heads = 2;
  m.seq_len = 16;
  m.max_positions = 16;
  m.vocab = 64;
  m.tie_embeddings = false;
  return m;
}

class CliHf : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("porter_cli_hf_" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    // The model: porter's init at another seed, written as a Hugging Face directory.
    const config::ModelConfig m = tiny_model();
    const models::Transformer gpt(m);
    values_ = gpt.init_values(7);
    model_ = dir_ / "gpt2-tiny";
    io::write_hf_checkpoint(model_, m, gpt.layout(), values_, tensor::DType::kF32);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string config(const std::string& model_keys, const std::string& extra = "") {
    const fs::path p = dir_ / "run.json";
    std::ofstream(p) << R"({
      "train_micro_batch_size_per_gpu": 2,
      "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},)" << extra << R"(
      "porter": {
        "model": {"from": ")" << model_.string() << "\"" << model_keys << R"(},
        "data": {"type": "synthetic", "seed": 3},
        "device": {"type": "cpu", "memory_limit": "64MiB", "threads": 1},
        "comm": {"timeout_s": 30},
        "train": {"steps": 2}
      }
    })";
    return p.string();
  }
  // The tensors of a written directory as f32, in its order.
  static std::vector<io::WeightTensor> tensors(const fs::path& d) {
    return io::read_safetensors(d / "model.safetensors");
  }

  fs::path dir_, model_;
  std::vector<float> values_;
};

TEST_F(CliHf, ConfigCheckAndEstimateSeeConfigJsonsModel) {
  CliRun r = porter({"config", "check", config(""), "--json"});
  ASSERT_EQ(r.rc, kExitOk) << r.err;
  const Json j = Json::parse(r.out.substr(r.out.find('{')));
  const Json& m = j["porter"]["model"];
  EXPECT_EQ(m["layers"], 2);
  EXPECT_EQ(m["hidden"], 32);
  EXPECT_EQ(m["vocab"], 64);
  EXPECT_EQ(m["tie_embeddings"], false);
  EXPECT_EQ(m["max_positions"], 16);
  EXPECT_EQ(m["seq_len"], 16);  // porter's default 1024 is more than the 16 positions
  EXPECT_EQ(m["from"], model_.string());
  CliRun e = porter({"estimate", "--config", config("")});
  EXPECT_EQ(e.rc, kExitOk) << e.err;
}

TEST_F(CliHf, ContradictionsNameTheUsersSourceAndConfigJson) {
  const std::string cfg = config(R"(, "layers": 3)");
  CliRun r = porter({"train", "--config", cfg});
  EXPECT_EQ(r.rc, kExitInvalid);
  EXPECT_THAT(r.err, HasSubstr(cfg + ": porter.model.layers: 3 contradicts the model "
                               "porter.model.from names: \"" + (model_ / "config.json").string() +
                               "\" has n_layer 2"));
  CliRun s = porter({"config", "check", config(""), "--set", "porter.model.seq_len=32"});
  EXPECT_EQ(s.rc, kExitInvalid);
  EXPECT_THAT(s.err, HasSubstr("--set porter.model.seq_len: porter.model.seq_len: 32 is longer "
                               "than the model porter.model.from names was made for"));
  // A rule the parser checks on config.json's keys names the config.json.
  Json c = Json::parse(std::ifstream(model_ / "config.json"));
  c["n_head"] = 3;
  std::ofstream(model_ / "config.json") << c.dump();
  CliRun t = porter({"config", "check", config("")});
  EXPECT_EQ(t.rc, kExitInvalid);
  EXPECT_THAT(t.err, HasSubstr((model_ / "config.json").string() + ": porter.model.hidden: 32 is "
                               "not divisible by heads 3"));
  CliRun u = porter({"config", "check", config(""), "--set", "porter.model.from=" + (dir_ / "nope").string()});
  EXPECT_EQ(u.rc, kExitInvalid);
  EXPECT_THAT(u.err, HasSubstr("--set porter.model.from: porter.model.from: \"" +
                               (dir_ / "nope" / "config.json").string() + "\": cannot read"));
}

TEST_F(CliHf, TrainStartsFromTheWeightsAndSaveHfWritesThemBack) {
  const fs::path dump = dir_ / "dump";
  const fs::path out = dir_ / "out";
  CliRun r = porter({"train", "--config", config(""), "--steps", "1", "--dump-dir", dump.string()});
  ASSERT_EQ(r.rc, kExitOk) << r.err;
  EXPECT_THAT(r.out, HasSubstr("  weights: " + model_.string() + " (Hugging Face, 29 tensors in 1 "
                               "file, F32, "));
  // The first step started from the model's values, not from the init of porter.train.seed.
  const models::Transformer gpt(tiny_model());
  for (const nn::ParamEntry& e : gpt.layout().entries()) {
    const io::NpyArray a = io::read_npy((dump / "params" / (e.name + ".npy")).string());
    ASSERT_EQ(a.data.size(), static_cast<size_t>(e.shape.numel()) * 4) << e.name;
    EXPECT_EQ(std::memcmp(a.data.data(), values_.data() + e.offset_elems, a.data.size()), 0) << e.name;
  }

  // No step: the written model is the one read, bitwise.
  CliRun s = porter({"train", "--config", config(""), "--steps", "0", "--save-hf", out.string()});
  ASSERT_EQ(s.rc, kExitOk) << s.err;
  EXPECT_THAT(s.out, HasSubstr("saved Hugging Face model: " + out.string() + " (step 0; config.json, "
                               "model.safetensors: 29 tensors, "));
  const std::vector<io::WeightTensor> in = tensors(model_), back = tensors(out);
  ASSERT_EQ(back.size(), in.size());
  for (size_t i = 0; i < in.size(); ++i) {
    EXPECT_EQ(back[i].name, in[i].name);
    EXPECT_EQ(back[i].bytes, in[i].bytes) << in[i].name;
  }
  EXPECT_EQ(io::read_hf_config(out).model_keys, io::read_hf_config(model_).model_keys);
}

TEST_F(CliHf, Bf16RunsWriteBf16AndResumeKeepsTheCheckpointsWeights) {
  const fs::path out = dir_ / "out";
  const fs::path ckpt = dir_ / "ckpt";
  const std::string cfg = config("", R"("bf16": {"enabled": true},)");
  CliRun r = porter({"train", "--config", cfg, "--save", ckpt.string(), "--save-hf", out.string()});
  ASSERT_EQ(r.rc, kExitOk) << r.err;
  EXPECT_THAT(r.out, HasSubstr("parameters, bf16, "));
  const std::vector<io::WeightTensor> back = tensors(out);
  for (const io::WeightTensor& t : back) EXPECT_EQ(t.dtype, tensor::DType::kBF16) << t.name;
  EXPECT_EQ(io::read_hf_config(out).json["torch_dtype"], "bfloat16");
  // Trained: not the values it started from.
  EXPECT_NE(io::read_hf_weights(out, tiny_model()).values, values_);

  CliRun s = porter({"train", "--config", cfg, "--resume", ckpt.string(), "--steps", "3"});
  ASSERT_EQ(s.rc, kExitOk) << s.err;
  EXPECT_THAT(s.out, HasSubstr("  weights: from --resume " + ckpt.string() + " (" + model_.string() +
                               " gave the model's shape)"));
}

// 4 ranks = 2 data-parallel x 2 tensor-parallel at ZeRO stage 3: every rank loads its part,
// and the whole model is gathered back: bitwise the input after no step, and after two steps
// the one-rank run's model up to the order of the partial sums.
TEST_F(CliHf, TensorParallelZero3RanksLoadAndGatherTheWholeModel) {
  const std::string extra = R"("train_batch_size": 4, "gradient_accumulation_steps": 1,
      "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},)";
  const std::string tp = config(R"(, "tensor_parallel": 2)", extra);
  const fs::path none = dir_ / "none";
  CliRun r = porter({"launch", "-n", "4", "--", PORTER_EXE, "train", "--config", tp, "--steps", "0",
                     "--save-hf", none.string()});
  ASSERT_EQ(r.rc, kExitOk) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("[rank 0] saved Hugging Face model: " + none.string()));
  const std::vector<io::WeightTensor> in = tensors(model_), back = tensors(none);
  ASSERT_EQ(back.size(), in.size());
  for (size_t i = 0; i < in.size(); ++i) EXPECT_EQ(back[i].bytes, in[i].bytes) << in[i].name;

  const fs::path trained = dir_ / "trained";
  CliRun s = porter({"launch", "-n", "4", "--", PORTER_EXE, "train", "--config", tp, "--steps", "2",
                     "--save-hf", trained.string()});
  ASSERT_EQ(s.rc, kExitOk) << s.out << s.err;
  const std::string one = config("", R"("train_batch_size": 4, "gradient_accumulation_steps": 2,)");
  const fs::path single = dir_ / "single";
  CliRun t = porter({"train", "--config", one, "--steps", "2", "--save-hf", single.string()});
  ASSERT_EQ(t.rc, kExitOk) << t.err;
  const std::vector<float> a = io::read_hf_weights(trained, tiny_model()).values;
  const std::vector<float> b = io::read_hf_weights(single, tiny_model()).values;
  ASSERT_EQ(a.size(), b.size());
  double max_diff = 0, max_step = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    max_diff = std::max(max_diff, static_cast<double>(std::fabs(a[i] - b[i])));
    max_step = std::max(max_step, static_cast<double>(std::fabs(b[i] - values_[i])));
  }
  EXPECT_GT(max_step, 1e-4);  // it trained
  EXPECT_LT(max_diff, 1e-5) << "largest step " << max_step;
}

// A checkpoint sharded over two files with model.safetensors.index.json, loaded by 2 launched
// ranks at ZeRO stage 3, each reading only its shard of the model from the files (Note
// [Sharded loading] in io/hf_checkpoint.h): the header counts both files, and the model
// gathered back after no step is the input, bitwise.
TEST_F(CliHf, Zero3RanksReadTheirShardsOfAnIndexedCheckpoint) {
  io::WeightMetadata meta;
  const std::vector<io::WeightTensor> all = io::read_safetensors(model_ / "model.safetensors", &meta);
  const size_t half = all.size() / 2;
  Json index;
  std::vector<io::WeightTensor> part;
  for (size_t i = 0; i < all.size(); ++i) {
    const std::string file = i < half ? "model-00001-of-00002.safetensors"
                                      : "model-00002-of-00002.safetensors";
    index["weight_map"][all[i].name] = file;
    part.push_back(all[i]);
    if (i + 1 == half || i + 1 == all.size()) {
      io::write_safetensors(model_ / file, part, meta);
      part.clear();
    }
  }
  std::ofstream(model_ / "model.safetensors.index.json") << index.dump();
  fs::remove(model_ / "model.safetensors");

  const std::string extra = R"("train_batch_size": 4, "gradient_accumulation_steps": 1,
      "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},)";
  const fs::path out = dir_ / "out";
  CliRun r = porter({"launch", "-n", "2", "--", PORTER_EXE, "train", "--config", config("", extra),
                     "--steps", "0", "--save-hf", out.string()});
  ASSERT_EQ(r.rc, kExitOk) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("  weights: " + model_.string() + " (Hugging Face, 29 tensors in 2 "
                               "files, F32, "));
  const std::vector<io::WeightTensor> back = tensors(out);
  ASSERT_EQ(back.size(), all.size());
  for (size_t i = 0; i < all.size(); ++i) {
    EXPECT_EQ(back[i].name, all[i].name);
    EXPECT_EQ(back[i].bytes, all[i].bytes) << all[i].name;
  }
}

}  // namespace
}  // namespace porter::cli
