// The memory page without a browser: its embedded data read back from the HTML equals what
// the engine measured and what the plan predicted, and the page is self-contained.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <memory>
#include <numeric>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "checkpoint/simulate.h"
#include "cli/memory_page.h"
#include "config/parse.h"
#include "io/data.h"
#include "engine/engine.h"
#include "engine/model.h"
#include "tests/cli/cli_test_util.h"

namespace porter::cli {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// Uniform checkpoints streamed to the host, two micro-batches per step: every phase, both
// checkpoint places and a repeated schedule appear.
const char* kConfig = R"({
  "train_micro_batch_size_per_gpu": 2,
  "gradient_accumulation_steps": 2,
  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
  "activation_checkpointing": {"cpu_checkpointing": true},
  "porter": {
    "model": {"layers": 3, "hidden": 32, "heads": 2, "seq_len": 16, "vocab": 64},
    "data": {"type": "synthetic", "seed": 3},
    "device": {"type": "cpu", "memory_limit": "64MiB", "threads": 1, "sim_link_gbps": 50},
    "checkpointing": {"policy": "uniform", "every_n_layers": 1},
    "train": {"steps": 2, "log_every": 1}
  }
})";

// The page's <script type="application/json" id="porter-data"> parsed.
json page_data(const std::string& html) {
  const std::string open = R"(<script type="application/json" id="porter-data">)";
  const size_t from = html.find(open);
  EXPECT_NE(from, std::string::npos);
  const size_t begin = from + open.size();
  const size_t end = html.find("</script>", begin);
  EXPECT_NE(end, std::string::npos);
  return json::parse(html.substr(begin, end - begin));
}

class MemoryPage : public ::testing::Test {
 protected:
  void SetUp() override {
    cfg_ = config::parse_config_string(kConfig).config;
    device_ = memory::make_device(engine::make_run_options(cfg_).device);
    eng_ = std::make_unique<engine::Engine>(
        *device_, std::make_unique<engine::TransformerModel>(cfg_.porter.model), cfg_);
  }
  // Trains `steps` steps with the record on; returns the last StepResult.
  engine::StepResult train(int steps) {
    io::DataSource data(cfg_.porter.data, cfg_.porter.model.vocab,
                            cfg_.train_micro_batch_size_per_gpu, cfg_.porter.model.seq_len);
    eng_->record_step_memory(true);
    eng_->reset_peaks();
    engine::StepResult r;
    for (int s = 0; s < steps; ++s) {
      r = eng_->train_step(data.step_batches(eng_->step(), cfg_.gradient_accumulation_steps));
    }
    return r;
  }
  config::Config cfg_;
  std::unique_ptr<memory::Device> device_;
  std::unique_ptr<engine::Engine> eng_;
};

TEST_F(MemoryPage, NoRecordBeforeAStepOrWhenOff) {
  EXPECT_EQ(eng_->last_step_memory(), nullptr);
  train(1);
  ASSERT_NE(eng_->last_step_memory(), nullptr);
  eng_->record_step_memory(false);
  EXPECT_EQ(eng_->last_step_memory(), nullptr);
}

TEST_F(MemoryPage, EmbeddedPeakIsTheMeasuredPeak) {
  const engine::StepResult last = train(2);
  const engine::StepMemory* step = eng_->last_step_memory();
  ASSERT_NE(step, nullptr);
  EXPECT_EQ(step->step, 2);
  EXPECT_EQ(step->dropped, 0u);
  const json d = page_data(render_memory_page(train_page_data(*eng_, *step, "cfg.json")));
  EXPECT_EQ(d["format"], "porter-memory-page");
  EXPECT_EQ(d["kind"], "train");
  const json& m = d["measured"];
  // The step's own peak, and (the steps being alike) the run's, as the report has it.
  EXPECT_EQ(m["peak_bytes"].get<size_t>(), last.peak_bytes);
  EXPECT_EQ(m["peak_bytes"].get<size_t>(), eng_->memory_report().peak_bytes);
  EXPECT_EQ(m["report_peak_bytes"].get<size_t>(), eng_->memory_report().peak_bytes);
  // The stacked series: one column per category, its row sums peak where peak_by_category
  // says.
  const size_t n = m["times"].size();
  EXPECT_EQ(n, step->entries.size() + 1);
  size_t peak = 0;
  for (size_t i = 0; i < n; ++i) {
    size_t total = 0;
    for (const json& c : d["categories"]) {
      total += m["bytes"][c.get<std::string>()][i].get<size_t>();
    }
    peak = std::max(peak, total);
  }
  EXPECT_EQ(peak, last.peak_bytes);
  size_t parts = 0;
  for (const auto& [name, bytes] : m["peak_by_category"].items()) parts += bytes.get<size_t>();
  EXPECT_EQ(parts, last.peak_bytes);
  EXPECT_EQ(d["capacity_bytes"].get<size_t>(), size_t{64} << 20);
}

TEST_F(MemoryPage, PredictedCurveIsThePlansSimulationPerMicroBatch) {
  train(1);
  const json d = page_data(render_memory_page(
      train_page_data(*eng_, *eng_->last_step_memory(), "cfg.json")));
  const checkpoint::Plan& plan = eng_->plan();
  const std::vector<size_t>& after = plan.prediction.footprint_after_op;
  const json& ops = d["predicted"]["ops"];
  ASSERT_EQ(ops.size(), 2 * plan.schedule.ops.size());
  double last_end = 0.0;
  for (size_t i = 0; i < ops.size(); ++i) {
    const size_t k = i % plan.schedule.ops.size();
    EXPECT_EQ(ops[i]["micro_batch"].get<size_t>(), i / plan.schedule.ops.size());
    EXPECT_EQ(ops[i]["op"].get<size_t>(), k);
    EXPECT_EQ(ops[i]["footprint_bytes"].get<size_t>(), after[k]) << "op " << i;
    EXPECT_GE(ops[i]["start"].get<double>(), last_end);
    EXPECT_GE(ops[i]["end"].get<double>(), ops[i]["start"].get<double>());
    last_end = ops[i]["end"].get<double>();
  }
  EXPECT_EQ(d["predicted"]["peak_bytes"].get<size_t>(), eng_->memory_report().predicted_peak_bytes);
  const engine::MemoryReport mem = eng_->memory_report();
  EXPECT_EQ(d["predicted"]["baseline_bytes"].get<size_t>(),
            mem.model_state_bytes + eng_->run_options().batch_bytes);
  // Phases: forward, recompute and backward per micro-batch, then the optimizer.
  std::set<std::string> phases;
  for (const json& p : d["phases"]) phases.insert(p["phase"].get<std::string>());
  EXPECT_EQ(phases, (std::set<std::string>{"forward", "recompute", "backward", "optimizer"}));
  EXPECT_EQ(d["phases"].back()["phase"], "optimizer");
}

TEST_F(MemoryPage, CheckpointLivesFollowTheSchedule) {
  train(1);
  const json d = page_data(render_memory_page(
      train_page_data(*eng_, *eng_->last_step_memory(), "cfg.json")));
  const checkpoint::Plan& plan = eng_->plan();
  size_t holds = 0, host = 0;
  for (const checkpoint::ScheduleOp& op : plan.schedule.ops) {
    if (op.kind == checkpoint::ScheduleOp::Kind::kForward && op.hold_input) {
      ++holds;
      host += op.offload ? 1 : 0;
    }
  }
  ASSERT_GT(host, 0u) << plan.schedule.to_string();
  ASSERT_EQ(d["checkpoints"].size(), 2 * holds);
  size_t host_lives = 0;
  for (const json& c : d["checkpoints"]) {
    EXPECT_LT(c["start"].get<double>(), c["end"].get<double>());
    EXPECT_EQ(c["bytes"].get<size_t>(),
              eng_->costs().stages[c["stage"].get<size_t>()].input_bytes);
    if (c["where"] == "host") {
      ++host_lives;
      ASSERT_EQ(c["host"].size(), 1u);
      EXPECT_LE(c["host"][0][1].get<double>(), c["end"].get<double>());
    } else {
      EXPECT_EQ(c["where"], "device");
      EXPECT_TRUE(c["host"].empty());
    }
  }
  EXPECT_EQ(host_lives, 2 * host);
  // The copies of both micro-batches, and pinned bytes in use at some op boundary.
  EXPECT_FALSE(d["copies"].empty());
  const json& pinned = d["measured"]["pinned"]["bytes"];
  EXPECT_TRUE(std::any_of(pinned.begin(), pinned.end(),
                          [](const json& b) { return b.get<size_t>() > 0; }));
}

TEST_F(MemoryPage, PlanPageIsTheSimulation) {
  const checkpoint::Plan& plan = eng_->plan();
  PlanPageInput in;
  in.config_file = "a</script>b.json";  // must not end the data block
  in.plan = &plan;
  in.costs = &eng_->costs();
  in.stage_name = [this](int s) { return eng_->model().stage_name(s); };
  in.model_state_bytes = 1000;
  in.batch_bytes = 24;
  in.capacity_bytes = size_t{64} << 20;
  in.predicted_peak_bytes = 5000;
  const std::string html = render_memory_page(plan_page_data(in));
  const json d = page_data(html);
  EXPECT_EQ(d["config"], "a</script>b.json");
  EXPECT_EQ(d["kind"], "plan");
  EXPECT_EQ(d["time_unit"], "op");
  EXPECT_TRUE(d["measured"].is_null());
  const checkpoint::Prediction sim = checkpoint::simulate(plan.schedule, eng_->costs(),
                                                          plan.offload, plan.sim.link_bytes_per_s);
  const json& ops = d["predicted"]["ops"];
  ASSERT_EQ(ops.size(), sim.footprint_after_op.size());
  for (size_t k = 0; k < ops.size(); ++k) {
    EXPECT_EQ(ops[k]["footprint_bytes"].get<size_t>(), sim.footprint_after_op[k]) << "op " << k;
    EXPECT_EQ(ops[k]["start"].get<double>(), static_cast<double>(k));
  }
  EXPECT_EQ(d["predicted"]["baseline_bytes"].get<size_t>(), 1024u);
  EXPECT_EQ(d["predicted"]["pinned_bytes"].get<size_t>(), plan.offload.pinned_bytes);
}

TEST_F(MemoryPage, PageIsSelfContainedWithAStaticChart) {
  train(1);
  const std::string html =
      render_memory_page(train_page_data(*eng_, *eng_->last_step_memory(), "cfg.json"));
  // No request leaves the page: no src or href, no stylesheet link, no import, no remote url.
  for (const char* banned : {" src=", "href=", "<link", "@import", "url(http", "fetch(",
                             "XMLHttpRequest"}) {
    EXPECT_EQ(html.find(banned), std::string::npos) << banned;
  }
  std::smatch match;
  const std::string no_ns = std::regex_replace(html, std::regex("http://www.w3.org/2000/svg"), "");
  EXPECT_EQ(no_ns.find("http://"), std::string::npos);
  EXPECT_EQ(no_ns.find("https://"), std::string::npos);
  // The static chart: stacked areas, the predicted curve and the capacity line.
  EXPECT_NE(html.find(R"(<svg id="chart-static")"), std::string::npos);
  EXPECT_NE(html.find(R"(<path class="area cat-params")"), std::string::npos);
  EXPECT_NE(html.find(R"(<path class="predicted")"), std::string::npos);
  EXPECT_NE(html.find(R"(<line class="capacity")"), std::string::npos);
  EXPECT_NE(html.find(R"(<body data-status="static">)"), std::string::npos);
}

TEST(MemoryPageCli, WriteErrorNamesTheFlag) {
  const fs::path cfg = fs::temp_directory_path() / "porter_memory_page_cli.json";
  std::ofstream(cfg) << kConfig;
  const testing::CliRun r = testing::porter(
      {"plan", "--config", cfg.string(), "--memory-page", "/nonexistent-dir/page.html"});
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_TRUE(
      testing::contains(r.err, "--memory-page: cannot write \"/nonexistent-dir/page.html\""))
      << r.err;
}

}  // namespace
}  // namespace porter::cli
