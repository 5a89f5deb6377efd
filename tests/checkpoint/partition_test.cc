// Partitioned checkpoints in the planner (Note [Partition placement]), the layout (Note
// [Partition semantics]) and the simulator (Note [Partition timing]): slices, the threshold,
// the printed schedule, per-rank bytes and the gathers' time, hand-computed, and the optimal
// planner staying within its budget.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <random>

#include "base/error.h"
#include "models/analytic.h"
#include "checkpoint/offload_plan.h"
#include "checkpoint/planner.h"
#include "checkpoint/simulate.h"

namespace porter::checkpoint {
namespace {

using ::testing::HasSubstr;

// Six stages: a non-block embedding and head around four blocks, inputs of uneven sizes (1001
// divides by neither 2 nor 4) so that the slice (16) and staging (512) roundings show.
ChainCosts six_stages() {
  const size_t inputs[] = {0, 1001, 5000, 3000, 600, 2000};
  ChainCosts c;
  c.source = "analytic";
  for (int i = 0; i < 6; ++i) {
    StageCost s;
    s.name = "s" + std::to_string(i);
    s.is_block = i >= 1 && i <= 4;
    s.input_bytes = inputs[i];
    s.output_bytes = i == 5 ? 4 : inputs[i + 1];
    OptionCost& k = s.option(SaveOption::kKeep);
    k.available = true;
    k.forward_peak_bytes = 100 + s.output_bytes;
    k.saved_bytes = 100;
    k.tape_refs_input = true;
    OptionCost& ck = s.option(SaveOption::kCheckpoint);
    ck = k;
    ck.saved_bytes = 0;
    ck.tape_refs_input = false;
    ck.recompute_peak_bytes = 100;
    ck.recompute_saved_bytes = 100;
    c.stages.push_back(s);
  }
  return c;
}

// Three stages with round sizes for footprints by hand: a_1 = 4000, a_2 = 8000 bytes; a
// forward peaks at its output + 100, a recompute at 100 and saves 100; one second per op.
ChainCosts three_stages() {
  const size_t inputs[] = {0, 4000, 8000};
  ChainCosts c;
  c.source = "profiled";
  for (int i = 0; i < 3; ++i) {
    StageCost s;
    s.name = "s" + std::to_string(i);
    s.is_block = i == 1;
    s.input_bytes = inputs[i];
    s.output_bytes = i == 2 ? 4 : inputs[i + 1];
    s.backward_s = 1.0;
    OptionCost& k = s.option(SaveOption::kKeep);
    k.available = true;
    k.forward_s = 1.0;
    k.forward_peak_bytes = 100 + s.output_bytes;
    k.saved_bytes = 100;
    k.tape_refs_input = true;
    OptionCost& ck = s.option(SaveOption::kCheckpoint);
    ck = k;
    ck.saved_bytes = 0;
    ck.tape_refs_input = false;
    ck.recompute_s = 1.0;
    ck.recompute_peak_bytes = 100;
    ck.recompute_saved_bytes = 100;
    c.stages.push_back(s);
  }
  return c;
}

PartitionOptions ways(int t, size_t min_bytes = 0, double tp_bytes_per_s = 0) {
  PartitionOptions p;
  p.ways = t;
  p.min_bytes = min_bytes;
  p.tp_bytes_per_s = tp_bytes_per_s;
  return p;
}

Schedule partitioned(Schedule s, const ChainCosts& c, const PartitionOptions& p) {
  place_partition(s, c, p);
  return s;
}

// The options from a config: RunOptions (tests/engine/run_options_test.cc).
TEST(PartitionTest, SliceBytesRoundUpToSixteen) {
  EXPECT_EQ(partition_slice_bytes(0, 2), 0u);
  EXPECT_EQ(partition_slice_bytes(1, 2), 16u);
  EXPECT_EQ(partition_slice_bytes(1001, 1), 1008u);
  EXPECT_EQ(partition_slice_bytes(1001, 2), 512u);  // ceil 500.5 = 501 -> 512
  EXPECT_EQ(partition_slice_bytes(1001, 4), 256u);  // 251 -> 256
  EXPECT_EQ(partition_slice_bytes(36, 4), 16u);     // 9 -> 16: ranks 2 and 3 are mostly padding
  EXPECT_EQ(partition_slice_bytes(4096, 4), 1024u);
}

TEST(PartitionTest, OneWayPartitionsNothing) {
  const ChainCosts c = six_stages();
  const Schedule full = schedule_full(c);
  const Schedule one = partitioned(full, c, ways(1));
  EXPECT_EQ(one, full);
  EXPECT_EQ(one.to_string(), "F0c+ F1c+ F2c+ F3c+ F4c+ F5c+ R5 B5 R4 B4 R3 B3 R2 B2 R1 B1 R0 B0");
  EXPECT_TRUE(layout_offload(one, c, 1).empty());
  EXPECT_EQ(plan_layout(one, c, OffloadOptions{}, ways(1)), OffloadLayout{});
  // And a partitioned schedule needs a group of two or more.
  const Schedule two = partitioned(full, c, ways(2));
  try {
    layout_offload(two, c, 1, false, 1);
    ADD_FAILURE() << "a one-rank layout of partitioned holds";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("partitioning needs a tensor-parallel group of 2 or more"));
  }
}

TEST(PartitionTest, TwoAndFourWaysOfTheFullSchedule) {
  const ChainCosts c = six_stages();
  const Schedule s2 = partitioned(schedule_full(c), c, ways(2));
  // Ops: 0..5 F0..F5, 6 R5, 7 B5, 8 R4, 9 B4, 10 R3, 11 B3, 12 R2, 13 B2, 14 R1, 15 B1, 16 R0,
  // 17 B0. a_0 (token ids) stays whole.
  ASSERT_EQ(s2.to_string(), "F0c+ F1c+/ F2c+/ F3c+/ F4c+/ F5c+/ R5 B5 R4 B4 R3 B3 R2 B2 R1 B1 R0 B0");
  EXPECT_EQ(partitioned(schedule_full(c), c, ways(4)), s2);  // the marks do not say how many ways

  struct Want {
    int stage, hold, use, prefetch, release, slot, slice_slot;
    size_t slice;
  };
  auto expect = [](const OffloadLayout& l, const std::vector<Want>& want) {
    ASSERT_EQ(l.entries.size(), want.size());
    for (size_t e = 0; e < want.size(); ++e) {
      SCOPED_TRACE("entry " + std::to_string(e));
      const StashEntry& s = l.entries[e];
      EXPECT_EQ(s.stage, want[e].stage);
      EXPECT_EQ(s.hold_op, want[e].hold);
      EXPECT_EQ(s.use_op, want[e].use);
      EXPECT_EQ(s.prefetch_op, want[e].prefetch);
      EXPECT_EQ(s.release_op, want[e].release);
      EXPECT_EQ(s.staging_slot, want[e].slot);
      EXPECT_EQ(s.slice_slot, want[e].slice_slot);
      EXPECT_EQ(s.slice_bytes, want[e].slice);
      EXPECT_TRUE(s.partitioned);
      EXPECT_FALSE(s.on_host);
      EXPECT_EQ(l.staged_bytes(s), static_cast<size_t>(l.ways) * want[e].slice);
    }
  };
  // Two ways, depth 1 (the ops of OffloadLayoutTest.FullScheduleAtEachDepth). Slices: 1001 ->
  // 512, 5000 -> 2512 (2500 rounded), 3000 -> 1504, 600 -> 304, 2000 -> 1008. Every slice is
  // alive from its hold (1..5) to its use, so five slice slots; the largest slice, 2512,
  // rounds to a 2560-byte slot. Gathered copies 2 x slice, the largest 5024 -> 5120.
  const OffloadLayout l2 = layout_offload(s2, c, 1, true, 2);
  EXPECT_EQ(l2.ways, 2);
  EXPECT_TRUE(l2.any_partitioned());
  expect(l2, {{1, 1, 14, 12, 15, 0, 0, 512}, {2, 2, 12, 10, 13, 1, 1, 2512}, {3, 3, 10, 8, 11, 0, 2, 1504},
              {4, 4, 8, 6, 9, 1, 3, 304}, {5, 5, 6, 6, 7, 0, 4, 1008}});
  EXPECT_EQ(l2.staging_slots, 2);
  EXPECT_EQ(l2.staging_slot_bytes, 5120u);
  EXPECT_EQ(l2.slice_slots, 5);
  EXPECT_EQ(l2.slice_slot_bytes, 2560u);
  EXPECT_EQ(l2.slice_arena_bytes(), 5 * 2560u);
  EXPECT_EQ(l2.pinned_bytes, 0u);  // nothing on the host
  EXPECT_EQ(l2.offloaded_bytes, 0u);

  // Four ways: 1001 -> 256, 5000 -> 1264 (1250), 3000 -> 752 (750), 600 -> 160 (150), 2000 ->
  // 512 (500). Gathered copies: 4 x 1264 = 5056 -> a 5120-byte staging slot.
  const OffloadLayout l4 = layout_offload(s2, c, 1, false, 4);
  expect(l4, {{1, 1, 14, 12, 15, 0, 0, 256}, {2, 2, 12, 10, 13, 1, 1, 1264}, {3, 3, 10, 8, 11, 0, 2, 752},
              {4, 4, 8, 6, 9, 1, 3, 160}, {5, 5, 6, 6, 7, 0, 4, 512}});
  EXPECT_EQ(l4.staging_slot_bytes, 5120u);
  EXPECT_EQ(l4.slice_slot_bytes, 1536u);  // 1264 rounded to 512
}

TEST(PartitionTest, SliceSlotsAreReusedAfterTheirUse) {
  const ChainCosts c = six_stages();
  // Uniform, 2 blocks a segment: 0 F0k, 1 F1c+/, 2 F2c, 3 F3c+/, 4 F4c, 5 F5k, 6 B5, 7 F3k,
  // 8 R4, 9 B4, 10 B3, 11 F1k, 12 R2, 13 B2, 14 B1, 15 B0. Both slices are held before either
  // is used (a_3 at 7, a_1 at 11): two slots.
  const Schedule u = partitioned(schedule_uniform(c, 2), c, ways(2));
  ASSERT_EQ(u.to_string(), "F0k F1c+/ F2c F3c+/ F4c F5k B5 F3k R4 B4 B3 F1k R2 B2 B1 B0");
  const OffloadLayout l = layout_offload(u, c, 0, true, 2);
  ASSERT_EQ(l.entries.size(), 2u);
  EXPECT_EQ(l.entries[0].use_op, 11);
  EXPECT_EQ(l.entries[1].use_op, 7);
  EXPECT_EQ(l.entries[0].slice_slot, 0);
  EXPECT_EQ(l.entries[1].slice_slot, 1);
  EXPECT_EQ(l.slice_slots, 2);

  // a_1 is used (op 3, a re-forward) before a_2 is held (op 4), so a_2's slice takes a_1's
  // slot; their gathered copies overlap (3..8 and 5..6): two staging slots.
  Schedule s;
  s.num_stages = 3;
  s.ops = {ScheduleOp::forward(0, SaveOption::kKeep, false),
           ScheduleOp::forward(1, SaveOption::kCheckpoint, true, false, true),
           ScheduleOp::forward(2, SaveOption::kCheckpoint, false),
           ScheduleOp::forward(1, SaveOption::kCheckpoint, false),
           ScheduleOp::forward(2, SaveOption::kCheckpoint, true, false, true),
           ScheduleOp::recompute(2),
           ScheduleOp::backward(2),
           ScheduleOp::recompute(1),
           ScheduleOp::backward(1),
           ScheduleOp::backward(0)};
  ASSERT_EQ(s.to_string(), "F0k F1c+/ F2c F1c F2c+/ R2 B2 R1 B1 B0");
  const OffloadLayout l3 = layout_offload(s, three_stages(), 0, true, 2);
  ASSERT_EQ(l3.entries.size(), 2u);
  EXPECT_EQ(l3.entries[0].use_op, 3);
  EXPECT_EQ(l3.entries[1].hold_op, 4);
  EXPECT_EQ(l3.entries[1].slice_slot, 0);
  EXPECT_EQ(l3.slice_slots, 1);
  EXPECT_EQ(l3.slice_slot_bytes, 4096u);  // a_2's slice of 4000, rounded to 512
  EXPECT_EQ(l3.staging_slots, 2);
}

TEST(PartitionTest, TheThresholdKeepsSmallHoldsWhole) {
  const ChainCosts c = six_stages();
  // min 2000: 1001 and 600 stay whole; 5000, 3000 and 2000 (not below it) are partitioned.
  const Schedule s = partitioned(schedule_full(c), c, ways(2, 2000));
  EXPECT_EQ(s.to_string(), "F0c+ F1c+ F2c+/ F3c+/ F4c+ F5c+/ R5 B5 R4 B4 R3 B3 R2 B2 R1 B1 R0 B0");
  const OffloadLayout l = layout_offload(s, c, 1, false, 2);
  ASSERT_EQ(l.entries.size(), 3u);
  EXPECT_EQ(l.entries[0].stage, 2);
  EXPECT_EQ(l.entries[1].stage, 3);
  EXPECT_EQ(l.entries[2].stage, 5);
  // Above every input nothing is partitioned.
  EXPECT_EQ(partitioned(schedule_full(c), c, ways(2, 5001)), schedule_full(c));
  // A keep forward's hold is never partitioned (its tape references a_i), and validate()
  // rejects one as it rejects a host hold.
  Schedule keep;
  keep.num_stages = 3;
  keep.ops = {ScheduleOp::forward(0, SaveOption::kKeep, false), ScheduleOp::forward(1, SaveOption::kKeep, true),
              ScheduleOp::forward(2, SaveOption::kKeep, false), ScheduleOp::backward(2),
              ScheduleOp::backward(1), ScheduleOp::backward(0)};
  EXPECT_FALSE(partitioned(keep, three_stages(), ways(2)).ops[1].partition);
  keep.ops[1].partition = true;
  try {
    validate(keep);
    ADD_FAILURE() << "a partitioned keep hold";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("schedule op 1 (F1k+/): a partitioned hold needs save option selective or "
                                    "checkpoint"));
  }
  Schedule tokens = schedule_full(three_stages());
  tokens.ops[0].partition = true;
  EXPECT_THROW(validate(tokens), InvalidArgument);  // a_0 is the token ids
}

TEST(PartitionTest, WithOffloadOnlyTheSliceGoesToTheHost) {
  const ChainCosts c = six_stages();
  Schedule s = schedule_full(c);
  place_offload(s, c, 1);
  place_partition(s, c, ways(4, 1000));
  // a_5 stays on the device (keep_last_on_device 1), partitioned; a_4 (600) is below the
  // threshold and goes to the host whole.
  ASSERT_EQ(s.to_string(), "F0c+ F1c^/ F2c^/ F3c^/ F4c^ F5c+/ R5 B5 R4 B4 R3 B3 R2 B2 R1 B1 R0 B0");
  const OffloadLayout l = layout_offload(s, c, 1, false, 4);
  ASSERT_EQ(l.entries.size(), 5u);
  const size_t host[] = {256, 1264, 752, 600};  // slices, and a_4 whole
  size_t offset = 0;
  for (int e = 0; e < 4; ++e) {
    SCOPED_TRACE("entry " + std::to_string(e));
    EXPECT_TRUE(l.entries[e].on_host);
    EXPECT_EQ(l.entries[e].partitioned, e != 3);
    EXPECT_EQ(l.host_bytes(l.entries[e]), host[e]);
    EXPECT_EQ(l.entries[e].pinned_offset, offset);
    offset += 4096;
  }
  EXPECT_FALSE(l.entries[4].on_host);
  EXPECT_TRUE(l.entries[4].partitioned);
  EXPECT_EQ(l.pinned_bytes, 4 * 4096u);
  EXPECT_EQ(l.offloaded_bytes, 256u + 1264 + 752 + 600);
  // The simulator copies the slices each way: the bytes per rank.
  const Prediction p = simulate(s, c, l);
  EXPECT_EQ(p.offload.d2h_bytes, 256u + 1264 + 752 + 600);
  EXPECT_EQ(p.offload.h2d_bytes, 256u + 1264 + 752 + 600);
  EXPECT_EQ(p.offload.gathers, 4);
  EXPECT_EQ(p.offload.gathered_bytes, 3 * (256u + 1264 + 752 + 512));
}

// Note [Partition semantics]'s footprint, by hand. Full schedule, two ways: 0 F0c+, 1 F1c+/,
// 2 F2c+/, 3 R2, 4 B2, 5 R1, 6 B1, 7 R0, 8 B0; slices of 2000 and 4000 bytes, gathered copies
// of 4000 and 8000.
TEST(PartitionTest, SimulatedBytesPerRank) {
  const ChainCosts c = three_stages();
  const Schedule s = partitioned(schedule_full(c), c, ways(2));
  ASSERT_EQ(s.to_string(), "F0c+ F1c+/ F2c+/ R2 B2 R1 B1 R0 B0");

  // Depth 0, separate slots:
  //   F0  start 0: peak 4100 (a_1 being made); after a_1 = 4000
  //   F1  a_1 + its slice 2000 = 6000 at the start, peak 6000 + 8100; after: a_2 + slice = 10000
  //   F2  a_2 + 2000 + 4000 = 14000, peak 14104; after: the slices, 6000 (the loss is consumed)
  //   R2  a_2's gathered copy 8000 is staged before it, then fetch() frees a_2's slice: the
  //       moment in between holds 2000 + 8000 + 4000 = 14000; R2 itself starts at 10000 and
  //       peaks at 10100; after 10100
  //   B2  10100; after: a_1's slice, 2000
  //   R1  staged 4000 + slice 2000 = 6000 at the fetch, 4000 at the start, peak 4100
  //   B1  4100; R0 100; B0 100.
  const OffloadLayout l0 = layout_offload(s, c, 0, false, 2);
  const Prediction p0 = simulate(s, c, l0);
  EXPECT_EQ(p0.footprint_after_op, (std::vector<size_t>{4000, 10000, 6000, 10100, 2000, 4100, 0, 100, 0}));
  EXPECT_EQ(p0.peak_activation_bytes, 14104u);
  EXPECT_EQ(p0.peak_op, 2);
  EXPECT_EQ(p0.offload.peak_slice_bytes, 6000u);
  EXPECT_EQ(p0.offload.peak_staging_bytes, 8000u);
  EXPECT_EQ(p0.offload.gathers, 2);
  EXPECT_EQ(p0.offload.gathered_bytes, 6000u);
  EXPECT_EQ(p0.offload.d2h_bytes, 0u);
  EXPECT_EQ(p0.offload.pinned_bytes, 0u);

  // Depth 1: a_1's gather is issued at R2 too (segment starts 3, 5, 7), so the moment before
  // R2 holds both gathered copies and a_2's slice: 2000 + 4000 + 8000 + 4000 = 18000.
  const OffloadLayout l1 = layout_offload(s, c, 1, false, 2);
  ASSERT_EQ(l1.entries[0].prefetch_op, 3);
  const Prediction p1 = simulate(s, c, l1);
  EXPECT_EQ(p1.peak_activation_bytes, 18000u);
  EXPECT_EQ(p1.peak_op, 3);
  EXPECT_EQ(p1.footprint_after_op[3], 14100u);

  // Contiguous: the arenas count throughout: one 8192-byte staging slot at depth 0 and two
  // slice slots of 4096, 16384 bytes above the activations alone (a_1 and a_2 while they are
  // the current activation, the tapes).
  const OffloadLayout lc = layout_offload(s, c, 0, true, 2);
  EXPECT_EQ(lc.staging_arena_bytes() + lc.slice_arena_bytes(), 16384u);
  const Prediction pc = simulate(s, c, lc);
  EXPECT_EQ(pc.footprint_after_op,
            (std::vector<size_t>{20384, 24384, 16384, 16484, 16384, 16484, 16384, 16484, 16384}));
  EXPECT_EQ(pc.peak_activation_bytes, 16384u + 4000 + 8100);  // at F1, as without partitioning
  EXPECT_EQ(pc.peak_op, 1);
  EXPECT_EQ(pc.offload.peak_slice_bytes, 8192u);
  EXPECT_EQ(pc.offload.peak_staging_bytes, 8192u);

  // A layout that is not the schedule's is refused.
  OffloadLayout wrong = l0;
  wrong.entries[0].on_host = true;
  EXPECT_THROW(simulate(s, c, wrong), InvalidArgument);
  wrong = l0;
  wrong.ways = 4;
  EXPECT_THROW(simulate(s, c, wrong), InvalidArgument);
}

// Note [Partition timing], by hand: one second per op, the tp link at 1000 B/s, so a_2's
// gather ((2-1) x 4000 bytes) takes 4 s and a_1's 2 s.
TEST(PartitionTest, GathersAreTimedOnTheTpLink) {
  const ChainCosts c = three_stages();
  const Schedule s = partitioned(schedule_full(c), c, ways(2));
  // Depth 0: each gather starts at its use and is waited for in full.
  const Prediction p0 = simulate(s, c, layout_offload(s, c, 0, false, 2), 0.0, 1000.0);
  EXPECT_TRUE(p0.offload.gather_timed);
  EXPECT_FALSE(p0.offload.timed);
  EXPECT_DOUBLE_EQ(p0.offload.gather_busy_s, 6.0);
  EXPECT_DOUBLE_EQ(p0.offload.gather_exposed_s, 6.0);
  EXPECT_DOUBLE_EQ(p0.offload.exposed_s, 0.0);
  EXPECT_EQ(p0.offload.gather_exposed_by_stage, (std::vector<double>{0.0, 2.0, 4.0}));
  // Depth 1: both at R2 (T = 3), a_2's first: it ends at 7, a_1's at 9. R2 waits 4; R2 and B2
  // run to T = 9, when a_1's has landed.
  const Prediction p1 = simulate(s, c, layout_offload(s, c, 1, false, 2), 0.0, 1000.0);
  EXPECT_DOUBLE_EQ(p1.offload.gather_busy_s, 6.0);
  EXPECT_DOUBLE_EQ(p1.offload.gather_exposed_s, 4.0);
  // The unknown tp link times nothing.
  const Prediction untimed = simulate(s, c, layout_offload(s, c, 1, false, 2), 0.0, 0.0);
  EXPECT_FALSE(untimed.offload.gather_timed);
  EXPECT_DOUBLE_EQ(untimed.offload.gather_exposed_s, 0.0);

  // Host slices: the copies move the slices (2000 and 4000 bytes at 2000 B/s: 1 and 2 s) and
  // the gather starts when the H2D copy ends. D2H: a_1's 1..2, a_2's 2..4. Depth 0: at R2
  // (T = 3) a_2's H2D waits for its D2H, 4..6, its gather 6..10: 3 s exposed for the copy, 4
  // for the gather. R2 and B2 run to T = 12; at R1 a_1's H2D 12..13 and gather 13..15: 1 and 2.
  Schedule h = schedule_full(c);
  place_offload(h, c, 0);
  place_partition(h, c, ways(2));
  ASSERT_EQ(h.to_string(), "F0c+ F1c^/ F2c^/ R2 B2 R1 B1 R0 B0");
  const Prediction ph = simulate(h, c, layout_offload(h, c, 0, false, 2), 2000.0, 1000.0);
  EXPECT_DOUBLE_EQ(ph.offload.copy_busy_s, 2 * (1.0 + 2.0));
  EXPECT_DOUBLE_EQ(ph.offload.exposed_s, 3.0 + 1.0);
  EXPECT_DOUBLE_EQ(ph.offload.gather_exposed_s, 4.0 + 2.0);
  EXPECT_EQ(ph.offload.exposed_by_stage, (std::vector<double>{0.0, 1.0, 3.0}));
  EXPECT_EQ(ph.offload.gather_exposed_by_stage, (std::vector<double>{0.0, 2.0, 4.0}));
}

ChainCosts with_times(ChainCosts c) {
  c.source = "profiled";
  for (StageCost& s : c.stages) {
    s.backward_s = 2.0;
    for (OptionCost& o : s.options) {
      if (!o.available) continue;
      o.forward_s = 1.0;
      o.recompute_s = s.forward_flops > 0 ? o.recompute_flops / s.forward_flops : 0.0;
    }
  }
  return c;
}

void expect_same(const Prediction& a, const Prediction& b) {
  EXPECT_EQ(a.peak_activation_bytes, b.peak_activation_bytes);
  EXPECT_EQ(a.footprint_after_op, b.footprint_after_op);
  EXPECT_EQ(a.offload.peak_slice_bytes, b.offload.peak_slice_bytes);
  EXPECT_EQ(a.offload.gathered_bytes, b.offload.gathered_bytes);
  EXPECT_DOUBLE_EQ(a.offload.gather_exposed_s, b.offload.gather_exposed_s);
}

config::ModelConfig gpt(int64_t layers) {
  config::ModelConfig m;
  m.layers = layers;
  m.hidden = 64;
  m.heads = 4;
  m.seq_len = 32;
  m.vocab = 128;
  return m;
}

TEST(PartitionTest, StandardPoliciesPartitionEveryHoldAboveTheThreshold) {
  const ChainCosts c = models::analytic_transformer_costs({gpt(4), 2, 32, tensor::DType::kF32});
  PlanOptions o;
  o.checkpointing.policy = config::CheckpointPolicy::kUniform;
  o.checkpointing.every_n_layers = 2;
  o.partition = ways(2, 1024);
  const Plan p = make_plan(o, c);
  // Stages: embedding, 4 blocks, head. Block inputs are 2 x 32 x 64 x 4 = 16 KiB.
  EXPECT_EQ(p.schedule.to_string(), "F0k F1c+/ F2c F3c+/ F4c F5k B5 F3k R4 B4 B3 F1k R2 B2 B1 B0");
  EXPECT_THAT(p.description, HasSubstr("2 checkpoints partitioned 2 ways"));
  EXPECT_EQ(p.offload.entries.size(), 2u);
  EXPECT_EQ(p.sim.partition_ways, 2);
  EXPECT_EQ(p.stages[1].where, Where::kPartitioned);
  EXPECT_TRUE(p.stages[1].partitioned);
  EXPECT_EQ(p.stages[2].where, Where::kDevice);
  expect_same(p.prediction, predict(p.schedule, c, o.offload, o.partition));
  // The threshold above the block inputs: nothing partitioned.
  o.partition.min_bytes = 16 * 1024 + 1;
  const Plan whole = make_plan(o, c);
  EXPECT_EQ(whole.schedule.to_string(), "F0k F1c+ F2c F3c+ F4c F5k B5 F3k R4 B4 B3 F1k R2 B2 B1 B0");
  EXPECT_THAT(whole.description, HasSubstr("no checkpoint of at least"));
  EXPECT_TRUE(whole.offload.empty());
  // Partitioned and offloaded.
  o.partition.min_bytes = 1024;
  o.offload.enabled = true;
  o.offload.keep_last_on_device = 0;
  const Plan host = make_plan(o, c);
  EXPECT_EQ(host.schedule.to_string(), "F0k F1c^/ F2c F3c^/ F4c F5k B5 F3k R4 B4 B3 F1k R2 B2 B1 B0");
  EXPECT_EQ(host.stages[1].where, Where::kHost);
  EXPECT_TRUE(host.stages[1].partitioned);
  EXPECT_EQ(host.offload.offloaded_bytes, 2 * 8192u);
}

// Note [Partition placement]: the optimal plan fits its budget under the prediction of the
// plan it runs and is never slower than without partitioning at the same budget.
void check_optimal(const ChainCosts& c, const OffloadOptions& offload, const char* what) {
  SCOPED_TRACE(what);
  const PartitionOptions part = ways(4, 1024, 1e6);
  const size_t none = simulate(schedule_none(c), c).peak_activation_bytes;
  const size_t min_whole = minimum_budget_bytes(c, offload);
  const size_t min_part = minimum_budget_bytes(c, offload, part);
  EXPECT_LE(min_part, min_whole);
  std::mt19937_64 rng(7);
  std::uniform_int_distribution<size_t> u(min_part, none);
  PlanOptions o;
  o.checkpointing.policy = config::CheckpointPolicy::kOptimal;
  o.offload = offload;
  for (int k = 0; k < 12; ++k) {
    const size_t budget = k == 0 ? min_part : u(rng);
    o.budget = config::MemoryBudget{uint64_t{budget}};
    o.partition = part;
    const Plan p = make_plan(o, c);
    EXPECT_LE(p.prediction.peak_activation_bytes, budget) << p.schedule.to_string();
    expect_same(p.prediction, predict(p.schedule, c, offload, part));
    EXPECT_EQ(p.offload, plan_layout(p.schedule, c, offload, part));
    if (budget < min_whole) continue;
    o.partition = PartitionOptions{};
    const Plan w = make_plan(o, c);
    const auto time = [](const Prediction& q) {
      return q.compute_s + q.offload.exposed_s + q.offload.gather_exposed_s;
    };
    EXPECT_LE(time(p.prediction), time(w.prediction) + 1e-9) << p.schedule.to_string() << " vs "
                                                              << w.schedule.to_string();
  }
  // Below the minimum: the error states it.
  o.partition = part;
  o.budget = config::MemoryBudget{uint64_t{min_part / 2}};
  try {
    make_plan(o, c);
    ADD_FAILURE() << "a budget below the minimum";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("below the minimum feasible activation peak"));
  }
}

TEST(PartitionTest, OptimalFitsItsBudgetWithPartitionedHolds) {
  const ChainCosts c = with_times(models::analytic_transformer_costs({gpt(8), 2, 32, tensor::DType::kF32}));
  check_optimal(c, OffloadOptions{}, "device");
  OffloadOptions host;
  host.enabled = true;
  host.link_bytes_per_s = 1e6;
  check_optimal(c, host, "offload");
  OffloadOptions contiguous = host;
  contiguous.contiguous = true;
  contiguous.prefetch_depth = 2;
  check_optimal(c, contiguous, "offload, contiguous, depth 2");
}

TEST(PartitionTest, OptimalPartitionsWhereThatSavesRecompute) {
  // Without times the program minimises recompute FLOPs: where whole holds do not fit,
  // partitioning lets it hold more and recompute less; it is never worse.
  const ChainCosts c = models::analytic_transformer_costs({gpt(8), 2, 32, tensor::DType::kF32});
  const size_t none = simulate(schedule_none(c), c).peak_activation_bytes;
  const size_t lo = minimum_budget_bytes(c);
  PlanOptions o;
  o.checkpointing.policy = config::CheckpointPolicy::kOptimal;
  int better = 0, partitioned_plans = 0;
  for (int k = 0; k <= 20; ++k) {
    const size_t budget = lo + (none - lo) * static_cast<size_t>(k) / 20;
    o.budget = config::MemoryBudget{uint64_t{budget}};
    o.partition = PartitionOptions{};
    const Plan whole = make_plan(o, c);
    o.partition = ways(4, 1024);
    const Plan part = make_plan(o, c);
    EXPECT_LE(part.prediction.peak_activation_bytes, budget);
    EXPECT_LE(part.prediction.recompute_flops, whole.prediction.recompute_flops) << budget;
    better += part.prediction.recompute_flops < whole.prediction.recompute_flops ? 1 : 0;
    partitioned_plans += part.offload.any_partitioned() ? 1 : 0;
  }
  EXPECT_GT(better, 0);
  EXPECT_GT(partitioned_plans, 0);
  // The program alone, at a budget in between, fits under the simulator with its partitioned
  // holds.
  const size_t mid = lo + (none - lo) / 3;
  const std::optional<Schedule> r = schedule_rotor(c, mid, OffloadOptions{}, ways(4, 1024));
  ASSERT_TRUE(r.has_value());
  EXPECT_LE(predict(*r, c, OffloadOptions{}, ways(4, 1024)).peak_activation_bytes, mid);
}

}  // namespace
}  // namespace porter::checkpoint
