// The caching allocator: reuse, splitting, coalescing, accounting, out-of-memory.
#include "memory/caching_allocator.h"

#include <sstream>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "memory/allocator_policy.h"
#include "test_util.h"

namespace porter::memory {
namespace {

using ::testing::HasSubstr;
using testing::make_cpu;

TEST(CachingAllocatorTest, ReusesFreedBlockWithoutNewSegment) {
  auto dev = make_cpu(64 * kMiB);
  CachingAllocator alloc(*dev);
  void* a = alloc.raw_allocate(1000, Category::kActivations);
  alloc.raw_free(a);
  void* b = alloc.raw_allocate(900, Category::kActivations);
  EXPECT_EQ(a, b);
  EXPECT_EQ(alloc.stats().num_segment_allocs, 1u);
  alloc.raw_free(b);
}

TEST(CachingAllocatorTest, SmallAndLargePoolsUseSeparateSegments) {
  auto dev = make_cpu(64 * kMiB);
  CachingAllocator alloc(*dev);
  DeviceBuffer small = alloc.allocate(4096, Category::kWorkspace);
  DeviceBuffer large = alloc.allocate(4 * kMiB, Category::kParams);
  auto snap = alloc.snapshot();
  ASSERT_EQ(snap.size(), 2u);
  size_t small_segments = 0;
  for (const auto& s : snap) {
    if (s.small_pool) {
      ++small_segments;
      EXPECT_EQ(s.size_bytes, policy::kSmallBuffer);
    } else {
      EXPECT_EQ(s.size_bytes, policy::kLargeBuffer);
    }
  }
  EXPECT_EQ(small_segments, 1u);
  EXPECT_EQ(alloc.stats().reserved_bytes, policy::kSmallBuffer + policy::kLargeBuffer);
}

TEST(CachingAllocatorTest, BestFitPicksSmallestAdequateBlock) {
  auto dev = make_cpu(64 * kMiB);
  CachingAllocator alloc(*dev);
  // Carve a small segment into [a 8K][sep][b 4K][sep][rest]; free a and b.
  void* a = alloc.raw_allocate(8192, Category::kWorkspace);
  void* s1 = alloc.raw_allocate(512, Category::kWorkspace);
  void* b = alloc.raw_allocate(4096, Category::kWorkspace);
  void* s2 = alloc.raw_allocate(512, Category::kWorkspace);
  alloc.raw_free(a);
  alloc.raw_free(b);
  void* c = alloc.raw_allocate(4000, Category::kWorkspace);
  EXPECT_EQ(c, b) << "a 4000-byte request must take the 4 KiB hole, not the 8 KiB one";
  for (void* p : {c, s1, s2}) alloc.raw_free(p);
}

TEST(CachingAllocatorTest, FragmentationIsResolvedByCoalescing) {
  // The device holds exactly one 20 MiB large segment, so the last request can only be met
  // if the two freed neighbours are merged into one block.
  auto dev = make_cpu(policy::kLargeBuffer);
  CachingAllocator alloc(*dev);
  void* a = alloc.raw_allocate(6 * kMiB, Category::kActivations);
  void* b = alloc.raw_allocate(6 * kMiB, Category::kActivations);
  void* c = alloc.raw_allocate(6 * kMiB, Category::kActivations);
  ASSERT_EQ(alloc.stats().num_segment_allocs, 1u);
  EXPECT_THROW(alloc.raw_allocate(11 * kMiB, Category::kActivations), OutOfMemoryError);
  alloc.raw_free(a);
  alloc.raw_free(b);
  EXPECT_EQ(alloc.stats().largest_free_block_bytes, 12 * kMiB);
  void* d = alloc.raw_allocate(11 * kMiB, Category::kActivations);
  EXPECT_EQ(d, a);
  EXPECT_EQ(alloc.stats().num_segment_allocs, 1u);
  alloc.raw_free(c);
  alloc.raw_free(d);
  auto snap = alloc.snapshot();
  ASSERT_EQ(snap.size(), 1u);
  EXPECT_EQ(snap[0].blocks.size(), 1u) << "all blocks must coalesce back into one";
}

TEST(CachingAllocatorTest, RetagMovesBytesAndTheActivationFootprintCountsBothKinds) {
  auto dev = make_cpu(256 * kMiB);
  CachingAllocator alloc(*dev);
  DeviceBuffer a = alloc.allocate(1000, Category::kActivations);
  DeviceBuffer w = alloc.allocate(300, Category::kWorkspace);
  EXPECT_EQ(alloc.stats().activation_bytes, 1000u);
  a.retag(Category::kCheckpoints);  // stays in the footprint
  w.retag(Category::kActivations);  // enters it
  MemoryStats s = alloc.stats();
  EXPECT_EQ(a.category(), Category::kCheckpoints);
  EXPECT_EQ(s[Category::kActivations].current_bytes, 300u);
  EXPECT_EQ(s[Category::kActivations].live_count, 1u);
  EXPECT_EQ(s[Category::kCheckpoints].current_bytes, 1000u);
  EXPECT_EQ(s[Category::kWorkspace].current_bytes, 0u);
  EXPECT_EQ(s.activation_bytes, 1300u);
  EXPECT_EQ(s.peak_activation_bytes, 1300u);
  EXPECT_EQ(s.requested_bytes, 1300u);
  a.reset();  // freed from the category it was moved to
  s = alloc.stats();
  EXPECT_EQ(s[Category::kCheckpoints].current_bytes, 0u);
  EXPECT_EQ(s.activation_bytes, 300u);
  EXPECT_EQ(s.peak_activation_bytes, 1300u);
  alloc.reset_peak();
  EXPECT_EQ(alloc.stats().peak_activation_bytes, 300u);
  int x = 0;
  EXPECT_THROW(alloc.retag(&x, Category::kParams), UsageError);
}

TEST(CachingAllocatorTest, CategoryAccountingAndPeaks) {
  auto dev = make_cpu(256 * kMiB);
  CachingAllocator alloc(*dev);
  {
    DeviceBuffer p = alloc.allocate(1000, Category::kParams);
    DeviceBuffer g = alloc.allocate(3 * kMiB, Category::kGrads);
    DeviceBuffer g2 = alloc.allocate(100, Category::kGrads);
    MemoryStats s = alloc.stats();
    EXPECT_EQ(s[Category::kParams].current_bytes, 1000u);
    EXPECT_EQ(s[Category::kGrads].current_bytes, 3 * kMiB + 100);
    EXPECT_EQ(s[Category::kGrads].live_count, 2u);
    EXPECT_EQ(s.requested_bytes, 1000 + 3 * kMiB + 100);
    EXPECT_EQ(s.allocated_bytes, 1024 + 3 * kMiB + 512);
  }
  MemoryStats s = alloc.stats();
  EXPECT_EQ(s[Category::kGrads].current_bytes, 0u);
  EXPECT_EQ(s[Category::kGrads].peak_bytes, 3 * kMiB + 100);
  EXPECT_EQ(s[Category::kGrads].alloc_count, 2u);
  EXPECT_EQ(s.peak_requested_bytes, 1000 + 3 * kMiB + 100);
  alloc.reset_peak();
  s = alloc.stats();
  EXPECT_EQ(s[Category::kGrads].peak_bytes, 0u);
  EXPECT_EQ(s.peak_allocated_bytes, 0u);
  EXPECT_EQ(s.peak_reserved_bytes, s.reserved_bytes);
  alloc.empty_cache();
  EXPECT_EQ(alloc.stats().reserved_bytes, 0u);
  EXPECT_EQ(dev->segment_bytes_in_use(), 0u);
}

TEST(CachingAllocatorTest, TimelineRecordsEveryChange) {
  auto dev = make_cpu(64 * kMiB);
  CachingAllocator alloc(*dev);
  void* a = alloc.raw_allocate(100, Category::kActivations);
  void* b = alloc.raw_allocate(200, Category::kCheckpoints);
  alloc.raw_free(a);
  alloc.raw_free(b);
  auto t = alloc.timeline();
  ASSERT_EQ(t.size(), 4u);
  EXPECT_EQ(t[0].category, Category::kActivations);
  EXPECT_EQ(t[0].delta_bytes, 100);
  EXPECT_EQ(t[1].delta_bytes, 200);
  EXPECT_EQ(t[2].delta_bytes, -100);
  EXPECT_EQ(t[2].category_bytes, 0u);
  EXPECT_EQ(t[3].category, Category::kCheckpoints);
  for (size_t i = 1; i < t.size(); ++i) EXPECT_GE(t[i].time_ns, t[i - 1].time_ns);
  std::ostringstream csv;
  alloc.write_timeline_csv(csv);
  EXPECT_THAT(csv.str(), HasSubstr("time_us,category,delta_bytes,category_bytes\n"));
  EXPECT_THAT(csv.str(), HasSubstr(",checkpoints,-200,0\n"));
  alloc.clear_timeline();
  EXPECT_TRUE(alloc.timeline().empty());
}

TEST(CachingAllocatorTest, TimelineCountsDroppedEntries) {
  auto dev = make_cpu(64 * kMiB);
  AllocatorOptions o;
  o.timeline_capacity = 3;
  CachingAllocator alloc(*dev, o);
  for (int i = 0; i < 3; ++i) alloc.raw_free(alloc.raw_allocate(64, Category::kWorkspace));
  EXPECT_EQ(alloc.timeline().size(), 3u);
  std::ostringstream csv;
  alloc.write_timeline_csv(csv);
  EXPECT_THAT(csv.str(), HasSubstr("# 3 entries dropped"));
}

TEST(CachingAllocatorTest, OutOfMemoryMessageAccountsForEveryCategory) {
  auto dev = make_cpu(64 * kMiB);
  CachingAllocator alloc(*dev);
  DeviceBuffer params = alloc.allocate(8 * kMiB, Category::kParams);
  DeviceBuffer acts = alloc.allocate(30 * kMiB, Category::kActivations);
  DeviceBuffer opt = alloc.allocate(12 * kMiB, Category::kOptimizer);
  try {
    alloc.allocate(20 * kMiB, Category::kWorkspace);
    FAIL() << "expected OutOfMemoryError";
  } catch (const OutOfMemoryError& e) {
    std::string m = e.what();
    EXPECT_EQ(e.requested_bytes(), 20 * kMiB);
    for (Category c : kAllCategories) EXPECT_THAT(m, HasSubstr(std::string(category_name(c))));
    EXPECT_THAT(m, HasSubstr("tried to allocate 20.00 MiB (20971520 bytes) for workspace"));
    EXPECT_THAT(m, HasSubstr("capacity            64.00 MiB"));
    EXPECT_THAT(m, HasSubstr("activations 30.00 MiB (31457280 bytes, 1 allocations)"));
    EXPECT_THAT(m, HasSubstr("params      8.00 MiB"));
    EXPECT_THAT(m, HasSubstr("reserved but free"));
    EXPECT_THAT(m, HasSubstr("largest free block"));
    EXPECT_THAT(m, HasSubstr("hint: the largest category is activations"));
    EXPECT_THAT(m, HasSubstr("porter.checkpointing.policy"));
  }
  EXPECT_EQ(alloc.stats().num_ooms, 1u);
  // Consistent afterwards: free something, retry, and it succeeds.
  acts.reset();
  DeviceBuffer retry = alloc.allocate(20 * kMiB, Category::kWorkspace);
  EXPECT_FALSE(retry.empty());
  EXPECT_EQ(alloc.stats()[Category::kWorkspace].current_bytes, 20 * kMiB);
}

TEST(CachingAllocatorTest, RequestLargerThanDeviceNamesTheLimit) {
  auto dev = make_cpu(8 * kMiB);
  CachingAllocator alloc(*dev);
  try {
    alloc.allocate(9 * kMiB, Category::kGrads);
    FAIL();
  } catch (const OutOfMemoryError& e) {
    EXPECT_THAT(e.what(), HasSubstr("porter.device.memory_limit"));
    EXPECT_THAT(e.what(), HasSubstr("zero_optimization.stage>=2"));
  }
}

TEST(CachingAllocatorTest, ReleasesCachedSegmentsBeforeGivingUp) {
  // 40 MiB device: a cached (free) 20 MiB small-request segment must be returned to the
  // device to make room for a 30 MiB request.
  auto dev = make_cpu(40 * kMiB);
  CachingAllocator alloc(*dev);
  alloc.raw_free(alloc.raw_allocate(5 * kMiB, Category::kWorkspace));
  alloc.raw_free(alloc.raw_allocate(512 * kKiB, Category::kWorkspace));
  EXPECT_EQ(alloc.stats().reserved_bytes, policy::kLargeBuffer + policy::kSmallBuffer);
  void* p = alloc.raw_allocate(30 * kMiB, Category::kParams);
  EXPECT_EQ(alloc.stats().reserved_bytes, 30 * kMiB);
  EXPECT_GE(alloc.stats().num_cache_flushes, 1u);
  alloc.raw_free(p);
}

TEST(CachingAllocatorTest, FallsBackToExactSegmentOnNearlyFullDevice) {
  auto dev = make_cpu(policy::kLargeBuffer + 3 * kMiB);
  CachingAllocator alloc(*dev);
  // 19.5 MiB takes a whole 20 MiB segment (a 512 KiB tail is not worth splitting off).
  void* a = alloc.raw_allocate(19 * kMiB + 512 * kKiB, Category::kParams);
  void* b = alloc.raw_allocate(2 * kMiB, Category::kParams);  // 20 MiB no longer fits
  EXPECT_EQ(alloc.stats().reserved_bytes, policy::kLargeBuffer + 2 * kMiB);
  alloc.raw_free(a);
  alloc.raw_free(b);
}

TEST(CachingAllocatorTest, MisuseIsCaught) {
  auto dev = make_cpu(64 * kMiB);
  CachingAllocator alloc(*dev);
  void* a = alloc.raw_allocate(64, Category::kWorkspace);
  alloc.raw_free(a);
  EXPECT_THROW(alloc.raw_free(a), UsageError);
  int local = 0;
  EXPECT_THROW(alloc.raw_free(&local), UsageError);
  EXPECT_THROW(alloc.record_stream(&local, dev->compute_stream()), UsageError);
  alloc.raw_free(nullptr);  // like free(nullptr): a no-op
}

TEST(CachingAllocatorTest, ZeroBytesIsAnEmptyBuffer) {
  auto dev = make_cpu(64 * kMiB);
  CachingAllocator alloc(*dev);
  DeviceBuffer b = alloc.allocate(0, Category::kParams);
  EXPECT_TRUE(b.empty());
  EXPECT_EQ(alloc.stats()[Category::kParams].alloc_count, 0u);
}

TEST(CachingAllocatorTest, BufferSubspanIsBoundsChecked) {
  auto dev = make_cpu(64 * kMiB);
  CachingAllocator alloc(*dev);
  DeviceBuffer b = alloc.allocate(1000, Category::kParams);
  MemorySpan s = b.subspan(100, 900);
  EXPECT_EQ(static_cast<std::byte*>(s.data()) - b.as<std::byte>(), 100);
  EXPECT_EQ(s.subspan(0, 900).size_bytes(), 900u);
  EXPECT_THROW(b.subspan(100, 901), InvalidArgument);
  EXPECT_THROW(s.subspan(901, 0), InvalidArgument);
  EXPECT_THROW(b.subspan(SIZE_MAX, 2), InvalidArgument);
}

TEST(CachingAllocatorTest, DeviceBufferMovesOwnership) {
  auto dev = make_cpu(64 * kMiB);
  CachingAllocator alloc(*dev);
  DeviceBuffer a = alloc.allocate(100, Category::kParams);
  void* p = a.data();
  DeviceBuffer b = std::move(a);
  EXPECT_TRUE(a.empty());  // NOLINT(bugprone-use-after-move): testing the moved-from state
  EXPECT_EQ(b.data(), p);
  b = alloc.allocate(200, Category::kParams);
  EXPECT_EQ(alloc.stats()[Category::kParams].live_count, 1u);
}

}  // namespace
}  // namespace porter::memory
