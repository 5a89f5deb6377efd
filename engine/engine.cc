// The Engine: construction (model states, the plan) and one training step as a sequence of
// phases (Note [One engine step] in engine.h). The costs the plan is made from (profiling,
// agreement, probes) are in costs.cc, stage 3's driver in stage3.cc, the statistics in
// stats.cc, the wall-clock breakdown in wall_clock.cc, evaluation in evaluate.cc, the host
// copies of parameters and gradients in params.cc, the micro-batches' checks and upload in
// batches.cc, the memory report in memory_report.cc, training checkpoints in state.cc, the
// schedule executor in executor.cc, train_step and the step API in step.cc, the optimizer's phases in zero/sharded_optimizer.cc.
#include "engine/engine.h"

#include <algorithm>
#include <chrono>

#include "base/check.h"
#include "base/error.h"
#include "engine/comm_trace.h"
#include "engine/engine_impl.h"
#include "engine/executor.h"
#include "engine/offload_trace.h"
#include "engine/stage3.h"
#include "engine/wall_clock.h"
#include "zero/buckets.h"

namespace porter::engine {

using Clock = std::chrono::steady_clock;

comm::ProcessGroups data_parallel(std::shared_ptr<comm::Communicator> dp) {
  comm::ProcessGroups g;
  if (dp != nullptr) {
    g.dp_rank = dp->rank();
    g.dp_size = dp->size();
  }
  g.world = dp;
  g.dp = std::move(dp);
  return g;
}

Engine::Engine(memory::Device& device, std::unique_ptr<Model> model, const config::Config& config,
               const comm::ProcessGroups& groups)
    : device_(&device), config_(config), run_(make_run_options(config)) {
  PORTER_CHECK(model != nullptr, "Engine: the model is null");
  const std::shared_ptr<comm::Communicator>& dp = groups.dp;
  const std::shared_ptr<comm::Communicator>& tp = groups.tp;
  check_supported(config, dp != nullptr ? dp->size() : 1, tp != nullptr ? tp->size() : 1);
  model->check_config(config);  // Note [Model capabilities]
  allocator_ = std::make_unique<memory::CachingAllocator>(device, run_.allocator);
  kernels_ = kernels::make_kernels(*allocator_);
  // Before anything runs a kernel (the profile below does): Note [Kernel table].
  kernels_->kernel_table().set_mode(run_.kernel_choice);
  if (run_.kernel_table_path) {
    const int world_rank = (dp != nullptr ? dp->rank() : 0) * (tp != nullptr ? tp->size() : 1) +
                           (tp != nullptr ? tp->rank() : 0);
    kernels_->kernel_table().pin(read_kernel_table(*run_.kernel_table_path, world_rank),
                                 "pinned from " + *run_.kernel_table_path);
  }
  model_ = std::move(model);
  impl_ = std::make_unique<Impl>();
  Impl& im = *impl_;
  // Offload (docs/engine.md, Offload): the pool within porter.device.pinned_limit (0: the
  // device's pinned capacity) and the stash, whose streams exist whether or not the plan
  // holds anything on the host (set_plan may bring host holds later).
  im.tp = tp;
  run_.stash.tp = im.tp_comm();  // partitioned checkpoints are gathered over it
  im.pinned = std::make_unique<memory::PinnedPool>(device, run_.pinned_limit_bytes);
  im.host = std::make_unique<memory::PinnedHostTier>(*im.pinned);
  im.stash = std::make_unique<offload::CheckpointStash>(*allocator_, *im.host, run_.stash);
  im.lr = std::make_unique<LrSchedule>(run_.optimizer.adamw.lr, run_.scheduler);
  im.dp = dp;
  build_model_states();
  im.ctx = std::make_unique<nn::Ctx>(*kernels_, *allocator_, run_.compute_dtype);
  im.ctx->set_tensor_parallel(im.tp_comm());
  plan_from_costs();
  allocator_->reset_peak();
}

Engine::~Engine() = default;

// Model states (Note [Model-state bytes per rank] in zero/partition.h): params in the compute
// dtype over the padded buffer, f32 grads (the full buffer at stages 0 and 1, the shard at
// stage 2; the reducer owns them), the optimizer's state over its range (the optimizer).
void Engine::build_model_states() {
  Impl& im = *impl_;
  const int zero_stage = run_.zero_stage();
  const nn::ParamLayout& layout = model_->layout();
  im.part = zero::make_partition(layout.total_elems(), im.dp != nullptr ? im.dp->size() : 1);
  // Stage 3 keeps no full parameter buffer: the optimizer owns the working shard and the
  // gatherer binds each stage to its gathered buffer (Note [Stage 3 gather]).
  im.flat = std::make_unique<nn::FlatParams>(*allocator_, layout, run_.compute_dtype,
                                             run_.grad_dtype, im.part.padded_elems,
                                             zero_stage < 2, zero_stage < 3);
  im.optimizer = std::make_unique<zero::ShardedOptimizer>(
      *im.flat, *kernels_, *allocator_, im.comm(), im.part, run_.optimizer, im.host.get());
  if (im.tp_comm() != nullptr) {
    const std::vector<bool> replicated = model_->tp_replicated();
    PORTER_CHECK(replicated.size() == layout.entries().size(), "Engine: a tensor-parallel run "
                 "needs a model that says which parameters are replicated (Model::tp_replicated)");
    im.optimizer->set_tensor_parallel(im.tp_comm(), replicated_ranges(layout, replicated));
  }
  std::vector<zero::StageParams> stages;
  std::vector<std::vector<int>> writers;
  for (int s = 0; s < model_->num_stages(); ++s) {
    stages.push_back({model_->stage_name(s), model_->stage(s).params()});
    writers.push_back(model_->grad_writers(s));
  }
  im.stage_layout = zero::stage_layout(layout, stages);
  const zero::StageLayout& sl = im.stage_layout;
  im.writes.assign(stages.size(), {});
  for (size_t s = 0; s < writers.size(); ++s) {
    for (int w : writers[s]) im.writes.at(static_cast<size_t>(w)).push_back(static_cast<int>(s));
  }
  Model* m = model_.get();
  nn::FlatParams* flat = im.flat.get();
  std::vector<zero::Bucket> buckets = zero::plan_buckets(sl.ranges, writers, run_.reduce_bucket_elems);
  im.comm_costs = bucket_costs(buckets, im.part, run_, model_->num_stages());
  im.reducer = std::make_unique<zero::GradReducer>(
      *im.flat, *kernels_, *allocator_, im.comm(), im.part, std::move(buckets),
      sl.entry_stage, run_.reducer, [m, flat] { m->bind(*flat); }, im.optimizer->grad_sink());
  if (im.optimizer->offloaded() && !im.reducer->streamed()) {
    // Note [Ready gradients]: each bucket's part of the shard goes to the host as it is final.
    zero::ShardedOptimizer* opt = im.optimizer.get();
    zero::GradReducer* red = im.reducer.get();
    im.reducer->set_on_ready(
        [opt, red](int64_t lo, int64_t hi) { opt->gradients_ready(red->shard(), lo, hi); });
  }
  if (zero_stage == 3) {
    Stage3Layout s3 = stage3_layout(*model_, run_.stage3, run_.compute_dtype);
    im.param_costs = std::move(s3.costs);
    im.gatherer = std::make_unique<zero::ParamGatherer>(
        *im.flat, *allocator_, im.comm(), im.part, im.optimizer->working(), std::move(s3.units),
        im.param_costs.max_live_elems, [m, flat] { m->bind(*flat); },
        im.optimizer->param_tier());
    // Note [Stage 3 driver]: evaluation and profiling play the forward pass's gather plan.
    im.forward_gathers = Stage3Driver(
        *im.gatherer,
        checkpoint::plan_gathers(forward_schedule(model_->num_stages()), im.param_costs));
  }
  if (im.flat->grads().defined()) {
    tensor::Tensor grads = im.flat->grads();
    kernels_->fill(grads, 0.0f);
  }
  im.reducer->zero_grads();
  // The rank's range only (its shard at stage 3): no whole-model buffer on the host.
  set_params_host_range([&](int64_t begin, std::span<float> values) {
    model_->init_values_range(run_.seed, begin, values);
  });
  model_->bind(*im.flat);
}

void Engine::set_plan(const checkpoint::Plan& plan) {
  if (pending_ != nullptr) throw_step_begun("set_plan");
  PORTER_CHECK(plan.schedule.num_stages == model_->num_stages(), "set_plan: the plan's schedule has ",
               plan.schedule.num_stages, " stages, the model ", model_->num_stages());
  checkpoint::validate(plan.schedule);
  const bool host_holds = std::any_of(plan.schedule.ops.begin(), plan.schedule.ops.end(),
                                      [](const checkpoint::ScheduleOp& op) { return op.stashed(); });
  PORTER_CHECK(!host_holds || !plan.offload.empty(),
               "set_plan: the schedule holds inputs on the host or partitioned but plan.offload "
               "is empty; "
               "build it with checkpoint::layout_offload(schedule, costs, prefetch_depth) "
               "(make_plan does)");
  // Before adopting the plan: a pinned shortfall is an OutOfMemoryError naming
  // porter.device.pinned_limit, and on any failure the previous plan and layout remain.
  // Stage 3: the schedule's gathers (throws for a stage3_max_live_parameters too small).
  checkpoint::GatherPlan gathers = checkpoint::plan_gathers(plan.schedule, impl_->param_costs);
  impl_->stash->prepare(plan.offload);
  impl_->plan = plan;
  if (impl_->gatherer) impl_->train_gathers = Stage3Driver(*impl_->gatherer, std::move(gathers));
  impl_->recompute_s_per_step.clear();
}

const checkpoint::Plan& Engine::plan() const { return impl_->plan; }
const checkpoint::ChainCosts& Engine::costs() const { return impl_->costs; }

kernels::KernelTable& Engine::kernel_table() const { return kernels_->kernel_table(); }

// Phases 3 and 4 (Note [Sharded optimizer]): the global norm, overflow and clipping, then
// AdamW on the optimizer's range and the all-gather of the parameters.
zero::GradNorm Engine::update(StepResult& r) {
  Impl& im = *impl_;
  // Note [Wall-clock breakdown]: the compute stream is synchronised first, so the phase
  // starts with backward's work done.
  const bool timed = r.wall_clock.enabled;
  if (timed) device_->compute_stream().synchronize();
  const auto update_t0 = Clock::now();
  const int64_t start_us = trace_ != nullptr ? trace_->now_us() : 0;
  const int64_t start_ns = im.step_memory ? im.step_memory->now_ns() : 0;
  const tensor::Tensor& grads = im.reducer->shard();
  if (im.gatherer) im.gatherer->check();  // a failed upload fails the step here, state untouched
  const zero::GradNorm norm = im.optimizer->global_norm(grads);
  r.lr = im.lr->lr(im.optimizer->steps());
  im.optimizer->update(grads, r.lr, norm);
  if (trace_ != nullptr && im.optimizer->offloaded()) {
    // The host AdamW on its own lane (Note [Optimizer offload]). Its stats stay for record().
    const zero::OffloadStats& o = im.optimizer->offload_stats();
    if (o.update_end > o.update_begin) {
      TraceSpan span;
      span.name = "host adamw";
      span.category = "optimizer";
      span.lane = "host optimizer";
      span.start_us = trace_->to_us(o.update_begin);
      span.dur_us = trace_->to_us(o.update_end) - span.start_us;
      span.step = step_;
      trace_->span(std::move(span));
    }
  }
  // Stage 3: the persistent stages' buffers follow the updated shards.
  if (im.gatherer && !norm.overflow) im.gatherer->refresh_persistent();
  r.grad_norm = norm.norm;
  r.clip_coef = norm.clip_coef;
  r.skipped = norm.overflow;
  if (timed) {
    device_->compute_stream().synchronize();
    const double wait_ms = 1e3 * im.optimizer->offload_stats().d2h_wait_s;
    r.wall_clock.offload_wait_ms += wait_ms;
    r.wall_clock.optimizer_ms += std::max(0.0, ms_between(update_t0, Clock::now()) - wait_ms);
  }
  if (im.step_memory) im.step_memory->optimizer(start_ns, im.step_memory->now_ns());
  if (trace_ != nullptr) {
    TraceSpan span;
    span.name = "optimizer adamw";
    span.category = "optimizer";
    span.lane = "compute";
    span.start_us = start_us;
    span.dur_us = trace_->now_us() - start_us;
    span.step = step_;
    trace_->span(std::move(span));
  }
  return norm;
}

// Phase 5a: the D2H copies of holds never read back may still be running (every other copy
// was waited on by a fetch). The host waits here, once per step, so the stash's statistics
// and records are complete (docs/engine.md, Offload).
void Engine::collect_offload(StepResult& r) {
  Impl& im = *impl_;
  const auto sync_t0 = Clock::now();
  im.stash->synchronize();
  if (r.wall_clock.enabled) r.wall_clock.offload_wait_ms += ms_between(sync_t0, Clock::now());
  r.offload = im.stash->stats();
  im.offload_total.add(r.offload);
  std::vector<offload::CopyRecord> copies = im.stash->take_copies();
  std::vector<offload::WaitRecord> waits = im.stash->take_waits();
  if (im.step_memory) im.step_memory->end_step(copies);
  if (trace_ != nullptr) {
    trace_offload(*trace_, [this](int s) { return model_->stage_name(s); }, step_, copies,
                  waits);
  }
  if (!run_.keep_all_copy_records) {
    im.copies.clear();
    im.waits.clear();
  }
  im.copies.insert(im.copies.end(), copies.begin(), copies.end());
  im.waits.insert(im.waits.end(), waits.begin(), waits.end());
}

// Phase 5b: the step's collectives, all complete by now (the optimizer waited for the last),
// as spans on the comm lane (Note [Comm trace]).
void Engine::collect_comm() {
  if (comm::Communicator* tp = impl_->tp_comm()) {
    std::vector<comm::CommRecord> records = tp->take_records();
    if (trace_ != nullptr) trace_comm(*trace_, step_, records, "tp comm");
  }
  comm::Communicator* comm = impl_->comm();
  if (comm == nullptr) return;
  std::vector<comm::CommRecord> records = comm->take_records();
  if (trace_ != nullptr) trace_comm(*trace_, step_, records);
}

void Engine::set_trace(TraceRecorder* trace) {
  trace_ = trace;
  if (comm::Communicator* comm = impl_->comm()) comm->record_ops(trace != nullptr);
  if (comm::Communicator* tp = impl_->tp_comm()) tp->record_ops(trace != nullptr);
}

int Engine::dp_rank() const { return impl_->dp != nullptr ? impl_->dp->rank() : 0; }
int Engine::tp_rank() const { return impl_->tp != nullptr ? impl_->tp->rank() : 0; }
int Engine::tp_size() const { return impl_->tp != nullptr ? impl_->tp->size() : 1; }
int Engine::dp_size() const { return impl_->part.world_size; }

}  // namespace porter::engine
