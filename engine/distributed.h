// porter::init_distributed: one call that joins the world a launcher started (torchrun,
// OpenMPI's mpirun, Slurm's srun, `porter launch`) and returns the process groups an Engine
// takes. See docs/engine.md, "Several ranks".
//
// Note [Joining the world]
// The launcher's environment says who this process is (comm::dist_env_from_process: RANK,
// WORLD_SIZE, MASTER_ADDR, MASTER_PORT from torchrun and porter launch; OMPI_COMM_WORLD_* from
// OpenMPI; SLURM_* from srun). Rank 0 serves a TcpStore at MASTER_ADDR:MASTER_PORT, every rank
// connects to it (within timeout_s, with the launcher's store token), builds the world
// communicator on `device` (NCCL for cuda, Gloo for cpu) and splits it into data- and
// tensor-parallel groups (comm::make_process_groups; tensor_parallel 1: the world is the dp
// group). Every rank must call it with the same tensor_parallel. With no launcher (one
// process) it returns one rank's groups and connects nothing.
#pragma once

#include <memory>

#include "comm/communicator.h"
#include "comm/env.h"
#include "comm/store.h"
#include "config/config.h"
#include "memory/device.h"

namespace porter {

struct Distributed {
  comm::DistEnv env;                          // what the launcher said
  std::shared_ptr<comm::Store> store;         // null for one rank
  std::shared_ptr<comm::Communicator> world;  // null for one rank
  comm::ProcessGroups groups;                 // the Engine's (default: one rank)
  int rank() const { return env.rank; }
  int world_size() const { return env.world_size; }
  bool distributed() const { return env.world_size > 1; }
};

struct DistributedOptions {
  int tensor_parallel = 1;   // porter.model.tensor_parallel
  double timeout_s = 300.0;  // porter.comm.timeout_s: the rendezvous and every collective
};

// Note [Joining the world]. Throws InvalidArgument for a world_size that tensor_parallel
// does not divide, and comm::CommError when a peer does not arrive within timeout_s.
Distributed init_distributed(memory::Device& device, const DistributedOptions& options = {});
// The same with tensor_parallel and timeout_s from the config.
Distributed init_distributed(memory::Device& device, const config::Config& config);
// With an explicit environment (tests; `porter train` passes the one it has checked).
Distributed init_distributed(memory::Device& device, const comm::DistEnv& env,
                             const DistributedOptions& options);

}  // namespace porter
