// `porter train`, `porter plan` and `porter estimate` run in-process on a tiny GPT: the report,
// trace and dump files, the JSON outputs, and the exit codes of bad configs and out-of-memory.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "models/analytic.h"
#include "checkpoint/planner.h"
#include "checkpoint/simulate.h"
#include "cli/app.h"
#include "memory/category.h"
#include "tests/cli/cli_test_util.h"
#include "models/transformer.h"
#include "io/npy.h"
#include "zero/partition.h"

namespace porter::cli {
namespace {

using testing::contains;
using testing::CliRun;
using testing::porter;

namespace fs = std::filesystem;
using nlohmann::json;

json read_json(const fs::path& p) {
  std::ifstream in(p);
  return json::parse(in);
}

// A 2-layer GPT with 2 micro-batches per step and uniform checkpoints, so that every kind of
// span (forward, recompute, backward, optimizer) appears.
const char* kTinyConfig = R"({
  "train_micro_batch_size_per_gpu": 2,
  "gradient_accumulation_steps": 2,
  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
  "porter": {
    "model": {"layers": 2, "hidden": 32, "heads": 2, "seq_len": 16, "vocab": 64},
    "data": {"type": "synthetic", "seed": 3},
    "device": {"type": "cpu", "memory_limit": "64MiB", "threads": 1},
    "checkpointing": {"policy": "uniform", "every_n_layers": 1},
    "train": {"steps": 3, "log_every": 2}
  }
})";

class CliTrain : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("porter_cli_train_" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  std::string config(const std::string& text, const std::string& name = "config.json") {
    const fs::path p = dir_ / name;
    std::ofstream(p) << text;
    return p.string();
  }
  // The tiny config with one replacement applied.
  std::string tiny(const std::string& from = "", const std::string& to = "") {
    std::string text = kTinyConfig;
    if (!from.empty()) {
      size_t at = text.find(from);
      EXPECT_NE(at, std::string::npos) << from;
      text.replace(at, from.size(), to);
    }
    return config(text);
  }
  fs::path dir_;
};

TEST_F(CliTrain, ReportHasEveryField) {
  const std::string report = (dir_ / "report.json").string();
  CliRun r = porter({"train", "--config", tiny(), "--report", report});
  ASSERT_EQ(r.rc, kExitOk) << r.err;
  // Not a terminal: one plain line every log_every (2) steps and on the last step.
  EXPECT_TRUE(contains(r.err, "step 2/3  loss ")) << r.err;
  EXPECT_TRUE(contains(r.err, "step 3/3  loss ")) << r.err;
  EXPECT_FALSE(contains(r.err, "step 1/3")) << r.err;
  EXPECT_FALSE(contains(r.err, "\r")) << r.err;
  EXPECT_TRUE(contains(r.out, "summary")) << r.out;
  EXPECT_TRUE(contains(r.out, "activation peak")) << r.out;

  json j = read_json(report);
  EXPECT_EQ(j["steps"], 3);
  ASSERT_EQ(j["losses"].size(), 3u);
  EXPECT_EQ(j["final_loss"], j["losses"][2]);
  EXPECT_EQ(j["first_loss"], j["losses"][0]);
  EXPECT_DOUBLE_EQ(j["final_loss_mean_last_10"].get<double>(),
                   (j["losses"][0].get<double>() + j["losses"][1].get<double>() +
                    j["losses"][2].get<double>()) / 3);
  EXPECT_NEAR(j["losses"][0].get<double>(), std::log(64.0), 0.3);
  EXPECT_EQ(j["tokens_per_step"], 2 * 2 * 16);
  EXPECT_GT(j["tokens_per_s"].get<double>(), 0.0);
  for (const char* k : {"median", "min", "max"}) EXPECT_GT(j["step_time_s"][k].get<double>(), 0.0) << k;
  EXPECT_LE(j["step_time_s"]["min"].get<double>(), j["step_time_s"]["median"].get<double>());
  EXPECT_LE(j["step_time_s"]["median"].get<double>(), j["step_time_s"]["max"].get<double>());

  const json& mem = j["memory"];
  EXPECT_EQ(mem["capacity_bytes"], 64u << 20);
  std::set<std::string> cats;
  for (auto it = mem["peak_by_category"].begin(); it != mem["peak_by_category"].end(); ++it) cats.insert(it.key());
  EXPECT_EQ(cats, (std::set<std::string>{"params", "grads", "optimizer", "activations", "checkpoints",
                                         "staging", "workspace", "comm"}));
  EXPECT_GT(mem["peak_by_category"]["params"].get<size_t>(), 0u);
  EXPECT_EQ(mem["peak_by_category"]["params"], mem["peak_by_category"]["grads"]);
  EXPECT_GT(mem["peak_by_category"]["checkpoints"].get<size_t>(), 0u);  // uniform holds inputs
  EXPECT_GE(mem["peak_bytes"].get<size_t>(), mem["model_state_bytes"].get<size_t>());
  EXPECT_GT(mem["predicted_peak_bytes"].get<size_t>(), 0u);
  EXPECT_GT(mem["activation_peak_bytes"].get<size_t>(), 0u);
  EXPECT_GT(mem["predicted_activation_peak_bytes"].get<size_t>(), 0u);

  const json& plan = j["plan"];
  EXPECT_EQ(plan["policy"], "uniform");
  ASSERT_EQ(plan["stages"].size(), 4u);  // embedding, 2 blocks, head
  EXPECT_EQ(plan["stages"][0]["name"], "embedding");
  EXPECT_EQ(plan["stages"][1]["action"], "checkpoint");
  EXPECT_EQ(plan["stages"][1]["holds_input"], true);
  EXPECT_EQ(plan["stages"][1]["where"], "device");
  EXPECT_TRUE(plan["predicted_recompute_s"].is_number());
  EXPECT_GT(plan["measured_recompute_s"].get<double>(), 0.0);
}

// The tiny config with checkpoints offloaded to pinned host memory over a simulated link, and
// the per-checkpoint records on.
std::string offload_text() {
  std::string text = kTinyConfig;
  const std::string device = "\"threads\": 1}";
  text.replace(text.find(device), device.size(), "\"threads\": 1, \"sim_link_gbps\": 2}");
  const std::string head = "\"gradient_accumulation_steps\": 2,";
  text.replace(text.find(head), head.size(),
               head + R"( "activation_checkpointing": {"cpu_checkpointing": true, "profile": true},)");
  return text;
}

TEST_F(CliTrain, OffloadShowsInTheReportSummaryAndTrace) {
  const std::string report = (dir_ / "report.json").string();
  const fs::path trace = dir_ / "trace.json";
  CliRun r = porter({"train", "--config", config(offload_text()), "--report", report, "--trace",
                     trace.string()});
  ASSERT_EQ(r.rc, kExitOk) << r.err;
  EXPECT_TRUE(contains(r.out, "\noffload: ")) << r.out;
  EXPECT_TRUE(contains(r.out, " hidden); pinned peak ")) << r.out;

  json j = read_json(report);
  const json& o = j["offload"];
  EXPECT_EQ(o["enabled"], true);
  // uniform every 1 layer, keep_last_on_device 1: block.0's input goes to the host, block.1's
  // stays; 3 steps of 2 micro-batches each copy it out and back.
  const json& p = o["predicted"];
  EXPECT_EQ(p["checkpoints"], 1);
  EXPECT_GT(o["d2h_bytes"].get<size_t>(), 0u);
  EXPECT_EQ(o["d2h_bytes"].get<size_t>(), 3 * p["d2h_bytes_per_step"].get<size_t>());
  EXPECT_EQ(o["h2d_bytes"].get<size_t>(), 3 * p["h2d_bytes_per_step"].get<size_t>());
  EXPECT_EQ(p["d2h_bytes_per_step"].get<size_t>(), 2 * p["offloaded_bytes_per_micro_batch"].get<size_t>());
  EXPECT_GT(o["copy_busy_s"].get<double>(), 0.0);
  EXPECT_GE(o["exposed_wait_s"].get<double>(), 0.0);
  EXPECT_LE(o["hidden_fraction"].get<double>(), 1.0);
  EXPECT_GT(o["pinned_peak_bytes"].get<size_t>(), 0u);
  EXPECT_GE(j["memory"]["pinned_peak_bytes"].get<size_t>(), o["pinned_peak_bytes"].get<size_t>());
  EXPECT_DOUBLE_EQ(o["link_bytes_per_s"].get<double>(), 2e9);
  EXPECT_EQ(p["timed"], true);  // profiled costs and a known link
  EXPECT_TRUE(p["exposed_s_per_step"].is_number());
  // profile: the last step's copies, one each way per micro-batch, and the compute waits.
  ASSERT_TRUE(o["copies"].is_array());
  std::set<std::string> dirs;
  for (const json& c : o["copies"]) {
    dirs.insert(c["direction"].get<std::string>());
    EXPECT_EQ(c["stage"], 1);
    EXPECT_EQ(c["bytes"], p["offloaded_bytes_per_micro_batch"]);
  }
  EXPECT_EQ(dirs, (std::set<std::string>{"d2h", "h2d"}));
  EXPECT_FALSE(o["waits"].empty());
  const json& stages = j["plan"]["stages"];
  EXPECT_EQ(stages[1]["where"], "host");
  EXPECT_EQ(stages[1]["offloaded_bytes"], p["offloaded_bytes_per_micro_batch"]);
  EXPECT_EQ(stages[2]["where"], "device");
  EXPECT_EQ(stages[2]["offloaded_bytes"], 0);

  // The trace has spans on the d2h and h2d lanes.
  json t = read_json(trace);
  std::map<int, std::string> lanes;
  for (const json& e : t["traceEvents"]) {
    if (e["ph"] == "M" && e["name"] == "thread_name") lanes[e["tid"]] = e["args"]["name"];
  }
  std::map<std::string, int> spans;
  for (const json& e : t["traceEvents"]) {
    if (e["ph"] == "X") ++spans[lanes[e["tid"].get<int>()]];
  }
  EXPECT_GT(spans["d2h"], 0);
  EXPECT_GT(spans["h2d"], 0);
  EXPECT_GT(spans["compute"], 0);
}

TEST_F(CliTrain, WithoutOffloadTheSectionIsZero) {
  const std::string report = (dir_ / "report.json").string();
  ASSERT_EQ(porter({"train", "--config", tiny(), "--report", report, "--steps", "1"}).rc, kExitOk);
  const json o = read_json(report)["offload"];
  EXPECT_EQ(o["enabled"], false);
  EXPECT_EQ(o["d2h_bytes"], 0);
  EXPECT_EQ(o["h2d_bytes"], 0);
  EXPECT_EQ(o["hidden_fraction"], 1.0);
  EXPECT_FALSE(o.contains("copies"));
}

TEST_F(CliTrain, PlanShowsOffload) {
  const std::string cfg = config(offload_text());
  CliRun r = porter({"plan", "--config", cfg, "--json", "--profile"});
  ASSERT_EQ(r.rc, kExitOk) << r.err;
  json j = json::parse(r.out);
  EXPECT_EQ(j["costs"], "profiled");  // --profile: offload plans from measured times
  EXPECT_EQ(j["stages"][1]["where"], "host");
  EXPECT_GT(j["stages"][1]["offloaded_bytes"].get<size_t>(), 0u);
  EXPECT_TRUE(j["stages"][1]["exposed_copy_s"].is_number());
  EXPECT_EQ(j["stages"][2]["where"], "device");
  const json& o = j["offload"];
  EXPECT_EQ(o["enabled"], true);
  EXPECT_EQ(o["checkpoints"], 1);
  EXPECT_EQ(o["offloaded_bytes"], j["stages"][1]["offloaded_bytes"]);
  EXPECT_GE(o["pinned_bytes"].get<size_t>(), o["offloaded_bytes"].get<size_t>());
  EXPECT_EQ(o["pinned_bytes"].get<size_t>() % 4096, 0u);
  EXPECT_GT(o["staging_peak_bytes"].get<size_t>(), 0u);
  EXPECT_EQ(o["prefetch_depth"], 1);
  EXPECT_DOUBLE_EQ(o["link_bytes_per_s"].get<double>(), 2e9);
  EXPECT_EQ(o["timed"], true);
  EXPECT_TRUE(o["hidden_fraction"].is_number());

  CliRun text = porter({"plan", "--config", cfg});
  ASSERT_EQ(text.rc, kExitOk) << text.err;
  EXPECT_TRUE(contains(text.out, "exposed copy")) << text.out;
  EXPECT_TRUE(contains(text.out, "  offload: 1 checkpoint, ")) << text.out;
  EXPECT_TRUE(contains(text.out, "prefetch depth 1")) << text.out;
  EXPECT_TRUE(contains(text.out, "predicted copies: ")) << text.out;

  // Without offload: no offload column, an empty section.
  CliRun plain = porter({"plan", "--config", tiny(), "--json"});
  ASSERT_EQ(plain.rc, kExitOk) << plain.err;
  json pj = json::parse(plain.out);
  EXPECT_EQ(pj["offload"]["enabled"], false);
  EXPECT_EQ(pj["stages"][1]["offloaded_bytes"], 0);
  EXPECT_TRUE(pj["stages"][1]["exposed_copy_s"].is_null());
}

TEST_F(CliTrain, OnATerminalProgressIsOneUpdatingLine) {
  CliRun r = porter({"train", "--config", tiny()}, /*tty=*/true);
  ASSERT_EQ(r.rc, kExitOk) << r.err;
  // One \r-rewritten line per step (log_every does not apply), erased to its end, ended by a
  // newline after the last step.
  for (const char* step : {"] step 1/3  loss ", "] step 2/3  loss ", "] step 3/3  loss "}) {
    EXPECT_TRUE(contains(r.err, step)) << r.err;
  }
  EXPECT_TRUE(contains(r.err, "\r[")) << r.err;
  EXPECT_TRUE(contains(r.err, " tok/s  ETA ")) << r.err;
  EXPECT_TRUE(contains(r.err, "\033[K\n")) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
}

TEST_F(CliTrain, TraceHasEverySpanKindAndAMemoryCounter) {
  const fs::path trace = dir_ / "trace.json";
  CliRun r = porter({"train", "--config", tiny(), "--trace", trace.string(), "--steps", "2"});
  ASSERT_EQ(r.rc, kExitOk) << r.err;
  json j = read_json(trace);
  std::set<std::string> cats;
  int counters = 0;
  for (const json& e : j["traceEvents"]) {
    if (e["ph"] == "X") cats.insert(e["cat"].get<std::string>());
    if (e["ph"] == "C" && e["name"] == "memory") ++counters;
  }
  for (const char* c : {"forward", "recompute", "backward", "optimizer"}) {
    EXPECT_TRUE(cats.count(c)) << c;
  }
  EXPECT_GT(counters, 0);
}

TEST_F(CliTrain, DumpDirHasTheLastStepsTensors) {
  const fs::path dump = dir_ / "dump";
  CliRun r = porter({"train", "--config", tiny(), "--dump-dir", dump.string()});
  ASSERT_EQ(r.rc, kExitOk) << r.err;
  json m = read_json(dump / "manifest.json");
  EXPECT_EQ(m["step"], 2);
  EXPECT_EQ(m["dtype"], "float32");
  EXPECT_TRUE(m["loss"].is_number());
  ASSERT_FALSE(m["names"].empty());
  EXPECT_EQ(m["names"][0], "wte");
  for (const json& t : m["tensors"]) {
    const std::string name = t["name"];
    for (const char* kind : {"params", "grads"}) {
      io::NpyArray a = io::read_npy((dump / kind / (name + ".npy")).string());
      EXPECT_EQ(a.dtype, tensor::DType::kF32) << name;
      EXPECT_EQ(a.shape, t["shape"].get<std::vector<int64_t>>()) << name;
    }
  }
  io::NpyArray qkv = io::read_npy((dump / "params" / "h.0.qkv.weight.npy").string());
  EXPECT_EQ(qkv.shape, (std::vector<int64_t>{96, 32}));
  io::NpyArray wte = io::read_npy((dump / "grads" / "wte.npy").string());
  EXPECT_EQ(wte.shape, (std::vector<int64_t>{64, 32}));
  for (int mb = 0; mb < 2; ++mb) {
    for (const char* kind : {"tokens", "targets"}) {
      io::NpyArray b = io::read_npy((dump / "batch" / (std::string(kind) + "_" + std::to_string(mb) + ".npy")).string());
      EXPECT_EQ(b.dtype, tensor::DType::kI32);
      EXPECT_EQ(b.shape, (std::vector<int64_t>{2, 16}));
    }
  }
  EXPECT_FALSE(fs::exists(dump / "batch" / "tokens_2.npy"));
}

TEST_F(CliTrain, SaveAndResumeContinueTheRun) {
  const fs::path ckpt = dir_ / "ckpt";
  const std::string cfg = tiny();
  ASSERT_EQ(porter({"train", "--config", cfg, "--steps", "2", "--save", ckpt.string()}).rc, kExitOk);
  const std::string report = (dir_ / "resumed.json").string();
  CliRun r = porter({"train", "--config", cfg, "--resume", ckpt.string(), "--report", report});
  ASSERT_EQ(r.rc, kExitOk) << r.err;
  json j = read_json(report);
  EXPECT_EQ(j["start_step"], 2);
  EXPECT_EQ(j["steps"], 1);
  // The same as an uninterrupted run's third step.
  const std::string full = (dir_ / "full.json").string();
  ASSERT_EQ(porter({"train", "--config", cfg, "--report", full}).rc, kExitOk);
  EXPECT_EQ(j["losses"][0], read_json(full)["losses"][2]);
}

TEST_F(CliTrain, PlanJson) {
  CliRun r = porter({"plan", "--config", tiny(), "--json"});
  ASSERT_EQ(r.rc, kExitOk) << r.err;
  json j = json::parse(r.out);
  EXPECT_EQ(j["policy"], "uniform");
  EXPECT_EQ(j["costs"], "device model cpu");  // analytic bytes, this machine's roofline times
  ASSERT_EQ(j["stages"].size(), 4u);
  EXPECT_EQ(j["stages"][2]["name"], "block.1");
  EXPECT_EQ(j["stages"][2]["forwards"], 2);
  EXPECT_GT(j["predicted_recompute_s"].get<double>(), 0.0);
  EXPECT_EQ(j["memory"]["fits"], true);
  EXPECT_EQ(j["predicted_total_peak_bytes"], j["memory"]["total_peak_bytes"]);
  EXPECT_GT(j["step_time"]["total_s"].get<double>(), 0.0);
  EXPECT_GT(j["recompute_flop_fraction"].get<double>(), 0.0);
  EXPECT_LT(j["predicted_activation_peak_bytes"].get<size_t>(), j["none_activation_peak_bytes"].get<size_t>());

  // A budget plans optimal; --profile from measured costs.
  CliRun opt = porter({"plan", "--config", tiny(), "--budget", "0.9", "--json", "--profile"});
  ASSERT_EQ(opt.rc, kExitOk) << opt.err;
  json o = json::parse(opt.out);
  EXPECT_EQ(o["policy"], "optimal");
  EXPECT_EQ(o["costs"], "profiled");
  EXPECT_TRUE(o["predicted_recompute_s"].is_number());
  EXPECT_LE(o["predicted_activation_peak_bytes"].get<size_t>(), o["budget_bytes"].get<size_t>());

  CliRun text = porter({"plan", "--config", tiny()});
  EXPECT_TRUE(contains(text.out, "holds input")) << text.out;
  EXPECT_TRUE(contains(text.out, "predicted activation peak")) << text.out;
}

TEST_F(CliTrain, EstimateJson) {
  CliRun r = porter({"estimate", "--config", tiny(), "--json"});
  ASSERT_EQ(r.rc, kExitOk) << r.err;
  json j = json::parse(r.out);
  std::vector<std::string> policies;
  for (const json& p : j["policies"]) policies.push_back(p["policy"]);
  EXPECT_EQ(policies, (std::vector<std::string>{"none", "full", "uniform", "block", "sqrt", "selective"}));
  const json& none = j["policies"][0];
  EXPECT_EQ(none["fits"], true);
  EXPECT_EQ(none["params_bytes"], j["model_state_bytes"]["params"]);
  EXPECT_GT(none["activation_peak_bytes"].get<size_t>(), j["policies"][1]["activation_peak_bytes"].get<size_t>());
  EXPECT_EQ(j["capacity_bytes"], 64u << 20);

  // With a budget, optimal appears; with a small device, none no longer fits.
  CliRun b = porter({"estimate", "--config", tiny("\"64MiB\"", "\"600KiB\""), "--budget", "0.9", "--json"});
  ASSERT_EQ(b.rc, kExitOk) << b.err;
  json k = json::parse(b.out);
  EXPECT_EQ(k["policies"].back()["policy"], "optimal");
  EXPECT_EQ(k["policies"][0]["fits"], false);
  EXPECT_EQ(k["policies"][1]["fits"], true);
}

// The ZeRO table: every stage's bytes are porter's exact partition bytes and the paper's
// formula with porter's dtypes, at the requested world size.
TEST_F(CliTrain, EstimateZeroStagesPerRank) {
  for (const bool bf16 : {false, true}) {
    const std::string cfg =
        bf16 ? tiny("\"optimizer\"", "\"bf16\": {\"enabled\": true}, \"optimizer\"")
             : tiny("\"optimizer\"", "\"zero_optimization\": {\"stage\": 2}, \"optimizer\"");
    CliRun r = porter({"estimate", "--config", cfg, "--world-size", "3", "--json"});
    ASSERT_EQ(r.rc, kExitOk) << r.err;
    const json j = json::parse(r.out);
    config::ModelConfig model;
    model.layers = 2;
    model.hidden = 32;
    model.heads = 2;
    model.seq_len = 16;
    model.vocab = 64;
    const models::Transformer gpt(model);
    const zero::Partition part = zero::make_partition(gpt.layout().total_elems(), 3);
    const zero::StateDTypes dtypes{bf16 ? tensor::DType::kBF16 : tensor::DType::kF32};
    EXPECT_EQ(j["world_size"], 3);
    EXPECT_EQ(j["zero"]["num_params"], gpt.layout().num_params());
    EXPECT_EQ(j["zero"]["padded_elems"], part.padded_elems);
    EXPECT_EQ(j["zero"]["shard_elems"], part.shard_elems);
    EXPECT_EQ(j["zero"]["k"], bf16 ? 12 : 8);
    ASSERT_EQ(j["zero"]["stages"].size(), 4u);
    for (int stage = 0; stage <= 3; ++stage) {
      const json& s = j["zero"]["stages"][static_cast<size_t>(stage)];
      const zero::StateBytes exact = zero::exact_bytes(part, stage, dtypes);
      const zero::StateBytes paper = zero::paper_bytes(gpt.layout().num_params(), 3, stage, dtypes);
      EXPECT_EQ(s["stage"], stage);
      EXPECT_EQ(s["exact"]["params"], exact.params) << stage;
      EXPECT_EQ(s["exact"]["grads"], exact.grads) << stage;
      EXPECT_EQ(s["exact"]["optimizer"], exact.optimizer) << stage;
      EXPECT_EQ(s["exact"]["total"], exact.total()) << stage;
      EXPECT_EQ(s["paper"]["total"], paper.total()) << stage;
      EXPECT_EQ(s["padding_bytes"].get<int64_t>(),
                static_cast<int64_t>(exact.total()) - static_cast<int64_t>(paper.total()));
    }
    // The policies use the configured stage's bytes (2, or 0 for the bf16 variant).
    const json& used = j["zero"]["stages"][bf16 ? 0 : 2]["exact"];
    EXPECT_EQ(j["model_state_bytes"], used);
    EXPECT_EQ(j["policies"][0]["optimizer_bytes"], used["optimizer"]);

    CliRun text = porter({"estimate", "--config", cfg, "--world-size", "3"});
    ASSERT_EQ(text.rc, kExitOk) << text.err;
    EXPECT_TRUE(contains(text.out, "ZeRO model states per rank at world size 3")) << text.out;
    const std::string k = bf16 ? "12" : "8", p = bf16 ? "2" : "4";
    EXPECT_TRUE(contains(text.out, "(" + p + "+4+" + k + ") Psi/3")) << text.out;  // stage 3
    EXPECT_TRUE(contains(text.out, p + " Psi + (4+" + k + ") Psi/3")) << text.out;  // stage 2
    EXPECT_TRUE(contains(text.out, "(" + p + "+4) Psi + " + k + " Psi/3")) << text.out;
  }
}

// Without --world-size, a config that states all three batch sizes implies the world size.
TEST_F(CliTrain, EstimateWorldSizeFromTheBatchSizes) {
  CliRun r = porter({"estimate", "--json", "--config",
                     tiny("\"train_micro_batch_size_per_gpu\": 2",
                          "\"train_batch_size\": 8, \"train_micro_batch_size_per_gpu\": 2")});
  ASSERT_EQ(r.rc, kExitOk) << r.err;
  EXPECT_EQ(json::parse(r.out)["world_size"], 2);
  EXPECT_EQ(json::parse(r.out)["zero"]["data_parallel_size"], 2);
  CliRun one = porter({"estimate", "--json", "--config", tiny()});
  ASSERT_EQ(one.rc, kExitOk) << one.err;
  EXPECT_EQ(json::parse(one.out)["world_size"], 1);
  // A world size the batch sizes do not allow is the config's error.
  CliRun bad = porter({"estimate", "--world-size", "3", "--config",
                       tiny("\"train_micro_batch_size_per_gpu\": 2",
                            "\"train_batch_size\": 8, \"train_micro_batch_size_per_gpu\": 2")});
  EXPECT_EQ(bad.rc, kExitInvalid) << bad.err;
}

// The tiny config's model at tensor_parallel t (heads 2: t = 1 or 2).
config::ModelConfig tiny_model(int64_t t = 1, bool sp = false) {
  config::ModelConfig model;
  model.layers = 2;
  model.hidden = 32;
  model.heads = 2;
  model.seq_len = 16;
  model.vocab = 64;
  model.tensor_parallel = t;
  model.sequence_parallel = sp;
  return model;
}

// --tensor-parallel T estimates one rank of a group of T: its part of the layout, its
// activations; the world size the batch sizes imply is T times theirs.
TEST_F(CliTrain, EstimateTensorParallelFlag) {
  CliRun r = porter({"estimate", "--config", tiny(), "--tensor-parallel", "2", "--json"});
  ASSERT_EQ(r.rc, kExitOk) << r.err;
  const json j = json::parse(r.out);
  EXPECT_EQ(j["model"]["tensor_parallel"], 2);
  EXPECT_EQ(j["world_size"], 2);
  EXPECT_EQ(j["zero"]["data_parallel_size"], 1);
  EXPECT_EQ(j["tensor_parallel"]["t"], 2);
  EXPECT_EQ(j["tensor_parallel"]["source"], "--tensor-parallel");
  EXPECT_TRUE(j["tensor_parallel"]["table"].is_null());
  const models::Transformer rank0(tiny_model(2), 0);
  EXPECT_EQ(j["zero"]["num_params"], rank0.layout().num_params());
  const zero::StateBytes states =
      zero::exact_bytes(zero::make_partition(rank0.layout().total_elems(), 1), 0,
                        zero::StateDTypes{tensor::DType::kF32});
  EXPECT_EQ(j["model_state_bytes"]["total"], states.total());
  const models::TransformerShape shape{tiny_model(2), 2, 16, tensor::DType::kF32};
  EXPECT_EQ(j["policies"][0]["activation_peak_bytes"], models::none_peak_bytes(shape));

  CliRun text = porter({"estimate", "--config", tiny(), "--tensor-parallel", "2"});
  ASSERT_EQ(text.rc, kExitOk) << text.err;
  EXPECT_TRUE(contains(text.out, "tensor parallel 2 (--tensor-parallel)")) << text.out;
  EXPECT_TRUE(contains(text.out, "(1 data-parallel rank x 2 tensor-parallel)")) << text.out;
  EXPECT_FALSE(contains(text.out, "tensor parallelism, per rank")) << text.out;  // no t table

  // The flag is checked against the config's rules, and the errors name it.
  CliRun three = porter({"estimate", "--config", tiny(), "--tensor-parallel", "3"});
  EXPECT_EQ(three.rc, kExitInvalid);
  EXPECT_TRUE(contains(three.err, "--tensor-parallel 3: porter.model.tensor_parallel: 3 does not "
                                  "divide heads 2")) << three.err;
  EXPECT_TRUE(contains(three.err, "give --tensor-parallel a divisor of porter.model.heads"))
      << three.err;
  CliRun zero_t = porter({"estimate", "--config", tiny(), "--tensor-parallel", "0"});
  EXPECT_EQ(zero_t.rc, kExitInvalid);
  EXPECT_TRUE(contains(zero_t.err, "--tensor-parallel 0: the ranks of a tensor-parallel group "
                                   "must be >= 1")) << zero_t.err;
  CliRun world = porter({"estimate", "--config", tiny(), "--tensor-parallel", "2",
                         "--world-size", "3"});
  EXPECT_EQ(world.rc, kExitInvalid);
  EXPECT_TRUE(contains(world.err, "--tensor-parallel 2: ")) << world.err;
  EXPECT_TRUE(contains(world.err, "does not divide the world size 3")) << world.err;
}

// Without the flag, a table of per-rank figures for every t dividing heads, beside
// Korthikanti et al.'s formula; the config's row equals the policy table's.
TEST_F(CliTrain, EstimateTensorParallelTable) {
  CliRun r = porter({"estimate", "--config", tiny(), "--json"});
  ASSERT_EQ(r.rc, kExitOk) << r.err;
  const json j = json::parse(r.out);
  EXPECT_EQ(j["tensor_parallel"]["t"], 1);
  EXPECT_EQ(j["tensor_parallel"]["source"], "config");
  const json& table = j["tensor_parallel"]["table"];
  ASSERT_EQ(table.size(), 3u);  // t = 1; t = 2 without and with sequence parallelism
  const std::pair<int64_t, bool> rows[] = {{1, false}, {2, false}, {2, true}};
  for (size_t i = 0; i < 3; ++i) {
    const auto [t, sp] = rows[i];
    const json& row = table[i];
    SCOPED_TRACE("t " + std::to_string(t) + (sp ? " sp" : ""));
    EXPECT_EQ(row["t"], t);
    EXPECT_EQ(row["sequence_parallel"], sp);
    const models::TransformerShape shape{tiny_model(t, sp), 2, 16, tensor::DType::kF32};
    EXPECT_EQ(row["layer_bytes"], models::layer_bytes(shape));
    EXPECT_DOUBLE_EQ(row["korthikanti_layer_bytes"].get<double>(),
                     models::korthikanti_layer_bytes(shape));
    EXPECT_EQ(row["none_activation_peak_bytes"], models::none_peak_bytes(shape));
    const models::Transformer rank0(tiny_model(t, sp), 0);
    EXPECT_EQ(row["model_state_bytes"]["total"],
              zero::exact_bytes(zero::make_partition(rank0.layout().total_elems(), 1), 0,
                                zero::StateDTypes{tensor::DType::kF32})
                  .total());
  }
  EXPECT_EQ(table[0]["none_activation_peak_bytes"], j["policies"][0]["activation_peak_bytes"]);
  EXPECT_EQ(table[0]["full_activation_peak_bytes"], j["policies"][1]["activation_peak_bytes"]);
  EXPECT_EQ(table[0]["model_state_bytes"], j["model_state_bytes"]);
  // Sequence parallelism splits the whole layer over the ranks; without it part is replicated.
  EXPECT_LT(table[2]["layer_bytes"].get<size_t>(), table[1]["layer_bytes"].get<size_t>());

  CliRun text = porter({"estimate", "--config", tiny()});
  ASSERT_EQ(text.rc, kExitOk) << text.err;
  EXPECT_TRUE(contains(text.out, "tensor parallelism, per rank")) << text.out;
  EXPECT_TRUE(contains(text.out, "Korthikanti")) << text.out;
  EXPECT_TRUE(contains(text.out, "1 *")) << text.out;  // the config's row
}

// porter plan at tensor_parallel 2: per-rank costs from the analytic model, or profiled on
// thread ranks of a tp group when the plan needs times.
TEST_F(CliTrain, PlanTensorParallel) {
  const std::string cfg = tiny("\"vocab\": 64", "\"vocab\": 64, \"tensor_parallel\": 2, "
                                                  "\"sequence_parallel\": true");
  CliRun r = porter({"plan", "--config", cfg, "--json"});
  ASSERT_EQ(r.rc, kExitOk) << r.err;
  const json j = json::parse(r.out);
  EXPECT_EQ(j["costs"], "device model cpu");
  EXPECT_EQ(j["tensor_parallel"], 2);
  EXPECT_EQ(j["sequence_parallel"], true);
  const models::TransformerShape shape{tiny_model(2, true), 2, 16, tensor::DType::kF32};
  EXPECT_EQ(j["none_activation_peak_bytes"], models::none_peak_bytes(shape));
  const checkpoint::ChainCosts costs = models::analytic_transformer_costs(shape);
  const checkpoint::Schedule uniform = checkpoint::schedule_uniform(costs, 1);
  EXPECT_EQ(j["predicted_activation_peak_bytes"],
            checkpoint::simulate(uniform, costs).peak_activation_bytes);

  CliRun text = porter({"plan", "--config", cfg});
  ASSERT_EQ(text.rc, kExitOk) << text.err;
  EXPECT_TRUE(contains(text.out, "tensor parallel 2 with sequence parallelism")) << text.out;

  CliRun opt = porter({"plan", "--config", cfg, "--budget", "0.9", "--json", "--profile"});
  ASSERT_EQ(opt.rc, kExitOk) << opt.err;
  const json o = json::parse(opt.out);
  EXPECT_EQ(o["costs"], "profiled");
  EXPECT_EQ(o["none_activation_peak_bytes"], models::none_peak_bytes(shape));
  EXPECT_LE(o["predicted_activation_peak_bytes"].get<size_t>(), o["budget_bytes"].get<size_t>());
}

TEST_F(CliTrain, BadConfigExitsTwo) {
  for (const char* cmd : {"train", "plan", "estimate"}) {
    CliRun r = porter({cmd, "--config", tiny("\"layers\": 2", "\"layers\": \"two\"")});
    EXPECT_EQ(r.rc, kExitInvalid) << cmd;
    EXPECT_TRUE(contains(r.err, "error: ")) << r.err;
    EXPECT_TRUE(contains(r.err, "porter.model.layers")) << r.err;
  }
  CliRun missing = porter({"train", "--config", (dir_ / "nope.json").string()});
  EXPECT_EQ(missing.rc, kExitInvalid);
  CliRun bad_budget = porter({"plan", "--config", tiny(), "--budget", "lots"});
  EXPECT_EQ(bad_budget.rc, kExitInvalid);
  EXPECT_TRUE(contains(bad_budget.err, "--budget: expected a fraction")) << bad_budget.err;
  EXPECT_EQ(porter({"train"}).rc, kExitUsage);
}

TEST_F(CliTrain, TextDataErrorsExitTwo) {
  std::string text = kTinyConfig;
  const std::string synthetic = "\"data\": {\"type\": \"synthetic\", \"seed\": 3}";
  text.replace(text.find(synthetic), synthetic.size(),
               "\"data\": {\"type\": \"text\", \"paths\": [\"no/such/dir\"]}");
  // Byte-level text needs vocab 256.
  CliRun vocab = porter({"train", "--config", config(text, "vocab.json")});
  EXPECT_EQ(vocab.rc, kExitInvalid);
  EXPECT_TRUE(contains(vocab.err, "porter.model.vocab: text data is byte-level")) << vocab.err;
  const std::string vocab64 = "\"vocab\": 64";
  text.replace(text.find(vocab64), vocab64.size(), "\"vocab\": 256");
  CliRun missing = porter({"train", "--config", config(text, "missing.json")});
  EXPECT_EQ(missing.rc, kExitInvalid);
  EXPECT_TRUE(contains(missing.err, "\"no/such/dir\" does not exist")) << missing.err;
}

// Raw uint16 tokens (nanoGPT's train.bin): token i is (i * mul + add) % 64.
void write_tokens(const fs::path& p, size_t n, int mul, int add) {
  std::vector<uint16_t> t(n);
  for (size_t i = 0; i < n; ++i) t[i] = static_cast<uint16_t>((i * static_cast<size_t>(mul) + static_cast<size_t>(add)) % 64);
  std::ofstream(p, std::ios::binary)
      .write(reinterpret_cast<const char*>(t.data()), static_cast<std::streamsize>(n * 2));
}

TEST_F(CliTrain, TokenShardsWithAValidationLoss) {
  write_tokens(dir_ / "train.bin", 2000, 7, 3);
  write_tokens(dir_ / "val.bin", 600, 5, 1);  // 37 windows of 17
  std::string text = kTinyConfig;
  const std::string synthetic = "\"data\": {\"type\": \"synthetic\", \"seed\": 3}";
  text.replace(text.find(synthetic), synthetic.size(),
               "\"data\": {\"type\": \"tokens\", \"paths\": \"" + (dir_ / "train.bin").string() +
                   "\", \"val_paths\": [\"" + (dir_ / "val.bin").string() + "\"]}");
  const std::string train = "\"train\": {\"steps\": 3, \"log_every\": 2}";
  text.replace(text.find(train), train.size(),
               "\"train\": {\"steps\": 3, \"log_every\": 2, \"eval_every\": 2, "
               "\"eval_micro_batches\": 2}");
  const std::string report = (dir_ / "report.json").string();
  CliRun r = porter({"train", "--config", config(text), "--report", report});
  ASSERT_EQ(r.rc, kExitOk) << r.err;
  EXPECT_TRUE(contains(r.out, "  data: tokens: 2000 tokens in 1 raw uint16 shard, 124 windows of "
                              "17; 2 x 2 x 16 tokens per step\n")) << r.out;
  EXPECT_TRUE(contains(r.out, "  validation: tokens: 600 tokens in 1 raw uint16 shard, 4 of its 37 "
                              "windows of 17; 2 micro-batches, every 2 steps and after the last\n"))
      << r.out;
  EXPECT_TRUE(contains(r.err, " (step 2, 2 micro-batches)\n")) << r.err;
  EXPECT_TRUE(contains(r.err, " (step 3, 2 micro-batches)\n")) << r.err;
  EXPECT_FALSE(contains(r.err, "(step 1,")) << r.err;
  EXPECT_TRUE(contains(r.out, "val loss (step 3)")) << r.out;

  json j = read_json(report);
  EXPECT_EQ(j["validation_data"], "tokens: 600 tokens in 1 raw uint16 shard, 4 of its 37 windows of 17");
  EXPECT_EQ(j["validation_micro_batches"], 2);
  ASSERT_EQ(j["validation"].size(), 2u);
  EXPECT_EQ(j["validation"][0]["step"], 2);
  EXPECT_EQ(j["validation"][1]["step"], 3);
  for (const json& v : j["validation"]) {
    const double loss = v["loss"].get<double>();
    EXPECT_NEAR(loss, std::log(64.0), 0.3);
    char line[64];
    std::snprintf(line, sizeof line, "val loss %.4f (step %d,", loss, v["step"].get<int>());
    EXPECT_TRUE(contains(r.err, line)) << line << "\n" << r.err;
  }
  // The same windows at every evaluation: a second run from scratch reports the same losses.
  CliRun again = porter({"train", "--config", config(text), "--report", report});
  ASSERT_EQ(again.rc, kExitOk) << again.err;
  EXPECT_EQ(read_json(report)["validation"], j["validation"]);

  // On a terminal each validation line erases the bar it interrupts; the next step redraws it.
  CliRun tty = porter({"train", "--config", config(text)}, /*tty=*/true);
  ASSERT_EQ(tty.rc, kExitOk) << tty.err;
  EXPECT_TRUE(contains(tty.err, "\033[K\r\033[Kval loss ")) << tty.err;
  EXPECT_TRUE(contains(tty.err, " (step 2, 2 micro-batches)\n\r[")) << tty.err;
  EXPECT_EQ(std::count(tty.err.begin(), tty.err.end(), '\n'), 3) << tty.err;

  // Without val_paths there is no validation.
  const std::string val = ", \"val_paths\": [\"" + (dir_ / "val.bin").string() + "\"]";
  text.replace(text.find(val), val.size(), "");
  CliRun none = porter({"train", "--config", config(text), "--report", report});
  ASSERT_EQ(none.rc, kExitOk) << none.err;
  EXPECT_FALSE(contains(none.err, "val loss")) << none.err;
  EXPECT_TRUE(read_json(report)["validation"].empty());
  EXPECT_TRUE(read_json(report)["validation_data"].is_null());
}

TEST_F(CliTrain, TokenShardErrorsExitTwo) {
  write_tokens(dir_ / "train.bin", 2000, 7, 3);
  std::vector<uint16_t> bad(300, 1);
  bad[123] = 100;  // vocab is 64
  std::ofstream(dir_ / "val.bin", std::ios::binary)
      .write(reinterpret_cast<const char*>(bad.data()), static_cast<std::streamsize>(bad.size() * 2));
  std::string text = kTinyConfig;
  const std::string synthetic = "\"data\": {\"type\": \"synthetic\", \"seed\": 3}";
  text.replace(text.find(synthetic), synthetic.size(),
               "\"data\": {\"type\": \"tokens\", \"paths\": \"" + (dir_ / "train.bin").string() +
                   "\", \"val_paths\": \"" + (dir_ / "val.bin").string() + "\"}");
  CliRun r = porter({"train", "--config", config(text)});
  EXPECT_EQ(r.rc, kExitInvalid);
  EXPECT_TRUE(contains(r.err, "error: porter.data.val_paths: \"" + (dir_ / "val.bin").string() +
                                  "\": token 123 (byte offset 246) is id 100, not below "
                                  "porter.model.vocab = 64")) << r.err;
  std::ofstream(dir_ / "train.bin", std::ios::binary) << "abc";
  r = porter({"train", "--config", config(text)});
  EXPECT_EQ(r.rc, kExitInvalid);
  EXPECT_TRUE(contains(r.err, "error: porter.data.paths: \"" + (dir_ / "train.bin").string() +
                                  "\" has 3 bytes, an odd number")) << r.err;
}

TEST_F(CliTrain, OutOfMemoryExitsThree) {
  // Model states (~446 KiB) fit in 560 KiB; with the none policy the activations do not.
  std::string text = kTinyConfig;
  const std::string uniform = "\"policy\": \"uniform\", \"every_n_layers\": 1";
  text.replace(text.find("\"64MiB\""), 7, "\"560KiB\"");
  text.replace(text.find(uniform), uniform.size(), "\"policy\": \"none\"");
  const fs::path trace = dir_ / "oom-trace.json";
  // The preflight refuses it before step 1 (Note [Preflight]); past it, the step runs out.
  CliRun refused = porter({"train", "--config", config(text, "oom.json")});
  EXPECT_EQ(refused.rc, kExitOom) << refused.err;
  EXPECT_TRUE(contains(refused.err, "before step 1 (preflight): ")) << refused.err;
  CliRun oom = porter({"train", "--config", config(text, "oom.json"), "--trace", trace.string(),
                       "--no-preflight"});
  EXPECT_EQ(oom.rc, kExitOom) << oom.err;
  EXPECT_TRUE(contains(oom.err, "error: out of memory on cpu:0")) << oom.err;
  EXPECT_TRUE(contains(oom.err, "hint: ")) << oom.err;
  EXPECT_TRUE(contains(oom.err, "warning: the plan's predicted peak")) << oom.err;
  // The trace up to the error is written.
  EXPECT_TRUE(read_json(trace)["traceEvents"].is_array());
}

// Note [Progress cadence] in config/porter_keys.cc: DeepSpeed's steps_per_print paces the
// progress lines when porter.train.log_every is not given; log_every wins when it is.
TEST_F(CliTrain, StepsPerPrintIsTheProgressCadenceWithoutLogEvery) {
  std::string text = kTinyConfig;
  const std::string from = "\"train\": {\"steps\": 3, \"log_every\": 2}";
  text.replace(text.find(from), from.size(), "\"train\": {\"steps\": 7}");
  text.replace(text.find("{"), 1, "{\"steps_per_print\": 3, ");
  CliRun r = porter({"train", "--config", config(text, "spp.json")});
  ASSERT_EQ(r.rc, kExitOk) << r.err;
  for (int step = 1; step <= 7; ++step) {
    const bool printed = step == 3 || step == 6 || step == 7;  // every 3rd, and the last
    EXPECT_EQ(contains(r.err, "step " + std::to_string(step) + "/7  loss "), printed)
        << step << "\n" << r.err;
  }
  // log_every, when given, is the cadence.
  CliRun both = porter({"train", "--config", config(text, "spp.json"), "--set",
                        "porter.train.log_every=2"});
  ASSERT_EQ(both.rc, kExitOk) << both.err;
  for (int step = 1; step <= 7; ++step) {
    const bool printed = step % 2 == 0 || step == 7;
    EXPECT_EQ(contains(both.err, "step " + std::to_string(step) + "/7  loss "), printed)
        << step << "\n" << both.err;
  }
}

// A published DeepSpeed config alone trains porter's default model, and train says so once,
// with how to give one (a note, not an error).
TEST_F(CliTrain, AConfigWithoutAModelSaysWhichModelItTrains) {
  const std::string published =
      std::string(PORTER_REALWORLD_CONFIG_DIR) +
      "/deepspeedexamples__megatron-lm__scripts__ds_zero2_config.json";
  // The default GPT (124M parameters) does not fit 1 MiB: the run stops before step 1, after
  // the note.
  CliRun r = porter({"train", "--config", published, "--steps", "1", "--set",
                     "porter.device={\"type\": \"cpu\", \"memory_limit\": \"1MiB\", \"threads\": 1}"});
  EXPECT_EQ(r.rc, kExitOom) << r.err;
  const std::string note =
      "note: " + published + ": porter.model: not given, so porter trains its default model, a "
      "GPT of 12 layers, hidden 768, 12 heads, seq_len 1024, vocab 50257; give the model in the "
      "config's \"porter\": {\"model\": {...}} (or key by key with --set, e.g. --set "
      "porter.model.layers=4), or load one with porter.model.from, a Hugging Face model "
      "directory\n";
  EXPECT_TRUE(contains(r.err, note)) << r.err;
  EXPECT_EQ(r.err.find("note: "), r.err.rfind("note: ")) << r.err;  // once
  // With a model, no note.
  CliRun tiny_run = porter({"train", "--config", tiny(), "--steps", "1"});
  ASSERT_EQ(tiny_run.rc, kExitOk) << tiny_run.err;
  EXPECT_FALSE(contains(tiny_run.err, "note: ")) << tiny_run.err;
}

// Exit code 1 is usage everywhere: flags that parse but do not go together (a UsageError) too.
TEST_F(CliTrain, FlagsThatDoNotGoTogetherExitOne) {
  CliRun r = porter({"train", "--config", tiny(), "--steps", "1", "--trace-rank", "0"});
  EXPECT_EQ(r.rc, kExitUsage) << r.err;
  EXPECT_TRUE(contains(r.err, "error: --trace-rank: there is no trace to write")) << r.err;
}

// An out-of-memory hint names only keys porter reads: each dotted key in every category's hint
// given with --set is a known key (a value of the wrong type is fine, an unknown key is not),
// and the comm hint names the bucket that fills that category.
TEST_F(CliTrain, OutOfMemoryHintsNameOnlyKeysPorterReads) {
  const std::regex key(R"([a-z_0-9]+(\.[a-z_0-9]+)+)");
  const std::string cfg = tiny();
  int checked = 0;
  for (memory::Category c : memory::kAllCategories) {
    const std::string hint(memory::category_hint(c));
    SCOPED_TRACE(hint);
    for (auto it = std::sregex_iterator(hint.begin(), hint.end(), key); it != std::sregex_iterator();
         ++it) {
      const std::string k = it->str();
      CliRun r = porter({"config", "check", cfg, "--set", k + "=[]"});
      EXPECT_FALSE(contains(r.err, "unknown key")) << k << ": " << r.err;
      ++checked;
    }
  }
  EXPECT_GE(checked, 10);
  const std::string comm(memory::category_hint(memory::Category::kComm));
  EXPECT_TRUE(contains(comm, "lower zero_optimization.reduce_bucket_size")) << comm;
  // partition_activations only partitions over tensor-parallel ranks.
  const std::string checkpoints(memory::category_hint(memory::Category::kCheckpoints));
  EXPECT_TRUE(contains(checkpoints, "with porter.model.tensor_parallel > 1, partition them"))
      << checkpoints;
}

}  // namespace
}  // namespace porter::cli

namespace porter::cli {
namespace {

// porter estimate's stage-3 bytes are the ones training measures: the params between steps
// (the shard and the persistent stages) and the gathered parameters' peak of the config's
// policy; porter plan predicts the same gathers.
TEST(CliStage3, EstimateAndPlanEqualWhatTrainingMeasures) {
  const fs::path dir = fs::temp_directory_path() / "porter_cli_stage3_estimate";
  fs::remove_all(dir);
  fs::create_directories(dir);
  const fs::path cfg = dir / "z3.json";
  std::ofstream(cfg) << R"({
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 20000,
                          "stage3_max_reuse_distance": 20000,
                          "stage3_param_persistence_threshold": 1000},
    "porter": {
      "model": {"layers": 3, "hidden": 32, "heads": 2, "seq_len": 16, "vocab": 64},
      "data": {"type": "synthetic", "seed": 3},
      "device": {"type": "cpu", "memory_limit": "64MiB", "threads": 1},
      "checkpointing": {"policy": "uniform", "every_n_layers": 3},
      "train": {"steps": 2, "log_every": 1}
    }
  })";
  const std::string report = (dir / "r.json").string();
  CliRun t = porter({"train", "--config", cfg.string(), "--report", report});
  ASSERT_EQ(t.rc, kExitOk) << t.err;
  EXPECT_TRUE(contains(t.out, "parameter gathers: ")) << t.out;
  const json r = read_json(report);
  CliRun e = porter({"estimate", "--config", cfg.string(), "--json"});
  ASSERT_EQ(e.rc, kExitOk) << e.err;
  const json est = json::parse(e.out);
  EXPECT_EQ(est["model_state_bytes"]["params"], r["memory"]["current_by_category"]["params"]);
  EXPECT_EQ(est["model_state_bytes"]["grads"], r["memory"]["current_by_category"]["grads"]);
  EXPECT_EQ(est["model_state_bytes"]["optimizer"], r["memory"]["current_by_category"]["optimizer"]);
  bool found = false;
  for (const json& p : est["policies"]) {
    if (p["policy"] != "uniform") continue;
    found = true;
    EXPECT_EQ(p["gathered_params_peak_bytes"], r["zero"]["peak_gathered_bytes"]);
  }
  EXPECT_TRUE(found) << e.out;
  EXPECT_GT(r["zero"]["gathers"].get<int64_t>(), 0);
  EXPECT_EQ(r["zero"]["peak_gathered_bytes"], r["zero"]["predicted_gathered_bytes"]);
  CliRun p = porter({"plan", "--config", cfg.string(), "--json"});
  ASSERT_EQ(p.rc, kExitOk) << p.err;
  EXPECT_EQ(json::parse(p.out)["stage3"]["peak_gathered_bytes"], r["zero"]["peak_gathered_bytes"]);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace porter::cli

namespace porter::cli {
namespace {

// porter estimate's optimizer-offload bytes are what training measures: nothing of the
// optimizer on the device, and the host state the report gives.
TEST(CliOptimizerOffload, EstimateEqualsWhatTrainingMeasures) {
  const fs::path dir = fs::temp_directory_path() / "porter_cli_optimizer_offload";
  fs::remove_all(dir);
  fs::create_directories(dir);
  const fs::path cfg = dir / "off.json";
  std::ofstream(cfg) << R"({
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "bf16": {"enabled": true},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
    "porter": {
      "model": {"layers": 2, "hidden": 32, "heads": 2, "seq_len": 16, "vocab": 64},
      "data": {"type": "synthetic", "seed": 3},
      "device": {"type": "cpu", "memory_limit": "64MiB", "threads": 1},
      "train": {"steps": 2, "log_every": 1}
    }
  })";
  const std::string report = (dir / "r.json").string();
  CliRun t = porter({"train", "--config", cfg.string(), "--report", report});
  ASSERT_EQ(t.rc, kExitOk) << t.err;
  EXPECT_TRUE(contains(t.out, "optimizer offload: ")) << t.out;
  const json r = read_json(report);
  CliRun e = porter({"estimate", "--config", cfg.string(), "--json"});
  ASSERT_EQ(e.rc, kExitOk) << e.err;
  const json est = json::parse(e.out);
  EXPECT_EQ(r["memory"]["current_by_category"]["optimizer"], 0);
  EXPECT_EQ(est["model_state_bytes"]["optimizer"], 0);
  EXPECT_EQ(est["model_state_bytes"]["params"], r["memory"]["current_by_category"]["params"]);
  EXPECT_EQ(est["host_bytes"]["total"], r["zero"]["offload_optimizer"]["host_bytes"]);
  EXPECT_EQ(r["zero"]["offload_optimizer"]["d2h_bytes"].get<uint64_t>(),
            2 * r["zero"]["shard_elems"].get<uint64_t>() * 4);  // 2 steps of f32 gradients
  fs::remove_all(dir);
}

}  // namespace
}  // namespace porter::cli

namespace porter::cli {
namespace {

// wall_clock_breakdown (Note [Wall-clock breakdown] in engine/engine.h): DeepSpeed's timing line
// under every printed progress line, and each step's phases in the report; neither when off.
TEST_F(CliTrain, WallClockBreakdownPrintsDeepSpeedsLineAndReportsThePhases) {
  const std::string report = (dir_ / "report.json").string();
  CliRun on = porter({"train", "--config",
                      tiny("\"gradient_accumulation_steps\": 2,",
                           "\"gradient_accumulation_steps\": 2, \"wall_clock_breakdown\": true,"),
                      "--report", report});
  ASSERT_EQ(on.rc, kExitOk) << on.err;
  const std::regex line(
      "\\[Rank 0\\] time \\(ms\\) \\| fwd: [0-9]+\\.[0-9]{2} \\| bwd: [0-9]+\\.[0-9]{2} \\| "
      "bwd_inner: [0-9]+\\.[0-9]{2} \\| bwd_allreduce: [0-9]+\\.[0-9]{2} \\| step: "
      "[0-9]+\\.[0-9]{2} \\| recompute: [0-9]+\\.[0-9]{2} \\| offload_wait: [0-9]+\\.[0-9]{2}\n");
  const auto lines = std::distance(std::sregex_iterator(on.err.begin(), on.err.end(), line),
                                   std::sregex_iterator());
  EXPECT_EQ(lines, 2) << on.err;  // log_every 2 of 3 steps: steps 2 and 3, as the progress lines
  EXPECT_TRUE(contains(on.err, "step 2/3  loss ")) << on.err;
  const json j = read_json(report);
  ASSERT_TRUE(j["wall_clock"].is_array()) << j["wall_clock"];
  ASSERT_EQ(j["wall_clock"].size(), 3u);
  for (const json& s : j["wall_clock"]) {
    double sum = 0.0;
    for (const char* k : {"forward_ms", "backward_inner_ms", "reduce_ms", "optimizer_ms",
                          "recompute_ms"}) {
      EXPECT_GT(s[k].get<double>(), 0.0) << k << " " << s;  // uniform checkpoints recompute
      sum += s[k].get<double>();
    }
    sum += s["offload_wait_ms"].get<double>();
    EXPECT_DOUBLE_EQ(s["backward_ms"].get<double>(),
                     s["backward_inner_ms"].get<double>() + s["reduce_ms"].get<double>());
    EXPECT_LE(sum, s["step_ms"].get<double>()) << s;
  }

  CliRun off = porter({"train", "--config", tiny(), "--report", report});
  ASSERT_EQ(off.rc, kExitOk) << off.err;
  EXPECT_FALSE(contains(off.err, "time (ms)")) << off.err;
  EXPECT_TRUE(read_json(report)["wall_clock"].is_null());
}

}  // namespace
}  // namespace porter::cli
