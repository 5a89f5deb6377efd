// The Gloo backend of Communicator: ring collectives over Gloo's TCP transport, run as host
// callbacks on a cpu comm stream. See docs/comm.md.
#pragma once

#include <memory>

#include "comm/communicator.h"

namespace porter::comm {

// Connects `size` ranks through `store` (keys under "<group_name>/"). Throws TimeoutError
// when peers do not arrive within options.timeout. Called by make_communicator, which has
// checked the arguments and picked this backend for a cpu device.
std::unique_ptr<Communicator> make_gloo_communicator(memory::Device& device,
                                                     std::shared_ptr<Store> store, int rank,
                                                     int size, const CommOptions& options);

}  // namespace porter::comm
