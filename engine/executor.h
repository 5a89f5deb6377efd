// The schedule executor: runs one micro-batch through a checkpoint::Schedule exactly as
// Note [Schedule semantics] (checkpoint/schedule.h) says. Internal to the engine; the
// profiler that measures a chain's costs is in costs.h.
// Host holds go through the checkpoint stash (offload/stash.h) at the ops its layout names.
#pragma once

#include <cstdint>
#include <functional>

#include "checkpoint/costs.h"
#include "checkpoint/schedule.h"
#include "engine/model.h"
#include "engine/step_memory.h"
#include "engine/trace.h"
#include "memory/caching_allocator.h"
#include "nn/ctx.h"
#include "tensor/tensor.h"
#include "offload/stash.h"

namespace porter::engine {

struct ExecEnv {
  Model* model;                        // not owned
  nn::Ctx* ctx;                        // not owned
  const checkpoint::Schedule* schedule;
  nn::OpPolicy selective_policy = nn::OpPolicy::selective_attention();
  TraceRecorder* trace = nullptr;      // not owned; null: no spans
  int64_t step = 0;                    // 0-based optimizer step (dropout key)
  int micro_batch = 0;
  uint64_t seed = 0;
  // Required when the schedule has host holds; drives them per stash->layout(), which must
  // be the layout of `schedule` (Engine::set_plan prepares it). Not owned.
  offload::CheckpointStash* stash = nullptr;
  // Called around every Backward op with its stage (ZeRO's gradient buckets, Note [Gradient
  // reduction] in zero/reducer.h); null: nothing. An exception from either unwinds like one
  // from the stage.
  std::function<void(int stage)> before_backward;
  std::function<void(int stage)> after_backward;
  // Called at the start of every op, before the stash's calls, and at its end, with the op's
  // index in the schedule (ZeRO stage 3's gathers and releases, Note [Gather plan] in
  // checkpoint/param_gather.h); null: nothing.
  std::function<void(size_t op)> before_op;
  std::function<void(size_t op)> after_op;
  // Each op's times go here (Note [Step memory record]); null: none. Not owned.
  StepMemoryRecorder* memory = nullptr;
};

struct MicroBatchResult {
  double loss = 0.0;         // the first forward of the last stage
  double recompute_s = 0.0;  // Recompute ops and every forward of a stage beyond its first
};

// Runs `env.schedule` on (tokens, targets) (B, T) i32, accumulating parameter gradients.
// On an exception every tape, held input and gradient of this micro-batch is released and
// the stash is aborted before it propagates, so the allocator and the pinned pool are back
// where they were.
MicroBatchResult run_schedule(const ExecEnv& env, const tensor::Tensor& tokens,
                              const tensor::Tensor& targets);

}  // namespace porter::engine
