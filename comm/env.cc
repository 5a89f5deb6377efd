// The launcher environment: torchrun's variables, OpenMPI's as a fallback, validated.
// Rules: Note [Launcher environment] in env.h; the table of variables in docs/rendezvous.md.
#include "comm/env.h"

#include <cstdlib>
#include <limits>

#include "base/check.h"
#include "base/error.h"

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
                                  "; the launcher (torchrun, mpirun, porter launch) sets it: "
                                  "unset it or fix its value"));
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

// torchrun's and OpenMPI's value of the same quantity, when both are set, must agree.
void check_agree(const Lookup& env, const std::string& torch_name,
                 const std::string& mpi_name) {
  auto a = env.count(torch_name);
  auto b = env.count(mpi_name);
  if (a && b && *a != *b) {
    throw InvalidArgument(str_cat("environment variables ", torch_name, "=", *a, " and ",
                                  mpi_name, "=", *b,
                                  " disagree; this process was started by two launchers: "
                                  "use one of torchrun/porter launch or mpirun"));
  }
}

}  // namespace

DistEnv dist_env_from(const EnvLookup& getenv) {
  PORTER_CHECK(static_cast<bool>(getenv), "dist_env_from: the lookup function is empty");
  const Lookup env{getenv};
  DistEnv d;
  std::string rank_name, size_name, local_rank_name, local_size_name;
  if (env.str("RANK")) {
    d.source = "torchrun";
    rank_name = "RANK";
    size_name = "WORLD_SIZE";
    local_rank_name = "LOCAL_RANK";
    local_size_name = "LOCAL_WORLD_SIZE";
    check_agree(env, "RANK", "OMPI_COMM_WORLD_RANK");
    check_agree(env, "WORLD_SIZE", "OMPI_COMM_WORLD_SIZE");
    check_agree(env, "LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK");
    check_agree(env, "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE");
  } else if (env.str("OMPI_COMM_WORLD_RANK")) {
    d.source = "openmpi";
    rank_name = "OMPI_COMM_WORLD_RANK";
    size_name = "OMPI_COMM_WORLD_SIZE";
    local_rank_name = "OMPI_COMM_WORLD_LOCAL_RANK";
    local_size_name = "OMPI_COMM_WORLD_LOCAL_SIZE";
    check_agree(env, "WORLD_SIZE", "OMPI_COMM_WORLD_SIZE");
    check_agree(env, "LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK");
  }

  if (d.source == "none") {
    // A world size without a rank is a half-configured launch, not a single process.
    for (const char* name : {"WORLD_SIZE", "OMPI_COMM_WORLD_SIZE"}) {
      auto n = env.count(name);
      if (n && *n != 1) {
        throw InvalidArgument(str_cat("environment variable ", name, "=", *n,
                                      " is set but RANK (or OMPI_COMM_WORLD_RANK) is not; set "
                                      "both, or neither for a single process"));
      }
    }
  } else {
    d.rank = *env.count(rank_name);
    auto size = env.count(size_name);
    if (!size) {
      throw InvalidArgument(str_cat("environment variable ", rank_name, " is set but ",
                                    size_name, " is not; the launcher sets both"));
    }
    d.world_size = *size;
    check_positive(size_name, d.world_size);
    check_below(rank_name, d.rank, size_name, d.world_size);
    // Without local variables, assume one host: the local rank is the global one.
    d.local_rank = env.count(local_rank_name).value_or(d.rank);
    d.local_world_size = env.count(local_size_name).value_or(d.world_size);
    check_positive(local_size_name, d.local_world_size);
    if (d.local_world_size > d.world_size) {
      throw InvalidArgument(str_cat("environment variable ", local_size_name, "=",
                                    d.local_world_size, " exceeds ", size_name, "=",
                                    d.world_size, " (processes on this host vs in all)"));
    }
    check_below(local_rank_name, d.local_rank, local_size_name, d.local_world_size);
  }

  if (auto addr = env.str("MASTER_ADDR")) {
    if (addr->empty()) {
      throw InvalidArgument(
          "environment variable MASTER_ADDR is empty; set it to rank 0's host name or "
          "address, or unset it for 127.0.0.1");
    }
    d.master_addr = *addr;
  }
  if (auto port = env.str("MASTER_PORT")) {
    const int64_t p = parse_count("MASTER_PORT", *port, 65535);
    if (p == 0) {
      throw InvalidArgument(
          "environment variable MASTER_PORT=\"0\" is not a port the ranks can meet on; set a "
          "free port in 1..65535 (default 29500)");
    }
    d.master_port = static_cast<uint16_t>(p);
  }
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
