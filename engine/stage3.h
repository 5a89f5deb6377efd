// ZeRO stage 3 in the engine: each model's gather units (each stage's flat parameter range,
// which stages read which units, and the knobs) for the planner (checkpoint::ParamGather,
// Note [Gathered parameters] in checkpoint/costs.h) and for the gatherer (zero::ParamUnit,
// Note [Stage 3 gather] in zero/param_gatherer.h), from one computation so the two cannot
// disagree; and the one driver that gathers them around every pass over the model.
//
// Note [Stage 3 driver]
// Every pass that runs the model at stage 3 (a training micro-batch, evaluate, profile)
// gathers parameters one way: the gather plan (Note [Gather plan] in
// checkpoint/param_gather.h) of the ops it runs, played around each op: evictions, gathers
// and waits before op k, releases after it. Training plays the plan of its schedule
// (Engine::set_plan); evaluation and profiling run each stage's forward once, in stage order,
// and play the plan of that schedule (forward_schedule), made once at construction, so that
// stage3_prefetch_bucket_size, stage3_max_live_parameters and stage3_max_reuse_distance hold
// there as in training. Profiling measures a stage between before_op and after_op, so its
// gathers (prefetches included) are never inside a measured window. Gathers move data and
// change no value: which plan a pass plays changes no result, only when bytes move and how
// many are gathered at once.
#pragma once

#include <cstddef>
#include <vector>

#include "checkpoint/costs.h"
#include "checkpoint/param_gather.h"
#include "checkpoint/schedule.h"
#include "engine/model.h"
#include "engine/run_options.h"
#include "tensor/dtype.h"
#include "zero/param_gatherer.h"

namespace porter::engine {

struct Stage3Layout {
  checkpoint::ParamGather costs;       // enabled
  std::vector<zero::ParamUnit> units;  // one per stage, in stage order
};

// Unit s is stage s's range (zero::stage_layout); stage s reads its own unit and every unit
// whose gradients it writes (Model::grad_writers: the head reads the tied embedding). A unit
// with fewer elements than stage3.persistence_threshold_elems is persistent.
Stage3Layout stage3_layout(Model& model, const Stage3Options& stage3, tensor::DType dtype);

// For planning without an Engine (porter plan, porter estimate): at ZeRO stage 3 sets
// costs.params to the built-in model's units (tp rank 0's part, which every rank's equals in
// size), as the Engine does; below stage 3 leaves the costs as they are.
void add_stage3_params(checkpoint::ChainCosts& costs, const RunOptions& run);

// The gradient reducer's comm buffers per stage (Note [Gradient buckets in the footprint] in
// checkpoint/costs.h) for `model`'s buckets (zero::plan_buckets at reduce_bucket_size) over
// dp_size data-parallel ranks, as the Engine's reducer allocates them.
std::vector<checkpoint::CommStage> bucket_costs(Model& model, const RunOptions& run, int dp_size);

// For planning without an Engine: add_stage3_params, and costs.comm from bucket_costs of the
// built-in model (tp rank 0's part) at dp_size ranks. Allocates nothing.
void add_zero_costs(checkpoint::ChainCosts& costs, const RunOptions& run, int dp_size);

// The schedule of a pass that runs each of `num_stages` stages' forward once, in order,
// keeping nothing (evaluation, profiling).
checkpoint::Schedule forward_schedule(int num_stages);

// Plays a gather plan on a gatherer (Note [Stage 3 driver]). Default-constructed (below stage
// 3) it does nothing.
class Stage3Driver {
 public:
  Stage3Driver() = default;
  Stage3Driver(zero::ParamGatherer& gatherer, checkpoint::GatherPlan plan)
      : gatherer_(&gatherer), plan_(std::move(plan)) {}
  bool active() const { return gatherer_ != nullptr; }
  // Around op k of the plan's schedule.
  void before_op(size_t k) const;
  void after_op(size_t k) const;
  const checkpoint::GatherPlan& plan() const { return plan_; }

 private:
  zero::ParamGatherer* gatherer_ = nullptr;
  checkpoint::GatherPlan plan_;
};

}  // namespace porter::engine
