// World, data-parallel and tensor-parallel groups over one world communicator.
#include "base/check.h"
#include "comm/communicator.h"

namespace porter::comm {

ProcessGroups make_process_groups(std::shared_ptr<Communicator> world, int tp) {
  PORTER_CHECK(world != nullptr, "make_process_groups needs the world communicator");
  const int size = world->size();
  PORTER_CHECK(tp >= 1 && size % tp == 0, "tensor-parallel size ", tp,
               " must be at least 1 and divide the world size ", size,
               "; choose a tp that divides the number of ranks");
  ProcessGroups g;
  g.tp_size = tp;
  g.dp_size = size / tp;
  g.tp_rank = world->rank() % tp;
  g.dp_rank = world->rank() / tp;
  const std::string& base = world->group_name();

  // A group spanning the whole world is the world communicator itself (no second context).
  // Every member of a group calls split with the same ranks and a name unique to the group,
  // so the groups' rendezvous keys never meet.
  std::vector<int> dp_ranks;
  for (int d = 0; d < g.dp_size; ++d) dp_ranks.push_back(d * tp + g.tp_rank);
  std::vector<int> tp_ranks;
  for (int t = 0; t < tp; ++t) tp_ranks.push_back(g.dp_rank * tp + t);

  g.world = world;
  if (tp == 1) {
    g.dp = world;
  } else {
    g.dp = world->split(dp_ranks, str_cat(base, "/dp/tp_rank", g.tp_rank));
  }
  if (g.dp_size == 1) {
    g.tp = world;
  } else {
    g.tp = world->split(tp_ranks, str_cat(base, "/tp/dp_rank", g.dp_rank));
  }
  return g;
}

}  // namespace porter::comm
