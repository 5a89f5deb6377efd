// Memory-layer benchmarks: caching allocator against std::malloc on the same mixed-size
// sequence, and copy-stream bandwidth against plain memcpy. Every figure is also reported
// as a ratio to its baseline, measured in the same process before the benchmarks run.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "base/check.h"
#include "base/units.h"
#include "memory/caching_allocator.h"
#include "memory/cpu_device.h"

namespace porter::memory {
namespace {

using Clock = std::chrono::steady_clock;

// A fixed mixed-size workload: 70% small (64 B..64 KiB), 25% medium (64 KiB..2 MiB), 5% large
// (2..16 MiB); each step frees the allocation made kWindow steps earlier, so about kWindow
// allocations are live, as activations and temporaries are in a training step.
constexpr size_t kSteps = 4096;
constexpr size_t kWindow = 64;

const std::vector<size_t>& mixed_sizes() {
  static const std::vector<size_t> sizes = [] {
    std::mt19937 rng(12345);
    std::vector<size_t> v(kSteps);
    for (size_t& n : v) {
      unsigned r = rng() % 100;
      if (r < 70) n = 64 + rng() % (64 * kKiB);
      else if (r < 95) n = 64 * kKiB + rng() % (2 * kMiB);
      else n = 2 * kMiB + rng() % (14 * kMiB);
    }
    return v;
  }();
  return sizes;
}

template <typename Alloc, typename Free>
void run_mixed(Alloc&& alloc, Free&& free_fn) {
  const auto& sizes = mixed_sizes();
  std::vector<void*> live(kWindow, nullptr);
  for (size_t i = 0; i < kSteps; ++i) {
    void*& slot = live[i % kWindow];
    if (slot != nullptr) free_fn(slot);
    slot = alloc(sizes[i]);
    benchmark::DoNotOptimize(slot);
  }
  for (void* p : live) {
    if (p != nullptr) free_fn(p);
  }
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Baselines, measured once per process (median of repeated runs).
double malloc_pairs_per_second() {
  static const double rate = [] {
    std::vector<double> runs;
    for (int r = 0; r < 9; ++r) {
      auto t0 = Clock::now();
      run_mixed([](size_t n) { return std::malloc(n); }, [](void* p) { std::free(p); });
      runs.push_back(kSteps / std::chrono::duration<double>(Clock::now() - t0).count());
    }
    return median(runs);
  }();
  return rate;
}

double memcpy_bytes_per_second(size_t bytes) {
  std::vector<char> src(bytes, 1), dst(bytes, 0);
  std::vector<double> runs;
  for (int r = 0; r < 9; ++r) {
    auto t0 = Clock::now();
    std::memcpy(dst.data(), src.data(), bytes);
    benchmark::ClobberMemory();
    runs.push_back(static_cast<double>(bytes) / std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return median(runs);
}

std::unique_ptr<CpuDevice> make_device(double link_gbps = 0) {
  DeviceOptions o;
  o.memory_limit_bytes = 4 * kGiB;
  o.sim_link_gbps = link_gbps;
  return std::make_unique<CpuDevice>(o);
}

void BM_Malloc_MixedSizes(benchmark::State& state) {
  for (auto _ : state) {
    run_mixed([](size_t n) { return std::malloc(n); }, [](void* p) { std::free(p); });
  }
  state.counters["pairs_per_s"] = benchmark::Counter(double(kSteps) * state.iterations(),
                                                     benchmark::Counter::kIsRate);
}
BENCHMARK(BM_Malloc_MixedSizes)->Unit(benchmark::kMicrosecond);

void BM_CachingAllocator_MixedSizes(benchmark::State& state) {
  auto dev = make_device();
  CachingAllocator alloc(*dev, AllocatorOptions{.record_timeline = state.range(0) != 0});
  auto a = [&](size_t n) { return alloc.raw_allocate(n, Category::kActivations); };
  auto f = [&](void* p) { alloc.raw_free(p); };
  // Check once before timing: the workload runs and returns everything.
  run_mixed(a, f);
  PORTER_CHECK_EQ(alloc.stats().requested_bytes, size_t{0});
  double seconds = 0;
  for (auto _ : state) {
    auto t0 = Clock::now();
    run_mixed(a, f);
    seconds += std::chrono::duration<double>(Clock::now() - t0).count();
    if (state.range(0) != 0) {
      state.PauseTiming();
      alloc.clear_timeline();  // a full timeline stops recording: keep it recording
      state.ResumeTiming();
    }
  }
  state.counters["pairs_per_s"] = benchmark::Counter(double(kSteps) * state.iterations(),
                                                     benchmark::Counter::kIsRate);
  state.counters["x_malloc"] = double(kSteps) * state.iterations() / seconds / malloc_pairs_per_second();
  state.counters["segments"] = double(alloc.stats().num_segments);
  state.counters["reserved_MiB"] = double(alloc.stats().peak_reserved_bytes) / kMiB;
}
BENCHMARK(BM_CachingAllocator_MixedSizes)->Arg(0)->Arg(1)->ArgName("timeline")
    ->Unit(benchmark::kMicrosecond);

void BM_Memcpy(benchmark::State& state) {
  const auto bytes = static_cast<size_t>(state.range(0));
  std::vector<char> src(bytes, 1), dst(bytes, 0);
  for (auto _ : state) {
    std::memcpy(dst.data(), src.data(), bytes);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(int64_t(bytes) * state.iterations());
}
BENCHMARK(BM_Memcpy)->Arg(1 << 20)->Arg(16 << 20)->Arg(64 << 20)->Unit(benchmark::kMicrosecond);

// One copy then a synchronize per iteration: includes the queue round trip.
void BM_CopyStream(benchmark::State& state) {
  const auto bytes = static_cast<size_t>(state.range(0));
  auto dev = make_device();
  auto stream = dev->create_stream("d2h");
  std::vector<char> src(bytes, 1), dst(bytes, 0);
  stream->copy_async(dst.data(), src.data(), bytes);
  stream->synchronize();
  PORTER_CHECK(std::memcmp(dst.data(), src.data(), bytes) == 0, "copy stream corrupted data");
  const double memcpy_peak = memcpy_bytes_per_second(bytes);
  auto t0 = Clock::now();
  for (auto _ : state) {
    stream->copy_async(dst.data(), src.data(), bytes);
    stream->synchronize();
  }
  double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  state.SetBytesProcessed(int64_t(bytes) * state.iterations());
  state.counters["x_memcpy"] = double(bytes) * state.iterations() / seconds / memcpy_peak;
}
BENCHMARK(BM_CopyStream)->Arg(1 << 20)->Arg(16 << 20)->Arg(64 << 20)->Unit(benchmark::kMicrosecond)
    ->UseRealTime();

// A throttled link: achieved bandwidth against the configured one.
void BM_CopyStreamThrottled(benchmark::State& state) {
  const double gbps = double(state.range(0));
  const size_t bytes = 32 << 20;
  auto dev = make_device(gbps);
  auto stream = dev->create_stream("d2h");
  std::vector<char> src(bytes, 1), dst(bytes, 0);
  auto t0 = Clock::now();
  for (auto _ : state) {
    stream->copy_async(dst.data(), src.data(), bytes);
    stream->synchronize();
  }
  double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  state.SetBytesProcessed(int64_t(bytes) * state.iterations());
  state.counters["x_link"] = double(bytes) * state.iterations() / seconds / (gbps * 1e9);
}
BENCHMARK(BM_CopyStreamThrottled)->Arg(2)->Arg(8)->ArgName("gbps")->Unit(benchmark::kMillisecond)
    ->UseRealTime();

}  // namespace
}  // namespace porter::memory

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  // Same-run baselines, printed so that ratios can be read off the table.
  double malloc_rate = porter::memory::malloc_pairs_per_second();
  double memcpy_rate = porter::memory::memcpy_bytes_per_second(64 << 20);
  benchmark::AddCustomContext("baseline_malloc_pairs_per_s", std::to_string(malloc_rate));
  benchmark::AddCustomContext("baseline_memcpy_64MiB_GBps", std::to_string(memcpy_rate / 1e9));
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
