// The host tier (Note [Host tier]): blocks and their accounting, lanes and their figures, the
// pinned tier's limit and deferred frees, the pageable tier, and misuse.
#include "memory/host_tier.h"

#include <cstring>
#include <numeric>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "memory/caching_allocator.h"
#include "test_util.h"

namespace porter::memory {
namespace {

using ::testing::HasSubstr;
using testing::make_cpu;

TEST(HostTierTest, PinnedBlocksComeFromThePoolAndAreCountedAtTheirBlockBytes) {
  auto dev = make_cpu(16 * kMiB);
  PinnedPool pool(*dev, 1 * kMiB);
  PinnedHostTier tier(pool);
  EXPECT_EQ(tier.name(), "pinned host memory");
  EXPECT_EQ(tier.limit_key(), "porter.device.pinned_limit");
  EXPECT_EQ(tier.limit_bytes(), 1 * kMiB);
  EXPECT_TRUE(tier.allocate(0).empty());
  {
    HostBlock a = tier.allocate(10000);  // a 12 KiB block
    HostBlock b = tier.allocate(4096);
    EXPECT_EQ(a.size_bytes(), 10000u);
    EXPECT_EQ(tier.block_bytes(a.data()), 12288u);
    EXPECT_EQ(tier.block_bytes(b.data()), 4096u);
    EXPECT_EQ(tier.in_use_bytes(), 12288u + 4096);
    EXPECT_EQ(pool.stats().in_use_bytes, 12288u + 4096);
    EXPECT_EQ(tier.stats().held_bytes, 12288u + 4096);
    a.reset();
    EXPECT_EQ(tier.stats().held_bytes, 4096u);
    EXPECT_EQ(tier.stats().peak_held_bytes, 12288u + 4096);
  }
  EXPECT_EQ(tier.stats().held_bytes, 0u);
  EXPECT_EQ(pool.stats().in_use_bytes, 0u);
}

TEST(HostTierTest, APinnedShortfallNamesTheLimit) {
  auto dev = make_cpu(16 * kMiB);
  PinnedPool pool(*dev, 64 * kKiB);
  PinnedHostTier tier(pool);
  HostBlock a = tier.allocate(48 * kKiB);
  try {
    HostBlock b = tier.allocate(32 * kKiB);
    FAIL() << "expected OutOfMemoryError";
  } catch (const OutOfMemoryError& e) {
    EXPECT_THAT(e.what(), HasSubstr("porter.device.pinned_limit"));
  }
  EXPECT_EQ(tier.stats().held_bytes, 48 * kKiB);  // the failure took nothing
}

TEST(HostTierTest, LanesCopyBothWaysAndCountWhatTheyMoved) {
  auto dev = make_cpu(16 * kMiB, /*link_gbps=*/1.0);
  CachingAllocator alloc(*dev);
  PinnedPool pool(*dev);
  PinnedHostTier tier(pool);
  std::unique_ptr<HostLane> down = tier.open_lane("test.d2h");
  std::unique_ptr<HostLane> up = tier.open_lane("test.h2d");
  EXPECT_EQ(down->name(), "test.d2h");
  EXPECT_EQ(&down->tier(), &tier);

  constexpr size_t kBytes = 256 * kKiB;
  DeviceBuffer src = alloc.allocate(kBytes, Category::kWorkspace);
  DeviceBuffer dst = alloc.allocate(kBytes, Category::kWorkspace);
  std::vector<uint8_t> pattern(kBytes);
  std::iota(pattern.begin(), pattern.end(), uint8_t{7});
  std::memcpy(src.data(), pattern.data(), kBytes);  // cpu device memory is host memory
  HostBlock host = tier.allocate(kBytes);

  down->after(dev->compute_stream());
  down->to_host(host.data(), src.data(), kBytes / 2);
  down->to_host(static_cast<std::byte*>(host.data()) + kBytes / 2,
                static_cast<const std::byte*>(src.data()) + kBytes / 2, kBytes / 2);
  std::unique_ptr<Event> landed = dev->create_event();
  down->record(*landed);
  up->wait(*landed);
  up->to_device(dst.data(), host.data(), kBytes);
  std::unique_ptr<Event> back = dev->create_event();
  up->record(*back);
  up->wait_on(dev->compute_stream(), *back);  // the compute stream (this thread) waits
  EXPECT_GT(up->last_wait_s(), 0.0);          // 512 KiB over a 1 GB/s link
  down->synchronize();
  EXPECT_EQ(std::memcmp(dst.data(), pattern.data(), kBytes), 0);

  const HostTierStats d = down->stats();
  EXPECT_EQ(d.d2h_bytes, kBytes);
  EXPECT_EQ(d.d2h_copies, 2);
  EXPECT_EQ(d.h2d_bytes, 0u);
  EXPECT_EQ(d.waits, 1);
  const HostTierStats u = up->take_stats();
  EXPECT_EQ(u.h2d_bytes, kBytes);
  EXPECT_EQ(u.h2d_copies, 1);
  EXPECT_EQ(u.waits, 1);
  EXPECT_EQ(up->stats(), HostTierStats{});  // taken
  // The tier sees every lane's traffic, and its own blocks.
  const HostTierStats t = tier.stats();
  EXPECT_EQ(t.d2h_bytes, kBytes);
  EXPECT_EQ(t.h2d_bytes, kBytes);
  EXPECT_EQ(t.d2h_copies + t.h2d_copies, 3);
  EXPECT_EQ(t.waits, 2);
  EXPECT_EQ(t.held_bytes, kBytes);
}

TEST(HostTierTest, APinnedBlockFreedWhileALaneReadsItWaitsForTheCopy) {
  auto dev = make_cpu(16 * kMiB, /*link_gbps=*/0.5);
  CachingAllocator alloc(*dev);
  PinnedPool pool(*dev);
  PinnedHostTier tier(pool);
  std::unique_ptr<HostLane> up = tier.open_lane("test.h2d");
  constexpr size_t kBytes = 1 * kMiB;  // 2 ms over the link
  DeviceBuffer dst = alloc.allocate(kBytes, Category::kWorkspace);
  HostBlock host = tier.allocate(kBytes);
  std::memset(host.data(), 0x5a, kBytes);
  up->to_device(dst.data(), host.data(), kBytes);
  host.record_stream(up->stream());
  host.reset();  // deferred until the copy has read it (Note [Deferred free])
  EXPECT_EQ(tier.stats().held_bytes, 0u);
  up->synchronize();
  EXPECT_EQ(pool.stats().in_use_bytes, 0u);
  EXPECT_EQ(static_cast<const uint8_t*>(dst.data())[kBytes - 1], 0x5a);
}

TEST(HostTierTest, PageableBlocksAreZeroedAndHeldAtTheirSize) {
  auto dev = make_cpu(16 * kMiB);
  PageableHostTier tier(*dev);
  EXPECT_EQ(tier.name(), "pageable host memory");
  HostBlock a = tier.allocate(1000);
  const auto* p = static_cast<const uint8_t*>(a.data());
  EXPECT_EQ(std::count(p, p + 1000, uint8_t{0}), 1000);
  EXPECT_EQ(tier.block_bytes(a.data()), 1000u);
  EXPECT_EQ(tier.in_use_bytes(), 1000u);
  EXPECT_EQ(tier.stats().held_bytes, 1000u);
  std::unique_ptr<HostLane> lane = tier.open_lane("test");
  std::vector<uint8_t> device_side(1000, 3);  // cpu device memory is host memory
  lane->to_host(a.data(), device_side.data(), 1000);
  lane->synchronize();
  EXPECT_EQ(p[999], 3);
  EXPECT_EQ(lane->stats().d2h_bytes, 1000u);
  a.reset();
  EXPECT_EQ(tier.in_use_bytes(), 0u);
}

TEST(HostTierTest, MisuseIsCaught) {
  auto dev = make_cpu(16 * kMiB);
  PageableHostTier pageable(*dev);
  HostBlock a = pageable.allocate(64);
  std::unique_ptr<Stream> s = dev->create_stream("s");
  // A pageable block is freed at once, so no stream may be recorded on it.
  EXPECT_THROW(a.record_stream(*s), UsageError);
  int not_a_block = 0;
  EXPECT_THROW(pageable.raw_free(&not_a_block), UsageError);
  EXPECT_THROW(pageable.block_bytes(&not_a_block), UsageError);
  PinnedPool pool(*dev);
  PinnedHostTier pinned(pool);
  EXPECT_THROW(pinned.raw_free(&not_a_block), UsageError);
}

TEST(HostTierTest, StatsAddTrafficAndKeepTheLaterHeldBytesAndTheLargerPeak) {
  HostTierStats a;
  a.d2h_bytes = 10;
  a.h2d_bytes = 1;
  a.d2h_copies = 2;
  a.waits = 1;
  a.wait_s = 0.5;
  a.held_bytes = 100;
  a.peak_held_bytes = 300;
  HostTierStats b;
  b.d2h_bytes = 5;
  b.h2d_bytes = 7;
  b.h2d_copies = 3;
  b.waits = 2;
  b.wait_s = 0.25;
  b.held_bytes = 50;
  b.peak_held_bytes = 200;
  a += b;
  EXPECT_EQ(a.d2h_bytes, 15u);
  EXPECT_EQ(a.h2d_bytes, 8u);
  EXPECT_EQ(a.d2h_copies, 2);
  EXPECT_EQ(a.h2d_copies, 3);
  EXPECT_EQ(a.waits, 3);
  EXPECT_DOUBLE_EQ(a.wait_s, 0.75);
  EXPECT_EQ(a.held_bytes, 50u);
  EXPECT_EQ(a.peak_held_bytes, 300u);
}

// Several threads allocate and free through one tier while lanes copy: the accounting
// returns to zero (run under TSan with the sanitize label).
TEST(HostTierTest, ThreadsShareOneTier) {
  auto dev = make_cpu(16 * kMiB);
  PinnedPool pool(*dev);
  PinnedHostTier tier(pool);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&tier, t] {
      std::unique_ptr<HostLane> lane = tier.open_lane("lane " + std::to_string(t));
      std::vector<uint8_t> src(8192, static_cast<uint8_t>(t));
      for (int i = 0; i < 50; ++i) {
        HostBlock b = tier.allocate(4096 + static_cast<size_t>(i % 3) * 4096);
        lane->to_host(b.data(), src.data(), 4096);
        b.record_stream(lane->stream());
        if (i % 10 == 0) lane->synchronize();
      }
      lane->synchronize();
    });
  }
  for (std::thread& th : threads) th.join();
  const HostTierStats s = tier.stats();
  EXPECT_EQ(s.held_bytes, 0u);
  EXPECT_EQ(s.d2h_copies, 200);
  EXPECT_EQ(s.d2h_bytes, 200u * 4096);
  EXPECT_EQ(s.waits, 4 * 6);
  pool.empty_cache();
  EXPECT_EQ(pool.stats().in_use_bytes, 0u);
}

}  // namespace
}  // namespace porter::memory
