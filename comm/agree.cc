// Store votes (comm/agree.h).
#include "comm/agree.h"

namespace porter::comm {

int count_votes(Store& store, const std::string& key, int world_size, bool yes, Seconds timeout) {
  // add() returns once the store has applied it, and a rank adds its yes before it counts
  // itself in, so the rank that brings the count to world_size sees every yes.
  if (yes) store.add(key + "/yes", 1);
  if (store.add(key + "/n", 1) == world_size) {
    store.set_string(key + "/total", std::to_string(store.add(key + "/yes", 0)));
  }
  return std::stoi(store.get_string(key + "/total", timeout));
}

}  // namespace porter::comm
