// The schedule executor (Note [Schedule semantics] in checkpoint/schedule.h): the state
// machine of cur / held / tape / grad, one stage runner per op, and the checkpoint stash's
// calls at the ops its layout names (Note [Offload semantics], Note [Stash protocol]).
#include "engine/executor.h"

#include <algorithm>
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "base/check.h"
#include "base/error.h"

namespace porter::engine {

namespace {

using Clock = std::chrono::steady_clock;
using checkpoint::ScheduleOp;
using checkpoint::SaveOption;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

[[noreturn]] void invalid_op(size_t index, const ScheduleOp& op, const std::string& why) {
  throw InternalError("schedule op " + std::to_string(index) + " (stage " +
                      std::to_string(op.stage) + "): " + why +
                      " (Note [Schedule semantics]; the planner should have rejected it)");
}

// After each op: a span for it and the footprint as a counter.
void record(TraceRecorder* trace, const ExecEnv& env, const char* category, int stage,
            int64_t start_us) {
  if (trace == nullptr) return;
  const int64_t end_us = trace->now_us();
  TraceSpan span;
  span.name = std::string(category) + " " + env.model->stage_name(stage);
  span.category = category;
  span.lane = "compute";
  span.start_us = start_us;
  span.dur_us = end_us - start_us;
  span.step = env.step;
  span.stage = stage;
  span.micro_batch = env.micro_batch;
  trace->span(std::move(span));
  const memory::MemoryStats s = env.ctx->allocator().stats();
  TraceCounter c;
  c.name = "memory";
  c.time_us = end_us;
  c.values = {{"activation_footprint", static_cast<double>(s.activation_bytes)},
              {"requested", static_cast<double>(s.requested_bytes)}};
  trace->counter(std::move(c));
}


[[noreturn]] void bad_layout(size_t entry, const std::string& why) {
  throw InternalError("stash entry " + std::to_string(entry) + ": " + why +
                      " (Note [Offload semantics]; the plan's offload layout does not belong "
                      "to its schedule)");
}

// Checks that each entry's ops are those the Note names for its stage, so that the executor
// cannot drive the stash off its layout.
StashCalls stash_calls(const checkpoint::OffloadLayout& layout,
                       const checkpoint::Schedule& schedule) {
  const size_t n = schedule.ops.size();
  StashCalls c{std::vector<int>(n, -1), std::vector<int>(n, -1),
               std::vector<std::vector<int>>(n), std::vector<std::vector<int>>(n)};
  auto op_at = [&](size_t e, int index, const char* what) -> const ScheduleOp& {
    if (index < 0 || static_cast<size_t>(index) >= n) {
      bad_layout(e, std::string(what) + " " + std::to_string(index) + " is outside the " +
                        std::to_string(n) + " ops");
    }
    return schedule.ops[static_cast<size_t>(index)];
  };
  for (size_t e = 0; e < layout.entries.size(); ++e) {
    const checkpoint::StashEntry& x = layout.entries[e];
    const ScheduleOp& hold = op_at(e, x.hold_op, "hold_op");
    if (hold.kind != ScheduleOp::Kind::kForward || !hold.stashed() || hold.stage != x.stage) {
      bad_layout(e, "hold_op " + std::to_string(x.hold_op) + " is not a host-holding or "
                    "partitioning forward of stage " + std::to_string(x.stage));
    }
    const ScheduleOp& rel = op_at(e, x.release_op, "release_op");
    if (rel.kind != ScheduleOp::Kind::kBackward || rel.stage != x.stage) {
      bad_layout(e, "release_op " + std::to_string(x.release_op) + " is not Backward(" +
                    std::to_string(x.stage) + ")");
    }
    c.hold[static_cast<size_t>(x.hold_op)] = static_cast<int>(e);
    c.release[static_cast<size_t>(x.release_op)].push_back(static_cast<int>(e));
    if (x.use_op < 0) continue;
    const ScheduleOp& use = op_at(e, x.use_op, "use_op");
    if (use.stage != x.stage || x.use_op <= x.hold_op || x.use_op > x.release_op) {
      bad_layout(e, "use_op " + std::to_string(x.use_op) + " does not read stage " +
                    std::to_string(x.stage) + "'s input between its hold and its release");
    }
    (void)op_at(e, x.prefetch_op, "prefetch_op");
    if (x.prefetch_op <= x.hold_op || x.prefetch_op > x.use_op) {
      bad_layout(e, "prefetch_op " + std::to_string(x.prefetch_op) + " is not in (hold_op " +
                    std::to_string(x.hold_op) + ", use_op " + std::to_string(x.use_op) + "]");
    }
    if (c.use[static_cast<size_t>(x.use_op)] >= 0) bad_layout(e, "shares its use_op");
    c.use[static_cast<size_t>(x.use_op)] = static_cast<int>(e);
    c.prefetch[static_cast<size_t>(x.prefetch_op)].push_back(static_cast<int>(e));
  }
  // Copies are issued in the order they are needed.
  for (std::vector<int>& p : c.prefetch) {
    std::sort(p.begin(), p.end(), [&](int a, int b) {
      return layout.entries[static_cast<size_t>(a)].use_op <
             layout.entries[static_cast<size_t>(b)].use_op;
    });
  }
  return c;
}

}  // namespace

MicroBatchRun::MicroBatchRun(const ExecEnv& env, const nn::Batch& batch, bool keep_output)
    : env_(env), batch_(&batch), keep_output_(keep_output) {
  Model& model = *env.model;
  const int n = model.num_stages();
  PORTER_ASSERT(env.schedule->num_stages == n, "schedule for ", env.schedule->num_stages,
                " stages, model has ", n);
  const tensor::Tensor& input = batch.get(model.input_name());
  targets_ = batch.get(model.target_name());
  run_ = {env.seed, static_cast<uint64_t>(env.step), static_cast<uint32_t>(env.micro_batch),
          input.dim(0), batch_positions(input)};
  tapes_.resize(static_cast<size_t>(n));
  held_.resize(static_cast<size_t>(n));
  is_held_.assign(static_cast<size_t>(n), false);
  on_host_.assign(static_cast<size_t>(n), false);
  forwards_.assign(static_cast<size_t>(n), 0);
  cur_ = input;
  g_ = n;
  offloading_ = env.stash != nullptr && !env.stash->layout().empty();
  if (offloading_) calls_ = stash_calls(env.stash->layout(), *env.schedule);
  // The first forward of the loss stage ends the forward half (Engine::forward).
  loss_end_ = env.schedule->ops.size();
  for (size_t k = 0; k < env.schedule->ops.size(); ++k) {
    const ScheduleOp& op = env.schedule->ops[k];
    if (op.kind == ScheduleOp::Kind::kForward && op.stage == n - 1) {
      loss_end_ = k + 1;
      break;
    }
  }
}

MicroBatchRun::~MicroBatchRun() {
  if (started_ && !done_) release();
}

void MicroBatchRun::release() noexcept {
  // Drop every reference into staging slots before the stash frees them.
  tapes_.clear();
  held_.clear();
  cur_ = tensor::Tensor();
  grad_ = tensor::Tensor();
  env_.model->set_targets(tensor::Tensor());
  if (offloading_) env_.stash->abort();
  done_ = true;
}

tensor::Tensor MicroBatchRun::input_of(size_t index, const ScheduleOp& op) {
  if (has_cur_ && cur_stage_ == op.stage) return cur_;
  const auto s = static_cast<size_t>(op.stage);
  if (is_held_[s] && on_host_[s]) {
    invalid_op(index, op, "it reads a host-held input before its use_op");
  }
  if (is_held_[s]) return held_[s];
  invalid_op(index, op, "its input is neither the current activation nor held");
}

void MicroBatchRun::run_until(size_t end) {
  PORTER_ASSERT(!done_, "MicroBatchRun::run_until after the micro-batch ended or failed");
  Model& model = *env_.model;
  nn::Ctx& ctx = *env_.ctx;
  const ExecEnv& env = env_;
  const checkpoint::Schedule& schedule = *env.schedule;
  const int n = model.num_stages();
  TraceRecorder* trace = env.trace;
  offload::CheckpointStash* stash = env.stash;
  const bool offloading = offloading_;
  const StashCalls& calls = calls_;
  const tensor::Tensor& targets = targets_;
  auto& tapes = tapes_;
  auto& held = held_;
  auto& is_held = is_held_;
  auto& on_host = on_host_;
  auto& forwards = forwards_;
  auto& cur = cur_;
  auto& cur_stage = cur_stage_;
  auto& has_cur = has_cur_;
  auto& grad = grad_;
  auto& g = g_;
  auto& loss = loss_;
  auto& result = result_;
  auto input_of = [this](size_t index, const ScheduleOp& op) { return this->input_of(index, op); };
  // The micro-batch's run identity and tensors are the Ctx's while its ops run; the loss
  // stage reads the targets on every forward and recompute (Note [Batch tensors]).
  ctx.set_run(run_);
  ctx.set_batch(batch_);
  model.set_targets(targets_);
  struct BatchGuard {
    nn::Ctx& c;
    ~BatchGuard() { c.set_batch(nullptr); }
  } batch_guard{ctx};
  if (!started_) {
    started_ = true;
    if (offloading) stash->begin(env.micro_batch);
  }
  end = std::min(end, schedule.ops.size());
  try {
    for (; next_ < end; ++next_) {
      const size_t k = next_;
      const ScheduleOp& op = schedule.ops[k];
      if (op.stage < 0 || op.stage >= n) invalid_op(k, op, "no such stage");
      const auto s = static_cast<size_t>(op.stage);
      nn::Layer& layer = model.stage(op.stage);
      const int64_t op_start_ns = env.memory != nullptr ? env.memory->op_start() : 0;
      const StepPhase phase = op.kind == ScheduleOp::Kind::kBackward ? StepPhase::kBackward
                              : op.kind == ScheduleOp::Kind::kRecompute || forwards[s] > 0
                                  ? StepPhase::kRecompute
                                  : StepPhase::kForward;
      if (env.before_op) env.before_op(k);
      // Note [Stash protocol]: prefetches, then the fetch of this op's input, before it runs.
      if (offloading) {
        for (int e : calls.prefetch[k]) stash->prefetch(e);
        if (const int e = calls.use[k]; e >= 0) {
          if (!is_held[s] || !on_host[s]) invalid_op(k, op, "fetches an input not on the host");
          held[s] = stash->fetch(e);  // category `staging`: never retagged
          on_host[s] = false;
        }
      }
      // The tp group's ops are named after the schedule op that issues them (Note [Comm trace]).
      std::optional<comm::CommLabel> tp_label;
      if (trace != nullptr && ctx.tensor_parallel() != nullptr) {
        const char* what = op.kind == ScheduleOp::Kind::kBackward ? "backward"
                           : phase == StepPhase::kRecompute       ? "recompute"
                                                                  : "forward";
        tp_label.emplace(ctx.tensor_parallel(), std::string(what) + " " + model.stage_name(op.stage));
      }
      int64_t start_us = trace != nullptr ? trace->now_us() : 0;
      auto t0 = Clock::now();
      switch (op.kind) {
        case ScheduleOp::Kind::kForward: {
          tensor::Tensor input = input_of(k, op);
          const int hold_entry = offloading ? calls.hold[k] : -1;
          if (op.hold_input && !is_held[s]) {
            if (op.stashed()) {
              if (hold_entry < 0) invalid_op(k, op, "a host or partitioned hold without a stash entry");
              // a_i goes to the host (or its slice stays; Note [Stash partition]) and is
              // dropped like an unheld cur; its buffer is freed when the D2H copy lands
              // (record_stream inside offload()).
              stash->offload(hold_entry, input);
              on_host[s] = true;
              start_us = trace != nullptr ? trace->now_us() : 0;
              t0 = Clock::now();
            } else {
              // Token ids stay in workspace: they are the batch, not an activation.
              if (op.stage > 0) input.retag(memory::Category::kCheckpoints);
              held[s] = input;
            }
            is_held[s] = true;
          } else if (hold_entry >= 0) {
            invalid_op(k, op, "the stash holds an input here that the schedule does not");
          }
          if (op.stage == n - 1) {
            model.set_targets(targets);
            if (keep_output_ && !output_) {  // the model's outputs, before the loss
              output_.emplace();
              output_->name = "output";
              output_->shape = input.shape();
              auto values = std::make_shared<std::vector<float>>(
                  tensor::to_host_f32(ctx.allocator().device(), input));
              output_->data = values->data();
              output_->owner = std::move(values);
            }
          }
          const bool repeat = forwards[s]++ > 0;
          tensor::Tensor out;
          switch (op.save) {
            case SaveOption::kKeep:
              out = nn::forward_stage(ctx, layer, op.stage, tapes[s], nn::SaveMode::kSaveAll,
                                      input);
              break;
            case SaveOption::kCheckpoint:
              out = nn::forward_stage(ctx, layer, op.stage, tapes[s], nn::SaveMode::kCheckpoint,
                                      input, nn::OpPolicy::keep_none());
              break;
            case SaveOption::kSelective:
              out = nn::forward_stage(ctx, layer, op.stage, tapes[s], nn::SaveMode::kCheckpoint,
                                      input, env.selective_policy);
              break;
          }
          input = tensor::Tensor();
          if (op.stage == n - 1 && !loss) {
            loss = static_cast<double>(tensor::to_host_f32(ctx.allocator().device(), out).at(0));
          }
          if (op.stage == n - 1) {
            // The loss is consumed at once (Note [Schedule semantics]); only a tape that
            // references it keeps it. This matters where a prefetch precedes the head's
            // backward: the simulator does not count a loss nothing holds there.
            cur = tensor::Tensor();
            has_cur = false;
          } else {
            cur = std::move(out);
            cur_stage = op.stage + 1;
            has_cur = true;
          }
          out = tensor::Tensor();
          if (repeat) result.recompute_s += seconds_since(t0);
          record(trace, env, repeat ? "recompute" : "forward", op.stage, start_us);
          break;
        }
        case ScheduleOp::Kind::kRecompute: {
          if (!tapes[s].has_plan()) invalid_op(k, op, "recompute without a partial tape");
          tensor::Tensor input = input_of(k, op);
          if (op.stage == n - 1) model.set_targets(targets);
          nn::recompute_stage(ctx, layer, op.stage, tapes[s], input);
          result.recompute_s += seconds_since(t0);
          record(trace, env, "recompute", op.stage, start_us);
          break;
        }
        case ScheduleOp::Kind::kBackward: {
          if (g != op.stage + 1) invalid_op(k, op, "backward out of order");
          if (tapes[s].has_plan()) invalid_op(k, op, "backward on a partial tape");
          if (has_cur && cur_stage == op.stage + 1) {  // an output nothing reads any more
            cur = tensor::Tensor();
            has_cur = false;
          }
          tensor::Tensor dy = std::move(grad);
          if (env.before_backward) env.before_backward(op.stage);
          grad = nn::backward_stage(ctx, layer, op.stage, tapes[s], dy);
          dy = tensor::Tensor();
          if (env.after_backward) env.after_backward(op.stage);
          held[s] = tensor::Tensor();
          is_held[s] = false;
          on_host[s] = false;
          g = op.stage;
          // The staged copy was dropped just above: its slot and pinned slot can go.
          if (offloading) {
            for (int e : calls.release[k]) stash->release(e);
          }
          record(trace, env, "backward", op.stage, start_us);
          break;
        }
      }
      if (env.after_op) env.after_op(k);
      if (env.memory != nullptr) {
        env.memory->op_end(env.micro_batch, static_cast<int>(k), phase, op.stage, op_start_ns);
      }
    }
    if (next_ == schedule.ops.size()) {
      if (offloading) stash->end();
      model.set_targets(tensor::Tensor());
      done_ = true;
    }
  } catch (...) {
    release();
    throw;
  }
}

MicroBatchResult MicroBatchRun::finish() {
  if (!done_) run_until(env_.schedule->ops.size());
  if (g_ != 0 || !loss_) {
    throw InternalError("schedule ended with gradient at stage " + std::to_string(g_) +
                        (loss_ ? "" : " and no forward of the loss stage") +
                        " (Note [Schedule semantics])");
  }
  result_.loss = *loss_;
  return result_;
}

double MicroBatchRun::forward() {
  run_until(loss_end_);
  PORTER_ASSERT(loss_.has_value(), "the schedule's first ", loss_end_,
                " ops ran no forward of the loss stage");
  return *loss_;
}

MicroBatchResult run_schedule(const ExecEnv& env, const nn::Batch& batch) {
  MicroBatchRun run(env, batch);
  return run.finish();
}

}  // namespace porter::engine
