// zero::CpuAdam against its two references, bit for bit (Note [CpuAdam bit identity]): the
// cpu device's AdamW (kernels::make_kernels(...)->adamw) and the scalar formula written out
// below, for every ISA this CPU runs, over sizes, dtypes, weight decay and gradient scale.
// It runs the cpu kernels (OpenMP), so it is not built under TSan; the pool and the ISAs
// among themselves are tested in cpu_adam_threads_test.cc, which is.
#include "zero/cpu_adam.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "memory/caching_allocator.h"
#include "memory/device.h"
#include "kernels/kernels.h"
#include "tensor/tensor.h"

namespace porter::zero {
namespace {

using tensor::DType;

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

// The host arrays of one AdamW problem: f32 state, a gradient of grad_dtype and an optional
// working copy of out_dtype, each held as its bits.
struct Problem {
  int64_t n = 0;
  DType grad_dtype = DType::kF32;
  bool has_out = false;
  DType out_dtype = DType::kBF16;
  std::vector<float> params, m, v;
  std::vector<uint32_t> grad32;  // f32 gradient bits
  std::vector<uint16_t> grad16;  // bf16 / f16 gradient bits
  std::vector<uint32_t> out32;
  std::vector<uint16_t> out16;

  void* grad_data() {
    return grad_dtype == DType::kF32 ? static_cast<void*>(grad32.data()) : grad16.data();
  }
  void* out_data() {
    if (!has_out) return nullptr;
    return out_dtype == DType::kF32 ? static_cast<void*>(out32.data()) : out16.data();
  }
  CpuAdamArrays arrays() {
    CpuAdamArrays a;
    a.params = params.data();
    a.exp_avg = m.data();
    a.exp_avg_sq = v.data();
    a.grad = grad_data();
    a.grad_dtype = grad_dtype;
    a.out = out_data();
    a.out_dtype = out_dtype;
    a.elems = n;
    return a;
  }
};

// Random state and gradients, with special values at fixed indices: inf, -inf, NaN, a
// gradient whose square overflows, f32 and f16 subnormals, signed zeros; parameters spread
// over exponents -30..18, so that the f16 write-back meets subnormals, overflow to inf and
// the rounding ties of every binade. Specials never share an index across the arrays, so
// no element meets two different NaNs (Note [CpuAdam bit identity]).
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
  for (size_t i = 0; i < un; ++i) {
    const float sign = (gen() & 1u) != 0 ? -1.0f : 1.0f;
    p.params[i] = sign * std::ldexp(1.0f + unit(gen), exponent(gen));
    p.m[i] = (unit(gen) - 0.5f) * 0.2f;
    p.v[i] = unit(gen) * 1e-2f;
    switch (i % 101) {
      case 50: p.params[i] = std::numeric_limits<float>::infinity(); break;
      case 51: p.params[i] = std::numeric_limits<float>::quiet_NaN(); break;
      case 52: p.params[i] = -0.0f; break;
      case 53: p.params[i] = float_of(0x00000005u); break;  // f32 subnormal
      case 54: p.params[i] = 65519.0f; break;               // just below f16 overflow
      case 55: p.params[i] = 65520.0f; break;               // f16 inf
      default: break;
    }
  }
  std::vector<float> g(un);
  for (size_t i = 0; i < un; ++i) {
    g[i] = (unit(gen) - 0.5f) * 4.0f;
    switch (i % 101) {
      case 0: g[i] = std::numeric_limits<float>::infinity(); break;
      case 1: g[i] = -std::numeric_limits<float>::infinity(); break;
      case 2: g[i] = float_of(0x7fc12345u); break;  // a NaN with a payload
      case 3: g[i] = 3e30f; break;                  // g * g overflows
      case 4: g[i] = float_of(0x00000321u); break;  // f32 subnormal
      case 5: g[i] = -0.0f; break;
      case 6: g[i] = 1e-6f; break;  // an f16 subnormal
      default: break;
    }
  }
  if (grad_dtype == DType::kF32) {
    p.grad32.resize(un);
    for (size_t i = 0; i < un; ++i) p.grad32[i] = bits_of(g[i]);
  } else {
    p.grad16.resize(un);
    for (size_t i = 0; i < un; ++i) {
      p.grad16[i] = grad_dtype == DType::kBF16 ? tensor::f32_to_bf16(g[i]) : tensor::f32_to_f16(g[i]);
    }
  }
  if (has_out) {
    if (out_dtype == DType::kF32) {
      p.out32.assign(un, 0xdeadbeefu);
    } else {
      p.out16.assign(un, 0xbeefu);
    }
  }
  return p;
}

// The formula of Note [CpuAdam bit identity], written out again, one element at a time.
void scalar_reference(Problem& p, const kernels::AdamWArgs& args) {
  const double bc1 =
      1.0 - std::pow(static_cast<double>(args.beta1), static_cast<double>(args.step));
  const double bc2 =
      1.0 - std::pow(static_cast<double>(args.beta2), static_cast<double>(args.step));
  const float decay = 1.0f - args.lr * args.weight_decay;
  const float step_size = static_cast<float>(args.lr / bc1);
  const float bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  const float omb1 = 1.0f - args.beta1, omb2 = 1.0f - args.beta2;
  for (size_t i = 0; i < static_cast<size_t>(p.n); ++i) {
    float g;
    if (p.grad_dtype == DType::kF32) {
      g = float_of(p.grad32[i]);
    } else if (p.grad_dtype == DType::kBF16) {
      g = tensor::bf16_to_f32(p.grad16[i]);
    } else {
      g = tensor::f16_to_f32(p.grad16[i]);
    }
    const float grad = g * args.grad_scale;
    float param = p.params[i] * decay;
    const float mi = p.m[i] * args.beta1 + omb1 * grad;
    const float vi = p.v[i] * args.beta2 + omb2 * grad * grad;
    const float denom = std::sqrt(vi) / bc2_sqrt + args.eps;
    param = param - step_size * (mi / denom);
    p.m[i] = mi;
    p.v[i] = vi;
    p.params[i] = param;
    if (!p.has_out) continue;
    switch (p.out_dtype) {
      case DType::kF32: p.out32[i] = bits_of(param); break;
      case DType::kBF16: p.out16[i] = tensor::f32_to_bf16(param); break;
      default: p.out16[i] = tensor::f32_to_f16(param); break;
    }
  }
}

// The cpu device's AdamW over the problem's own memory (cpu tensors are host memory).
class DeviceAdam {
 public:
  DeviceAdam() {
    memory::DeviceOptions o;
    o.kind = memory::DeviceKind::kCpu;
    o.memory_limit_bytes = size_t{64} << 20;
    o.threads = 2;
    device_ = memory::make_device(o);
    allocator_ = std::make_unique<memory::CachingAllocator>(*device_);
    kernels_ = kernels::make_kernels(*allocator_);
  }
  void update(Problem& p, const kernels::AdamWArgs& args) {
    const tensor::Shape shape{p.n};
    tensor::Tensor params = tensor::Tensor::from_blob(p.params.data(), shape, DType::kF32);
    tensor::Tensor m = tensor::Tensor::from_blob(p.m.data(), shape, DType::kF32);
    tensor::Tensor v = tensor::Tensor::from_blob(p.v.data(), shape, DType::kF32);
    tensor::Tensor grad = tensor::Tensor::from_blob(p.grad_data(), shape, p.grad_dtype);
    tensor::Tensor out;
    if (p.has_out) out = tensor::Tensor::from_blob(p.out_data(), shape, p.out_dtype);
    kernels_->adamw(params, grad, m, v, args, p.has_out ? &out : nullptr);
  }

 private:
  std::unique_ptr<memory::Device> device_;
  std::unique_ptr<memory::CachingAllocator> allocator_;
  std::unique_ptr<kernels::Kernels> kernels_;
};

// Bitwise equality of two arrays, reporting the first mismatch with both bit patterns.
template <typename T>
void expect_same_bits(const std::vector<T>& want, const std::vector<T>& got, const char* what) {
  ASSERT_EQ(want.size(), got.size()) << what;
  if (want.empty() || std::memcmp(want.data(), got.data(), want.size() * sizeof(T)) == 0) return;
  size_t first = 0, count = 0;
  for (size_t i = want.size(); i-- > 0;) {
    if (std::memcmp(&want[i], &got[i], sizeof(T)) != 0) {
      first = i;
      ++count;
    }
  }
  uint32_t w = 0, g = 0;
  std::memcpy(&w, &want[first], sizeof(T));
  std::memcpy(&g, &got[first], sizeof(T));
  char buf[96];
  std::snprintf(buf, sizeof buf, "want 0x%0*x, got 0x%0*x", static_cast<int>(2 * sizeof(T)), w,
                static_cast<int>(2 * sizeof(T)), g);
  ADD_FAILURE() << what << ": " << count << " of " << want.size()
                << " elements differ; the first at " << first << ": " << buf;
}

void expect_same(const Problem& want, const Problem& got) {
  expect_same_bits(want.params, got.params, "params");
  expect_same_bits(want.m, got.m, "exp_avg");
  expect_same_bits(want.v, got.v, "exp_avg_sq");
  expect_same_bits(want.out32, got.out32, "out (f32)");
  expect_same_bits(want.out16, got.out16, "out (16-bit)");
}

std::string out_name(bool has_out, DType out) {
  return has_out ? std::string(tensor::dtype_name(out)) : std::string("none");
}

kernels::AdamWArgs args_for(float weight_decay, float grad_scale, int64_t step) {
  kernels::AdamWArgs args;
  args.lr = 1e-3f;
  args.weight_decay = weight_decay;
  args.grad_scale = grad_scale;
  args.step = step;
  return args;
}

// Two steps (3 and 4, so that both bias corrections matter) of the device kernel, the
// scalar formula and CpuAdam on every ISA, from the same start.
void check_against_references(int64_t n, DType grad_dtype, bool has_out, DType out_dtype,
                              float weight_decay, float grad_scale, DeviceAdam& device) {
  SCOPED_TRACE("n " + std::to_string(n) + ", grad " + std::string(tensor::dtype_name(grad_dtype)) +
               ", out " + out_name(has_out, out_dtype) + ", weight_decay " +
               std::to_string(weight_decay) + ", grad_scale " + std::to_string(grad_scale));
  const Problem start =
      make_problem(n, grad_dtype, has_out, out_dtype, 7 + static_cast<uint32_t>(n));
  Problem by_device = start, by_formula = start;
  for (int64_t step : {3, 4}) {
    device.update(by_device, args_for(weight_decay, grad_scale, step));
    scalar_reference(by_formula, args_for(weight_decay, grad_scale, step));
  }
  {
    SCOPED_TRACE("the device kernel against the formula written here");
    expect_same(by_formula, by_device);
  }
  for (CpuIsa isa : supported_cpu_isas()) {
    SCOPED_TRACE("isa " + std::string(cpu_isa_name(isa)));
    CpuAdam adam({.threads = 2, .max_isa = isa});
    ASSERT_EQ(adam.isa_level(), isa);
    Problem mine = start;
    for (int64_t step : {3, 4})
      adam.update(mine.arrays(), args_for(weight_decay, grad_scale, step));
    expect_same(by_device, mine);
  }
}

TEST(CpuAdamTest, MatchesTheCpuDeviceKernelAndTheFormulaBitwise) {
  DeviceAdam device;
  const DType floats[] = {DType::kF32, DType::kBF16, DType::kF16};
  for (int64_t n : {0, 1, 15, 17, 16 * 1024 + 5}) {
    for (DType grad : floats) {
      for (int out = 0; out < 4; ++out) {  // none, f32, bf16, f16
        const bool has_out = out > 0;
        const DType out_dtype = has_out ? floats[out - 1] : DType::kBF16;
        for (float wd : {0.0f, 0.1f}) {
          for (float gs : {1.0f, 0.37f}) {
            check_against_references(n, grad, has_out, out_dtype, wd, gs, device);
          }
        }
      }
    }
  }
}

// 1M + 3 elements: every dtype pair once, with weight decay and a gradient scale.
TEST(CpuAdamTest, MatchesTheCpuDeviceKernelOnAMillionAndThree) {
  DeviceAdam device;
  const int64_t n = (int64_t{1} << 20) + 3;
  check_against_references(n, DType::kF32, false, DType::kBF16, 0.1f, 0.37f, device);
  check_against_references(n, DType::kF32, true, DType::kBF16, 0.0f, 1.0f, device);
  check_against_references(n, DType::kBF16, true, DType::kBF16, 0.1f, 0.37f, device);
  check_against_references(n, DType::kF16, true, DType::kF16, 0.1f, 0.37f, device);
  check_against_references(n, DType::kBF16, true, DType::kF32, 0.0f, 0.37f, device);
  check_against_references(n, DType::kF32, true, DType::kF16, 0.1f, 1.0f, device);
}

// Every f16 bit pattern as a gradient (subnormals, infinities, signalling and quiet NaNs),
// with a working copy in each dtype.
TEST(CpuAdamTest, EveryF16GradientMatchesTheCpuDeviceKernel) {
  DeviceAdam device;
  for (DType out : {DType::kF32, DType::kBF16, DType::kF16}) {
    SCOPED_TRACE("out " + std::string(tensor::dtype_name(out)));
    Problem start = make_problem(65536, DType::kF16, true, out, 11);
    for (size_t i = 0; i < 65536; ++i) start.grad16[i] = static_cast<uint16_t>(i);
    Problem by_device = start;
    device.update(by_device, args_for(0.1f, 0.5f, 2));
    for (CpuIsa isa : supported_cpu_isas()) {
      SCOPED_TRACE("isa " + std::string(cpu_isa_name(isa)));
      CpuAdam adam({.threads = 2, .max_isa = isa});
      Problem mine = start;
      adam.update(mine.arrays(), args_for(0.1f, 0.5f, 2));
      expect_same(by_device, mine);
    }
  }
}

// The 16-bit write-back over a sweep of f32 bit patterns: with lr 0 the parameters come
// through unchanged (p * 1 - 0 * (m / denom)), so the working copy is the conversion of
// each pattern: every exponent, both signs, NaN payloads, f16 subnormals and the overflow
// boundary, and the neighbours of each bf16 and f16 rounding tie.
TEST(CpuAdamTest, WriteBackOfF32BitPatternsMatchesTheCpuDeviceKernel) {
  DeviceAdam device;
  std::vector<uint32_t> patterns;
  for (uint64_t u = 0; u <= 0xffffffffull; u += 65521) patterns.push_back(static_cast<uint32_t>(u));
  // 65504, 65520 (ties to f16 inf), 2^-14, 2^-24, a bf16 tie and an f16 tie above 1, inf,
  // the quiet NaN and the smallest f32 normal.
  for (uint32_t base : {0x477fe000u, 0x477ff000u, 0x38800000u, 0x33800000u, 0x3f808000u,
                        0x3f801000u, 0x7f800000u, 0x7fc00000u, 0x00800000u}) {
    for (uint32_t d = 0; d < 64; ++d) {
      patterns.push_back(base + d - 32);
      patterns.push_back((base + d - 32) | 0x80000000u);
    }
  }
  const auto n = static_cast<int64_t>(patterns.size());
  for (DType out : {DType::kBF16, DType::kF16}) {
    SCOPED_TRACE("out " + std::string(tensor::dtype_name(out)));
    Problem start = make_problem(n, DType::kF32, true, out, 13);
    for (size_t i = 0; i < patterns.size(); ++i) {
      start.params[i] = float_of(patterns[i]);
      start.grad32[i] = bits_of(0.25f);  // finite m / denom, so p passes through
    }
    kernels::AdamWArgs args = args_for(0.0f, 1.0f, 1);
    args.lr = 0.0f;
    Problem by_device = start;
    device.update(by_device, args);
    for (CpuIsa isa : supported_cpu_isas()) {
      SCOPED_TRACE("isa " + std::string(cpu_isa_name(isa)));
      CpuAdam adam({.threads = 1, .max_isa = isa});
      Problem mine = start;
      adam.update(mine.arrays(), args);
      expect_same(by_device, mine);
    }
  }
}

}  // namespace
}  // namespace porter::zero
