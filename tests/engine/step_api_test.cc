// DeepSpeed's step API (Engine::forward, backward, optimizer_step; Note [Step API] in
// engine/step.cc) against train_step: the same losses, parameters and whole saved state, bit
// for bit, with accumulation 1 and 4, clipping, dropout, fp16's loss scaling, checkpointing
// with offload, and ZeRO-2 on two ranks; and its misuse is a UsageError that changes nothing.
#include <cmath>
#include <optional>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "engine/engine.h"
#include "engine_test_util.h"

namespace porter::engine {
namespace {

using namespace testing;
using ::testing::HasSubstr;

struct ApiRun {
  std::vector<double> losses;
  std::vector<float> params;
  SavedState state;
};

// `steps` steps through train_step, or through forward/backward/optimizer_step.
ApiRun run(Engine& e, const config::Config& c, int steps, bool step_api, int rank = 0) {
  ApiRun r;
  for (int s = 0; s < steps; ++s) {
    std::vector<io::HostBatch> mbs = batches(c, s * 16 + rank);
    if (!step_api) {
      r.losses.push_back(e.train_step(mbs).loss);
      continue;
    }
    std::optional<StepResult> result;
    for (const io::HostBatch& mb : mbs) {
      EXPECT_FALSE(e.is_gradient_accumulation_boundary());
      const double loss = e.forward(mb);
      EXPECT_TRUE(std::isfinite(loss));
      e.backward();
      result = e.optimizer_step();
      EXPECT_EQ(result.has_value(), &mb == &mbs.back());
    }
    r.losses.push_back(result->loss);
  }
  r.params = e.params_host();
  r.state = saved_state(e);
  return r;
}

void expect_same(const ApiRun& a, const ApiRun& b, const std::string& what) {
  ASSERT_EQ(a.losses.size(), b.losses.size());
  for (size_t i = 0; i < a.losses.size(); ++i) EXPECT_EQ(a.losses[i], b.losses[i]) << what << " step " << i;
  EXPECT_TRUE(bitwise_equal(a.params, b.params)) << what;
  expect_same_state(a.state, b.state, what);
}

TEST(StepApi, GivesTrainStepsBitsWithAccumulationClippingAndFp16) {
  struct Case {
    const char* name;
    int64_t accumulation;
    bool fp16;
    config::CheckpointPolicy policy;
    bool offload;
  };
  const Case cases[] = {
      {"accumulation 1", 1, false, config::CheckpointPolicy::kNone, false},
      {"accumulation 4", 4, false, config::CheckpointPolicy::kNone, false},
      {"accumulation 4, fp16", 4, true, config::CheckpointPolicy::kNone, false},
      {"accumulation 4, full checkpoints offloaded", 4, false, config::CheckpointPolicy::kFull, true},
      {"accumulation 1, selective", 1, false, config::CheckpointPolicy::kSelective, false},
  };
  for (const Case& k : cases) {
    config::Config c = tiny_config(k.policy, /*dropout=*/0.1, k.accumulation);
    c.gradient_clipping = 0.05;  // small enough to clip every step
    if (k.fp16) {
      c.fp16.enabled = true;
      c.fp16.initial_scale_power = 12;
    }
    if (k.offload) {
      config::ActivationCheckpointingConfig ac;
      ac.cpu_checkpointing = true;  // the checkpoints go through the stash
      c.activation_checkpointing = ac;
    }
    auto d1 = cpu_device();
    auto d2 = cpu_device();
    auto a = gpt_engine(*d1, c);
    auto b = gpt_engine(*d2, c);
    expect_same(run(*a, c, 3, false), run(*b, c, 3, true), k.name);
  }
}

TEST(StepApi, GivesTrainStepsBitsAtZeroStageTwoOnTwoRanks) {
  const config::Config c = zero_config(2, 2, /*gas=*/2);
  std::vector<ApiRun> by_train(2), by_api(2);
  for (bool api : {false, true}) {
    for_each_dp_rank(c, [&](int rank, memory::Device& device, std::shared_ptr<comm::Communicator> dp) {
      Engine e(device, std::make_unique<TransformerModel>(c.porter.model), c, data_parallel(dp));
      (api ? by_api : by_train)[static_cast<size_t>(rank)] = run(e, c, 3, api, rank);
    });
  }
  std::vector<SavedState> train_states, api_states;
  for (int r = 0; r < 2; ++r) {
    const auto i = static_cast<size_t>(r);
    EXPECT_EQ(by_train[i].losses, by_api[i].losses) << "rank " << r;
    EXPECT_TRUE(bitwise_equal(by_train[i].params, by_api[i].params)) << "rank " << r;
    train_states.push_back(by_train[i].state);
    api_states.push_back(by_api[i].state);
  }
  expect_same_state(train_states, api_states, "ZeRO-2 on two ranks");
}

TEST(StepApi, OutputIsTheLossStagesInput) {
  const config::Config c = tiny_config(config::CheckpointPolicy::kFull, 0.0, 1);
  auto d = cpu_device();
  auto e = gpt_engine(*d, c);
  EXPECT_THAT(error_of<UsageError>([&] { (void)e->output(); }), HasSubstr("keep_output"));
  const io::HostBatch mb = batches(c, 0)[0];
  (void)e->forward(mb, /*keep_output=*/true);
  const io::HostTensor& out = e->output();
  EXPECT_EQ(out.shape, (tensor::Shape{c.train_micro_batch_size_per_gpu, c.porter.model.seq_len,
                                      c.porter.model.hidden}));
  EXPECT_EQ(out.dtype, tensor::DType::kF32);
  e->backward();
  EXPECT_TRUE(e->optimizer_step().has_value());
}

TEST(StepApi, MisuseIsAUsageErrorThatChangesNothing) {
  const config::Config c = tiny_config(config::CheckpointPolicy::kNone, 0.1, 2);
  auto d1 = cpu_device();
  auto d2 = cpu_device();
  auto a = gpt_engine(*d1, c);
  auto b = gpt_engine(*d2, c);
  const std::vector<io::HostBatch> mbs = batches(c, 0);
  EXPECT_THAT(error_of<UsageError>([&] { a->backward(); }), HasSubstr("call forward(batch) first"));
  EXPECT_FALSE(a->optimizer_step().has_value());  // nothing begun: nothing to do
  (void)a->forward(mbs[0]);
  EXPECT_THAT(error_of<UsageError>([&] { (void)a->forward(mbs[1]); }), HasSubstr("call backward()"));
  EXPECT_THAT(error_of<UsageError>([&] { (void)a->optimizer_step(); }), HasSubstr("call backward() first"));
  EXPECT_THAT(error_of<UsageError>([&] { (void)a->train_step(mbs); }), HasSubstr("is unfinished"));
  // Nothing may change the model, plan or parameters between a forward and its backward.
  EXPECT_THAT(error_of<UsageError>([&] { (void)a->evaluate(mbs); }), HasSubstr("evaluate: a step"));
  EXPECT_THAT(error_of<UsageError>([&] { (void)a->profile(); }), HasSubstr("profile: a step"));
  EXPECT_THAT(error_of<UsageError>([&] { a->set_plan(a->plan()); }), HasSubstr("set_plan: a step"));
  EXPECT_THAT(error_of<UsageError>([&] { a->set_params_host(a->params_host()); }),
              HasSubstr("set_params_host: a step"));
  EXPECT_THAT(error_of<UsageError>([&] { a->offload_states(); }), HasSubstr("offload_states: a step"));
  a->backward();
  EXPECT_FALSE(a->optimizer_step().has_value());  // 1 of 2 micro-batches
  (void)a->forward(mbs[1]);
  a->backward();
  EXPECT_TRUE(a->is_gradient_accumulation_boundary());
  EXPECT_THAT(error_of<UsageError>([&] { (void)a->forward(mbs[0]); }), HasSubstr("call optimizer_step()"));
  io::HostBatch wrong = mbs[0];
  wrong.tokens.pop_back();
  const StepResult ra = *a->optimizer_step();
  EXPECT_THAT(error_of<InvalidArgument>([&] { (void)a->forward(wrong); }), HasSubstr("tokens"));
  const StepResult rb = b->train_step(mbs);
  EXPECT_EQ(ra.loss, rb.loss);
  EXPECT_TRUE(bitwise_equal(a->params_host(), b->params_host()));
  // After the misuse the next steps are still the same.
  EXPECT_EQ(a->train_step(batches(c, 1)).loss, b->train_step(batches(c, 1)).loss);
  EXPECT_TRUE(bitwise_equal(a->params_host(), b->params_host()));
}

}  // namespace
}  // namespace porter::engine
