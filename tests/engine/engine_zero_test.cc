// Data parallelism and ZeRO stages 0, 1 and 2 through the Engine (docs/zero.md): ranks run as
// threads (comm::run_thread_ranks), each with its own cpu device and Gloo communicator.
//
// Exactness (docs/zero.md, "Exactness"): with 2 ranks, one micro-batch per rank and no
// clipping, stages 0, 1 and 2 give bitwise equal losses: every element is the sum of the same
// two values (a + b == b + a in floating point) times 1/N, and AdamW is elementwise. With
// clipping the norm is summed in another order (the local full buffer at stage 0, shard norms
// all-reduced above), and with 4 ranks or accumulation the sums' order differs; those agree
// within 1e-6 relative.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <unistd.h>
#include <stdexcept>

#include <gtest/gtest.h>

#include <map>
#include <mutex>

#include "base/error.h"
#include "comm/communicator.h"
#include "io/state_file.h"
#include "engine_test_util.h"
#include "zero/partition.h"

namespace porter::engine {
namespace {

using namespace porter::engine::testing;

struct RankRun {
  std::vector<StepResult> steps;
  std::vector<float> params;
  std::array<size_t, memory::kNumCategories> bytes_after_init{};
  std::array<size_t, memory::kNumCategories> bytes_after_step{};
  ZeroStats total;
  MemoryReport memory;
  size_t predicted_comm_bytes = 0;
};

using ModelFactory = std::function<std::unique_ptr<Model>(const config::Config&, int rank)>;

std::unique_ptr<Model> gpt(const config::Config& c, int) {
  return std::make_unique<TransformerModel>(c.porter.model);
}

// Runs `steps` steps on c.world_size thread ranks; rethrows the first rank's error.
std::vector<RankRun> run_ranks(const config::Config& c, int steps, ModelFactory make = gpt) {
  const int ws = static_cast<int>(c.world_size);
  std::vector<RankRun> runs(static_cast<size_t>(ws));
  auto errors = comm::run_thread_ranks(ws, [&](int rank, std::shared_ptr<comm::Store> store) {
    auto device = cpu_device();
    comm::CommOptions o;
    o.timeout = comm::Seconds{c.porter.comm.timeout_s};
    std::shared_ptr<comm::Communicator> dp = comm::make_communicator(*device, store, rank, ws, o);
    Engine e(*device, make(c, rank), c, data_parallel(dp));
    RankRun& run = runs[static_cast<size_t>(rank)];
    const memory::MemoryStats s0 = e.allocator().stats();
    for (size_t k = 0; k < memory::kNumCategories; ++k) {
      run.bytes_after_init[k] = s0.by_category[k].current_bytes;
    }
    const io::DataSource data(c.porter.data, c.porter.model.vocab, c.train_micro_batch_size_per_gpu,
                          c.porter.model.seq_len);
    for (int s = 0; s < steps; ++s) {
      run.steps.push_back(
          e.train_step(data.rank_batches(s, c.gradient_accumulation_steps, rank, ws)));
    }
    const memory::MemoryStats s1 = e.allocator().stats();
    for (size_t k = 0; k < memory::kNumCategories; ++k) {
      run.bytes_after_step[k] = s1.by_category[k].current_bytes;
    }
    run.params = e.params_host();
    run.total = e.zero_stats();
    run.memory = e.memory_report();
    run.predicted_comm_bytes = e.plan().prediction.peak_comm_bytes;
  });
  for (auto& err : errors) {
    if (err) std::rethrow_exception(err);
  }
  return runs;
}

// The mean loss over ranks of each step (each rank reports its own micro-batches' loss).
std::vector<double> global_losses(const std::vector<RankRun>& runs) {
  std::vector<double> out(runs[0].steps.size(), 0.0);
  for (const RankRun& r : runs) {
    for (size_t s = 0; s < out.size(); ++s) out[s] += r.steps[s].loss / runs.size();
  }
  return out;
}

void expect_close(const std::vector<double>& a, const std::vector<double>& b, double rel,
                  const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_NEAR(a[i], b[i], rel * std::fabs(b[i])) << what << " step " << i;
  }
}

TEST(EngineZeroTest, StagesGiveBitwiseEqualLossesAtTwoRanks) {
  std::vector<double> ref;
  std::vector<float> ref_params;
  for (int stage = 0; stage <= 2; ++stage) {
    const std::vector<RankRun> runs = run_ranks(zero_config(2, stage), 20);
    // Every rank holds the same parameters after the all-reduce / all-gather.
    EXPECT_TRUE(bitwise_equal(runs[0].params, runs[1].params)) << "stage " << stage;
    const std::vector<double> losses = global_losses(runs);
    // Synthetic tokens are uniform (loss ~ ln 256): check that the steps update and stay finite.
    EXPECT_NE(losses[1], losses[0]) << "stage " << stage;
    EXPECT_TRUE(std::isfinite(losses.back())) << "stage " << stage;
    if (stage == 0) {
      ref = losses;
      ref_params = runs[0].params;
      continue;
    }
    for (size_t s = 0; s < ref.size(); ++s) {
      EXPECT_EQ(losses[s], ref[s]) << "stage " << stage << " step " << s;
    }
    EXPECT_TRUE(bitwise_equal(runs[0].params, ref_params)) << "stage " << stage;
    // Communication happened and is reported.
    EXPECT_GT(runs[0].total.comm_bytes, 0u);
    EXPECT_EQ(runs[0].steps[0].zero.zero_stage, stage);
    EXPECT_EQ(runs[0].steps[0].zero.world_size, 2);
  }
}

TEST(EngineZeroTest, ScalingVariantsAndStageOneAllReduceAgree) {
  // Default: sum, then x 1/2. prescale_gradients: x 1/2, then sum. predivide factor 2 at two
  // ranks: x 1/2, sum, no post-scale. Stage 1 with reduce_scatter false all-reduces.
  const std::vector<double> ref = global_losses(run_ranks(zero_config(2, 2), 6));
  config::Config pre = zero_config(2, 2);
  pre.prescale_gradients = true;
  expect_close(global_losses(run_ranks(pre, 6)), ref, 1e-6, "prescale_gradients");
  config::Config div = zero_config(2, 2);
  div.gradient_predivide_factor = 2.0;
  expect_close(global_losses(run_ranks(div, 6)), ref, 1e-6, "gradient_predivide_factor 2");
  config::Config ar = zero_config(2, 1);
  ar.zero_optimization.reduce_scatter = false;
  const std::vector<double> all_reduce = global_losses(run_ranks(ar, 6));
  for (size_t s = 0; s < ref.size(); ++s) EXPECT_EQ(all_reduce[s], ref[s]) << s;
}

// A communicator that counts the collectives issued through it ("all_reduce", ...; and the
// all-gathers labelled "params", the optimizer's parameter all-gather), then forwards them.
class CountingComm : public comm::Communicator {
 public:
  explicit CountingComm(std::shared_ptr<comm::Communicator> inner) : inner_(std::move(inner)) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  std::string_view backend() const override { return inner_->backend(); }
  const std::string& group_name() const override { return inner_->group_name(); }
  comm::Work all_reduce(void* buf, size_t count, comm::ElemType type, comm::ReduceOp op) override {
    count_op("all_reduce");
    return inner_->all_reduce(buf, count, type, op);
  }
  comm::Work reduce_scatter(const void* in, void* out, size_t count, comm::ElemType type,
                            comm::ReduceOp op) override {
    count_op("reduce_scatter");
    return inner_->reduce_scatter(in, out, count, type, op);
  }
  comm::Work all_gather(const void* in, void* out, size_t count, comm::ElemType type) override {
    count_op(inner_->label() == "params" ? "param all_gather" : "all_gather");
    if (inner_->label() == "params") max_param_gather_elems_ = std::max(max_param_gather_elems_, count * size());
    return inner_->all_gather(in, out, count, type);
  }
  comm::Work broadcast(void* buf, size_t count, comm::ElemType type, int root) override {
    count_op("broadcast");
    return inner_->broadcast(buf, count, type, root);
  }
  comm::Work barrier() override { return inner_->barrier(); }
  std::unique_ptr<comm::Communicator> split(const std::vector<int>& ranks,
                                            const std::string& name) override {
    return inner_->split(ranks, name);
  }
  void abort(const std::string& reason) override { inner_->abort(reason); }
  memory::Stream& stream() override { return inner_->stream(); }
  comm::CommStats stats() const override { return inner_->stats(); }
  void reset_stats() override { inner_->reset_stats(); }
  void record_ops(bool on) override { inner_->record_ops(on); }
  std::vector<comm::CommRecord> take_records() override { return inner_->take_records(); }
  uint64_t dropped_records() const override { return inner_->dropped_records(); }
  void set_label(std::string label) override { inner_->set_label(std::move(label)); }
  const std::string& label() const override { return inner_->label(); }

  std::map<std::string, int64_t> ops() const {
    std::lock_guard<std::mutex> lock(mu_);
    return ops_;
  }
  size_t max_param_gather_elems() const { return max_param_gather_elems_; }

 private:
  void count_op(const std::string& name) {
    std::lock_guard<std::mutex> lock(mu_);
    ++ops_[name];
  }
  std::shared_ptr<comm::Communicator> inner_;
  mutable std::mutex mu_;
  std::map<std::string, int64_t> ops_;
  size_t max_param_gather_elems_ = 0;
};

// One rank of run_counted: its step results, the collectives it issued during the steps and
// its training checkpoint as save_checkpoint wrote it.
struct CountedRun {
  std::vector<StepResult> steps;
  std::map<std::string, int64_t> ops;
  size_t max_param_gather_elems = 0;
  size_t peak_comm_bytes = 0;
  io::LoadedState state;
};

// `steps` steps on c.world_size thread ranks, each through a CountingComm; every rank saves
// its state under `dir` (removed afterwards).
std::vector<CountedRun> run_counted(const config::Config& c, int steps, const std::string& tag) {
  const int ws = static_cast<int>(c.world_size);
  const auto dir = std::filesystem::temp_directory_path() /
                   ("porter_zero_" + tag + "_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::vector<CountedRun> runs(static_cast<size_t>(ws));
  auto errors = comm::run_thread_ranks(ws, [&](int rank, std::shared_ptr<comm::Store> store) {
    auto device = cpu_device();
    comm::CommOptions o;
    o.timeout = comm::Seconds{c.porter.comm.timeout_s};
    auto counting = std::make_shared<CountingComm>(
        std::shared_ptr<comm::Communicator>(comm::make_communicator(*device, store, rank, ws, o)));
    Engine e(*device, std::make_unique<TransformerModel>(c.porter.model), c, data_parallel(counting));
    e.reset_peaks();
    CountedRun& run = runs[static_cast<size_t>(rank)];
    const std::map<std::string, int64_t> before = counting->ops();  // construction's
    const io::DataSource data(c.porter.data, c.porter.model.vocab, c.train_micro_batch_size_per_gpu,
                          c.porter.model.seq_len);
    for (int s = 0; s < steps; ++s) {
      run.steps.push_back(
          e.train_step(data.rank_batches(s, c.gradient_accumulation_steps, rank, ws)));
    }
    run.ops = counting->ops();
    for (const auto& [name, n] : before) run.ops[name] -= n;
    run.max_param_gather_elems = counting->max_param_gather_elems();
    run.peak_comm_bytes =
        e.memory_report().peak_by_category[memory::index_of(memory::Category::kComm)];
    e.save_checkpoint(dir);
  });
  for (auto& err : errors) {
    if (err) std::rethrow_exception(err);
  }
  for (int r = 0; r < ws; ++r) {
    runs[static_cast<size_t>(r)].state = io::read_state(dir / ("rank" + std::to_string(r)));
  }
  std::filesystem::remove_all(dir);
  return runs;
}

// The whole saved training state of every rank, bit for bit: every section (parameters, f32
// master, both moments), the step, the optimizer's steps and the loss scaler; and the losses.
void expect_same_state(const std::vector<CountedRun>& a, const std::vector<CountedRun>& b,
                       const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t r = 0; r < a.size(); ++r) {
    ASSERT_EQ(a[r].steps.size(), b[r].steps.size()) << what;
    for (size_t s = 0; s < a[r].steps.size(); ++s) {
      EXPECT_EQ(a[r].steps[s].loss, b[r].steps[s].loss) << what << ": rank " << r << " step " << s;
    }
    const io::LoadedState& x = a[r].state;
    const io::LoadedState& y = b[r].state;
    ASSERT_EQ(x.sections.size(), y.sections.size()) << what;
    ASSERT_GE(x.sections.size(), 3u) << what;  // params, exp_avg, exp_avg_sq
    for (size_t i = 0; i < x.sections.size(); ++i) {
      EXPECT_EQ(x.sections[i].name, y.sections[i].name) << what;
      EXPECT_TRUE(x.sections[i].bytes == y.sections[i].bytes)
          << what << ": rank " << r << " section " << x.sections[i].name << " differs";
    }
    for (const char* key : {"step", "optimizer_steps", "loss_scaler"}) {
      EXPECT_EQ(x.meta.value(key, nlohmann::json()), y.meta.value(key, nlohmann::json()))
          << what << ": rank " << r << " meta " << key;
    }
  }
}

int64_t op_count(const CountedRun& run, const std::string& op) {
  auto it = run.ops.find(op);
  return it == run.ops.end() ? 0 : it->second;
}

// Note [Reduce-scatter off] in zero/reducer.h: stages 1-3 with reduce_scatter false all-reduce
// every bucket they would reduce-scatter, with the same payload, and on Gloo give the same
// bits at 2 and 3 ranks (at 3 the sums have three terms, whose order the ring fixes by chunk).
TEST(EngineZeroTest, ReduceScatterOffAllReducesWithTheSameState) {
  for (int ws : {2, 3}) {
    for (int stage = 1; stage <= 3; ++stage) {
      const std::string what = std::to_string(ws) + " ranks, stage " + std::to_string(stage);
      config::Config c = zero_config(ws, stage);
      c.gradient_clipping = 0.05;  // the norm, from the reduced shards, is in the state too
      const std::vector<CountedRun> scatter = run_counted(c, 4, "rs_on");
      c.zero_optimization.reduce_scatter = false;
      const std::vector<CountedRun> reduce = run_counted(c, 4, "rs_off");
      expect_same_state(scatter, reduce, what);
      for (size_t r = 0; r < scatter.size(); ++r) {
        // The packed buckets were reduce-scattered, and are all-reduced now: nothing else changed.
        const int64_t rs = op_count(scatter[r], "reduce_scatter");
        EXPECT_GT(rs, 0) << what;
        EXPECT_EQ(op_count(reduce[r], "reduce_scatter"), 0) << what;
        EXPECT_EQ(op_count(reduce[r], "all_reduce"), op_count(scatter[r], "all_reduce") + rs)
            << what;
        for (size_t s = 0; s < scatter[r].steps.size(); ++s) {
          EXPECT_EQ(reduce[r].steps[s].zero.comm_bytes, scatter[r].steps[s].zero.comm_bytes)
              << what << " step " << s;
        }
      }
    }
  }
}

// Note [Bucketed parameter all-gather] in zero/sharded_optimizer.h.
TEST(EngineZeroTest, AllgatherBucketSizeSplitsTheParameterGather) {
  for (int ws : {2, 3}) {
    for (int stage = 1; stage <= 2; ++stage) {
      const std::string what = std::to_string(ws) + " ranks, stage " + std::to_string(stage);
      config::Config c = zero_config(ws, stage);
      // A small model: a 16-element bucket is hundreds of all-gathers per step (8 elements a
      // rank at 2 ranks, 5 at 3), and 1000 elements leaves a remainder chunk.
      c.porter.model.hidden = 16;
      c.porter.model.vocab = 32;
      c.porter.model.layers = 1;
      const int steps = 2;
      const std::vector<CountedRun> whole = run_counted(c, steps, "ag_whole");
      const int64_t s_elems = whole[0].steps[0].zero.shard_elems;
      EXPECT_EQ(op_count(whole[0], "param all_gather"), steps) << what;  // 5e8: one per step
      for (int64_t bucket : {int64_t{16}, int64_t{1000}, 2 * ws * s_elems + 2}) {
        const std::string w = what + ", allgather_bucket_size " + std::to_string(bucket);
        const int64_t chunk = std::max<int64_t>(1, bucket / ws);
        if (bucket == 1000) {
          ASSERT_NE(s_elems % chunk, 0) << w << ": meant not to divide S";
        }
        config::Config b = c;
        b.zero_optimization.allgather_bucket_size_elems = bucket;
        const std::vector<CountedRun> runs = run_counted(b, steps, "ag_" + std::to_string(bucket));
        expect_same_state(whole, runs, w);
        const int64_t per_step = chunk >= s_elems ? 1 : (s_elems + chunk - 1) / chunk;
        for (const CountedRun& r : runs) {
          EXPECT_EQ(op_count(r, "param all_gather"), per_step * steps) << w;
          // Each all-gather moves at most the bucket (a 16-element bucket at 3 ranks: 5 each).
          EXPECT_LE(r.max_param_gather_elems,
                    static_cast<size_t>(std::max<int64_t>(bucket, ws))) << w;
          // The staging buffer, in comm, while the chunks are gathered.
          if (per_step > 1) {
            EXPECT_GE(r.peak_comm_bytes, static_cast<size_t>(ws * chunk * 4)) << w;
          }
        }
      }
    }
  }
}

TEST(EngineZeroTest, StagesAgreeAtFourRanks) {
  std::vector<double> ref;
  for (int stage = 0; stage <= 2; ++stage) {
    const std::vector<RankRun> runs = run_ranks(zero_config(4, stage), 20);
    for (const RankRun& r : runs) EXPECT_TRUE(bitwise_equal(r.params, runs[0].params));
    const std::vector<double> losses = global_losses(runs);
    if (stage == 0) {
      ref = losses;
    } else {
      expect_close(losses, ref, 1e-6, "stage " + std::to_string(stage));
    }
  }
}

TEST(EngineZeroTest, StageZeroMatchesOneRankAtTheSameGlobalBatch) {
  const std::vector<double> dp = global_losses(run_ranks(zero_config(2, 0), 10));
  config::Config one = zero_config(1, 0, 2);  // 2 micro-batches = the two ranks' one each
  auto device = cpu_device();
  auto e = gpt_engine(*device, one);
  const io::DataSource data(one.porter.data, one.porter.model.vocab, 2, one.porter.model.seq_len);
  std::vector<double> single;
  for (int s = 0; s < 10; ++s) single.push_back(e->train_step(data.step_batches(s, 2)).loss);
  expect_close(dp, single, 1e-6, "stage 0 at 2 ranks vs 1 rank");
}

TEST(EngineZeroTest, GradientAccumulationAgreesAcrossStages) {
  std::vector<double> ref;
  for (int stage = 0; stage <= 2; ++stage) {
    config::Config c = zero_config(2, stage, 2);
    c.zero_optimization.overlap_comm = stage != 1;  // both orders of issue
    const std::vector<double> losses = global_losses(run_ranks(c, 8));
    if (stage == 0) {
      ref = losses;
    } else {
      expect_close(losses, ref, 1e-6, "gas 2 stage " + std::to_string(stage));
    }
  }
}

TEST(EngineZeroTest, ClippingMatchesAcrossStages) {
  std::vector<double> ref;
  for (int stage = 0; stage <= 2; ++stage) {
    config::Config c = zero_config(2, stage);
    c.gradient_clipping = 0.05;
    const std::vector<RankRun> runs = run_ranks(c, 8);
    EXPECT_LT(runs[0].steps[0].clip_coef, 1.0);  // active
    EXPECT_EQ(runs[0].steps[0].grad_norm, runs[1].steps[0].grad_norm);
    const std::vector<double> losses = global_losses(runs);
    if (stage == 0) {
      ref = losses;
    } else {
      expect_close(losses, ref, 1e-6, "clipped stage " + std::to_string(stage));
    }
  }
}

TEST(EngineZeroTest, CheckpointingAndOffloadLeaveZero2Unchanged) {
  const config::Config plain = zero_config(2, 2);
  config::Config ckpt = plain;
  ckpt.porter.checkpointing.policy = config::CheckpointPolicy::kUniform;
  config::ActivationCheckpointingConfig ac;
  ac.cpu_checkpointing = true;
  ckpt.activation_checkpointing = ac;
  const std::vector<RankRun> a = run_ranks(plain, 6);
  const std::vector<RankRun> b = run_ranks(ckpt, 6);
  for (size_t r = 0; r < 2; ++r) {
    for (size_t s = 0; s < 6; ++s) EXPECT_EQ(a[r].steps[s].loss, b[r].steps[s].loss) << s;
    EXPECT_TRUE(bitwise_equal(a[r].params, b[r].params));
    EXPECT_GT(b[r].steps[0].offload.d2h_bytes, 0u);
  }
}

// Note [Gradient buckets in the footprint]: with the reducer's buckets in the replay, the
// predicted total peak is the measured one to the byte, and so is the comm category's peak, at
// every stage, with reductions overlapped or after backward, buckets of many stages or one,
// reduce-scatter or all-reduce, and several micro-batches.
TEST(EngineZeroTest, PredictedTotalAndCommPeaksEqualTheMeasuredOnes) {
  struct Case {
    int ranks, stage;
    bool overlap, reduce_scatter;
    int64_t bucket, accumulation;
  };
  for (const Case& k : {Case{2, 0, true, true, 5000, 1}, Case{2, 1, true, true, 5000, 2},
                        Case{2, 1, false, false, 5000, 1}, Case{2, 2, true, true, 5000, 1},
                        Case{2, 2, false, true, 5000, 2}, Case{2, 2, true, true, 500'000'000, 1},
                        Case{1, 2, true, true, 5000, 1}, Case{2, 3, true, true, 5000, 2},
                        Case{4, 2, true, true, 3000, 1}, Case{2, 2, true, true, 5000, -2},
                        Case{2, 1, true, true, 5000, -1}, Case{2, 3, true, true, 5000, -1}}) {
    // A negative accumulation: |k.accumulation| micro-batches with bf16 gradients (Note
    // [Gradient dtype]), whose buckets and shard are half the bytes.
    config::Config c = zero_config(k.ranks, k.stage, std::abs(k.accumulation));
    if (k.accumulation < 0) {
      c.bf16.enabled = true;
      c.data_types.grad_accum_dtype = config::GradDType::kBf16;
    }
    c.zero_optimization.overlap_comm = k.overlap;
    c.zero_optimization.reduce_scatter = k.reduce_scatter;
    c.zero_optimization.reduce_bucket_size_elems = k.bucket;
    const std::string what = std::to_string(k.ranks) + " ranks, stage " + std::to_string(k.stage) +
                             (k.overlap ? ", overlap" : "") + (k.reduce_scatter ? "" : ", all-reduce") +
                             ", bucket " + std::to_string(k.bucket) + ", " +
                             std::to_string(k.accumulation) + " micro-batches";
    const zero::Partition part =
        zero::make_partition(TransformerModel(c.porter.model).layout().total_elems(), k.ranks);
    for (const RankRun& r : run_ranks(c, 2)) {
      EXPECT_EQ(r.memory.predicted_peak_bytes, r.memory.peak_bytes) << what;
      EXPECT_EQ(r.predicted_comm_bytes,
                r.memory.peak_by_category[memory::index_of(memory::Category::kComm)])
          << what;
      const size_t g = k.accumulation < 0 ? 2 : 4;
      const auto elems = static_cast<size_t>(k.stage >= 2 ? part.shard_elems : part.padded_elems);
      EXPECT_EQ(r.memory.peak_by_category[memory::index_of(memory::Category::kGrads)], g * elems)
          << what;
    }
  }
}

// Note [Gradient dtype]: with bf16 gradients each rank's backward accumulates its gradients in
// bf16, the reduce-scatter sums the two ranks' in bf16 and the post-scale halves the sum in
// bf16: the shard each rank ends with is round(round(g0 + g1) * 0.5) of the two ranks' local
// bf16 gradients, which a one-rank run of each rank's micro-batch gives (stage 0 on one rank
// neither reduces nor scales).
TEST(EngineZeroTest, Bf16GradientsAreTheBf16ReductionOfEachRanksBf16Gradients) {
  for (int stage : {1, 2}) {
    config::Config c = zero_config(2, stage);
    c.bf16.enabled = true;
    c.data_types.grad_accum_dtype = config::GradDType::kBf16;
    const io::DataSource data(c.porter.data, c.porter.model.vocab, c.train_micro_batch_size_per_gpu,
                              c.porter.model.seq_len);
    std::vector<std::vector<float>> reduced(2), local(2);
    for_each_dp_rank(c, [&](int rank, memory::Device& device, std::shared_ptr<comm::Communicator> dp) {
      Engine e(device, std::make_unique<TransformerModel>(c.porter.model), c, data_parallel(dp));
      e.train_step(data.rank_batches(0, 1, rank, 2));
      reduced[static_cast<size_t>(rank)] = e.grads_host();
    });
    config::Config one = c;
    one.world_size = 1;
    one.train_batch_size = c.train_micro_batch_size_per_gpu;
    one.zero_optimization.stage = 0;
    for (int rank = 0; rank < 2; ++rank) {
      auto device = cpu_device();
      Engine e(*device, std::make_unique<TransformerModel>(one.porter.model), one);
      e.train_step(data.rank_batches(0, 1, rank, 2));
      local[static_cast<size_t>(rank)] = e.grads_host();
    }
    const zero::Partition part = zero::make_partition(static_cast<int64_t>(local[0].size()), 2);
    size_t differ = 0, nonzero = 0;
    for (int rank = 0; rank < 2; ++rank) {
      for (int64_t i = part.begin(rank); i < std::min<int64_t>(part.end(rank), static_cast<int64_t>(local[0].size())); ++i) {
        const auto u = static_cast<size_t>(i);
        const float sum = tensor::bf16_to_f32(tensor::f32_to_bf16(local[0][u] + local[1][u]));
        const float want = tensor::bf16_to_f32(tensor::f32_to_bf16(sum * 0.5f));
        differ += std::memcmp(&want, &reduced[static_cast<size_t>(rank)][u], 4) != 0 ? 1 : 0;
        nonzero += want != 0.0f ? 1 : 0;
      }
    }
    EXPECT_EQ(differ, 0u) << "stage " << stage;
    EXPECT_GT(nonzero, local[0].size() / 2) << "stage " << stage;
  }
}

TEST(EngineZeroTest, ModelStateBytesEqualTheShardFormulas) {
  for (bool bf16 : {false, true}) {
    for (int stage = 0; stage <= 2; ++stage) {
      config::Config c = zero_config(2, stage);
      c.bf16.enabled = bf16;
      const std::vector<RankRun> runs = run_ranks(c, 2);
      const models::Transformer model(c.porter.model);
      const zero::Partition part = zero::make_partition(model.layout().total_elems(), 2);
      zero::StateDTypes dt;
      dt.param = bf16 ? tensor::DType::kBF16 : tensor::DType::kF32;
      const zero::StateBytes want = zero::exact_bytes(part, stage, dt);
      const std::string what =
          std::string(bf16 ? "bf16" : "f32") + " stage " + std::to_string(stage);
      for (const RankRun& r : runs) {
        for (const auto* bytes : {&r.bytes_after_init, &r.bytes_after_step}) {
          EXPECT_EQ((*bytes)[memory::index_of(memory::Category::kParams)], want.params) << what;
          EXPECT_EQ((*bytes)[memory::index_of(memory::Category::kGrads)], want.grads) << what;
          EXPECT_EQ((*bytes)[memory::index_of(memory::Category::kOptimizer)], want.optimizer)
              << what;
          EXPECT_EQ((*bytes)[memory::index_of(memory::Category::kComm)], 0u) << what;
        }
        EXPECT_TRUE(std::isfinite(r.steps.back().loss)) << what;
      }
      EXPECT_EQ(runs[0].steps[0].zero.shard_elems, part.shard_elems);
    }
  }
}

TEST(EngineZeroTest, Bf16RunsAtStageTwo) {
  config::Config c = zero_config(2, 2);
  c.bf16.enabled = true;
  const std::vector<double> two = global_losses(run_ranks(c, 10));
  c.zero_optimization.stage = 0;
  const std::vector<double> zero = global_losses(run_ranks(c, 10));
  EXPECT_TRUE(std::isfinite(two.back()));
  expect_close(two, zero, 1e-6, "bf16 stage 2 vs stage 0");
}

TEST(EngineZeroTest, RefusesAWrongWorldSizeAndParameterOffloadBelowStage3) {
  auto device = cpu_device();
  config::Config c = zero_config(2, 1);  // world_size 2 without a communicator
  const std::string ws = error_of<InvalidArgument>([&] { gpt_engine(*device, c); });
  EXPECT_NE(ws.find("world_size 2"), std::string::npos) << ws;
  // Parameter offload below stage 3 is the parser's rule (Note [Run options]): a Config built
  // in code that breaks it is asserted against.
  c = zero_config(1, 2);
  c.zero_optimization.offload_param.device = config::OffloadDevice::kCpu;
  const std::string off = error_of<InternalError>([&] { gpt_engine(*device, c); });
  EXPECT_NE(off.find("parameter offload below ZeRO stage 3"), std::string::npos) << off;
}

TEST(EngineZeroTest, OneRankStageTwoEqualsStageZero) {
  // dp null: stage 2 still moves each bucket into the (whole-buffer) shard.
  std::vector<double> ref;
  for (int stage : {0, 2}) {
    const config::Config c = zero_config(1, stage, 2);
    auto device = cpu_device();
    auto e = gpt_engine(*device, c);
    std::vector<double> losses;
    for (int s = 0; s < 5; ++s) losses.push_back(e->train_step(batches(c, s)).loss);
    if (stage == 0) {
      ref = losses;
    } else {
      expect_close(losses, ref, 1e-6, "one rank stage 2");
    }
  }
}


TEST(EngineZeroTest, ARankThatThrowsMidStepFailsThePeersWithinTheTimeout) {
  config::Config c = zero_config(2, 2);
  c.porter.comm.timeout_s = 2.0;
  c.zero_optimization.reduce_bucket_size_elems = 1000;  // the head's bucket is issued first
  auto errors = comm::run_thread_ranks(2, [&](int rank, std::shared_ptr<comm::Store> store) {
    auto device = cpu_device();
    comm::CommOptions o;
    o.timeout = comm::Seconds{c.porter.comm.timeout_s};
    std::shared_ptr<comm::Communicator> dp = comm::make_communicator(*device, store, rank, 2, o);
    int step = 0;
    auto armed = [&step, rank] { return rank == 1 && step == 2; };
    Engine e(*device, std::make_unique<BombModel>(c.porter.model, 1, armed), c, data_parallel(dp));
    const io::DataSource data(c.porter.data, c.porter.model.vocab, 2, c.porter.model.seq_len);
    for (step = 0; step < 4; ++step) e.train_step(data.rank_batches(step, 1, rank, 2));
  });
  ASSERT_TRUE(errors[0] != nullptr);
  ASSERT_TRUE(errors[1] != nullptr);
  try {
    std::rethrow_exception(errors[1]);
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("bomb"), std::string::npos) << e.what();
  }
  try {
    std::rethrow_exception(errors[0]);
  } catch (const std::exception& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("rank"), std::string::npos) << m;
    EXPECT_TRUE(dynamic_cast<const PeerError*>(&e) != nullptr ||
                dynamic_cast<const TimeoutError*>(&e) != nullptr)
        << m;
  }
}

TEST(EngineZeroTest, Fp16OverflowOnOneRankSkipsTheStepOnAll) {
  config::Config c = zero_config(2, 2);
  c.fp16.enabled = true;
  c.fp16.loss_scale = 0.0;
  c.fp16.initial_scale_power = 8;
  c.fp16.hysteresis = 1;
  std::vector<RankRun> runs(2);
  auto errors = comm::run_thread_ranks(2, [&](int rank, std::shared_ptr<comm::Store> store) {
    auto device = cpu_device();
    comm::CommOptions o;
    o.timeout = comm::Seconds{c.porter.comm.timeout_s};
    std::shared_ptr<comm::Communicator> dp = comm::make_communicator(*device, store, rank, 2, o);
    int step = 0;
    auto armed = [&step, rank] { return rank == 1 && step == 3; };
    Engine e(*device, std::make_unique<BombModel>(c.porter.model, 2, armed, Bomb::kInfinities), c,
             data_parallel(dp));
    const io::DataSource data(c.porter.data, c.porter.model.vocab, 2, c.porter.model.seq_len);
    std::vector<float> before;
    for (step = 0; step < 6; ++step) {
      if (step == 3) before = e.params_host();
      runs[static_cast<size_t>(rank)].steps.push_back(
          e.train_step(data.rank_batches(step, 1, rank, 2)));
      if (step == 3) {
        EXPECT_TRUE(bitwise_equal(e.params_host(), before)) << "rank " << rank;
      }
    }
    runs[static_cast<size_t>(rank)].params = e.params_host();
    runs[static_cast<size_t>(rank)].total = e.zero_stats();
  });
  for (auto& err : errors) {
    if (err) std::rethrow_exception(err);
  }
  for (const RankRun& r : runs) {
    for (size_t s = 0; s < r.steps.size(); ++s) {
      EXPECT_EQ(r.steps[s].skipped, s == 3) << s;
      EXPECT_TRUE(std::isfinite(r.steps[s].loss)) << s;
    }
    EXPECT_EQ(r.steps[2].zero.loss_scale, 256.0);
    EXPECT_EQ(r.steps[3].zero.loss_scale, 128.0);
    EXPECT_EQ(r.total.skipped_steps, 1);
  }
  EXPECT_TRUE(bitwise_equal(runs[0].params, runs[1].params));
  EXPECT_NE(runs[0].steps[5].loss, runs[0].steps[4].loss);
}

TEST(EngineZeroTest, CheckpointSaveAndResumeAtTwoRanks) {
  const config::Config c = zero_config(2, 2);
  const auto dir = std::filesystem::temp_directory_path() /
                   ("porter_zero_ckpt_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::vector<std::vector<double>> straight(2), resumed(2);
  for (int phase = 0; phase < 3; ++phase) {
    auto errors = comm::run_thread_ranks(2, [&](int rank, std::shared_ptr<comm::Store> store) {
      auto device = cpu_device();
      comm::CommOptions o;
      o.timeout = comm::Seconds{c.porter.comm.timeout_s};
      std::shared_ptr<comm::Communicator> dp = comm::make_communicator(*device, store, rank, 2, o);
      Engine e(*device, std::make_unique<TransformerModel>(c.porter.model), c, data_parallel(dp));
      const io::DataSource data(c.porter.data, c.porter.model.vocab, 2, c.porter.model.seq_len);
      // phase 0: 6 straight steps; 1: 3 steps then save; 2: load, 3 more steps.
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
    });
    for (auto& err : errors) {
      if (err) std::rethrow_exception(err);
    }
  }
  EXPECT_TRUE(std::filesystem::exists(dir / "rank0"));
  EXPECT_TRUE(std::filesystem::exists(dir / "rank1"));
  for (size_t r = 0; r < 2; ++r) {
    ASSERT_EQ(resumed[r].size(), 3u);
    for (size_t s = 0; s < 3; ++s) EXPECT_EQ(resumed[r][s], straight[r][s + 3]) << r << " " << s;
  }
  // A one-rank engine refuses the two-rank checkpoint.
  auto device = cpu_device();
  auto one = gpt_engine(*device, zero_config(1, 2));
  const std::string msg = error_of<InvalidArgument>([&] { one->load_checkpoint(dir / "rank0"); });
  EXPECT_NE(msg.find("2 data-parallel ranks"), std::string::npos) << msg;
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace porter::engine
