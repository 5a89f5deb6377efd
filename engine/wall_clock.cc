// The wall-clock breakdown's op timer (wall_clock.h).
#include "engine/wall_clock.h"

#include <algorithm>
#include <utility>

namespace porter::engine {

namespace {

// The stash's waits so far this step (Note [Wall-clock breakdown]: offload waits).
double stash_wait_ms(const offload::CheckpointStash& stash) {
  const offload::StashStats s = stash.stats();
  return 1e3 * (s.exposed_wait_s + s.gather_exposed_s);
}

}  // namespace

std::chrono::steady_clock::time_point OpClock::now() const {
  compute_->synchronize();
  return std::chrono::steady_clock::now();
}

void OpClock::wrap(ExecEnv& env, int num_stages) {
  const checkpoint::Schedule* schedule = env.schedule;
  forwards_.assign(static_cast<size_t>(num_stages), 0);
  env.after_backward = [inner = std::move(env.after_backward), this](int stage) {
    const auto t0 = now();
    if (inner) inner(stage);
    reduce_ms_ += ms_between(t0, now());
  };
  env.before_op = [inner = std::move(env.before_op), this](size_t k) {
    start_ = now();
    stash_wait_ms_ = stash_wait_ms(*stash_);
    reduce_ms_ = 0.0;
    if (inner) inner(k);
  };
  env.after_op = [inner = std::move(env.after_op), schedule, this](size_t k) {
    if (inner) inner(k);
    const double op_ms = ms_between(start_, now());
    const double wait_ms = stash_wait_ms(*stash_) - stash_wait_ms_;
    const checkpoint::ScheduleOp& op = schedule->ops[k];
    const double work_ms = std::max(0.0, op_ms - wait_ms - reduce_ms_);
    WallClockBreakdown& wc = *wc_;
    wc.offload_wait_ms += wait_ms;
    wc.reduce_ms += reduce_ms_;
    if (op.kind == checkpoint::ScheduleOp::Kind::kBackward) {
      wc.backward_inner_ms += work_ms;
    } else if (op.kind == checkpoint::ScheduleOp::Kind::kForward &&
               forwards_[static_cast<size_t>(op.stage)]++ == 0) {
      wc.forward_ms += work_ms;
    } else {  // Recompute, or a repeated forward (as the executor counts recompute_s)
      wc.recompute_ms += work_ms;
    }
  };
}

}  // namespace porter::engine
