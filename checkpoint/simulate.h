// The simulator: replays a schedule over a chain's costs (checkpoint/schedule.h) with its host
// holds staged as their layout places them (checkpoint/offload_plan.h), and times their copies
// over the link, without running anything.
#pragma once

#include "checkpoint/costs.h"
#include "checkpoint/offload_plan.h"
#include "checkpoint/schedule.h"

namespace porter::checkpoint {

struct SimOptions {
  int prefetch_depth = 1;          // Note [Offload semantics]
  double link_bytes_per_s = 0.0;   // each direction; 0: unknown (no timing)
};

// Replays `schedule` against `costs` (Note [Activation bytes]) with the staging of its host
// holds as `layout` places them: each read-back entry in its own slot, or with
// layout.contiguous the whole arena for the whole micro-batch. `layout` is the schedule's
// own (layout_offload of this schedule; empty without host holds); another throws
// InvalidArgument. Times the copies when the costs have times and link_bytes_per_s > 0.
Prediction simulate(const Schedule& schedule, const ChainCosts& costs, const OffloadLayout& layout,
                    double link_bytes_per_s = 0.0);

// The same with the layout layout_offload(schedule, costs, options.prefetch_depth) gives
// (separate staging slots). Validates first.
Prediction simulate(const Schedule& schedule, const ChainCosts& costs,
                    const SimOptions& options = {});

}  // namespace porter::checkpoint
