// porter.model.mlp_tiles (Note [MLP tiles] in models/blocks.cc): each block's MLP as one op
// over tiles of the token rows, its intermediates recomputed in backward.
//
// - Against the untiled MLP (k = 1) with k = 3 and 7 on 2 x 17 rows, which neither divides:
//   the first step's loss is the same bits for every k, and so is every gradient but the
//   MLP's own weights (the activation gradients are the same bits); those agree within f32
//   rounding; GPT and Llama, f32 and bf16, dropout 0.1. Two tiled runs of one k are
//   bit-identical.
// - Every checkpoint policy at k = 4: bit-identical to none; the predicted activation and
//   total peaks equal the measured ones and nothing leaks; the analytic stage costs equal the
//   profiled ones.
// - A block's saved bytes drop by its intermediates: 2 x (B, T, 4C/t) for the GPT, 3 x
//   (B, T, F/t) for the Llama.
// - Tensor parallelism 2 without sequence parallelism against one rank and against untiled;
//   with sequence parallelism the config is refused.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>

#include <gtest/gtest.h>

#include "config/parse.h"
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
  bool bf16 = false;
  std::string name() const {
    return std::string(llama ? "llama" : "gpt") + (bf16 ? " bf16" : " f32");
  }
};

const std::vector<Variant> kVariants = {{false, false}, {false, true}, {true, false}, {true, true}};

config::Config tiles_config(const Variant& v, int64_t tiles,
                            CheckpointPolicy p = CheckpointPolicy::kNone) {
  config::Config c = tiny_config(p, 0.1, 2, v.bf16);
  c.porter.model.seq_len = 17;  // N = 34 rows: 3 tiles of 12, 12, 10; 7 of 5 (the last 4)
  c.porter.model.mlp_tiles = tiles;
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

// The MLP's own weights: the only gradients tiling reorders (Note [MLP tiles]).
bool mlp_weight(const std::string& name) {
  return name.find(".fc1.") != std::string::npos || name.find(".fc2.") != std::string::npos ||
         name.find(".mlp.") != std::string::npos;
}

// |a - b| <= tol x the largest |b| of each tensor of the layout; returns the worst ratio over
// the tensors `which` selects.
template <typename Which>
double worst_relative(const nn::ParamLayout& layout, const std::vector<float>& a,
                      const std::vector<float>& b, Which which) {
  double worst = 0.0;
  for (const nn::ParamEntry& e : layout.entries()) {
    if (!which(e.name)) continue;
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

// Whether every tensor `which` selects has the same bits in a and b.
template <typename Which>
bool same_bits(const nn::ParamLayout& layout, const std::vector<float>& a,
               const std::vector<float>& b, Which which) {
  for (const nn::ParamEntry& e : layout.entries()) {
    if (!which(e.name)) continue;
    const auto begin = static_cast<size_t>(e.offset_elems);
    const auto end = begin + static_cast<size_t>(e.shape.numel());
    if (!bitwise_equal(std::vector<float>(a.begin() + begin, a.begin() + end),
                       std::vector<float>(b.begin() + begin, b.begin() + end))) {
      ADD_FAILURE() << e.name << " differs";
      return false;
    }
  }
  return true;
}

TEST(EngineMlpTilesTest, TiledMlpAgreesWithTheUntiledOne) {
  for (const Variant& v : kVariants) {
    SCOPED_TRACE(v.name());
    const TilesRun one = run(tiles_config(v, 1), 3);
    const models::Transformer model(tiles_config(v, 1).porter.model);
    // f32: the reordered sums of dW alone; bf16: each tile's partial sum of dW rounded to
    // bf16 before the next is added.
    const double grad_tol = v.bf16 ? 2e-2 : 1e-5;
    TilesRun first;
    for (int64_t k : {3, 7}) {
      SCOPED_TRACE("mlp_tiles " + std::to_string(k));
      const TilesRun got = run(tiles_config(v, k), 3);
      // Bit-identical: every row of every activation (Note [MLP tiles]).
      EXPECT_EQ(got.losses[0], one.losses[0]);
      for (size_t s = 0; s < got.losses.size(); ++s) {
        EXPECT_NEAR(got.losses[s], one.losses[s], (v.bf16 ? 1e-3 : 1e-6) * one.losses[s])
            << "step " << s;
      }
      const double worst = worst_relative(model.layout(), got.first_grads, one.first_grads,
                                          [](const std::string&) { return true; });
      EXPECT_LE(worst, grad_tol);
      EXPECT_GT(worst_relative(model.layout(), got.first_grads, one.first_grads, mlp_weight),
                0.0) << "the MLP weight gradients sum over the rows in another order";
      // Every other gradient comes from bit-identical activation gradients.
      EXPECT_TRUE(same_bits(model.layout(), got.first_grads, one.first_grads,
                            [](const std::string& n) { return !mlp_weight(n); }));
      std::printf("%s mlp_tiles %lld: first gradients within %.3g of each tensor's largest\n",
                  v.name().c_str(), static_cast<long long>(k), worst);
      if (k == 3) first = got;
    }
    // A tiled run is deterministic: the tiles are summed in a fixed order.
    const TilesRun again = run(tiles_config(v, 3), 3);
    EXPECT_EQ(again.losses, first.losses);
    EXPECT_TRUE(bitwise_equal(again.first_grads, first.first_grads));
  }
}

TEST(EngineMlpTilesTest, EveryPolicyIsBitIdenticalWithTiles) {
  for (const Variant& v : kVariants) {
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

TEST(EngineMlpTilesTest, PredictedPeaksMatchMeasuredAndNothingLeaks) {
  for (const Variant& v : kVariants) {
    for (CheckpointPolicy p : kPolicies) {
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

TEST(EngineMlpTilesTest, ProfiledBytesEqualTheAnalyticModel) {
  for (const Variant& v : kVariants) {
    for (int64_t k : {4, 7}) {
      SCOPED_TRACE(v.name() + " mlp_tiles " + std::to_string(k));
      const config::Config c = tiles_config(v, k, CheckpointPolicy::kFull);
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

// A block's keep option: what its tape holds between forward and backward.
size_t block_saved_bytes(const models::TransformerShape& s) {
  return models::analytic_transformer_costs(s)
      .stages.at(1)
      .option(checkpoint::SaveOption::kKeep)
      .saved_bytes;
}

TEST(EngineMlpTilesTest, ABlockKeepsNoMlpIntermediates) {
  // The tiny shapes of the tests above, whole and at tensor_parallel 2.
  for (const Variant& v : {Variant{false, false}, Variant{true, true}}) {
    for (int64_t tp : {1, 2}) {
      SCOPED_TRACE(v.name() + " tensor_parallel " + std::to_string(tp));
      config::Config c = tiles_config(v, 1);
      c.porter.model.tensor_parallel = tp;
      models::TransformerShape s = shape_of(c, v.bf16 ? tensor::DType::kBF16 : tensor::DType::kF32);
      const size_t untiled = block_saved_bytes(s);
      s.model.mlp_tiles = 3;
      const size_t tiled = block_saved_bytes(s);
      const size_t b = 2, t = 17, dt = v.bf16 ? 2 : 4, utp = static_cast<size_t>(tp);
      const size_t want = v.llama ? 3 * b * t * (96 / utp) * dt : 2 * b * t * (4 * 32 / utp) * dt;
      EXPECT_EQ(untiled - tiled, want);
      EXPECT_EQ(models::layer_bytes(s) + want,
                [&] {
                  models::TransformerShape u = s;
                  u.model.mlp_tiles = 1;
                  return models::layer_bytes(u);
                }());
    }
  }
  // A Llama-7B block at seq 8192, micro-batch 1, bf16, flash attention: the three
  // (8192, 11008) bf16 intermediates, 3 x 180.4 MB, leave its saved bytes.
  config::ModelConfig m;
  m.type = config::ModelType::kLlama;
  m.layers = 32;
  m.hidden = 4096;
  m.heads = 32;
  m.intermediate = 11008;
  m.seq_len = 8192;
  m.vocab = 32000;
  m.tie_embeddings = false;
  m.attention = config::AttentionKind::kFlash;
  models::TransformerShape s{m, 1, 8192, tensor::DType::kBF16};
  const size_t one = models::layer_bytes(s);
  const checkpoint::StageCost block1 = models::analytic_transformer_costs(s).stages.at(1);
  s.model.mlp_tiles = 8;
  const size_t eight = models::layer_bytes(s);
  const checkpoint::StageCost block8 = models::analytic_transformer_costs(s).stages.at(1);
  EXPECT_EQ(one - eight, size_t{3} * 8192 * 11008 * 2);
  std::printf("llama-7b block, seq 8192, bf16, flash: layer_bytes mlp_tiles 1 %zu, "
              "mlp_tiles 8 %zu\n", one, eight);
  const auto kKeep = checkpoint::SaveOption::kKeep;
  std::printf("  forward total peak %zu -> %zu, backward total peak %zu -> %zu\n",
              block1.option(kKeep).forward_total_peak_bytes,
              block8.option(kKeep).forward_total_peak_bytes, block1.backward_total_peak_bytes,
              block8.backward_total_peak_bytes);
  EXPECT_LT(block8.option(kKeep).forward_total_peak_bytes,
            block1.option(kKeep).forward_total_peak_bytes);
  EXPECT_LT(block8.backward_total_peak_bytes, block1.backward_total_peak_bytes);
  // The same forward FLOPs: the tiles run the same matmuls.
  EXPECT_EQ(block8.forward_flops, block1.forward_flops);
}

config::Config tp_tiles_config(bool llama, int64_t tp, int64_t tiles) {
  config::Config c = tiny_config(CheckpointPolicy::kNone, /*dropout=*/0.1, /*accumulation=*/1);
  c.world_size = tp;
  c.train_batch_size = c.train_micro_batch_size_per_gpu;
  c.porter.model.tensor_parallel = tp;
  c.porter.model.seq_len = 17;
  c.porter.model.mlp_tiles = tiles;
  if (llama) {
    c.porter.model.type = config::ModelType::kLlama;
    c.porter.model.kv_heads = 2;
    c.porter.model.intermediate = 96;
  }
  c.porter.comm.timeout_s = 30.0;
  return c;
}

TEST(EngineMlpTilesTest, TensorParallelTilesAgreeWithOneRankAndUntiled) {
  for (bool llama : {false, true}) {
    SCOPED_TRACE(llama ? "llama" : "gpt");
    const std::vector<TpRankRun> whole = run_tp_ranks(tp_tiles_config(llama, 1, 1), 3);
    const std::vector<TpRankRun> one = run_tp_ranks(tp_tiles_config(llama, 2, 1), 3);
    const std::vector<TpRankRun> tiled = run_tp_ranks(tp_tiles_config(llama, 2, 3), 3);
    const models::Transformer part(tp_tiles_config(llama, 2, 1).porter.model, 0);
    for (size_t r = 0; r < 2; ++r) {
      // The first loss: the same rows through the same partial products and all-reduce.
      EXPECT_EQ(tiled[r].steps[0].loss, one[r].steps[0].loss) << "rank " << r;
      for (size_t s = 0; s < one[r].steps.size(); ++s) {
        EXPECT_NEAR(tiled[r].steps[s].loss, one[r].steps[s].loss, 1e-6 * one[r].steps[s].loss)
            << "rank " << r << " step " << s;
        EXPECT_NEAR(tiled[r].steps[s].loss, whole[0].steps[s].loss,
                    1e-5 * whole[0].steps[s].loss)
            << "rank " << r << " step " << s;
        EXPECT_EQ(tiled[r].steps[s].loss, tiled[0].steps[s].loss);
      }
      std::vector<float> a = tiled[r].first_grads, b = one[r].first_grads;
      a.resize(static_cast<size_t>(part.layout().total_elems()));
      b.resize(a.size());
      EXPECT_LE(worst_relative(part.layout(), a, b, [](const std::string&) { return true; }),
                1e-5)
          << "rank " << r;
    }
    // Full recompute with tiles: the same bits, its activation peak as predicted.
    config::Config full = tp_tiles_config(llama, 2, 3);
    full.porter.checkpointing.policy = CheckpointPolicy::kFull;
    const std::vector<TpRankRun> got = run_tp_ranks(full, 3);
    expect_bitwise_runs(got, tiled, "full");
    for (size_t r = 0; r < got.size(); ++r) {
      EXPECT_EQ(got[r].memory.peak_activation_bytes, got[r].memory.predicted_activation_bytes)
          << "rank " << r;
    }
  }
}

TEST(EngineMlpTilesTest, SequenceParallelismIsRefused) {
  const std::string json =
      "{\"train_batch_size\": 2, \"train_micro_batch_size_per_gpu\": 1, \"porter\": {\"model\": "
      "{\"tensor_parallel\": 2, \"sequence_parallel\": true, \"seq_len\": 8, \"mlp_tiles\": 4}}}";
  config::ParseOptions o;
  o.world_size = 2;
  try {
    (void)config::parse_config_string(json, o);
    ADD_FAILURE() << "no error";
  } catch (const config::ConfigError& e) {
    EXPECT_EQ(e.path(), "porter.model.mlp_tiles");
    const std::string what = e.what();
    EXPECT_NE(what.find("porter.model.mlp_tiles 1 with sequence_parallel"), std::string::npos)
        << what;
  }
  // Without sequence parallelism, and at tensor_parallel 1 (where it has no effect), accepted.
  std::string ok = json;
  ok.replace(ok.find("\"sequence_parallel\": true"), 25, "\"sequence_parallel\": false");
  EXPECT_EQ(config::parse_config_string(ok, o).config.porter.model.mlp_tiles, 4);
}

}  // namespace
}  // namespace porter::engine
