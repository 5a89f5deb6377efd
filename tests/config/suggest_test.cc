// Edit distance and the did-you-mean choice.
#include <gtest/gtest.h>

#include "config/suggest.h"

namespace porter::config {
namespace {

TEST(EditDistance, Basics) {
  EXPECT_EQ(edit_distance("", ""), 0u);
  EXPECT_EQ(edit_distance("abc", ""), 3u);
  EXPECT_EQ(edit_distance("kitten", "sitting"), 3u);
  EXPECT_EQ(edit_distance("stage", "stage"), 0u);
  EXPECT_EQ(edit_distance("stage3_param_persitance_threshold", "stage3_param_persistence_threshold"), 2u);
}

TEST(Suggest, TheIssuesExamples) {
  std::vector<std::string> zero_keys = {"stage", "overlap_comm", "contiguous_gradients",
                                        "stage3_param_persistence_threshold",
                                        "stage3_prefetch_bucket_size"};
  EXPECT_EQ(suggest("comm_overlap", zero_keys), "overlap_comm");
  EXPECT_EQ(suggest("stage3_param_persitance_threshold", zero_keys),
            "stage3_param_persistence_threshold");
  EXPECT_EQ(suggest("Stage", zero_keys), "stage");
}

TEST(Suggest, NothingWhenNothingIsClose) {
  std::vector<std::string> keys = {"lr", "betas", "eps", "weight_decay"};
  EXPECT_EQ(suggest("momentum", keys), std::nullopt);
  EXPECT_EQ(suggest("", keys), std::nullopt);
  EXPECT_EQ(suggest(std::string(1000, 'x'), keys), std::nullopt);
  EXPECT_EQ(suggest("x", keys), std::nullopt);
}

}  // namespace
}  // namespace porter::config
