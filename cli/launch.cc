// Starting, watching and stopping the children of `porter launch` (Note [Launcher]).
#include "cli/launch.h"

#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstring>
#include <fstream>
#include <optional>
#include <stdexcept>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "base/error.h"

extern char** environ;

namespace porter::cli {
namespace {

using Clock = std::chrono::steady_clock;

std::string errno_text(int e) { return std::strerror(e); }

// The launcher's signal handler only records the signal; the loop forwards it.
std::atomic<int> g_pending_signal{0};
static_assert(std::atomic<int>::is_always_lock_free);
extern "C" void on_forwarded_signal(int sig) { g_pending_signal.store(sig); }

// Installs the forwarding handler for SIGINT and SIGTERM (without SA_RESTART, so poll()
// returns at once) and restores the previous handlers when destroyed.
class SignalForwarding {
 public:
  SignalForwarding() {
    g_pending_signal.store(0);
    struct sigaction sa {};
    sa.sa_handler = on_forwarded_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = 0;
    sigaction(SIGINT, &sa, &old_int_);
    sigaction(SIGTERM, &sa, &old_term_);
  }
  ~SignalForwarding() {
    sigaction(SIGINT, &old_int_, nullptr);
    sigaction(SIGTERM, &old_term_, nullptr);
  }
  SignalForwarding(const SignalForwarding&) = delete;
  SignalForwarding& operator=(const SignalForwarding&) = delete;

 private:
  struct sigaction old_int_ {};
  struct sigaction old_term_ {};
};

class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(o.release()) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = o.release();
    }
    return *this;
  }
  ~Fd() { reset(); }
  int get() const { return fd_; }
  int release() {
    const int f = fd_;
    fd_ = -1;
    return f;
  }
  void reset() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

// One child's stdout or stderr: the read end of its pipe and the unterminated tail.
struct Stream {
  Fd fd;
  std::string partial;
  std::ostream* sink = nullptr;  // not owned: the launcher's out or err
  std::string prefix;            // "[rank r] "
};

struct Child {
  pid_t pid = -1;
  bool alive = false;
  RankExit exit;
  Stream streams[2];  // stdout, stderr
};

// Writes the complete lines of `s.partial` with their prefix (all of it, with a newline,
// at EOF).
void emit_lines(Stream& s, bool eof) {
  size_t begin = 0;
  std::string text;
  for (size_t nl; (nl = s.partial.find('\n', begin)) != std::string::npos; begin = nl + 1) {
    text += s.prefix;
    text.append(s.partial, begin, nl + 1 - begin);
  }
  s.partial.erase(0, begin);
  if (eof && !s.partial.empty()) {
    text += s.prefix + s.partial + "\n";
    s.partial.clear();
  }
  if (!text.empty()) *s.sink << text << std::flush;
}

std::string describe_signal(int sig) {
  const char* name = ::strsignal(sig);
  return "signal " + std::to_string(sig) + (name ? std::string(" (") + name + ")" : "");
}

RankExit exit_of(int rank, int status) {
  RankExit e;
  e.rank = rank;
  if (WIFSIGNALED(status)) {
    e.signaled = true;
    e.code = WTERMSIG(status);
  } else {
    e.code = WEXITSTATUS(status);
  }
  return e;
}

// Sends `sig` to every live child's process group (the child itself when the group is gone).
void signal_children(std::vector<Child>& children, int sig) {
  for (Child& c : children) {
    if (!c.alive) continue;
    if (::kill(-c.pid, sig) != 0) ::kill(c.pid, sig);
  }
}

// Starts one child. Returns its pid; throws UsageError when it cannot start.
pid_t spawn_child(const LaunchOptions& o, int rank, uint16_t port,
                  const std::vector<std::string>& base_env,
                  const std::vector<std::string>& extra_env, Child& child) {
  int out_pipe[2], err_pipe[2];
  if (::pipe2(out_pipe, O_CLOEXEC) != 0) throw IoError("launch: pipe: " + errno_text(errno));
  Fd out_read(out_pipe[0]), out_write(out_pipe[1]);
  if (::pipe2(err_pipe, O_CLOEXEC) != 0) throw IoError("launch: pipe: " + errno_text(errno));
  Fd err_read(err_pipe[0]), err_write(err_pipe[1]);

  const std::vector<std::string> env =
      child_environment(base_env, o.node_rank * o.nproc + rank, o.nnodes * o.nproc,
                        o.master_addr, port, rank, o.nproc, extra_env);
  std::vector<char*> envp, argv;
  for (const std::string& e : env) envp.push_back(const_cast<char*>(e.c_str()));
  envp.push_back(nullptr);
  for (const std::string& a : o.command) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);

  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_adddup2(&actions, out_write.get(), STDOUT_FILENO);
  posix_spawn_file_actions_adddup2(&actions, err_write.get(), STDERR_FILENO);
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  sigset_t defaults, none;
  sigemptyset(&defaults);
  sigaddset(&defaults, SIGINT);
  sigaddset(&defaults, SIGTERM);
  sigaddset(&defaults, SIGPIPE);
  sigemptyset(&none);
  posix_spawnattr_setsigdefault(&attr, &defaults);
  posix_spawnattr_setsigmask(&attr, &none);
  posix_spawnattr_setpgroup(&attr, 0);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP | POSIX_SPAWN_SETSIGDEF |
                                      POSIX_SPAWN_SETSIGMASK);
  pid_t pid = -1;
  const int rc = ::posix_spawnp(&pid, argv[0], &actions, &attr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  if (rc != 0) {
    throw UsageError("launch: cannot start rank " + std::to_string(rank) + ": \"" +
                     o.command[0] + "\": " + errno_text(rc) +
                     " (give a path, or a command on PATH, after --)");
  }
  child.pid = pid;
  child.alive = true;
  child.exit.rank = o.node_rank * o.nproc + rank;  // the world rank
  const std::string prefix = "[rank " + std::to_string(child.exit.rank) + "] ";
  child.streams[0].fd = std::move(out_read);
  child.streams[1].fd = std::move(err_read);
  for (Stream& s : child.streams) s.prefix = prefix;
  return pid;
}

}  // namespace

const RankExit& LaunchResult::first_failure() const {
  for (const RankExit& e : ranks) {
    if (e.rank == first_failed_rank) return e;
  }
  throw std::logic_error("LaunchResult: no rank failed");
}

int LaunchResult::exit_code() const {
  if (ok()) return 0;
  const RankExit& first = first_failure();
  return first.signaled ? 128 + first.code : first.code;
}

std::string RankExit::describe() const {
  return signaled ? describe_signal(code) : "exit code " + std::to_string(code);
}

uint16_t free_port() {
  Fd sock(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (sock.get() < 0) throw IoError("launch: socket: " + errno_text(errno));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = 0;
  if (::bind(sock.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    throw IoError("launch: cannot find a free port (bind to port 0): " + errno_text(errno) +
                  "; give --master-port");
  }
  socklen_t len = sizeof addr;
  if (::getsockname(sock.get(), reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    throw IoError("launch: getsockname: " + errno_text(errno));
  }
  return ntohs(addr.sin_port);
}

std::vector<std::string> child_environment(const std::vector<std::string>& base, int rank,
                                           int world_size, const std::string& master_addr,
                                           uint16_t master_port, int local_rank,
                                           int local_world_size,
                                           const std::vector<std::string>& extra) {
  static const char* const kSet[] = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                     "MASTER_ADDR", "MASTER_PORT"};
  std::vector<std::string> env;
  for (const std::string& entry : base) {
    const std::string name = entry.substr(0, entry.find('='));
    bool drop = name.rfind("OMPI_COMM_WORLD_", 0) == 0;
    for (const char* k : kSet) drop = drop || name == k;
    if (!drop) env.push_back(entry);
  }
  env.push_back("RANK=" + std::to_string(rank));
  env.push_back("WORLD_SIZE=" + std::to_string(world_size));
  env.push_back("LOCAL_RANK=" + std::to_string(local_rank < 0 ? rank : local_rank));
  env.push_back("LOCAL_WORLD_SIZE=" +
                std::to_string(local_world_size < 0 ? world_size : local_world_size));
  env.push_back("MASTER_ADDR=" + master_addr);
  env.push_back("MASTER_PORT=" + std::to_string(master_port));
  for (const std::string& e : extra) {
    const std::string name = e.substr(0, e.find('='));
    std::erase_if(env, [&](const std::string& x) { return x.compare(0, name.size() + 1, name + "=") == 0; });
    env.push_back(e);
  }
  return env;
}

std::string self_executable() {
  std::string path(4096, '\0');
  const ssize_t n = ::readlink("/proc/self/exe", path.data(), path.size());
  if (n <= 0 || static_cast<size_t>(n) >= path.size()) {
    throw IoError("cannot resolve /proc/self/exe to re-execute porter: " + errno_text(errno));
  }
  path.resize(static_cast<size_t>(n));
  return path;
}

namespace {

// 32 hex digits from /dev/urandom (Note [Store token]).
std::string random_token() {
  std::ifstream in("/dev/urandom", std::ios::binary);
  unsigned char bytes[16];
  if (!in.read(reinterpret_cast<char*>(bytes), sizeof bytes)) {
    throw IoError("launch: cannot read /dev/urandom for the store token; set PORTER_STORE_TOKEN");
  }
  static const char* const kHex = "0123456789abcdef";
  std::string token;
  for (unsigned char b : bytes) {
    token += kHex[b >> 4];
    token += kHex[b & 15];
  }
  return token;
}

bool has_variable(const std::vector<std::string>& env, const std::string& name) {
  for (const std::string& e : env) {
    if (e.compare(0, name.size() + 1, name + "=") == 0) return true;
  }
  return false;
}

// One world: starts the children and waits for all of them. With end_at_failure, the first
// failure ends the others at once (Note [Restarts]); else they get o.timeout_s.
LaunchResult run_world(const LaunchOptions& o, uint16_t port,
                       const std::vector<std::string>& base_env,
                       const std::vector<std::string>& extra_env, bool end_at_failure,
                       std::ostream& out, std::ostream& err) {
  LaunchResult result;
  result.master_port = port;
  SignalForwarding forwarding;
  std::vector<Child> children(static_cast<size_t>(o.nproc));
  for (int r = 0; r < o.nproc; ++r) {
    Child& c = children[static_cast<size_t>(r)];
    c.streams[0].sink = &out;
    c.streams[1].sink = &err;
    try {
      spawn_child(o, r, result.master_port, base_env, extra_env, c);
    } catch (...) {
      signal_children(children, SIGKILL);
      for (Child& k : children) {
        if (k.alive) ::waitpid(k.pid, nullptr, 0);
      }
      throw;
    }
  }

  int alive = o.nproc;
  std::optional<Clock::time_point> fail_deadline, kill_deadline, drain_deadline;
  constexpr int kPollMs = 20;
  constexpr double kDrainS = 2.0;  // output still in flight after the last child exited
  char buf[65536];
  for (;;) {
    if (const int sig = g_pending_signal.exchange(0); sig != 0 && alive > 0) {
      err << "launch: got " << describe_signal(sig) << "; forwarding it to the "
          << alive << " running rank" << (alive == 1 ? "" : "s") << "\n" << std::flush;
      result.forwarded_signal = sig;
      signal_children(children, sig);
      if (!fail_deadline) {
        fail_deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(o.timeout_s));
      }
    }

    std::vector<pollfd> fds;
    std::vector<Stream*> owners;
    for (Child& c : children) {
      for (Stream& s : c.streams) {
        if (s.fd.get() < 0) continue;
        fds.push_back(pollfd{s.fd.get(), POLLIN, 0});
        owners.push_back(&s);
      }
    }
    if (alive == 0 && fds.empty()) break;
    if (alive == 0 && drain_deadline && Clock::now() > *drain_deadline) break;
    const int n = ::poll(fds.data(), fds.size(), kPollMs);
    if (n < 0 && errno != EINTR) throw IoError("launch: poll: " + errno_text(errno));
    for (size_t i = 0; n > 0 && i < fds.size(); ++i) {
      if ((fds[i].revents & (POLLIN | POLLHUP | POLLERR)) == 0) continue;
      Stream& s = *owners[i];
      const ssize_t got = ::read(s.fd.get(), buf, sizeof buf);
      if (got > 0) {
        s.partial.append(buf, static_cast<size_t>(got));
        emit_lines(s, false);
      } else if (got == 0 || errno != EINTR) {
        emit_lines(s, true);
        s.fd.reset();
      }
    }

    for (Child& c : children) {
      if (!c.alive) continue;
      int status = 0;
      const pid_t p = ::waitpid(c.pid, &status, WNOHANG);
      if (p == 0 || (p < 0 && errno == EINTR)) continue;
      const bool killed = c.exit.killed;
      c.exit = p > 0 ? exit_of(c.exit.rank, status) : RankExit{c.exit.rank, false, 255, false};
      c.exit.killed = killed;
      c.alive = false;
      --alive;
      if (alive == 0) {
        drain_deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                            std::chrono::duration<double>(kDrainS));
      }
      if (c.exit.ok() || killed) continue;
      if (result.first_failed_rank < 0) {
        result.first_failed_rank = c.exit.rank;
        err << "launch: rank " << c.exit.rank << " failed (" << c.exit.describe() << ")";
        if (alive > 0 && end_at_failure) {
          err << "; ending the other " << alive << " rank" << (alive == 1 ? "" : "s");
          for (Child& k : children) {
            if (k.alive) k.exit.killed = true;
          }
          signal_children(children, SIGKILL);
        } else if (alive > 0) {
          err << "; giving the other " << alive << " rank" << (alive == 1 ? "" : "s")
              << " up to " << o.timeout_s << " s to exit";
          if (!fail_deadline) {
            fail_deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                               std::chrono::duration<double>(o.timeout_s));
          }
        }
        err << "\n" << std::flush;
      } else {
        err << "launch: rank " << c.exit.rank << " failed (" << c.exit.describe() << ")\n"
            << std::flush;
      }
    }

    const Clock::time_point now = Clock::now();
    if (alive > 0 && fail_deadline && now >= *fail_deadline && !kill_deadline) {
      err << "launch: " << alive << " rank" << (alive == 1 ? "" : "s")
          << " still running " << o.timeout_s << " s after the failure; terminating:";
      for (Child& c : children) {
        if (c.alive) {
          err << " " << c.exit.rank;
          c.exit.killed = true;
        }
      }
      err << "\n" << std::flush;
      signal_children(children, SIGTERM);
      kill_deadline = now + std::chrono::duration_cast<Clock::duration>(
                                std::chrono::duration<double>(kKillGraceS));
    }
    if (alive > 0 && kill_deadline && now >= *kill_deadline) {
      signal_children(children, SIGKILL);
      kill_deadline = now + std::chrono::hours(1);  // once
    }
  }
  for (Child& c : children) {
    for (Stream& s : c.streams) {
      if (s.fd.get() >= 0) emit_lines(s, true);
    }
    result.ranks.push_back(c.exit);
  }
  if (result.first_failed_rank < 0 && result.forwarded_signal != 0) {
    for (const RankExit& e : result.ranks) {
      if (!e.ok()) {
        result.first_failed_rank = e.rank;
        break;
      }
    }
  }
  if (!result.ok()) {
    err << "launch: failed:";
    for (const RankExit& e : result.ranks) {
      err << " rank " << e.rank << " " << (e.ok() ? "ok" : e.describe())
          << (e.killed ? " (killed by the launcher)" : "") << ";";
    }
    err << " first failure: rank " << result.first_failed_rank << "\n" << std::flush;
  }
  return result;
}

// Note [Restarts]: whether a failed world is started again.
bool restartable(const LaunchResult& r) {
  if (r.ok() || r.forwarded_signal != 0) return false;
  const RankExit& first = r.first_failure();
  return first.signaled || (first.code != 1 && first.code != kExitPreempted);
}

}  // namespace

LaunchResult launch(const LaunchOptions& o, std::ostream& out, std::ostream& err) {
  if (o.nproc < 1) throw UsageError("launch: -n must be at least 1, got " + std::to_string(o.nproc));
  if (o.command.empty() || o.command[0].empty()) {
    throw UsageError("launch: no command: give it after --, e.g. porter launch -n 2 -- porter "
                     "train --config cfg.json");
  }
  if (o.master_addr.empty()) throw UsageError("launch: --master-addr is empty");
  if (!(o.timeout_s >= 0)) throw UsageError("launch: --timeout must be >= 0 seconds");
  if (o.max_restarts < 0) throw UsageError("launch: --max-restarts must be >= 0");
  if (o.nnodes < 1) throw UsageError("launch: --nnodes must be at least 1");
  if (o.node_rank < 0 || o.node_rank >= o.nnodes) {
    throw UsageError("launch: --node-rank " + std::to_string(o.node_rank) + " must be in 0.." +
                     std::to_string(o.nnodes - 1) + " (--nnodes " + std::to_string(o.nnodes) + ")");
  }
  if (o.nnodes > 1 && o.master_port == 0) {
    throw UsageError("launch: --nnodes " + std::to_string(o.nnodes) + " needs --master-port: "
                     "every node's ranks must meet rank 0's store at the same port");
  }
  if (o.nnodes > 1 && (o.master_addr == "127.0.0.1" || o.master_addr == "localhost")) {
    err << "launch: warning: --master-addr " << o.master_addr << " with --nnodes " << o.nnodes
        << ": the other nodes cannot reach a loopback address; give node 0's address\n";
  }
  std::vector<std::string> base_env;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) base_env.emplace_back(*e);
  std::vector<std::string> extra_env;
  if (!has_variable(base_env, "PORTER_STORE_TOKEN") &&
      !has_variable(base_env, "PORTER_STORE_TOKEN_FILE")) {
    if (o.nnodes == 1) {
      extra_env.push_back("PORTER_STORE_TOKEN=" + random_token());  // Note [Store token]
    } else {
      err << "launch: warning: no PORTER_STORE_TOKEN or PORTER_STORE_TOKEN_FILE: rank 0's store "
             "will admit any connection; give every node the same token\n";
    }
  }
  for (int attempt = 0;; ++attempt) {
    std::vector<std::string> env = extra_env;
    env.push_back("PORTER_RESTART=" + std::to_string(attempt));
    const uint16_t port = o.master_port != 0 ? o.master_port : free_port();
    std::string shown;
    for (const std::string& a : o.command) shown += (shown.empty() ? "" : " ") + a;
    err << "launch: " << o.nproc << " rank" << (o.nproc == 1 ? "" : "s");
    if (o.nnodes > 1) {
      err << " (" << o.node_rank * o.nproc << ".." << (o.node_rank + 1) * o.nproc - 1 << " of "
          << o.nnodes * o.nproc << ", node " << o.node_rank << " of " << o.nnodes << ")";
    }
    err << ", MASTER_ADDR=" << o.master_addr << " MASTER_PORT=" << port
        << (attempt > 0 ? ", restart " + std::to_string(attempt) + " of " +
                              std::to_string(o.max_restarts)
                        : std::string())
        << ": " << shown << "\n" << std::flush;
    LaunchResult r =
        run_world(o, port, base_env, env, attempt < o.max_restarts, out, err);
    r.restarts = attempt;
    if (attempt >= o.max_restarts || !restartable(r)) {
      if (!r.ok() && attempt > 0) {
        err << "launch: gave up after " << attempt << " restart" << (attempt == 1 ? "" : "s")
            << " (--max-restarts " << o.max_restarts << ")\n" << std::flush;
      }
      return r;
    }
    err << "launch: restarting the world from its latest checkpoint (restart " << attempt + 1
        << " of " << o.max_restarts << ")\n" << std::flush;
  }
}

}  // namespace porter::cli
