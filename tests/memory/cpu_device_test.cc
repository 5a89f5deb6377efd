// The simulated device: hard capacities, FIFO copy streams, events, waits, the throttle.
#include "memory/cpu_device.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <numeric>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "test_util.h"

namespace porter::memory {
namespace {

using Clock = std::chrono::steady_clock;
using testing::make_cpu;

std::vector<uint8_t> pattern(size_t n, uint8_t seed) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>(seed + i * 31 + (i >> 9));
  return v;
}

TEST(CpuDeviceTest, SegmentCapacityIsHard) {
  auto dev = make_cpu(10 * kMiB);
  void* a = dev->allocate_segment(6 * kMiB);
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a) % CpuDevice::kSegmentAlignment, 0u);
  EXPECT_EQ(dev->allocate_segment(5 * kMiB), nullptr);
  void* b = dev->allocate_segment(4 * kMiB);
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(dev->segment_bytes_in_use(), 10 * kMiB);
  EXPECT_EQ(dev->allocate_segment(1), nullptr);
  dev->free_segment(a, 6 * kMiB);
  dev->free_segment(b, 4 * kMiB);
  EXPECT_EQ(dev->segment_bytes_in_use(), 0u);
}

TEST(CpuDeviceTest, PinnedLimitIsSeparate) {
  auto dev = make_cpu(64 * kMiB, 0, /*pinned_bytes=*/2 * kMiB);
  void* p = dev->allocate_pinned(2 * kMiB);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(dev->allocate_pinned(4096), nullptr);
  void* s = dev->allocate_segment(32 * kMiB);
  EXPECT_NE(s, nullptr) << "pinned use must not count against device capacity";
  dev->free_pinned(p, 2 * kMiB);
  dev->free_segment(s, 32 * kMiB);
}

TEST(CpuDeviceTest, DescriptionNamesLimits) {
  auto dev = make_cpu(3 * kGiB, 12.5);
  EXPECT_THAT(dev->description(), ::testing::HasSubstr("capacity 3.00 GiB"));
  EXPECT_THAT(dev->description(), ::testing::HasSubstr("link 12.5 GB/s"));
}

TEST(CpuDeviceTest, CopyStreamRunsInFifoOrder) {
  auto dev = make_cpu(64 * kMiB);
  auto s = dev->create_stream("d2h");
  auto a = pattern(1 * kMiB, 3);
  std::vector<uint8_t> b(a.size()), c(a.size());
  s->copy_async(b.data(), a.data(), a.size());
  s->copy_async(c.data(), b.data(), b.size());  // depends on the first copy
  s->synchronize();
  EXPECT_EQ(c, a);
}

TEST(CpuDeviceTest, EventCompletesWhenStreamReachesIt) {
  auto dev = make_cpu(64 * kMiB, /*link_gbps=*/0.25);
  auto s = dev->create_stream("d2h");
  auto ev = dev->create_event();
  EXPECT_TRUE(ev->query()) << "an event never recorded is complete";
  auto src = pattern(4 * kMiB, 9);
  std::vector<uint8_t> dst(src.size());
  s->copy_async(dst.data(), src.data(), src.size());  // ~17 ms at 0.25 GB/s
  s->record(*ev);
  EXPECT_FALSE(ev->query());
  ev->synchronize();
  EXPECT_TRUE(ev->query());
  EXPECT_EQ(dst, src);
}

TEST(CpuDeviceTest, StreamWaitOrdersAcrossStreams) {
  auto dev = make_cpu(64 * kMiB, 0.25);
  auto s1 = dev->create_stream("h2d");
  auto s2 = dev->create_stream("d2h");
  auto ev = dev->create_event();
  auto src = pattern(2 * kMiB, 1);
  std::vector<uint8_t> mid(src.size()), out(src.size());
  s1->copy_async(mid.data(), src.data(), src.size());
  s1->record(*ev);
  s2->wait(*ev);  // without this, s2 would copy `mid` before s1 filled it
  s2->copy_async(out.data(), mid.data(), mid.size());
  s2->synchronize();
  EXPECT_EQ(out, src);
}

TEST(CpuDeviceTest, ComputeStreamWaitBlocksTheCaller) {
  auto dev = make_cpu(64 * kMiB, 0.25);
  auto s = dev->create_stream("h2d");
  auto ev = dev->create_event();
  auto src = pattern(2 * kMiB, 5);
  std::vector<uint8_t> dst(src.size());
  s->copy_async(dst.data(), src.data(), src.size());
  s->record(*ev);
  dev->compute_stream().wait(*ev);
  EXPECT_TRUE(ev->query());
  EXPECT_EQ(dst, src);
}

TEST(CpuDeviceTest, WaitCapturesTheRecordAtCallTime) {
  auto dev = make_cpu(64 * kMiB, 0.25);
  auto s1 = dev->create_stream("a");
  auto s2 = dev->create_stream("b");
  auto ev = dev->create_event();
  dev->compute_stream().record(*ev);  // already complete
  s2->wait(*ev);
  std::vector<uint8_t> big(4 * kMiB), sink(big.size());
  s1->copy_async(sink.data(), big.data(), big.size());
  s1->record(*ev);  // a later record must not hold back the earlier wait
  std::atomic<bool> ran{false};
  s2->host_callback([&] { ran = true; });
  s2->synchronize();
  EXPECT_TRUE(ran);
  EXPECT_FALSE(ev->query()) << "s2 finished before s1's copy: the wait did not block on it";
  s1->synchronize();
}

TEST(CpuDeviceTest, CallbackErrorsSurfaceOnSynchronize) {
  auto dev = make_cpu(64 * kMiB);
  auto s = dev->create_stream("d2h");
  std::vector<int> order;
  s->host_callback([&] { order.push_back(1); });
  s->host_callback([] { throw IoError("disk on fire"); });
  s->host_callback([&] { order.push_back(3); });
  EXPECT_THROW(s->synchronize(), IoError);
  EXPECT_EQ(order, (std::vector<int>{1, 3}));
  EXPECT_NO_THROW(s->synchronize()) << "an error is reported once";
}

// The throttle can only slow copies down: pick a link rate well below what this build's
// memcpy achieves (sanitizer builds copy 10-50x slower), so the link, not memcpy, dominates.
double link_rate_for_this_host() {
  auto dev = make_cpu(64 * kMiB);
  auto s = dev->create_stream("probe");
  std::vector<uint8_t> src(8 * kMiB, 3), dst(src.size());
  s->copy_async(dst.data(), src.data(), src.size());  // warm the pages
  s->synchronize();
  auto t0 = Clock::now();
  s->copy_async(dst.data(), src.data(), src.size());
  s->synchronize();
  double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  double raw_gbps = static_cast<double>(src.size()) / seconds / 1e9;
  return std::min(0.5, raw_gbps / 4);
}

// Copies `copies` x `bytes` on a stream throttled to `gbps`; returns the achieved GB/s.
double measure_throttled(double gbps, size_t bytes, int copies) {
  auto dev = make_cpu(64 * kMiB, gbps);
  auto s = dev->create_stream("d2h");
  std::vector<uint8_t> src(bytes, 7), dst(bytes);
  auto t0 = Clock::now();
  for (int i = 0; i < copies; ++i) s->copy_async(dst.data(), src.data(), bytes);
  s->synchronize();
  double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  EXPECT_EQ(dst, src);
  return copies * static_cast<double>(bytes) / seconds / 1e9;
}

// A throttle must never exceed its rate, so every run is checked against the upper bound. A
// loaded machine can only make a run slower (the worker thread is not scheduled), so the
// lower bound holds for the best of three runs.
template <typename Measure>
void expect_within_20_percent(double gbps, Measure&& measure) {
  double best = 0;
  for (int run = 0; run < 3; ++run) {
    double got = measure();
    EXPECT_LT(got, 1.2 * gbps) << "configured " << gbps << " GB/s";
    best = std::max(best, got);
  }
  EXPECT_GT(best, 0.8 * gbps) << "configured " << gbps << " GB/s";
}

TEST(CpuDeviceTest, ThrottledCopyMatchesConfiguredBandwidth) {
  const double gbps = link_rate_for_this_host();
  // About 80 ms of link time: long against scheduler jitter, short for the suite.
  const auto bytes = static_cast<size_t>(gbps * 1e9 * 0.08);
  expect_within_20_percent(gbps, [&] { return measure_throttled(gbps, bytes, 1); });
}

TEST(CpuDeviceTest, BackToBackThrottledCopiesShareTheLink) {
  const double gbps = link_rate_for_this_host();
  const auto bytes = static_cast<size_t>(gbps * 1e9 * 0.02);
  expect_within_20_percent(gbps, [&] { return measure_throttled(gbps, bytes, 4); });
}

TEST(CpuDeviceTest, DestructionDrainsQueuedWork) {
  auto dev = make_cpu(64 * kMiB, 1.0);
  std::vector<uint8_t> src(1 * kMiB, 42), dst(src.size());
  {
    auto s = dev->create_stream("d2h");
    s->copy_async(dst.data(), src.data(), src.size());
  }
  EXPECT_EQ(dst, src);
}

TEST(CpuDeviceTest, RejectsBadOptions) {
  DeviceOptions o;
  o.sim_link_gbps = -1;
  EXPECT_THROW(CpuDevice{o}, InvalidArgument);
  o.sim_link_gbps = 0;
  o.threads = -2;
  EXPECT_THROW(CpuDevice{o}, InvalidArgument);
}

TEST(CpuDeviceTest, EventsOfAnotherKindAreRejected) {
  struct ForeignEvent final : Event {
    bool query() const override { return true; }
    void synchronize() const override {}
  } foreign;
  auto dev = make_cpu(64 * kMiB);
  auto s = dev->create_stream("x");
  EXPECT_THROW(s->record(foreign), UsageError);
  EXPECT_THROW(dev->compute_stream().wait(foreign), UsageError);
}

}  // namespace
}  // namespace porter::memory
