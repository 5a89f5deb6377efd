// The Llama and Qwen2 (the Llama with q, k and v biases) through the Engine (Note [Llama] in
// models/transformer.h): every checkpoint policy, ZeRO stage, offload and tensor-parallel
// setting gives the losses and the whole training state of the plain run bit for bit, as for
// the GPT, and the plan's predicted activation peak is the measured one.
#include <gtest/gtest.h>

#include <cmath>

#include "engine_test_util.h"

namespace porter::engine {
namespace {

using namespace porter::engine::testing;
using P = config::CheckpointPolicy;

void make_llama(config::Config& c, int64_t kv_heads, config::ModelType arch) {
  config::ModelConfig& m = c.porter.model;
  m.type = arch;
  m.kv_heads = kv_heads;
  m.intermediate = 3 * m.hidden;
  m.rope_theta = 5e5;
  m.norm_eps = 1e-6;
  m.tie_embeddings = false;
}

// zero_config's model at 4 heads, 2 key/value heads, on `world` data-parallel ranks.
config::Config llama_zero_config(int world, int stage, config::ModelType arch) {
  config::Config c = zero_config(world, stage);
  c.porter.model.heads = 4;
  c.porter.model.dropout = 0.1;
  make_llama(c, 2, arch);
  return c;
}

// Each test runs for the Llama and for Qwen2.
class EngineLlama : public ::testing::TestWithParam<config::ModelType> {};

TEST_P(EngineLlama, PoliciesStagesAndOffloadGiveBitwiseEqualLosses) {
  const config::ModelType arch = GetParam();
  const std::vector<DpRankRun> base = run_dp_ranks(llama_zero_config(2, 0, arch), 3);
  ASSERT_TRUE(std::isfinite(base[0].losses.back()));
  EXPECT_LT(base[0].losses.back(), base[0].losses.front());
  struct Variant {
    std::string name;
    int stage;
    P policy;
    bool offload_optimizer = false;
    bool offload_param = false;
  };
  const std::vector<Variant> variants = {
      {"full", 0, P::kFull},
      {"selective", 0, P::kSelective},
      {"sqrt", 0, P::kSqrt},
      {"zero-1", 1, P::kNone},
      {"zero-2 selective", 2, P::kSelective},
      {"zero-3 full", 3, P::kFull},
      {"zero-2 optimizer offload", 2, P::kFull, true},
      {"zero-3 optimizer and parameter offload", 3, P::kFull, true, true},
  };
  for (const Variant& v : variants) {
    SCOPED_TRACE(v.name);
    config::Config c = llama_zero_config(2, v.stage, arch);
    c.porter.checkpointing.policy = v.policy;
    if (v.policy == P::kSelective) c.porter.checkpointing.selective_ops = {"core_attention"};
    if (v.offload_optimizer) c.zero_optimization.offload_optimizer.device = config::OffloadDevice::kCpu;
    if (v.offload_param) c.zero_optimization.offload_param.device = config::OffloadDevice::kCpu;
    expect_bitwise_runs(run_dp_ranks(c, 3), base, v.name);
  }
}

TEST_P(EngineLlama, OptimalPlanFitsAndPredictsTheMeasuredPeak) {
  config::Config c = llama_zero_config(1, 0, GetParam());
  c.porter.checkpointing.policy = P::kOptimal;
  c.porter.checkpointing.memory_budget = config::MemoryBudget{0.7};
  const std::vector<DpRankRun> got = run_dp_ranks(c, 2);
  EXPECT_EQ(got[0].memory.peak_activation_bytes, got[0].prediction.peak_activation_bytes)
      << got[0].plan;
  expect_bitwise_runs(got, run_dp_ranks(llama_zero_config(1, 0, GetParam()), 2),
                      "optimal vs none");
}

config::Config llama_tp_config(int world, int tp, P policy, bool sp, config::ModelType arch) {
  config::Config c = tiny_config(policy, /*dropout=*/0.1, /*accumulation=*/1);
  c.world_size = world;
  c.train_batch_size = c.train_micro_batch_size_per_gpu * (world / tp);
  c.porter.model.tensor_parallel = tp;
  c.porter.model.sequence_parallel = sp;
  c.porter.model.vocab = 70;
  c.porter.comm.timeout_s = 30.0;
  c.porter.checkpointing.partition_min_bytes = 0;
  make_llama(c, c.porter.model.heads / 2 >= tp ? c.porter.model.heads / 2 : tp, arch);
  return c;
}

TEST_P(EngineLlama, TensorParallelMatchesOneRankAndIsBitwiseAcrossPolicies) {
  const config::ModelType arch = GetParam();
  for (bool sp : {false, true}) {
    SCOPED_TRACE(sp ? "sequence parallel" : "tensor parallel");
    const std::vector<TpRankRun> one =
        run_tp_ranks(llama_tp_config(1, 1, P::kNone, false, arch), 4);
    const std::vector<TpRankRun> two = run_tp_ranks(llama_tp_config(2, 2, P::kNone, sp, arch), 4);
    for (size_t s = 0; s < one[0].steps.size(); ++s) {
      EXPECT_NEAR(two[0].steps[s].loss, one[0].steps[s].loss, 1e-5 * std::fabs(one[0].steps[s].loss))
          << "step " << s;
      EXPECT_EQ(two[1].steps[s].loss, two[0].steps[s].loss);
    }
    for (P policy : {P::kFull, P::kSelective}) {
      config::Config c = llama_tp_config(2, 2, policy, sp, arch);
      if (policy == P::kFull) {
        config::ActivationCheckpointingConfig ac;
        ac.partition_activations = !sp;
        ac.cpu_checkpointing = true;
        c.activation_checkpointing = ac;
        c.porter.checkpointing.keep_last_on_device = 0;
      }
      const std::vector<TpRankRun> got = run_tp_ranks(c, 4);
      expect_bitwise_runs(got, two, std::string(config::to_string(policy)));
      for (size_t r = 0; r < got.size(); ++r) {
        EXPECT_EQ(got[r].memory.peak_activation_bytes, got[r].memory.predicted_activation_bytes)
            << "rank " << r;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Archs, EngineLlama,
                         ::testing::Values(config::ModelType::kLlama, config::ModelType::kQwen2),
                         [](const ::testing::TestParamInfo<config::ModelType>& info) {
                           return std::string(config::to_string(info.param));
                         });

}  // namespace
}  // namespace porter::engine
