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
//
// Note [Stage 3 sizing]
// Stage 3 exists to hold fewer parameter bytes than stage 2, so the gather knobs the config
// leaves out (zero_optimization.stage3_prefetch_bucket_size, stage3_max_live_parameters,
// stage3_max_reuse_distance; "auto" and null count as left out for the last two, "auto" for
// the first is the HF Trainer's 0.9 hidden^2) are sized by porter, from bytes, for the run's
// gather units and data-parallel ranks; DeepSpeed's defaults (5e7, 1e9, 1e9) would keep every
// stage of a small model gathered from its forward to its backward, more than stage 2 holds.
// With L the most elements one stage reads gathered at once (its unit, plus the tied
// embedding for the head; persistent units aside: the least max_live that runs), the padded
// parameters P, the rank's shard S (0 when offload_param keeps it on the host) and the
// persistent units' elements Q, stage 3 holds S + Q + (live gathered) elements at most, stage
// 2 holds P, so stage 3 holds less whenever live < room = P - S - Q:
//   stage3_max_reuse_distance: 0. A stage's parameters are freed after each use and gathered
//     again for its backward, unless the very next op reads them (a recompute followed by its
//     backward, the last stage's forward followed by its own backward keep them).
//   stage3_prefetch_bucket_size: L when 2L < room (the next stage's gather is issued before
//     the current stage runs, so it overlaps that stage's compute), else 0 (each gather waits;
//     only one stage fits). With stage3_max_live_parameters given: L when it is at least 2L.
//   stage3_max_live_parameters: L + prefetch (the current stage and the one being fetched);
//     DeepSpeed's 1e9 when the config gives stage3_max_reuse_distance, whose choice it then
//     leaves alone.
// The sizes are bytes only: a prefetch of one stage hides its gather when the stage computes
// for at least as long as the gather takes (the predicted step, engine/step_time.h, counts
// gathers as overlapped whenever the prefetch is not 0). A given knob is kept; when the
// gather plan of the run's schedule holds more parameter bytes per rank than stage 2 would,
// stage3_report's warning says so with both figures and names the knobs given (none given:
// the persistent stages and the largest stage, which no sizing moves; at one data-parallel
// rank, where the shard is every parameter, it warns only when a knob is given).
// The knobs move bytes only: the trained values are stage 2's, bit for bit.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/costs.h"
#include "checkpoint/param_gather.h"
#include "checkpoint/schedule.h"
#include "engine/model.h"
#include "engine/run_options.h"
#include "tensor/dtype.h"
#include "zero/buckets.h"
#include "zero/param_gatherer.h"

namespace porter::engine {

class Engine;

struct Stage3Layout {
  checkpoint::ParamGather costs;       // enabled
  std::vector<zero::ParamUnit> units;  // one per stage, in stage order
};

// Unit s is stage s's range (zero::stage_layout); stage s reads its own unit and every unit
// whose gradients it writes (Model::grad_writers: the head reads the tied embedding). A unit
// with fewer elements than stage3.persistence_threshold_elems is persistent. The knobs not
// given are sized for this model (Note [Stage 3 sizing]).
Stage3Layout stage3_layout(Model& model, const Stage3Options& stage3, tensor::DType dtype);

// Sets the knobs of `stage3` that are not given (Note [Stage 3 sizing]) for `gather`'s units
// and reads, with `padded_elems` the flat buffer's elements padded for stage3.dp_size ranks.
void size_stage3(Stage3Options& stage3, const checkpoint::ParamGather& gather, int64_t padded_elems);

// What `porter train` and `porter plan` say about stage 3's knobs (Note [Stage 3 sizing]).
struct Stage3Report {
  Stage3Options knobs;             // in effect
  int64_t largest_read_elems = 0;  // L
  int64_t peak_live_elems = 0;     // the gather plan's, over the schedule
  // Per data-parallel rank, the params category at its peak: stage 2's whole working
  // parameters, and stage 3's shard (unless offloaded), persistent units and gathered peak.
  size_t stage2_params_bytes = 0;
  size_t stage3_params_bytes = 0;
  // "stage 3 gathers: prefetch 198,912 elements (sized by porter), ...; parameters per rank
  // at peak 2.67 MB, stage 2 3.34 MB".
  std::string line() const;
  // Empty, or why stage 3 holds more than stage 2 here: both figures and the knobs given.
  std::string warning;
};
// For `model` at `run`'s ZeRO stage 3 over `schedule` (its gather plan's peak); nullopt below
// stage 3. Allocates nothing.
std::optional<Stage3Report> stage3_report(Model& model, const RunOptions& run,
                                          const checkpoint::Schedule& schedule);
// The built-in model of `run` (porter plan: pass forecast's run and plan.schedule).
std::optional<Stage3Report> stage3_report(const RunOptions& run, const checkpoint::Schedule& schedule);
// The Engine's model, options and plan (porter train).
std::optional<Stage3Report> stage3_report(Engine& engine);

// For planning without an Engine (porter plan, porter estimate): at ZeRO stage 3 sets
// costs.params to the built-in model's units (tp rank 0's part, which every rank's equals in
// size), as the Engine does; below stage 3 leaves the costs as they are.
void add_stage3_params(checkpoint::ChainCosts& costs, const RunOptions& run);

// The gradient reducer's comm buffers per stage (Note [Gradient buckets in the footprint] in
// checkpoint/costs.h) for `model`'s buckets (zero::plan_buckets at reduce_bucket_size) over
// dp_size data-parallel ranks, as the Engine's reducer allocates them.
std::vector<checkpoint::CommStage> bucket_costs(Model& model, const RunOptions& run, int dp_size);
// The same from the reducer's own buckets (the Engine's): empty when no stage holds any.
std::vector<checkpoint::CommStage> bucket_costs(const std::vector<zero::Bucket>& buckets,
                                                const zero::Partition& part,
                                                const RunOptions& run, int num_stages);

// For planning without an Engine: add_stage3_params (the knobs not given sized for dp_size
// ranks), and costs.comm from bucket_costs of the built-in model (tp rank 0's part) at dp_size
// ranks. Allocates nothing.
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
