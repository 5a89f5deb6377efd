// Helpers shared by the train, plan and estimate subcommands.
#include "cli/common.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <fstream>

#include <nlohmann/json.hpp>

#include "base/error.h"
#include "base/units.h"
#include "config/parse.h"

namespace porter::cli {

config::Config load_config(const std::string& file, bool strict, std::ostream& err,
                           int64_t world_size) {
  config::ParseResult result;
  try {
    result = config::parse_config_file(file, config::ParseOptions{world_size, strict});
  } catch (const porter::Error& e) {
    throw InvalidArgument(file + ": " + e.what());
  }
  for (const config::Warning& w : result.warnings) err << "warning: " << file << ": " << w.text() << "\n";
  return result.config;
}

namespace {

// The file's JSON, keys in their order; null when it cannot be read or is not an object.
nlohmann::ordered_json read_json_object(const std::string& file) {
  std::ifstream in(file);
  if (!in) return nullptr;
  nlohmann::ordered_json j = nlohmann::ordered_json::parse(in, nullptr, /*allow_exceptions=*/false,
                                                           /*ignore_comments=*/true);
  return j.is_object() ? j : nullptr;
}

}  // namespace

config::Config load_config(const std::string& file, bool strict, std::ostream& err,
                           int64_t world_size, int64_t tensor_parallel, const std::string& flag) {
  const std::string what = flag + " " + std::to_string(tensor_parallel);
  if (tensor_parallel < 1) {
    throw InvalidArgument(what + ": the ranks of a tensor-parallel group must be >= 1");
  }
  nlohmann::ordered_json j = read_json_object(file);
  const bool placeable =
      !j.is_null() && (!j.contains("porter") || j["porter"].is_object()) &&
      (!j.contains("porter") || !j["porter"].contains("model") || j["porter"]["model"].is_object());
  // A file the JSON reader refuses, or whose porter.model is not an object, fails the same
  // way without the override, with the parser's own message (line and column, the path).
  if (!placeable) return load_config(file, strict, err, world_size);
  j["porter"]["model"]["tensor_parallel"] = tensor_parallel;
  config::ParseResult result;
  try {
    result = config::parse_config_string(j.dump(), config::ParseOptions{world_size, strict});
  } catch (const porter::Error& e) {
    const std::string message = e.what();
    const bool ours = message.find("tensor_parallel") != std::string::npos ||
                      message.find("sequence_parallel") != std::string::npos;
    if (!ours) throw InvalidArgument(file + ": " + message);
    std::string hint;
    if (message.find("does not divide heads") != std::string::npos) {
      hint = "; give " + flag + " a divisor of porter.model.heads";
    } else if (message.find("world size") != std::string::npos) {
      hint = "; give --world-size a multiple of it, or leave --world-size out";
    }
    throw InvalidArgument(what + ": " + message + hint);
  }
  for (const config::Warning& w : result.warnings) {
    err << "warning: " << file << ": " << w.text() << "\n";
  }
  return result.config;
}

int64_t implied_world_size(const std::string& file, std::optional<int64_t> tensor_parallel) {
  const nlohmann::ordered_json j = read_json_object(file);
  if (j.is_null()) return 1;
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

}  // namespace porter::cli
