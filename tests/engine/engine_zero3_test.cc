// ZeRO stage 3 through the Engine (docs/zero.md, "Stage 3"): ranks as threads, each with its
// own cpu device and Gloo communicator.
//
// Exactness: stage 3 reduces gradients exactly as stage 2 and gathers the same working copies
// that stage 2 all-gathers after AdamW, so losses and the whole training state (each rank's
// parameter shard, master, moments, step and loss scaler) are bitwise those of stage 2, at
// any world size, under every schedule. Memory: the params category holds the
// rank's shard, the persistent stages and, during a step, the gathered buffers the gather
// plan has alive (Note [Gather plan]); the measured peak of those equals the plan's.
#include <algorithm>
#include <cstring>
#include <cmath>
#include <filesystem>
#include <stdexcept>
#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>

#include "base/error.h"
#include "checkpoint/param_gather.h"
#include "comm/communicator.h"
#include "io/consolidate.h"
#include "io/state_file.h"
#include "io/weights_file.h"
#include "engine_test_util.h"
#include "zero/partition.h"

namespace porter::engine {
namespace {

using namespace porter::engine::testing;
using ::testing::HasSubstr;

config::Config z3_config(int world_size, int stage, int64_t gas = 1) {
  config::Config c = zero_config(world_size, stage, gas);
  c.gradient_clipping = 1.0;
  c.porter.model.layers = 3;
  c.porter.model.dropout = 0.1;
  // A block is ~50k elements: prefetch one ahead, free what is not reused within one block,
  // and keep only the final layernorm persistent.
  c.zero_optimization.stage3_prefetch_bucket_size_elems = 60000;
  c.zero_optimization.stage3_max_reuse_distance_elems = 60000;
  c.zero_optimization.stage3_param_persistence_threshold_elems = 1000;
  return c;
}

using RankRun = DpRankRun;


struct Variant {
  std::string name;
  std::function<void(config::Config&)> apply;
};

void set_policy(config::Config& c, config::CheckpointPolicy p, int64_t every = 0) {
  c.porter.checkpointing.policy = p;
  c.porter.checkpointing.every_n_layers = every;
}

const std::vector<Variant>& variants() {
  static const std::vector<Variant> v = {
      {"none", [](config::Config& c) { set_policy(c, config::CheckpointPolicy::kNone); }},
      {"full", [](config::Config& c) { set_policy(c, config::CheckpointPolicy::kFull); }},
      {"uniform", [](config::Config& c) { set_policy(c, config::CheckpointPolicy::kUniform, 2); }},
      {"selective", [](config::Config& c) { set_policy(c, config::CheckpointPolicy::kSelective); }},
      {"sqrt", [](config::Config& c) { set_policy(c, config::CheckpointPolicy::kSqrt); }},
      {"block", [](config::Config& c) {
         set_policy(c, config::CheckpointPolicy::kBlock);
         c.porter.checkpointing.block_layers = 2;
       }},
      {"uniform+offload", [](config::Config& c) {
         set_policy(c, config::CheckpointPolicy::kUniform, 1);
         config::ActivationCheckpointingConfig ac;
         ac.cpu_checkpointing = true;
         c.activation_checkpointing = ac;
         c.porter.device.sim_link_gbps = 50.0;
       }},
      {"accumulation", [](config::Config& c) {
         set_policy(c, config::CheckpointPolicy::kFull);
         c.gradient_accumulation_steps = 3;
         c.train_batch_size = c.train_micro_batch_size_per_gpu * 3 * c.world_size;
       }},
      {"bf16", [](config::Config& c) {
         set_policy(c, config::CheckpointPolicy::kUniform, 1);
         c.bf16.enabled = true;
       }},
      {"fp16", [](config::Config& c) {
         set_policy(c, config::CheckpointPolicy::kSelective);
         c.fp16.enabled = true;
         c.fp16.loss_scale = 0.0;
         c.fp16.initial_scale_power = 8;
       }},
  };
  return v;
}

TEST(EngineZero3Test, BitwiseEqualToStageTwoAtTwoRanksUnderEveryVariant) {
  for (const Variant& v : variants()) {
    config::Config c = z3_config(2, 2);
    v.apply(c);
    const std::vector<RankRun> two = run_dp_ranks(c, 3);
    c.zero_optimization.stage = 3;
    const std::vector<RankRun> three = run_dp_ranks(c, 3);
    expect_bitwise_runs(three, two, "stage 3 vs 2, " + v.name);
    EXPECT_GT(three[0].total.gathers, 0) << v.name;
  }
}

// What expect_same_state(a, b) reports, one message a line.
std::string state_failures(const std::vector<SavedState>& a, const std::vector<SavedState>& b) {
  ::testing::TestPartResultArray results;
  {
    ::testing::ScopedFakeTestPartResultReporter reporter(
        ::testing::ScopedFakeTestPartResultReporter::INTERCEPT_ONLY_CURRENT_THREAD, &results);
    expect_same_state(a, b, "flipped");
  }
  std::string out;
  for (int i = 0; i < results.size(); ++i) {
    out += std::string(results.GetTestPartResult(i).message()) + "\n";
  }
  return out;
}

// The comparison behind the tests above puts stage 3's shards together against stage 2's
// whole parameters: one flipped bit in either run, on either rank, is found and named.
TEST(EngineZero3Test, TheStateComparisonFindsOneBitInAnyShard) {
  config::Config c = z3_config(2, 2);
  const std::vector<RankRun> two = run_dp_ranks(c, 1);
  c.zero_optimization.stage = 3;
  const std::vector<RankRun> three = run_dp_ranks(c, 1);
  std::vector<SavedState> s2 = {two[0].state, two[1].state};
  std::vector<SavedState> s3 = {three[0].state, three[1].state};
  expect_same_state(s3, s2, "unchanged");
  ASSERT_EQ(s3[1].sections[0].name, "params");
  EXPECT_EQ(s3[1].sections[0].begin, s3[1].sections[0].elems);  // rank 1's shard: [S, 2S)
  EXPECT_EQ(s2[1].sections[0].begin, 0);                        // stage 2: the whole buffer
  for (int r = 0; r < 2; ++r) {
    std::vector<SavedState> flipped = s3;
    std::vector<std::byte>& m = flipped[static_cast<size_t>(r)].sections.back().bytes;  // exp_avg_sq
    m[m.size() / 2] ^= std::byte{0x10};
    EXPECT_THAT(state_failures(flipped, s2),
                HasSubstr("rank " + std::to_string(r) + "'s exp_avg_sq differs in 1 of"));
  }
  // Both stage-2 ranks' copies of an element of rank 1's shard, flipped alike: stage 3's
  // rank 1 differs from them, and they from stage 3's assembled shards.
  std::vector<SavedState> flipped = s2;
  const size_t at = static_cast<size_t>(s3[1].sections[0].begin + 5);
  for (SavedState& st : flipped) st.sections[0].bytes[at * 4] ^= std::byte{1};
  const std::string got = state_failures(s3, flipped);
  const std::string shard = std::to_string(s3[1].sections[0].elems);
  const std::string whole = std::to_string(s2[0].sections[0].elems);
  EXPECT_THAT(got, HasSubstr("rank 1's params differs in 1 of " + shard + " elements"));
  EXPECT_THAT(got, HasSubstr("rank 0's params differs in 1 of " + whole + " elements"));
  EXPECT_THAT(got, ::testing::Not(HasSubstr("rank 0's params differs in 1 of " + shard)));
}

TEST(EngineZero3Test, BitwiseEqualToStageTwoAtFourRanks) {
  for (const char* name : {"uniform", "accumulation", "bf16"}) {
    const auto it = std::find_if(variants().begin(), variants().end(),
                                 [&](const Variant& v) { return v.name == name; });
    config::Config c = z3_config(4, 2);
    it->apply(c);
    const std::vector<RankRun> two = run_dp_ranks(c, 3);
    c.zero_optimization.stage = 3;
    const std::vector<RankRun> three = run_dp_ranks(c, 3);
    expect_bitwise_runs(three, two, std::string("4 ranks, ") + name);
  }
}

// Optimal plans from profiled times, which differ from rank to rank: the ranks agree on the
// costs (Note [Agreed costs]), so they run one schedule and their gathers pair up.
TEST(EngineZero3Test, RanksAgreeOnTheOptimalPlanAndMatchStageTwo) {
  config::Config c = z3_config(2, 2);
  c.porter.checkpointing.policy = config::CheckpointPolicy::kOptimal;
  c.porter.checkpointing.memory_budget = config::MemoryBudget{0.8};
  const std::vector<RankRun> two = run_dp_ranks(c, 2);
  c.zero_optimization.stage = 3;
  const std::vector<RankRun> three = run_dp_ranks(c, 2);
  EXPECT_EQ(three[0].plan, three[1].plan);
  EXPECT_EQ(two[0].plan, two[1].plan);
  expect_bitwise_runs(three, two, "optimal");
}

TEST(EngineZero3Test, ParamsAreTheShardPlusTheLiveGatheredBuffersAsPredicted) {
  for (int policy = 0; policy < 3; ++policy) {
    config::Config c = z3_config(2, 3);
    if (policy == 1) set_policy(c, config::CheckpointPolicy::kFull);
    if (policy == 2) set_policy(c, config::CheckpointPolicy::kUniform, 3);
    const std::vector<RankRun> runs = run_dp_ranks(c, 2);
    for (const RankRun& r : runs) {
      const size_t shard = static_cast<size_t>(r.total.shard_elems) * 4;  // f32 working params
      const size_t persistent = r.prediction.params.persistent_bytes;
      EXPECT_GT(persistent, 0u) << r.plan;  // the final layernorm
      EXPECT_EQ(r.current(memory::Category::kParams), shard + persistent) << r.plan;
      EXPECT_EQ(r.total.peak_gathered_bytes, r.prediction.params.peak_gathered_bytes) << r.plan;
      EXPECT_EQ(r.total.peak_live_elems, r.prediction.params.peak_live_elems) << r.plan;
      EXPECT_EQ(r.peak(memory::Category::kParams), shard + persistent + r.prediction.params.peak_gathered_bytes)
          << r.plan;
      // 2 steps of the plan's gathers, and the persistent final layernorm refreshed after
      // each update.
      EXPECT_EQ(r.total.gathers, 2 * r.prediction.params.gathers + 2) << r.plan;
      EXPECT_GT(r.total.gathered_bytes, 0u);
    }
  }
}

TEST(EngineZero3Test, StageThreeHoldsLessThanStageTwo) {
  // Deep enough that one block gathered and one prefetched are less than half the model.
  config::Config c = z3_config(2, 2);
  c.porter.model.layers = 8;
  set_policy(c, config::CheckpointPolicy::kFull);
  const std::vector<RankRun> two = run_dp_ranks(c, 1);
  c.zero_optimization.stage = 3;
  const std::vector<RankRun> three = run_dp_ranks(c, 1);
  EXPECT_LT(three[0].peak(memory::Category::kParams), two[0].peak(memory::Category::kParams));
  EXPECT_LT(three[0].current(memory::Category::kParams), two[0].current(memory::Category::kParams));
}

// Each knob moves the measured peak of live gathered elements, and the plan predicted it.
TEST(EngineZero3Test, EveryKnobChangesThePeakAsPlanned) {
  struct Case {
    std::string knob;
    std::function<void(config::ZeroConfig&)> low, high;
  };
  const std::vector<Case> cases = {
      {"stage3_prefetch_bucket_size",
       [](config::ZeroConfig& z) { z.stage3_prefetch_bucket_size_elems = 0; },
       [](config::ZeroConfig& z) { z.stage3_prefetch_bucket_size_elems = 1'000'000; }},
      {"stage3_max_reuse_distance",
       [](config::ZeroConfig& z) { z.stage3_max_reuse_distance_elems = 0; },
       [](config::ZeroConfig& z) { z.stage3_max_reuse_distance_elems = 1'000'000; }},
      {"stage3_max_live_parameters",
       [](config::ZeroConfig& z) {
         z.stage3_prefetch_bucket_size_elems = 1'000'000;
         z.stage3_max_live_parameters_elems = 60000;
       },
       [](config::ZeroConfig& z) {
         z.stage3_prefetch_bucket_size_elems = 1'000'000;
         z.stage3_max_live_parameters_elems = 1'000'000;
       }},
  };
  for (const Case& k : cases) {
    config::Config c = z3_config(2, 3);
    set_policy(c, config::CheckpointPolicy::kUniform, 3);
    k.low(c.zero_optimization);
    const std::vector<RankRun> low = run_dp_ranks(c, 1);
    k.high(c.zero_optimization);
    const std::vector<RankRun> high = run_dp_ranks(c, 1);
    EXPECT_LT(low[0].total.peak_live_elems, high[0].total.peak_live_elems) << k.knob;
    for (const auto* runs : {&low, &high}) {
      EXPECT_EQ((*runs)[0].total.peak_live_elems, (*runs)[0].prediction.params.peak_live_elems)
          << k.knob;
    }
    expect_bitwise_runs(low, high, k.knob);
  }
  // The cap holds at every gather (the gatherer throws otherwise) and at the peak.
  config::Config c = z3_config(2, 3);
  c.zero_optimization.stage3_prefetch_bucket_size_elems = 1'000'000;
  c.zero_optimization.stage3_max_live_parameters_elems = 60000;
  EXPECT_LE(run_dp_ranks(c, 1)[0].total.peak_live_elems, 60000);
  // Persistence: every stage below the threshold stays gathered, nothing is gathered per op.
  c = z3_config(2, 3);
  c.zero_optimization.stage3_param_persistence_threshold_elems = 10'000'000;
  const std::vector<RankRun> all = run_dp_ranks(c, 1);
  EXPECT_EQ(all[0].prediction.params.gathers, 0);
  EXPECT_EQ(all[0].total.gathers, 5);  // each of the 5 stages refreshed once after the update
  EXPECT_EQ(all[0].total.peak_live_elems, 0);
  EXPECT_GT(all[0].prediction.params.persistent_bytes, 0u);
}

TEST(EngineZero3Test, AMaxLiveBelowOneStageIsRefusedNamingTheKey) {
  config::Config c = z3_config(1, 3);
  c.world_size = 1;
  c.train_batch_size = 2;
  c.zero_optimization.stage3_max_live_parameters_elems = 100;
  auto device = cpu_device();
  const std::string msg = error_of<InvalidArgument>([&] { gpt_engine(*device, c); });
  EXPECT_NE(msg.find("stage3_max_live_parameters"), std::string::npos) << msg;
  EXPECT_NE(msg.find("raise it to at least"), std::string::npos) << msg;
}

TEST(EngineZero3Test, OneRankStageThreeEqualsStageZero) {
  std::vector<double> ref;
  std::vector<float> ref_params;
  SavedState ref_state;
  for (int stage : {0, 3}) {
    config::Config c = z3_config(1, stage);
    c.world_size = 1;
    c.train_batch_size = 2;
    set_policy(c, config::CheckpointPolicy::kFull);
    auto device = cpu_device();
    auto e = gpt_engine(*device, c);
    std::vector<double> losses;
    for (int s = 0; s < 3; ++s) losses.push_back(e->train_step(batches(c, s)).loss);
    // evaluate gathers stage by stage and leaves nothing gathered.
    const double eval = e->evaluate(batches(c, 9));
    EXPECT_TRUE(std::isfinite(eval));
    if (stage == 0) {
      ref = losses;
      ref_params = e->params_host();
      ref_state = saved_state(*e);
    } else {
      EXPECT_EQ(losses, ref);
      EXPECT_TRUE(bitwise_equal(e->params_host(), ref_params));
      expect_same_state(saved_state(*e), ref_state, "stage 3 vs 0");
      EXPECT_EQ(e->zero_stats().peak_live_elems, e->plan().prediction.params.peak_live_elems);
    }
  }
}

TEST(EngineZero3Test, SaveAndResumeAtTwoRanksIsBitIdentical) {
  config::Config c = z3_config(2, 3);
  set_policy(c, config::CheckpointPolicy::kUniform, 1);
  const auto dir = std::filesystem::temp_directory_path() /
                   ("porter_zero3_ckpt_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::vector<std::vector<double>> straight(2), resumed(2);
  std::vector<SavedState> straight_state(2), resumed_state(2);
  for (int phase = 0; phase < 3; ++phase) {
    for_each_dp_rank(c, [&](int rank, memory::Device& device, std::shared_ptr<comm::Communicator> dp) {
      Engine e(device, std::make_unique<TransformerModel>(c.porter.model), c, data_parallel(dp));
      const io::DataSource data(c.porter.data, c.porter.model.vocab, 2, c.porter.model.seq_len);
      int begin = 0, end = phase == 1 ? 3 : 6;
      if (phase == 2) {
        e.load_checkpoint(dir);
        begin = static_cast<int>(e.step());
      }
      for (int s = begin; s < end; ++s) {
        const double loss = e.train_step(data.rank_batches(s, 1, rank, 2)).loss;
        if (phase == 0) straight[static_cast<size_t>(rank)].push_back(loss);
        if (phase == 2) resumed[static_cast<size_t>(rank)].push_back(loss);
      }
      if (phase == 1) e.save_checkpoint(dir);
      if (phase == 0) straight_state[static_cast<size_t>(rank)] = saved_state(e);
      if (phase == 2) resumed_state[static_cast<size_t>(rank)] = saved_state(e);
    });
  }
  expect_same_state(resumed_state, straight_state, "resumed at step 3");
  for (size_t r = 0; r < 2; ++r) {
    ASSERT_EQ(resumed[r].size(), 3u);
    for (size_t s = 0; s < 3; ++s) EXPECT_EQ(resumed[r][s], straight[r][s + 3]) << r << " " << s;
    // Each rank's file holds its shard of the working parameters only.
    const io::LoadedState st = io::read_state(dir / ("rank" + std::to_string(r)));
    ASSERT_TRUE(st.meta.contains("params_range"));
    const int64_t b = st.meta["params_range"][0], e = st.meta["params_range"][1];
    EXPECT_EQ(static_cast<int64_t>(st.section("params").bytes.size()), (e - b) * 4);
  }
  std::filesystem::remove_all(dir);
}


TEST(EngineZero3Test, ARankThatDiesDuringTheGathersFailsItsPeersWithinTheTimeout) {
  config::Config c = z3_config(2, 3);
  c.porter.comm.timeout_s = 3.0;
  // Rank 1 fails in block 1's forward; forward reduces nothing, so the surviving rank's first
  // collective after that is the gather of the next block's parameters.
  c.zero_optimization.stage3_max_reuse_distance_elems = 0;
  c.zero_optimization.stage3_prefetch_bucket_size_elems = 0;
  std::vector<std::string> messages(2);
  std::vector<double> seconds(2, 0.0);
  auto errors = comm::run_thread_ranks(2, [&](int rank, std::shared_ptr<comm::Store> store) {
    auto device = cpu_device();
    comm::CommOptions o;
    o.timeout = comm::Seconds{c.porter.comm.timeout_s};
    std::shared_ptr<comm::Communicator> dp = comm::make_communicator(*device, store, rank, 2, o);
    int step = 0;
    auto armed = [&step, rank] { return rank == 1 && step == 1; };
    Engine e(*device, std::make_unique<BombModel>(c.porter.model, 2, armed, Bomb::kForward), c,
             data_parallel(dp));
    const io::DataSource data(c.porter.data, c.porter.model.vocab, 2, c.porter.model.seq_len);
    const auto t0 = std::chrono::steady_clock::now();
    try {
      for (step = 0; step < 3; ++step) e.train_step(data.rank_batches(step, 1, rank, 2));
    } catch (const std::exception& ex) {
      messages[static_cast<size_t>(rank)] = ex.what();
      seconds[static_cast<size_t>(rank)] =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      throw;
    }
  });
  ASSERT_TRUE(errors[0] != nullptr);
  ASSERT_TRUE(errors[1] != nullptr);
  EXPECT_NE(messages[1].find("bomb"), std::string::npos) << messages[1];
  try {
    std::rethrow_exception(errors[0]);
  } catch (const std::exception& ex) {
    EXPECT_TRUE(dynamic_cast<const PeerError*>(&ex) != nullptr ||
                dynamic_cast<const TimeoutError*>(&ex) != nullptr)
        << ex.what();
    EXPECT_NE(messages[0].find("rank 1"), std::string::npos) << messages[0];
    // It failed inside a parameter gather (one broadcast per shard owner).
    EXPECT_NE(messages[0].find("broadcast"), std::string::npos) << messages[0];
  }
  EXPECT_LT(seconds[0], c.porter.comm.timeout_s + 2.0) << messages[0];
}

}  // namespace
}  // namespace porter::engine

namespace porter::engine {
namespace {

// stage3_gather_16bit_weights_on_model_save: rank 0 writes the gathered working weights; they
// equal the stage-0 run's parameters bitwise (2 ranks, one micro-batch each, no clipping: the
// stages sum the same two values), and porter consolidate of the per-rank shards gives the
// same file.
TEST(EngineZero3Test, ConsolidatedWeightsOnSaveEqualStageZeroBitwise) {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("porter_zero3_save_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::vector<float> stage0;
  for (int stage : {0, 3}) {
    config::Config c = z3_config(2, stage);
    c.gradient_clipping = 0.0;
    c.bf16.enabled = true;
    c.zero_optimization.stage3_gather_16bit_weights_on_model_save = true;
    for_each_dp_rank(c, [&](int rank, memory::Device& device, std::shared_ptr<comm::Communicator> dp) {
      Engine e(device, std::make_unique<TransformerModel>(c.porter.model), c, data_parallel(dp));
      const io::DataSource data(c.porter.data, c.porter.model.vocab, 2, c.porter.model.seq_len);
      for (int s = 0; s < 3; ++s) e.train_step(data.rank_batches(s, 1, rank, 2));
      const std::vector<float> p = e.params_host();
      if (stage == 0 && rank == 0) stage0 = p;
      if (stage == 3) e.save_checkpoint(dir);
    });
  }
  const TransformerModel model(z3_config(2, 3).porter.model);
  const std::vector<io::WeightTensor> saved = io::read_safetensors(dir / "model.safetensors");
  const io::ConsolidateResult offline = io::consolidate_checkpoint(dir);
  ASSERT_EQ(saved.size(), model.layout().entries().size());
  ASSERT_EQ(offline.tensors.size(), saved.size());
  for (size_t i = 0; i < saved.size(); ++i) {
    const nn::ParamEntry& e = model.layout().entries()[i];
    EXPECT_EQ(saved[i].name, e.name);
    EXPECT_EQ(saved[i].dtype, tensor::DType::kBF16);
    EXPECT_EQ(saved[i].bytes, offline.tensors[i].bytes) << e.name;
    // bf16 -> f32 is exact: compare with the stage-0 run's parameters.
    const std::vector<std::byte> f32 = io::to_f32_bytes(tensor::DType::kBF16, saved[i].bytes);
    ASSERT_EQ(f32.size(), static_cast<size_t>(e.shape.numel()) * 4);
    EXPECT_EQ(std::memcmp(f32.data(), stage0.data() + e.offset_elems, f32.size()), 0) << e.name;
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace porter::engine
