// RunOptions (engine/run_options.h): each config knob reaches exactly the options it names,
// every key of the config reaches an option or is named as another layer's, the rules that
// used to be written in several places, and what the engine refuses.
#include "engine/run_options.h"

#include <map>
#include <set>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "base/error.h"
#include "config/parse.h"

namespace porter::engine {
namespace {

using ::testing::HasSubstr;

// A run with checkpoints stored (full policy, so that offload knobs apply) on the cpu device.
nlohmann::json base_json() {
  return nlohmann::json::parse(R"({
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "activation_checkpointing": {},
    "porter": {
      "model": {"layers": 2, "hidden": 32, "heads": 2, "seq_len": 16, "vocab": 64},
      "device": {"type": "cpu"},
      "checkpointing": {"policy": "full"}
    }
  })");
}

RunOptions options_of(const nlohmann::json& j) {
  return make_run_options(config::parse_config_string(j.dump()).config);
}

void flatten(const nlohmann::ordered_json& j, const std::string& path,
             std::map<std::string, std::string>& out) {
  if (j.is_object()) {
    for (auto it = j.begin(); it != j.end(); ++it) {
      flatten(it.value(), path.empty() ? it.key() : path + "." + it.key(), out);
    }
  } else {
    out[path] = j.dump();
  }
}

// The option paths whose values differ between two runs.
std::set<std::string> differing(const RunOptions& a, const RunOptions& b) {
  std::map<std::string, std::string> fa, fb;
  flatten(a.to_json(), "", fa);
  flatten(b.to_json(), "", fb);
  EXPECT_EQ(fa.size(), fb.size());
  std::set<std::string> out;
  for (const auto& [k, v] : fa) {
    if (fb.count(k) == 0 || fb.at(k) != v) out.insert(k);
  }
  return out;
}

struct Knob {
  const char* name;
  nlohmann::json patch;            // merged into the base config
  std::set<std::string> expected;  // the option paths it must change, and no other
};

TEST(RunOptions, EachKnobChangesOnlyItsOptions) {
  const RunOptions base = options_of(base_json());
  const std::vector<Knob> knobs = {
      {"fp16", {{"fp16", {{"enabled", true}}}},
       {"compute_dtype", "shape.compute_dtype", "optimizer.fp16.enabled"}},
      {"bf16", {{"bf16", {{"enabled", true}}}}, {"compute_dtype", "shape.compute_dtype"}},
      {"zero stage", {{"zero_optimization", {{"stage", 1}}}},
       {"reducer.zero_stage", "optimizer.zero_stage"}},
      {"overlap_comm", {{"zero_optimization", {{"overlap_comm", true}}}},
       {"reducer.overlap_comm"}},
      {"reduce_scatter", {{"zero_optimization", {{"reduce_scatter", false}}}},
       {"reducer.reduce_scatter"}},
      {"prescale_gradients", {{"prescale_gradients", true}}, {"reducer.prescale_gradients"}},
      {"gradient_predivide_factor", {{"gradient_predivide_factor", 2.0}},
       {"reducer.predivide_factor"}},
      {"gradient_clipping", {{"gradient_clipping", 0.5}}, {"optimizer.gradient_clipping"}},
      {"lr", {{"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 3e-3}}}}}},
       {"optimizer.adamw.lr"}},
      {"weight_decay",
       {{"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-3}, {"weight_decay", 0.1}}}}}},
       {"optimizer.adamw.weight_decay"}},
      {"micro batch", {{"train_micro_batch_size_per_gpu", 4}},
       {"shape.micro_batch", "batch_bytes"}},
      {"accumulation", {{"gradient_accumulation_steps", 3}}, {"gradient_accumulation_steps"}},
      {"seq_len", {{"porter", {{"model", {{"seq_len", 8}}}}}},
       {"shape.model.seq_len", "shape.seq", "batch_bytes"}},
      {"layers", {{"porter", {{"model", {{"layers", 3}}}}}}, {"shape.model.layers"}},
      {"memory_limit", {{"porter", {{"device", {{"memory_limit", "64MiB"}}}}}},
       {"device.memory_limit_bytes", "capacity_bytes"}},
      {"pinned_limit", {{"porter", {{"device", {{"pinned_limit", "32MiB"}}}}}},
       {"device.pinned_limit_bytes", "pinned_limit_bytes"}},
      {"sim_link_gbps", {{"porter", {{"device", {{"sim_link_gbps", 4}}}}}},
       {"device.sim_link_gbps", "plan.offload.link_bytes_per_s"}},
      {"threads", {{"porter", {{"device", {{"threads", 1}}}}}},
       {"device.threads", "optimizer.offload.threads"}},
      {"offload pin_memory",
       {{"zero_optimization", {{"offload_optimizer", {{"pin_memory", false}}}}}},
       {"optimizer.offload.pin_memory"}},
      {"poison_freed", {{"porter", {{"device", {{"poison_freed", true}}}}}},
       {"allocator.poison_freed"}},
      {"device model", {{"porter", {{"device", {{"model", "l40s"}}}}}}, {"device_model.model"}},
      {"peak_tflops", {{"porter", {{"device", {{"peak_tflops", 100}}}}}},
       {"device_model.overrides.peak_tflops"}},
      {"train seed", {{"porter", {{"train", {{"seed", 7}}}}}}, {"seed"}},
      {"cpu_checkpointing", {{"activation_checkpointing", {{"cpu_checkpointing", true}}}},
       {"plan.offload.enabled"}},
      {"contiguous_memory_optimization",
       {{"activation_checkpointing", {{"contiguous_memory_optimization", true}}}},
       {"plan.offload.contiguous", "stash.contiguous"}},
      {"synchronize_checkpoint_boundary",
       {{"activation_checkpointing", {{"synchronize_checkpoint_boundary", true}}}},
       {"stash.synchronize_boundary"}},
      {"profile", {{"activation_checkpointing", {{"profile", true}}}}, {"keep_all_copy_records"}},
      {"prefetch_depth", {{"porter", {{"checkpointing", {{"prefetch_depth", 3}}}}}},
       {"plan.checkpointing.prefetch_depth", "plan.offload.prefetch_depth"}},
      {"keep_last_on_device", {{"porter", {{"checkpointing", {{"keep_last_on_device", 0}}}}}},
       {"plan.checkpointing.keep_last_on_device", "plan.offload.keep_last_on_device"}},
      {"number_checkpoints", {{"activation_checkpointing", {{"number_checkpoints", 2}}}},
       {"plan.checkpointing.segments"}},
      {"policy", {{"porter", {{"checkpointing", {{"policy", "sqrt"}}}}}},
       {"plan.checkpointing.policy"}},
      {"partition_min_bytes", {{"porter", {{"checkpointing", {{"partition_min_bytes", 0}}}}}},
       {"plan.partition.min_bytes"}},
      {"sim_tp_gbps", {{"porter", {{"comm", {{"sim_tp_gbps", 25}}}}}},
       {"plan.partition.tp_bytes_per_s"}},
      {"sequence_parallel", {{"porter", {{"model", {{"sequence_parallel", true}}}}}},
       {"shape.model.sequence_parallel"}},
      {"reduce_bucket_size", {{"zero_optimization", {{"reduce_bucket_size", 1000}}}},
       {"reduce_bucket_elems"}},
      {"wall_clock_breakdown", {{"wall_clock_breakdown", true}}, {"wall_clock_breakdown"}},
      {"kv_heads", {{"porter", {{"model", {{"kv_heads", 2}}}}}}, {"shape.model.kv_heads"}},
      {"norm_eps", {{"porter", {{"model", {{"norm_eps", 1e-6}}}}}}, {"shape.model.norm_eps"}},
      {"max_positions", {{"porter", {{"model", {{"max_positions", 32}}}}}},
       {"shape.model.max_positions"}},
      // At tensor_parallel 1 partitioning has no effect (a warning).
      {"partition_activations",
       {{"activation_checkpointing", {{"partition_activations", true}}}}, {}},
  };
  for (const Knob& k : knobs) {
    nlohmann::json j = base_json();
    j.merge_patch(k.patch);
    EXPECT_EQ(differing(base, options_of(j)), k.expected) << k.name;
  }
}

// Note [Run options]: every key the config writes reaches at least one option, or is named
// here as another layer's. A key added to the config fails this test until it is one or the
// other.
TEST(RunOptions, EveryConfigKeyReachesAnOption) {
  struct KeyCase {
    nlohmann::json context;  // merged into the base first (e.g. the stage a key needs)
    nlohmann::json patch;    // merged after: the key's other value
  };
  const nlohmann::json none = nlohmann::json::object();
  const nlohmann::json z3 = {{"zero_optimization", {{"stage", 3}}}};
  const nlohmann::json llama = {{"porter", {{"model", {{"arch", "llama"}}}}}};
  auto at = [](const std::string& path, const nlohmann::json& value) {
    nlohmann::json j = value;
    for (size_t end = path.size(); end != std::string::npos;) {
      const size_t dot = path.rfind('.', end - 1);
      const size_t begin = dot == std::string::npos ? 0 : dot + 1;
      j = nlohmann::json{{path.substr(begin, end - begin), j}};
      end = dot;
      if (dot == std::string::npos) break;
    }
    return j;
  };
  const std::map<std::string, KeyCase> reaching = {
      {"train_batch_size", {{{"gradient_accumulation_steps", nullptr}}, {{"train_batch_size", 4}}}},
      {"train_micro_batch_size_per_gpu", {none, at("train_micro_batch_size_per_gpu", 4)}},
      {"gradient_accumulation_steps", {none, at("gradient_accumulation_steps", 2)}},
      {"gradient_clipping", {none, at("gradient_clipping", 0.5)}},
      {"wall_clock_breakdown", {none, at("wall_clock_breakdown", true)}},
      {"prescale_gradients", {none, at("prescale_gradients", true)}},
      {"gradient_predivide_factor", {none, at("gradient_predivide_factor", 2.0)}},
      {"optimizer.type", {none, at("optimizer.type", "Adam")}},
      {"optimizer.params.lr", {none, at("optimizer.params.lr", 3e-3)}},
      {"optimizer.params.betas", {none, at("optimizer.params.betas", {0.8, 0.9})}},
      {"optimizer.params.eps", {none, at("optimizer.params.eps", 1e-6)}},
      {"optimizer.params.weight_decay", {none, at("optimizer.params.weight_decay", 0.1)}},
      {"optimizer.params.torch_adam", {none, at("optimizer.params.torch_adam", true)}},
      {"optimizer.params.adam_w_mode",
       {at("optimizer.type", "Adam"), at("optimizer.params.adam_w_mode", false)}},
      {"fp16.enabled", {none, at("fp16.enabled", true)}},
      {"fp16.loss_scale", {none, at("fp16.loss_scale", 128.0)}},
      {"fp16.initial_scale_power", {none, at("fp16.initial_scale_power", 8)}},
      {"fp16.loss_scale_window", {none, at("fp16.loss_scale_window", 10)}},
      {"fp16.hysteresis", {none, at("fp16.hysteresis", 1)}},
      {"fp16.min_loss_scale", {none, at("fp16.min_loss_scale", 2.0)}},
      {"bf16.enabled", {none, at("bf16.enabled", true)}},
      {"zero_optimization.stage", {none, at("zero_optimization.stage", 2)}},
      {"zero_optimization.reduce_scatter", {none, at("zero_optimization.reduce_scatter", false)}},
      {"zero_optimization.reduce_bucket_size", {none, at("zero_optimization.reduce_bucket_size", 1000)}},
      {"zero_optimization.allgather_bucket_size",
       {none, at("zero_optimization.allgather_bucket_size", 1000)}},
      {"zero_optimization.overlap_comm", {none, at("zero_optimization.overlap_comm", true)}},
      {"zero_optimization.stage3_prefetch_bucket_size",
       {z3, at("zero_optimization.stage3_prefetch_bucket_size", 1000)}},
      {"zero_optimization.stage3_param_persistence_threshold",
       {z3, at("zero_optimization.stage3_param_persistence_threshold", 1000)}},
      {"zero_optimization.stage3_max_live_parameters",
       {z3, at("zero_optimization.stage3_max_live_parameters", 100000)}},
      {"zero_optimization.stage3_max_reuse_distance",
       {z3, at("zero_optimization.stage3_max_reuse_distance", 1000)}},
      {"zero_optimization.stage3_gather_16bit_weights_on_model_save",
       {z3, at("zero_optimization.stage3_gather_16bit_weights_on_model_save", true)}},
      {"zero_optimization.offload_optimizer.device",
       {z3, at("zero_optimization.offload_optimizer.device", "cpu")}},
      {"zero_optimization.offload_optimizer.pin_memory",
       {z3, at("zero_optimization.offload_optimizer.pin_memory", false)}},
      {"zero_optimization.offload_optimizer.ratio",
       {z3, at("zero_optimization.offload_optimizer", {{"device", "cpu"}, {"ratio", 0.5}})}},
      {"zero_optimization.offload_param.device",
       {z3, at("zero_optimization.offload_param.device", "cpu")}},
      {"zero_optimization.offload_param.pin_memory",
       {z3, at("zero_optimization.offload_param.pin_memory", false)}},
      {"activation_checkpointing.partition_activations",
       {{{"porter", {{"model", {{"tensor_parallel", 2}}}}}},
        at("activation_checkpointing.partition_activations", true)}},
      {"activation_checkpointing.cpu_checkpointing",
       {none, at("activation_checkpointing.cpu_checkpointing", true)}},
      {"activation_checkpointing.contiguous_memory_optimization",
       {none, at("activation_checkpointing.contiguous_memory_optimization", true)}},
      {"activation_checkpointing.number_checkpoints",
       {none, at("activation_checkpointing.number_checkpoints", 2)}},
      {"activation_checkpointing.synchronize_checkpoint_boundary",
       {none, at("activation_checkpointing.synchronize_checkpoint_boundary", true)}},
      {"activation_checkpointing.profile", {none, at("activation_checkpointing.profile", true)}},
      {"porter.model.arch", {none, llama}},
      {"porter.model.layers", {none, at("porter.model.layers", 3)}},
      {"porter.model.hidden", {none, at("porter.model.hidden", 64)}},
      {"porter.model.heads", {none, at("porter.model.heads", 4)}},
      {"porter.model.seq_len", {none, at("porter.model.seq_len", 8)}},
      {"porter.model.vocab", {none, at("porter.model.vocab", 128)}},
      {"porter.model.dropout", {none, at("porter.model.dropout", 0.1)}},
      {"porter.model.tie_embeddings", {none, at("porter.model.tie_embeddings", false)}},
      {"porter.model.tensor_parallel", {none, at("porter.model.tensor_parallel", 2)}},
      {"porter.model.sequence_parallel", {none, at("porter.model.sequence_parallel", true)}},
      {"porter.model.kv_heads", {llama, at("porter.model.kv_heads", 1)}},
      {"porter.model.intermediate", {llama, at("porter.model.intermediate", 96)}},
      {"porter.model.norm_eps", {none, at("porter.model.norm_eps", 1e-6)}},
      {"porter.model.rope_theta", {llama, at("porter.model.rope_theta", 500000.0)}},
      {"porter.model.max_positions", {none, at("porter.model.max_positions", 32)}},
      {"porter.model.attention", {none, at("porter.model.attention", "flash")}},
      {"porter.model.loss_tiles", {none, at("porter.model.loss_tiles", 4)}},
      {"porter.model.mlp_tiles", {none, at("porter.model.mlp_tiles", 4)}},
      {"porter.device.type", {none, at("porter.device.type", "cuda")}},
      {"porter.device.memory_limit", {none, at("porter.device.memory_limit", "64MiB")}},
      {"porter.device.pinned_limit", {none, at("porter.device.pinned_limit", "32MiB")}},
      {"porter.device.sim_link_gbps", {none, at("porter.device.sim_link_gbps", 4)}},
      {"porter.device.threads", {none, at("porter.device.threads", 1)}},
      {"porter.device.poison_freed", {none, at("porter.device.poison_freed", true)}},
      {"porter.device.kernel_choice", {none, at("porter.device.kernel_choice", "fastest")}},
      {"porter.device.kernel_table", {none, at("porter.device.kernel_table", "table.json")}},
      {"porter.device.model", {none, at("porter.device.model", "h100-sxm")}},
      {"porter.device.peak_tflops", {none, at("porter.device.peak_tflops", 100)}},
      {"porter.device.hbm_gbps", {none, at("porter.device.hbm_gbps", 100)}},
      {"porter.device.host_link_gbps", {none, at("porter.device.host_link_gbps", 10)}},
      {"porter.device.interconnect_gbps", {none, at("porter.device.interconnect_gbps", 50)}},
      {"porter.checkpointing.policy", {none, at("porter.checkpointing.policy", "sqrt")}},
      {"porter.checkpointing.prefetch_depth", {none, at("porter.checkpointing.prefetch_depth", 3)}},
      {"porter.checkpointing.keep_last_on_device",
       {none, at("porter.checkpointing.keep_last_on_device", 0)}},
      {"porter.checkpointing.partition_min_bytes",
       {none, at("porter.checkpointing.partition_min_bytes", 0)}},
      {"porter.train.seed", {none, at("porter.train.seed", 7)}},
      {"porter.comm.sim_tp_gbps", {none, at("porter.comm.sim_tp_gbps", 25)}},
      {"porter.optimizer.no_decay",
       {none, at("porter.optimizer.no_decay", nlohmann::json::array())}},
      {"porter.optimizer.param_groups",
       {none, at("porter.optimizer.param_groups",
                 {{{"params", {"*.bias"}}, {"lr_scale", 0.5}}})}},
      {"scheduler.type", {none, {{"scheduler", {{"type", "WarmupLR"}}}}}},
      {"data_types.grad_accum_dtype",
       {{{"bf16", {{"enabled", true}}}}, at("data_types.grad_accum_dtype", "bf16")}},
      {"communication_data_type",
       {{{"bf16", {{"enabled", true}}}}, at("communication_data_type", "bf16")}},
  };
  // Keys of other layers: the data, the training loop and its outputs, the launch and
  // rendezvous, and DeepSpeed keys porter reads without effect (their warning says so).
  const std::set<std::string> elsewhere = {
      "steps_per_print", "porter.data.type", "porter.data.seed", "porter.train.steps",
      "porter.train.log_every", "porter.train.eval_every", "porter.train.eval_micro_batches",
      "porter.train.save_every", "porter.train.keep_checkpoints",
      "porter.trace.path", "porter.comm.backend", "porter.comm.timeout_s",
      "zero_optimization.contiguous_gradients", "zero_optimization.round_robin_gradients",
      "zero_optimization.allgather_partitions", "zero_optimization.sub_group_size",
      "zero_optimization.offload_optimizer.buffer_count",
      "zero_optimization.offload_optimizer.fast_init",
      "zero_optimization.offload_param.buffer_count",
      "zero_optimization.offload_param.buffer_size",
      "zero_optimization.offload_param.max_in_cpu"};
  // Every key the config writes is one or the other.
  std::map<std::string, std::string> keys;
  flatten(config::to_json(config::parse_config_string(base_json().dump()).config), "", keys);
  for (const auto& [key, value] : keys) {
    const bool listed = reaching.count(key) > 0 || elsewhere.count(key) > 0;
    EXPECT_TRUE(listed) << key << ": a config key that neither reaches RunOptions here nor is "
                           "named as another layer's";
  }
  for (const auto& [key, c] : reaching) {
    nlohmann::json before = base_json();
    before.merge_patch(c.context);
    nlohmann::json after = before;
    after.merge_patch(c.patch);
    const config::ParseOptions two{2, false};  // tensor_parallel 2 needs two ranks
    const bool tp = after["porter"]["model"].value("tensor_parallel", 1) > 1;
    const config::ParseOptions one{1, false};
    RunOptions a, b;
    try {
      a = make_run_options(
          config::parse_config_string(before.dump(), tp ? two : one).config);
      b = make_run_options(config::parse_config_string(after.dump(), tp ? two : one).config);
    } catch (const std::exception& e) {
      ADD_FAILURE() << key << ": " << e.what();
      continue;
    }
    EXPECT_FALSE(differing(a, b).empty()) << key << " changes no field of RunOptions";
  }
}

TEST(RunOptions, OffloadOptionsFromTheConfig) {
  config::Config cfg;
  EXPECT_FALSE(offload_options(cfg).enabled);
  EXPECT_EQ(offload_options(cfg).link_bytes_per_s, 0.0);
  cfg.activation_checkpointing = config::ActivationCheckpointingConfig{};
  cfg.activation_checkpointing->cpu_checkpointing = true;
  cfg.activation_checkpointing->contiguous_memory_optimization = true;
  cfg.porter.checkpointing.prefetch_depth = 3;
  cfg.porter.checkpointing.keep_last_on_device = 2;
  cfg.porter.device.sim_link_gbps = 0.5;
  const checkpoint::OffloadOptions o = offload_options(cfg);
  EXPECT_TRUE(o.enabled);
  EXPECT_TRUE(o.contiguous);
  EXPECT_EQ(o.prefetch_depth, 3);
  EXPECT_EQ(o.keep_last_on_device, 2);
  EXPECT_DOUBLE_EQ(o.link_bytes_per_s, 0.5e9);
  EXPECT_EQ(make_run_options(cfg).plan.offload.link_bytes_per_s, o.link_bytes_per_s);
}

TEST(RunOptions, PartitionOptionsFromTheConfig) {
  config::Config cfg;
  EXPECT_EQ(partition_options(cfg).ways, 1);
  EXPECT_EQ(partition_options(cfg).min_bytes, 65536u);
  cfg.porter.model.tensor_parallel = 4;
  EXPECT_EQ(partition_options(cfg).ways, 1);  // partition_activations off
  cfg.activation_checkpointing = config::ActivationCheckpointingConfig{};
  cfg.activation_checkpointing->partition_activations = true;
  cfg.porter.checkpointing.partition_min_bytes = 4096;
  cfg.porter.comm.sim_tp_gbps = 25.0;
  const checkpoint::PartitionOptions p = partition_options(cfg);
  EXPECT_EQ(p.ways, 4);
  EXPECT_TRUE(p.enabled());
  EXPECT_EQ(p.min_bytes, 4096u);
  EXPECT_DOUBLE_EQ(p.tp_bytes_per_s, 25e9);
  // Under sequence parallelism the checkpoints are already 1/t of the rows on each rank.
  cfg.porter.model.sequence_parallel = true;
  EXPECT_EQ(partition_options(cfg).ways, 1);
}

TEST(RunOptions, TheComputeDtypeRule) {
  EXPECT_EQ(options_of(base_json()).compute_dtype, tensor::DType::kF32);
  nlohmann::json f = base_json();
  f["fp16"] = {{"enabled", true}};
  EXPECT_EQ(options_of(f).compute_dtype, tensor::DType::kF16);
  nlohmann::json b = base_json();
  b["bf16"] = {{"enabled", true}};
  const RunOptions rb = options_of(b);
  EXPECT_EQ(rb.compute_dtype, tensor::DType::kBF16);
  EXPECT_EQ(rb.shape.compute_dtype, tensor::DType::kBF16);
}

TEST(RunOptions, DerivedFigures) {
  const RunOptions r = options_of(base_json());
  EXPECT_EQ(r.batch_bytes, 2u * 2 * 16 * 4);  // tokens and targets, (2, 16) i32 each
  EXPECT_EQ(r.capacity_bytes, std::optional<size_t>(memory::kDefaultCpuMemoryLimitBytes));
  checkpoint::Prediction p;
  p.peak_total_bytes = 1000;
  EXPECT_EQ(r.predicted_peak_bytes(500, p), 500u + r.batch_bytes + 1000u);
  EXPECT_EQ(r.analytic_costs().num_stages(), 4);  // embedding, 2 blocks, head
  EXPECT_EQ(r.selective_name, "attention");
}

TEST(RunOptions, CostSourceRule) {
  auto source = [](const char* policy, bool offload, bool analytic, CostUse use) {
    nlohmann::json j = base_json();
    j["porter"]["checkpointing"] = {{"policy", policy}};
    if (std::string(policy) == "optimal") j["porter"]["checkpointing"]["memory_budget"] = 0.5;
    if (std::string(policy) == "none") j.erase("activation_checkpointing");
    if (offload) j["activation_checkpointing"] = {{"cpu_checkpointing", true}};
    return options_of(j).cost_source(analytic, use);
  };
  using enum CostSource;
  EXPECT_EQ(source("none", false, true, CostUse::kTraining), kAnalytic);
  EXPECT_EQ(source("none", false, true, CostUse::kPlan), kAnalytic);
  EXPECT_EQ(source("none", false, false, CostUse::kTraining), kProfiled);  // a user's chain
  EXPECT_EQ(source("full", false, true, CostUse::kPlan), kAnalytic);
  EXPECT_EQ(source("full", false, true, CostUse::kTraining), kProfiled);  // recompute time
  EXPECT_EQ(source("full", true, true, CostUse::kPlan), kProfiled);       // copy time
  EXPECT_EQ(source("optimal", false, true, CostUse::kPlan), kProfiled);
  EXPECT_EQ(cost_source_name(kAnalytic), "analytic");
  EXPECT_EQ(cost_source_name(kProfiled), "profiled");
}

TEST(RunOptions, RecomputeFlopFraction) {
  checkpoint::ChainCosts c;
  c.stages.resize(2);
  c.stages[0].forward_flops = 10;
  c.stages[1].forward_flops = 30;
  checkpoint::Prediction p;
  p.recompute_flops = 30;
  EXPECT_DOUBLE_EQ(recompute_flop_fraction(p, c), 30.0 / 120.0);
  EXPECT_EQ(recompute_flop_fraction(p, checkpoint::ChainCosts{}), 0.0);
}

void expect_refused(const nlohmann::json& j, const std::string& text, int world_size = 1) {
  const config::Config c =
      config::parse_config_string(j.dump(), config::ParseOptions{world_size, false}).config;
  try {
    check_supported(c, world_size);
    ADD_FAILURE() << "accepted; expected: " << text;
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr(text));
  }
}

TEST(RunOptions, UnsupportedSaysSoNamingTheKeyAndWhatToUse) {
  EXPECT_NO_THROW(check_supported(config::parse_config_string(base_json().dump()).config, 1));
  nlohmann::json z3 = base_json();
  z3["zero_optimization"] = {{"stage", 3}};
  EXPECT_NO_THROW(check_supported(config::parse_config_string(z3.dump()).config, 1));
  nlohmann::json opt = base_json();
  opt["zero_optimization"] = {{"stage", 2}, {"offload_optimizer", {{"device", "cpu"}}}};
  EXPECT_NO_THROW(check_supported(config::parse_config_string(opt.dump()).config, 1));
  nlohmann::json par = base_json();
  par["zero_optimization"] = {{"stage", 3}, {"offload_param", {{"device", "cpu"}}},
                               {"offload_optimizer", {{"device", "cpu"}, {"ratio", 0.5}}}};
  EXPECT_NO_THROW(check_supported(config::parse_config_string(par.dump()).config, 1));
  nlohmann::json tp = base_json();
  tp["porter"]["model"]["tensor_parallel"] = 2;
  const config::Config tp2 =
      config::parse_config_string(tp.dump(), config::ParseOptions{2, false}).config;
  EXPECT_NO_THROW(check_supported(tp2, 1, 2));
  try {
    check_supported(tp2, 2, 1);
    ADD_FAILURE() << "a tp config without its tp group was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("porter.model.tensor_parallel 2 but the tensor-parallel "
                                    "communicator has 1 rank(s)"));
  }
  nlohmann::json l2 = base_json();
  l2["optimizer"] = {{"type", "Adam"},
                     {"params", {{"lr", 1e-3}, {"adam_w_mode", false}, {"weight_decay", 0.1}}}};
  expect_refused(l2, "optimizer.params.adam_w_mode: false with weight_decay");
}

// Note [Gradient dtype]: data_types.grad_accum_dtype, else communication_data_type, else f32,
// for the flat buffer, the reducer and the byte counts.
TEST(RunOptions, GradientDtypeComesFromGradAccumDtypeThenCommunicationDataType) {
  nlohmann::json j = base_json();
  EXPECT_EQ(options_of(j).grad_dtype, tensor::DType::kF32);
  j["bf16"] = {{"enabled", true}};
  EXPECT_EQ(options_of(j).grad_dtype, tensor::DType::kF32);  // DeepSpeed's bf16 default: f32 grads
  j["communication_data_type"] = "bf16";
  EXPECT_EQ(options_of(j).grad_dtype, tensor::DType::kBF16);
  j.erase("communication_data_type");
  j["data_types"] = {{"grad_accum_dtype", "bf16"}};
  const RunOptions r = options_of(j);
  EXPECT_EQ(r.grad_dtype, tensor::DType::kBF16);
  EXPECT_EQ(r.reducer.grad_dtype, tensor::DType::kBF16);
  EXPECT_EQ(r.state_dtypes().grad_bytes(), 2u);
  EXPECT_EQ(r.to_json()["reducer"]["grad_dtype"], "bf16");
  j["data_types"] = {{"grad_accum_dtype", "fp32"}};
  j["communication_data_type"] = "fp32";
  EXPECT_EQ(options_of(j).grad_dtype, tensor::DType::kF32);
}

}  // namespace
}  // namespace porter::engine
