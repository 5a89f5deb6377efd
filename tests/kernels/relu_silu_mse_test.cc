// The layer library's cpu kernels (ReLU, SiLU, squared error) against float64 references in
// f32 and bf16, their bits independent of the thread count, and their argument checks.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "base/error.h"
#include "tests/nn/nn_test_util.h"

namespace porter::nn {

using namespace porter::tensor;
using namespace porter::kernels;
namespace {

using testing::Env;
using testing::random_values;
using testing::round_to;

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// Max |got - want| over max(|want|, 1): a relative error for large values, absolute near 0.
double max_err(const std::vector<float>& got, const std::vector<double>& want) {
  double e = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    e = std::max(e, std::fabs(got[i] - want[i]) / std::max(1.0, std::fabs(want[i])));
  }
  return e;
}

// Tolerance of one op's output: f32 math (fast_exp is a few ulp), then the store's rounding.
double tol(DType dt) { return dt == DType::kF32 ? 2e-6 : 8e-3; }

TEST(ReluSiluMseTest, ReluMatchesReferenceExactly) {
  Env env;
  for (DType dt : {DType::kF32, DType::kBF16}) {
    for (int64_t n : {int64_t{1}, int64_t{37}, int64_t{20000}}) {
      auto x = round_to(dt, random_values(static_cast<size_t>(n), 1, -3.0f, 3.0f));
      x[0] = 0.0f;  // the kink: relu'(0) = 0, as PyTorch
      auto dy = round_to(dt, random_values(static_cast<size_t>(n), 2));
      Tensor tx = env.from(x, {n}, dt), tdy = env.from(dy, {n}, dt);
      Tensor y = env.empty({n}, dt), dx = env.empty({n}, dt);
      env.kernels->relu_forward(tx, y);
      env.kernels->relu_backward(tx, tdy, dx);
      std::vector<float> gy = env.host(y), gdx = env.host(dx);
      for (int64_t i = 0; i < n; ++i) {
        ASSERT_EQ(gy[i], x[i] > 0.0f ? x[i] : 0.0f) << dtype_name(dt) << " " << i;
        ASSERT_EQ(gdx[i], x[i] > 0.0f ? dy[i] : 0.0f) << dtype_name(dt) << " " << i;
      }
      env.kernels->relu_forward(tx, tx);  // in place
      EXPECT_EQ(env.host(tx), gy);
    }
  }
}

TEST(ReluSiluMseTest, SiluMatchesFloat64Reference) {
  Env env;
  for (DType dt : {DType::kF32, DType::kBF16}) {
    const int64_t n = 20011;  // two blocks and a tail
    auto x = round_to(dt, random_values(static_cast<size_t>(n), 3, -9.0f, 9.0f));
    auto dy = round_to(dt, random_values(static_cast<size_t>(n), 4));
    Tensor tx = env.from(x, {n}, dt), tdy = env.from(dy, {n}, dt);
    Tensor y = env.empty({n}, dt), dx = env.empty({n}, dt);
    env.kernels->silu_forward(tx, y);
    env.kernels->silu_backward(tx, tdy, dx);
    std::vector<double> want_y(n), want_dx(n);
    for (int64_t i = 0; i < n; ++i) {
      const double v = x[i], s = sigmoid(v);
      want_y[i] = v * s;
      want_dx[i] = dy[i] * s * (1.0 + v * (1.0 - s));
    }
    EXPECT_LT(max_err(env.host(y), want_y), tol(dt)) << dtype_name(dt);
    EXPECT_LT(max_err(env.host(dx), want_dx), tol(dt)) << dtype_name(dt);
  }
}

TEST(ReluSiluMseTest, MseMatchesFloat64Reference) {
  Env env;
  for (DType dt : {DType::kF32, DType::kBF16}) {
    for (auto [rows, cols] : {std::pair<int64_t, int64_t>{1, 1}, {5, 3}, {17, 300}}) {
      const size_t n = static_cast<size_t>(rows * cols);
      auto p = round_to(dt, random_values(n, 5, -2.0f, 2.0f));
      auto t = random_values(n, 6);  // targets stay f32: a mixed call
      Tensor tp = env.from(p, {rows, cols}, dt), tt = env.from(t, {rows, cols});
      Tensor losses = env.empty({rows});
      env.kernels->mse_forward(tp, tt, losses);
      std::vector<double> want(static_cast<size_t>(rows), 0.0);
      for (size_t i = 0; i < n; ++i) {
        const double d = static_cast<double>(p[i]) - t[i];
        want[i / cols] += d * d;
      }
      // f32 sums of <= 300 squares: a few 1e-6 relative.
      EXPECT_LT(max_err(env.host(losses), want), 1e-5) << dtype_name(dt) << " " << rows;
      Tensor dp = env.empty({rows, cols}, dt);
      env.kernels->mse_backward(tp, tt, dp, 0.125f);
      std::vector<double> want_d(n);
      for (size_t i = 0; i < n; ++i) want_d[i] = 2.0 * 0.125 * (static_cast<double>(p[i]) - t[i]);
      EXPECT_LT(max_err(env.host(dp), want_d), tol(dt)) << dtype_name(dt);
      env.kernels->mse_backward(tp, tt, tp, 0.125f);  // in place
      EXPECT_EQ(env.host(tp), env.host(dp));
    }
  }
}

// Note [Cpu determinism]: the same bits with 1 and 3 threads, over several blocks.
TEST(ReluSiluMseTest, BitsDoNotDependOnThreadCount) {
  const int64_t rows = 70, cols = 1000;
  const size_t n = static_cast<size_t>(rows * cols);
  auto x = random_values(n, 7, -5.0f, 5.0f), dy = random_values(n, 8), t = random_values(n, 9);
  std::vector<std::vector<float>> runs;
  for (int threads : {1, 3}) {
    Env env(threads);
    Tensor tx = env.from(x, {rows, cols}), tdy = env.from(dy, {rows, cols});
    Tensor tt = env.from(t, {rows, cols});
    std::vector<float> all;
    for (int op = 0; op < 5; ++op) {
      Tensor out = env.empty(op == 4 ? Shape{rows} : Shape{rows, cols});
      switch (op) {
        case 0: env.kernels->relu_backward(tx, tdy, out); break;
        case 1: env.kernels->silu_forward(tx, out); break;
        case 2: env.kernels->silu_backward(tx, tdy, out); break;
        case 3: env.kernels->mse_backward(tx, tt, out, 0.5f); break;
        case 4: env.kernels->mse_forward(tx, tt, out); break;
      }
      std::vector<float> h = env.host(out);
      all.insert(all.end(), h.begin(), h.end());
    }
    runs.push_back(std::move(all));
  }
  ASSERT_EQ(runs[0].size(), runs[1].size());
  EXPECT_EQ(std::memcmp(runs[0].data(), runs[1].data(), runs[0].size() * 4), 0);
}

TEST(ReluSiluMseTest, RejectsBadArguments) {
  Env env;
  Tensor x = env.from(random_values(12, 1), {3, 4});
  Tensor wrong = env.empty({4, 3});
  Tensor ids = env.ids(std::vector<int32_t>(12, 0), {3, 4});
  EXPECT_THAT([&] { env.kernels->relu_forward(x, wrong); },
              ::testing::ThrowsMessage<InvalidArgument>(::testing::HasSubstr(
                  "relu_forward: y has shape (4, 3), expected (3, 4)")));
  EXPECT_THROW(env.kernels->silu_backward(x, wrong, x), InvalidArgument);
  EXPECT_THROW(env.kernels->silu_forward(ids, x), InvalidArgument);
  Tensor losses = env.empty({4});
  EXPECT_THAT([&] { env.kernels->mse_forward(x, x, losses); },
              ::testing::ThrowsMessage<InvalidArgument>(
                  ::testing::HasSubstr("must hold one value per row of pred")));
  Tensor rows = env.empty({3});
  EXPECT_THROW(env.kernels->mse_forward(x, wrong, rows), InvalidArgument);
  EXPECT_THROW(env.kernels->mse_forward(x, x, x), InvalidArgument);  // losses not f32 (3)
  EXPECT_THROW(env.kernels->mse_backward(x, ids, x, 1.0f), InvalidArgument);
}

}  // namespace
}  // namespace porter::nn
