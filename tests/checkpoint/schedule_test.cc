// Schedules: printing, validation messages, and the simulator's peaks on hand-computed chains.
#include "checkpoint/schedule.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "base/error.h"

namespace porter::checkpoint {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// A chain of n stages with round numbers: activations of 10 bytes (the input of stage 0 and
// the loss excepted), a kKeep tape of 100 bytes that references its input, a forward peak of
// the tape plus the output.
ChainCosts toy_chain(int n) {
  ChainCosts c;
  c.source = "profiled";
  for (int i = 0; i < n; ++i) {
    StageCost s;
    s.name = "s" + std::to_string(i);
    s.is_block = true;
    s.input_bytes = i == 0 ? 0 : 10;
    s.output_bytes = i == n - 1 ? 1 : 10;
    s.backward_s = 2.0;
    s.forward_flops = 100.0;
    s.backward_total_peak_bytes = 50;
    OptionCost& k = s.option(SaveOption::kKeep);
    k.available = true;
    k.forward_s = 1.0;
    k.forward_peak_bytes = 100 + s.output_bytes;
    k.forward_total_peak_bytes = k.forward_peak_bytes + 5;
    k.saved_bytes = 100;
    k.tape_refs_input = true;
    OptionCost& ck = s.option(SaveOption::kCheckpoint);
    ck = k;
    ck.saved_bytes = 0;
    ck.tape_refs_input = false;
    ck.recompute_s = 1.0;
    ck.recompute_peak_bytes = 100;
    ck.recompute_total_peak_bytes = 100;
    ck.recompute_saved_bytes = 100;
    ck.recompute_flops = 90.0;
    OptionCost& sel = s.option(SaveOption::kSelective);
    sel = ck;
    sel.saved_bytes = 60;
    sel.recompute_s = 0.25;
    sel.recompute_peak_bytes = 40;
    sel.recompute_saved_bytes = 40;
    sel.recompute_flops = 10.0;
    c.stages.push_back(s);
  }
  return c;
}

Schedule make(int n, std::vector<ScheduleOp> ops) { return Schedule{n, std::move(ops)}; }

using Op = ScheduleOp;
constexpr SaveOption K = SaveOption::kKeep, C = SaveOption::kCheckpoint, S = SaveOption::kSelective;

TEST(ScheduleTest, ToString) {
  Schedule s = make(2, {Op::forward(0, K, true), Op::forward(1, C, false), Op::forward(1, S, true),
                        Op::recompute(1), Op::backward(1), Op::backward(0)});
  EXPECT_EQ(s.to_string(), "F0k+ F1c F1s+ R1 B1 B0");
}

TEST(ScheduleTest, NoneOnToyChain) {
  const ChainCosts c = toy_chain(3);
  Schedule s = make(3, {Op::forward(0, K, false), Op::forward(1, K, false), Op::forward(2, K, false),
                        Op::backward(2), Op::backward(1), Op::backward(0)});
  const Prediction p = simulate(s, c);
  // F0: 0 + 110; F1: 110 + 110; F2: 220 + 101. The loss is dropped at once.
  EXPECT_EQ(p.peak_activation_bytes, 321u);
  EXPECT_EQ(p.peak_op, 2);
  EXPECT_THAT(p.footprint_after_op, ElementsAre(110u, 220u, 320u, 210u, 100u, 0u));
  EXPECT_DOUBLE_EQ(p.compute_s, 3 * 1.0 + 3 * 2.0);
  EXPECT_DOUBLE_EQ(p.recompute_s, 0.0);
  EXPECT_DOUBLE_EQ(p.recompute_flops, 0.0);
  // Total: B2 starts at 320 and its workspace adds 50 (the loss needs no gradient); B1 runs
  // at 210 with the gradient of a_2 (10): 270; F2 at 220 + 106.
  EXPECT_EQ(p.peak_total_bytes, 370u);
}

TEST(ScheduleTest, FullOnToyChain) {
  const ChainCosts c = toy_chain(3);
  Schedule s = make(3, {Op::forward(0, C, true), Op::forward(1, C, true), Op::forward(2, C, true),
                        Op::recompute(2), Op::backward(2), Op::recompute(1), Op::backward(1),
                        Op::recompute(0), Op::backward(0)});
  const Prediction p = simulate(s, c);
  // Held inputs a_0 (0), a_1, a_2 (10 each): F2 peaks at 20 + 101; R2 at 20 + 100.
  EXPECT_EQ(p.peak_activation_bytes, 121u);
  EXPECT_EQ(p.peak_op, 2);
  EXPECT_THAT(p.footprint_after_op, ElementsAre(10u, 20u, 20u, 120u, 10u, 110u, 0u, 100u, 0u));
  EXPECT_DOUBLE_EQ(p.recompute_s, 3.0);
  EXPECT_DOUBLE_EQ(p.compute_s, 3.0 + 3.0 + 6.0);
  EXPECT_DOUBLE_EQ(p.recompute_flops, 270.0);
}

TEST(ScheduleTest, UniformSegmentReforwardsAndRecomputesTheLastStage) {
  const ChainCosts c = toy_chain(3);
  // One segment [0, 3): hold a_0, forward all with kCheckpoint; re-forward 0..1 keeping,
  // recompute 2 from cur = a_2.
  Schedule s = make(3, {Op::forward(0, C, true), Op::forward(1, C, false), Op::forward(2, C, false),
                        Op::forward(0, K, false), Op::forward(1, K, false), Op::recompute(2),
                        Op::backward(2), Op::backward(1), Op::backward(0)});
  const Prediction p = simulate(s, c);
  // F0 110 -> 10 (a_1); F1 10+110 -> 10 (a_2); F2 10+101 -> 0; F0k 0+110 -> 110;
  // F1k 110+110 -> 220; R2 220+100 -> 320; B2 320 -> 220 (cur a_2 stays until B1 drops
  // it); B1 -> 100; B0 -> 0.
  EXPECT_THAT(p.footprint_after_op, ElementsAre(10u, 10u, 0u, 110u, 220u, 320u, 220u, 100u, 0u));
  EXPECT_EQ(p.peak_activation_bytes, 320u);
  EXPECT_EQ(p.peak_op, 5);
  EXPECT_DOUBLE_EQ(p.recompute_s, 2.0 + 1.0);
  EXPECT_DOUBLE_EQ(p.recompute_flops, 200.0 + 90.0);
}

TEST(ScheduleTest, SelectiveAddsItsRecomputeToTheTape) {
  const ChainCosts c = toy_chain(2);
  Schedule s = make(2, {Op::forward(0, S, true), Op::forward(1, K, false), Op::backward(1),
                        Op::recompute(0), Op::backward(0)});
  const Prediction p = simulate(s, c);
  // F0s: 0 + 110 -> 60 + a_1; F1k: 70 + 101 -> 70 + 100 (loss dropped); B1 -> 60; R0: 60 + 40.
  EXPECT_THAT(p.footprint_after_op, ElementsAre(70u, 170u, 60u, 100u, 0u));
  EXPECT_EQ(p.peak_activation_bytes, 171u);
  EXPECT_DOUBLE_EQ(p.recompute_s, 0.25);
}

TEST(ScheduleTest, HeldInputsAndTapeReferencesKeepActivationsAlive) {
  const ChainCosts c = toy_chain(3);
  Schedule s = make(3, {Op::forward(0, K, false), Op::forward(1, C, true), Op::forward(2, K, false),
                        Op::backward(2), Op::recompute(1), Op::backward(1), Op::backward(0)});
  const Prediction p = simulate(s, c);
  // F0 -> tape0 100 + a_1 10; F1c+ -> a_1 held, a_2 cur: 120; F2 -> + tape2 100, the loss
  // dropped: 220; B2 -> a_2 is no longer referenced: 110; R1 -> 210; B1 -> 100; B0 -> 0.
  EXPECT_THAT(p.footprint_after_op, ElementsAre(110u, 120u, 220u, 110u, 210u, 100u, 0u));
}

struct BadCase {
  const char* what;
  Schedule schedule;
  const char* message;
};

TEST(ScheduleTest, ValidateNamesTheOpAndTheRule) {
  const std::vector<BadCase> cases = {
      {"input missing", make(2, {Op::forward(1, K, false)}),
       "schedule op 0 (F1k): its input a_1 is neither the current activation nor held"},
      {"backward out of order", make(2, {Op::forward(0, K, false), Op::forward(1, K, false), Op::backward(0)}),
       "schedule op 2 (B0): the backward of stage 1 must run first"},
      {"backward of a partial tape", make(1, {Op::forward(0, C, true), Op::backward(0)}),
       "schedule op 1 (B0): the tape of stage 0 is partial (recompute it first)"},
      {"recompute of a full tape", make(1, {Op::forward(0, K, false), Op::recompute(0)}),
       "schedule op 1 (R0): the tape of stage 0 is already full"},
      {"recompute without input",
       make(2, {Op::forward(0, C, false), Op::forward(1, K, false), Op::backward(1), Op::recompute(0)}),
       "schedule op 3 (R0): its input a_0 is neither the current activation nor held"},
      {"stage out of range", make(2, {Op::forward(2, K, false)}), "schedule op 0 (F2k): stage 2 is outside 0..1"},
      {"unfinished", make(2, {Op::forward(0, K, false), Op::forward(1, K, false), Op::backward(1)}),
       "schedule ends after 3 ops with an unfinished micro-batch: the backward of stage 0 never runs"},
      {"forward after backward",
       make(1, {Op::forward(0, K, false), Op::backward(0), Op::forward(0, K, false)}),
       "schedule op 2 (F0k): the backward of stage 0 already ran"},
      {"double backward",
       make(1, {Op::forward(0, K, false), Op::backward(0), Op::backward(0)}),
       "schedule op 2 (B0): the backward of stage 0 already ran"},
  };
  for (const BadCase& c : cases) {
    try {
      validate(c.schedule);
      ADD_FAILURE() << c.what << ": accepted " << c.schedule.to_string();
    } catch (const InvalidArgument& e) {
      EXPECT_THAT(e.what(), HasSubstr(c.message)) << c.what;
    }
  }
}

TEST(ScheduleTest, SimulateRejectsUnavailableOptionsAndMismatchedCosts) {
  ChainCosts c = toy_chain(2);
  c.stages[0].option(SaveOption::kSelective).available = false;
  Schedule s = make(2, {Op::forward(0, S, true), Op::forward(1, K, false), Op::backward(1),
                        Op::recompute(0), Op::backward(0)});
  validate(s);
  try {
    simulate(s, c);
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("schedule op 0 (F0s+): save option selective is not available for stage 0 (s0)"));
  }
  try {
    simulate(s, toy_chain(3));
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("schedule has 2 stages but the costs have 3"));
  }
}

}  // namespace
}  // namespace porter::checkpoint
