// Flash attention on cpu (Note [Flash attention tiles] in kernels/cpu/attention_flash.cc)
// against a double reference: out and lse forward, dqkv backward analytically and through
// central differences, grouped-query heads, odd lengths and head sizes, f32, bf16 and f16,
// against the materialised attention, thread counts and the workspace it takes.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "kernels/cpu/attention_heads.h"
#include "memory/category.h"
#include "tests/nn/nn_test_util.h"

namespace porter::nn {

using namespace porter::tensor;
using namespace porter::kernels;
namespace {

using testing::Env;
using testing::max_rel_error;
using testing::random_values;
using testing::round_bf16;
using testing::round_f16;

// qkv (b, t, (h + 2 hkv) d).
struct Dims {
  int64_t b, t, h, hkv, d;
  int64_t width() const { return (h + 2 * hkv) * d; }
  int64_t col(int64_t part, int64_t head) const {  // part 0 = q, 1 = k, 2 = v
    return (part == 0 ? head : part == 1 ? h + head : h + hkv + head) * d;
  }
  std::string name() const {
    return "B " + std::to_string(b) + " T " + std::to_string(t) + " H " + std::to_string(h) +
           " Hkv " + std::to_string(hkv) + " D " + std::to_string(d);
  }
};

struct Ref {
  std::vector<double> out, lse, dqkv;
};

// out (B, T, H D), lse (B, H, T) and, with dout, dqkv in double.
Ref reference(const std::vector<double>& x, const Dims& d, const std::vector<double>* dout) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(d.d));
  const int64_t w = d.width(), c = d.h * d.d;
  Ref r;
  r.out.assign(d.b * d.t * c, 0.0);
  r.lse.assign(d.b * d.h * d.t, 0.0);
  if (dout != nullptr) r.dqkv.assign(x.size(), 0.0);
  auto at = [&](int64_t b, int64_t t, int64_t part, int64_t head, int64_t e) -> int64_t {
    return (b * d.t + t) * w + d.col(part, head) + e;
  };
  std::vector<double> p, dp;
  for (int64_t b = 0; b < d.b; ++b) {
    for (int64_t h = 0; h < d.h; ++h) {
      const int64_t g = h / (d.h / d.hkv);
      for (int64_t i = 0; i < d.t; ++i) {
        p.assign(i + 1, 0.0);
        double mx = -INFINITY, sum = 0;
        for (int64_t j = 0; j <= i; ++j) {
          double dot = 0;
          for (int64_t e = 0; e < d.d; ++e) dot += x[at(b, i, 0, h, e)] * x[at(b, j, 1, g, e)];
          p[j] = dot * scale;
          mx = std::max(mx, p[j]);
        }
        for (int64_t j = 0; j <= i; ++j) sum += std::exp(p[j] - mx);
        r.lse[(b * d.h + h) * d.t + i] = mx + std::log(sum);
        for (int64_t j = 0; j <= i; ++j) p[j] = std::exp(p[j] - mx) / sum;
        const int64_t orow = (b * d.t + i) * c + h * d.d;
        for (int64_t e = 0; e < d.d; ++e) {
          double acc = 0;
          for (int64_t j = 0; j <= i; ++j) acc += p[j] * x[at(b, j, 2, g, e)];
          r.out[orow + e] = acc;
        }
        if (dout == nullptr) continue;
        dp.assign(i + 1, 0.0);
        double rowdot = 0;
        for (int64_t j = 0; j <= i; ++j) {
          double v = 0;
          for (int64_t e = 0; e < d.d; ++e) v += (*dout)[orow + e] * x[at(b, j, 2, g, e)];
          dp[j] = v;
          rowdot += p[j] * v;
        }
        for (int64_t j = 0; j <= i; ++j) {
          const double ds = p[j] * (dp[j] - rowdot) * scale;
          for (int64_t e = 0; e < d.d; ++e) {
            r.dqkv[at(b, i, 0, h, e)] += ds * x[at(b, j, 1, g, e)];
            r.dqkv[at(b, j, 1, g, e)] += ds * x[at(b, i, 0, h, e)];
            r.dqkv[at(b, j, 2, g, e)] += p[j] * (*dout)[orow + e];
          }
        }
      }
    }
  }
  return r;
}

struct Result {
  std::vector<float> out, lse, dqkv;
};

struct Types {
  DType qkv, out, dqkv;
};

Result run(Env& env, const Dims& d, const std::vector<float>& qkv, const std::vector<float>& dout,
           Types types) {
  Tensor tq = env.from(qkv, {d.b, d.t, d.width()}, types.qkv);
  Tensor out = env.empty({d.b, d.t, d.h * d.d}, types.out);
  Tensor lse = env.empty({d.b, d.h, d.t});
  Tensor tdo = env.from(dout, {d.b, d.t, d.h * d.d}, types.out);
  Tensor dq = env.empty({d.b, d.t, d.width()}, types.dqkv);
  const int h = static_cast<int>(d.h), hkv = static_cast<int>(d.hkv);
  env.kernels->flash_attention_forward(tq, out, lse, h, hkv);
  env.kernels->flash_attention_backward(tdo, tq, out, lse, dq, h, hkv);
  return {env.host(out), env.host(lse), env.host(dq)};
}

// Part `part` (0 = dQ, 1 = dK, 2 = dV) of a (B, T, (H + 2 Hkv) D) gradient.
template <typename T>
std::vector<T> part_of(const std::vector<T>& dqkv, const Dims& d, int64_t part) {
  const int64_t begin = d.col(part, 0), end = part == 0 ? d.col(1, 0) : part == 1 ? d.col(2, 0)
                                                                                   : d.width();
  std::vector<T> v;
  for (int64_t row = 0; row < d.b * d.t; ++row) {
    const auto* p = dqkv.data() + row * d.width();
    v.insert(v.end(), p + begin, p + end);
  }
  return v;
}

double max_abs_error(const std::vector<float>& got, const std::vector<double>& want) {
  double err = 0;
  for (size_t i = 0; i < got.size(); ++i) err = std::max(err, std::abs(got[i] - want[i]));
  return got.size() == want.size() ? err : INFINITY;
}

struct Inputs {
  std::vector<float> qkv, dout;
  std::vector<double> qkv_d, dout_d;
};

Inputs inputs(const Dims& d, uint32_t seed, DType dtype) {
  Inputs in;
  in.qkv = testing::round_to(dtype, random_values(d.b * d.t * d.width(), seed, -2.0f, 2.0f));
  in.dout = testing::round_to(dtype, random_values(d.b * d.t * d.h * d.d, seed + 1));
  in.qkv_d.assign(in.qkv.begin(), in.qkv.end());
  in.dout_d.assign(in.dout.begin(), in.dout.end());
  return in;
}

// Each result within `bound` of its own largest magnitude; lse within `lse_bound` absolute.
// A gradient part's magnitude is floored at a tenth of the whole gradient's: with one key (T =
// 1) dQ and dK are exactly zero, dS = P (dP - D) with dP and D the same sum in two orders, and
// the kernel's are f32 rounding noise.
void expect_near_reference(const Result& r, const Ref& want, const Dims& d, double bound,
                           double lse_bound) {
  EXPECT_LT(max_rel_error(r.out, want.out), bound) << "out";
  EXPECT_LT(max_abs_error(r.lse, want.lse), lse_bound) << "lse";
  double floor = 1e-6;
  for (double g : want.dqkv) floor = std::max(floor, 0.1 * std::abs(g));
  for (int64_t part = 0; part < 3; ++part) {
    EXPECT_LT(max_rel_error(part_of(r.dqkv, d, part), part_of(want.dqkv, d, part), floor), bound)
        << "d" << "QKV"[part];
  }
}

// Lengths around the 64-row blocks and 256-key tiles (520: three tiles, the last partial), head
// sizes 64 and odd or small, grouped query heads.
const Dims kDims[] = {{2, 1, 4, 2, 24},  {2, 7, 4, 1, 24},   {1, 63, 2, 2, 64},
                      {2, 65, 4, 2, 64}, {1, 200, 4, 1, 24}, {1, 257, 4, 2, 64},
                      {1, 130, 3, 3, 17}, {1, 129, 2, 1, 8},  {1, 520, 2, 1, 32}};

TEST(FlashAttentionTest, F32MatchesReference) {
  Env env;
  for (const Dims& d : kDims) {
    SCOPED_TRACE(d.name());
    const Inputs in = inputs(d, 1, DType::kF32);
    const Result r = run(env, d, in.qkv, in.dout, {DType::kF32, DType::kF32, DType::kF32});
    expect_near_reference(r, reference(in.qkv_d, d, &in.dout_d), d, 1e-5, 1e-5);
  }
}

// Checks the analytic reference (and so the kernel) against central differences of
// sum(out * dout), grouped heads included.
TEST(FlashAttentionTest, BackwardMatchesFiniteDifferences) {
  Env env;
  const Dims d{2, 5, 4, 2, 3};
  const Inputs in = inputs(d, 3, DType::kF32);
  const Result r = run(env, d, in.qkv, in.dout, {DType::kF32, DType::kF32, DType::kF32});
  std::vector<double> fd(in.qkv.size());
  for (size_t i = 0; i < fd.size(); ++i) {
    auto loss = [&](double v) {
      std::vector<double> x = in.qkv_d;
      x[i] = v;
      const Ref ref = reference(x, d, nullptr);
      double l = 0;
      for (size_t k = 0; k < ref.out.size(); ++k) l += ref.out[k] * in.dout_d[k];
      return l;
    };
    const double h = 1e-5;
    fd[i] = (loss(in.qkv_d[i] + h) - loss(in.qkv_d[i] - h)) / (2 * h);
  }
  EXPECT_LT(max_rel_error(r.dqkv, fd), 1e-5);
}

// bf16 qkv, out, dout and dqkv: on the AVX512-BF16 tiles (even head sizes, where the cpu has
// them) P and dS are rounded to bf16 for their products, and every result once more when it is
// stored (2^-9 each), as in the materialised bf16 attention; an odd head size takes the
// portable f32 loops. lse is f32 from exact bf16 products.
TEST(FlashAttentionTest, Bf16MatchesReference) {
  Env env;
  for (const Dims& d : kDims) {
    SCOPED_TRACE(d.name());
    const Inputs in = inputs(d, 5, DType::kBF16);
    const Result r = run(env, d, in.qkv, in.dout, {DType::kBF16, DType::kBF16, DType::kBF16});
    expect_near_reference(r, reference(in.qkv_d, d, &in.dout_d), d, 8e-3, 1e-5);
  }
}

// f16 runs the portable loops in f32: with f32 out and dqkv the results are f32-close to the
// reference on the f16 values; with f16 out and dqkv each is that, rounded once (2^-11).
TEST(FlashAttentionTest, F16RunsInF32AndRoundsOnce) {
  Env env;
  for (const Dims& d : {kDims[1], kDims[3], kDims[6]}) {
    SCOPED_TRACE(d.name());
    const Inputs in = inputs(d, 7, DType::kF16);
    const Ref want = reference(in.qkv_d, d, &in.dout_d);
    const Result r32 = run(env, d, in.qkv, in.dout, {DType::kF16, DType::kF16, DType::kF32});
    // out is f16 here (dout shares its dtype), so only dqkv and lse are held to f32.
    EXPECT_LT(max_abs_error(r32.lse, want.lse), 1e-5);
    for (int64_t part = 0; part < 3; ++part) {
      EXPECT_LT(max_rel_error(part_of(r32.dqkv, d, part), part_of(want.dqkv, d, part)), 2e-3)
          << "d" << "QKV"[part];
    }
    const Result r16 = run(env, d, in.qkv, in.dout, {DType::kF16, DType::kF16, DType::kF16});
    EXPECT_EQ(r16.out, r32.out);
    EXPECT_EQ(r16.dqkv, round_f16(r32.dqkv));
    expect_near_reference(r16, want, d, 2e-3, 1e-5);
  }
}

// Mixed dtypes: f32 qkv with bf16 out/dout and f32 dqkv; bf16 qkv with f32 out/dout (the
// portable path); f32 qkv with f16 everything else.
TEST(FlashAttentionTest, MixedDtypes) {
  Env env;
  const Dims d{2, 70, 4, 2, 32};
  const Types cases[] = {{DType::kF32, DType::kBF16, DType::kF32},
                         {DType::kBF16, DType::kF32, DType::kF32},
                         {DType::kF32, DType::kF16, DType::kF16}};
  for (const Types& types : cases) {
    SCOPED_TRACE(std::string(dtype_name(types.qkv)) + " " + std::string(dtype_name(types.out)) +
                 " " + std::string(dtype_name(types.dqkv)));
    Inputs in = inputs(d, 9, types.qkv);
    in.dout = testing::round_to(types.out, in.dout);
    in.dout_d.assign(in.dout.begin(), in.dout.end());
    const Result r = run(env, d, in.qkv, in.dout, types);
    expect_near_reference(r, reference(in.qkv_d, d, &in.dout_d), d, 8e-3, 1e-5);
  }
}

// With Hkv = H flash takes the materialised attention's (B, T, 3C) qkv: the same values to
// f32 rounding (different summation orders).
TEST(FlashAttentionTest, MatchesMaterialisedAttention) {
  Env env;
  for (const Dims& d : {Dims{2, 65, 2, 2, 64}, Dims{1, 200, 3, 3, 24}, Dims{1, 257, 2, 2, 64}}) {
    SCOPED_TRACE(d.name());
    const Inputs in = inputs(d, 11, DType::kF32);
    const Result f = run(env, d, in.qkv, in.dout, {DType::kF32, DType::kF32, DType::kF32});
    Tensor tq = env.from(in.qkv, {d.b, d.t, d.width()});
    Tensor out = env.empty({d.b, d.t, d.h * d.d}), probs = env.empty({d.b, d.h, d.t, d.t});
    Tensor tdo = env.from(in.dout, {d.b, d.t, d.h * d.d}), dq = env.empty({d.b, d.t, d.width()});
    env.kernels->attention_forward(tq, out, probs, static_cast<int>(d.h));
    env.kernels->attention_backward(tdo, tq, probs, dq, static_cast<int>(d.h));
    const std::vector<float> m_out = env.host(out), m_dq = env.host(dq);
    EXPECT_LT(max_rel_error(f.out, testing::to_double(m_out)), 2e-6);
    for (int64_t part = 0; part < 3; ++part) {
      EXPECT_LT(max_rel_error(part_of(f.dqkv, d, part), testing::to_double(part_of(m_dq, d, part))),
                5e-6)
          << "d" << "QKV"[part];
    }
  }
}

// Note [Cpu determinism]: the same bits on one thread and on two, on every path.
TEST(FlashAttentionTest, BitIdenticalAcrossThreadCounts) {
  Env one(1), two(2);
  for (const Dims& d : {Dims{2, 200, 4, 2, 64}, Dims{1, 257, 4, 1, 24}}) {
    for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
      SCOPED_TRACE(d.name() + " " + std::string(dtype_name(dtype)));
      const Inputs in = inputs(d, 13, dtype);
      const Result a = run(one, d, in.qkv, in.dout, {dtype, dtype, dtype});
      const Result b = run(two, d, in.qkv, in.dout, {dtype, dtype, dtype});
      EXPECT_EQ(a.out, b.out);
      EXPECT_EQ(a.lse, b.lse);
      EXPECT_EQ(a.dqkv, b.dqkv);
    }
  }
}

// Forward takes no workspace; backward takes one buffer of exactly
// flash_attention_backward_workspace_bytes (the rows' D).
TEST(FlashAttentionTest, WorkspaceIsTheRowsD) {
  Env env;
  const Dims d{2, 100, 4, 2, 32};
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    const Inputs in = inputs(d, 15, dtype);
    Tensor tq = env.from(in.qkv, {d.b, d.t, d.width()}, dtype);
    Tensor out = env.empty({d.b, d.t, d.h * d.d}, dtype), lse = env.empty({d.b, d.h, d.t});
    Tensor tdo = env.from(in.dout, {d.b, d.t, d.h * d.d}, dtype);
    Tensor dq = env.empty({d.b, d.t, d.width()}, dtype);
    const FlashAttentionCall call{d.b, d.t, d.d, static_cast<int>(d.h), static_cast<int>(d.hkv),
                                  dtype, dtype, dtype};
    memory::CachingAllocator& alloc = *env.allocator;
    auto measure = [&](auto&& fn) {
      const memory::MemoryStats before = alloc.stats();
      alloc.reset_peak();
      fn();
      const memory::MemoryStats after = alloc.stats();
      const uint64_t allocs = after[memory::Category::kWorkspace].alloc_count -
                              before[memory::Category::kWorkspace].alloc_count;
      return std::pair<size_t, uint64_t>(after.peak_requested_bytes - before.requested_bytes,
                                         allocs);
    };
    const auto f = measure([&] {
      env.kernels->flash_attention_forward(tq, out, lse, static_cast<int>(d.h),
                                           static_cast<int>(d.hkv));
    });
    EXPECT_EQ(f.first, flash_attention_forward_workspace_bytes(memory::DeviceKind::kCpu, call));
    EXPECT_EQ(f.second, 0u);
    const auto b = measure([&] {
      env.kernels->flash_attention_backward(tdo, tq, out, lse, dq, static_cast<int>(d.h),
                                            static_cast<int>(d.hkv));
    });
    const size_t want = flash_attention_backward_workspace_bytes(memory::DeviceKind::kCpu, call);
    EXPECT_EQ(want, static_cast<size_t>(d.b * d.h * d.t) * 4);
    EXPECT_EQ(b.first, want);
    EXPECT_EQ(b.second, 1u);
  }
}

}  // namespace
}  // namespace porter::nn
