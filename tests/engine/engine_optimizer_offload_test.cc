// Optimizer offload through the Engine (Note [Optimizer offload] in zero/sharded_optimizer.h):
// the master weights and moments live in host memory and AdamW runs there (zero::CpuAdam,
// bitwise the device kernel), so a run with the optimizer offloaded is bitwise one without,
// at every stage that partitions the optimizer, and the device holds no optimizer bytes.
#include <filesystem>
#include <unistd.h>

#include <gtest/gtest.h>

#include "base/error.h"
#include "comm/communicator.h"
#include "engine_test_util.h"
#include "memory/pinned_pool.h"
#include "kernels/kernels.h"
#include "zero/partition.h"
#include "zero/sharded_optimizer.h"

namespace porter::engine {
namespace {

using namespace porter::engine::testing;

config::Config off_config(int world_size, int stage, bool offload, int64_t gas = 1) {
  config::Config c = offload_config(world_size, stage, gas);
  if (offload) c.zero_optimization.offload_optimizer.device = config::OffloadDevice::kCpu;
  return c;
}

using RankRun = DpRankRun;

// Gradient clipping is on (offload_config) and clips in these runs; "fp16 overflow" starts at a
// loss scale of 2^22, so the first step overflows and is skipped on every rank, from the
// host's overflow count when the gradients stream (Note [Streamed gradients]).
TEST(EngineOptimizerOffload, BitwiseTheRunWithoutOffloadAtEveryStageAndPrecision) {
  struct Case {
    int ws, stage;
    int64_t gas;
    const char* precision;
    double ratio = 1.0;
  };
  for (const Case& k : {Case{1, 1, 1, "f32"}, Case{2, 1, 1, "f32"}, Case{2, 2, 2, "f32"},
                        Case{2, 3, 1, "f32"}, Case{2, 2, 1, "bf16"}, Case{2, 3, 2, "bf16"},
                        Case{2, 2, 1, "fp16"}, Case{1, 2, 2, "bf16"}, Case{1, 2, 4, "f32"},
                        Case{2, 3, 4, "fp16 overflow"}, Case{2, 3, 1, "bf16", 0.5},
                        Case{1, 3, 4, "bf16"}, Case{2, 2, 2, "bf16 grads"},
                        Case{1, 3, 2, "bf16 grads"}}) {
    const std::string precision = k.precision;
    const std::string what = "ws " + std::to_string(k.ws) + " stage " + std::to_string(k.stage) +
                             " gas " + std::to_string(k.gas) + " " + precision + " ratio " +
                             std::to_string(k.ratio);
    config::Config c = off_config(k.ws, k.stage, false, k.gas);
    if (precision.starts_with("bf16")) c.bf16.enabled = true;
    if (precision == "bf16 grads") {  // Note [Gradient dtype]: kept, reduced and streamed in bf16
      c.data_types.grad_accum_dtype = config::GradDType::kBf16;
    }
    if (precision.starts_with("fp16")) {
      c.fp16.enabled = true;
      c.fp16.loss_scale = 0.0;
      c.fp16.initial_scale_power = precision == "fp16" ? 8 : 22;
    }
    const std::vector<RankRun> device = run_dp_ranks(c, 3);
    c.zero_optimization.offload_optimizer.device = config::OffloadDevice::kCpu;
    c.zero_optimization.offload_optimizer.ratio = k.ratio;
    const std::vector<RankRun> host = run_dp_ranks(c, 3);
    expect_bitwise_runs(host, device, what);
    const bool streamed = k.stage >= 2 && k.ratio == 1.0;
    for (const RankRun& r : host) {
      const uint64_t g = precision == "bf16 grads" ? 2 : 4;
      const uint64_t shard_bytes = static_cast<uint64_t>(r.total.shard_elems) * g;
      if (k.ratio == 1.0) {
        // nothing of the optimizer on the device
        EXPECT_EQ(r.current(memory::Category::kOptimizer), 0u) << what;
      }
      EXPECT_GT(r.total.offload_host_bytes, 0u) << what;
      EXPECT_GE(r.pinned_bytes, r.total.offload_host_bytes) << what;  // pinned by default
      if (streamed) {
        // Note [Streamed gradients]: no gradient shard on the device, ever; every micro-batch's
        // reduced parts went down during backward.
        EXPECT_EQ(r.peak(memory::Category::kGrads), 0u) << what;
        EXPECT_EQ(r.total.offload_d2h_bytes, 3 * static_cast<uint64_t>(k.gas) * shard_bytes) << what;
        EXPECT_EQ(r.total.offload_d2h_overlapped_bytes, r.total.offload_d2h_bytes) << what;
      } else {
        const uint64_t host_part = static_cast<uint64_t>(
            zero::offloaded_elems(r.total.shard_elems, k.ratio)) * 4;
        EXPECT_EQ(r.total.offload_d2h_bytes, 3 * host_part) << what;
        // Note [Ready gradients]: the buckets reduced during backward went down then; with
        // several ranks and overlap_comm only the last two buckets in flight are left.
        EXPECT_LE(r.total.offload_d2h_overlapped_bytes, r.total.offload_d2h_bytes) << what;
        if (k.ws > 1) EXPECT_GT(r.total.offload_d2h_overlapped_bytes, 0u) << what;
        EXPECT_GT(r.peak(memory::Category::kGrads), 0u) << what;
      }
      EXPECT_EQ(r.memory.predicted_host_state.total(), r.memory.host_state.total()) << what;
      EXPECT_GT(r.total.offload_cpu_update_s, 0.0) << what;
      if (precision == "fp16 overflow") {  // some steps overflowed and were skipped, not all
        EXPECT_LT(r.state.optimizer_steps, 3) << what;
      }
    }
    for (const RankRun& r : device) EXPECT_GT(r.current(memory::Category::kOptimizer), 0u) << what;
  }
}

TEST(EngineOptimizerOffload, HostStateIsTheShardFormulaAndPageableWithoutPinMemory) {
  config::Config c = off_config(2, 2, true);
  c.bf16.enabled = true;
  const std::vector<RankRun> pinned = run_dp_ranks(c, 1);
  // master + m + v + the gradient shard (f32) + the working copy (bf16), per shard element,
  // each array at the pinned pool's granularity (Note [Host-state bytes per rank]).
  const zero::Partition part = zero::make_partition(pinned[0].total.padded_elems, 2);
  EXPECT_EQ(pinned[0].total.offload_host_bytes,
            zero::host_state_bytes(part, 2, zero::StateDTypes{tensor::DType::kBF16}, true, false,
                                   true, true)
                .total());
  c.zero_optimization.offload_optimizer.pin_memory = false;
  const std::vector<RankRun> pageable = run_dp_ranks(c, 1);
  // Stage 2 streams the gradients (Note [Streamed gradients]): the shard's f32 copy is the only
  // one, beside its staging block of min(S, 2^20) values.
  const auto s = static_cast<size_t>(pinned[0].total.shard_elems);
  EXPECT_EQ(pageable[0].total.offload_host_bytes,
            s * (4 + 4 + 4 + 4 + 2) + std::min<size_t>(s, zero::kGradStagingElems) * 4);
  // The report's measured figure is what the pool holds (nothing else is pinned here).
  EXPECT_EQ(pinned[0].memory.host_state.total(), pinned[0].pinned_bytes);
  EXPECT_EQ(pinned[0].memory.host_state.total(), pinned[0].memory.predicted_host_state.total());
  EXPECT_GE(pinned[0].total.offload_host_bytes, pageable[0].total.offload_host_bytes);
  EXPECT_LT(pageable[0].pinned_bytes, pinned[0].total.offload_host_bytes);
  expect_bitwise_runs(pageable, pinned, "pageable vs pinned");
}

// Note [Host-state bytes per rank]: what is measured is the pinned pool's blocks, not the
// prediction's rounding. A pool that caches a block three granules larger than an f32 array
// hands it to the first array (the master), and the optimizer reports that block.
TEST(EngineOptimizerOffload, MeasuredHostBytesAreThePinnedPoolsBlocks) {
  auto device = cpu_device();
  memory::CachingAllocator alloc(*device);
  auto kernels = kernels::make_kernels(alloc);
  nn::ParamLayout layout;
  layout.add("", {{"w", tensor::Shape{5000}}, {"b", tensor::Shape{30}}});
  const zero::Partition part = zero::make_partition(layout.total_elems(), 1);
  nn::FlatParams flat(alloc, layout, tensor::DType::kF32, tensor::DType::kF32, part.padded_elems,
                      /*allocate_grads=*/false);
  zero::OptimizerOptions o;
  o.zero_stage = 1;
  o.offload.enabled = true;
  o.offload.threads = 1;
  const zero::HostStateBytes predicted = zero::host_state_bytes(
      part, 1, zero::StateDTypes{tensor::DType::kF32}, true, false, true, true);
  constexpr size_t g = memory::PinnedPool::kGranularity;
  const size_t array = (static_cast<size_t>(part.padded_elems) * 4 + g - 1) / g * g;
  memory::PinnedPool pool(*device);
  pool.allocate(array + 3 * g).reset();
  zero::ShardedOptimizer opt(flat, *kernels, alloc, nullptr, part, o, &pool);
  EXPECT_EQ(pool.stats().num_reused, 1u);
  const zero::HostStateBytes measured = opt.host_state();
  EXPECT_EQ(measured.optimizer, predicted.optimizer + 3 * g);
  EXPECT_EQ(measured.grads, predicted.grads);
  EXPECT_EQ(measured.params, predicted.params);
  EXPECT_EQ(measured.total(), pool.stats().in_use_bytes);
}

TEST(EngineOptimizerOffload, TheHostUpdateHasItsOwnTraceLane) {
  config::Config c = off_config(1, 2, true);
  auto device = cpu_device();
  auto e = gpt_engine(*device, c);
  TraceRecorder trace;
  e->set_trace(&trace);
  e->train_step(batches(c, 0));
  e->train_step(batches(c, 1));
  int host = 0;
  for (const TraceSpan& s : trace.spans()) {
    if (s.lane != "host optimizer") continue;
    ++host;
    EXPECT_EQ(s.name, "host adamw");
    EXPECT_GT(s.dur_us, 0);
  }
  EXPECT_EQ(host, 2);  // one per step
}

TEST(EngineOptimizerOffload, APinnedLimitTooSmallIsRefusedBeforeTheFirstStep) {
  config::Config c = off_config(1, 1, true);
  c.porter.device.pinned_limit_bytes = 64 * 1024;
  auto device = cpu_device();
  const std::string msg = error_of<OutOfMemoryError>([&] { gpt_engine(*device, c); });
  EXPECT_NE(msg.find("zero_optimization.offload_optimizer"), std::string::npos) << msg;
  EXPECT_NE(msg.find("porter.device.pinned_limit"), std::string::npos) << msg;
}

TEST(EngineOptimizerOffload, SaveAndResumeAreBitIdenticalAndCheckpointsMatchWithoutOffload) {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("porter_optimizer_offload_" + std::to_string(::getpid()));
  for (bool bf16 : {false, true}) {
    std::filesystem::remove_all(dir);
    config::Config c = off_config(1, 1, true);
    c.bf16.enabled = bf16;
    const StraightRun straight = straight_and_checkpoint(c, dir);
    // Resumed with offload, and without: both continue bit-identically.
    for (bool offload : {true, false}) {
      config::Config r = c;
      if (!offload) r.zero_optimization.offload_optimizer.device = config::OffloadDevice::kNone;
      expect_resumes(r, dir, straight,
                     std::string("bf16 ") + (bf16 ? "on" : "off") + (offload ? ", offload" : ""));
    }
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace porter::engine
