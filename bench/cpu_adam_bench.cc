// zero::CpuAdam at memory speed: parameters per second over 16M parameters (f32 gradients,
// with a bf16 working copy and without) on 1 and 2 threads, as bytes per second against a
// STREAM triad measured in this process (Note [Bench roofline]), beside the cpu device's
// AdamW (kernels::Kernels::adamw) on the same arrays. Each benchmark first checks its kernel
// against the cpu device's, bit for bit.
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
#include "kernels/cpu/isa.h"
#include "memory/caching_allocator.h"
#include "memory/device.h"
#include "kernels/kernels.h"
#include "tensor/tensor.h"
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
      : n(elems),
        params(host_array<float>(n)),
        m(host_array<float>(n)),
        v(host_array<float>(n)),
        grad(host_array<float>(n)),
        out(host_array<uint16_t>(n)) {
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
    a.grad_dtype = tensor::DType::kF32;
    a.out = with_out ? out.get() : nullptr;
    a.out_dtype = tensor::DType::kBF16;
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
kernels::Kernels& device_kernels(int threads) {
  struct Device {
    explicit Device(int t) {
      memory::DeviceOptions o;
      o.kind = memory::DeviceKind::kCpu;
      o.memory_limit_bytes = size_t{1} << 30;
      o.threads = t;
      device = memory::make_device(o);
      allocator = std::make_unique<memory::CachingAllocator>(*device);
      kernels = kernels::make_kernels(*allocator);
    }
    std::unique_ptr<memory::Device> device;
    std::unique_ptr<memory::CachingAllocator> allocator;
    std::unique_ptr<kernels::Kernels> kernels;
  };
  static Device one(1), two(2);
  return threads == 1 ? *one.kernels : *two.kernels;
}

void device_adamw(kernels::Kernels& k, const CpuAdamArrays& a, const kernels::AdamWArgs& args) {
  const tensor::Shape shape{a.elems};
  tensor::Tensor p = tensor::Tensor::from_blob(a.params, shape, tensor::DType::kF32);
  tensor::Tensor m = tensor::Tensor::from_blob(a.exp_avg, shape, tensor::DType::kF32);
  tensor::Tensor v = tensor::Tensor::from_blob(a.exp_avg_sq, shape, tensor::DType::kF32);
  tensor::Tensor g = tensor::Tensor::from_blob(const_cast<void*>(a.grad), shape, a.grad_dtype);
  tensor::Tensor out;
  if (a.out != nullptr) out = tensor::Tensor::from_blob(a.out, shape, a.out_dtype);
  k.adamw(p, g, m, v, args, a.out != nullptr ? &out : nullptr);
}

kernels::AdamWArgs args_at(int64_t step) {
  kernels::AdamWArgs args;
  args.lr = 1e-3f;
  args.weight_decay = 0.01f;
  args.step = step;
  return args;
}

// Copies of the first `n` elements of `a`, so a check leaves the timed arrays alone.
struct Copy {
  Copy(const Arrays& a, int64_t n)
      : p(a.params.get(), a.params.get() + n),
        m(a.m.get(), a.m.get() + n),
        v(a.v.get(), a.v.get() + n),
        g(a.grad.get(), a.grad.get() + n),
        out(n, 0) {}
  CpuAdamArrays view(bool with_out) {
    CpuAdamArrays a;
    a.params = p.data();
    a.exp_avg = m.data();
    a.exp_avg_sq = v.data();
    a.grad = g.data();
    a.out = with_out ? out.data() : nullptr;
    a.out_dtype = tensor::DType::kBF16;
    a.elems = static_cast<int64_t>(p.size());
    return a;
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

// ---- the memory roofline -------------------------------------------------------------

// Note [Bench roofline]
// The roofline is a STREAM triad a = b + s c over three arrays of 512 MiB on 2 threads,
// counted as STREAM counts it: 24 bytes per element. Its stores are non-temporal, as in
// Intel's published STREAM builds: ordinary stores first read each line of a into the cache
// (write-allocate), which the count leaves out, so that triad (reported too, "plain")
// under-states what the memory moves by up to a third. AdamW writes only lines it has just
// read, so it pays no write-allocate either way; the in-place stream a = b + s a (24 bytes,
// reported as "inplace") is the same pattern, and is the second ratio of each AdamW row.
enum class StreamKind { kTriadPlain = 0, kTriad = 1, kInPlace = 2 };

const char* stream_name(StreamKind k) {
  switch (k) {
    case StreamKind::kTriadPlain: return "triad_plain";
    case StreamKind::kTriad: return "triad";
    case StreamKind::kInPlace: return "inplace";
  }
  return "?";
}

void triad_plain(double* __restrict a, const double* __restrict b, const double* __restrict c,
                 int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) a[i] = b[i] + 3.0 * c[i];
}

#if PORTER_CPU_X86
PORTER_CPU_TARGET("avx512f")
void triad_nt_avx512(double* a, const double* b, const double* c, int64_t begin, int64_t end) {
  const __m512d s = _mm512_set1_pd(3.0);
  for (int64_t i = begin; i < end; i += 8) {
    _mm512_stream_pd(a + i,
                     _mm512_add_pd(_mm512_load_pd(b + i), _mm512_mul_pd(s, _mm512_load_pd(c + i))));
  }
  _mm_sfence();
}

void triad_nt_sse2(double* a, const double* b, const double* c, int64_t begin, int64_t end) {
  const __m128d s = _mm_set1_pd(3.0);
  for (int64_t i = begin; i < end; i += 2) {
    _mm_stream_pd(a + i, _mm_add_pd(_mm_load_pd(b + i), _mm_mul_pd(s, _mm_load_pd(c + i))));
  }
  _mm_sfence();
}
#endif

void triad_nt(double* a, const double* b, const double* c, int64_t begin, int64_t end) {
#if PORTER_CPU_X86
  static const bool avx512 = kernels::cpu::cpu_runs("avx512f");
  if (avx512) {
    triad_nt_avx512(a, b, c, begin, end);
  } else {
    triad_nt_sse2(a, b, c, begin, end);
  }
#else
  triad_plain(a, b, c, begin, end);
#endif
}

void inplace_plain(double* __restrict a, const double* __restrict b, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) a[i] = b[i] + 0.5 * a[i];
}

#if PORTER_CPU_X86
PORTER_CPU_TARGET("avx512f")
void inplace_avx512(double* a, const double* b, int64_t begin, int64_t end) {
  const __m512d s = _mm512_set1_pd(0.5);
  for (int64_t i = begin; i < end; i += 8) {
    _mm512_store_pd(a + i,
                    _mm512_add_pd(_mm512_load_pd(b + i), _mm512_mul_pd(s, _mm512_load_pd(a + i))));
  }
}
#endif

// With AVX-512 where the CPU has it: on this class of machine a core's bandwidth grows with
// the width of its loads (fewer instructions per line in flight), so a scalar loop would
// under-state the bound.
void inplace(double* a, const double* b, int64_t begin, int64_t end) {
#if PORTER_CPU_X86
  static const bool avx512 = kernels::cpu::cpu_runs("avx512f");
  if (avx512) {
    inplace_avx512(a, b, begin, end);
    return;
  }
#endif
  inplace_plain(a, b, begin, end);
}

struct Streams {
  Streams()
      : a(host_array<double>(kTriadElems)),
        b(host_array<double>(kTriadElems)),
        c(host_array<double>(kTriadElems)) {
    for (int64_t i = 0; i < kTriadElems; ++i) {
      a[i] = 0.0;
      b[i] = 1.0;
      c[i] = 2.0;
    }
  }
  // One pass of `kind` over all elements on `threads` threads (the caller among them), in
  // chunks that are multiples of 8 elements (a cache line, for the aligned vector code).
  void run(StreamKind kind, int threads) {
    const int64_t chunk = (kTriadElems / threads + 7) / 8 * 8;
    auto part = [this, kind, chunk](int t) {
      const int64_t begin = t * chunk, end = std::min(kTriadElems, begin + chunk);
      switch (kind) {
        case StreamKind::kTriadPlain: triad_plain(a.get(), b.get(), c.get(), begin, end); break;
        case StreamKind::kTriad: triad_nt(a.get(), b.get(), c.get(), begin, end); break;
        case StreamKind::kInPlace: inplace(a.get(), b.get(), begin, end); break;
      }
    };
    std::vector<std::thread> workers;
    for (int t = 1; t < threads; ++t) workers.emplace_back(part, t);
    part(0);
    for (std::thread& w : workers) w.join();
  }
  std::unique_ptr<double[], FreeDeleter> a, b, c;
};

Streams& streams() {
  static Streams s;
  return s;
}

// STREAM's count: 24 bytes per element for either kind.
constexpr double kStreamBytes = 24.0 * static_cast<double>(kTriadElems);

// The bytes/s of `kind` on 2 threads, median of 5 passes, measured once per process.
double stream_bytes_per_s(StreamKind kind) {
  static double measured[3] = {0, 0, 0};
  double& bw = measured[static_cast<int>(kind)];
  if (bw == 0) {
    streams().run(kind, 2);  // warm-up
    std::vector<double> s;
    for (int r = 0; r < 5; ++r) {
      const auto t0 = Clock::now();
      streams().run(kind, 2);
      s.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    }
    std::sort(s.begin(), s.end());
    bw = kStreamBytes / s[2];
  }
  return bw;
}

// args: kind (0 plain triad, 1 triad, 2 in-place), threads.
void BM_Stream(benchmark::State& state) {
  const auto kind = static_cast<StreamKind>(state.range(0));
  const int threads = static_cast<int>(state.range(1));
  Streams& st = streams();
  st.run(StreamKind::kTriad, threads);
  st.run(kind, threads);
  // After a triad, a = 1 + 3 * 2; the in-place pass then makes it 1 + 0.5 * 7.
  const double want = kind == StreamKind::kInPlace ? 4.5 : 7.0;
  if (st.a[0] != want || st.a[kTriadElems - 1] != want) {
    state.SkipWithError("the stream kernel computed a wrong value");
    return;
  }
  state.SetLabel(stream_name(kind));
  for (auto _ : state) {
    st.run(kind, threads);
    benchmark::DoNotOptimize(st.a.get());
    benchmark::ClobberMemory();
  }
  state.counters["GB/s"] = benchmark::Counter(
      kStreamBytes, benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1000);
}
BENCHMARK(BM_Stream)
    ->ArgNames({"kind", "threads"})
    ->ArgsProduct({{0, 1, 2}, {1, 2}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// Times `step(iteration)` and sets the counters: parameters/s, GB/s of the update's bytes
// (Note [CpuAdam roofline]), and their ratios to the 2-thread triad ("roofline") and
// in-place stream ("vs_inplace") of Note [Bench roofline].
template <typename Step>
void time_updates(benchmark::State& state, const CpuAdamArrays& a, Step&& step) {
  const double triad_bw = stream_bytes_per_s(StreamKind::kTriad);
  const double inplace_bw = stream_bytes_per_s(StreamKind::kInPlace);
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
  state.counters["roofline"] = achieved / triad_bw;
  state.counters["vs_inplace"] = achieved / inplace_bw;
  state.counters["triad_GB/s"] = triad_bw / 1e9;
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
  time_updates(state, a, [&](int64_t it) { adam.update(a, args_at(it)); });
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
  kernels::Kernels& k = device_kernels(threads);
  const CpuAdamArrays a = arr.view(with_out);
  time_updates(state, a, [&](int64_t it) { device_adamw(k, a, args_at(it)); });
}
BENCHMARK(BM_DeviceAdamW)
    ->ArgNames({"threads", "bf16_out"})
    ->ArgsProduct({{1, 2}, {0, 1}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

}  // namespace
}  // namespace porter::zero

BENCHMARK_MAIN();
