// The memory page in a real browser: headless Chromium loads a page made by a short run of the
// demo config, runs its script without error and draws the report's measured peak; a
// screenshot is taken; with scripts off the static chart is still there. Skips where Chromium
// is not installed (scripts/install-deps.sh installs it).
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tests/cli/cli_test_util.h"

namespace porter::cli {
namespace {

namespace fs = std::filesystem;

// PORTER_CHROMIUM overrides where the browser is.
std::string chromium() {
  const char* env = std::getenv("PORTER_CHROMIUM");
  return env != nullptr ? env : "/usr/bin/chromium";
}

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// The value of `name` on the page's <body>, or "(none)".
std::string body_attribute(const std::string& dom, const std::string& name) {
  std::smatch m;
  const std::regex body("<body[^>]*\\s" + name + "=\"([^\"]*)\"");
  return std::regex_search(dom, m, body) ? m[1].str() : "(none)";
}

class MemoryPageBrowser : public ::testing::Test {
 protected:
  void SetUp() override {
    // make test installs it (scripts/install-deps.sh): a missing browser is a broken set-up.
    ASSERT_TRUE(fs::exists(chromium()))
        << chromium() << " is not installed: run scripts/install-deps.sh (Debian's chromium "
        << "package) to test the memory page in a browser";
    dir_ = fs::temp_directory_path() /
           ("porter_memory_page_" +
            std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    page_ = dir_ / "page.html";
    report_ = dir_ / "report.json";
  }
  void TearDown() override {
    if (!dir_.empty()) fs::remove_all(dir_);
  }

  // `porter train` on the demo config for 2 steps, from the repository root (its data paths
  // are relative to it): the page and the report.
  void train_page(const std::vector<std::string>& more = {}) {
    const fs::path cwd = fs::current_path();
    fs::current_path(PORTER_SOURCE_DIR);
    std::vector<std::string> args = {"train", "--config", "examples/gpt-tiny.json", "--steps", "2",
                                     "--memory-page", page_.string(), "--report",
                                     report_.string()};
    args.insert(args.end(), more.begin(), more.end());
    const testing::CliRun r = testing::porter(args);
    fs::current_path(cwd);
    ASSERT_EQ(r.rc, 0) << r.err;
    ASSERT_TRUE(testing::contains(r.out, "memory page: " + page_.string())) << r.out;
  }

  // Runs headless Chromium on the page with `flags`; its stdout.
  std::string browse(const std::vector<std::string>& flags, const std::string& page) {
    const fs::path profile = dir_ / ("profile" + std::to_string(runs_++));
    std::string cmd = "timeout 120 " + chromium() +
                      " --headless --no-sandbox --disable-gpu --disable-quic --no-first-run"
                      " --disable-background-networking --disable-component-update"
                      " --disable-sync --user-data-dir=" + profile.string();
    for (const std::string& f : flags) cmd += " " + f;
    const fs::path out = dir_ / "stdout.txt", err = dir_ / "stderr.txt";
    cmd += " 'file://" + page + "' > " + out.string() + " 2> " + err.string();
    const int rc = std::system(cmd.c_str());
    EXPECT_EQ(rc, 0) << cmd << "\n" << read_file(err);
    return read_file(out);
  }

  fs::path dir_;
  fs::path page_, report_;
  int runs_ = 0;
};

TEST_F(MemoryPageBrowser, ScriptDrawsTheReportsMeasuredPeak) {
  train_page();
  const std::string dom = browse({"--dump-dom"}, page_.string());
  ASSERT_EQ(body_attribute(dom, "data-status"), "ok") << dom.substr(0, 2000);
  const nlohmann::json report = nlohmann::json::parse(read_file(report_));
  EXPECT_EQ(body_attribute(dom, "data-drawn-peak-bytes"),
            std::to_string(report["memory"]["peak_bytes"].get<size_t>()));
  // The script's chart replaced the static one, and drew the checkpoints and the peak table.
  EXPECT_NE(dom.find("id=\"chart-live\""), std::string::npos);
  EXPECT_EQ(dom.find("id=\"chart-static\""), std::string::npos);
  EXPECT_NE(dom.find("id=\"lanes-svg\""), std::string::npos);
  EXPECT_NE(dom.find("<table class=\"peak\">"), std::string::npos);
  EXPECT_EQ(body_attribute(dom, "data-clipped"), "");
}

// The page's data, from its JSON island.
nlohmann::json page_json(const std::string& html) {
  const std::string open = R"(<script type="application/json" id="porter-data">)";
  const size_t begin = html.find(open);
  if (begin == std::string::npos) return nullptr;
  const size_t end = html.find("</script>", begin);
  return nlohmann::json::parse(html.substr(begin + open.size(), end - begin - open.size()));
}

// Every text of every chart lies inside its SVG, as the browser lays it out (the page's
// script measures each text's box against its SVG's view box): with two micro-batches and
// the full policy (every stage holds its input) the checkpoint lanes are named
// "embedding #0", ..., right-aligned left of the time axis. The drawn y-axis is the data's.
TEST_F(MemoryPageBrowser, LabelsAreNotClipped) {
  train_page({"--set", "gradient_accumulation_steps=2", "--set",
              "porter.checkpointing={\"policy\": \"full\"}"});
  const nlohmann::json data = page_json(read_file(page_));
  ASSERT_TRUE(data.is_object());
  bool long_name = false;
  for (const auto& life : data["checkpoints"]) long_name |= life["name"] == "embedding";
  ASSERT_TRUE(long_name) << data["checkpoints"].dump();
  const std::string dom = browse({"--window-size=1400,900", "--dump-dom"}, page_.string());
  ASSERT_EQ(body_attribute(dom, "data-status"), "ok") << dom.substr(0, 2000);
  EXPECT_NE(dom.find(">embedding #0</text>"), std::string::npos);
  EXPECT_EQ(body_attribute(dom, "data-clipped"), "");
  const double y_max = data["chart"]["y_max_bytes"].get<double>();
  EXPECT_EQ(std::stod(body_attribute(dom, "data-y-max-bytes")), y_max);
}

// A step that runs out of memory (Note [Out-of-memory page] in cli/memory_page.h): its page
// loads, draws the failure and names the request. --no-preflight lets the step run out.
TEST_F(MemoryPageBrowser, OutOfMemoryPage) {
  const fs::path cfg = dir_ / "oom.json";
  std::ofstream(cfg) << R"({
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "porter": {
      "model": {"layers": 2, "hidden": 32, "heads": 2, "seq_len": 16, "vocab": 64},
      "data": {"type": "synthetic", "seed": 3},
      "device": {"type": "cpu", "memory_limit": "560KiB", "threads": 1},
      "checkpointing": {"policy": "none"},
      "train": {"steps": 3}
    }
  })";
  const testing::CliRun r =
      testing::porter({"train", "--no-preflight", "--config", cfg.string(), "--memory-page",
                       page_.string()});
  ASSERT_EQ(r.rc, 3) << r.err;
  ASSERT_TRUE(testing::contains(r.err, "memory page of the failed step: " + page_.string()))
      << r.err;
  const nlohmann::json data = page_json(read_file(page_));
  ASSERT_TRUE(data["failure"].is_object());
  const std::string dom = browse({"--window-size=1400,900", "--dump-dom"}, page_.string());
  ASSERT_EQ(body_attribute(dom, "data-status"), "ok") << dom.substr(0, 2000);
  EXPECT_EQ(body_attribute(dom, "data-clipped"), "");
  EXPECT_NE(dom.find("<section id=\"failure-section\">"), std::string::npos)
      << "the failure section is hidden";
  EXPECT_NE(dom.find("class=\"failed-request\""), std::string::npos);
  EXPECT_NE(dom.find(">Live at the failure ("), std::string::npos);
  EXPECT_NE(dom.find("<td>category</td><td>activations</td>"), std::string::npos);
  EXPECT_NE(dom.find(std::to_string(data["failure"]["requested_bytes"].get<size_t>()) + " bytes)"),
            std::string::npos);
}

TEST_F(MemoryPageBrowser, Screenshot) {
  train_page();
  const fs::path png = PORTER_MEMORY_PAGE_SCREENSHOT;
  fs::remove(png);
  browse({"--screenshot=" + png.string(), "--window-size=1400,900", "--hide-scrollbars"},
         page_.string());
  ASSERT_TRUE(fs::exists(png)) << png;
  const std::string bytes = read_file(png);
  ASSERT_GT(bytes.size(), 24u);
  EXPECT_EQ(bytes.substr(1, 3), "PNG");
  auto be32 = [&](size_t at) {
    uint32_t v = 0;
    for (size_t i = 0; i < 4; ++i) v = v << 8 | static_cast<unsigned char>(bytes[at + i]);
    return v;
  };
  EXPECT_EQ(be32(16), 1400u);  // IHDR width
  EXPECT_EQ(be32(20), 900u);   // and height
  // A blank 1400 x 900 page compresses to a few KiB; a chart does not.
  EXPECT_GT(bytes.size(), size_t{40} << 10);
}

// Note [Scripts off in headless Chromium]
// --blink-settings=scriptEnabled=false is how a browser runs with scripts off, but headless
// Chromium (156) then returns nothing for --dump-dom and writes no --screenshot: both are
// taken through script evaluation. So the page is loaded twice: with scriptEnabled=false (it
// must load: exit 0), and as a copy whose Content-Security-Policy forbids every script, which
// blocks the page's own script exactly as a browser with scripts off would while the dump
// still works.
TEST_F(MemoryPageBrowser, StaticChartWithScriptsOff) {
  train_page();
  browse({"--blink-settings=scriptEnabled=false", "--dump-dom"}, page_.string());
  std::string html = read_file(page_);
  const size_t head = html.find("<head>");
  ASSERT_NE(head, std::string::npos);
  html.insert(head + 6,
              R"(<meta http-equiv="Content-Security-Policy" content="script-src 'none'">)");
  const fs::path blocked = dir_ / "no-script.html";
  std::ofstream(blocked) << html;
  const std::string dom = browse({"--dump-dom"}, blocked.string());
  EXPECT_EQ(body_attribute(dom, "data-status"), "static");
  EXPECT_NE(dom.find("<svg id=\"chart-static\""), std::string::npos) << dom.substr(0, 2000);
  EXPECT_NE(dom.find("<path class=\"area cat-activations\""), std::string::npos);
  EXPECT_NE(dom.find("<path class=\"predicted\""), std::string::npos);
  EXPECT_NE(dom.find("<line class=\"capacity\""), std::string::npos);
}

// page.html#probe-peak hovers the drawn peak from the page's own script.
TEST_F(MemoryPageBrowser, HoverNamesCategoriesAndPhase) {
  train_page();
  const fs::path probe = dir_ / "probe.html";
  fs::copy_file(page_, probe);
  const std::string dom = browse({"--window-size=1400,900", "--dump-dom"}, probe.string() +
                                 "#probe-peak");
  ASSERT_EQ(body_attribute(dom, "data-status"), "ok");
  const std::string tip = body_attribute(dom, "data-probe");
  for (const char* part : {"phase", "activations", "params", "measured total", "predicted",
                           "capacity80.0 MiB"}) {
    EXPECT_TRUE(testing::contains(tip, part)) << part << " not in: " << tip;
  }
}

TEST_F(MemoryPageBrowser, PlanPageDrawsThePrediction) {
  page_ = dir_ / "plan.html";
  const fs::path cwd = fs::current_path();
  fs::current_path(PORTER_SOURCE_DIR);
  const testing::CliRun r = testing::porter(
      {"plan", "--config", "examples/gpt-tiny.json", "--memory-page", page_.string()});
  fs::current_path(cwd);
  ASSERT_EQ(r.rc, 0) << r.err;
  const std::string dom = browse({"--dump-dom"}, page_.string());
  ASSERT_EQ(body_attribute(dom, "data-status"), "ok") << dom.substr(0, 2000);
  EXPECT_EQ(body_attribute(dom, "data-drawn-peak-bytes"), "0");  // nothing measured
  EXPECT_NE(dom.find("class=\"predicted\""), std::string::npos);
  EXPECT_NE(dom.find("id=\"lanes-svg\""), std::string::npos);
}

}  // namespace
}  // namespace porter::cli
