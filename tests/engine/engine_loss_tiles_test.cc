// porter.model.loss_tiles (Note [Loss tiles] in models/transformer.cc): the head's logits and
// cross-entropy over tiles of the token rows.
//
// - Against the untiled head (k = 1) with k = 3, 7 and 40 (> N, one row a tile) on 2 x 17
//   rows, which no k divides: the first step's loss (a forward before any update) is the
//   same bits for every k; the first gradients agree within f32 rounding of each tensor's
//   largest value; GPT and Llama, tied and untied, f32 and bf16. Two tiled runs of one k
//   are bit-identical.
// - Every checkpoint policy at k = 4: the predicted activation and total peaks equal the
//   measured ones and nothing leaks; the analytic stage costs equal the profiled ones.
// - The analytic head keeps no logits: its saved bytes drop by the logits' bytes less the
//   N x 4 bytes of log-sum-exp.
// - Tensor parallelism 2, with and without sequence parallelism: k = 3 against k = 1.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>

#include <gtest/gtest.h>

#include "models/analytic.h"
#include "models/transformer.h"
#include "engine_test_util.h"

namespace porter::engine {
namespace {

using namespace porter::engine::testing;
using config::CheckpointPolicy;

const std::vector<CheckpointPolicy> kPolicies = {
    CheckpointPolicy::kNone,  CheckpointPolicy::kFull,      CheckpointPolicy::kUniform,
    CheckpointPolicy::kBlock, CheckpointPolicy::kSqrt,      CheckpointPolicy::kSelective,
    CheckpointPolicy::kOptimal};

struct Variant {
  bool llama = false;
  bool tied = true;
  bool bf16 = false;
  std::string name() const {
    return std::string(llama ? "llama" : "gpt") + (tied ? " tied" : " untied") +
           (bf16 ? " bf16" : " f32");
  }
};

config::Config tiles_config(const Variant& v, int64_t tiles,
                            CheckpointPolicy p = CheckpointPolicy::kNone) {
  config::Config c = tiny_config(p, 0.1, 2, v.bf16);
  c.porter.model.seq_len = 17;  // N = 34 rows: 3 tiles of 12, 12, 10; 7 of 5 (the last 4)
  c.porter.model.tie_embeddings = v.tied;
  c.porter.model.loss_tiles = tiles;
  if (v.llama) {
    c.porter.model.type = config::ModelType::kLlama;
    c.porter.model.kv_heads = 2;
    c.porter.model.intermediate = 96;
  }
  c.porter.checkpointing.every_n_layers = 2;
  c.porter.checkpointing.block_layers = 2;
  c.porter.checkpointing.memory_budget = config::MemoryBudget{0.6};
  return c;
}

struct TilesRun {
  std::vector<double> losses;
  std::vector<float> first_grads;
};

TilesRun run(const config::Config& c, int steps) {
  auto device = cpu_device();
  auto e = gpt_engine(*device, c);
  TilesRun r;
  for (int s = 0; s < steps; ++s) {
    r.losses.push_back(e->train_step(batches(c, s)).loss);
    if (s == 0) r.first_grads = e->grads_host();
  }
  return r;
}

// |a - b| <= tol x the largest |b| of each tensor of the layout; returns the worst ratio.
double worst_relative(const nn::ParamLayout& layout, const std::vector<float>& a,
                      const std::vector<float>& b) {
  double worst = 0.0;
  for (const nn::ParamEntry& e : layout.entries()) {
    double scale = 0.0, diff = 0.0;
    for (int64_t i = e.offset_elems; i < e.offset_elems + e.shape.numel(); ++i) {
      const auto k = static_cast<size_t>(i);
      scale = std::max(scale, static_cast<double>(std::fabs(b[k])));
      diff = std::max(diff, std::fabs(static_cast<double>(a[k]) - b[k]));
    }
    if (scale > 0.0) worst = std::max(worst, diff / scale);
  }
  return worst;
}

const std::vector<Variant> kVariants = {
    {false, true, false}, {false, false, false}, {true, true, false}, {true, false, false},
    {false, true, true},  {true, false, true}};

TEST(EngineLossTilesTest, TiledHeadAgreesWithTheUntiledOne) {
  for (const Variant& v : kVariants) {
    SCOPED_TRACE(v.name());
    const TilesRun one = run(tiles_config(v, 1), 3);
    const models::Transformer model(tiles_config(v, 1).porter.model);
    // f32: the reordered sums of dW alone; bf16: each tile's partial sum of dW rounded to
    // bf16 before the next is added.
    const double grad_tol = v.bf16 ? 2e-2 : 1e-5;
    TilesRun first;
    for (int64_t k : {3, 7, 40}) {
      SCOPED_TRACE("loss_tiles " + std::to_string(k));
      const TilesRun got = run(tiles_config(v, k), 3);
      // Bit-identical: the per-row losses and their one sum (Note [Loss tiles]).
      EXPECT_EQ(got.losses[0], one.losses[0]);
      for (size_t s = 0; s < got.losses.size(); ++s) {
        EXPECT_NEAR(got.losses[s], one.losses[s], (v.bf16 ? 1e-3 : 1e-6) * one.losses[s])
            << "step " << s;
      }
      const double worst = worst_relative(model.layout(), got.first_grads, one.first_grads);
      EXPECT_LE(worst, grad_tol);
      std::printf("%s loss_tiles %lld: first gradients within %.3g of each tensor's largest\n",
                  v.name().c_str(), static_cast<long long>(k), worst);
      if (k == 3) first = got;
    }
    // A tiled run is deterministic: the tiles are summed in a fixed order.
    const TilesRun again = run(tiles_config(v, 3), 3);
    EXPECT_EQ(again.losses, first.losses);
    EXPECT_TRUE(bitwise_equal(again.first_grads, first.first_grads));
  }
}

TEST(EngineLossTilesTest, EveryPolicyIsBitIdenticalWithTiles) {
  for (const Variant& v : {Variant{false, true, false}, Variant{true, false, true}}) {
    std::vector<float> ref_grads;
    std::vector<double> ref_losses;
    for (CheckpointPolicy p : kPolicies) {
      SCOPED_TRACE(std::string(config::to_string(p)) + " " + v.name());
      const config::Config c = tiles_config(v, 4, p);
      auto device = cpu_device();
      auto e = gpt_engine(*device, c);
      std::vector<double> losses;
      std::vector<float> grads;
      for (int s = 0; s < 2; ++s) {
        losses.push_back(e->train_step(batches(c, s)).loss);
        if (s == 0) grads = e->grads_host();
      }
      if (p == CheckpointPolicy::kNone) {
        ref_grads = grads;
        ref_losses = losses;
        continue;
      }
      EXPECT_TRUE(bitwise_equal(grads, ref_grads));
      EXPECT_EQ(losses, ref_losses);
    }
  }
}

models::TransformerShape shape_of(const config::Config& c, tensor::DType dtype) {
  return {c.porter.model, c.train_micro_batch_size_per_gpu, c.porter.model.seq_len, dtype};
}

TEST(EngineLossTilesTest, PredictedPeaksMatchMeasuredAndNothingLeaks) {
  for (bool llama : {false, true}) {
    for (bool bf16 : {false, true}) {
      for (CheckpointPolicy p : kPolicies) {
        const Variant v{llama, !llama, bf16};
        SCOPED_TRACE(std::string(config::to_string(p)) + " " + v.name());
        const config::Config c = tiles_config(v, 4, p);
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
        if (p == CheckpointPolicy::kNone) {
          EXPECT_EQ(peak, models::none_peak_bytes(shape_of(c, e->compute_dtype())));
        }
      }
    }
  }
}

TEST(EngineLossTilesTest, ProfiledBytesEqualTheAnalyticModel) {
  for (bool llama : {false, true}) {
    for (bool bf16 : {false, true}) {
      const Variant v{llama, !llama, bf16};
      SCOPED_TRACE(v.name());
      const config::Config c = tiles_config(v, 4, CheckpointPolicy::kFull);
      auto device = cpu_device();
      auto e = gpt_engine(*device, c);
      const std::vector<float> grads = e->grads_host();
      const checkpoint::ChainCosts prof = e->profile();
      EXPECT_TRUE(bitwise_equal(e->grads_host(), grads));
      const checkpoint::ChainCosts ana =
          models::analytic_transformer_costs(shape_of(c, e->compute_dtype()));
      expect_costs_match(prof, ana);
    }
  }
}

// The head's keep option: what its tape holds between forward and backward.
size_t head_saved_bytes(const models::TransformerShape& s) {
  return models::analytic_transformer_costs(s).stages.back().option(checkpoint::SaveOption::kKeep).saved_bytes;
}

TEST(EngineLossTilesTest, TheHeadKeepsNoLogits) {
  // A Llama-7B-like shape at seq 8192 in bf16, whole and at tensor_parallel 2 (logits of
  // V / 2 columns per rank), with and without sequence parallelism.
  for (int64_t tp : {1, 2}) {
    for (bool sp : {false, true}) {
      if (tp == 1 && sp) continue;
      config::ModelConfig m;
      m.type = config::ModelType::kLlama;
      m.layers = 32;
      m.hidden = 4096;
      m.heads = 32;
      m.intermediate = 11008;
      m.seq_len = 8192;
      m.vocab = 32000;
      m.tie_embeddings = false;
      m.tensor_parallel = tp;
      m.sequence_parallel = sp;
      models::TransformerShape s{m, 1, 8192, tensor::DType::kBF16};
      const size_t n = 8192, vs = 32000 / static_cast<size_t>(tp);
      const size_t untiled = head_saved_bytes(s);
      s.model.loss_tiles = 8;
      const size_t tiled = head_saved_bytes(s);
      const size_t logits = n * vs * 2;
      SCOPED_TRACE("tensor_parallel " + std::to_string(tp) + (sp ? " sp" : ""));
      // At tp 1 the untiled head keeps no log-sum-exp; at tp > 1 it keeps one too.
      EXPECT_EQ(untiled - tiled, tp == 1 ? logits - n * 4 : logits);
      std::printf("head saved bytes, tp %lld%s: loss_tiles 1 %zu, loss_tiles 8 %zu\n",
                  static_cast<long long>(tp), sp ? " sp" : "", untiled, tiled);
      // The forward and backward peaks hold one tile's logits, not every row's.
      const checkpoint::StageCost head8 = models::analytic_transformer_costs(s).stages.back();
      s.model.loss_tiles = 1;
      const checkpoint::StageCost head1 = models::analytic_transformer_costs(s).stages.back();
      const auto kKeep = checkpoint::SaveOption::kKeep;
      EXPECT_LT(head8.option(kKeep).forward_total_peak_bytes,
                head1.option(kKeep).forward_total_peak_bytes);
      EXPECT_LT(head8.backward_total_peak_bytes, head1.backward_total_peak_bytes);
    }
  }
}

config::Config tp_tiles_config(int64_t tiles, bool sp) {
  config::Config c = tiny_config(CheckpointPolicy::kFull, /*dropout=*/0.1, /*accumulation=*/1);
  c.world_size = 2;
  c.train_batch_size = c.train_micro_batch_size_per_gpu;
  c.porter.model.tensor_parallel = 2;
  c.porter.model.sequence_parallel = sp;
  c.porter.model.vocab = 69;  // shards of 35, the last 34 real
  c.porter.model.loss_tiles = tiles;
  c.porter.comm.timeout_s = 30.0;
  return c;
}

TEST(EngineLossTilesTest, TensorParallelTilesAgreeWithUntiled) {
  for (bool sp : {false, true}) {
    SCOPED_TRACE(sp ? "sequence parallel" : "tensor parallel");
    const std::vector<TpRankRun> one = run_tp_ranks(tp_tiles_config(1, sp), 3);
    const std::vector<TpRankRun> tiled = run_tp_ranks(tp_tiles_config(3, sp), 3);
    const models::Transformer part(tp_tiles_config(1, sp).porter.model, 0);
    for (size_t r = 0; r < 2; ++r) {
      // The first loss: every row's partial, gathered and combined as untiled.
      EXPECT_EQ(tiled[r].steps[0].loss, one[r].steps[0].loss) << "rank " << r;
      for (size_t s = 0; s < one[r].steps.size(); ++s) {
        EXPECT_NEAR(tiled[r].steps[s].loss, one[r].steps[s].loss, 1e-6 * one[r].steps[s].loss)
            << "rank " << r << " step " << s;
      }
      std::vector<float> a = tiled[r].first_grads, b = one[r].first_grads;
      a.resize(static_cast<size_t>(part.layout().total_elems()));
      b.resize(a.size());
      EXPECT_LE(worst_relative(part.layout(), a, b), 1e-5) << "rank " << r;
    }
  }
}

}  // namespace
}  // namespace porter::engine
