// zero::CpuAdam at memory speed: parameters per second over 16M parameters (f32 gradients,
// with a bf16 working copy and without) on 1 and 2 threads, as bytes per second against a
// STREAM triad measured in this process (the roofline of Note [CpuAdam roofline]), beside
// the cpu device's AdamW (nn::Kernels::adamw) on the same arrays. Each benchmark first
// checks its kernel against the cpu device's, bit for bit.
//
//   ./build/release/bench/cpu_adam_bench --benchmark_repetitions=3
//       --benchmark_report_aggregates_only=true --benchmark_counters_tabular=true
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "base/check.h"
#include "memory/caching_allocator.h"
#include "memory/device.h"
#include "nn/kernels.h"
#include "nn/tensor.h"
#include "zero/cpu_adam.h"

namespace porter::zero {
namespace {

using Clock = std::chrono::steady_clock;

constexpr int64_t kParams = int64_t{16} << 20;
// Doubles per triad array: 3 x 512 MiB, several times any last-level cache.
constexpr int64_t kTriadElems = int64_t{64} << 20;

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};

// n elements of T, 64-byte aligned (a cache line; a zmm vector).
template <typename T>
std::unique_ptr<T[], FreeDeleter> host_array(int64_t n) {
  const size_t bytes = (static_cast<size_t>(n) * sizeof(T) + 63) / 64 * 64;
  auto* p = static_cast<T*>(std::aligned_alloc(64, std::max<size_t>(bytes, 64)));
  PORTER_CHECK(p != nullptr, "cpu_adam_bench: cannot allocate ", bytes, " bytes");
  return std::unique_ptr<T[], FreeDeleter>(p);
}

// A value in [-1, 1) from an index, cheap enough to fill hundreds of MiB.
float hashed(int64_t i, uint32_t seed) {
  uint32_t x = static_cast<uint32_t>(i) * 2654435761u ^ seed;
  x ^= x >> 15;
  x *= 2246822519u;
  x ^= x >> 13;
  return static_cast<float>(x >> 8) * (2.0f / 16777216.0f) - 1.0f;
}

// One AdamW problem: f32 master, moments and gradients, and a bf16 working copy.
struct Arrays {
  explicit Arrays(int64_t elems)
      : n(elems), params(host_array<float>(n)), m(host_array<float>(n)), v(host_array<float>(n)),
        grad(host_array<float>(n)), out(host_array<uint16_t>(n)) {
    for (int64_t i = 0; i < n; ++i) {  // first touch here, on the main thread
      params[i] = hashed(i, 1);
      m[i] = 0.1f * hashed(i, 2);
      v[i] = 0.01f * (hashed(i, 3) + 1.0f);
      grad[i] = hashed(i, 4);
      out[i] = 0;
    }
  }
  CpuAdamArrays view(bool with_out) const {
    CpuAdamArrays a;
    a.params = params.get();
    a.exp_avg = m.get();
    a.exp_avg_sq = v.get();
    a.grad = grad.get();
    a.grad_dtype = nn::DType::kF32;
    a.out = with_out ? out.get() : nullptr;
    a.out_dtype = nn::DType::kBF16;
    a.elems = n;
    return a;
  }
  int64_t n;
  std::unique_ptr<float[], FreeDeleter> params, m, v, grad;
  std::unique_ptr<uint16_t[], FreeDeleter> out;
};

Arrays& arrays(int64_t n) {
  static Arrays a16(kParams);
  static Arrays a64(4 * kParams);
  PORTER_CHECK(n == a16.n || n == a64.n, "cpu_adam_bench: no arrays of ", n, " elements");
  return n == a16.n ? a16 : a64;
}

// The cpu device's kernels with `threads` OpenMP threads.
nn::Kernels& device_kernels(int threads) {
  struct Device {
    explicit Device(int t) {
      memory::DeviceOptions o;
      o.kind = memory::DeviceKind::kCpu;
      o.memory_limit_bytes = size_t{1} << 30;
      o.threads = t;
      device = memory::make_device(o);
      allocator = std::make_unique<memory::CachingAllocator>(*device);
      kernels = nn::make_kernels(*allocator);
    }
    std::unique_ptr<memory::Device> device;
    std::unique_ptr<memory::CachingAllocator> allocator;
    std::unique_ptr<nn::Kernels> kernels;
  };
  static Device one(1), two(2);
  return threads == 1 ? *one.kernels : *two.kernels;
}

void device_adamw(nn::Kernels& k, const CpuAdamArrays& a, const nn::AdamWArgs& args) {
  const nn::Shape shape{a.elems};
  nn::Tensor p = nn::Tensor::from_blob(a.params, shape, nn::DType::kF32);
  nn::Tensor m = nn::Tensor::from_blob(a.exp_avg, shape, nn::DType::kF32);
  nn::Tensor v = nn::Tensor::from_blob(a.exp_avg_sq, shape, nn::DType::kF32);
  nn::Tensor g = nn::Tensor::from_blob(const_cast<void*>(a.grad), shape, a.grad_dtype);
  nn::Tensor out;
  if (a.out != nullptr) out = nn::Tensor::from_blob(a.out, shape, a.out_dtype);
  k.adamw(p, g, m, v, args, a.out != nullptr ? &out : nullptr);
}

nn::AdamWArgs args_at(int64_t step) {
  nn::AdamWArgs args;
  args.lr = 1e-3f;
  args.weight_decay = 0.01f;
  args.step = step;
  return args;
}

// Copies of the first `n` elements of `a`, so a check leaves the timed arrays alone.
struct Copy {
  Copy(const Arrays& a, int64_t n) : p(a.params.get(), a.params.get() + n), m(a.m.get(), a.m.get() + n),
        v(a.v.get(), a.v.get() + n), g(a.grad.get(), a.grad.get() + n), out(n, 0) {}
  CpuAdamArrays view(bool with_out) {
    return {p.data(), m.data(), v.data(), g.data(), nn::DType::kF32,
            with_out ? out.data() : nullptr, nn::DType::kBF16, static_cast<int64_t>(p.size())};
  }
  bool operator==(const Copy& o) const { return p == o.p && m == o.m && v == o.v && out == o.out; }
  std::vector<float> p, m, v, g;
  std::vector<uint16_t> out;
};

// Whether CpuAdam on `threads` threads gives the cpu device's bits on a prefix of `a`.
bool matches_device(const Arrays& a, int threads, bool with_out) {
  const int64_t n = std::min<int64_t>(a.n, (int64_t{1} << 20) + 3);
  Copy mine(a, n), theirs(a, n);
  CpuAdam adam({.threads = threads});
  adam.update(mine.view(with_out), args_at(3));
  device_adamw(device_kernels(threads), theirs.view(with_out), args_at(3));
  return mine == theirs;
}

// ---- the triad ---------------------------------------------------------------------------

void triad_range(double* __restrict a, const double* __restrict b, const double* __restrict c,
                 double s, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) a[i] = b[i] + s * c[i];
}

struct Triad {
  Triad() : a(host_array<double>(kTriadElems)), b(host_array<double>(kTriadElems)),
            c(host_array<double>(kTriadElems)) {
    for (int64_t i = 0; i < kTriadElems; ++i) {
      a[i] = 0.0;
      b[i] = 1.0;
      c[i] = 2.0;
    }
  }
  // One a = b + s c over all elements, on `threads` threads (the caller among them).
  void run(int threads) {
    std::vector<std::thread> workers;
    const int64_t chunk = (kTriadElems + threads - 1) / threads;
    for (int t = 1; t < threads; ++t) {
      workers.emplace_back([this, t, chunk] {
        triad_range(a.get(), b.get(), c.get(), 3.0, t * chunk, std::min(kTriadElems, (t + 1) * chunk));
      });
    }
    triad_range(a.get(), b.get(), c.get(), 3.0, 0, std::min(kTriadElems, chunk));
    for (std::thread& w : workers) w.join();
  }
  std::unique_ptr<double[], FreeDeleter> a, b, c;
};

Triad& triad() {
  static Triad t;
  return t;
}

// STREAM's count: 24 bytes per element (read b and c, write a; not the write-allocate read
// of a, which the hardware adds).
constexpr double kTriadBytes = 24.0 * static_cast<double>(kTriadElems);

// The triad's bytes/s on `threads` threads, median of 5 runs, measured once per process.
double triad_bytes_per_s(int threads) {
  static double measured[3] = {0, 0, 0};
  PORTER_CHECK(threads >= 1 && threads <= 2, "cpu_adam_bench: triad on 1 or 2 threads");
  double& bw = measured[threads];
  if (bw == 0) {
    triad().run(threads);  // warm-up
    std::vector<double> s;
    for (int r = 0; r < 5; ++r) {
      const auto t0 = Clock::now();
      triad().run(threads);
      s.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    }
    std::sort(s.begin(), s.end());
    bw = kTriadBytes / s[2];
  }
  return bw;
}

// args: threads.
void BM_Triad(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  Triad& t = triad();
  t.run(threads);
  if (t.a[kTriadElems - 1] != 7.0 || t.a[0] != 7.0) {
    state.SkipWithError("the triad computed a wrong value");
    return;
  }
  for (auto _ : state) {
    t.run(threads);
    benchmark::DoNotOptimize(t.a.get());
    benchmark::ClobberMemory();
  }
  state.counters["GB/s"] = benchmark::Counter(kTriadBytes, benchmark::Counter::kIsIterationInvariantRate,
                                              benchmark::Counter::kIs1000);
}
BENCHMARK(BM_Triad)->ArgName("threads")->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();

// Times `step(iteration)` and sets the rate counters: parameters/s, GB/s of the update's
// bytes (Note [CpuAdam roofline]), and the ratio to the 2-thread triad ("roofline") and to
// the triad on the same thread count ("roofline_t").
template <typename Step>
void time_updates(benchmark::State& state, const CpuAdamArrays& a, int threads, Step&& step) {
  const double bw2 = triad_bytes_per_s(2), bwt = triad_bytes_per_s(threads);
  const auto bytes = static_cast<double>(cpu_adam_bytes(a));
  int64_t iteration = 0;
  const auto t0 = Clock::now();
  for (auto _ : state) {
    step(++iteration);
    benchmark::ClobberMemory();
  }
  const double s = std::chrono::duration<double>(Clock::now() - t0).count();
  const double achieved = bytes * static_cast<double>(iteration) / s;
  state.counters["params/s"] = benchmark::Counter(static_cast<double>(a.elems),
                                                  benchmark::Counter::kIsIterationInvariantRate,
                                                  benchmark::Counter::kIs1000);
  state.counters["GB/s"] = benchmark::Counter(bytes, benchmark::Counter::kIsIterationInvariantRate,
                                              benchmark::Counter::kIs1000);
  state.counters["roofline"] = achieved / bw2;
  state.counters["roofline_t"] = achieved / bwt;
  state.counters["triad_GB/s"] = bwt / 1e9;
}

// args: parameters, threads, bf16 working copy (0/1).
void BM_CpuAdam(benchmark::State& state) {
  const int64_t n = state.range(0);
  const int threads = static_cast<int>(state.range(1));
  const bool with_out = state.range(2) != 0;
  Arrays& arr = arrays(n);
  if (!matches_device(arr, threads, with_out)) {
    state.SkipWithError("CpuAdam differs from the cpu device's AdamW");
    return;
  }
  CpuAdam adam({.threads = threads});
  state.SetLabel(std::string(adam.isa()));
  const CpuAdamArrays a = arr.view(with_out);
  time_updates(state, a, threads, [&](int64_t it) { adam.update(a, args_at(it)); });
}
BENCHMARK(BM_CpuAdam)
    ->ArgNames({"params", "threads", "bf16_out"})
    ->ArgsProduct({{kParams}, {1, 2}, {0, 1}})
    ->Args({4 * kParams, 2, 0})
    ->Args({4 * kParams, 2, 1})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// The cpu device's AdamW on the same arrays: args threads, bf16 working copy (0/1).
void BM_DeviceAdamW(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  const bool with_out = state.range(1) != 0;
  Arrays& arr = arrays(kParams);
  if (!matches_device(arr, threads, with_out)) {
    state.SkipWithError("CpuAdam differs from the cpu device's AdamW");
    return;
  }
  nn::Kernels& k = device_kernels(threads);
  const CpuAdamArrays a = arr.view(with_out);
  time_updates(state, a, threads, [&](int64_t it) { device_adamw(k, a, args_at(it)); });
}
BENCHMARK(BM_DeviceAdamW)
    ->ArgNames({"threads", "bf16_out"})
    ->ArgsProduct({{1, 2}, {0, 1}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

}  // namespace
}  // namespace porter::zero

BENCHMARK_MAIN();
