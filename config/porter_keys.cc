// porter's own section ("porter": model, data, device, checkpointing, train, trace, comm,
// optimizer): its key tables, the checks within it, the checkpoint-policy resolution, and the
// checks that span sections.
#include <algorithm>
#include <cmath>
#include <string>

#include "config/sections.h"

namespace porter::config::detail {
namespace {

constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();
constexpr IntRange kPositive{1, kInt64Max};

// Bounds keep every size product (hidden^2, vocab x hidden, ...) inside 64 bits.
constexpr Key<ModelConfig> kModelKeys[] = {
    {"arch", enum_key<&ModelConfig::type, kModelTypes>(), Alias{"type"}},
    {"from", &ModelConfig::from, kOmitNone},
    {"layers", &ModelConfig::layers, IntRange{1, 100'000}},
    {"hidden", &ModelConfig::hidden, IntRange{1, 1 << 20}},
    {"heads", &ModelConfig::heads, IntRange{1, 1 << 16}},
    {"seq_len", &ModelConfig::seq_len, IntRange{1, 1 << 24}},
    {"vocab", &ModelConfig::vocab, IntRange{1, 1 << 24}},
    {"dropout", &ModelConfig::dropout, RealRange{0.0, 1.0, false, true}},
    {"tie_embeddings", &ModelConfig::tie_embeddings},
    {"tensor_parallel", &ModelConfig::tensor_parallel, IntRange{1, 1 << 16}},
    {"sequence_parallel", &ModelConfig::sequence_parallel},
    {"kv_heads", &ModelConfig::kv_heads, IntRange{0, 1 << 16}},
    {"intermediate", &ModelConfig::intermediate, IntRange{0, 1 << 22}},
    {"norm_eps", &ModelConfig::norm_eps, RealRange{0.0, 1.0, true, false}},
    {"rope_theta", &ModelConfig::rope_theta, RealRange{0.0, 1e12, true, false}},
    {"max_positions", &ModelConfig::max_positions, IntRange{0, 1 << 24}},
    {"attention", enum_key<&ModelConfig::attention, kAttentionKinds>()},
    {"loss_tiles", &ModelConfig::loss_tiles, IntRange{0, 1 << 20}},
    {"mlp_tiles", &ModelConfig::mlp_tiles, IntRange{0, 1 << 20}},
};

// After the whole porter section: the data type is read after the model.
void check_model(const std::string& path, const Config& c) {
  const ModelConfig& m = c.porter.model;
  if (m.hidden % m.heads != 0) {
    fail(path + ".hidden", std::to_string(m.hidden) + " is not divisible by heads " +
                               std::to_string(m.heads) + "; each head needs hidden/heads channels");
  }
  // The GPT has learned positions and one key/value head per query head; every other
  // architecture (Llama, Qwen2) is rotary with grouped-query attention.
  if (m.type == ModelType::kGpt) {
    if (m.kv_heads != 0 && m.kv_heads != m.heads) {
      fail(path + ".kv_heads", std::to_string(m.kv_heads) + " key/value heads, but the GPT has "
                               "one per query head (" + std::to_string(m.heads) + "); grouped-"
                               "query attention needs " + path + ".arch \"llama\"");
    }
    if (m.intermediate != 0 && m.intermediate != 4 * m.hidden) {
      fail(path + ".intermediate", std::to_string(m.intermediate) + ", but the GPT's MLP is 4 x "
                                   "hidden = " + std::to_string(4 * m.hidden) + " wide; drop the "
                                   "key or set " + path + ".arch \"llama\"");
    }
    if (m.rope_theta != 10000.0) {
      fail(path + ".rope_theta", "is used only by " + path + ".arch \"llama\" (the GPT has "
                                 "learned positions, not rotary ones); drop the key");
    }
  } else {
    const int64_t kv = m.kv_heads == 0 ? m.heads : m.kv_heads;
    if (m.heads % kv != 0) {
      fail(path + ".kv_heads", std::to_string(kv) + " does not divide heads " +
                                   std::to_string(m.heads) + "; each key/value head serves an "
                                   "equal group of query heads");
    }
    if (kv % m.tensor_parallel != 0) {
      fail(path + ".tensor_parallel", std::to_string(m.tensor_parallel) +
                                          " does not divide kv_heads " + std::to_string(kv) +
                                          "; tensor parallelism splits the key/value heads "
                                          "evenly");
    }
    if ((m.hidden / m.heads) % 2 != 0) {
      fail(path + ".hidden", "hidden / heads = " + std::to_string(m.hidden / m.heads) +
                                 " channels per head is odd; rotary embeddings rotate pairs of "
                                 "channels");
    }
  }
  if (m.max_positions != 0 && m.max_positions < m.seq_len) {
    fail(path + ".max_positions", std::to_string(m.max_positions) + " positions are fewer than "
                                  "seq_len " + std::to_string(m.seq_len) + "; raise it or lower "
                                  "seq_len");
  }
  if (m.heads % m.tensor_parallel != 0) {
    fail(path + ".tensor_parallel", std::to_string(m.tensor_parallel) +
                                        " does not divide heads " + std::to_string(m.heads) +
                                        "; tensor parallelism splits the heads evenly");
  }
  if (c.world_size % m.tensor_parallel != 0) {
    fail(path + ".tensor_parallel", std::to_string(m.tensor_parallel) +
                                        " does not divide the world size " +
                                        std::to_string(c.world_size) +
                                        "; ranks = data-parallel x tensor-parallel");
  }
  // Text data is read byte by byte (io/data.cc): each of the 256 byte values is a token.
  if (c.porter.data.type == DataType::kText && m.vocab < 256) {
    fail(path + ".vocab", "text data is byte-level and needs a vocab of at least 256, got " +
                              std::to_string(m.vocab) + " (porter.data.type is \"text\"); set " +
                              path + ".vocab to 256");
  }
}

void check_file_path(const std::string& file, const std::string& path) {
  if (file.empty()) fail(path, "\"\": empty file path");
}

// A file path or a list of them.
void read_paths(const Json& paths, const std::string& path, DataConfig& d, Diagnostics&) {
  if (paths.is_string()) {
    d.paths.push_back(as_string(paths, path));
  } else if (paths.is_array()) {
    for (size_t i = 0; i < paths.size(); ++i) {
      d.paths.push_back(as_string(paths[i], path + "[" + std::to_string(i) + "]"));
    }
  } else {
    fail(path, "expected a file path or a list of file paths, got " + describe(paths));
  }
  for (size_t i = 0; i < d.paths.size(); ++i) {
    check_file_path(d.paths[i], path + "[" + std::to_string(i) + "]");
  }
}

std::optional<OJson> write_paths(const DataConfig& d) {
  if (d.paths.empty()) return std::nullopt;
  return OJson(d.paths);
}

void read_val_paths(const Json& paths, const std::string& path, DataConfig& d, Diagnostics& diag) {
  DataConfig val;
  read_paths(paths, path, val, diag);
  d.val_paths = std::move(val.paths);
}

std::optional<OJson> write_val_paths(const DataConfig& d) {
  if (d.val_paths.empty()) return std::nullopt;
  return OJson(d.val_paths);
}

constexpr Key<DataConfig> kDataKeys[] = {
    {"type", enum_key<&DataConfig::type, kDataTypes>()},
    {"paths", Custom<DataConfig>{&read_paths, &write_paths}},
    {"val_paths", Custom<DataConfig>{&read_val_paths, &write_val_paths}},
    {"seed", &DataConfig::seed, IntRange{0, kInt64Max}},
};

void read_data(ObjectReader& r, Config& c) {
  DataConfig& d = c.porter.data;
  read_keys(r, d, c);
  if (d.type != DataType::kSynthetic && d.paths.empty()) {
    fail(r.path_of("paths"), "missing; data type \"" + std::string(to_string(d.type)) +
                                 "\" needs one or more files in paths");
  }
  if (d.type == DataType::kSynthetic && !d.paths.empty()) {
    fail(r.path_of("paths"), describe(*r.get("paths")) + " given, but " + r.path_of("type") +
                                 " is \"synthetic\"; set type to \"text\" or \"tokens\", or "
                                 "drop paths");
  }
  if (d.type == DataType::kSynthetic && !d.val_paths.empty()) {
    fail(r.path_of("val_paths"), "given, but " + r.path_of("type") + " is \"synthetic\"; a "
                                 "validation set is files of the training data's type");
  }
  r.finish();
}

// porter.device.model: a name of kGpuModels, or null (none). The error for another name lists
// the known ones.
void read_device_model(const Json& v, const std::string& path, DeviceConfig& d, Diagnostics&) {
  d.model = v.is_null() ? std::nullopt : std::optional<GpuModel>(as_enum(v, path, kGpuModels));
}
std::optional<OJson> write_device_model(const DeviceConfig& d) {
  if (!d.model) return std::nullopt;
  return OJson(enum_name(kGpuModels, *d.model));
}

constexpr Key<DeviceConfig> kDeviceKeys[] = {
    {"type", enum_key<&DeviceConfig::type, kDeviceTypes>()},
    {"memory_limit", &DeviceConfig::memory_limit_bytes, Bytes{1}},
    {"pinned_limit", &DeviceConfig::pinned_limit_bytes, Bytes{1}},
    {"sim_link_gbps", &DeviceConfig::sim_link_gbps, RealRange{0.0, 1e6, true, false}},
    {"threads", &DeviceConfig::threads, IntRange{0, 4096}},
    {"poison_freed", &DeviceConfig::poison_freed},
    {"kernel_choice", enum_key<&DeviceConfig::kernel_choice, kKernelChoices>()},
    {"kernel_table", &DeviceConfig::kernel_table, kOmitNone},
    {"model", Custom<DeviceConfig>{&read_device_model, &write_device_model}},
    {"peak_tflops", &DeviceConfig::peak_tflops, RealRange{0.0, 1e6, true, false}, kOmitNone},
    {"hbm_gbps", &DeviceConfig::hbm_gbps, RealRange{0.0, 1e6, true, false}, kOmitNone},
    {"host_link_gbps", &DeviceConfig::host_link_gbps, RealRange{0.0, 1e6, true, false},
     kOmitNone},
    {"interconnect_gbps", &DeviceConfig::interconnect_gbps, RealRange{0.0, 1e6, true, false},
     kOmitNone},
};

void read_device(ObjectReader& r, Config& c) {
  DeviceConfig& d = c.porter.device;
  read_keys(r, d, c);
  if (d.sim_link_gbps && d.type == DeviceType::kCuda) {
    fail(r.path_of("sim_link_gbps"), describe(*r.get("sim_link_gbps")) +
                                         ": only the simulated cpu device throttles copies, but "
                                         "porter.device.type is \"cuda\"");
  }
  r.finish();
}

// null: none.
void read_memory_budget(const Json& v, const std::string& path, CheckpointingConfig& k,
                        Diagnostics&) {
  if (v.is_null()) return;
  const std::string rule =
      "a fraction in [0, 1] of the memory that keeping every activation needs, or a byte "
      "count (an integer >= 2, or a string such as \"6GiB\")";
  if (v.is_string()) {
    k.memory_budget = MemoryBudget{as_bytes(v, path, 2)};
    return;
  }
  if (!v.is_number()) fail(path, "expected " + rule + ", got " + describe(v));
  double d = v.get<double>();
  if (d >= 0.0 && d <= 1.0) {
    k.memory_budget = MemoryBudget{d};
  } else if (d > 1.0 && (v.is_number_integer() || d == std::floor(d))) {
    k.memory_budget = MemoryBudget{as_bytes(v, path, 2)};
  } else {
    fail(path, "expected " + rule + ", got " + describe(v));
  }
}

std::optional<OJson> write_memory_budget(const CheckpointingConfig& k) {
  if (!k.memory_budget) return std::nullopt;
  return std::visit([](auto v) { return OJson(v); }, k.memory_budget->value);
}

void read_selective_ops(const Json& ops, const std::string& path, CheckpointingConfig& k,
                        Diagnostics&) {
  if (!ops.is_array()) fail(path, "expected a list of op kinds, got " + describe(ops));
  const std::vector<std::string>& kinds = selective_op_kinds();
  std::vector<std::string_view> names(kinds.begin(), kinds.end());
  for (size_t i = 0; i < ops.size(); ++i) {
    const std::string item = path + "[" + std::to_string(i) + "]";
    std::string op = kinds[static_cast<size_t>(as_enum_index(ops[i], item, names))];
    if (std::find(k.selective_ops.begin(), k.selective_ops.end(), op) != k.selective_ops.end()) {
      fail(item, "\"" + op + "\" is listed twice");
    }
    k.selective_ops.push_back(op);
  }
}

std::optional<OJson> write_selective_ops(const CheckpointingConfig& k) {
  if (k.selective_ops.empty()) return std::nullopt;
  return OJson(k.selective_ops);
}

// `segments` has no key: the parser folds activation_checkpointing.number_checkpoints into it
// (Note [Policy from activation_checkpointing]), and it is not printed.
using Checkpointing = CheckpointingConfig;
constexpr Key<Checkpointing> kCheckpointingKeys[] = {
    {"policy", enum_key<&Checkpointing::policy, kCheckpointPolicies>()},
    {"every_n_layers", &Checkpointing::every_n_layers, kPositive, kOmitNone},
    {"block_layers", &Checkpointing::block_layers, kPositive, kOmitNone},
    {"memory_budget", Custom<Checkpointing>{&read_memory_budget, &write_memory_budget}},
    {"selective_ops", Custom<Checkpointing>{&read_selective_ops, &write_selective_ops}},
    {"prefetch_depth", &Checkpointing::prefetch_depth, IntRange{0, 1024}},
    {"keep_last_on_device", &Checkpointing::keep_last_on_device, IntRange{0, 1'000'000}},
    {"partition_min_bytes", &Checkpointing::partition_min_bytes, IntRange{0, kInt64Max}},
};

constexpr Key<TrainConfig> kTrainKeys[] = {
    {"steps", &TrainConfig::steps, kPositive},
    {"seed", &TrainConfig::seed, IntRange{0, kInt64Max}},
    {"log_every", &TrainConfig::log_every, kPositive},
    {"eval_every", &TrainConfig::eval_every, IntRange{0, kInt64Max}},
    {"eval_micro_batches", &TrainConfig::eval_micro_batches, IntRange{1, 1 << 20}},
    {"save_every", &TrainConfig::save_every, IntRange{0, kInt64Max}},
    {"keep_checkpoints", &TrainConfig::keep_checkpoints, IntRange{1, 1'000'000}},
};

constexpr Key<TraceConfig> kTraceKeys[] = {
    {"path", &TraceConfig::path, Check{&check_file_path}},
};

constexpr Key<CommConfig> kCommKeys[] = {
    {"backend", enum_key<&CommConfig::backend, kCommBackends>()},
    {"timeout_s", &CommConfig::timeout_s, RealRange{0.0, 1e7, true, false}},
    {"sim_tp_gbps", &CommConfig::sim_tp_gbps, RealRange{0.0, 1e6, true, false}},
};

// porter.optimizer.no_decay: a list of parameter patterns.
std::vector<std::string> read_patterns(const Json& v, const std::string& path) {
  if (!v.is_array()) {
    fail(path, "expected a list of parameter patterns (e.g. [\"ndim<2\", \"wpe\"]), got " +
                   describe(v));
  }
  std::vector<std::string> out;
  for (size_t i = 0; i < v.size(); ++i) {
    const std::string item = path + "[" + std::to_string(i) + "]";
    out.push_back(as_string(v[i], item));
    check_param_pattern(out.back(), item);
  }
  return out;
}

void read_no_decay(const Json& v, const std::string& path, PorterOptimizerConfig& o,
                   Diagnostics&) {
  o.no_decay = read_patterns(v, path);
}
std::optional<OJson> write_no_decay(const PorterOptimizerConfig& o) { return OJson(o.no_decay); }

// porter.optimizer.param_groups: a list of {"params": [...], "weight_decay": x, "lr_scale": y}.
// A key a group does not know is an error, not a warning: a misspelt weight_decay would train
// the group at the optimizer's decay.
void read_param_groups(const Json& v, const std::string& path, PorterOptimizerConfig& o,
                       Diagnostics&) {
  if (!v.is_array()) fail(path, "expected a list of groups, got " + describe(v));
  for (size_t i = 0; i < v.size(); ++i) {
    const std::string item = path + "[" + std::to_string(i) + "]";
    const Json& g = v[i];
    if (!g.is_object()) {
      fail(item, "expected a group {\"params\": [patterns], \"weight_decay\": x, "
                 "\"lr_scale\": y}, got " + describe(g));
    }
    for (const auto& [key, value] : g.items()) {
      if (key != "params" && key != "weight_decay" && key != "lr_scale") {
        fail(child_path(item, key), "unknown key of a parameter group; a group takes "
                                    "\"params\", \"weight_decay\" and \"lr_scale\"");
      }
    }
    ParamGroupConfig group;
    if (!g.contains("params")) {
      fail(child_path(item, "params"), "missing; a group names its parameters with a list of "
                                       "patterns");
    }
    group.params = read_patterns(g.at("params"), child_path(item, "params"));
    if (group.params.empty()) {
      fail(child_path(item, "params"), "[]: a group without patterns matches no parameter");
    }
    if (g.contains("weight_decay") && !g.at("weight_decay").is_null()) {
      group.weight_decay = as_real(g.at("weight_decay"), child_path(item, "weight_decay"),
                                   RealRange{0.0, 1e6});
    }
    if (g.contains("lr_scale")) {
      group.lr_scale = as_real(g.at("lr_scale"), child_path(item, "lr_scale"), RealRange{0.0, 1e6});
    }
    o.param_groups.push_back(std::move(group));
  }
}

std::optional<OJson> write_param_groups(const PorterOptimizerConfig& o) {
  OJson out = OJson::array();
  for (const ParamGroupConfig& g : o.param_groups) {
    OJson j;
    j["params"] = g.params;
    j["weight_decay"] = g.weight_decay ? OJson(*g.weight_decay) : OJson(nullptr);
    j["lr_scale"] = g.lr_scale;
    out.push_back(std::move(j));
  }
  return out;
}

constexpr Key<PorterOptimizerConfig> kOptimizerKeys[] = {
    {"param_groups", Custom<PorterOptimizerConfig>{&read_param_groups, &write_param_groups}},
    {"no_decay", Custom<PorterOptimizerConfig>{&read_no_decay, &write_no_decay}},
};

// A section read by its table alone.
template <typename S>
void read_plain(ObjectReader& r, S& section, const Config& c) {
  read_keys(r, section, c);
  r.finish();
}

}  // namespace

PorterReadState read_porter_section(ObjectReader& root, Config& c) {
  PorterReadState state;
  PorterSection& p = c.porter;
  if (std::optional<ObjectReader> r = root.object("porter")) {
    if (std::optional<ObjectReader> s = r->object("model")) {
      state.model_given = true;
      read_plain(*s, p.model, c);
    }
    if (std::optional<ObjectReader> s = r->object("data")) read_data(*s, c);
    if (std::optional<ObjectReader> s = r->object("device")) read_device(*s, c);
    if (std::optional<ObjectReader> s = r->object("checkpointing")) {
      state.policy_given = s->has("policy");
      read_plain(*s, p.checkpointing, c);
    }
    if (std::optional<ObjectReader> s = r->object("train")) {
      state.log_every_given = s->has("log_every");
      read_plain(*s, p.train, c);
    }
    if (std::optional<ObjectReader> s = r->object("trace")) read_plain(*s, p.trace, c);
    if (std::optional<ObjectReader> s = r->object("comm")) read_plain(*s, p.comm, c);
    if (std::optional<ObjectReader> s = r->object("optimizer")) read_plain(*s, p.optimizer, c);
    r->finish();
  }
  check_model("porter.model", c);
  return state;
}

// Tensor and sequence parallelism against the batch and the checkpoint settings
// (docs/tensor-parallel.md).
void check_tensor_parallel(const Config& c, Diagnostics& diag) {
  const ModelConfig& m = c.porter.model;
  const std::optional<ActivationCheckpointingConfig>& ac = c.activation_checkpointing;
  const bool partition = ac && ac->partition_activations;
  if (m.tensor_parallel == 1) {
    if (m.sequence_parallel) {
      diag.warn("porter.model.sequence_parallel",
                "true has no effect with porter.model.tensor_parallel 1 (one rank holds every "
                "token row)");
    }
    if (partition) {
      diag.warn("activation_checkpointing.partition_activations",
                "true has no effect with porter.model.tensor_parallel 1: a tensor-parallel "
                "group of one rank holds whole checkpoints");
    }
    return;
  }
  if (partition && c.porter.checkpointing.policy == CheckpointPolicy::kNone) {
    diag.warn("activation_checkpointing.partition_activations",
              "true has no effect with porter.checkpointing.policy \"none\": nothing is held "
              "across a segment");
  }
  if (partition && m.sequence_parallel) {
    diag.warn("activation_checkpointing.partition_activations",
              "true has no effect under porter.model.sequence_parallel: the checkpoints are "
              "already 1/t of the token rows on each rank and are not partitioned again");
  }
  if (m.sequence_parallel && m.mlp_tiles > 1) {
    fail("porter.model.mlp_tiles",
         std::to_string(m.mlp_tiles) + " MLP tiles with porter.model.sequence_parallel: a rank "
         "holds only its 1/" + std::to_string(m.tensor_parallel) + " of the token rows there, "
         "which the tiled MLP does not gather; use porter.model.mlp_tiles 1 with "
         "sequence_parallel, or turn sequence_parallel off (Note [MLP tiles] in "
         "models/blocks.cc)");
  }
  if (m.sequence_parallel) {
    const int64_t rows = c.train_micro_batch_size_per_gpu * m.seq_len;
    if (rows % m.tensor_parallel != 0) {
      fail("porter.model.seq_len",
           std::to_string(m.seq_len) + " x train_micro_batch_size_per_gpu " +
               std::to_string(c.train_micro_batch_size_per_gpu) + " = " + std::to_string(rows) +
               " token rows do not divide into porter.model.tensor_parallel " +
               std::to_string(m.tensor_parallel) +
               " equal shards, which sequence_parallel needs; choose a seq_len that makes the "
               "rows a multiple of it, or turn sequence_parallel off");
    }
    if ((rows / m.tensor_parallel * m.hidden) % 4 != 0) {
      fail("porter.model.hidden",
           std::to_string(m.hidden) + ": under sequence_parallel each rank's shard of the "
           "residual stream must be a multiple of 4 elements (dropout masks are drawn 4 at a "
           "time from the global element index); choose an even hidden");
    }
  }
}

// Note [Policy from activation_checkpointing]
// A DeepSpeed config says *how* checkpoints are stored (partitioned, on cpu, contiguous) but
// leaves *which* layers to the model code (Megatron's --checkpoint-num-layers). porter owns
// the model, so when porter.checkpointing.policy is absent the policy follows from the
// DeepSpeed section: none without activation_checkpointing; uniform with number_checkpoints
// segments when that is given; full (every layer) otherwise. number_checkpoints becomes
// porter.checkpointing's `segments` here (used by the uniform policy, and by `porter
// estimate`'s uniform row under any policy), so nothing past the parser reads the DeepSpeed
// key.
// Note [Progress cadence]
// DeepSpeed prints its progress every steps_per_print steps; porter train prints a progress
// line every porter.train.log_every steps (off a terminal). A published DeepSpeed config has
// steps_per_print and no porter section, so when log_every is not given, steps_per_print is
// its value (and the resolved config prints both); when neither is, it is 1.
void resolve_log_every(const PorterReadState& state, Config& c) {
  if (!state.log_every_given && c.steps_per_print) c.porter.train.log_every = *c.steps_per_print;
}

// Note [Fixed behaviour] in config/parse.h: a DeepSpeed config has no model (the training
// script builds it), so a config without porter.model trains the default one, which is said.
// The note is about the whole config (its path is empty, so that it names every file, not a
// --set that gave another porter key).
void note_default_model(const PorterReadState& state, const Config& c, Diagnostics& diag) {
  if (state.model_given) return;
  const ModelConfig& m = c.porter.model;
  diag.note("",
            "porter.model: not given, so porter trains its default model, a " +
                std::string(m.type == ModelType::kLlama ? "Llama" : "GPT") + " of " +
                std::to_string(m.layers) + " layers, hidden " + std::to_string(m.hidden) + ", " +
                std::to_string(m.heads) + " heads, seq_len " + std::to_string(m.seq_len) +
                ", vocab " + std::to_string(m.vocab) +
                "; give the model in the config's \"porter\": {\"model\": {...}} (or key by key "
                "with --set, e.g. --set porter.model.layers=4), or load one with "
                "porter.model.from, a Hugging Face model directory");
}

void check_across_sections(const PorterReadState& state, Config& c, Diagnostics& diag) {
  resolve_log_every(state, c);
  note_default_model(state, c, diag);
  CheckpointingConfig& k = c.porter.checkpointing;
  const std::optional<ActivationCheckpointingConfig>& ac = c.activation_checkpointing;
  // 0: not given (a plain integer: GCC 12 misreads an optional here as maybe-uninitialized).
  const int64_t number_checkpoints = ac ? ac->number_checkpoints.value_or(0) : 0;
  const std::string kPolicy = "porter.checkpointing.policy";
  const int64_t layers = c.porter.model.layers;
  if (!state.policy_given) {
    if (!ac) {
      k.policy = CheckpointPolicy::kNone;
    } else {
      k.policy = number_checkpoints > 0 ? CheckpointPolicy::kUniform : CheckpointPolicy::kFull;
    }
  }

  auto only_for = [&](bool given, CheckpointPolicy wanted, const char* key) {
    if (given && k.policy != wanted) {
      fail("porter.checkpointing." + std::string(key),
           "is used only by policy \"" + std::string(to_string(wanted)) + "\", but " + kPolicy +
               " is \"" + std::string(to_string(k.policy)) + "\"");
    }
  };
  only_for(k.every_n_layers.has_value(), CheckpointPolicy::kUniform, "every_n_layers");
  only_for(k.block_layers.has_value(), CheckpointPolicy::kBlock, "block_layers");
  only_for(k.memory_budget.has_value(), CheckpointPolicy::kOptimal, "memory_budget");
  only_for(!k.selective_ops.empty(), CheckpointPolicy::kSelective, "selective_ops");

  if (number_checkpoints > 0) k.segments = number_checkpoints;
  switch (k.policy) {
    case CheckpointPolicy::kUniform:
      if (k.every_n_layers && number_checkpoints > 0) {
        fail("porter.checkpointing.every_n_layers",
             std::to_string(*k.every_n_layers) + " given together with "
             "activation_checkpointing.number_checkpoints " + std::to_string(number_checkpoints) +
             "; give one of them");
      }
      if (!k.every_n_layers && number_checkpoints == 0) {
        fail(kPolicy, "\"uniform\" needs porter.checkpointing.every_n_layers or "
                      "activation_checkpointing.number_checkpoints");
      }

      if (k.every_n_layers && *k.every_n_layers > layers) {
        fail("porter.checkpointing.every_n_layers",
             std::to_string(*k.every_n_layers) + " is more than the model's " +
                 std::to_string(layers) + " layers (porter.model.layers)");
      }
      if (number_checkpoints > layers) {
        // DeepSpeed uses the number only to size its checkpoint buffers, so it accepts this.
        diag.warn("activation_checkpointing.number_checkpoints",
                  std::to_string(number_checkpoints) + " is more than the model's " +
                      std::to_string(layers) + " layers (porter.model.layers); porter "
                      "checkpoints every layer, one layer per segment");
      }
      break;
    case CheckpointPolicy::kBlock:
      if (!k.block_layers) fail(kPolicy, "\"block\" needs porter.checkpointing.block_layers");
      if (*k.block_layers > layers) {
        fail("porter.checkpointing.block_layers",
             std::to_string(*k.block_layers) + " is more than the model's " +
                 std::to_string(layers) + " layers (porter.model.layers)");
      }
      break;
    case CheckpointPolicy::kOptimal:
      if (!k.memory_budget) fail(kPolicy, "\"optimal\" needs porter.checkpointing.memory_budget");
      break;
    case CheckpointPolicy::kSelective:
      if (k.selective_ops.empty()) k.selective_ops = {"core_attention"};
      break;
    case CheckpointPolicy::kNone:
      if (ac) {
        for (auto [on, key] : {std::pair{ac->cpu_checkpointing, "cpu_checkpointing"},
                               std::pair{ac->contiguous_memory_optimization,
                                         "contiguous_memory_optimization"}}) {
          if (on) {
            fail("activation_checkpointing." + std::string(key),
                 "true, but " + kPolicy + " is \"none\": there are no checkpoints to store");
          }
        }
      }
      break;
    case CheckpointPolicy::kFull:
    case CheckpointPolicy::kSqrt:
      break;
  }
  check_tensor_parallel(c, diag);
}

const PorterKeyTables& porter_key_tables() {
  static const PorterKeyTables tables{kModelKeys, kDataKeys,  kDeviceKeys, kCheckpointingKeys,
                                      kTrainKeys, kTraceKeys, kCommKeys, kOptimizerKeys};
  return tables;
}

}  // namespace porter::config::detail
