// porter's own section ("porter": model, data, device, checkpointing, train, trace), the
// checkpoint-policy resolution, and the checks that span sections.
#include <algorithm>
#include <cmath>
#include <string>

#include "config/sections.h"

namespace porter::config::detail {
namespace {

constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();
constexpr IntRange kPositive{1, kInt64Max};

void read_model(ObjectReader& r, Config& c) {
  ModelConfig& m = c.porter.model;
  m.type = r.enumeration("type", kModelTypes).value_or(m.type);
  // Bounds keep every size product (hidden^2, vocab x hidden, ...) inside 64 bits.
  m.layers = r.integer("layers", IntRange{1, 100'000}).value_or(m.layers);
  m.hidden = r.integer("hidden", IntRange{1, 1 << 20}).value_or(m.hidden);
  m.heads = r.integer("heads", IntRange{1, 1 << 16}).value_or(m.heads);
  m.seq_len = r.integer("seq_len", IntRange{1, 1 << 24}).value_or(m.seq_len);
  m.vocab = r.integer("vocab", IntRange{1, 1 << 24}).value_or(m.vocab);
  m.dropout = r.real("dropout", RealRange{0.0, 1.0, false, true}).value_or(m.dropout);
  m.tie_embeddings = r.boolean("tie_embeddings").value_or(m.tie_embeddings);
  m.tensor_parallel = r.integer("tensor_parallel", IntRange{1, 1 << 16}).value_or(m.tensor_parallel);
  r.finish();
}

void check_model(const std::string& path, const Config& c) {
  const ModelConfig& m = c.porter.model;
  if (m.hidden % m.heads != 0) {
    fail(path + ".hidden", std::to_string(m.hidden) + " is not divisible by heads " +
                               std::to_string(m.heads) + "; each head needs hidden/heads channels");
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
}

void read_data(ObjectReader& r, DataConfig& d) {
  d.type = r.enumeration("type", kDataTypes).value_or(d.type);
  if (const Json* paths = r.get("paths")) {
    const std::string path = r.path_of("paths");
    if (paths->is_string()) {
      d.paths.push_back(as_string(*paths, path));
    } else if (paths->is_array()) {
      for (size_t i = 0; i < paths->size(); ++i) {
        d.paths.push_back(as_string((*paths)[i], path + "[" + std::to_string(i) + "]"));
      }
    } else {
      fail(path, "expected a file path or a list of file paths, got " + describe(*paths));
    }
    for (size_t i = 0; i < d.paths.size(); ++i) {
      if (d.paths[i].empty()) fail(path + "[" + std::to_string(i) + "]", "\"\": empty file path");
    }
  }
  d.seed = static_cast<uint64_t>(r.integer("seed", IntRange{0, kInt64Max}).value_or(
      static_cast<int64_t>(d.seed)));
  if (d.type == DataType::kText && d.paths.empty()) {
    fail(r.path_of("paths"), "missing; data type \"text\" needs one or more files in paths");
  }
  if (d.type == DataType::kSynthetic && !d.paths.empty()) {
    fail(r.path_of("paths"), describe(*r.get("paths")) + " given, but " + r.path_of("type") +
                                 " is \"synthetic\"; set type to \"text\" or drop paths");
  }
  r.finish();
}

void read_device(ObjectReader& r, DeviceConfig& d) {
  d.type = r.enumeration("type", kDeviceTypes).value_or(d.type);
  if (!r.is_null("memory_limit")) d.memory_limit_bytes = r.bytes("memory_limit", 1);
  if (!r.is_null("pinned_limit")) d.pinned_limit_bytes = r.bytes("pinned_limit", 1);
  if (!r.is_null("sim_link_gbps")) {
    d.sim_link_gbps = r.real("sim_link_gbps", RealRange{0.0, 1e6, true, false});
  }
  d.threads = r.integer("threads", IntRange{0, 4096}).value_or(d.threads);
  d.poison_freed = r.boolean("poison_freed").value_or(d.poison_freed);
  if (d.sim_link_gbps && d.type == DeviceType::kCuda) {
    fail(r.path_of("sim_link_gbps"), describe(*r.get("sim_link_gbps")) +
                                         ": only the simulated cpu device throttles copies, but "
                                         "porter.device.type is \"cuda\"");
  }
  r.finish();
}

MemoryBudget read_memory_budget(const Json& v, const std::string& path) {
  const std::string rule =
      "a fraction in [0, 1] of the memory that keeping every activation needs, or a byte "
      "count (an integer >= 2, or a string such as \"6GiB\")";
  if (v.is_string()) return MemoryBudget{as_bytes(v, path, 2)};
  if (!v.is_number()) fail(path, "expected " + rule + ", got " + describe(v));
  double d = v.get<double>();
  if (d >= 0.0 && d <= 1.0) return MemoryBudget{d};
  if (d > 1.0 && (v.is_number_integer() || d == std::floor(d))) {
    return MemoryBudget{as_bytes(v, path, 2)};
  }
  fail(path, "expected " + rule + ", got " + describe(v));
}

void read_checkpointing(ObjectReader& r, CheckpointingConfig& k, PorterReadState& state) {
  if (std::optional<CheckpointPolicy> p = r.enumeration("policy", kCheckpointPolicies)) {
    k.policy = *p;
    state.policy_given = true;
  }
  if (!r.is_null("every_n_layers")) k.every_n_layers = r.integer("every_n_layers", kPositive);
  if (!r.is_null("block_layers")) k.block_layers = r.integer("block_layers", kPositive);
  if (const Json* b = r.get("memory_budget"); b != nullptr && !b->is_null()) {
    k.memory_budget = read_memory_budget(*b, r.path_of("memory_budget"));
  }
  if (const Json* ops = r.get("selective_ops")) {
    const std::string path = r.path_of("selective_ops");
    if (!ops->is_array()) fail(path, "expected a list of op kinds, got " + describe(*ops));
    const std::vector<std::string>& kinds = selective_op_kinds();
    std::vector<std::string_view> names(kinds.begin(), kinds.end());
    for (size_t i = 0; i < ops->size(); ++i) {
      const std::string item = path + "[" + std::to_string(i) + "]";
      std::string op = kinds[static_cast<size_t>(as_enum_index((*ops)[i], item, names))];
      if (std::find(k.selective_ops.begin(), k.selective_ops.end(), op) != k.selective_ops.end()) {
        fail(item, "\"" + op + "\" is listed twice");
      }
      k.selective_ops.push_back(op);
    }
  }
  k.prefetch_depth = r.integer("prefetch_depth", IntRange{0, 1024}).value_or(k.prefetch_depth);
  k.keep_last_on_device =
      r.integer("keep_last_on_device", IntRange{0, 1'000'000}).value_or(k.keep_last_on_device);
  r.finish();
}

void read_train(ObjectReader& r, TrainConfig& t) {
  t.steps = r.integer("steps", kPositive).value_or(t.steps);
  t.seed = static_cast<uint64_t>(
      r.integer("seed", IntRange{0, kInt64Max}).value_or(static_cast<int64_t>(t.seed)));
  t.log_every = r.integer("log_every", kPositive).value_or(t.log_every);
  r.finish();
}

void read_trace(ObjectReader& r, TraceConfig& t) {
  if (!r.is_null("path")) {
    t.path = r.string("path");
    if (t.path && t.path->empty()) fail(r.path_of("path"), "\"\": empty file path");
  }
  r.finish();
}

void read_comm(ObjectReader& r, CommConfig& m) {
  m.backend = r.enumeration("backend", kCommBackends).value_or(m.backend);
  m.timeout_s = r.real("timeout_s", RealRange{0.0, 1e7, true, false}).value_or(m.timeout_s);
  r.finish();
}

}  // namespace

PorterReadState read_porter_section(ObjectReader& root, Config& c) {
  PorterReadState state;
  std::optional<ObjectReader> r = root.object("porter");
  if (r) {
    if (std::optional<ObjectReader> s = r->object("model")) read_model(*s, c);
    if (std::optional<ObjectReader> s = r->object("data")) read_data(*s, c.porter.data);
    if (std::optional<ObjectReader> s = r->object("device")) read_device(*s, c.porter.device);
    if (std::optional<ObjectReader> s = r->object("checkpointing")) {
      read_checkpointing(*s, c.porter.checkpointing, state);
    }
    if (std::optional<ObjectReader> s = r->object("train")) read_train(*s, c.porter.train);
    if (std::optional<ObjectReader> s = r->object("trace")) read_trace(*s, c.porter.trace);
    if (std::optional<ObjectReader> s = r->object("comm")) read_comm(*s, c.porter.comm);
    r->finish();
  }
  check_model("porter.model", c);
  return state;
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
void check_across_sections(const PorterReadState& state, Config& c) {
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
        fail("activation_checkpointing.number_checkpoints",
             std::to_string(number_checkpoints) + " is more than the model's " +
                 std::to_string(layers) + " layers (porter.model.layers)");
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
                               std::pair{ac->partition_activations, "partition_activations"},
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
}

}  // namespace porter::config::detail
