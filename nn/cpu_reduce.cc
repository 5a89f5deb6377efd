// Whole-tensor reductions on cpu: sum and squared norm, deterministic for any thread count
// (Note [Cpu determinism]: fixed chunks, partials added in order in double).
#include <cstdint>
#include <vector>

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

template <bool kSquare>
float reduce(int threads, const Tensor& x) {
  const int64_t n = x.numel();
  const int64_t chunks = cpu::blocks_of(n);
  std::vector<double> partials(static_cast<size_t>(chunks));
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
  for (double p : partials) total += p;
  return static_cast<float>(total);
}

}  // namespace

void CpuKernels::do_sum(const Tensor& x, Tensor& out) {
  *out.data_as<float>() = reduce<false>(threads_, x);
}

void CpuKernels::do_squared_norm(const Tensor& x, Tensor& out) {
  *out.data_as<float>() = reduce<true>(threads_, x);
}

}  // namespace porter::nn
