// The pinned host pool: reuse by size, the limit, clear exhaustion errors, misuse.
#include "memory/pinned_pool.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "test_util.h"

namespace porter::memory {
namespace {

using ::testing::HasSubstr;
using testing::make_cpu;

TEST(PinnedPoolTest, ReusesBuffersBySize) {
  auto dev = make_cpu(16 * kMiB);
  PinnedPool pool(*dev);
  void* a = pool.raw_allocate(10000);
  pool.raw_free(a);
  void* b = pool.raw_allocate(9000);  // both round to 12 KiB
  EXPECT_EQ(a, b);
  PinnedStats s = pool.stats();
  EXPECT_EQ(s.num_allocs, 2u);
  EXPECT_EQ(s.num_reused, 1u);
  EXPECT_EQ(s.num_device_allocs, 1u);
  EXPECT_EQ(s.in_use_bytes, 12288u);
  pool.raw_free(b);
}

TEST(PinnedPoolTest, DoesNotHandOutBuffersMuchLargerThanAsked) {
  auto dev = make_cpu(16 * kMiB);
  PinnedPool pool(*dev);
  PinnedBuffer big = pool.allocate(1 * kMiB);
  void* big_ptr = big.data();
  big.reset();
  PinnedBuffer small = pool.allocate(4096);
  EXPECT_NE(small.data(), big_ptr);
  EXPECT_EQ(pool.stats().cached_bytes, 1 * kMiB);
}

// block_bytes is what the pool holds for a buffer: the rounded request for a new block, the
// whole cached block when a larger one is reused.
TEST(PinnedPoolTest, BlockBytesAreTheBlocksCapacity) {
  auto dev = make_cpu(16 * kMiB);
  PinnedPool pool(*dev);
  PinnedBuffer fresh = pool.allocate(10000);
  EXPECT_EQ(pool.block_bytes(fresh.data()), 12288u);
  EXPECT_EQ(fresh.size_bytes(), 10000u);
  PinnedBuffer larger = pool.allocate(7 * 4096);
  larger.reset();
  PinnedBuffer reused = pool.allocate(4 * 4096);  // the cached 28 KiB block, within twice
  EXPECT_EQ(pool.stats().num_reused, 1u);
  EXPECT_EQ(pool.block_bytes(reused.data()), 7u * 4096);
  EXPECT_EQ(pool.stats().in_use_bytes, pool.block_bytes(fresh.data()) + pool.block_bytes(reused.data()));
  void* gone = reused.data();
  reused.reset();
  EXPECT_THROW(pool.block_bytes(gone), UsageError);
  int not_pinned = 0;
  EXPECT_THROW(pool.block_bytes(&not_pinned), UsageError);
}

TEST(PinnedPoolTest, ExhaustionIsAClearError) {
  auto dev = make_cpu(16 * kMiB);
  PinnedPool pool(*dev, /*limit_bytes=*/1 * kMiB);
  PinnedBuffer a = pool.allocate(600 * kKiB);
  try {
    pool.allocate(600 * kKiB);
    FAIL() << "expected OutOfMemoryError";
  } catch (const OutOfMemoryError& e) {
    EXPECT_THAT(e.what(), HasSubstr("pinned host memory exhausted"));
    EXPECT_THAT(e.what(), HasSubstr("tried to allocate 600.00 KiB (614400 bytes)"));
    EXPECT_THAT(e.what(), HasSubstr("limit      1.00 MiB (porter.device.pinned_limit)"));
    EXPECT_THAT(e.what(), HasSubstr("in use     600.00 KiB in 1 buffer(s)"));
    EXPECT_THAT(e.what(), HasSubstr("hint: raise porter.device.pinned_limit"));
  }
  a.reset();
  PinnedBuffer b = pool.allocate(600 * kKiB);  // usable again after a free
  EXPECT_FALSE(b.empty());
}

TEST(PinnedPoolTest, DropsCacheToStayWithinLimit) {
  auto dev = make_cpu(16 * kMiB);
  PinnedPool pool(*dev, 1 * kMiB);
  pool.allocate(600 * kKiB).reset();  // cached
  PinnedBuffer b = pool.allocate(800 * kKiB);
  EXPECT_FALSE(b.empty());
  EXPECT_EQ(pool.stats().cached_bytes, 0u);
  EXPECT_EQ(dev->pinned_bytes_in_use(), 800 * kKiB);
}

TEST(PinnedPoolTest, DeviceRefusalIsAClearError) {
  auto dev = make_cpu(16 * kMiB, 0, /*pinned_bytes=*/1 * kMiB);
  PinnedPool pool(*dev, 4 * kMiB);
  try {
    pool.allocate(2 * kMiB);
    FAIL();
  } catch (const OutOfMemoryError& e) {
    EXPECT_THAT(e.what(), HasSubstr("the device refused the allocation"));
  }
}

TEST(PinnedPoolTest, LimitDefaultsToDevicePinnedCapacity) {
  auto dev = make_cpu(16 * kMiB, 0, 3 * kMiB);
  PinnedPool pool(*dev);
  EXPECT_EQ(pool.stats().limit_bytes, 3 * kMiB);
}

TEST(PinnedPoolTest, MisuseIsCaught) {
  auto dev = make_cpu(16 * kMiB);
  PinnedPool pool(*dev);
  void* p = pool.raw_allocate(100);
  pool.raw_free(p);
  EXPECT_THROW(pool.raw_free(p), UsageError);
  EXPECT_THROW(pool.record_stream(p, dev->compute_stream()), UsageError);
  EXPECT_TRUE(pool.allocate(0).empty());
}

TEST(PinnedPoolTest, EmptyCacheReturnsEverything) {
  auto dev = make_cpu(16 * kMiB);
  PinnedPool pool(*dev);
  for (size_t n : {4096u, 70000u, 1u << 20}) pool.allocate(n).reset();
  EXPECT_GT(dev->pinned_bytes_in_use(), 0u);
  pool.empty_cache();
  EXPECT_EQ(dev->pinned_bytes_in_use(), 0u);
  EXPECT_EQ(pool.stats().cached_bytes, 0u);
}

}  // namespace
}  // namespace porter::memory
