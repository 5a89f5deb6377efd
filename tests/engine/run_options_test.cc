// RunOptions (engine/run_options.h): each config knob reaches exactly the options it names,
// the rules that used to be written in several places, and what the engine refuses.
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

}  // namespace
}  // namespace porter::engine
