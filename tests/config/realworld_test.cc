// Every real-world DeepSpeed config in tests/config/realworld is accepted, at the world sizes
// its batch numbers allow, with exactly the warnings and notes expected.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "config/parse.h"

namespace porter::config {
namespace {

const std::filesystem::path kDir = PORTER_REALWORLD_CONFIG_DIR;

std::vector<std::string> texts(const std::vector<Warning>& warnings) {
  std::vector<std::string> out;
  for (const Warning& w : warnings) out.push_back(w.text());
  return out;
}

struct RealWorldCase {
  std::string file;
  std::vector<int64_t> world_sizes;  // each one the batch numbers allow
  std::vector<std::string> warnings;
  std::vector<std::string> notes;    // Note [Fixed behaviour] in config/parse.h
};

// No published config has a model: each says which one porter trains.
const std::string kModelNote =
    "porter.model: not given, so porter trains its default model, a GPT of 12 layers, hidden "
    "768, 12 heads, seq_len 1024, vocab 50257; give the model in the config's \"porter\": "
    "{\"model\": {...}} (or key by key with --set, e.g. --set porter.model.layers=4), or load "
    "one with porter.model.from, a Hugging Face model directory";
const std::string kContiguousNote =
    "zero_optimization.contiguous_gradients: porter always keeps gradients contiguous: they "
    "accumulate in one flat buffer (at ZeRO stages 2 and 3, the rank's gradient shard), "
    "whatever the value (the key has no effect)";
const std::string kSubGroupNote =
    "zero_optimization.sub_group_size: porter's AdamW steps the rank's whole optimizer shard "
    "at once (offloaded, the host AdamW updates it in one pass over its threads), with all of "
    "its state allocated for the run; there are no sub-groups (the key has no effect)";

const std::vector<RealWorldCase>& cases() {
  static const std::vector<RealWorldCase> kCases = {
      {"deepspeed__tests__model__megatron_gpt2__ds_config_func_bs8_zero2_offload.json",
       {1, 2, 4, 8},
       {"zero_optimization.cpu_offload: deprecated; use \"offload_optimizer\": {\"device\": "
        "\"cpu\"} instead",
        "activation_checkpointing.partition_activations: true has no effect with "
        "porter.model.tensor_parallel 1: a tensor-parallel group of one rank holds whole "
        "checkpoints"},
       {kModelNote}},
      {"deepspeedexamples__megatron-lm-v1.1.5-zero3__examples__ds_zero_stage_infinity_config.json",
       {1, 2, 16},
       {"zero_optimization.offload_optimizer.device: \"nvme\": porter does not offload to "
        "NVMe; it reads this as \"cpu\" (host memory), which needs the same state to fit in "
        "host memory; use \"cpu\"",
        "zero_optimization.offload_param.device: \"nvme\": porter does not offload to NVMe; it "
        "reads this as \"cpu\" (host memory), which needs the same state to fit in host "
        "memory; use \"cpu\"",
        "zero_optimization.offload_param.max_in_cpu: caps the parameter elements kept in host "
        "memory, for NVMe offload only; porter keeps this state in host memory, so it has no "
        "effect",
        "zero_optimization.stage3_param_persitance_threshold: unknown key, ignored (did you mean "
        "\"stage3_param_persistence_threshold\"?)",
        "aio: porter does not implement this section (asynchronous I/O for NVMe offload); "
        "ignored"},
       {kContiguousNote, kSubGroupNote,
        "zero_optimization.offload_optimizer.nvme_path: porter has no NVMe offload, so the path "
        "is not used (nor zero_optimization.offload_param.nvme_path); offload to host memory "
        "instead, with \"device\": \"cpu\"",
        kModelNote}},
      {"deepspeedexamples__megatron-lm__scripts__ds_zero-offload_10b_config.json",
       {1, 2, 5, 10},
       {"zero_optimization.cpu_offload: deprecated; use \"offload_optimizer\": {\"device\": "
        "\"cpu\"} instead",
        "zero_optimization.comm_overlap: unknown key, ignored (did you mean \"overlap_comm\"?)",
        "activation_checkpointing.partition_activations: true has no effect with "
        "porter.model.tensor_parallel 1: a tensor-parallel group of one rank holds whole "
        "checkpoints"},
       {kContiguousNote, kModelNote}},
      {"deepspeedexamples__megatron-lm__scripts__ds_zero2_config.json",
       {1, 2, 4, 8, 16},
       {"activation_checkpointing.partition_activations: true has no effect with "
        "porter.model.tensor_parallel 1: a tensor-parallel group of one rank holds whole "
        "checkpoints"},
       {kModelNote}},
      {"deepspeedexamples__megatron-lm__scripts__ds_zero3_config.json",
       {1, 4, 16},
       {"activation_checkpointing.partition_activations: true has no effect with "
        "porter.model.tensor_parallel 1: a tensor-parallel group of one rank holds whole "
        "checkpoints"},
       {kModelNote}},
      {"transformers__tests__deepspeed__ds_config_zero3.json",
       {1, 8},
       {"zero_optimization.stage3_gather_fp16_weights_on_model_save: deprecated; use "
        "\"stage3_gather_16bit_weights_on_model_save\" instead"},
       {kContiguousNote, kSubGroupNote, kModelNote}},
  };
  return kCases;
}

TEST(RealWorldConfigs, EveryFileInTheFolderHasACase) {
  size_t json_files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(kDir)) {
    if (entry.path().extension() != ".json") continue;
    ++json_files;
    bool found = false;
    for (const RealWorldCase& c : cases()) found = found || c.file == entry.path().filename();
    EXPECT_TRUE(found) << entry.path() << " has no expectations in realworld_test.cc";
  }
  EXPECT_EQ(json_files, cases().size());
}

TEST(RealWorldConfigs, AcceptedWithExactlyTheExpectedWarnings) {
  for (const RealWorldCase& c : cases()) {
    for (int64_t world_size : c.world_sizes) {
      SCOPED_TRACE(c.file + " at world size " + std::to_string(world_size));
      ParseResult r = parse_config_file(kDir / c.file, ParseOptions{world_size, false});
      EXPECT_EQ(texts(r.warnings), c.warnings);
      EXPECT_EQ(texts(r.notes), c.notes);
      // The printed config reads back equal. Of the warnings, only those about what the
      // settings mean ("has no effect") come back: the printed spelling is canonical.
      ParseResult again = parse_config_string(to_json_string(r.config), ParseOptions{world_size, false});
      EXPECT_EQ(again.config, r.config);
      std::vector<std::string> meaning;
      for (const std::string& w : c.warnings)
        if (w.find("has no effect") != std::string::npos) meaning.push_back(w);
      EXPECT_EQ(texts(again.warnings), meaning);
    }
  }
}

TEST(RealWorldConfigs, StrictRejectsExactlyThoseWithWarnings) {
  for (const RealWorldCase& c : cases()) {
    SCOPED_TRACE(c.file);
    ParseOptions strict{c.world_sizes.front(), true};
    if (c.warnings.empty()) {
      EXPECT_NO_THROW(parse_config_file(kDir / c.file, strict));
    } else {
      try {
        parse_config_file(kDir / c.file, strict);
        ADD_FAILURE() << "strict parse accepted a config with warnings";
      } catch (const ConfigError& e) {
        for (const std::string& w : c.warnings) {
          EXPECT_NE(std::string(e.what()).find(w), std::string::npos) << e.what();
        }
        // Notes are never errors.
        EXPECT_EQ(std::string(e.what()).find("porter.model: not given"), std::string::npos)
            << e.what();
        EXPECT_EQ(std::string(e.what()).find("(the key has no effect)"), std::string::npos)
            << e.what();
      }
    }
  }
}

TEST(RealWorldConfigs, Bs8Zero2OffloadResolves) {
  ParseResult r = parse_config_file(
      kDir / "deepspeed__tests__model__megatron_gpt2__ds_config_func_bs8_zero2_offload.json",
      ParseOptions{2, false});
  const Config& c = r.config;
  EXPECT_EQ(c.train_batch_size, 8);
  EXPECT_EQ(c.train_micro_batch_size_per_gpu, 4);
  EXPECT_EQ(c.gradient_accumulation_steps, 1);
  EXPECT_EQ(c.steps_per_print, 1);
  EXPECT_EQ(c.zero_optimization.stage, 2);
  EXPECT_EQ(c.zero_optimization.reduce_bucket_size_elems, 7'000'000);
  EXPECT_EQ(c.zero_optimization.allgather_bucket_size_elems, 7'000'000);
  EXPECT_FALSE(c.zero_optimization.overlap_comm);
  EXPECT_EQ(c.zero_optimization.offload_optimizer.device, OffloadDevice::kCpu);
  EXPECT_TRUE(c.zero_optimization.offload_optimizer.pin_memory);
  EXPECT_TRUE(c.fp16.enabled);
  EXPECT_EQ(c.fp16.loss_scale, 0.0);
  ASSERT_TRUE(c.activation_checkpointing);
  EXPECT_TRUE(c.activation_checkpointing->partition_activations);
  EXPECT_TRUE(c.activation_checkpointing->contiguous_memory_optimization);
  EXPECT_FALSE(c.activation_checkpointing->number_checkpoints);
  // Contiguous memory without number_checkpoints is fine in porter: the plan is known.
  EXPECT_EQ(c.porter.checkpointing.policy, CheckpointPolicy::kFull);
}

TEST(RealWorldConfigs, InfinityConfigReadsFloatIntegersAndNvme) {
  ParseResult r = parse_config_file(
      kDir / "deepspeedexamples__megatron-lm-v1.1.5-zero3__examples__ds_zero_stage_infinity_config.json");
  const ZeroConfig& z = r.config.zero_optimization;
  EXPECT_EQ(r.config.train_batch_size, 4);
  EXPECT_EQ(z.stage, 3);
  EXPECT_EQ(z.stage3_max_live_parameters_elems, 1'000'000'000);
  EXPECT_EQ(z.stage3_max_reuse_distance_elems, 100'000'000);
  EXPECT_EQ(z.stage3_prefetch_bucket_size_elems, 50'000'000);
  EXPECT_EQ(z.stage3_param_persistence_threshold_elems, 100'000);  // the typo'd key is ignored
  EXPECT_EQ(z.sub_group_size_elems, 100'000'000);
  EXPECT_EQ(z.offload_optimizer.device, OffloadDevice::kCpu);
  EXPECT_EQ(z.offload_param.device, OffloadDevice::kCpu);
  EXPECT_EQ(z.offload_param.max_in_cpu_elems, 1);
  EXPECT_EQ(r.config.fp16.loss_scale, 1024.0);
  EXPECT_TRUE(r.config.wall_clock_breakdown);
}

TEST(RealWorldConfigs, TransformersAutoValuesResolve) {
  ParseResult r = parse_config_file(kDir / "transformers__tests__deepspeed__ds_config_zero3.json",
                                    ParseOptions{8, false});
  const Config& c = r.config;
  EXPECT_EQ(c.train_micro_batch_size_per_gpu, 1);
  EXPECT_EQ(c.gradient_accumulation_steps, 1);
  EXPECT_EQ(c.train_batch_size, 8);
  EXPECT_EQ(c.gradient_clipping, 1.0);
  EXPECT_FALSE(c.fp16.enabled);
  ASSERT_TRUE(c.optimizer);
  EXPECT_EQ(c.optimizer->type, OptimizerType::kAdamW);
  EXPECT_EQ(c.optimizer->lr, 1e-3);
  EXPECT_EQ(c.optimizer->beta2, 0.999);
  ASSERT_TRUE(c.scheduler);
  EXPECT_EQ(c.scheduler->warmup_max_lr, 1e-3);
  EXPECT_EQ(c.scheduler->warmup_num_steps, 1000);
  // Sized from porter.model.hidden (768 by default), as the HF Trainer does.
  EXPECT_EQ(c.zero_optimization.reduce_bucket_size_elems, 768 * 768);
  EXPECT_EQ(c.zero_optimization.stage3_prefetch_bucket_size_elems, 768 * 768 * 9 / 10);
  EXPECT_EQ(c.zero_optimization.stage3_param_persistence_threshold_elems, 7680);
  EXPECT_EQ(c.zero_optimization.sub_group_size_elems, 100'000'000'000'000);
  EXPECT_TRUE(c.zero_optimization.stage3_gather_16bit_weights_on_model_save);
  EXPECT_EQ(c.zero_optimization.offload_param.device, OffloadDevice::kCpu);
  EXPECT_EQ(c.steps_per_print, 2000);
  // Note [Progress cadence]: steps_per_print paces porter train's progress lines.
  EXPECT_EQ(c.porter.train.log_every, 2000);
}

TEST(RealWorldConfigs, BatchNumbersThatDoNotDivideTheWorldSizeAreRejected) {
  // 30 = micro x 3 x world: world size 4 leaves no integer micro batch.
  try {
    parse_config_file(kDir / "deepspeedexamples__megatron-lm__scripts__ds_zero-offload_10b_config.json",
                      ParseOptions{4, false});
    ADD_FAILURE() << "accepted";
  } catch (const ConfigError& e) {
    EXPECT_EQ(e.path(), "train_batch_size");
    EXPECT_NE(std::string(e.what()).find("30"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("world size 4"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace porter::config
