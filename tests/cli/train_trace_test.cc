// Note [Train trace]: ranks hand their events to rank 0 through the store, in chunks, and rank
// 0 writes one file with every kept rank as a process on its clock.
#include "cli/train_trace.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <string>

#include "comm/communicator.h"
#include "tests/cli/trace_schema.h"

namespace porter::cli {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// Two thread ranks, each with a recorder of `spans_per_rank` spans; rank 0 writes `path`.
void share_two_ranks(const fs::path& path, std::optional<int> only_rank, int spans_per_rank) {
  auto errors = comm::run_thread_ranks(2, [&](int rank, std::shared_ptr<comm::Store> store) {
    engine::TraceRecorder trace;
    const int64_t sync_us = sync_trace_clock(nullptr, trace);
    for (int i = 0; i < spans_per_rank; ++i) {
      trace.span({"step " + std::to_string(i), "step", "compute", sync_us + 10 * i, 5, i});
    }
    TraceShare share{store.get(), rank, 2, only_rank, comm::Seconds{20}};
    share.chunk_bytes = 100;  // many chunks
    share_trace(share, trace, sync_us, path.string());
  });
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

json read(const fs::path& p) {
  std::ifstream in(p);
  return json::parse(in);
}

class TrainTrace : public ::testing::Test {
 protected:
  void SetUp() override {
    // One directory per test: ctest runs this fixture's tests at the same time.
    dir_ = fs::temp_directory_path() /
           ("porter_train_trace_" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
};

TEST_F(TrainTrace, EveryRanksEventsInOneFileThroughChunks) {
  const fs::path path = dir_ / "t.json";
  share_two_ranks(path, std::nullopt, 40);
  const json j = read(path);
  EXPECT_EQ(testing::trace_schema_errors(j), std::vector<std::string>{});
  std::map<int, int> spans;  // pid -> spans
  std::map<int, int64_t> first_ts;
  for (const json& e : j["traceEvents"]) {
    if (e["ph"] != "X") continue;
    ++spans[e["pid"]];
    if (e["name"] == "step 0") first_ts[e["pid"]] = e["ts"];
  }
  EXPECT_EQ(spans, (std::map<int, int>{{1, 40}, {2, 40}}));
  // Both ranks put step 0 at their own sync time: on rank 0's clock they coincide.
  EXPECT_EQ(first_ts[1], first_ts[2]);
}

TEST_F(TrainTrace, TraceRankKeepsOneRankUnderItsOwnPid) {
  const fs::path path = dir_ / "t1.json";
  share_two_ranks(path, 1, 3);
  const json j = read(path);
  EXPECT_EQ(testing::trace_schema_errors(j), std::vector<std::string>{});
  std::set<int> pids;
  for (const json& e : j["traceEvents"]) pids.insert(e["pid"].get<int>());
  EXPECT_EQ(pids, std::set<int>{2});
}

TEST(TraceSchema, CatchesWhatViewersRefuse) {
  const json bad = json::parse(R"({"traceEvents": [
      {"name": "a", "ph": "X", "pid": 1, "tid": 1, "ts": 0, "dur": -1},
      {"name": "b", "ph": "B", "pid": 1, "tid": 1, "ts": 0},
      {"name": "c", "ph": "C", "pid": 2, "tid": 1, "ts": "0", "args": {"x": "y"}}]})");
  const std::vector<std::string> errors = testing::trace_schema_errors(bad);
  ASSERT_EQ(errors.size(), 6u);
  EXPECT_NE(errors[0].find(": dur"), std::string::npos) << errors[0];
  EXPECT_NE(errors[1].find(": ph"), std::string::npos) << errors[1];
  EXPECT_NE(errors[2].find(": ts"), std::string::npos) << errors[2];
  EXPECT_NE(errors[3].find(": counter value x"), std::string::npos) << errors[3];
  EXPECT_EQ(errors[4], "pid 1 has no process_name");
  EXPECT_EQ(errors[5], "pid 2 has no process_name");
}

}  // namespace
}  // namespace porter::cli
