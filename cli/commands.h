// Subcommand registration. Each subcommand file defines one add_*_command, which adds its
// CLI11 subcommand to the app and sets `*exit_code` when the subcommand runs.
#pragma once

#include <ostream>

#include <CLI/CLI.hpp>

namespace porter::cli {

struct CommandContext {
  std::ostream* out;  // not owned: results
  std::ostream* err;  // not owned: warnings and errors
  int exit_code = 0;  // set by the subcommand that ran
};

// `porter config check FILE [--world-size N] [--strict] [--json]`
void add_config_command(CLI::App& app, CommandContext& context);

}  // namespace porter::cli
