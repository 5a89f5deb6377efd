// Note [Checked sizes] where users meet it: `porter estimate` and `porter plan` refuse a shape
// whose byte counts overflow (exit 2, the keys named) instead of printing a wrapped figure,
// and answer a 100,000-layer model with every fixed policy.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <string>

#include <nlohmann/json.hpp>

#include "cli/app.h"
#include "tests/cli/cli_test_util.h"

namespace porter::cli {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using testing::porter;

// examples/gpt-tiny-zero2.json's run without its data: a byte-level GPT on 2 ranks, ZeRO
// stage 2, offloaded checkpoints, a simulated 80 MiB device.
nlohmann::json tiny_zero2(const std::string& policy) {
  return {{"train_micro_batch_size_per_gpu", 16},
          {"gradient_accumulation_steps", 1},
          {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 3e-3}}}}},
          {"zero_optimization", {{"stage", 2}, {"reduce_bucket_size", 200000}}},
          {"activation_checkpointing", {{"cpu_checkpointing", true}}},
          {"porter",
           {{"model", {{"layers", 4}, {"hidden", 128}, {"heads", 4}, {"seq_len", 128}, {"vocab", 256}}},
            {"data", {{"type", "synthetic"}, {"seed", 1}}},
            {"device", {{"type", "cpu"}, {"memory_limit", "80MiB"}, {"sim_link_gbps", 12}, {"threads", 1}}},
            {"checkpointing", {{"policy", policy}}},
            {"train", {{"steps", 1}}}}}};
}

class EstimateSizesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path(::testing::TempDir()) /
           ("porter_estimate_sizes_" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string write(const std::string& name, const nlohmann::json& j) {
    const fs::path p = dir_ / name;
    std::ofstream(p) << j.dump(2);
    return p.string();
  }
  fs::path dir_;
};

// seq_len 2^24 and 2^16 heads: the attention probabilities of one block are 2^66 bytes (with
// the materialised attention asked for; auto would take flash attention, which keeps none).
TEST_F(EstimateSizesTest, OverflowingShapeIsAnInvalidConfigNamingTheKeys) {
  nlohmann::json c = tiny_zero2("full");
  c["porter"]["model"]["attention"] = "materialized";
  c["porter"]["model"]["seq_len"] = 16777216;
  c["porter"]["model"]["heads"] = 65536;
  c["porter"]["model"]["hidden"] = 65536;
  const std::string config = write("huge.json", c);
  for (const char* command : {"estimate", "plan"}) {
    const testing::CliRun r = porter({command, "--config", config});
    EXPECT_EQ(r.rc, kExitInvalid) << command << "\n" << r.out << r.err;
    EXPECT_THAT(r.err, HasSubstr("porter.model.seq_len 16777216 x porter.model.seq_len 16777216")) << command;
    EXPECT_THAT(r.err, HasSubstr("porter.model.heads / tensor_parallel 65536")) << command;
    EXPECT_THAT(r.err, HasSubstr("overflows 64-bit byte counts")) << command;
    EXPECT_THAT(r.out, ::testing::Not(HasSubstr("PiB"))) << command;
  }
  // Through --set over a config that fits: 100,000 layers (the parser's most) whose tensors
  // all fit (a block's probabilities are 16 x 512 x 65536^2 x 4 = 2^47 bytes) but whose chain
  // does not.
  const std::string ok = write("ok.json", tiny_zero2("full"));
  const testing::CliRun layers = porter({"estimate", "--config", ok, "--set", "porter.model.layers=100000",
                                         "--set", "porter.model.seq_len=65536", "--set", "porter.model.hidden=65536",
                                         "--set", "porter.model.heads=512",
                                         "--set", "porter.model.attention=materialized"});
  EXPECT_EQ(layers.rc, kExitInvalid) << layers.out << layers.err;
  EXPECT_THAT(layers.err, HasSubstr("porter.model.layers 100000 x one block's"));
  EXPECT_THAT(layers.err, HasSubstr("porter.model.seq_len 65536"));
  EXPECT_THAT(layers.err, HasSubstr("overflows 64-bit byte counts"));
}

// 100,000 layers: every fixed policy answers (the replay and the plans are linear in the
// stages), and the figures hang together.
TEST_F(EstimateSizesTest, HundredThousandLayersAnswerEveryFixedPolicy) {
  nlohmann::json c = tiny_zero2("full");
  c["porter"]["model"]["layers"] = 100000;
  const testing::CliRun r = porter({"estimate", "--json", "--config", write("deep.json", c)});
  ASSERT_EQ(r.rc, kExitOk) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["model"]["layers"], 100000);
  std::map<std::string, size_t> peak;
  for (const nlohmann::json& p : j["policies"]) {
    ASSERT_FALSE(p.contains("error")) << p.dump();
    peak[p["policy"].get<std::string>()] = p["activation_peak_bytes"].get<size_t>();
  }
  for (const char* policy : {"none", "full", "uniform", "block", "sqrt", "selective"}) {
    ASSERT_TRUE(peak.count(policy)) << policy;
  }
  // The tensor-parallel table plans none and full at t = 1 with the same costs.
  const nlohmann::json& t1 = j["tensor_parallel"]["table"][0];
  ASSERT_EQ(t1["t"], 1);
  EXPECT_EQ(t1["none_activation_peak_bytes"].get<size_t>(), peak["none"]);
  EXPECT_EQ(t1["full_activation_peak_bytes"].get<size_t>(), peak["full"]);
  // none keeps 100,000 blocks' tapes; every other policy holds less, and at least one
  // block's input.
  const size_t layer = t1["layer_bytes"].get<size_t>();
  EXPECT_GE(peak["none"], 100000 * layer);
  for (const auto& [policy, bytes] : peak) {
    if (policy != "none") EXPECT_LT(bytes, peak["none"]) << policy;
    EXPECT_GT(bytes, 0u) << policy;
  }
}

}  // namespace
}  // namespace porter::cli
