// Elementwise cpu kernels against scalar references: bias, GELU, dropout, add, accumulate,
// cast, fill, scale, sum, squared_norm and AdamW, in f32 and bf16, at odd sizes.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>

#include "tensor/philox.h"
#include "tests/nn/nn_test_util.h"

namespace porter::nn {

using namespace porter::tensor;
using namespace porter::kernels;
namespace {

using testing::Env;
using testing::max_rel_error;
using testing::random_values;
using testing::round_bf16;

float bf16_round(float x) { return tensor::bf16_to_f32(tensor::f32_to_bf16(x)); }

TEST(ElementwiseTest, BiasAddIsExactInF32AndRoundsOnceInBf16) {
  Env env;
  for (auto [rows, cols] : {std::pair<int64_t, int64_t>{1, 1}, {3, 17}, {5, 1}, {33, 65}}) {
    auto x = round_bf16(random_values(static_cast<size_t>(rows * cols), 1));
    auto bias = round_bf16(random_values(static_cast<size_t>(cols), 2));
    for (tensor::DType dt : {tensor::DType::kF32, tensor::DType::kBF16}) {
      tensor::Tensor tx = env.from(x, {rows, cols}, dt);
      tensor::Tensor tb = env.from(bias, {cols}, dt);
      env.kernels->bias_add(tx, tb);
      std::vector<float> got = env.host(tx);
      for (int64_t i = 0; i < rows * cols; ++i) {
        float want = x[i] + bias[i % cols];
        if (dt == tensor::DType::kBF16) want = bf16_round(want);
        ASSERT_EQ(got[i], want) << "dtype " << tensor::dtype_name(dt) << " element " << i;
      }
    }
  }
}

TEST(ElementwiseTest, BiasBackwardAccumulatesColumnSums) {
  Env env;
  for (auto [rows, cols] : {std::pair<int64_t, int64_t>{1, 3}, {7, 17}, {300, 130}}) {
    auto dy = random_values(static_cast<size_t>(rows * cols), 3);
    auto db0 = random_values(static_cast<size_t>(cols), 4);
    tensor::Tensor tdy = env.from(dy, {rows, cols});
    tensor::Tensor tdb = env.from(db0, {cols});
    env.kernels->bias_backward(tdy, tdb);
    std::vector<double> want(db0.begin(), db0.end());
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) want[c] += dy[r * cols + c];
    }
    // f32 sums of <= 300 terms of magnitude <= 1: well inside 1e-5 of the max.
    EXPECT_LT(max_rel_error(env.host(tdb), want), 1e-5) << rows << "x" << cols;
  }
}

double gelu_ref(double x) {
  return 0.5 * x * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x)));
}

// Forward against the double formula; backward against central differences of it.
TEST(ElementwiseTest, GeluForwardAndBackwardMatchReference) {
  Env env;
  for (int64_t n : {1, 3, 17, 40001}) {
    auto x = random_values(static_cast<size_t>(n), 5, -6.0f, 6.0f);
    auto dy = random_values(static_cast<size_t>(n), 6);
    tensor::Tensor tx = env.from(x, {n}), ty = env.empty({n});
    tensor::Tensor tdy = env.from(dy, {n}), tdx = env.empty({n});
    env.kernels->gelu_forward(tx, ty);
    env.kernels->gelu_backward(tx, tdy, tdx);
    std::vector<double> want_y(n), want_dx(n);
    for (int64_t i = 0; i < n; ++i) {
      want_y[i] = gelu_ref(x[i]);
      const double h = 1e-6;
      want_dx[i] = dy[i] * (gelu_ref(x[i] + h) - gelu_ref(x[i] - h)) / (2 * h);
    }
    // fast_exp is within a few f32 ulps; 2e-6 of the max magnitude (6) allows for it.
    EXPECT_LT(max_rel_error(env.host(ty), want_y), 2e-6) << "n " << n;
    EXPECT_LT(max_rel_error(env.host(tdx), want_dx), 1e-5) << "n " << n;
  }
}

TEST(ElementwiseTest, GeluBf16RoundsTheF32Result) {
  Env env;
  auto x = round_bf16(random_values(1000, 7, -4.0f, 4.0f));
  tensor::Tensor tx = env.from(x, {10, 100}, tensor::DType::kBF16), ty = env.empty({10, 100}, tensor::DType::kBF16);
  tensor::Tensor ty32 = env.empty({10, 100});
  env.kernels->gelu_forward(tx, ty);
  env.kernels->gelu_forward(env.from(x, {10, 100}), ty32);
  std::vector<float> got = env.host(ty), ref = env.host(ty32);
  for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], bf16_round(ref[i])) << i;
}

TEST(ElementwiseTest, GeluInPlace) {
  Env env;
  auto x = random_values(100, 8);
  tensor::Tensor t = env.from(x, {100}), ref = env.empty({100});
  env.kernels->gelu_forward(env.from(x, {100}), ref);
  env.kernels->gelu_forward(t, t);
  EXPECT_EQ(env.host(t), env.host(ref));
}

TEST(ElementwiseTest, DropoutMaskIsAPureFunctionOfTheKey) {
  Env env;
  const float p = 0.3f;
  for (int64_t n : {1, 5, 17, 50003}) {
    auto x = random_values(static_cast<size_t>(n), 9);
    tensor::PhiloxKey key = tensor::dropout_key(1234, 1, 77, 2, 5);
    tensor::Tensor tx = env.from(x, {n}), ty = env.empty({n});
    env.kernels->dropout_forward(tx, ty, p, key);
    std::vector<float> y = env.host(ty);
    const float keep_scale = 1.0f / (1.0f - p);
    int64_t dropped = 0;
    for (int64_t i = 0; i < n; ++i) {
      bool keep = tensor::philox_uniform(key, static_cast<uint64_t>(i)) >= p;
      ASSERT_EQ(y[i], keep ? x[i] * keep_scale : 0.0f) << "element " << i;
      dropped += keep ? 0 : 1;
    }
    if (n > 10000) {
      EXPECT_NEAR(static_cast<double>(dropped) / n, p, 0.01);
    }
    // Backward regenerates the same mask from the key: dx = dy * mask / (1 - p).
    auto dy = random_values(static_cast<size_t>(n), 10);
    tensor::Tensor tdy = env.from(dy, {n}), tdx = env.empty({n});
    env.kernels->dropout_backward(tdy, tdx, p, key);
    std::vector<float> dx = env.host(tdx);
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_EQ(dx[i], y[i] == 0.0f && x[i] != 0.0f ? 0.0f : dy[i] * keep_scale) << i;
    }
  }
}

TEST(ElementwiseTest, DropoutDiffersAcrossKeysAndIsIdentityAtZero) {
  Env env;
  auto x = random_values(4096, 11, 0.5f, 1.0f);
  tensor::Tensor tx = env.from(x, {4096}), a = env.empty({4096}), b = env.empty({4096});
  env.kernels->dropout_forward(tx, a, 0.5f, tensor::dropout_key(1, 0, 0, 0, 0));
  env.kernels->dropout_forward(tx, b, 0.5f, tensor::dropout_key(1, 0, 1, 0, 0));
  EXPECT_NE(env.host(a), env.host(b));
  env.kernels->dropout_forward(tx, b, 0.5f, tensor::dropout_key(1, 0, 0, 0, 0));
  EXPECT_EQ(env.host(a), env.host(b));
  env.kernels->dropout_forward(tx, a, 0.0f, tensor::dropout_key(1, 0, 0, 0, 0));
  EXPECT_EQ(env.host(a), x);
}

// Sequence parallelism: a rank that owns elements [o, n) of a tensor drops them out with
// group_offset = o / 4 and gets exactly the whole tensor's mask there (Note [Dropout keys]).
// 40011 leaves the last Philox group partial; the large halves span several cpu blocks.
TEST(ElementwiseTest, DropoutOfASecondHalfWithGroupOffsetMatchesTheWhole) {
  Env env;
  const float p = 0.4f;
  for (int64_t n : {8, 104, 40008, 40011}) {
    const int64_t o = (n / 2) / 4 * 4, tail = n - o;
    const tensor::PhiloxKey key = tensor::dropout_key(99, 2, 12345, 1, 3);
    tensor::PhiloxKey shard_key = key;
    shard_key.group_offset = static_cast<uint64_t>(o / 4);
    for (bool backward : {false, true}) {
      auto x = random_values(static_cast<size_t>(n), backward ? 21 : 20);
      std::vector<float> x_tail(x.begin() + o, x.end());
      tensor::Tensor whole = env.from(x, {n}), whole_y = env.empty({n});
      tensor::Tensor part = env.from(x_tail, {tail}), part_y = env.empty({tail});
      if (backward) {
        env.kernels->dropout_backward(whole, whole_y, p, key);
        env.kernels->dropout_backward(part, part_y, p, shard_key);
      } else {
        env.kernels->dropout_forward(whole, whole_y, p, key);
        env.kernels->dropout_forward(part, part_y, p, shard_key);
      }
      std::vector<float> want = env.host(whole_y);
      want.erase(want.begin(), want.begin() + o);
      EXPECT_EQ(env.host(part_y), want) << "n " << n << (backward ? " backward" : " forward");
      // The shard's mask is not the unshifted one (the offset took effect).
      tensor::Tensor unshifted = env.empty({tail});
      env.kernels->dropout_forward(part, unshifted, p, key);
      if (tail > 16) {
        EXPECT_NE(env.host(unshifted), want) << "n " << n;
      }
    }
  }
}

TEST(ElementwiseTest, AddAccumulateAndInPlace) {
  Env env;
  auto a = random_values(40000, 12), b = random_values(40000, 13);
  tensor::Tensor ta = env.from(a, {200, 200}), tb = env.from(b, {200, 200}), out = env.empty({200, 200});
  env.kernels->add(ta, tb, out);
  std::vector<float> got = env.host(out);
  for (size_t i = 0; i < a.size(); ++i) ASSERT_EQ(got[i], a[i] + b[i]) << i;
  env.kernels->add(ta, tb, ta);  // residual in place
  EXPECT_EQ(env.host(ta), got);
  env.kernels->accumulate(ta, tb);
  got = env.host(ta);
  for (size_t i = 0; i < a.size(); ++i) ASSERT_EQ(got[i], (a[i] + b[i]) + b[i]) << i;
  // bf16 accumulator, f32 addend: one rounding per add.
  tensor::Tensor acc = env.from(round_bf16(a), {200, 200}, tensor::DType::kBF16);
  env.kernels->accumulate(acc, tb);
  got = env.host(acc);
  auto ar = round_bf16(a);
  for (size_t i = 0; i < a.size(); ++i) ASSERT_EQ(got[i], bf16_round(ar[i] + b[i])) << i;
}

TEST(ElementwiseTest, CastRoundsToNearestEvenAndWidensExactly) {
  Env env;
  std::vector<float> x = random_values(1001, 14, -100.0f, 100.0f);
  x.push_back(1.00390625f);   // halfway between two bf16: ties to even (1.0)
  x.push_back(1.01171875f);   // halfway, rounds up to even (1.015625)
  x.push_back(INFINITY);
  const int64_t n = static_cast<int64_t>(x.size());
  tensor::Tensor tx = env.from(x, {n}), th = env.empty({n}, tensor::DType::kBF16), tf = env.empty({n});
  env.kernels->cast(tx, th);
  env.kernels->cast(th, tf);
  std::vector<float> back = env.host(tf);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(back[i], bf16_round(x[i])) << i;
  EXPECT_EQ(back[n - 3], 1.0f);
  EXPECT_EQ(back[n - 2], 1.015625f);
  EXPECT_EQ(back[n - 1], INFINITY);
}

TEST(ElementwiseTest, FillAndScale) {
  Env env;
  tensor::Tensor t = env.empty({3, 17}), h = env.empty({3, 17}, tensor::DType::kBF16);
  env.kernels->fill(t, 1.5f);
  env.kernels->scale(t, -2.0f);
  EXPECT_EQ(env.host(t), std::vector<float>(51, -3.0f));
  env.kernels->fill(h, 0.1f);
  EXPECT_EQ(env.host(h), std::vector<float>(51, bf16_round(0.1f)));
}

TEST(ElementwiseTest, SumAndSquaredNormMatchDoubleReference) {
  Env env;
  for (int64_t n : {1, 3, 17, 16385, 1000003}) {
    auto x = random_values(static_cast<size_t>(n), 15);
    tensor::Tensor tx = env.from(x, {n}), out = env.empty({1});
    double s = 0, ss = 0;
    for (float v : x) {
      s += v;
      ss += double{v} * v;
    }
    env.kernels->sum(tx, out);
    // f32 lanes within a 16384-element chunk, double across chunks: 1e-6 relative to the
    // sum of magnitudes (~n/2) bounds the error.
    EXPECT_NEAR(env.host(out)[0], s, 1e-6 * n) << "n " << n;
    env.kernels->squared_norm(tx, out);
    EXPECT_NEAR(env.host(out)[0], ss, 1e-6 * ss) << "n " << n;
  }
}

// torch.optim.AdamW (1.13) in double: p *= 1 - lr wd; m, v moments; bias-corrected step.
TEST(ElementwiseTest, AdamWMatchesPyTorchFormula) {
  Env env;
  const int64_t n = 20003;
  auto p = random_values(n, 16), m0 = std::vector<float>(n, 0.0f), v0 = m0;
  kernels::AdamWArgs args;
  args.lr = 1e-2f;
  args.weight_decay = 0.1f;
  args.grad_scale = 0.5f;
  tensor::Tensor tp = env.from(p, {n}), tm = env.from(m0, {n}), tv = env.from(v0, {n});
  tensor::Tensor out = env.empty({n}, tensor::DType::kBF16);
  std::vector<double> rp(p.begin(), p.end()), rm(n, 0.0), rv(n, 0.0);
  for (int64_t step = 1; step <= 3; ++step) {
    auto g = random_values(n, 100 + static_cast<uint32_t>(step));
    tensor::Tensor tg = env.from(g, {n});
    args.step = step;
    env.kernels->adamw(tp, tg, tm, tv, args, &out);
    const double b1 = args.beta1, b2 = args.beta2;
    const double bc1 = 1 - std::pow(b1, step), bc2 = 1 - std::pow(b2, step);
    for (int64_t i = 0; i < n; ++i) {
      double gi = double{g[i]} * args.grad_scale;
      rp[i] *= 1 - double{args.lr} * args.weight_decay;
      rm[i] = b1 * rm[i] + (1 - b1) * gi;
      rv[i] = b2 * rv[i] + (1 - b2) * gi * gi;
      rp[i] -= args.lr / bc1 * rm[i] / (std::sqrt(rv[i]) / std::sqrt(bc2) + args.eps);
    }
  }
  // f32 arithmetic over 3 steps: 1e-6 of the max magnitude (~1).
  std::vector<float> got = env.host(tp);
  EXPECT_LT(max_rel_error(got, rp), 1e-6);
  EXPECT_LT(max_rel_error(env.host(tm), rm), 1e-6);
  EXPECT_LT(max_rel_error(env.host(tv), rv), 1e-6);
  std::vector<float> working = env.host(out);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(working[i], bf16_round(got[i])) << i;
}

TEST(ElementwiseTest, AdamWTakesBf16Gradients) {
  Env env;
  auto g = round_bf16(random_values(100, 17));
  tensor::Tensor p1 = env.from(std::vector<float>(100, 1.0f), {100}), p2 = p1;
  p2 = env.from(std::vector<float>(100, 1.0f), {100});
  tensor::Tensor m1 = env.from(std::vector<float>(100, 0.0f), {100}), v1 = env.from(std::vector<float>(100, 0.0f), {100});
  tensor::Tensor m2 = env.from(std::vector<float>(100, 0.0f), {100}), v2 = env.from(std::vector<float>(100, 0.0f), {100});
  env.kernels->adamw(p1, env.from(g, {100}), m1, v1, {});
  env.kernels->adamw(p2, env.from(g, {100}, tensor::DType::kBF16), m2, v2, {});
  EXPECT_EQ(env.host(p1), env.host(p2));
}

}  // namespace
}  // namespace porter::nn
