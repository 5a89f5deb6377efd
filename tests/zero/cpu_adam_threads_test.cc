// zero::CpuAdam among itself: every ISA this CPU runs, 1-3 threads and several tile sizes give
// the same bits as the single-threaded scalar kernel; the working copy is tensor/dtype.h's
// conversion of the master; the pool survives many and concurrent updates; bad arrays and
// arguments are refused before anything is written. No cpu kernels (OpenMP) run here, so
// this binary runs under TSan too; cpu_adam_test.cc holds CpuAdam against the cpu device.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "base/error.h"
#include "zero/cpu_adam.h"

namespace porter::zero {
namespace {

using tensor::DType;

#if defined(__SANITIZE_THREAD__)
constexpr bool kThreadSanitizer = true;
#else
constexpr bool kThreadSanitizer = false;
#endif

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

// Host arrays of one problem; gradients and the working copy as bits.
struct Problem {
  int64_t n = 0;
  DType grad_dtype = DType::kF32;
  bool has_out = false;
  DType out_dtype = DType::kBF16;
  std::vector<float> params, m, v;
  std::vector<uint32_t> grad32, out32;
  std::vector<uint16_t> grad16, out16;

  CpuAdamArrays arrays() {
    CpuAdamArrays a;
    a.params = params.data();
    a.exp_avg = m.data();
    a.exp_avg_sq = v.data();
    a.grad = grad_dtype == DType::kF32 ? static_cast<const void*>(grad32.data()) : grad16.data();
    a.grad_dtype = grad_dtype;
    if (has_out) a.out = out_dtype == DType::kF32 ? static_cast<void*>(out32.data()) : out16.data();
    a.out_dtype = out_dtype;
    a.elems = n;
    return a;
  }
  bool operator==(const Problem& o) const {
    auto same = [](const auto& x, const auto& y) {
      return x.size() == y.size() &&
             (x.empty() || std::memcmp(x.data(), y.data(), x.size() * sizeof(x[0])) == 0);
    };
    return same(params, o.params) && same(m, o.m) && same(v, o.v) && same(out32, o.out32) &&
           same(out16, o.out16);
  }
};

// Random state and gradients with inf, NaN and overflowing gradients at fixed indices, and
// parameters over exponents -30..18 (the f16 write-back's whole range).
Problem make_problem(int64_t n, DType grad_dtype, bool has_out, DType out_dtype, uint32_t seed) {
  Problem p;
  p.n = n;
  p.grad_dtype = grad_dtype;
  p.has_out = has_out;
  p.out_dtype = out_dtype;
  const auto un = static_cast<size_t>(n);
  p.params.resize(un);
  p.m.resize(un);
  p.v.resize(un);
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-30, 18);
  std::vector<float> g(un);
  for (size_t i = 0; i < un; ++i) {
    const float sign = (gen() & 1u) != 0 ? -1.0f : 1.0f;
    p.params[i] = sign * std::ldexp(1.0f + unit(gen), exponent(gen));
    p.m[i] = (unit(gen) - 0.5f) * 0.2f;
    p.v[i] = unit(gen) * 1e-2f;
    g[i] = (unit(gen) - 0.5f) * 4.0f;
    switch (i % 97) {
      case 0: g[i] = std::numeric_limits<float>::infinity(); break;
      case 1: g[i] = float_of(0xffc0beefu); break;  // a negative NaN with a payload
      case 2: g[i] = 3e30f; break;                  // g * g overflows
      case 3: g[i] = float_of(0x00000321u); break;  // f32 subnormal
      case 40: p.params[i] = -std::numeric_limits<float>::infinity(); break;
      case 41: p.params[i] = 65520.0f; break;  // f16 inf
      default: break;
    }
  }
  if (grad_dtype == DType::kF32) {
    for (float x : g) p.grad32.push_back(bits_of(x));
  } else {
    for (float x : g) {
      p.grad16.push_back(grad_dtype == DType::kBF16 ? tensor::f32_to_bf16(x) : tensor::f32_to_f16(x));
    }
  }
  if (has_out && out_dtype == DType::kF32) p.out32.assign(un, 0xdeadbeefu);
  if (has_out && out_dtype != DType::kF32) p.out16.assign(un, 0xbeefu);
  return p;
}

kernels::AdamWArgs args_for(float weight_decay, float grad_scale, int64_t step) {
  kernels::AdamWArgs args;
  args.lr = 1e-3f;
  args.weight_decay = weight_decay;
  args.grad_scale = grad_scale;
  args.step = step;
  return args;
}

std::string describe(const Problem& p) {
  return "n " + std::to_string(p.n) + ", grad " + std::string(tensor::dtype_name(p.grad_dtype)) +
         ", out " + (p.has_out ? std::string(tensor::dtype_name(p.out_dtype)) : std::string("none"));
}

// The first index where two problems differ, for the failure message.
std::string first_difference(const Problem& want, const Problem& got) {
  for (size_t i = 0; i < want.params.size(); ++i) {
    if (bits_of(want.params[i]) != bits_of(got.params[i]) ||
        bits_of(want.m[i]) != bits_of(got.m[i]) || bits_of(want.v[i]) != bits_of(got.v[i]) ||
        (!want.out32.empty() && want.out32[i] != got.out32[i]) ||
        (!want.out16.empty() && want.out16[i] != got.out16[i])) {
      return "element " + std::to_string(i) + ": params " + std::to_string(want.params[i]) +
             " vs " + std::to_string(got.params[i]);
    }
  }
  return "none";
}

// Runs `adam` for two steps on a copy of `start`.
Problem run(CpuAdam& adam, const Problem& start, float wd, float gs) {
  Problem p = start;
  for (int64_t step : {1, 2}) adam.update(p.arrays(), args_for(wd, gs, step));
  return p;
}

TEST(CpuAdamThreadsTest, ReportsItsThreadsAndIsa) {
  const std::vector<CpuIsa> isas = supported_cpu_isas();
  ASSERT_FALSE(isas.empty());
  EXPECT_EQ(isas.front(), CpuIsa::kScalar);
  EXPECT_EQ(isas.back(), best_cpu_isa());
  for (int t : {1, 2, 3}) EXPECT_EQ(CpuAdam({.threads = t}).threads(), t);
  const int hw = static_cast<int>(std::thread::hardware_concurrency());
  EXPECT_EQ(CpuAdam({.threads = 0}).threads(), hw > 0 ? hw : 1);

  CpuAdam best;
  EXPECT_EQ(best.isa_level(), best_cpu_isa());
  EXPECT_EQ(best.isa(), cpu_isa_name(best_cpu_isa()));
  for (CpuIsa isa : isas) {
    CpuAdam forced({.threads = 1, .max_isa = isa});
    EXPECT_EQ(forced.isa_level(), isa);
    EXPECT_EQ(forced.isa(), cpu_isa_name(isa));
  }
  EXPECT_EQ(CpuAdam({.max_isa = CpuIsa::kScalar}).isa(), "scalar");
  EXPECT_EQ(cpu_isa_name(CpuIsa::kAvx2), "avx2");
  EXPECT_EQ(cpu_isa_name(CpuIsa::kAvx512), "avx512");
  EXPECT_EQ(CpuAdam({.tile_elems = 100}).tile_elems(), 100);
}

// The grid: small sizes (empty, one element, one short vector, one vector and a tail) and a
// few tiles, every dtype pair, weight decay on and off, gradient scale 1 and not; every ISA
// on 1, 2 and 3 threads and three tile sizes (the default, 1000: tiles that start off the
// vector width, and 16) against one scalar thread. Each of those 27 kernels is built once and
// updates every problem (a pool's threads start once, not for each of the grid's 240 problems:
// thread starts were most of this test's time under TSan).
TEST(CpuAdamThreadsTest, EveryIsaThreadCountAndTileGivesTheSameBits) {
  CpuAdam reference({.threads = 1, .max_isa = CpuIsa::kScalar});
  std::vector<std::unique_ptr<CpuAdam>> kernels;
  for (CpuIsa isa : supported_cpu_isas()) {
    for (int threads : {1, 2, 3}) {
      for (int64_t tile : {kCpuAdamTileElems, int64_t{1000}, int64_t{16}}) {
        kernels.push_back(std::make_unique<CpuAdam>(
            CpuAdamOptions{.threads = threads, .max_isa = isa, .tile_elems = tile}));
      }
    }
  }
  const DType floats[] = {DType::kF32, DType::kBF16, DType::kF16};
  for (int64_t n : {0, 1, 15, 17, 3 * 1000 + 7}) {
    for (DType grad : floats) {
      for (int out = 0; out < 4; ++out) {  // none, f32, bf16, f16
        const Problem start =
            make_problem(n, grad, out > 0, out > 0 ? floats[out - 1] : DType::kBF16,
                         static_cast<uint32_t>(n) + 3);
        for (float wd : {0.0f, 0.1f}) {
          for (float gs : {1.0f, 0.37f}) {
            const Problem want = run(reference, start, wd, gs);
            for (const std::unique_ptr<CpuAdam>& adam : kernels) {
              const Problem got = run(*adam, start, wd, gs);
              EXPECT_TRUE(want == got)
                  << describe(start) << ", wd " << wd << ", gs " << gs << ", isa " << adam->isa()
                  << ", threads " << adam->threads() << ", tile " << adam->tile_elems()
                  << ": first difference at " << first_difference(want, got);
            }
          }
        }
      }
    }
  }
}

// 1M + 3 elements (128 default tiles and a tail), with weight decay and a gradient scale,
// for six dtype pairs (every gradient and every working copy; the small sizes above take
// all twelve): every ISA on 1, 2 and 3 threads.
//
// Under TSan, whose cost is per byte touched (a minute here for the whole test), two pairs
// (2- and 4-byte gradients and working copies) on 2 and 3 threads: TSan looks for races between
// the pool's threads over the 129 tiles, which the ISA and the element widths shape, not the
// formulas or a single thread; the release and ASan runs check every pair's bits.
TEST(CpuAdamThreadsTest, AMillionAndThreeGiveTheSameBitsOnEveryIsaAndThreadCount) {
  const int64_t n = (int64_t{1} << 20) + 3;
  CpuAdam reference({.threads = 1, .max_isa = CpuIsa::kScalar});
  struct Pair {
    DType grad;
    bool has_out;
    DType out;
  };
  const Pair pairs[] = {{DType::kF32, false, DType::kBF16}, {DType::kF32, true, DType::kBF16},
                        {DType::kBF16, true, DType::kBF16}, {DType::kF16, true, DType::kF16},
                        {DType::kBF16, true, DType::kF32},  {DType::kF32, true, DType::kF16}};
  for (const Pair& pair : pairs) {
    if (kThreadSanitizer && !(pair.grad == DType::kF32 && pair.out == DType::kF16) &&
        !(pair.grad == DType::kBF16 && pair.out == DType::kF32)) {
      continue;
    }
    const Problem start = make_problem(n, pair.grad, pair.has_out, pair.out, 5);
    const Problem want = run(reference, start, 0.1f, 0.37f);
    for (CpuIsa isa : supported_cpu_isas()) {
      for (int threads : {1, 2, 3}) {
        if (kThreadSanitizer && threads == 1) continue;
        CpuAdam adam({.threads = threads, .max_isa = isa});
        const Problem got = run(adam, start, 0.1f, 0.37f);
        EXPECT_TRUE(want == got) << describe(start) << ", isa " << cpu_isa_name(isa) << ", threads "
                                 << threads << ": first difference at "
                                 << first_difference(want, got);
      }
    }
  }
}

// The working copy is tensor/dtype.h's rounding of the updated master, on every ISA.
TEST(CpuAdamThreadsTest, TheWorkingCopyIsTheRoundedMaster) {
  for (CpuIsa isa : supported_cpu_isas()) {
    CpuAdam adam({.threads = 2, .max_isa = isa});
    for (DType out : {DType::kF32, DType::kBF16, DType::kF16}) {
      const Problem p = run(adam, make_problem(40000 + 9, DType::kF32, true, out, 21), 0.1f, 1.0f);
      for (size_t i = 0; i < p.params.size(); ++i) {
        const float x = p.params[i];
        if (out == DType::kF32) {
          ASSERT_EQ(p.out32[i], bits_of(x)) << cpu_isa_name(isa) << " f32, element " << i;
        } else {
          const uint16_t want = out == DType::kBF16 ? tensor::f32_to_bf16(x) : tensor::f32_to_f16(x);
          ASSERT_EQ(p.out16[i], want)
              << cpu_isa_name(isa) << " " << tensor::dtype_name(out) << ", element " << i << " = " << x;
        }
      }
    }
  }
}

// The working copy at every offset from a 64-byte boundary (Note [CpuAdam working copy
// stores]: non-temporal stores when a range starts aligned, ordinary ones otherwise) has the
// same bits, and nothing outside it is written.
TEST(CpuAdamThreadsTest, TheWorkingCopyIsTheSameAtEveryAlignment) {
  CpuAdam reference({.threads = 1, .max_isa = CpuIsa::kScalar});
  for (DType out : {DType::kF32, DType::kBF16, DType::kF16}) {
    const Problem start = make_problem(1000 + 5, DType::kF32, true, out, 47);
    const Problem want = run(reference, start, 0.1f, 1.0f);
    const size_t elem = tensor::dtype_size(out);
    for (CpuIsa isa : supported_cpu_isas()) {
      CpuAdam adam({.threads = 2, .max_isa = isa, .tile_elems = 256});
      for (size_t offset = 0; offset < 64 / elem; ++offset) {
        // 64-byte aligned storage with a guard element on each side of the copy.
        std::vector<uint8_t> storage((static_cast<size_t>(start.n) + 2) * elem + 128, 0xa5);
        const auto base = (reinterpret_cast<uintptr_t>(storage.data()) + 63) / 64 * 64;
        uint8_t* dst = reinterpret_cast<uint8_t*>(base) + (offset + 1) * elem;
        Problem got = start;
        for (int64_t step : {1, 2}) {
          CpuAdamArrays a = got.arrays();
          a.out = dst;
          adam.update(a, args_for(0.1f, 1.0f, step));
        }
        const void* want_out =
            out == DType::kF32 ? static_cast<const void*>(want.out32.data()) : want.out16.data();
        EXPECT_EQ(std::memcmp(dst, want_out, static_cast<size_t>(start.n) * elem), 0)
            << cpu_isa_name(isa) << " " << tensor::dtype_name(out) << ", offset " << offset;
        for (size_t b = 0; b < elem; ++b) {
          ASSERT_EQ(dst[-1 - static_cast<ptrdiff_t>(b)], 0xa5) << "written before the copy";
          ASSERT_EQ(dst[static_cast<size_t>(start.n) * elem + b], 0xa5) << "written after it";
        }
        got.out32 = want.out32;
        got.out16 = want.out16;
        EXPECT_TRUE(want == got) << first_difference(want, got);
      }
    }
  }
}

// Every f16 bit pattern as a gradient gives the same bits on every ISA.
TEST(CpuAdamThreadsTest, EveryF16GradientGivesTheSameBitsOnEveryIsa) {
  Problem start = make_problem(65536, DType::kF16, true, DType::kF16, 17);
  for (size_t i = 0; i < 65536; ++i) start.grad16[i] = static_cast<uint16_t>(i);
  CpuAdam reference({.threads = 1, .max_isa = CpuIsa::kScalar});
  const Problem want = run(reference, start, 0.0f, 0.5f);
  for (CpuIsa isa : supported_cpu_isas()) {
    CpuAdam adam({.threads = 3, .max_isa = isa});
    const Problem got = run(adam, start, 0.0f, 0.5f);
    EXPECT_TRUE(want == got) << cpu_isa_name(isa) << ": first difference at "
                             << first_difference(want, got);
  }
}

// With lr 0 the master passes through (p * 1 - 0 * finite), so the write-back of a sweep of
// f32 bit patterns is tensor::f32_to_bf16 / f32_to_f16 of each: all exponents and signs, NaN
// payloads, f16 subnormals, overflow and ties. (A signalling NaN comes out of p * 1 quiet.)
TEST(CpuAdamThreadsTest, WriteBackOfF32BitPatternsIsTheNnConversion) {
  std::vector<uint32_t> patterns;
  for (uint64_t u = 0; u <= 0xffffffffull; u += 65519) patterns.push_back(static_cast<uint32_t>(u));
  for (uint32_t base : {0x477fe000u, 0x477ff000u, 0x38800000u, 0x33800000u, 0x3f808000u,
                        0x3f801000u, 0x7f800000u, 0x7f800001u, 0x00800000u}) {
    for (uint32_t d = 0; d < 64; ++d) {
      patterns.push_back(base + d - 32);
      patterns.push_back((base + d - 32) | 0x80000000u);
    }
  }
  const auto n = static_cast<int64_t>(patterns.size());
  kernels::AdamWArgs args = args_for(0.1f, 1.0f, 1);
  args.lr = 0.0f;
  for (CpuIsa isa : supported_cpu_isas()) {
    CpuAdam adam({.threads = 2, .max_isa = isa});
    for (DType out : {DType::kBF16, DType::kF16}) {
      Problem p = make_problem(n, DType::kF32, true, out, 23);
      for (size_t i = 0; i < patterns.size(); ++i) {
        p.params[i] = float_of(patterns[i]);
        p.grad32[i] = bits_of(-0.5f);
      }
      adam.update(p.arrays(), args);
      for (size_t i = 0; i < patterns.size(); ++i) {
        const float before = float_of(patterns[i]);
        if (!std::isnan(before)) {
          ASSERT_EQ(bits_of(p.params[i]), patterns[i]) << "element " << i;
        }
        const uint16_t want =
            out == DType::kBF16 ? tensor::f32_to_bf16(p.params[i]) : tensor::f32_to_f16(p.params[i]);
        ASSERT_EQ(p.out16[i], want) << cpu_isa_name(isa) << " " << tensor::dtype_name(out)
                                    << ", pattern 0x" << std::hex << patterns[i];
      }
    }
  }
}

// cpu_adamw_range updates [begin, end) and nothing else.
TEST(CpuAdamThreadsTest, ARangeUpdatesOnlyItsElements) {
  const Problem start = make_problem(100, DType::kBF16, true, DType::kBF16, 29);
  CpuAdam reference({.threads = 1, .max_isa = CpuIsa::kScalar});
  Problem whole = start;
  reference.update(whole.arrays(), args_for(0.1f, 1.0f, 1));
  for (CpuIsa isa : supported_cpu_isas()) {
    Problem part = start;
    cpu_adamw_range(isa, part.arrays(), adamw_constants(args_for(0.1f, 1.0f, 1)), 13, 61);
    for (size_t i = 0; i < 100; ++i) {
      const Problem& want = i >= 13 && i < 61 ? whole : start;
      ASSERT_EQ(bits_of(part.params[i]), bits_of(want.params[i])) << cpu_isa_name(isa) << " " << i;
      ASSERT_EQ(bits_of(part.m[i]), bits_of(want.m[i])) << cpu_isa_name(isa) << " " << i;
      ASSERT_EQ(part.out16[i], want.out16[i]) << cpu_isa_name(isa) << " " << i;
    }
  }
  if (best_cpu_isa() != CpuIsa::kAvx512) {
    Problem p = start;
    EXPECT_THROW(cpu_adamw_range(CpuIsa::kAvx512, p.arrays(), adamw_constants({}), 0, 100),
                 InvalidArgument);
  }
}

// One CpuAdam, many small updates (each wakes the pool), and two threads updating through
// it at once (serialised): the same bits as one scalar thread.
TEST(CpuAdamThreadsTest, ThePoolSurvivesManyAndConcurrentUpdates) {
  CpuAdam reference({.threads = 1, .max_isa = CpuIsa::kScalar});
  CpuAdam adam({.threads = 3, .tile_elems = 64});
  const Problem start = make_problem(1000, DType::kF32, true, DType::kBF16, 31);
  Problem want = start, got = start;
  for (int64_t step = 1; step <= 200; ++step) {
    reference.update(want.arrays(), args_for(0.01f, 1.0f, step));
    adam.update(got.arrays(), args_for(0.01f, 1.0f, step));
  }
  EXPECT_TRUE(want == got) << first_difference(want, got);

  const Problem a0 = make_problem(20000, DType::kBF16, true, DType::kBF16, 37);
  const Problem b0 = make_problem(30000, DType::kF16, false, DType::kBF16, 41);
  Problem a_want = a0, b_want = b0, a = a0, b = b0;
  for (int64_t step = 1; step <= 5; ++step) {
    reference.update(a_want.arrays(), args_for(0.1f, 0.5f, step));
    reference.update(b_want.arrays(), args_for(0.0f, 2.0f, step));
  }
  std::thread ta([&] {
    for (int64_t step = 1; step <= 5; ++step) adam.update(a.arrays(), args_for(0.1f, 0.5f, step));
  });
  std::thread tb([&] {
    for (int64_t step = 1; step <= 5; ++step) adam.update(b.arrays(), args_for(0.0f, 2.0f, step));
  });
  ta.join();
  tb.join();
  EXPECT_TRUE(a_want == a) << first_difference(a_want, a);
  EXPECT_TRUE(b_want == b) << first_difference(b_want, b);
}

// What update() refuses, with the message naming the problem, and that nothing was written.
TEST(CpuAdamThreadsTest, BadArraysAndArgumentsThrowBeforeAnythingIsWritten) {
  CpuAdam adam({.threads = 2});
  const Problem start = make_problem(64, DType::kF32, true, DType::kBF16, 43);
  auto expect_refused =
      [&](const std::function<void(Problem&, CpuAdamArrays&, kernels::AdamWArgs&)>& spoil,
          const std::string& text) {
        Problem p = start;
        CpuAdamArrays a = p.arrays();
        kernels::AdamWArgs args = args_for(0.1f, 1.0f, 1);
        spoil(p, a, args);
        try {
          adam.update(a, args);
          ADD_FAILURE() << "no error; expected one containing \"" << text << "\"";
        } catch (const InvalidArgument& e) {
          EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
        }
        EXPECT_TRUE(p == start) << "an array was written before the error: " << text;
      };
  expect_refused([](Problem&, CpuAdamArrays& a, kernels::AdamWArgs&) { a.elems = -1; },
                 "elems must not be negative");
  expect_refused([](Problem&, CpuAdamArrays& a, kernels::AdamWArgs&) { a.exp_avg_sq = nullptr; },
                 "exp_avg_sq is null for 64 elements");
  expect_refused([](Problem&, CpuAdamArrays& a, kernels::AdamWArgs&) { a.grad = nullptr; },
                 "grad is null");
  expect_refused([](Problem&, CpuAdamArrays& a, kernels::AdamWArgs&) { a.grad_dtype = DType::kI32; },
                 "grad_dtype i32");
  expect_refused([](Problem&, CpuAdamArrays& a, kernels::AdamWArgs&) { a.out_dtype = DType::kI32; },
                 "out_dtype i32");
  expect_refused(
      [](Problem& p, CpuAdamArrays& a, kernels::AdamWArgs&) { a.exp_avg = p.params.data() + 10; },
      "params and exp_avg overlap");
  expect_refused([](Problem& p, CpuAdamArrays& a,
                    kernels::AdamWArgs&) { a.out = reinterpret_cast<uint16_t*>(p.v.data()) + 1; },
                 "exp_avg_sq and out overlap");
  expect_refused([](Problem&, CpuAdamArrays&, kernels::AdamWArgs& args) { args.step = 0; },
                 "step 0 must be >= 1");
  expect_refused([](Problem&, CpuAdamArrays&, kernels::AdamWArgs& args) { args.eps = 0.0f; },
                 "need lr >= 0, eps > 0 and betas in [0, 1)");
  expect_refused([](Problem&, CpuAdamArrays&, kernels::AdamWArgs& args) { args.beta2 = 1.0f; },
                 "betas in [0, 1)");
  expect_refused([](Problem&, CpuAdamArrays&, kernels::AdamWArgs& args) { args.lr = -1e-3f; },
                 "lr -0.001");

  // An empty update needs no arrays; a bad dtype is still refused.
  CpuAdamArrays empty;
  EXPECT_NO_THROW(adam.update(empty, {}));
  empty.grad_dtype = DType::kI32;
  EXPECT_THROW(adam.update(empty, {}), InvalidArgument);
  EXPECT_THROW(CpuAdam({.threads = -1}), InvalidArgument);
  EXPECT_THROW(CpuAdam({.tile_elems = 0}), InvalidArgument);
}

// The constants follow kernels/cpu/adamw.cc (bias corrections in double), and the byte count
// Note [CpuAdam roofline].
TEST(CpuAdamThreadsTest, ConstantsAndBytesPerElement) {
  kernels::AdamWArgs args = args_for(0.1f, 0.25f, 3);
  args.lr = 2e-3f;
  const AdamWConstants k = adamw_constants(args);
  EXPECT_EQ(k.decay, 1.0f - 2e-3f * 0.1f);
  EXPECT_EQ(k.step_size, static_cast<float>(double{2e-3f} / (1.0 - std::pow(double{0.9f}, 3.0))));
  EXPECT_EQ(k.bc2_sqrt, static_cast<float>(std::sqrt(1.0 - std::pow(double{0.999f}, 3.0))));
  EXPECT_EQ(k.one_minus_beta1, 1.0f - 0.9f);
  EXPECT_EQ(k.one_minus_beta2, 1.0f - 0.999f);
  EXPECT_EQ(k.grad_scale, 0.25f);
  EXPECT_EQ(k.eps, 1e-8f);

  Problem p = make_problem(10, DType::kF32, false, DType::kBF16, 1);
  EXPECT_EQ(cpu_adam_bytes(p.arrays()), 28 * 10);
  p = make_problem(10, DType::kF32, true, DType::kBF16, 1);
  EXPECT_EQ(cpu_adam_bytes(p.arrays()), 30 * 10);
  p = make_problem(10, DType::kBF16, true, DType::kF32, 1);
  EXPECT_EQ(cpu_adam_bytes(p.arrays()), 30 * 10);
  p = make_problem(10, DType::kF16, false, DType::kBF16, 1);
  EXPECT_EQ(cpu_adam_bytes(p.arrays()), 26 * 10);
}

}  // namespace
}  // namespace porter::zero
