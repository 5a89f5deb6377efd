// Causal attention on cpu against a double reference: forward, probabilities (zero above the
// diagonal), backward analytically and through central differences, bf16, thread counts.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <optional>
#include <string>

#include "base/error.h"
#include "kernels/cpu/attention_heads.h"
#include "kernels/kernel_table.h"
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

struct Dims {
  int64_t b, t, c, heads;
  int64_t hd() const { return c / heads; }
};

double at(const std::vector<double>& qkv, const Dims& d, int64_t b, int64_t t, int64_t part,
          int64_t h, int64_t e) {
  return qkv[(b * d.t + t) * 3 * d.c + part * d.c + h * d.hd() + e];
}

// out (B, T, C) and probs (B, H, T, T) in double.
void attention_ref(const std::vector<double>& qkv, const Dims& d, std::vector<double>* out,
                   std::vector<double>* probs) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(d.hd()));
  out->assign(d.b * d.t * d.c, 0.0);
  probs->assign(d.b * d.heads * d.t * d.t, 0.0);
  for (int64_t b = 0; b < d.b; ++b) {
    for (int64_t h = 0; h < d.heads; ++h) {
      for (int64_t i = 0; i < d.t; ++i) {
        std::vector<double> s(i + 1);
        double mx = -INFINITY, sum = 0;
        for (int64_t j = 0; j <= i; ++j) {
          double dot = 0;
          for (int64_t e = 0; e < d.hd(); ++e) dot += at(qkv, d, b, i, 0, h, e) * at(qkv, d, b, j, 1, h, e);
          s[j] = dot * scale;
          mx = std::max(mx, s[j]);
        }
        for (int64_t j = 0; j <= i; ++j) sum += std::exp(s[j] - mx);
        double* prow = probs->data() + ((b * d.heads + h) * d.t + i) * d.t;
        for (int64_t j = 0; j <= i; ++j) prow[j] = std::exp(s[j] - mx) / sum;
        for (int64_t e = 0; e < d.hd(); ++e) {
          double acc = 0;
          for (int64_t j = 0; j <= i; ++j) acc += prow[j] * at(qkv, d, b, j, 2, h, e);
          (*out)[(b * d.t + i) * d.c + h * d.hd() + e] = acc;
        }
      }
    }
  }
}

// dqkv in double from the analytic softmax-attention gradient.
std::vector<double> attention_backward_ref(const std::vector<double>& qkv,
                                           const std::vector<double>& dout, const Dims& d) {
  std::vector<double> out, probs;
  attention_ref(qkv, d, &out, &probs);
  const double scale = 1.0 / std::sqrt(static_cast<double>(d.hd()));
  std::vector<double> dqkv(qkv.size(), 0.0);
  auto idx = [&](int64_t b, int64_t t, int64_t part, int64_t h, int64_t e) {
    return (b * d.t + t) * 3 * d.c + part * d.c + h * d.hd() + e;
  };
  for (int64_t b = 0; b < d.b; ++b) {
    for (int64_t h = 0; h < d.heads; ++h) {
      for (int64_t i = 0; i < d.t; ++i) {
        const double* p = probs.data() + ((b * d.heads + h) * d.t + i) * d.t;
        std::vector<double> dp(i + 1);
        double rowdot = 0;
        for (int64_t j = 0; j <= i; ++j) {
          double v = 0;
          for (int64_t e = 0; e < d.hd(); ++e) v += dout[(b * d.t + i) * d.c + h * d.hd() + e] * at(qkv, d, b, j, 2, h, e);
          dp[j] = v;
          rowdot += p[j] * v;
        }
        for (int64_t j = 0; j <= i; ++j) {
          const double ds = p[j] * (dp[j] - rowdot) * scale;
          for (int64_t e = 0; e < d.hd(); ++e) {
            dqkv[idx(b, i, 0, h, e)] += ds * at(qkv, d, b, j, 1, h, e);
            dqkv[idx(b, j, 1, h, e)] += ds * at(qkv, d, b, i, 0, h, e);
            dqkv[idx(b, j, 2, h, e)] += p[j] * dout[(b * d.t + i) * d.c + h * d.hd() + e];
          }
        }
      }
    }
  }
  return dqkv;
}

struct Result {
  std::vector<float> out, probs, dqkv;
};

// qkv and dout in `dtype`; out and dqkv in `result` (`dtype` when not given).
Result run(Env& env, const Dims& d, const std::vector<float>& qkv, const std::vector<float>& dout,
           tensor::DType dtype, std::optional<tensor::DType> result = std::nullopt) {
  const tensor::DType rt = result.value_or(dtype);
  tensor::Tensor tq = env.from(qkv, {d.b, d.t, 3 * d.c}, dtype);
  tensor::Tensor out = env.empty({d.b, d.t, d.c}, rt), probs = env.empty({d.b, d.heads, d.t, d.t});
  tensor::Tensor tdo = env.from(dout, {d.b, d.t, d.c}, dtype), dq = env.empty({d.b, d.t, 3 * d.c}, rt);
  env.kernels->attention_forward(tq, out, probs, static_cast<int>(d.heads));
  env.kernels->attention_backward(tdo, tq, probs, dq, static_cast<int>(d.heads));
  return {env.host(out), env.host(probs), env.host(dq)};
}

// Part `part` (0 = dQ, 1 = dK, 2 = dV) of a (B, T, 3C) gradient.
template <typename T>
std::vector<T> part_of(const std::vector<T>& dqkv, const Dims& d, int64_t part) {
  std::vector<T> v;
  v.reserve(dqkv.size() / 3);
  for (int64_t row = 0; row < d.b * d.t; ++row) {
    const auto* p = dqkv.data() + row * 3 * d.c + part * d.c;
    v.insert(v.end(), p, p + d.c);
  }
  return v;
}

const Dims kDims[] = {{1, 1, 4, 1}, {2, 17, 12, 3}, {1, 64, 32, 4}, {2, 130, 64, 2}, {1, 129, 16, 1}};

TEST(AttentionTest, F32MatchesReference) {
  Env env;
  for (const Dims& d : kDims) {
    auto qkv = random_values(d.b * d.t * 3 * d.c, 1, -2.0f, 2.0f);
    auto dout = random_values(d.b * d.t * d.c, 2);
    Result r = run(env, d, qkv, dout, tensor::DType::kF32);
    std::vector<double> want_out, want_probs;
    std::vector<double> qd(qkv.begin(), qkv.end()), dd(dout.begin(), dout.end());
    attention_ref(qd, d, &want_out, &want_probs);
    // f32 dot products of <= 32 terms and softmax over <= 130: 1e-5 of the max magnitude.
    EXPECT_LT(max_rel_error(r.out, want_out), 1e-5) << "T " << d.t << " C " << d.c;
    EXPECT_LT(max_rel_error(r.probs, want_probs), 1e-5) << "T " << d.t << " C " << d.c;
    for (int64_t bh = 0; bh < d.b * d.heads; ++bh) {
      for (int64_t i = 0; i < d.t; ++i) {
        for (int64_t j = i + 1; j < d.t; ++j) {
          ASSERT_EQ(r.probs[(bh * d.t + i) * d.t + j], 0.0f) << "above the diagonal";
        }
      }
    }
    // Backward chains three f32 matmuls and the softmax gradient: 1e-5 of the max.
    EXPECT_LT(max_rel_error(r.dqkv, attention_backward_ref(qd, dd, d)), 1e-5)
        << "T " << d.t << " C " << d.c;
  }
}

// Checks the analytic reference (and so the kernel) against central differences.
TEST(AttentionTest, BackwardMatchesFiniteDifferences) {
  Env env;
  const Dims d{2, 5, 6, 2};
  auto qkv = random_values(d.b * d.t * 3 * d.c, 3, -1.0f, 1.0f);
  auto dout = random_values(d.b * d.t * d.c, 4);
  Result r = run(env, d, qkv, dout, tensor::DType::kF32);
  std::vector<double> qd(qkv.begin(), qkv.end()), fd(qkv.size());
  for (size_t i = 0; i < qd.size(); ++i) {
    auto loss = [&](double v) {
      std::vector<double> x = qd, out, probs;
      x[i] = v;
      attention_ref(x, d, &out, &probs);
      double l = 0;
      for (size_t k = 0; k < out.size(); ++k) l += out[k] * dout[k];
      return l;
    };
    const double h = 1e-5;
    fd[i] = (loss(qd[i] + h) - loss(qd[i] - h)) / (2 * h);
  }
  EXPECT_LT(max_rel_error(r.dqkv, fd), 1e-5);
}

// Sequence lengths around the 64-row block (1, 63, 65, 70, 130, 200), several batches and
// heads, head sizes 8 to 64.
const Dims kBf16Dims[] = {{2, 1, 16, 2},  {2, 63, 32, 2},   {1, 65, 64, 4},
                          {2, 70, 32, 2}, {2, 130, 48, 3}, {1, 130, 128, 2}, {2, 200, 96, 3}};

// bf16 qkv/out/dout/dqkv (f32 probabilities), multiplied in bf16 (Note [Bf16 attention]):
// the scores are products of bf16 values, exact in f32, so the probabilities are as close as
// in f32 (measured below 2e-7 here). out and dQ, dK, dV carry two bf16 roundings of 2^-9
// each: of P or dS before their matmul, and of the result; measured up to 3.6e-3 (out) and
// 5.8e-3 (dQ) of their largest magnitude on these shapes. Each gradient is held to its own
// magnitude, so a wrong dQ cannot hide under a larger dV.
TEST(AttentionTest, Bf16MatchesReference) {
  Env env;
  for (const Dims& d : kBf16Dims) {
    for (uint32_t seed : {5u, 9u}) {
      SCOPED_TRACE("B " + std::to_string(d.b) + " T " + std::to_string(d.t) + " C " +
                   std::to_string(d.c) + " heads " + std::to_string(d.heads) + " seed " +
                   std::to_string(seed));
      auto qkv = round_bf16(random_values(d.b * d.t * 3 * d.c, seed, -2.0f, 2.0f));
      auto dout = round_bf16(random_values(d.b * d.t * d.c, seed + 1));
      Result r = run(env, d, qkv, dout, tensor::DType::kBF16);
      std::vector<double> qd(qkv.begin(), qkv.end()), dd(dout.begin(), dout.end());
      std::vector<double> want_out, want_probs;
      attention_ref(qd, d, &want_out, &want_probs);
      EXPECT_LT(max_rel_error(r.out, want_out), 8e-3);
      EXPECT_LT(max_rel_error(r.probs, want_probs), 1e-6);
      for (int64_t bh = 0; bh < d.b * d.heads; ++bh) {
        for (int64_t i = 0; i < d.t; ++i) {
          for (int64_t j = i + 1; j < d.t; ++j) {
            ASSERT_EQ(r.probs[(bh * d.t + i) * d.t + j], 0.0f) << "above the diagonal";
          }
        }
      }
      const std::vector<double> want_dqkv = attention_backward_ref(qd, dd, d);
      for (int64_t part = 0; part < 3; ++part) {
        EXPECT_LT(max_rel_error(part_of(r.dqkv, d, part), part_of(want_dqkv, d, part)), 8e-3)
            << "d" << "QKV"[part];
      }
    }
  }
}

// The bf16 path accumulates in f32 and rounds once at the end: with f32 out and dqkv the
// same call gives the unrounded values, and the probabilities are the same bits.
TEST(AttentionTest, Bf16RoundsItsF32AccumulatorOnce) {
  Env env;
  for (const Dims& d : kBf16Dims) {
    SCOPED_TRACE("T " + std::to_string(d.t));
    auto qkv = round_bf16(random_values(d.b * d.t * 3 * d.c, 11, -2.0f, 2.0f));
    auto dout = round_bf16(random_values(d.b * d.t * d.c, 12));
    Result r = run(env, d, qkv, dout, tensor::DType::kBF16);
    Result r32 = run(env, d, qkv, dout, tensor::DType::kBF16, tensor::DType::kF32);
    EXPECT_EQ(r.probs, r32.probs);
    EXPECT_EQ(r.out, round_bf16(r32.out));
    EXPECT_EQ(r.dqkv, round_bf16(r32.dqkv));
  }
}

// Same inputs, same bits: twice on one Kernels (cached primitives) and on a fresh one.
TEST(AttentionTest, Bf16IsDeterministic) {
  Env env, fresh;
  const Dims d{2, 130, 48, 3};
  auto qkv = random_values(d.b * d.t * 3 * d.c, 13, -2.0f, 2.0f);
  auto dout = random_values(d.b * d.t * d.c, 14);
  Result a = run(env, d, qkv, dout, tensor::DType::kBF16), b = run(env, d, qkv, dout, tensor::DType::kBF16);
  Result c = run(fresh, d, qkv, dout, tensor::DType::kBF16);
  EXPECT_EQ(a.out, b.out);
  EXPECT_EQ(a.probs, b.probs);
  EXPECT_EQ(a.dqkv, b.dqkv);
  EXPECT_EQ(a.out, c.out);
  EXPECT_EQ(a.probs, c.probs);
  EXPECT_EQ(a.dqkv, c.dqkv);
}

// f16 qkv/out/dout/dqkv: each output rounds once to f16 (2^-11), 8x tighter than bf16.
TEST(AttentionTest, F16WithinF16Rounding) {
  Env env;
  const Dims d{2, 70, 32, 2};
  auto qkv = testing::round_f16(random_values(d.b * d.t * 3 * d.c, 5, -2.0f, 2.0f));
  auto dout = testing::round_f16(random_values(d.b * d.t * d.c, 6));
  Result r = run(env, d, qkv, dout, tensor::DType::kF16);
  std::vector<double> qd(qkv.begin(), qkv.end()), dd(dout.begin(), dout.end());
  std::vector<double> want_out, want_probs;
  attention_ref(qd, d, &want_out, &want_probs);
  EXPECT_LT(max_rel_error(r.out, want_out), 1e-3);
  EXPECT_LT(max_rel_error(r.probs, want_probs), 1e-5);
  EXPECT_LT(max_rel_error(r.dqkv, attention_backward_ref(qd, dd, d)), 1e-3);
  // f16 is the f32 computation on the same values, rounded once at the end.
  Result r32 = run(env, d, qkv, dout, tensor::DType::kF32);
  EXPECT_EQ(r.out, testing::round_f16(r32.out));
  EXPECT_EQ(r.dqkv, testing::round_f16(r32.dqkv));
}

// Note [Cpu determinism] for attention, including oneDNN's batched calls, f32 and bf16.
TEST(AttentionTest, BitIdenticalAcrossThreadCounts) {
  Env one(1), two(2);
  const Dims d{2, 200, 96, 3};
  auto qkv = random_values(d.b * d.t * 3 * d.c, 7);
  auto dout = random_values(d.b * d.t * d.c, 8);
  for (tensor::DType dtype : {tensor::DType::kF32, tensor::DType::kBF16}) {
    SCOPED_TRACE(std::string(tensor::dtype_name(dtype)));
    Result a = run(one, d, qkv, dout, dtype), b = run(two, d, qkv, dout, dtype);
    EXPECT_EQ(a.out, b.out);
    EXPECT_EQ(a.probs, b.probs);
    EXPECT_EQ(a.dqkv, b.dqkv);
  }
}

// Sets an environment variable for one scope (the kernels read PORTER_CPU_ATTENTION when they
// are made).
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) { setenv(name, value, 1); }
  ~ScopedEnv() { unsetenv(name_); }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
};

// porter's head tiles (Note [Attention head tiles]) and oneDNN's batched calls both meet the
// reference, and agree with each other: f32 within 1e-5, bf16 within its two roundings. On a
// cpu without AVX-512F (f32) or AVX512-BF16 (bf16) both runs take the oneDNN path. An odd head
// size (3) takes it in bf16 on every cpu.
TEST(AttentionTest, HeadTilesAndOneDnnAgree) {
  std::optional<Env> tiles, onednn;
  {
    ScopedEnv force("PORTER_CPU_ATTENTION", "tiles");
    tiles.emplace();
  }
  {
    ScopedEnv force("PORTER_CPU_ATTENTION", "onednn");
    onednn.emplace();
  }
  const Dims dims[] = {{2, 17, 12, 3}, {2, 63, 32, 2}, {1, 65, 64, 4}, {2, 70, 32, 2},
                       {1, 129, 16, 1}, {2, 130, 48, 3}, {1, 33, 6, 2}};
  for (tensor::DType dtype : {tensor::DType::kF32, tensor::DType::kBF16}) {
    const double bound = dtype == tensor::DType::kF32 ? 2e-5 : 8e-3;
    for (const Dims& d : dims) {
      SCOPED_TRACE(std::string(tensor::dtype_name(dtype)) + " B " + std::to_string(d.b) + " T " +
                   std::to_string(d.t) + " C " + std::to_string(d.c) + " heads " +
                   std::to_string(d.heads));
      auto qkv = round_bf16(random_values(d.b * d.t * 3 * d.c, 21, -2.0f, 2.0f));
      auto dout = round_bf16(random_values(d.b * d.t * d.c, 22));
      Result a = run(*tiles, d, qkv, dout, dtype), b = run(*onednn, d, qkv, dout, dtype);
      std::vector<double> qd(qkv.begin(), qkv.end()), dd(dout.begin(), dout.end());
      std::vector<double> want_out, want_probs;
      attention_ref(qd, d, &want_out, &want_probs);
      const std::vector<double> want_dqkv = attention_backward_ref(qd, dd, d);
      for (const Result* r : {&a, &b}) {
        EXPECT_LT(max_rel_error(r->out, want_out), bound);
        EXPECT_LT(max_rel_error(r->probs, want_probs), 1e-6);
        for (int64_t part = 0; part < 3; ++part) {
          EXPECT_LT(max_rel_error(part_of(r->dqkv, d, part), part_of(want_dqkv, d, part)), bound)
              << "d" << "QKV"[part] << (r == &a ? " (auto)" : " (onednn)");
        }
      }
      std::vector<double> b_out(b.out.begin(), b.out.end());
      EXPECT_LT(max_rel_error(a.out, b_out), bound);
    }
  }
}

TEST(AttentionTest, UnknownImplementationIsRefusedNamingTheVariable) {
  ScopedEnv bad("PORTER_CPU_ATTENTION", "flash");
  try {
    Env env;
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("PORTER_CPU_ATTENTION"));
    EXPECT_THAT(e.what(), HasSubstr("\"flash\""));
    EXPECT_THAT(e.what(), HasSubstr("onednn"));
  }
}

// Under kernel_choice fastest, a call above the measuring threshold (2^28 FLOPs forward) runs
// whichever implementation measured faster, and its results are that implementation's bits:
// not a mix of the runs the measurement made on the same tensors. A second call reuses the
// choice. Under exact (the default) the same call runs the tiles, unmeasured.
TEST(AttentionTest, MeasuredChoiceGivesOneImplementationsBits) {
  std::optional<Env> tiles, onednn, measured;
  {
    ScopedEnv force("PORTER_CPU_ATTENTION", "tiles");
    tiles.emplace();
  }
  {
    ScopedEnv force("PORTER_CPU_ATTENTION", "onednn");
    onednn.emplace();
  }
  measured.emplace();
  measured->kernels->kernel_table().set_mode(KernelChoice::kFastest);
  Env exact;
  const Dims d{4, 512, 128, 2};
  for (tensor::DType dtype : {tensor::DType::kF32, tensor::DType::kBF16}) {
    SCOPED_TRACE(std::string(tensor::dtype_name(dtype)));
    auto qkv = round_bf16(random_values(d.b * d.t * 3 * d.c, 31, -2.0f, 2.0f));
    auto dout = round_bf16(random_values(d.b * d.t * d.c, 32));
    Result a = run(*tiles, d, qkv, dout, dtype), b = run(*onednn, d, qkv, dout, dtype);
    // Backward of each implementation on given probabilities (forward and backward are chosen
    // apart, so the measured backward may run on the other implementation's probabilities).
    const auto backward = [&](Env& env, const std::vector<float>& probs) {
      tensor::Tensor tq = env.from(qkv, {d.b, d.t, 3 * d.c}, dtype);
      tensor::Tensor tp = env.from(probs, {d.b, d.heads, d.t, d.t});
      tensor::Tensor tdo = env.from(dout, {d.b, d.t, d.c}, dtype), dq = env.empty({d.b, d.t, 3 * d.c}, dtype);
      env.kernels->attention_backward(tdo, tq, tp, dq, static_cast<int>(d.heads));
      return env.host(dq);
    };
    for (int call = 0; call < 2; ++call) {
      SCOPED_TRACE("call " + std::to_string(call));
      Result m = run(*measured, d, qkv, dout, dtype);
      EXPECT_TRUE((m.probs == a.probs && m.out == a.out) || (m.probs == b.probs && m.out == b.out));
      EXPECT_TRUE(m.dqkv == backward(*tiles, m.probs) || m.dqkv == backward(*onednn, m.probs));
    }
    const Result e = run(exact, d, qkv, dout, dtype);
    if (dtype == tensor::DType::kF32 ? cpu::attention_tiles_f32_supported()
                             : cpu::attention_tiles_bf16_supported(d.c / d.heads)) {
      EXPECT_EQ(e.probs, a.probs);
      EXPECT_EQ(e.out, a.out);
      EXPECT_EQ(e.dqkv, a.dqkv);
    }
  }
  const nlohmann::json exact_table = exact.kernels->kernel_table().to_json();
  EXPECT_FALSE(exact_table.at("entries").empty());
  for (const nlohmann::json& entry : exact_table.at("entries")) {
    EXPECT_EQ(entry.at("kind"), "attention");
    EXPECT_EQ(entry.at("choice"), "tiles");
    EXPECT_EQ(entry.at("source"), "fixed");
  }
  const nlohmann::json measured_table = measured->kernels->kernel_table().to_json();
  for (const nlohmann::json& entry : measured_table.at("entries")) {
    if (entry.at("kind") == "attention") {
      EXPECT_EQ(entry.at("source"), "measured");
    }
  }
}

TEST(AttentionTest, RejectsBadShapesNamingTheOp) {
  Env env;
  tensor::Tensor qkv = env.empty({2, 4, 12}), out = env.empty({2, 4, 4}), probs = env.empty({2, 2, 4, 4});
  try {
    env.kernels->attention_forward(qkv, out, probs, 5);
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("attention_forward"));
    EXPECT_THAT(e.what(), HasSubstr("(2, 4, 12)"));
  }
  tensor::Tensor bad_probs = env.empty({2, 2, 4, 3});
  EXPECT_THROW(env.kernels->attention_forward(qkv, out, bad_probs, 2), InvalidArgument);
  tensor::Tensor dq = env.empty({2, 4, 12}), dout_bad = env.empty({2, 4, 5});
  EXPECT_THROW(env.kernels->attention_backward(dout_bad, qkv, probs, dq, 2), InvalidArgument);
}

}  // namespace
}  // namespace porter::nn
