// The checkpoint planner: turns a policy from the config (none, full, uniform, block, sqrt,
// selective, optimal) and a chain's costs into a Plan: the schedule the engine runs, a
// per-stage summary, and the predicted peak and recompute time.
//
// The modules of checkpoint/ (each name.h + name.cc) depend on one another only downward:
//   costs  <-  schedule  <-  offload_plan  <-  simulate  <-  planner
//   costs  <-  schedule  <-  param_gather  <-  simulate
//   costs  <-  schedule  <-  offload_plan  <-  rotor  <-  planner
//   costs  <-  analytic
// costs: the per-stage cost model. schedule: schedules, validate() and the replay of a
// schedule over costs. offload_plan: the layout of host and partitioned holds. simulate: the
// replay with staging, copy and gather timing, and ZeRO stage 3's gathered parameters.
// param_gather: stage 3's gather plan of a schedule. rotor: one solve of the dynamic program.
// planner: the policies, the searches around rotor, and make_plan. analytic: the costs of the
// built-in GPT.
//
// Note [Policies]
// Stage granularity: the embedding, each block and the head of the GPT (any Layer of a
// user chain). "Blocks" are the stages with StageCost::is_block (a user chain's stages are
// all blocks).
//   none       every stage kKeep.
//   full       every stage (embedding and head included) is its own checkpointed segment:
//              its input is held, its forward keeps nothing, it is recomputed just before
//              its backward.
//   uniform    the blocks in segments of `every_n_layers` (or ceil(blocks / segments));
//              a segment holds only its first input and is
//              re-forwarded with kKeep before its backwards (Megatron's "uniform").
//              Non-block stages keep.
//   block      the first `block_layers` blocks each checkpointed alone; the rest keep
//              (Megatron's "block").
//   sqrt       segments of round(sqrt(n)) stages over the whole chain (Chen et al. 2016).
//   selective  every block kSelective with the op policy of `selective_ops` (default: core
//              attention, Korthikanti et al.); non-block stages keep.
//   optimal    the Rotor dynamic program (Beaumont et al. 2019) over the chain, with
//              per-stage options keep / selective / checkpoint (Rockmate), minimising
//              compute time subject to the predicted activation peak <= the budget. The
//              result is also compared with every standard plan that fits the budget and the
//              fastest is kept, so optimal is never slower than uniform or sqrt at the same
//              memory. A budget below the minimum feasible one throws InvalidArgument
//              stating that minimum.
//
// Note [Offload placement]
// With offload on (activation_checkpointing.cpu_checkpointing), held inputs may live on the
// host (Note [Offload semantics] in checkpoint/offload_plan.h).
//   standard policies  every hold that can be offloaded (save != kKeep, stage > 0, input
//                      bytes > 0) goes to the host except the last `keep_last_on_device` of
//                      them in op order, which backward reads first (place_offload).
//   optimal            the Rotor program gains a host option for each hold: it frees the
//                      hold's device bytes for the rest of the subproblem and costs the copy
//                      time that the neighbouring compute cannot hide (docs/offload.md).
//                      keep_last_on_device does not constrain it; the program decides.
//                      make_plan keeps the fastest (simulated compute + exposed copy time)
//                      of its result, the device-only program's and every standard plan on
//                      device and offloaded, among those that fit the budget.
// The plan carries the layout the stash runs (Plan::offload, made by plan_layout): its
// contiguity is OffloadOptions::contiguous, with offload on or off, so that a stash built
// from the same config (offload::StashOptions) adopts it.
// The plan's prediction then includes staging bytes, pinned bytes and, when the costs have
// times and the link bandwidth is known, the exposed copy time per stage.
//
// Note [Partition placement]
// With activation_checkpointing.partition_activations under tensor parallelism (t =
// PartitionOptions::ways > 1, the held checkpoints replicated across the tp group), a held
// input may be kept as this rank's 1/t slice and all-gathered before it is read (Note
// [Partition semantics] in checkpoint/offload_plan.h). A hold is partitionable when its
// stage is > 0 and its input has at least partition_min_bytes (partitionable()).
//   standard policies  after place_offload, every partitionable hold (save != kKeep, the
//                      first hold of its input), device or host, is partitioned
//                      (place_partition): a device hold then costs slice_bytes on the device
//                      until its gathered copy is fetched, a host hold copies only the slice.
//   optimal            the Rotor program chooses, for each hold, among these placements:
//                        device        a_i whole on the device;
//                        partitioned   only the slice on the device (partitionable holds);
//                        host          with offload on: on the host, as its slice when the
//                                      hold is partitionable, else whole.
//                      The program charges a partitioned hold its slice for the rest of the
//                      subproblem and the gathered copy where it is read, and the gather time
//                      that the backwards before the read cannot hide (docs/offload.md,
//                      "Partitioned checkpoints").
//                      Each result is simulated and retried below the budget like the offload
//                      results (Note [Plan search] in planner.cc). make_plan keeps the fastest
//                      that fits among it, the results of the program without partitioning
//                      (device only, and with offload: host holds whole) and every standard
//                      plan with and without partitioning (and offload), so a plan with
//                      partitioning on is never predicted slower, nor over the budget, where
//                      one without fits. With analytic costs (no times) a gather costs
//                      nothing to the program and ties go to the whole device hold, so holds
//                      are partitioned where that saves recompute.
// The prediction's bytes are per rank, every rank of the group planning the same schedule.
#pragma once

#include <cstddef>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/costs.h"
#include "checkpoint/offload_plan.h"
#include "checkpoint/rotor.h"
#include "checkpoint/schedule.h"
#include "checkpoint/simulate.h"
#include "config/config.h"
#include "nn/ctx.h"

namespace porter::checkpoint {

// Where a stage's held input lives: kPartitioned is this rank's 1/t slice on the device; a
// partitioned host hold is kHost with StagePlan::partitioned.
enum class Where : uint8_t { kDevice, kPartitioned, kHost };
std::string_view where_name(Where w);  // "device", "partitioned", "host"

// The per-stage summary of a plan, for reports.
struct StagePlan {
  std::string name;
  // "keep", "selective" or "checkpoint": the save option of the stage's first forward.
  std::string action;
  bool holds_input = false;  // its input is stored as a checkpoint
  int forwards = 1;          // forward runs per micro-batch (recomputes included)
  Where where = Where::kDevice;
  bool partitioned = false;     // held as 1/t slices across the tp group (device or host)
  double exposed_copy_s = 0.0;  // predicted compute-stream wait for its copies (timed only)
  double exposed_gather_s = 0.0;  // the same for its gathers (gather-timed only)
};

struct Plan {
  config::CheckpointPolicy policy = config::CheckpointPolicy::kNone;
  Schedule schedule;
  std::vector<StagePlan> stages;
  nn::OpPolicy selective_policy = nn::OpPolicy::selective_attention();
  std::optional<size_t> budget_bytes;  // optimal: the resolved budget
  Prediction prediction;
  std::string description;             // one line, e.g. "uniform: 3 segments of 4 blocks"
  SimOptions sim;                      // what the prediction assumed (depth, links, ways)
  OffloadLayout offload;               // no entries without host or partitioned holds;
                                       // contiguous as planned
};

struct OffloadOptions {
  bool enabled = false;         // activation_checkpointing.cpu_checkpointing
  int prefetch_depth = 1;       // porter.checkpointing.prefetch_depth
  int keep_last_on_device = 1;  // porter.checkpointing.keep_last_on_device
  bool contiguous = false;      // activation_checkpointing.contiguous_memory_optimization
  double link_bytes_per_s = 0;  // each direction: measured, or sim_link_gbps; 0 unknown
  SimOptions sim() const { return {prefetch_depth, link_bytes_per_s}; }
};

// Note [Partition placement].
struct PartitionOptions {
  // t when activation_checkpointing.partition_activations is on and the held checkpoints are
  // replicated across the tensor-parallel group of t ranks (porter.model.tensor_parallel,
  // without sequence_parallel); else 1: nothing is partitioned.
  int ways = 1;
  // porter.checkpointing.partition_min_bytes: a hold whose input is smaller stays whole.
  size_t min_bytes = 65536;
  // The tp link's bandwidth, for the gathers' time (porter.comm.sim_tp_gbps or measured);
  // 0 unknown: gathers are not timed.
  double tp_bytes_per_s = 0;
  bool enabled() const { return ways > 1; }
};

struct PlanOptions {
  config::CheckpointingConfig checkpointing;
  // Overrides checkpointing.memory_budget (porter plan --budget); optimal only.
  std::optional<config::MemoryBudget> budget;
  OffloadOptions offload;
  PartitionOptions partition;
};

// The OpPolicy of `selective_ops` (op kind names recomputed; empty: core attention).
nn::OpPolicy selective_policy(const std::vector<std::string>& selective_ops);

// What make_plan hears while it solves the optimal program (Note [Plan progress] in
// planner.cc): the solve's number (1, 2, ...: the searches solve several times) and the
// fraction of its table filled, a few dozen times per solve.
struct PlanProgress {
  int solve = 1;
  double fraction = 0.0;
};
using PlanProgressFn = std::function<void(const PlanProgress&)>;

// Builds the plan for the options' policy. Throws InvalidArgument for a policy that does
// not apply to the chain (e.g. block_layers > blocks), an infeasible budget, or byte figures
// whose sums would not fit 64 bits (Note [Checked sizes] in base/checked.h). `progress`, when
// given, hears the optimal policy's solves.
Plan make_plan(const PlanOptions& options, const ChainCosts& costs,
               const PlanProgressFn& progress = {});

// The smallest activation peak any schedule the optimal planner considers can reach (with
// host holds when `offload` is enabled, partitioned ones when `partition` is): a bisection of
// schedule_rotor's budget below the lowest standard peak (Note [Plan search] in planner.cc).
size_t minimum_budget_bytes(const ChainCosts& costs, const OffloadOptions& offload = {},
                            const PartitionOptions& partition = {});

// The layout make_plan gives `schedule`'s host and partitioned holds: layout_offload at the
// offload options' prefetch depth and contiguity and the partition's ways; with offload off
// and no partitioned hold, no entries and only the contiguity.
OffloadLayout plan_layout(const Schedule& schedule, const ChainCosts& costs,
                          const OffloadOptions& offload, const PartitionOptions& partition = {});

// simulate() of `schedule` as make_plan predicts it (its plan_layout, the links).
Prediction predict(const Schedule& schedule, const ChainCosts& costs,
                   const OffloadOptions& offload, const PartitionOptions& partition = {});

// A budget as bytes: fractions are of the `none` plan's predicted peak.
size_t resolve_budget(const config::MemoryBudget& budget, const ChainCosts& costs);

// The schedules of the standard policies, for tests and benchmarks.
Schedule schedule_none(const ChainCosts& costs);
Schedule schedule_full(const ChainCosts& costs);
// Segments of `blocks_per_segment` blocks (non-block stages keep).
Schedule schedule_uniform(const ChainCosts& costs, int blocks_per_segment);
Schedule schedule_block(const ChainCosts& costs, int checkpointed_blocks);
Schedule schedule_sqrt(const ChainCosts& costs);
Schedule schedule_selective(const ChainCosts& costs);
// The Rotor/Rockmate DP (checkpoint/rotor.h) without the comparison with standard plans,
// retried below the budget until its result fits under the simulator (Note [Plan search] in
// planner.cc); nullopt when nothing fits. With `offload.enabled` it also chooses host holds
// (Note [Offload placement]), with `partition.enabled()` partitioned ones (Note [Partition
// placement]); its result then fits `budget_bytes` under predict(..., offload, partition).
std::optional<Schedule> schedule_rotor(const ChainCosts& costs, size_t budget_bytes,
                                       const OffloadOptions& offload = {},
                                       const PartitionOptions& partition = {},
                                       const PlanProgressFn& progress = {});

// Marks host holds on a standard policy's schedule (Note [Offload placement]).
void place_offload(Schedule& schedule, const ChainCosts& costs, int keep_last_on_device);
// Marks partitioned holds on a standard policy's schedule (Note [Partition placement]): every
// first hold with save != kKeep whose stage is partitionable, when partition.ways > 1 (with
// ways 1, clears every mark). Device and host holds alike.
void place_partition(Schedule& schedule, const ChainCosts& costs, const PartitionOptions& partition);

// The per-stage summary of any schedule; exposed copy times from `prediction` when given.
std::vector<StagePlan> summarize(const Schedule& schedule, const ChainCosts& costs,
                                 const Prediction* prediction = nullptr);

}  // namespace porter::checkpoint
