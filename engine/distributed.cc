// porter::init_distributed (Note [Joining the world] in distributed.h).
#include "engine/distributed.h"

#include "base/check.h"
#include "engine/engine.h"

namespace porter {

Distributed init_distributed(memory::Device& device, const comm::DistEnv& env,
                             const DistributedOptions& options) {
  PORTER_CHECK(options.tensor_parallel >= 1, "init_distributed: tensor_parallel is ",
               options.tensor_parallel, "; it must be at least 1");
  PORTER_CHECK(env.world_size % options.tensor_parallel == 0, "init_distributed: ",
               env.world_size, " ranks (", env.source,
               ") do not split into tensor-parallel groups of ", options.tensor_parallel,
               "; launch a multiple of porter.model.tensor_parallel ranks");
  Distributed d;
  d.env = env;
  if (!d.distributed()) return d;
  const comm::Seconds timeout(options.timeout_s);
  comm::TcpStoreOptions so;
  so.host = env.master_addr;
  so.port = env.master_port;
  so.is_server = env.rank == 0;
  so.timeout = timeout;
  so.world_size = env.world_size;
  so.token = env.store_token;
  d.store = std::make_shared<comm::TcpStore>(so);
  comm::CommOptions co;
  co.group_name = "world";
  co.timeout = timeout;
  d.world = comm::make_communicator(device, d.store, env.rank, env.world_size, co);
  d.groups = options.tensor_parallel == 1
                 ? engine::data_parallel(d.world)
                 : comm::make_process_groups(d.world, options.tensor_parallel);
  return d;
}

Distributed init_distributed(memory::Device& device, const DistributedOptions& options) {
  return init_distributed(device, comm::dist_env_from_process(), options);
}

Distributed init_distributed(memory::Device& device, const config::Config& config) {
  DistributedOptions o;
  o.tensor_parallel = static_cast<int>(config.porter.model.tensor_parallel);
  o.timeout_s = config.porter.comm.timeout_s;
  return init_distributed(device, o);
}

}  // namespace porter
