// Helpers shared by the train, plan and estimate subcommands.
#include "cli/common.h"

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>

#include <nlohmann/json.hpp>

#include "base/error.h"
#include "base/units.h"
#include "config/parse.h"
#include "io/hf_checkpoint.h"
#include "models/factory.h"

namespace porter::cli {

namespace {

// The word as a POSIX shell reads it: unquoted when it is plain, else in single quotes.
std::string shell_word(const std::string& word) {
  static const std::string kPlain =
      "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-./=:,+@%";
  if (!word.empty() && word.find_first_not_of(kPlain) == std::string::npos) return word;
  std::string quoted = "'";
  for (char c : word) quoted += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return quoted + "'";
}

struct ConfigInputs {
  std::vector<config::ConfigSource> files;
  std::vector<config::ConfigOverride> sets;
};

// Note [Config from a Hugging Face model]
// porter.model.from names a Hugging Face model directory: its config.json's keys
// (io::hf_model_overrides) become overrides after every file and --set, each named after
// that config.json. Every command reads its config through read_inputs, so train, estimate,
// plan, config check and every launched rank parse the same model, and the parser checks the
// keys like any other (an error about porter.model.hidden then names the config.json). A key
// the user set to another value is an error naming the user's source and both values. A
// relative path is relative to the working directory, like porter.data's paths.
void apply_model_from(ConfigInputs& in) {
  const config::MergedConfig merged = config::merge_config_sources(in.files, in.sets);
  const nlohmann::json& j = merged.json;
  const auto porter = j.find("porter");
  if (porter == j.end() || !porter->is_object()) return;
  const auto model = porter->find("model");
  if (model == porter->end() || !model->is_object()) return;
  const auto from = model->find("from");
  // Anything but a string is the parser's to refuse.
  if (from == model->end() || !from->is_string()) return;
  io::HfConfig hf;
  try {
    hf = io::read_hf_config(from->get<std::string>());
  } catch (const IoError& e) {
    throw IoError(merged.provenance.label("porter.model.from") + ": porter.model.from: " + e.what());
  }
  nlohmann::ordered_json overrides;
  try {
    overrides = io::hf_model_overrides(hf, *model);
  } catch (const config::ConfigError& e) {
    throw config::SourcedConfigError(merged.provenance.label(e.path()), e);
  }
  for (const auto& [key, value] : overrides.items()) {
    in.sets.push_back(config::ConfigOverride{hf.path.string(), {"porter", "model", key}, value});
  }
}

// Every file read and checked alone (its syntax errors name it), and every --set parsed;
// then porter.model.from applied (Note [Config from a Hugging Face model]).
ConfigInputs read_inputs(const ConfigArgs& args) {
  ConfigInputs in;
  for (const std::string& file : args.files) {
    try {
      in.files.push_back(config::read_config_source(file));
    } catch (const config::SourcedConfigError&) {
      throw;  // already names the file
    } catch (const porter::Error& e) {
      throw InvalidArgument(file + ": " + e.what());
    }
  }
  for (const std::string& set : args.sets) in.sets.push_back(config::parse_config_override(set));
  apply_model_from(in);
  return in;
}

}  // namespace

void print_diagnostics(const config::SourcedParseResult& result, std::ostream& err) {
  for (const config::SourcedWarning& w : result.warnings) err << "warning: " << w.text() << "\n";
  for (const config::SourcedWarning& n : result.notes) err << "note: " << n.text() << "\n";
}

std::string ConfigArgs::display() const {
  std::string s;
  for (const std::string& f : files) s += (s.empty() ? "" : " + ") + f;
  for (const std::string& a : sets) s += (s.empty() ? "" : " + ") + ("--set " + a);
  return s;
}

std::string ConfigArgs::command_args() const {
  std::string s;
  for (const std::string& f : files) s += (s.empty() ? "" : " ") + ("--config " + shell_word(f));
  for (const std::string& a : sets) s += (s.empty() ? "" : " ") + ("--set " + shell_word(a));
  return s;
}

void add_config_options(CLI::App* cmd, ConfigArgs& args, const std::string& config_help) {
  cmd->add_option("--config", args.files,
                  config_help + "; give it again to merge more files, each over the ones before "
                                "(objects merge key by key, other values replace)")
      ->type_name("FILE")
      ->allow_extra_args(false)  // one file a flag: a stray word is an error, not a config
      ->required();
  add_set_option(cmd, args.sets);
}

void add_set_option(CLI::App* cmd, std::vector<std::string>& sets) {
  // Checked while parsing the flags, so that a malformed one is a usage error.
  const CLI::Validator assignment(
      [](std::string& text) {
        try {
          config::parse_config_override(text);
          return std::string();
        } catch (const porter::Error& e) {
          // CLI11 puts "--set: " before the message, which starts with "--set ".
          const std::string message = e.what();
          return message.rfind("--set ", 0) == 0 ? message.substr(6) : message;
        }
      },
      "", "KEY=JSON");
  cmd->add_option("--set", sets,
                  "Set one key after the files, e.g. --set porter.model.layers=8; the value is "
                  "JSON, or else a string (--set porter.checkpointing.policy=uniform); repeatable")
      ->type_name("KEY=JSON")
      ->allow_extra_args(false)
      ->check(assignment);
}

config::SourcedParseResult parse_config_args(const ConfigArgs& args,
                                             const config::ParseOptions& options) {
  const ConfigInputs in = read_inputs(args);
  return config::parse_config_sources(in.files, in.sets, options);
}

config::Config load_config(const ConfigArgs& args, bool strict, std::ostream& err,
                           int64_t world_size) {
  const config::SourcedParseResult result =
      parse_config_args(args, config::ParseOptions{world_size, strict});
  print_diagnostics(result, err);
  return result.config;
}

config::Config load_config(const std::string& file, bool strict, std::ostream& err,
                           int64_t world_size) {
  return load_config(ConfigArgs{{file}, {}}, strict, err, world_size);
}

config::Config load_config(const ConfigArgs& args, bool strict, std::ostream& err,
                           int64_t world_size, int64_t tensor_parallel, const std::string& flag) {
  const std::string what = flag + " " + std::to_string(tensor_parallel);
  if (tensor_parallel < 1) {
    throw InvalidArgument(what + ": the ranks of a tensor-parallel group must be >= 1");
  }
  ConfigInputs in = read_inputs(args);
  const nlohmann::json merged = config::merge_config_sources(in.files, in.sets).json;
  auto settable = [](const nlohmann::json& parent, const char* key) {
    auto it = parent.find(key);
    return it == parent.end() || it->is_null() || it->is_object();
  };
  const bool placeable = settable(merged, "porter") &&
                         (!merged.contains("porter") || merged["porter"].is_null() ||
                          settable(merged["porter"], "model"));
  // A config whose porter or porter.model is not an object fails the same way without the
  // override, with the parser's own message (the path, the file).
  if (!placeable) return load_config(args, strict, err, world_size);
  // The flag is the last override, so the errors and warnings it causes can name it.
  in.sets.push_back(config::ConfigOverride{what, {"porter", "model", "tensor_parallel"},
                                           nlohmann::json(tensor_parallel)});
  config::SourcedParseResult result;
  try {
    result = config::parse_config_sources(in.files, in.sets,
                                          config::ParseOptions{world_size, strict});
  } catch (const config::SourcedConfigError& e) {
    const std::string& message = e.message();
    const bool ours = message.find("tensor_parallel") != std::string::npos ||
                      message.find("sequence_parallel") != std::string::npos;
    if (!ours) throw;
    std::string hint;
    if (message.find("does not divide heads") != std::string::npos) {
      hint = "; give " + flag + " a divisor of porter.model.heads";
    } else if (message.find("world size") != std::string::npos) {
      hint = "; give --world-size a multiple of it, or leave --world-size out";
    }
    throw InvalidArgument(what + ": " + message + hint);
  }
  print_diagnostics(result, err);
  return result.config;
}

config::Config load_config(const std::string& file, bool strict, std::ostream& err,
                           int64_t world_size, int64_t tensor_parallel, const std::string& flag) {
  return load_config(ConfigArgs{{file}, {}}, strict, err, world_size, tensor_parallel, flag);
}

int64_t implied_world_size(const ConfigArgs& args, std::optional<int64_t> tensor_parallel) {
  nlohmann::json j;
  try {
    const ConfigInputs in = read_inputs(args);
    j = config::merge_config_sources(in.files, in.sets).json;
  } catch (const porter::Error&) {
    return 1;
  }
  auto integer = [&](const char* key) -> int64_t {
    auto it = j.find(key);
    return it != j.end() && it->is_number_integer() ? it->get<int64_t>() : 0;
  };
  const int64_t tbs = integer("train_batch_size");
  const int64_t mbs = integer("train_micro_batch_size_per_gpu");
  const int64_t gas = integer("gradient_accumulation_steps");
  int64_t tp = 1;
  if (auto p = j.find("porter"); p != j.end() && p->is_object()) {
    if (auto m = p->find("model"); m != p->end() && m->is_object()) {
      if (auto t = m->find("tensor_parallel"); t != m->end() && t->is_number_integer()) {
        tp = std::max<int64_t>(1, t->get<int64_t>());
      }
    }
  }
  if (tensor_parallel) tp = std::max<int64_t>(1, *tensor_parallel);
  const bool implied = tbs > 0 && mbs > 0 && gas > 0 && tbs % (mbs * gas) == 0;
  return (implied ? tbs / (mbs * gas) : 1) * tp;
}

int64_t implied_world_size(const std::string& file, std::optional<int64_t> tensor_parallel) {
  return implied_world_size(ConfigArgs{{file}, {}}, tensor_parallel);
}

config::MemoryBudget parse_budget_flag(const std::string& text) {
  double v = 0;
  const char* end = text.data() + text.size();
  auto [ptr, ec] = std::from_chars(text.data(), end, v);
  if (ec == std::errc() && ptr == end && v >= 0.0 && v <= 1.0) return config::MemoryBudget{v};
  if (std::optional<uint64_t> bytes = parse_bytes(text); bytes && *bytes >= 2) {
    return config::MemoryBudget{*bytes};
  }
  throw InvalidArgument("--budget: expected a fraction in [0, 1] or a byte count >= 2 "
                        "(\"6GiB\", \"500MB\", \"123456\"), got \"" + text + "\"");
}

void Table::print(std::ostream& out, const std::string& indent) const {
  std::vector<size_t> widths;
  for (const auto& row : rows_) {
    if (widths.size() < row.size()) widths.resize(row.size(), 0);
    for (size_t i = 0; i < row.size(); ++i) widths[i] = std::max(widths[i], row[i].size());
  }
  for (size_t r = 0; r < rows_.size(); ++r) {
    const auto& row = rows_[r];
    if (r == 0 && std::all_of(row.begin(), row.end(), [](const std::string& c) { return c.empty(); })) {
      continue;  // no header
    }
    std::string line = indent;
    for (size_t i = 0; i < row.size(); ++i) {
      const std::string pad(widths[i] - row[i].size(), ' ');
      if (i > 0) line += "  ";
      line += i == 0 ? row[i] + pad : pad + row[i];
    }
    while (!line.empty() && line.back() == ' ') line.pop_back();
    out << line << "\n";
  }
}

std::string format_seconds(double s) {
  char buf[32];
  if (s >= 1.0) {
    std::snprintf(buf, sizeof buf, "%.2f s", s);
  } else if (s >= 1e-3) {
    std::snprintf(buf, sizeof buf, "%.1f ms", s * 1e3);
  } else {
    std::snprintf(buf, sizeof buf, "%.0f us", s * 1e6);
  }
  return buf;
}

std::string format_count(double v) {
  char buf[32];
  if (v >= 1e9) {
    std::snprintf(buf, sizeof buf, "%.2fG", v / 1e9);
  } else if (v >= 1e6) {
    std::snprintf(buf, sizeof buf, "%.2fM", v / 1e6);
  } else if (v >= 1e4) {
    std::snprintf(buf, sizeof buf, "%.1fk", v / 1e3);
  } else {
    std::snprintf(buf, sizeof buf, "%.0f", v);
  }
  return buf;
}

std::string describe_model(const config::ModelConfig& m) {
  std::string out = std::string(models::arch_spec(m.type).display_name()) + ", " +
                    std::to_string(m.layers) + " layers, hidden " + std::to_string(m.hidden) +
                    ", " + std::to_string(m.heads) + " heads";
  if (m.kv_heads != 0 && m.kv_heads != m.heads) {  // grouped-query attention
    out += " (" + std::to_string(m.kv_heads) + " key/value)";
  }
  out += ", seq " + std::to_string(m.seq_len) + ", vocab " + std::to_string(m.vocab);
  if (m.attention != config::AttentionKind::kAuto) {
    out += ", " + std::string(config::to_string(m.attention)) + " attention";
  }
  if (m.loss_tiles > 1) out += ", loss in " + std::to_string(m.loss_tiles) + " tiles";
  if (m.mlp_tiles > 1) out += ", MLP in " + std::to_string(m.mlp_tiles) + " tiles";
  return out;
}

checkpoint::PlanProgressFn plan_progress_printer(std::ostream& err, const std::string& command) {
  using Clock = std::chrono::steady_clock;
  const auto start = std::make_shared<Clock::time_point>(Clock::now());
  const auto last = std::make_shared<Clock::time_point>(*start);
  return [&err, command, start, last](const checkpoint::PlanProgress& p) {
    const Clock::time_point now = Clock::now();
    if (now - *start < std::chrono::seconds(1) || now - *last < std::chrono::seconds(1)) return;
    *last = now;
    char pct[16];
    std::snprintf(pct, sizeof pct, "%.0f%%", 100.0 * p.fraction);
    err << command << ": planning optimal: solve " << p.solve << ", " << pct << " ("
        << format_seconds(std::chrono::duration<double>(now - *start).count()) << ")\n";
  };
}

}  // namespace porter::cli
