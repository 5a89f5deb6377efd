// The gather plan of ZeRO stage 3: from a micro-batch's schedule, when each stage's
// parameters are all-gathered, waited for and freed (Note [Gathered parameters] in
// checkpoint/costs.h). The engine runs it (zero/param_gatherer.h); the simulator adds its
// buffers to the replay (checkpoint/simulate.h), so the predicted and measured bytes come from
// the same plan.
//
// Note [Gather plan]
// porter knows the whole micro-batch before it runs: the schedule lists every forward,
// recompute and backward, so the order in which units are read, and where each is read
// again, are known exactly (no recorded trace, nothing to invalidate). Op k reads R_k =
// reads[stage of op k] (persistent units and units without elements left out). Before op k:
//   1. room: a unit of R_k that is not live needs room under max_live_elems (live: gathered
//      or in flight, persistent ones not counted). Units not in R_k are freed for it, those
//      whose next read is farthest first (kept units, then prefetched ones, which are waited
//      for before they are freed). `evict[k]`.
//   2. gather: the units of R_k that are not live are issued. `issue[k]`.
//   3. prefetch: the reads of the ops after k are scanned in order; each unit not live is
//      issued while the prefetched units not yet read (op k's own aside) stay within
//      prefetch_elems and the live ones within max_live_elems; the scan stops at the first
//      that does not fit, so prefetches follow read order. Also `issue[k]`, after the gathers
//      of step 2, and before the waits, so that the comm stream has them queued.
//   4. wait: the units of R_k not yet waited for. `wait[k]`.
// After op k, each unit of R_k is freed (`release[k]`) unless it is read again in this
// micro-batch within max_reuse_distance: the elements of the distinct other units read in
// between. A recomputed stage, read again by its own backward right after, is kept; a
// forward's stage, read again only by a backward far away, is freed. Nothing is live after
// the last op, so every micro-batch starts from the same state.
// A stage whose own reads exceed max_live_elems cannot run: plan_gathers throws
// InvalidArgument naming stage3_max_live_parameters and the smallest value that works.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "checkpoint/costs.h"
#include "checkpoint/schedule.h"

namespace porter::checkpoint {

struct GatherWindow {
  int unit = 0;
  int first_op = 0;  // issued just before this op
  int last_op = 0;   // freed just after this op (an eviction before op k ends at k - 1)
};

struct GatherPlan {
  // Per op of the schedule, in the order the engine performs them (Note [Gather plan]).
  std::vector<std::vector<int>> evict, issue, wait, release;
  std::vector<GatherWindow> windows;  // every gathered buffer's lifetime
  int64_t peak_live_elems = 0;        // at most, at once
  size_t peak_live_bytes = 0;
  int gathers = 0;                    // per micro-batch
  size_t gathered_bytes = 0;          // of the gathered buffers, summed over gathers
  bool empty() const { return windows.empty(); }
};

// Note [Gather plan]. An empty plan when params is disabled. Throws InvalidArgument when a
// stage's reads do not fit max_live_elems, or when params does not match the schedule.
GatherPlan plan_gathers(const Schedule& schedule, const ParamGather& params);

}  // namespace porter::checkpoint
