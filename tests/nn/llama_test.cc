// Llama's kernels (RMSNorm, the rotary qkv, SwiGLU) against double references, in f32 and
// bf16, and the Llama model: layout, init, and bit-identical gradients under every
// checkpoint policy (Note [Llama] in models/transformer.h).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "base/error.h"
#include "models/factory.h"
#include "nn_test_util.h"

namespace porter::nn {

using namespace porter::tensor;
using namespace porter::kernels;
namespace {

using ::testing::HasSubstr;
using testing::Env;
using testing::max_rel_error;
using testing::random_values;
using testing::round_to;

// ---- RMSNorm ----

std::vector<double> rms_ref(const std::vector<float>& x, const std::vector<float>& g, int64_t rows,
                            int64_t cols, double eps, std::vector<double>* rstd = nullptr) {
  std::vector<double> y(x.size());
  if (rstd) rstd->resize(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t c = 0; c < cols; ++c) ss += double(x[r * cols + c]) * x[r * cols + c];
    const double rs = 1.0 / std::sqrt(ss / cols + eps);
    if (rstd) (*rstd)[r] = rs;
    for (int64_t c = 0; c < cols; ++c) y[r * cols + c] = x[r * cols + c] * rs * g[c];
  }
  return y;
}

// <dy, y(x)> in double, for central differences.
double rms_dot(const std::vector<float>& x, const std::vector<float>& g,
               const std::vector<float>& dy, int64_t rows, int64_t cols, double eps) {
  const std::vector<double> y = rms_ref(x, g, rows, cols, eps);
  double s = 0;
  for (size_t i = 0; i < y.size(); ++i) s += y[i] * dy[i];
  return s;
}

TEST(RmsNormTest, ForwardAndBackwardMatchReference) {
  Env env;
  const float eps = 1e-6f;
  for (auto [rows, cols] : {std::pair<int64_t, int64_t>{1, 2}, {3, 17}, {5, 768}, {130, 65}}) {
    const size_t n = static_cast<size_t>(rows * cols);
    auto x = random_values(n, 1, -2.0f, 3.0f);
    auto g = random_values(static_cast<size_t>(cols), 2, 0.5f, 1.5f);
    auto dy = random_values(n, 4);
    auto dg0 = random_values(static_cast<size_t>(cols), 5);
    Tensor tx = env.from(x, {rows, cols}), tg = env.from(g, {cols});
    Tensor ty = env.empty({rows, cols}), rstd = env.empty({rows});
    env.kernels->rmsnorm_forward(tx, tg, ty, rstd, eps);
    std::vector<double> rs;
    EXPECT_LT(max_rel_error(env.host(ty), rms_ref(x, g, rows, cols, eps, &rs)), 2e-6);
    EXPECT_LT(max_rel_error(env.host(rstd), rs), 2e-6);

    Tensor tdy = env.from(dy, {rows, cols}), tdx = env.empty({rows, cols});
    Tensor tdg = env.from(dg0, {cols});
    env.kernels->rmsnorm_backward(tdy, tx, tg, rstd, tdx, tdg);
    // dx by central differences of the reference; dgamma analytically (accumulated).
    std::vector<double> dx(n), dg(static_cast<size_t>(cols));
    for (size_t i = 0; i < std::min<size_t>(n, 200); ++i) {
      std::vector<float> xp = x, xm = x;
      const float h = 1e-2f * std::max(1.0f, std::fabs(x[i]));
      xp[i] += h;
      xm[i] -= h;
      dx[i] = (rms_dot(xp, g, dy, rows, cols, eps) - rms_dot(xm, g, dy, rows, cols, eps)) /
              (double(xp[i]) - xm[i]);
    }
    for (int64_t c = 0; c < cols; ++c) {
      double s = dg0[static_cast<size_t>(c)];
      for (int64_t r = 0; r < rows; ++r) s += dy[r * cols + c] * x[r * cols + c] * rs[r];
      dg[static_cast<size_t>(c)] = s;
    }
    std::vector<float> got = env.host(tdx);
    got.resize(std::min<size_t>(n, 200));
    dx.resize(got.size());
    EXPECT_LT(max_rel_error(got, dx), 5e-3) << rows << "x" << cols;
    EXPECT_LT(max_rel_error(env.host(tdg), dg), 2e-6) << rows << "x" << cols;
  }
}

TEST(RmsNormTest, Bf16WithinBf16Rounding) {
  Env env;
  const int64_t rows = 9, cols = 96;
  auto x = round_to(DType::kBF16, random_values(size_t(rows * cols), 7, -2.0f, 2.0f));
  auto g = random_values(size_t(cols), 8, 0.5f, 1.5f);
  Tensor tx = env.from(x, {rows, cols}, DType::kBF16), tg = env.from(g, {cols});
  Tensor ty = env.empty({rows, cols}, DType::kBF16), rstd = env.empty({rows});
  env.kernels->rmsnorm_forward(tx, tg, ty, rstd, 1e-5f);
  EXPECT_LT(max_rel_error(env.host(ty), rms_ref(x, g, rows, cols, 1e-5)), 8e-3);
}

TEST(RmsNormTest, RejectsBadShapesNamingTheOp) {
  Env env;
  Tensor x = env.empty({4, 8}), g = env.empty({7}), y = env.empty({4, 8}), rstd = env.empty({4});
  try {
    env.kernels->rmsnorm_forward(x, g, y, rstd, 1e-5f);
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("rmsnorm_forward"));
  }
}

// ---- rotary qkv ----

struct RopeCase {
  int64_t b, t;
  int heads, kv;
  int64_t d;
  double theta;
};

// qkv (B, T, 3 H D) from q, k, v in double (Hugging Face's rotate_half, repeat_kv).
std::vector<double> rope_ref(const RopeCase& c, const std::vector<float>& q,
                             const std::vector<float>& k, const std::vector<float>& v) {
  const int64_t C = c.heads * c.d, Ckv = c.kv * c.d, half = c.d / 2, group = c.heads / c.kv;
  std::vector<double> out(static_cast<size_t>(c.b * c.t * 3 * C));
  for (int64_t row = 0; row < c.b * c.t; ++row) {
    const int64_t pos = row % c.t;
    for (int64_t h = 0; h < c.heads; ++h) {
      const int64_t g = h / group;
      for (int64_t i = 0; i < c.d; ++i) {
        const int64_t j = i % half;
        const double a = pos * std::pow(c.theta, -2.0 * j / c.d);
        const double cs = std::cos(a), sn = std::sin(a);
        auto rot = [&](const std::vector<float>& x, int64_t base) {
          const double rh = i < half ? -double(x[base + i + half]) : double(x[base + i - half]);
          return x[base + i] * cs + rh * sn;
        };
        out[row * 3 * C + h * c.d + i] = rot(q, row * C + h * c.d);
        out[row * 3 * C + C + h * c.d + i] = rot(k, row * Ckv + g * c.d);
        out[row * 3 * C + 2 * C + h * c.d + i] = v[row * Ckv + g * c.d + i];
      }
    }
  }
  return out;
}

class RopeTest : public ::testing::TestWithParam<RopeCase> {};

TEST_P(RopeTest, ForwardMatchesReferenceAndBackwardIsItsTranspose) {
  const RopeCase c = GetParam();
  Env env;
  const int64_t C = c.heads * c.d, Ckv = c.kv * c.d;
  auto q = random_values(size_t(c.b * c.t * C), 1);
  auto k = random_values(size_t(c.b * c.t * Ckv), 2);
  auto v = random_values(size_t(c.b * c.t * Ckv), 3);
  Tensor tq = env.from(q, {c.b, c.t, C}), tk = env.from(k, {c.b, c.t, Ckv});
  Tensor tv = env.from(v, {c.b, c.t, Ckv}), qkv = env.empty({c.b, c.t, 3 * C});
  env.kernels->rope_qkv_forward(tq, tk, tv, qkv, c.heads, c.kv, c.theta);
  const std::vector<double> want = rope_ref(c, q, k, v);
  EXPECT_LT(max_rel_error(env.host(qkv), want), 1e-6);

  // Backward is the adjoint: <g, F(q, k, v)> = <dq, q> + <dk, k> + <dv, v>.
  auto g = random_values(size_t(c.b * c.t * 3 * C), 4);
  Tensor tg = env.from(g, {c.b, c.t, 3 * C});
  Tensor dq = env.empty({c.b, c.t, C}), dk = env.empty({c.b, c.t, Ckv}), dv = env.empty({c.b, c.t, Ckv});
  env.kernels->rope_qkv_backward(tg, dq, dk, dv, c.heads, c.kv, c.theta);
  double lhs = 0, rhs = 0, scale = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    lhs += g[i] * want[i];
    scale += std::fabs(g[i] * want[i]);
  }
  const auto hq = env.host(dq), hk = env.host(dk), hv = env.host(dv);
  for (size_t i = 0; i < q.size(); ++i) rhs += double(hq[i]) * q[i];
  for (size_t i = 0; i < k.size(); ++i) rhs += double(hk[i]) * k[i] + double(hv[i]) * v[i];
  EXPECT_NEAR(lhs, rhs, 1e-6 * scale);
}

INSTANTIATE_TEST_SUITE_P(Shapes, RopeTest,
                         ::testing::Values(RopeCase{2, 16, 4, 2, 8, 1e4}, RopeCase{1, 9, 4, 1, 12, 5e5},
                                           RopeCase{3, 5, 6, 6, 4, 1e4}, RopeCase{1, 130, 8, 2, 64, 1e6}));

TEST(RopeTest, Bf16AndThreadCounts) {
  const RopeCase c{2, 11, 4, 2, 16, 1e4};
  const int64_t C = c.heads * c.d, Ckv = c.kv * c.d;
  auto q = round_to(DType::kBF16, random_values(size_t(c.b * c.t * C), 1));
  auto k = round_to(DType::kBF16, random_values(size_t(c.b * c.t * Ckv), 2));
  auto v = round_to(DType::kBF16, random_values(size_t(c.b * c.t * Ckv), 3));
  std::vector<std::vector<float>> outs;
  for (int threads : {1, 2}) {
    Env env(threads);
    Tensor tq = env.from(q, {c.b, c.t, C}, DType::kBF16), tk = env.from(k, {c.b, c.t, Ckv}, DType::kBF16);
    Tensor tv = env.from(v, {c.b, c.t, Ckv}, DType::kBF16);
    Tensor qkv = env.empty({c.b, c.t, 3 * C}, DType::kBF16);
    env.kernels->rope_qkv_forward(tq, tk, tv, qkv, c.heads, c.kv, c.theta);
    outs.push_back(env.host(qkv));
    EXPECT_LT(max_rel_error(outs.back(), rope_ref(c, q, k, v)), 8e-3);
  }
  EXPECT_EQ(outs[0], outs[1]);
}

TEST(RopeTest, RejectsKvHeadsThatDoNotDivide) {
  Env env;
  Tensor q = env.empty({1, 2, 24}), k = env.empty({1, 2, 16}), v = env.empty({1, 2, 16});
  Tensor qkv = env.empty({1, 2, 72});
  try {
    env.kernels->rope_qkv_forward(q, k, v, qkv, 3, 2, 1e4);
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("kv_heads 2"));
  }
}

// ---- SwiGLU ----

TEST(SwigluTest, ForwardAndBackwardMatchReference) {
  Env env;
  const int64_t n = 40000;  // several parallel blocks
  auto g = random_values(size_t(n), 1, -6.0f, 6.0f), u = random_values(size_t(n), 2);
  auto dy = random_values(size_t(n), 3);
  Tensor tg = env.from(g, {n}), tu = env.from(u, {n}), ty = env.empty({n});
  env.kernels->swiglu_forward(tg, tu, ty);
  const size_t count = static_cast<size_t>(n);
  std::vector<double> y(count), dg(count), du(count);
  for (size_t i = 0; i < size_t(n); ++i) {
    const double s = 1.0 / (1.0 + std::exp(-double(g[i])));
    y[i] = g[i] * s * u[i];
    dg[i] = dy[i] * u[i] * (s * (1 + g[i] * (1 - s)));
    du[i] = dy[i] * g[i] * s;
  }
  EXPECT_LT(max_rel_error(env.host(ty), y), 2e-6);
  Tensor tdy = env.from(dy, {n}), tdg = env.empty({n}), tdu = env.empty({n});
  env.kernels->swiglu_backward(tg, tu, tdy, tdg, tdu);
  EXPECT_LT(max_rel_error(env.host(tdg), dg), 2e-6);
  EXPECT_LT(max_rel_error(env.host(tdu), du), 2e-6);
}

// ---- the model ----

config::ModelConfig llama_config(double dropout = 0.1, bool tied = false) {
  config::ModelConfig mc;
  mc.type = config::ModelType::kLlama;
  mc.layers = 3;
  mc.hidden = 32;
  mc.heads = 4;
  mc.kv_heads = 2;
  mc.intermediate = 88;
  mc.seq_len = 12;
  mc.vocab = 50;
  mc.dropout = dropout;
  mc.tie_embeddings = tied;
  mc.rope_theta = 5e5;
  return mc;
}

TEST(LlamaLayoutTest, HuggingFaceNamesAndShapes) {
  models::Transformer llama(llama_config());
  std::vector<std::string> names;
  for (const ParamEntry& e : llama.layout().entries()) names.push_back(e.name);
  ASSERT_EQ(names.size(), 1u + 3 * 9 + 2);
  EXPECT_EQ(names.front(), "embed_tokens.weight");
  EXPECT_EQ(names[1], "layers.0.input_layernorm.weight");
  EXPECT_EQ(names[names.size() - 2], "norm.weight");
  EXPECT_EQ(names.back(), "lm_head.weight");
  EXPECT_EQ(llama.layout().find("layers.2.self_attn.k_proj.weight").shape, (Shape{16, 32}));
  EXPECT_EQ(llama.layout().find("layers.2.self_attn.o_proj.weight").shape, (Shape{32, 32}));
  EXPECT_EQ(llama.layout().find("layers.1.mlp.down_proj.weight").shape, (Shape{32, 88}));
  EXPECT_EQ(llama.layout().find("layers.1.mlp.gate_proj.weight").shape, (Shape{88, 32}));
  EXPECT_EQ(llama.stage_name(1), "block.0");
  EXPECT_EQ(llama.embedding_name(), "embed_tokens.weight");
  EXPECT_TRUE(llama.replicated("layers.0.post_attention_layernorm.weight"));
  EXPECT_FALSE(llama.replicated("layers.0.self_attn.q_proj.weight"));

  models::Transformer tied(llama_config(0.0, true));
  EXPECT_THROW(tied.layout().find("lm_head.weight"), InvalidArgument);

  // The default MLP width: 8/3 hidden rounded up to a multiple of 256 (Llama's rule).
  config::ModelConfig mc = llama_config();
  mc.intermediate = 0;
  mc.hidden = 4096;
  EXPECT_EQ(models::arch_spec(mc.type).intermediate(mc), 11008);
}

TEST(LlamaLayoutTest, InitIsNormalMatricesAndUnitNorms) {
  models::Transformer llama(llama_config());
  const std::vector<float> v = llama.init_values(3);
  const ParamEntry& norm = llama.layout().find("layers.0.input_layernorm.weight");
  for (int64_t i = 0; i < norm.shape.numel(); ++i) EXPECT_EQ(v[size_t(norm.offset_elems + i)], 1.0f);
  const ParamEntry& down = llama.layout().find("layers.2.mlp.down_proj.weight");
  double ss = 0;
  for (int64_t i = 0; i < down.shape.numel(); ++i) ss += double(v[size_t(down.offset_elems + i)]) * v[size_t(down.offset_elems + i)];
  EXPECT_NEAR(std::sqrt(ss / double(down.shape.numel())), 0.02, 0.002);  // no residual scaling
  EXPECT_EQ(v, models::Transformer(llama_config()).init_values(3));
}

TEST(LlamaLayoutTest, RejectsShapesItCannotBuild) {
  config::ModelConfig mc = llama_config();
  mc.kv_heads = 3;
  EXPECT_THROW(models::Transformer{mc}, InvalidArgument);
  mc = llama_config();
  mc.hidden = 36;  // 9 channels per head: no rotary pairs
  EXPECT_THROW(models::Transformer{mc}, InvalidArgument);
}

struct Result {
  float loss = 0;
  std::vector<float> grads;
};

Result run(Env& env, models::Transformer& model, FlatParams& flat, const std::vector<models::StagePlan>& plans,
           DType dtype, uint64_t step = 3) {
  Tensor g = flat.grads();
  env.kernels->fill(g, 0.0f);
  Ctx ctx(*env.kernels, *env.allocator, dtype);
  ctx.set_run({7, step, 0});
  std::vector<int32_t> tok(24), tgt(24);
  for (int i = 0; i < 24; ++i) {
    tok[size_t(i)] = (i * 7 + i * i) % 50;
    tgt[size_t(i)] = (i * 11 + 3) % 50;
  }
  Result r;
  r.loss = model.forward_backward(ctx, env.ids(tok, {2, 12}), env.ids(tgt, {2, 12}), plans);
  r.grads = env.host(flat.grads());
  return r;
}

class LlamaRecomputeTest : public ::testing::TestWithParam<DType> {};

TEST_P(LlamaRecomputeTest, GradientsBitIdenticalUnderEveryPolicy) {
  const DType dtype = GetParam();
  Env env;
  models::Transformer llama(llama_config(0.1));
  FlatParams flat(*env.allocator, llama.layout(), dtype, DType::kF32);
  Tensor p = flat.params();
  from_host_f32(*env.device, llama.init_values(5), p);
  llama.bind(flat);
  const Result base = run(env, llama, flat, {}, dtype);
  ASSERT_TRUE(std::isfinite(base.loss));
  EXPECT_NE(run(env, llama, flat, {}, dtype, 4).loss, base.loss);  // dropout is on
  const OpPolicy policies[] = {OpPolicy::keep_none(), OpPolicy::selective_attention(),
                               OpPolicy::keep_only({OpKind::kMatmul}), OpPolicy::keep_all(),
                               OpPolicy::recompute_only({OpKind::kDropout, OpKind::kGelu}),
                               OpPolicy::recompute_only({OpKind::kOther})};
  for (const OpPolicy& policy : policies) {
    std::vector<models::StagePlan> plans(size_t(llama.num_stages()), {SaveMode::kCheckpoint, policy});
    const Result got = run(env, llama, flat, plans, dtype);
    EXPECT_EQ(std::memcmp(&got.loss, &base.loss, 4), 0) << policy.to_string();
    EXPECT_EQ(got.grads, base.grads) << policy.to_string();
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, LlamaRecomputeTest, ::testing::Values(DType::kF32, DType::kBF16));

// Gradients of the whole model against central differences of its loss along a random
// direction in each tensor: a coarse check that every parameter's gradient path is wired
// (the Hugging Face fixtures check the values to 1e-4).
TEST(LlamaGradientTest, MatchesFiniteDifferencesOnEveryTensor) {
  Env env(1);
  models::Transformer llama(llama_config(0.0, true));
  FlatParams flat(*env.allocator, llama.layout(), DType::kF32, DType::kF32);
  std::vector<float> values = llama.init_values(9);
  for (float& v : values) v *= 2.0f;  // larger weights: gradients well above f32 noise
  Tensor p = flat.params();
  from_host_f32(*env.device, values, p);
  llama.bind(flat);
  const Result base = run(env, llama, flat, {}, DType::kF32);
  uint32_t seed = 1;
  for (const ParamEntry& e : llama.layout().entries()) {
    const std::vector<float> dir = random_values(size_t(e.shape.numel()), seed++);
    double analytic = 0;
    for (int64_t i = 0; i < e.shape.numel(); ++i) {
      analytic += double(dir[size_t(i)]) * base.grads[size_t(e.offset_elems + i)];
    }
    const float h = 5e-4f;
    std::vector<float> plus = values, minus = values;
    for (int64_t i = 0; i < e.shape.numel(); ++i) {
      plus[size_t(e.offset_elems + i)] += h * dir[size_t(i)];
      minus[size_t(e.offset_elems + i)] -= h * dir[size_t(i)];
    }
    from_host_f32(*env.device, plus, p);
    const double lp = run(env, llama, flat, {}, DType::kF32).loss;
    from_host_f32(*env.device, minus, p);
    const double lm = run(env, llama, flat, {}, DType::kF32).loss;
    const double fd = (lp - lm) / (2.0 * h);
    EXPECT_NEAR(fd, analytic, 0.02 * std::fabs(analytic) + 2e-4) << e.name;
  }
  from_host_f32(*env.device, values, p);
}

}  // namespace
}  // namespace porter::nn
