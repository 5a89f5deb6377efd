// The checkpoint planner: turns a policy from the config (none, full, uniform, block, sqrt,
// selective, optimal) and a chain's costs into a Plan: the schedule the engine runs, a
// per-stage summary, and the predicted peak and recompute time.
//
// Note [Policies]
// Stage granularity: the embedding, each block and the head of the GPT (any Layer of a
// user chain). "Blocks" are the stages with StageCost::is_block (a user chain's stages are
// all blocks).
//   none       every stage kKeep.
//   full       every stage (embedding and head included) is its own checkpointed segment:
//              its input is held, its forward keeps nothing, it is recomputed just before
//              its backward.
//   uniform    the blocks in segments of `every_n_layers` (or ceil(blocks /
//              number_checkpoints)); a segment holds only its first input and is
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
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/costs.h"
#include "checkpoint/schedule.h"
#include "config/config.h"
#include "nn/ctx.h"

namespace porter::checkpoint {

// Where a stage's held input lives. Only kDevice exists until the offload issue.
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
};

struct Plan {
  config::CheckpointPolicy policy = config::CheckpointPolicy::kNone;
  Schedule schedule;
  std::vector<StagePlan> stages;
  nn::OpPolicy selective_policy = nn::OpPolicy::selective_attention();
  std::optional<size_t> budget_bytes;  // optimal: the resolved budget
  Prediction prediction;
  std::string description;             // one line, e.g. "uniform: 3 segments of 4 blocks"
};

struct PlanOptions {
  config::CheckpointingConfig checkpointing;
  std::optional<int64_t> number_checkpoints;  // activation_checkpointing.number_checkpoints
  // Overrides checkpointing.memory_budget (porter plan --budget); optimal only.
  std::optional<config::MemoryBudget> budget;
};

// The OpPolicy of `selective_ops` (op kind names recomputed; empty: core attention).
nn::OpPolicy selective_policy(const std::vector<std::string>& selective_ops);

// Builds the plan for the options' policy. Throws InvalidArgument for a policy that does
// not apply to the chain (e.g. block_layers > blocks) or an infeasible budget.
Plan make_plan(const PlanOptions& options, const ChainCosts& costs);

// The smallest activation peak any schedule the optimal planner considers can reach.
size_t minimum_budget_bytes(const ChainCosts& costs);

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
// The Rotor/Rockmate DP alone (without the comparison with standard plans); nullopt when
// nothing fits.
std::optional<Schedule> schedule_rotor(const ChainCosts& costs, size_t budget_bytes);

// The per-stage summary of any schedule.
std::vector<StagePlan> summarize(const Schedule& schedule, const ChainCosts& costs);

}  // namespace porter::checkpoint
