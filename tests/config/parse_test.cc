// What valid configs resolve to: defaults, batch inference, number forms, "auto", aliases,
// comments, warnings and the checkpoint policy.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "config/parse.h"

namespace porter::config {
namespace {

ParseResult parse(const std::string& json, int64_t world_size = 1) {
  return parse_config_string(json, ParseOptions{world_size, false});
}

std::vector<std::string> warnings_of(const std::string& json) {
  std::vector<std::string> out;
  for (const Warning& w : parse(json).warnings) out.push_back(w.text());
  return out;
}

TEST(ConfigDefaults, AreDeepSpeedsAndTheIssues) {
  Config c = parse(R"({"train_batch_size": 4})").config;
  EXPECT_EQ(c.train_micro_batch_size_per_gpu, 4);
  EXPECT_EQ(c.gradient_accumulation_steps, 1);
  EXPECT_EQ(c.gradient_clipping, 1.0);
  EXPECT_FALSE(c.steps_per_print);
  EXPECT_FALSE(c.wall_clock_breakdown);
  EXPECT_FALSE(c.prescale_gradients);
  EXPECT_EQ(c.gradient_predivide_factor, 1.0);
  EXPECT_FALSE(c.optimizer);
  EXPECT_FALSE(c.scheduler);
  EXPECT_FALSE(c.fp16.enabled);
  EXPECT_EQ(c.fp16.initial_scale_power, 16);
  EXPECT_EQ(c.fp16.loss_scale_window, 1000);
  EXPECT_EQ(c.fp16.hysteresis, 2);
  EXPECT_EQ(c.fp16.min_loss_scale, 1.0);
  EXPECT_FALSE(c.bf16.enabled);
  const ZeroConfig& z = c.zero_optimization;
  EXPECT_EQ(z.stage, 0);
  EXPECT_TRUE(z.contiguous_gradients);
  EXPECT_TRUE(z.reduce_scatter);
  EXPECT_EQ(z.reduce_bucket_size_elems, 500'000'000);
  EXPECT_EQ(z.allgather_bucket_size_elems, 500'000'000);
  EXPECT_FALSE(z.overlap_comm);
  EXPECT_EQ(z.sub_group_size_elems, 1'000'000'000);
  // Left out: porter sizes them at stage 3 (Note [Stage 3 sizing] in engine/stage3.h).
  EXPECT_FALSE(z.stage3_prefetch_bucket_size_elems.has_value());
  EXPECT_EQ(z.stage3_param_persistence_threshold_elems, 100'000);
  EXPECT_FALSE(z.stage3_max_live_parameters_elems.has_value());
  EXPECT_FALSE(z.stage3_max_reuse_distance_elems.has_value());
  EXPECT_EQ(z.offload_optimizer.device, OffloadDevice::kNone);
  EXPECT_TRUE(z.offload_optimizer.pin_memory);
  EXPECT_EQ(z.offload_optimizer.buffer_count, 4);
  EXPECT_EQ(z.offload_param.buffer_count, 5);
  EXPECT_EQ(z.offload_param.buffer_size_elems, 100'000'000);
  EXPECT_EQ(z.offload_param.max_in_cpu_elems, 1'000'000'000);
  EXPECT_FALSE(c.activation_checkpointing);
  EXPECT_EQ(c.porter.checkpointing.policy, CheckpointPolicy::kNone);
  EXPECT_EQ(c.porter.device.type, DeviceType::kAuto);
}

TEST(ConfigDefaults, OverlapCommDefaultsOnAtStage3Only) {
  EXPECT_TRUE(parse(R"({"train_batch_size": 1, "zero_optimization": {"stage": 3}})")
                  .config.zero_optimization.overlap_comm);
  EXPECT_FALSE(parse(R"({"train_batch_size": 1, "zero_optimization": {"stage": 2}})")
                   .config.zero_optimization.overlap_comm);
}

TEST(BatchTriple, AnyTwoDetermineTheThird) {
  Config a = parse(R"({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4})", 2).config;
  EXPECT_EQ(a.gradient_accumulation_steps, 4);
  Config b = parse(R"({"train_batch_size": 32, "gradient_accumulation_steps": 2})", 4).config;
  EXPECT_EQ(b.train_micro_batch_size_per_gpu, 4);
  Config c = parse(R"({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 5})", 2).config;
  EXPECT_EQ(c.train_batch_size, 30);
  Config d = parse(R"({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 3,
                       "gradient_accumulation_steps": 2})", 4).config;
  EXPECT_EQ(d.train_batch_size, 24);
  Config e = parse(R"({"train_micro_batch_size_per_gpu": 3})", 4).config;
  EXPECT_EQ(e.train_batch_size, 12);
  EXPECT_EQ(e.gradient_accumulation_steps, 1);
}

TEST(BatchTriple, UsesTheDataParallelSizeUnderTensorParallelism) {
  Config c = parse(R"({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                       "porter": {"model": {"tensor_parallel": 2}}})", 8).config;
  EXPECT_EQ(c.data_parallel_size(), 4);
  EXPECT_EQ(c.train_batch_size, 8);
}

TEST(BatchTriple, MismatchNamesAllFourNumbers) {
  try {
    parse(R"({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
              "gradient_accumulation_steps": 2})", 3);
    FAIL() << "accepted";
  } catch (const ConfigError& e) {
    std::string m = e.what();
    EXPECT_EQ(e.path(), "train_batch_size");
    for (const char* part : {"32", "train_micro_batch_size_per_gpu 4",
                             "gradient_accumulation_steps 2", "world size 3", "= 24"}) {
      EXPECT_NE(m.find(part), std::string::npos) << part << " not in: " << m;
    }
  }
}

TEST(NumberForms, IntegralFloatsAreIntegers) {
  Config c = parse(R"({"train_batch_size": 8.0, "zero_optimization": {
      "reduce_bucket_size": 6.039798e+07, "sub_group_size": 1e9, "stage": 2.0}})").config;
  EXPECT_EQ(c.train_batch_size, 8);
  EXPECT_EQ(c.zero_optimization.reduce_bucket_size_elems, 60'397'980);
  EXPECT_EQ(c.zero_optimization.sub_group_size_elems, 1'000'000'000);
  EXPECT_EQ(c.zero_optimization.stage, 2);
}

TEST(NumberForms, BytesTakeUnits) {
  Config c = parse(R"({"train_batch_size": 1, "porter": {"device": {
      "memory_limit": "2GiB", "pinned_limit": "512MB"},
      "checkpointing": {"policy": "optimal", "memory_budget": "1.5GiB"}}})").config;
  EXPECT_EQ(c.porter.device.memory_limit_bytes, 2ull << 30);
  EXPECT_EQ(c.porter.device.pinned_limit_bytes, 512'000'000u);
  ASSERT_TRUE(c.porter.checkpointing.memory_budget);
  EXPECT_EQ(c.porter.checkpointing.memory_budget->value,
            (std::variant<uint64_t, double>{uint64_t{3} << 29}));
}

TEST(NumberForms, MemoryBudgetFractionOrBytes) {
  auto budget = [](const std::string& v) {
    return parse(R"({"train_batch_size": 1, "porter": {"checkpointing": {"policy": "optimal",
                   "memory_budget": )" + v + "}}}")
        .config.porter.checkpointing.memory_budget->value;
  };
  EXPECT_EQ(budget("0.25"), (std::variant<uint64_t, double>{0.25}));
  EXPECT_EQ(budget("1"), (std::variant<uint64_t, double>{1.0}));
  EXPECT_EQ(budget("0"), (std::variant<uint64_t, double>{0.0}));
  EXPECT_EQ(budget("1000000"), (std::variant<uint64_t, double>{uint64_t{1000000}}));
  EXPECT_EQ(budget("4e9"), (std::variant<uint64_t, double>{uint64_t{4000000000}}));
}

TEST(Auto, ResolvesFromTheModel) {
  Config c = parse(R"({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2,
      "gradient_accumulation_steps": "auto",
      "porter": {"model": {"hidden": 1024, "heads": 16}},
      "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
        "overlap_comm": "auto", "contiguous_gradients": "auto"}})", 4).config;
  EXPECT_EQ(c.train_batch_size, 8);
  EXPECT_EQ(c.gradient_accumulation_steps, 1);
  EXPECT_EQ(c.zero_optimization.reduce_bucket_size_elems, 1024 * 1024);
  EXPECT_EQ(c.zero_optimization.stage3_prefetch_bucket_size_elems, 943718);
  EXPECT_EQ(c.zero_optimization.stage3_param_persistence_threshold_elems, 10240);
  EXPECT_TRUE(c.zero_optimization.overlap_comm);
  EXPECT_TRUE(c.zero_optimization.contiguous_gradients);
}

TEST(Auto, SchedulerFollowsTheOptimizerAndTrainSteps) {
  Config c = parse(R"({"train_batch_size": 1, "porter": {"train": {"steps": 200}},
      "optimizer": {"type": "adam", "params": {"lr": 3e-4}},
      "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto",
        "warmup_max_lr": "auto", "warmup_min_lr": "auto", "warmup_num_steps": "auto"}}})").config;
  ASSERT_TRUE(c.scheduler);
  EXPECT_EQ(c.optimizer->type, OptimizerType::kAdam);
  EXPECT_EQ(c.scheduler->total_num_steps, 200);
  EXPECT_EQ(c.scheduler->warmup_max_lr, 3e-4);
  EXPECT_EQ(c.scheduler->warmup_min_lr, 0.0);
  EXPECT_EQ(c.scheduler->warmup_num_steps, 200);  // DeepSpeed's 1000, capped at the total
}

TEST(Comments, UnderscoreKeysAreIgnoredAtEveryLevel) {
  EXPECT_EQ(warnings_of(R"({"_comment": "x", "train_batch_size": 1,
      "zero_optimization": {"_note": [1, 2], "stage": 1},
      "porter": {"_why": {}, "model": {"_": 0}}})"),
            std::vector<std::string>{});
}

TEST(Warnings, UnknownKeysSuggestTheNearestKnownOne) {
  EXPECT_EQ(warnings_of(R"({"train_batch_size": 1, "zero_optimization": {"stag": 1},
      "gradient_cliping": 1.0, "porter": {"modle": {}}, "frobnicate": 1})"),
            (std::vector<std::string>{
                "porter.modle: unknown key, ignored (did you mean \"model\"?)",
                "zero_optimization.stag: unknown key, ignored (did you mean \"stage\"?)",
                "frobnicate: unknown key, ignored",
                "gradient_cliping: unknown key, ignored (did you mean \"gradient_clipping\"?)",
            }));
}

TEST(Warnings, NotImplementedKeysSaySo) {
  std::vector<std::string> w = warnings_of(R"({"train_batch_size": 1,
      "tensorboard": {"enabled": true}, "wandb": {"enabled": false},
      "zero_optimization": {"zero_quantized_weights": true, "elastic_checkpoint": false}})");
  EXPECT_EQ(w, (std::vector<std::string>{
                   "zero_optimization.zero_quantized_weights: set to true, but porter does not "
                   "implement it (ZeRO++ quantized weights); ignored",
                   "tensorboard: porter does not implement this section (TensorBoard "
                   "logging); ignored"}));
}

TEST(Warnings, DeprecatedAliasesMapOntoTheirReplacement) {
  ParseResult r = parse(R"({"train_batch_size": 1, "bfloat16": {"enabled": true},
      "zero_optimization": {"stage": 3, "cpu_offload_param": true, "cpu_offload": true,
                            "cpu_offload_use_pin_memory": false}})");
  EXPECT_TRUE(r.config.bf16.enabled);
  EXPECT_EQ(r.config.zero_optimization.offload_param.device, OffloadDevice::kCpu);
  EXPECT_EQ(r.config.zero_optimization.offload_optimizer.device, OffloadDevice::kCpu);
  EXPECT_FALSE(r.config.zero_optimization.offload_param.pin_memory);
  ASSERT_EQ(r.warnings.size(), 4u);
  EXPECT_EQ(r.warnings[0].path, "bfloat16");
  EXPECT_NE(r.warnings[1].text().find("use \"offload_optimizer\""), std::string::npos);
}

TEST(Warnings, SettingsWithoutEffectUnderTensorParallelism) {
  // No group to partition over, or nothing to partition.
  EXPECT_EQ(warnings_of(R"({"train_batch_size": 1, "porter": {"model": {"sequence_parallel": true}}})"),
            std::vector<std::string>{"porter.model.sequence_parallel: true has no effect with "
                                     "porter.model.tensor_parallel 1 (one rank holds every token "
                                     "row)"});
  const ParseResult sp = parse_config_string(
      R"({"train_batch_size": 2, "activation_checkpointing": {"partition_activations": true},
          "porter": {"model": {"tensor_parallel": 2, "sequence_parallel": true}}})",
      ParseOptions{2, false});
  ASSERT_EQ(sp.warnings.size(), 1u);
  EXPECT_THAT(sp.warnings[0].text(), ::testing::HasSubstr("already 1/t of the token rows"));
  const ParseResult none = parse_config_string(
      R"({"train_batch_size": 2, "activation_checkpointing": {"partition_activations": true},
          "porter": {"model": {"tensor_parallel": 2}, "checkpointing": {"policy": "none"}}})",
      ParseOptions{2, false});
  ASSERT_EQ(none.warnings.size(), 1u);
  EXPECT_THAT(none.warnings[0].text(), ::testing::HasSubstr("policy \"none\": nothing is held"));
  const ParseResult on = parse_config_string(
      R"({"train_batch_size": 2, "activation_checkpointing": {"partition_activations": true},
          "porter": {"model": {"tensor_parallel": 2}}})",
      ParseOptions{2, false});
  EXPECT_TRUE(on.warnings.empty());
}

TEST(Warnings, PartialOffloadAtStage3IsKept) {
  ParseResult r = parse(R"({"train_batch_size": 1, "zero_optimization": {"stage": 3,
      "offload_optimizer": {"device": "cpu", "ratio": 0.3}}})");
  EXPECT_EQ(r.config.zero_optimization.offload_optimizer.ratio, 0.3);
  EXPECT_TRUE(r.warnings.empty());
}

TEST(Warnings, MoreCheckpointsThanLayersIsAcceptedAsEveryLayer) {
  ParseResult r = parse(R"({"train_batch_size": 1, "activation_checkpointing":
      {"number_checkpoints": 10}, "porter": {"model": {"layers": 4}}})");
  EXPECT_EQ(r.config.porter.checkpointing.policy, CheckpointPolicy::kUniform);
  EXPECT_EQ(r.config.porter.checkpointing.segments, 10);
  ASSERT_EQ(r.warnings.size(), 1u);
  EXPECT_EQ(r.warnings[0].path, "activation_checkpointing.number_checkpoints");
  EXPECT_NE(r.warnings[0].text().find("checkpoints every layer"), std::string::npos);
}

TEST(Strict, TurnsWarningsIntoErrors) {
  const std::string json = R"({"train_batch_size": 1, "zero_optimization": {"comm_overlap": true}})";
  EXPECT_EQ(parse(json).warnings.size(), 1u);
  try {
    parse_config_string(json, ParseOptions{1, true});
    FAIL() << "strict accepted an unknown key";
  } catch (const ConfigError& e) {
    EXPECT_EQ(e.path(), "zero_optimization.comm_overlap");
    EXPECT_NE(std::string(e.what()).find("did you mean \"overlap_comm\""), std::string::npos);
  }
}

TEST(Policy, FollowsActivationCheckpointingWhenNotGiven) {
  EXPECT_EQ(parse(R"({"train_batch_size": 1})").config.porter.checkpointing.policy,
            CheckpointPolicy::kNone);
  EXPECT_EQ(parse(R"({"train_batch_size": 1, "activation_checkpointing": {}})")
                .config.porter.checkpointing.policy,
            CheckpointPolicy::kFull);
  EXPECT_EQ(parse(R"({"train_batch_size": 1, "activation_checkpointing": {"number_checkpoints": 4}})")
                .config.porter.checkpointing.policy,
            CheckpointPolicy::kUniform);
  Config s = parse(R"({"train_batch_size": 1, "porter": {"checkpointing": {"policy": "selective"}}})").config;
  EXPECT_EQ(s.porter.checkpointing.selective_ops, std::vector<std::string>{"core_attention"});
}

TEST(Policy, NumberCheckpointsIsFoldedIntoSegments) {
  const CheckpointingConfig k =
      parse(R"({"train_batch_size": 1, "activation_checkpointing": {"number_checkpoints": 4}})")
          .config.porter.checkpointing;
  EXPECT_EQ(k.segments, std::optional<int64_t>(4));
  EXPECT_FALSE(k.every_n_layers);
  const CheckpointingConfig e =
      parse(R"({"train_batch_size": 1, "activation_checkpointing": {},
                "porter": {"checkpointing": {"policy": "uniform", "every_n_layers": 3}}})")
          .config.porter.checkpointing;
  EXPECT_EQ(e.every_n_layers, std::optional<int64_t>(3));
  EXPECT_FALSE(e.segments);
  // Under another policy the segments are kept (estimate's uniform row uses them) and the
  // planner does not read them.
  const CheckpointingConfig f =
      parse(R"({"train_batch_size": 1, "activation_checkpointing": {"number_checkpoints": 4},
                "porter": {"checkpointing": {"policy": "full"}}})")
          .config.porter.checkpointing;
  EXPECT_EQ(f.segments, std::optional<int64_t>(4));
  EXPECT_EQ(f.policy, CheckpointPolicy::kFull);
}

TEST(Policy, ContiguousMemoryNeedsNeitherPartitioningNorNumberCheckpoints) {
  // A deliberate difference from DeepSpeed (docs/config.md): porter knows the plan.
  ParseResult r = parse(R"({"train_batch_size": 1, "activation_checkpointing":
      {"contiguous_memory_optimization": true, "cpu_checkpointing": true}})");
  EXPECT_TRUE(r.warnings.empty());
  EXPECT_TRUE(r.config.activation_checkpointing->contiguous_memory_optimization);
  EXPECT_FALSE(r.config.activation_checkpointing->partition_activations);
}

TEST(Rules, TextDataAcceptsAVocabOfExactlyTheByteValues) {
  Config c = parse(R"({"train_batch_size": 1, "porter": {"model": {"vocab": 256},
      "data": {"type": "text", "paths": "corpus.txt"}}})").config;
  EXPECT_EQ(c.porter.model.vocab, 256);
  // Synthetic data draws ids below the vocab, so any vocab works.
  EXPECT_EQ(parse(R"({"train_batch_size": 1, "porter": {"model": {"vocab": 7}}})")
                .config.porter.model.vocab,
            7);
}

TEST(MalformedJson, ReportsLineAndColumn) {
  try {
    parse("{\n  \"train_batch_size\": 1,\n  \"fp16\": {\"enabled\": tru}\n}");
    FAIL() << "accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("line 3, column"), std::string::npos) << e.what();
  }
}

TEST(MalformedJson, DuplicateKeysNameTheKeyAndWhere) {
  try {
    parse("{\"train_batch_size\": 1,\n \"zero_optimization\": {\"stage\": 1,\n   \"stage\": 2}}");
    FAIL() << "accepted";
  } catch (const ConfigError& e) {
    EXPECT_EQ(e.path(), "zero_optimization.stage");
    EXPECT_NE(std::string(e.what()).find("duplicate key \"stage\" at line 3, column 4"),
              std::string::npos)
        << e.what();
  }
}

TEST(Files, MissingFileIsAnIoError) {
  EXPECT_THROW(parse_config_file("/nonexistent/porter.json"), IoError);
}

std::vector<std::string> notes_of(const std::string& json) {
  std::vector<std::string> out;
  for (const Warning& n : parse(json).notes) out.push_back(n.text());
  return out;
}

// Note [Fixed behaviour]: each key whose choice porter makes one way is noted once, only when
// given, whatever its value; never as a warning.
TEST(Notes, FixedZeroKeysAreNotedOnceWhenGiven) {
  const std::string model = R"("porter": {"model": {"layers": 2}})";
  EXPECT_TRUE(notes_of(R"({"train_batch_size": 1, "zero_optimization": {"stage": 3}, )" + model +
                       "}")
                  .empty());
  ParseResult r = parse(R"({"train_batch_size": 1, "zero_optimization": {"stage": 3,
      "contiguous_gradients": false, "sub_group_size": "auto",
      "offload_param": {"device": "cpu", "nvme_path": "/nvme"}}, )" + model + "}");
  EXPECT_TRUE(r.warnings.empty());
  ASSERT_EQ(r.notes.size(), 3u);
  EXPECT_EQ(r.notes[0].path, "zero_optimization.contiguous_gradients");
  EXPECT_THAT(r.notes[0].message,
              ::testing::StartsWith("porter always keeps gradients contiguous"));
  EXPECT_EQ(r.notes[1].path, "zero_optimization.sub_group_size");
  EXPECT_THAT(r.notes[1].message,
              ::testing::StartsWith("porter's AdamW steps the rank's whole optimizer shard at once"));
  EXPECT_EQ(r.notes[2].text(),
            "zero_optimization.offload_param.nvme_path: porter has no NVMe offload, so the path "
            "is not used; offload to host memory instead, with \"device\": \"cpu\"");
  // The other keys whose choice porter makes one way.
  EXPECT_EQ(notes_of(R"({"train_batch_size": 1, "zero_optimization": {"stage": 2,
      "round_robin_gradients": true, "allgather_partitions": false,
      "offload_optimizer": {"device": "cpu", "fast_init": true}}, )" + model + "}"),
            (std::vector<std::string>{
                "zero_optimization.round_robin_gradients: porter's optimizer offload copies each "
                "bucket's part of the rank's gradient shard to the host as soon as it is "
                "reduced, whatever the value (the key has no effect)",
                "zero_optimization.allgather_partitions: porter always all-gathers the updated "
                "parameters at stages 1 and 2, never a series of broadcasts, whatever the value "
                "(the key has no effect)",
                "zero_optimization.offload_optimizer.fast_init: speeds up NVMe offload's set-up, "
                "and porter has no NVMe offload (the key has no effect)"}));
  // Strict mode refuses warnings, not notes.
  EXPECT_EQ(parse_config_string(R"({"train_batch_size": 1, "zero_optimization":
      {"stage": 2, "contiguous_gradients": true}, )" + model + "}",
                                ParseOptions{1, true})
                .notes.size(),
            1u);
}

TEST(Notes, AConfigWithoutAModelSaysWhichOneItTrains) {
  EXPECT_EQ(notes_of(R"({"train_batch_size": 1})"),
            std::vector<std::string>{
                "porter.model: not given, so porter trains its default model, a GPT of 12 "
                "layers, hidden 768, 12 heads, seq_len 1024, vocab 50257; give the model in the "
                "config's \"porter\": {\"model\": {...}} (or key by key with --set, e.g. --set "
                "porter.model.layers=4), or load one with porter.model.from, a Hugging Face model "
                "directory"});
  // A porter section without a model, or a null model, is no model either.
  EXPECT_EQ(notes_of(R"({"train_batch_size": 1, "porter": {"train": {"steps": 2}}})").size(), 1u);
  EXPECT_EQ(notes_of(R"({"train_batch_size": 1, "porter": {"model": null}})").size(), 1u);
  // Any model section, even one that keeps every default, is the user's choice.
  EXPECT_TRUE(notes_of(R"({"train_batch_size": 1, "porter": {"model": {}}})").empty());
}

// Note [Progress cadence].
TEST(ProgressCadence, StepsPerPrintIsLogEveryUnlessLogEveryIsGiven) {
  EXPECT_EQ(parse(R"({"train_batch_size": 1})").config.porter.train.log_every, 1);
  EXPECT_EQ(parse(R"({"train_batch_size": 1, "steps_per_print": 5})").config.porter.train.log_every,
            5);
  const Config both = parse(R"({"train_batch_size": 1, "steps_per_print": 5,
      "porter": {"train": {"log_every": 2}}})").config;
  EXPECT_EQ(both.porter.train.log_every, 2);
  EXPECT_EQ(both.steps_per_print, std::optional<int64_t>(5));
  // The resolved config prints both and reads back equal.
  const Config c = parse(R"({"train_batch_size": 1, "steps_per_print": 5})").config;
  EXPECT_EQ(parse(to_json_string(c)).config, c);
}

}  // namespace
}  // namespace porter::config
