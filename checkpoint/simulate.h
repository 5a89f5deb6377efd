// The simulator: replays a schedule over a chain's costs (checkpoint/schedule.h) with its host
// and partitioned holds staged as their layout places them (checkpoint/offload_plan.h), and
// times their copies over the link and their gathers over the tp link, without running
// anything. Bytes are per rank.
#pragma once

#include "checkpoint/costs.h"
#include "checkpoint/offload_plan.h"
#include "checkpoint/schedule.h"

namespace porter::checkpoint {

struct SimOptions {
  int prefetch_depth = 1;          // Note [Offload semantics]
  double link_bytes_per_s = 0.0;   // each direction; 0: unknown (no timing)
  int partition_ways = 1;          // Note [Partition semantics]: the tp group's size
  double tp_bytes_per_s = 0.0;     // the tp link (all-gathers); 0: unknown (gathers untimed)
};

// Replays `schedule` against `costs` (Note [Activation bytes]) with the stash's bytes as
// `layout` places them (Note [Offload semantics], Note [Partition semantics]): each read-back
// entry's staged copy in its own slot and each device slice on its own, or with
// layout.contiguous the whole arenas for the whole micro-batch. `layout` is the schedule's
// own (layout_offload of this schedule; empty without host or partitioned holds); another
// throws InvalidArgument. Times the copies when the costs have times and link_bytes_per_s > 0,
// and the gathers when they have times and tp_bytes_per_s > 0.
Prediction simulate(const Schedule& schedule, const ChainCosts& costs, const OffloadLayout& layout,
                    double link_bytes_per_s = 0.0, double tp_bytes_per_s = 0.0);

// The same with the layout layout_offload(schedule, costs, options.prefetch_depth, false,
// options.partition_ways) gives (separate staging slots). Validates first.
Prediction simulate(const Schedule& schedule, const ChainCosts& costs,
                    const SimOptions& options = {});

}  // namespace porter::checkpoint
