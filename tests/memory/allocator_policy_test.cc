// The allocator's size policy (Note [Size classes]) as pure arithmetic.
#include "memory/allocator_policy.h"

#include <gtest/gtest.h>

namespace porter::memory::policy {
namespace {

TEST(AllocatorPolicyTest, RoundsToBlockMultiples) {
  EXPECT_EQ(round_size(1), 512u);
  EXPECT_EQ(round_size(512), 512u);
  EXPECT_EQ(round_size(513), 1024u);
  EXPECT_EQ(round_size(kSmallSize), kSmallSize);
  EXPECT_EQ(round_size(kSmallSize + 1), kSmallSize + 512);
}

TEST(AllocatorPolicyTest, PoolsAndSegmentSizes) {
  EXPECT_TRUE(is_small(kSmallSize));
  EXPECT_FALSE(is_small(kSmallSize + 512));
  EXPECT_EQ(preferred_segment_size(512), kSmallBuffer);
  EXPECT_EQ(preferred_segment_size(kSmallSize), kSmallBuffer);
  EXPECT_EQ(preferred_segment_size(kSmallSize + 512), kLargeBuffer);
  EXPECT_EQ(preferred_segment_size(kMinLargeAlloc - 512), kLargeBuffer);
  EXPECT_EQ(preferred_segment_size(kMinLargeAlloc), kMinLargeAlloc);
  EXPECT_EQ(preferred_segment_size(kMinLargeAlloc + 512), kMinLargeAlloc + kRoundLarge);
  EXPECT_EQ(minimal_segment_size(3 * 512), 3u * 512);
}

TEST(AllocatorPolicyTest, SplitThresholds) {
  EXPECT_TRUE(should_split(1024, 512, /*small_pool=*/true));
  EXPECT_FALSE(should_split(512, 512, true));
  EXPECT_FALSE(should_split(kSmallSize + kSmallSize, kSmallSize, /*small_pool=*/false));
  EXPECT_TRUE(should_split(kSmallSize + kSmallSize + 512, kSmallSize, false));
}

}  // namespace
}  // namespace porter::memory::policy
