// The analytic GPT model at tensor_parallel t > 1 against the allocator: on t thread ranks of
// one Gloo group, every rank measures every stage under every save option (its forward,
// recompute and backward, the Ctx given the group) and each figure equals the analytic one
// to the byte, on every rank, with and without sequence parallelism, tied and untied, f32 and
// bf16. Also whole steps against the simulator, and Korthikanti et al.'s formula.
#include <algorithm>
#include <array>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "models/analytic.h"

#include "base/error.h"
#include "checkpoint/planner.h"
#include "checkpoint/schedule.h"
#include "checkpoint/simulate.h"
#include "comm/communicator.h"
#include "memory/caching_allocator.h"
#include "memory/device.h"
#include "models/factory.h"
#include "kernels/kernels.h"

namespace porter::checkpoint {
namespace {

using tensor::DType;
using nn::OpKind;
using nn::OpPolicy;
using nn::SaveMode;
using tensor::Tensor;

constexpr int64_t kBatch = 2, kSeq = 12;

// layers 2, hidden 32, heads 4, seq 12, vocab 50: at t = 4 the vocabulary shards are 13 rows,
// the last with 11 real ones.
config::ModelConfig tp_model(int64_t t, bool sp, bool tied, int64_t seq_len = kSeq) {
  config::ModelConfig m;
  m.layers = 2;
  m.hidden = 32;
  m.heads = 4;
  m.seq_len = seq_len;
  m.vocab = 50;
  m.dropout = 0.1;
  m.tie_embeddings = tied;
  m.tensor_parallel = t;
  m.sequence_parallel = sp;
  return m;
}

struct Env {
  std::unique_ptr<memory::Device> device;
  std::unique_ptr<memory::CachingAllocator> alloc;
  std::unique_ptr<kernels::Kernels> kernels;
  Env() {
    memory::DeviceOptions o;
    o.memory_limit_bytes = size_t{256} << 20;
    o.threads = 1;
    device = memory::make_device(o);
    alloc = std::make_unique<memory::CachingAllocator>(*device);
    kernels = kernels::make_kernels(*alloc);
  }
  Tensor ids(int64_t b, int64_t t, int64_t vocab, int salt) {
    std::vector<int32_t> v(static_cast<size_t>(b * t));
    for (size_t i = 0; i < v.size(); ++i) {
      v[i] = static_cast<int32_t>((i * 7 + static_cast<size_t>(salt) * 13 + i * i) % vocab);
    }
    Tensor x = Tensor::empty(*alloc, tensor::Shape{b, t}, DType::kI32, memory::Category::kWorkspace);
    device->copy_sync(x.data(), v.data(), x.nbytes());
    return x;
  }
  size_t act() const { return alloc->stats().activation_bytes; }
  size_t peak_act() const { return alloc->stats().peak_activation_bytes; }
  size_t req() const { return alloc->stats().requested_bytes; }
  size_t peak_req() const { return alloc->stats().peak_requested_bytes; }
};

// One rank's part of the model, bound to initial values, with a Ctx on the group.
struct RankModel {
  Env env;
  models::Transformer gpt;
  nn::FlatParams flat;
  nn::Ctx ctx;
  RankModel(const config::ModelConfig& mc, DType dtype, int rank, comm::Communicator* tp)
      : gpt(mc, rank),
        flat(*env.alloc, gpt.layout(), dtype, DType::kF32),
        ctx(*env.kernels, *env.alloc, dtype) {
    Tensor p = flat.params();
    tensor::from_host_f32(*env.device, gpt.init_values(5), p);
    Tensor g = flat.grads();
    env.kernels->fill(g, 0.0f);
    gpt.bind(flat);
    ctx.set_tensor_parallel(tp);
    // Under sequence parallelism a block takes the micro-batch's (B, T) from here.
    ctx.set_run({11, 2, 0, kBatch, mc.seq_len});
  }
};

// What one rank measured of one stage: every option of the chain's costs (unavailable options
// are not run), and the all-category peak of the backward after each.
struct StageMeasured {
  size_t input_bytes = 0, output_bytes = 0;
  std::array<OptionCost, kNumSaveOptions> options{};
  std::array<size_t, kNumSaveOptions> backward_total_peak{};
};

// Stage s under `option` (forward, recompute, backward), as tests/checkpoint/analytic_test.cc
// measures it; dy has the stage output's shape (none for the head).
void measure_option(RankModel& m, int s, const Tensor& x, const Tensor& out_like,
                    SaveOption option, const OpPolicy& selective, StageMeasured& into) {
  Env& env = m.env;
  OptionCost& c = into.options[static_cast<size_t>(option)];
  c.available = true;
  const SaveMode mode = option == SaveOption::kKeep ? SaveMode::kSaveAll : SaveMode::kCheckpoint;
  const OpPolicy policy = option == SaveOption::kSelective ? selective : OpPolicy::keep_none();
  nn::Tape tape;
  size_t base = env.act(), base_req = env.req();
  env.alloc->reset_peak();
  Tensor y = nn::forward_stage(m.ctx, m.gpt.stage(s), s, tape, mode, x, policy);
  c.forward_peak_bytes = env.peak_act() - base;
  c.forward_total_peak_bytes = env.peak_req() - base_req;
  c.saved_bytes = env.act() - base - y.nbytes();
  y = Tensor();
  if (option != SaveOption::kKeep) {
    base = env.act();
    base_req = env.req();
    env.alloc->reset_peak();
    nn::recompute_stage(m.ctx, m.gpt.stage(s), s, tape, x);
    c.recompute_peak_bytes = env.peak_act() - base;
    c.recompute_total_peak_bytes = env.peak_req() - base_req;
    c.recompute_saved_bytes = env.act() - base;
  }
  Tensor dy;
  if (out_like.defined()) {
    dy = Tensor::empty(*env.alloc, out_like.shape(), out_like.dtype(),
                       memory::Category::kWorkspace);
    env.kernels->fill(dy, 0.01f);
  }
  base_req = env.req();
  env.alloc->reset_peak();
  nn::backward_stage(m.ctx, m.gpt.stage(s), s, tape, dy);
  into.backward_total_peak[static_cast<size_t>(option)] = env.peak_req() - base_req;
}

// Every stage and available option of `analytic` on rank `rank`. Every rank runs the same
// sequence of stages and options, so their collectives pair up.
std::vector<StageMeasured> measure_rank(const config::ModelConfig& mc, DType dtype, int rank,
                                        comm::Communicator* tp, const ChainCosts& analytic,
                                        const OpPolicy& selective) {
  RankModel m(mc, dtype, rank, tp);
  Tensor tokens = m.env.ids(kBatch, mc.seq_len, mc.vocab, 0);
  m.gpt.head().set_targets(m.env.ids(kBatch, mc.seq_len, mc.vocab, 1));
  // Real stage inputs from one keep-everything forward (their tapes dropped).
  std::vector<Tensor> inputs{tokens};
  for (int s = 0; s + 1 < m.gpt.num_stages(); ++s) {
    nn::Tape t;
    inputs.push_back(
        nn::forward_stage(m.ctx, m.gpt.stage(s), s, t, SaveMode::kSaveAll, inputs.back()));
  }
  std::vector<StageMeasured> out(static_cast<size_t>(m.gpt.num_stages()));
  for (int s = 0; s < m.gpt.num_stages(); ++s) {
    StageMeasured& st = out[static_cast<size_t>(s)];
    const bool last = s + 1 == m.gpt.num_stages();
    st.input_bytes = s == 0 ? 0 : inputs[static_cast<size_t>(s)].nbytes();
    st.output_bytes = last ? 4 : inputs[static_cast<size_t>(s) + 1].nbytes();
    const Tensor out_like = last ? Tensor() : inputs[static_cast<size_t>(s) + 1];
    for (int o = 0; o < kNumSaveOptions; ++o) {
      const auto option = static_cast<SaveOption>(o);
      if (!analytic.stages[static_cast<size_t>(s)].option(option).available) continue;
      measure_option(m, s, inputs[static_cast<size_t>(s)], out_like, option, selective, st);
    }
  }
  return out;
}

// fn(rank, communicator) on t thread ranks of one Gloo group; rethrows the first failure.
template <typename Fn>
void run_group(int t, Fn fn) {
  auto errors = comm::run_thread_ranks(t, [&](int rank, std::shared_ptr<comm::Store> store) {
    auto device = memory::make_device(memory::DeviceOptions{});
    comm::CommOptions o;
    o.group_name = "tp";
    o.timeout = comm::Seconds{60};
    auto comm = comm::make_communicator(*device, store, rank, t, o);
    fn(rank, comm.get());
  });
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

struct TpCase {
  int t;
  bool sp;
  bool tied;
  DType dtype;
  int64_t seq = kSeq;  // > 64: the cpu attention backward works in two row blocks
};

std::string case_name(const TpCase& c) {
  return "t" + std::to_string(c.t) + (c.sp ? "_sp" : "") + (c.tied ? "_tied" : "_untied") +
         "_" + std::string(tensor::dtype_name(c.dtype)) +
         (c.seq != kSeq ? "_seq" + std::to_string(c.seq) : "");
}

// Every t in {2, 4}, sp off and on, tied and untied, f32 and bf16; and two at T = 70.
std::vector<TpCase> all_cases() {
  std::vector<TpCase> v;
  for (int t : {2, 4})
    for (bool sp : {false, true})
      for (bool tied : {true, false})
        for (DType dt : {DType::kF32, DType::kBF16}) v.push_back({t, sp, tied, dt});
  v.push_back({2, true, true, DType::kF32, 70});
  v.push_back({4, false, false, DType::kBF16, 70});
  return v;
}

void expect_option_eq(const OptionCost& a, const OptionCost& m) {
  EXPECT_EQ(a.forward_peak_bytes, m.forward_peak_bytes);
  EXPECT_EQ(a.forward_total_peak_bytes, m.forward_total_peak_bytes);
  EXPECT_EQ(a.saved_bytes, m.saved_bytes);
  EXPECT_EQ(a.recompute_peak_bytes, m.recompute_peak_bytes);
  EXPECT_EQ(a.recompute_total_peak_bytes, m.recompute_total_peak_bytes);
  EXPECT_EQ(a.recompute_saved_bytes, m.recompute_saved_bytes);
}

class AnalyticTpVsMeasured : public ::testing::TestWithParam<TpCase> {};

TEST_P(AnalyticTpVsMeasured, EveryStageAndOptionOnEveryRankToTheByte) {
  const TpCase k = GetParam();
  const config::ModelConfig mc = tp_model(k.t, k.sp, k.tied, k.seq);
  const OpPolicy policies[] = {OpPolicy::selective_attention(),
                               OpPolicy::keep_only({OpKind::kMatmul}),
                               OpPolicy::recompute_only({OpKind::kDropout, OpKind::kGelu})};
  for (const OpPolicy& sel : policies) {
    SCOPED_TRACE("selective " + sel.to_string());
    const ChainCosts costs = models::analytic_transformer_costs({mc, kBatch, k.seq, k.dtype}, sel);
    ASSERT_EQ(costs.num_stages(), 4);
    std::vector<std::vector<StageMeasured>> ranks(static_cast<size_t>(k.t));
    run_group(k.t, [&](int rank, comm::Communicator* tp) {
      ranks[static_cast<size_t>(rank)] = measure_rank(mc, k.dtype, rank, tp, costs, sel);
    });
    for (int r = 0; r < k.t; ++r) {
      for (int s = 0; s < costs.num_stages(); ++s) {
        const StageCost& a = costs.stages[static_cast<size_t>(s)];
        const StageMeasured& m = ranks[static_cast<size_t>(r)][static_cast<size_t>(s)];
        SCOPED_TRACE("rank " + std::to_string(r) + ", stage " + a.name);
        EXPECT_EQ(a.input_bytes, m.input_bytes);
        EXPECT_EQ(a.output_bytes, m.output_bytes);
        for (int o = 0; o < kNumSaveOptions; ++o) {
          const auto option = static_cast<SaveOption>(o);
          if (!a.option(option).available) continue;
          SCOPED_TRACE(std::string("option ") + std::string(save_option_name(option)));
          expect_option_eq(a.option(option), m.options[static_cast<size_t>(o)]);
          // Every rank measures the same (the figures are per rank, and the same on each).
          expect_option_eq(ranks[0][static_cast<size_t>(s)].options[static_cast<size_t>(o)],
                           m.options[static_cast<size_t>(o)]);
          EXPECT_EQ(a.backward_total_peak_bytes, m.backward_total_peak[static_cast<size_t>(o)]);
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Groups, AnalyticTpVsMeasured, ::testing::ValuesIn(all_cases()),
                         [](const auto& p) { return case_name(p.param); });

// Transformer::forward_backward on every rank under none, full and selective peaks at exactly the
// simulated figure of the per-rank costs, and the none peak's closed form agrees.
TEST(AnalyticTpTest, SimulatedPeaksEqualAMeasuredStepOnEveryRank) {
  for (const TpCase k : {TpCase{2, false, true, DType::kF32}, TpCase{4, true, false, DType::kBF16},
                         TpCase{4, false, true, DType::kF32}, TpCase{2, true, true, DType::kF32}}) {
    SCOPED_TRACE(case_name(k));
    const config::ModelConfig mc = tp_model(k.t, k.sp, k.tied);
    const models::TransformerShape shape{mc, kBatch, kSeq, k.dtype};
    const ChainCosts costs = models::analytic_transformer_costs(shape);
    EXPECT_EQ(models::none_peak_bytes(shape),
              simulate(schedule_none(costs), costs).peak_activation_bytes);
    const int n = costs.num_stages();
    const std::vector<models::StagePlan> none(static_cast<size_t>(n));
    const std::vector<models::StagePlan> full(static_cast<size_t>(n),
                                          {SaveMode::kCheckpoint, OpPolicy::keep_none()});
    std::vector<models::StagePlan> sel(static_cast<size_t>(n));
    for (int s = 1; s + 1 < n; ++s) {
      sel[static_cast<size_t>(s)] = {SaveMode::kCheckpoint, OpPolicy::selective_attention()};
    }
    const std::pair<const std::vector<models::StagePlan>*, Schedule> cases[] = {
        {&none, schedule_none(costs)},
        {&full, schedule_full(costs)},
        {&sel, schedule_selective(costs)}};
    std::vector<std::vector<size_t>> peaks(static_cast<size_t>(k.t));
    run_group(k.t, [&](int rank, comm::Communicator* tp) {
      RankModel m(mc, k.dtype, rank, tp);
      for (const auto& [plans, schedule] : cases) {
        const size_t base = m.env.act();
        m.env.alloc->reset_peak();
        m.gpt.forward_backward(m.ctx, m.env.ids(kBatch, kSeq, mc.vocab, 0),
                               m.env.ids(kBatch, kSeq, mc.vocab, 1), *plans);
        peaks[static_cast<size_t>(rank)].push_back(m.env.peak_act() - base);
      }
    });
    for (int r = 0; r < k.t; ++r) {
      for (size_t i = 0; i < std::size(cases); ++i) {
        EXPECT_EQ(peaks[static_cast<size_t>(r)][i],
                  simulate(cases[i].second, costs).peak_activation_bytes)
            << cases[i].second.to_string() << " on rank " << r;
      }
    }
  }
}

// One rank's shapes, in the notation of docs/memory-model.md: A = N·C·d, the residual
// stream r (A, or A/t under sequence parallelism), u = A/t, P/t of the probabilities.
TEST(AnalyticTpTest, PerRankShapesAndFlops) {
  const double N = kBatch * kSeq, C = 32, T = kSeq, V = 50;
  const size_t a = kBatch * kSeq * 32 * 4, p = kBatch * 4 * kSeq * kSeq * 4;
  const ChainCosts one = models::analytic_transformer_costs({tp_model(1, false, true), kBatch, kSeq, DType::kF32});
  for (int t : {2, 4}) {
    for (bool sp : {false, true}) {
      SCOPED_TRACE("t " + std::to_string(t) + (sp ? " sp" : ""));
      const models::TransformerShape shape{tp_model(t, sp, true), kBatch, kSeq, DType::kF32};
      const ChainCosts c = models::analytic_transformer_costs(shape);
      const size_t r = sp ? a / t : a, u = a / t, rows = sp ? N / t : N;
      const StageCost& blk = c.stages[1];
      EXPECT_EQ(blk.input_bytes, r);
      EXPECT_EQ(c.stages[0].output_bytes, r);
      // x, ln1, x2, ln2 are the residual stream's; qkv 3u, att u, h 4u, g 4u are this rank's
      // channels; 4 f32 layernorm statistics per row; this rank's heads' probabilities.
      EXPECT_EQ(blk.option(SaveOption::kKeep).saved_bytes, 3 * r + 12 * u + 16 * rows + p / t);
      EXPECT_EQ(models::layer_bytes(shape), 4 * r + 12 * u + 16 * rows + p / t);
      EXPECT_DOUBLE_EQ(blk.forward_flops, one.stages[1].forward_flops / t);
      EXPECT_DOUBLE_EQ(blk.forward_flops, (24 * N * C * C + 4 * N * T * C) / t);
      const double vs = std::ceil(V / t);
      EXPECT_DOUBLE_EQ(c.stages.back().forward_flops, 2 * N * C * vs);
      // The head keeps lnf and its statistics, the (N, Vs) logits and the (N) f32 log-sum-exp.
      EXPECT_EQ(c.stages.back().option(SaveOption::kKeep).saved_bytes,
                r + 8 * rows + static_cast<size_t>(N * vs) * 4 + static_cast<size_t>(N) * 4);
      // A checkpointed head recomputes the loss too: backward reads its log-sum-exp.
      EXPECT_EQ(c.stages.back().option(SaveOption::kCheckpoint).recompute_saved_bytes,
                c.stages.back().option(SaveOption::kKeep).saved_bytes);
      // Backward workspace (docs/memory-model.md, "Tensor and sequence parallelism"), with
      // the cpu f32 attention backward's dS block W_b.
      const size_t wb = kBatch * (4 / t) * kSeq * kSeq * 4;
      const size_t logits = static_cast<size_t>(N * vs) * 4;
      if (sp) {
        EXPECT_EQ(blk.backward_total_peak_bytes, 16 * 32 + 6 * u + std::max(2 * a, wb));
        EXPECT_EQ(c.stages.back().backward_total_peak_bytes,
                  logits + std::max(2 * a + u, 2 * u + 8 * 32));
        EXPECT_EQ(c.stages[0].backward_total_peak_bytes, u + a);
      } else {
        EXPECT_EQ(blk.backward_total_peak_bytes,
                  std::max({4 * a, 3 * a + 3 * u, 2 * a + 4 * u + wb}));
        EXPECT_EQ(c.stages.back().backward_total_peak_bytes, logits + 2 * a);
        EXPECT_EQ(c.stages[0].backward_total_peak_bytes, a);
      }
    }
  }
}

TEST(AnalyticTpTest, KorthikantiFormula) {
  // s = 12, b = 2, h = 32, a = 4: sbh = 768, 5as/h = 7.5.
  EXPECT_DOUBLE_EQ(models::korthikanti_layer_bytes({tp_model(1, false, true), 2, 12}), 768 * 41.5);
  EXPECT_DOUBLE_EQ(models::korthikanti_layer_bytes({tp_model(1, true, true), 2, 12}), 768 * 41.5);
  EXPECT_DOUBLE_EQ(models::korthikanti_layer_bytes({tp_model(2, false, true), 2, 12}),
                   768 * (10 + 12 + 3.75));
  EXPECT_DOUBLE_EQ(models::korthikanti_layer_bytes({tp_model(4, false, true), 2, 12}),
                   768 * (10 + 6 + 1.875));
  EXPECT_DOUBLE_EQ(models::korthikanti_layer_bytes({tp_model(4, true, true), 2, 12}), 768 * 41.5 / 4);
  // porter's exact layer at t = 1 in bf16 (docs/memory-model.md): sbh(32 + 16/h + 4as/h).
  const size_t porter = models::layer_bytes({tp_model(1, false, true), 2, 12, DType::kBF16});
  EXPECT_DOUBLE_EQ(static_cast<double>(porter), 768 * (32 + 16.0 / 32 + 4 * 4 * 12 / 32.0));
}

TEST(AnalyticTpTest, ModelStatesAreTheRanksLayout) {
  for (int t : {1, 2, 4}) {
    const config::ModelConfig mc = tp_model(t, false, false);
    const size_t elems = static_cast<size_t>(models::Transformer(mc, 0).layout().total_elems());
    EXPECT_EQ(models::model_state_bytes(mc, DType::kBF16).params, 2 * elems);
    EXPECT_EQ(static_cast<size_t>(models::Transformer(mc, t - 1).layout().total_elems()), elems);
  }
}

TEST(AnalyticTpTest, RejectsShapesTheModelCannotSplit) {
  EXPECT_THROW(models::analytic_transformer_costs({tp_model(3, false, true), kBatch, kSeq}), InvalidArgument);
  // 2 x 11 = 22 token rows do not split over 4 sequence-parallel ranks.
  EXPECT_THROW(models::analytic_transformer_costs({tp_model(4, true, true), 2, 11}), InvalidArgument);
  EXPECT_NO_THROW(models::analytic_transformer_costs({tp_model(4, false, true), 2, 11}));
}

}  // namespace
}  // namespace porter::checkpoint
