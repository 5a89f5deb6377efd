// ZeRO stage 3's gather knobs sized by porter (Note [Stage 3 sizing] in engine/stage3.h): with
// the knobs left out of the config, each rank's parameter peak (the params category: shard,
// persistent stages and gathered buffers) is below stage 2's whole working parameters, at 2
// and 4 ranks, for the demo GPT and a 12-layer one, and the training is stage 2's bit for bit;
// knobs the config gives are kept, and when they hold more than stage 2 the report's warning
// says so with both figures. Ranks as threads, each with its own cpu device.
#include <optional>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "base/units.h"
#include "config/parse.h"
#include "engine/stage3.h"
#include "engine_test_util.h"

namespace porter::engine {
namespace {

using namespace porter::engine::testing;
using ::testing::HasSubstr;

// examples/gpt-tiny-zero3.json's model (4 layers, hidden 128, 4 heads, seq 128, vocab 256),
// or a 12-layer one of the same width on shorter sequences.
config::Config sizing_config(int world_size, int stage, int layers) {
  config::Config c = zero_config(world_size, stage);
  c.porter.model.layers = layers;
  c.porter.model.hidden = 128;
  c.porter.model.heads = 4;
  c.porter.model.seq_len = layers == 4 ? 128 : 32;
  c.porter.model.vocab = 256;
  c.porter.checkpointing.policy = config::CheckpointPolicy::kFull;
  c.zero_optimization.reduce_bucket_size_elems = 200000;
  return c;
}

struct SizedRun {
  std::vector<DpRankRun> runs;
  std::vector<std::optional<Stage3Report>> reports;  // stage3_report(engine), per rank
  // porter plan's: the built-in model of the run's options over the Engine's schedule.
  std::vector<std::optional<Stage3Report>> planned;
};

// run_dp_ranks, with each rank's stage3_report.
SizedRun run_ranks(const config::Config& c, int steps) {
  const int ws = static_cast<int>(c.world_size);
  SizedRun out;
  out.runs.resize(static_cast<size_t>(ws));
  out.reports.resize(static_cast<size_t>(ws));
  out.planned.resize(static_cast<size_t>(ws));
  for_each_dp_rank(c, [&](int rank, memory::Device& device, std::shared_ptr<comm::Communicator> dp) {
    Engine e(device, std::make_unique<TransformerModel>(c.porter.model), c, data_parallel(dp));
    out.reports[static_cast<size_t>(rank)] = stage3_report(e);
    out.planned[static_cast<size_t>(rank)] = stage3_report(e.run_options(), e.plan().schedule);
    e.reset_peaks();
    DpRankRun& run = out.runs[static_cast<size_t>(rank)];
    const io::DataSource data(c.porter.data, c.porter.model.vocab, c.train_micro_batch_size_per_gpu,
                              c.porter.model.seq_len);
    for (int s = 0; s < steps; ++s) {
      run.losses.push_back(
          e.train_step(data.rank_batches(s, c.gradient_accumulation_steps, rank, ws)).loss);
    }
    run.memory = e.memory_report();
    run.params = e.params_host();
    run.state = saved_state(e);
    run.total = e.zero_stats();
    run.prediction = e.plan().prediction;
    run.plan = e.plan().schedule.to_string();
  });
  return out;
}

TEST(EngineZero3SizingTest, DefaultKnobsHoldLessThanStageTwoAndTrainBitwiseAsStageTwo) {
  for (int layers : {4, 12}) {
    for (int ws : {2, 4}) {
      const std::string what = std::to_string(layers) + " layers, " + std::to_string(ws) + " ranks";
      config::Config c = sizing_config(ws, 2, layers);
      const SizedRun two = run_ranks(c, 2);
      c.zero_optimization.stage = 3;
      const SizedRun three = run_ranks(c, 2);
      expect_bitwise_runs(three.runs, two.runs, what);
      for (int r = 0; r < ws; ++r) {
        const DpRankRun& t = three.runs[static_cast<size_t>(r)];
        const size_t stage2 = two.runs[static_cast<size_t>(r)].peak(memory::Category::kParams);
        const size_t stage3 = t.peak(memory::Category::kParams);
        EXPECT_LT(stage3, stage2) << what;
        EXPECT_GT(t.total.gathers, 0) << what;
        ASSERT_TRUE(three.reports[static_cast<size_t>(r)].has_value()) << what;
        const Stage3Report& rep = *three.reports[static_cast<size_t>(r)];
        // The report's figures are the measured ones, to the byte.
        EXPECT_EQ(rep.stage3_params_bytes, stage3) << what;
        EXPECT_EQ(rep.stage2_params_bytes, stage2) << what;
        EXPECT_EQ(rep.peak_live_elems, t.total.peak_live_elems) << what;
        EXPECT_TRUE(rep.warning.empty()) << what << ": " << rep.warning;
        ASSERT_TRUE(three.planned[static_cast<size_t>(r)].has_value()) << what;
        EXPECT_EQ(three.planned[static_cast<size_t>(r)]->stage3_params_bytes, stage3) << what;
        EXPECT_EQ(three.planned[static_cast<size_t>(r)]->line(), rep.line()) << what;
        EXPECT_FALSE(rep.knobs.prefetch_given || rep.knobs.max_live_given ||
                     rep.knobs.max_reuse_distance_given) << what;
        // Note [Stage 3 sizing]: free after use; one stage ahead when two fit under stage 2.
        const int64_t L = rep.largest_read_elems;
        EXPECT_GT(L, 0) << what;
        EXPECT_EQ(rep.knobs.max_reuse_distance_elems, 0) << what;
        EXPECT_TRUE(rep.knobs.prefetch_elems == 0 || rep.knobs.prefetch_elems == L) << what;
        EXPECT_EQ(rep.knobs.max_live_elems, L + rep.knobs.prefetch_elems) << what;
        EXPECT_LE(t.total.peak_live_elems, rep.knobs.max_live_elems) << what;
        EXPECT_THAT(rep.line(), HasSubstr("(sized by porter)")) << what;
      }
      if (layers == 12 || ws == 4) {
        // Two blocks fit under stage 2 here: the next one is prefetched.
        EXPECT_EQ(three.reports[0]->knobs.prefetch_elems, three.reports[0]->largest_read_elems)
            << what;
      }
    }
  }
}

TEST(EngineZero3SizingTest, TheConfigsKnobsAreKeptAndTheWarningGivesBothFigures) {
  // DeepSpeed's defaults, written in the config: every stage stays gathered from its forward
  // to its backward, more than stage 2 holds.
  config::Config c = sizing_config(2, 2, 4);
  const SizedRun two = run_ranks(c, 1);
  c.zero_optimization.stage = 3;
  c.zero_optimization.stage3_prefetch_bucket_size_elems = 50'000'000;
  c.zero_optimization.stage3_max_live_parameters_elems = 1'000'000'000;
  c.zero_optimization.stage3_max_reuse_distance_elems = 1'000'000'000;
  const SizedRun three = run_ranks(c, 1);
  const Stage3Report& rep = *three.reports[0];
  EXPECT_EQ(rep.knobs.prefetch_elems, 50'000'000);
  EXPECT_EQ(rep.knobs.max_live_elems, 1'000'000'000);
  EXPECT_EQ(rep.knobs.max_reuse_distance_elems, 1'000'000'000);
  EXPECT_THAT(rep.line(), HasSubstr("(config)"));
  const size_t stage2 = two.runs[0].peak(memory::Category::kParams);
  const size_t stage3 = three.runs[0].peak(memory::Category::kParams);
  EXPECT_GT(stage3, stage2);
  EXPECT_EQ(rep.stage3_params_bytes, stage3);
  EXPECT_EQ(rep.stage2_params_bytes, stage2);
  EXPECT_THAT(rep.warning, HasSubstr(format_bytes(stage3)));
  EXPECT_THAT(rep.warning, HasSubstr(format_bytes(stage2)));
  EXPECT_THAT(rep.warning, HasSubstr("stage3_max_reuse_distance 1000000000"));
  expect_bitwise_runs(three.runs, two.runs, "given knobs");

  // One knob given: it is kept, the others are sized around it, and holding less than stage 2
  // there is no warning.
  c.zero_optimization.stage3_prefetch_bucket_size_elems.reset();
  c.zero_optimization.stage3_max_live_parameters_elems.reset();
  c.zero_optimization.stage3_max_reuse_distance_elems = 0;
  c.world_size = 4;
  c.train_batch_size = 2 * 4;
  const SizedRun one = run_ranks(c, 1);
  const Stage3Report& r1 = *one.reports[0];
  EXPECT_TRUE(r1.knobs.max_reuse_distance_given);
  EXPECT_FALSE(r1.knobs.prefetch_given);
  EXPECT_EQ(r1.knobs.max_reuse_distance_elems, 0);
  EXPECT_EQ(r1.knobs.prefetch_elems, r1.largest_read_elems);
  EXPECT_EQ(r1.knobs.max_live_elems, 1'000'000'000);  // the reuse distance governs
  EXPECT_LT(r1.stage3_params_bytes, r1.stage2_params_bytes);
  EXPECT_TRUE(r1.warning.empty()) << r1.warning;
}

// From JSON: a left-out knob, "auto" (stage3_max_live_parameters, stage3_max_reuse_distance)
// and null are porter's to size; a number is kept.
TEST(EngineZero3SizingTest, LeftOutAutoAndNullAreSizedANumberIsKept) {
  const std::string base = R"({
    "train_micro_batch_size_per_gpu": 2,
    "zero_optimization": {"stage": 3 KNOBS},
    "porter": {"model": {"layers": 4, "hidden": 128, "heads": 4, "seq_len": 128, "vocab": 256},
               "device": {"type": "cpu"}, "checkpointing": {"policy": "full"}}
  })";
  auto options = [&](const std::string& knobs) {
    std::string j = base;
    j.replace(j.find(" KNOBS"), 6, knobs);
    config::ParseOptions po;
    po.world_size = 4;
    return make_run_options(config::parse_config_string(j, po).config);
  };
  const RunOptions sized = options("");
  EXPECT_FALSE(sized.stage3.prefetch_given || sized.stage3.max_live_given ||
               sized.stage3.max_reuse_distance_given);
  EXPECT_EQ(sized.stage3.dp_size, 4);
  EXPECT_EQ(sized.stage3.max_reuse_distance_elems, 0);
  EXPECT_GT(sized.stage3.prefetch_elems, 0);
  EXPECT_EQ(sized.stage3.max_live_elems, 2 * sized.stage3.prefetch_elems);
  for (const std::string& knobs :
       {std::string(R"(, "stage3_max_live_parameters": "auto", "stage3_max_reuse_distance": "auto")"),
        std::string(R"(, "stage3_max_live_parameters": null, "stage3_max_reuse_distance": null,
                        "stage3_prefetch_bucket_size": null)")}) {
    const RunOptions o = options(knobs);
    EXPECT_EQ(o.to_json()["stage3"], sized.to_json()["stage3"]) << knobs;
  }
  const RunOptions kept = options(R"(, "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9)");
  EXPECT_TRUE(kept.stage3.max_live_given && kept.stage3.max_reuse_distance_given);
  EXPECT_EQ(kept.stage3.max_live_elems, 1'000'000'000);
  EXPECT_EQ(kept.stage3.max_reuse_distance_elems, 1'000'000'000);
  EXPECT_EQ(kept.stage3.prefetch_elems, sized.stage3.prefetch_elems);  // still porter's
  // Below stage 3 nothing is sized.
  std::string two = base;
  two.replace(two.find("\"stage\": 3 KNOBS"), 16, "\"stage\": 2");
  config::ParseOptions po;
  po.world_size = 4;
  const RunOptions below = make_run_options(config::parse_config_string(two, po).config);
  EXPECT_EQ(below.stage3.max_live_elems, 1'000'000'000);
  EXPECT_FALSE(stage3_report(below, checkpoint::Schedule{}).has_value());
}

}  // namespace
}  // namespace porter::engine
