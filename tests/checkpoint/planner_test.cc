// The planner: standard policies' schedules and summaries, config errors, budgets, and the
// optimal planner (Rotor/Rockmate DP plus the standard plans) under random budgets.
#include "checkpoint/planner.h"

#include <chrono>
#include <random>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "base/error.h"
#include "base/units.h"
#include "models/analytic.h"

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
  const ChainCosts c = models::analytic_transformer_costs({tiny(4), 2, 16, tensor::DType::kF32});
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
  const ChainCosts c = models::analytic_transformer_costs({tiny(4), 2, 16, tensor::DType::kF32});
  const size_t none_peak = simulate(schedule_none(c), c).peak_activation_bytes;
  Plan none = make_plan(options_for(config::CheckpointPolicy::kNone), c);
  EXPECT_EQ(none.prediction.peak_activation_bytes, none_peak);
  EXPECT_EQ(none_peak, models::none_peak_bytes({tiny(4), 2, 16, tensor::DType::kF32}));

  PlanOptions uo = options_for(config::CheckpointPolicy::kUniform);
  uo.checkpointing.segments = 3;  // ceil(4 / 3) = 2 blocks per segment
  Plan uni = make_plan(uo, c);
  EXPECT_EQ(uni.schedule, schedule_uniform(c, 2));
  EXPECT_EQ(uni.description, "uniform: 2 segments of 2 blocks");
  uo.checkpointing.segments.reset();
  uo.checkpointing.every_n_layers = 1;
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
  const ChainCosts c = models::analytic_transformer_costs({tiny(4), 2, 16, tensor::DType::kF32});
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
  u.checkpointing.segments = 2;  // the parser folds number_checkpoints in only without it
  expect_error(u, c, "porter.checkpointing.every_n_layers = 0 and porter.checkpointing.segments "
                     "= 2 are both set; set one of them");
  u.checkpointing.every_n_layers.reset();
  u.checkpointing.segments = 0;
  expect_error(u, c, "porter.checkpointing.segments = 0 must be >= 1");
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
  const ChainCosts c = models::analytic_transformer_costs({tiny(4), 2, 16, tensor::DType::kF32});
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
  const ChainCosts c = models::analytic_transformer_costs({tiny(4), 2, 16, tensor::DType::kF32});
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
  check_random_budgets(with_times(models::analytic_transformer_costs({tiny(6), 2, 16, tensor::DType::kF32})), "tiny gpt");
  check_random_budgets(with_times(models::analytic_transformer_costs({gpt_small_cpu(), 4, 256, tensor::DType::kF32})),
                       "gpt-small-cpu");
}

TEST(PlannerTest, OptimalFitsRandomBudgetsOnAHeterogeneousChain) {
  check_random_budgets(hetero_chain(12, 7), "hetero 12");
  check_random_budgets(hetero_chain(20, 8), "hetero 20");
}

TEST(PlannerTest, OptimalWithoutTimesMinimisesRecomputeFlops) {
  const ChainCosts c = models::analytic_transformer_costs({tiny(6), 2, 16, tensor::DType::kF32});
  PlanOptions o = options_for(config::CheckpointPolicy::kOptimal);
  const Prediction uni = simulate(schedule_uniform(c, 2), c);
  o.budget = config::MemoryBudget{uint64_t{uni.peak_activation_bytes}};
  const Plan p = make_plan(o, c);
  EXPECT_LE(p.prediction.recompute_flops, uni.recompute_flops);
  EXPECT_EQ(p.prediction.recompute_s, 0.0);
}

TEST(PlannerTest, RotorBeatsUniformSomewhereAndIsFast) {
  const ChainCosts c = with_times(models::analytic_transformer_costs({tiny(28), 2, 16, tensor::DType::kF32}));
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

// ---- offload (Note [Offload placement]) --------------------------------------------------

OffloadOptions offload_on(int depth = 1, int keep_last = 1, double link = 0.0, bool contiguous = false) {
  OffloadOptions o;
  o.enabled = true;
  o.prefetch_depth = depth;
  o.keep_last_on_device = keep_last;
  o.link_bytes_per_s = link;
  o.contiguous = contiguous;
  return o;
}

// The options from a config: RunOptions (tests/engine/run_options_test.cc).
TEST(PlannerOffloadTest, SimOptionsAndLayoutFollowTheOptions) {
  OffloadOptions o;
  o.enabled = true;
  o.contiguous = true;
  o.prefetch_depth = 3;
  o.keep_last_on_device = 2;
  o.link_bytes_per_s = 0.5e9;
  const SimOptions sim = o.sim();
  EXPECT_EQ(sim.prefetch_depth, 3);
  EXPECT_DOUBLE_EQ(sim.link_bytes_per_s, 0.5e9);
  // The contiguity goes into the plan's layout, with offload on and off (the stash built
  // from the same config runs only that one).
  const ChainCosts c = models::analytic_transformer_costs({tiny(2), 2, 16, tensor::DType::kF32});
  PlanOptions po = options_for(config::CheckpointPolicy::kFull);
  po.offload = o;
  const Plan on = make_plan(po, c);
  EXPECT_TRUE(on.offload.contiguous);
  EXPECT_FALSE(on.offload.empty());
  EXPECT_EQ(on.offload, layout_offload(on.schedule, c, 3, true));
  EXPECT_EQ(on.offload, plan_layout(on.schedule, c, o));
  po.offload.enabled = false;
  const Plan off = make_plan(po, c);
  EXPECT_TRUE(off.offload.contiguous);
  EXPECT_TRUE(off.offload.empty());
  po.offload.contiguous = false;
  EXPECT_FALSE(make_plan(po, c).offload.contiguous);
}

TEST(PlannerOffloadTest, StandardPlansPlaceAndPredictTheOffload) {
  const ChainCosts c = with_times(models::analytic_transformer_costs({tiny(4), 2, 16, tensor::DType::kF32}));
  const size_t a = c.stages[2].input_bytes;  // every block's input: 2 x 16 x 32 floats
  ASSERT_EQ(a, 2u * 16 * 32 * 4);
  PlanOptions uo = options_for(config::CheckpointPolicy::kUniform);
  uo.checkpointing.every_n_layers = 1;
  uo.offload = offload_on(1, 1, /*link=*/a / 0.5);  // a block input copies in 0.5 s
  const Plan p = make_plan(uo, c);
  // Four one-block segments hold a_1..a_4; the last (a_4) stays on device.
  Schedule want = schedule_uniform(c, 1);
  place_offload(want, c, 1);
  EXPECT_EQ(p.schedule, want);
  EXPECT_EQ(p.schedule.to_string(), "F0k F1c^ F2c^ F3c^ F4c+ F5k B5 R4 B4 R3 B3 R2 B2 R1 B1 B0");
  EXPECT_EQ(p.description, "uniform: 4 segments of 1 block; 3 checkpoints on host (" + format_bytes(3 * a) +
                               "), prefetch depth 1");
  EXPECT_EQ(p.sim.prefetch_depth, 1);
  EXPECT_DOUBLE_EQ(p.sim.link_bytes_per_s, uo.offload.link_bytes_per_s);
  EXPECT_EQ(p.offload, layout_offload(p.schedule, c, 1));
  EXPECT_EQ(p.offload.entries.size(), 3u);
  EXPECT_EQ(p.prediction.offload.d2h_bytes, 3 * a);
  EXPECT_EQ(p.prediction.offload.pinned_bytes, 3 * round_up(a, kPinnedSlotAlignment));
  ASSERT_TRUE(p.prediction.offload.timed);
  const Prediction sim = simulate(p.schedule, c, p.sim);
  EXPECT_EQ(p.prediction.peak_activation_bytes, sim.peak_activation_bytes);
  EXPECT_DOUBLE_EQ(p.prediction.offload.exposed_s, sim.offload.exposed_s);
  ASSERT_EQ(p.stages.size(), 6u);
  EXPECT_EQ(p.stages[0].where, Where::kDevice);
  for (int i = 1; i <= 3; ++i) EXPECT_EQ(p.stages[i].where, Where::kHost) << i;
  EXPECT_EQ(p.stages[4].where, Where::kDevice);
  double exposed = 0.0;
  for (int i = 0; i < 6; ++i) {
    EXPECT_DOUBLE_EQ(p.stages[i].exposed_copy_s, sim.offload.exposed_by_stage[i]) << i;
    exposed += p.stages[i].exposed_copy_s;
  }
  EXPECT_DOUBLE_EQ(exposed, p.prediction.offload.exposed_s);
  EXPECT_LT(p.prediction.peak_activation_bytes, simulate(schedule_uniform(c, 1), c).peak_activation_bytes);

  // Offload off: the same policy plans as before, with no host holds and no layout.
  uo.offload.enabled = false;
  const Plan off = make_plan(uo, c);
  EXPECT_EQ(off.schedule, schedule_uniform(c, 1));
  EXPECT_EQ(off.description, "uniform: 4 segments of 1 block");
  EXPECT_TRUE(off.offload.empty());
  EXPECT_EQ(off.prediction.offload.d2h_bytes, 0u);
  // `none` holds nothing: offload on says so.
  PlanOptions no = options_for(config::CheckpointPolicy::kNone);
  no.offload = offload_on();
  EXPECT_EQ(make_plan(no, c).description, "none: every stage keeps its activations; offload on, no checkpoint to offload");
}

TEST(PlannerOffloadTest, SummarizeMarksHostHoldsWithoutAPrediction) {
  const ChainCosts c = models::analytic_transformer_costs({tiny(4), 2, 16, tensor::DType::kF32});
  Schedule s = schedule_full(c);
  place_offload(s, c, 2);
  const std::vector<StagePlan> sp = summarize(s, c);
  const Where want[] = {Where::kDevice, Where::kHost, Where::kHost, Where::kHost, Where::kDevice, Where::kDevice};
  for (int i = 0; i < 6; ++i) {
    EXPECT_EQ(sp[i].where, want[i]) << i;
    EXPECT_EQ(sp[i].exposed_copy_s, 0.0);
  }
  EXPECT_EQ(where_name(sp[1].where), "host");
}

TEST(PlannerOffloadTest, OffloadNeverRaisesThePeakOfFullOrUniform) {
  for (const ChainCosts& c : {with_times(models::analytic_transformer_costs({tiny(6), 2, 16, tensor::DType::kF32})), hetero_chain(12, 7)}) {
    std::vector<Schedule> scheds = {schedule_full(c), schedule_sqrt(c), schedule_selective(c)};
    int blocks = 0;
    for (const StageCost& s : c.stages) blocks += s.is_block;
    for (int per = 1; per <= blocks; ++per) scheds.push_back(schedule_uniform(c, per));
    for (const Schedule& dev : scheds) {
      const Prediction base = simulate(dev, c);
      for (int keep = 0; keep <= 2; ++keep) {
        Schedule h = dev;
        place_offload(h, c, keep);
        for (int d = 0; d <= 3; ++d) {
          SimOptions o;
          o.prefetch_depth = d;
          const Prediction p = simulate(h, c, o);
          SCOPED_TRACE(h.to_string() + " depth " + std::to_string(d));
          EXPECT_LE(p.peak_activation_bytes, base.peak_activation_bytes);
          EXPECT_LE(p.peak_total_bytes, base.peak_total_bytes);
          // Op by op, too: a host hold's bytes are off the device from its forward to its
          // prefetch.
          ASSERT_EQ(p.footprint_after_op.size(), base.footprint_after_op.size());
          for (size_t k = 0; k < p.footprint_after_op.size(); ++k) {
            EXPECT_LE(p.footprint_after_op[k], base.footprint_after_op[k]) << "op " << k;
          }
          EXPECT_DOUBLE_EQ(p.compute_s, base.compute_s);
        }
      }
    }
    // full with every hold on the host and depth 0: right after the forward pass nothing of
    // a_1..a_{n-1} is on the device any more.
    Schedule f = schedule_full(c);
    place_offload(f, c, 0);
    SimOptions o;
    o.prefetch_depth = 0;
    const Prediction p = simulate(f, c, o);
    const Prediction base = simulate(schedule_full(c), c);
    const int n = c.num_stages();
    size_t held = 0;
    for (int i = 1; i < n; ++i) held += c.stages[i].input_bytes;
    EXPECT_EQ(base.footprint_after_op[n - 1] - p.footprint_after_op[n - 1], held);
    EXPECT_EQ(p.offload.d2h_bytes, held);
  }
}

// Every plan a budget admits: the optimal plan with offload fits under simulate(), is never
// slower (compute + exposed) than a standard offloaded plan or the device-only optimum that
// fits, and its Rotor schedule fits too.
void check_optimal_offload(const ChainCosts& c, const OffloadOptions& off, const char* what) {
  SCOPED_TRACE(what);
  const size_t none = simulate(schedule_none(c), c).peak_activation_bytes;
  const size_t min_dev = minimum_budget_bytes(c);
  const size_t min_off = minimum_budget_bytes(c, off);
  // Never higher. Where every stage can be recomputed from the token ids the floor is one
  // stage's own peak, which no offload lowers (docs/offload.md); stem_chain() shows lower.
  EXPECT_LE(min_off, min_dev);

  // The standard offloaded plans, at the configured keep_last.
  std::vector<Schedule> rivals = {schedule_full(c), schedule_sqrt(c)};
  int blocks = 0;
  for (const StageCost& s : c.stages) blocks += s.is_block;
  for (int per = 1; per <= blocks; ++per) rivals.push_back(schedule_uniform(c, per));
  for (Schedule& r : rivals) place_offload(r, c, off.keep_last_on_device);
  // full and sqrt checkpoint every stage: no rival where a stage cannot.
  std::erase_if(rivals, [&](const Schedule& r) {
    for (const ScheduleOp& op : r.ops)
      if (op.kind == ScheduleOp::Kind::kForward && !c.stages[op.stage].option(op.save).available) return true;
    return false;
  });

  PlanOptions o = options_for(config::CheckpointPolicy::kOptimal);
  o.offload = off;
  auto time = [](const Prediction& p) { return p.compute_s + p.offload.exposed_s; };
  std::mt19937_64 rng(99);
  std::uniform_int_distribution<size_t> u(min_off, none);
  std::vector<size_t> budgets = {min_off, (min_off + min_dev) / 2, min_dev};
  for (int k = 0; k < 8; ++k) budgets.push_back(u(rng));
  for (const Schedule& r : rivals) budgets.push_back(predict(r, c, off).peak_activation_bytes);
  for (size_t budget : budgets) {
    SCOPED_TRACE("budget " + std::to_string(budget));
    o.budget = config::MemoryBudget{uint64_t{budget}};
    const Plan p = make_plan(o, c);
    EXPECT_NO_THROW(validate(p.schedule));
    const Prediction exact = predict(p.schedule, c, off);
    EXPECT_LE(exact.peak_activation_bytes, budget) << p.schedule.to_string();
    EXPECT_EQ(exact.peak_activation_bytes, p.prediction.peak_activation_bytes);
    EXPECT_EQ(p.offload, layout_offload(p.schedule, c, off.prefetch_depth, off.contiguous));
    for (const Schedule& r : rivals) {
      const Prediction rp = predict(r, c, off);
      if (rp.peak_activation_bytes <= budget) {
        EXPECT_LE(time(p.prediction), time(rp) + 1e-9) << r.to_string();
      }
    }
    if (budget >= min_dev) {
      PlanOptions d = o;
      d.offload.enabled = false;
      const Plan dp = make_plan(d, c);
      EXPECT_LE(time(p.prediction), time(predict(dp.schedule, c, off)) + 1e-9)
          << dp.schedule.to_string();
    }
    if (auto r = schedule_rotor(c, budget, off)) {
      EXPECT_LE(predict(*r, c, off).peak_activation_bytes, budget) << r->to_string();
    }
  }

  // Below the device-only minimum only offload fits: the device-only plan is refused, the
  // offloaded one holds on the host, whatever keep_last_on_device says.
  const size_t tight = (min_off + min_dev) / 2;
  if (tight < min_dev) {
    o.budget = config::MemoryBudget{uint64_t{tight}};
    PlanOptions d = o;
    d.offload.enabled = false;
    EXPECT_THROW(make_plan(d, c), InvalidArgument);
    o.offload.keep_last_on_device = 1000;
    const Plan p = make_plan(o, c);
    EXPECT_LE(p.prediction.peak_activation_bytes, tight);
    EXPECT_GT(p.prediction.offload.d2h_bytes, 0u);
    EXPECT_THAT(p.schedule.to_string(), HasSubstr("^"));
    EXPECT_THAT(p.description, HasSubstr("on host"));
  }
  // Below the offload minimum: refused, stating it.
  o.budget = config::MemoryBudget{uint64_t{min_off - 1}};
  expect_error(o, c, "is below the minimum feasible activation peak of " + format_bytes(min_off));
}

TEST(PlannerOffloadTest, OptimalWithOffloadOnTheGpt) {
  const ChainCosts c = with_times(models::analytic_transformer_costs({tiny(6), 2, 16, tensor::DType::kF32}));
  const double a = static_cast<double>(c.stages[2].input_bytes);
  check_optimal_offload(c, offload_on(1, 1, a / 0.01), "fast link");
  check_optimal_offload(c, offload_on(1, 1, a / 2.0), "slow link");
  check_optimal_offload(c, offload_on(0, 0, a / 0.5), "depth 0");
  check_optimal_offload(c, offload_on(2, 1, a / 0.5, true), "depth 2, contiguous");
  check_optimal_offload(c, offload_on(1, 1, 0.0), "no link");
}

TEST(PlannerOffloadTest, OptimalWithOffloadOnAHeterogeneousChain) {
  const ChainCosts c = hetero_chain(12, 7);
  check_optimal_offload(c, offload_on(1, 1, 5000.0), "link 5000 B/s");
  check_optimal_offload(c, offload_on(3, 2, 50000.0), "depth 3");
}

TEST(PlannerOffloadTest, RotorWithAFreeLinkRecomputesNoMore) {
  // With a fast link the copies hide: the program with host holds recomputes no more than
  // without, and fits.
  const ChainCosts c = with_times(models::analytic_transformer_costs({tiny(6), 2, 16, tensor::DType::kF32}));
  const OffloadOptions off = offload_on(1, 1, 1e12);
  for (int per : {1, 2, 3}) {
    const size_t budget = simulate(schedule_uniform(c, per), c).peak_activation_bytes;
    std::optional<Schedule> d = schedule_rotor(c, budget);
    std::optional<Schedule> h = schedule_rotor(c, budget, off);
    ASSERT_TRUE(d.has_value());
    ASSERT_TRUE(h.has_value());
    const Prediction hp = simulate(*h, c, off.sim());
    EXPECT_LE(hp.peak_activation_bytes, budget);
    EXPECT_LE(hp.compute_s, simulate(*d, c).compute_s + 1e-9);
  }
}

// A chain whose stage 1 (a "stem") cannot be recomputed (keep only): its large output a_2
// cannot be regenerated, so without offload it stays on the device through the forwards and
// backwards of the later, larger stages 3..5; with offload it waits on the host. Stage 2,
// which reads it, is small.
ChainCosts stem_chain() {
  ChainCosts c;
  c.source = "profiled";
  for (int i = 0; i < 6; ++i) {
    StageCost s;
    s.name = i == 1 ? "stem" : "s" + std::to_string(i);
    s.is_block = i >= 2;
    s.input_bytes = i == 0 ? 0 : i == 2 ? 40000 : 4000;
    s.output_bytes = i == 5 ? 4 : i == 1 ? 40000 : 4000;
    s.backward_s = 2.0;
    OptionCost& k = s.option(SaveOption::kKeep);
    k.available = true;
    k.forward_s = 1.0;
    k.saved_bytes = i == 1 ? 100 : i == 2 ? 2000 : 30000;
    k.forward_peak_bytes = k.saved_bytes + s.output_bytes;
    k.tape_refs_input = true;
    if (i != 1) {
      OptionCost& ck = s.option(SaveOption::kCheckpoint);
      ck = k;
      ck.saved_bytes = 0;
      ck.tape_refs_input = false;
      ck.recompute_s = 1.0;
      ck.recompute_peak_bytes = k.saved_bytes;
      ck.recompute_saved_bytes = k.saved_bytes;
    }
    c.stages.push_back(s);
  }
  return c;
}

TEST(PlannerOffloadTest, OffloadLowersTheMinimumWhereHoldsAreUnavoidable) {
  const ChainCosts c = stem_chain();
  for (const OffloadOptions& off : {offload_on(1, 1, 4000.0), offload_on(0, 0, 0.0), offload_on(2, 1, 1e9, true)}) {
    const size_t min_dev = minimum_budget_bytes(c);
    const size_t min_off = minimum_budget_bytes(c, off);
    SCOPED_TRACE("depth " + std::to_string(off.prefetch_depth) + (off.contiguous ? ", contiguous" : ""));
    if (off.contiguous) {
      // The arena (a 40 KB slot for a_2) counts through the forwards of 3..5 too, where the
      // device-only floor lies: no gain, and never a loss.
      EXPECT_EQ(min_off, min_dev);
    } else {
      EXPECT_LT(min_off, min_dev);
    }
    if (off.prefetch_depth == 0 && !off.contiguous) {
      // Hand-computed: a_2 on the host, the rest full. F2c^ peaks at a_1 4000 + the stem's
      // tape 100 + a_2 40000 + stage 2's forward 6000 = 50100; after it only 8100 remain,
      // and R2 on the staged a_2 is 4100 + 40000 + 2000 = 46100. (With depth 1 the entry is
      // issued one segment ahead, at R3, and sits in staging through B3.)
      using Op = ScheduleOp;
      constexpr SaveOption K = SaveOption::kKeep, C = SaveOption::kCheckpoint;
      const Schedule h{6, {Op::forward(0, C, true), Op::forward(1, K, false), Op::forward(2, C, true, true),
                           Op::forward(3, C, true), Op::forward(4, C, true), Op::forward(5, C, true),
                           Op::recompute(5), Op::backward(5), Op::recompute(4), Op::backward(4),
                           Op::recompute(3), Op::backward(3), Op::recompute(2), Op::backward(2),
                           Op::backward(1), Op::recompute(0), Op::backward(0)}};
      const Prediction hp = simulate(h, c, off.sim());
      EXPECT_EQ(hp.peak_activation_bytes, 50100u);
      EXPECT_EQ(hp.peak_op, 2);
      EXPECT_LE(min_off, 50100u);
      // The same schedule with a_2 on the device peaks at the forward of stage 3 or later.
      Schedule d = h;
      d.ops[2].offload = false;
      EXPECT_GE(simulate(d, c).peak_activation_bytes, 40000u + 42100u);
      EXPECT_GE(min_dev, 80000u);
    }
    check_optimal_offload(c, off, "stem chain");
  }
}

}  // namespace
}  // namespace porter::checkpoint
