// matmul on cpu (oneDNN): transposes, alpha/beta, batches, bf16, odd sizes, the primitive
// cache, determinism across thread counts, the weight layout choice, and shape validation.
#include <algorithm>
#include <cstdlib>
#include <map>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "base/error.h"
#include "kernels/cpu/matmul.h"
#include "kernels/kernel_table.h"
#include "tests/nn/nn_test_util.h"

namespace porter::nn {

using namespace porter::tensor;
using namespace porter::kernels;
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using testing::Env;
using testing::max_rel_error;
using testing::random_values;
using testing::round_bf16;
using testing::round_to;

// Reference: out = alpha * op(a) @ op(b) + beta * out0, in double, batch by batch. op(a) and
// op(b) are copied row-major in double first, so that the inner loop runs along a row of each
// (the layout cases below are GPT-sized: strided reads of B made the reference most of this
// binary's time); each element still sums its k products in order from zero.
std::vector<double> reference(const std::vector<float>& a, const std::vector<float>& b,
                              const std::vector<float>& out0, int64_t batch, int64_t m,
                              int64_t n, int64_t k, const kernels::MatmulSpec& spec) {
  const auto um = static_cast<size_t>(m), un = static_cast<size_t>(n), uk = static_cast<size_t>(k);
  std::vector<double> out(static_cast<size_t>(batch) * um * un);
  std::vector<double> op_a(um * uk), op_b(uk * un), row(un);
  for (int64_t q = 0; q < batch; ++q) {
    const float* aq = a.data() + q * m * k;
    const float* bq = b.data() + q * k * n;
    for (size_t i = 0; i < um; ++i) {
      for (size_t l = 0; l < uk; ++l) {
        op_a[i * uk + l] = spec.trans_a ? aq[l * um + i] : aq[i * uk + l];
      }
    }
    for (size_t l = 0; l < uk; ++l) {
      for (size_t j = 0; j < un; ++j) {
        op_b[l * un + j] = spec.trans_b ? bq[j * uk + l] : bq[l * un + j];
      }
    }
    for (size_t i = 0; i < um; ++i) {
      std::fill(row.begin(), row.end(), 0.0);
      for (size_t l = 0; l < uk; ++l) {
        const double av = op_a[i * uk + l];
        const double* bl = op_b.data() + l * un;
        for (size_t j = 0; j < un; ++j) row[j] += av * bl[j];
      }
      for (size_t j = 0; j < un; ++j) {
        const size_t o = static_cast<size_t>(q) * um * un + i * un + j;
        out[o] = spec.alpha * row[j] + (spec.beta != 0.0f ? spec.beta * double{out0[o]} : 0.0);
      }
    }
  }
  return out;
}

struct Case {
  int64_t batch, m, n, k;
  bool trans_a, trans_b;
  float alpha, beta;
};

// Runs one case in the given dtypes and returns the error relative to the max magnitude.
double run_case(Env& env, const Case& c, DType in_dtype, DType out_dtype) {
  const bool batched = c.batch > 0;
  const int64_t batch = batched ? c.batch : 1;
  auto shape = [&](int64_t r, int64_t cols) {
    return batched ? tensor::Shape{batch, r, cols} : tensor::Shape{r, cols};
  };
  std::vector<float> a = random_values(static_cast<size_t>(batch * c.m * c.k), 1);
  std::vector<float> b = random_values(static_cast<size_t>(batch * c.k * c.n), 2);
  std::vector<float> out0 = random_values(static_cast<size_t>(batch * c.m * c.n), 3);
  a = round_to(in_dtype, a);
  b = round_to(in_dtype, b);
  out0 = round_to(out_dtype, out0);
  tensor::Tensor ta = env.from(a, c.trans_a ? shape(c.k, c.m) : shape(c.m, c.k), in_dtype);
  tensor::Tensor tb = env.from(b, c.trans_b ? shape(c.n, c.k) : shape(c.k, c.n), in_dtype);
  tensor::Tensor tout = env.from(out0, shape(c.m, c.n), out_dtype);
  kernels::MatmulSpec spec{c.trans_a, c.trans_b, c.alpha, c.beta};
  env.kernels->matmul(ta, tb, tout, spec);
  return max_rel_error(env.host(tout), reference(a, b, out0, batch, c.m, c.n, c.k, spec));
}

const Case kCases[] = {
    {0, 1, 1, 1, false, false, 1.0f, 0.0f},     {0, 3, 17, 5, false, false, 1.0f, 0.0f},
    {0, 17, 33, 65, true, false, 1.0f, 0.0f},   {0, 17, 33, 65, false, true, 1.0f, 0.0f},
    {0, 31, 15, 47, true, true, 1.0f, 0.0f},    {0, 64, 48, 80, false, false, 0.5f, 1.0f},
    {0, 19, 23, 29, true, false, -2.0f, 0.25f}, {3, 17, 9, 33, false, false, 1.0f, 0.0f},
    {2, 17, 9, 33, true, true, 1.5f, 1.0f},     {1, 1, 200, 3, false, true, 1.0f, 0.0f},
    // Transposed operands of backward-pass size (K in the hundreds, >= 2^16 elements), where
    // oneDNN picks its blocked brgemm kernels rather than the small-matrix path.
    {0, 300, 70, 260, true, true, 1.0f, 0.0f},  {0, 40, 300, 260, false, true, 1.0f, 0.5f},
    {2, 260, 30, 256, true, false, 1.0f, 0.0f},
};

// f32: K <= 80 terms, each rounding at 2^-24; 1e-5 of the max magnitude is loose enough
// for oneDNN's blocked summation order and tight enough to catch any indexing error.
TEST(MatmulTest, F32MatchesReference) {
  Env env;
  for (const Case& c : kCases) {
    EXPECT_LT(run_case(env, c, DType::kF32, DType::kF32), 1e-5)
        << "batch " << c.batch << " m " << c.m << " n " << c.n << " k " << c.k << " ta "
        << c.trans_a << " tb " << c.trans_b << " alpha " << c.alpha << " beta " << c.beta;
  }
}

// bf16 inputs (exactly representable in the reference) with an f32 output: products are
// exact in f32, so only summation rounding remains.
TEST(MatmulTest, Bf16InputsF32OutputMatchReference) {
  Env env;
  for (const Case& c : kCases) {
    EXPECT_LT(run_case(env, c, DType::kBF16, DType::kF32), 1e-5) << "m " << c.m << " k " << c.k;
  }
}

// A bf16 output rounds each element to 8 bits of mantissa: 2^-8 relative, so 8e-3 of the
// max magnitude covers it (plus beta * out0 rounding).
TEST(MatmulTest, Bf16OutputWithinBf16Rounding) {
  Env env;
  for (const Case& c : kCases) {
    EXPECT_LT(run_case(env, c, DType::kBF16, DType::kBF16), 8e-3) << "m " << c.m << " k " << c.k;
  }
}

// f16 inputs go through f32 copies (Note [Cpu f16 matmul]): products exact in f32, so an
// f32 output differs from the reference by summation rounding only, as with bf16.
TEST(MatmulTest, F16InputsF32OutputMatchReference) {
  Env env;
  for (const Case& c : kCases) {
    EXPECT_LT(run_case(env, c, DType::kF16, DType::kF32), 1e-5) << "m " << c.m << " k " << c.k;
  }
}

// An f16 output rounds each element to 11 bits of mantissa: 2^-11 relative, so 1e-3 of the
// max magnitude covers it (plus beta * out0 rounding), 8x tighter than bf16's bound.
TEST(MatmulTest, F16OutputWithinF16Rounding) {
  Env env;
  for (const Case& c : kCases) {
    EXPECT_LT(run_case(env, c, DType::kF16, DType::kF16), 1e-3) << "m " << c.m << " k " << c.k;
  }
}

// The f16 path is the f32 matmul of the widened operands, rounded once: bit for bit.
TEST(MatmulTest, F16IsTheF32ProductOfTheWidenedOperandsRoundedOnce) {
  Env env;
  const int64_t m = 37, n = 29, k = 70;
  auto a = testing::round_f16(random_values(static_cast<size_t>(m * k), 7, -3.0f, 3.0f));
  auto b = testing::round_f16(random_values(static_cast<size_t>(k * n), 8, -3.0f, 3.0f));
  auto out0 = testing::round_f16(random_values(static_cast<size_t>(m * n), 9));
  for (float beta : {0.0f, 0.5f}) {
    tensor::Tensor a32 = env.from(a, {m, k}), b32 = env.from(b, {k, n}), out32 = env.from(out0, {m, n});
    tensor::Tensor a16 = env.from(a, {m, k}, DType::kF16), b16 = env.from(b, {k, n}, DType::kF16);
    tensor::Tensor out16 = env.from(out0, {m, n}, DType::kF16);
    env.kernels->matmul(a32, b32, out32, {false, false, 1.0f, beta});
    env.kernels->matmul(a16, b16, out16, {false, false, 1.0f, beta});
    EXPECT_EQ(env.host(out16), round_to(DType::kF16, env.host(out32))) << "beta " << beta;
  }
}

// Past 65504 an f16 output is inf (the overflow the fp16 loss scaler looks for).
TEST(MatmulTest, F16OutputOverflowsToInf) {
  Env env;
  tensor::Tensor a = env.from({300.0f, 300.0f}, {1, 2}, DType::kF16);
  tensor::Tensor b = env.from({100.0f, 120.0f}, {2, 1}, DType::kF16);
  tensor::Tensor out = env.empty({1, 1}, DType::kF16), out32 = env.empty({1, 1});
  env.kernels->matmul(a, b, out32);
  EXPECT_EQ(env.host(out32)[0], 66000.0f);
  env.kernels->matmul(a, b, out);
  EXPECT_EQ(env.host(out)[0], INFINITY);
  env.kernels->matmul(a, b, out, {false, false, -1.0f, 0.0f});
  EXPECT_EQ(env.host(out)[0], -INFINITY);
  env.kernels->matmul(a, b, out, {false, false, 0.5f, 0.0f});
  EXPECT_EQ(env.host(out)[0], 32992.0f);  // 33000 to the f16 grid (spacing 32 there)
}

TEST(MatmulTest, ZeroInnerDimensionScalesOutputByBeta) {
  Env env;
  tensor::Tensor a = env.empty({3, 0});
  tensor::Tensor b = env.empty({0, 2});
  tensor::Tensor out = env.from({1, 2, 3, 4, 5, 6}, {3, 2});
  env.kernels->matmul(a, b, out, {false, false, 1.0f, 0.5f});
  EXPECT_EQ(env.host(out), (std::vector<float>{0.5f, 1, 1.5f, 2, 2.5f, 3}));
  env.kernels->matmul(a, b, out);
  EXPECT_EQ(env.host(out), std::vector<float>(6, 0.0f));
}

// Note [Matmul determinism]: the GPT's shapes give the same bits with 1 and 2 threads.
// Of the primitive itself: measured choices (Note [Matmul weight layout]) are per thread count
// and can differ between the two, so both Envs run it plain.
TEST(MatmulTest, GptShapesBitIdenticalAcrossThreadCounts) {
  ::setenv("PORTER_MATMUL_LAYOUT", "plain", 1);
  Env one(1), two(2);
  ::unsetenv("PORTER_MATMUL_LAYOUT");
  const int64_t tokens = 128, c = 768;
  struct Shape3 {
    int64_t m, n, k;
    bool ta, tb;
  };
  const Shape3 shapes[] = {{tokens, 3 * c, c, false, false},
                           {tokens, c, 4 * c, false, false},
                           {tokens, c, 3 * c, false, true},   // dx = dy W^T
                           {c, 3 * c, tokens, true, false}};  // dW = x^T dy
  for (const Shape3& s : shapes) {
    std::vector<float> a = random_values(static_cast<size_t>(s.m * s.k), 4);
    std::vector<float> b = random_values(static_cast<size_t>(s.k * s.n), 5);
    std::vector<float> results[2];
    Env* envs[2] = {&one, &two};
    for (int e = 0; e < 2; ++e) {
      Env& env = *envs[e];
      tensor::Tensor ta = env.from(a, s.ta ? tensor::Shape{s.k, s.m} : tensor::Shape{s.m, s.k});
      tensor::Tensor tb = env.from(b, s.tb ? tensor::Shape{s.n, s.k} : tensor::Shape{s.k, s.n});
      tensor::Tensor out = env.empty({s.m, s.n});
      env.kernels->matmul(ta, tb, out, {s.ta, s.tb, 1.0f, 0.0f});
      results[e] = env.host(out);
    }
    EXPECT_EQ(results[0], results[1]) << s.m << "x" << s.n << "x" << s.k;
  }
}

TEST(MatmulTest, PrimitivesAreCachedPerProblem) {
  kernels::DnnlMatmul mm(2);
  std::vector<float> a(12, 1.0f), b(20, 2.0f), out(15, 0.0f);
  kernels::MatmulProblem p;
  p.m = 3;
  p.n = 5;
  p.k = 4;
  p.a_strides[2] = 4;
  p.b_strides[2] = 5;
  p.out_strides[2] = 5;
  for (int i = 0; i < 3; ++i) mm.run(p, a.data(), b.data(), out.data());
  EXPECT_EQ(mm.cached_primitives(), 1u);
  EXPECT_EQ(out, std::vector<float>(15, 8.0f));
  p.alpha = 0.5f;
  mm.run(p, a.data(), b.data(), out.data());
  EXPECT_EQ(mm.cached_primitives(), 2u);
  EXPECT_EQ(out, std::vector<float>(15, 4.0f));
}

// A 2-D problem as CpuKernels::do_matmul builds it: row-major operands, op(a) (m, k),
// op(b) (k, n), out (m, n).
kernels::MatmulProblem problem_2d(int64_t m, int64_t n, int64_t k, bool ta, bool tb, DType ab, float beta) {
  kernels::MatmulProblem p;
  p.m = m;
  p.n = n;
  p.k = k;
  p.a_strides[2] = ta ? 1 : k;
  p.a_strides[3] = ta ? m : 1;
  p.b_strides[2] = tb ? 1 : n;
  p.b_strides[3] = tb ? k : 1;
  p.out_strides[2] = n;
  p.a_dtype = p.b_dtype = ab;
  p.beta = beta;
  return p;
}

struct LayoutCase {
  int64_t m, n, k;
  bool ta, tb;
  float beta;
};

// The GPT's MLP and qkv shapes at 256 token rows, rows of B of 3072 and 768 elements, the
// weight gradient accumulating (beta = 1), and an odd small one.
const LayoutCase kLayoutCases[] = {
    {256, 3072, 768, false, false, 0.0f},  {256, 768, 3072, false, true, 0.0f},
    {768, 3072, 256, true, false, 1.0f},   {256, 2304, 768, false, true, 0.0f},
    {3072, 768, 256, true, false, 1.0f},   {37, 70, 33, false, false, 1.0f},
};

// Runs `p` through `mm` on a, b (f32 values, held as p's dtype) and out0; returns out.
std::vector<float> run_problem(kernels::DnnlMatmul& mm, const kernels::MatmulProblem& p, const std::vector<float>& a,
                               const std::vector<float>& b, const std::vector<float>& out0) {
  std::vector<float> out = out0;
  if (p.a_dtype == DType::kF32) {
    mm.run(p, a.data(), b.data(), out.data());
    return out;
  }
  std::vector<uint16_t> a16(a.size()), b16(b.size());
  for (size_t i = 0; i < a.size(); ++i) a16[i] = tensor::f32_to_bf16(a[i]);
  for (size_t i = 0; i < b.size(); ++i) b16[i] = tensor::f32_to_bf16(b[i]);
  mm.run(p, a16.data(), b16.data(), out.data());
  return out;
}

// Note [Matmul weight layout]: in f32, reading B blocked gives the plain layout's bits.
TEST(MatmulLayoutTest, BlockedWeightsGiveThePlainBitsInF32) {
  kernels::DnnlMatmul plain(2, kernels::MatmulLayout::kPlain), blocked(2, kernels::MatmulLayout::kBlocked);
  int blocked_cases = 0;
  for (const LayoutCase& c : kLayoutCases) {
    const kernels::MatmulProblem p = problem_2d(c.m, c.n, c.k, c.ta, c.tb, DType::kF32, c.beta);
    const std::vector<float> a = random_values(static_cast<size_t>(c.m * c.k), 1);
    const std::vector<float> b = random_values(static_cast<size_t>(c.k * c.n), 2);
    const std::vector<float> out0 = random_values(static_cast<size_t>(c.m * c.n), 3);
    const std::vector<float> want = run_problem(plain, p, a, b, out0);
    const std::vector<float> got = run_problem(blocked, p, a, b, out0);
    EXPECT_EQ(got, want) << c.m << "x" << c.n << "x" << c.k;
    EXPECT_FALSE(plain.blocked_weights(p));
    // oneDNN's brgemm kernels always prefer a blocked B, so the blocked path ran.
    if (plain.implementation(p).rfind("brg", 0) == 0) {
      EXPECT_TRUE(blocked.blocked_weights(p)) << blocked.implementation(p);
      EXPECT_THAT(blocked.implementation(p), HasSubstr("blocked weights"));
      ++blocked_cases;
    }
  }
  if (blocked_cases > 0) {
    EXPECT_GE(blocked.blocked_buffer_bytes(), size_t{3072 * 768 * 4});
  }
  EXPECT_EQ(plain.blocked_buffer_bytes(), 0u);
}

// In bf16 the blocked kernel may sum K in another order; both are bf16 products summed in f32.
TEST(MatmulLayoutTest, BlockedWeightsInBf16MatchTheReference) {
  // Fewer rows than kLayoutCases, for the double reference's sake; K of 2048 and 3072.
  const LayoutCase cases[] = {{64, 3072, 768, false, false, 0.0f},
                              {64, 768, 3072, false, true, 0.0f},
                              {256, 256, 2048, true, false, 1.0f},
                              {37, 70, 33, false, false, 1.0f}};
  kernels::DnnlMatmul plain(2, kernels::MatmulLayout::kPlain), blocked(2, kernels::MatmulLayout::kBlocked);
  for (const LayoutCase& c : cases) {
    const kernels::MatmulProblem p = problem_2d(c.m, c.n, c.k, c.ta, c.tb, DType::kBF16, c.beta);
    const std::vector<float> a = round_bf16(random_values(static_cast<size_t>(c.m * c.k), 4));
    const std::vector<float> b = round_bf16(random_values(static_cast<size_t>(c.k * c.n), 5));
    const std::vector<float> out0 = random_values(static_cast<size_t>(c.m * c.n), 6);
    const std::vector<double> want =
        reference(a, b, out0, 1, c.m, c.n, c.k, kernels::MatmulSpec{c.ta, c.tb, 1.0f, c.beta});
    EXPECT_LT(max_rel_error(run_problem(plain, p, a, b, out0), want), 1e-5);
    EXPECT_LT(max_rel_error(run_problem(blocked, p, a, b, out0), want), 1e-5)
        << c.m << "x" << c.n << "x" << c.k;
  }
}

// Note [Kernel table]: under kernel_choice exact (the default) a measured f32 choice gives
// plain's bits whichever candidate wins, it is recorded once, and a second user of the table
// takes it without measuring; small problems are recorded plain, unmeasured.
TEST(KernelTableTest, ExactChoiceGivesPlainBitsAndIsRecordedOnce) {
  kernels::KernelTable table;
  kernels::DnnlMatmul first(2, kernels::MatmulLayout::kMeasure, &table), second(2, kernels::MatmulLayout::kMeasure, &table);
  const kernels::MatmulProblem big = problem_2d(512, 3072, 768, false, false, DType::kF32, 0.0f);
  const std::vector<float> a = random_values(512 * 768, 7), b = random_values(768 * 3072, 8);
  const std::vector<float> out0(512 * 3072, 0.0f);
  const std::vector<float> got = run_problem(first, big, a, b, out0);
  kernels::DnnlMatmul plain(2, kernels::MatmulLayout::kPlain);
  EXPECT_EQ(got, run_problem(plain, big, a, b, out0));
  EXPECT_THAT(first.implementation(big), Not(HasSubstr("sgemm")));
  EXPECT_EQ(second.implementation(big), first.implementation(big));
  ASSERT_EQ(table.size(), 1u);
  const nlohmann::json entry = table.to_json().at("entries").at(0);
  EXPECT_EQ(entry.at("kind"), "matmul");
  EXPECT_THAT(entry.at("key").get<std::string>(), HasSubstr("m 512 n 3072 k 768"));
  EXPECT_THAT((std::vector<std::string>{"plain", "blocked", "rows"}),
              ::testing::Contains(entry.at("choice").get<std::string>()));
  const kernels::MatmulProblem small = problem_2d(64, 64, 64, false, false, DType::kF32, 0.0f);
  EXPECT_FALSE(first.blocked_weights(small));
  EXPECT_EQ(table.size(), 2u);
  EXPECT_EQ(table.count(kernels::KernelTable::Source::kFixed) + table.count(kernels::KernelTable::Source::kMeasured),
            2u);
}

// Under exact a bf16 problem has one candidate: plain, unmeasured, whatever is faster.
TEST(KernelTableTest, ExactBf16RunsPlain) {
  kernels::KernelTable table;
  kernels::DnnlMatmul mm(2, kernels::MatmulLayout::kMeasure, &table), plain(2, kernels::MatmulLayout::kPlain);
  const kernels::MatmulProblem p = problem_2d(512, 3072, 768, false, true, DType::kBF16, 0.0f);
  const std::vector<float> a = round_bf16(random_values(512 * 768, 12));
  const std::vector<float> b = round_bf16(random_values(768 * 3072, 13));
  const std::vector<float> out0(512 * 3072, 0.0f);
  EXPECT_EQ(run_problem(mm, p, a, b, out0), run_problem(plain, p, a, b, out0));
  EXPECT_FALSE(mm.widened_operands(p));
  EXPECT_FALSE(mm.blocked_weights(p));
  const nlohmann::json entry = table.to_json().at("entries").at(0);
  EXPECT_EQ(entry.at("choice"), "plain");
  EXPECT_EQ(entry.at("source"), "fixed");
}

// Under fastest every candidate is timed, and the result is the bits of the one the table
// names.
TEST(KernelTableTest, FastestGivesTheBitsOfTheRecordedChoice) {
  kernels::KernelTable table(KernelChoice::kFastest);
  kernels::DnnlMatmul mm(2, kernels::MatmulLayout::kMeasure, &table);
  const kernels::MatmulProblem p = problem_2d(512, 3072, 768, false, true, DType::kBF16, 0.0f);
  const std::vector<float> a = round_bf16(random_values(512 * 768, 12));
  const std::vector<float> b = round_bf16(random_values(768 * 3072, 13));
  const std::vector<float> out0(512 * 3072, 0.0f);
  const std::vector<float> got = run_problem(mm, p, a, b, out0);
  // The bf16 problem's entry (a widened candidate records its f32 problem's too).
  nlohmann::json entry;
  const nlohmann::json recorded = table.to_json();
  for (const nlohmann::json& e : recorded.at("entries")) {
    if (e.at("key").get<std::string>().starts_with("bf16xbf16")) entry = e;
  }
  ASSERT_TRUE(entry.is_object()) << recorded.dump(1);
  const std::string choice = entry.at("choice").get<std::string>();
  EXPECT_EQ(entry.at("source"), "measured");
  const std::map<std::string, kernels::MatmulLayout> layouts = {{"plain", kernels::MatmulLayout::kPlain},
                                                       {"blocked", kernels::MatmulLayout::kBlocked},
                                                       {"rows", kernels::MatmulLayout::kRows},
                                                       {"widened", kernels::MatmulLayout::kWidened}};
  ASSERT_TRUE(layouts.contains(choice)) << choice;
  kernels::DnnlMatmul forced(2, layouts.at(choice));
  EXPECT_EQ(got, run_problem(forced, p, a, b, out0)) << choice;
}

// A pinned table decides, even a choice exact would not make (sgemm), and pinning after use
// makes the next call look the problem up again.
TEST(KernelTableTest, PinnedChoiceDecidesAndReplacesAnEarlierOne) {
  kernels::KernelTable table;
  kernels::DnnlMatmul mm(2, kernels::MatmulLayout::kMeasure, &table);
  const kernels::MatmulProblem p = problem_2d(256, 3072, 768, false, false, DType::kF32, 0.0f);
  const std::vector<float> a = random_values(256 * 768, 21), b = random_values(768 * 3072, 22);
  const std::vector<float> out0(256 * 3072, 0.0f);
  (void)run_problem(mm, p, a, b, out0);
  nlohmann::json pinned = table.to_json();
  ASSERT_EQ(pinned.at("entries").size(), 1u);
  pinned["entries"][0]["choice"] = "gemm";
  table.pin(pinned, "pinned from test");
  kernels::DnnlMatmul gemm(2, kernels::MatmulLayout::kGemm);
  EXPECT_EQ(run_problem(mm, p, a, b, out0), run_problem(gemm, p, a, b, out0));
  EXPECT_EQ(mm.implementation(p), "sgemm");
  EXPECT_EQ(table.origin(), "pinned from test");
  EXPECT_EQ(table.to_json().at("entries").at(0).at("source"), "pinned");
  // A choice this problem has no form for (sgemm takes no bf16) runs plain.
  const kernels::MatmulProblem bf = problem_2d(256, 3072, 768, false, false, DType::kBF16, 0.0f);
  kernels::KernelTable other;
  kernels::DnnlMatmul probe(2, kernels::MatmulLayout::kMeasure, &other);
  (void)probe.implementation(bf);
  nlohmann::json odd = other.to_json();
  odd["entries"][0]["choice"] = "gemm";
  other.pin(odd, "pinned from another cpu");
  EXPECT_THAT(probe.implementation(bf), Not(HasSubstr("sgemm")));
}

// Timing oneDNN's attention (under kernel_choice fastest) runs its batched matmuls, whose first
// call above the threshold measures their own candidates, inside the outer measurement.
TEST(KernelTableTest, AMeasurementInsideAMeasurementCompletes) {
  const std::lock_guard outer(kernels::KernelTable::measurement_mutex());
  kernels::KernelTable table(KernelChoice::kFastest);
  kernels::DnnlMatmul mm(2, kernels::MatmulLayout::kMeasure, &table);
  const kernels::MatmulProblem p = problem_2d(256, 3072, 768, false, false, DType::kF32, 0.0f);
  (void)run_problem(mm, p, random_values(256 * 768, 23), random_values(768 * 3072, 24),
                    std::vector<float>(256 * 3072, 0.0f));
  EXPECT_EQ(table.count(kernels::KernelTable::Source::kMeasured), 1u);
}

// A layout forced by PORTER_MATMUL_LAYOUT (here given directly) is recorded with source env.
TEST(KernelTableTest, ForcedLayoutIsRecorded) {
  kernels::KernelTable table;
  kernels::DnnlMatmul mm(2, kernels::MatmulLayout::kBlocked, &table);
  const kernels::MatmulProblem p = problem_2d(256, 3072, 768, false, false, DType::kF32, 0.0f);
  (void)mm.implementation(p);
  const nlohmann::json entry = table.to_json().at("entries").at(0);
  EXPECT_EQ(entry.at("source"), "env");
  EXPECT_EQ(entry.at("detail"), "PORTER_MATMUL_LAYOUT=blocked");
  EXPECT_EQ(entry.at("choice").get<std::string>(), mm.blocked_weights(p) ? "blocked" : "plain");
}

// The table's JSON round-trips through pin(), and a malformed one is refused naming its origin.
TEST(KernelTableTest, JsonRoundTripAndMalformedTables) {
  kernels::KernelTable table(KernelChoice::kFastest);
  table.record("matmul", "k1", {"rows", kernels::KernelTable::Source::kMeasured, "plain 2 ms, rows 1 ms"});
  table.record("attention", "k2", {"tiles", kernels::KernelTable::Source::kFixed, ""});
  EXPECT_EQ(table.record("matmul", "k1", {"plain", kernels::KernelTable::Source::kFixed, ""}).choice, "rows");
  const nlohmann::json j = table.to_json();
  EXPECT_EQ(j.at("kernel_choice"), "fastest");
  EXPECT_EQ(j.at("origin"), "measured in this run");
  kernels::KernelTable copy;
  copy.pin(j, "resumed from ckpt");
  EXPECT_EQ(copy.find("matmul", "k1")->choice, "rows");
  EXPECT_EQ(copy.find("matmul", "k1")->source, kernels::KernelTable::Source::kPinned);
  EXPECT_EQ(copy.find("attention", "k2")->choice, "tiles");
  EXPECT_FALSE(copy.find("matmul", "k2").has_value());
  EXPECT_EQ(copy.generation(), 1u);
  try {
    copy.pin(nlohmann::json::parse(R"({"entries": [{"kind": "matmul", "choice": 3}]})"), "t.json");
    FAIL() << "a malformed table was pinned";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("t.json: kernel table entry"));
  }
  EXPECT_THROW(copy.pin(nlohmann::json::parse("[1, 2]"), "t.json"), InvalidArgument);
  EXPECT_EQ(copy.find("matmul", "k1")->choice, "rows");  // unchanged by a refused pin
  EXPECT_EQ(kernels::kernel_choice_from_name("fastest", "x"), KernelChoice::kFastest);
  EXPECT_THROW(kernels::kernel_choice_from_name("quick", "porter.device.kernel_choice"), InvalidArgument);
}

// kGemm runs 2-D f32 problems through oneDNN's sgemm, in every transpose form, with alpha and
// beta; what sgemm cannot take (batches, bf16) runs as plain.
TEST(MatmulLayoutTest, GemmRunsTwoDimensionalF32ThroughSgemm) {
  kernels::DnnlMatmul gemm(2, kernels::MatmulLayout::kGemm);
  for (const LayoutCase& c : kLayoutCases) {
    kernels::MatmulProblem p = problem_2d(c.m, c.n, c.k, c.ta, c.tb, DType::kF32, c.beta);
    p.alpha = 0.5f;
    const std::vector<float> a = random_values(static_cast<size_t>(c.m * c.k), 14);
    const std::vector<float> b = random_values(static_cast<size_t>(c.k * c.n), 15);
    const std::vector<float> out0 = random_values(static_cast<size_t>(c.m * c.n), 16);
    const std::vector<double> want =
        reference(a, b, out0, 1, c.m, c.n, c.k, kernels::MatmulSpec{c.ta, c.tb, 0.5f, c.beta});
    const std::vector<float> got = run_problem(gemm, p, a, b, out0);
    EXPECT_LT(max_rel_error(got, want), 1e-5) << c.m << "x" << c.n << "x" << c.k;
    EXPECT_EQ(got, run_problem(gemm, p, a, b, out0)) << "run to run";
    EXPECT_EQ(gemm.implementation(p), "sgemm");
  }
  kernels::MatmulProblem batched = problem_2d(8, 8, 8, false, false, DType::kF32, 0.0f);
  batched.batch1 = 2;
  batched.a_strides[1] = batched.b_strides[1] = batched.out_strides[1] = 64;
  EXPECT_NE(gemm.implementation(batched), "sgemm");
  EXPECT_NE(gemm.implementation(problem_2d(8, 8, 8, false, false, DType::kBF16, 0.0f)), "sgemm");
}

// Note [Widened bf16 matmul]: a widened bf16 problem gives the bits of the f32 problem on the
// widened values, its out rounded once to bf16 when out is bf16.
TEST(MatmulLayoutTest, WidenedBf16IsTheF32ProductOfTheBf16Values) {
  struct WidenCase {
    int64_t m, n, k;
    bool ta, tb;
    float beta;
    DType out;
  };
  const WidenCase cases[] = {{256, 3072, 768, false, true, 0.0f, DType::kBF16},
                        {256, 768, 3072, false, false, 0.0f, DType::kBF16},
                        {768, 3072, 256, true, false, 1.0f, DType::kF32},
                        {37, 70, 33, false, false, 1.0f, DType::kBF16}};
  kernels::DnnlMatmul widened(2, kernels::MatmulLayout::kWidened), plain(2, kernels::MatmulLayout::kPlain);
  for (const WidenCase& c : cases) {
    kernels::MatmulProblem p = problem_2d(c.m, c.n, c.k, c.ta, c.tb, DType::kBF16, c.beta);
    p.out_dtype = c.out;
    const std::vector<float> a = round_bf16(random_values(static_cast<size_t>(c.m * c.k), 9));
    const std::vector<float> b = round_bf16(random_values(static_cast<size_t>(c.k * c.n), 10));
    std::vector<float> out0 = random_values(static_cast<size_t>(c.m * c.n), 11);
    if (c.out == DType::kBF16) out0 = round_bf16(out0);
    // Want: the f32 problem on the same values, rounded to out's dtype.
    kernels::MatmulProblem p32 = p;
    p32.a_dtype = p32.b_dtype = p32.out_dtype = DType::kF32;
    std::vector<float> want = run_problem(plain, p32, a, b, out0);
    if (c.out == DType::kBF16) want = round_bf16(want);
    // Got: the bf16 problem on bf16 operands (and a bf16 out, read back as f32).
    std::vector<uint16_t> a16(a.size()), b16(b.size()), out16(out0.size());
    for (size_t i = 0; i < a.size(); ++i) a16[i] = tensor::f32_to_bf16(a[i]);
    for (size_t i = 0; i < b.size(); ++i) b16[i] = tensor::f32_to_bf16(b[i]);
    std::vector<float> got = out0;
    if (c.out == DType::kBF16) {
      for (size_t i = 0; i < out0.size(); ++i) out16[i] = tensor::f32_to_bf16(out0[i]);
      widened.run(p, a16.data(), b16.data(), out16.data());
      for (size_t i = 0; i < got.size(); ++i) got[i] = tensor::bf16_to_f32(out16[i]);
    } else {
      widened.run(p, a16.data(), b16.data(), got.data());
    }
    EXPECT_EQ(got, want) << c.m << "x" << c.n << "x" << c.k;
    EXPECT_TRUE(widened.widened_operands(p));
    EXPECT_THAT(widened.implementation(p), HasSubstr("bf16 widened to f32"));
    EXPECT_FALSE(plain.widened_operands(p));
    EXPECT_FALSE(widened.widened_operands(p32));  // f32 problems run as they are
  }
  EXPECT_GE(widened.widened_buffer_bytes(), size_t{(256 * 768 + 768 * 3072 + 256 * 3072) * 4});
  EXPECT_EQ(plain.widened_buffer_bytes(), 0u);
}

// Note [Matmul weight layout]: a transposed A (the weight gradient's form) copied row-major
// first gives the product within the reference's tolerance, in f32 and bf16, with alpha, beta
// and a batch; an A stored row-major has nothing to copy and runs as plain.
TEST(MatmulLayoutTest, RowMajorCopyOfATransposedAMatchesTheReference) {
  const LayoutCase cases[] = {{768, 3072, 256, true, false, 1.0f},
                              {3072, 768, 256, true, false, 1.0f},
                              {96, 200, 64, true, true, 0.0f},
                              {37, 70, 33, true, false, 1.0f}};
  kernels::DnnlMatmul rows(2, kernels::MatmulLayout::kRows), plain(2, kernels::MatmulLayout::kPlain);
  for (const DType dtype : {DType::kF32, DType::kBF16}) {
    for (const LayoutCase& c : cases) {
      kernels::MatmulProblem p = problem_2d(c.m, c.n, c.k, c.ta, c.tb, dtype, c.beta);
      p.alpha = 0.5f;
      std::vector<float> a = random_values(static_cast<size_t>(c.m * c.k), 17);
      std::vector<float> b = random_values(static_cast<size_t>(c.k * c.n), 18);
      if (dtype == DType::kBF16) {
        a = round_bf16(a);
        b = round_bf16(b);
      }
      const std::vector<float> out0 = random_values(static_cast<size_t>(c.m * c.n), 19);
      const std::vector<double> want =
          reference(a, b, out0, 1, c.m, c.n, c.k, kernels::MatmulSpec{c.ta, c.tb, 0.5f, c.beta});
      const std::vector<float> got = run_problem(rows, p, a, b, out0);
      EXPECT_LT(max_rel_error(got, want), 1e-5) << c.m << "x" << c.n << "x" << c.k;
      EXPECT_EQ(got, run_problem(rows, p, a, b, out0)) << "run to run";
      EXPECT_THAT(rows.implementation(p), HasSubstr("A copied row-major"));
      // In f32, where plain runs oneDNN's brgemm too, the copy gives plain's bits: the same
      // kernel over the same K blocks (that brgemm copies a transposed A into row-major panels
      // itself).
      if (dtype == DType::kF32 && plain.implementation(p).rfind("brg", 0) == 0) {
        EXPECT_EQ(got, run_problem(plain, p, a, b, out0)) << c.m << "x" << c.n << "x" << c.k;
      }
    }
  }
  // The copy sits before any blocked B in the shared buffer: 768 x 256 floats at least.
  EXPECT_GE(rows.blocked_buffer_bytes(), size_t{768 * 256 * 4});
  // A batched transposed A (the attention's form) is copied too.
  kernels::MatmulProblem batched = problem_2d(64, 48, 32, true, false, DType::kF32, 0.0f);
  batched.batch1 = 3;
  batched.a_strides[1] = 64 * 32;
  batched.b_strides[1] = 32 * 48;
  batched.out_strides[1] = 64 * 48;
  const std::vector<float> a = random_values(3 * 64 * 32, 20), b = random_values(3 * 32 * 48, 21);
  const std::vector<float> out0(3 * 64 * 48, 0.0f);
  const std::vector<double> want = reference(a, b, out0, 3, 64, 48, 32, kernels::MatmulSpec{true, false});
  EXPECT_LT(max_rel_error(run_problem(rows, batched, a, b, out0), want), 1e-5);
  EXPECT_THAT(rows.implementation(batched), HasSubstr("A copied row-major"));
  // A row-major A has nothing to copy.
  const kernels::MatmulProblem plain_a = problem_2d(64, 48, 32, false, false, DType::kF32, 0.0f);
  EXPECT_THAT(rows.implementation(plain_a), Not(HasSubstr("A copied")));
}

TEST(MatmulLayoutTest, LayoutComesFromTheEnvironment) {
  ::unsetenv("PORTER_MATMUL_LAYOUT");
  EXPECT_EQ(kernels::matmul_layout_from_env(), kernels::MatmulLayout::kMeasure);
  ::setenv("PORTER_MATMUL_LAYOUT", "plain", 1);
  EXPECT_EQ(kernels::matmul_layout_from_env(), kernels::MatmulLayout::kPlain);
  ::setenv("PORTER_MATMUL_LAYOUT", "blocked", 1);
  EXPECT_EQ(kernels::matmul_layout_from_env(), kernels::MatmulLayout::kBlocked);
  ::setenv("PORTER_MATMUL_LAYOUT", "gemm", 1);
  EXPECT_EQ(kernels::matmul_layout_from_env(), kernels::MatmulLayout::kGemm);
  ::setenv("PORTER_MATMUL_LAYOUT", "widened", 1);
  EXPECT_EQ(kernels::matmul_layout_from_env(), kernels::MatmulLayout::kWidened);
  ::setenv("PORTER_MATMUL_LAYOUT", "rows", 1);
  EXPECT_EQ(kernels::matmul_layout_from_env(), kernels::MatmulLayout::kRows);
  ::setenv("PORTER_MATMUL_LAYOUT", "fastest", 1);
  try {
    kernels::matmul_layout_from_env();
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("PORTER_MATMUL_LAYOUT"));
    EXPECT_THAT(e.what(), HasSubstr("\"fastest\""));
    EXPECT_THAT(e.what(), HasSubstr("plain"));
  }
  ::unsetenv("PORTER_MATMUL_LAYOUT");
}

TEST(MatmulTest, RejectsMismatchedShapesNamingTheOp) {
  Env env;
  tensor::Tensor a = env.empty({3, 4}), b = env.empty({5, 6}), out = env.empty({3, 6});
  try {
    env.kernels->matmul(a, b, out);
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("matmul"));
    EXPECT_THAT(e.what(), HasSubstr("(3, 4)"));
    EXPECT_THAT(e.what(), HasSubstr("(5, 6)"));
  }
  tensor::Tensor b2 = env.empty({4, 6}), bad_out = env.empty({3, 7});
  EXPECT_THROW(env.kernels->matmul(a, b2, bad_out), InvalidArgument);
  tensor::Tensor b_bf16 = env.empty({4, 6}, DType::kBF16);
  EXPECT_THROW(env.kernels->matmul(a, b_bf16, out), InvalidArgument);
  tensor::Tensor a3 = env.empty({2, 3, 4});
  EXPECT_THROW(env.kernels->matmul(a3, b2, out), InvalidArgument);
  tensor::Tensor ids = env.empty({3, 4}, DType::kI32);
  EXPECT_THROW(env.kernels->matmul(ids, b2, out), InvalidArgument);
}

TEST(MatmulTest, RejectsOutputAliasingAnInput) {
  Env env;
  tensor::Tensor a = env.empty({4, 4}), b = env.empty({4, 4});
  try {
    env.kernels->matmul(a, b, a);
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("matmul: output out"));
  }
}

}  // namespace
}  // namespace porter::nn
