// Every checkpoint policy through make_plan and the executor: bit-identical gradients,
// losses and whole training states, measured peaks against the formulas and the planner's predictions, profiled costs
// against the analytic model, no leak.
#include <algorithm>

#include <gtest/gtest.h>

#include "models/analytic.h"
#include "engine_test_util.h"

namespace porter::engine {
namespace {

using namespace porter::engine::testing;
using config::CheckpointPolicy;

const std::vector<CheckpointPolicy> kPolicies = {
    CheckpointPolicy::kNone,  CheckpointPolicy::kFull,      CheckpointPolicy::kUniform,
    CheckpointPolicy::kBlock, CheckpointPolicy::kSqrt,      CheckpointPolicy::kSelective,
    CheckpointPolicy::kOptimal};

config::Config policy_config(CheckpointPolicy p, bool bf16 = false, int64_t accumulation = 2) {
  config::Config c = tiny_config(p, 0.1, accumulation, bf16);
  c.porter.checkpointing.every_n_layers = 2;
  c.porter.checkpointing.block_layers = 2;
  c.porter.checkpointing.memory_budget = config::MemoryBudget{0.6};
  return c;
}

std::string name_of(CheckpointPolicy p) { return std::string(config::to_string(p)); }

TEST(EnginePolicyTest, EveryPolicyGivesBitIdenticalGradientsAndLosses) {
  for (bool bf16 : {false, true}) {
    std::vector<float> ref_grads, ref_params;
    std::vector<double> ref_losses;
    SavedState ref_state;
    for (CheckpointPolicy p : kPolicies) {
      SCOPED_TRACE(name_of(p) + (bf16 ? " bf16" : " f32"));
      const config::Config c = policy_config(p, bf16);
      auto device = cpu_device();
      auto e = gpt_engine(*device, c);
      EXPECT_EQ(e->plan().policy, p);
      std::vector<double> losses;
      std::vector<float> grads;
      for (int s = 0; s < 5; ++s) {
        losses.push_back(e->train_step(batches(c, s)).loss);
        if (s == 0) grads = e->grads_host();
      }
      if (p == CheckpointPolicy::kNone) {
        ref_grads = grads;
        ref_losses = losses;
        ref_params = e->params_host();
        ref_state = saved_state(*e);
        continue;
      }
      EXPECT_TRUE(bitwise_equal(grads, ref_grads));
      EXPECT_EQ(losses, ref_losses);
      EXPECT_TRUE(bitwise_equal(e->params_host(), ref_params));
      expect_same_state(saved_state(*e), ref_state, name_of(p));
    }
  }
}

models::TransformerShape shape_of(const config::Config& c, tensor::DType dtype) {
  return {c.porter.model, c.train_micro_batch_size_per_gpu, c.porter.model.seq_len, dtype};
}

TEST(EnginePolicyTest, NonePeakEqualsTheClosedForm) {
  for (bool bf16 : {false, true}) {
    const config::Config c = policy_config(CheckpointPolicy::kNone, bf16);
    auto device = cpu_device();
    auto e = gpt_engine(*device, c);
    const StepResult r = e->train_step(batches(c, 0));
    EXPECT_EQ(r.peak_activation_bytes,
              models::none_peak_bytes(shape_of(c, e->compute_dtype())))
        << (bf16 ? "bf16" : "f32");
  }
}

TEST(EnginePolicyTest, FullPeakIsHeldInputsPlusTheLargestRecompute) {
  const config::Config c = policy_config(CheckpointPolicy::kFull);
  auto device = cpu_device();
  auto e = gpt_engine(*device, c);
  const StepResult r = e->train_step(batches(c, 0));
  // Every stage holds its input from its forward until its backward. Forward i runs with
  // the inputs of stages 0..i held; recompute i with the inputs of stages 0..i still held
  // (the head's also with the loss, its output, alive).
  const checkpoint::ChainCosts& k = e->costs();
  const int n = k.num_stages();
  const auto kC = checkpoint::SaveOption::kCheckpoint;
  size_t held = 0, expected = 0;
  for (int i = 0; i < n; ++i) {
    held += k.stages[i].input_bytes;
    expected = std::max(expected, held + k.stages[i].option(kC).forward_peak_bytes);
  }
  for (int i = n - 1; i >= 0; --i) {
    const checkpoint::StageCost& s = k.stages[i];
    const checkpoint::OptionCost& o = s.option(kC);
    const size_t loss = i == n - 1 ? s.output_bytes : 0;
    expected = std::max(expected, held + loss + o.saved_bytes + o.recompute_peak_bytes);
    held -= s.input_bytes;
  }
  EXPECT_EQ(r.peak_activation_bytes, expected);
  EXPECT_EQ(e->plan().prediction.peak_activation_bytes, expected);
}

TEST(EnginePolicyTest, PredictedPeaksMatchMeasuredAndNothingLeaks) {
  for (bool bf16 : {false, true}) {
    for (CheckpointPolicy p : kPolicies) {
      SCOPED_TRACE(name_of(p) + (bf16 ? " bf16" : " f32"));
      const config::Config c = policy_config(p, bf16);
      auto device = cpu_device();
      auto e = gpt_engine(*device, c);
      const size_t baseline = e->allocator().stats().requested_bytes;
      size_t peak = 0, total = 0;
      for (int s = 0; s < 2; ++s) {
        const StepResult r = e->train_step(batches(c, s));
        peak = std::max(peak, r.peak_activation_bytes);
        total = std::max(total, r.peak_bytes);
        EXPECT_EQ(e->allocator().stats().activation_bytes, 0u);
        EXPECT_EQ(e->allocator().stats().requested_bytes, baseline);
      }
      const MemoryReport m = e->memory_report();
      EXPECT_EQ(m.peak_activation_bytes, peak);
      EXPECT_EQ(m.predicted_activation_bytes, peak) << e->plan().schedule.to_string();
      EXPECT_EQ(m.predicted_peak_bytes, total);
      EXPECT_EQ(m.model_state_bytes, baseline);
      if (p != CheckpointPolicy::kNone && p != CheckpointPolicy::kSelective) {
        EXPECT_GT(m.measured_recompute_s, 0.0);
        EXPECT_GT(m.predicted_recompute_s, 0.0);
      }
    }
  }
}

TEST(EnginePolicyTest, ProfiledBytesEqualTheAnalyticModel) {
  for (bool bf16 : {false, true}) {
    SCOPED_TRACE(bf16 ? "bf16" : "f32");
    const config::Config c = policy_config(CheckpointPolicy::kFull, bf16);
    auto device = cpu_device();
    auto e = gpt_engine(*device, c);
    const std::vector<float> grads = e->grads_host();
    const checkpoint::ChainCosts prof = e->profile();
    EXPECT_TRUE(bitwise_equal(e->grads_host(), grads));
    const checkpoint::ChainCosts ana = models::analytic_transformer_costs(shape_of(c, e->compute_dtype()));
    expect_costs_match(prof, ana);
  }
}

}  // namespace
}  // namespace porter::engine
