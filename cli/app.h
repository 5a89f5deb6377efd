// The porter command line: builds the CLI11 app from every subcommand and runs it.
#pragma once

#include <ostream>

namespace porter::cli {

// Exit codes shared by every subcommand. `porter launch` (and `train --nproc`, which is
// launch) exits with the code of the first rank that failed (LaunchResult::exit_code), so an
// out-of-memory rank makes the launch exit 3 as one process would.
inline constexpr int kExitOk = 0;
inline constexpr int kExitUsage = 1;    // bad flags or arguments (CLI11 prints why), UsageError
inline constexpr int kExitInvalid = 2;  // the input (a config, a file) is invalid
inline constexpr int kExitOom = 3;      // the device ran out of memory
inline constexpr int kExitChecksFailed = 4;  // porter stress: a run failed its checks

// Runs `porter` with these arguments, writing to `out` and `err` instead of the process's
// streams (tests pass string streams). `err_is_tty` turns on the progress bar of `train`.
// Returns the process exit code.
int run(int argc, const char* const* argv, std::ostream& out, std::ostream& err,
        bool err_is_tty = false);

}  // namespace porter::cli
