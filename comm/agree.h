// Agreement among the ranks through the rendezvous store, for decisions that must be the same
// everywhere but are not collectives of the model (a stop after this step, a checkpoint to
// resume from, the end of a write).
#pragma once

#include <string>

#include "comm/store.h"

namespace porter::comm {

// Every rank of a world of `world_size` calls it once with the same `key` (unique to this
// decision: the store keeps the keys under it) and its own vote; each gets the number of
// ranks that voted yes, once all have voted (a store barrier: add, then wait for the last
// rank's total). Throws TimeoutError after `timeout` (<= 0: the store's default).
int count_votes(Store& store, const std::string& key, int world_size, bool yes,
                Seconds timeout = Seconds{0});

}  // namespace porter::comm
