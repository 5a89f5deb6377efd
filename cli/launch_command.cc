// `porter launch -n N [--nnodes M --node-rank R] [--master-addr A] [--master-port P]
// [--timeout S] [--max-restarts K] -- COMMAND [ARGS...]`: runs this node's N ranks of COMMAND
// with torchrun's environment (Notes [Launcher] and [Restarts] in cli/launch.h).
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
  cmd->add_option("-n,--nproc", o->nproc, "Number of ranks (processes) to start on this node")
      ->required()
      ->check(CLI::Range(1, 4096));
  cmd->add_option("--nnodes", o->nnodes,
                  "Nodes in the world, each running its own porter launch with the same -n "
                  "(default 1)")
      ->check(CLI::Range(1, 65536));
  cmd->add_option("--node-rank", o->node_rank,
                  "This node's index, 0..nnodes-1: its ranks are node_rank * n .. node_rank * n + n - 1")
      ->check(CLI::Range(0, 65535));
  cmd->add_option("--max-restarts", o->max_restarts,
                  "Start a failed world again, at most this many times; porter train --save DIR "
                  "resumes from DIR's latest checkpoint (default 0)")
      ->check(CLI::Range(0, 1000000));
  cmd->add_option("--master-addr", o->master_addr,
                  "MASTER_ADDR for the ranks: where rank 0's store listens (default 127.0.0.1; with "
                  "--nnodes, node 0's address)");
  cmd->add_option("--master-port", o->master_port,
                  "MASTER_PORT for the ranks (default: a free port; required with --nnodes)")
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
      "memory, 5 preempted after saving), or 128 + the signal that killed it (the launcher names "
      "the rank and how); with --max-restarts, that of the last world; 1 a usage error of launch itself (bad flags, no command after --, a command that cannot "
      "start).");
  cmd->callback([o, &context] { context.exit_code = run_launch(*o, context); });
}

}  // namespace porter::cli
