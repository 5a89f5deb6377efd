// What keeps a `porter train` run from losing its work: output paths checked before step 1,
// the choice of checkpoint to resume from, and a stop on SIGTERM/SIGINT at a step boundary.
#pragma once

#include <filesystem>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "comm/store.h"

namespace porter::cli {

// An output the run writes at the end (or during it): `flag` names it in messages.
struct OutputPath {
  std::string flag;  // "--report"
  std::string path;  // empty: not asked for
  bool directory = false;  // a directory porter creates (--save), else a file
};

// Throws IoError for the first output that cannot be written: a file whose directory does
// not exist or is not writable, an existing file that is not writable, or a directory that
// cannot be created or written. Creates the directories. Leaves nothing else behind (the
// probe file is removed).
void check_output_paths(const std::vector<OutputPath>& outputs);

// Note [Choosing a checkpoint]
// `--resume PATH` (a checkpoint or a run directory; Note [Run directory] in io/run_dir.h):
// the candidates from io::resume_candidates are tried in order. Each rank verifies its share
// of a candidate's files (io::check_checkpoint: sizes and CRC-32C), and the world takes it
// only when every rank's share passed (comm::count_votes under "resume/<i>"), so all ranks
// load the same one. A candidate that fails is skipped with a warning on `err` that names it
// and why; when none passes, IoError lists them. With one rank, `store` is null.
std::filesystem::path choose_resume(const std::string& path, comm::Store* store, int rank,
                                    int world_size, comm::Seconds timeout, std::ostream& err);

// Note [Preemption]
// While a StopSignals lives, the first SIGTERM or SIGINT only sets a flag; the training loop
// asks stop_agreed() after every step, and the world stops together, saves, and exits
// kExitPreempted. A second signal restores the default action and raises it again: the
// process stops at once.
// The ranks must stop after the same step, but the launcher's signal does not reach them in
// the same step, and a barrier per step would wait on a rank that has left (the store cannot
// tell, while a collective fails at once). So a rank that got a signal after finishing step s
// asks for a stop after step s + 1: the first such request (store add on "preempt/requests")
// sets "preempt/stop_after" = s + 1, and every rank checks for that key (one non-blocking
// check per step) and stops once its step reaches it. The request is set before its rank
// starts step s + 1, and no rank can finish step s + 1 without that rank's part in its
// collectives, so every rank sees the key by the end of step s + 1: all stop there. The cost
// is one step more than the signalled rank's (none with one rank).
class StopSignals {
 public:
  StopSignals();
  ~StopSignals();  // restores the previous handlers
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;
  int signal() const;  // the first signal received, 0 for none
  // Whether the world stops after `step` (every rank calls it after every step).
  bool stop_agreed(comm::Store* store, int64_t step);

 private:
  bool requested_ = false;  // this rank asked the world to stop
};

// The name of `sig` as a shell user writes it: "SIGTERM".
std::string signal_name(int sig);

}  // namespace porter::cli
