// The JSON reports of `porter estimate --json` and `porter plan --json` for a loaded config:
// the commands print them, and the Python module returns them (porter.estimate, porter.plan).
#pragma once

#include <cstdint>
#include <optional>
#include <ostream>
#include <string>

#include <nlohmann/json.hpp>

#include "config/config.h"

namespace porter::cli {

// What the estimate's flags give besides the config (docs/cli.md, "porter estimate").
struct EstimateReportOptions {
  std::string config_name;                // the report's "config": where the config came from
  std::string budget;                     // as --budget: "6GiB" or a fraction; empty: none
  std::optional<int64_t> ranks_per_node;  // as --ranks-per-node
  std::string host_memory;                // as --host-memory: "512GiB"; empty: this machine's
};

// The report `porter estimate --json` prints for `cfg` at cfg.world_size ranks, its
// porter.model.tensor_parallel from the config (the table of degrees included). Progress of a
// long optimal plan goes to `err`. Throws porter::Error as the command does.
nlohmann::ordered_json estimate_report(const config::Config& cfg,
                                       const EstimateReportOptions& options, std::ostream& err);

// What the plan's flags give besides the config (docs/cli.md, "porter plan").
struct PlanReportOptions {
  std::string config_name;  // the report's "config"
  std::string budget;       // as --budget: the optimal policy under this budget; empty: none
  bool profile = false;     // as --profile: plan from measured times (Note [Plan profiling])
};

// The report `porter plan --json` prints for `cfg` at cfg.world_size ranks. Progress goes to
// `err`. Throws porter::Error as the command does.
nlohmann::ordered_json plan_report(const config::Config& cfg, const PlanReportOptions& options,
                                   std::ostream& err);

}  // namespace porter::cli
