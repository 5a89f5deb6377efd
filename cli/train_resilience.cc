// Output checks, resume choice and preemption of porter train (cli/train_resilience.h).
#include "cli/train_resilience.h"

#include <atomic>
#include <csignal>
#include <cstring>
#include <fstream>

#include <unistd.h>

#include "base/error.h"
#include "comm/agree.h"
#include "io/run_dir.h"

namespace porter::cli {

namespace fs = std::filesystem;

namespace {

std::string quoted(const fs::path& p) { return "\"" + p.string() + "\""; }

// Creates and removes a file in `dir`: the one test of writability that also covers
// read-only mounts and full quota directories, which access(2) does not.
void probe_directory(const std::string& flag, const fs::path& dir) {
  const fs::path probe = dir / (".porter-write-probe-" + std::to_string(::getpid()));
  {
    std::ofstream f(probe);
    if (!f) {
      throw IoError(flag + ": cannot write into " + quoted(dir) + " (" + std::strerror(errno) +
                    "); give a writable location");
    }
  }
  std::error_code ec;
  fs::remove(probe, ec);
}

}  // namespace

void check_output_paths(const std::vector<OutputPath>& outputs) {
  for (const OutputPath& o : outputs) {
    if (o.path.empty()) continue;
    const fs::path p(o.path);
    std::error_code ec;
    if (o.directory) {
      if (fs::exists(p, ec) && !fs::is_directory(p, ec)) {
        throw IoError(o.flag + " " + quoted(p) + ": exists and is not a directory");
      }
      fs::create_directories(p, ec);
      if (ec) {
        throw IoError(o.flag + " " + quoted(p) + ": cannot create the directory (" + ec.message() +
                      "); give a writable location");
      }
      probe_directory(o.flag + " " + quoted(p), p);
      continue;
    }
    if (fs::is_directory(p, ec)) {
      throw IoError(o.flag + " " + quoted(p) + ": is a directory; give a file name");
    }
    const fs::path parent = p.has_parent_path() ? p.parent_path() : fs::path(".");
    if (!fs::is_directory(parent, ec)) {
      throw IoError(o.flag + " " + quoted(p) + ": the directory " + quoted(parent) +
                    " does not exist; create it or give another path");
    }
    if (fs::exists(p, ec) && ::access(p.c_str(), W_OK) != 0) {
      throw IoError(o.flag + " " + quoted(p) + ": exists and is not writable (" +
                    std::strerror(errno) + ")");
    }
    probe_directory(o.flag + " " + quoted(p), parent);
  }
}

fs::path choose_resume(const std::string& path, comm::Store* store, int rank, int world_size,
                       comm::Seconds timeout, std::ostream& err) {
  const std::vector<fs::path> candidates = io::resume_candidates(path);
  std::string skipped;
  for (size_t i = 0; i < candidates.size(); ++i) {
    const std::string why = io::check_checkpoint(candidates[i], rank, world_size);
    int bad = why.empty() ? 0 : 1;
    if (store) {
      bad = comm::count_votes(*store, "resume/" + std::to_string(i), world_size, !why.empty(),
                              timeout);
    }
    if (bad == 0) return candidates[i];
    const std::string reason =
        why.empty() ? std::to_string(bad) + " other rank(s) found it damaged" : why;
    err << "warning: --resume: skipping " << candidates[i].string() << ": " << reason
        << (i + 1 < candidates.size() ? "; trying " + candidates[i + 1].string() : std::string())
        << "\n";
    skipped += "\n  " + candidates[i].string() + ": " + reason;
  }
  throw IoError("--resume " + quoted(fs::path(path)) + ": no checkpoint in it passes its checks:" + skipped);
}

namespace {

std::atomic<int> g_stop_signal{0};
struct sigaction g_old_term, g_old_int;

extern "C" void on_stop_signal(int sig) {
  int expected = 0;
  if (g_stop_signal.compare_exchange_strong(expected, sig)) return;
  // The second signal: stop at once, as without porter's handler.
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}

}  // namespace

StopSignals::StopSignals() {
  g_stop_signal.store(0);
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  sigaction(SIGTERM, &sa, &g_old_term);
  sigaction(SIGINT, &sa, &g_old_int);
}

StopSignals::~StopSignals() {
  sigaction(SIGTERM, &g_old_term, nullptr);
  sigaction(SIGINT, &g_old_int, nullptr);
}

int StopSignals::signal() const { return g_stop_signal.load(); }

bool StopSignals::stop_agreed(comm::Store* store, int64_t step) {
  if (!store) return signal() != 0;
  if (signal() != 0 && !requested_) {  // Note [Preemption]: the first request sets the step
    requested_ = true;
    if (store->add("preempt/requests", 1) == 1) {
      store->set_string("preempt/stop_after", std::to_string(step + 1));
    }
  }
  if (!store->check("preempt/stop_after")) return false;
  return step >= std::stoll(store->get_string("preempt/stop_after"));
}

std::string signal_name(int sig) {
  switch (sig) {
    case SIGTERM: return "SIGTERM";
    case SIGINT: return "SIGINT";
    default: return "signal " + std::to_string(sig);
  }
}

}  // namespace porter::cli
