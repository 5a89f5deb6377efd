// Where this process sits in the world, from the launcher's environment. See docs/rendezvous.md.
//
// Note [Launcher environment]
// Three launchers are read, in this order of precedence:
// 1. torchrun's variables (porter launch sets the same): RANK, WORLD_SIZE, LOCAL_RANK,
//    LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT.
// 2. When RANK is unset, OpenMPI's OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE,
//    OMPI_COMM_WORLD_LOCAL_RANK and OMPI_COMM_WORLD_LOCAL_SIZE.
// 3. When neither is set, Slurm's, but only in a task that srun started (SLURM_STEP_ID set):
//    SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, and the local world size from
//    SLURM_TASKS_PER_NODE ("4", "4(x2)"; the largest count when nodes differ) or
//    SLURM_NTASKS_PER_NODE. A batch script or salloc shell also carries SLURM_PROCID=0 and
//    SLURM_NTASKS=<tasks of the allocation>, but it is one process, and a launcher it runs
//    (porter launch, torchrun, mpirun) passes those on to every rank it starts: reading them
//    there would make a lone process wait for ranks that never come, or flag every rank of
//    that launcher as disagreeing with Slurm.
// MASTER_ADDR and MASTER_PORT come from the environment, defaulting to 127.0.0.1:29500. Under
// Slurm (the source), an unset MASTER_ADDR is the first host of SLURM_STEP_NODELIST (else
// SLURM_JOB_NODELIST), where srun places task 0, and an unset MASTER_PORT is
// 10000 + SLURM_JOB_ID % 50000, so that every task of a job derives the same port and two jobs
// rarely collide. With no launcher, the process is rank 0 of 1.
// Agreement: the variables of a lower launcher that describe the same processes must agree
// with the source's: torchrun's and OpenMPI's always; Slurm's when srun started these very
// processes (an srun task whose SLURM_NTASKS equals the world size). When SLURM_NTASKS differs,
// srun started one launcher per node (srun ... torchrun) and its variables describe that
// launcher, not the ranks.
// Malformed or inconsistent values (RANK >= WORLD_SIZE, a non-numeric port, two launchers
// disagreeing) throw InvalidArgument naming the variable.
//
// The store token (Note [Store authentication] in comm/tcp_store.cc) is PORTER_STORE_TOKEN, or
// the contents of the file PORTER_STORE_TOKEN_FILE names (one trailing newline trimmed), so
// that it need not appear in a process listing. Both set must agree; an empty token, an
// unreadable or empty file, or one longer than kMaxStoreTokenBytes is an error.
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
  std::string source = "none";  // "torchrun", "openmpi", "slurm" or "none"
  std::string store_token;      // empty: the store admits any connection (it warns)
};

// Looks variables up through `getenv` (tests pass a map).
using EnvLookup = std::function<std::optional<std::string>(const std::string&)>;
DistEnv dist_env_from(const EnvLookup& getenv);
DistEnv dist_env_from_process();  // the process environment
EnvLookup env_lookup(const std::map<std::string, std::string>& vars);

// The first host of a Slurm node list: "node[01-04,07]" -> "node01", "a,b" -> "a",
// "gpu-[3-5]" -> "gpu-3", "rack[1-2]-n[5-6]" -> "rack1-n5". `name` is the variable, for errors.
std::string slurm_first_host(const std::string& name, const std::string& nodelist);
// The largest task count per node in a Slurm tasks-per-node list ("4", "4(x2)", "4(x2),3").
int slurm_max_tasks_per_node(const std::string& name, const std::string& value);
// The rendezvous port derived from a Slurm job id: 10000 + job_id % 50000.
uint16_t slurm_port_from_job_id(uint64_t job_id);

}  // namespace porter::comm
