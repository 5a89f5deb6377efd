// Whole-tensor reductions on cpu: sum, squared norm and the count of non-finite elements,
// deterministic for any thread count (Note [Cpu determinism]: fixed chunks, partials added in
// order in double). The partials are kernel workspace (Note [Kernel workspace]): one double
// per chunk.
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <vector>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/host_reduce.h"

namespace porter::kernels {
namespace {

constexpr int kLanes = 16;

enum class Reduce { kSum, kSquare, kNonfinite };

// Whether v is inf or NaN: all exponent bits set. A bit test rather than std::isfinite, so
// the loop vectorises (and a loaded bf16 or f16 inf or NaN stays one in f32).
inline float nonfinite(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  return (u & 0x7f800000u) == 0x7f800000u ? 1.0f : 0.0f;
}

// The sum of f(x[i]) over one chunk in kLanes f32 partial sums, added in a fixed order. The
// lanes let the loop vectorise without reassociating (no -ffast-math needed). Counts are
// exact: a lane counts at most kBlockElems / kLanes < 2^24.
template <Reduce kMode, typename T>
PORTER_CPU_CLONES double chunk_sum(const T* x, int64_t n) {
  auto f = [](float v) {
    if constexpr (kMode == Reduce::kSquare) return v * v;
    else if constexpr (kMode == Reduce::kNonfinite) return nonfinite(v);
    else return v;
  };
  float lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
#pragma omp simd
    for (int l = 0; l < kLanes; ++l) lanes[l] += f(cpu::load(x + i + l));
  }
  double total = 0.0;
  for (int l = 0; l < kLanes; ++l) total += lanes[l];
  for (; i < n; ++i) {
    const float v = cpu::load(x + i);
    total += kMode == Reduce::kSquare ? static_cast<double>(v) * v : f(v);
  }
  return total;
}

// `partials` holds cpu::blocks_of(x.numel()) doubles.
template <Reduce kMode>
float reduce(int threads, const Tensor& x, double* partials) {
  const int64_t n = x.numel();
  const int64_t chunks = cpu::blocks_of(n);
  cpu::dispatch_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* xp = static_cast<const T*>(x.data());
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t begin = c * cpu::kBlockElems;
      partials[c] = chunk_sum<kMode, T>(xp + begin, std::min(cpu::kBlockElems, n - begin));
    }
  });
  double total = 0.0;
  for (int64_t c = 0; c < chunks; ++c) total += partials[c];
  return static_cast<float>(total);
}

}  // namespace

float host_squared_norm(const void* x, tensor::DType dtype, int64_t n, int threads) {
  std::vector<double> partials(static_cast<size_t>(cpu::blocks_of(n)));
  const Tensor t = Tensor::from_blob(const_cast<void*>(x), tensor::Shape{n}, dtype,
                                     memory::Category::kGrads);
  return reduce<Reduce::kSquare>(std::max(1, threads), t, partials.data());
}

float host_nonfinite_count(const void* x, tensor::DType dtype, int64_t n, int threads) {
  std::vector<double> partials(static_cast<size_t>(cpu::blocks_of(n)));
  const Tensor t = Tensor::from_blob(const_cast<void*>(x), tensor::Shape{n}, dtype,
                                     memory::Category::kGrads);
  return reduce<Reduce::kNonfinite>(std::max(1, threads), t, partials.data());
}

void CpuKernels::do_sum(const Tensor& x, Tensor& out) {
  const memory::DeviceBuffer partials =
      workspace(reduction_workspace_bytes(kind(), x.numel()), "sum");
  *out.data_as<float>() = reduce<Reduce::kSum>(threads_, x, partials.as<double>());
}

void CpuKernels::do_squared_norm(const Tensor& x, Tensor& out) {
  const memory::DeviceBuffer partials =
      workspace(reduction_workspace_bytes(kind(), x.numel()), "squared_norm");
  *out.data_as<float>() = reduce<Reduce::kSquare>(threads_, x, partials.as<double>());
}

void CpuKernels::do_nonfinite_count(const Tensor& x, Tensor& out) {
  const memory::DeviceBuffer partials =
      workspace(reduction_workspace_bytes(kind(), x.numel()), "nonfinite_count");
  *out.data_as<float>() = reduce<Reduce::kNonfinite>(threads_, x, partials.as<double>());
}

}  // namespace porter::kernels
