// Printing the resolved config and parsing it again gives an equal Config, with no warnings.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "config/parse.h"

namespace porter::config {
namespace {

struct RoundTripCase {
  const char* name;
  std::string json;
  int64_t world_size;
};

void PrintTo(const RoundTripCase& c, std::ostream* os) { *os << c.name; }

const std::vector<RoundTripCase>& round_trip_cases() {
  static const std::vector<RoundTripCase> kCases = {
      {"minimal", R"({"train_batch_size": 1})", 1},
      {"everything", R"({
        "train_batch_size": 48, "gradient_accumulation_steps": 3, "gradient_clipping": 0.5,
        "steps_per_print": 7, "wall_clock_breakdown": true, "prescale_gradients": true,
        "gradient_predivide_factor": 2.5,
        "optimizer": {"type": "Adam", "params": {"lr": 0.00015, "betas": [0.8, 0.95], "eps": 1e-6,
                      "weight_decay": 0.1, "torch_adam": true, "adam_w_mode": false}},
        "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 500,
                      "warmup_min_ratio": 0.1, "cos_min_ratio": 0.01, "warmup_num_steps": 50,
                      "warmup_type": "linear", "last_batch_iteration": 3}},
        "bf16": {"enabled": true},
        "zero_optimization": {"stage": 3, "contiguous_gradients": false, "reduce_scatter": false,
          "reduce_bucket_size": 1e7, "allgather_bucket_size": 2e7, "overlap_comm": false,
          "round_robin_gradients": true, "allgather_partitions": false, "sub_group_size": 1e14,
          "stage3_prefetch_bucket_size": 123, "stage3_param_persistence_threshold": 0,
          "stage3_max_live_parameters": 5, "stage3_max_reuse_distance": 6,
          "stage3_gather_16bit_weights_on_model_save": true,
          "offload_optimizer": {"device": "cpu", "pin_memory": false, "buffer_count": 4,
                                "fast_init": true},
          "offload_param": {"device": "cpu", "buffer_count": 5, "buffer_size": 1e8, "max_in_cpu": 1e9}},
        "activation_checkpointing": {"partition_activations": true, "cpu_checkpointing": true,
          "contiguous_memory_optimization": true, "number_checkpoints": 6,
          "synchronize_checkpoint_boundary": true, "profile": true},
        "porter": {
          "model": {"type": "gpt", "layers": 24, "hidden": 2048, "heads": 16, "seq_len": 2048,
                    "vocab": 32000, "dropout": 0.1, "tie_embeddings": false, "tensor_parallel": 2},
          "data": {"type": "text", "paths": ["a.txt", "b.txt"], "seed": 9},
          "device": {"type": "cpu", "memory_limit": "6GiB", "pinned_limit": 1000000000,
                     "sim_link_gbps": 12.5, "threads": 8, "poison_freed": true},
          "checkpointing": {"prefetch_depth": 3, "keep_last_on_device": 0},
          "train": {"steps": 1000, "seed": 7, "log_every": 10},
          "trace": {"path": "trace.json"}}})",
       32},
      {"selective", R"({"train_micro_batch_size_per_gpu": 2,
        "porter": {"checkpointing": {"policy": "selective", "selective_ops": ["fc1", "gelu"]}}})", 4},
      {"optimal_fraction", R"({"train_batch_size": 4,
        "porter": {"checkpointing": {"policy": "optimal", "memory_budget": 0.3}}})", 2},
      {"optimal_bytes", R"({"train_batch_size": 4,
        "porter": {"checkpointing": {"policy": "optimal", "memory_budget": "3GB"}}})", 1},
      {"block", R"({"train_batch_size": 4, "porter": {"checkpointing": {"policy": "block", "block_layers": 5}}})", 1},
      {"uniform_every", R"({"train_batch_size": 4, "activation_checkpointing": {},
        "porter": {"checkpointing": {"policy": "uniform", "every_n_layers": 3}}})", 1},
      {"warmup_decay", R"({"train_batch_size": 4, "fp16": {"enabled": true, "loss_scale": 128.5},
        "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 100}}})", 1},
      {"nvme_resolves_to_cpu", R"({"train_batch_size": 4, "zero_optimization": {"stage": 3,
        "offload_param": {"device": "nvme", "nvme_path": "/x"}}})", 1},
      {"auto_everywhere", R"({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
        "fp16": {"enabled": "auto"}, "optimizer": {"type": "AdamW", "params": {"lr": "auto",
        "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto",
        "warmup_max_lr": "auto", "warmup_num_steps": "auto"}},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto", "allgather_bucket_size": "auto"}})", 3},
      {"param_groups", R"({"train_batch_size": 1, "porter": {"optimizer": {
        "param_groups": [{"params": ["h.0.*", "ndim==1"], "weight_decay": 0.3, "lr_scale": 0.5},
                         {"params": ["lnf.*"]}],
        "no_decay": ["*.bias", "ndim<=1", "w[pt]e"]}}})", 1},
      {"no_decay_empty", R"({"train_batch_size": 1, "porter": {"optimizer": {"no_decay": []}}})", 1},
  };
  return kCases;
}

class RoundTrip : public testing::TestWithParam<RoundTripCase> {};

TEST_P(RoundTrip, PrintedConfigParsesBackEqual) {
  const RoundTripCase& c = GetParam();
  ParseOptions options{c.world_size, false};
  ParseResult first = parse_config_string(c.json, options);
  std::string printed = to_json_string(first.config);
  ParseResult second = parse_config_string(printed, options);
  EXPECT_EQ(second.config, first.config) << printed;
  EXPECT_TRUE(second.warnings.empty()) << second.warnings.front().text();
  EXPECT_EQ(to_json_string(second.config), printed);
  // And strict mode accepts what porter itself printed.
  EXPECT_NO_THROW(parse_config_string(printed, ParseOptions{c.world_size, true}));
}

INSTANTIATE_TEST_SUITE_P(Configs, RoundTrip, testing::ValuesIn(round_trip_cases()),
                         [](const testing::TestParamInfo<RoundTripCase>& p) {
                           return std::string(p.param.name);
                         });

TEST(RoundTrip, EqualityNoticesEveryDifference) {
  Config a = parse_config_string(R"({"train_batch_size": 1})").config;
  Config b = a;
  EXPECT_EQ(a, b);
  b.zero_optimization.offload_param.max_in_cpu_elems += 1;
  EXPECT_NE(a, b);
  b = a;
  b.porter.checkpointing.memory_budget = MemoryBudget{0.5};
  EXPECT_NE(a, b);
}

TEST(RoundTrip, PrintsResolvedValues) {
  Config c = parse_config_string(R"({"train_batch_size": 8, "zero_optimization": {"stage": 3,
      "reduce_bucket_size": "auto"}})", ParseOptions{2, false}).config;
  nlohmann::ordered_json j = to_json(c);
  EXPECT_EQ(j["train_micro_batch_size_per_gpu"], 4);
  EXPECT_EQ(j["zero_optimization"]["reduce_bucket_size"], 768 * 768);
  EXPECT_EQ(j["zero_optimization"]["overlap_comm"], true);
  EXPECT_EQ(j["porter"]["checkpointing"]["policy"], "none");
  EXPECT_TRUE(j["steps_per_print"].is_null());
}

TEST(RoundTrip, PrintsTheParameterGroupsAndTheDefaultNoDecay) {
  const Config plain = parse_config_string(R"({"train_batch_size": 1})").config;
  const nlohmann::ordered_json p = to_json(plain)["porter"]["optimizer"];
  EXPECT_EQ(p["no_decay"], nlohmann::ordered_json({"ndim<2", "wpe"}));
  EXPECT_EQ(p["param_groups"], nlohmann::ordered_json::array());

  const Config c = parse_config_string(R"({"train_batch_size": 1, "porter": {"optimizer": {
      "param_groups": [{"params": ["h.*.attn.*"], "lr_scale": 2}], "no_decay": []}}})").config;
  ASSERT_EQ(c.porter.optimizer.param_groups.size(), 1u);
  const ParamGroupConfig& g = c.porter.optimizer.param_groups[0];
  EXPECT_EQ(g.params, std::vector<std::string>{"h.*.attn.*"});
  EXPECT_FALSE(g.weight_decay.has_value());  // the optimizer's
  EXPECT_EQ(g.lr_scale, 2.0);
  EXPECT_TRUE(c.porter.optimizer.no_decay.empty());
  const nlohmann::ordered_json j = to_json(c)["porter"]["optimizer"];
  EXPECT_EQ(j["param_groups"][0]["params"][0], "h.*.attn.*");
  EXPECT_TRUE(j["param_groups"][0]["weight_decay"].is_null());
  EXPECT_EQ(j["param_groups"][0]["lr_scale"], 2.0);
  EXPECT_EQ(j["no_decay"], nlohmann::ordered_json::array());
}

TEST(ParamPatterns, GlobsMatchLayoutNamesAndSelectorsMatchRanks) {
  EXPECT_TRUE(param_pattern_matches("*.bias", "h.3.qkv.bias", 1));
  EXPECT_FALSE(param_pattern_matches("*.bias", "h.3.qkv.weight", 2));
  EXPECT_TRUE(param_pattern_matches("h.[0-2].*", "h.2.fc1.weight", 2));
  EXPECT_FALSE(param_pattern_matches("h.[0-2].*", "h.3.fc1.weight", 2));
  EXPECT_TRUE(param_pattern_matches("wpe", "wpe", 2));
  EXPECT_FALSE(param_pattern_matches("wpe", "wpe.weight", 2));
  EXPECT_TRUE(param_pattern_matches("ndim<2", "anything", 1));
  EXPECT_FALSE(param_pattern_matches("ndim<2", "anything", 2));
  EXPECT_TRUE(param_pattern_matches("ndim<=2", "x", 2));
  EXPECT_TRUE(param_pattern_matches("ndim==0", "x", 0));
  EXPECT_FALSE(param_pattern_matches("ndim==0", "x", 1));
  EXPECT_TRUE(param_pattern_matches("ndim>=3", "x", 4));
  EXPECT_FALSE(param_pattern_matches("ndim>3", "x", 3));
  // A name that merely starts with "ndim" is a glob.
  EXPECT_TRUE(param_pattern_matches("ndim_proj*", "ndim_proj.weight", 2));
  EXPECT_NO_THROW(check_param_pattern("h.[!0].*", "p"));
  EXPECT_NO_THROW(check_param_pattern("h.[]].*", "p"));
  EXPECT_THROW(check_param_pattern("h.[0", "p"), ConfigError);
  EXPECT_THROW(check_param_pattern("ndim<", "p"), ConfigError);
  EXPECT_THROW(check_param_pattern("ndim<2x", "p"), ConfigError);
}

}  // namespace
}  // namespace porter::config
