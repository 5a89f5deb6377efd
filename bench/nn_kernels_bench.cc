// cpu kernel benchmarks: matmul GFLOP/s on the GPT's shapes against oneDNN's own sgemm
// (same shape, and a square 2048^3 peak) and elementwise GB/s against a memcpy moving the
// same bytes on the same threads, all measured in this process. Each benchmark checks its
// result once before timing.
#include <benchmark/benchmark.h>

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <oneapi/dnnl/dnnl.h>
#include <random>
#include <vector>

#include "memory/caching_allocator.h"
#include "memory/device.h"
#include "kernels/kernels.h"
#include "tensor/philox.h"

namespace porter::kernels {

using namespace porter::tensor;
namespace {

using Clock = std::chrono::steady_clock;

int bench_threads() {
  const char* env = std::getenv("PORTER_BENCH_THREADS");
  return env != nullptr ? std::max(1, std::atoi(env)) : 2;
}

// One cpu device, allocator and kernels for the whole run.
struct Env {
  Env() {
    memory::DeviceOptions o;
    o.kind = memory::DeviceKind::kCpu;
    o.memory_limit_bytes = size_t{6} << 30;
    o.threads = bench_threads();
    device = memory::make_device(o);
    allocator = std::make_unique<memory::CachingAllocator>(*device);
    kernels = kernels::make_kernels(*allocator);
  }
  tensor::Tensor random(tensor::Shape shape, uint32_t seed, DType dtype = DType::kF32, float lo = -1.0f,
                float hi = 1.0f) {
    std::mt19937 gen(seed);
    std::uniform_real_distribution<float> dist(lo, hi);
    std::vector<float> v(static_cast<size_t>(shape.numel()));
    for (float& x : v) x = dist(gen);
    tensor::Tensor t = tensor::Tensor::empty(*allocator, shape, dtype, memory::Category::kWorkspace);
    from_host_f32(*device, v, t);
    return t;
  }
  tensor::Tensor empty(tensor::Shape shape, DType dtype = DType::kF32) {
    return tensor::Tensor::empty(*allocator, shape, dtype, memory::Category::kWorkspace);
  }
  std::unique_ptr<memory::Device> device;
  std::unique_ptr<memory::CachingAllocator> allocator;
  std::unique_ptr<kernels::Kernels> kernels;
};

Env& env() {
  static Env e;
  return e;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

template <typename Fn>
double median_seconds(int runs, Fn&& fn) {
  fn();  // warm-up
  std::vector<double> t;
  for (int r = 0; r < runs; ++r) {
    auto t0 = Clock::now();
    fn();
    t.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return median(t);
}

// oneDNN's sgemm (row-major) on the bench's thread count.
void sgemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const float* a, const float* b,
           float* c) {
  omp_set_num_threads(bench_threads());
  dnnl_sgemm(ta ? 'T' : 'N', tb ? 'T' : 'N', m, n, k, 1.0f, a, ta ? m : k, b, tb ? k : n, 0.0f,
             c, n);
}

// Square 2048^3 f32 sgemm: the peak a matmul on this machine and thread count can expect.
double sgemm_peak_gflops() {
  static const double peak = [] {
    const int64_t n = 2048;
    std::vector<float> a(n * n, 0.5f), b(n * n, 0.25f), c(n * n);
    double s = median_seconds(5, [&] { sgemm(false, false, n, n, n, a.data(), b.data(), c.data()); });
    return 2.0 * n * n * n / s / 1e9;
  }();
  return peak;
}

void BM_SgemmPeak(benchmark::State& state) {
  const int64_t n = 2048;
  std::vector<float> a(n * n, 0.5f), b(n * n, 0.25f), c(n * n);
  for (auto _ : state) sgemm(false, false, n, n, n, a.data(), b.data(), c.data());
  state.counters["GFLOP/s"] = benchmark::Counter(2.0 * n * n * n, benchmark::Counter::kIsIterationInvariantRate,
                                                 benchmark::Counter::kIs1000);
  state.counters["peak_GFLOP/s"] = sgemm_peak_gflops();
}
BENCHMARK(BM_SgemmPeak)->Unit(benchmark::kMillisecond)->UseRealTime();

// args: m, n, k, trans_a, trans_b, bf16 inputs. Shapes are the GPT's at 2048 tokens, C = 768.
void BM_Matmul(benchmark::State& state) {
  const int64_t m = state.range(0), n = state.range(1), k = state.range(2);
  const bool ta = state.range(3) != 0, tb = state.range(4) != 0, bf16 = state.range(5) != 0;
  Env& e = env();
  const DType dt = bf16 ? DType::kBF16 : DType::kF32;
  tensor::Tensor a = e.random(ta ? tensor::Shape{k, m} : tensor::Shape{m, k}, 1, dt);
  tensor::Tensor b = e.random(tb ? tensor::Shape{n, k} : tensor::Shape{k, n}, 2, dt);
  tensor::Tensor out = e.empty({m, n});
  const MatmulSpec spec{ta, tb, 1.0f, 0.0f};
  // The same problem through oneDNN's sgemm, on f32 copies: the check and the baseline.
  tensor::Tensor a32 = e.empty(a.shape()), b32 = e.empty(b.shape()), ref = e.empty({m, n});
  e.kernels->cast(a, a32);
  e.kernels->cast(b, b32);
  sgemm(ta, tb, m, n, k, a32.data_as<float>(), b32.data_as<float>(), ref.data_as<float>());
  e.kernels->matmul(a, b, out, spec);
  double err = 0, mag = 1e-30;
  for (int64_t i = 0; i < m * n; i += 97) {
    err = std::max(err, double(std::abs(out.data_as<float>()[i] - ref.data_as<float>()[i])));
    mag = std::max(mag, double(std::abs(ref.data_as<float>()[i])));
  }
  if (err / mag > 1e-4) {
    state.SkipWithError("matmul disagrees with oneDNN sgemm");
    return;
  }
  const double flops = 2.0 * m * n * k;
  const double sgemm_s = median_seconds(5, [&] {
    sgemm(ta, tb, m, n, k, a32.data_as<float>(), b32.data_as<float>(), ref.data_as<float>());
  });
  for (auto _ : state) e.kernels->matmul(a, b, out, spec);
  state.counters["GFLOP/s"] = benchmark::Counter(flops, benchmark::Counter::kIsIterationInvariantRate,
                                                 benchmark::Counter::kIs1000);
  state.counters["sgemm_same_shape_GFLOP/s"] = flops / sgemm_s / 1e9;
  state.counters["sgemm_peak_GFLOP/s"] = sgemm_peak_gflops();
}

void matmul_shapes(benchmark::internal::Benchmark* b) {
  const int64_t t = 2048, c = 768;
  for (int bf16 : {0, 1}) {
    b->Args({t, 3 * c, c, 0, 0, bf16});       // qkv forward
    b->Args({t, 4 * c, c, 0, 0, bf16});       // fc1 forward
    b->Args({t, c, 4 * c, 0, 0, bf16});       // fc2 forward
    b->Args({t, 8192, c, 0, 0, bf16});        // head forward (vocab 8192)
    b->Args({t, c, 4 * c, 0, 1, bf16});       // fc1 backward dx = dy W^T
    b->Args({c, 4 * c, t, 1, 0, bf16});       // fc1 backward dW = x^T dy
    b->Args({t, c, 8192, 0, 1, bf16});        // head backward dx
    b->Args({c, 8192, t, 1, 0, bf16});        // head backward dW
  }
  b->ArgNames({"m", "n", "k", "ta", "tb", "bf16"});
}
BENCHMARK(BM_Matmul)->Apply(matmul_shapes)->Unit(benchmark::kMillisecond)->UseRealTime();

// memcpy of `bytes` split over the bench's threads, as the kernels split their work.
double memcpy_gbps(size_t bytes) {
  std::vector<char> src(bytes, 1), dst(bytes, 0);
  const int threads = bench_threads();
  double s = median_seconds(7, [&] {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int i = 0; i < threads; ++i) {
      size_t lo = bytes * i / threads, hi = bytes * (i + 1) / threads;
      std::memcpy(dst.data() + lo, src.data() + lo, hi - lo);
    }
  });
  return 2.0 * bytes / s / 1e9;  // read + write, as the kernels' bytes count both
}

enum Op { kGelu, kGeluBackward, kLayerNorm, kLayerNormBackward, kAdd, kDropout, kBiasAdd };

// args: op, rows, cols. Bytes moved are what the op must read and write at least once.
void BM_Elementwise(benchmark::State& state) {
  const Op op = static_cast<Op>(state.range(0));
  const int64_t rows = state.range(1), cols = state.range(2), n = rows * cols;
  Env& e = env();
  tensor::Tensor x = e.random({rows, cols}, 3, DType::kF32, -3.0f, 3.0f), y = e.empty({rows, cols});
  tensor::Tensor dy = e.random({rows, cols}, 4), g = e.random({cols}, 5), b = e.random({cols}, 6);
  tensor::Tensor mean = e.empty({rows}), rstd = e.empty({rows});
  tensor::Tensor dg = e.empty({cols}), db = e.empty({cols});
  const PhiloxKey key = dropout_key(1, 0, 0, 0, 0);
  double bytes = 0;
  std::function<void()> run;
  switch (op) {
    case kGelu: bytes = 8.0 * n; run = [&] { e.kernels->gelu_forward(x, y); }; break;
    case kGeluBackward: bytes = 12.0 * n; run = [&] { e.kernels->gelu_backward(x, dy, y); }; break;
    case kLayerNorm:
      bytes = 8.0 * n;
      run = [&] { e.kernels->layernorm_forward(x, g, b, y, mean, rstd); };
      break;
    case kLayerNormBackward:
      bytes = 12.0 * n;
      e.kernels->layernorm_forward(x, g, b, y, mean, rstd);
      run = [&] { e.kernels->layernorm_backward(dy, x, g, mean, rstd, y, dg, db); };
      break;
    case kAdd: bytes = 12.0 * n; run = [&] { e.kernels->add(x, dy, y); }; break;
    case kDropout: bytes = 8.0 * n; run = [&] { e.kernels->dropout_forward(x, y, 0.1f, key); }; break;
    case kBiasAdd: bytes = 8.0 * n; run = [&] { e.kernels->bias_add(y, b); }; break;
  }
  // Check once: a few elements against the scalar definition.
  run();
  const float* xp = x.data_as<float>();
  const float* yp = y.data_as<float>();
  for (int64_t i = 0; i < n; i += n / 7 + 1) {
    float want = 0;
    bool check = true;
    switch (op) {
      case kGelu: {
        double v = xp[i];
        want = float(0.5 * v * (1 + std::tanh(std::sqrt(2 / M_PI) * (v + 0.044715 * v * v * v))));
        break;
      }
      case kAdd: want = xp[i] + dy.data_as<float>()[i]; break;
      case kDropout:
        want = tensor::philox_uniform(key, i) >= 0.1f ? xp[i] * (1.0f / 0.9f) : 0.0f;
        break;
      default: check = false;
    }
    if (check && std::abs(yp[i] - want) > 1e-5f * (1 + std::abs(want))) {
      state.SkipWithError("elementwise result disagrees with its definition");
      return;
    }
  }
  const double baseline = memcpy_gbps(static_cast<size_t>(bytes / 2));
  for (auto _ : state) run();
  state.counters["GB/s"] = benchmark::Counter(bytes, benchmark::Counter::kIsIterationInvariantRate,
                                              benchmark::Counter::kIs1000);
  state.counters["memcpy_GB/s"] = baseline;
}

void elementwise_shapes(benchmark::internal::Benchmark* b) {
  const int64_t t = 2048, c = 768;
  b->Args({kGelu, t, 4 * c});
  b->Args({kGeluBackward, t, 4 * c});
  b->Args({kLayerNorm, t, c});
  b->Args({kLayerNormBackward, t, c});
  b->Args({kAdd, t, c});
  b->Args({kDropout, t, c});
  b->Args({kBiasAdd, t, 4 * c});
  b->ArgNames({"op", "rows", "cols"});
}
BENCHMARK(BM_Elementwise)->Apply(elementwise_shapes)->Unit(benchmark::kMicrosecond)->UseRealTime();

// Square 2048^3 bf16 matmul through the kernels (f32 out): the peak the bf16 attention's
// matmuls on this machine and thread count can expect.
double bf16_matmul_peak_gflops() {
  static const double peak = [] {
    const int64_t n = 2048;
    Env& e = env();
    tensor::Tensor a = e.random({n, n}, 11, DType::kBF16), b = e.random({n, n}, 12, DType::kBF16);
    tensor::Tensor c = e.empty({n, n});
    double s = median_seconds(5, [&] { e.kernels->matmul(a, b, c, {false, false, 1.0f, 0.0f}); });
    return 2.0 * n * n * n / s / 1e9;
  }();
  return peak;
}

// args: batch, seq_len, channels, heads, backward, bf16 (qkv, out, dout and dqkv in bf16; the
// probabilities are f32 either way). Causal FLOPs: each of the two forward matmuls does
// B H hd T (T + 1) multiply-adds; backward has four.
void BM_Attention(benchmark::State& state) {
  const int64_t bsz = state.range(0), t = state.range(1), c = state.range(2);
  const int heads = static_cast<int>(state.range(3));
  const bool backward = state.range(4) != 0, bf16 = state.range(5) != 0;
  const DType dt = bf16 ? DType::kBF16 : DType::kF32;
  Env& e = env();
  tensor::Tensor qkv = e.random({bsz, t, 3 * c}, 7, dt), out = e.empty({bsz, t, c}, dt);
  tensor::Tensor probs = e.empty({bsz, heads, t, t}), dout = e.random({bsz, t, c}, 8, dt);
  tensor::Tensor dqkv = e.empty({bsz, t, 3 * c}, dt);
  e.kernels->attention_forward(qkv, out, probs, heads);
  // Check once: every probability row sums to 1.
  for (int64_t r = 0; r < bsz * heads * t; r += 37) {
    double s = 0;
    for (int64_t j = 0; j < t; ++j) s += probs.data_as<float>()[r * t + j];
    if (std::abs(s - 1.0) > 1e-4) {
      state.SkipWithError("attention probabilities do not sum to 1");
      return;
    }
  }
  for (auto _ : state) {
    if (backward) {
      e.kernels->attention_backward(dout, qkv, probs, dqkv, heads);
    } else {
      e.kernels->attention_forward(qkv, out, probs, heads);
    }
  }
  const double flops = (backward ? 4.0 : 2.0) * bsz * c * t * (t + 1);
  state.counters["GFLOP/s"] = benchmark::Counter(flops, benchmark::Counter::kIsIterationInvariantRate,
                                                 benchmark::Counter::kIs1000);
  if (bf16) {
    state.counters["bf16_matmul_peak_GFLOP/s"] = bf16_matmul_peak_gflops();
  } else {
    state.counters["sgemm_peak_GFLOP/s"] = sgemm_peak_gflops();
  }
}
BENCHMARK(BM_Attention)
    ->Args({4, 512, 768, 12, 0, 0})
    ->Args({4, 512, 768, 12, 1, 0})
    ->Args({4, 512, 768, 12, 0, 1})
    ->Args({4, 512, 768, 12, 1, 1})
    ->ArgNames({"B", "T", "C", "heads", "bwd", "bf16"})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

}  // namespace
}  // namespace porter::kernels

BENCHMARK_MAIN();
