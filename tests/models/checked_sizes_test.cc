// Note [Checked sizes] (base/checked.h) in the analytic model and the model states: a shape
// whose byte counts do not fit 64 bits is refused with InvalidArgument naming the config keys
// that made the size, never answered with a wrapped figure; a shape just inside still gets
// its exact figures.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <string>

#include "base/checked.h"
#include "base/error.h"
#include "models/analytic.h"
#include "zero/partition.h"

namespace porter::models {
namespace {

using ::testing::HasSubstr;

config::ModelConfig shape(int64_t layers, int64_t hidden, int64_t heads, int64_t seq) {
  config::ModelConfig m;
  m.layers = layers;
  m.hidden = hidden;
  m.heads = heads;
  m.seq_len = seq;
  m.vocab = 256;
  return m;
}

// The message of the InvalidArgument `f` throws ("" when it throws none).
template <typename F>
std::string refusal(F&& f) {
  try {
    f();
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "";
}

TEST(CheckedTest, ProductsAndSumsStopAtTheSignedBound) {
  size_t out = 0;
  EXPECT_TRUE(try_mul<size_t>(size_t{1} << 31, size_t{1} << 31, out));
  EXPECT_EQ(out, size_t{1} << 62);
  EXPECT_FALSE(try_mul<size_t>(size_t{1} << 32, size_t{1} << 31, out));  // 2^63 > INT64_MAX
  EXPECT_TRUE(try_add<size_t>(kMaxCheckedSize - 1, 1, out));
  EXPECT_EQ(out, kMaxCheckedSize);
  EXPECT_FALSE(try_add<size_t>(kMaxCheckedSize, 1, out));
  EXPECT_FALSE(try_add<size_t>(std::numeric_limits<size_t>::max(), 2, out));  // would wrap to 1
  EXPECT_EQ(checked_product({{"a", 3}, {"b", 5}, {"c", 7}}), 105u);
  const std::string msg = refusal([] { checked_product({{"porter.x", 1u << 31}, {"porter.y", 1u << 31}, {"z", 4}}, "it"); });
  EXPECT_THAT(msg, HasSubstr("it: porter.x 2147483648 x porter.y 2147483648 x z 4 overflows 64-bit byte counts"));
}

// seq_len 2^24 with 2^16 heads: one block's attention probabilities alone are 2^66 bytes.
TEST(CheckedSizesTest, AttentionProbabilitiesThatOverflowNameTheirKeys) {
  const TransformerShape s{shape(2, 65536, 65536, 16777216), 1, 0, tensor::DType::kF32};
  for (const std::string& msg :
       {refusal([&] { analytic_transformer_costs(s); }), refusal([&] { none_peak_bytes(s); }),
        refusal([&] { layer_bytes(s); })}) {
    EXPECT_THAT(msg, HasSubstr("the attention probabilities"));
    EXPECT_THAT(msg, HasSubstr("porter.model.heads / tensor_parallel 65536"));
    EXPECT_THAT(msg, HasSubstr("porter.model.seq_len 16777216 x porter.model.seq_len 16777216"));
    EXPECT_THAT(msg, HasSubstr("overflows 64-bit byte counts"));
  }
}

// Every tensor fits, but 2^40 blocks of them do not.
TEST(CheckedSizesTest, LayersThatOverflowTheChainNameTheLayerCount) {
  const TransformerShape s{shape(int64_t{1} << 40, 4096, 32, 4096), 8, 0, tensor::DType::kBF16};
  const std::string costs = refusal([&] { analytic_transformer_costs(s); });
  EXPECT_THAT(costs, HasSubstr("porter.model.layers 1099511627776 x one block's"));
  EXPECT_THAT(costs, HasSubstr("porter.model.seq_len 4096"));
  EXPECT_THAT(costs, HasSubstr("overflows 64-bit byte counts"));
  EXPECT_THAT(refusal([&] { none_peak_bytes(s); }), HasSubstr("porter.model.layers 1099511627776"));
  // One block alone still has its exact bytes.
  EXPECT_GT(layer_bytes(s), 0u);
}

// Just inside the bound the figures are exact: the probabilities of seq_len 2^20 at 2^10
// heads (2^52 bytes) and the block's other tensors fit, and the layer figure is their sum.
TEST(CheckedSizesTest, ALargeShapeInsideTheBoundKeepsItsFigures) {
  const TransformerShape s{shape(4, 1024, 1024, 1 << 20), 1, 0, tensor::DType::kF32};
  const TransformerDims d = dims_of(s);
  EXPECT_EQ(d.probs(), size_t{1} << 52);
  EXPECT_GT(layer_bytes(s), d.probs());
  EXPECT_GT(none_peak_bytes(s), 4 * d.probs());
}

TEST(CheckedSizesTest, ModelStatesThatOverflowAreRefused) {
  // A flat buffer of 2^61 elements: 16 bytes each at stage 0 is 2^65.
  const zero::Partition part = zero::make_partition(int64_t{1} << 61, 1);
  const std::string msg = refusal([&] { zero::exact_bytes(part, 0, zero::StateDTypes{tensor::DType::kF32}); });
  EXPECT_THAT(msg, HasSubstr("2305843009213693952 parameter elements per rank (ZeRO stage 0)"));
  EXPECT_THAT(msg, HasSubstr("overflows 64-bit byte counts"));
  // Sharded over 2^10 ranks the same model's states fit, exactly.
  const zero::Partition sharded = zero::make_partition(int64_t{1} << 61, 1024);
  const zero::StateBytes b = zero::exact_bytes(sharded, 3, zero::StateDTypes{tensor::DType::kF32});
  EXPECT_EQ(b.params, (size_t{1} << 51) * 4);
  EXPECT_EQ(b.total(), (size_t{1} << 51) * 16);
  // Padding a buffer at the top of the range to the shards cannot wrap.
  EXPECT_THAT(refusal([] { zero::make_partition(std::numeric_limits<int64_t>::max(), 3); }),
              HasSubstr("padded to 3 shards"));
}

}  // namespace
}  // namespace porter::models
