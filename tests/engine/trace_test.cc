// TraceRecorder: Chrome Trace Event JSON with lanes, spans, counters; dropped events;
// ScopedSpan timing; atomic file writes; several ranks merged into one file.
#include "engine/trace.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "base/error.h"

namespace porter::engine {
namespace {

using nlohmann::json;

json to_json(const TraceRecorder& r) {
  std::ostringstream s;
  r.write_json(s);
  return json::parse(s.str());
}

TEST(Trace, SpansCountersAndLanes) {
  TraceRecorder r;
  r.span({"forward block.0", "forward", "compute", 10, 5, 1, 1, 0});
  r.span({"d2h block.0", "d2h", "d2h", 12, 3, 1, 1, 0, {{"bytes", 4096.0}}});
  r.span({"custom", "misc", "mylane", 20, 1});
  r.counter({"memory", 15, {{"activations", 1024.0}, {"checkpoints", 8.0}}});
  json j = to_json(r);
  EXPECT_EQ(j["displayTimeUnit"], "ms");
  EXPECT_EQ(j["otherData"]["dropped_events"], 0);
  std::map<std::string, int> tids;
  int spans = 0, counters = 0;
  for (const json& e : j["traceEvents"]) {
    if (e["ph"] == "M" && e["name"] == "thread_name") tids[e["args"]["name"]] = e["tid"];
    if (e["ph"] == "X") ++spans;
    if (e["ph"] == "C") {
      ++counters;
      EXPECT_EQ(e["name"], "memory");
      EXPECT_EQ(e["ts"], 15);
      EXPECT_EQ(e["args"]["activations"], 1024.0);
      EXPECT_EQ(e["args"]["checkpoints"], 8.0);
    }
  }
  EXPECT_EQ(spans, 3);
  EXPECT_EQ(counters, 1);
  EXPECT_EQ(tids["compute"], 1);
  EXPECT_EQ(tids["d2h"], 2);
  EXPECT_EQ(tids["h2d"], 3);
  EXPECT_EQ(tids["comm"], 4);
  EXPECT_EQ(tids["mylane"], 5);
  for (const json& e : j["traceEvents"]) {
    if (e["ph"] == "X" && e["name"] == "forward block.0") {
      EXPECT_EQ(e["cat"], "forward");
      EXPECT_EQ(e["tid"], 1);
      EXPECT_EQ(e["ts"], 10);
      EXPECT_EQ(e["dur"], 5);
      EXPECT_EQ(e["args"]["step"], 1);
      EXPECT_EQ(e["args"]["stage"], 1);
      EXPECT_EQ(e["args"]["micro_batch"], 0);
    }
    if (e["ph"] == "X" && e["name"] == "d2h block.0") {
      EXPECT_EQ(e["tid"], 2);
      EXPECT_EQ(e["args"]["bytes"], 4096.0);
      EXPECT_EQ(e["args"]["stage"], 1);
    }
    if (e["ph"] == "X" && e["name"] == "custom") {
      EXPECT_FALSE(e["args"].contains("step"));
    }
  }
}

TEST(Trace, EventsBeyondTheLimitAreCounted) {
  TraceRecorder r(3);
  for (int i = 0; i < 5; ++i) r.span({"s", "step", "compute", i, 1});
  r.counter({"memory", 1, {{"x", 1.0}}});
  EXPECT_EQ(r.spans().size(), 3u);
  EXPECT_EQ(r.counters().size(), 0u);
  EXPECT_EQ(r.dropped(), 3u);
  EXPECT_EQ(to_json(r)["otherData"]["dropped_events"], 3);
}

TEST(Trace, ScopedSpanMeasuresItsScope) {
  TraceRecorder r;
  {
    ScopedSpan s(&r, {"optimizer", "optimizer", "compute", 0, 0, 4});
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  { ScopedSpan none(nullptr, {"ignored", "x", "compute"}); }
  auto spans = r.spans();
  ASSERT_EQ(spans.size(), 1u);
  EXPECT_EQ(spans[0].name, "optimizer");
  EXPECT_EQ(spans[0].step, 4);
  EXPECT_GE(spans[0].dur_us, 2000);
  EXPECT_LE(spans[0].start_us + spans[0].dur_us, r.now_us());
}

TEST(Trace, WriteFileIsAtomicAndParses) {
  namespace fs = std::filesystem;
  fs::path dir = fs::temp_directory_path() / "porter_trace_test";
  fs::remove_all(dir);
  fs::create_directories(dir);
  TraceRecorder r;
  r.span({"step", "step", "compute", 0, 100, 1});
  const fs::path file = dir / "trace.json";
  r.write_file(file.string());
  std::ifstream in(file);
  json j = json::parse(in);
  EXPECT_TRUE(j["traceEvents"].is_array());
  // Nothing but the trace is left in the directory.
  int entries = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator(dir)) ++entries;
  EXPECT_EQ(entries, 1);
  EXPECT_THROW(r.write_file((dir / "no-such-dir" / "t.json").string()), IoError);
}

TEST(Trace, TextArgsAndTheRanksProcess) {
  TraceRecorder r;
  r.span({"all_gather params", "comm", "comm", 3, 2, 0, -1, -1, {{"bytes", 8.0}},
          {{"group", "dp"}, {"bucket", "params"}}});
  const json j = to_json(r);
  std::map<std::string, json> meta;
  for (const json& e : j["traceEvents"]) {
    EXPECT_EQ(e["pid"], 1);  // rank 0
    if (e["ph"] == "M") meta[e["name"]] = e;
    if (e["ph"] == "X") {
      EXPECT_EQ(e["tid"], 4);  // the comm lane
      EXPECT_EQ(e["args"]["group"], "dp");
      EXPECT_EQ(e["args"]["bucket"], "params");
      EXPECT_EQ(e["args"]["bytes"], 8.0);
    }
  }
  EXPECT_EQ(meta["process_name"]["args"]["name"], "rank 0");
  EXPECT_EQ(meta["process_sort_index"]["args"]["sort_index"], 0);
}

TEST(Trace, RanksMergeIntoOneFileWithShiftedClocks) {
  TraceRecorder r0, r1;
  r0.span({"step 0", "step", "compute", 100, 50, 0});
  r1.span({"step 0", "step", "compute", 40, 60, 0});
  r1.span({"reduce_scatter bucket 0", "comm", "comm", 45, 5, 0});
  r1.counter({"memory", 41, {{"requested", 7.0}}});
  std::ostringstream s;
  merge_trace_json(s, {{0, r0.events_json(0), 0, 2}, {1, r1.events_json(1), 70, 3}});
  const json j = json::parse(s.str());
  EXPECT_EQ(j["otherData"]["dropped_events"], 5);
  std::map<int, std::string> names;
  std::map<int, int> sort_index;
  std::map<std::pair<int, std::string>, int> spans;  // (pid, name) -> ts
  int rank1_tids = 0;
  for (const json& e : j["traceEvents"]) {
    const int pid = e["pid"];
    if (e["name"] == "process_name") names[pid] = e["args"]["name"];
    if (e["name"] == "process_sort_index") sort_index[pid] = e["args"]["sort_index"];
    if (e["ph"] == "X") spans[{pid, e["name"]}] = e["ts"];
    if (e["ph"] == "C") {
      EXPECT_EQ(pid, 2);
      EXPECT_EQ(e["ts"], 111);
    }
    if (pid == 2 && e["name"] == "thread_name") {
      ++rank1_tids;
      EXPECT_GT(e["tid"].get<int>(), kTraceLaneStride);  // no tid shared with rank 0
    }
    if (e["ph"] == "M") {
      EXPECT_EQ(e["ts"], 0);
    }
  }
  EXPECT_EQ(names, (std::map<int, std::string>{{1, "rank 0"}, {2, "rank 1"}}));
  EXPECT_EQ(sort_index, (std::map<int, int>{{1, 0}, {2, 1}}));
  EXPECT_EQ(rank1_tids, 4);
  EXPECT_EQ((spans[{1, "step 0"}]), 100);
  EXPECT_EQ((spans[{2, "step 0"}]), 110);
  EXPECT_EQ((spans[{2, "reduce_scatter bucket 0"}]), 115);
}

TEST(Trace, AMergeWithEarlierEventsMovesTheFileLaterAndRefusesBrokenEvents) {
  TraceRecorder r0, r1;
  r0.span({"a", "step", "compute", 10, 1});
  r1.span({"b", "step", "compute", 10, 1});
  std::ostringstream s;
  merge_trace_json(s, {{0, r0.events_json(0), 0, 0}, {1, r1.events_json(1), -30, 0}});
  std::map<std::string, int> ts;
  const json j = json::parse(s.str());
  for (const json& e : j["traceEvents"]) {
    if (e["ph"] == "X") ts[e["name"]] = e["ts"];
  }
  EXPECT_EQ(ts["a"], 30);
  EXPECT_EQ(ts["b"], 0);
  std::ostringstream bad;
  const std::string cut = r1.events_json(1).substr(0, 20);
  EXPECT_THROW(merge_trace_json(bad, {{1, cut, 0, 0}}), InvalidArgument);
}

}  // namespace
}  // namespace porter::engine
