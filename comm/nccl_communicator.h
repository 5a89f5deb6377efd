// The NCCL backend of Communicator (cuda devices). Compiled only with PORTER_WITH_CUDA.
// Compiled in CI, not yet run on a GPU: see docs/comm.md.
#pragma once

#include <memory>

#include "comm/communicator.h"

namespace porter::comm {

// Rank 0's ncclUniqueId travels through `store` (under "<group_name>/"); every rank then
// joins with ncclCommInitRankConfig (non-blocking, so the join honours options.timeout).
// Called by make_communicator, which has checked the arguments and picked this backend for a
// cuda device.
std::unique_ptr<Communicator> make_nccl_communicator(memory::Device& device,
                                                     std::shared_ptr<Store> store, int rank,
                                                     int size, const CommOptions& options);

}  // namespace porter::comm
