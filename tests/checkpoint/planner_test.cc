// The planner: standard policies' schedules and summaries, config errors, budgets, and the
// optimal planner (Rotor/Rockmate DP plus the standard plans) under random budgets.
#include "checkpoint/planner.h"

#include <chrono>
#include <random>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "base/error.h"
#include "base/units.h"
#include "checkpoint/analytic.h"

namespace porter::checkpoint {
namespace {

using ::testing::HasSubstr;

config::ModelConfig gpt_small_cpu() {  // examples/configs/gpt-small-cpu.json's model
  config::ModelConfig m;
  m.layers = 8;
  m.hidden = 256;
  m.heads = 8;
  m.seq_len = 256;
  m.vocab = 8192;
  m.dropout = 0.1;
  return m;
}

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

// A heterogeneous chain: stage sizes and times vary by a fixed pseudo-random pattern.
ChainCosts hetero_chain(int n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> u(1, 9);
  ChainCosts c;
  c.source = "profiled";
  size_t in = 0;
  for (int i = 0; i < n; ++i) {
    StageCost s;
    s.name = "layer." + std::to_string(i);
    s.is_block = true;
    s.input_bytes = in;
    s.output_bytes = static_cast<size_t>(u(rng)) * 1000;
    in = s.output_bytes;
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
    if (i % 3 == 1) {
      OptionCost& sel = s.option(SaveOption::kSelective);
      sel = ck;
      sel.saved_bytes = saved / 2;
      sel.recompute_s = k.forward_s / 4;
      sel.recompute_peak_bytes = saved / 2 + 100;
      sel.recompute_saved_bytes = saved - saved / 2;
    }
    c.stages.push_back(s);
  }
  return c;
}

PlanOptions options_for(config::CheckpointPolicy p) {
  PlanOptions o;
  o.checkpointing.policy = p;
  return o;
}

TEST(PlannerTest, StandardSchedulesAreValidWithTheRightSummaries) {
  const ChainCosts c = analytic_gpt_costs({tiny(4), 2, 16, nn::DType::kF32});
  ASSERT_EQ(c.num_stages(), 6);
  EXPECT_EQ(schedule_none(c).to_string(), "F0k F1k F2k F3k F4k F5k B5 B4 B3 B2 B1 B0");
  EXPECT_EQ(schedule_full(c).to_string(),
            "F0c+ F1c+ F2c+ F3c+ F4c+ F5c+ R5 B5 R4 B4 R3 B3 R2 B2 R1 B1 R0 B0");
  EXPECT_EQ(schedule_uniform(c, 2).to_string(),
            "F0k F1c+ F2c F3c+ F4c F5k B5 F3k R4 B4 B3 F1k R2 B2 B1 B0");
  EXPECT_EQ(schedule_uniform(c, 3).to_string(), "F0k F1c+ F2c F3c F4c+ F5k B5 R4 B4 F1k F2k R3 B3 B2 B1 B0");
  EXPECT_EQ(schedule_block(c, 2).to_string(), "F0k F1c+ F2c+ F3k F4k F5k B5 B4 B3 R2 B2 R1 B1 B0");
  // sqrt: round(sqrt(6)) = 2 stages per segment over the whole chain.
  EXPECT_EQ(schedule_sqrt(c).to_string(),
            "F0c+ F1c F2c+ F3c F4c+ F5c F4k R5 B5 B4 F2k R3 B3 B2 F0k R1 B1 B0");
  EXPECT_EQ(schedule_selective(c).to_string(), "F0k F1s+ F2s+ F3s+ F4s+ F5k B5 R4 B4 R3 B3 R2 B2 R1 B1 B0");
  for (const Schedule& s : {schedule_none(c), schedule_full(c), schedule_uniform(c, 1), schedule_uniform(c, 4),
                            schedule_block(c, 0), schedule_block(c, 4), schedule_sqrt(c), schedule_selective(c)}) {
    EXPECT_NO_THROW(validate(s)) << s.to_string();
  }

  auto u = summarize(schedule_uniform(c, 2), c);
  ASSERT_EQ(u.size(), 6u);
  EXPECT_EQ(u[0].name, "embedding");
  EXPECT_EQ(u[0].action, "keep");
  EXPECT_EQ(u[0].forwards, 1);
  EXPECT_EQ(u[1].name, "block.0");
  EXPECT_EQ(u[1].action, "checkpoint");
  EXPECT_TRUE(u[1].holds_input);
  EXPECT_EQ(u[1].forwards, 2);  // checkpointed, then re-forwarded keeping
  EXPECT_FALSE(u[2].holds_input);
  EXPECT_EQ(u[2].forwards, 2);  // forwarded, then recomputed
  EXPECT_EQ(u[5].name, "head");
  EXPECT_EQ(u[5].where, Where::kDevice);
  auto sel = summarize(schedule_selective(c), c);
  EXPECT_EQ(sel[2].action, "selective");
  EXPECT_TRUE(sel[2].holds_input);
  EXPECT_EQ(sel[2].forwards, 2);
  EXPECT_EQ(sel[0].forwards, 1);
}

TEST(PlannerTest, MakePlanForEachPolicy) {
  const ChainCosts c = analytic_gpt_costs({tiny(4), 2, 16, nn::DType::kF32});
  const size_t none_peak = simulate(schedule_none(c), c).peak_activation_bytes;
  Plan none = make_plan(options_for(config::CheckpointPolicy::kNone), c);
  EXPECT_EQ(none.prediction.peak_activation_bytes, none_peak);
  EXPECT_EQ(none_peak, gpt_none_peak_bytes({tiny(4), 2, 16, nn::DType::kF32}));

  PlanOptions uo = options_for(config::CheckpointPolicy::kUniform);
  uo.number_checkpoints = 3;  // ceil(4 / 3) = 2 blocks per segment
  Plan uni = make_plan(uo, c);
  EXPECT_EQ(uni.schedule, schedule_uniform(c, 2));
  EXPECT_EQ(uni.description, "uniform: 2 segments of 2 blocks");
  uo.checkpointing.every_n_layers = 1;  // wins over number_checkpoints
  EXPECT_EQ(make_plan(uo, c).schedule, schedule_uniform(c, 1));

  PlanOptions bo = options_for(config::CheckpointPolicy::kBlock);
  bo.checkpointing.block_layers = 3;
  Plan blk = make_plan(bo, c);
  EXPECT_EQ(blk.schedule, schedule_block(c, 3));
  EXPECT_LT(blk.prediction.peak_activation_bytes, none_peak);

  Plan full = make_plan(options_for(config::CheckpointPolicy::kFull), c);
  Plan sel = make_plan(options_for(config::CheckpointPolicy::kSelective), c);
  EXPECT_LT(full.prediction.peak_activation_bytes, sel.prediction.peak_activation_bytes);
  EXPECT_LT(sel.prediction.peak_activation_bytes, none_peak);
  EXPECT_GT(full.prediction.recompute_flops, sel.prediction.recompute_flops);
  EXPECT_GT(sel.prediction.recompute_flops, 0.0);
  EXPECT_EQ(sel.stages.size(), 6u);
  EXPECT_EQ(make_plan(options_for(config::CheckpointPolicy::kSqrt), c).schedule, schedule_sqrt(c));
}

void expect_error(const PlanOptions& o, const ChainCosts& c, const std::string& text) {
  try {
    make_plan(o, c);
    ADD_FAILURE() << "no error; expected: " << text;
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr(text));
  }
}

TEST(PlannerTest, ConfigErrorsNameTheKey) {
  const ChainCosts c = analytic_gpt_costs({tiny(4), 2, 16, nn::DType::kF32});
  PlanOptions b = options_for(config::CheckpointPolicy::kBlock);
  b.checkpointing.block_layers = 9;
  expect_error(b, c, "porter.checkpointing.block_layers = 9 is more than the model's 4 blocks");
  b.checkpointing.block_layers.reset();
  expect_error(b, c, "porter.checkpointing.block_layers is required by policy \"block\"");
  PlanOptions u = options_for(config::CheckpointPolicy::kUniform);
  u.checkpointing.every_n_layers = 5;
  expect_error(u, c, "porter.checkpointing.every_n_layers = 5 is more than the model's 4 blocks");
  u.checkpointing.every_n_layers = 0;
  expect_error(u, c, "porter.checkpointing.every_n_layers = 0 must be >= 1");
  u.checkpointing.every_n_layers.reset();
  u.number_checkpoints = 0;
  expect_error(u, c, "activation_checkpointing.number_checkpoints = 0 must be >= 1");
  PlanOptions o = options_for(config::CheckpointPolicy::kOptimal);
  expect_error(o, c, "porter.checkpointing.memory_budget is required by policy \"optimal\"");
  o.checkpointing.memory_budget = config::MemoryBudget{1.5};
  expect_error(o, c, "porter.checkpointing.memory_budget = 1.5");
  PlanOptions s = options_for(config::CheckpointPolicy::kSelective);
  s.checkpointing.selective_ops = {"softmax"};
  expect_error(s, c, "porter.checkpointing.selective_ops: unknown op \"softmax\"");
}

TEST(PlannerTest, SelectivePolicyFromOpNames) {
  EXPECT_EQ(selective_policy({}).to_string(), nn::OpPolicy::selective_attention().to_string());
  const nn::OpPolicy p = selective_policy({"core_attention", "gelu"});
  EXPECT_FALSE(p.keeps(nn::OpKind::kAttention));
  EXPECT_FALSE(p.keeps(nn::OpKind::kGelu));
  EXPECT_TRUE(p.keeps(nn::OpKind::kMatmul));
  EXPECT_FALSE(selective_policy({"fc1"}).keeps(nn::OpKind::kMatmul));
}

TEST(PlannerTest, FractionBudgetsResolveAgainstTheNonePeak) {
  const ChainCosts c = analytic_gpt_costs({tiny(4), 2, 16, nn::DType::kF32});
  const size_t none = simulate(schedule_none(c), c).peak_activation_bytes;
  EXPECT_EQ(resolve_budget(config::MemoryBudget{0.5}, c), none / 2);
  EXPECT_EQ(resolve_budget(config::MemoryBudget{1.0}, c), none);
  EXPECT_EQ(resolve_budget(config::MemoryBudget{uint64_t{12345}}, c), 12345u);
  PlanOptions o = options_for(config::CheckpointPolicy::kOptimal);
  o.budget = config::MemoryBudget{0.6};  // the --budget override wins over the config
  o.checkpointing.memory_budget = config::MemoryBudget{0.1};
  Plan p = make_plan(o, c);
  ASSERT_TRUE(p.budget_bytes.has_value());
  EXPECT_EQ(*p.budget_bytes, static_cast<size_t>(0.6 * static_cast<double>(none)));
  EXPECT_LE(p.prediction.peak_activation_bytes, *p.budget_bytes);
  // A budget of the whole none peak needs no recompute.
  o.budget = config::MemoryBudget{1.0};
  EXPECT_EQ(make_plan(o, c).prediction.recompute_flops, 0.0);
}

TEST(PlannerTest, InfeasibleBudgetStatesTheMinimum) {
  const ChainCosts c = analytic_gpt_costs({tiny(4), 2, 16, nn::DType::kF32});
  const size_t min = minimum_budget_bytes(c);
  EXPECT_LE(min, simulate(schedule_full(c), c).peak_activation_bytes);
  PlanOptions o = options_for(config::CheckpointPolicy::kOptimal);
  o.budget = config::MemoryBudget{uint64_t{min - 1}};
  expect_error(o, c, "porter.checkpointing.memory_budget: " + format_bytes(min - 1) +
                         " is below the minimum feasible activation peak of " + format_bytes(min) +
                         " for this model and micro-batch (policy \"optimal\")");
  o.budget = config::MemoryBudget{uint64_t{min}};
  Plan p = make_plan(o, c);
  EXPECT_EQ(p.prediction.peak_activation_bytes, min);
}

void check_random_budgets(const ChainCosts& c, const char* what) {
  SCOPED_TRACE(what);
  const size_t none = simulate(schedule_none(c), c).peak_activation_bytes;
  const size_t min = minimum_budget_bytes(c);
  ASSERT_LE(min, none);
  std::mt19937_64 rng(20240601);
  std::uniform_int_distribution<size_t> u(min, none);
  PlanOptions o = options_for(config::CheckpointPolicy::kOptimal);
  for (int k = 0; k < 20; ++k) {
    const size_t budget = u(rng);
    o.budget = config::MemoryBudget{uint64_t{budget}};
    const Plan p = make_plan(o, c);
    EXPECT_LE(p.prediction.peak_activation_bytes, budget) << p.schedule.to_string();
    EXPECT_NO_THROW(validate(p.schedule));
    if (auto r = schedule_rotor(c, budget)) {
      EXPECT_LE(simulate(*r, c).peak_activation_bytes, budget);
      EXPECT_LE(p.prediction.compute_s, simulate(*r, c).compute_s);
    }
  }
  // At the memory of uniform (any segment size) and sqrt, optimal is never slower.
  std::vector<Schedule> rivals = {schedule_sqrt(c)};
  int blocks = 0;
  for (const StageCost& s : c.stages) blocks += s.is_block;
  for (int per = 1; per <= blocks; ++per) rivals.push_back(schedule_uniform(c, per));
  for (const Schedule& s : rivals) {
    const Prediction rival = simulate(s, c);
    o.budget = config::MemoryBudget{uint64_t{rival.peak_activation_bytes}};
    const Plan p = make_plan(o, c);
    EXPECT_LE(p.prediction.recompute_s, rival.recompute_s + 1e-9) << s.to_string();
    EXPECT_LE(p.prediction.peak_activation_bytes, rival.peak_activation_bytes);
  }
}

TEST(PlannerTest, OptimalFitsRandomBudgetsOnTheGpt) {
  check_random_budgets(with_times(analytic_gpt_costs({tiny(6), 2, 16, nn::DType::kF32})), "tiny gpt");
  check_random_budgets(with_times(analytic_gpt_costs({gpt_small_cpu(), 4, 256, nn::DType::kF32})),
                       "gpt-small-cpu");
}

TEST(PlannerTest, OptimalFitsRandomBudgetsOnAHeterogeneousChain) {
  check_random_budgets(hetero_chain(12, 7), "hetero 12");
  check_random_budgets(hetero_chain(20, 8), "hetero 20");
}

TEST(PlannerTest, OptimalWithoutTimesMinimisesRecomputeFlops) {
  const ChainCosts c = analytic_gpt_costs({tiny(6), 2, 16, nn::DType::kF32});
  PlanOptions o = options_for(config::CheckpointPolicy::kOptimal);
  const Prediction uni = simulate(schedule_uniform(c, 2), c);
  o.budget = config::MemoryBudget{uint64_t{uni.peak_activation_bytes}};
  const Plan p = make_plan(o, c);
  EXPECT_LE(p.prediction.recompute_flops, uni.recompute_flops);
  EXPECT_EQ(p.prediction.recompute_s, 0.0);
}

TEST(PlannerTest, RotorBeatsUniformSomewhereAndIsFast) {
  const ChainCosts c = with_times(analytic_gpt_costs({tiny(28), 2, 16, nn::DType::kF32}));
  ASSERT_EQ(c.num_stages(), 30);
  const Prediction full = simulate(schedule_full(c), c);
  const auto t0 = std::chrono::steady_clock::now();
  std::optional<Schedule> r = schedule_rotor(c, full.peak_activation_bytes * 3 / 2);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_TRUE(r.has_value());
  const Prediction p = simulate(*r, c);
  EXPECT_LE(p.peak_activation_bytes, full.peak_activation_bytes * 3 / 2);
  EXPECT_LT(p.recompute_s, full.recompute_s);
  // Not a timing assertion on speed, a guard against an accidental blow-up of the DP.
  EXPECT_LT(secs, 5.0);
}

}  // namespace
}  // namespace porter::checkpoint
