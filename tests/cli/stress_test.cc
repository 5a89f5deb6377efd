// `porter stress`: the draws (a pure function of seed and run, always a valid config, covering
// every knob), the limit margin, a short fixed-seed stress in-process, a failure report with
// its reproduction command, and the exit codes.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli/app.h"
#include "tests/cli/cli_test_util.h"
#include "cli/stress.h"
#include "config/parse.h"

namespace porter::cli {
namespace {

using testing::contains;
using testing::CliRun;
using testing::porter;

namespace fs = std::filesystem;
using nlohmann::json;

// A small GPT the draws scale down from; one micro-batch of 4 x 32 tokens.
const char* kBase = R"({
  "train_micro_batch_size_per_gpu": 4,
  "gradient_accumulation_steps": 2,
  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
  "porter": {
    "model": {"layers": 3, "hidden": 64, "heads": 4, "seq_len": 32, "vocab": 64},
    "data": {"type": "synthetic", "seed": 5},
    "device": {"type": "cpu", "memory_limit": "64MiB", "threads": 1},
    "checkpointing": {"policy": "uniform", "every_n_layers": 1},
    "train": {"steps": 3}
  }
})";

config::Config base_config(const std::string& text = kBase) {
  return config::parse_config_string(text).config;
}

class CliStress : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("porter_cli_stress_" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  std::string config(const std::string& text) {
    const fs::path p = dir_ / "config.json";
    std::ofstream(p) << text;
    return p.string();
  }
  fs::path dir_;
};

TEST(StressDraw, IsAPureFunctionOfSeedAndRun) {
  const config::Config base = base_config();
  const Variation a = draw_variation(base, 11, 5);
  const Variation b = draw_variation(base, 11, 5);
  EXPECT_EQ(a.config, b.config);
  EXPECT_EQ(a.label, b.label);
  // Another run or another seed draws something else (over a few, at least one differs).
  int differ = 0;
  for (int64_t r = 0; r < 4; ++r) {
    differ += !(draw_variation(base, 11, r).config == draw_variation(base, 12, r).config);
  }
  EXPECT_GT(differ, 0);
}

TEST(StressDraw, EveryDrawIsValidAndSmallAndEveryKnobVaries) {
  const config::Config base = base_config();
  std::set<config::CheckpointPolicy> policies;
  std::set<int64_t> depths;
  std::set<bool> offload, contiguous;
  int below = 0;
  for (int64_t r = 0; r < 200; ++r) {
    const Variation v = draw_variation(base, 3, r);  // throws for a config porter rejects
    const config::Config& c = v.config;
    const config::ModelConfig& m = c.porter.model;
    EXPECT_GE(m.layers, 1);
    EXPECT_LE(m.layers, 3);
    EXPECT_EQ(m.hidden % m.heads, 0) << v.label;
    EXPECT_LE(m.hidden, 64);
    EXPECT_LE(m.seq_len, 32);
    EXPECT_LE(c.train_micro_batch_size_per_gpu, 4);
    EXPECT_EQ(c.porter.data.type, config::DataType::kSynthetic);
    EXPECT_FALSE(c.porter.device.memory_limit_bytes.has_value());
    policies.insert(c.porter.checkpointing.policy);
    depths.insert(c.porter.checkpointing.prefetch_depth);
    ASSERT_TRUE(c.activation_checkpointing.has_value());
    offload.insert(c.activation_checkpointing->cpu_checkpointing);
    contiguous.insert(c.activation_checkpointing->contiguous_memory_optimization);
    below += v.check_below;
    EXPECT_EQ(v.check_below, r % kBelowEvery == kBelowEvery - 1);
  }
  EXPECT_EQ(policies.size(), 7u);
  EXPECT_EQ(depths, (std::set<int64_t>{0, 1, 2, 3}));
  EXPECT_EQ(offload.size(), 2u);
  EXPECT_EQ(contiguous.size(), 2u);
  EXPECT_EQ(below, 50);
}

TEST(StressDraw, LimitIsThePredictionPlusTheMargin) {
  EXPECT_EQ(limit_margin(0), kMarginBytes);
  EXPECT_EQ(limit_margin(size_t{100} << 20),
            (size_t{100} << 20) + kMarginBytes +
                static_cast<size_t>(kMarginFraction * static_cast<double>(size_t{100} << 20)));
}

TEST_F(CliStress, AShortFixedSeedStressPasses) {
  CliRun r = porter({"stress", "--config", config(kBase), "--runs", "4", "--seed", "7", "--json"});
  ASSERT_EQ(r.rc, kExitOk) << r.out << r.err;
  json j = json::parse(r.out);
  EXPECT_EQ(j["passed"], 4);
  EXPECT_EQ(j["failed"], 0);
  EXPECT_TRUE(j["failures"].empty());
  ASSERT_EQ(j["results"].size(), 4u);
  for (const json& run : j["results"]) {
    EXPECT_LE(run["measured_peak_bytes"].get<size_t>(), run["limit_bytes"].get<size_t>());
    EXPECT_LE(run["reserved_peak_bytes"].get<size_t>(), run["limit_bytes"].get<size_t>());
    EXPECT_GT(run["measured_peak_bytes"].get<size_t>(), 0u);
  }
  // Run 3 also ran below its measured peak, and ran out of memory there.
  EXPECT_EQ(j["below_peak_checks"], 1);
  EXPECT_EQ(j["below_peak_out_of_memory"], 1);
  EXPECT_TRUE(contains(j["results"][3]["below_outcome"].get<std::string>(), "out of memory"));
  EXPECT_TRUE(j["worst_total_peak_error"]["error"].is_number());
  // One progress line per run on stderr.
  for (const char* line : {"run 0 (1/4)", "run 3 (4/4)"}) EXPECT_TRUE(contains(r.err, line)) << r.err;

  // The text summary of the same runs.
  CliRun text = porter({"stress", "--config", config(kBase), "--runs", "2", "--seed", "7"});
  ASSERT_EQ(text.rc, kExitOk) << text.out << text.err;
  EXPECT_TRUE(contains(text.out, "passed")) << text.out;
  EXPECT_TRUE(contains(text.out, "worst total peak error")) << text.out;
  EXPECT_FALSE(contains(text.out, "failures")) << text.out;
}

TEST_F(CliStress, AFailingRunIsReportedWithItsReproduction) {
  // A pinned limit of one page: every run that offloads more than a page cannot start.
  std::string text = kBase;
  const std::string device = "\"memory_limit\": \"64MiB\"";
  text.replace(text.find(device), device.size(), device + ", \"pinned_limit\": 4096");
  const std::string cfg = config(text);
  CliRun r = porter({"stress", "--config", cfg, "--runs", "12", "--seed", "7", "--json"});
  ASSERT_EQ(r.rc, kExitChecksFailed) << r.out << r.err;
  json j = json::parse(r.out);
  ASSERT_GT(j["failed"].get<int>(), 0);
  const json& f = j["failures"][0];
  EXPECT_TRUE(contains(f["variation"].get<std::string>(), "offload")) << f;
  EXPECT_TRUE(contains(f["reasons"][0].get<std::string>(), "pinned_limit")) << f;
  const std::string run = std::to_string(f["run"].get<int>());
  EXPECT_EQ(f["repro"], "porter stress --config " + cfg + " --seed 7 --first " + run +
                            " --runs 1 --steps 3");
  // The reproduction fails the same way, alone.
  CliRun again = porter({"stress", "--config", cfg, "--seed", "7", "--first", run, "--runs", "1"});
  EXPECT_EQ(again.rc, kExitChecksFailed);
  EXPECT_TRUE(contains(again.out, "reproduce: porter stress")) << again.out;
  EXPECT_TRUE(contains(again.out, "pinned_limit")) << again.out;
}

TEST_F(CliStress, InvalidInputExitsTwo) {
  const std::string cfg = config(kBase);
  CliRun runs = porter({"stress", "--config", cfg, "--runs", "0"});
  EXPECT_EQ(runs.rc, kExitInvalid);
  EXPECT_TRUE(contains(runs.err, "--runs: expected at least 1")) << runs.err;
  EXPECT_EQ(porter({"stress", "--config", cfg, "--steps", "0"}).rc, kExitInvalid);
  EXPECT_EQ(porter({"stress", "--config", (dir_ / "nope.json").string()}).rc, kExitInvalid);
  EXPECT_EQ(porter({"stress"}).rc, kExitUsage);
}

}  // namespace
}  // namespace porter::cli
