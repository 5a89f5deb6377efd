// Parameter offload through the Engine (Note [Parameter offload] in zero/sharded_optimizer.h):
// at ZeRO stage 3 the rank's parameter shard lives in host memory and each gathered unit's part
// is uploaded before its broadcasts, so a run with the parameters offloaded (with or without the
// optimizer) is bitwise the run without, while the device holds no parameter shard.
#include <filesystem>
#include <unistd.h>

#include <gtest/gtest.h>

#include "base/error.h"
#include "comm/communicator.h"
#include "engine_test_util.h"
#include "faulty_device.h"
#include "zero/partition.h"

namespace porter::engine {
namespace {

using namespace porter::engine::testing;

config::Config s3_config(int world_size, int64_t gas = 1) {
  config::Config c = offload_config(world_size, 3, gas);
  c.zero_optimization.stage3_param_persistence_threshold_elems = 1000;
  return c;
}

void set_offload(config::Config& c, bool optimizer, bool params) {
  c.zero_optimization.offload_optimizer.device =
      optimizer ? config::OffloadDevice::kCpu : config::OffloadDevice::kNone;
  c.zero_optimization.offload_param.device =
      params ? config::OffloadDevice::kCpu : config::OffloadDevice::kNone;
}

using RankRun = DpRankRun;

TEST(EngineParamOffload, BitwiseTheRunWithoutOffloadWithAndWithoutTheOptimizer) {
  struct Case {
    int ws;
    int64_t gas;
    const char* precision;
  };
  for (const Case& k : {Case{1, 1, "f32"}, Case{2, 1, "f32"}, Case{2, 2, "bf16"},
                        Case{1, 2, "bf16"}, Case{2, 1, "fp16"}}) {
    const std::string base = "ws " + std::to_string(k.ws) + " gas " + std::to_string(k.gas) +
                             " " + k.precision;
    config::Config c = s3_config(k.ws, k.gas);
    if (std::string(k.precision) == "bf16") c.bf16.enabled = true;
    if (std::string(k.precision) == "fp16") {
      c.fp16.enabled = true;
      c.fp16.loss_scale = 0.0;
      c.fp16.initial_scale_power = 8;
    }
    const std::vector<RankRun> device = run_dp_ranks(c, 3);
    const tensor::DType dtype = c.bf16.enabled   ? tensor::DType::kBF16
                            : c.fp16.enabled ? tensor::DType::kF16
                                             : tensor::DType::kF32;
    for (bool optimizer : {false, true}) {
      const std::string what = base + (optimizer ? ", optimizer and params" : ", params");
      config::Config o = c;
      set_offload(o, optimizer, true);
      const std::vector<RankRun> host = run_dp_ranks(o, 3);
      expect_bitwise_runs(host, device, what);
      for (size_t r = 0; r < host.size(); ++r) {
        const RankRun& h = host[r];
        const zero::Partition part = zero::make_partition(h.total.padded_elems, k.ws);
        const size_t shard_bytes = static_cast<size_t>(part.shard_elems) * tensor::dtype_size(dtype);
        // The device lost exactly the shard: what is left is the persistent stages.
        EXPECT_EQ(h.current(memory::Category::kParams) + shard_bytes, device[r].current(memory::Category::kParams)) << what;
        EXPECT_EQ(h.current(memory::Category::kParams), h.total.persistent_bytes) << what;
        EXPECT_EQ(h.current(memory::Category::kOptimizer), optimizer ? 0u : device[r].current(memory::Category::kOptimizer)) << what;
        // Host bytes are the estimate's (Note [Host-state bytes per rank]), all pinned.
        const zero::HostStateBytes predicted =
            zero::host_state_bytes(part, 3, zero::StateDTypes{dtype}, optimizer, true, true, true);
        EXPECT_EQ(h.total.param_offload_host_bytes, predicted.params) << what;
        EXPECT_EQ(h.total.offload_host_bytes, predicted.optimizer + predicted.grads) << what;
        EXPECT_GE(h.pinned_bytes, predicted.total()) << what;
        EXPECT_GT(h.total.param_offload_h2d_bytes, 0u) << what;
        // With the optimizer on the device its updated shard comes down at every update.
        if (!optimizer && std::string(k.precision) != "fp16") {
          EXPECT_EQ(h.total.param_offload_d2h_bytes, 3 * shard_bytes) << what;
        }
        if (optimizer) {
          EXPECT_EQ(h.total.param_offload_d2h_bytes, 0u) << what;
          EXPECT_EQ(h.total.offload_h2d_bytes, 0u) << what;  // CpuAdam wrote the shard itself
        }
      }
    }
  }
}

TEST(EngineParamOffload, PageableWithoutPinMemory) {
  config::Config c = s3_config(2);
  c.bf16.enabled = true;
  set_offload(c, false, true);
  const std::vector<RankRun> pinned = run_dp_ranks(c, 2);
  c.zero_optimization.offload_param.pin_memory = false;
  const std::vector<RankRun> pageable = run_dp_ranks(c, 2);
  expect_bitwise_runs(pageable, pinned, "pageable vs pinned");
  const zero::Partition part = zero::make_partition(pinned[0].total.padded_elems, 2);
  EXPECT_EQ(pageable[0].total.param_offload_host_bytes, static_cast<size_t>(part.shard_elems) * 2);
  EXPECT_LT(pageable[0].pinned_bytes, pinned[0].pinned_bytes);
}

TEST(EngineParamOffload, APinnedLimitTooSmallIsRefusedBeforeTheFirstStep) {
  config::Config c = s3_config(1);
  set_offload(c, false, true);
  c.porter.device.pinned_limit_bytes = 64 * 1024;
  auto device = cpu_device();
  const std::string msg = error_of<OutOfMemoryError>([&] { gpt_engine(*device, c); });
  EXPECT_NE(msg.find("zero_optimization.offload_param"), std::string::npos) << msg;
  EXPECT_NE(msg.find("porter.device.pinned_limit"), std::string::npos) << msg;
  EXPECT_NE(msg.find("parameter shard"), std::string::npos) << msg;
}

TEST(EngineParamOffload, SaveAndResumeAreBitIdenticalWithAndWithoutOffload) {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("porter_param_offload_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  config::Config c = s3_config(1);
  c.bf16.enabled = true;
  set_offload(c, true, true);
  const StraightRun straight = straight_and_checkpoint(c, dir);
  for (bool offload : {true, false}) {
    config::Config r = c;
    set_offload(r, offload, offload);
    expect_resumes(r, dir, straight, offload ? "offload" : "no offload");
  }
  std::filesystem::remove_all(dir);
}

// A copy error on the parameter upload stream in the middle of a step fails the step before
// the update, so the engine is where it was: the next step is the one it would have taken.
TEST(EngineParamOffload, ACopyErrorMidStepLeavesTheStateUnchanged) {
  for (bool optimizer : {false, true}) {
    config::Config c = s3_config(1);
    c.bf16.enabled = true;
    set_offload(c, optimizer, true);
    std::vector<double> straight;
    std::vector<float> straight_params;
    SavedState straight_state;
    {
      auto device = cpu_device();
      auto e = gpt_engine(*device, c);
      for (int s = 0; s < 3; ++s) straight.push_back(e->train_step(batches(c, s)).loss);
      straight_params = e->params_host();
      straight_state = saved_state(*e);
    }
    FaultyDevice device(cpu_device());
    auto e = gpt_engine(device, c);
    EXPECT_EQ(e->train_step(batches(c, 0)).loss, straight[0]);
    const std::vector<float> before = e->params_host();
    const SavedState before_state = saved_state(*e);
    device.fail_copy("param h2d", 3);  // the third upload of the next step
    const std::string msg = error_of<std::exception>([&] { e->train_step(batches(c, 1)); });
    EXPECT_NE(msg.find("injected copy failure"), std::string::npos) << msg;
    EXPECT_EQ(device.failures(), 1);
    EXPECT_EQ(e->step(), 1);
    EXPECT_TRUE(bitwise_equal(e->params_host(), before)) << "optimizer " << optimizer;
    const std::string what = std::string("optimizer ") + (optimizer ? "offloaded" : "on the device");
    expect_same_state(saved_state(*e), before_state, what + ", after the failed step");
    EXPECT_EQ(e->train_step(batches(c, 1)).loss, straight[1]) << what;
    EXPECT_EQ(e->train_step(batches(c, 2)).loss, straight[2]) << what;
    EXPECT_TRUE(bitwise_equal(e->params_host(), straight_params)) << what;
    expect_same_state(saved_state(*e), straight_state, what);
  }
}

// Note [Partial offload]: offload_optimizer.ratio of the shard's optimizer on the host, the rest
// on the device; bitwise the run without offload at any ratio, with or without the parameters
// offloaded, and checkpoints that resume under any other ratio.
TEST(EnginePartialOffload, AnyRatioIsBitwiseTheRunWithoutOffload) {
  for (int ws : {1, 2}) {
    config::Config c = s3_config(ws, 2);
    c.bf16.enabled = true;
    const std::vector<RankRun> device = run_dp_ranks(c, 3);
    for (double ratio : {0.0, 0.3, 0.75}) {
      for (bool params : {false, true}) {
        const std::string what = "ws " + std::to_string(ws) + " ratio " + std::to_string(ratio) +
                                 (params ? " with params" : "");
        config::Config o = c;
        set_offload(o, true, params);
        o.zero_optimization.offload_optimizer.ratio = ratio;
        const std::vector<RankRun> host = run_dp_ranks(o, 3);
        expect_bitwise_runs(host, device, what);
        for (size_t r = 0; r < host.size(); ++r) {
          const zero::Partition part = zero::make_partition(host[r].total.padded_elems, ws);
          const int64_t h = zero::offloaded_elems(part.shard_elems, ratio);
          // Master + two moments, f32, for the device's part.
          EXPECT_EQ(host[r].current(memory::Category::kOptimizer), static_cast<size_t>(part.shard_elems - h) * 12) << what;
          const zero::HostStateBytes predicted = zero::host_state_bytes(
              part, 3, zero::StateDTypes{tensor::DType::kBF16}, true, params, true, true, ratio);
          EXPECT_EQ(host[r].total.offload_host_bytes + host[r].total.param_offload_host_bytes,
                    predicted.total())
              << what;
          EXPECT_EQ(host[r].total.offload_d2h_bytes, 3 * static_cast<uint64_t>(h) * 4) << what;
        }
      }
    }
  }
}

TEST(EnginePartialOffload, CheckpointsResumeUnderAnyOtherRatio) {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("porter_partial_offload_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  config::Config c = s3_config(1);
  c.bf16.enabled = true;
  set_offload(c, true, false);
  c.zero_optimization.offload_optimizer.ratio = 0.4;
  const StraightRun straight = straight_and_checkpoint(c, dir);
  for (double ratio : {0.4, 0.9, 1.0, -1.0}) {  // -1: no offload at all
    config::Config r = c;
    if (ratio < 0) {
      set_offload(r, false, false);
    } else {
      r.zero_optimization.offload_optimizer.ratio = ratio;
    }
    expect_resumes(r, dir, straight, "ratio " + std::to_string(ratio));
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace porter::engine
