// `porter consolidate` in-process: a checkpoint from `porter train --save` becomes a
// safetensors file with the layout's names and shapes, the metadata and a summary; a
// tensor-parallel checkpoint becomes the whole model (its ranks joined) or one rank's part;
// bad arguments and ranks that are not the model's parts get their exit codes and messages.
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "cli/app.h"
#include "io/consolidate.h"
#include "io/state_file.h"
#include "io/weights_file.h"
#include "models/factory.h"
#include "zero/partition.h"
#include "tests/cli/cli_test_util.h"

namespace porter::cli {
namespace {

using testing::CliRun;
using testing::contains;
using testing::porter;

namespace fs = std::filesystem;
using nlohmann::json;

const char* kConfig = R"({
  "train_micro_batch_size_per_gpu": 2,
  "gradient_accumulation_steps": 1,
  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
  "bf16": {"enabled": BF16},
  "porter": {
    "model": {"layers": 2, "hidden": 32, "heads": 2, "seq_len": 16, "vocab": 64},
    "data": {"type": "synthetic", "seed": 3},
    "device": {"type": "cpu", "memory_limit": "64MiB", "threads": 1},
    "train": {"steps": 2, "log_every": 1}
  }
})";

class CliConsolidate : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("porter_cli_consolidate_" +
            std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Trains the tiny config for 2 steps and saves into dir_/ckpt.
  fs::path train(bool bf16) {
    std::string text = kConfig;
    text.replace(text.find("BF16"), 4, bf16 ? "true" : "false");
    const fs::path cfg = dir_ / "config.json";
    std::ofstream(cfg) << text;
    const fs::path ckpt = dir_ / "ckpt";
    const CliRun r = porter({"train", "--config", cfg.string(), "--save", ckpt.string()});
    EXPECT_EQ(r.rc, kExitOk) << r.err;
    return ckpt;
  }

  fs::path dir_;
};

json read_json(const fs::path& p) {
  std::ifstream in(p);
  return json::parse(in);
}

TEST_F(CliConsolidate, WritesTheLayoutsTensorsAndASummary) {
  for (bool bf16 : {false, true}) {
    SCOPED_TRACE(bf16 ? "bf16" : "f32");
    const fs::path ckpt = train(bf16);
    const json layout = read_json(ckpt / "meta.json")["layout"];
    for (const std::string dtype : {"working", "f32"}) {
      SCOPED_TRACE(dtype);
      const fs::path out = dir_ / ("model-" + dtype + ".safetensors");
      const CliRun r = porter({"consolidate", "--checkpoint", ckpt.string(), "--out", out.string(),
                               "--dtype", dtype});
      ASSERT_EQ(r.rc, kExitOk) << r.err;
      io::WeightMetadata meta;
      const std::vector<io::WeightTensor> tensors = io::read_safetensors(out, &meta);
      ASSERT_EQ(tensors.size(), layout["params"].size());
      int64_t params = 0;
      for (size_t i = 0; i < tensors.size(); ++i) {
        EXPECT_EQ(tensors[i].name, layout["params"][i]["name"]);
        EXPECT_EQ(json(tensors[i].shape), layout["params"][i]["shape"]);
        params += tensors[i].numel();
      }
      const tensor::DType want = dtype == "f32" || !bf16 ? tensor::DType::kF32 : tensor::DType::kBF16;
      for (const io::WeightTensor& t : tensors) EXPECT_EQ(t.dtype, want) << t.name;
      EXPECT_EQ(meta, (io::WeightMetadata{{"format", "pt"},
                                              {"porter.step", "2"},
                                              {"porter.source", ckpt.string()}}));
      // The summary: tensors, parameters, bytes, dtype, step, ranks read.
      EXPECT_TRUE(contains(r.out, "consolidated " + ckpt.string() + " -> " + out.string())) << r.out;
      EXPECT_TRUE(contains(r.out, "  step        2\n")) << r.out;
      EXPECT_TRUE(contains(r.out, "  ranks read  1 (dp 1, ZeRO stage 0)\n")) << r.out;
      EXPECT_TRUE(contains(r.out, "  tensors     " + std::to_string(tensors.size()) + "\n")) << r.out;
      EXPECT_TRUE(contains(r.out, "  parameters  " + std::to_string(params) + " (")) << r.out;
      EXPECT_TRUE(contains(r.out, "  bytes       " +
                                      std::to_string(params * static_cast<int64_t>(tensor::dtype_size(want))) +
                                      " (")) << r.out;
      const std::string origin = dtype == "f32" && bf16 ? "f32 (the f32 master weights; trained in bf16)"
                                 : bf16                 ? "bf16 (the working parameters)"
                                                        : "f32 (the working parameters)";
      EXPECT_TRUE(contains(r.out, "  dtype       " + origin + "\n")) << r.out;
    }
    fs::remove_all(ckpt);
  }
}

// The one-rank checkpoint `ckpt` as two tensor-parallel ranks would have saved it: every
// section split into the parts of tensor_parallel 2 (io::split_tensor_parallel), with those
// parts' layouts.
fs::path as_tensor_parallel(const fs::path& ckpt, const fs::path& tp) {
  const io::CheckpointInfo info = io::inspect_checkpoint(ckpt);
  config::ModelConfig model = io::checkpoint_model_config(info);
  model.tensor_parallel = 2;
  const io::LoadedState one = io::read_state(ckpt);
  for (int k = 0; k < 2; ++k) {
    const std::unique_ptr<models::Transformer> part_model = models::build_model(model, k);
    const nn::ParamLayout& layout = part_model->layout();
    const int64_t padded = zero::make_partition(layout.total_elems(), 1).padded_elems;
    json meta = one.meta;
    meta.erase("sections");
    meta.erase("format_version");
    meta["config"]["model"]["tensor_parallel"] = 2;
    json params = json::array();
    for (const nn::ParamEntry& e : layout.entries()) {
      params.push_back({{"name", e.name}, {"shape", e.shape.to_vector()}, {"offset", e.offset_elems}});
    }
    meta["layout"] = {{"total_elems", layout.total_elems()}, {"params", params}};
    std::vector<io::StateSection> sections;
    for (const io::StateSection& s : one.sections) {
      const size_t elem = io::section_elem_bytes(info, s.name);
      std::vector<std::byte> part = io::split_tensor_parallel(model, k, s.bytes, elem);
      part.resize(static_cast<size_t>(padded) * elem);
      sections.push_back({s.name, std::move(part)});
    }
    io::write_state(tp / ("rank" + std::to_string(k)), meta, sections);
  }
  return tp;
}

TEST_F(CliConsolidate, TensorParallelCheckpointsGiveTheWholeModelOrOneRanksPart) {
  for (bool bf16 : {false, true}) {
    SCOPED_TRACE(bf16 ? "bf16" : "f32");
    const fs::path ckpt = train(bf16);
    const fs::path tp = as_tensor_parallel(ckpt, dir_ / "tp");
    for (const std::string dtype : {"working", "f32"}) {
      SCOPED_TRACE(dtype);
      // The tp ranks joined are the one-rank checkpoint's weights, bit for bit.
      const fs::path want = dir_ / "one.safetensors", got = dir_ / "joined.safetensors";
      ASSERT_EQ(porter({"consolidate", "--checkpoint", ckpt.string(), "--out", want.string(),
                        "--dtype", dtype}).rc, kExitOk);
      const CliRun r = porter({"consolidate", "--checkpoint", tp.string(), "--out", got.string(),
                               "--dtype", dtype});
      ASSERT_EQ(r.rc, kExitOk) << r.err;
      EXPECT_TRUE(contains(r.out, "  ranks read  2 (dp 1 x tp 2: the tp ranks' parts joined into "
                                  "the whole model, ZeRO stage 0)\n")) << r.out;
      io::WeightMetadata meta;
      const std::vector<io::WeightTensor> joined = io::read_safetensors(got, &meta);
      const std::vector<io::WeightTensor> whole = io::read_safetensors(want);
      EXPECT_EQ(meta.count("porter.tp_rank"), 0u);
      ASSERT_EQ(joined.size(), whole.size());
      for (size_t i = 0; i < whole.size(); ++i) {
        EXPECT_EQ(joined[i].name, whole[i].name);
        EXPECT_EQ(joined[i].shape, whole[i].shape) << whole[i].name;
        EXPECT_EQ(joined[i].dtype, whole[i].dtype) << whole[i].name;
        EXPECT_TRUE(joined[i].bytes == whole[i].bytes) << whole[i].name;
      }
    }
    // One rank's part with --tp-rank: its layout's (split) shapes.
    const fs::path out = dir_ / "tp1.safetensors";
    CliRun r = porter({"consolidate", "--checkpoint", tp.string(), "--out", out.string(), "--tp-rank", "1"});
    ASSERT_EQ(r.rc, kExitOk) << r.err;
    EXPECT_TRUE(contains(r.out, "  ranks read  1 of 2 (dp 1 x tp 2: tp rank 1's, ZeRO stage 0)\n")) << r.out;
    io::WeightMetadata meta;
    const std::vector<io::WeightTensor> part = io::read_safetensors(out, &meta);
    EXPECT_EQ(meta["porter.tp_rank"], "1");
    const json layout = read_json(tp / "rank1" / "meta.json")["layout"];
    ASSERT_EQ(part.size(), layout["params"].size());
    for (size_t i = 0; i < part.size(); ++i) EXPECT_EQ(json(part[i].shape), layout["params"][i]["shape"]);
    r = porter({"consolidate", "--checkpoint", tp.string(), "--out", out.string(), "--tp-rank", "2"});
    EXPECT_EQ(r.rc, kExitInvalid);
    EXPECT_TRUE(contains(r.err, "tp rank 2 is not in")) << r.err;
    fs::remove_all(ckpt);
    fs::remove_all(tp);
  }
}

TEST_F(CliConsolidate, TensorParallelRanksThatAreNotTheModelsPartsAreNotJoined) {
  const fs::path ckpt = train(false);
  // Two "tensor-parallel ranks" that are copies of the one-rank state: not tensor_parallel 2's
  // parts of the model.
  const fs::path tp = dir_ / "tp";
  for (const char* r : {"rank0", "rank1"}) {
    io::LoadedState s = io::read_state(ckpt);
    s.meta["config"]["model"]["tensor_parallel"] = 2;
    io::write_state(tp / r, s.meta, s.sections);
  }
  const fs::path out = dir_ / "tp.safetensors";
  CliRun r = porter({"consolidate", "--checkpoint", tp.string(), "--out", out.string()});
  EXPECT_EQ(r.rc, kExitInvalid);
  EXPECT_TRUE(contains(r.err, "'s tp rank 0 does not hold the part of the model its config.model "
                              "describes (the model layout at parameter 0: ")) << r.err;
  EXPECT_TRUE(contains(r.err, "so the tp ranks cannot be joined into the whole model; pass "
                              "--tp-rank K to write one rank's part (K in 0..1)")) << r.err;
  EXPECT_FALSE(fs::exists(out));
  r = porter({"consolidate", "--checkpoint", tp.string(), "--out", out.string(), "--tp-rank", "1"});
  ASSERT_EQ(r.rc, kExitOk) << r.err;
}

TEST_F(CliConsolidate, BadArgumentsAndMissingCheckpoints) {
  const std::string out = (dir_ / "x.safetensors").string();
  CliRun r = porter({"consolidate", "--checkpoint", (dir_ / "none").string(), "--out", out});
  EXPECT_EQ(r.rc, kExitInvalid);
  EXPECT_TRUE(contains(r.err, "none\": no such directory")) << r.err;
  r = porter({"consolidate", "--checkpoint", dir_.string(), "--out", out});
  EXPECT_EQ(r.rc, kExitInvalid);
  EXPECT_TRUE(contains(r.err, "is not a porter training checkpoint")) << r.err;
  r = porter({"consolidate", "--checkpoint", dir_.string(), "--out", out, "--dtype", "f16"});
  EXPECT_EQ(r.rc, kExitUsage);
  EXPECT_TRUE(contains(r.err, "--dtype")) << r.err;
  r = porter({"consolidate", "--checkpoint", dir_.string()});
  EXPECT_EQ(r.rc, kExitUsage);
  EXPECT_TRUE(contains(r.err, "--out is required")) << r.err;
  EXPECT_FALSE(fs::exists(out));
}

}  // namespace
}  // namespace porter::cli
