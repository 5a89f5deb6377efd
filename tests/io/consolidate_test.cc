// Consolidated weights (io/consolidate.h): checkpoints the Engine wrote at one and two
// ranks (ZeRO stages 0, 1, 2; f32 and bf16) give back exactly the engine's parameters and
// master weights, the same at every stage; synthetic stage-3 and tensor-parallel rank
// directories are assembled from their shards (the whole model from tensor-parallel ranks is
// tests/cli/consolidate_test.cc's and tests/engine/reshard_test.cc's); incomplete, mixed and
// foreign directories are refused with messages that name the problem.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>

#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "base/error.h"
#include "comm/communicator.h"
#include "io/consolidate.h"
#include "io/state_file.h"
#include "io/weights_file.h"
#include "tests/engine/engine_test_util.h"
#include "zero/partition.h"

namespace porter::engine {
namespace {

using ::testing::HasSubstr;
using namespace porter::engine::testing;
namespace fs = std::filesystem;
using nlohmann::json;

fs::path temp_dir(const std::string& name) {
  fs::path p = fs::temp_directory_path() /
               ("porter_consolidate_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  return p;
}

std::vector<std::byte> f32_bytes(const std::vector<float>& v) {
  std::vector<std::byte> out(v.size() * 4);
  if (!v.empty()) std::memcpy(out.data(), v.data(), out.size());
  return out;
}

// All tensors' bytes, concatenated in order.
std::vector<std::byte> concat(const std::vector<io::WeightTensor>& tensors) {
  std::vector<std::byte> out;
  for (const io::WeightTensor& t : tensors) out.insert(out.end(), t.bytes.begin(), t.bytes.end());
  return out;
}

// params_host() (f32, the layout's total_elems with padding) as the layout's tensors in f32.
std::vector<std::byte> host_tensors_f32(const Engine& e, const nn::ParamLayout& layout) {
  return concat(io::layout_tensors(layout, tensor::DType::kF32, f32_bytes(e.params_host())));
}

// Like tests/engine/engine_zero_test.cc's: no clipping and one micro-batch per rank, so that
// stages 0, 1 and 2 are bit-identical at two ranks.
config::Config dp_config(int world_size, int stage, bool bf16) {
  config::Config c;
  c.world_size = world_size;
  c.train_micro_batch_size_per_gpu = 2;
  c.gradient_accumulation_steps = 1;
  c.train_batch_size = 2 * world_size;
  c.gradient_clipping = 0.0;
  c.bf16.enabled = bf16;
  config::OptimizerConfig opt;
  opt.lr = 3e-3;
  opt.weight_decay = 0.01;
  c.optimizer = opt;
  c.porter.model.layers = 2;
  c.porter.model.hidden = 32;
  c.porter.model.heads = 2;
  c.porter.model.seq_len = 16;
  c.porter.model.vocab = 64;
  c.porter.model.dropout = 0.0;
  c.porter.train.seed = 11;
  c.porter.comm.timeout_s = 20.0;
  c.zero_optimization.stage = stage;
  c.zero_optimization.reduce_bucket_size_elems = 5000;
  return c;
}

// The largest |a - b| over two f32 byte buffers of the same size.
double max_abs_diff_f32(const std::vector<std::byte>& a, const std::vector<std::byte>& b) {
  EXPECT_EQ(a.size(), b.size());
  double d = 0.0;
  for (size_t k = 0; k < std::min(a.size(), b.size()) / 4; ++k) {
    float x, y;
    std::memcpy(&x, a.data() + 4 * k, 4);
    std::memcpy(&y, b.data() + 4 * k, 4);
    d = std::max(d, std::fabs(static_cast<double>(x) - y));
  }
  return d;
}

struct Trained {
  std::vector<std::byte> working_f32;  // params_host() of rank 0, as the layout's tensors
};

// Trains `steps` steps on c.world_size thread ranks and saves into `dir`.
Trained train_and_save(const config::Config& c, int steps, const fs::path& dir) {
  const int ws = static_cast<int>(c.world_size);
  Trained out;
  auto errors = comm::run_thread_ranks(ws, [&](int rank, std::shared_ptr<comm::Store> store) {
    auto device = cpu_device();
    comm::CommOptions o;
    o.timeout = comm::Seconds{c.porter.comm.timeout_s};
    std::shared_ptr<comm::Communicator> dp =
        ws > 1 ? comm::make_communicator(*device, store, rank, ws, o) : nullptr;
    Engine e(*device, std::make_unique<TransformerModel>(c.porter.model), c, data_parallel(dp));
    const io::DataSource data(c.porter.data, c.porter.model.vocab, 2, c.porter.model.seq_len);
    for (int s = 0; s < steps; ++s) e.train_step(data.rank_batches(s, 1, rank, ws));
    e.save_checkpoint(dir);
    if (rank == 0) out.working_f32 = host_tensors_f32(e, e.model().layout());
  });
  for (auto& err : errors) {
    if (err) std::rethrow_exception(err);
  }
  return out;
}

io::ConsolidateResult consolidate(const fs::path& dir, io::WeightsDType dtype) {
  io::ConsolidateOptions o;
  o.dtype = dtype;
  return io::consolidate_checkpoint(dir, o);
}

TEST(ConsolidateTest, OneRankGivesTheEnginesParametersAndMasterWeights) {
  for (bool bf16 : {false, true}) {
    SCOPED_TRACE(bf16 ? "bf16" : "f32");
    const config::Config c = tiny_config(config::CheckpointPolicy::kNone, 0.1, 2, bf16);
    const fs::path dir = temp_dir(bf16 ? "one_bf16" : "one_f32");
    auto device = cpu_device();
    auto e = gpt_engine(*device, c);
    for (int s = 0; s < 3; ++s) e->train_step(batches(c, s));
    e->save_checkpoint(dir);
    const nn::ParamLayout& layout = e->model().layout();

    const io::ConsolidateResult w = consolidate(dir, io::WeightsDType::kWorking);
    EXPECT_EQ(w.step, 3);
    EXPECT_EQ(w.section, "params");
    EXPECT_EQ(w.dtype, bf16 ? tensor::DType::kBF16 : tensor::DType::kF32);
    EXPECT_EQ(w.rank_dirs, std::vector<fs::path>{dir});
    ASSERT_EQ(w.tensors.size(), layout.entries().size());
    for (size_t i = 0; i < w.tensors.size(); ++i) {
      EXPECT_EQ(w.tensors[i].name, layout.entries()[i].name);
      EXPECT_EQ(w.tensors[i].shape, layout.entries()[i].shape.to_vector());
      EXPECT_EQ(w.tensors[i].dtype, w.dtype);
    }
    EXPECT_EQ(w.num_params, layout.num_params());
    EXPECT_EQ(w.data_bytes, static_cast<uint64_t>(layout.num_params()) * tensor::dtype_size(w.dtype));
    // Bitwise the engine's parameters (params_host widens bf16 exactly).
    EXPECT_EQ(io::to_f32_bytes(w.dtype, concat(w.tensors)), host_tensors_f32(*e, layout));

    const io::ConsolidateResult f = consolidate(dir, io::WeightsDType::kF32);
    EXPECT_EQ(f.dtype, tensor::DType::kF32);
    if (!bf16) {
      // f32 training has no master copy: the parameters are the f32 weights.
      EXPECT_EQ(f.section, "params");
      EXPECT_EQ(concat(f.tensors), concat(w.tensors));
    } else {
      // The exact f32 master copy, whose bf16 rounding is the working copy.
      EXPECT_EQ(f.section, "master");
      const io::LoadedState state = io::read_state(dir);
      EXPECT_EQ(concat(f.tensors),
                concat(io::layout_tensors(layout, tensor::DType::kF32, state.section("master").bytes)));
      const std::vector<std::byte> master = concat(f.tensors);
      const std::vector<std::byte> working = concat(w.tensors);
      ASSERT_EQ(master.size(), 2 * working.size());
      size_t rounded_equal = 0, differs_from_working = 0;
      for (size_t k = 0; k < working.size() / 2; ++k) {
        float m;
        uint16_t h;
        std::memcpy(&m, master.data() + 4 * k, 4);
        std::memcpy(&h, working.data() + 2 * k, 2);
        rounded_equal += tensor::f32_to_bf16(m) == h;
        differs_from_working += tensor::bf16_to_f32(h) != m;
      }
      EXPECT_EQ(rounded_equal, working.size() / 2);
      EXPECT_GT(differs_from_working, 0u);  // the master holds more than the bf16 bits
    }
    fs::remove_all(dir);
  }
}

TEST(ConsolidateTest, TwoRanksAtEveryStageGiveTheSameWeights) {
  for (bool bf16 : {false, true}) {
    std::vector<std::byte> ref_working, ref_f32;
    for (int stage = 0; stage <= 2; ++stage) {
      SCOPED_TRACE(std::string(bf16 ? "bf16" : "f32") + " stage " + std::to_string(stage));
      const config::Config c = dp_config(2, stage, bf16);
      const fs::path dir = temp_dir("two_" + std::to_string(stage) + (bf16 ? "_bf16" : "_f32"));
      const Trained t = train_and_save(c, 3, dir);
      ASSERT_TRUE(fs::exists(dir / "rank1" / "meta.json"));
      std::vector<std::string> progress;
      io::ConsolidateOptions o;
      o.on_rank_read = [&](int done, int count, const fs::path& rd) {
        progress.push_back(std::to_string(done) + "/" + std::to_string(count) + " " +
                           rd.filename().string());
      };
      const io::ConsolidateResult w = io::consolidate_checkpoint(dir, o);
      EXPECT_EQ(progress, (std::vector<std::string>{"1/2 rank0", "2/2 rank1"}));
      EXPECT_EQ(w.dp_size, 2);
      EXPECT_EQ(w.zero_stage, stage);
      EXPECT_EQ(w.rank_dirs, (std::vector<fs::path>{dir / "rank0", dir / "rank1"}));
      EXPECT_EQ(io::to_f32_bytes(w.dtype, concat(w.tensors)), t.working_f32);
      const io::ConsolidateResult f = consolidate(dir, io::WeightsDType::kF32);
      EXPECT_EQ(f.section, bf16 ? "master" : "params");
      if (bf16 && stage >= 1) {
        // Each rank's master section is its shard: the result is their concatenation.
        std::vector<std::byte> shards;
        for (const char* r : {"rank0", "rank1"}) {
          const io::LoadedState state = io::read_state(dir / r);
          const std::vector<std::byte>& m = state.section("master").bytes;
          shards.insert(shards.end(), m.begin(), m.end());
        }
        const io::LoadedState r0 = io::read_state(dir / "rank0");
        const std::vector<io::FlatTensorSpec> specs = io::layout_specs(r0.meta["layout"], "meta");
        EXPECT_EQ(concat(f.tensors), concat(io::layout_tensors(specs, tensor::DType::kF32, shards)));
      }
      // The stages are bit-identical at two ranks (tests/engine/engine_zero_test.cc); one
      // rank with both micro-batches is the same training summed in another order, so close
      // rather than bitwise (as EngineZeroTest.StageZeroMatchesOneRankAtTheSameGlobalBatch).
      if (stage == 0) {
        config::Config one = dp_config(1, 0, bf16);
        one.gradient_accumulation_steps = 2;
        one.train_batch_size = 4;
        const fs::path one_dir = temp_dir("one_of_two");
        {
          auto device = cpu_device();
          auto e = gpt_engine(*device, one);
          const io::DataSource data(one.porter.data, one.porter.model.vocab, 2, one.porter.model.seq_len);
          for (int s = 0; s < 3; ++s) e->train_step(data.step_batches(s, 2));
          e->save_checkpoint(one_dir);
        }
        EXPECT_LT(max_abs_diff_f32(concat(consolidate(one_dir, io::WeightsDType::kF32).tensors),
                                   concat(f.tensors)),
                  1e-5);
        fs::remove_all(one_dir);
        ref_working = concat(w.tensors);
        ref_f32 = concat(f.tensors);
      } else {
        EXPECT_EQ(concat(w.tensors), ref_working);
        EXPECT_EQ(concat(f.tensors), ref_f32);
      }
      fs::remove_all(dir);
    }
  }
}

// Note [Synthetic rank directories]
// A 3-parameter layout whose tensors straddle the shards: 'a' (3, 50) at 0, 'b' (7) at 192,
// 'c' (2, 2) at 256; total 320 elements, padded to 384 for 3 ranks (S = 128: shard 0 is part
// of 'a', shard 1 the rest of 'a' and 'b', shard 2 'c' and padding). The master value of
// element i of tp rank k is 0.01 i - 1 + 100 k (0 in the padding); params are its bf16.
struct Synthetic {
  int dp = 3;
  int tp = 1;
  int stage = 3;
  int64_t step = 5;
};

const json kLayout = {{"total_elems", 320},
                      {"params", {{{"name", "a"}, {"shape", {3, 50}}, {"offset", 0}},
                                  {{"name", "b"}, {"shape", {7}}, {"offset", 192}},
                                  {{"name", "c"}, {"shape", {2, 2}}, {"offset", 256}}}}};

bool in_param(int64_t i) {
  return i < 150 || (i >= 192 && i < 199) || (i >= 256 && i < 260);
}

std::vector<float> synthetic_master(int64_t padded, int tp_rank) {
  std::vector<float> m(static_cast<size_t>(padded), 0.0f);
  for (int64_t i = 0; i < padded; ++i) {
    if (in_param(i)) m[static_cast<size_t>(i)] = 0.01f * static_cast<float>(i) - 1.0f + 100.0f * tp_rank;
  }
  return m;
}

std::vector<std::byte> bf16_bytes(const std::vector<float>& v) {
  std::vector<std::byte> out(v.size() * 2);
  for (size_t i = 0; i < v.size(); ++i) {
    const uint16_t h = tensor::f32_to_bf16(v[i]);
    std::memcpy(out.data() + 2 * i, &h, 2);
  }
  return out;
}

std::vector<std::byte> slice(const std::vector<std::byte>& v, int64_t begin, int64_t end, size_t elem) {
  return {v.begin() + begin * static_cast<int64_t>(elem), v.begin() + end * static_cast<int64_t>(elem)};
}

void write_synthetic(const fs::path& dir, const Synthetic& s) {
  const zero::Partition part = zero::make_partition(320, s.dp);
  for (int k = 0; k < s.tp; ++k) {
    const std::vector<float> master = synthetic_master(part.padded_elems, k);
    const std::vector<std::byte> m32 = f32_bytes(master), p16 = bf16_bytes(master);
    for (int d = 0; d < s.dp; ++d) {
      json meta = {{"kind", "porter.engine"}, {"step", s.step},      {"compute_dtype", "bf16"},
                   {"seed", 1},               {"layout", kLayout},   {"dp_size", s.dp},
                   {"zero_stage", s.stage},   {"optimizer_steps", s.step},
                   {"config", {{"model", {{"layers", 1}, {"tensor_parallel", s.tp}}}}}};
      const int64_t lo = s.stage >= 1 ? part.begin(d) : 0;
      const int64_t hi = s.stage >= 1 ? part.end(d) : part.padded_elems;
      std::vector<io::StateSection> sections;
      if (s.stage == 3) {
        meta["params_range"] = {part.begin(d), part.end(d)};
        sections.push_back({"params", slice(p16, part.begin(d), part.end(d), 2)});
      } else {
        sections.push_back({"params", p16});
      }
      sections.push_back({"master", slice(m32, lo, hi, 4)});
      sections.push_back({"exp_avg", std::vector<std::byte>(static_cast<size_t>(hi - lo) * 4)});
      sections.push_back({"exp_avg_sq", std::vector<std::byte>(static_cast<size_t>(hi - lo) * 4)});
      const int world = s.dp * s.tp;
      io::write_state(world > 1 ? dir / ("rank" + std::to_string(d * s.tp + k)) : dir, meta, sections);
    }
  }
}

std::vector<std::byte> expected(tensor::DType dtype, int tp_rank = 0, int dp = 3) {
  const std::vector<float> master = synthetic_master(zero::make_partition(320, dp).padded_elems, tp_rank);
  const std::vector<std::byte> flat = dtype == tensor::DType::kF32 ? f32_bytes(master) : bf16_bytes(master);
  return concat(io::layout_tensors(io::layout_specs(kLayout, "layout"), dtype, flat));
}

TEST(ConsolidateTest, StageThreeShardsAreAssembled) {
  const fs::path dir = temp_dir("stage3");
  write_synthetic(dir, {});
  const io::ConsolidateResult w = consolidate(dir, io::WeightsDType::kWorking);
  EXPECT_EQ(w.zero_stage, 3);
  EXPECT_EQ(w.step, 5);
  EXPECT_EQ(w.rank_dirs.size(), 3u);
  ASSERT_EQ(w.tensors.size(), 3u);
  EXPECT_EQ(w.tensors[0].shape, (std::vector<int64_t>{3, 50}));
  EXPECT_EQ(w.tensors[2].name, "c");
  EXPECT_EQ(w.num_params, 161);
  EXPECT_EQ(concat(w.tensors), expected(tensor::DType::kBF16));
  const io::ConsolidateResult f = consolidate(dir, io::WeightsDType::kF32);
  EXPECT_EQ(f.section, "master");
  EXPECT_EQ(concat(f.tensors), expected(tensor::DType::kF32));
  // Stage 1 (whole params, sharded master) and stage 0 (whole everything) give the same.
  for (int stage : {0, 1}) {
    fs::remove_all(dir);
    write_synthetic(dir, {.stage = stage});
    EXPECT_EQ(concat(consolidate(dir, io::WeightsDType::kWorking).tensors), expected(tensor::DType::kBF16));
    EXPECT_EQ(concat(consolidate(dir, io::WeightsDType::kF32).tensors), expected(tensor::DType::kF32));
  }
  fs::remove_all(dir);
}

TEST(ConsolidateTest, TensorParallelRanksOneAtATimeOrJoinedThroughTheModel) {
  const fs::path dir = temp_dir("tp");
  write_synthetic(dir, {.dp = 2, .tp = 2, .stage = 1});
  // Without tp_rank the parts are joined into the whole model that config.model describes,
  // which these synthetic layouts are not the parts of.
  const std::string msg = error_of<IoError>([&] { consolidate(dir, io::WeightsDType::kWorking); });
  EXPECT_THAT(msg, HasSubstr("'s tp rank 0 does not hold the part of the model its config.model "
                             "describes (the model layout at parameter 0: "));
  EXPECT_THAT(msg, HasSubstr("pass --tp-rank K to write one rank's part (K in 0..1)"));
  for (int k : {0, 1}) {
    SCOPED_TRACE(k);
    io::ConsolidateOptions o;
    o.tp_rank = k;
    o.dtype = io::WeightsDType::kF32;
    const io::ConsolidateResult r = io::consolidate_checkpoint(dir, o);
    // The dp ranks of tp rank k: world ranks dp * tp + k.
    EXPECT_EQ(r.rank_dirs, (std::vector<fs::path>{dir / ("rank" + std::to_string(k)),
                                                  dir / ("rank" + std::to_string(2 + k))}));
    EXPECT_EQ(r.tp_size, 2);
    EXPECT_EQ(r.tp_rank, k);
    EXPECT_EQ(concat(r.tensors), expected(tensor::DType::kF32, k, 2));
  }
  io::ConsolidateOptions o;
  o.tp_rank = 2;
  EXPECT_THAT(error_of<InvalidArgument>([&] { io::consolidate_checkpoint(dir, o); }),
              HasSubstr("tp rank 2 is not in"));
  fs::remove_all(dir);
}

TEST(ConsolidateTest, IncompleteMixedAndForeignDirectoriesAreRefused) {
  const fs::path dir = temp_dir("errors");
  auto error = [&](const fs::path& d = {}) {
    return error_of<IoError>([&] { consolidate(d.empty() ? dir : d, io::WeightsDType::kWorking); });
  };
  EXPECT_THAT(error(), HasSubstr("no such directory"));
  fs::create_directories(dir);
  EXPECT_THAT(error(), HasSubstr("is not a porter training checkpoint: it has neither meta.json "
                                 "nor rank0/meta.json"));

  // Missing ranks are all named.
  write_synthetic(dir, {.dp = 4, .stage = 3});
  fs::remove_all(dir / "rank1");
  fs::remove(dir / "rank3" / "meta.json");
  std::string msg = error();
  EXPECT_THAT(msg, HasSubstr("was written by 4 ranks (dp 4 x tp 1) but lacks \"" +
                             (dir / "rank1").string() + "\", \"" + (dir / "rank3").string() +
                             "\" (no meta.json: a save that did not complete)"));

  // A rank from another save: the field and both values.
  fs::remove_all(dir);
  write_synthetic(dir, {});
  {
    io::LoadedState s = io::read_state(dir / "rank2");
    s.meta["step"] = 6;
    io::write_state(dir / "rank2", s.meta, s.sections);
  }
  msg = error();
  EXPECT_THAT(msg, HasSubstr("checkpoint ranks disagree on step: \"" + (dir / "rank0").string() +
                             "\" has 5, \"" + (dir / "rank2").string() + "\" has 6"));
  {
    io::LoadedState s = io::read_state(dir / "rank2");
    s.meta["step"] = 5;
    s.meta["layout"]["params"][1]["shape"] = {8};
    io::write_state(dir / "rank2", s.meta, s.sections);
  }
  EXPECT_THAT(error(), HasSubstr("disagree on the model layout at parameter 1: \"" +
                                 (dir / "rank0").string() + "\" has 'b' (7) at offset 192, \"" +
                                 (dir / "rank2").string() + "\" has 'b' (8) at offset 192"));

  // A section of the wrong size, and a corrupt one (io::read_state's checksum).
  fs::remove_all(dir);
  write_synthetic(dir, {});
  {
    io::LoadedState s = io::read_state(dir / "rank1");
    s.sections[0].bytes.resize(10);
    io::write_state(dir / "rank1", s.meta, s.sections);
  }
  EXPECT_THAT(error(), HasSubstr("rank1\": section 'params' has 10 bytes, expected 256: "
                                 "elements [128, 256)"));
  {
    std::fstream f(dir / "rank0" / "params.bin", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(3);
    f.put('\x55');
  }
  EXPECT_THAT(error(), HasSubstr("checksum mismatch"));

  // Replicas that differ (stage 0: every rank holds the whole buffer).
  fs::remove_all(dir);
  write_synthetic(dir, {.dp = 2, .stage = 0});
  {
    io::LoadedState s = io::read_state(dir / "rank1");
    s.sections[0].bytes[2 * 195] ^= std::byte{1};  // 'b' element 3
    io::write_state(dir / "rank1", s.meta, s.sections);
  }
  EXPECT_THAT(error(), HasSubstr("rank1\": params element 195 (parameter 'b' element 3) differs "
                                 "from \"" + (dir / "rank0").string() + "\"'s"));

  // A stage-3 shard that leaves a parameter uncovered.
  fs::remove_all(dir);
  write_synthetic(dir, {});
  {
    io::LoadedState s = io::read_state(dir / "rank1");
    s.meta["params_range"] = {128, 192};
    s.sections[0].bytes.resize(64 * 2);
    io::write_state(dir / "rank1", s.meta, s.sections);
  }
  EXPECT_THAT(error(), HasSubstr("elements [192, 199) of the flat buffer (parameter 'b') are in "
                                 "no rank's params section"));

  // One rank's directory of a multi-rank checkpoint; a foreign meta.json.
  EXPECT_THAT(error(dir / "rank0"), HasSubstr("is one rank's state of a checkpoint written by 3 "
                                              "ranks (dp 3 x tp 1): pass the directory that "
                                              "holds rank0 .. rank2"));
  fs::remove_all(dir);
  io::write_state(dir, {{"kind", "something.else"}}, {});
  EXPECT_THAT(error(), HasSubstr("is not a porter training checkpoint: kind is \"something.else\", "
                                 "expected \"porter.engine\""));
  fs::remove_all(dir);
}

}  // namespace
}  // namespace porter::engine
