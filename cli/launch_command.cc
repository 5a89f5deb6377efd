// `porter launch -n N [--master-addr A] [--master-port P] [--timeout S] -- COMMAND [ARGS...]`:
// runs N local ranks of COMMAND with torchrun's environment (Note [Launcher] in cli/launch.h).
#include <memory>
#include <string>
#include <vector>

#include "cli/app.h"
#include "cli/commands.h"
#include "cli/launch.h"

namespace porter::cli {

int run_launch(const LaunchOptions& options, const CommandContext& context) {
  return launch(options, *context.out, *context.err).exit_code();
}

void add_launch_command(CLI::App& app, CommandContext& context) {
  auto o = std::make_shared<LaunchOptions>();
  CLI::App* cmd = app.add_subcommand(
      "launch", "Run N local ranks of a command with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT");
  cmd->add_option("-n,--nproc", o->nproc, "Number of ranks (processes) to start")
      ->required()
      ->check(CLI::Range(1, 4096));
  cmd->add_option("--master-addr", o->master_addr,
                  "MASTER_ADDR for the ranks: where rank 0's store listens (default 127.0.0.1)");
  cmd->add_option("--master-port", o->master_port,
                  "MASTER_PORT for the ranks (default: a free port)")
      ->check(CLI::Range(1, 65535));
  cmd->add_option("--timeout", o->timeout_s,
                  "Seconds the other ranks get to exit after one fails, before they are killed "
                  "(default 30)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("command", o->command, "The command every rank runs, after --");
  cmd->footer(
      "Each rank's output lines are prefixed with \"[rank r] \"; SIGINT and SIGTERM are "
      "forwarded to every rank.\nExit codes: 0 every rank exited 0; when a rank failed, the "
      "exit code of the first rank that failed (porter's: 1 usage, 2 invalid input, 3 out of "
      "memory), or 128 + the signal that killed it (the launcher names the rank and how); 1 a "
      "usage error of launch itself (bad flags, no command after --, a command that cannot "
      "start).");
  cmd->callback([o, &context] { context.exit_code = run_launch(*o, context); });
}

}  // namespace porter::cli
