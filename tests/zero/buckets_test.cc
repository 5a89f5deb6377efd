// zero::plan_buckets (Note [Gradient buckets]) and bucket_blocks (Note [Bucketed
// reduce-scatter]).
#include "zero/buckets.h"

#include <gtest/gtest.h>

#include "base/error.h"

namespace porter::zero {
namespace {

// Four stages of 128, 256, 64 and 0 elements (the last a loss without parameters).
std::vector<StageRange> ranges() { return {{0, 128}, {128, 384}, {384, 448}, {448, 448}}; }

TEST(BucketsTest, GroupsConsecutiveStagesInBackwardOrder) {
  const std::vector<Bucket> b = plan_buckets(ranges(), {}, 320);
  ASSERT_EQ(b.size(), 2u);
  // 64 + 256 = 320 fits; adding 128 does not.
  EXPECT_EQ(b[0].lo, 128);
  EXPECT_EQ(b[0].hi, 448);
  EXPECT_EQ(b[0].first_stage, 1);
  EXPECT_EQ(b[0].last_stage, 2);
  EXPECT_EQ(b[0].alloc_before, 2);
  EXPECT_EQ(b[0].ready_after, 1);
  EXPECT_EQ(b[1].lo, 0);
  EXPECT_EQ(b[1].hi, 128);
  EXPECT_EQ(b[1].alloc_before, 0);
  EXPECT_EQ(b[1].ready_after, 0);
}

TEST(BucketsTest, ALargeStageIsItsOwnBucket) {
  const std::vector<Bucket> b = plan_buckets(ranges(), {}, 100);
  ASSERT_EQ(b.size(), 3u);
  EXPECT_EQ(b[0].elems(), 64);
  EXPECT_EQ(b[1].elems(), 256);
  EXPECT_EQ(b[2].elems(), 128);
  EXPECT_EQ(plan_buckets(ranges(), {}, 1'000'000).size(), 1u);
}

TEST(BucketsTest, TiedWritersExtendTheBucketsLife) {
  // Stage 3 (no own parameters here, like a tied head) writes into stage 0's range.
  std::vector<std::vector<int>> writers = {{0, 3}, {1}, {2}, {3}};
  const std::vector<Bucket> b = plan_buckets(ranges(), writers, 100);
  ASSERT_EQ(b.size(), 3u);
  EXPECT_EQ(b[2].first_stage, 0);
  EXPECT_EQ(b[2].alloc_before, 3);  // live from the head's backward
  EXPECT_EQ(b[2].ready_after, 0);
}

TEST(BucketsTest, RejectsGapsAndBadSizes) {
  EXPECT_THROW(plan_buckets({{0, 64}, {128, 192}}, {}, 100), InvalidArgument);
  EXPECT_THROW(plan_buckets(ranges(), {}, 0), InvalidArgument);
  EXPECT_TRUE(plan_buckets({}, {}, 10).empty());
}

TEST(BucketsTest, BlocksAreTheRanksIntersections) {
  const Partition p = make_partition(1000, 4);  // padded 1024, S 256
  // [200, 700): rank 0 [200, 256), rank 1 [256, 512), rank 2 [512, 700), rank 3 empty.
  const BucketBlocks b = bucket_blocks(200, 700, p);
  EXPECT_EQ(b.block, 256);
  EXPECT_EQ(b.size(0), 56);
  EXPECT_EQ(b.lo[0], 200);
  EXPECT_EQ(b.size(1), 256);
  EXPECT_EQ(b.size(2), 188);
  EXPECT_EQ(b.lo[2], 512);
  EXPECT_EQ(b.size(3), 0);
  const BucketBlocks inside = bucket_blocks(300, 400, p);  // within rank 1
  EXPECT_EQ(inside.block, 100);
  EXPECT_EQ(inside.size(0), 0);
  EXPECT_EQ(inside.size(1), 100);
  EXPECT_THROW(bucket_blocks(0, 2000, p), InvalidArgument);
}

}  // namespace
}  // namespace porter::zero
