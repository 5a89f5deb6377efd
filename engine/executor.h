// The schedule executor: runs one micro-batch through a checkpoint::Schedule exactly as
// Note [Schedule semantics] (checkpoint/schedule.h) says. Internal to the engine; the
// profiler that measures a chain's costs is in costs.h.
// Host holds go through the checkpoint stash (offload/stash.h) at the ops its layout names.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include "checkpoint/costs.h"
#include "checkpoint/schedule.h"
#include "engine/model.h"
#include "io/data.h"
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

// The positions per row of a micro-batch whose first stage reads `input` (RunInfo::seq):
// (B, T) token ids and (B, T, C) features have T; (B, K) features are one position a row.
inline int64_t batch_positions(const tensor::Tensor& input) {
  return input.rank() >= 3 || (input.rank() == 2 && input.dtype() == tensor::DType::kI32)
             ? input.dim(1)
             : 1;
}

// The stash calls of every schedule op index, from the layout (Note [Offload semantics]).
struct StashCalls {
  std::vector<int> hold;                    // entry offloaded before the op, or -1
  std::vector<int> use;                     // entry fetched before the op, or -1
  std::vector<std::vector<int>> prefetch;   // entries prefetched before the op, by use_op
  std::vector<std::vector<int>> release;    // entries released after the op
};

// One micro-batch through `env.schedule`, accumulating parameter gradients: the state
// machine of Note [Schedule semantics] (cur / held / tape / grad), resumable so that the
// Engine's step API can stop after the loss stage's forward and run the rest on backward().
// The stage-0 input and the loss stage's targets are the batch's tensors the model names
// (Model::input_name, Model::target_name); the batch is the Ctx's while the ops run.
// On an exception every tape, held input and gradient of this micro-batch is released and
// the stash is aborted before it propagates, so the allocator and the pinned pool are back
// where they were; the same happens when a started run is destroyed before it ends. `env`
// and `batch` must outlive the run.
class MicroBatchRun {
 public:
  // keep_output: the loss stage's input (the model's outputs) is copied to the host as f32
  // at its first forward (take_output).
  MicroBatchRun(const ExecEnv& env, const nn::Batch& batch, bool keep_output = false);
  ~MicroBatchRun();
  MicroBatchRun(const MicroBatchRun&) = delete;
  MicroBatchRun& operator=(const MicroBatchRun&) = delete;

  // Runs the schedule's ops up to and including the first forward of the loss stage; returns
  // the loss.
  double forward();
  // Runs the remaining ops; checks that the schedule ended with every gradient done.
  MicroBatchResult finish();
  bool done() const { return done_; }
  std::optional<io::HostTensor> take_output() { return std::move(output_); }

 private:
  void run_until(size_t end);
  tensor::Tensor input_of(size_t index, const checkpoint::ScheduleOp& op);
  void release() noexcept;


  ExecEnv env_;
  const nn::Batch* batch_;
  nn::RunInfo run_;
  tensor::Tensor targets_;
  std::vector<nn::Tape> tapes_;
  std::vector<tensor::Tensor> held_;
  std::vector<bool> is_held_;
  // Held on the host and not fetched yet: held_[i] is empty until its use_op.
  std::vector<bool> on_host_;
  std::vector<int> forwards_;
  tensor::Tensor cur_;  // a_{cur_stage_}
  int cur_stage_ = 0;
  bool has_cur_ = true;
  tensor::Tensor grad_;  // of a_g; the loss stage ignores its dy
  int g_ = 0;
  std::optional<double> loss_;
  MicroBatchResult result_;
  bool offloading_ = false;
  StashCalls calls_;
  bool keep_output_ = false;
  std::optional<io::HostTensor> output_;
  size_t next_ = 0;       // the next op to run
  size_t loss_end_ = 0;   // one past the loss stage's first forward
  bool started_ = false;
  bool done_ = false;
};

// The whole micro-batch at once: MicroBatchRun(env, batch).finish().
MicroBatchResult run_schedule(const ExecEnv& env, const nn::Batch& batch);

}  // namespace porter::engine
