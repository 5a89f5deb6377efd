// What the train, plan and estimate subcommands share: loading a config, budget flags, and
// aligned text tables. What a config implies (the device, dtypes, the planner's inputs) is
// engine::make_run_options (engine/run_options.h).
#pragma once

#include <cstdint>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "config/config.h"

namespace porter::cli {

// Parses `file` for `world_size` ranks, printing the warnings to `err`. Throws porter::Error.
config::Config load_config(const std::string& file, bool strict, std::ostream& err,
                           int64_t world_size = 1);

// "--budget": a fraction in [0, 1] or bytes ("6GiB", "123456"). Throws InvalidArgument naming
// the flag.
config::MemoryBudget parse_budget_flag(const std::string& text);

// A left-aligned first column, the rest right-aligned, columns two spaces apart. A header of
// empty strings is not printed.
class Table {
 public:
  explicit Table(std::vector<std::string> header) { rows_.push_back(std::move(header)); }
  void add(std::vector<std::string> row) { rows_.push_back(std::move(row)); }
  void print(std::ostream& out, const std::string& indent = "  ") const;

 private:
  std::vector<std::vector<std::string>> rows_;
};

// "1.23 s", "45.6 ms", "789 us".
std::string format_seconds(double s);
// "12.3k", "4.56M".
std::string format_count(double v);

}  // namespace porter::cli
