// LayerNorm, embedding and cross-entropy on cpu against double references; backward through
// central differences of the reference (dx) or the analytic gradient (parameters).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>

#include "base/error.h"
#include "tests/nn/nn_test_util.h"

namespace porter::nn {

using namespace porter::tensor;
using namespace porter::kernels;
namespace {

using ::testing::HasSubstr;
using testing::Env;
using testing::max_rel_error;
using testing::random_values;
using testing::round_bf16;
using testing::round_f16;

// y = layernorm(x) per row, in double.
std::vector<double> layernorm_ref(const std::vector<double>& x, const std::vector<float>& g,
                                  const std::vector<float>& b, int64_t rows, int64_t cols,
                                  double eps, std::vector<double>* xhat = nullptr) {
  std::vector<double> y(x.size());
  if (xhat) xhat->resize(x.size());
  for (int64_t r = 0; r < rows; ++r) {
    double mean = 0, var = 0;
    for (int64_t c = 0; c < cols; ++c) mean += x[r * cols + c];
    mean /= cols;
    for (int64_t c = 0; c < cols; ++c) var += (x[r * cols + c] - mean) * (x[r * cols + c] - mean);
    const double rstd = 1.0 / std::sqrt(var / cols + eps);
    for (int64_t c = 0; c < cols; ++c) {
      double h = (x[r * cols + c] - mean) * rstd;
      if (xhat) (*xhat)[r * cols + c] = h;
      y[r * cols + c] = h * g[c] + b[c];
    }
  }
  return y;
}

struct Size {
  int64_t rows, cols;
};

TEST(LayerNormTest, ForwardAndBackwardMatchReference) {
  Env env;
  const float eps = 1e-5f;
  for (Size s : {Size{1, 1}, Size{3, 17}, Size{5, 768}, Size{130, 65}}) {
    const size_t n = static_cast<size_t>(s.rows * s.cols);
    auto x = random_values(n, 1, -2.0f, 3.0f);
    auto g = random_values(static_cast<size_t>(s.cols), 2);
    auto b = random_values(static_cast<size_t>(s.cols), 3);
    auto dy = random_values(n, 4);
    auto dg0 = random_values(static_cast<size_t>(s.cols), 5);
    auto db0 = random_values(static_cast<size_t>(s.cols), 6);
    tensor::Tensor tx = env.from(x, {s.rows, s.cols}), tg = env.from(g, {s.cols}), tb = env.from(b, {s.cols});
    tensor::Tensor ty = env.empty({s.rows, s.cols}), mean = env.empty({s.rows}), rstd = env.empty({s.rows});
    env.kernels->layernorm_forward(tx, tg, tb, ty, mean, rstd, eps);
    std::vector<double> xd(x.begin(), x.end()), xhat;
    std::vector<double> want_y = layernorm_ref(xd, g, b, s.rows, s.cols, eps, &xhat);
    // f32 mean/variance over <= 768 terms: 1e-5 of the max |y|.
    EXPECT_LT(max_rel_error(env.host(ty), want_y), 1e-5) << s.rows << "x" << s.cols;

    tensor::Tensor tdy = env.from(dy, {s.rows, s.cols}), tdx = env.empty({s.rows, s.cols});
    tensor::Tensor tdg = env.from(dg0, {s.cols}), tdb = env.from(db0, {s.cols});
    env.kernels->layernorm_backward(tdy, tx, tg, mean, rstd, tdx, tdg, tdb);
    // dx by central differences of L = sum(dy * y) on the double reference.
    std::vector<double> want_dx(n);
    for (size_t i = 0; i < n; ++i) {
      const double h = 1e-5;
      auto loss = [&](double xi) {
        std::vector<double> xp = xd;
        xp[i] = xi;
        const int64_t r = static_cast<int64_t>(i) / s.cols;
        std::vector<double> row(xp.begin() + r * s.cols, xp.begin() + (r + 1) * s.cols);
        std::vector<double> yr = layernorm_ref(row, g, b, 1, s.cols, eps);
        double l = 0;
        for (int64_t c = 0; c < s.cols; ++c) l += dy[r * s.cols + c] * yr[c];
        return l;
      };
      want_dx[i] = (loss(xd[i] + h) - loss(xd[i] - h)) / (2 * h);
    }
    std::vector<double> want_dg(dg0.begin(), dg0.end()), want_db(db0.begin(), db0.end());
    for (int64_t r = 0; r < s.rows; ++r) {
      for (int64_t c = 0; c < s.cols; ++c) {
        want_dg[c] += dy[r * s.cols + c] * xhat[r * s.cols + c];
        want_db[c] += dy[r * s.cols + c];
      }
    }
    // dx has f32 rounding amplified by rstd (up to ~1/sqrt(eps) when cols = 1, where the
    // exact dx is 0): 1e-4 of max(|dx|, 1).
    EXPECT_LT(max_rel_error(env.host(tdx), want_dx, 1.0), 1e-4) << s.rows << "x" << s.cols;
    EXPECT_LT(max_rel_error(env.host(tdg), want_dg), 1e-5) << s.rows << "x" << s.cols;
    EXPECT_LT(max_rel_error(env.host(tdb), want_db), 1e-5) << s.rows << "x" << s.cols;
  }
}

TEST(LayerNormTest, Bf16ActivationsWithF32Parameters) {
  Env env;
  const int64_t rows = 9, cols = 33;
  auto x = round_bf16(random_values(rows * cols, 7));
  auto g = random_values(cols, 8), b = random_values(cols, 9);
  tensor::Tensor tx = env.from(x, {rows, cols}, DType::kBF16), ty = env.empty({rows, cols}, DType::kBF16);
  tensor::Tensor mean = env.empty({rows}), rstd = env.empty({rows});
  env.kernels->layernorm_forward(tx, env.from(g, {cols}), env.from(b, {cols}), ty, mean, rstd);
  std::vector<double> xd(x.begin(), x.end());
  // One bf16 rounding of y: 2^-8 relative, 8e-3 of the max.
  EXPECT_LT(max_rel_error(env.host(ty), layernorm_ref(xd, g, b, rows, cols, 1e-5)), 8e-3);
}

// f16 activations and parameters, f16 dgamma/dbeta accumulators: each output rounds once
// to f16 (2^-11 relative), against the reference on the f16-rounded inputs.
TEST(LayerNormTest, F16ForwardAndBackwardWithinF16Rounding) {
  Env env;
  const int64_t rows = 9, cols = 33;
  auto x = round_f16(random_values(rows * cols, 7));
  auto g = round_f16(random_values(cols, 8)), b = round_f16(random_values(cols, 9));
  auto dy = round_f16(random_values(rows * cols, 10));
  const DType h = DType::kF16;
  tensor::Tensor tx = env.from(x, {rows, cols}, h), ty = env.empty({rows, cols}, h);
  tensor::Tensor tg = env.from(g, {cols}, h), tb = env.from(b, {cols}, h);
  tensor::Tensor mean = env.empty({rows}), rstd = env.empty({rows});
  env.kernels->layernorm_forward(tx, tg, tb, ty, mean, rstd);
  std::vector<double> xd(x.begin(), x.end()), xhat;
  const std::vector<double> want_y = layernorm_ref(xd, g, b, rows, cols, 1e-5, &xhat);
  EXPECT_LT(max_rel_error(env.host(ty), want_y), 1e-3);

  tensor::Tensor tdy = env.from(dy, {rows, cols}, h), tdx = env.empty({rows, cols}, h);
  tensor::Tensor dg = env.from(std::vector<float>(cols, 0.0f), {cols}, h);
  tensor::Tensor db = env.from(std::vector<float>(cols, 0.0f), {cols}, h);
  env.kernels->layernorm_backward(tdy, tx, tg, mean, rstd, tdx, dg, db);
  std::vector<double> want_dg(cols, 0.0), want_db(cols, 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      want_dg[c] += dy[r * cols + c] * xhat[r * cols + c];
      want_db[c] += dy[r * cols + c];
    }
  }
  EXPECT_LT(max_rel_error(env.host(dg), want_dg), 2e-3);
  EXPECT_LT(max_rel_error(env.host(db), want_db), 2e-3);
  // dx = rstd (g - mean(g) - xhat mean(g xhat)), g = dy gamma, in double.
  std::vector<double> want_dx(x.size());
  for (int64_t r = 0; r < rows; ++r) {
    double mean_x = 0, var = 0, mg = 0, mgx = 0;
    for (int64_t c = 0; c < cols; ++c) mean_x += x[r * cols + c];
    mean_x /= cols;
    for (int64_t c = 0; c < cols; ++c) var += std::pow(x[r * cols + c] - mean_x, 2);
    const double rs = 1.0 / std::sqrt(var / cols + 1e-5);
    for (int64_t c = 0; c < cols; ++c) {
      mg += double{dy[r * cols + c]} * g[c] / cols;
      mgx += double{dy[r * cols + c]} * g[c] * xhat[r * cols + c] / cols;
    }
    for (int64_t c = 0; c < cols; ++c) {
      want_dx[r * cols + c] =
          rs * (double{dy[r * cols + c]} * g[c] - mg - xhat[r * cols + c] * mgx);
    }
  }
  EXPECT_LT(max_rel_error(env.host(tdx), want_dx), 2e-3);
}

TEST(EmbeddingTest, F16TablesAndOutput) {
  Env env;
  const int64_t vocab = 11, cols = 9, t_max = 6, batch = 2, seq = 5;
  auto wte = round_f16(random_values(vocab * cols, 30)), wpe = round_f16(random_values(t_max * cols, 31));
  std::vector<int32_t> tok = {3, 0, 10, 3, 7, 1, 1, 2, 9, 4};
  tensor::Tensor twte = env.from(wte, {vocab, cols}, DType::kF16);
  tensor::Tensor twpe = env.from(wpe, {t_max, cols}, DType::kF16);
  tensor::Tensor out = env.empty({batch, seq, cols}, DType::kF16);
  env.kernels->embedding_forward(env.ids(tok, {batch, seq}), twte, twpe, out);
  std::vector<float> got = env.host(out);
  for (int64_t n = 0; n < batch * seq; ++n) {
    for (int64_t c = 0; c < cols; ++c) {
      const float want = wte[tok[n] * cols + c] + wpe[(n % seq) * cols + c];
      ASSERT_EQ(got[n * cols + c], testing::round_to(DType::kF16, want)) << n << " " << c;
    }
  }
}

TEST(EmbeddingTest, ForwardAddsTokenAndPositionRows) {
  Env env;
  const int64_t batch = 2, t_len = 3, vocab = 5, cols = 17, t_max = 4;
  auto wte = random_values(vocab * cols, 10), wpe = random_values(t_max * cols, 11);
  std::vector<int32_t> tok = {4, 0, 4, 1, 1, 3};
  tensor::Tensor out = env.empty({batch, t_len, cols});
  env.kernels->embedding_forward(env.ids(tok, {batch, t_len}), env.from(wte, {vocab, cols}),
                                 env.from(wpe, {t_max, cols}), out);
  std::vector<float> got = env.host(out);
  for (int64_t n = 0; n < batch * t_len; ++n) {
    for (int64_t c = 0; c < cols; ++c) {
      ASSERT_EQ(got[n * cols + c], wte[tok[n] * cols + c] + wpe[(n % t_len) * cols + c]);
    }
  }
}

TEST(EmbeddingTest, BackwardAccumulatesRepeatedTokens) {
  Env env;
  const int64_t batch = 3, t_len = 5, vocab = 7, cols = 130, t_max = 6;
  std::vector<int32_t> tok = {1, 1, 2, 6, 0, 1, 2, 2, 2, 5, 6, 6, 0, 1, 3};
  auto dout = random_values(batch * t_len * cols, 12);
  auto dwte0 = random_values(vocab * cols, 13), dwpe0 = random_values(t_max * cols, 14);
  tensor::Tensor dwte = env.from(dwte0, {vocab, cols}), dwpe = env.from(dwpe0, {t_max, cols});
  env.kernels->embedding_backward(env.from(dout, {batch, t_len, cols}), env.ids(tok, {batch, t_len}),
                                  dwte, dwpe);
  std::vector<double> want_te(dwte0.begin(), dwte0.end()), want_pe(dwpe0.begin(), dwpe0.end());
  for (int64_t n = 0; n < batch * t_len; ++n) {
    for (int64_t c = 0; c < cols; ++c) {
      want_te[tok[n] * cols + c] += dout[n * cols + c];
      want_pe[(n % t_len) * cols + c] += dout[n * cols + c];
    }
  }
  EXPECT_LT(max_rel_error(env.host(dwte), want_te), 1e-6);
  EXPECT_LT(max_rel_error(env.host(dwpe), want_pe), 1e-6);
}

TEST(EmbeddingTest, RejectsOutOfRangeTokens) {
  Env env;
  tensor::Tensor out = env.empty({1, 2, 3});
  try {
    env.kernels->embedding_forward(env.ids({0, 9}, {1, 2}), env.empty({4, 3}), env.empty({2, 3}), out);
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("embedding_forward"));
    EXPECT_THAT(e.what(), HasSubstr("id 9"));
  }
}

// losses and dlogits in double: log-sum-exp with max subtraction.
void cross_entropy_ref(const std::vector<float>& logits, const std::vector<int32_t>& tgt,
                       int64_t rows, int64_t classes, float scale, std::vector<double>* losses,
                       std::vector<double>* dlogits) {
  losses->assign(rows, 0.0);
  dlogits->assign(logits.size(), 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    double mx = -INFINITY, s = 0;
    for (int64_t c = 0; c < classes; ++c) mx = std::max(mx, double{logits[r * classes + c]});
    for (int64_t c = 0; c < classes; ++c) s += std::exp(logits[r * classes + c] - mx);
    (*losses)[r] = std::log(s) + mx - logits[r * classes + tgt[r]];
    for (int64_t c = 0; c < classes; ++c) {
      double p = std::exp(logits[r * classes + c] - mx) / s;
      (*dlogits)[r * classes + c] = (p - (c == tgt[r] ? 1.0 : 0.0)) * scale;
    }
  }
}

TEST(CrossEntropyTest, ForwardAndBackwardMatchReferenceAndStayFinite) {
  Env env;
  for (Size s : {Size{1, 1}, Size{3, 17}, Size{7, 1000}, Size{2, 8193}}) {
    auto logits = random_values(static_cast<size_t>(s.rows * s.cols), 15, -5.0f, 5.0f);
    logits[0] = 1000.0f;  // would overflow exp() without max subtraction
    std::vector<int32_t> tgt(s.rows);
    for (int64_t r = 0; r < s.rows; ++r) tgt[r] = static_cast<int32_t>((r * 7 + 3) % s.cols);
    const float scale = 1.0f / static_cast<float>(s.rows);
    std::vector<double> want_loss, want_d;
    cross_entropy_ref(logits, tgt, s.rows, s.cols, scale, &want_loss, &want_d);
    tensor::Tensor tl = env.from(logits, {s.rows, s.cols}), losses = env.empty({s.rows});
    tensor::Tensor tt = env.ids(tgt, {s.rows}), dl = env.empty({s.rows, s.cols});
    env.kernels->cross_entropy_forward(tl, tt, losses);
    env.kernels->cross_entropy_backward(tl, tt, dl, scale);
    // The loss row 0 is ~1000 (target is not the 1000 logit): 1e-6 of max(|loss|, 1) is a
    // few f32 ulps of it; the others are compared on their own below.
    std::vector<float> got_loss = env.host(losses);
    EXPECT_LT(max_rel_error(got_loss, want_loss, 1.0), 1e-6) << s.rows << "x" << s.cols;
    for (int64_t r = 1; r < s.rows; ++r) EXPECT_NEAR(got_loss[r], want_loss[r], 1e-5) << r;
    EXPECT_LT(max_rel_error(env.host(dl), want_d), 1e-6) << s.rows << "x" << s.cols;
    // In place (dlogits = logits) gives the same bits.
    env.kernels->cross_entropy_backward(tl, tt, tl, scale);
    EXPECT_EQ(env.host(tl), env.host(dl));
  }
}

TEST(CrossEntropyTest, Bf16LogitsAndGradient) {
  Env env;
  const int64_t rows = 4, classes = 33;
  auto logits = round_bf16(random_values(rows * classes, 16, -3.0f, 3.0f));
  std::vector<int32_t> tgt = {0, 32, 5, 17};
  std::vector<double> want_loss, want_d;
  cross_entropy_ref(logits, tgt, rows, classes, 1.0f, &want_loss, &want_d);
  tensor::Tensor tl = env.from(logits, {rows, classes}, DType::kBF16), losses = env.empty({rows});
  tensor::Tensor dl = env.empty({rows, classes}, DType::kBF16);
  env.kernels->cross_entropy_forward(tl, env.ids(tgt, {rows}), losses);
  env.kernels->cross_entropy_backward(tl, env.ids(tgt, {rows}), dl, 1.0f);
  EXPECT_LT(max_rel_error(env.host(losses), want_loss), 1e-6);
  EXPECT_LT(max_rel_error(env.host(dl), want_d), 8e-3);
}

TEST(CrossEntropyTest, F16LogitsAndGradient) {
  Env env;
  const int64_t rows = 4, classes = 33;
  auto logits = round_f16(random_values(rows * classes, 16, -3.0f, 3.0f));
  std::vector<int32_t> tgt = {0, 32, 5, 17};
  std::vector<double> want_loss, want_d;
  cross_entropy_ref(logits, tgt, rows, classes, 1.0f, &want_loss, &want_d);
  tensor::Tensor tl = env.from(logits, {rows, classes}, DType::kF16), losses = env.empty({rows});
  tensor::Tensor dl = env.empty({rows, classes}, DType::kF16);
  env.kernels->cross_entropy_forward(tl, env.ids(tgt, {rows}), losses);
  env.kernels->cross_entropy_backward(tl, env.ids(tgt, {rows}), dl, 1.0f);
  EXPECT_LT(max_rel_error(env.host(losses), want_loss), 1e-6);
  EXPECT_LT(max_rel_error(env.host(dl), want_d), 1e-3);
  // In place (dlogits = logits), as the GPT head does.
  env.kernels->cross_entropy_backward(tl, env.ids(tgt, {rows}), tl, 1.0f);
  EXPECT_EQ(env.host(tl), env.host(dl));
}

TEST(CrossEntropyTest, RejectsOutOfRangeTargets) {
  Env env;
  tensor::Tensor losses = env.empty({2});
  try {
    env.kernels->cross_entropy_forward(env.empty({2, 5}), env.ids({1, -1}, {2}), losses);
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("cross_entropy_forward"));
    EXPECT_THAT(e.what(), HasSubstr("id -1"));
  }
}

}  // namespace
}  // namespace porter::nn
