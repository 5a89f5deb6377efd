// The analytic GPT model against the allocator: every stage's byte figures under every save
// option equal what nn::forward_stage / recompute_stage / backward_stage allocate, for f32
// and bf16, with and without dropout; the none peak's closed form; model-state bytes.
#include "models/analytic.h"

#include <cmath>

#include <gtest/gtest.h>

#include "checkpoint/planner.h"
#include "checkpoint/schedule.h"
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
    for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<int32_t>((i * 7 + salt * 13 + i * i) % vocab);
    Tensor x = Tensor::empty(*alloc, tensor::Shape{b, t}, DType::kI32, memory::Category::kWorkspace);
    device->copy_sync(x.data(), v.data(), x.nbytes());
    return x;
  }
  size_t act() const { return alloc->stats().activation_bytes; }
  size_t peak_act() const { return alloc->stats().peak_activation_bytes; }
  size_t req() const { return alloc->stats().requested_bytes; }
  size_t peak_req() const { return alloc->stats().peak_requested_bytes; }
};

// llama: the Llama, or with qwen2 Qwen2 (the Llama with q, k and v biases).
config::ModelConfig small_model(double dropout, int64_t vocab, int64_t seq_len = 12,
                                bool llama = false, bool qwen2 = false) {
  config::ModelConfig m;
  m.layers = 2;
  m.hidden = 32;
  m.heads = 4;
  m.seq_len = seq_len;
  m.vocab = vocab;
  m.dropout = dropout;
  if (llama) {  // grouped-query attention, an MLP width of its own
    m.type = qwen2 ? config::ModelType::kQwen2 : config::ModelType::kLlama;
    m.kv_heads = 2;
    m.intermediate = 88;
    m.tie_embeddings = false;
  }
  return m;
}

struct Measured {
  OptionCost cost;
  size_t backward_total_peak = 0;
};

// Runs stage `s` of `gpt` on input `x` under `option` and reads the allocator's figures.
Measured measure(Env& env, nn::Ctx& ctx, models::Transformer& gpt, int s, const Tensor& x, SaveOption option,
                 const OpPolicy& selective) {
  Measured m;
  OptionCost& c = m.cost;
  c.available = true;
  const SaveMode mode = option == SaveOption::kKeep ? SaveMode::kSaveAll : SaveMode::kCheckpoint;
  const OpPolicy policy = option == SaveOption::kSelective ? selective : OpPolicy::keep_none();
  nn::Tape tape;
  size_t base = env.act(), base_req = env.req();
  env.alloc->reset_peak();
  Tensor y = nn::forward_stage(ctx, gpt.stage(s), s, tape, mode, x, policy);
  c.forward_peak_bytes = env.peak_act() - base;
  c.forward_total_peak_bytes = env.peak_req() - base_req;
  c.saved_bytes = env.act() - base - y.nbytes();
  y = Tensor();
  if (option != SaveOption::kKeep) {
    base = env.act();
    base_req = env.req();
    env.alloc->reset_peak();
    nn::recompute_stage(ctx, gpt.stage(s), s, tape, x);
    c.recompute_peak_bytes = env.peak_act() - base;
    c.recompute_total_peak_bytes = env.peak_req() - base_req;
    c.recompute_saved_bytes = env.act() - base;
  }
  Tensor dy;
  if (s + 1 < gpt.num_stages()) dy = Tensor::empty(*env.alloc, x.shape(), x.dtype(), memory::Category::kWorkspace);
  if (s == 0) dy = Tensor::empty(*env.alloc, tensor::Shape{x.dim(0), x.dim(1), gpt.config().hidden}, ctx.compute_dtype(),
                                 memory::Category::kWorkspace);
  if (dy.defined()) env.kernels->fill(dy, 0.01f);
  base_req = env.req();
  env.alloc->reset_peak();
  nn::backward_stage(ctx, gpt.stage(s), s, tape, dy);
  m.backward_total_peak = env.peak_req() - base_req;
  return m;
}

struct Case {
  DType dtype;
  double dropout;
  int64_t vocab;
  int64_t seq = 12;  // > 64: the cpu attention backward works in two row blocks
  bool llama = false;
  bool qwen2 = false;  // with llama
};

class AnalyticVsMeasured : public ::testing::TestWithParam<Case> {};

TEST_P(AnalyticVsMeasured, EveryStageAndOptionToTheByte) {
  const Case k = GetParam();
  Env env;
  const config::ModelConfig mc = small_model(k.dropout, k.vocab, k.seq, k.llama, k.qwen2);
  models::Transformer gpt(mc);
  nn::FlatParams flat(*env.alloc, gpt.layout(), k.dtype, DType::kF32);
  Tensor p = flat.params();
  tensor::from_host_f32(*env.device, gpt.init_values(5), p);
  gpt.bind(flat);
  const int64_t B = 2, T = k.seq;
  Tensor tokens = env.ids(B, T, mc.vocab, 0);
  gpt.head().set_targets(env.ids(B, T, mc.vocab, 1));
  nn::Ctx ctx(*env.kernels, *env.alloc, k.dtype);
  ctx.set_run({11, 2, 0});

  // Real stage inputs from one keep-everything forward (their tapes dropped).
  std::vector<Tensor> inputs{tokens};
  for (int s = 0; s + 1 < gpt.num_stages(); ++s) {
    nn::Tape t;
    inputs.push_back(nn::forward_stage(ctx, gpt.stage(s), s, t, SaveMode::kSaveAll, inputs.back()));
  }

  const OpPolicy policies[] = {OpPolicy::selective_attention(), OpPolicy::keep_only({OpKind::kMatmul}),
                               OpPolicy::recompute_only({OpKind::kDropout, OpKind::kGelu})};
  for (const OpPolicy& sel : policies) {
    const ChainCosts costs = models::analytic_transformer_costs({mc, B, T, k.dtype}, sel);
    ASSERT_EQ(costs.num_stages(), gpt.num_stages());
    for (int s = 0; s < gpt.num_stages(); ++s) {
      const StageCost& st = costs.stages[s];
      SCOPED_TRACE("stage " + st.name + ", selective " + sel.to_string());
      EXPECT_EQ(st.name, gpt.stage_name(s));
      EXPECT_EQ(st.input_bytes, s == 0 ? 0 : inputs[s].nbytes());
      EXPECT_EQ(st.output_bytes, s + 1 < gpt.num_stages() ? inputs[s + 1].nbytes() : 4u);
      EXPECT_EQ(st.is_block, s > 0 && s + 1 < gpt.num_stages());
      for (int o = 0; o < kNumSaveOptions; ++o) {
        const auto option = static_cast<SaveOption>(o);
        const OptionCost& a = st.option(option);
        if (!a.available) {
          EXPECT_EQ(option, SaveOption::kSelective);
          continue;
        }
        SCOPED_TRACE(std::string("option ") + std::string(save_option_name(option)));
        const Measured m = measure(env, ctx, gpt, s, inputs[s], option, sel);
        EXPECT_EQ(a.forward_peak_bytes, m.cost.forward_peak_bytes);
        EXPECT_EQ(a.forward_total_peak_bytes, m.cost.forward_total_peak_bytes);
        EXPECT_EQ(a.saved_bytes, m.cost.saved_bytes);
        EXPECT_EQ(a.recompute_peak_bytes, m.cost.recompute_peak_bytes);
        EXPECT_EQ(a.recompute_total_peak_bytes, m.cost.recompute_total_peak_bytes);
        EXPECT_EQ(a.recompute_saved_bytes, m.cost.recompute_saved_bytes);
        EXPECT_EQ(st.backward_total_peak_bytes, m.backward_total_peak);
      }
    }
  }
}

// vocab 50 < 3 * hidden: the last block's forward is the none peak; vocab 500: the head's.
// The total peaks include the kernels' workspace (Note [Kernel workspace] in kernels/kernels.h):
// in bf16 the attention scratch sets the block's backward and selective-recompute totals,
// and at T = 70 the f32 backward's dS block does.
INSTANTIATE_TEST_SUITE_P(DtypesAndDropout, AnalyticVsMeasured,
                         ::testing::Values(Case{DType::kF32, 0.0, 50}, Case{DType::kF32, 0.1, 50},
                                           Case{DType::kBF16, 0.0, 500}, Case{DType::kBF16, 0.1, 500},
                                           Case{DType::kF32, 0.1, 500},
                                           Case{DType::kF32, 0.1, 50, 70},
                                           Case{DType::kBF16, 0.0, 50, 70}));

INSTANTIATE_TEST_SUITE_P(Llama, AnalyticVsMeasured,
                         ::testing::Values(Case{DType::kF32, 0.0, 50, 12, true},
                                           Case{DType::kF32, 0.1, 500, 12, true},
                                           Case{DType::kBF16, 0.0, 500, 12, true},
                                           Case{DType::kBF16, 0.1, 50, 70, true},
                                           Case{DType::kF32, 0.0, 50, 70, true}));

INSTANTIATE_TEST_SUITE_P(Qwen2, AnalyticVsMeasured,
                         ::testing::Values(Case{DType::kF32, 0.0, 50, 12, true, true},
                                           Case{DType::kBF16, 0.1, 500, 12, true, true},
                                           Case{DType::kF32, 0.1, 50, 70, true, true}));

TEST(AnalyticTest, NonePeakClosedFormMatchesTheSimulatorAndAWholeStep) {
  for (bool llama : {false, true}) {
  for (DType dt : {DType::kF32, DType::kBF16}) {
    for (double p : {0.0, 0.1}) {
      for (int64_t vocab : {50, 500}) {
        const config::ModelConfig mc = small_model(p, vocab, 12, llama);
        const models::TransformerShape shape{mc, 2, 12, dt};
        const ChainCosts costs = models::analytic_transformer_costs(shape);
        EXPECT_EQ(models::none_peak_bytes(shape), simulate(schedule_none(costs), costs).peak_activation_bytes)
            << "dropout " << p << " vocab " << vocab;

        // A whole step through Transformer::forward_backward, measured.
        Env env;
        models::Transformer gpt(mc);
        nn::FlatParams flat(*env.alloc, gpt.layout(), dt, DType::kF32);
        Tensor params = flat.params();
        tensor::from_host_f32(*env.device, gpt.init_values(5), params);
        gpt.bind(flat);
        nn::Ctx ctx(*env.kernels, *env.alloc, dt);
        const size_t base = env.act();
        env.alloc->reset_peak();
        gpt.forward_backward(ctx, env.ids(2, 12, vocab, 0), env.ids(2, 12, vocab, 1));
        EXPECT_EQ(env.peak_act() - base, models::none_peak_bytes(shape)) << "dropout " << p << " vocab " << vocab
                                                                     << " llama " << llama;
      }
    }
  }
  }
}

// Transformer::forward_backward holds every stage input through the step, forwards every stage, then
// recomputes and runs backward stage by stage: schedule_full when every stage checkpoints,
// schedule_selective when the blocks run selective. The simulator predicts its peak exactly.
TEST(AnalyticTest, SimulatedPeaksOfFullAndSelectiveEqualAMeasuredStep) {
  for (DType dt : {DType::kF32, DType::kBF16}) {
    for (double p : {0.0, 0.1}) {
      const config::ModelConfig mc = small_model(p, 500);
      const models::TransformerShape shape{mc, 2, 12, dt};
      const ChainCosts costs = models::analytic_transformer_costs(shape);
      Env env;
      models::Transformer gpt(mc);
      nn::FlatParams flat(*env.alloc, gpt.layout(), dt, DType::kF32);
      Tensor params = flat.params();
      tensor::from_host_f32(*env.device, gpt.init_values(5), params);
      gpt.bind(flat);
      nn::Ctx ctx(*env.kernels, *env.alloc, dt);
      const int n = gpt.num_stages();
      std::vector<models::StagePlan> full(static_cast<size_t>(n), {SaveMode::kCheckpoint, OpPolicy::keep_none()});
      std::vector<models::StagePlan> sel(static_cast<size_t>(n), {SaveMode::kSaveAll, OpPolicy::keep_none()});
      for (int s = 1; s + 1 < n; ++s) sel[s] = {SaveMode::kCheckpoint, OpPolicy::selective_attention()};
      const std::pair<const std::vector<models::StagePlan>*, Schedule> cases[] = {
          {&full, schedule_full(costs)}, {&sel, schedule_selective(costs)}};
      for (const auto& [plans, schedule] : cases) {
        const size_t base = env.act();
        env.alloc->reset_peak();
        gpt.forward_backward(ctx, env.ids(2, 12, 500, 0), env.ids(2, 12, 500, 1), *plans);
        EXPECT_EQ(env.peak_act() - base, simulate(schedule, costs).peak_activation_bytes)
            << schedule.to_string() << " dropout " << p;
        EXPECT_EQ(env.act(), base);
      }
    }
  }
}

// The worked example of docs/memory-model.md: examples/configs/gpt-small-cpu.json's model at
// micro-batch 4.
TEST(AnalyticTest, WorkedExampleOfTheDocs) {
  config::ModelConfig mc;
  mc.layers = 8;
  mc.hidden = 256;
  mc.heads = 8;
  mc.seq_len = 256;
  mc.vocab = 8192;
  mc.dropout = 0.1;
  const ChainCosts f = models::analytic_transformer_costs({mc, 4, 256, DType::kF32});
  EXPECT_EQ(f.stages[1].option(SaveOption::kKeep).saved_bytes, 24'133'632u);
  EXPECT_EQ(f.stages.back().option(SaveOption::kKeep).forward_peak_bytes, 34'611'204u);
  EXPECT_EQ(simulate(schedule_none(f), f).peak_activation_bytes, 237'117'444u);
  EXPECT_EQ(simulate(schedule_none(f), f).peak_op, 9);  // the head's forward
  EXPECT_EQ(simulate(schedule_full(f), f).peak_activation_bytes, 44'048'388u);
  EXPECT_EQ(simulate(schedule_selective(f), f).peak_activation_bytes, 161'619'972u);
  EXPECT_EQ(simulate(schedule_uniform(f, 2), f).peak_activation_bytes, 54'558'720u);
  EXPECT_EQ(simulate(schedule_sqrt(f), f).peak_activation_bytes, 77'643'776u);
  const ChainCosts b = models::analytic_transformer_costs({mc, 4, 256, DType::kBF16});
  EXPECT_EQ(simulate(schedule_none(b), b).peak_activation_bytes, 152'182'788u);
  EXPECT_EQ(simulate(schedule_full(b), b).peak_activation_bytes, 22'560'768u);
  EXPECT_EQ(simulate(schedule_full(b), b).peak_op, 8);  // the last block's forward
  EXPECT_EQ(simulate(schedule_selective(b), b).peak_activation_bytes, 80'879'620u);
  // Kernel workspace: the block's backward peaks during the attention backward (in f32 the
  // GELU moment's 8A is as high).
  EXPECT_EQ(f.stages[1].backward_total_peak_bytes, 8'388'608u);
  EXPECT_EQ(b.stages[1].backward_total_peak_bytes, 10'747'904u);
  EXPECT_EQ(kernels::attention_forward_workspace_bytes(memory::DeviceKind::kCpu,
                                                  {4, 256, 256, 8, DType::kBF16, DType::kBF16}),
            4'980'736u);
  EXPECT_EQ(models::model_state_bytes(mc, DType::kF32).params, 33'925'120u);
}

// Kernel workspace is in the total figures only, and depends on the device the kernels run
// on: the activation footprint is the same for cpu and cuda, the totals follow
// nn::attention_*_workspace_bytes (Note [Kernel workspace] in kernels/kernels.h).
TEST(AnalyticTest, KernelWorkspaceEntersTheTotalsOnlyPerDevice) {
  for (DType dt : {DType::kF32, DType::kBF16}) {
    const config::ModelConfig mc = small_model(0.0, 50, 70);
    models::TransformerShape shape{mc, 2, 70, dt};
    const ChainCosts cpu = models::analytic_transformer_costs(shape);
    shape.device = memory::DeviceKind::kCuda;
    const ChainCosts cuda = models::analytic_transformer_costs(shape);
    ASSERT_EQ(cpu.num_stages(), cuda.num_stages());
    for (int s = 0; s < cpu.num_stages(); ++s) {
      for (int o = 0; o < kNumSaveOptions; ++o) {
        const OptionCost& x = cpu.stages[s].options[o];
        const OptionCost& y = cuda.stages[s].options[o];
        EXPECT_EQ(x.forward_peak_bytes, y.forward_peak_bytes);
        EXPECT_EQ(x.saved_bytes, y.saved_bytes);
        EXPECT_EQ(x.recompute_peak_bytes, y.recompute_peak_bytes);
        EXPECT_EQ(x.recompute_saved_bytes, y.recompute_saved_bytes);
      }
    }
    EXPECT_EQ(simulate(schedule_none(cpu), cpu).peak_activation_bytes,
              simulate(schedule_none(cuda), cuda).peak_activation_bytes);

    // The block's backward: the GELU moment (8A) or the attention moment (6A + scratch).
    const size_t a = 2 * 70 * 32 * tensor::dtype_size(dt);
    const kernels::AttentionCall call{2, 70, 32, 4, dt, dt, dt};
    for (const auto& [costs, kind] : {std::pair{&cpu, memory::DeviceKind::kCpu},
                                      std::pair{&cuda, memory::DeviceKind::kCuda}}) {
      EXPECT_EQ(costs->stages[1].backward_total_peak_bytes,
                std::max(8 * a, 6 * a + kernels::attention_backward_workspace_bytes(kind, call)));
      // Selective recomputes only the attention: its outputs (A + P) and its scratch.
      const size_t p = 2 * 4 * 70 * 70 * 4;
      EXPECT_EQ(costs->stages[1].option(SaveOption::kSelective).recompute_total_peak_bytes,
                a + p + kernels::attention_forward_workspace_bytes(kind, call));
    }
  }
}

TEST(AnalyticTest, ModelStateBytesUseTheRealLayout) {
  const config::ModelConfig mc = small_model(0.0, 50);
  const models::Transformer gpt(mc);
  const size_t n = static_cast<size_t>(gpt.layout().total_elems());
  const models::ModelStateBytes f = models::model_state_bytes(mc, DType::kF32);
  EXPECT_EQ(f.params, 4 * n);
  EXPECT_EQ(f.grads, 4 * n);
  EXPECT_EQ(f.optimizer, 8 * n);
  const models::ModelStateBytes b = models::model_state_bytes(mc, DType::kBF16);
  EXPECT_EQ(b.params, 2 * n);
  EXPECT_EQ(b.grads, 4 * n);
  EXPECT_EQ(b.optimizer, 12 * n);
}

TEST(AnalyticTest, FlopsAndSelectiveSaving) {
  const config::ModelConfig mc = small_model(0.0, 50);
  const ChainCosts c = models::analytic_transformer_costs({mc, 2, 12, DType::kF32});
  const double N = 24, C = 32, T = 12;
  const StageCost& blk = c.stages[1];
  EXPECT_DOUBLE_EQ(blk.forward_flops, 24 * N * C * C + 4 * N * T * C);
  // Selective recomputes core attention only: its output and probabilities.
  const OptionCost& sel = blk.option(SaveOption::kSelective);
  EXPECT_EQ(sel.recompute_saved_bytes, 4 * (N * C + 2 * 4 * 12 * 12));
  EXPECT_DOUBLE_EQ(sel.recompute_flops, 4 * N * T * C);
  EXPECT_FALSE(c.stages[0].option(SaveOption::kSelective).available);
  EXPECT_FALSE(c.stages.back().option(SaveOption::kSelective).available);
  EXPECT_EQ(c.source, "analytic");
  EXPECT_FALSE(c.has_times());
}

}  // namespace
}  // namespace porter::checkpoint
