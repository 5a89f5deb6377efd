// The memory page without a browser: its embedded data read back from the HTML equals what
// the engine measured and what the plan predicted, and the page is self-contained.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <numeric>
#include <optional>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/units.h"
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
    EXPECT_EQ(ops[i]["peak_bytes"].get<size_t>(), plan.prediction.peak_total_during_op[k])
        << "op " << i;
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

// The numbers of an SVG path's d attribute, in order (commands dropped).
std::vector<double> path_numbers(const std::string& d) {
  std::vector<double> out;
  const std::regex number(R"(-?[0-9]+(\.[0-9]+)?)");
  for (auto it = std::sregex_iterator(d.begin(), d.end(), number); it != std::sregex_iterator();
       ++it) {
    out.push_back(std::stod(it->str()));
  }
  return out;
}

// Note [Predicted envelope]: on a plan page op k spans [k, k + 1], and the predicted curve over
// it is op k's predicted peak over the baseline, in the data and in the static chart; its
// highest point is the predicted peak.
TEST_F(MemoryPage, PlanPageCurveOverEachOpIsThatOpsPeak) {
  const checkpoint::Plan& plan = eng_->plan();
  const checkpoint::Prediction sim = checkpoint::simulate(plan.schedule, eng_->costs(),
                                                          plan.offload, plan.sim.link_bytes_per_s);
  const engine::MemoryReport mem = eng_->memory_report();
  PlanPageInput in;
  in.config_file = "cfg.json";
  in.plan = &plan;
  in.costs = &eng_->costs();
  in.stage_name = [this](int s) { return eng_->model().stage_name(s); };
  in.model_state_bytes = mem.model_state_bytes;
  in.batch_bytes = eng_->run_options().batch_bytes;
  in.capacity_bytes = size_t{64} << 20;
  in.predicted_peak_bytes = eng_->run_options().predicted_peak_bytes(mem.model_state_bytes, sim);
  const std::string html = render_memory_page(plan_page_data(in));
  const json d = page_data(html);
  const json& ops = d["predicted"]["ops"];
  ASSERT_EQ(ops.size(), plan.schedule.ops.size());
  ASSERT_EQ(sim.peak_total_during_op.size(), ops.size());
  const size_t base = d["predicted"]["baseline_bytes"].get<size_t>();
  size_t highest = 0;
  for (size_t k = 0; k < ops.size(); ++k) {
    EXPECT_EQ(ops[k]["peak_bytes"].get<size_t>(), sim.peak_total_during_op[k]) << "op " << k;
    // An op holds at least what it leaves.
    EXPECT_GE(sim.peak_total_during_op[k], sim.footprint_after_op[k]) << "op " << k;
    highest = std::max(highest, base + sim.peak_total_during_op[k]);
  }
  EXPECT_EQ(*std::max_element(sim.peak_total_during_op.begin(), sim.peak_total_during_op.end()),
            sim.peak_total_bytes);
  EXPECT_EQ(highest, d["predicted"]["peak_bytes"].get<size_t>());
  // The static chart's curve: "M x0,y0 H x1" then "V y H x" per op, ops touching end to start.
  std::smatch m;
  ASSERT_TRUE(std::regex_search(html, m, std::regex(R"(<path class="predicted" d="([^"]*)\")")));
  const std::vector<double> v = path_numbers(m[1].str());
  ASSERT_EQ(v.size(), 3 + 2 * (ops.size() - 1)) << m[1].str();
  const json& c = d["chart"];
  const double left = c["left"].get<double>(), plot_w = c["width"].get<double>() - left -
                                                         c["right"].get<double>();
  const double top = c["top"].get<double>(), plot_h = c["height"].get<double>() - top -
                                                      c["bottom"].get<double>();
  const double n = static_cast<double>(ops.size());
  auto x = [&](double t) { return left + t / n * plot_w; };
  auto y = [&](double b) { return top + (1.0 - b / c["y_max_bytes"].get<double>()) * plot_h; };
  EXPECT_NEAR(v[0], x(0), 0.051);
  for (size_t k = 0; k < ops.size(); ++k) {
    const double level = v[k == 0 ? 1 : 1 + 2 * k];
    const double end = v[k == 0 ? 2 : 2 + 2 * k];
    EXPECT_NEAR(level, y(static_cast<double>(base + sim.peak_total_during_op[k])), 0.051)
        << "op " << k;
    EXPECT_NEAR(end, x(static_cast<double>(k + 1)), 0.051) << "op " << k;
  }
}

// Note [Chart scale]: a small run on a large device is drawn at its own scale; the capacity
// is a label above the chart.
TEST_F(MemoryPage, YAxisFitsTheDataNotTheDevice) {
  train(1);
  const std::string html =
      render_memory_page(train_page_data(*eng_, *eng_->last_step_memory(), "cfg.json"));
  const json d = page_data(html);
  const json& c = d["chart"];
  const double highest = std::max(d["measured"]["peak_bytes"].get<double>(),
                                   d["predicted"]["peak_bytes"].get<double>());
  const double y_max = c["y_max_bytes"].get<double>();
  EXPECT_GE(y_max, 1.1 * highest);
  EXPECT_LE(y_max, 1.5 * 1.1 * highest);
  EXPECT_LT(y_max, d["capacity_bytes"].get<double>());
  EXPECT_FALSE(c["capacity_on_chart"].get<bool>());
  EXPECT_EQ(c["y_ticks"].back().get<double>(), y_max);
  EXPECT_EQ(c["y_ticks"].front().get<double>(), 0.0);
  EXPECT_LE(c["y_ticks"].size(), 6u);
  EXPECT_TRUE(testing::contains(html, "capacity 64.00 MiB (above the chart)")) << html.size();
  EXPECT_FALSE(testing::contains(html, "capacity 64.00 MiB</text>"));  // no line's label
  // The lanes' names (with the micro-batch: there are two) fit left of the time axis.
  size_t longest = 0;
  for (const json& life : d["checkpoints"]) {
    longest = std::max(longest, life["name"].get<std::string>().size() + 3);  // " #0"
  }
  EXPECT_GE(c["left"].get<double>(), 14 + 7.5 * static_cast<double>(longest));
}

// Note [Out-of-memory page]: a config whose step does not fit 560 KiB (the none policy keeps
// every activation of two micro-batches' worth of blocks).
const char* kOomConfig = R"({
  "train_micro_batch_size_per_gpu": 2,
  "gradient_accumulation_steps": 2,
  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
  "porter": {
    "model": {"layers": 2, "hidden": 32, "heads": 2, "seq_len": 16, "vocab": 64},
    "data": {"type": "synthetic", "seed": 3},
    "device": {"type": "cpu", "memory_limit": "560KiB", "threads": 1},
    "checkpointing": {"policy": "none"},
    "train": {"steps": 3, "log_every": 2}
  }
})";

TEST(MemoryPageOom, PageStopsAtTheFailedRequest) {
  const config::Config cfg = config::parse_config_string(kOomConfig).config;
  const std::unique_ptr<memory::Device> device =
      memory::make_device(engine::make_run_options(cfg).device);
  engine::Engine eng(*device, std::make_unique<engine::TransformerModel>(cfg.porter.model), cfg);
  io::DataSource data(cfg.porter.data, cfg.porter.model.vocab, cfg.train_micro_batch_size_per_gpu,
                      cfg.porter.model.seq_len);
  eng.record_step_memory(true);
  EXPECT_FALSE(eng.unfinished_step_memory().has_value());
  std::optional<OutOfMemoryError> error;
  try {
    eng.train_step(data.step_batches(0, cfg.gradient_accumulation_steps));
  } catch (const OutOfMemoryError& e) {
    error = e;
  }
  ASSERT_TRUE(error.has_value()) << "the step fit 560 KiB";
  const std::optional<engine::StepMemory> step = eng.unfinished_step_memory();
  ASSERT_TRUE(step.has_value());
  EXPECT_EQ(eng.last_step_memory(), nullptr);
  const std::string html = render_memory_page(oom_page_data(eng, *step, *error, "oom.json", 0));
  const json d = page_data(html);
  const json& f = d["failure"];
  ASSERT_TRUE(f.is_object());
  EXPECT_EQ(f["requested_bytes"].get<size_t>(), error->requested_bytes());
  EXPECT_EQ(f["category"], "activations");
  EXPECT_TRUE(testing::contains(error->what(), "(" + std::to_string(error->requested_bytes()) +
                                                   " bytes) for activations."));
  EXPECT_EQ(f["message"], error->what());
  // What was live is the allocator's accounting in the message, to the byte.
  EXPECT_EQ(f["live_from"], "allocator");
  size_t live = 0;
  for (const json& c : d["categories"]) {
    const std::string name = c.get<std::string>();
    const size_t bytes = f["live_by_category"][name].get<size_t>();
    live += bytes;
    const std::regex line("\n +" + name + " +[^\n]*\\((\\d+) bytes, ");
    std::smatch m;
    const std::string what = error->what();
    ASSERT_TRUE(std::regex_search(what, m, line)) << name;
    EXPECT_EQ(bytes, std::stoull(m[1].str())) << name;
  }
  EXPECT_EQ(f["live_bytes"].get<size_t>(), live);
  // The measured series stops at the failure: its last state is what was live, and no event
  // after the failure's time is drawn.
  const json& m = d["measured"];
  const size_t n = m["times"].size();
  ASSERT_GT(n, 1u);
  size_t last = 0;
  for (const json& c : d["categories"]) last += m["bytes"][c.get<std::string>()][n - 1].get<size_t>();
  EXPECT_EQ(last, live);
  EXPECT_LE(m["times"][n - 1].get<double>(), f["time"].get<double>());
  EXPECT_LT(n, step->entries.size() + 1) << "the unwinding's frees are drawn";
  // The op it was in: the first op the step did not complete, drawn up to the failure.
  const checkpoint::Schedule& schedule = eng.plan().schedule;
  ASSERT_FALSE(f["op"].is_null());
  const size_t op = f["op"].get<size_t>();
  ASSERT_LT(op, schedule.ops.size());
  EXPECT_EQ(f["stage"].get<int>(), schedule.ops[op].stage);
  EXPECT_EQ(f["name"], eng.model().stage_name(schedule.ops[op].stage));
  EXPECT_EQ(step->ops.size(), f["micro_batch"].get<size_t>() * schedule.ops.size() + op);
  const json& last_op = d["predicted"]["ops"].back();
  EXPECT_EQ(last_op["op"].get<size_t>(), op);
  EXPECT_EQ(last_op["end"].get<double>(), f["time"].get<double>());
  EXPECT_GT(d["duration"].get<double>(), f["time"].get<double>());
  // Live plus the request is on the chart, and so is the capacity.
  EXPECT_GE(d["chart"]["y_max_bytes"].get<double>(),
            1.1 * static_cast<double>(live + error->requested_bytes()));
  EXPECT_TRUE(d["chart"]["capacity_on_chart"].get<bool>());
  EXPECT_TRUE(testing::contains(html, R"(<rect class="failed-request")"));
  EXPECT_TRUE(testing::contains(
      html, "out of memory: " + format_bytes(error->requested_bytes()) + " for activations"));
}

TEST(MemoryPageOom, PathRule) {
  EXPECT_EQ(oom_page_path("a/page.html", "r.json", 0, 1), "a/page.html");
  EXPECT_EQ(oom_page_path("", "out/run.json", 0, 1), "out/run.html");
  EXPECT_EQ(oom_page_path("", "", 0, 1), "porter-oom-memory.html");
  EXPECT_EQ(oom_page_path("a/page.html", "", 1, 2), "a/page.rank1.html");
  EXPECT_EQ(oom_page_path("", "out/run.json", 0, 4), "out/run.rank0.html");
  EXPECT_EQ(oom_page_path("", "", 3, 4), "porter-oom-memory.rank3.html");
  EXPECT_EQ(oom_page_path("page", "", 1, 2), "page.rank1");
}

// `porter train` that runs out of memory: exit code 3, the page beside --report (or at
// --memory-page, or in the working directory), and the error names it. --no-preflight: the
// step itself must run out (Note [Preflight] in cli/train_command.cc refuses the config).
TEST(MemoryPageCli, OutOfMemoryStepWritesItsPage) {
  const fs::path dir = fs::temp_directory_path() / "porter_memory_page_oom";
  fs::remove_all(dir);
  fs::create_directories(dir);
  const fs::path cfg = dir / "oom.json";
  std::ofstream(cfg) << kOomConfig;
  const fs::path report = dir / "run.json";
  const std::vector<std::string> train = {"train", "--no-preflight", "--config", cfg.string()};
  auto with = [&train](std::vector<std::string> more) {
    more.insert(more.begin(), train.begin(), train.end());
    return testing::porter(more);
  };
  const testing::CliRun r = with({"--report", report.string()});
  ASSERT_EQ(r.rc, 3) << r.err;
  const fs::path page = dir / "run.html";
  EXPECT_TRUE(testing::contains(r.err, "error: out of memory on cpu:0")) << r.err;
  EXPECT_TRUE(testing::contains(r.err, "\nmemory page of the failed step: " + page.string() + "\n"))
      << r.err;
  ASSERT_TRUE(fs::exists(page));
  std::ifstream in(page);
  const std::string html((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const json d = page_data(html);
  EXPECT_EQ(d["kind"], "train");
  EXPECT_EQ(d["step"], 1);
  EXPECT_EQ(d["failure"]["category"], "activations");
  EXPECT_TRUE(testing::contains(
      r.err, "(" + std::to_string(d["failure"]["requested_bytes"].get<size_t>()) +
                 " bytes) for activations."))
      << r.err;
  EXPECT_FALSE(fs::exists(report));  // the report is a finished run's
  // --memory-page wins; without either, the working directory's default.
  const fs::path chosen = dir / "chosen.html";
  const testing::CliRun r2 =
      with({"--report", report.string(), "--memory-page", chosen.string()});
  EXPECT_EQ(r2.rc, 3);
  EXPECT_TRUE(testing::contains(r2.err, "memory page of the failed step: " + chosen.string()))
      << r2.err;
  EXPECT_TRUE(fs::exists(chosen));
  const fs::path cwd = fs::current_path();
  fs::current_path(dir);
  const testing::CliRun r3 = with({});
  fs::current_path(cwd);
  EXPECT_EQ(r3.rc, 3);
  EXPECT_TRUE(testing::contains(r3.err, "memory page of the failed step: porter-oom-memory.html"))
      << r3.err;
  EXPECT_TRUE(fs::exists(dir / "porter-oom-memory.html"));
  // A page that cannot be written is refused before step 1, not found out after the failure.
  const testing::CliRun r4 = with({"--memory-page", "/nonexistent-dir/page.html"});
  EXPECT_EQ(r4.rc, 2);
  EXPECT_TRUE(testing::contains(r4.err, "--memory-page \"/nonexistent-dir/page.html\": the "
                                        "directory \"/nonexistent-dir\" does not exist"))
      << r4.err;
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
