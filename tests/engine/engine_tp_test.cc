// Tensor parallelism through the Engine (docs/tensor-parallel.md): ranks run as threads, each
// with its own cpu device, a Gloo world communicator and the dp and tp groups of
// comm::make_process_groups.
//
// - Equivalence: t = 2 and t = 4 against t = 1 (f32, dropout 0.1, clipping on): the losses
//   over 10 steps agree within 1e-5 relative, and each tensor of the first step's gradients
//   and of the parameters after the 10 steps (each rank's part of them) within a bound
//   relative to its own largest value; the difference is only the order of the partial sums.
// - At a fixed t, runs are bit-identical, to the whole training state, across checkpoint
//   policies, partitioning on and off, offload on and off, prefetch depths 0-3 and contiguous
//   on and off, and across ZeRO stages 2 and 3 and a resume.
// - Two-dimensional runs (dp x t = 4 with ZeRO-2), t = world, and a rank that fails.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <string>

#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "base/error.h"
#include "comm/communicator.h"
#include "engine_test_util.h"

namespace porter::engine {
namespace {

using namespace porter::engine::testing;
using ::testing::HasSubstr;

config::Config tp_config(int world, int tp, config::CheckpointPolicy policy, bool sp = false) {
  config::Config c = tiny_config(policy, /*dropout=*/0.1, /*accumulation=*/1);
  c.world_size = world;
  c.train_batch_size = c.train_micro_batch_size_per_gpu * (world / tp);
  c.porter.model.tensor_parallel = tp;
  c.porter.model.sequence_parallel = sp;
  c.porter.model.vocab = 70;  // t = 4 pads the vocabulary (shards of 18, the last 16 real)
  c.porter.comm.timeout_s = 30.0;
  c.porter.checkpointing.partition_min_bytes = 0;  // the tiny checkpoints are partitioned too
  return c;
}

// The key third of each block's qkv.bias in a rank's layout ([q, k, v] rows of its heads).
// Its gradient is zero in exact arithmetic (a key bias adds one constant to every score of
// a query's row, which the softmax removes), so what it holds is rounding noise, which
// AdamW's m / sqrt(v) turns into steps of the full learning rate. Across t its values are
// not compared; at a fixed t the whole-state comparisons hold them to the bit.
std::vector<std::pair<int64_t, int64_t>> key_biases(const nn::ParamLayout& layout) {
  std::vector<std::pair<int64_t, int64_t>> out;
  for (const nn::ParamEntry& e : layout.entries()) {
    if (e.name.size() < 8 || e.name.compare(e.name.size() - 8, 8, "qkv.bias") != 0) continue;
    const int64_t third = e.shape.numel() / 3;
    out.emplace_back(e.offset_elems + third, e.offset_elems + 2 * third);
  }
  return out;
}

// Each tensor of `layout` on its own: |a - b| <= tol * max|b| over the tensor (a layernorm's
// or a bias's values are held to their own scale, not the largest tensor's), but the
// `skipped` ranges; the padding between tensors exactly.
void expect_close(const nn::ParamLayout& layout, const std::vector<float>& a,
                    const std::vector<float>& b, double tol, const std::string& what,
                    const std::vector<std::pair<int64_t, int64_t>>& skipped = {}) {
  ASSERT_EQ(a.size(), b.size()) << what;
  std::vector<bool> in_tensor(a.size(), false);
  for (const nn::ParamEntry& e : layout.entries()) {
    double scale = 0.0, worst = 0.0;
    for (int64_t i = e.offset_elems; i < e.offset_elems + e.shape.numel(); ++i) {
      const size_t k = static_cast<size_t>(i);
      in_tensor[k] = true;
      if (std::any_of(skipped.begin(), skipped.end(),
                      [i](const auto& r) { return i >= r.first && i < r.second; })) {
        continue;
      }
      scale = std::max(scale, static_cast<double>(std::fabs(b[k])));
      worst = std::max(worst, std::fabs(static_cast<double>(a[k]) - b[k]));
    }
    EXPECT_LE(worst, tol * scale) << what << ": " << e.name << " worst difference " << worst
                                  << " against its scale " << scale;
  }
  for (size_t k = 0; k < a.size(); ++k) {
    if (!in_tensor[k]) {
      EXPECT_EQ(a[k], b[k]) << what << ": padding element " << k;
    }
  }
}

class EngineTpEquivalence : public ::testing::TestWithParam<std::pair<int, bool>> {};

TEST_P(EngineTpEquivalence, GradientsAndTenLossesMatchOneRank) {
  const auto [t, sp] = GetParam();
  const auto policy = config::CheckpointPolicy::kFull;
  const std::vector<TpRankRun> one = run_tp_ranks(tp_config(1, 1, policy), 10);
  const std::vector<TpRankRun> group = run_tp_ranks(tp_config(t, t, policy, sp), 10);
  for (int r = 0; r < t; ++r) {
    const TpRankRun& got = group[static_cast<size_t>(r)];
    for (size_t s = 0; s < got.steps.size(); ++s) {
      EXPECT_NEAR(got.steps[s].loss, one[0].steps[s].loss, 1e-5 * one[0].steps[s].loss)
          << "rank " << r << " step " << s;
      EXPECT_NEAR(got.steps[s].grad_norm, one[0].steps[s].grad_norm,
                  1e-5 * one[0].steps[s].grad_norm)
          << "rank " << r << " step " << s;
    }
    models::Transformer part(tp_config(t, t, policy, sp).porter.model, r);
    const size_t whole_elems = static_cast<size_t>(
        models::Transformer(tp_config(1, 1, policy).porter.model).layout().total_elems());
    const size_t part_elems = static_cast<size_t>(part.layout().total_elems());
    auto part_of = [&](std::vector<float> v) {  // the rank's share of the t = 1 values
      v.resize(whole_elems);
      return part.shard_values(v);
    };
    auto mine = [&](std::vector<float> v) {
      v.resize(part_elems);
      return v;
    };
    // Gradients: the reordered partial sums alone (measured 5.1e-7 at worst).
    expect_close(part.layout(), mine(got.first_grads), part_of(one[0].first_grads), 1e-5,
                 "first gradients, rank " + std::to_string(r));
    // Parameters after 10 AdamW steps at lr 1e-2: m / sqrt(v) magnifies the gradients'
    // rounding where they are small (measured 6.8e-4 of a tensor's largest value at worst,
    // t = 4); a wrong update is a step of the learning rate, about 1e-1 of these tensors.
    expect_close(part.layout(), mine(got.params), part_of(one[0].params), 2e-3,
                 "parameters after 10 steps, rank " + std::to_string(r), key_biases(part.layout()));
    EXPECT_GT(got.tp.comm_bytes, 0u);
  }
}

INSTANTIATE_TEST_SUITE_P(Groups, EngineTpEquivalence,
                         ::testing::Values(std::pair{2, false}, std::pair{4, false},
                                           std::pair{2, true}),
                         [](const auto& group) {
                           return "t" + std::to_string(group.param.first) +
                                  (group.param.second ? "_sp" : "");
                         });

struct Variant {
  std::string name;
  config::CheckpointPolicy policy;
  bool partition = false;
  bool offload = false;
  bool contiguous = false;
  int prefetch = 1;
};

config::Config variant_config(const Variant& v, bool sp = false) {
  config::Config c = tp_config(2, 2, v.policy, sp);
  if (v.policy == config::CheckpointPolicy::kUniform) c.porter.checkpointing.every_n_layers = 1;
  if (v.partition || v.offload || v.contiguous) {
    config::ActivationCheckpointingConfig ac;
    ac.partition_activations = v.partition;
    ac.cpu_checkpointing = v.offload;
    ac.contiguous_memory_optimization = v.contiguous;
    c.activation_checkpointing = ac;
    c.porter.checkpointing.keep_last_on_device = 0;
  }
  c.porter.checkpointing.prefetch_depth = v.prefetch;
  return c;
}

TEST(EngineTp, BitIdenticalAcrossPoliciesPartitioningOffloadAndPrefetch) {
  using P = config::CheckpointPolicy;
  const std::vector<TpRankRun> base = run_tp_ranks(variant_config({"none", P::kNone}), 2);
  const std::vector<Variant> variants = {
      {"full", P::kFull},
      {"uniform", P::kUniform},
      {"selective", P::kSelective},
      {"full partitioned", P::kFull, true},
      {"full partitioned prefetch 0", P::kFull, true, false, false, 0},
      {"full partitioned prefetch 3", P::kFull, true, false, false, 3},
      {"full partitioned contiguous", P::kFull, true, false, true},
      {"full offloaded", P::kFull, false, true},
      {"full partitioned offloaded", P::kFull, true, true},
      {"full partitioned offloaded contiguous prefetch 2", P::kFull, true, true, true, 2},
      {"none partitioned (holds nothing)", P::kNone, true},
  };
  for (const Variant& v : variants) {
    SCOPED_TRACE(v.name);
    const std::vector<TpRankRun> got = run_tp_ranks(variant_config(v), 2);
    expect_bitwise_runs(got, base, v.name);
    if (v.partition && v.policy != P::kNone) {
      EXPECT_GT(got[0].tp.gathers, 0) << "nothing was gathered";
      EXPECT_GT(got[0].tp.gathered_bytes, 0u);
    }
  }
}

TEST(EngineTp, PartitionedCheckpointBytesAreThePredictedShare) {
  const config::CheckpointPolicy full = config::CheckpointPolicy::kFull;
  const std::vector<TpRankRun> whole = run_tp_ranks(variant_config({"full", full}), 1);
  const std::vector<TpRankRun> part = run_tp_ranks(variant_config({"full partitioned", full, true}), 1);
  for (size_t r = 0; r < part.size(); ++r) {
    EXPECT_EQ(part[r].memory.peak_activation_bytes, part[r].memory.predicted_activation_bytes)
        << "rank " << r;
    EXPECT_EQ(whole[r].memory.peak_activation_bytes, whole[r].memory.predicted_activation_bytes);
    // Every held block input is replaced by its half.
    size_t slices = 0, held = 0;
    for (const checkpoint::StashEntry& e : part[r].plan.offload.entries) {
      EXPECT_TRUE(e.partitioned);
      EXPECT_EQ(e.slice_bytes, (e.bytes / 2 + 15) / 16 * 16);
      slices += e.slice_bytes;
      held += e.bytes;
    }
    EXPECT_GT(slices, 0u);
    EXPECT_EQ(part[r].tp.gathered_bytes, slices);  // one gather per checkpoint: the other half
  }
}

TEST(EngineTp, TwoDimensionalWithZero2AndTEqualsWorld) {
  const config::CheckpointPolicy full = config::CheckpointPolicy::kFull;
  config::Config one = tp_config(2, 1, full);
  one.zero_optimization.stage = 2;
  config::Config two = tp_config(4, 2, full);
  two.zero_optimization.stage = 2;
  const std::vector<TpRankRun> a = run_tp_ranks(one, 4);
  const std::vector<TpRankRun> b = run_tp_ranks(two, 4);
  // Rank (dp d, tp r) = d * 2 + r trains on dp rank d's batches.
  for (size_t s = 0; s < 4; ++s) {
    for (int d = 0; d < 2; ++d) {
      for (int r = 0; r < 2; ++r) {
        EXPECT_NEAR(b[static_cast<size_t>(d * 2 + r)].steps[s].loss,
                    a[static_cast<size_t>(d)].steps[s].loss, 1e-5 * a[0].steps[s].loss);
      }
    }
  }
  const std::vector<TpRankRun> all = run_tp_ranks(tp_config(4, 4, full), 2);  // no dp
  EXPECT_NEAR(all[3].steps[1].loss, run_tp_ranks(tp_config(1, 1, full), 2)[0].steps[1].loss,
              1e-5 * all[0].steps[1].loss);
}

// ZeRO stage 3 over the dp groups of a 2 x 2 world (each tp rank's part gathered over its dp
// group) is bitwise stage 2 there, in losses, parameters and the whole training state.
TEST(EngineTp, StageThreeOverTheDpGroupsIsBitwiseStageTwo) {
  config::Config c = tp_config(4, 2, config::CheckpointPolicy::kFull);
  c.zero_optimization.stage = 2;
  const std::vector<TpRankRun> two = run_tp_ranks(c, 3);
  c.zero_optimization.stage = 3;
  c.zero_optimization.stage3_max_reuse_distance_elems = 0;
  const std::vector<TpRankRun> three = run_tp_ranks(c, 3);
  expect_bitwise_runs(three, two, "stage 3 vs 2");
}

// The trace's "tp comm" lane has the layers' collectives, named after the schedule op that
// issued them, and the gathers of partitioned checkpoints.
TEST(EngineTp, TheTraceHasATpCommLane) {
  config::Config c = variant_config({"full partitioned", config::CheckpointPolicy::kFull, true});
  std::vector<std::string> names;
  auto errors = comm::run_thread_ranks(2, [&](int rank, std::shared_ptr<comm::Store> store) {
    auto device = cpu_device();
    comm::CommOptions o;
    o.timeout = comm::Seconds{c.porter.comm.timeout_s};
    std::shared_ptr<comm::Communicator> world = comm::make_communicator(*device, store, rank, 2, o);
    comm::ProcessGroups g = comm::make_process_groups(world, 2);
    Engine e(*device, std::make_unique<TransformerModel>(c.porter.model, g.tp_rank), c, g);
    TraceRecorder trace;
    e.set_trace(&trace);
    const io::DataSource data(c.porter.data, c.porter.model.vocab, c.train_micro_batch_size_per_gpu,
                          c.porter.model.seq_len);
    e.train_step(data.rank_batches(0, 1, 0, 1));
    if (rank != 0) return;
    for (const TraceSpan& s : trace.spans()) {
      if (s.lane == "tp comm") names.push_back(s.name);
    }
  });
  for (auto& err : errors) {
    if (err) std::rethrow_exception(err);
  }
  auto has = [&](const std::string& text) {
    return std::any_of(names.begin(), names.end(),
                       [&](const std::string& n) { return n.find(text) != std::string::npos; });
  };
  EXPECT_TRUE(has("all_reduce forward embedding")) << ::testing::PrintToString(names);
  EXPECT_TRUE(has("all_reduce recompute block.1")) << ::testing::PrintToString(names);
  EXPECT_TRUE(has("all_reduce backward block.0")) << ::testing::PrintToString(names);
  EXPECT_TRUE(has("all_gather forward head")) << ::testing::PrintToString(names);  // the loss
  EXPECT_TRUE(has("all_gather")) << ::testing::PrintToString(names);
}

// Training checkpoints: each rank saves its part into dir/rank<world rank>; resuming
// continues bit-identically, to the whole training state.
TEST(EngineTp, SaveAndResumeAreBitIdentical) {
  const config::Config c = tp_config(4, 2, config::CheckpointPolicy::kFull);
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("porter_engine_tp_ckpt_" + std::to_string(getpid()));
  std::filesystem::remove_all(dir);
  std::vector<std::vector<float>> straight(4), resumed(4);
  std::vector<SavedState> straight_state(4), resumed_state(4);
  for (int phase = 0; phase < 3; ++phase) {
    auto errors = comm::run_thread_ranks(4, [&](int rank, std::shared_ptr<comm::Store> store) {
      auto device = cpu_device();
      comm::CommOptions o;
      o.timeout = comm::Seconds{c.porter.comm.timeout_s};
      std::shared_ptr<comm::Communicator> world =
          comm::make_communicator(*device, store, rank, 4, o);
      comm::ProcessGroups g = comm::make_process_groups(world, 2);
      Engine e(*device, std::make_unique<TransformerModel>(c.porter.model, g.tp_rank), c, g);
      const io::DataSource data(c.porter.data, c.porter.model.vocab,
                            c.train_micro_batch_size_per_gpu, c.porter.model.seq_len);
      auto step = [&](int s) { e.train_step(data.rank_batches(s, 1, g.dp_rank, g.dp_size)); };
      if (phase == 0) {  // 4 steps straight
        for (int s = 0; s < 4; ++s) step(s);
        straight[static_cast<size_t>(rank)] = e.params_host();
        straight_state[static_cast<size_t>(rank)] = saved_state(e);
      } else if (phase == 1) {  // 2 steps, then save
        for (int s = 0; s < 2; ++s) step(s);
        e.save_checkpoint(dir);
      } else {  // load, then the last 2
        e.load_checkpoint(dir);
        EXPECT_EQ(e.step(), 2);
        for (int s = 2; s < 4; ++s) step(s);
        resumed[static_cast<size_t>(rank)] = e.params_host();
        resumed_state[static_cast<size_t>(rank)] = saved_state(e);
      }
    });
    for (auto& err : errors) {
      if (err) std::rethrow_exception(err);
    }
  }
  for (int r = 0; r < 4; ++r) {
    EXPECT_TRUE(std::filesystem::exists(dir / ("rank" + std::to_string(r)))) << r;
    EXPECT_TRUE(bitwise_equal(resumed[static_cast<size_t>(r)], straight[static_cast<size_t>(r)]))
        << "rank " << r;
  }
  expect_same_state(resumed_state, straight_state, "resumed at step 2");
  std::filesystem::remove_all(dir);
}

TEST(EngineTp, AFailedRankFailsItsPeersNamingRankGroupAndOperation) {
  config::Config c = tp_config(2, 2, config::CheckpointPolicy::kFull);
  c.porter.comm.timeout_s = 10.0;
  std::string message;
  auto errors = comm::run_thread_ranks(2, [&](int rank, std::shared_ptr<comm::Store> store) {
    auto device = cpu_device();
    comm::CommOptions o;
    o.timeout = comm::Seconds{c.porter.comm.timeout_s};
    std::shared_ptr<comm::Communicator> world = comm::make_communicator(*device, store, rank, 2, o);
    comm::ProcessGroups g = comm::make_process_groups(world, 2);
    Engine e(*device, std::make_unique<TransformerModel>(c.porter.model, g.tp_rank), c, g);
    if (rank == 1) {
      world->abort("rank 1 stopped");  // dies before its first step
      return;
    }
    const io::DataSource data(c.porter.data, c.porter.model.vocab, c.train_micro_batch_size_per_gpu,
                          c.porter.model.seq_len);
    const auto t0 = std::chrono::steady_clock::now();
    try {
      e.train_step(data.rank_batches(0, 1, 0, 1));
    } catch (const Error& err) {
      message = err.what();
    }
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(15));
  });
  for (auto& err : errors) {
    if (err) std::rethrow_exception(err);
  }
  EXPECT_THAT(message, HasSubstr("rank 0 of world"));
  EXPECT_THAT(message, ::testing::AnyOf(HasSubstr("all_reduce"), HasSubstr("all_gather")));
}

}  // namespace
}  // namespace porter::engine
