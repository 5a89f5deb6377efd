// GPU benchmarks of the cuda kernels: matmul TFLOP/s (f32 without TF32, bf16 with f32
// accumulation) and memory-bound kernels in GB/s, each against a device-to-device copy of
// the same bytes measured in the same run. Every benchmark checks its result once before
// timing. Without CUDA, or without a GPU, it says so and exits 0.
#include "base/build_config.h"

#include <iostream>

#if PORTER_WITH_CUDA

#include <benchmark/benchmark.h>

#include <chrono>
#include <cmath>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "memory/caching_allocator.h"
#include "memory/device.h"
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/kernels.h"
#include "tensor/tensor.h"

namespace porter::kernels {

using namespace porter::tensor;
namespace {

// The device, its allocator and kernels, shared by the benchmarks of this binary.
struct Gpu {
  std::unique_ptr<memory::Device> device;
  std::unique_ptr<memory::CachingAllocator> allocator;
  std::unique_ptr<kernels::Kernels> kernels;
  double copy_gbps = 0;  // device-to-device copy, read + write bytes per second / 1e9

  tensor::Tensor random(tensor::Shape shape, DType dtype, float lo = -1.0f, float hi = 1.0f) {
    tensor::Tensor t = tensor::Tensor::empty(*allocator, shape, dtype, memory::Category::kWorkspace);
    std::mt19937 rng(7);
    std::uniform_real_distribution<float> dist(lo, hi);
    std::vector<float> v(static_cast<size_t>(shape.numel()));
    for (auto& x : v) x = dist(rng);
    from_host_f32(*device, v, t);
    return t;
  }
  tensor::Tensor empty(tensor::Shape shape, DType dtype) {
    return tensor::Tensor::empty(*allocator, shape, dtype, memory::Category::kWorkspace);
  }
};

Gpu& gpu() {
  // Leaked on purpose: destroying CUDA state from a static destructor at exit races the
  // runtime's own teardown.
  static Gpu* g = [] {
    auto* env = new Gpu;
    memory::DeviceOptions options;
    options.kind = memory::DeviceKind::kCuda;
    env->device = memory::make_device(options);
    env->allocator = std::make_unique<memory::CachingAllocator>(*env->device);
    env->kernels = kernels::make_cuda_kernels(*env->allocator);
    return env;
  }();
  return *g;
}

constexpr int kRepsPerIteration = 10;  // launches between synchronisations

// Seconds per launch of fn, measured over kRepsPerIteration launches and one sync.
template <typename Fn>
double time_launches(Fn&& fn) {
  Gpu& g = gpu();
  auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < kRepsPerIteration; ++i) fn();
  g.device->compute_stream().synchronize();
  std::chrono::duration<double> d = std::chrono::steady_clock::now() - start;
  return d.count() / kRepsPerIteration;
}

template <typename Fn>
void run_timed(benchmark::State& state, Fn&& fn) {
  fn();  // warm-up: plans, workspace
  gpu().device->compute_stream().synchronize();
  for (auto _ : state) state.SetIterationTime(time_launches(fn));
}

void measure_copy_peak() {
  Gpu& g = gpu();
  const size_t bytes = size_t{256} << 20;
  tensor::Tensor a = g.empty(tensor::Shape{static_cast<int64_t>(bytes / 4)}, DType::kF32);
  tensor::Tensor b = g.empty(tensor::Shape{static_cast<int64_t>(bytes / 4)}, DType::kF32);
  auto copy = [&] { g.device->compute_stream().copy_async(b.data(), a.data(), bytes); };
  copy();
  double best = 1e30;
  for (int i = 0; i < 5; ++i) best = std::min(best, time_launches(copy));
  g.copy_gbps = 2.0 * static_cast<double>(bytes) / best / 1e9;
}

void report_bytes(benchmark::State& state, double bytes_per_launch) {
  state.counters["GB/s"] = benchmark::Counter(bytes_per_launch * static_cast<double>(state.iterations()) / 1e9,
                                              benchmark::Counter::kIsRate);
  state.counters["copy_GB/s"] = gpu().copy_gbps;
}

void check(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error("benchmark self-check failed: " + what);
}

// --- matmul ---------------------------------------------------------------------------------

void BM_Matmul(benchmark::State& state) {
  Gpu& g = gpu();
  const int64_t n = state.range(0);
  const DType dt = state.range(1) == 0 ? DType::kF32 : DType::kBF16;
  tensor::Tensor a = g.random(tensor::Shape{n, n}, dt), b = g.random(tensor::Shape{n, n}, dt);
  tensor::Tensor out = g.empty(tensor::Shape{n, n}, DType::kF32);
  g.kernels->matmul(a, b, out);
  {
    // out[0, 0] and out[n-1, n-1] against a host dot product of the (rounded) inputs.
    std::vector<float> ha = tensor::to_host_f32(*g.device, a), hb = tensor::to_host_f32(*g.device, b);
    std::vector<float> ho = tensor::to_host_f32(*g.device, out);
    for (int64_t idx : {int64_t{0}, n - 1}) {
      double ref = 0, mag = 0;
      for (int64_t k = 0; k < n; ++k) {
        double p = static_cast<double>(ha[idx * n + k]) * hb[k * n + idx];
        ref += p;
        mag += std::abs(p);
      }
      check(std::abs(ref - ho[idx * n + idx]) <= 1e-5 * mag + 1e-6, "matmul element");
    }
  }
  run_timed(state, [&] { g.kernels->matmul(a, b, out); });
  state.counters["TFLOP/s"] = benchmark::Counter(2.0 * n * n * n * static_cast<double>(state.iterations()) / 1e12,
                                                 benchmark::Counter::kIsRate);
}
BENCHMARK(BM_Matmul)->ArgsProduct({{1024, 4096}, {0, 1}})->UseManualTime()->Unit(benchmark::kMicrosecond);

// --- memory-bound kernels -------------------------------------------------------------------

void BM_Copy(benchmark::State& state) {
  Gpu& g = gpu();
  const int64_t n = state.range(0);
  tensor::Tensor a = g.random(tensor::Shape{n}, DType::kF32), b = g.empty(tensor::Shape{n}, DType::kF32);
  run_timed(state, [&] { g.device->compute_stream().copy_async(b.data(), a.data(), a.nbytes()); });
  report_bytes(state, 2.0 * static_cast<double>(a.nbytes()));
}
BENCHMARK(BM_Copy)->Arg(int64_t{64} << 20)->UseManualTime()->Unit(benchmark::kMicrosecond);

void BM_Gelu(benchmark::State& state) {
  Gpu& g = gpu();
  const int64_t n = state.range(0);
  const DType dt = state.range(1) == 0 ? DType::kF32 : DType::kBF16;
  tensor::Tensor x = g.random(tensor::Shape{n}, dt, -4.0f, 4.0f), y = g.empty(tensor::Shape{n}, dt);
  g.kernels->gelu_forward(x, y);
  {
    std::vector<float> hx = tensor::to_host_f32(*g.device, x), hy = tensor::to_host_f32(*g.device, y);
    for (size_t i : {size_t{0}, hx.size() / 2, hx.size() - 1}) {
      double v = hx[i];
      double ref = 0.5 * v * (1 + std::tanh(0.7978845608028654 * (v + 0.044715 * v * v * v)));
      check(std::abs(ref - hy[i]) <= (dt == DType::kF32 ? 1e-5 : 1e-2) * (1 + std::abs(ref)),
            "gelu element");
    }
  }
  run_timed(state, [&] { g.kernels->gelu_forward(x, y); });
  report_bytes(state, static_cast<double>(x.nbytes() + y.nbytes()));
}
BENCHMARK(BM_Gelu)->ArgsProduct({{int64_t{64} << 20}, {0, 1}})->UseManualTime()->Unit(benchmark::kMicrosecond);

void BM_LayerNorm(benchmark::State& state) {
  Gpu& g = gpu();
  const int64_t rows = 8192, cols = state.range(0);
  tensor::Tensor x = g.random(tensor::Shape{rows, cols}, DType::kF32), y = g.empty(tensor::Shape{rows, cols}, DType::kF32);
  tensor::Tensor gamma = g.random(tensor::Shape{cols}, DType::kF32), beta = g.random(tensor::Shape{cols}, DType::kF32);
  tensor::Tensor mean = g.empty(tensor::Shape{rows}, DType::kF32), rstd = g.empty(tensor::Shape{rows}, DType::kF32);
  g.kernels->layernorm_forward(x, gamma, beta, y, mean, rstd);
  {
    std::vector<float> hx = tensor::to_host_f32(*g.device, x), hm = tensor::to_host_f32(*g.device, mean);
    double m = 0;
    for (int64_t c = 0; c < cols; ++c) m += hx[c];
    m /= static_cast<double>(cols);
    check(std::abs(m - hm[0]) <= 1e-5, "layernorm mean");
  }
  run_timed(state, [&] { g.kernels->layernorm_forward(x, gamma, beta, y, mean, rstd); });
  report_bytes(state, static_cast<double>(x.nbytes() + y.nbytes()));
}
BENCHMARK(BM_LayerNorm)->Arg(768)->Arg(4096)->UseManualTime()->Unit(benchmark::kMicrosecond);

// The GPT step benchmark's attention shape: B=4, T=512, C=768, 12 heads.
void BM_AttentionForward(benchmark::State& state) {
  Gpu& g = gpu();
  const int64_t batch = 4, seq = 512, channels = 768;
  const int heads = 12;
  tensor::Tensor qkv = g.random(tensor::Shape{batch, seq, 3 * channels}, DType::kF32);
  tensor::Tensor out = g.empty(tensor::Shape{batch, seq, channels}, DType::kF32);
  tensor::Tensor probs = g.empty(tensor::Shape{batch, heads, seq, seq}, DType::kF32);
  g.kernels->attention_forward(qkv, out, probs, heads);
  {
    // Row 0 of every head attends only to itself: probability exactly 1.
    std::vector<float> hp = tensor::to_host_f32(*g.device, probs);
    check(hp[0] == 1.0f && hp[1] == 0.0f, "attention probs row 0");
  }
  run_timed(state, [&] { g.kernels->attention_forward(qkv, out, probs, heads); });
  const double hd = static_cast<double>(channels) / heads;
  state.counters["TFLOP/s"] = benchmark::Counter(
      4.0 * batch * heads * seq * seq * hd * static_cast<double>(state.iterations()) / 1e12,
      benchmark::Counter::kIsRate);
}
BENCHMARK(BM_AttentionForward)->UseManualTime()->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace porter::kernels

int main(int argc, char** argv) {
  if (!porter::memory::cuda_available()) {
    std::cout << "no GPU visible: cuda kernel benchmarks skipped\n";
    return 0;
  }
  benchmark::Initialize(&argc, argv);
  porter::kernels::measure_copy_peak();
  std::cout << "device-to-device copy peak: " << porter::kernels::gpu().copy_gbps << " GB/s\n";
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}

#else  // !PORTER_WITH_CUDA

int main() {
  std::cout << "built without CUDA: cuda kernel benchmarks skipped\n";
  return 0;
}

#endif  // PORTER_WITH_CUDA
