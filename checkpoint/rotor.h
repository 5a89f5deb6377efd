// The Rotor dynamic program (Beaumont et al. 2019) with Rockmate's per-stage save options,
// host holds and partitioned holds: one solve over a chain's costs within a byte limit. The searches around it (the
// reserve retries and the budget bisection) are the planner's (checkpoint/planner.h).
#pragma once

#include <cstddef>
#include <functional>
#include <optional>

#include "checkpoint/costs.h"
#include "checkpoint/offload_plan.h"
#include "checkpoint/schedule.h"

namespace porter::checkpoint {

// What the program may choose and what a host hold costs it (Note [Rotor recurrence] in
// rotor.cc).
struct RotorOptions {
  bool host_holds = false;        // a hold may live on the host (offload on)
  int prefetch_depth = 1;         // the backwards before a use that hide its H2D copy
  double link_bytes_per_s = 0.0;  // each direction; 0: copies cost nothing
  // A partitionable hold (partitionable(stage, partition_min_bytes)) may keep only its 1/t
  // slice when partition_ways > 1; its host variant is then partitioned too (Note [Partition
  // placement] in planner.h).
  int partition_ways = 1;
  size_t partition_min_bytes = 0;
  double tp_bytes_per_s = 0.0;    // the tp link; 0: gathers cost nothing
  // Solve a run of identical stages' subproblems once (Note [Rotor runs] in rotor.cc): the
  // same schedule either way; false solves every subproblem, for tests that compare.
  bool share_runs = true;
};

// The schedule of least compute (time with times, else FLOPs, else stage runs) whose
// footprint, as the recurrence charges it, stays within `limit_bytes`; nullopt when none
// does. Without host or partitioned holds the simulator finds it within the limit too; with
// them it may not, since staging ahead of a use is not charged (the planner's schedule_rotor
// retries).
// `progress`, when given, hears the fraction of the program solved (0..1], a few dozen times.
std::optional<Schedule> solve_rotor(const ChainCosts& costs, size_t limit_bytes,
                                    const RotorOptions& options = {},
                                    const std::function<void(double)>& progress = {});

}  // namespace porter::checkpoint
