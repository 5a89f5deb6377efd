// The wall-clock breakdown of a step (Note [Wall-clock breakdown] in engine.h): the timer that
// wraps the executor's hooks. Internal to the engine.
#pragma once

#include <chrono>
#include <vector>

#include "checkpoint/schedule.h"
#include "engine/engine.h"
#include "engine/executor.h"
#include "memory/device.h"
#include "offload/stash.h"

namespace porter::engine {

inline double ms_between(std::chrono::steady_clock::time_point a,
                         std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

// Times each op of a micro-batch from its before_op to its after_op, less the stash's waits
// and (Backward) the reducer's work within it, into `wc`.
class OpClock {
 public:
  OpClock(WallClockBreakdown& wc, memory::Stream& compute, const offload::CheckpointStash& stash)
      : wc_(&wc), compute_(&compute), stash_(&stash) {}
  // The host clock after the compute stream's queued work (the breakdown synchronises).
  std::chrono::steady_clock::time_point now() const;
  // Wraps env's before_op, after_op and after_backward for one micro-batch of `num_stages`
  // stages; env.schedule must be set. The clock must outlive the run.
  void wrap(ExecEnv& env, int num_stages);

 private:
  WallClockBreakdown* wc_;
  memory::Stream* compute_;
  const offload::CheckpointStash* stash_;
  std::chrono::steady_clock::time_point start_;
  double stash_wait_ms_ = 0.0;
  double reduce_ms_ = 0.0;    // the reducer's, within this op
  std::vector<int> forwards_;  // per stage, this micro-batch
};

}  // namespace porter::engine
