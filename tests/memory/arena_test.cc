// Arenas: one allocation in fixed slots; misuse gives clear errors.
#include "memory/arena.h"

#include <cstring>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "test_util.h"

namespace porter::memory {
namespace {

using ::testing::HasSubstr;
using testing::make_cpu;

TEST(ArenaTest, DeviceArenaIsOneAllocationOfFixedSlots) {
  auto dev = make_cpu(64 * kMiB);
  CachingAllocator alloc(*dev);
  Arena arena = Arena::on_device(alloc, "staging", 1000, 4, Category::kStaging);
  EXPECT_EQ(arena.stride_bytes(), 1024u);
  MemoryStats s = alloc.stats();
  EXPECT_EQ(s[Category::kStaging].alloc_count, 1u);
  EXPECT_EQ(s[Category::kStaging].current_bytes, 4096u);
  for (size_t i = 0; i < 4; ++i) {
    size_t slot = arena.acquire();
    EXPECT_EQ(slot, i);
    EXPECT_EQ(arena.slot_data(slot), static_cast<std::byte*>(arena.base()) + i * 1024);
  }
  EXPECT_EQ(arena.in_use(), 4u);
  EXPECT_FALSE(arena.try_acquire().has_value());
  arena.release(2);
  EXPECT_EQ(arena.acquire(), 2u);
  for (size_t i = 0; i < 4; ++i) arena.release(i);
}

TEST(ArenaTest, PinnedArena) {
  auto dev = make_cpu(64 * kMiB);
  PinnedPool pool(*dev);
  {
    Arena arena = Arena::on_pinned(pool, "host-checkpoints", 3 * kMiB, 3);
    EXPECT_EQ(pool.stats().in_use_bytes, 9 * kMiB);
    size_t slot = arena.acquire();
    std::memset(arena.slot_data(slot), 1, arena.slot_bytes());
    arena.release(slot);
  }
  EXPECT_EQ(pool.stats().in_use_bytes, 0u);
}

TEST(ArenaTest, MisuseGivesClearErrors) {
  auto dev = make_cpu(64 * kMiB);
  CachingAllocator alloc(*dev);
  Arena arena = Arena::on_device(alloc, "staging", 512, 2, Category::kStaging);
  size_t a = arena.acquire();
  size_t b = arena.acquire();
  try {
    arena.acquire();
    FAIL();
  } catch (const UsageError& e) {
    EXPECT_THAT(e.what(), HasSubstr("arena 'staging': all 2 slots of 512 bytes are in use"));
  }
  arena.release(a);
  try {
    arena.release(a);
    FAIL();
  } catch (const UsageError& e) {
    EXPECT_THAT(e.what(), HasSubstr("release of slot 0, which is not acquired (released twice"));
  }
  try {
    arena.slot_data(a);
    FAIL();
  } catch (const UsageError& e) {
    EXPECT_THAT(e.what(), HasSubstr("access of slot 0, which is not acquired"));
  }
  try {
    arena.release(7);
    FAIL();
  } catch (const UsageError& e) {
    EXPECT_THAT(e.what(), HasSubstr("release of slot 7, but the arena has 2 slots"));
  }
  arena.release(b);
}

TEST(ArenaTest, BadShapesAreRejected) {
  auto dev = make_cpu(64 * kMiB);
  CachingAllocator alloc(*dev);
  EXPECT_THROW(Arena::on_device(alloc, "x", 0, 4, Category::kStaging), InvalidArgument);
  EXPECT_THROW(Arena::on_device(alloc, "x", 512, 0, Category::kStaging), InvalidArgument);
  EXPECT_THROW(Arena::on_device(alloc, "x", SIZE_MAX / 2, 4, Category::kStaging), InvalidArgument);
  EXPECT_THROW(Arena::on_device(alloc, "x", 32 * kMiB, 4, Category::kStaging), OutOfMemoryError);
  EXPECT_EQ(alloc.stats().requested_bytes, 0u);
}

}  // namespace
}  // namespace porter::memory
