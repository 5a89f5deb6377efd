// The tensor-parallel GPT (Note [GPT tensor parallelism]): its per-rank layout, the sharding of
// the t = 1 values, and equivalence with t = 1 on thread ranks: the loss and every rank's
// gradients (its part of the t = 1 gradients, each tensor against its own largest value) agree
// to 1e-5 with dropout on (measured: 7.1e-7 at worst), with and without sequence parallelism,
// and checkpoint + recompute is bit-identical to keeping everything.
#include <cmath>
#include <memory>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "base/error.h"
#include "comm/communicator.h"
#include "memory/caching_allocator.h"
#include "memory/device.h"
#include "models/transformer.h"
#include "kernels/kernels.h"

namespace porter::nn {

using namespace porter::tensor;
using namespace porter::kernels;
namespace {

using ::testing::HasSubstr;

config::ModelConfig small_config(int64_t tp, bool sp, bool tied = true, bool llama = false) {
  config::ModelConfig mc;
  if (llama) {  // grouped-query at t <= 2; t = 4 needs a key/value head per rank
    mc.type = config::ModelType::kLlama;
    mc.kv_heads = tp == 4 ? 4 : 2;
    mc.intermediate = 88;
  }
  mc.layers = 2;
  mc.hidden = 32;
  mc.heads = 4;
  mc.seq_len = 12;
  mc.vocab = 50;  // t = 4: shards of 13 rows, the last with 11 real ones
  mc.dropout = 0.1;
  mc.tie_embeddings = tied;
  mc.tensor_parallel = tp;
  mc.sequence_parallel = sp;
  return mc;
}

struct Rank {
  std::unique_ptr<memory::Device> device;
  std::unique_ptr<memory::CachingAllocator> alloc;
  std::unique_ptr<Kernels> kernels;
  Rank() {
    memory::DeviceOptions o;
    o.memory_limit_bytes = size_t{256} << 20;
    o.threads = 1;
    device = memory::make_device(o);
    alloc = std::make_unique<memory::CachingAllocator>(*device);
    kernels = make_kernels(*alloc);
  }
  Tensor ids(int64_t b, int64_t t, int64_t vocab, int salt) {
    std::vector<int32_t> v(static_cast<size_t>(b * t));
    for (size_t i = 0; i < v.size(); ++i) {
      v[i] = static_cast<int32_t>((i * 7 + static_cast<size_t>(salt) * 13 + i * i) % vocab);
    }
    Tensor x = Tensor::empty(*alloc, Shape{b, t}, DType::kI32, memory::Category::kWorkspace);
    device->copy_sync(x.data(), v.data(), x.nbytes());
    return x;
  }
};

struct Result {
  std::vector<float> losses;               // per step
  std::vector<std::vector<float>> grads;   // per step, this rank's layout
};

enum class Plan { kKeepAll, kCheckpointAll, kSelective };

// `steps` micro-batches (one per step, parameters fixed) through rank `rank`'s part of the
// model, with `tp` the group's communicator (null at t = 1).
Result run_rank(const config::ModelConfig& mc, int rank, comm::Communicator* tp, Plan plan,
                int steps) {
  Rank env;
  models::Transformer gpt(mc, rank);
  FlatParams flat(*env.alloc, gpt.layout(), DType::kF32, DType::kF32);
  Tensor p = flat.params();
  from_host_f32(*env.device, gpt.init_values(5), p);
  gpt.bind(flat);
  std::vector<models::StagePlan> plans(static_cast<size_t>(gpt.num_stages()));
  for (models::StagePlan& s : plans) {
    if (plan == Plan::kCheckpointAll) s = {SaveMode::kCheckpoint, OpPolicy::keep_none()};
    if (plan == Plan::kSelective) s = {SaveMode::kCheckpoint, OpPolicy::selective_attention()};
  }
  Result r;
  for (int step = 0; step < steps; ++step) {
    Tensor g = flat.grads();
    env.kernels->fill(g, 0.0f);
    Ctx ctx(*env.kernels, *env.alloc);
    ctx.set_tensor_parallel(tp);
    ctx.set_run({/*seed=*/99, static_cast<uint64_t>(step), /*micro_batch=*/0});
    Tensor tokens = env.ids(2, 12, mc.vocab, step);
    Tensor targets = env.ids(2, 12, mc.vocab, step + 100);
    r.losses.push_back(gpt.forward_backward(ctx, tokens, targets, plans));
    r.grads.push_back(to_host_f32(*env.device, flat.grads()));
  }
  EXPECT_EQ(env.alloc->stats().by_category[static_cast<size_t>(memory::Category::kActivations)]
                .current_bytes,
            0u);
  return r;
}

// Every rank's result, on t thread ranks sharing one Gloo group.
std::vector<Result> run_group(const config::ModelConfig& mc, Plan plan, int steps) {
  const int t = static_cast<int>(mc.tensor_parallel);
  std::vector<Result> out(static_cast<size_t>(t));
  auto errors = comm::run_thread_ranks(t, [&](int rank, std::shared_ptr<comm::Store> store) {
    auto device = memory::make_device(memory::DeviceOptions{});
    comm::CommOptions o;
    o.group_name = "tp";
    o.timeout = comm::Seconds{60};
    auto comm = comm::make_communicator(*device, store, rank, t, o);
    out[static_cast<size_t>(rank)] = run_rank(mc, rank, comm.get(), plan, steps);
  });
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
  return out;
}

// Each tensor of `layout` on its own: |a - b| <= tol * max|b| over the tensor, so that a
// layernorm's or a bias's gradient is held to its own scale, not to the largest gradient's
// (tol is the partial sums' reordering, not a wrong element). The padding between tensors
// must agree exactly.
void expect_close(const ParamLayout& layout, const std::vector<float>& a,
                    const std::vector<float>& b, double tol, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  std::vector<bool> in_tensor(a.size(), false);
  for (const ParamEntry& e : layout.entries()) {
    double scale = 0.0, worst = 0.0;
    for (int64_t i = e.offset_elems; i < e.offset_elems + e.shape.numel(); ++i) {
      const size_t k = static_cast<size_t>(i);
      in_tensor[k] = true;
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

TEST(GptTpLayoutTest, PerRankShapesAndPadding) {
  models::Transformer r0(small_config(4, false, false), 0), r3(small_config(4, false, false), 3);
  EXPECT_EQ(r0.layout().find("wte").shape, (Shape{13, 32}));
  EXPECT_EQ(r0.layout().find("wpe").shape, (Shape{12, 32}));
  EXPECT_EQ(r0.layout().find("h.0.qkv.weight").shape, (Shape{24, 32}));
  EXPECT_EQ(r0.layout().find("h.0.qkv.bias").shape, (Shape{24}));
  EXPECT_EQ(r0.layout().find("h.0.proj.weight").shape, (Shape{32, 8}));
  EXPECT_EQ(r0.layout().find("h.0.proj.bias").shape, (Shape{32}));
  EXPECT_EQ(r0.layout().find("h.0.fc1.weight").shape, (Shape{32, 32}));
  EXPECT_EQ(r0.layout().find("h.0.fc2.weight").shape, (Shape{32, 32}));
  EXPECT_EQ(r0.layout().find("head.weight").shape, (Shape{13, 32}));
  EXPECT_EQ(r3.tp().vocab_begin(), 39);
  EXPECT_EQ(r3.tp().vocab_valid(), 11);
}

TEST(GptTpLayoutTest, ShardValuesPicksEachRanksPart) {
  const auto mc = small_config(2, false);
  auto whole_mc = mc;
  whole_mc.tensor_parallel = 1;
  models::Transformer whole(whole_mc);
  std::vector<float> v(static_cast<size_t>(whole.layout().total_elems()));
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(i);
  const ParamEntry& qkv = whole.layout().find("h.1.qkv.weight");   // (96, 32)
  const ParamEntry& proj = whole.layout().find("h.1.proj.weight");  // (32, 32)
  const ParamEntry& wte = whole.layout().find("wte");               // (50, 32)
  for (int r = 0; r < 2; ++r) {
    models::Transformer part(mc, r);
    const std::vector<float> s = part.shard_values(v);
    const ParamEntry& pq = part.layout().find("h.1.qkv.weight");    // (48, 32)
    // Row 16 of the shard is k's first row of this rank's heads: whole row 32 + 16 r.
    EXPECT_EQ(s[pq.offset_elems + 16 * 32], v[qkv.offset_elems + (32 + 16 * r) * 32]);
    const ParamEntry& pp = part.layout().find("h.1.proj.weight");   // (32, 16)
    EXPECT_EQ(s[pp.offset_elems + 3 * 16 + 5], v[proj.offset_elems + 3 * 32 + 16 * r + 5]);
    const ParamEntry& pw = part.layout().find("wte");               // (25, 32)
    EXPECT_EQ(s[pw.offset_elems + 2 * 32 + 1], v[wte.offset_elems + (25 * r + 2) * 32 + 1]);
    const ParamEntry& ln = part.layout().find("lnf.weight");
    EXPECT_EQ(s[ln.offset_elems + 7], v[whole.layout().find("lnf.weight").offset_elems + 7]);
  }
  EXPECT_THROW(models::Transformer(mc, 0).shard_values(std::vector<float>(3)), InvalidArgument);
}

TEST(GptTpLayoutTest, MergeShardsInvertsShardValues) {
  for (bool llama : {false, true}) {
    for (int t : {2, 4}) {
      const auto mc = small_config(t, false, false, llama);
      config::ModelConfig whole_config = mc;
      whole_config.tensor_parallel = 1;
      const models::Transformer whole(whole_config);
      std::vector<float> values(static_cast<size_t>(whole.layout().total_elems()), 0.0f);
      for (const ParamEntry& e : whole.layout().entries()) {
        for (int64_t i = 0; i < e.shape.numel(); ++i) {
          values[static_cast<size_t>(e.offset_elems + i)] = static_cast<float>(e.offset_elems + i);
        }
      }
      std::vector<std::vector<float>> parts;
      for (int r = 0; r < t; ++r) parts.push_back(models::Transformer(mc, r).shard_values(values));
      EXPECT_EQ(models::Transformer(mc, 0).merge_shards(parts), values) << "llama " << llama << " t " << t;
    }
  }
}

TEST(GptTpLayoutTest, RejectsHeadsThatDoNotSplit) {
  auto mc = small_config(3, false);
  try {
    models::Transformer g(mc, 0);
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("porter.model.heads = 4 is not divisible by "
                                    "tensor_parallel = 3"));
  }
  EXPECT_THROW(models::Transformer(small_config(2, false), 2), InvalidArgument);
}

struct TpCase {
  int t;
  bool sp;
  bool tied;
  bool llama = false;
};

class GptTpEquivalenceTest : public ::testing::TestWithParam<TpCase> {};

TEST_P(GptTpEquivalenceTest, LossesAndGradientsMatchOneRank) {
  const TpCase c = GetParam();
  const int steps = 3;
  config::ModelConfig whole = small_config(c.t, c.sp, c.tied, c.llama);
  whole.tensor_parallel = 1;
  whole.sequence_parallel = false;
  const Result one = run_rank(whole, 0, nullptr, Plan::kKeepAll, steps);
  const std::vector<Result> group =
      run_group(small_config(c.t, c.sp, c.tied, c.llama), Plan::kKeepAll, steps);
  for (int r = 0; r < c.t; ++r) {
    const Result& got = group[static_cast<size_t>(r)];
    models::Transformer part(small_config(c.t, c.sp, c.tied, c.llama), r);
    for (int s = 0; s < steps; ++s) {
      EXPECT_NEAR(got.losses[static_cast<size_t>(s)], one.losses[static_cast<size_t>(s)],
                  1e-5 * std::fabs(one.losses[static_cast<size_t>(s)]))
          << "rank " << r << " step " << s;
      expect_close(part.layout(), got.grads[static_cast<size_t>(s)],
                   part.shard_values(one.grads[static_cast<size_t>(s)]), 1e-5,
                   "rank " + std::to_string(r) + " step " + std::to_string(s));
    }
  }
  // The replicated parameters' gradients are the same bytes on every rank.
  models::Transformer part0(small_config(c.t, c.sp, c.tied, c.llama), 0);
  const std::vector<std::string> replicated =
      c.llama ? std::vector<std::string>{"norm.weight", "layers.1.post_attention_layernorm.weight",
                                         "layers.0.input_layernorm.weight"}
              : std::vector<std::string>{"lnf.weight", "h.1.ln2.bias", "h.0.fc2.bias", "wpe"};
  for (const std::string& name : replicated) {
    const ParamEntry& e = part0.layout().find(name);
    for (int r = 1; r < c.t; ++r) {
      for (int64_t i = 0; i < e.shape.numel(); ++i) {
        ASSERT_EQ(group[static_cast<size_t>(r)].grads[0][static_cast<size_t>(e.offset_elems + i)],
                  group[0].grads[0][static_cast<size_t>(e.offset_elems + i)])
            << name << " on rank " << r;
      }
    }
  }
}

TEST_P(GptTpEquivalenceTest, RecomputeIsBitIdenticalAtFixedT) {
  const TpCase c = GetParam();
  const auto mc = small_config(c.t, c.sp, c.tied, c.llama);
  const std::vector<Result> keep = run_group(mc, Plan::kKeepAll, 1);
  for (Plan plan : {Plan::kCheckpointAll, Plan::kSelective}) {
    const std::vector<Result> again = run_group(mc, plan, 1);
    for (int r = 0; r < c.t; ++r) {
      EXPECT_EQ(again[static_cast<size_t>(r)].losses, keep[static_cast<size_t>(r)].losses);
      EXPECT_EQ(again[static_cast<size_t>(r)].grads, keep[static_cast<size_t>(r)].grads)
          << "rank " << r;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Groups, GptTpEquivalenceTest,
                         ::testing::Values(TpCase{2, false, true}, TpCase{4, false, true},
                                           TpCase{2, true, true}, TpCase{4, true, false},
                                           TpCase{2, false, false, true},
                                           TpCase{2, true, true, true},
                                           TpCase{4, true, false, true}),
                         [](const auto& group) {
                           return std::string(group.param.llama ? "llama_" : "") + "t" +
                                  std::to_string(group.param.t) +
                                  (group.param.sp ? "_sp" : "") +
                                  (group.param.tied ? "_tied" : "_untied");
                         });

}  // namespace
}  // namespace porter::nn
