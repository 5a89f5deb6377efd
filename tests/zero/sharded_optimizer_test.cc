// zero::ShardedOptimizer (Note [Sharded optimizer]) on one rank: its range and state, the
// norm, clipping, fp16 overflow and the update against a host AdamW. Several ranks: the
// bitwise stage tests in tests/engine/engine_zero_test.cc.
#include "zero/sharded_optimizer.h"

#include <cmath>
#include <numeric>

#include <gtest/gtest.h>

#include "base/error.h"

namespace porter::zero {
namespace {

struct Rig {
  std::unique_ptr<memory::Device> device;
  std::unique_ptr<memory::CachingAllocator> alloc;
  std::unique_ptr<kernels::Kernels> kernels;
  nn::ParamLayout layout;
  std::unique_ptr<nn::FlatParams> flat;

  Rig(tensor::DType dtype, int world_size) {
    memory::DeviceOptions o;
    o.memory_limit_bytes = size_t{64} << 20;
    o.threads = 1;
    device = memory::make_device(o);
    alloc = std::make_unique<memory::CachingAllocator>(*device);
    kernels = kernels::make_kernels(*alloc);
    layout.add("", {{"w", tensor::Shape{100}}, {"b", tensor::Shape{30}}});
    const Partition part = make_partition(layout.total_elems(), world_size);
    flat = std::make_unique<nn::FlatParams>(*alloc, layout, dtype, tensor::DType::kF32,
                                            part.padded_elems, /*allocate_grads=*/false);
  }
  tensor::Tensor grads(const std::vector<float>& v) {
    tensor::Tensor t = tensor::Tensor::empty(*alloc, tensor::Shape{static_cast<int64_t>(v.size())},
                                     tensor::DType::kF32, memory::Category::kGrads);
    tensor::from_host_f32(*device, v, t);
    return t;
  }
};

std::vector<float> ramp(int64_t n, float scale) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = scale * static_cast<float>(i % 7 - 3);
  return v;
}

TEST(ShardedOptimizerTest, OneRankOwnsTheWholeBufferAndItsState) {
  Rig f32(tensor::DType::kF32, 1);
  const Partition part = make_partition(f32.layout.total_elems(), 1);
  ShardedOptimizer o(*f32.flat, *f32.kernels, *f32.alloc, nullptr, part, OptimizerOptions{});
  EXPECT_EQ(o.begin(), 0);
  EXPECT_EQ(o.end(), part.padded_elems);
  EXPECT_FALSE(o.has_master());
  ASSERT_EQ(o.state_tensors().size(), 2u);
  EXPECT_STREQ(o.state_tensors()[0].name, "exp_avg");
  EXPECT_EQ(f32.alloc->stats()[memory::Category::kOptimizer].current_bytes,
            2 * static_cast<size_t>(part.padded_elems) * 4);

  Rig bf16(tensor::DType::kBF16, 1);
  ShardedOptimizer b(*bf16.flat, *bf16.kernels, *bf16.alloc, nullptr, part, OptimizerOptions{});
  EXPECT_TRUE(b.has_master());
  ASSERT_EQ(b.state_tensors().size(), 3u);
  EXPECT_STREQ(b.state_tensors()[0].name, "master");
  EXPECT_EQ(bf16.alloc->stats()[memory::Category::kOptimizer].current_bytes,
            3 * static_cast<size_t>(part.padded_elems) * 4);
}

TEST(ShardedOptimizerTest, NormClippingAndUpdateMatchAHostAdamW) {
  Rig r(tensor::DType::kF32, 1);
  const Partition part = make_partition(r.layout.total_elems(), 1);
  OptimizerOptions opt;
  opt.adamw.lr = 0.1;
  opt.adamw.weight_decay = 0.01;
  opt.gradient_clipping = 1.0;
  ShardedOptimizer o(*r.flat, *r.kernels, *r.alloc, nullptr, part, opt);
  const std::vector<float> p0 = ramp(part.padded_elems, 0.5f);
  o.set_params(p0);
  const std::vector<float> g = ramp(part.padded_elems, 0.25f);
  const tensor::Tensor grads = r.grads(g);
  double sq = 0.0;
  for (float x : g) sq += static_cast<double>(x) * x;
  const GradNorm n = o.global_norm(grads);
  EXPECT_NEAR(n.norm, std::sqrt(sq), 1e-4 * std::sqrt(sq));
  EXPECT_FALSE(n.overflow);
  ASSERT_GT(n.norm, 1.0);
  EXPECT_DOUBLE_EQ(n.clip_coef, 1.0 / (n.norm + 1e-6));
  o.update(grads, 0.1, n);
  o.finish_step(false);
  EXPECT_EQ(o.steps(), 1);
  // Step 1 of AdamW: m = (1 - b1) g', v = (1 - b2) g'^2 with g' = coef g; bias-corrected the
  // update is lr * g' / (|g'| + eps) plus the decoupled decay.
  const std::vector<float> p1 = tensor::to_host_f32(*r.device, r.flat->params());
  for (size_t i = 0; i < p1.size(); ++i) {
    const double gc = n.clip_coef * g[i];
    const double step = gc == 0.0 ? 0.0 : 0.1 * gc / (std::abs(gc) + 1e-8);
    const double want = p0[i] - 0.1 * 0.01 * p0[i] - step;
    EXPECT_NEAR(p1[i], want, 1e-5) << i;
  }
}

TEST(ShardedOptimizerTest, Fp16OverflowSkipsTheUpdateAndLowersTheScale) {
  Rig r(tensor::DType::kF16, 1);
  const Partition part = make_partition(r.layout.total_elems(), 1);
  OptimizerOptions opt;
  opt.fp16.enabled = true;
  opt.fp16.hysteresis = 1;  // the first overflow halves the scale
  ShardedOptimizer o(*r.flat, *r.kernels, *r.alloc, nullptr, part, opt);
  o.set_params(ramp(part.padded_elems, 0.5f));
  const std::vector<float> before = tensor::to_host_f32(*r.device, r.flat->params());
  const double scale = o.loss_scale();
  EXPECT_EQ(scale, 65536.0);  // 2^initial_scale_power
  std::vector<float> g = ramp(part.padded_elems, 1.0f);
  g[5] = std::numeric_limits<float>::infinity();
  const tensor::Tensor grads = r.grads(g);
  const GradNorm n = o.global_norm(grads);
  EXPECT_TRUE(n.overflow);
  EXPECT_EQ(n.clip_coef, 1.0);
  o.update(grads, 0.1, n);
  o.finish_step(true);
  EXPECT_EQ(o.steps(), 0);
  EXPECT_EQ(o.loss_scale(), scale / 2);
  EXPECT_EQ(tensor::to_host_f32(*r.device, r.flat->params()), before);
}

TEST(ShardedOptimizerTest, RefusesAStageAboveThreeAndAForeignBuffer) {
  Rig r(tensor::DType::kF32, 1);
  const Partition part = make_partition(r.layout.total_elems(), 1);
  OptimizerOptions opt;
  opt.zero_stage = 4;
  EXPECT_THROW(ShardedOptimizer(*r.flat, *r.kernels, *r.alloc, nullptr, part, opt),
               InvalidArgument);
  // Stage 3 owns its working shard (category params), apart from the flat buffer.
  opt.zero_stage = 3;
  ShardedOptimizer z3(*r.flat, *r.kernels, *r.alloc, nullptr, part, opt);
  EXPECT_EQ(z3.working().numel(), part.shard_elems);
  EXPECT_NE(z3.working().data(), r.flat->params().data());
  const Partition other = make_partition(r.layout.total_elems() * 4, 1);
  EXPECT_THROW(ShardedOptimizer(*r.flat, *r.kernels, *r.alloc, nullptr, other, OptimizerOptions{}),
               InvalidArgument);
}

}  // namespace
}  // namespace porter::zero
