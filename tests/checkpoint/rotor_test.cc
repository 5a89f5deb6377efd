// The Rotor program's shared runs (Note [Rotor runs] in checkpoint/rotor.cc): solving a run of
// identical stages' subproblems once gives the schedule that solving every subproblem gives,
// and the schedule the program gave before (rotor_reference.inc, the previous solve kept
// verbatim), on transformer chains and on heterogeneous chains with and without runs, with
// host and partitioned holds; the planner's progress reports; the replay at a long chain.
#include "checkpoint/rotor.h"

#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "checkpoint/planner.h"
#include "models/analytic.h"
#include "tests/checkpoint/rotor_reference.inc"

namespace porter::checkpoint {
namespace {

config::ModelConfig tiny(int64_t layers) {
  config::ModelConfig m;
  m.layers = layers;
  m.hidden = 32;
  m.heads = 4;
  m.seq_len = 16;
  m.vocab = 64;
  return m;
}

// Analytic bytes with synthetic times: forward 1, backward 2, recompute in proportion to FLOPs.
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

// A stage with pseudo-random figures (times, sizes, a selective option on some).
StageCost random_stage(std::mt19937& rng, int i, size_t in) {
  std::uniform_int_distribution<int> u(1, 9);
  StageCost s;
  s.name = "layer." + std::to_string(i);
  s.is_block = true;
  s.input_bytes = in;
  s.output_bytes = static_cast<size_t>(u(rng)) * 1000;
  s.backward_s = 0.2 * u(rng);
  const size_t saved = static_cast<size_t>(u(rng)) * 4000;
  OptionCost& k = s.option(SaveOption::kKeep);
  k.available = true;
  k.forward_s = 0.1 * u(rng);
  k.saved_bytes = saved;
  k.forward_peak_bytes = saved + s.output_bytes + static_cast<size_t>(u(rng)) * 500;
  k.tape_refs_input = true;
  OptionCost& ck = s.option(SaveOption::kCheckpoint);
  ck = k;
  ck.saved_bytes = 0;
  ck.tape_refs_input = false;
  ck.recompute_s = k.forward_s;
  ck.recompute_peak_bytes = saved + static_cast<size_t>(u(rng)) * 300;
  ck.recompute_saved_bytes = saved;
  if (u(rng) % 3 == 0) {
    OptionCost& sel = s.option(SaveOption::kSelective);
    sel = ck;
    sel.saved_bytes = saved / 2;
    sel.recompute_s = k.forward_s / 4;
    sel.recompute_peak_bytes = saved / 2 + 100;
    sel.recompute_saved_bytes = saved - saved / 2;
  }
  return s;
}

// A chain of `runs`: each entry repeats one random stage that many times (a run of identical
// stages when its input equals its output; otherwise the copies differ in their input).
ChainCosts chain_of_runs(const std::vector<int>& runs, uint32_t seed, bool times = true) {
  std::mt19937 rng(seed);
  ChainCosts c;
  c.source = times ? "profiled" : "analytic";
  size_t in = 0;
  int i = 0;
  for (int count : runs) {
    StageCost proto = random_stage(rng, i, in);
    proto.input_bytes = proto.output_bytes;  // a run's copies read what the previous produced
    for (int r = 0; r < count; ++r, ++i) {
      StageCost s = proto;
      s.name = "layer." + std::to_string(i);
      if (r == 0) s.input_bytes = in;  // the first reads the previous run's output
      in = s.output_bytes;
      if (!times) {
        s.backward_s = 0.0;
        for (OptionCost& o : s.options) o.forward_s = o.recompute_s = 0.0;
      }
      c.stages.push_back(s);
    }
  }
  return c;
}

// Both ways of solving, and the program as it was, at budgets from tight to loose, under
// `options`: the same schedule or all nothing.
void expect_same_schedules(const ChainCosts& c, RotorOptions options, const std::string& what) {
  const size_t none = simulate(schedule_none(c), c).peak_activation_bytes;
  int solved = 0;
  for (double f : {0.08, 0.15, 0.25, 0.4, 0.6, 0.8, 1.0}) {
    const auto budget = static_cast<size_t>(f * static_cast<double>(none));
    options.share_runs = true;
    const std::optional<Schedule> shared = solve_rotor(c, budget, options);
    options.share_runs = false;
    const std::optional<Schedule> every = solve_rotor(c, budget, options);
    const std::optional<Schedule> before = solve_rotor_reference(c, budget, options);
    ASSERT_EQ(shared.has_value(), every.has_value()) << what << " at " << f << " of none's peak";
    ASSERT_EQ(shared.has_value(), before.has_value()) << what << " at " << f << " of none's peak";
    if (!shared) continue;
    ++solved;
    EXPECT_EQ(shared->to_string(), every->to_string()) << what << " at " << f << " of none's peak";
    EXPECT_EQ(shared->to_string(), before->to_string()) << what << " at " << f << " of none's peak";
  }
  EXPECT_GE(solved, 3) << what << ": too few budgets were feasible to compare";
}

void expect_same_schedules_all_options(const ChainCosts& c, const std::string& what) {
  expect_same_schedules(c, {}, what);
  RotorOptions host;
  host.host_holds = true;
  host.link_bytes_per_s = 2e4;
  expect_same_schedules(c, host, what + ", host holds");
  RotorOptions part;
  part.partition_ways = 2;
  part.partition_min_bytes = 1;
  part.tp_bytes_per_s = 5e4;
  expect_same_schedules(c, part, what + ", partitioned");
  part.host_holds = true;
  part.prefetch_depth = 2;
  part.link_bytes_per_s = 1e4;
  expect_same_schedules(c, part, what + ", host and partitioned, depth 2");
}

TEST(RotorRunsTest, TransformerChainsGetTheSameSchedules) {
  const ChainCosts flops = models::analytic_transformer_costs({tiny(12), 2, 16, tensor::DType::kF32});
  expect_same_schedules_all_options(flops, "tiny gpt, 12 layers, FLOPs");
  expect_same_schedules_all_options(with_times(flops), "tiny gpt, 12 layers, times");
  config::ModelConfig llama = tiny(9);
  llama.type = config::ModelType::kLlama;
  llama.kv_heads = 2;
  llama.intermediate = 96;
  expect_same_schedules_all_options(
      with_times(models::analytic_transformer_costs({llama, 2, 16, tensor::DType::kF32})),
      "tiny llama, 9 layers, times");
}

TEST(RotorRunsTest, HeterogeneousChainsGetTheSameSchedules) {
  // Runs of several lengths between distinct stages, one stage alone, a run at the end.
  expect_same_schedules_all_options(chain_of_runs({1, 5, 1, 3, 2, 1}, 11), "runs 1 5 1 3 2 1");
  expect_same_schedules_all_options(chain_of_runs({4, 4, 4}, 12), "runs 4 4 4");
  expect_same_schedules_all_options(chain_of_runs({2, 1, 6}, 13, false), "runs 2 1 6, no times");
  // No run at all.
  expect_same_schedules_all_options(chain_of_runs(std::vector<int>(10, 1), 14), "no runs");
}

TEST(RotorRunsTest, ProgressIsReportedPerSolveAndChangesNothing) {
  const ChainCosts c = with_times(models::analytic_transformer_costs({tiny(10), 2, 16, tensor::DType::kF32}));
  PlanOptions o;
  o.checkpointing.policy = config::CheckpointPolicy::kOptimal;
  o.budget = config::MemoryBudget{0.4};
  std::vector<PlanProgress> heard;
  const Plan with = make_plan(o, c, [&](const PlanProgress& p) { heard.push_back(p); });
  const Plan without = make_plan(o, c);
  EXPECT_EQ(with.schedule, without.schedule);
  ASSERT_FALSE(heard.empty());
  EXPECT_EQ(heard.front().solve, 1);
  for (size_t k = 1; k < heard.size(); ++k) {
    if (heard[k].solve == heard[k - 1].solve) {
      EXPECT_GT(heard[k].fraction, heard[k - 1].fraction);
    } else {
      EXPECT_EQ(heard[k].solve, heard[k - 1].solve + 1);
      EXPECT_DOUBLE_EQ(heard[k - 1].fraction, 1.0);  // each solve ends complete
    }
  }
  EXPECT_DOUBLE_EQ(heard.back().fraction, 1.0);
}

// The replay keeps its footprint as running sums (Note [Incremental footprint] in
// schedule.cc): at 100,000 blocks the none policy's simulated peak is still the closed form of
// models::none_peak_bytes.
TEST(ReplayTest, LongChainPeakIsTheClosedForm) {
  const models::TransformerShape shape{tiny(100000), 2, 16, tensor::DType::kF32};
  const ChainCosts c = models::analytic_transformer_costs(shape);
  ASSERT_EQ(c.num_stages(), 100002);
  EXPECT_EQ(simulate(schedule_none(c), c).peak_activation_bytes, models::none_peak_bytes(shape));
  // Full: every stage's input held and nothing else, then one stage recomputed at a time.
  const Prediction full = simulate(schedule_full(c), c);
  EXPECT_GT(full.peak_activation_bytes, 100000 * c.stages[1].input_bytes);
  EXPECT_LT(full.peak_activation_bytes, models::none_peak_bytes(shape));
}

}  // namespace
}  // namespace porter::checkpoint
