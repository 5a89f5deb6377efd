// The launcher environment: torchrun's variables, OpenMPI's and then Slurm's as fallbacks,
// validated; and the store token. Rules: Note [Launcher environment] in env.h; the table of
// variables in docs/rendezvous.md.
#include "comm/env.h"

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <vector>

#include "base/check.h"
#include "base/error.h"
#include "comm/store.h"

namespace porter::comm {

namespace {

// A strict non-negative decimal integer (digits only, no sign, no spaces) up to `max`.
int64_t parse_count(const std::string& name, const std::string& value, int64_t max) {
  bool ok = !value.empty() && value.size() <= 18;
  int64_t v = 0;
  for (char ch : value) {
    if (ch < '0' || ch > '9') {
      ok = false;
      break;
    }
    v = v * 10 + (ch - '0');
  }
  if (!ok || v > max) {
    throw InvalidArgument(str_cat("environment variable ", name, "=\"", value,
                                  "\" is not an integer in 0..", max,
                                  "; the launcher (torchrun, mpirun, srun, porter launch) sets "
                                  "it: unset it or fix its value"));
  }
  return v;
}

struct Lookup {
  const EnvLookup& getenv;
  std::optional<std::string> str(const std::string& name) const { return getenv(name); }
  std::optional<int> count(const std::string& name) const {
    auto v = getenv(name);
    if (!v) return std::nullopt;
    return static_cast<int>(parse_count(name, *v, std::numeric_limits<int>::max()));
  }
};

void check_positive(const std::string& name, int v) {
  if (v < 1) {
    throw InvalidArgument(str_cat("environment variable ", name, "=", v,
                                  " must be at least 1 (the number of processes)"));
  }
}

void check_below(const std::string& name, int v, const std::string& bound_name, int bound) {
  if (v >= bound) {
    throw InvalidArgument(str_cat("environment variable ", name, "=", v, " must be below ",
                                  bound_name, "=", bound, " (ranks count from 0)"));
  }
}

// One launcher's names for the same four quantities. Slurm's local world size is not one
// variable (it is derived from a per-node list), so it has no name here.
struct Launcher {
  const char* source;  // DistEnv::source
  const char* label;   // for messages
  std::string rank, size, local_rank, local_size;
};

const Launcher kTorchrun{"torchrun", "torchrun/porter launch", "RANK", "WORLD_SIZE",
                         "LOCAL_RANK", "LOCAL_WORLD_SIZE"};
const Launcher kOpenMpi{"openmpi", "mpirun", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                        "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"};
const Launcher kSlurm{"slurm", "srun", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", ""};

// Two launchers' values of the same quantity, when both are set, must agree.
void check_agree(const Lookup& env, const Launcher& la, const std::string& a_name,
                 const Launcher& lb, const std::string& b_name) {
  if (a_name.empty() || b_name.empty()) return;
  auto a = env.count(a_name);
  auto b = env.count(b_name);
  if (a && b && *a != *b) {
    throw InvalidArgument(str_cat("environment variables ", a_name, "=", *a, " and ", b_name,
                                  "=", *b, " disagree; this process was started by two "
                                  "launchers (", la.label, " and ", lb.label,
                                  "): start each rank with one of them"));
  }
}

void check_all_agree(const Lookup& env, const Launcher& a, const Launcher& b) {
  check_agree(env, a, a.rank, b, b.rank);
  check_agree(env, a, a.size, b, b.size);
  check_agree(env, a, a.local_rank, b, b.local_rank);
  check_agree(env, a, a.local_size, b, b.local_size);
}

// Whether this process is a task that srun started (a batch script or salloc shell is not).
bool in_srun_task(const Lookup& env) {
  return env.str("SLURM_STEP_ID").has_value() || env.str("SLURM_STEPID").has_value();
}

// Whether Slurm's variables describe the same processes as `world_size` ranks of another
// launcher: srun started exactly these processes. Otherwise srun (if any) started one launcher
// per node, and Slurm's rank and size are that launcher's (Note [Launcher environment]).
bool slurm_describes_the_ranks(const Lookup& env, int world_size) {
  if (!in_srun_task(env) || !env.str(kSlurm.rank)) return false;
  auto n = env.count(kSlurm.size);
  return n && *n == world_size;
}

std::string trim_newline(std::string s) {
  if (!s.empty() && s.back() == '\n') s.pop_back();
  if (!s.empty() && s.back() == '\r') s.pop_back();
  return s;
}

std::string read_token_file(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    throw InvalidArgument(str_cat("PORTER_STORE_TOKEN_FILE=\"", path,
                                  "\" is a directory; it names a file holding the store token"));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    throw InvalidArgument(str_cat("PORTER_STORE_TOKEN_FILE=\"", path,
                                  "\" cannot be read (", std::strerror(errno),
                                  "); it names a file holding the store token: fix the path or "
                                  "its permissions, or set PORTER_STORE_TOKEN instead"));
  }
  std::ostringstream buf;
  buf << in.rdbuf();
  if (in.bad()) {
    throw InvalidArgument(str_cat("PORTER_STORE_TOKEN_FILE=\"", path,
                                  "\": reading the store token failed"));
  }
  std::string token = trim_newline(buf.str());
  if (token.empty()) {
    throw InvalidArgument(str_cat("PORTER_STORE_TOKEN_FILE=\"", path,
                                  "\" is empty; write the store token into it (one line, the "
                                  "same on every rank), e.g. openssl rand -hex 32 > ", path));
  }
  return token;
}

void check_token_size(const std::string& name, const std::string& token) {
  if (token.size() > kMaxStoreTokenBytes) {
    throw InvalidArgument(str_cat("the store token from ", name, " has ", token.size(),
                                  " bytes, more than the ", kMaxStoreTokenBytes,
                                  " a token may have; 32 random bytes (64 hex digits) are "
                                  "plenty"));
  }
}

std::string store_token_from(const Lookup& env) {
  auto direct = env.str("PORTER_STORE_TOKEN");
  auto file = env.str("PORTER_STORE_TOKEN_FILE");
  if (direct && direct->empty()) {
    throw InvalidArgument(
        "environment variable PORTER_STORE_TOKEN is set but empty; set it to a secret shared "
        "by every rank of the run (e.g. $(openssl rand -hex 32)), or unset it for an "
        "unauthenticated store");
  }
  if (direct) check_token_size("PORTER_STORE_TOKEN", *direct);
  if (!file) return direct.value_or("");
  if (file->empty()) {
    throw InvalidArgument(
        "environment variable PORTER_STORE_TOKEN_FILE is set but empty; set it to the path of "
        "a file holding the store token, or unset it");
  }
  std::string from_file = read_token_file(*file);
  check_token_size(str_cat("PORTER_STORE_TOKEN_FILE=\"", *file, "\""), from_file);
  if (direct && *direct != from_file) {
    // Never print a token: the message goes to logs.
    throw InvalidArgument(str_cat("PORTER_STORE_TOKEN and the contents of "
                                  "PORTER_STORE_TOKEN_FILE=\"", *file,
                                  "\" differ; set only one of them"));
  }
  return from_file;
}

// The first item of a comma-separated list whose commas inside [...] do not separate.
std::string first_item(const std::string& name, const std::string& list) {
  int depth = 0;
  for (size_t i = 0; i < list.size(); ++i) {
    const char ch = list[i];
    if (ch == '[') ++depth;
    if (ch == ']') --depth;
    if (depth < 0 || depth > 1) break;
    if (ch == ',' && depth == 0) return list.substr(0, i);
  }
  if (depth != 0) {
    throw InvalidArgument(str_cat("environment variable ", name, "=\"", list,
                                  "\" has unbalanced brackets; Slurm writes node lists such as "
                                  "node[01-04,07]: set MASTER_ADDR to rank 0's host instead"));
  }
  return list;
}

}  // namespace

std::string slurm_first_host(const std::string& name, const std::string& nodelist) {
  auto bad = [&](const char* why) {
    return InvalidArgument(str_cat("environment variable ", name, "=\"", nodelist, "\" ", why,
                                   "; Slurm writes node lists such as node[01-04,07]: set "
                                   "MASTER_ADDR to rank 0's host instead"));
  };
  const std::string item = first_item(name, nodelist);
  std::string host;
  size_t i = 0;
  while (i < item.size()) {
    if (item[i] != '[') {
      host += item[i++];
      continue;
    }
    // A bracket group "[01-04,07]": its first value is the start of its first range.
    const size_t close = item.find(']', i);
    if (close == std::string::npos) throw bad("has unbalanced brackets");
    const std::string group = item.substr(i + 1, close - i - 1);
    const std::string first = group.substr(0, group.find_first_of(",-"));
    if (first.empty()) throw bad("has an empty bracket range");
    for (char ch : first) {
      if (ch < '0' || ch > '9') throw bad("has a bracket range that is not numeric");
    }
    host += first;
    i = close + 1;
  }
  if (host.empty()) throw bad("names no host");
  for (char ch : host) {
    if (ch == ']' || ch == ' ') throw bad("is not a node list");
  }
  return host;
}

int slurm_max_tasks_per_node(const std::string& name, const std::string& value) {
  // Entries "N" or "N(xM)", separated by commas.
  int best = 0;
  size_t start = 0;
  while (true) {
    const size_t comma = value.find(',', start);
    const std::string entry =
        value.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    const size_t paren = entry.find('(');
    std::string count = entry.substr(0, paren);
    if (paren != std::string::npos) {
      // "(xM)": M nodes with this count; only the count matters here.
      const std::string rep = entry.substr(paren);
      bool ok = rep.size() > 3 && rep[1] == 'x' && rep.back() == ')';
      if (ok) parse_count(name, rep.substr(2, rep.size() - 3), std::numeric_limits<int>::max());
      if (!ok) {
        throw InvalidArgument(str_cat("environment variable ", name, "=\"", value,
                                      "\" is not a tasks-per-node list such as 4 or 4(x2),3; "
                                      "srun sets it: unset it or fix its value"));
      }
    }
    best = std::max(best, static_cast<int>(parse_count(name, count,
                                                       std::numeric_limits<int>::max())));
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return best;
}

uint16_t slurm_port_from_job_id(uint64_t job_id) {
  return static_cast<uint16_t>(10000 + job_id % 50000);
}

DistEnv dist_env_from(const EnvLookup& getenv) {
  PORTER_CHECK(static_cast<bool>(getenv), "dist_env_from: the lookup function is empty");
  const Lookup env{getenv};
  DistEnv d;
  const Launcher* source = nullptr;
  if (env.str(kTorchrun.rank)) {
    source = &kTorchrun;
  } else if (env.str(kOpenMpi.rank)) {
    source = &kOpenMpi;
  } else if (env.str(kSlurm.rank) && in_srun_task(env)) {
    source = &kSlurm;
  }
  // Lower launchers' stray variables must agree with the source's (a world size without its
  // rank included): torchrun's and OpenMPI's always.
  if (source == &kTorchrun) check_all_agree(env, kTorchrun, kOpenMpi);
  if (source == &kOpenMpi) check_all_agree(env, kTorchrun, kOpenMpi);

  if (source == nullptr) {
    // A world size without a rank is a half-configured launch, not a single process. (Slurm's
    // SLURM_NTASKS alone is an allocation's size, set in any batch script: not a launch.)
    for (const std::string& name : {kTorchrun.size, kOpenMpi.size}) {
      auto n = env.count(name);
      if (n && *n != 1) {
        throw InvalidArgument(str_cat("environment variable ", name, "=", *n,
                                      " is set but RANK (or OMPI_COMM_WORLD_RANK, or "
                                      "SLURM_PROCID under srun) is not; set both, or neither "
                                      "for a single process"));
      }
    }
  } else {
    const Launcher& l = *source;
    d.source = l.source;
    d.rank = *env.count(l.rank);
    auto size = env.count(l.size);
    if (!size) {
      throw InvalidArgument(str_cat("environment variable ", l.rank, " is set but ", l.size,
                                    " is not; the launcher sets both"));
    }
    d.world_size = *size;
    check_positive(l.size, d.world_size);
    check_below(l.rank, d.rank, l.size, d.world_size);
    // Without local variables, assume one host: the local rank is the global one.
    d.local_rank = env.count(l.local_rank).value_or(d.rank);
    std::string local_size_name = l.local_size;
    std::optional<int> local_size;
    if (source == &kSlurm) {
      for (const char* name : {"SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE"}) {
        if (auto v = env.str(name)) {
          local_size_name = name;
          local_size = slurm_max_tasks_per_node(name, *v);
          break;
        }
      }
    } else {
      local_size = env.count(l.local_size);
    }
    d.local_world_size = local_size.value_or(d.world_size);
    if (local_size) check_positive(local_size_name, d.local_world_size);
    if (d.local_world_size > d.world_size) {
      throw InvalidArgument(str_cat("environment variable ", local_size_name, "=",
                                    d.local_world_size, " exceeds ", l.size, "=",
                                    d.world_size, " (processes on this host vs in all)"));
    }
    check_below(l.local_rank, d.local_rank,
                local_size ? local_size_name : std::string(l.size), d.local_world_size);
    if (source != &kSlurm && slurm_describes_the_ranks(env, d.world_size)) {
      check_all_agree(env, l, kSlurm);
    }
  }

  if (auto addr = env.str("MASTER_ADDR")) {
    if (addr->empty()) {
      throw InvalidArgument(
          "environment variable MASTER_ADDR is empty; set it to rank 0's host name or "
          "address, or unset it for 127.0.0.1");
    }
    d.master_addr = *addr;
  } else if (source == &kSlurm) {
    for (const char* name : {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST"}) {
      if (auto list = env.str(name)) {
        d.master_addr = slurm_first_host(name, *list);
        break;
      }
    }
  }
  if (auto port = env.str("MASTER_PORT")) {
    const int64_t p = parse_count("MASTER_PORT", *port, 65535);
    if (p == 0) {
      throw InvalidArgument(
          "environment variable MASTER_PORT=\"0\" is not a port the ranks can meet on; set a "
          "free port in 1..65535 (default 29500)");
    }
    d.master_port = static_cast<uint16_t>(p);
  } else if (source == &kSlurm) {
    if (auto job = env.str("SLURM_JOB_ID")) {
      const auto id = static_cast<uint64_t>(
          parse_count("SLURM_JOB_ID", *job, std::numeric_limits<int64_t>::max()));
      d.master_port = slurm_port_from_job_id(id);
    }
  }
  d.store_token = store_token_from(env);
  return d;
}

DistEnv dist_env_from_process() {
  return dist_env_from([](const std::string& name) -> std::optional<std::string> {
    const char* v = std::getenv(name.c_str());
    if (v == nullptr) return std::nullopt;
    return std::string(v);
  });
}

EnvLookup env_lookup(const std::map<std::string, std::string>& vars) {
  return [vars](const std::string& name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
}

}  // namespace porter::comm
