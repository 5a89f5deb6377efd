// porter.model.attention "flash" through the Engine: every checkpoint policy gives the same
// bits, the predicted peaks equal the measured ones and the profiled bytes the analytic
// model, for the GPT and the grouped-query Llama, f32 and bf16; the losses follow the
// materialised attention's within f32 rounding; a block saves (B, H, T) f32 instead of
// (B, H, T, T).
#include <algorithm>
#include <cmath>

#include <gtest/gtest.h>

#include "engine/forecast.h"
#include "engine_test_util.h"
#include "models/analytic.h"

namespace porter::engine {
namespace {

using namespace porter::engine::testing;
using config::AttentionKind;
using config::CheckpointPolicy;

const std::vector<CheckpointPolicy> kPolicies = {
    CheckpointPolicy::kNone,  CheckpointPolicy::kFull, CheckpointPolicy::kUniform,
    CheckpointPolicy::kBlock, CheckpointPolicy::kSqrt, CheckpointPolicy::kSelective,
    CheckpointPolicy::kOptimal};

// The tiny model at a sequence length that spans several of the kernels' query blocks and
// key tiles (odd, so the last ones are partial).
config::Config flash_config(CheckpointPolicy p, bool llama, bool bf16,
                            AttentionKind attention = AttentionKind::kFlash) {
  config::Config c = tiny_config(p, 0.1, 2, bf16);
  c.porter.model.seq_len = 67;
  c.porter.model.attention = attention;
  if (llama) {
    c.porter.model.type = config::ModelType::kLlama;
    c.porter.model.kv_heads = 2;
    c.porter.model.intermediate = 96;
  }
  c.porter.checkpointing.every_n_layers = 2;
  c.porter.checkpointing.block_layers = 2;
  c.porter.checkpointing.memory_budget = config::MemoryBudget{0.6};
  return c;
}

std::string what(CheckpointPolicy p, bool llama, bool bf16) {
  return std::string(config::to_string(p)) + (llama ? " llama" : " gpt") + (bf16 ? " bf16" : " f32");
}

models::TransformerShape shape_of(const config::Config& c, tensor::DType dtype) {
  return {c.porter.model, c.train_micro_batch_size_per_gpu, c.porter.model.seq_len, dtype};
}

TEST(EngineFlashTest, EveryPolicyGivesTheSameBitsAndItsPredictedPeaks) {
  for (bool llama : {false, true}) {
    for (bool bf16 : {false, true}) {
      std::vector<double> ref_losses;
      std::vector<float> ref_grads;
      SavedState ref_state;
      for (CheckpointPolicy p : kPolicies) {
        SCOPED_TRACE(what(p, llama, bf16));
        const config::Config c = flash_config(p, llama, bf16);
        auto device = cpu_device();
        auto e = gpt_engine(*device, c);
        const size_t baseline = e->allocator().stats().requested_bytes;
        std::vector<double> losses;
        std::vector<float> grads;
        size_t peak = 0, total = 0;
        for (int s = 0; s < 3; ++s) {
          const StepResult r = e->train_step(batches(c, s));
          losses.push_back(r.loss);
          peak = std::max(peak, r.peak_activation_bytes);
          total = std::max(total, r.peak_bytes);
          if (s == 0) grads = e->grads_host();
          EXPECT_EQ(e->allocator().stats().requested_bytes, baseline);
        }
        const MemoryReport m = e->memory_report();
        EXPECT_EQ(m.predicted_activation_bytes, peak) << e->plan().schedule.to_string();
        EXPECT_EQ(m.predicted_peak_bytes, total);
        if (p == CheckpointPolicy::kNone) {
          EXPECT_EQ(peak, models::none_peak_bytes(shape_of(c, e->compute_dtype())));
          ref_losses = losses;
          ref_grads = grads;
          ref_state = saved_state(*e);
          continue;
        }
        EXPECT_EQ(losses, ref_losses);
        EXPECT_TRUE(bitwise_equal(grads, ref_grads));
        expect_same_state(saved_state(*e), ref_state, what(p, llama, bf16));
      }
    }
  }
}

TEST(EngineFlashTest, ProfiledBytesEqualTheAnalyticModel) {
  for (bool llama : {false, true}) {
    for (bool bf16 : {false, true}) {
      SCOPED_TRACE(what(CheckpointPolicy::kFull, llama, bf16));
      const config::Config c = flash_config(CheckpointPolicy::kFull, llama, bf16);
      auto device = cpu_device();
      auto e = gpt_engine(*device, c);
      const checkpoint::ChainCosts prof = e->profile();
      const checkpoint::ChainCosts ana =
          models::analytic_transformer_costs(shape_of(c, e->compute_dtype()));
      expect_costs_match(prof, ana);
    }
  }
}

// Tensor parallelism 2, with and without sequence parallelism, offloaded and partitioned
// checkpoints included: the losses of one rank within rounding, the ranks in step, every
// policy bit-identical to none, the peaks as predicted.
TEST(EngineFlashTest, TensorParallelMatchesOneRankAndIsBitwiseAcrossPolicies) {
  auto tp_config = [](int tp, bool sp, CheckpointPolicy policy) {
    config::Config c = flash_config(policy, /*llama=*/true, false);
    c.gradient_accumulation_steps = 1;
    c.world_size = tp;
    c.train_batch_size = c.train_micro_batch_size_per_gpu;
    c.porter.model.tensor_parallel = tp;
    c.porter.model.sequence_parallel = sp;
    c.porter.model.seq_len = 34;  // 2 x 34 token rows split evenly under sequence parallelism
    c.porter.comm.timeout_s = 30.0;
    c.porter.checkpointing.partition_min_bytes = 0;
    return c;
  };
  const std::vector<TpRankRun> one = run_tp_ranks(tp_config(1, false, CheckpointPolicy::kNone), 3);
  for (bool sp : {false, true}) {
    SCOPED_TRACE(sp ? "sequence parallel" : "tensor parallel");
    const std::vector<TpRankRun> two = run_tp_ranks(tp_config(2, sp, CheckpointPolicy::kNone), 3);
    for (size_t s = 0; s < one[0].steps.size(); ++s) {
      EXPECT_NEAR(two[0].steps[s].loss, one[0].steps[s].loss,
                  1e-5 * std::fabs(one[0].steps[s].loss))
          << "step " << s;
      EXPECT_EQ(two[1].steps[s].loss, two[0].steps[s].loss);
    }
    for (CheckpointPolicy policy : {CheckpointPolicy::kFull, CheckpointPolicy::kSelective}) {
      config::Config c = tp_config(2, sp, policy);
      if (policy == CheckpointPolicy::kFull) {
        config::ActivationCheckpointingConfig ac;
        ac.partition_activations = !sp;
        ac.cpu_checkpointing = true;
        c.activation_checkpointing = ac;
        c.porter.checkpointing.keep_last_on_device = 0;
      }
      const std::vector<TpRankRun> got = run_tp_ranks(c, 3);
      expect_bitwise_runs(got, two, std::string(config::to_string(policy)));
      for (size_t r = 0; r < got.size(); ++r) {
        EXPECT_EQ(got[r].memory.peak_activation_bytes, got[r].memory.predicted_activation_bytes)
            << "rank " << r;
      }
    }
  }
}

TEST(EngineFlashTest, FollowsTheMaterialisedAttentionWithinRounding) {
  for (bool llama : {false, true}) {
    SCOPED_TRACE(llama ? "llama" : "gpt");
    std::vector<std::vector<double>> losses;
    std::vector<std::vector<float>> grads;
    for (AttentionKind kind : {AttentionKind::kMaterialized, AttentionKind::kFlash}) {
      const config::Config c = flash_config(CheckpointPolicy::kNone, llama, false, kind);
      auto device = cpu_device();
      auto e = gpt_engine(*device, c);
      std::vector<double> l;
      for (int s = 0; s < 3; ++s) {
        l.push_back(e->train_step(batches(c, s)).loss);
        if (s == 0) grads.push_back(e->grads_host());
      }
      losses.push_back(l);
    }
    for (size_t s = 0; s < losses[0].size(); ++s) {
      EXPECT_NEAR(losses[1][s], losses[0][s], 2e-5 * std::abs(losses[0][s])) << "step " << s;
    }
    ASSERT_EQ(grads[0].size(), grads[1].size());
    double max_abs = 0.0, max_diff = 0.0;
    for (size_t i = 0; i < grads[0].size(); ++i) {
      max_abs = std::max(max_abs, static_cast<double>(std::abs(grads[0][i])));
      max_diff = std::max(max_diff, static_cast<double>(std::abs(grads[0][i] - grads[1][i])));
    }
    EXPECT_LT(max_diff, 1e-4 * max_abs);
    // The f32 losses may round alike; the gradients show the different orders of the sums.
    EXPECT_GT(max_diff, 0.0) << "the two attentions sum in different orders";
  }
}

TEST(EngineFlashTest, ABlockKeepsRowStatisticsInsteadOfTheProbabilities) {
  for (bool llama : {false, true}) {
    config::Config c = flash_config(CheckpointPolicy::kNone, llama, false);
    const models::TransformerShape flash = shape_of(c, tensor::DType::kF32);
    c.porter.model.attention = AttentionKind::kMaterialized;
    const models::TransformerShape mat = shape_of(c, tensor::DType::kF32);
    const size_t b = 2, h = 4, t = 67, d = 8;
    // The probabilities go, the row log-sum-exp comes; the Llama's qkv also loses the
    // expanded key and value heads (4 query heads over 2 key/value heads).
    size_t expected = b * h * t * t * 4 - b * h * t * 4;
    if (llama) expected += b * t * 2 * (h - 2) * d * 4;
    EXPECT_EQ(models::layer_bytes(mat) - models::layer_bytes(flash), expected);
    EXPECT_LT(models::korthikanti_layer_bytes(flash), models::korthikanti_layer_bytes(mat));
  }
}

TEST(EngineFlashTest, AutoTakesTheMaterialisedAttentionWhereItFitsAndFlashWhereNot) {
  config::Config c = flash_config(CheckpointPolicy::kNone, true, false, AttentionKind::kAuto);
  c.porter.model.seq_len = 1024;
  c.porter.model.layers = 2;
  ForecastOptions fo;
  fo.time_host_update = false;
  fo.device = nominal_cpu_device_model(size_t{1} << 30);
  fo.capacity_bytes = size_t{1} << 30;
  EXPECT_EQ(resolve_attention(c, fo), AttentionKind::kMaterialized);
  // Two layers' (2, 4, 1024, 1024) f32 probabilities are 64 MiB: not in 48 MiB.
  fo.capacity_bytes = size_t{48} << 20;
  EXPECT_EQ(resolve_attention(c, fo), AttentionKind::kFlash);
  const Forecast f = forecast(c, fo);
  EXPECT_EQ(f.config.porter.model.attention, AttentionKind::kFlash);
  EXPECT_TRUE(f.fits()) << f.verdict();
  c.porter.model.attention = AttentionKind::kMaterialized;  // asked for: kept
  EXPECT_EQ(resolve_attention(c, fo), AttentionKind::kMaterialized);
  // From 8192 tokens on the cpu, flash also where the materialised attention would fit.
  c.porter.model.attention = AttentionKind::kAuto;
  c.porter.model.seq_len = 8192;
  fo.capacity_bytes = size_t{16} << 30;
  EXPECT_EQ(resolve_attention(c, fo), AttentionKind::kFlash);
}

// porter.model.loss_tiles 0: the fewest tiles with which the run fits.
TEST(EngineFlashTest, LossTilesZeroTakesTheFewestTilesThatFit) {
  config::Config c = flash_config(CheckpointPolicy::kFull, true, false, AttentionKind::kFlash);
  c.porter.model.seq_len = 512;
  c.porter.model.vocab = 8192;  // (2 x 512, 8192) f32 logits: 32 MiB, and their gradient
  c.porter.model.loss_tiles = 0;
  ForecastOptions fo;
  fo.time_host_update = false;
  fo.device = nominal_cpu_device_model(size_t{1} << 30);
  fo.capacity_bytes = size_t{1} << 30;
  EXPECT_EQ(resolve_loss_tiles(c, fo), 1);
  fo.capacity_bytes = size_t{48} << 20;
  const int64_t k = resolve_loss_tiles(c, fo);
  EXPECT_GT(k, 1);
  config::Config at = c;
  at.porter.model.loss_tiles = k;
  EXPECT_TRUE(forecast(at, fo).fits());
  at.porter.model.loss_tiles = k / 2;
  EXPECT_FALSE(forecast(at, fo).fits());
  const Forecast f = forecast(c, fo);
  EXPECT_EQ(f.config.porter.model.loss_tiles, k);
  c.porter.model.loss_tiles = 3;  // asked for: kept
  EXPECT_EQ(resolve_loss_tiles(c, fo), 3);
  // Both left to porter: one count for both, the fewest that fits.
  c.porter.model.loss_tiles = 0;
  c.porter.model.mlp_tiles = 0;
  const config::Config both = resolve_tiles(c, fo);
  const int64_t kb = both.porter.model.loss_tiles;
  EXPECT_EQ(both.porter.model.mlp_tiles, kb);
  EXPECT_GE(kb, 1);
  EXPECT_LE(kb, k);
  EXPECT_TRUE(forecast(both, fo).fits());
  if (kb > 1) {
    config::Config fewer = both;
    fewer.porter.model.loss_tiles = fewer.porter.model.mlp_tiles = kb / 2;
    EXPECT_FALSE(forecast(fewer, fo).fits());
  }
}

}  // namespace
}  // namespace porter::engine
