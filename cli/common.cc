// Helpers shared by the train, plan and estimate subcommands.
#include "cli/common.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>

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
