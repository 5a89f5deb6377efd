// Schedules: printing, validation messages, and the simulator's peaks on hand-computed chains.
#include "checkpoint/schedule.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "base/error.h"
#include "checkpoint/offload_plan.h"
#include "checkpoint/simulate.h"

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

// ---- host holds (Note [Offload semantics]) ----------------------------------------------

// full on toy_chain(3) with a_1 and a_2 on the host: 0 F0c+, 1 F1c^, 2 F2c^, 3 R2, 4 B2, 5 R1,
// 6 B1, 7 R0, 8 B0. a_2 is read at 3, released at 4; a_1 read at 5, released at 6. The first
// backward is op 4, so with depth 1 both loads are issued at 3 (a_2 clamped to its use).
Schedule full_host(bool keep_a2_on_device = false) {
  return make(3, {Op::forward(0, C, true), Op::forward(1, C, true, true), Op::forward(2, C, true, !keep_a2_on_device),
                  Op::recompute(2), Op::backward(2), Op::recompute(1), Op::backward(1), Op::recompute(0),
                  Op::backward(0)});
}

TEST(ScheduleTest, HostHoldsPrintAsCaret) {
  EXPECT_EQ(full_host().to_string(), "F0c+ F1c^ F2c^ R2 B2 R1 B1 R0 B0");
  EXPECT_EQ(full_host(true).to_string(), "F0c+ F1c^ F2c+ R2 B2 R1 B1 R0 B0");
  EXPECT_NO_THROW(validate(full_host()));
}

TEST(ScheduleTest, ValidateRejectsImpossibleHostHolds) {
  ScheduleOp no_hold = Op::forward(1, C, false);
  no_hold.offload = true;  // the factory would have cleared it
  const std::vector<BadCase> cases = {
      {"host hold of a keep forward",
       make(2, {Op::forward(0, K, false), Op::forward(1, K, true, true), Op::backward(1), Op::backward(0)}),
       "schedule op 1 (F1k^): a host hold needs save option selective or checkpoint"},
      {"host hold of the token ids",
       make(1, {Op::forward(0, C, true, true), Op::recompute(0), Op::backward(0)}),
       "schedule op 0 (F0c^): a host hold needs stage > 0"},
      {"offload without hold",
       make(2, {Op::forward(0, K, false), no_hold, Op::recompute(1), Op::backward(1), Op::backward(0)}),
       "schedule op 1 (F1c^): a host hold (offload) needs hold_input"},
      {"host hold of a held input",
       make(3, {Op::forward(0, K, false), Op::forward(1, C, true), Op::forward(2, K, false), Op::backward(2),
                Op::forward(1, C, true, true), Op::recompute(1), Op::backward(1), Op::backward(0)}),
       "schedule op 4 (F1c^): a host hold of a_1, which is already held"},
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

TEST(ScheduleTest, HostHoldsLeaveTheFootprintAndStagingComesBack) {
  const ChainCosts c = toy_chain(3);
  // Depth 0: F0 0+110 -> a_1 10; F1c^ 10+110 -> a_2 10 (a_1 left); F2c^ 10+101 -> 0; R2 with
  // a_2 staged: 10+100 -> tape 100 + staged 10 (the tape's input reference is the staged
  // copy, counted once); B2 -> 0 (staging released); R1 (staged a_1) 10+100 -> 110; B1 -> 0;
  // R0 0+100 -> 100; B0 -> 0.
  SimOptions d0;
  d0.prefetch_depth = 0;
  const Prediction p0 = simulate(full_host(), c, d0);
  EXPECT_THAT(p0.footprint_after_op, ElementsAre(10u, 10u, 0u, 110u, 0u, 110u, 0u, 100u, 0u));
  EXPECT_EQ(p0.peak_activation_bytes, 120u);
  EXPECT_EQ(p0.peak_op, 1);
  EXPECT_EQ(p0.offload.d2h_bytes, 20u);
  EXPECT_EQ(p0.offload.h2d_bytes, 20u);
  EXPECT_EQ(p0.offload.pinned_bytes, 8192u);
  EXPECT_EQ(p0.offload.peak_staging_bytes, 10u);
  EXPECT_FALSE(p0.offload.timed);  // no link bandwidth
  // Compute and recompute are those of the device schedule.
  const Prediction dev = simulate(full_host(true), c);
  EXPECT_DOUBLE_EQ(p0.compute_s, 12.0);
  EXPECT_DOUBLE_EQ(p0.recompute_s, 3.0);
  EXPECT_DOUBLE_EQ(p0.recompute_flops, 270.0);

  // Depth 1: a_1 is staged from op 3 on, alongside a_2: R2 starts at 20 (+100 = 120), after
  // it 120; B2 -> 10 (a_1's staging); R1 10+100 -> 110.
  const Prediction p1 = simulate(full_host(), c, SimOptions{});
  EXPECT_THAT(p1.footprint_after_op, ElementsAre(10u, 10u, 0u, 120u, 10u, 110u, 0u, 100u, 0u));
  EXPECT_EQ(p1.peak_activation_bytes, 120u);
  EXPECT_EQ(p1.offload.peak_staging_bytes, 20u);
  // Total: B2 starts at 120 with no gradient (the loss's) + 50; B1 at 110 + a_2's gradient 10
  // + 50 = 170.
  EXPECT_EQ(p1.peak_total_bytes, 170u);

  // Contiguous, depth 1: two slots of 512 bytes (10 rounded) count throughout.
  const Prediction pc = simulate(full_host(), c, layout_offload(full_host(), c, 1, true));
  EXPECT_THAT(pc.footprint_after_op,
              ElementsAre(1034u, 1034u, 1024u, 1124u, 1024u, 1124u, 1024u, 1124u, 1024u));
  EXPECT_EQ(pc.peak_activation_bytes, 1024u + 120u);  // F1 at 10 + 110, plus the arena
  EXPECT_EQ(pc.peak_op, 1);
  EXPECT_EQ(pc.offload.peak_staging_bytes, 1024u);
  // B1: 100 (tape) + 1024 + gradient 10 + workspace 50.
  EXPECT_EQ(pc.peak_total_bytes, 1184u);

  // The same schedule without host holds peaks higher (Note [Activation bytes]: 121).
  const Schedule dev_full = make(3, {Op::forward(0, C, true), Op::forward(1, C, true), Op::forward(2, C, true),
                                     Op::recompute(2), Op::backward(2), Op::recompute(1), Op::backward(1),
                                     Op::recompute(0), Op::backward(0)});
  EXPECT_EQ(simulate(dev_full, c, SimOptions{}).peak_activation_bytes, 121u);
  EXPECT_EQ(simulate(dev_full, c, SimOptions{}).offload.d2h_bytes, 0u);
  EXPECT_EQ(dev.offload.d2h_bytes, 10u);
}

// The contiguity the simulator counts is the layout's; a layout that is not the schedule's
// own is refused, naming both.
TEST(ScheduleTest, SimulateTakesTheLayoutItIsGivenAndNoOther) {
  const ChainCosts c = toy_chain(3);
  const OffloadLayout slots = layout_offload(full_host(), c, 1);
  EXPECT_FALSE(slots.contiguous);
  EXPECT_EQ(simulate(full_host(), c, slots).footprint_after_op,
            simulate(full_host(), c, SimOptions{}).footprint_after_op);
  const OffloadLayout arena = layout_offload(full_host(), c, 1, true);
  EXPECT_TRUE(arena.contiguous);
  EXPECT_EQ(simulate(full_host(), c, arena).offload.peak_staging_bytes,
            arena.staging_arena_bytes());
  for (const OffloadLayout& wrong : {layout_offload(full_host(true), c, 1), OffloadLayout{}}) {
    try {
      simulate(full_host(), c, wrong);
      FAIL();
    } catch (const InvalidArgument& e) {
      EXPECT_THAT(e.what(), HasSubstr("simulate: the offload layout has " +
                                      std::to_string(wrong.entries.size()) +
                                      " entries that are not the schedule's 2 host holds"));
    }
  }
}

TEST(ScheduleTest, ReforwardReadingAStagedInputCountsItOnce) {
  const ChainCosts c = toy_chain(3);
  // uniform-like: hold a_1 on the host, forward 1..2 with kCheckpoint, re-forward 1 with
  // kKeep from the staged a_1 (its tape references the staged copy), recompute 2 from cur.
  Schedule s = make(3, {Op::forward(0, K, false), Op::forward(1, C, true, true), Op::forward(2, C, false),
                        Op::forward(1, K, false), Op::recompute(2), Op::backward(2), Op::backward(1),
                        Op::backward(0)});
  SimOptions d0;
  d0.prefetch_depth = 0;
  const Prediction p = simulate(s, c, d0);
  // F0k 0+110 -> tape 100 + a_1 10 = 110;
  // F1c^: 110+110 -> 100 + a_2 10 (a_1 left) = 110; F2c 110+101 -> 100; F1k reads the staged
  // a_1 (use = prefetch = 3): 100 + 10 + 110 -> 100 + 10 + 100 + a_2 10 = 220; R2 from cur a_2:
  // 220+100 -> 320; B2 -> 220 (cur a_2 stays until B1); B1 -> 100 (staging released);
  // B0 -> 0.
  EXPECT_THAT(p.footprint_after_op, ElementsAre(110u, 110u, 100u, 220u, 320u, 220u, 100u, 0u));
  EXPECT_EQ(p.peak_activation_bytes, 320u);
}

// Timing (Note [Offload timing]): ops take F 1, R 1, B 2 seconds; a copy of 10 bytes takes
// 10 / link.
TEST(ScheduleTest, SlowLinkIsExposedAndFastLinkHidden) {
  const ChainCosts c = toy_chain(3);
  SimOptions o;
  o.prefetch_depth = 1;
  o.link_bytes_per_s = 2.0;  // 5 s per copy
  // Both host holds, depth 1. D2H a_1 1..6, a_2 max(2, 6)..11. At R2 (T = 3): H2D a_2
  // max(3, 11)..16, a_1 16..21; R2 waits 13 (T = 16 -> 17), B2 -> 19, R1 waits 2 (T = 21).
  Prediction p = simulate(full_host(), c, o);
  ASSERT_TRUE(p.offload.timed);
  EXPECT_DOUBLE_EQ(p.offload.copy_busy_s, 20.0);
  EXPECT_DOUBLE_EQ(p.offload.exposed_s, 15.0);
  EXPECT_THAT(p.offload.exposed_by_stage, ElementsAre(0.0, 2.0, 13.0));
  EXPECT_DOUBLE_EQ(p.compute_s, 12.0);  // no waits inside
  EXPECT_DOUBLE_EQ(p.offload.hidden_fraction(), 0.25);
  // Depth 0: a_1 is loaded at R1 (T = 19): max(19, 16)..24, a wait of 5.
  o.prefetch_depth = 0;
  p = simulate(full_host(), c, o);
  EXPECT_DOUBLE_EQ(p.offload.exposed_s, 18.0);
  EXPECT_THAT(p.offload.exposed_by_stage, ElementsAre(0.0, 5.0, 13.0));

  // a_2 on device, only a_1 on the host, depth 1: prefetched at B2 (op 4, T = 4).
  o.prefetch_depth = 1;
  // Slow: D2H 1..6, H2D max(4, 6)..11, R1 at T = 6 waits 5.
  p = simulate(full_host(true), c, o);
  EXPECT_DOUBLE_EQ(p.offload.copy_busy_s, 10.0);
  EXPECT_DOUBLE_EQ(p.offload.exposed_s, 5.0);
  EXPECT_DOUBLE_EQ(p.offload.hidden_fraction(), 0.5);
  // Fast (0.1 s per copy): D2H 1..1.1, H2D 4..4.1, R1 at T = 6: hidden.
  o.link_bytes_per_s = 100.0;
  p = simulate(full_host(true), c, o);
  EXPECT_DOUBLE_EQ(p.offload.copy_busy_s, 0.2);
  EXPECT_DOUBLE_EQ(p.offload.exposed_s, 0.0);
  EXPECT_DOUBLE_EQ(p.offload.hidden_fraction(), 1.0);
  // Fast but on demand (depth 0): the load starts at R1 itself, fully exposed.
  o.prefetch_depth = 0;
  p = simulate(full_host(true), c, o);
  EXPECT_NEAR(p.offload.exposed_s, 0.1, 1e-12);
  EXPECT_NEAR(p.offload.exposed_by_stage[1], 0.1, 1e-12);
  // Without times (analytic costs) nothing is timed.
  ChainCosts a = c;
  a.source = "analytic";
  EXPECT_FALSE(simulate(full_host(), a, o).offload.timed);
  EXPECT_DOUBLE_EQ(simulate(full_host(), a, o).offload.exposed_s, 0.0);
}

}  // namespace
}  // namespace porter::checkpoint
