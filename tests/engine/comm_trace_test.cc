// The comm lane of a data-parallel run (Note [Comm trace]): every collective of a 2-rank ZeRO
// run is a span on both ranks, inside its step, labelled by what it is for, and its bytes add
// up to the step's StepResult::zero.comm_bytes.
#include <gtest/gtest.h>

#include <map>
#include <set>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "engine_test_util.h"

namespace porter::engine {
namespace {

using namespace porter::engine::testing;

config::Config zero_config(int stage, int64_t accumulation) {
  config::Config c = tiny_config(config::CheckpointPolicy::kNone, 0.0, accumulation);
  c.world_size = 2;
  c.train_batch_size = c.train_micro_batch_size_per_gpu * accumulation * 2;
  c.porter.comm.timeout_s = 20.0;
  c.zero_optimization.stage = stage;
  c.zero_optimization.reduce_bucket_size_elems = 8000;  // several buckets
  c.zero_optimization.overlap_comm = true;
  return c;
}

struct RankTrace {
  std::vector<StepResult> steps;
  std::vector<TraceSpan> spans;
};

// Runs `steps` steps on 2 thread ranks, each with its own recorder; the first `untraced`
// steps run before the recorder is attached.
std::vector<RankTrace> run_traced(const config::Config& c, int steps, int untraced = 0) {
  std::vector<RankTrace> out(2);
  auto errors = comm::run_thread_ranks(2, [&](int rank, std::shared_ptr<comm::Store> store) {
    auto device = cpu_device();
    comm::CommOptions o;
    o.group_name = "dp";
    o.timeout = comm::Seconds{c.porter.comm.timeout_s};
    auto dp = std::shared_ptr<comm::Communicator>(
        comm::make_communicator(*device, store, rank, 2, o));
    Engine e(*device, std::make_unique<TransformerModel>(c.porter.model), c, data_parallel(dp));
    TraceRecorder trace;
    const io::DataSource data(c.porter.data, c.porter.model.vocab, c.train_micro_batch_size_per_gpu,
                          c.porter.model.seq_len);
    RankTrace& mine = out[static_cast<size_t>(rank)];
    for (int s = 0; s < steps; ++s) {
      if (s == untraced) e.set_trace(&trace);
      mine.steps.push_back(
          e.train_step(data.rank_batches(s, c.gradient_accumulation_steps, rank, 2)));
    }
    mine.spans = trace.spans();
  });
  for (auto& err : errors) {
    if (err) std::rethrow_exception(err);
  }
  return out;
}

double arg(const TraceSpan& s, const std::string& key) {
  for (const auto& [k, v] : s.args) {
    if (k == key) return v;
  }
  ADD_FAILURE() << s.name << " has no arg " << key;
  return -1;
}

std::string text_arg(const TraceSpan& s, const std::string& key) {
  for (const auto& [k, v] : s.text_args) {
    if (k == key) return v;
  }
  return "(none)";
}

TEST(CommTrace, EveryCollectiveOfAZero2StepIsASpanOnTheCommLane) {
  const config::Config c = zero_config(2, 2);
  constexpr int kSteps = 3;
  const std::vector<RankTrace> ranks = run_traced(c, kSteps);
  for (int rank = 0; rank < 2; ++rank) {
    const RankTrace& rt = ranks[static_cast<size_t>(rank)];
    std::map<int64_t, uint64_t> bytes_per_step;
    std::map<int64_t, std::pair<int64_t, int64_t>> step_extent;
    std::set<std::string> labels;
    int comm_spans = 0;
    for (const TraceSpan& s : rt.spans) {
      if (s.category == "step") step_extent[s.step] = {s.start_us, s.start_us + s.dur_us};
    }
    for (const TraceSpan& s : rt.spans) {
      if (s.lane != "comm") continue;
      ++comm_spans;
      EXPECT_EQ(s.category, "comm");
      EXPECT_EQ(text_arg(s, "group"), "dp");
      EXPECT_EQ(text_arg(s, "type"), "f32");
      EXPECT_GE(s.dur_us, 0);
      ASSERT_TRUE(step_extent.count(s.step)) << s.name;
      // The op ran on the comm stream inside its step.
      EXPECT_GE(s.start_us, step_extent[s.step].first) << s.name;
      EXPECT_LE(s.start_us + s.dur_us, step_extent[s.step].second) << s.name;
      const std::string label = text_arg(s, "bucket");
      labels.insert(label.rfind("bucket ", 0) == 0 ? "bucket" : label);
      EXPECT_EQ(s.name, text_arg(s, "op") + " " + label);
      bytes_per_step[s.step] += static_cast<uint64_t>(arg(s, "bytes"));
      if (text_arg(s, "op") == "all_gather") {
        EXPECT_EQ(label, "params");
        EXPECT_EQ(arg(s, "count"), static_cast<double>(rt.steps[0].zero.shard_elems));
      }
    }
    EXPECT_GT(comm_spans, 3 * kSteps) << "rank " << rank;
    EXPECT_EQ(labels, (std::set<std::string>{"bucket", "grad norm", "params"}));
    ASSERT_EQ(bytes_per_step.size(), static_cast<size_t>(kSteps));
    for (int s = 0; s < kSteps; ++s) {
      EXPECT_GT(rt.steps[static_cast<size_t>(s)].zero.comm_bytes, 0u);
      EXPECT_EQ(bytes_per_step[s], rt.steps[static_cast<size_t>(s)].zero.comm_bytes)
          << "rank " << rank << " step " << s;
    }
  }
}

TEST(CommTrace, StageZeroAllReducesTheBucketsAndStepsBeforeTheTraceLeaveNoSpans) {
  const config::Config c = zero_config(0, 1);
  const std::vector<RankTrace> ranks = run_traced(c, 3, /*untraced=*/1);
  for (const RankTrace& rt : ranks) {
    std::map<int64_t, uint64_t> bytes_per_step;
    for (const TraceSpan& s : rt.spans) {
      if (s.lane != "comm") continue;
      EXPECT_EQ(text_arg(s, "op"), "all_reduce") << s.name;
      EXPECT_EQ(text_arg(s, "bucket").rfind("bucket ", 0), 0u) << s.name;
      bytes_per_step[s.step] += static_cast<uint64_t>(arg(s, "bytes"));
    }
    ASSERT_EQ(bytes_per_step.size(), 2u);
    EXPECT_FALSE(bytes_per_step.count(0));
    EXPECT_EQ(bytes_per_step[1], rt.steps[1].zero.comm_bytes);
    EXPECT_EQ(bytes_per_step[2], rt.steps[2].zero.comm_bytes);
  }
}

}  // namespace
}  // namespace porter::engine
