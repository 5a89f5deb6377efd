// porter plan from the config alone (Note [Forecast] in engine/forecast.h): a 7B run planned
// without its GPUs and without allocating the model, the verdict, --fit's configurations
// (the first trained to check it fits as predicted), and porter train's preflight.
#include <sys/resource.h>

#include <filesystem>
#include <fstream>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "cli/app.h"
#include "cli_test_util.h"

namespace porter::cli {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using namespace porter::cli::testing;

const char* kConfig = R"({
  "train_micro_batch_size_per_gpu": 8,
  "gradient_accumulation_steps": 1,
  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
  "porter": {
    "model": {"layers": 3, "hidden": 64, "heads": 4, "seq_len": 64, "vocab": 128,
              "attention": "materialized"},
    "data": {"type": "synthetic", "seed": 3},
    "device": {"type": "cpu", "memory_limit": "64MiB", "threads": 1},
    "checkpointing": {"policy": "none"},
    "train": {"steps": 2, "log_every": 1}
  }
})";

class CliPlan : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("porter_cli_plan_" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string write(const std::string& name, const std::string& text) {
    const fs::path p = dir_ / name;
    std::ofstream(p) << text;
    return p.string();
  }
  fs::path dir_;
};

long max_rss_kib() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_maxrss;
}

// The 7B Llama at ZeRO stage 3 on 8 H100s: planned here, where there is no GPU, from the
// analytic model: nothing model-sized is allocated (one rank's unsharded states alone would
// be 110 GiB, its shard 14 GiB).
std::string seven_b() { return std::string(PORTER_SOURCE_DIR) + "/examples/llama-7b-zero3.json"; }

TEST_F(CliPlan, PlansASevenBillionLlamaOnEightGpusWithoutThem) {
  const long before = max_rss_kib();
  CliRun r = porter({"plan", "--config", seven_b(), "--json"});
  const long after = max_rss_kib();
  ASSERT_EQ(r.rc, kExitOk) << r.err;
  EXPECT_LT(after - before, 512L * 1024) << "peak RSS grew by " << (after - before) << " KiB";
  const json j = json::parse(r.out);
  EXPECT_EQ(j["world_size"], 8);
  EXPECT_EQ(j["zero_stage"], 3);
  EXPECT_EQ(j["costs"], "device model h100-sxm");
  const json& m = j["memory"];
  EXPECT_EQ(m["capacity_bytes"].get<size_t>(), size_t{80} << 30);
  EXPECT_EQ(m["fits"], true);
  EXPECT_EQ(m["total_peak_bytes"].get<size_t>(),
            m["model_state_bytes"].get<size_t>() + m["batch_bytes"].get<size_t>() +
                m["step_peak_bytes"].get<size_t>());
  EXPECT_GT(m["comm_peak_bytes"].get<size_t>(), size_t{1} << 30);  // reduce_bucket_size 5e8
  EXPECT_GT(m["gathered_params_peak_bytes"].get<size_t>(), 0u);
  const json& t = j["step_time"];
  EXPECT_GT(t["total_s"].get<double>(), 0.0);
  EXPECT_GT(t["mfu"].get<double>(), 0.0);
  EXPECT_LE(t["mfu"].get<double>(), 1.0);

  CliRun text = porter({"plan", "--config", seven_b(), "--world-size", "1", "--set", "train_batch_size=4"});
  ASSERT_EQ(text.rc, kExitOk) << text.err;
  EXPECT_TRUE(contains(text.out, "world: 1 rank = 1 data-parallel x 1 tensor-parallel")) << text.out;
  EXPECT_TRUE(contains(text.out, "verdict: does not fit: needs ")) << text.out;
  EXPECT_TRUE(contains(text.out, "predicted step time on h100-sxm")) << text.out;
}

// A cuda config without porter.device.model plans for an H100 SXM and says so.
TEST_F(CliPlan, ACudaConfigWithoutADeviceModelPlansForTheDefaultGpu) {
  CliRun r = porter({"plan", "--config", seven_b(), "--set",
                     "porter.device={\"type\": \"cuda\"}", "--set", "porter.model.layers=4"});
  ASSERT_EQ(r.rc, kExitOk) << r.err;
  EXPECT_TRUE(contains(r.out, "porter.device.model is not set, so a cuda run is planned for h100-sxm"))
      << r.out;
}

// --fit on a config that does not fit lists configurations that do; the first, merged into
// the config, trains and its measured total peak is the forecast one.
TEST_F(CliPlan, FitFindsConfigurationsThatTrainWithinTheDevice) {
  const std::string cfg = write("config.json", kConfig);
  CliRun given = porter({"plan", "--config", cfg, "--json"});
  ASSERT_EQ(given.rc, kExitOk) << given.err;
  const size_t need = json::parse(given.out)["memory"]["total_peak_bytes"].get<size_t>();
  const std::string limit = "porter.device.memory_limit=" + std::to_string(need * 3 / 4);
  CliRun check = porter({"plan", "--config", cfg, "--set", limit, "--json"});
  ASSERT_EQ(check.rc, kExitOk) << check.err;
  ASSERT_EQ(json::parse(check.out)["memory"]["fits"], false);

  CliRun fit = porter({"plan", "--fit", "--config", cfg, "--set", limit, "--json"});
  ASSERT_EQ(fit.rc, kExitOk) << fit.err;
  const json f = json::parse(fit.out);
  ASSERT_FALSE(f["candidates"].empty()) << fit.out;
  const json& best = f["candidates"][0];
  EXPECT_LE(best["total_peak_bytes"].get<size_t>(), need * 3 / 4);
  EXPECT_EQ(f["largest"].size(), 4u);

  const std::string fragment = write("fit.json", best["config"].dump());
  const std::string report = (dir_ / "report.json").string();
  CliRun train = porter({"train", "--config", cfg, "--config", fragment, "--set", limit,
                         "--steps", "2", "--report", report});
  ASSERT_EQ(train.rc, kExitOk) << train.err;
  std::ifstream in(report);
  const json rep = json::parse(in);
  const json& mem = rep["memory"];
  EXPECT_EQ(mem["peak_bytes"], mem["predicted_peak_bytes"]);
  EXPECT_LE(mem["peak_bytes"].get<size_t>(), need * 3 / 4);
  EXPECT_EQ(mem["predicted_peak_bytes"], best["total_peak_bytes"]) << best.dump();

  CliRun text = porter({"plan", "--fit", "--config", cfg, "--set", limit, "--top", "3"});
  ASSERT_EQ(text.rc, kExitOk) << text.err;
  EXPECT_TRUE(contains(text.out, "the first as a config fragment")) << text.out;
  EXPECT_TRUE(contains(text.out, "the largest that fit")) << text.out;
}

// porter train refuses a run whose forecast exceeds the device before allocating anything,
// naming the verdict and --fit; --no-preflight starts it (and it runs out of memory).
TEST_F(CliPlan, TrainRefusesBeforeStepOneWhatCannotFit) {
  const std::string cfg = write("config.json", kConfig);
  const std::string limit = "porter.device.memory_limit=\"2MiB\"";
  CliRun r = porter({"train", "--config", cfg, "--set", limit});
  EXPECT_EQ(r.rc, kExitOom);
  EXPECT_TRUE(contains(r.err, "before step 1 (preflight): ")) << r.err;
  EXPECT_TRUE(contains(r.err, "does not fit: needs ")) << r.err;
  EXPECT_TRUE(contains(r.err, "than the 2.00 MiB device")) << r.err;
  EXPECT_TRUE(contains(r.err, "porter plan --fit --config ")) << r.err;
  CliRun skip = porter({"train", "--config", cfg, "--set", limit, "--no-preflight"});
  EXPECT_EQ(skip.rc, kExitOom);
  EXPECT_FALSE(contains(skip.err, "before step 1 (preflight): ")) << skip.err;
}

}  // namespace
}  // namespace porter::cli
