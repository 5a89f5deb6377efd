// Where this process sits in the world, from the launcher's environment. See docs/rendezvous.md.
//
// Note [Launcher environment]
// torchrun's variables: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
// MASTER_PORT. When RANK is unset, OpenMPI's OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE and
// OMPI_COMM_WORLD_LOCAL_RANK are used (MASTER_ADDR/MASTER_PORT still come from the
// environment, defaulting to 127.0.0.1:29500). With neither, the process is rank 0 of 1.
// Malformed or inconsistent values (RANK >= WORLD_SIZE, a non-numeric port, torchrun and
// OpenMPI disagreeing) throw InvalidArgument naming the variable.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>

namespace porter::comm {

struct DistEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  uint16_t master_port = 29500;
  std::string source = "none";  // "torchrun", "openmpi" or "none"
};

// Looks variables up through `getenv` (tests pass a map).
using EnvLookup = std::function<std::optional<std::string>(const std::string&)>;
DistEnv dist_env_from(const EnvLookup& getenv);
DistEnv dist_env_from_process();  // the process environment
EnvLookup env_lookup(const std::map<std::string, std::string>& vars);

}  // namespace porter::comm
