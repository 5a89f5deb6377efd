// Philox4x32-10 against the Random123 known-answer vectors, and the dropout key contract:
// a mask is a pure function of (seed, stage, step, micro-batch, site, element).
#include "tensor/philox.h"

#include <gtest/gtest.h>

#include <set>

namespace porter::nn {

using namespace porter::tensor;

namespace {

void expect_philox(tensor::Philox4 ctr, uint32_t key0, uint32_t key1, tensor::Philox4 want) {
  tensor::Philox4 got = philox4x32_10(ctr, key0, key1);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(got.v[i], want.v[i]) << "word " << i;
}

// Random123 1.09, kat_vectors: "philox4x32 10 <ctr x4> <key x2> <result x4>".
TEST(PhiloxTest, MatchesRandom123KnownAnswers) {
  expect_philox({{0, 0, 0, 0}}, 0, 0, {{0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}});
  expect_philox({{0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}}, 0xffffffffu, 0xffffffffu,
                {{0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}});
  expect_philox({{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}}, 0xa4093822u, 0x299f31d0u,
                {{0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}});
}

TEST(PhiloxTest, UniformsAreInUnitIntervalAndGroupedByFour) {
  tensor::PhiloxKey key = tensor::dropout_key(42, 0, 0, 0, 0);
  double mean = 0;
  const int n = 100000;
  for (int i = 0; i < n; ++i) {
    float u = tensor::philox_uniform(key, static_cast<uint64_t>(i));
    ASSERT_GE(u, 0.0f);
    ASSERT_LT(u, 1.0f);
    mean += u;
  }
  EXPECT_NEAR(mean / n, 0.5, 0.005);
  float four[4];
  tensor::philox_uniform4(key, 7, four);
  for (int l = 0; l < 4; ++l) EXPECT_EQ(four[l], tensor::philox_uniform(key, 28 + l));
}

// group_offset shifts the group counter: local group g of the shifted key is global group
// g + offset of the unshifted one (Note [Dropout keys]); offset 0 is the plain key.
TEST(PhiloxTest, GroupOffsetShiftsTheCounter) {
  const tensor::PhiloxKey key = tensor::dropout_key(7, 1, 2, 3, 4);
  for (uint64_t offset : {uint64_t{0}, uint64_t{1}, uint64_t{5003}, uint64_t{1} << 33}) {
    tensor::PhiloxKey shifted = key;
    shifted.group_offset = offset;
    for (uint64_t g : {uint64_t{0}, uint64_t{9}, (uint64_t{1} << 32) - 1}) {
      float got[4], want[4];
      tensor::philox_uniform4(shifted, g, got);
      tensor::philox_uniform4(key, g + offset, want);
      for (int l = 0; l < 4; ++l) {
        EXPECT_EQ(got[l], want[l]) << "offset " << offset << " group " << g << " word " << l;
        EXPECT_EQ(tensor::philox_uniform(shifted, 4 * g + l), want[l]);
      }
    }
  }
}

TEST(PhiloxTest, DropoutKeyIsAPureFunctionOfItsFields) {
  auto first = [](const tensor::PhiloxKey& k) { return tensor::philox_uniform(k, 12345); };
  EXPECT_EQ(first(tensor::dropout_key(1, 2, 3, 4, 5)), first(tensor::dropout_key(1, 2, 3, 4, 5)));
  // Changing any one field changes the stream.
  std::set<float> seen;
  seen.insert(first(tensor::dropout_key(1, 2, 3, 4, 5)));
  seen.insert(first(tensor::dropout_key(9, 2, 3, 4, 5)));
  seen.insert(first(tensor::dropout_key(1, 9, 3, 4, 5)));
  seen.insert(first(tensor::dropout_key(1, 2, 9, 4, 5)));
  seen.insert(first(tensor::dropout_key(1, 2, 3, 9, 5)));
  seen.insert(first(tensor::dropout_key(1, 2, 3, 4, 9)));
  seen.insert(first(tensor::dropout_key(1, 2, uint64_t{3} << 40, 4, 5)));  // high step bits count
  EXPECT_EQ(seen.size(), 7u);
}

}  // namespace
}  // namespace porter::nn
