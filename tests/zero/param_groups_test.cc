// Parameter groups resolved into runs of the flat buffer (Note [Parameter groups] in
// zero/param_groups.h): the order of the rules, the merging of equal neighbours, the gaps and
// the tail padding, and the error for a group pattern that matches nothing.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "base/error.h"
#include "zero/param_groups.h"

namespace porter::zero {
namespace {

// 100 (matrix), 30 (vector, padded to 64), 40 (matrix "pos"), 70 (vector, padded to 128):
// offsets 0, 128, 192, 256; total 384.
nn::ParamLayout layout4() {
  nn::ParamLayout l;
  l.add("", {{"w", tensor::Shape{10, 10}}, {"b", tensor::Shape{30}},
             {"pos", tensor::Shape{4, 10}}, {"v", tensor::Shape{70}}});
  return l;
}

config::PorterOptimizerConfig groups(std::vector<std::string> no_decay,
                                     std::vector<config::ParamGroupConfig> pg = {}) {
  config::PorterOptimizerConfig g;
  g.no_decay = std::move(no_decay);
  g.param_groups = std::move(pg);
  return g;
}

TEST(ParamGroups, WithoutRulesOneRunDecaysEverything) {
  const std::vector<ParamRun> runs = resolve_param_groups(layout4(), 512, groups({}), 0.1);
  EXPECT_EQ(runs, (std::vector<ParamRun>{{0, 0.1, 1.0}}));
}

TEST(ParamGroups, NoDecayCutsRunsAndGapsAndPaddingGoWithTheParameterBefore) {
  const nn::ParamLayout l = layout4();
  EXPECT_EQ(l.find("b").offset_elems, 128);
  EXPECT_EQ(l.find("pos").offset_elems, 192);
  EXPECT_EQ(l.find("v").offset_elems, 256);
  // The default: w decays; b, pos and v do not, so they merge into one run to the end.
  EXPECT_EQ(resolve_param_groups(l, 512, groups({"ndim<2", "pos"}), 0.1),
            (std::vector<ParamRun>{{0, 0.1, 1.0}, {128, 0.0, 1.0}}));
  // Only vectors undecayed: pos decays again, v is a run of its own.
  EXPECT_EQ(resolve_param_groups(l, 512, groups({"ndim<2"}), 0.1),
            (std::vector<ParamRun>{{0, 0.1, 1.0}, {128, 0.0, 1.0}, {192, 0.1, 1.0},
                                   {256, 0.0, 1.0}}));
}

TEST(ParamGroups, TheFirstMatchingGroupWinsAndNoDecayIsForTheRest) {
  config::ParamGroupConfig first;
  first.params = {"b", "p*"};
  first.lr_scale = 0.5;  // weight decay: the optimizer's
  config::ParamGroupConfig second;
  second.params = {"ndim<2"};  // b is taken by the first group already
  second.weight_decay = 0.3;
  const nn::ParamLayout l = layout4();
  const std::vector<ParamGroupOf> of =
      param_groups_of(l, groups({"ndim<2", "w"}, {first, second}), 0.1);
  ASSERT_EQ(of.size(), 4u);
  EXPECT_EQ(of[0].name, "w");  // no group; no_decay
  EXPECT_EQ(of[0].weight_decay, 0.0);
  EXPECT_EQ(of[1].weight_decay, 0.1);  // b: the first group
  EXPECT_EQ(of[1].lr_scale, 0.5);
  EXPECT_EQ(of[2].weight_decay, 0.1);  // pos: the first group
  EXPECT_EQ(of[2].lr_scale, 0.5);
  EXPECT_EQ(of[3].weight_decay, 0.3);  // v: the second group, before no_decay
  EXPECT_EQ(of[3].lr_scale, 1.0);
  EXPECT_EQ(resolve_param_groups(l, 384, groups({"ndim<2", "w"}, {first, second}), 0.1),
            (std::vector<ParamRun>{{0, 0.0, 1.0}, {128, 0.1, 0.5}, {256, 0.3, 1.0}}));
}

TEST(ParamGroups, AGroupPatternThatMatchesNothingIsAnErrorButANoDecayOneIsNot) {
  config::ParamGroupConfig g;
  g.params = {"w", "h.*"};
  try {
    resolve_param_groups(layout4(), 384, groups({"wpe"}, {g}), 0.1);
    FAIL() << "accepted";
  } catch (const InvalidArgument& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("porter.optimizer.param_groups[0].params[1]: \"h.*\" matches no parameter"),
              std::string::npos)
        << m;
    EXPECT_NE(m.find("\"w\", \"b\", \"pos\", \"v\""), std::string::npos) << m;
  }
  EXPECT_NO_THROW(resolve_param_groups(layout4(), 384, groups({"wpe", "*.nothing"}), 0.1));
}

TEST(ParamGroups, APaddedSizeBelowTheLayoutIsRefused) {
  EXPECT_THROW(resolve_param_groups(layout4(), 383, groups({}), 0.1), InvalidArgument);
}

}  // namespace
}  // namespace porter::zero
