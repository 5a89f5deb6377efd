// The Engine's private state (engine.h), shared by the files that implement the Engine:
// engine.cc (construction, the step's phases), batches.cc, costs.cc, evaluate.cc, params.cc,
// stats.cc, memory_report.cc and state.cc.
#pragma once

#include <algorithm>
#include <array>
#include <memory>
#include <vector>

#include "checkpoint/param_gather.h"
#include "checkpoint/planner.h"
#include "engine/engine.h"
#include "engine/lr_schedule.h"
#include "engine/stage3.h"
#include "engine/step_memory.h"
#include "nn/ctx.h"
#include "nn/layer.h"
#include "offload/stash.h"
#include "zero/param_gatherer.h"
#include "zero/partition.h"
#include "zero/reducer.h"
#include "zero/sharded_optimizer.h"

namespace porter::engine {

struct Engine::Impl {
  // The pinned pool and its host tier (Note [Host tier] in memory/host_tier.h) before the
  // stash, the optimizer and the gatherer: they return their blocks to it when destroyed.
  // One tier serves all three, so its stats() are the run's whole host traffic.
  std::unique_ptr<memory::PinnedPool> pinned;
  std::unique_ptr<memory::PinnedHostTier> host;
  std::unique_ptr<offload::CheckpointStash> stash;
  double link_bytes_per_s = 0.0;  // Engine::link_bytes_per_s
  offload::StashStats offload_total;  // since construction or reset_peaks()
  std::vector<offload::CopyRecord> copies;  // the last step's (every step's with profile)
  std::vector<offload::WaitRecord> waits;
  // Data parallel and ZeRO (docs/zero.md). Null or a size-1 communicator: one rank.
  std::shared_ptr<comm::Communicator> dp;
  // Tensor parallel: null or a size-1 communicator without it.
  std::shared_ptr<comm::Communicator> tp;
  TensorParallelStats tp_total;  // cumulative since construction or reset_peaks()
  bool kernel_table_agreed = false;  // Note [Kernel table agreement] in costs.cc
  comm::CommStats tp_comm0;      // the tp communicator's statistics when the step began
  double tp_bytes_per_s = 0.0;   // what the planner charged gathers to (0: no partitioning)
  zero::Partition part;  // Note [Flat partition]
  std::unique_ptr<nn::FlatParams> flat;  // params (compute dtype), grads (f32; none at stage 2)
  // After flat: destroyed first. The optimizer's state (Note [Sharded optimizer]) and the
  // gradient reducer, which unbinds its buckets from the flat buffers.
  std::unique_ptr<zero::ShardedOptimizer> optimizer;
  std::unique_ptr<zero::GradReducer> reducer;
  // Each stage's flat range and each entry's stage (zero::stage_layout), and per stage the
  // stages whose gradients its backward writes (the inverse of Model::grad_writers): the
  // reducer's buckets and the profile's per-stage gradient scratch (Engine::profile).
  zero::StageLayout stage_layout;
  std::vector<std::vector<int>> writes;
  // ZeRO stage 3 (docs/zero.md, "Stage 3"): the parameter gatherer over the optimizer's
  // working shard, and its drivers (Note [Stage 3 driver]): the current schedule's (set_plan)
  // and the forward pass's (evaluate, profile); null / inactive at stages 0-2.
  std::unique_ptr<zero::ParamGatherer> gatherer;
  Stage3Driver train_gathers;
  Stage3Driver forward_gathers;
  checkpoint::ParamGather param_costs;   // the costs' params (Note [Gathered parameters])
  // The costs' comm: the reducer's buckets (Note [Gradient buckets in the footprint]).
  std::vector<checkpoint::CommStage> comm_costs;
  ZeroStats zero_total;         // cumulative since construction or reset_peaks()
  std::unique_ptr<nn::Ctx> ctx;
  std::unique_ptr<LrSchedule> lr;
  checkpoint::ChainCosts costs;
  checkpoint::Plan plan;
  std::vector<double> recompute_s_per_step;
  std::unique_ptr<StepMemoryRecorder> step_memory;  // null unless record_step_memory(true)
  // Peaks of earlier windows: train_step and profile reset the allocator's peaks to measure
  // themselves, so the report keeps the running maximum here.
  std::array<size_t, memory::kNumCategories> peak_by_category{};
  size_t peak_requested_bytes = 0;
  size_t peak_activation_bytes = 0;

  // The communicator when there is more than one rank, else null.
  comm::Communicator* comm() const { return dp != nullptr && dp->size() > 1 ? dp.get() : nullptr; }
  comm::Communicator* tp_comm() const { return tp != nullptr && tp->size() > 1 ? tp.get() : nullptr; }
  void fold_peaks(const memory::MemoryStats& s) {
    for (size_t c = 0; c < memory::kNumCategories; ++c)
      peak_by_category[c] = std::max(peak_by_category[c], s.by_category[c].peak_bytes);
    peak_requested_bytes = std::max(peak_requested_bytes, s.peak_requested_bytes);
    peak_activation_bytes = std::max(peak_activation_bytes, s.peak_activation_bytes);
  }
};

// The replicated parameters' element ranges (Model::tp_replicated), adjacent ones merged (the
// alignment padding between them holds zero gradients).
std::vector<std::pair<int64_t, int64_t>> replicated_ranges(const nn::ParamLayout& layout,
                                                           const std::vector<bool>& replicated);
// A micro-batch of the model's batch_spec for profiling: token ids spread over the
// vocabulary, features in [-0.5, 0.5), integer labels 0, masks false.
io::HostBatch synthetic_batch(const RunOptions& run, const Model& model);
// Throws UsageError for `what` (evaluate, profile, set_plan, ...) called while a step begun
// with Engine::forward is unfinished (Note [Step API] in step.cc): it would change the model,
// the plan or the parameters under the micro-batch between its forward and its backward.
[[noreturn]] void throw_step_begun(const char* what);

// A micro-batch's tensors on the device (workspace), named as Note [Batch tensors] says:
// a token batch's "tokens" and "targets", then its named tensors. An i64 tensor the model
// expects as i32 (class labels from a data pipeline) is narrowed on the way.
nn::Batch upload_batch(memory::CachingAllocator& alloc, const io::HostBatch& mb,
                       const std::vector<BatchField>& spec);
// Throws InvalidArgument unless `micro_batches` hold the tensors of the model's batch_spec,
// with their dtypes and shapes (and expected_count of them; 0: any number but none), and
// token ids within the model's vocabulary.
void check_batches(const RunOptions& run, Model& model,
                   const std::vector<io::HostBatch>& micro_batches, size_t expected_count);
// One of them, micro-batch number `index` (for the messages), against model.batch_spec.
void check_batch(const std::vector<BatchField>& spec, Model& model, const io::HostBatch& mb,
                 size_t index);

}  // namespace porter::engine
