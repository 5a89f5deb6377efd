// A chain of user layers (examples/consumer/user_layers.h, the docs/engine.md example) through the
// Engine: it trains, its gradients pass a finite-difference check, and checkpointing it
// gives the same gradients and training state bit for bit.
#include <cmath>

#include <gtest/gtest.h>

#include "engine_test_util.h"
#include "examples/consumer/user_layers.h"

namespace porter::engine {
namespace {

using namespace porter::engine::testing;

config::Config chain_config(config::CheckpointPolicy policy = config::CheckpointPolicy::kNone) {
  config::Config c = tiny_config(policy, 0.0, 2);
  c.train_micro_batch_size_per_gpu = 4;
  c.train_batch_size = 8;
  c.porter.model.seq_len = 8;
  c.porter.model.vocab = 16;
  c.gradient_clipping = 0.0;
  c.optimizer->lr = 3e-2;
  c.optimizer->weight_decay = 0.0;
  return c;
}

std::unique_ptr<Engine> chain_engine(memory::Device& d, const config::Config& c) {
  return std::make_unique<Engine>(d, example::make_regressor(16, 8, 16), c);
}

TEST(EngineUserLayerTest, ChainTrainsAndTheLossFalls) {
  auto device = cpu_device();
  const config::Config c = chain_config();
  auto e = chain_engine(*device, c);
  EXPECT_EQ(e->model().num_stages(), 4);
  EXPECT_EQ(e->costs().source, "profiled");
  double first = 0, last = 0;
  for (int s = 0; s < 40; ++s) {
    const StepResult r = e->train_step(batches(c, s % 4));
    if (s == 0) first = r.loss;
    last = r.loss;
  }
  EXPECT_LT(last, 0.1 * first) << "first " << first << " last " << last;
}

TEST(EngineUserLayerTest, GradientsMatchFiniteDifferences) {
  auto device = cpu_device();
  config::Config c = chain_config();
  c.optimizer->lr = 0.0;  // the step computes gradients and leaves the parameters alone
  auto e = chain_engine(*device, c);
  const std::vector<io::HostBatch> mb = batches(c, 0);
  const std::vector<float> p0 = e->params_host();
  e->train_step(mb);
  ASSERT_TRUE(bitwise_equal(e->params_host(), p0));
  const std::vector<float> analytic = e->grads_host();
  int checked = 0;
  for (const nn::ParamEntry& entry : e->model().layout().entries()) {
    for (int64_t j = 0; j < entry.shape.numel(); j += 7) {
      const size_t i = static_cast<size_t>(entry.offset_elems + j);
      const float h = 1e-2f;
      std::vector<float> p = p0;
      p[i] = p0[i] + h;
      e->set_params_host(p);
      const double up = e->evaluate(mb);
      p[i] = p0[i] - h;
      e->set_params_host(p);
      const double down = e->evaluate(mb);
      const double numeric = (up - down) / (2.0 * h);
      EXPECT_NEAR(analytic[i], numeric, 2e-4 + 2e-3 * std::fabs(numeric)) << entry.name << "[" << j << "]";
      ++checked;
    }
  }
  EXPECT_GT(checked, 50);
}

TEST(EngineUserLayerTest, CheckpointedChainHasBitIdenticalGradients) {
  const config::Config c = chain_config();
  std::vector<float> ref;
  SavedState ref_state;
  for (int full = 0; full < 2; ++full) {
    auto device = cpu_device();
    auto e = chain_engine(*device, c);
    if (full) {
      using checkpoint::ScheduleOp;
      checkpoint::Plan p;
      p.schedule.num_stages = 4;
      for (int i = 0; i < 4; ++i)
        p.schedule.ops.push_back(ScheduleOp::forward(i, checkpoint::SaveOption::kCheckpoint, true));
      for (int i = 3; i >= 0; --i) {
        p.schedule.ops.push_back(ScheduleOp::recompute(i));
        p.schedule.ops.push_back(ScheduleOp::backward(i));
      }
      e->set_plan(p);
    }
    e->train_step(batches(c, 0));
    if (!full) {
      ref = e->grads_host();
      ref_state = saved_state(*e);
    } else {
      EXPECT_TRUE(bitwise_equal(e->grads_host(), ref));
      expect_same_state(saved_state(*e), ref_state, "every stage checkpointed");
    }
  }
}

}  // namespace
}  // namespace porter::engine
