// The invalid-config table: each config is rejected with a ConfigError whose text names the
// JSON path and the offending value.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "config/parse.h"

namespace porter::config {
namespace {

struct InvalidCase {
  const char* name;
  std::string json;
  std::string path;   // expected ConfigError::path()
  std::string value;  // must appear in the message
  int64_t world_size = 1;
};

// Names the case in test output (instead of gtest's byte dump).
void PrintTo(const InvalidCase& c, std::ostream* os) { *os << c.name; }

// A valid base so that each case breaks exactly one rule.
std::string with(const std::string& members) {
  return "{\"train_batch_size\": 8, " + members + "}";
}

const std::vector<InvalidCase>& invalid_cases() {
  static const std::vector<InvalidCase> kCases = {
      // --- document shape -------------------------------------------------------------------
      {"empty_file", "", "", "empty"},
      {"whitespace_only", "  \n\t ", "", "empty"},
      {"array_root", "[1, 2]", "", "[1,2]"},
      {"string_root", "\"train_batch_size\"", "", "\"train_batch_size\""},
      {"number_root", "8", "", "got 8"},
      {"truncated", "{\"train_batch_size\": 8", "", "line 1, column"},
      {"trailing_comma", "{\"train_batch_size\": 8,}", "", "line 1, column 24"},
      {"bad_literal", "{\n\"fp16\": {\"enabled\": yes}}", "", "line 2, column"},
      {"trailing_garbage", "{\"train_batch_size\": 8} x", "", "line 1, column 25"},
      {"duplicate_top_level", "{\"train_batch_size\": 8, \"train_batch_size\": 16}",
       "train_batch_size", "duplicate key \"train_batch_size\" at line 1, column 25"},
      {"duplicate_nested", with("\"zero_optimization\": {\"stage\": 1, \"stage\": 1}"),
       "zero_optimization.stage", "duplicate key \"stage\""},
      {"duplicate_in_array_object", with("\"porter\": {\"data\": {\"paths\": [{\"a\": 1, \"a\": 2}]}}"),
       "porter.data.paths[0].a", "duplicate key \"a\""},
      {"too_deep", std::string(100, '[') + std::string(100, ']'), "", "nesting deeper than 64"},
      // --- batch sizes ----------------------------------------------------------------------
      {"no_batch_size", "{\"gradient_accumulation_steps\": 2}", "train_batch_size", "no batch size"},
      {"batch_zero", "{\"train_batch_size\": 0}", "train_batch_size", "got 0"},
      {"batch_negative", "{\"train_micro_batch_size_per_gpu\": -4}", "train_micro_batch_size_per_gpu", "got -4"},
      {"batch_string", "{\"train_batch_size\": \"eight\"}", "train_batch_size", "\"eight\""},
      {"batch_fraction", "{\"train_batch_size\": 8.5}", "train_batch_size", "8.5"},
      {"batch_too_large", "{\"train_batch_size\": 1e30}", "train_batch_size", "1e+30"},
      {"batch_triple_mismatch",
       "{\"train_batch_size\": 30, \"train_micro_batch_size_per_gpu\": 4, \"gradient_accumulation_steps\": 2}",
       "train_batch_size", "30 != train_micro_batch_size_per_gpu 4 x gradient_accumulation_steps 2 x world size 2", 2},
      {"batch_not_divisible", "{\"train_batch_size\": 10, \"train_micro_batch_size_per_gpu\": 4}",
       "train_batch_size", "10 is not a multiple of train_micro_batch_size_per_gpu 4", 1},
      {"batch_vs_world_size", "{\"train_batch_size\": 6, \"gradient_accumulation_steps\": 1}",
       "train_batch_size", "world size 4", 4},
      {"batch_product_overflows",
       "{\"train_micro_batch_size_per_gpu\": 9000000000000000000, \"gradient_accumulation_steps\": 4}",
       "train_batch_size", "9000000000000000000 x 4"},
      {"accumulation_auto_not_for_gas_only", "{\"gradient_accumulation_steps\": \"auto\"}",
       "train_batch_size", "no batch size"},
      // --- top-level scalars ----------------------------------------------------------------
      {"clipping_negative", with("\"gradient_clipping\": -1"), "gradient_clipping", "got -1"},
      {"clipping_string", with("\"gradient_clipping\": \"1.0\""), "gradient_clipping", "\"1.0\""},
      {"steps_per_print_zero", with("\"steps_per_print\": 0"), "steps_per_print", "got 0"},
      {"wall_clock_not_bool", with("\"wall_clock_breakdown\": 1"), "wall_clock_breakdown", "got 1"},
      {"predivide_zero", with("\"gradient_predivide_factor\": 0"), "gradient_predivide_factor", "got 0"},
      {"prescale_auto", with("\"prescale_gradients\": \"auto\""), "prescale_gradients",
       "\"auto\" is not accepted"},
      // --- optimizer and scheduler ----------------------------------------------------------
      {"optimizer_unknown_type", with("\"optimizer\": {\"type\": \"Lamb\"}"), "optimizer.type",
       "\"Lamb\""},
      {"optimizer_missing_type", with("\"optimizer\": {\"params\": {}}"), "optimizer.type", "missing"},
      {"optimizer_not_object", with("\"optimizer\": \"Adam\""), "optimizer", "\"Adam\""},
      {"optimizer_negative_lr", with("\"optimizer\": {\"type\": \"Adam\", \"params\": {\"lr\": -0.1}}"),
       "optimizer.params.lr", "-0.1"},
      {"optimizer_betas_shape", with("\"optimizer\": {\"type\": \"AdamW\", \"params\": {\"betas\": [0.9]}}"),
       "optimizer.params.betas", "[0.9]"},
      {"optimizer_beta_range", with("\"optimizer\": {\"type\": \"AdamW\", \"params\": {\"betas\": [0.9, 1.0]}}"),
       "optimizer.params.betas[1]", "got 1.0"},
      {"optimizer_eps_zero", with("\"optimizer\": {\"type\": \"AdamW\", \"params\": {\"eps\": 0}}"),
       "optimizer.params.eps", "got 0"},
      {"scheduler_unknown_type", with("\"scheduler\": {\"type\": \"OneCycle\"}"), "scheduler.type",
       "\"OneCycle\""},
      {"scheduler_decay_needs_total", with("\"scheduler\": {\"type\": \"WarmupDecayLR\", \"params\": {}}"),
       "scheduler.params.total_num_steps", "missing"},
      {"scheduler_warmup_longer_than_total",
       with("\"scheduler\": {\"type\": \"WarmupCosineLR\", \"params\": {\"total_num_steps\": 10, \"warmup_num_steps\": 20}}"),
       "scheduler.params.warmup_num_steps", "20"},
      {"scheduler_warmup_type", with("\"scheduler\": {\"type\": \"WarmupLR\", \"params\": {\"warmup_type\": \"cosine\"}}"),
       "scheduler.params.warmup_type", "\"cosine\""},
      {"scheduler_min_above_max",
       with("\"scheduler\": {\"type\": \"WarmupLR\", \"params\": {\"warmup_min_lr\": 0.1, \"warmup_max_lr\": 0.01}}"),
       "scheduler.params.warmup_min_lr", "0.1"},
      // --- precision ------------------------------------------------------------------------
      {"fp16_and_bf16", with("\"fp16\": {\"enabled\": true}, \"bf16\": {\"enabled\": true}"),
       "bf16.enabled", "true"},
      {"fp16_enabled_string", with("\"fp16\": {\"enabled\": \"yes\"}"), "fp16.enabled", "\"yes\""},
      {"fp16_negative_loss_scale", with("\"fp16\": {\"loss_scale\": -1}"), "fp16.loss_scale", "got -1"},
      {"fp16_hysteresis_zero", with("\"fp16\": {\"hysteresis\": 0}"), "fp16.hysteresis", "got 0"},
      {"fp16_scale_power_huge", with("\"fp16\": {\"initial_scale_power\": 200}"),
       "fp16.initial_scale_power", "got 200"},
      {"bf16_with_old_name", with("\"bf16\": {}, \"bfloat16\": {}"), "bfloat16", "\"bf16\""},
      // Note [Gradient dtype]: fp32 or the compute dtype, reduced in that dtype.
      {"grad_dtype_not_compute", with("\"data_types\": {\"grad_accum_dtype\": \"bf16\"}"),
       "data_types.grad_accum_dtype", "\"bf16\" with fp32 compute"},
      {"grad_dtype_other_16_bit",
       with("\"fp16\": {\"enabled\": true}, \"data_types\": {\"grad_accum_dtype\": \"bf16\"}"),
       "data_types.grad_accum_dtype", "use \"fp32\" or \"fp16\""},
      {"grad_dtype_unknown", with("\"data_types\": {\"grad_accum_dtype\": \"fp8\"}"),
       "data_types.grad_accum_dtype", "\"fp8\""},
      {"comm_dtype_not_grad_dtype",
       with("\"bf16\": {\"enabled\": true}, \"data_types\": {\"grad_accum_dtype\": \"bf16\"}, "
            "\"communication_data_type\": \"fp32\""),
       "communication_data_type", "\"fp32\" with gradients kept in bf16"},
      // --- zero_optimization ----------------------------------------------------------------
      {"zero_stage_word", with("\"zero_optimization\": {\"stage\": \"two\"}"), "zero_optimization.stage",
       "expected an integer in 0..3, got \"two\""},
      {"zero_stage_range", with("\"zero_optimization\": {\"stage\": 4}"), "zero_optimization.stage", "got 4"},
      {"zero_stage_fraction", with("\"zero_optimization\": {\"stage\": 1.5}"), "zero_optimization.stage", "1.5"},
      {"zero_not_object", with("\"zero_optimization\": true"), "zero_optimization", "got true"},
      {"zero_bucket_fraction", with("\"zero_optimization\": {\"reduce_bucket_size\": 5e8.5}"), "", "line 1"},
      {"zero_bucket_fractional_float", with("\"zero_optimization\": {\"reduce_bucket_size\": 2.5e-1}"),
       "zero_optimization.reduce_bucket_size", "0.25"},
      {"zero_allgather_odd", with("\"zero_optimization\": {\"stage\": 2, \"allgather_bucket_size\": 7000001}"),
       "zero_optimization.allgather_bucket_size", "7000001"},
      {"zero_overlap_string", with("\"zero_optimization\": {\"overlap_comm\": \"true\"}"),
       "zero_optimization.overlap_comm", "\"true\""},
      {"offload_device_unknown", with("\"zero_optimization\": {\"stage\": 2, \"offload_optimizer\": {\"device\": \"gpu\"}}"),
       "zero_optimization.offload_optimizer.device", "\"gpu\""},
      {"offload_optimizer_stage0", with("\"zero_optimization\": {\"offload_optimizer\": {\"device\": \"cpu\"}}"),
       "zero_optimization.offload_optimizer.device", "\"cpu\""},
      {"offload_param_stage2", with("\"zero_optimization\": {\"stage\": 2, \"offload_param\": {\"device\": \"cpu\"}}"),
       "zero_optimization.offload_param.device", "zero_optimization.stage is 2"},
      {"cpu_offload_param_stage1", with("\"zero_optimization\": {\"stage\": 1, \"cpu_offload_param\": true}"),
       "zero_optimization.cpu_offload_param", "stage is 1"},
      {"offload_ratio_below_stage3",
       with("\"zero_optimization\": {\"stage\": 2, \"offload_optimizer\": {\"device\": \"cpu\", \"ratio\": 0.5}}"),
       "zero_optimization.offload_optimizer.ratio", "0.5"},
      {"offload_ratio_range", with("\"zero_optimization\": {\"stage\": 3, \"offload_optimizer\": {\"ratio\": 1.5}}"),
       "zero_optimization.offload_optimizer.ratio", "1.5"},
      {"offload_buffer_count_zero", with("\"zero_optimization\": {\"stage\": 3, \"offload_param\": {\"buffer_count\": 0}}"),
       "zero_optimization.offload_param.buffer_count", "got 0"},
      {"deprecated_with_replacement",
       with("\"zero_optimization\": {\"stage\": 2, \"cpu_offload\": true, \"offload_optimizer\": {\"device\": \"cpu\"}}"),
       "zero_optimization.cpu_offload", "offload_optimizer"},
      {"deprecated_gather_with_replacement",
       with("\"zero_optimization\": {\"stage3_gather_fp16_weights_on_model_save\": true, "
            "\"stage3_gather_16bit_weights_on_model_save\": true}"),
       "zero_optimization.stage3_gather_fp16_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save"},
      {"deprecated_pin_with_replacement",
       with("\"zero_optimization\": {\"stage\": 3, \"cpu_offload_use_pin_memory\": true, "
            "\"offload_param\": {\"device\": \"cpu\", \"pin_memory\": false}}"),
       "zero_optimization.cpu_offload_use_pin_memory", "pin_memory"},
      {"cpu_offload_not_bool", with("\"zero_optimization\": {\"stage\": 2, \"cpu_offload\": \"cpu\"}"),
       "zero_optimization.cpu_offload", "\"cpu\""},
      // --- activation_checkpointing ---------------------------------------------------------
      {"ac_number_checkpoints_zero", with("\"activation_checkpointing\": {\"number_checkpoints\": 0}"),
       "activation_checkpointing.number_checkpoints", "got 0"},
      {"ac_flag_not_bool", with("\"activation_checkpointing\": {\"partition_activations\": \"yes\"}"),
       "activation_checkpointing.partition_activations", "\"yes\""},
      {"ac_cpu_checkpointing_without_checkpoints",
       with("\"activation_checkpointing\": {\"cpu_checkpointing\": true}, \"porter\": {\"checkpointing\": {\"policy\": \"none\"}}"),
       "activation_checkpointing.cpu_checkpointing", "\"none\""},
      // --- porter section -------------------------------------------------------------------
      {"porter_not_object", with("\"porter\": []"), "porter", "[]"},
      {"model_arch", with("\"porter\": {\"model\": {\"arch\": \"mamba\"}}"), "porter.model.arch", "\"mamba\""},
      {"gpt_kv_heads", with("\"porter\": {\"model\": {\"kv_heads\": 4}}"), "porter.model.kv_heads", "llama"},
      {"gpt_rope_theta", with("\"porter\": {\"model\": {\"rope_theta\": 5e5}}"), "porter.model.rope_theta", "llama"},
      {"llama_kv_heads", with("\"porter\": {\"model\": {\"arch\": \"llama\", \"kv_heads\": 5}}"), "porter.model.kv_heads", "does not divide heads 12"},
      {"llama_max_positions", with("\"porter\": {\"model\": {\"arch\": \"llama\", \"max_positions\": 64}}"), "porter.model.max_positions", "fewer than seq_len 1024"},
      {"norm_eps_zero", with("\"porter\": {\"model\": {\"norm_eps\": 0}}"), "porter.model.norm_eps", "0"},
      {"val_paths_synthetic", with("\"porter\": {\"data\": {\"val_paths\": \"v.bin\"}}"), "porter.data.val_paths", "synthetic"},
      {"model_layers_zero", with("\"porter\": {\"model\": {\"layers\": 0}}"), "porter.model.layers", "got 0"},
      {"model_hidden_heads", with("\"porter\": {\"model\": {\"hidden\": 100, \"heads\": 12}}"),
       "porter.model.hidden", "100"},
      {"model_dropout_one", with("\"porter\": {\"model\": {\"dropout\": 1.0}}"), "porter.model.dropout", "1.0"},
      {"model_tp_heads", with("\"porter\": {\"model\": {\"tensor_parallel\": 5}}"),
       "porter.model.tensor_parallel", "5"},
      {"model_tp_world", with("\"porter\": {\"model\": {\"tensor_parallel\": 4}}"),
       "porter.model.tensor_parallel", "world size 2", 2},
      {"model_sp_rows",
       with("\"train_micro_batch_size_per_gpu\": 1, \"porter\": {\"model\": {\"tensor_parallel\": 2, "
            "\"sequence_parallel\": true, \"seq_len\": 7}}"),
       "porter.model.seq_len", "do not divide into porter.model.tensor_parallel 2", 2},
      {"model_sp_hidden",
       with("\"train_micro_batch_size_per_gpu\": 1, \"porter\": {\"model\": {\"tensor_parallel\": 2, "
            "\"sequence_parallel\": true, \"seq_len\": 2, \"hidden\": 6, \"heads\": 2}}"),
       "porter.model.hidden", "multiple of 4 elements", 2},
      {"model_vocab_below_bytes_for_text",
       with("\"porter\": {\"model\": {\"vocab\": 128}, \"data\": {\"type\": \"text\", "
            "\"paths\": [\"a.txt\"]}}"),
       "porter.model.vocab",
       "porter.model.vocab: text data is byte-level and needs a vocab of at least 256, got 128 "
       "(porter.data.type is \"text\"); set porter.model.vocab to 256"},
      {"model_tie_not_bool", with("\"porter\": {\"model\": {\"tie_embeddings\": 0}}"),
       "porter.model.tie_embeddings", "got 0"},
      {"data_type", with("\"porter\": {\"data\": {\"type\": \"parquet\"}}"), "porter.data.type", "\"parquet\""},
      {"data_text_without_paths", with("\"porter\": {\"data\": {\"type\": \"text\"}}"), "porter.data.paths", "\"text\""},
      {"data_paths_not_strings", with("\"porter\": {\"data\": {\"type\": \"text\", \"paths\": [\"a\", 3]}}"),
       "porter.data.paths[1]", "got 3"},
      {"data_synthetic_with_paths", with("\"porter\": {\"data\": {\"paths\": [\"a.txt\"]}}"),
       "porter.data.paths", "a.txt"},
      {"device_type", with("\"porter\": {\"device\": {\"type\": \"tpu\"}}"), "porter.device.type", "\"tpu\""},
      {"device_memory_limit_unit", with("\"porter\": {\"device\": {\"memory_limit\": \"2 parsecs\"}}"),
       "porter.device.memory_limit", "\"2 parsecs\""},
      {"device_memory_limit_negative", with("\"porter\": {\"device\": {\"memory_limit\": -5}}"),
       "porter.device.memory_limit", "-5"},
      {"device_memory_limit_fraction", with("\"porter\": {\"device\": {\"memory_limit\": \"1.5B\"}}"),
       "porter.device.memory_limit", "\"1.5B\""},
      {"device_memory_limit_huge_fraction",
       with("\"porter\": {\"device\": {\"memory_limit\": \"" + std::string(400, '9') + ".5\"}}"),
       "porter.device.memory_limit", "\"99999999"},
      {"device_link_zero", with("\"porter\": {\"device\": {\"sim_link_gbps\": 0}}"),
       "porter.device.sim_link_gbps", "got 0"},
      {"device_link_on_cuda", with("\"porter\": {\"device\": {\"type\": \"cuda\", \"sim_link_gbps\": 12}}"),
       "porter.device.sim_link_gbps", "12"},
      {"device_threads_negative", with("\"porter\": {\"device\": {\"threads\": -1}}"),
       "porter.device.threads", "-1"},
      {"policy_unknown", with("\"porter\": {\"checkpointing\": {\"policy\": \"Uniform\"}}"),
       "porter.checkpointing.policy", "\"Uniform\""},
      {"policy_uniform_needs_count", with("\"porter\": {\"checkpointing\": {\"policy\": \"uniform\"}}"),
       "porter.checkpointing.policy", "\"uniform\""},
      {"policy_uniform_both_counts",
       with("\"activation_checkpointing\": {\"number_checkpoints\": 4}, \"porter\": {\"checkpointing\": "
            "{\"policy\": \"uniform\", \"every_n_layers\": 2}}"),
       "porter.checkpointing.every_n_layers", "number_checkpoints 4"},
      {"policy_block_needs_layers", with("\"porter\": {\"checkpointing\": {\"policy\": \"block\"}}"),
       "porter.checkpointing.policy", "\"block\""},
      {"policy_block_too_many", with("\"porter\": {\"checkpointing\": {\"policy\": \"block\", \"block_layers\": 40}}"),
       "porter.checkpointing.block_layers", "40"},
      {"policy_optimal_needs_budget", with("\"porter\": {\"checkpointing\": {\"policy\": \"optimal\"}}"),
       "porter.checkpointing.policy", "\"optimal\""},
      {"budget_without_optimal", with("\"porter\": {\"checkpointing\": {\"policy\": \"full\", \"memory_budget\": 0.5}}"),
       "porter.checkpointing.memory_budget", "\"full\""},
      {"budget_fraction_above_one",
       with("\"porter\": {\"checkpointing\": {\"policy\": \"optimal\", \"memory_budget\": 1.5}}"),
       "porter.checkpointing.memory_budget", "1.5"},
      {"budget_negative", with("\"porter\": {\"checkpointing\": {\"policy\": \"optimal\", \"memory_budget\": -0.5}}"),
       "porter.checkpointing.memory_budget", "-0.5"},
      {"selective_unknown_op",
       with("\"porter\": {\"checkpointing\": {\"policy\": \"selective\", \"selective_ops\": [\"attention\"]}}"),
       "porter.checkpointing.selective_ops[0]", "\"attention\""},
      {"selective_op_twice",
       with("\"porter\": {\"checkpointing\": {\"policy\": \"selective\", \"selective_ops\": [\"gelu\", \"gelu\"]}}"),
       "porter.checkpointing.selective_ops[1]", "\"gelu\""},
      {"every_n_layers_without_uniform", with("\"porter\": {\"checkpointing\": {\"every_n_layers\": 2}}"),
       "porter.checkpointing.every_n_layers", "\"none\""},
      {"prefetch_depth_negative", with("\"porter\": {\"checkpointing\": {\"prefetch_depth\": -1}}"),
       "porter.checkpointing.prefetch_depth", "-1"},
      {"train_steps_zero", with("\"porter\": {\"train\": {\"steps\": 0}}"), "porter.train.steps", "got 0"},
      {"train_seed_negative", with("\"porter\": {\"train\": {\"seed\": -1}}"), "porter.train.seed", "-1"},
      {"trace_path_number", with("\"porter\": {\"trace\": {\"path\": 7}}"), "porter.trace.path", "got 7"},
      {"trace_path_empty", with("\"porter\": {\"trace\": {\"path\": \"\"}}"), "porter.trace.path", "\"\""},
      // --- porter.optimizer -------------------------------------------------------------------
      {"no_decay_not_a_list", with("\"porter\": {\"optimizer\": {\"no_decay\": \"ndim<2\"}}"),
       "porter.optimizer.no_decay", "expected a list of parameter patterns"},
      {"no_decay_number", with("\"porter\": {\"optimizer\": {\"no_decay\": [\"wpe\", 3]}}"),
       "porter.optimizer.no_decay[1]", "got 3"},
      {"no_decay_empty_pattern", with("\"porter\": {\"optimizer\": {\"no_decay\": [\"\"]}}"),
       "porter.optimizer.no_decay[0]", "empty pattern"},
      {"no_decay_bad_selector",
       with("\"porter\": {\"optimizer\": {\"no_decay\": [\"ndim<two\"]}}"),
       "porter.optimizer.no_decay[0]", "\"ndim<two\" is not a rank selector"},
      {"no_decay_selector_negative",
       with("\"porter\": {\"optimizer\": {\"no_decay\": [\"ndim>=-1\"]}}"),
       "porter.optimizer.no_decay[0]", "\"ndim>=-1\""},
      {"no_decay_unclosed_bracket",
       with("\"porter\": {\"optimizer\": {\"no_decay\": [\"h.[01.bias\"]}}"),
       "porter.optimizer.no_decay[0]", "'[' at offset 2 is not closed"},
      {"param_groups_not_a_list",
       with("\"porter\": {\"optimizer\": {\"param_groups\": {\"params\": [\"*\"]}}}"),
       "porter.optimizer.param_groups", "expected a list of groups"},
      {"param_group_not_an_object",
       with("\"porter\": {\"optimizer\": {\"param_groups\": [\"*.bias\"]}}"),
       "porter.optimizer.param_groups[0]", "\"*.bias\""},
      {"param_group_unknown_key",
       with("\"porter\": {\"optimizer\": {\"param_groups\": [{\"params\": [\"*\"], "
            "\"weight_decy\": 0}]}}"),
       "porter.optimizer.param_groups[0].weight_decy", "unknown key of a parameter group"},
      {"param_group_without_params",
       with("\"porter\": {\"optimizer\": {\"param_groups\": [{\"lr_scale\": 2}]}}"),
       "porter.optimizer.param_groups[0].params", "missing"},
      {"param_group_empty_params",
       with("\"porter\": {\"optimizer\": {\"param_groups\": [{\"params\": []}]}}"),
       "porter.optimizer.param_groups[0].params", "[]"},
      {"param_group_bad_pattern",
       with("\"porter\": {\"optimizer\": {\"param_groups\": [{\"params\": [\"*\", "
            "\"ndim=<1\"]}]}}"),
       "porter.optimizer.param_groups[0].params[1]", "\"ndim=<1\""},
      {"param_group_negative_decay",
       with("\"porter\": {\"optimizer\": {\"param_groups\": [{\"params\": [\"*\"], "
            "\"weight_decay\": -0.1}]}}"),
       "porter.optimizer.param_groups[0].weight_decay", "-0.1"},
      {"param_group_lr_scale_string",
       with("\"porter\": {\"optimizer\": {\"param_groups\": [{\"params\": [\"*\"], "
            "\"lr_scale\": \"half\"}]}}"),
       "porter.optimizer.param_groups[0].lr_scale", "\"half\""},
  };
  return kCases;
}

class InvalidConfig : public testing::TestWithParam<InvalidCase> {};

TEST_P(InvalidConfig, IsRejectedNamingThePathAndTheValue) {
  const InvalidCase& c = GetParam();
  try {
    ParseResult r = parse_config_string(c.json, ParseOptions{c.world_size, false});
    FAIL() << "accepted: " << c.json << "\nresolved: " << to_json_string(r.config);
  } catch (const ConfigError& e) {
    const std::string message = e.what();
    EXPECT_EQ(e.path(), c.path) << message;
    if (!c.path.empty()) {
      EXPECT_EQ(message.rfind(c.path + ": ", 0), 0u) << message;
    }
    EXPECT_NE(message.find(c.value), std::string::npos)
        << "\"" << c.value << "\" not in: " << message;
  }
}

INSTANTIATE_TEST_SUITE_P(Table, InvalidConfig, testing::ValuesIn(invalid_cases()),
                         [](const testing::TestParamInfo<InvalidCase>& p) {
                           return std::string(p.param.name);
                         });

TEST(InvalidConfigTable, HasAtLeastFortyCases) { EXPECT_GE(invalid_cases().size(), 40u); }

}  // namespace
}  // namespace porter::config
