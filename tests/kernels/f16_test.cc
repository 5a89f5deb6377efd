// f16 on the cpu kernels: the f16 <-> f32 conversions (Note [f16 conversion] in tensor/dtype.h)
// over every bit pattern, round-to-nearest-even and overflow; the elementwise kernels, the
// reductions and AdamW in f16; nonfinite_count on every float dtype; the dtype-mix rule
// (Note [Cpu dtype combinations]).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "base/error.h"
#include "tensor/philox.h"
#include "tests/nn/nn_test_util.h"

namespace porter::nn {

using namespace porter::tensor;
using namespace porter::kernels;
namespace {

using ::testing::HasSubstr;
using testing::Env;
using testing::max_rel_error;
using testing::random_values;
using testing::round_f16;

float f16_round(float x) { return tensor::f16_to_f32(tensor::f32_to_f16(x)); }

uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// The value of an f16 bit pattern, decoded from its fields in double (independent of
// tensor::f16_to_f32's bit tricks).
double f16_value(uint16_t h) {
  const int sign = h >> 15, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  double v;
  if (exp == 0x1f) {
    v = mant == 0 ? INFINITY : NAN;
  } else if (exp == 0) {
    v = std::ldexp(mant, -24);
  } else {
    v = std::ldexp(1024 + mant, exp - 25);
  }
  return sign ? -v : v;
}

TEST(F16ConversionTest, EveryPatternWidensExactlyAndRoundTrips) {
  int nans = 0;
  for (uint32_t i = 0; i < 65536; ++i) {
    const uint16_t h = static_cast<uint16_t>(i);
    const float f = tensor::f16_to_f32(h);
    const double want = f16_value(h);
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(f)) << std::hex << i;
      // NaN stays NaN through the round trip (quieted, top payload bits kept).
      const uint16_t back = tensor::f32_to_f16(f);
      ASSERT_EQ(back & 0x7c00, 0x7c00) << std::hex << i;
      ASSERT_NE(back & 0x3ff, 0) << std::hex << i;
      ASSERT_EQ(back & 0x8000, h & 0x8000) << std::hex << i;
      ++nans;
      continue;
    }
    ASSERT_EQ(static_cast<double>(f), want) << std::hex << i;
    ASSERT_EQ(std::signbit(f), (h & 0x8000) != 0) << std::hex << i;  // -0 stays -0
    ASSERT_EQ(tensor::f32_to_f16(f), h) << std::hex << i;
  }
  EXPECT_EQ(nans, 2 * 1023);
}

// For every pair of adjacent finite f16 values: the exact midpoint ties to the even one,
// a nudge either side of it goes to the nearer one. Covers subnormals, the normal boundary
// and the top binade.
TEST(F16ConversionTest, RoundsToNearestEvenBetweenEveryAdjacentPair) {
  for (uint32_t i = 0; i < 0x7bff; ++i) {
    const uint16_t lo = static_cast<uint16_t>(i), hi = static_cast<uint16_t>(i + 1);
    const double a = f16_value(lo), b = f16_value(hi);
    const float mid = static_cast<float>((a + b) / 2);  // exact in f32 (12 significant bits)
    ASSERT_EQ(static_cast<double>(mid), (a + b) / 2);
    const uint16_t even = (lo & 1) == 0 ? lo : hi;
    ASSERT_EQ(tensor::f32_to_f16(mid), even) << std::hex << i;
    ASSERT_EQ(tensor::f32_to_f16(-mid), even | 0x8000) << std::hex << i;
    ASSERT_EQ(tensor::f32_to_f16(std::nextafter(mid, 0.0f)), lo) << std::hex << i;
    ASSERT_EQ(tensor::f32_to_f16(std::nextafter(mid, INFINITY)), hi) << std::hex << i;
  }
}

TEST(F16ConversionTest, OverflowUnderflowAndSpecials) {
  EXPECT_EQ(tensor::f32_to_f16(65504.0f), 0x7bff);
  EXPECT_EQ(tensor::f32_to_f16(65519.99f), 0x7bff);  // below the midpoint to 65536
  EXPECT_EQ(tensor::f32_to_f16(65520.0f), 0x7c00);   // the midpoint ties to "even" 65536: inf
  EXPECT_EQ(tensor::f32_to_f16(1e6f), 0x7c00);
  EXPECT_EQ(tensor::f32_to_f16(-1e30f), 0xfc00);
  EXPECT_EQ(tensor::f32_to_f16(INFINITY), 0x7c00);
  EXPECT_EQ(tensor::f32_to_f16(-INFINITY), 0xfc00);
  EXPECT_EQ(tensor::f32_to_f16(std::numeric_limits<float>::max()), 0x7c00);
  EXPECT_EQ(tensor::f32_to_f16(0x1p-14f), 0x0400);  // smallest normal
  EXPECT_EQ(tensor::f32_to_f16(0x1p-24f), 0x0001);  // smallest subnormal
  EXPECT_EQ(tensor::f32_to_f16(0x1p-25f), 0x0000);  // half of it ties to even: 0
  EXPECT_EQ(tensor::f32_to_f16(0x1.000002p-25f), 0x0001);
  EXPECT_EQ(tensor::f32_to_f16(0x1.8p-24f), 0x0002);  // 1.5 ulp ties to even 2
  EXPECT_EQ(tensor::f32_to_f16(-0x1p-30f), 0x8000);    // underflows to -0
  EXPECT_EQ(tensor::f32_to_f16(std::numeric_limits<float>::denorm_min()), 0x0000);
  EXPECT_EQ(tensor::f32_to_f16(0.0f), 0x0000);
  EXPECT_EQ(tensor::f32_to_f16(-0.0f), 0x8000);
  EXPECT_EQ(tensor::f32_to_f16(1.0f), 0x3c00);
  EXPECT_EQ(tensor::f32_to_f16(1.0f + 0x1p-11f), 0x3c00);                   // tie, to even
  EXPECT_EQ(tensor::f32_to_f16(1.0f + 0x1p-10f + 0x1p-11f), 0x3c02);        // tie, to even (up)
  EXPECT_EQ(tensor::f32_to_f16(0.1f), 0x2e66);
  EXPECT_EQ(tensor::f32_to_f16(std::nanf("")) & 0x7e00, 0x7e00);
  EXPECT_EQ(tensor::f32_to_f16(float_of(0x7f800001u)) & 0x7e00, 0x7e00);  // signalling -> quiet NaN
}

#if defined(__FLT16_MAX__)
// Against the compiler's _Float16 (libgcc's soft conversion or F16C) on a spread of f32 bit
// patterns, every exponent included.
TEST(F16ConversionTest, MatchesTheCompilersFloat16OnSampledFloats) {
  for (uint64_t u = 0; u < (uint64_t{1} << 32); u += 9973) {
    const float f = float_of(static_cast<uint32_t>(u));
    if (std::isnan(f)) continue;
    const _Float16 ref = static_cast<_Float16>(f);
    uint16_t want;
    std::memcpy(&want, &ref, 2);
    ASSERT_EQ(tensor::f32_to_f16(f), want) << std::hex << u;
  }
}
#endif

TEST(F16KernelTest, CastRoundsToNearestEvenOverflowsToInfAndWidensExactly) {
  Env env;
  std::vector<float> x = random_values(40001, 14, -70000.0f, 70000.0f);
  x.push_back(1.00048828125f);  // 1 + 2^-11, halfway: ties to even (1.0)
  x.push_back(1.00146484375f);  // 1 + 3 * 2^-11, halfway: ties to even (1 + 2^-9)
  x.push_back(65520.0f);        // rounds to inf
  x.push_back(-INFINITY);
  x.push_back(0x1p-20f);        // subnormal in f16
  const int64_t n = static_cast<int64_t>(x.size());
  tensor::Tensor tx = env.from(x, {n}), th = env.empty({n}, tensor::DType::kF16), tf = env.empty({n});
  env.kernels->cast(tx, th);
  env.kernels->cast(th, tf);
  std::vector<float> back = env.host(tf);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(bits_of(back[i]), bits_of(f16_round(x[i]))) << i;
  EXPECT_EQ(back[n - 5], 1.0f);
  EXPECT_EQ(back[n - 4], 1.001953125f);
  EXPECT_EQ(back[n - 3], INFINITY);
  EXPECT_EQ(back[n - 2], -INFINITY);
  EXPECT_EQ(back[n - 1], 0x1p-20f);
  // bf16 <-> f16 through f32: one rounding each way.
  tensor::Tensor tb = env.empty({n}, tensor::DType::kBF16), th2 = env.empty({n}, tensor::DType::kF16);
  env.kernels->cast(th, tb);
  env.kernels->cast(tb, th2);
  std::vector<float> via_bf16 = env.host(th2);
  for (int64_t i = 0; i < n; ++i) {
    const float want = f16_round(tensor::bf16_to_f32(tensor::f32_to_bf16(back[i])));
    ASSERT_EQ(bits_of(via_bf16[i]), bits_of(want)) << i;
  }
}

TEST(F16KernelTest, BiasAddGeluAddAccumulateRoundOnce) {
  Env env;
  const int64_t rows = 33, cols = 65, n = rows * cols;
  auto x = round_f16(random_values(static_cast<size_t>(n), 1, -4.0f, 4.0f));
  auto bias = round_f16(random_values(static_cast<size_t>(cols), 2));
  auto y = round_f16(random_values(static_cast<size_t>(n), 3));
  // Each f16 op equals the f32 op on the same values, rounded once.
  auto f32_then_round = [&](auto&& op, const std::vector<float>& in) {
    tensor::Tensor t32 = env.from(in, {rows, cols}), t16 = env.from(in, {rows, cols}, tensor::DType::kF16);
    op(t32, tensor::DType::kF32);
    op(t16, tensor::DType::kF16);
    EXPECT_EQ(env.host(t16), round_f16(env.host(t32)));
  };
  f32_then_round([&](tensor::Tensor& t, tensor::DType dt) { env.kernels->bias_add(t, env.from(bias, {cols}, dt)); },
                 x);
  f32_then_round([&](tensor::Tensor& t, tensor::DType) { env.kernels->gelu_forward(t, t); }, x);
  f32_then_round(
      [&](tensor::Tensor& t, tensor::DType dt) {
        tensor::Tensor dy = env.from(y, {rows, cols}, dt), dx = env.empty({rows, cols}, dt);
        env.kernels->gelu_backward(t, dy, dx);
        env.kernels->cast(dx, t);
      },
      x);
  f32_then_round([&](tensor::Tensor& t, tensor::DType dt) { env.kernels->add(t, env.from(y, {rows, cols}, dt), t); },
                 x);
  // f16 accumulator, f32 addend (a mix the f16 model makes).
  f32_then_round([&](tensor::Tensor& t, tensor::DType) { env.kernels->accumulate(t, env.from(y, {rows, cols})); },
                 x);
  f32_then_round([&](tensor::Tensor& t, tensor::DType) { env.kernels->scale(t, 3.0f); }, x);
  // Scaling past 65504 gives inf in f16.
  tensor::Tensor big = env.from({60000.0f, -40000.0f, 1.0f}, {3}, tensor::DType::kF16);
  env.kernels->scale(big, 2.0f);
  EXPECT_EQ(env.host(big), (std::vector<float>{INFINITY, -INFINITY, 2.0f}));
  tensor::Tensor f = env.empty({3, 17}, tensor::DType::kF16);
  env.kernels->fill(f, 0.1f);
  EXPECT_EQ(env.host(f), std::vector<float>(51, f16_round(0.1f)));
}

TEST(F16KernelTest, DropoutKeepsTheSameMaskAsF32) {
  Env env;
  const int64_t n = 40003;
  auto x = round_f16(random_values(static_cast<size_t>(n), 4));
  const PhiloxKey key{1234, {5, 6, 7}};
  tensor::Tensor x32 = env.from(x, {n}), y32 = env.empty({n});
  tensor::Tensor x16 = env.from(x, {n}, tensor::DType::kF16), y16 = env.empty({n}, tensor::DType::kF16);
  env.kernels->dropout_forward(x32, y32, 0.25f, key);
  env.kernels->dropout_forward(x16, y16, 0.25f, key);
  EXPECT_EQ(env.host(y16), round_f16(env.host(y32)));
}

TEST(F16KernelTest, SumAndSquaredNormOfF16MatchF32OfTheSameValues) {
  Env env;
  for (int64_t n : {1, 17, 16385, 100003}) {
    auto x = round_f16(random_values(static_cast<size_t>(n), 15));
    tensor::Tensor t32 = env.from(x, {n}), t16 = env.from(x, {n}, tensor::DType::kF16);
    tensor::Tensor a = env.empty({1}), b = env.empty({1});
    // Loads widen exactly; the chunks and lanes are the same: bit for bit.
    env.kernels->sum(t32, a);
    env.kernels->sum(t16, b);
    EXPECT_EQ(env.host(a), env.host(b)) << n;
    env.kernels->squared_norm(t32, a);
    env.kernels->squared_norm(t16, b);
    EXPECT_EQ(env.host(a), env.host(b)) << n;
  }
}

// AdamW on the f32 master with an f16 gradient and an f16 working copy: the master, m and v
// are exactly the f32-gradient run on the same values; the working copy is the master
// rounded once to f16.
TEST(F16KernelTest, AdamWTakesF16GradientsAndWritesAnF16WorkingCopy) {
  Env env;
  const int64_t n = 20003;
  auto p = random_values(static_cast<size_t>(n), 16);
  const std::vector<float> zeros(static_cast<size_t>(n), 0.0f);
  tensor::Tensor p1 = env.from(p, {n}), m1 = env.from(zeros, {n}), v1 = env.from(zeros, {n});
  tensor::Tensor p2 = env.from(p, {n}), m2 = env.from(zeros, {n}), v2 = env.from(zeros, {n});
  tensor::Tensor work = env.empty({n}, tensor::DType::kF16);
  kernels::AdamWArgs args;
  args.lr = 1e-2f;
  args.weight_decay = 0.1f;
  args.grad_scale = 1.0f / 1024.0f;  // unscaling a loss-scaled gradient
  for (int64_t step = 1; step <= 3; ++step) {
    auto g = round_f16(random_values(static_cast<size_t>(n), 100 + static_cast<uint32_t>(step),
                                     -1000.0f, 1000.0f));
    args.step = step;
    env.kernels->adamw(p1, env.from(g, {n}), m1, v1, args);
    env.kernels->adamw(p2, env.from(g, {n}, tensor::DType::kF16), m2, v2, args, &work);
  }
  EXPECT_EQ(env.host(p1), env.host(p2));
  EXPECT_EQ(env.host(m1), env.host(m2));
  EXPECT_EQ(env.host(v1), env.host(v2));
  EXPECT_EQ(env.host(work), round_f16(env.host(p2)));
}

// nonfinite_count: inf, -inf and NaN (quiet and signalling, any payload) count; the largest
// finite values, subnormals and zeros do not. Positions straddle chunk (16384) and lane (16)
// boundaries; the tail after the last full lane group is covered too.
TEST(NonfiniteCountTest, CountsInfAndNanInEveryDtype) {
  Env env;
  for (tensor::DType dt : {tensor::DType::kF32, tensor::DType::kBF16, tensor::DType::kF16}) {
    for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{15}, int64_t{16385}, int64_t{50001}}) {
      SCOPED_TRACE(std::string(tensor::dtype_name(dt)) + " n=" + std::to_string(n));
      auto x = testing::round_to(dt, random_values(static_cast<size_t>(n), 21));
      tensor::Tensor out = env.empty({1});
      tensor::Tensor t = env.from(x, {n}, dt);
      env.kernels->nonfinite_count(t, out);
      EXPECT_EQ(env.host(out)[0], 0.0f);
      if (n == 0) continue;
      // The largest finite value of the dtype is not counted.
      const float max_finite = dt == tensor::DType::kF16    ? 65504.0f
                               : dt == tensor::DType::kBF16 ? tensor::bf16_to_f32(0x7f7f)
                                                    : std::numeric_limits<float>::max();
      x[0] = max_finite;
      x[static_cast<size_t>(n - 1)] = -max_finite;
      t = env.from(x, {n}, dt);
      env.kernels->nonfinite_count(t, out);
      EXPECT_EQ(env.host(out)[0], 0.0f);
      const std::vector<int64_t> at = {0, 16383, 16384, 16385, 50000, 49999, 17, n - 1};
      int expected = 0;
      const float specials[] = {INFINITY, -INFINITY, std::nanf(""), -std::nanf("")};
      for (size_t j = 0; j < at.size(); ++j) {
        if (at[j] >= n || !std::isfinite(x[static_cast<size_t>(at[j])])) continue;
        x[static_cast<size_t>(at[j])] = specials[j % 4];
        ++expected;
      }
      t = env.from(x, {n}, dt);
      env.kernels->nonfinite_count(t, out);
      EXPECT_EQ(env.host(out)[0], static_cast<float>(expected));
    }
  }
}

// An f16 overflow produced by a kernel (what the loss scaler looks for) is counted; so is a
// signalling NaN and a NaN with only a low payload bit, written as raw bits.
TEST(NonfiniteCountTest, SeesOverflowAndRawNanPatterns) {
  Env env;
  tensor::Tensor g = env.from({30000.0f, 1.0f, -50000.0f, 2.0f}, {4}, tensor::DType::kF16);
  tensor::Tensor out = env.empty({1});
  env.kernels->nonfinite_count(g, out);
  EXPECT_EQ(env.host(out)[0], 0.0f);
  env.kernels->scale(g, 4.0f);
  env.kernels->nonfinite_count(g, out);
  EXPECT_EQ(env.host(out)[0], 2.0f);

  const std::vector<uint16_t> f16_bits = {0x7c01, 0xfc00, 0x7bff, 0x0001, 0x7e00, 0x8000};
  tensor::Tensor h = env.empty({6}, tensor::DType::kF16);
  env.device->copy_sync(h.data(), f16_bits.data(), 12);
  env.kernels->nonfinite_count(h, out);
  EXPECT_EQ(env.host(out)[0], 3.0f);
  const std::vector<uint16_t> bf16_bits = {0x7f81, 0xff80, 0x7f7f, 0x0001};
  tensor::Tensor b = env.empty({4}, tensor::DType::kBF16);
  env.device->copy_sync(b.data(), bf16_bits.data(), 8);
  env.kernels->nonfinite_count(b, out);
  EXPECT_EQ(env.host(out)[0], 2.0f);
  const std::vector<uint32_t> f32_bits = {0x7f800001u, 0x7fffffffu, 0x7f7fffffu, 0xff800000u};
  tensor::Tensor f = env.empty({4});
  env.device->copy_sync(f.data(), f32_bits.data(), 16);
  env.kernels->nonfinite_count(f, out);
  EXPECT_EQ(env.host(out)[0], 3.0f);
}

TEST(NonfiniteCountTest, ValidatesItsArguments) {
  Env env;
  tensor::Tensor x = env.empty({4}), ids = env.empty({4}, tensor::DType::kI32);
  tensor::Tensor out2 = env.empty({2}), out_bf16 = env.empty({1}, tensor::DType::kBF16), out = env.empty({1});
  EXPECT_THROW(env.kernels->nonfinite_count(ids, out), InvalidArgument);
  EXPECT_THROW(env.kernels->nonfinite_count(x, out2), InvalidArgument);
  EXPECT_THROW(env.kernels->nonfinite_count(x, out_bf16), InvalidArgument);
  EXPECT_THROW(env.kernels->nonfinite_count(x, x), InvalidArgument);
}

// Note [Cpu dtype combinations]: one 16-bit type per call next to f32.
TEST(F16KernelTest, ACallMixingBf16AndF16IsRejectedWithTheRule) {
  Env env;
  tensor::Tensor a = env.empty({8}, tensor::DType::kBF16), b = env.empty({8}, tensor::DType::kF16);
  tensor::Tensor out = env.empty({8}, tensor::DType::kF16);
  try {
    env.kernels->add(a, b, out);
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("mixes bf16 and f16"));
    EXPECT_THAT(e.what(), HasSubstr("Note [Cpu dtype combinations]"));
  }
  // Mixed with f32 it runs.
  tensor::Tensor c = env.from(std::vector<float>(8, 1.5f), {8});
  env.kernels->fill(b, 0.25f);
  env.kernels->add(c, b, out);
  EXPECT_EQ(env.host(out), std::vector<float>(8, 1.75f));
}

}  // namespace
}  // namespace porter::nn
