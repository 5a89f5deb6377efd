// Subcommand registration. Each subcommand file defines one add_*_command, which adds its
// CLI11 subcommand to the app and sets `*exit_code` when the subcommand runs.
#pragma once

#include <ostream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

namespace porter::cli {

struct CommandContext {
  std::ostream* out = nullptr;  // not owned: results
  std::ostream* err = nullptr;  // not owned: warnings and errors
  int exit_code = 0;  // set by the subcommand that ran
  bool err_is_tty = false;  // whether `err` is a terminal (progress bars)
  std::vector<std::string> args;  // the arguments after the program name (train --nproc)
  std::string error_prefix;  // before an error's text: "rank 1 of 2: " in a distributed train
};

// `porter config check FILE... [--config F]... [--set K=V]... [--world-size N] [--strict] [--json]`
void add_config_command(CLI::App& app, CommandContext& context);
// Every --config may be repeated (the files are merged) and followed by --set K=V overrides
// (add_config_options in cli/common.h).
// `porter train --config F [--nproc N] [--steps N] [--report F] [--trace F] [--dump-dir D]
// [--save D] [--resume D]`
void add_train_command(CLI::App& app, CommandContext& context);
// `porter plan --config F [--budget B] [--json]`
void add_plan_command(CLI::App& app, CommandContext& context);
// `porter estimate --config F [--budget B] [--json]`
void add_estimate_command(CLI::App& app, CommandContext& context);
// `porter stress --config F [--runs N] [--seed S] [--first R] [--steps K] [--json]`
void add_stress_command(CLI::App& app, CommandContext& context);
// `porter consolidate --checkpoint DIR --out FILE [--dtype working|f32] [--tp-rank K]`
void add_consolidate_command(CLI::App& app, CommandContext& context);

// `porter launch -n N [--master-addr A] [--master-port P] [--timeout S] -- COMMAND...`
void add_launch_command(CLI::App& app, CommandContext& context);

}  // namespace porter::cli
