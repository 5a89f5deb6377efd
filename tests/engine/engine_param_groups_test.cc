// Optimizer parameter groups through the Engine (Note [Parameter groups] in
// zero/param_groups.h): each parameter follows AdamW's formula with its group's weight decay
// and lr x lr_scale, bit for bit against a host computation; the groups give the same bits at
// every ZeRO stage, with and without offload, on two ranks; bad groups are refused.
//
// The host reference below is the formula of kernels/cpu/adamw.cc written out again. These
// tests build without -march flags, so the compiler has no fused multiply-add to contract it
// into.
#include <cmath>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "base/error.h"
#include "engine_test_util.h"
#include "kernels/kernels.h"
#include "zero/param_groups.h"
#include "zero/partition.h"
#include "zero/sharded_optimizer.h"

namespace porter::engine {
namespace {

using namespace porter::engine::testing;

// The one-rank run of the reference tests: f32, no clipping, no dropout, weight decay 0.1.
config::Config reference_config() {
  config::Config c = tiny_config(config::CheckpointPolicy::kNone, /*dropout=*/0.0);
  c.gradient_clipping = 0.0;
  c.optimizer->weight_decay = 0.1;
  return c;
}

// AdamW's state on the host, element by element (kernels/cpu/adamw.cc's adamw_range).
struct HostAdamW {
  std::vector<float> m, v;
  explicit HostAdamW(size_t n) : m(n, 0.0f), v(n, 0.0f) {}
  // One step of element i at (lr, weight_decay); returns the new parameter.
  float step(size_t i, float p, float g, const config::OptimizerConfig& o, double lr,
             double weight_decay, int64_t step) {
    kernels::AdamWArgs a;
    a.lr = static_cast<float>(lr);
    a.beta1 = static_cast<float>(o.beta1);
    a.beta2 = static_cast<float>(o.beta2);
    a.eps = static_cast<float>(o.eps);
    a.weight_decay = static_cast<float>(weight_decay);
    a.step = step;
    a.grad_scale = 1.0f;
    const kernels::AdamWConstants k = kernels::adamw_constants(a);
    const float grad = g * k.grad_scale;
    float param = p * k.decay;
    const float mi = m[i] * k.beta1 + k.one_minus_beta1 * grad;
    const float vi = v[i] * k.beta2 + k.one_minus_beta2 * grad * grad;
    const float denom = std::sqrt(vi) / k.bc2_sqrt + k.eps;
    param = param - k.step_size * (mi / denom);
    m[i] = mi;
    v[i] = vi;
    return param;
  }
};

uint32_t bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

// Every element of every parameter after `steps` steps, against HostAdamW with each
// parameter's group (zero::param_groups_of), bit for bit.
void expect_follows_adamw(const config::Config& c, int steps) {
  auto device = cpu_device();
  auto e = gpt_engine(*device, c);
  const TransformerModel layout_of(c.porter.model);
  const nn::ParamLayout& layout = layout_of.layout();
  const std::vector<zero::ParamGroupOf> groups =
      zero::param_groups_of(layout, c.porter.optimizer, c.optimizer->weight_decay);
  std::vector<float> p = e->params_host();
  HostAdamW ref(p.size());
  for (int s = 0; s < steps; ++s) {
    const StepResult r = e->train_step(batches(c, s));
    const std::vector<float> g = e->grads_host();
    const std::vector<float> got = e->params_host();
    ASSERT_EQ(got.size(), p.size());
    int64_t mismatches = 0;
    for (size_t k = 0; k < groups.size(); ++k) {
      const nn::ParamEntry& entry = layout.entries()[k];
      const double lr = r.lr * groups[k].lr_scale;
      for (int64_t j = 0; j < entry.shape.numel(); ++j) {
        const auto i = static_cast<size_t>(entry.offset_elems + j);
        const float want = ref.step(i, p[i], g[i], *c.optimizer, lr, groups[k].weight_decay,
                                    s + 1);
        if (bits(want) != bits(got[i]) && ++mismatches <= 5) {
          ADD_FAILURE() << "step " << s + 1 << ", " << entry.name << "[" << j << "]: got "
                        << got[i] << ", AdamW gives " << want << " (weight_decay "
                        << groups[k].weight_decay << ", lr " << lr << ")";
        }
      }
    }
    EXPECT_EQ(mismatches, 0) << "step " << s + 1;
    p = got;
  }
}

TEST(EngineParamGroups, TheDefaultDecaysOnlyMatricesButThePositionTable) {
  const config::Config c = reference_config();
  const TransformerModel m(c.porter.model);
  const std::vector<zero::ParamGroupOf> groups =
      zero::param_groups_of(m.layout(), c.porter.optimizer, 0.1);
  ASSERT_EQ(groups.size(), m.layout().entries().size());
  int decayed = 0;
  for (size_t k = 0; k < groups.size(); ++k) {
    const nn::ParamEntry& e = m.layout().entries()[k];
    const bool matrix = e.shape.rank() >= 2 && e.name != "wpe";
    EXPECT_EQ(groups[k].weight_decay, matrix ? 0.1 : 0.0) << e.name;
    EXPECT_EQ(groups[k].lr_scale, 1.0) << e.name;
    decayed += matrix ? 1 : 0;
  }
  // wte, and qkv, proj, fc1, fc2 of each of the 3 blocks.
  EXPECT_EQ(decayed, 1 + 4 * 3);
}

TEST(EngineParamGroups, DefaultGroupsFollowAdamWBitForBitOverSeveralSteps) {
  expect_follows_adamw(reference_config(), 3);
}

TEST(EngineParamGroups, GroupsWithTheirOwnDecayAndLrScaleFollowAdamW) {
  config::Config c = reference_config();
  config::ParamGroupConfig first;  // block 0 at half the lr and its own decay
  first.params = {"h.0.*"};
  first.weight_decay = 0.3;
  first.lr_scale = 0.5;
  config::ParamGroupConfig biases;  // every other bias decays at the optimizer's 0.1
  biases.params = {"*.bias"};
  biases.lr_scale = 2.0;
  c.porter.optimizer.param_groups = {first, biases};
  const TransformerModel m(c.porter.model);
  const std::vector<zero::ParamGroupOf> groups =
      zero::param_groups_of(m.layout(), c.porter.optimizer, 0.1);
  for (const zero::ParamGroupOf& g : groups) {
    if (g.name.rfind("h.0.", 0) == 0) {
      EXPECT_EQ(g.weight_decay, 0.3) << g.name;
      EXPECT_EQ(g.lr_scale, 0.5) << g.name;
    } else if (g.name.size() > 5 && g.name.substr(g.name.size() - 5) == ".bias") {
      EXPECT_EQ(g.weight_decay, 0.1) << g.name;
      EXPECT_EQ(g.lr_scale, 2.0) << g.name;
    }
  }
  expect_follows_adamw(c, 2);
}

TEST(EngineParamGroups, EmptyNoDecayDecaysEveryParameter) {
  config::Config c = reference_config();
  c.porter.optimizer.no_decay = {};
  const TransformerModel m(c.porter.model);
  for (const zero::ParamGroupOf& g : zero::param_groups_of(m.layout(), c.porter.optimizer, 0.1)) {
    EXPECT_EQ(g.weight_decay, 0.1) << g.name;
  }
  expect_follows_adamw(c, 2);
}

TEST(EngineParamGroups, LrScaleZeroLeavesTheGroupUnchangedAndScalesNothingElse) {
  config::Config c = reference_config();
  config::ParamGroupConfig frozen;
  frozen.params = {"h.1.*"};
  frozen.lr_scale = 0.0;
  c.porter.optimizer.param_groups = {frozen};
  auto device = cpu_device();
  auto e = gpt_engine(*device, c);
  const TransformerModel m(c.porter.model);
  const std::vector<float> before = e->params_host();
  for (int s = 0; s < 2; ++s) e->train_step(batches(c, s));
  const std::vector<float> after = e->params_host();
  for (const nn::ParamEntry& entry : m.layout().entries()) {
    const auto b = before.begin() + entry.offset_elems;
    const auto a = after.begin() + entry.offset_elems;
    const bool same = std::equal(b, b + entry.shape.numel(), a);
    EXPECT_EQ(same, entry.name.rfind("h.1.", 0) == 0) << entry.name;
  }
}

// With zero gradients AdamW's moments stay 0, so a decayed parameter becomes exactly
// p (1 - lr wd) and an undecayed one stays p; on the sharded optimizer itself, over a range
// whose runs a shard boundary cuts.
TEST(EngineParamGroups, ZeroGradientsOnlyDecay) {
  auto device = cpu_device();
  memory::CachingAllocator alloc(*device);
  auto kernels = kernels::make_kernels(alloc);
  nn::ParamLayout layout;
  layout.add("", {{"w", tensor::Shape{10, 10}}, {"b", tensor::Shape{30}},
                  {"pos", tensor::Shape{4, 10}}, {"v", tensor::Shape{70}}});
  const zero::Partition part = zero::make_partition(layout.total_elems(), 1);
  nn::FlatParams flat(alloc, layout, tensor::DType::kF32, tensor::DType::kF32, part.padded_elems,
                      /*allocate_grads=*/false);
  zero::OptimizerOptions opt;
  opt.adamw.lr = 0.05;
  opt.adamw.weight_decay = 0.2;
  opt.param_groups.no_decay = {"ndim<2", "pos"};
  zero::ShardedOptimizer o(flat, *kernels, alloc, nullptr, part, opt);
  std::vector<float> p0(static_cast<size_t>(part.padded_elems));
  for (size_t i = 0; i < p0.size(); ++i) p0[i] = 0.25f + static_cast<float>(i % 13) * 0.5f;
  o.set_params(p0);
  tensor::Tensor g = tensor::Tensor::empty(alloc, tensor::Shape{part.padded_elems},
                                           tensor::DType::kF32, memory::Category::kGrads);
  kernels->fill(g, 0.0f);
  std::vector<float> want = p0;
  const float decay = 1.0f - 0.05f * 0.2f;
  for (int s = 0; s < 3; ++s) {
    const zero::GradNorm n = o.global_norm(g);
    o.update(g, 0.05, n);
    o.finish_step(false);
    const int64_t w = layout.find("w").offset_elems;
    for (int64_t i = w; i < w + 100; ++i) want[static_cast<size_t>(i)] *= decay;
    const std::vector<float> got = tensor::to_host_f32(*device, flat.params());
    for (const nn::ParamEntry& e : layout.entries()) {
      for (int64_t j = 0; j < e.shape.numel(); ++j) {
        const auto i = static_cast<size_t>(e.offset_elems + j);
        ASSERT_EQ(bits(got[i]), bits(want[i]))
            << "step " << s + 1 << ", " << e.name << "[" << j << "]: " << got[i] << " vs "
            << want[i];
      }
    }
  }
}

// The groups are resolved over the whole flat buffer, so every stage and offload split gives
// the same bits: two ranks, stages 0 to 3, optimizer offload at 2 and 3, a partial offload,
// and parameter offload, against stage 0, the whole saved state. zero_config has no clipping
// (whose norm each stage sums in another order) and one micro-batch per rank, under which
// the stages are bitwise equal (docs/zero.md, "Exactness").
TEST(EngineParamGroups, SameBitsAtEveryStageAndOffloadOnTwoRanks) {
  auto with_groups = [](config::Config c) {
    config::ParamGroupConfig g;
    g.params = {"h.1.*", "lnf.*"};
    g.weight_decay = 0.05;
    g.lr_scale = 0.5;
    c.porter.optimizer.param_groups = {g};
    c.optimizer->weight_decay = 0.1;
    return c;
  };
  const std::vector<DpRankRun> base = run_dp_ranks(with_groups(zero_config(2, 0)), 2);
  struct Case {
    const char* what;
    int stage;
    bool offload;
    double ratio;
    bool params;
  };
  for (const Case& k : {Case{"stage 1", 1, false, 1.0, false},
                        Case{"stage 2", 2, false, 1.0, false},
                        Case{"stage 3", 3, false, 1.0, false},
                        Case{"stage 2, optimizer offload", 2, true, 1.0, false},
                        Case{"stage 3, optimizer offload 0.4", 3, true, 0.4, false},
                        Case{"stage 3, optimizer and parameter offload", 3, true, 1.0, true}}) {
    SCOPED_TRACE(k.what);
    config::Config c = with_groups(zero_config(2, k.stage));
    if (k.offload) {
      c.zero_optimization.offload_optimizer.device = config::OffloadDevice::kCpu;
      c.zero_optimization.offload_optimizer.ratio = k.ratio;
    }
    if (k.params) c.zero_optimization.offload_param.device = config::OffloadDevice::kCpu;
    const std::vector<DpRankRun> run = run_dp_ranks(c, 2);
    for (size_t r = 0; r < run.size(); ++r) {
      EXPECT_EQ(run[r].losses, base[r].losses);
      EXPECT_TRUE(bitwise_equal(run[r].params, base[r].params)) << "rank " << r;
    }
    std::vector<SavedState> a, b;
    for (const DpRankRun& x : base) a.push_back(x.state);
    for (const DpRankRun& x : run) b.push_back(x.state);
    expect_same_state(a, b, k.what);
  }
  // The groups change the run: without them every parameter decays at 0.1.
  config::Config plain = zero_config(2, 0);
  plain.optimizer->weight_decay = 0.1;
  plain.porter.optimizer.no_decay = {};
  const std::vector<DpRankRun> other = run_dp_ranks(plain, 2);
  EXPECT_FALSE(bitwise_equal(other[0].params, base[0].params));
}

TEST(EngineParamGroups, AGroupPatternThatMatchesNothingIsRefused) {
  config::Config c = reference_config();
  config::ParamGroupConfig g;
  g.params = {"*.bias", "blocks.*.attn.*"};
  c.porter.optimizer.param_groups = {g};
  auto device = cpu_device();
  const std::string msg = error_of<InvalidArgument>([&] { gpt_engine(*device, c); });
  EXPECT_NE(msg.find("porter.optimizer.param_groups[0].params[1]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("\"blocks.*.attn.*\" matches no parameter"), std::string::npos) << msg;
}

TEST(EngineParamGroups, AGroupDecayWithCoupledAdamIsRefused) {
  config::Config c = reference_config();
  c.optimizer->weight_decay = 0.0;
  c.optimizer->type = config::OptimizerType::kAdam;
  c.optimizer->adam_w_mode = false;
  config::ParamGroupConfig g;
  g.params = {"h.0.*"};
  g.weight_decay = 0.1;
  c.porter.optimizer.param_groups = {g};
  auto device = cpu_device();
  const std::string msg = error_of<InvalidArgument>([&] { gpt_engine(*device, c); });
  EXPECT_NE(msg.find("porter.optimizer.param_groups[0].weight_decay"), std::string::npos) << msg;
}

}  // namespace
}  // namespace porter::engine
