// Whole-tensor reductions on cpu: sum and squared norm, deterministic for any thread count
// (Note [Cpu determinism]: fixed chunks, partials added in order in double). The partials
// are kernel workspace (Note [Kernel workspace]): one double per chunk.
#include <cstdint>

#include "nn/cpu_kernels.h"

namespace porter::nn {
namespace {

constexpr int kLanes = 16;

// The sum of f(x[i]) over one chunk in kLanes f32 partial sums, added in a fixed order. The
// lanes let the loop vectorise without reassociating (no -ffast-math needed).
template <bool kSquare, typename T>
PORTER_CPU_CLONES double chunk_sum(const T* x, int64_t n) {
  float lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
#pragma omp simd
    for (int l = 0; l < kLanes; ++l) {
      float v = cpu::load(x + i + l);
      lanes[l] += kSquare ? v * v : v;
    }
  }
  double total = 0.0;
  for (int l = 0; l < kLanes; ++l) total += lanes[l];
  for (; i < n; ++i) {
    double v = cpu::load(x + i);
    total += kSquare ? v * v : v;
  }
  return total;
}

// `partials` holds cpu::blocks_of(x.numel()) doubles.
template <bool kSquare>
float reduce(int threads, const Tensor& x, double* partials) {
  const int64_t n = x.numel();
  const int64_t chunks = cpu::blocks_of(n);
  cpu::dispatch_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* xp = static_cast<const T*>(x.data());
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t begin = c * cpu::kBlockElems;
      partials[c] = chunk_sum<kSquare>(xp + begin, std::min(cpu::kBlockElems, n - begin));
    }
  });
  double total = 0.0;
  for (int64_t c = 0; c < chunks; ++c) total += partials[c];
  return static_cast<float>(total);
}

}  // namespace

void CpuKernels::do_sum(const Tensor& x, Tensor& out) {
  const memory::DeviceBuffer partials =
      workspace(reduction_workspace_bytes(kind(), x.numel()), "sum");
  *out.data_as<float>() = reduce<false>(threads_, x, partials.as<double>());
}

void CpuKernels::do_squared_norm(const Tensor& x, Tensor& out) {
  const memory::DeviceBuffer partials =
      workspace(reduction_workspace_bytes(kind(), x.numel()), "squared_norm");
  *out.data_as<float>() = reduce<true>(threads_, x, partials.as<double>());
}

}  // namespace porter::nn
