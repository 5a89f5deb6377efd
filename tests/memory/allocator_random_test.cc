// Randomised alloc/free sequences checked against a reference model after every step:
// no two live blocks overlap, alignment holds, stats equal the sum of the live blocks, the
// segment layout is sound (blocks tile each segment, free neighbours are merged), and after
// freeing everything and empty_cache() everything is back to baseline.
#include <cstring>
#include <map>
#include <random>

#include <gtest/gtest.h>

#include "memory/allocator_policy.h"
#include "memory/caching_allocator.h"
#include "test_util.h"

namespace porter::memory {
namespace {

struct LiveAlloc {
  size_t requested;
  Category category;
  uint8_t fill;
};

class AllocatorModelTest : public ::testing::TestWithParam<uint32_t> {
 protected:
  void check_invariants(const CachingAllocator& alloc, const CpuDevice& dev,
                        const std::map<uintptr_t, LiveAlloc>& model) {
    // No overlap, alignment.
    uintptr_t prev_end = 0;
    for (const auto& [addr, a] : model) {
      ASSERT_EQ(addr % policy::kMinBlockSize, 0u);
      ASSERT_GE(addr, prev_end) << "live allocations overlap";
      prev_end = addr + a.requested;
    }
    // Stats equal the sum of the live blocks.
    MemoryStats s = alloc.stats();
    std::array<size_t, kNumCategories> bytes{};
    std::array<size_t, kNumCategories> count{};
    size_t total = 0;
    for (const auto& [addr, a] : model) {
      bytes[index_of(a.category)] += a.requested;
      count[index_of(a.category)] += 1;
      total += a.requested;
    }
    for (Category c : kAllCategories) {
      ASSERT_EQ(s[c].current_bytes, bytes[index_of(c)]) << category_name(c);
      ASSERT_EQ(s[c].live_count, count[index_of(c)]) << category_name(c);
      ASSERT_LE(s[c].current_bytes, s[c].peak_bytes);
    }
    ASSERT_EQ(s.requested_bytes, total);
    // Segment layout: blocks tile each segment; no two free neighbours; allocated blocks
    // are exactly the model's live allocations.
    size_t reserved = 0, allocated = 0, free_bytes = 0, largest_free = 0, live_blocks = 0;
    for (const SegmentInfo& seg : alloc.snapshot()) {
      reserved += seg.size_bytes;
      uintptr_t cursor = seg.address;
      bool prev_free = false;
      for (const auto& b : seg.blocks) {
        ASSERT_EQ(b.address, cursor) << "blocks must tile their segment";
        cursor += b.size_bytes;
        bool is_free = !b.allocated && !b.pending;
        ASSERT_FALSE(is_free && prev_free) << "adjacent free blocks were not coalesced";
        prev_free = is_free;
        if (b.allocated) {
          ++live_blocks;
          allocated += b.size_bytes;
          auto it = model.find(b.address);
          ASSERT_NE(it, model.end()) << "allocator has a live block the model does not";
          ASSERT_EQ(b.requested_bytes, it->second.requested);
          ASSERT_GE(b.size_bytes, policy::round_size(it->second.requested));
        } else if (is_free) {
          free_bytes += b.size_bytes;
          largest_free = std::max(largest_free, b.size_bytes);
        }
      }
      ASSERT_EQ(cursor, seg.address + seg.size_bytes);
    }
    ASSERT_EQ(live_blocks, model.size());
    ASSERT_EQ(s.allocated_bytes, allocated);
    ASSERT_EQ(s.reserved_bytes, reserved);
    ASSERT_EQ(s.cached_free_bytes, free_bytes);
    ASSERT_EQ(s.largest_free_block_bytes, largest_free);
    ASSERT_EQ(s.reserved_bytes, s.allocated_bytes + s.cached_free_bytes + s.pending_free_bytes);
    ASSERT_EQ(dev.segment_bytes_in_use(), s.reserved_bytes);
    ASSERT_LE(s.reserved_bytes, s.capacity_bytes);
  }
};

TEST_P(AllocatorModelTest, RandomSequencesKeepInvariants) {
  std::mt19937 rng(GetParam());
  auto dev = testing::make_cpu(160 * kMiB);
  CachingAllocator alloc(*dev);
  std::map<uintptr_t, LiveAlloc> model;
  uint64_t ooms = 0;

  auto random_size = [&]() -> size_t {
    switch (rng() % 10) {
      case 0: return 0;
      case 1: return 1 + rng() % 512;                       // tiny
      case 2: case 3: case 4: return 1 + rng() % (64 * kKiB);  // small
      case 5: return policy::kSmallSize - 256 + rng() % 1024;   // at the pool boundary
      case 6: case 7: return 1 + rng() % (4 * kMiB);           // medium
      default: return 1 + rng() % (24 * kMiB);                 // large
    }
  };

  for (int step = 0; step < 2500; ++step) {
    bool do_alloc = model.empty() || rng() % 100 < 55;
    if (do_alloc) {
      size_t n = random_size();
      Category c = kAllCategories[rng() % kNumCategories];
      void* p = nullptr;
      try {
        p = alloc.raw_allocate(n, c);
      } catch (const OutOfMemoryError&) {
        ++ooms;
      }
      if (n == 0) {
        ASSERT_EQ(p, nullptr);
      } else if (p != nullptr) {
        auto fill = static_cast<uint8_t>(rng());
        std::memset(p, fill, n);
        model.emplace(reinterpret_cast<uintptr_t>(p), LiveAlloc{n, c, fill});
      }
    } else {
      auto it = model.begin();
      std::advance(it, rng() % model.size());
      // The contents survived every allocation made since: nobody else was handed them.
      const auto* bytes = reinterpret_cast<const uint8_t*>(it->first);
      for (size_t i = 0; i < it->second.requested; i += 97) {
        ASSERT_EQ(bytes[i], it->second.fill) << "allocation was overwritten";
      }
      alloc.raw_free(reinterpret_cast<void*>(it->first));
      model.erase(it);
    }
    if (step % 7 == 0 && rng() % 10 == 0) alloc.empty_cache();
    check_invariants(alloc, *dev, model);
    if (HasFatalFailure()) return;
  }
  EXPECT_EQ(alloc.stats().num_ooms, ooms);
  for (const auto& [addr, a] : model) alloc.raw_free(reinterpret_cast<void*>(addr));
  model.clear();
  alloc.empty_cache();
  MemoryStats s = alloc.stats();
  EXPECT_EQ(s.reserved_bytes, 0u);
  EXPECT_EQ(s.allocated_bytes, 0u);
  EXPECT_EQ(s.requested_bytes, 0u);
  EXPECT_EQ(s.num_segments, 0u);
  EXPECT_EQ(dev->segment_bytes_in_use(), 0u);
  for (Category c : kAllCategories) EXPECT_EQ(s[c].current_bytes, 0u);
}

INSTANTIATE_TEST_SUITE_P(Seeds, AllocatorModelTest, ::testing::Values(1u, 7u, 42u, 2024u));

}  // namespace
}  // namespace porter::memory
