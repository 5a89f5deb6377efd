// ZeRO stage 3's gather plan (Note [Gather plan]) and its buffers in the simulator and the
// planner's budget (Note [Gathered parameters]).
#include "checkpoint/param_gather.h"

#include <algorithm>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "base/error.h"
#include "models/analytic.h"
#include "checkpoint/planner.h"

namespace porter::checkpoint {
namespace {

using ::testing::HasSubstr;

ChainCosts gpt(int64_t layers) {
  models::TransformerShape s;
  s.model.layers = layers;
  s.model.hidden = 64;
  s.model.heads = 4;
  s.model.seq_len = 32;
  s.model.vocab = 512;
  s.micro_batch = 2;
  return models::analytic_transformer_costs(s);
}

// Units of `elems` each (the head reads the embedding's unit too, as the tied GPT does).
ParamGather units(int n, int64_t block_elems, int64_t embed_elems, int64_t head_elems) {
  ParamGather p;
  p.enabled = true;
  for (int s = 0; s < n; ++s) {
    const int64_t e = s == 0 ? embed_elems : s == n - 1 ? head_elems : block_elems;
    p.units.push_back({"stage" + std::to_string(s), e, static_cast<size_t>(e) * 4, false});
    p.reads.push_back({s});
  }
  p.reads.back().push_back(0);
  return p;
}

// Replays the plan's issue / evict / release lists and checks their invariants: every read
// unit is live and waited when its op runs, nothing is gathered twice or freed unless live,
// the live elements stay within the cap, and everything is freed at the end.
int64_t replay_plan(const Schedule& sch, const ParamGather& p, const GatherPlan& plan) {
  std::vector<bool> live(p.units.size(), false), waited(p.units.size(), false);
  int64_t cur = 0, peak = 0;
  for (size_t k = 0; k < sch.ops.size(); ++k) {
    for (int u : plan.evict[k]) {
      EXPECT_TRUE(live[static_cast<size_t>(u)]) << k;
      live[static_cast<size_t>(u)] = false;
      cur -= p.units[static_cast<size_t>(u)].elems;
    }
    for (int u : plan.issue[k]) {
      EXPECT_FALSE(live[static_cast<size_t>(u)]) << k;
      live[static_cast<size_t>(u)] = true;
      waited[static_cast<size_t>(u)] = false;
      cur += p.units[static_cast<size_t>(u)].elems;
      EXPECT_LE(cur, p.max_live_elems) << "op " << k;
    }
    for (int u : plan.wait[k]) waited[static_cast<size_t>(u)] = true;
    for (int u : p.reads[static_cast<size_t>(sch.ops[k].stage)]) {
      EXPECT_TRUE(live[static_cast<size_t>(u)] && waited[static_cast<size_t>(u)])
          << "op " << k << " reads unit " << u << " not gathered";
    }
    peak = std::max(peak, cur);
    for (int u : plan.release[k]) {
      EXPECT_TRUE(live[static_cast<size_t>(u)]) << k;
      live[static_cast<size_t>(u)] = false;
      cur -= p.units[static_cast<size_t>(u)].elems;
    }
  }
  EXPECT_EQ(cur, 0);
  EXPECT_EQ(peak, plan.peak_live_elems);
  return peak;
}

TEST(GatherPlan, EmptyWhenDisabled) {
  const ChainCosts c = gpt(3);
  EXPECT_TRUE(plan_gathers(schedule_full(c), ParamGather{}).empty());
}

TEST(GatherPlan, NoPrefetchNoReuseGathersOneStageAtATime) {
  const ChainCosts c = gpt(4);
  ParamGather p = units(c.num_stages(), 1000, 300, 10);
  p.prefetch_elems = 0;
  p.max_reuse_distance = -1;  // never keep
  const Schedule s = schedule_none(c);  // F0..F5 B5..B0
  const GatherPlan plan = plan_gathers(s, p);
  // The head reads its own unit and the embedding's.
  EXPECT_EQ(replay_plan(s, p, plan), 1000);
  EXPECT_EQ(plan.gathers, 2 * c.num_stages() + 2);
  for (size_t k = 0; k < s.ops.size(); ++k) EXPECT_EQ(plan.issue[k], plan.wait[k]) << k;
}

TEST(GatherPlan, ReuseDistanceKeepsARecomputedStageForItsBackward) {
  const ChainCosts c = gpt(4);
  ParamGather p = units(c.num_stages(), 1000, 300, 10);
  p.prefetch_elems = 0;
  const Schedule s = schedule_full(c);  // F0c+ .. then R_i B_i pairs
  p.max_reuse_distance = 0;  // R_i then B_i: nothing read in between
  const GatherPlan keep = plan_gathers(s, p);
  p.max_reuse_distance = -1;
  const GatherPlan never = plan_gathers(s, p);
  EXPECT_LT(keep.gathers, never.gathers);
  replay_plan(s, p, keep);
  replay_plan(s, p, never);
  // Uniform segments re-forward a segment before its backwards: a larger distance keeps the
  // whole segment gathered.
  const Schedule u = schedule_uniform(c, 4);
  p.max_reuse_distance = 0;
  const int64_t low = replay_plan(u, p, plan_gathers(u, p));
  p.max_reuse_distance = 1'000'000;
  const int64_t high = replay_plan(u, p, plan_gathers(u, p));
  EXPECT_LT(low, high);
}

TEST(GatherPlan, PrefetchRunsAheadWithinItsBucketAndTheLiveCap) {
  const ChainCosts c = gpt(6);
  ParamGather p = units(c.num_stages(), 1000, 300, 10);
  p.max_reuse_distance = -1;
  const Schedule s = schedule_none(c);
  p.prefetch_elems = 0;
  const int64_t none = replay_plan(s, p, plan_gathers(s, p));
  p.prefetch_elems = 2000;  // two blocks ahead
  const GatherPlan two = plan_gathers(s, p);
  const int64_t ahead = replay_plan(s, p, two);
  EXPECT_EQ(ahead, 3000);
  EXPECT_GT(ahead, none);
  // The first op issues its own unit and prefetches up to the bucket, in read order.
  EXPECT_EQ(two.issue[0], (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(two.wait[0], (std::vector<int>{0}));
  p.max_live_elems = 1500;
  const int64_t capped = replay_plan(s, p, plan_gathers(s, p));
  EXPECT_LE(capped, 1500);
}

TEST(GatherPlan, EvictsKeptUnitsToMakeRoomUnderTheCap) {
  const ChainCosts c = gpt(4);
  ParamGather p = units(c.num_stages(), 1000, 300, 10);
  p.prefetch_elems = 0;
  p.max_reuse_distance = 1'000'000;  // would keep every forward's stage until its backward
  p.max_live_elems = 2000;
  const Schedule s = schedule_none(c);
  const GatherPlan plan = plan_gathers(s, p);
  replay_plan(s, p, plan);
  size_t evictions = 0;
  for (const auto& e : plan.evict) evictions += e.size();
  EXPECT_GT(evictions, 0u);
}

TEST(GatherPlan, PersistentUnitsAreNotPlanned) {
  const ChainCosts c = gpt(3);
  ParamGather p = units(c.num_stages(), 1000, 300, 10);
  p.units.back().persistent = true;
  const GatherPlan plan = plan_gathers(schedule_none(c), p);
  for (const GatherWindow& w : plan.windows) EXPECT_NE(w.unit, c.num_stages() - 1);
  EXPECT_EQ(p.persistent_bytes(), 40u);
}

TEST(GatherPlan, ACapBelowOneStageNamesTheKnobAndTheMinimum) {
  const ChainCosts c = gpt(3);
  ParamGather p = units(c.num_stages(), 1000, 300, 10);
  p.max_live_elems = 500;
  try {
    plan_gathers(schedule_none(c), p);
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("zero_optimization.stage3_max_live_parameters is 500"));
    EXPECT_THAT(e.what(), HasSubstr("raise it to at least 1000"));
  }
}

// The simulator counts the gathered buffers in the total and budget peaks, not in the
// activation footprint, and the optimal planner keeps their sum within the budget.
TEST(GatherPlan, SimulatorAndPlannerShareOneBudget) {
  ChainCosts c = gpt(6);
  const Prediction without = simulate(schedule_none(c), c);
  c.params = units(c.num_stages(), 200000, 50000, 100);
  c.params.prefetch_elems = 0;
  c.params.max_reuse_distance = -1;
  const Prediction with = simulate(schedule_none(c), c);
  EXPECT_EQ(with.peak_activation_bytes, without.peak_activation_bytes);
  EXPECT_EQ(with.params.peak_gathered_bytes, 800000u);
  EXPECT_GT(with.peak_budget_bytes, with.peak_activation_bytes);
  EXPECT_LE(with.peak_budget_bytes, with.peak_activation_bytes + 800000);
  EXPECT_GT(with.peak_total_bytes, without.peak_total_bytes);
  EXPECT_EQ(without.peak_budget_bytes, without.peak_activation_bytes);

  PlanOptions o;
  o.checkpointing.policy = config::CheckpointPolicy::kOptimal;
  const size_t budget = with.peak_budget_bytes * 6 / 10;
  o.budget = config::MemoryBudget{static_cast<uint64_t>(budget)};
  const Plan plan = make_plan(o, c);
  EXPECT_LE(plan.prediction.peak_budget_bytes, budget);
  EXPECT_GT(plan.prediction.params.peak_gathered_bytes, 0u);
  // The same budget without the parameters leaves more for activations.
  ChainCosts bare = c;
  bare.params = ParamGather{};
  const Plan bare_plan = make_plan(o, bare);
  EXPECT_GE(bare_plan.prediction.peak_activation_bytes, plan.prediction.peak_activation_bytes);
}

}  // namespace
}  // namespace porter::checkpoint
