// Shared helpers for the nn kernel tests: a cpu device with kernels, tensors from host
// values, seeded random inputs and error measures.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <utility>
#include <vector>

#include "memory/caching_allocator.h"
#include "memory/device.h"
#include "kernels/kernels.h"
#include "tensor/tensor.h"

namespace porter::nn::testing {

using namespace porter::tensor;
using namespace porter::kernels;

// A cpu device with `threads` kernel threads, its allocator and its kernels.
struct Env {
  explicit Env(int threads = 2) {
    memory::DeviceOptions o;
    o.kind = memory::DeviceKind::kCpu;
    o.memory_limit_bytes = size_t{1} << 30;
    o.pinned_limit_bytes = size_t{64} << 20;
    o.threads = threads;
    device = memory::make_device(o);
    allocator = std::make_unique<memory::CachingAllocator>(*device);
    kernels = kernels::make_kernels(*allocator);
  }

  Tensor empty(Shape shape, tensor::DType dtype = tensor::DType::kF32) {
    return Tensor::empty(*allocator, shape, dtype, memory::Category::kWorkspace);
  }
  Tensor from(const std::vector<float>& values, Shape shape, tensor::DType dtype = tensor::DType::kF32) {
    Tensor t = empty(shape, dtype);
    from_host_f32(*device, values, t);
    return t;
  }
  Tensor ids(const std::vector<int32_t>& values, Shape shape) {
    Tensor t = empty(shape, tensor::DType::kI32);
    if (!values.empty()) device->copy_sync(t.data(), values.data(), t.nbytes());
    return t;
  }
  std::vector<float> host(const Tensor& t) { return tensor::to_host_f32(*device, t); }

  std::unique_ptr<memory::Device> device;
  std::unique_ptr<memory::CachingAllocator> allocator;
  std::unique_ptr<kernels::Kernels> kernels;
};

// Uniform values in [lo, hi), reproducible from `seed`.
inline std::vector<float> random_values(size_t n, uint32_t seed, float lo = -1.0f,
                                        float hi = 1.0f) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = dist(gen);
  return v;
}

// Values rounded to bf16, so a bf16 tensor holds exactly what the reference sees.
inline std::vector<float> round_bf16(std::vector<float> v) {
  for (float& x : v) x = tensor::bf16_to_f32(tensor::f32_to_bf16(x));
  return v;
}

// Values rounded to f16 (to inf beyond 65504), so an f16 tensor holds what the reference sees.
inline std::vector<float> round_f16(std::vector<float> v) {
  for (float& x : v) x = tensor::f16_to_f32(tensor::f32_to_f16(x));
  return v;
}

// Values rounded to `dtype` (unchanged for f32).
inline std::vector<float> round_to(tensor::DType dtype, std::vector<float> v) {
  if (dtype == tensor::DType::kBF16) return round_bf16(std::move(v));
  if (dtype == tensor::DType::kF16) return round_f16(std::move(v));
  return v;
}

inline float round_to(tensor::DType dtype, float x) {
  if (dtype == tensor::DType::kBF16) return tensor::bf16_to_f32(tensor::f32_to_bf16(x));
  if (dtype == tensor::DType::kF16) return tensor::f16_to_f32(tensor::f32_to_f16(x));
  return x;
}

// max |got - want| / max(max |want|, floor): the error relative to the tensor's magnitude.
inline double max_rel_error(const std::vector<float>& got, const std::vector<double>& want,
                            double floor = 1e-6) {
  double scale = floor, err = 0.0;
  for (double w : want) scale = std::max(scale, std::abs(w));
  for (size_t i = 0; i < got.size() && i < want.size(); ++i) {
    err = std::max(err, std::abs(static_cast<double>(got[i]) - want[i]));
  }
  return got.size() == want.size() ? err / scale : INFINITY;
}

inline std::vector<double> to_double(const std::vector<float>& v) {
  return {v.begin(), v.end()};
}

}  // namespace porter::nn::testing
