// One training step under the `none` policy: the loss falls, the step's fields, shape and
// count checks, atomicity after out-of-memory, no leak, trace spans, config refusals.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "base/error.h"
#include "engine_test_util.h"

namespace porter::engine {
namespace {

using ::testing::HasSubstr;
using namespace porter::engine::testing;

TEST(EngineStepTest, LossFallsAndFieldsAreFilled) {
  auto device = cpu_device();
  const config::Config c = tiny_config(config::CheckpointPolicy::kNone, 0.0);
  auto e = gpt_engine(*device, c);
  const size_t baseline = e->allocator().stats().requested_bytes;
  EXPECT_EQ(e->allocator().stats().activation_bytes, 0u);
  double first = 0, last = 0;
  for (int s = 0; s < 8; ++s) {
    const StepResult r = e->train_step(batches(c, 0));
    if (s == 0) first = r.loss;
    last = r.loss;
    EXPECT_EQ(r.step, s + 1);
    EXPECT_EQ(r.tokens, 2 * 2 * 16);
    EXPECT_DOUBLE_EQ(r.lr, 1e-2);
    EXPECT_GT(r.grad_norm, 0.0);
    EXPECT_LE(r.clip_coef, 1.0);
    EXPECT_GT(r.peak_activation_bytes, 0u);
    EXPECT_GE(r.peak_bytes, baseline + r.peak_activation_bytes);
    EXPECT_EQ(r.recompute_s, 0.0);  // none recomputes nothing
    // Everything the step allocated is back: footprint zero, requested at the baseline.
    EXPECT_EQ(e->allocator().stats().activation_bytes, 0u);
    EXPECT_EQ(e->allocator().stats().requested_bytes, baseline);
  }
  EXPECT_EQ(e->step(), 8);
  EXPECT_LT(last, first - 0.5) << "first " << first << " last " << last;
  EXPECT_NEAR(first, std::log(64.0), 0.3);  // init near uniform over the vocabulary
}

// Note [Wall-clock breakdown]: positive phases whose sum is within the step, and nothing
// timed (nor bits changed) with the key off.
void expect_breakdown(const StepResult& r, bool recomputes, const std::string& what) {
  const WallClockBreakdown& w = r.wall_clock;
  EXPECT_TRUE(w.enabled) << what;
  EXPECT_GT(w.forward_ms, 0.0) << what;
  EXPECT_GT(w.backward_inner_ms, 0.0) << what;
  EXPECT_GT(w.reduce_ms, 0.0) << what;
  EXPECT_GT(w.optimizer_ms, 0.0) << what;
  EXPECT_GT(w.offload_wait_ms, 0.0) << what;  // at least the end-of-step synchronisation
  if (recomputes) {
    EXPECT_GT(w.recompute_ms, 0.0) << what;
  } else {
    EXPECT_EQ(w.recompute_ms, 0.0) << what;
  }
  EXPECT_DOUBLE_EQ(w.backward_ms(), w.backward_inner_ms + w.reduce_ms) << what;
  EXPECT_LE(w.total_ms(), 1e3 * r.time_s) << what;
  // Most of a step is these phases (the rest: batches to the device, zeroing, records).
  EXPECT_GT(w.total_ms(), 0.5 * 1e3 * r.time_s) << what;
}

TEST(EngineStepTest, WallClockBreakdownTimesThePhasesWithinTheStep) {
  for (const config::CheckpointPolicy policy :
       {config::CheckpointPolicy::kNone, config::CheckpointPolicy::kFull}) {
    const bool recomputes = policy != config::CheckpointPolicy::kNone;
    config::Config c = tiny_config(policy, 0.1);
    if (recomputes) {
      config::ActivationCheckpointingConfig ac;
      ac.cpu_checkpointing = true;  // the checkpoints go through the stash
      c.activation_checkpointing = ac;
    }
    auto off_device = cpu_device();
    auto off = gpt_engine(*off_device, c);
    c.wall_clock_breakdown = true;
    auto device = cpu_device();
    auto on = gpt_engine(*device, c);
    for (int s = 0; s < 3; ++s) {
      const StepResult a = off->train_step(batches(c, s));
      const StepResult b = on->train_step(batches(c, s));
      EXPECT_FALSE(a.wall_clock.enabled);
      EXPECT_EQ(a.wall_clock.total_ms(), 0.0);
      EXPECT_EQ(a.loss, b.loss) << "step " << s;
      expect_breakdown(b, recomputes, "policy " + std::string(config::to_string(policy)));
      EXPECT_THAT(b.wall_clock.format(0),
                  ::testing::MatchesRegex("\\[Rank 0\\] time \\(ms\\) \\| fwd: [0-9]+\\.[0-9]{2} "
                                          "\\| bwd: [0-9.]+ \\| bwd_inner: [0-9.]+ \\| "
                                          "bwd_allreduce: [0-9.]+ \\| step: [0-9.]+ \\| "
                                          "recompute: [0-9.]+ \\| offload_wait: [0-9.]+"));
    }
    EXPECT_TRUE(bitwise_equal(off->params_host(), on->params_host()));
  }
}

// With two ranks at stage 2 the reduction's waits are in bwd_allreduce.
TEST(EngineStepTest, WallClockBreakdownCountsTheGradientReduction) {
  config::Config c = zero_config(2, 2);
  c.wall_clock_breakdown = true;
  for_each_dp_rank(c, [&](int rank, memory::Device& device,
                          std::shared_ptr<comm::Communicator> dp) {
    Engine e(device, std::make_unique<TransformerModel>(c.porter.model), c, data_parallel(dp));
    const io::DataSource data(c.porter.data, c.porter.model.vocab, c.train_micro_batch_size_per_gpu,
                          c.porter.model.seq_len);
    for (int s = 0; s < 2; ++s) {
      const StepResult r = e.train_step(data.rank_batches(s, 1, rank, 2));
      expect_breakdown(r, false, "rank " + std::to_string(rank));
      EXPECT_GT(r.zero.comm_bytes, 0u);
    }
  });
}

TEST(EngineStepTest, ClippingUsesDeepSpeedsRule) {
  auto device = cpu_device();
  config::Config c = tiny_config(config::CheckpointPolicy::kNone, 0.0);
  c.gradient_clipping = 1e-3;
  auto e = gpt_engine(*device, c);
  const StepResult r = e->train_step(batches(c, 0));
  EXPECT_DOUBLE_EQ(r.clip_coef, std::min(1.0, 1e-3 / (r.grad_norm + 1e-6)));
  EXPECT_LT(r.clip_coef, 1.0);
  // The buffer is left unclipped: its norm is the reported one.
  const std::vector<float> g = e->grads_host();
  double sq = 0;
  for (float x : g) sq += static_cast<double>(x) * x;
  EXPECT_NEAR(std::sqrt(sq), r.grad_norm, 1e-4 * r.grad_norm);
}

TEST(EngineStepTest, WrongCountAndShapeAreRejected) {
  auto device = cpu_device();
  const config::Config c = tiny_config();
  auto e = gpt_engine(*device, c);
  std::vector<io::HostBatch> one = batches(c, 0);
  one.pop_back();
  try {
    e->train_step(one);
    FAIL();
  } catch (const InvalidArgument& err) {
    EXPECT_THAT(err.what(), HasSubstr("1 micro-batches, but gradient_accumulation_steps is 2"));
  }
  std::vector<io::HostBatch> bad = batches(c, 0);
  bad[1].seq = 8;
  try {
    e->train_step(bad);
    FAIL();
  } catch (const InvalidArgument& err) {
    EXPECT_THAT(err.what(), HasSubstr("micro-batch 1 is (2, 8)"));
    EXPECT_THAT(err.what(), HasSubstr("porter.model.seq_len"));
  }
  bad = batches(c, 0);
  bad[0].tokens.resize(5);
  EXPECT_THROW(e->train_step(bad), InvalidArgument);
  bad = batches(c, 0);
  bad[0].targets[3] = 64;
  try {
    e->train_step(bad);
    FAIL();
  } catch (const InvalidArgument& err) {
    EXPECT_THAT(err.what(), HasSubstr("outside the vocabulary [0, 64)"));
  }
  EXPECT_EQ(e->step(), 0);
}

TEST(EngineStepTest, OutOfMemoryLeavesStateUnchangedAndRetryWorks) {
  const config::Config c = tiny_config(config::CheckpointPolicy::kNone, 0.1);
  // Measure what a step needs under none and under full, then give a device the midpoint.
  size_t none_peak = 0, full_peak = 0;
  std::vector<float> reference_params;
  double reference_loss = 0;
  for (auto policy : {config::CheckpointPolicy::kNone, config::CheckpointPolicy::kFull}) {
    config::Config pc = c;
    pc.porter.checkpointing.policy = policy;
    auto device = cpu_device();
    auto e = gpt_engine(*device, pc);
    const StepResult r = e->train_step(batches(c, 0));
    (policy == config::CheckpointPolicy::kNone ? none_peak : full_peak) = r.peak_bytes;
    reference_loss = r.loss;
    reference_params = e->params_host();
  }
  ASSERT_LT(full_peak, none_peak);
  auto device = cpu_device((none_peak + full_peak) / 2);
  auto e = gpt_engine(*device, c);
  const std::vector<float> before = e->params_host();
  const size_t baseline = e->allocator().stats().requested_bytes;
  for (int attempt = 0; attempt < 2; ++attempt) {
    EXPECT_THROW(e->train_step(batches(c, 0)), OutOfMemoryError);
    EXPECT_EQ(e->step(), 0);
    EXPECT_TRUE(bitwise_equal(e->params_host(), before));
    EXPECT_EQ(e->allocator().stats().activation_bytes, 0u);
    EXPECT_EQ(e->allocator().stats().requested_bytes, baseline);
  }
  // A plan that fits (every stage checkpointed) then runs the same step bit for bit.
  checkpoint::PlanOptions full;
  full.checkpointing.policy = config::CheckpointPolicy::kFull;
  e->set_plan(checkpoint::make_plan(full, e->costs()));
  const StepResult r = e->train_step(batches(c, 0));
  EXPECT_EQ(r.loss, reference_loss);
  EXPECT_TRUE(bitwise_equal(e->params_host(), reference_params));
  EXPECT_EQ(e->step(), 1);
}

TEST(EngineStepTest, TraceHasSpansPerStageAndMemoryCounters) {
  auto device = cpu_device();
  const config::Config c = tiny_config(config::CheckpointPolicy::kNone, 0.0, 1);
  auto e = gpt_engine(*device, c);
  TraceRecorder trace;
  e->set_trace(&trace);
  e->train_step(batches(c, 0));
  const std::vector<TraceSpan> spans = trace.spans();
  int forwards = 0, backwards = 0, optimizer = 0;
  for (const TraceSpan& s : spans) {
    if (s.category == "forward") ++forwards;
    if (s.category == "backward") ++backwards;
    if (s.category == "optimizer") ++optimizer;
  }
  EXPECT_EQ(forwards, 5);  // embedding, 3 blocks, head
  EXPECT_EQ(backwards, 5);
  EXPECT_EQ(optimizer, 1);
  bool found = false;
  for (const TraceSpan& s : spans) found = found || (s.name == "forward block.2" && s.lane == "compute");
  EXPECT_TRUE(found);
  EXPECT_EQ(trace.counters().size(), 10u);
  EXPECT_EQ(trace.counters()[0].name, "memory");
}

TEST(EngineStepTest, UnsupportedConfigsNameTheKey) {
  auto device = cpu_device();
  auto expect_refused = [&](config::Config c, const std::string& key) {
    try {
      gpt_engine(*device, c);
      FAIL() << key;
    } catch (const InvalidArgument& err) {
      EXPECT_THAT(err.what(), HasSubstr(key));
    }
  };
  // The rules between keys are the parser's (Note [Run options]): a Config built in code that
  // breaks one is asserted against, not run.
  config::Config c = tiny_config();
  c.zero_optimization.stage = 2;
  c.zero_optimization.offload_param.device = config::OffloadDevice::kCpu;
  EXPECT_THROW(gpt_engine(*device, c), InternalError);  // stage 3 only
  c = tiny_config();
  c.zero_optimization.offload_optimizer.device = config::OffloadDevice::kCpu;
  EXPECT_THROW(gpt_engine(*device, c), InternalError);  // stage 0 has no shard
  c = tiny_config();
  c.world_size = 2;
  expect_refused(c, "world_size 2");
  c = tiny_config();
  c.world_size = 2;
  c.porter.model.tensor_parallel = 2;  // but no tensor-parallel communicator
  expect_refused(c, "porter.model.tensor_parallel 2 but the tensor-parallel communicator has 1");
  c = tiny_config();
  c.optimizer->adam_w_mode = false;
  expect_refused(c, "optimizer.params.adam_w_mode");
  c.optimizer->weight_decay = 0.0;
  EXPECT_NO_THROW(gpt_engine(*device, c));  // plain Adam without decay is AdamW
  config::ModelConfig other = c.porter.model;
  other.layers = 2;
  try {
    Engine e(*device, std::make_unique<TransformerModel>(other), c);
    FAIL();
  } catch (const InvalidArgument& err) {
    EXPECT_THAT(err.what(), HasSubstr("another model config than porter.model"));
  }
}

TEST(EngineStepTest, Bf16TrainsWithMasterWeights) {
  auto device = cpu_device();
  const config::Config c = tiny_config(config::CheckpointPolicy::kNone, 0.0, 2, true);
  auto e = gpt_engine(*device, c);
  EXPECT_EQ(e->compute_dtype(), tensor::DType::kBF16);
  const memory::MemoryStats s = e->allocator().stats();
  const size_t p = static_cast<size_t>(e->model().layout().total_elems());
  EXPECT_EQ(s[memory::Category::kParams].current_bytes, 2 * p);
  EXPECT_EQ(s[memory::Category::kGrads].current_bytes, 4 * p);
  EXPECT_EQ(s[memory::Category::kOptimizer].current_bytes, 12 * p);  // master, m, v
  double first = 0, last = 0;
  for (int i = 0; i < 8; ++i) {
    const StepResult r = e->train_step(batches(c, 0));
    if (i == 0) first = r.loss;
    last = r.loss;
  }
  EXPECT_LT(last, first - 0.5);
}

TEST(EngineStepTest, EvaluateMatchesTheStepsLossWithoutChangingAnything) {
  auto device = cpu_device();
  const config::Config c = tiny_config(config::CheckpointPolicy::kNone, 0.0);
  auto e = gpt_engine(*device, c);
  const std::vector<float> p = e->params_host();
  const double eval = e->evaluate(batches(c, 0));
  EXPECT_TRUE(bitwise_equal(e->params_host(), p));
  EXPECT_EQ(e->step(), 0);
  const StepResult r = e->train_step(batches(c, 0));
  EXPECT_EQ(eval, r.loss);
}

// Evaluation has no dropout: with dropout on, it equals the loss of the same model at dropout 0.
TEST(EngineStepTest, EvaluateRunsWithoutDropout) {
  auto device = cpu_device();
  const config::Config with = tiny_config(config::CheckpointPolicy::kFull, 0.3);
  const config::Config without = tiny_config(config::CheckpointPolicy::kFull, 0.0);
  auto a = gpt_engine(*device, with);
  const double eval = a->evaluate(batches(with, 0));
  EXPECT_EQ(eval, a->evaluate(batches(with, 0)));
  const double train = a->train_step(batches(with, 0)).loss;
  EXPECT_NE(eval, train);
  a.reset();
  auto b = gpt_engine(*device, without);
  EXPECT_EQ(eval, b->evaluate(batches(without, 0)));
}

}  // namespace
}  // namespace porter::engine
