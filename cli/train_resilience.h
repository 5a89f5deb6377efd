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
// asks stop_agreed() after every step, and when any rank got a signal the world stops there
// together (comm::count_votes under "stop/<step>": the launcher forwards a signal to every
// rank, but not necessarily before the same step), saves, and exits kExitPreempted. A second
// signal restores the default action and raises it again: the process stops at once.
class StopSignals {
 public:
  StopSignals();
  ~StopSignals();  // restores the previous handlers
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;
  int signal() const;  // the first signal received, 0 for none
  // Whether the world stops after `step`; a collective over the store with several ranks.
  bool stop_agreed(comm::Store* store, int world_size, int64_t step, comm::Seconds timeout) const;
};

// The name of `sig` as a shell user writes it: "SIGTERM".
std::string signal_name(int sig);

}  // namespace porter::cli
