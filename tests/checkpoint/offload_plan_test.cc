// The offload layout (Note [Offload semantics]): stash entries, prefetch/use/release ops,
// staging slots and pinned offsets, hand-computed for full and uniform schedules at prefetch
// depths 0..3.
#include "checkpoint/offload_plan.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "base/error.h"
#include "checkpoint/planner.h"

namespace porter::checkpoint {
namespace {

using ::testing::HasSubstr;

// Six stages: a non-block embedding and head around four blocks, inputs of uneven sizes so
// that the pinned (4096) and staging (512) roundings show.
ChainCosts layout_chain() {
  const size_t inputs[] = {0, 1000, 5000, 3000, 600, 2000};
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
    if (s.is_block) {
      OptionCost& sel = s.option(SaveOption::kSelective);
      sel = ck;
      sel.saved_bytes = 50;
      sel.recompute_saved_bytes = 50;
    }
    c.stages.push_back(s);
  }
  return c;
}

struct Ops {
  int stage, hold, use, prefetch, release, slot;
  size_t pinned;
};

void expect_entries(const OffloadLayout& l, const std::vector<Ops>& want) {
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
    EXPECT_EQ(s.pinned_offset, want[e].pinned);
  }
}

Schedule offloaded(Schedule s, const ChainCosts& c, int keep_last) {
  place_offload(s, c, keep_last);
  return s;
}

TEST(OffloadLayoutTest, FullScheduleAtEachDepth) {
  const ChainCosts c = layout_chain();
  const Schedule s = offloaded(schedule_full(c), c, 0);
  // Ops: 0..5 F0..F5, 6 R5, 7 B5, 8 R4, 9 B4, 10 R3, 11 B3, 12 R2, 13 B2, 14 R1, 15 B1, 16 R0,
  // 17 B0. a_0 (token ids) stays; stages 1..5 are held on the host.
  ASSERT_EQ(s.to_string(), "F0c+ F1c^ F2c^ F3c^ F4c^ F5c^ R5 B5 R4 B4 R3 B3 R2 B2 R1 B1 R0 B0");
  // Pinned: 1000, 5000, 3000, 600, 2000 rounded to 4096 each: 4096, 8192, 4096, 4096, 4096.
  const size_t p[] = {0, 4096, 12288, 16384, 20480};

  // Depth 0: every load on demand; one slot reused.
  OffloadLayout d0 = layout_offload(s, c, 0);
  expect_entries(d0, {{1, 1, 14, 14, 15, 0, p[0]}, {2, 2, 12, 12, 13, 0, p[1]}, {3, 3, 10, 10, 11, 0, p[2]},
                      {4, 4, 8, 8, 9, 0, p[3]}, {5, 5, 6, 6, 7, 0, p[4]}});
  EXPECT_EQ(d0.staging_slots, 1);
  EXPECT_EQ(d0.staging_slot_bytes, 5120u);  // 5000 rounded to 512
  EXPECT_EQ(d0.staging_arena_bytes(), 5120u);
  EXPECT_EQ(d0.pinned_bytes, 24576u);
  EXPECT_EQ(d0.offloaded_bytes, 11600u);
  EXPECT_EQ(d0.entry_at_hold(3), 2);
  EXPECT_EQ(d0.entry_at_hold(0), -1);
  EXPECT_EQ(d0.entry_at_hold(6), -1);

  // Depth 1: by use a_5 (6), a_4 (8), a_3 (10), a_2 (12), a_1 (14). a_5 at the first backward
  // (7) clamped to its use 6; a_4 at a_5's use (6); a_3 at 8; a_2 at 10; a_1 at 12.
  // Slots in prefetch order: a_5 0 (free after 7), a_4 1 (free after 9), a_3 at 8: 0, a_2 at
  // 10: 1, a_1 at 12: 0.
  OffloadLayout d1 = layout_offload(s, c, 1);
  expect_entries(d1, {{1, 1, 14, 12, 15, 0, p[0]}, {2, 2, 12, 10, 13, 1, p[1]}, {3, 3, 10, 8, 11, 0, p[2]},
                      {4, 4, 8, 6, 9, 1, p[3]}, {5, 5, 6, 6, 7, 0, p[4]}});
  EXPECT_EQ(d1.staging_slots, 2);
  EXPECT_EQ(d1.staging_arena_bytes(), 10240u);

  // Depth 2: a_5 6 (clamped), a_4 at the first backward 7, a_3 at a_5's use 6, a_2 at 8, a_1
  // at 10. Prefetch order a_5, a_3 (6), a_4 (7), a_2 (8), a_1 (10): slots 0, 1, 2, 0 (a_5 out
  // after 7), 2 (a_4 out after 9).
  OffloadLayout d2 = layout_offload(s, c, 2);
  expect_entries(d2, {{1, 1, 14, 10, 15, 2, p[0]}, {2, 2, 12, 8, 13, 0, p[1]}, {3, 3, 10, 6, 11, 1, p[2]},
                      {4, 4, 8, 7, 9, 2, p[3]}, {5, 5, 6, 6, 7, 0, p[4]}});
  EXPECT_EQ(d2.staging_slots, 3);

  // Depth 3: a_5 6, a_4 7, a_3 7 (the first backward), a_2 at a_5's use 6, a_1 at a_4's 8.
  // Prefetch order a_5, a_2 (6), a_4, a_3 (7), a_1 (8): slots 0, 1, 2, 3, 0.
  OffloadLayout d3 = layout_offload(s, c, 3);
  expect_entries(d3, {{1, 1, 14, 8, 15, 0, p[0]}, {2, 2, 12, 6, 13, 1, p[1]}, {3, 3, 10, 7, 11, 3, p[2]},
                      {4, 4, 8, 7, 9, 2, p[3]}, {5, 5, 6, 6, 7, 0, p[4]}});
  EXPECT_EQ(d3.staging_slots, 4);
  EXPECT_EQ(d3.staging_arena_bytes(), 4 * 5120u);
}

// Device holds are segments too: a host hold is prefetched d segments ahead of its use,
// counting the device-held segments that backward visits first.
TEST(OffloadLayoutTest, DeviceHeldSegmentsCountTowardThePrefetchDepth) {
  const ChainCosts c = layout_chain();
  const Schedule s = offloaded(schedule_full(c), c, 2);
  // Ops as in FullScheduleAtEachDepth. Segment starts: 6 (a_5, device), 8 (a_4, device),
  // 10 (a_3), 12 (a_2), 14 (a_1), 16 (a_0, the token ids on the device).
  ASSERT_EQ(s.to_string(), "F0c+ F1c^ F2c^ F3c^ F4c+ F5c+ R5 B5 R4 B4 R3 B3 R2 B2 R1 B1 R0 B0");
  // Depth 1: a_3 at a_4's start 8 (not the first backward 7), a_2 at 10, a_1 at 12. Slots:
  // a_3 0, a_2 1 (a_3 out after 11), a_1 0.
  expect_entries(layout_offload(s, c, 1),
                 {{1, 1, 14, 12, 15, 0, 0}, {2, 2, 12, 10, 13, 1, 4096}, {3, 3, 10, 8, 11, 0, 12288}});
  // Depth 2: a_3 at a_5's start 6, a_2 at 8, a_1 at 10: three copies staged at once.
  const OffloadLayout d2 = layout_offload(s, c, 2);
  expect_entries(d2, {{1, 1, 14, 10, 15, 2, 0}, {2, 2, 12, 8, 13, 1, 4096}, {3, 3, 10, 6, 11, 0, 12288}});
  EXPECT_EQ(d2.staging_slots, 3);
}

TEST(OffloadLayoutTest, UniformScheduleReadsTheHoldInTheReforward) {
  const ChainCosts c = layout_chain();
  const Schedule s = offloaded(schedule_uniform(c, 2), c, 0);
  // 0 F0k, 1 F1c^, 2 F2c, 3 F3c^, 4 F4c, 5 F5k, 6 B5, 7 F3k, 8 R4, 9 B4, 10 B3, 11 F1k, 12 R2,
  // 13 B2, 14 B1, 15 B0. R4 and R2 read cur; the re-forwards F3k and F1k read the holds.
  ASSERT_EQ(s.to_string(), "F0k F1c^ F2c F3c^ F4c F5k B5 F3k R4 B4 B3 F1k R2 B2 B1 B0");
  OffloadLayout d0 = layout_offload(s, c, 0);
  expect_entries(d0, {{1, 1, 11, 11, 14, 0, 0}, {3, 3, 7, 7, 10, 0, 4096}});
  EXPECT_EQ(d0.staging_slots, 1);
  EXPECT_EQ(d0.staging_slot_bytes, 3072u);
  EXPECT_EQ(d0.pinned_bytes, 8192u);
  EXPECT_EQ(d0.offloaded_bytes, 4000u);
  // Depth 1: a_3 at the first backward (6), a_1 at a_3's use (7), while a_3's slot is busy.
  OffloadLayout d1 = layout_offload(s, c, 1);
  expect_entries(d1, {{1, 1, 11, 7, 14, 1, 0}, {3, 3, 7, 6, 10, 0, 4096}});
  EXPECT_EQ(d1.staging_slots, 2);
  // Depth 2 and 3: both at the first backward.
  for (int d : {2, 3}) {
    OffloadLayout l = layout_offload(s, c, d);
    expect_entries(l, {{1, 1, 11, 6, 14, 1, 0}, {3, 3, 7, 6, 10, 0, 4096}});
  }
  // keep_last_on_device = 1 keeps a_3 (read first) on the device.
  const Schedule k1 = offloaded(schedule_uniform(c, 2), c, 1);
  ASSERT_EQ(k1.to_string(), "F0k F1c^ F2c F3c+ F4c F5k B5 F3k R4 B4 B3 F1k R2 B2 B1 B0");
  expect_entries(layout_offload(k1, c, 0), {{1, 1, 11, 11, 14, 0, 0}});
  // Depth 1: a_1 is one segment behind a_3's (device-held) segment, which starts at 7.
  expect_entries(layout_offload(k1, c, 1), {{1, 1, 11, 7, 14, 0, 0}});
  expect_entries(layout_offload(k1, c, 2), {{1, 1, 11, 6, 14, 0, 0}});  // the first backward
  EXPECT_EQ(layout_offload(k1, c, 1).staging_slot_bytes, 1024u);
}

TEST(OffloadLayoutTest, PlaceOffloadKeepsTheLastHoldsOnDevice) {
  const ChainCosts c = layout_chain();
  EXPECT_EQ(offloaded(schedule_full(c), c, 1).to_string(),
            "F0c+ F1c^ F2c^ F3c^ F4c^ F5c+ R5 B5 R4 B4 R3 B3 R2 B2 R1 B1 R0 B0");
  EXPECT_EQ(offloaded(schedule_full(c), c, 2).to_string(),
            "F0c+ F1c^ F2c^ F3c^ F4c+ F5c+ R5 B5 R4 B4 R3 B3 R2 B2 R1 B1 R0 B0");
  EXPECT_EQ(offloaded(schedule_full(c), c, 9).to_string(), schedule_full(c).to_string());
  // keep holds are never offloaded; selective holds are.
  EXPECT_EQ(offloaded(schedule_selective(c), c, 1).to_string(), "F0k F1s^ F2s^ F3s^ F4s+ F5k B5 R4 B4 R3 B3 R2 B2 R1 B1 B0");
  // A zero-byte input is not offloaded.
  ChainCosts z = c;
  z.stages[2].input_bytes = 0;
  EXPECT_EQ(offloaded(schedule_full(z), z, 0).to_string(),
            "F0c+ F1c^ F2c+ F3c^ F4c^ F5c^ R5 B5 R4 B4 R3 B3 R2 B2 R1 B1 R0 B0");
  // Re-placing clears earlier host marks.
  Schedule s = offloaded(schedule_full(c), c, 0);
  place_offload(s, c, 5);
  EXPECT_EQ(s, schedule_full(c));
  EXPECT_THROW(place_offload(s, c, -1), InvalidArgument);
}

TEST(OffloadLayoutTest, NoHostHoldsGiveAnEmptyLayout) {
  const ChainCosts c = layout_chain();
  const OffloadLayout l = layout_offload(schedule_full(c), c, 1);
  EXPECT_TRUE(l.empty());
  EXPECT_EQ(l.staging_arena_bytes(), 0u);
  EXPECT_EQ(l.pinned_bytes, 0u);
}

TEST(OffloadLayoutTest, RejectsANegativeDepthAndInvalidSchedules) {
  const ChainCosts c = layout_chain();
  try {
    layout_offload(schedule_full(c), c, -1);
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("porter.checkpointing.prefetch_depth = -1 must be >= 0"));
  }
  Schedule bad = schedule_full(c);
  bad.ops.pop_back();
  EXPECT_THROW(layout_offload(bad, c, 1), InvalidArgument);
}

}  // namespace
}  // namespace porter::checkpoint
