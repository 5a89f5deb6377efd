// The schedule executor against Note [Schedule semantics]: hand-written schedules (keep
// everything, every stage checkpointed, a re-forwarded segment, selective blocks, nested
// re-forwards from held token ids) give bit-identical gradients, losses and whole training
// states with dropout on, and release everything they hold.
#include <gtest/gtest.h>

#include "engine_test_util.h"

namespace porter::engine {
namespace {

using namespace porter::engine::testing;
using checkpoint::SaveOption;
using checkpoint::ScheduleOp;
using Ops = std::vector<ScheduleOp>;

constexpr int kStages = 5;  // embedding, 3 blocks, head
constexpr auto kK = SaveOption::kKeep;
constexpr auto kS = SaveOption::kSelective;
constexpr auto kC = SaveOption::kCheckpoint;

ScheduleOp F(int i, SaveOption s, bool hold = false) { return ScheduleOp::forward(i, s, hold); }
ScheduleOp R(int i) { return ScheduleOp::recompute(i); }
ScheduleOp B(int i) { return ScheduleOp::backward(i); }

std::vector<std::pair<std::string, Ops>> schedules() {
  return {
      {"none", {F(0, kK), F(1, kK), F(2, kK), F(3, kK), F(4, kK), B(4), B(3), B(2), B(1), B(0)}},
      {"full",
       {F(0, kC, true), F(1, kC, true), F(2, kC, true), F(3, kC, true), F(4, kC, true), R(4), B(4),
        R(3), B(3), R(2), B(2), R(1), B(1), R(0), B(0)}},
      // Blocks 1-2 as one segment re-forwarded with keep (Megatron's uniform).
      {"segment",
       {F(0, kK), F(1, kC, true), F(2, kC), F(3, kK), F(4, kK), B(4), B(3), F(1, kK), F(2, kK), B(2),
        B(1), B(0)}},
      {"selective",
       {F(0, kK), F(1, kS, true), F(2, kS, true), F(3, kS, true), F(4, kK), B(4), R(3), B(3), R(2),
        B(2), R(1), B(1), B(0)}},
      // Nested: stages 0-1 re-forwarded from the held token ids, stage 2 recomputed.
      {"nested",
       {F(0, kC, true), F(1, kC), F(2, kC, true), F(3, kK), F(4, kK), B(4), B(3), R(2), B(2), F(0, kK),
        F(1, kK), B(1), B(0)}},
  };
}

void use_schedule(Engine& e, const Ops& ops) {
  checkpoint::Plan p;
  p.schedule.num_stages = kStages;
  p.schedule.ops = ops;
  e.set_plan(p);
}

TEST(EngineScheduleTest, GradientsAndLossesAreBitIdenticalUnderEverySchedule) {
  for (bool bf16 : {false, true}) {
    const config::Config c = tiny_config(config::CheckpointPolicy::kNone, 0.1, 2, bf16);
    std::vector<float> ref_grads, ref_params;
    std::vector<double> ref_losses;
    SavedState ref_state;
    for (const auto& [name, ops] : schedules()) {
      SCOPED_TRACE(name + (bf16 ? " bf16" : " f32"));
      auto device = cpu_device();
      auto e = gpt_engine(*device, c);
      use_schedule(*e, ops);
      const size_t baseline = e->allocator().stats().requested_bytes;
      std::vector<double> losses;
      std::vector<float> first_grads;
      for (int s = 0; s < 5; ++s) {
        const StepResult r = e->train_step(batches(c, s));
        losses.push_back(r.loss);
        if (s == 0) first_grads = e->grads_host();
        if (name == "none") {
          EXPECT_EQ(r.recompute_s, 0.0);
        } else {
          EXPECT_GT(r.recompute_s, 0.0);
        }
        EXPECT_EQ(e->allocator().stats().activation_bytes, 0u);
        EXPECT_EQ(e->allocator().stats().requested_bytes, baseline);
      }
      if (name == "none") {
        ref_grads = first_grads;
        ref_losses = losses;
        ref_params = e->params_host();
        ref_state = saved_state(*e);
        continue;
      }
      EXPECT_TRUE(bitwise_equal(first_grads, ref_grads));
      EXPECT_EQ(losses, ref_losses);
      EXPECT_TRUE(bitwise_equal(e->params_host(), ref_params));
      expect_same_state(saved_state(*e), ref_state, name + (bf16 ? " bf16" : " f32"));
    }
  }
}

TEST(EngineScheduleTest, CheckpointingLowersTheMeasuredPeak) {
  const config::Config c = tiny_config(config::CheckpointPolicy::kNone, 0.1, 1);
  std::vector<size_t> peaks;
  for (const auto& [name, ops] : schedules()) {
    auto device = cpu_device();
    auto e = gpt_engine(*device, c);
    use_schedule(*e, ops);
    peaks.push_back(e->train_step(batches(c, 0)).peak_activation_bytes);
  }
  EXPECT_LT(peaks[1], peaks[0]);  // full < none
  EXPECT_LT(peaks[2], peaks[0]);  // segment < none
  EXPECT_LT(peaks[3], peaks[0]);  // selective < none
}

TEST(EngineScheduleTest, HeldInputsAreCheckpointsAndTokenIdsStayWorkspace) {
  const config::Config c = tiny_config(config::CheckpointPolicy::kNone, 0.0, 1);
  auto device = cpu_device();
  auto e = gpt_engine(*device, c);
  use_schedule(*e, schedules()[1].second);  // full
  e->train_step(batches(c, 0));
  const memory::MemoryStats s = e->allocator().stats();
  // Four held activations (blocks and head inputs), (B, T, C) f32 each.
  EXPECT_EQ(s[memory::Category::kCheckpoints].peak_bytes, 4u * 2 * 16 * 32 * 4);
  EXPECT_EQ(s[memory::Category::kCheckpoints].current_bytes, 0u);
}

}  // namespace
}  // namespace porter::engine
