// The schedule executor (Note [Schedule semantics] in checkpoint/schedule.h): the state
// machine of cur / held / tape / grad, one stage runner per op.
#include "engine/executor.h"

#include <chrono>
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

}  // namespace

MicroBatchResult run_schedule(const ExecEnv& env, const nn::Tensor& tokens,
                              const nn::Tensor& targets) {
  Model& model = *env.model;
  nn::Ctx& ctx = *env.ctx;
  const checkpoint::Schedule& schedule = *env.schedule;
  const int n = model.num_stages();
  PORTER_ASSERT(schedule.num_stages == n, "schedule for ", schedule.num_stages,
                " stages, model has ", n);
  ctx.set_run({env.seed, static_cast<uint64_t>(env.step), static_cast<uint32_t>(env.micro_batch)});

  // Note [Schedule semantics]. Destroying these on unwind releases every tape, held input
  // and gradient of the micro-batch.
  std::vector<nn::Tape> tapes(static_cast<size_t>(n));
  std::vector<nn::Tensor> held(static_cast<size_t>(n));
  std::vector<bool> is_held(static_cast<size_t>(n), false);
  std::vector<int> forwards(static_cast<size_t>(n), 0);
  nn::Tensor cur = tokens;  // a_{cur_stage}
  int cur_stage = 0;
  bool has_cur = true;
  nn::Tensor grad;  // of a_g; the loss stage ignores its dy
  int g = n;
  std::optional<double> loss;
  MicroBatchResult result;
  TraceRecorder* trace = env.trace;

  // The loss stage reads the micro-batch's targets on every forward and recompute; the
  // reference is dropped however the micro-batch ends.
  struct TargetsGuard {
    Model& m;
    ~TargetsGuard() { m.set_targets(nn::Tensor()); }
  } targets_guard{model};

  auto input_of = [&](size_t index, const ScheduleOp& op) -> nn::Tensor {
    if (has_cur && cur_stage == op.stage) return cur;
    if (is_held[static_cast<size_t>(op.stage)]) return held[static_cast<size_t>(op.stage)];
    invalid_op(index, op, "its input is neither the current activation nor held");
  };

  for (size_t k = 0; k < schedule.ops.size(); ++k) {
    const ScheduleOp& op = schedule.ops[k];
    if (op.stage < 0 || op.stage >= n) invalid_op(k, op, "no such stage");
    const auto s = static_cast<size_t>(op.stage);
    nn::Layer& layer = model.stage(op.stage);
    const int64_t start_us = trace != nullptr ? trace->now_us() : 0;
    const auto t0 = Clock::now();
    switch (op.kind) {
      case ScheduleOp::Kind::kForward: {
        nn::Tensor input = input_of(k, op);
        if (op.hold_input && !is_held[s]) {
          // Token ids stay in workspace: they are the batch, not an activation.
          if (op.stage > 0) input.retag(memory::Category::kCheckpoints);
          held[s] = input;
          is_held[s] = true;
        }
        if (op.stage == n - 1) model.set_targets(targets);
        const bool repeat = forwards[s]++ > 0;
        nn::Tensor out;
        switch (op.save) {
          case SaveOption::kKeep:
            out = nn::forward_stage(ctx, layer, op.stage, tapes[s], nn::SaveMode::kSaveAll, input);
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
        input = nn::Tensor();
        if (op.stage == n - 1 && !loss) {
          loss = static_cast<double>(nn::to_host_f32(ctx.allocator().device(), out).at(0));
        }
        cur = std::move(out);
        cur_stage = op.stage + 1;
        has_cur = true;
        if (repeat) result.recompute_s += seconds_since(t0);
        record(trace, env, repeat ? "recompute" : "forward", op.stage, start_us);
        break;
      }
      case ScheduleOp::Kind::kRecompute: {
        if (!tapes[s].has_plan()) invalid_op(k, op, "recompute without a partial tape");
        nn::Tensor input = input_of(k, op);
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
          cur = nn::Tensor();
          has_cur = false;
        }
        nn::Tensor dy = std::move(grad);
        grad = nn::backward_stage(ctx, layer, op.stage, tapes[s], dy);
        dy = nn::Tensor();
        held[s] = nn::Tensor();
        is_held[s] = false;
        g = op.stage;
        record(trace, env, "backward", op.stage, start_us);
        break;
      }
    }
  }
  if (g != 0 || !loss) {
    throw InternalError("schedule ended with gradient at stage " + std::to_string(g) +
                        (loss ? "" : " and no forward of the loss stage") +
                        " (Note [Schedule semantics])");
  }
  result.loss = *loss;
  return result;
}

}  // namespace porter::engine
