// One optimizer step: train_step and DeepSpeed's step API (forward, backward,
// optimizer_step) as the same phases (Note [One engine step] in engine.h; Note [Step API]).
#include <chrono>
#include <memory>
#include <string>

#include "base/check.h"
#include "base/error.h"
#include "engine/engine.h"
#include "engine/engine_impl.h"
#include "engine/executor.h"
#include "engine/stage3.h"
#include "engine/wall_clock.h"

namespace porter::engine {

using Clock = std::chrono::steady_clock;

// Note [Step API]
// train_step(micro_batches) is begin_step, then forward_micro_batch and backward_micro_batch
// for each micro-batch, then finish_step; forward(), backward() and optimizer_step() are the
// same calls one at a time, so the two APIs run the same ops in the same order on the same
// data and give the same bits. A micro-batch's schedule is split after the loss stage's first
// forward (MicroBatchRun): what happens between forward() and backward() in the caller
// cannot change what the schedule computes, only when. The step's state between the calls
// (its result so far, the running micro-batch, the wall-clock breakdown's clock, the trace's
// step span) is a PendingStep; an error drops it with everything the micro-batch held.
struct Engine::PendingStep {
  Clock::time_point t0;
  std::unique_ptr<ScopedSpan> span;  // the trace's "step N" span, ended by finish_step
  comm::CommStats comm0;             // the dp communicator's statistics at begin_step
  StepResult r;
  std::unique_ptr<OpClock> clock;    // the wall-clock breakdown's (Note [Wall-clock breakdown])
  std::vector<io::HostBatch> batches;  // the step API's micro-batches, for record()
  double loss = 0.0;      // the running micro-batch's
  double loss_sum = 0.0;  // the micro-batches' so far, in order
  size_t done = 0;  // micro-batches whose backward ran
  // The micro-batch between forward_micro_batch and backward_micro_batch; the run is
  // destroyed before the batch and env it refers to.
  nn::Batch batch;
  ExecEnv env;
  std::unique_ptr<MicroBatchRun> run;
};

void Engine::PendingStepDeleter::operator()(PendingStep* p) const { delete p; }

void throw_step_begun(const char* what) {
  throw UsageError(std::string(what) + ": a step begun with forward() is unfinished; finish it "
                   "with backward() and optimizer_step() first");
}

// Phase 1: this step's statistics and records start empty (a failed step's are dropped), and
// the step's state begins.
void Engine::begin_step() {
  Impl& im = *impl_;
  pending_.reset(new PendingStep);
  PendingStep& p = *pending_;
  p.t0 = Clock::now();
  TraceSpan step_trace;
  step_trace.name = "step " + std::to_string(step_);
  step_trace.category = "step";
  step_trace.lane = "compute";
  step_trace.step = step_;
  p.span = std::make_unique<ScopedSpan>(trace_, std::move(step_trace));
  im.fold_peaks(allocator_->stats());
  allocator_->reset_peak();
  if (im.step_memory) im.step_memory->begin_step(step_ + 1);
  im.stash->reset_stats();
  (void)im.stash->take_copies();
  (void)im.stash->take_waits();
  (void)im.optimizer->take_exposed_s();
  (void)im.optimizer->take_offload_stats();
  im.optimizer->begin_step();
  if (im.gatherer) (void)im.gatherer->take_stats();
  comm::Communicator* comm = im.comm();
  if (comm != nullptr) (void)comm->take_records();
  if (comm::Communicator* tp = im.tp_comm()) {
    (void)tp->take_records();
    im.tp_comm0 = tp->stats();
  }
  p.comm0 = comm != nullptr ? comm->stats() : comm::CommStats{};
  p.r.wall_clock.enabled = run_.wall_clock_breakdown;
  p.clock = std::make_unique<OpClock>(p.r.wall_clock, device_->compute_stream(), *im.stash);
}

// Phase 2, the first half for one micro-batch: the reducer zeroes the gradients before the
// step's first (the full flat buffer at stages 0 and 1, the rank's shard at stage 2), the
// batch goes to the device, and the schedule runs to the loss stage's first forward.
void Engine::forward_micro_batch(const io::HostBatch& mb, bool keep_output) {
  Impl& im = *impl_;
  PendingStep& p = *pending_;
  const size_t i = p.done;
  if (i == 0) {
    im.reducer->zero_grads();
    model_->set_loss_scale(static_cast<float>(
        im.optimizer->loss_scale() / static_cast<double>(run_.gradient_accumulation_steps)));
  }
  p.batch = upload_batch(*allocator_, mb, model_->batch_spec(run_));
  zero::GradReducer* reducer = im.reducer.get();
  ExecEnv& env = p.env;
  env = ExecEnv{};
  env.model = model_.get();
  env.ctx = im.ctx.get();
  env.schedule = &im.plan.schedule;
  env.selective_policy = im.plan.selective_policy;
  env.trace = trace_;
  env.step = step_;
  env.micro_batch = static_cast<int>(i);
  env.seed = run_.seed;
  env.stash = im.stash.get();
  env.before_backward = [reducer](int stage) { reducer->before_backward(stage); };
  env.after_backward = [reducer](int stage) { reducer->after_backward(stage); };
  env.memory = im.step_memory.get();
  if (im.train_gathers.active()) {  // Note [Stage 3 driver]
    const Stage3Driver* gathers = &im.train_gathers;
    env.before_op = [gathers](size_t k) { gathers->before_op(k); };
    env.after_op = [gathers](size_t k) { gathers->after_op(k); };
  }
  if (p.r.wall_clock.enabled) p.clock->wrap(env, model_->num_stages());  // Note [Wall-clock breakdown]
  reducer->begin_micro_batch(i + 1 == static_cast<size_t>(run_.gradient_accumulation_steps));
  p.run = std::make_unique<MicroBatchRun>(env, p.batch, keep_output);
  p.loss = p.run->forward();
  p.loss_sum += p.loss;
  if (keep_output) last_output_ = p.run->take_output();
}

// Phase 2, the second half: the rest of the schedule, with the gradient buckets reduced as
// Note [Gradient reduction] says; every reduction is complete, averaged and in the shard
// when the micro-batch ends.
void Engine::backward_micro_batch() {
  Impl& im = *impl_;
  PendingStep& p = *pending_;
  WallClockBreakdown& wc = p.r.wall_clock;
  const MicroBatchResult mr = p.run->finish();
  const auto reduce_t0 = wc.enabled ? p.clock->now() : Clock::time_point{};
  im.reducer->end_micro_batch();
  if (wc.enabled) wc.reduce_ms += ms_between(reduce_t0, p.clock->now());
  p.r.recompute_s += mr.recompute_s;
  p.run.reset();
  p.batch = nn::Batch{};
  ++p.done;
}

// Phases 3 to 5: the update (Note [Sharded optimizer]), then the step's records.
StepResult Engine::finish_step(const std::vector<io::HostBatch>& micro_batches) {
  Impl& im = *impl_;
  PendingStep& p = *pending_;
  StepResult& r = p.r;
  r.loss = p.loss_sum / static_cast<double>(p.done);
  zero::GradNorm norm;
  zero::ReducerStats reduced;
  try {
    reduced = im.reducer->take_stats();
    norm = update(r);
  } catch (const std::exception& e) {
    fail_step(e);
    throw;
  }
  im.optimizer->finish_step(norm.overflow);
  collect_offload(r);
  collect_comm();
  record(micro_batches, p.comm0, reduced, r);
  r.time_s = std::chrono::duration<double>(Clock::now() - p.t0).count();
  if (!im.kernel_table_agreed) {
    agree_kernel_table();
    im.kernel_table_agreed = true;
  }
  StepResult out = std::move(r);
  pending_.reset();  // ends the step's trace span
  return out;
}

void Engine::fail_step(const std::exception& e) {
  Impl& im = *impl_;
  // Note [Comm failure]: peers must not wait out the timeout for this rank.
  if (comm::Communicator* comm = im.comm()) {
    comm->abort("rank " + std::to_string(comm->rank()) + ": train_step " +
                std::to_string(step_) + " failed: " + e.what());
  }
  if (comm::Communicator* tp = im.tp_comm(); tp != nullptr) {
    tp->abort("rank " + std::to_string(tp->rank()) + " of " + tp->group_name() +
              ": train_step " + std::to_string(step_) + " failed: " + e.what());
  }
  im.reducer->abort();
  if (im.gatherer) im.gatherer->abort();
  pending_.reset();
}

StepResult Engine::train_step(const std::vector<io::HostBatch>& micro_batches) {
  check_states_on_device("train_step");  // Note [Offloaded model states]
  if (pending_ != nullptr) {
    throw UsageError("train_step: a step begun with forward() is unfinished (" +
                     std::to_string(pending_->done) + " of " +
                     std::to_string(run_.gradient_accumulation_steps) +
                     " micro-batches done); finish it with backward() and optimizer_step() first");
  }
  check_batches(run_, *model_, micro_batches,
                static_cast<size_t>(run_.gradient_accumulation_steps));
  begin_step();
  try {
    for (const io::HostBatch& mb : micro_batches) {
      forward_micro_batch(mb, false);
      backward_micro_batch();
    }
  } catch (const std::exception& e) {
    fail_step(e);
    throw;
  }
  return finish_step(micro_batches);
}

double Engine::forward(const io::HostBatch& batch, bool keep_output) {
  check_states_on_device("forward");
  const auto accumulation = static_cast<size_t>(run_.gradient_accumulation_steps);
  if (pending_ != nullptr && pending_->run != nullptr) {
    throw UsageError("forward: the last forward() has had no backward(); call backward() "
                     "before the next micro-batch's forward()");
  }
  if (pending_ != nullptr && pending_->done == accumulation) {
    throw UsageError("forward: all " + std::to_string(accumulation) +
                     " micro-batches of the step (gradient_accumulation_steps) have run "
                     "backward(); call optimizer_step() before the next forward()");
  }
  check_batch(model_->batch_spec(run_), *model_, batch, pending_ != nullptr ? pending_->done : 0);
  if (pending_ == nullptr) begin_step();
  try {
    forward_micro_batch(batch, keep_output);
  } catch (const std::exception& e) {
    fail_step(e);
    throw;
  }
  pending_->batches.push_back(batch);
  return pending_->loss;
}

void Engine::backward() {
  if (pending_ == nullptr || pending_->run == nullptr) {
    throw UsageError("backward: no forward() is waiting for its backward; call forward(batch) "
                     "first");
  }
  try {
    backward_micro_batch();
  } catch (const std::exception& e) {
    fail_step(e);
    throw;
  }
}

bool Engine::is_gradient_accumulation_boundary() const {
  return pending_ != nullptr && pending_->run == nullptr &&
         pending_->done == static_cast<size_t>(run_.gradient_accumulation_steps);
}

std::optional<StepResult> Engine::optimizer_step() {
  if (pending_ != nullptr && pending_->run != nullptr) {
    throw UsageError("optimizer_step: the last forward() has had no backward(); call "
                     "backward() first");
  }
  if (!is_gradient_accumulation_boundary()) return std::nullopt;
  std::vector<io::HostBatch> batches = std::move(pending_->batches);
  return finish_step(batches);
}

const io::HostTensor& Engine::output() const {
  if (!last_output_) {
    throw UsageError("output: no forward(batch, keep_output = true) has run; the outputs are "
                     "kept only when asked for");
  }
  return *last_output_;
}

}  // namespace porter::engine
