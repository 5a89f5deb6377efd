// zero::make_partition, exact_bytes and paper_bytes against hand-computed numbers.
#include "zero/partition.h"

#include <gtest/gtest.h>

#include "base/error.h"

namespace porter::zero {
namespace {

TEST(PartitionTest, PadsToWorldSizeTimesAlignment) {
  // 1000 elements, 3 ranks: unit 3 * 64 = 192; round_up(1000, 192) = 1152; S = 384.
  const Partition p = make_partition(1000, 3);
  EXPECT_EQ(p.total_elems, 1000);
  EXPECT_EQ(p.padded_elems, 1152);
  EXPECT_EQ(p.shard_elems, 384);
  EXPECT_EQ(p.begin(0), 0);
  EXPECT_EQ(p.end(0), 384);
  EXPECT_EQ(p.begin(2), 768);
  EXPECT_EQ(p.end(2), 1152);
  EXPECT_EQ(p.shard_elems % 64, 0);
}

TEST(PartitionTest, ExactMultiplesAreNotPadded) {
  const Partition one = make_partition(640, 1);
  EXPECT_EQ(one.padded_elems, 640);
  EXPECT_EQ(one.shard_elems, 640);
  const Partition two = make_partition(640, 2);  // 640 = 5 * 128
  EXPECT_EQ(two.padded_elems, 640);
  EXPECT_EQ(two.shard_elems, 320);
  const Partition four = make_partition(640, 4);  // unit 256 -> 768
  EXPECT_EQ(four.padded_elems, 768);
  EXPECT_EQ(four.shard_elems, 192);
}

TEST(PartitionTest, EmptyAndOneElement) {
  const Partition e = make_partition(0, 4);
  EXPECT_EQ(e.padded_elems, 0);
  EXPECT_EQ(e.shard_elems, 0);
  const Partition o = make_partition(1, 8);  // unit 512
  EXPECT_EQ(o.padded_elems, 512);
  EXPECT_EQ(o.shard_elems, 64);
}

TEST(PartitionTest, RejectsBadArguments) {
  EXPECT_THROW(make_partition(10, 0), InvalidArgument);
  EXPECT_THROW(make_partition(-1, 2), InvalidArgument);
  EXPECT_THROW(exact_bytes(make_partition(10, 2), 4, StateDTypes{}), InvalidArgument);
}

TEST(PartitionTest, ExactBytesPerStage) {
  // P = 1000, N = 3: padded 1152, S = 384. bf16: p = 2, g = 4, k = 12.
  const Partition p = make_partition(1000, 3);
  const StateDTypes bf16{tensor::DType::kBF16};
  StateBytes b = exact_bytes(p, 0, bf16);
  EXPECT_EQ(b.params, 2u * 1152);
  EXPECT_EQ(b.grads, 4u * 1152);
  EXPECT_EQ(b.optimizer, 12u * 1152);
  b = exact_bytes(p, 1, bf16);
  EXPECT_EQ(b.params, 2304u);
  EXPECT_EQ(b.grads, 4608u);
  EXPECT_EQ(b.optimizer, 12u * 384);
  b = exact_bytes(p, 2, bf16);
  EXPECT_EQ(b.grads, 4u * 384);
  EXPECT_EQ(b.optimizer, 4608u);
  EXPECT_EQ(b.total(), 2304u + 1536u + 4608u);
  b = exact_bytes(p, 3, bf16);
  EXPECT_EQ(b.params, 2u * 384);
  // f32: k = 8.
  b = exact_bytes(p, 2, StateDTypes{tensor::DType::kF32});
  EXPECT_EQ(b.params, 4u * 1152);
  EXPECT_EQ(b.grads, 4u * 384);
  EXPECT_EQ(b.optimizer, 8u * 384);
}

TEST(PartitionTest, PaperBytesUseTheUnpaddedCount) {
  // Psi = 1000, N = 4, fp16-like params (2 bytes), g = 4, K = 12.
  const StateDTypes half{tensor::DType::kF16};
  StateBytes b = paper_bytes(1000, 4, 0, half);
  EXPECT_EQ(b.total(), (2u + 4u + 12u) * 1000);
  b = paper_bytes(1000, 4, 1, half);
  EXPECT_EQ(b.params + b.grads, 6000u);
  EXPECT_EQ(b.optimizer, 3000u);  // 12 * 1000 / 4
  b = paper_bytes(1000, 4, 2, half);
  EXPECT_EQ(b.grads, 1000u);
  b = paper_bytes(1000, 4, 3, half);
  EXPECT_EQ(b.total(), 18u * 250);
  // Exact and paper differ by the padding only.
  const Partition p = make_partition(1024, 4);  // already a multiple of 256
  EXPECT_EQ(exact_bytes(p, 2, half).total(), paper_bytes(1024, 4, 2, half).total());
}

// The ZeRO paper's Figure 1 (Rajbhandari et al. 2020): Psi = 7.5B parameters on 64 devices
// with fp16 parameters and gradients and K = 12 hold 120 GB (stage 0), 31.4 GB (stage 1),
// 16.6 GB (stage 2) and 1.9 GB (stage 3) of model states per device. With 16-bit gradients
// (Note [Gradient dtype]) porter's exact bytes are those, padding aside.
TEST(PartitionTest, SixteenBitGradientsGiveTheZeroPapersFigureOne) {
  const StateDTypes fp16{tensor::DType::kF16, tensor::DType::kF16};
  EXPECT_EQ(fp16.grad_bytes(), 2u);
  const int64_t psi = 7'500'000'000;
  const Partition p = make_partition(psi, 64);
  const double figure[] = {120.0, 31.4, 16.6, 1.9};
  for (int stage = 0; stage <= 3; ++stage) {
    const double gb = static_cast<double>(exact_bytes(p, stage, fp16).total()) / 1e9;
    EXPECT_NEAR(gb, figure[stage], 0.05) << "stage " << stage;
    // The padding: at most 64 ranks x 64 alignment elements x 16 bytes.
    EXPECT_LE(exact_bytes(p, stage, fp16).total() - paper_bytes(psi, 64, stage, fp16).total(),
              size_t{64} * 64 * 16);
  }
}

}  // namespace
}  // namespace porter::zero
