// porter::engine::Engine: trains a Model one optimizer step at a time on one device, under
// the config's checkpoint policy. See docs/engine.md.
//
// Note [One engine step]
// With N data-parallel ranks (dp; docs/zero.md) at ZeRO stage z in {0, 1, 2, 3}, train_step
// runs these phases in order (docs/engine.md, "One step", names the file that owns each):
// 1. begin_step: the allocator's and the stash's per-step statistics start empty.
// 2. forward_micro_batch and backward_micro_batch, per micro-batch (Note [Step API] in
//    step.cc: the step API runs the same phases one call at a time): the reducer zeroes the
//    gradients (the full flat buffer at stages 0 and 1, the rank's shard at stage 2); each
//    micro-batch's tensors go to the device (workspace; Note [Batch tensors] in io/data.h),
//    then the plan's schedule runs (Note [Schedule
//    semantics] in checkpoint/schedule.h); host-held checkpoints go through the checkpoint
//    stash at the ops plan.offload names (Note [Offload semantics] in
//    checkpoint/offload_plan.h). The loss stage scales its gradient by loss_scale /
//    gradient_accumulation_steps (loss_scale 1 without fp16), so the accumulated gradient is
//    that of the mean loss. Around each Backward the gradient reducer (Note [Gradient
//    reduction] in zero/reducer.h) allocates and binds stage 2's buckets and issues each
//    complete bucket's reduction on the comm stream (overlap_comm; else after backward):
//    stage 2 in every micro-batch, stages 0 and 1 in the last; every reduction is complete,
//    averaged and in the shard when the micro-batch (the step) ends. At stage 3 (reduced as
//    stage 2) the parameter gatherer runs the gather plan around every op (Note [Gather plan]
//    in checkpoint/param_gather.h; Note [Stage 3 driver] in stage3.h): evictions, gathers
//    and waits before it, frees after.
// 3. global_norm, 4. update, finish_step: the sharded optimizer (Note [Sharded optimizer] in
//    zero/sharded_optimizer.h): the global norm, fp16 overflow agreed by all ranks, the clip
//    coefficient, AdamW on the rank's range at the scheduler's lr for the count of updating
//    steps, and the all-gather of the updated parameters (stages 1 and 2; at stage 3 only the
//    persistent stages are gathered again).
// 5. collect_offload, collect_comm and record: wait for the stash's copy streams; with a
//    trace, turn the step's copy and wait records and the communicator's op records into
//    spans (Notes [Offload trace], [Comm trace]); record times, memory, offload and ZeRO
//    statistics (StepResult::zero). Everything the step allocates is
//    returned to the allocator and the pinned pool by the end of the step (the contiguous
//    arenas, sized by set_plan, stay).
// A failure in 2-4 aborts the dp communicator (Note [Comm failure]) and the reducer; with one
// rank nothing is communicated and the step is exactly the single-device step.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "checkpoint/planner.h"
#include "comm/communicator.h"
#include "config/config.h"
#include "io/data.h"
#include "engine/lr_schedule.h"
#include "engine/model.h"
#include "engine/run_options.h"
#include "engine/step_memory.h"
#include "engine/trace.h"
#include "memory/caching_allocator.h"
#include "memory/device.h"
#include "memory/pinned_pool.h"
#include "kernels/kernel_table.h"
#include "kernels/kernels.h"
#include "offload/stash.h"
#include "zero/partition.h"

namespace porter::engine {

struct CheckpointSnapshot;  // engine/checkpoint_snapshot.h

// ZeRO and data-parallel figures of one step, or cumulative (Engine::zero_stats()).
struct ZeroStats {
  int zero_stage = 0;
  int world_size = 1;            // data-parallel ranks
  int64_t shard_elems = 0;       // S (Note [Flat partition] in zero/partition.h)
  int64_t padded_elems = 0;
  uint64_t comm_bytes = 0;       // payload bytes of this rank's collectives
  double comm_busy_s = 0.0;      // comm-stream busy time
  double comm_exposed_s = 0.0;   // time the compute stream waited on collectives
  // The gradient reductions' (reduce-scatter or all-reduce) comm-stream time and the time the
  // compute stream waited for them; the fraction of their busy time that ran while backward
  // was still computing (1: all hidden).
  double reduce_busy_s = 0.0;
  double reduce_exposed_s = 0.0;
  double reduce_hidden_fraction = 0.0;
  double loss_scale = 1.0;       // fp16 dynamic loss scale after the step (1 otherwise)
  int64_t skipped_steps = 0;     // fp16 overflow: steps whose update was skipped
  // Stage 3's parameter gathers (Note [Stage 3 gather] in zero/param_gatherer.h); zero below.
  int64_t gathers = 0;
  uint64_t gathered_bytes = 0;     // received from the other ranks
  double gather_busy_s = 0.0;      // comm-stream time of the gathers
  double gather_exposed_s = 0.0;   // time the compute stream waited for them
  double gather_hidden_fraction = 0.0;  // 1 - exposed / busy (0 when nothing was gathered)
  int64_t peak_live_elems = 0;     // gathered elements alive at once, at most (persistent aside)
  size_t peak_gathered_bytes = 0;  // their bytes
  // The plan's prediction of the same (plan.prediction.params) and the persistent stages'
  // buffers, which stay for the whole run.
  int64_t predicted_peak_live_elems = 0;
  size_t predicted_gathered_bytes = 0;
  size_t persistent_bytes = 0;
  // Optimizer offload (Note [Optimizer offload] in zero/sharded_optimizer.h); zero without.
  uint64_t offload_d2h_bytes = 0;    // gradients to the host
  uint64_t offload_d2h_overlapped_bytes = 0;  // of which queued while backward went on
  double offload_d2h_wait_s = 0.0;   // the update's wait for the gradient copies
  uint64_t offload_h2d_bytes = 0;    // working copies back
  double offload_cpu_update_s = 0.0; // the host AdamW
  double offload_exposed_s = 0.0;    // copies + host update, which the step waited for
  size_t offload_host_bytes = 0;     // host memory of the offloaded state (pinned with pin_memory)
  // Parameter offload (Note [Parameter offload]); zero without.
  size_t param_offload_host_bytes = 0;   // the parameter shard in host memory
  uint64_t param_offload_h2d_bytes = 0;  // this rank's parts of the gathered units, uploaded
  uint64_t param_offload_d2h_bytes = 0;  // the device-updated shard back (optimizer on device)
};
// Accumulates a later step's figures (stats.cc): counters add, peaks take the maximum, the
// hidden fractions follow the summed times, and what describes the run now (layout, loss
// scale, the plan's predictions, host bytes) is b's.
ZeroStats& operator+=(ZeroStats& a, const ZeroStats& b);

// Tensor-parallel figures of one step, or cumulative (Engine::tp_stats();
// docs/tensor-parallel.md).
struct TensorParallelStats {
  int tp = 1;                      // porter.model.tensor_parallel
  bool sequence_parallel = false;
  uint64_t comm_bytes = 0;         // payload of every collective on the tp group
  double comm_busy_s = 0.0;        // its comm-stream busy time
  // Partitioned checkpoints (activation_checkpointing.partition_activations): the
  // all-gathers that rebuilt them before their recompute.
  int64_t gathers = 0;
  uint64_t gathered_bytes = 0;     // received by this rank
  double gather_busy_s = 0.0;      // comm-stream time of the gathers
  double gather_exposed_s = 0.0;   // time the compute stream waited for them
  double hidden_fraction = 0.0;    // 1 - exposed / busy (0 when nothing was gathered)
  // Slices of partitioned checkpoints on the device at once, at most (measured by the
  // stash), and the plan's prediction of it (plan.prediction.offload.peak_slice_bytes).
  size_t partitioned_bytes = 0;
  size_t predicted_partitioned_bytes = 0;
};
// Accumulates a later step's figures, as ZeroStats' operator+= does.
TensorParallelStats& operator+=(TensorParallelStats& a, const TensorParallelStats& b);

// Note [Wall-clock breakdown]
// With wall_clock_breakdown true, train_step times its phases on the host clock (steady_clock)
// into StepResult::wall_clock; off, nothing is timed and every field stays 0. The phases are
// disjoint intervals of the step, so they add up to at most time_s (the rest: uploading the
// batches, zeroing the gradients, records):
//   forward_ms        each stage's first forward (the loss included), its stage-3 gathers too
//   recompute_ms      Recompute ops and repeated forwards (checkpointed stages)
//   backward_inner_ms the Backward ops' compute (DeepSpeed's bwd_inner)
//   reduce_ms         the gradient reduction's host time: issuing the buckets and waiting for
//                     them in backward and at the micro-batch's end (bwd_allreduce)
//   optimizer_ms      norm, clipping, AdamW and the parameter all-gather (step), less the
//                     optimizer offload's wait for its gradient copies
//   offload_wait_ms   waits for copies: the checkpoint stash's fetches and end-of-step
//                     synchronisation, and the offloaded optimizer's gradient copies
// backward_ms() is DeepSpeed's bwd (inner + reduce). On cpu the compute stream is the calling
// thread, so host time is the work's time. On cuda the kernels run asynchronously; with the
// breakdown on, the engine synchronises the compute stream at every phase boundary (as
// DeepSpeed's timers do), which makes the figures honest and the step slower; off, it never
// does.
struct WallClockBreakdown {
  bool enabled = false;
  double forward_ms = 0.0;
  double recompute_ms = 0.0;
  double backward_inner_ms = 0.0;
  double reduce_ms = 0.0;
  double optimizer_ms = 0.0;
  double offload_wait_ms = 0.0;
  double backward_ms() const { return backward_inner_ms + reduce_ms; }
  double total_ms() const {
    return forward_ms + recompute_ms + backward_ms() + optimizer_ms + offload_wait_ms;
  }
  // DeepSpeed's line, then porter's two phases: "[Rank 0] time (ms) | fwd: 1.23 | bwd: ... |
  // bwd_inner: ... | bwd_allreduce: ... | step: ... | recompute: ... | offload_wait: ...".
  std::string format(int rank) const;
};

struct StepResult {
  int64_t step = 0;             // the step just completed (1-based count of steps done)
  double loss = 0.0;            // mean over micro-batches
  double grad_norm = 0.0;       // before clipping
  double clip_coef = 1.0;       // applied to the gradients (1: no clipping)
  double lr = 0.0;
  double time_s = 0.0;          // wall time of train_step
  double recompute_s = 0.0;     // measured: recomputes and repeated forwards
  int64_t tokens = 0;           // tokens processed (batch * seq * micro-batches)
  size_t peak_activation_bytes = 0;  // measured footprint peak during this step
  size_t peak_bytes = 0;             // measured peak of all categories during this step
  offload::StashStats offload;       // this step's copies and waits (zero without offload)
  ZeroStats zero;                    // this step's communication (stage 0, ws 1: all zero)
  TensorParallelStats tensor_parallel;  // this step's (tp 1: all zero)
  bool skipped = false;              // fp16 overflow on some rank: no update this step
  WallClockBreakdown wall_clock;     // wall_clock_breakdown (Note [Wall-clock breakdown])
};

struct MemoryReport {
  size_t capacity_bytes = 0;
  size_t peak_bytes = 0;  // peak requested bytes over all categories since the last reset
  std::array<size_t, memory::kNumCategories> peak_by_category{};
  std::array<size_t, memory::kNumCategories> current_by_category{};
  size_t peak_activation_bytes = 0;           // measured (activations + checkpoints + staging)
  size_t predicted_activation_bytes = 0;      // the plan's prediction
  size_t model_state_bytes = 0;               // params + grads + optimizer
  size_t predicted_peak_bytes = 0;            // model states + batch + predicted total peak
  double predicted_recompute_s = 0.0;         // per step
  double measured_recompute_s = 0.0;          // median per step
  size_t peak_pinned_bytes = 0;               // pinned bytes the stash held at once, at most
  size_t pinned_limit_bytes = 0;              // the pinned pool's (porter.device.pinned_limit)
  size_t predicted_pinned_bytes = 0;          // the plan's plan.offload.pinned_bytes
  size_t offloaded_bytes = 0;                 // the plan's, per micro-batch (0: no offload)
  offload::StashStats offload;                // Engine::offload_stats()
  // Host memory of the offloaded model states (Note [Host-state bytes per rank]): predicted by
  // zero::host_state_bytes from the config, and measured from what the optimizer holds; all
  // zero without optimizer or parameter offload. Pinned ones count against pinned_limit_bytes
  // beside the stash's.
  zero::HostStateBytes predicted_host_state;
  zero::HostStateBytes host_state;
  size_t pinned_in_use_bytes = 0;             // the pinned pool's, now (stash and model states)
  std::string format() const;                 // a table for the terminal
};

// What Engine::offload_states and reload_states did (Note [Offloaded model states] in
// engine/states_offload.cc): the last call of each, and the counts since construction.
struct StatesOffloadStats {
  bool offloaded = false;  // the model states are in host memory now
  bool pinned = true;      // the last offload's host memory: the pinned pool, or pageable
  int64_t offloads = 0;
  int64_t reloads = 0;
  // The last offload_states(): the device's model-state bytes (params + grads + optimizer)
  // and the allocator's reserved bytes, before and after it (after: 0, and the cache
  // emptied); the bytes copied to the host, the host bytes holding them (block sizes), and
  // its wall time.
  size_t device_bytes_before = 0;
  size_t device_bytes_after = 0;
  size_t reserved_bytes_before = 0;
  size_t reserved_bytes_after = 0;
  uint64_t offload_bytes = 0;
  size_t host_bytes = 0;
  double offload_s = 0.0;
  // The last reload_states(): the bytes copied back, the device's model-state bytes after it
  // and its wall time.
  uint64_t reload_bytes = 0;
  size_t device_bytes_reloaded = 0;
  double reload_s = 0.0;
};

// The kernel table held by `path`: a table (as KernelTable::to_json writes it), a report
// written by `porter train --report` (its "kernel_table"), or a training checkpoint directory
// (its meta.json, or rank<world_rank>/meta.json). Throws IoError when it cannot be read and
// InvalidArgument when it holds no table.
nlohmann::json read_kernel_table(const std::filesystem::path& path, int world_rank = 0);

// The process groups of a run without tensor parallelism: `dp` (null: one rank) is the world
// and the data-parallel group.
comm::ProcessGroups data_parallel(std::shared_ptr<comm::Communicator> dp);

class Engine {
 public:
  // Translates the config once (make_run_options), builds the flat buffers (params, grads,
  // optimizer state), initialises the parameters from porter.train.seed and plans the
  // checkpoint schedule from the model's analytic costs or a profiling pass (Note [Engine
  // costs] in run_options.h). Checkpoint, optimizer and parameter offload all run (Note [What
  // the engine runs] in run_options.h). Throws InvalidArgument for configs it cannot run
  // (check_supported: a world_size other than the dp group's size times tensor_parallel, a tp
  // group of another size, Adam with coupled weight decay) and for a model that is not the
  // one the config describes (Model::check_config).
  //
  // `groups` are the run's process groups (comm::make_process_groups); the engine uses their
  // dp and tp communicators, and a null or size-1 one runs without that dimension. The
  // default runs one rank; data_parallel(dp) makes the groups of a run without tensor
  // parallelism.
  //
  // Data parallel (docs/zero.md): groups.dp is the data-parallel communicator, of
  // config.data_parallel_size() ranks. Every rank constructs its Engine with the same config
  // and calls train_step with its own micro-batches (DataSource::rank_batches); ZeRO stages 0
  // to 3 partition as zero_optimization.stage says (stage 3: docs/zero.md, "Stage 3").
  // config.world_size must be dp's size times tensor_parallel. A rank whose step fails aborts
  // dp (Note [Comm failure]) so that its peers fail at once; after a communication error the
  // engine cannot step again.
  //
  // Tensor parallel (docs/tensor-parallel.md): groups.tp is the tensor-parallel communicator
  // of porter.model.tensor_parallel ranks (world = dp x tp); the model is this rank's part
  // (TransformerModel(config.porter.model, groups.tp_rank)). The ranks of a tp group train on
  // the same micro-batches; their layers communicate through the engine's Ctx, and partitioned
  // checkpoints are gathered over it. A failing rank aborts tp as well as dp.
  Engine(memory::Device& device, std::unique_ptr<Model> model, const config::Config& config,
         const comm::ProcessGroups& groups = {});
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // One optimizer step over `micro_batches` (gradient_accumulation_steps of them, each
  // (micro_batch, seq)): this rank's share of the global batch. Throws InvalidArgument for a
  // wrong count or shape; on one rank, on any error the engine's state is unchanged (the
  // step can be retried). StepResult::loss is this rank's mean loss.
  StepResult train_step(const std::vector<io::HostBatch>& micro_batches);

  // DeepSpeed's step API (docs/engine.md, "The step API"): `loss = forward(batch)`,
  // `backward()`, `optimizer_step()`, once per micro-batch, as engine(batch),
  // engine.backward(loss) and engine.step() in DeepSpeed. train_step is these calls over its
  // micro-batches, so the two give the same bits, with accumulation, clipping and fp16 alike.
  // - forward(batch) runs the plan's schedule for the micro-batch up to the loss stage's
  //   first forward (what it keeps is what the checkpoint policy keeps) and returns its loss;
  //   the first forward of a step begins it (the gradients are zeroed). With keep_output the
  //   loss stage's input, the model's outputs, is copied to the host (output()).
  // - backward() runs the rest of the micro-batch's schedule: recomputes, backward, and the
  //   gradient reduction of Note [Gradient reduction].
  // - optimizer_step() at the accumulation boundary (after gradient_accumulation_steps
  //   backward()s) runs the update and returns the step's result (loss: the mean of the
  //   micro-batches'); before it, it does nothing and returns nullopt, as DeepSpeed's
  //   engine.step() does between boundaries.
  // Out of order (forward twice without backward, backward without forward, forward past the
  // boundary, train_step inside a begun step) is a UsageError with nothing changed. A failure
  // inside any of them drops the begun step (its gradients) and aborts the communicators as
  // train_step does.
  double forward(const io::HostBatch& batch, bool keep_output = false);
  void backward();
  std::optional<StepResult> optimizer_step();
  // Whether the next optimizer_step() updates: every micro-batch of the step has run backward.
  bool is_gradient_accumulation_boundary() const;
  // The model's outputs of the last forward(batch, true), f32 on the host, named "output";
  // throws UsageError when there is none.
  const io::HostTensor& output() const;

  // Measures every stage's costs (checkpoint/costs.h) on a synthetic micro-batch of the
  // configured shape; leaves gradients and parameters unchanged.
  checkpoint::ChainCosts profile();
  // Replans with another checkpointing config (tests, benchmarks, `porter plan`).
  void set_plan(const checkpoint::Plan& plan);
  const checkpoint::Plan& plan() const;
  const checkpoint::ChainCosts& costs() const;

  MemoryReport memory_report() const;
  void reset_peaks();
  // Keeps the last completed step's memory record from the next step on (Note [Step memory
  // record] in step_memory.h); false drops it. last_step_memory() is null until a recorded
  // step completes.
  void record_step_memory(bool on);
  const StepMemory* last_step_memory() const;
  // After a train_step that threw, with the record on: that step's record up to now
  // (StepMemoryRecorder::unfinished); nullopt otherwise.
  std::optional<StepMemory> unfinished_step_memory() const;

  // Training checkpoints (io/state_file.h): parameters, master weights, AdamW moments,
  // the step, and the config they belong to. With N > 1 ranks every rank calls both with
  // the same dir and uses dir/rank<r> (Note [Data-parallel checkpoints] in state.cc).
  // load_checkpoint checks that the model and the compute dtype match this engine's and
  // throws IoError / InvalidArgument otherwise; a checkpoint of another data-parallel size,
  // tensor-parallel degree, ZeRO stage or offload is resharded into this rank's part (Note
  // [Resharding a checkpoint] in engine/reshard.h). After it, training continues as from the
  // saved state, bit-identically at the same layout.
  // The checkpoint also holds the kernel table (Note [Kernel table] in kernels/kernel_table.cc);
  // load_checkpoint pins it unless porter.device.kernel_table pins another.
  // save_checkpoint is write_snapshot(snapshot_checkpoint(), dir): the snapshot copies the
  // state to host memory (a collective at stage 3 with stage3_gather_16bit_weights_on_model_save),
  // after which training may go on while another thread writes it (engine/checkpointer.h).
  void save_checkpoint(const std::filesystem::path& dir) const;
  CheckpointSnapshot snapshot_checkpoint() const;
  // The same into `into`, reusing its sections' host buffers where they have the size: a
  // periodic save copies into the memory of the previous one instead of faulting in new pages.
  void snapshot_checkpoint(CheckpointSnapshot& into) const;
  void load_checkpoint(const std::filesystem::path& dir);

  // The kernel choices of this run (Note [Kernel table]): measured, pinned from
  // porter.device.kernel_table, or resumed from a checkpoint.
  kernels::KernelTable& kernel_table() const;

  int64_t step() const { return step_; }
  int dp_rank() const;
  int dp_size() const;
  int tp_rank() const;
  int tp_size() const;
  // dp_rank * tp_size + tp_rank.
  int world_rank() const { return dp_rank() * tp_size() + tp_rank(); }
  // Cumulative since construction or reset_peaks().
  TensorParallelStats tp_stats() const;
  // Cumulative since construction or reset_peaks().
  ZeroStats zero_stats() const;
  const config::Config& config() const { return config_; }
  // What the engine derived from the config (Note [Run options] in run_options.h).
  const RunOptions& run_options() const { return run_; }
  Model& model() { return *model_; }
  memory::CachingAllocator& allocator() { return *allocator_; }
  kernels::Kernels& kernels() { return *kernels_; }
  memory::Device& device() { return *device_; }
  tensor::DType compute_dtype() const { return run_.compute_dtype; }

  // Host copies (f32) of the working parameters and of the gradient buffer as the last
  // step left it (accumulated and averaged over ranks, before clipping; with fp16 still
  // scaled), in layout order. At stages 1 to 3 with N > 1 only the rank's gradient shard is
  // known: the other elements are 0. At stage 3 params_host() all-gathers the parameter
  // shards, so every rank must call it (as set_params_host, save_checkpoint and
  // load_checkpoint, which gather the persistent stages).
  std::vector<float> params_host() const;
  std::vector<float> grads_host() const;
  // The micro-batches of the last step (for --dump-dir).
  const std::vector<io::HostBatch>& last_batches() const { return last_batches_; }

  // Offload (Note [Offload semantics] in checkpoint/offload_plan.h): cumulative copy and wait
  // statistics since construction or reset_peaks(), and the per-checkpoint records of the
  // last step (activation_checkpointing.profile keeps them for every step).
  offload::StashStats offload_stats() const;
  const std::vector<offload::CopyRecord>& last_copies() const;
  const std::vector<offload::WaitRecord>& last_waits() const;
  // The link bandwidth the planner used, bytes/s each way: sim_link_gbps, or measured at
  // construction when offload is on (0 when offload is off and no link is simulated).
  double link_bytes_per_s() const;
  memory::PinnedPool& pinned_pool();

  // Spans and memory counters go to `trace` (null: none). Not owned. With a trace the
  // data-parallel communicator records its ops (Note [Comm trace]); call it from the thread
  // that calls train_step.
  void set_trace(TraceRecorder* trace);

  // The mean loss of `micro_batches` at the current parameters, forward only: no gradient,
  // no update, nothing kept, and no dropout (RunInfo::eval, as PyTorch's eval mode). Same
  // shape checks as train_step.
  double evaluate(const std::vector<io::HostBatch>& micro_batches);
  // Overwrites the parameters (and the f32 master copy for bf16) with `values` in layout
  // order, e.g. pretrained weights or a finite-difference probe. Moments and step stay.
  void set_params_host(const std::vector<float>& values);
  // set_params_host without the whole model in host memory (Note [Sharded loading] in
  // engine/params.cc): `fill` is called once with the part of the padded flat buffer this
  // rank holds, elements [begin, begin + values.size()): all of them at stages 0-2, the
  // rank's shard [optimizer begin, end) at stage 3. It writes their values (layout order, 0
  // past the layout), which are loaded as set_params_host loads the same elements. Every
  // rank calls it (a collective at stage 3).
  void set_params_host_range(const std::function<void(int64_t begin, std::span<float> values)>& fill);

  // Offloading the model states between phases (docs/engine.md, "Offloading the model states
  // between phases"; Note [Offloaded model states] in engine/states_offload.cc), as
  // DeepSpeed's engine.offload_states / reload_states: offload_states copies every parameter,
  // gradient and optimizer-state buffer that lives on the device to host memory (pinned,
  // within porter.device.pinned_limit, with pin_memory; pageable otherwise), frees the device
  // blocks and empties the allocator's cache, so the device's params, grads and optimizer
  // categories read 0; reload_states copies them back, bit for bit, and training goes on as
  // if nothing happened. Neither communicates: each rank calls them for itself. While the
  // states are away, train_step, evaluate, profile, checkpoints and the host copies of the
  // parameters and gradients throw UsageError (call reload_states() first); so do
  // offload_states when they are away already and reload_states when they are not. A host
  // shortfall throws OutOfMemoryError with nothing moved.
  void offload_states(bool pin_memory = true);
  void reload_states();
  bool states_offloaded() const;
  StatesOffloadStats states_offload_stats() const;

 private:
  struct Impl;
  // Construction, in order (the costs in costs.cc).
  void build_model_states();
  void plan_from_costs();
  void agree_on_costs();
  void agree_kernel_table();
  // Note [Agreed costs]: `values` <- their maximum over the world; a bandwidth's minimum.
  void agree_max(std::vector<double>& values, const char* label);
  double agree_bandwidth(double bytes_per_s, const char* label);
  double measure_tp_bytes_per_s(size_t bytes);
  // Throws UsageError naming `what` while the model states are offloaded (offload_states).
  void check_states_on_device(const char* what) const;
  // The phases of train_step (Note [One engine step]), in step.cc but update: a step begun
  // (begin_step, and the step's state), each micro-batch's forward and backward halves, and
  // its end (the update and the records); fail_step drops a begun step after an error.
  void begin_step();
  void forward_micro_batch(const io::HostBatch& batch, bool keep_output);
  void backward_micro_batch();
  StepResult finish_step(const std::vector<io::HostBatch>& micro_batches);
  void fail_step(const std::exception& e);
  zero::GradNorm update(StepResult& r);
  void collect_offload(StepResult& r);
  void collect_comm();
  // stats.cc
  void record(const std::vector<io::HostBatch>& micro_batches, const comm::CommStats& comm0,
              const zero::ReducerStats& reduced, StepResult& r);

  memory::Device* device_;
  config::Config config_;
  RunOptions run_;
  std::unique_ptr<memory::CachingAllocator> allocator_;
  std::unique_ptr<kernels::Kernels> kernels_;
  std::unique_ptr<Model> model_;
  int64_t step_ = 0;
  std::vector<io::HostBatch> last_batches_;
  TraceRecorder* trace_ = nullptr;  // not owned; may be null
  // Destroyed before the members above, while the allocator its buffers came from is alive.
  std::unique_ptr<Impl> impl_;
  // The model states' host copies while offloaded, and the statistics (states_offload.cc).
  // After impl_, so destroyed before it: its blocks come from impl_'s pinned pool.
  struct StatesOffload;
  struct StatesOffloadDeleter {
    void operator()(StatesOffload* s) const;
  };
  std::unique_ptr<StatesOffload, StatesOffloadDeleter> states_offload_;
  // The step begun by train_step or forward() and not finished (step.cc). Last: destroyed
  // first, while the stash and the allocator its tensors use are alive.
  struct PendingStep;
  struct PendingStepDeleter {
    void operator()(PendingStep* p) const;
  };
  std::unique_ptr<PendingStep, PendingStepDeleter> pending_;
  std::optional<io::HostTensor> last_output_;
};

}  // namespace porter::engine
