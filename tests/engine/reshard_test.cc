// Resuming a training checkpoint at another layout (Note [Resharding a checkpoint] in
// engine/reshard.h): a state saved at one (data-parallel size, tensor-parallel degree, ZeRO
// stage, offload) and loaded at another is the saved state element for element (the whole
// model's params, master, exp_avg and exp_avg_sq, the step, optimizer_steps and the loss
// scaler; params_host() on every rank), and the next two steps are bitwise those of a run
// that stayed at the new layout with the same state; what cannot be resharded says what
// differs. Ranks are threads with their own cpu devices (as in engine_zero_test and
// engine_tp_test).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "base/error.h"
#include "engine/reshard.h"
#include "io/consolidate.h"
#include "io/weights_file.h"
#include "models/transformer.h"
#include "tests/engine/engine_test_util.h"

namespace porter::engine {
namespace {

using ::testing::HasSubstr;
using namespace porter::engine::testing;
namespace fs = std::filesystem;

enum class Offload { kNone, kOptimizer, kParams, kHalf };  // kHalf: offload_optimizer.ratio 0.5

struct Layout {
  int dp = 1, tp = 1, stage = 0;
  Offload offload = Offload::kNone;
  std::string name() const {
    const char* off[] = {"", "_optimizer_offload", "_param_offload", "_ratio_half"};
    return "dp" + std::to_string(dp) + "_tp" + std::to_string(tp) + "_zero" +
           std::to_string(stage) + off[static_cast<int>(offload)];
  }
};

// A tiny transformer whose vocabulary (65) leaves a padding row at tensor_parallel 2, with
// clipping and dropout, one micro-batch of 2 per data-parallel rank.
config::Config layout_config(const Layout& l, bool bf16) {
  config::Config c = tiny_config(config::CheckpointPolicy::kNone, /*dropout=*/0.1,
                                 /*accumulation=*/1, bf16);
  c.world_size = l.dp * l.tp;
  c.train_batch_size = c.train_micro_batch_size_per_gpu * l.dp;
  c.porter.model.layers = 2;
  c.porter.model.vocab = 65;
  c.porter.model.tensor_parallel = l.tp;
  c.porter.device.threads = 1;
  c.porter.comm.timeout_s = 30.0;
  c.zero_optimization.stage = l.stage;
  c.zero_optimization.reduce_bucket_size_elems = 20000;
  if (l.offload == Offload::kOptimizer || l.offload == Offload::kHalf) {
    c.zero_optimization.offload_optimizer.device = config::OffloadDevice::kCpu;
    c.zero_optimization.offload_optimizer.ratio = l.offload == Offload::kHalf ? 0.5 : 1.0;
  }
  if (l.offload == Offload::kParams) {
    c.zero_optimization.offload_param.device = config::OffloadDevice::kCpu;
  }
  return c;
}

// Runs fn(engine) on c.world_size thread ranks in tensor-parallel groups of
// porter.model.tensor_parallel; rethrows the first rank's error.
void run_world(const config::Config& c, const std::function<void(Engine&)>& fn) {
  const int ws = static_cast<int>(c.world_size);
  const int tp = static_cast<int>(c.porter.model.tensor_parallel);
  if (ws == 1) {
    auto device = cpu_device();
    Engine e(*device, std::make_unique<TransformerModel>(c.porter.model), c);
    fn(e);
    return;
  }
  auto errors = comm::run_thread_ranks(ws, [&](int rank, std::shared_ptr<comm::Store> store) {
    auto device = cpu_device();
    comm::CommOptions o;
    o.timeout = comm::Seconds{c.porter.comm.timeout_s};
    std::shared_ptr<comm::Communicator> world = comm::make_communicator(*device, store, rank, ws, o);
    const comm::ProcessGroups g = comm::make_process_groups(world, tp);
    Engine e(*device, std::make_unique<TransformerModel>(c.porter.model, g.tp_rank), c,
             tp == 1 ? data_parallel(world) : g);
    fn(e);
  });
  for (auto& err : errors) {
    if (err) std::rethrow_exception(err);
  }
}

double train(Engine& e, const config::Config& c, int64_t step) {
  const io::DataSource data(c.porter.data, c.porter.model.vocab, c.train_micro_batch_size_per_gpu,
                            c.porter.model.seq_len);
  return e.train_step(data.rank_batches(step, c.gradient_accumulation_steps, e.dp_rank(), e.dp_size()))
      .loss;
}

// Two steps at layout `a`, saved into `dir`.
void save_at(const Layout& a, bool bf16, const fs::path& dir) {
  const config::Config c = layout_config(a, bf16);
  run_world(c, [&](Engine& e) {
    train(e, c, 0);
    train(e, c, 1);
    e.save_checkpoint(dir);
  });
}

// One rank's run after loading a checkpoint.
struct Resumed {
  int world_rank = 0, tp_rank = 0;
  int64_t step = 0;
  std::string kernel_table_origin;
  std::vector<float> params;  // params_host() just after load_checkpoint
  std::vector<double> losses;  // steps 2 and 3
  SavedState state;            // after them
};

// Loads `from` at layout `b`, saves what it loaded into `save_to` (unless empty) and trains
// steps 2 and 3.
std::vector<Resumed> resume_at(const Layout& b, bool bf16, const fs::path& from,
                               const fs::path& save_to = {}) {
  const config::Config c = layout_config(b, bf16);
  std::vector<Resumed> out(static_cast<size_t>(c.world_size));
  run_world(c, [&](Engine& e) {
    Resumed& r = out[static_cast<size_t>(e.world_rank())];
    e.load_checkpoint(from);
    r.world_rank = e.world_rank();
    r.tp_rank = e.tp_rank();
    r.step = e.step();
    r.kernel_table_origin = e.kernel_table().origin();
    r.params = e.params_host();  // a collective at stage 3
    if (!save_to.empty()) e.save_checkpoint(save_to);
    for (int64_t s = 2; s < 4; ++s) r.losses.push_back(train(e, c, s));
    r.state = saved_state(e);
  });
  return out;
}

std::vector<float> widened(const std::vector<std::byte>& bytes, size_t elem_bytes, bool bf16) {
  const std::vector<std::byte> f32 =
      io::to_f32_bytes(elem_bytes == 4 ? tensor::DType::kF32 : (bf16 ? tensor::DType::kBF16 : tensor::DType::kF16), bytes);
  std::vector<float> v(f32.size() / 4);
  if (!v.empty()) std::memcpy(v.data(), f32.data(), f32.size());
  return v;
}

// The first element at which two byte buffers of elem_bytes elements differ, or -1.
int64_t first_difference(const std::vector<std::byte>& a, const std::vector<std::byte>& b,
                         size_t elem_bytes) {
  if (a.size() != b.size()) return 0;
  for (size_t i = 0; i < a.size(); i += elem_bytes) {
    if (std::memcmp(a.data() + i, b.data() + i, elem_bytes) != 0) return static_cast<int64_t>(i / elem_bytes);
  }
  return -1;
}

fs::path temp_dir(const std::string& name) {
  fs::path p = fs::temp_directory_path() / ("porter_reshard_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  return p;
}

struct Pair {
  Layout from, to;
  bool bf16 = true;
};

void PrintTo(const Pair& p, std::ostream* os) {
  *os << p.from.name() << " -> " << p.to.name() << (p.bf16 ? " (bf16)" : " (f32)");
}

std::string pair_name(const ::testing::TestParamInfo<Pair>& info) {
  return info.param.from.name() + "_to_" + info.param.to.name() + (info.param.bf16 ? "_bf16" : "_f32");
}

// Each layout's checkpoint is saved once for the suite (the first pair that loads it).
class Reshard : public ::testing::TestWithParam<Pair> {
 protected:
  static fs::path saved(const Layout& l, bool bf16) {
    const std::string name = l.name() + (bf16 ? "_bf16" : "_f32");
    auto it = saved_.find(name);
    if (it == saved_.end()) {
      const fs::path dir = temp_dir(name);
      save_at(l, bf16, dir);
      it = saved_.emplace(name, dir).first;
    }
    return it->second;
  }
  static void TearDownTestSuite() {
    for (const auto& [name, dir] : saved_) fs::remove_all(dir);
    saved_.clear();
  }

 private:
  static inline std::map<std::string, fs::path> saved_;
};

// The layout matrix: the cross product of seven layouts in bf16, which together hold dp 1-4,
// tp 1-2, every stage and every offload (none, the optimizer, the parameters, half the
// optimizer), so every pair changes the layout, the tensor-parallel degree changes both ways
// (splitting the whole model and joining the parts) and stays at 2 with another dp size and
// stage; and three pairs in f32 (no master copy; with the optimizer offloaded its master is
// the working copy). The full cross product of dp 1-4 x tp 1-2 x stages 0-3 x 4 offloads
// would take hours; these 45 pairs take about 20 s in a release build.
const Layout kLayouts[] = {
    {1, 1, 0},
    {2, 1, 2},
    {4, 1, 1, Offload::kOptimizer},
    {3, 1, 3, Offload::kHalf},
    {2, 1, 3, Offload::kParams},
    {1, 2, 3, Offload::kParams},
    {2, 2, 2, Offload::kOptimizer},
};

std::vector<Pair> pairs() {
  std::vector<Pair> out;
  for (const Layout& a : kLayouts) {
    for (const Layout& b : kLayouts) {
      if (&a != &b) out.push_back({a, b});
    }
  }
  out.push_back({{3, 1, 1, Offload::kOptimizer}, {2, 1, 3, Offload::kHalf}, false});
  out.push_back({{2, 1, 3, Offload::kParams}, {1, 2, 0}, false});
  out.push_back({{1, 2, 3, Offload::kHalf}, {4, 1, 2, Offload::kOptimizer}, false});
  return out;
}

TEST_P(Reshard, TheLoadedStateIsTheSavedOneAndTrainsOnAsARunThatStayed) {
  const Pair& p = GetParam();
  const fs::path saved = Reshard::saved(p.from, p.bf16);
  const fs::path loaded = temp_dir(p.to.name() + "_loaded");
  const std::vector<Resumed> got = resume_at(p.to, p.bf16, saved, loaded);

  // The state the new layout loaded (saved again there) is the saved one, the whole model's
  // every section element for element.
  const config::ModelConfig model = layout_config(p.from, p.bf16).porter.model;
  std::vector<std::string> sections = {"params", "exp_avg", "exp_avg_sq"};
  if (p.bf16) sections.push_back("master");
  WholeSection whole_params;
  for (const std::string& s : sections) {
    const WholeSection want = read_whole_section(saved, s, model);
    const WholeSection have = read_whole_section(loaded, s, layout_config(p.to, p.bf16).porter.model);
    EXPECT_EQ(have.elem_bytes, want.elem_bytes) << s;
    EXPECT_EQ(have.bytes.size(), want.bytes.size()) << s;
    EXPECT_EQ(first_difference(have.bytes, want.bytes, want.elem_bytes), -1) << s;
    EXPECT_GT(std::count_if(want.bytes.begin(), want.bytes.end(), [](std::byte x) { return x != std::byte{0}; }),
              0) << s << ": a state no step changed proves nothing";
    if (s == "params") whole_params = want;
  }
  const io::CheckpointInfo a = io::inspect_checkpoint(saved), b = io::inspect_checkpoint(loaded);
  EXPECT_EQ(b.step, 2);
  for (const char* key : {"step", "optimizer_steps", "loss_scaler"}) {
    EXPECT_EQ(b.meta(0).at(key), a.meta(0).at(key)) << key;
  }
  EXPECT_EQ(b.dp_size, p.to.dp);
  EXPECT_EQ(b.tp_size, p.to.tp);
  EXPECT_EQ(b.zero_stage, p.to.stage);
  // Every rank's working parameters: its part of the saved whole model, as the model itself
  // splits it (models::Transformer::shard_values, not the resharding's own code).
  const config::ModelConfig to_model = layout_config(p.to, p.bf16).porter.model;
  const std::vector<float> whole = widened(whole_params.bytes, whole_params.elem_bytes, p.bf16);
  for (const Resumed& r : got) {
    SCOPED_TRACE("rank " + std::to_string(r.world_rank));
    EXPECT_EQ(r.step, 2);
    EXPECT_EQ(r.kernel_table_origin, "resumed from " + saved.string());
    EXPECT_TRUE(bitwise_equal(r.params, models::Transformer(to_model, r.tp_rank).shard_values(whole)));
  }

  // Two more steps: bitwise those of a run at the new layout that loaded the same state from a
  // checkpoint written at that layout (the fast path).
  const std::vector<Resumed> stayed = resume_at(p.to, p.bf16, loaded);
  ASSERT_EQ(stayed.size(), got.size());
  std::vector<SavedState> got_states, stayed_states;
  for (size_t r = 0; r < got.size(); ++r) {
    EXPECT_EQ(got[r].losses, stayed[r].losses) << "rank " << r;
    for (double loss : got[r].losses) EXPECT_TRUE(std::isfinite(loss)) << "rank " << r;
    got_states.push_back(got[r].state);
    stayed_states.push_back(stayed[r].state);
  }
  expect_same_state(got_states, stayed_states, pair_name({p, 0}));
  fs::remove_all(loaded);
}

INSTANTIATE_TEST_SUITE_P(Layouts, Reshard, ::testing::ValuesIn(pairs()), pair_name);

TEST(ReshardErrors, WhatCannotBeReshardedSaysWhatDiffersAndWhatToDo) {
  const fs::path dir = temp_dir("errors");
  save_at({2, 2, 2}, /*bf16=*/true, dir);
  // Another compute dtype, at another layout too.
  {
    const config::Config c = layout_config({1, 1, 0}, /*bf16=*/false);
    const std::string msg = error_of<InvalidArgument>([&] {
      run_world(c, [&](Engine& e) { e.load_checkpoint(dir); });
    });
    EXPECT_THAT(msg, HasSubstr("compute dtype differs: the checkpoint was trained in bf16, this "
                               "engine computes in f32 (bf16.enabled must match; the layout may "
                               "differ)"));
  }
  // Another model: one more layer.
  {
    config::Config c = layout_config({1, 1, 0}, true);
    c.porter.model.layers = 3;
    const std::string msg = error_of<InvalidArgument>([&] {
      run_world(c, [&](Engine& e) { e.load_checkpoint(dir); });
    });
    EXPECT_THAT(msg, HasSubstr("tensor-parallel rank 0: model layout differs at parameter 26: the "
                               "checkpoint has 'lnf.weight' (32) at offset 14912, this model has "
                               "'h.2.ln1.weight' (32) at offset 14912"));
    EXPECT_THAT(msg, HasSubstr("load it into an engine built from the same model config (the "
                               "data-parallel size, tensor_parallel, ZeRO stage and offload may "
                               "differ)"));
  }
  // A model of the user's own layers cannot change its tensor-parallel degree: porter does not
  // know its parts.
  {
    const config::Config c = layout_config({1, 1, 0}, true);
    const models::Transformer one(c.porter.model);
    RankLayout mine;
    mine.model = c.porter.model;
    mine.layout = &one.layout();
    mine.transformer = false;
    mine.compute_dtype = tensor::DType::kBF16;
    const std::string msg = error_of<InvalidArgument>([&] {
      reshard_sections(io::inspect_checkpoint(dir), mine, {{"params", 0, one.layout().total_elems()}});
    });
    EXPECT_THAT(msg, HasSubstr(": written by 2 data-parallel x 2 tensor-parallel ranks at ZeRO "
                               "stage 2, this engine runs 1 data-parallel x 1 tensor-parallel "
                               "ranks at ZeRO stage 0: changing the tensor-parallel degree is "
                               "supported for the built-in transformer (porter.model) only, whose "
                               "parts porter knows; resume this model at tensor_parallel 2 (the "
                               "data-parallel size and ZeRO stage may differ)"));
  }
  // One rank's directory of the four.
  {
    const config::Config c = layout_config({1, 1, 0}, true);
    const std::string msg = error_of<InvalidArgument>([&] {
      run_world(c, [&](Engine& e) { e.load_checkpoint(dir / "rank1"); });
    });
    EXPECT_THAT(msg, HasSubstr("this is one rank's state of a checkpoint written by 4 ranks (2 "
                               "data-parallel ranks x 2 tensor-parallel); load the directory "
                               "that holds rank0 .. rank3, which resumes at any layout"));
  }
  // A corrupt section: nothing changes.
  {
    std::fstream f(dir / "rank3" / "exp_avg.bin", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(40);
    f.put('\x7f');
  }
  {
    const config::Config c = layout_config({1, 1, 0}, true);
    auto device = cpu_device();
    Engine e(*device, std::make_unique<TransformerModel>(c.porter.model), c);
    const std::vector<float> before = e.params_host();
    EXPECT_THAT(error_of<IoError>([&] { e.load_checkpoint(dir); }), HasSubstr("checksum mismatch"));
    EXPECT_EQ(e.step(), 0);
    EXPECT_TRUE(bitwise_equal(e.params_host(), before));
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace porter::engine
