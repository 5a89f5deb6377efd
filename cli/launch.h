// Local multi-process launching for `porter launch` and `porter train --nproc`: N children
// with torchrun's environment, their output prefixed by rank, signals forwarded, and a failed
// rank reported by number with its exit code or signal. See docs/cli.md, "porter launch".
//
// Note [Launcher]
// - Each child gets the launcher's environment with RANK, WORLD_SIZE, LOCAL_RANK,
//   LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT set (Note [Launcher environment] in
//   comm/env.h) and OpenMPI's OMPI_COMM_WORLD_* removed, so an outer mpirun cannot disagree
//   with it. MASTER_PORT defaults to a port the kernel reports free (bind to port 0); rank 0's
//   TcpStore listens there.
// - Each child runs in its own process group with stdin from /dev/null, so a terminal's
//   Ctrl-C reaches only the launcher, which forwards SIGINT and SIGTERM to every child's
//   group (a child that is a shell takes its own children along).
// - stdout and stderr of each child are pipes; one loop (poll, no threads) reads them all and
//   writes each complete line to the launcher's stdout or stderr as "[rank r] line". A last
//   unterminated line is written with a newline at EOF.
// - The first child to fail (non-zero exit or a signal) is reported at once. The others get
//   `timeout_s` to exit on their own (they normally fail on their next collective, whose peer
//   is gone, or finish); then they get SIGTERM, and SIGKILL kKillGraceS seconds later.
// - The launch succeeds only when every child exits 0. Otherwise it exits with the code of the
//   first child that failed (LaunchResult::exit_code): porter's ranks exit with porter's codes
//   (2 invalid input, 3 out of memory), so a launched run fails with the code one process
//   would have given; a child killed by signal s gives 128 + s, as a shell reports it.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

namespace porter::cli {

// Note [Restarts]
// With max_restarts > 0, a world that fails (a rank exits non-zero or is killed) is ended at
// once (SIGKILL to every other rank: with a peer gone, none of them can finish a step or a
// checkpoint) and started again, at most max_restarts times, on a fresh port when the port
// was the launcher's pick. Each child gets PORTER_RESTART=<k> (0 in the first world), from
// which `porter train --save DIR` resumes from DIR's latest complete checkpoint (Note [Run
// directory] in io/run_dir.h). Not restarted: a rank that exits 1 (usage: the same command
// fails again) or 5 (preempted: the world saved and stopped as asked), and a world the
// launcher forwarded SIGINT or SIGTERM to. Across nodes (nnodes > 1) each node's launcher
// restarts its own ranks; the other nodes' ranks lose their peers, fail, and restart too.
//
// Note [Store token]
// Unless the environment already has PORTER_STORE_TOKEN or PORTER_STORE_TOKEN_FILE, a
// one-node launch hands its ranks a fresh random token (128 bits from /dev/urandom) in
// PORTER_STORE_TOKEN; rank 0's store admits only connections that present it
// (docs/rendezvous.md). With several nodes every node must give the same token, so the
// launcher needs one from the environment and warns when there is none.
struct LaunchOptions {
  int nproc = 1;                     // ranks on this node
  int nnodes = 1;                    // nodes of the world, each with nproc ranks
  int node_rank = 0;                 // this node's index: its ranks are node_rank * nproc + i
  std::string master_addr = "127.0.0.1";
  uint16_t master_port = 0;          // 0: a free port (one node only)
  double timeout_s = 30.0;           // after the first failure (Note [Launcher])
  int max_restarts = 0;              // Note [Restarts]
  std::vector<std::string> command;  // argv of every child; command[0] is looked up on PATH
};

// How one child ended.
struct RankExit {
  int rank = 0;
  bool signaled = false;  // terminated by a signal (code is the signal number)
  int code = 0;           // the exit code, or the signal
  bool killed = false;    // by the launcher, after the timeout
  bool ok() const { return !signaled && code == 0; }
  std::string describe() const;  // "exit code 3", "signal 15 (Terminated)"
};

struct LaunchResult {
  uint16_t master_port = 0;
  std::vector<RankExit> ranks;  // by rank (this node's, with several nodes)
  int first_failed_rank = -1;   // the world rank; -1: none failed
  int forwarded_signal = 0;     // the last SIGINT/SIGTERM forwarded to the children (0: none)
  int restarts = 0;             // worlds started after the first (Note [Restarts])
  bool ok() const { return first_failed_rank < 0; }
  const RankExit& first_failure() const;  // !ok() only
  // 0 when ok(); else the first failed rank's exit code, or 128 + its signal (Note [Launcher]).
  int exit_code() const;
};

// Seconds between the SIGTERM and the SIGKILL of a child that outlived the timeout.
inline constexpr double kKillGraceS = 3.0;

// Runs the children and waits for all of them, writing their prefixed output and the
// launcher's own messages ("launch: ...") to `out` and `err`. Throws UsageError for a bad
// option or a command that cannot be started (already-started children are killed first).
LaunchResult launch(const LaunchOptions& options, std::ostream& out, std::ostream& err);

// A TCP port that is free now (the kernel's pick for a socket bound to port 0).
uint16_t free_port();

// Exit code of a porter rank that stopped on SIGTERM or SIGINT after saving (porter train).
inline constexpr int kExitPreempted = 5;

// The environment of child `rank` of `world_size`: `base` ("NAME=value" entries) without the
// launcher variables it sets and without OMPI_COMM_WORLD_*, then those variables
// (LOCAL_RANK and LOCAL_WORLD_SIZE are rank and world_size when given as -1), then `extra`.
std::vector<std::string> child_environment(const std::vector<std::string>& base, int rank,
                                           int world_size, const std::string& master_addr,
                                           uint16_t master_port, int local_rank = -1,
                                           int local_world_size = -1,
                                           const std::vector<std::string>& extra = {});

// This executable's path (/proc/self/exe resolved), for re-executing porter.
std::string self_executable();

}  // namespace porter::cli
