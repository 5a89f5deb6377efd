// Sharded Hugging Face loading (Note [Sharded loading] in io/hf_checkpoint.h): each rank's
// range read straight from the files is shard_values of the whole read, bit for bit, for every
// architecture, tensor-parallel size, dtype, range and sharded checkpoint; the errors are the
// whole read's; Transformer::init_values_range is init_values in any range; engines loaded
// through Engine::set_params_host_range hold the training state set_params_host gives (tensor
// parallel 2, ZeRO stage 3 over 2 ranks, bf16 with a partial optimizer offload); and a rank's
// peak resident memory grows by its part plus a few MiB, not by the model.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <limits>
#include <string>
#include <vector>

#include <sys/wait.h>
#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "base/error.h"
#include "comm/communicator.h"
#include "io/hf_checkpoint.h"
#include "io/weights_file.h"
#include "models/factory.h"
#include "models/transformer.h"
#include "tests/engine/engine_test_util.h"

namespace porter::io {
namespace {

namespace fs = std::filesystem;
using engine::testing::bitwise_equal;

fs::path temp_dir(const std::string& name) {
  fs::path p = fs::temp_directory_path() /
               ("porter_hf_sharded_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  fs::create_directories(p);
  return p;
}

config::ModelConfig gpt_model(bool tied) {
  config::ModelConfig m;
  m.layers = 2;
  m.hidden = 32;
  m.heads = 4;
  m.seq_len = 16;
  m.max_positions = 16;
  m.vocab = 61;  // not a multiple of 2 or 4: the last ranks' vocabulary rows are padding
  m.tie_embeddings = tied;
  return m;
}

config::ModelConfig llama_model(config::ModelType type, bool tied) {
  config::ModelConfig m;
  m.type = type;
  m.layers = 2;
  m.hidden = 64;
  m.heads = 4;
  m.kv_heads = 2;
  m.intermediate = 96;
  m.seq_len = 16;
  m.max_positions = 32;
  m.vocab = 67;
  m.tie_embeddings = tied;
  return m;
}

// porter's init at `seed` written to `dir` as `dtype`; returns the model at tensor_parallel 1.
void write_model(const fs::path& dir, config::ModelConfig m, tensor::DType dtype, uint64_t seed) {
  m.tensor_parallel = 1;
  const models::Transformer whole(m);
  write_hf_checkpoint(dir, m, whole.layout(), whole.init_values(seed), dtype);
}

// The directory's model.safetensors split into two files listed by model.safetensors.index.json,
// as save_pretrained writes large models.
void split_into_shards(const fs::path& dir) {
  WeightMetadata meta;
  const std::vector<WeightTensor> all = read_safetensors(dir / "model.safetensors", &meta);
  const size_t half = all.size() / 2;
  const std::vector<WeightTensor> a(all.begin(), all.begin() + static_cast<long>(half));
  const std::vector<WeightTensor> b(all.begin() + static_cast<long>(half), all.end());
  write_safetensors(dir / "model-00001-of-00002.safetensors", a, meta);
  write_safetensors(dir / "model-00002-of-00002.safetensors", b, meta);
  nlohmann::json index;
  index["metadata"] = {{"total_size", 0}};
  for (const WeightTensor& t : a) index["weight_map"][t.name] = "model-00001-of-00002.safetensors";
  for (const WeightTensor& t : b) index["weight_map"][t.name] = "model-00002-of-00002.safetensors";
  std::ofstream(dir / "model.safetensors.index.json") << index.dump(2);
  fs::remove(dir / "model.safetensors");
}

// Rank `tp_rank`'s part of `m` at tensor_parallel `tp`.
std::unique_ptr<models::Transformer> part_of(config::ModelConfig m, int tp, int tp_rank) {
  m.tensor_parallel = tp;
  return models::build_model(m, tp_rank);
}

void expect_same_counts(const HfWeights& a, const HfWeights& b, const std::string& what) {
  EXPECT_EQ(a.files, b.files) << what;
  EXPECT_EQ(a.tensors, b.tensors) << what;
  EXPECT_EQ(a.skipped, b.skipped) << what;
  EXPECT_EQ(a.dtypes, b.dtypes) << what;
  EXPECT_EQ(a.bytes, b.bytes) << what;
}

// Every rank's part of the model in `dir`, read whole and in three uneven ranges (and past
// the layout, where the engine's padding is), against shard_values of the whole read.
void expect_parts_equal_shard_values(const fs::path& dir, const config::ModelConfig& m, int tp,
                                     const std::string& what) {
  const HfWeights whole = read_hf_weights(dir, m);
  for (int r = 0; r < tp; ++r) {
    const std::string at = what + " tp " + std::to_string(tp) + " rank " + std::to_string(r);
    const auto part = part_of(m, tp, r);
    const std::vector<float> want = part->shard_values(whole.values);
    const int64_t n = static_cast<int64_t>(want.size()), padded = n + 37;
    std::vector<float> got(static_cast<size_t>(padded), -1.0f);
    const HfWeights info = read_hf_weights_part(dir, *part, 0, got);
    EXPECT_TRUE(info.values.empty()) << at;
    expect_same_counts(info, whole, at);
    EXPECT_TRUE(bitwise_equal(std::vector<float>(got.begin(), got.begin() + n), want)) << at;
    EXPECT_TRUE(std::all_of(got.begin() + n, got.end(), [](float v) { return v == 0.0f; })) << at;
    // Ranges that cut through parameters, rows and the transposed tensors' columns.
    const int64_t cuts[] = {0, n / 3 + 5, 2 * n / 3 + 11, padded};
    std::vector<float> pieces;
    for (int k = 0; k < 3; ++k) {
      std::vector<float> piece(static_cast<size_t>(cuts[k + 1] - cuts[k]), -1.0f);
      read_hf_weights_part(dir, *part, cuts[k], piece);
      pieces.insert(pieces.end(), piece.begin(), piece.end());
    }
    EXPECT_TRUE(bitwise_equal(pieces, got)) << at << " in three ranges";
  }
}

struct ArchCase {
  std::string name;
  config::ModelConfig model;
  std::vector<int> tps;
};

std::vector<ArchCase> arch_cases() {
  return {{"gpt2 untied", gpt_model(false), {1, 2, 4}},
          {"gpt2 tied", gpt_model(true), {1, 2, 4}},
          {"llama", llama_model(config::ModelType::kLlama, false), {1, 2}},
          {"qwen2 tied", llama_model(config::ModelType::kQwen2, true), {1, 2}}};
}

TEST(HfShardedLoad, EveryRanksRangeIsShardValuesOfTheWholeReadBitForBit) {
  const fs::path root = temp_dir("parts");
  for (const ArchCase& a : arch_cases()) {
    for (tensor::DType dtype : {tensor::DType::kF32, tensor::DType::kBF16, tensor::DType::kF16}) {
      const std::string what = a.name + " " + std::string(tensor::dtype_name(dtype));
      const fs::path dir = root / "model";
      fs::remove_all(dir);
      write_model(dir, a.model, dtype, 3);
      for (int tp : a.tps) expect_parts_equal_shard_values(dir, a.model, tp, what);
    }
  }
  fs::remove_all(root);
}

// The init by range (what an engine can load instead of the whole model's init at tensor
// parallel t): init_values' elements, bit for bit, in any range.
TEST(HfShardedLoad, InitValuesRangeIsInitValuesBitForBit) {
  for (const ArchCase& a : arch_cases()) {
    for (int tp : a.tps) {
      for (int r = 0; r < tp; ++r) {
        const std::string at = a.name + " tp " + std::to_string(tp) + " rank " + std::to_string(r);
        const auto part = part_of(a.model, tp, r);
        const std::vector<float> want = part->init_values(17);
        const int64_t n = static_cast<int64_t>(want.size()), padded = n + 9;
        const int64_t cuts[] = {0, n / 4 + 3, n / 2 + 1, padded};
        std::vector<float> got;
        for (int k = 0; k < 3; ++k) {
          std::vector<float> piece(static_cast<size_t>(cuts[k + 1] - cuts[k]), -1.0f);
          part->init_values_range(17, cuts[k], piece);
          got.insert(got.end(), piece.begin(), piece.end());
        }
        EXPECT_TRUE(bitwise_equal(std::vector<float>(got.begin(), got.begin() + n), want)) << at;
        EXPECT_TRUE(std::all_of(got.begin() + n, got.end(), [](float v) { return v == 0.0f; })) << at;
      }
    }
  }
}

TEST(HfShardedLoad, ShardedCheckpointsWithAnIndexReadTheSame) {
  const fs::path root = temp_dir("index");
  for (const ArchCase& a : arch_cases()) {
    const fs::path dir = root / "model";
    fs::remove_all(dir);
    write_model(dir, a.model, tensor::DType::kBF16, 5);
    split_into_shards(dir);
    for (int tp : a.tps) expect_parts_equal_shard_values(dir, a.model, tp, a.name + " sharded");
    EXPECT_EQ(read_hf_weights(dir, a.model).files.size(), 2u);
  }
  fs::remove_all(root);
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// The file's tensor `name` with element `index` set to `value` (f32 files).
void poke(const fs::path& file, const std::string& name, int64_t index, float value) {
  WeightMetadata meta;
  std::vector<WeightTensor> all = read_safetensors(file, &meta);
  for (WeightTensor& t : all) {
    if (t.name == name) std::memcpy(t.bytes.data() + index * 4, &value, 4);
  }
  write_safetensors(file, all, meta);
}

TEST(HfShardedLoad, ErrorsAreTheWholeReadsAndEachRankFindsTheValuesItReads) {
  const fs::path dir = temp_dir("errors");
  const config::ModelConfig m = gpt_model(false);
  write_model(dir, m, tensor::DType::kF32, 3);
  // fc1 (c_fc) is column-parallel and stored transposed (in, out) = (32, 128): element 70 is
  // file (0, 70), porter's row 70, which tensor-parallel rank 1 of 2 holds.
  poke(dir / "model.safetensors", "transformer.h.1.mlp.c_fc.weight", 70,
       std::numeric_limits<float>::quiet_NaN());
  const std::string whole = error_of([&] { read_hf_weights(dir, m); });
  EXPECT_THAT(whole, ::testing::HasSubstr("tensor 'transformer.h.1.mlp.c_fc.weight': element 70 "
                                          "[0, 70] is nan; porter refuses weights that are not "
                                          "finite"));
  auto read_part = [&](int tp, int r) {
    const auto part = part_of(m, tp, r);
    std::vector<float> out(static_cast<size_t>(part->layout().total_elems()));
    return error_of([&] { read_hf_weights_part(dir, *part, 0, out); });
  };
  EXPECT_EQ(read_part(1, 0), whole);
  EXPECT_EQ(read_part(2, 1), whole);
  EXPECT_EQ(read_part(2, 0), "");  // rank 0's rows do not hold it

  // A shape config.json does not give: every rank refuses it, with the whole read's message.
  write_model(dir, m, tensor::DType::kF32, 3);
  {
    WeightMetadata meta;
    std::vector<WeightTensor> all = read_safetensors(dir / "model.safetensors", &meta);
    for (WeightTensor& t : all) {
      if (t.name == "transformer.h.0.ln_2.weight") {
        t.shape = {16};
        t.bytes.resize(16 * 4);
      }
    }
    write_safetensors(dir / "model.safetensors", all, meta);
  }
  const std::string shape = error_of([&] { read_hf_weights(dir, m); });
  EXPECT_THAT(shape, ::testing::HasSubstr("tensor 'transformer.h.0.ln_2.weight': shape (16), but "
                                          "the model's config.json gives (32)"));
  EXPECT_EQ(read_part(1, 0), shape);
  EXPECT_EQ(read_part(2, 0), shape);
  EXPECT_EQ(read_part(2, 1), shape);

  // A tied lm_head.weight that differs from the embedding: every rank compares them whole.
  const config::ModelConfig t = gpt_model(true);
  write_model(dir, t, tensor::DType::kF32, 3);
  {
    WeightMetadata meta;
    std::vector<WeightTensor> all = read_safetensors(dir / "model.safetensors", &meta);
    for (const WeightTensor& w : std::vector<WeightTensor>(all)) {
      if (w.name == "transformer.wte.weight") {
        WeightTensor head = w;
        head.name = "lm_head.weight";
        const float v = 0.5f;
        std::memcpy(head.bytes.data() + 1000 * 4, &v, 4);
        all.push_back(head);
      }
    }
    write_safetensors(dir / "model.safetensors", all, meta);
  }
  const std::string tied = error_of([&] { read_hf_weights(dir, t); });
  EXPECT_THAT(tied, ::testing::HasSubstr("tensor 'lm_head.weight' differs from "
                                         "'transformer.wte.weight' at element 1000 [31, 8]"));
  for (int r = 0; r < 2; ++r) {
    const auto part = part_of(t, 2, r);
    std::vector<float> out(static_cast<size_t>(part->layout().total_elems()));
    EXPECT_EQ(error_of([&] { read_hf_weights_part(dir, *part, 0, out); }), tied) << r;
  }
  fs::remove_all(dir);
}

// Engines loaded both ways on thread ranks: set_params_host(shard_values(whole)) without
// optimizer offload (its state does not depend on it: Engine promise 1), and
// set_params_host_range(read_hf_weights_part) with the case's offload. The second's state as
// loaded holds the values shard_values gives (the working copy rounded to the compute dtype,
// the master in f32); after one step both hold the same state bit for bit.
struct EngineCase {
  std::string name;
  int world = 1, tp = 1, stage = 0;
  bool bf16 = false;
  double offload_ratio = 0.0;  // 0: no optimizer offload
};

config::Config engine_config(const EngineCase& k, bool offload) {
  config::Config c = engine::testing::zero_config(k.world, k.stage);
  c.porter.model.tensor_parallel = k.tp;
  c.train_batch_size = c.train_micro_batch_size_per_gpu * (k.world / k.tp);
  c.bf16.enabled = k.bf16;
  if (offload && k.offload_ratio > 0) {
    c.zero_optimization.offload_optimizer.device = config::OffloadDevice::kCpu;
    c.zero_optimization.offload_optimizer.ratio = k.offload_ratio;
  }
  return c;
}

// `section` of a state as loaded holds `want` (the padded buffer's values) over its range: in
// f32, or rounded to bf16.
void expect_section_holds(const engine::testing::SavedState::Section& section,
                          const std::vector<float>& want, const std::string& what) {
  for (int64_t i = 0; i < section.elems; ++i) {
    const float v = want.at(static_cast<size_t>(section.begin + i));
    const std::byte* got = section.bytes.data() + static_cast<size_t>(i) * section.elem_bytes;
    bool same = false;
    if (section.elem_bytes == 4) {
      same = std::memcmp(got, &v, 4) == 0;
    } else {
      const uint16_t h = tensor::f32_to_bf16(v);
      same = std::memcmp(got, &h, 2) == 0;
    }
    if (!same) {
      ADD_FAILURE() << what << ": section " << section.name << " element " << section.begin + i;
      return;
    }
  }
}

void expect_engines_load_alike(const EngineCase& k, const fs::path& dir) {
  const config::Config ref = engine_config(k, false), c = engine_config(k, true);
  write_model(dir, c.porter.model, tensor::DType::kBF16, 9);
  const std::vector<float> whole = read_hf_weights(dir, c.porter.model).values;
  std::vector<engine::testing::SavedState> loaded(k.world), after_a(k.world), after_b(k.world);
  std::vector<std::vector<float>> params_a(k.world), params_b(k.world), want(k.world);
  std::vector<double> loss_a(k.world), loss_b(k.world);
  auto errors = comm::run_thread_ranks(k.world, [&](int rank, std::shared_ptr<comm::Store> store) {
    auto device = engine::testing::cpu_device();
    comm::CommOptions o;
    o.timeout = comm::Seconds{c.porter.comm.timeout_s};
    std::shared_ptr<comm::Communicator> world = comm::make_communicator(*device, store, rank, k.world, o);
    const comm::ProcessGroups g = comm::make_process_groups(world, k.tp);
    const io::DataSource data(c.porter.data, c.porter.model.vocab, c.train_micro_batch_size_per_gpu,
                              c.porter.model.seq_len);
    const auto batches = data.rank_batches(0, c.gradient_accumulation_steps, g.dp_rank, g.dp_size);
    const auto part = models::build_model(c.porter.model, g.tp_rank);
    const size_t r = static_cast<size_t>(rank);
    want[r] = part->shard_values(whole);
    {
      engine::Engine e(*device, std::make_unique<engine::TransformerModel>(ref.porter.model, g.tp_rank),
                       ref, g);
      e.set_params_host(want[r]);
      params_a[r] = e.params_host();
      loss_a[r] = e.train_step(batches).loss;
      after_a[r] = engine::testing::saved_state(e);
    }
    {
      engine::Engine e(*device, std::make_unique<engine::TransformerModel>(c.porter.model, g.tp_rank),
                       c, g);
      HfWeights info;
      e.set_params_host_range([&](int64_t begin, std::span<float> values) {
        info = read_hf_weights_part(dir, *part, begin, values);
      });
      EXPECT_EQ(info.tensors, static_cast<int64_t>(part->layout().entries().size()));
      loaded[r] = engine::testing::saved_state(e);
      params_b[r] = e.params_host();
      loss_b[r] = e.train_step(batches).loss;
      after_b[r] = engine::testing::saved_state(e);
    }
  });
  for (auto& err : errors) {
    if (err) std::rethrow_exception(err);
  }
  for (int r = 0; r < k.world; ++r) {
    const std::string at = k.name + " rank " + std::to_string(r);
    EXPECT_TRUE(bitwise_equal(params_a[r], params_b[r])) << at;
    EXPECT_EQ(loss_a[r], loss_b[r]) << at;
    std::vector<float> padded = want[r];
    padded.resize(static_cast<size_t>(loaded[r].padded_elems), 0.0f);
    std::vector<std::string> names;
    for (const auto& section : loaded[r].sections) {
      names.push_back(section.name);
      if (section.name == "params" || section.name == "master") {
        expect_section_holds(section, padded, at);
      } else {
        expect_section_holds(section, std::vector<float>(padded.size(), 0.0f), at);  // moments
      }
    }
    EXPECT_THAT(names, ::testing::Contains("params")) << at;
    if (k.bf16) {
      EXPECT_THAT(names, ::testing::Contains("master")) << at;
    }
  }
  engine::testing::expect_same_state(after_a, after_b, k.name + ": after a step");
}

TEST(HfShardedLoad, EnginesLoadedByRangeHoldTheSameStateBitForBit) {
  const fs::path dir = temp_dir("engines");
  for (const EngineCase& k : {EngineCase{"tp 1 stage 0", 1, 1, 0},
                              EngineCase{"tp 2 stage 1 bf16", 2, 2, 1, true},
                              EngineCase{"stage 3 over 2 ranks", 2, 1, 3},
                              EngineCase{"stage 3 over 2 ranks, bf16, half offloaded", 2, 1, 3, true, 0.5},
                              EngineCase{"stage 3, f32, offloaded", 2, 1, 3, false, 1.0},
                              EngineCase{"tp 2 x dp 2 stage 3 bf16", 4, 2, 3, true}}) {
    fs::remove_all(dir);
    expect_engines_load_alike(k, dir);
  }
  fs::remove_all(dir);
}

// Peak resident memory: VmHWM and VmRSS of /proc/self/status, bytes.
int64_t status_bytes(const char* key) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(key, 0) == 0) return std::stoll(line.substr(std::strlen(key))) * 1024;
  }
  return -1;
}

// Runs `load` in a fresh child process and returns by how much it raised the child's peak
// resident set above the resident set it started from (-1 when the child failed).
int64_t peak_growth_bytes(const std::function<void()>& load) {
  int fds[2];
  if (::pipe(fds) != 0) return -1;
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(fds[0]);
    // The high-water mark from here (Linux 4.0+: "5" resets it to the current resident set).
    { std::ofstream("/proc/self/clear_refs") << "5"; }
    const int64_t start = status_bytes("VmRSS:");
    int64_t growth = -1;
    try {
      load();
      growth = status_bytes("VmHWM:") - start;
    } catch (...) {
    }
    (void)!::write(fds[1], &growth, sizeof(growth));
    ::_exit(0);
  }
  ::close(fds[1]);
  int64_t growth = -1;
  if (::read(fds[0], &growth, sizeof(growth)) != sizeof(growth)) growth = -1;
  ::close(fds[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  return growth;
}

// A Llama of 106M parameters (424 MB in f32), written as bf16 (212 MB): rank 1 of tensor
// parallel 2 holds 53M parameters, and a ZeRO stage-3 shard of 2 ranks the same; its largest
// tensors (the embedding and the head) are 8M elements (32 MB in f32).
TEST(HfShardedLoad, PeakResidentMemoryIsTheRanksPartNotTheModel) {
  const fs::path dir = temp_dir("rss");
  config::ModelConfig m;
  m.type = config::ModelType::kLlama;
  m.layers = 8;
  m.hidden = 1024;
  m.heads = 16;
  m.kv_heads = 4;
  m.intermediate = 2816;
  m.vocab = 8192;
  m.seq_len = 64;
  m.max_positions = 64;
  m.tie_embeddings = false;
  // Written in a child, so this process never holds the model.
  ASSERT_GE(peak_growth_bytes([&] { write_model(dir, m, tensor::DType::kBF16, 1); }), 0);
  const models::Transformer whole_model(m);
  const int64_t whole_elems = whole_model.layout().total_elems();
  int64_t largest = 0;
  for (const nn::ParamEntry& e : whole_model.layout().entries()) {
    largest = std::max(largest, e.shape.numel());
  }
  const int64_t slack = int64_t{64} << 20;
  auto mib = [](int64_t b) { return std::to_string(b >> 20) + " MiB"; };

  // Tensor parallel 2, rank 1: its whole part (what a rank holds below stage 3).
  const auto tp_part = part_of(m, 2, 1);
  const int64_t tp_elems = tp_part->layout().total_elems();
  const int64_t tp_growth = peak_growth_bytes([&] {
    std::vector<float> out(static_cast<size_t>(tp_elems));
    read_hf_weights_part(dir, *tp_part, 0, out);
  });
  // Stage 3 over 2 ranks at tensor parallel 1, rank 1: its half of the flat buffer.
  const auto whole_part = part_of(m, 1, 0);
  const int64_t half = whole_elems / 2;
  const int64_t z3_growth = peak_growth_bytes([&] {
    std::vector<float> out(static_cast<size_t>(whole_elems - half));
    read_hf_weights_part(dir, *whole_part, half, out);
  });
  // The whole read, for scale: the model in f32 at least.
  const int64_t whole_growth = peak_growth_bytes([&] { read_hf_weights(dir, m); });
  fs::remove_all(dir);

  const int64_t tp_bytes = tp_elems * 4, z3_bytes = (whole_elems - half) * 4;
  std::cout << "model " << mib(whole_elems * 4) << " in f32, largest tensor " << mib(largest * 4)
            << "; peak growth: tp 2 rank 1 " << mib(tp_growth) << " (part " << mib(tp_bytes)
            << "), stage 3 rank 1 of 2 " << mib(z3_growth) << " (shard " << mib(z3_bytes)
            << "), whole read " << mib(whole_growth) << "\n";
  ASSERT_GT(tp_growth, 0);
  ASSERT_GT(z3_growth, 0);
  EXPECT_GE(whole_growth, whole_elems * 4);  // the measurement sees a whole model
  EXPECT_LT(tp_growth, tp_bytes + largest * 4 + slack);
  EXPECT_LT(z3_growth, z3_bytes + largest * 4 + slack);
  EXPECT_LT(tp_growth, whole_elems * 4 * 3 / 4);
  EXPECT_LT(z3_growth, whole_elems * 4 * 3 / 4);
}

}  // namespace
}  // namespace porter::io
