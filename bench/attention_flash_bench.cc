// Causal attention forward + backward on cpu: the flash kernels (Note [Flash attention] in
// kernels/kernels.cc) against the materialised attention_forward/backward, B = 1, 12 heads of
// 64, f32 and bf16, T from 512 to 8192. Counters: the bytes each keeps for backward (the
// (B, H, T, T) f32 probabilities against the (B, H, T) f32 lse) and the causal GFLOP/s of the
// materialised products (flash recomputes the scores in backward on top). Each benchmark checks
// once that flash and the materialised path agree on out. Medians: --benchmark_repetitions=5
// --benchmark_report_aggregates_only=true.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <random>
#include <vector>

#include "memory/caching_allocator.h"
#include "memory/device.h"
#include "kernels/kernels.h"

namespace porter::kernels {

using namespace porter::tensor;
namespace {

int bench_threads() {
  const char* env = std::getenv("PORTER_BENCH_THREADS");
  return env != nullptr ? std::max(1, std::atoi(env)) : 2;
}

// One cpu device, allocator and kernels for the whole run; room for T = 8192's 3 GiB of
// probabilities.
struct Env {
  Env() {
    memory::DeviceOptions o;
    o.kind = memory::DeviceKind::kCpu;
    o.memory_limit_bytes = size_t{8} << 30;
    o.threads = bench_threads();
    device = memory::make_device(o);
    allocator = std::make_unique<memory::CachingAllocator>(*device);
    kernels = kernels::make_kernels(*allocator);
  }
  Tensor random(Shape shape, uint32_t seed, DType dtype) {
    std::mt19937 gen(seed);
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    std::vector<float> v(static_cast<size_t>(shape.numel()));
    for (float& x : v) x = dist(gen);
    Tensor t = Tensor::empty(*allocator, shape, dtype, memory::Category::kWorkspace);
    from_host_f32(*device, v, t);
    return t;
  }
  Tensor empty(Shape shape, DType dtype = DType::kF32) {
    return Tensor::empty(*allocator, shape, dtype, memory::Category::kWorkspace);
  }
  std::unique_ptr<memory::Device> device;
  std::unique_ptr<memory::CachingAllocator> allocator;
  std::unique_ptr<kernels::Kernels> kernels;
};

Env& env() {
  static Env e;
  return e;
}

constexpr int kHeads = 12;
constexpr int64_t kHeadDim = 64;

// args: T, flash (1) or materialised (0), bf16.
void BM_AttentionFwdBwd(benchmark::State& state) {
  const int64_t t = state.range(0), c = kHeads * kHeadDim;
  const bool flash = state.range(1) != 0, bf16 = state.range(2) != 0;
  const DType dt = bf16 ? DType::kBF16 : DType::kF32;
  Env& e = env();
  Tensor qkv = e.random({1, t, 3 * c}, 7, dt), dout = e.random({1, t, c}, 8, dt);
  Tensor out = e.empty({1, t, c}, dt), dqkv = e.empty({1, t, 3 * c}, dt);
  const double probs_bytes = static_cast<double>(kHeads) * t * t * 4;
  const double lse_bytes = static_cast<double>(kHeads) * t * 4;
  {
    // Check once, on a short prefix of the sequence, that the two agree.
    const int64_t tc = std::min<int64_t>(t, 256);
    Tensor q = e.random({1, tc, 3 * c}, 9, dt);
    Tensor o1 = e.empty({1, tc, c}), o2 = e.empty({1, tc, c}), lse = e.empty({1, kHeads, tc});
    Tensor probs = e.empty({1, kHeads, tc, tc});
    e.kernels->flash_attention_forward(q, o1, lse, kHeads, kHeads);
    e.kernels->attention_forward(q, o2, probs, kHeads);
    double err = 0;
    for (int64_t i = 0; i < o1.numel(); ++i) {
      err = std::max(err, std::abs(double{o1.data_as<float>()[i]} - o2.data_as<float>()[i]));
    }
    if (err > (bf16 ? 2e-2 : 1e-5)) {
      state.SkipWithError("flash and materialised attention disagree");
      return;
    }
  }
  if (flash) {
    Tensor lse = e.empty({1, kHeads, t});
    for (auto _ : state) {
      e.kernels->flash_attention_forward(qkv, out, lse, kHeads, kHeads);
      e.kernels->flash_attention_backward(dout, qkv, out, lse, dqkv, kHeads, kHeads);
    }
  } else {
    Tensor probs = e.empty({1, kHeads, t, t});
    for (auto _ : state) {
      e.kernels->attention_forward(qkv, out, probs, kHeads);
      e.kernels->attention_backward(dout, qkv, probs, dqkv, kHeads);
    }
  }
  // The causal products: two in forward, four in backward, B H D T (T + 1) multiply-adds each.
  const double flops = 6.0 * c * t * (t + 1);
  state.counters["GFLOP/s"] = benchmark::Counter(flops, benchmark::Counter::kIsIterationInvariantRate,
                                                 benchmark::Counter::kIs1000);
  state.counters["kept_MiB"] = (flash ? lse_bytes : probs_bytes) / (1 << 20);
  state.counters["saved_MiB"] = (probs_bytes - lse_bytes) / (1 << 20);
}

void shapes(benchmark::internal::Benchmark* b) {
  for (int bf16 : {0, 1}) {
    for (int64_t t : {512, 1024, 4096, 8192}) {
      for (int flash : {1, 0}) b->Args({t, flash, bf16});
    }
  }
}

BENCHMARK(BM_AttentionFwdBwd)
    ->Apply(shapes)
    ->ArgNames({"T", "flash", "bf16"})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

}  // namespace
}  // namespace porter::kernels

BENCHMARK_MAIN();
