// The Engine: construction (model states, costs, the plan) and one training step as a
// sequence of phases (Note [One engine step] in engine.h), evaluation and profiling. The
// memory report is in memory_report.cc, training checkpoints in state.cc, the schedule
// executor in executor.cc, the optimizer's phases in zero/sharded_optimizer.cc.
#include "engine/engine.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>

#include "base/check.h"
#include "base/error.h"
#include "engine/comm_trace.h"
#include "engine/engine_impl.h"
#include "engine/executor.h"
#include "engine/offload_trace.h"
#include "engine/stage3.h"
#include "offload/link_probe.h"
#include "zero/buckets.h"

namespace porter::engine {

namespace {

using Clock = std::chrono::steady_clock;

tensor::Tensor upload_ids(memory::CachingAllocator& alloc, const std::vector<int32_t>& ids,
                      int64_t batch, int64_t seq) {
  tensor::Tensor t = tensor::Tensor::empty(alloc, tensor::Shape{batch, seq}, tensor::DType::kI32,
                                   memory::Category::kWorkspace);
  if (!ids.empty()) alloc.device().copy_sync(t.data(), ids.data(), t.nbytes());
  return t;
}

// Of the gradient reductions' busy time, the fraction that ran while backward was still
// computing: 1 - exposed / busy, in [0, 1]; 0 when nothing was reduced.
double hidden_fraction(double busy_s, double exposed_s) {
  return busy_s > 0.0 ? std::clamp(1.0 - exposed_s / busy_s, 0.0, 1.0) : 0.0;
}

// Stage 3's gather figures (measured, and the plan's) into a step's or the run's ZeroStats.
void set_gather_stats(ZeroStats& z, const zero::GatherStats& g,
                      const checkpoint::ParamPrediction& predicted) {
  z.gathers = g.gathers;
  z.gathered_bytes = g.gathered_bytes;
  z.gather_busy_s = g.busy_s;
  z.gather_exposed_s = g.exposed_s;
  z.gather_hidden_fraction = hidden_fraction(g.busy_s, g.exposed_s);
  z.peak_live_elems = g.peak_live_elems;
  z.peak_gathered_bytes = g.peak_live_bytes;
  z.predicted_peak_live_elems = predicted.peak_live_elems;
  z.predicted_gathered_bytes = predicted.peak_gathered_bytes;
  z.persistent_bytes = predicted.persistent_bytes;
}

// The offloaded state's host bytes (Note [Host-state bytes per rank]): the optimizer's arrays,
// and the parameter shard apart when the parameters are offloaded.
void set_host_state(ZeroStats& z, const zero::ShardedOptimizer& optimizer) {
  const zero::HostStateBytes h = optimizer.host_state();
  z.param_offload_host_bytes = optimizer.params_offloaded() ? h.params : 0;
  z.offload_host_bytes = h.total() - z.param_offload_host_bytes;
}

double ms_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

// The stash's waits so far this step (Note [Wall-clock breakdown]: offload waits).
double stash_wait_ms(const offload::CheckpointStash& stash) {
  const offload::StashStats s = stash.stats();
  return 1e3 * (s.exposed_wait_s + s.gather_exposed_s);
}

void check_batches(const config::Config& c, Model& model,
                   const std::vector<io::HostBatch>& micro_batches, size_t expected_count) {
  const int64_t b = c.train_micro_batch_size_per_gpu;
  const int64_t t = c.porter.model.seq_len;
  if (expected_count > 0) {
    PORTER_CHECK(micro_batches.size() == expected_count, "train_step: ", micro_batches.size(),
                 " micro-batches, but gradient_accumulation_steps is ", expected_count,
                 "; pass one HostBatch per accumulation step");
  } else {
    PORTER_CHECK(!micro_batches.empty(), "evaluate: no micro-batches");
  }
  // Note [Model capabilities]: only a model with a vocabulary bounds the ids.
  const std::optional<int64_t> vocab = model.vocab_size();
  for (size_t i = 0; i < micro_batches.size(); ++i) {
    const io::HostBatch& mb = micro_batches[i];
    PORTER_CHECK(mb.batch == b && mb.seq == t, "micro-batch ", i, " is (", mb.batch, ", ",
                 mb.seq, "), the engine was planned for (train_micro_batch_size_per_gpu, "
                 "porter.model.seq_len) = (", b, ", ", t, ")");
    const size_t n = static_cast<size_t>(b * t);
    PORTER_CHECK(mb.tokens.size() == n && mb.targets.size() == n, "micro-batch ", i, " has ",
                 mb.tokens.size(), " tokens and ", mb.targets.size(), " targets; (", b, ", ", t,
                 ") needs ", n, " of each");
    if (!vocab) continue;
    for (size_t j = 0; j < n; ++j) {
      PORTER_CHECK(mb.tokens[j] >= 0 && mb.tokens[j] < *vocab && mb.targets[j] >= 0 &&
                       mb.targets[j] < *vocab,
                   "micro-batch ", i, " position ", j, ": token ", mb.tokens[j], " / target ",
                   mb.targets[j], " outside the vocabulary [0, ", *vocab, ")");
    }
  }
}

}  // namespace

Engine::Engine(memory::Device& device, std::unique_ptr<Model> model, const config::Config& config,
               std::shared_ptr<comm::Communicator> dp, std::shared_ptr<comm::Communicator> tp)
    : device_(&device), config_(config), run_(make_run_options(config)) {
  PORTER_CHECK(model != nullptr, "Engine: the model is null");
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
  im.tp = std::move(tp);
  run_.stash.tp = im.tp_comm();  // partitioned checkpoints are gathered over it
  im.pinned = std::make_unique<memory::PinnedPool>(device, run_.pinned_limit_bytes);
  im.stash = std::make_unique<offload::CheckpointStash>(*allocator_, *im.pinned, run_.stash);
  im.lr = std::make_unique<LrSchedule>(run_.optimizer.adamw.lr, config.scheduler);
  im.dp = std::move(dp);
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
                                             tensor::DType::kF32, im.part.padded_elems,
                                             zero_stage < 2, zero_stage < 3);
  im.optimizer = std::make_unique<zero::ShardedOptimizer>(
      *im.flat, *kernels_, *allocator_, im.comm(), im.part, run_.optimizer, im.pinned.get());
  if (im.tp_comm() != nullptr) {
    // The replicated parameters' element ranges, adjacent ones merged (the alignment padding
    // between them holds zero gradients).
    const std::vector<bool> replicated = model_->tp_replicated();
    PORTER_CHECK(replicated.size() == layout.entries().size(), "Engine: a tensor-parallel run "
                 "needs a model that says which parameters are replicated (Model::tp_replicated)");
    std::vector<std::pair<int64_t, int64_t>> ranges;
    for (size_t i = 0; i < replicated.size(); ++i) {
      if (!replicated[i]) continue;
      const nn::ParamEntry& e = layout.entries()[i];
      const int64_t end = e.offset_elems + e.shape.numel();
      const int64_t aligned = (end + nn::kParamAlignElems - 1) / nn::kParamAlignElems *
                              nn::kParamAlignElems;
      if (!ranges.empty() && ranges.back().second == e.offset_elems) {
        ranges.back().second = aligned;
      } else {
        ranges.emplace_back(e.offset_elems, aligned);
      }
    }
    im.optimizer->set_tensor_parallel(im.tp_comm(), std::move(ranges));
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
  im.reducer = std::make_unique<zero::GradReducer>(
      *im.flat, *kernels_, *allocator_, im.comm(), im.part,
      zero::plan_buckets(sl.ranges, writers, config_.zero_optimization.reduce_bucket_size_elems),
      sl.entry_stage, run_.reducer, [m, flat] { m->bind(*flat); });
  if (im.optimizer->offloaded()) {
    // Note [Ready gradients]: each bucket's part of the shard goes to the host as it is final.
    zero::ShardedOptimizer* opt = im.optimizer.get();
    zero::GradReducer* red = im.reducer.get();
    im.reducer->set_on_ready(
        [opt, red](int64_t lo, int64_t hi) { opt->gradients_ready(red->shard(), lo, hi); });
  }
  if (zero_stage == 3) {
    Stage3Layout s3 = stage3_layout(*model_, config_.zero_optimization, run_.compute_dtype);
    im.param_costs = std::move(s3.costs);
    im.gatherer = std::make_unique<zero::ParamGatherer>(
        *im.flat, *allocator_, im.comm(), im.part, im.optimizer->working(), std::move(s3.units),
        im.param_costs.max_live_elems, [m, flat] { m->bind(*flat); },
        im.optimizer->params_offloaded());
  }
  if (im.flat->grads().defined()) {
    tensor::Tensor grads = im.flat->grads();
    kernels_->fill(grads, 0.0f);
  }
  im.reducer->zero_grads();
  set_params_host(model_->init_values(run_.seed));
  model_->bind(*im.flat);
}

// Note [Engine costs] in run_options.h decides between the model's analytic costs and a
// profiling pass; Note [Link probe] gives the link bandwidth when offload is on and no link
// is simulated.
void Engine::plan_from_costs() {
  Impl& im = *impl_;
  const std::optional<checkpoint::ChainCosts> analytic = model_->analytic_costs(run_);
  if (run_.cost_source(analytic.has_value(), CostUse::kTraining) == CostSource::kAnalytic) {
    im.costs = *analytic;
  } else {
    im.costs = profile();
    agree_on_costs();
  }
  im.costs.params = im.param_costs;  // Note [Gathered parameters]: disabled below stage 3
  checkpoint::PlanOptions options = run_.plan;
  im.link_bytes_per_s = options.offload.link_bytes_per_s;  // sim_link_gbps, else 0: unknown
  if (im.link_bytes_per_s == 0.0 && options.offload.enabled) {
    size_t bytes = 0;
    for (const checkpoint::StageCost& st : im.costs.stages) bytes = std::max(bytes, st.input_bytes);
    im.link_bytes_per_s =
        offload::measure_link_bytes_per_s(*allocator_, *im.pinned, *im.stash, bytes);
    im.link_bytes_per_s = agree_bandwidth(im.link_bytes_per_s, "link probe");
  }
  options.offload.link_bytes_per_s = im.link_bytes_per_s;
  if (options.partition.ways > 1 && options.partition.tp_bytes_per_s == 0.0) {
    size_t bytes = 0;
    for (const checkpoint::StageCost& st : im.costs.stages) bytes = std::max(bytes, st.input_bytes);
    options.partition.tp_bytes_per_s =
        agree_bandwidth(measure_tp_bytes_per_s(bytes), "link probe");
  }
  im.tp_bytes_per_s = options.partition.tp_bytes_per_s;
  set_plan(checkpoint::make_plan(options, im.costs));
}

void Engine::set_plan(const checkpoint::Plan& plan) {
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
  impl_->gather_plan = std::move(gathers);
  impl_->recompute_s_per_step.clear();
}

const checkpoint::Plan& Engine::plan() const { return impl_->plan; }
const checkpoint::ChainCosts& Engine::costs() const { return impl_->costs; }

kernels::KernelTable& Engine::kernel_table() const { return kernels_->kernel_table(); }

StepResult Engine::train_step(const std::vector<io::HostBatch>& micro_batches) {
  Impl& im = *impl_;
  check_batches(config_, *model_, micro_batches,
                static_cast<size_t>(run_.gradient_accumulation_steps));
  const auto t0 = Clock::now();
  TraceSpan step_trace;
  step_trace.name = "step " + std::to_string(step_);
  step_trace.category = "step";
  step_trace.lane = "compute";
  step_trace.step = step_;
  ScopedSpan step_span(trace_, std::move(step_trace));
  begin_step();
  comm::Communicator* comm = im.comm();
  const comm::CommStats comm0 = comm != nullptr ? comm->stats() : comm::CommStats{};
  StepResult r;
  zero::GradNorm norm;
  zero::ReducerStats reduced;
  try {
    reduced = forward_backward_and_reduce(micro_batches, r);
    norm = update(r);
  } catch (const std::exception& e) {
    // Note [Comm failure]: peers must not wait out the timeout for this rank.
    if (comm != nullptr) {
      comm->abort("rank " + std::to_string(comm->rank()) + ": train_step " +
                  std::to_string(step_) + " failed: " + e.what());
    }
    if (comm::Communicator* tp = im.tp_comm(); tp != nullptr) {
      tp->abort("rank " + std::to_string(tp->rank()) + " of " + tp->group_name() +
                ": train_step " + std::to_string(step_) + " failed: " + e.what());
    }
    im.reducer->abort();
    if (im.gatherer) im.gatherer->abort();
    throw;
  }
  im.optimizer->finish_step(norm.overflow);
  collect_offload(r);
  collect_comm();
  record(micro_batches, comm0, reduced, r);
  r.time_s = std::chrono::duration<double>(Clock::now() - t0).count();
  if (!im.kernel_table_agreed) {
    agree_kernel_table();
    im.kernel_table_agreed = true;
  }
  return r;
}

// Phase 1: this step's statistics and records start empty (a failed step's are dropped).
void Engine::begin_step() {
  Impl& im = *impl_;
  im.fold_peaks(allocator_->stats());
  allocator_->reset_peak();
  if (im.step_memory) im.step_memory->begin_step(step_ + 1);
  im.stash->reset_stats();
  (void)im.stash->take_copies();
  (void)im.stash->take_waits();
  (void)im.optimizer->take_exposed_s();
  (void)im.optimizer->take_offload_stats();
  im.optimizer->begin_step();
  if (im.gatherer) (void)im.gatherer->take_stats();
  if (comm::Communicator* comm = im.comm()) (void)comm->take_records();
  if (comm::Communicator* tp = im.tp_comm()) {
    (void)tp->take_records();
    im.tp_comm0 = tp->stats();
  }
}

// Phase 2: every micro-batch through the schedule, its gradient buckets reduced as Note
// [Gradient reduction] says.
zero::ReducerStats Engine::forward_backward_and_reduce(
    const std::vector<io::HostBatch>& micro_batches, StepResult& r) {
  Impl& im = *impl_;
  const double loss_scale = im.optimizer->loss_scale();
  im.reducer->zero_grads();
  model_->set_loss_scale(
      static_cast<float>(loss_scale / static_cast<double>(run_.gradient_accumulation_steps)));
  double loss_sum = 0.0;
  // Note [Wall-clock breakdown]: each op is timed from its before_op to its after_op, less
  // the stash's waits and (Backward) the reducer's work within it.
  WallClockBreakdown& wc = r.wall_clock;
  wc.enabled = config_.wall_clock_breakdown;
  memory::Stream& compute = device_->compute_stream();
  const auto now = [&compute] {
    compute.synchronize();
    return Clock::now();
  };
  struct OpClock {
    Clock::time_point start;
    double stash_wait_ms = 0.0;
    double reduce_ms = 0.0;    // the reducer's, within this op
    std::vector<int> forwards;  // per stage, this micro-batch
  } clock;
  for (size_t i = 0; i < micro_batches.size(); ++i) {
    const io::HostBatch& mb = micro_batches[i];
    tensor::Tensor tokens = upload_ids(*allocator_, mb.tokens, mb.batch, mb.seq);
    tensor::Tensor targets = upload_ids(*allocator_, mb.targets, mb.batch, mb.seq);
    zero::GradReducer* reducer = im.reducer.get();
    ExecEnv env;
    env.model = model_.get();
    env.ctx = im.ctx.get();
    env.schedule = &im.plan.schedule;
    env.selective_policy = im.plan.selective_policy;
    env.trace = trace_;
    env.step = step_;
    env.micro_batch = static_cast<int>(i);
    env.seed = run_.seed;
    env.stash = im.stash.get();
    env.before_backward = [reducer](int stage) { reducer->before_backward(stage); };
    env.after_backward = [reducer](int stage) { reducer->after_backward(stage); };
    env.memory = im.step_memory.get();
    if (zero::ParamGatherer* g = im.gatherer.get()) {
      // Note [Gather plan]: evictions, gathers and waits before the op, releases after it.
      const checkpoint::GatherPlan* gp = &im.gather_plan;
      env.before_op = [g, gp](size_t k) {
        for (int u : gp->evict[k]) g->release(u);
        for (int u : gp->issue[k]) g->gather(u);
        for (int u : gp->wait[k]) g->wait(u);
      };
      env.after_op = [g, gp](size_t k) {
        for (int u : gp->release[k]) g->release(u);
      };
    }
    if (wc.enabled) {
      offload::CheckpointStash* stash = im.stash.get();
      const checkpoint::Schedule* schedule = &im.plan.schedule;
      clock.forwards.assign(static_cast<size_t>(model_->num_stages()), 0);
      env.after_backward = [reducer, &clock, &now](int stage) {
        const auto t0 = now();
        reducer->after_backward(stage);
        clock.reduce_ms += ms_between(t0, now());
      };
      env.before_op = [inner = std::move(env.before_op), stash, &clock, &now](size_t k) {
        clock.start = now();
        clock.stash_wait_ms = stash_wait_ms(*stash);
        clock.reduce_ms = 0.0;
        if (inner) inner(k);
      };
      env.after_op = [inner = std::move(env.after_op), stash, schedule, &clock, &wc,
                      &now](size_t k) {
        if (inner) inner(k);
        const double op_ms = ms_between(clock.start, now());
        const double wait_ms = stash_wait_ms(*stash) - clock.stash_wait_ms;
        const checkpoint::ScheduleOp& op = schedule->ops[k];
        const double work_ms = std::max(0.0, op_ms - wait_ms - clock.reduce_ms);
        wc.offload_wait_ms += wait_ms;
        wc.reduce_ms += clock.reduce_ms;
        if (op.kind == checkpoint::ScheduleOp::Kind::kBackward) {
          wc.backward_inner_ms += work_ms;
        } else if (op.kind == checkpoint::ScheduleOp::Kind::kForward &&
                   clock.forwards[static_cast<size_t>(op.stage)]++ == 0) {
          wc.forward_ms += work_ms;
        } else {  // Recompute, or a repeated forward (as the executor counts recompute_s)
          wc.recompute_ms += work_ms;
        }
      };
    }
    reducer->begin_micro_batch(i + 1 == micro_batches.size());
    const MicroBatchResult mr = run_schedule(env, tokens, targets);
    const auto reduce_t0 = wc.enabled ? now() : Clock::time_point{};
    reducer->end_micro_batch();
    if (wc.enabled) wc.reduce_ms += ms_between(reduce_t0, now());
    loss_sum += mr.loss;
    r.recompute_s += mr.recompute_s;
  }
  r.loss = loss_sum / static_cast<double>(micro_batches.size());
  return im.reducer->take_stats();
}

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

// Phase 5c: the step's figures, and the running totals.
void Engine::record(const std::vector<io::HostBatch>& micro_batches, const comm::CommStats& comm0,
                    const zero::ReducerStats& reduced, StepResult& r) {
  Impl& im = *impl_;
  ++step_;
  last_batches_ = micro_batches;
  const memory::MemoryStats s = allocator_->stats();
  r.step = step_;
  ZeroStats& z = r.zero;
  z.zero_stage = run_.zero_stage();
  z.world_size = im.part.world_size;
  z.shard_elems = im.part.shard_elems;
  z.padded_elems = im.part.padded_elems;
  if (comm::Communicator* comm = im.comm()) {
    const comm::CommStats comm1 = comm->stats();
    z.comm_bytes = comm1.payload_bytes - comm0.payload_bytes;
    z.comm_busy_s = comm1.busy_s - comm0.busy_s;
  }
  z.comm_exposed_s = im.optimizer->take_exposed_s() + reduced.reduce_exposed_s;
  z.reduce_hidden_fraction = hidden_fraction(reduced.reduce_busy_s, reduced.reduce_exposed_s);
  z.loss_scale = im.optimizer->loss_scale();
  z.skipped_steps = r.skipped ? 1 : 0;
  if (im.optimizer->offloaded() || im.optimizer->params_offloaded()) {
    const zero::OffloadStats o = im.optimizer->take_offload_stats();
    z.param_offload_d2h_bytes = o.param_d2h_bytes;
    im.zero_total.param_offload_d2h_bytes += o.param_d2h_bytes;
    z.offload_d2h_bytes = o.d2h_bytes;
    z.offload_d2h_overlapped_bytes = o.d2h_overlapped_bytes;
    z.offload_d2h_wait_s = o.d2h_wait_s;
    z.offload_h2d_bytes = o.h2d_bytes;
    z.offload_cpu_update_s = o.cpu_update_s;
    z.offload_exposed_s = o.exposed_s;
    ZeroStats& ot = im.zero_total;
    ot.offload_d2h_bytes += o.d2h_bytes;
    ot.offload_d2h_overlapped_bytes += o.d2h_overlapped_bytes;
    ot.offload_d2h_wait_s += o.d2h_wait_s;
    ot.offload_h2d_bytes += o.h2d_bytes;
    ot.offload_cpu_update_s += o.cpu_update_s;
    ot.offload_exposed_s += o.exposed_s;
  }
  set_host_state(z, *im.optimizer);
  if (im.gatherer) {
    const zero::GatherStats g = im.gatherer->take_stats();
    z.param_offload_h2d_bytes = g.h2d_bytes;
    im.zero_total.param_offload_h2d_bytes += g.h2d_bytes;
    set_gather_stats(z, g, im.plan.prediction.params);
    z.comm_exposed_s += g.exposed_s;
    zero::GatherStats& gt = im.gather_total;
    gt.gathers += g.gathers;
    gt.gathered_bytes += g.gathered_bytes;
    gt.h2d_bytes += g.h2d_bytes;
    gt.busy_s += g.busy_s;
    gt.exposed_s += g.exposed_s;
    gt.peak_live_elems = std::max(gt.peak_live_elems, g.peak_live_elems);
    gt.peak_live_bytes = std::max(gt.peak_live_bytes, g.peak_live_bytes);
  }
  ZeroStats& t = im.zero_total;
  t.comm_bytes += z.comm_bytes;
  t.comm_busy_s += z.comm_busy_s;
  t.comm_exposed_s += z.comm_exposed_s;
  t.skipped_steps += z.skipped_steps;
  im.reduce_busy_total_s += reduced.reduce_busy_s;
  im.reduce_exposed_total_s += reduced.reduce_exposed_s;
  TensorParallelStats& tps = r.tensor_parallel;
  tps.tp = tp_size();
  tps.sequence_parallel = config_.porter.model.sequence_parallel && tps.tp > 1;
  if (comm::Communicator* tp = im.tp_comm()) {
    const comm::CommStats tp1 = tp->stats();
    tps.comm_bytes = tp1.payload_bytes - im.tp_comm0.payload_bytes;
    tps.comm_busy_s = tp1.busy_s - im.tp_comm0.busy_s;
  }
  tps.gathers = r.offload.gathers;
  tps.gathered_bytes = r.offload.gathered_bytes;
  tps.gather_busy_s = r.offload.gather_busy_s;
  tps.gather_exposed_s = r.offload.gather_exposed_s;
  tps.hidden_fraction = hidden_fraction(tps.gather_busy_s, tps.gather_exposed_s);
  tps.partitioned_bytes = r.offload.slice_peak_bytes;
  tps.predicted_partitioned_bytes = im.plan.prediction.offload.peak_slice_bytes;
  TensorParallelStats& tpt = im.tp_total;
  tpt.tp = tps.tp;
  tpt.sequence_parallel = tps.sequence_parallel;
  tpt.comm_bytes += tps.comm_bytes;
  tpt.comm_busy_s += tps.comm_busy_s;
  tpt.gathers += tps.gathers;
  tpt.gathered_bytes += tps.gathered_bytes;
  tpt.gather_busy_s += tps.gather_busy_s;
  tpt.gather_exposed_s += tps.gather_exposed_s;
  tpt.hidden_fraction = hidden_fraction(tpt.gather_busy_s, tpt.gather_exposed_s);
  tpt.partitioned_bytes = std::max(tpt.partitioned_bytes, tps.partitioned_bytes);
  tpt.predicted_partitioned_bytes = tps.predicted_partitioned_bytes;
  r.tokens = static_cast<int64_t>(micro_batches.size()) * micro_batches[0].batch *
             micro_batches[0].seq;
  r.peak_activation_bytes = s.peak_activation_bytes;
  r.peak_bytes = s.peak_requested_bytes;
  im.recompute_s_per_step.push_back(r.recompute_s);
}

double Engine::evaluate(const std::vector<io::HostBatch>& micro_batches) {
  Impl& im = *impl_;
  check_batches(config_, *model_, micro_batches, 0);
  const int n = model_->num_stages();
  double sum = 0.0;
  struct TargetsGuard {
    Model& m;
    ~TargetsGuard() { m.set_targets(tensor::Tensor()); }
  } guard{*model_};
  // Stage 3: each stage's units are gathered before its forward and released once the next
  // stage does not read them; nothing stays gathered however evaluate ends.
  zero::ParamGatherer* g = im.gatherer.get();
  struct GatherGuard {
    zero::ParamGatherer* g;
    ~GatherGuard() {
      if (g != nullptr) g->abort();
    }
  } gather_guard{g};
  auto reads = [&](int s) -> const std::vector<int>& { return im.param_costs.reads[static_cast<size_t>(s)]; };
  for (size_t i = 0; i < micro_batches.size(); ++i) {
    const io::HostBatch& mb = micro_batches[i];
    tensor::Tensor x = upload_ids(*allocator_, mb.tokens, mb.batch, mb.seq);
    tensor::Tensor targets = upload_ids(*allocator_, mb.targets, mb.batch, mb.seq);
    im.ctx->set_run({run_.seed, static_cast<uint64_t>(step_), static_cast<uint32_t>(i),
                     static_cast<int64_t>(mb.batch), static_cast<int64_t>(mb.seq),
                     /*eval=*/true});
    for (int s = 0; s < n; ++s) {
      if (g != nullptr) {
        for (int u : reads(s)) {
          if (!g->unit(u).persistent && g->unit(u).elems() > 0 && !g->live(u)) g->gather(u);
        }
        for (int u : reads(s)) {
          if (g->live(u)) g->wait(u);
        }
      }
      nn::Tape tape;  // a checkpointed forward keeps nothing; dropped at once
      if (s == n - 1) model_->set_targets(targets);
      x = nn::forward_stage(*im.ctx, model_->stage(s), s, tape, nn::SaveMode::kCheckpoint, x);
      if (g != nullptr) {
        for (int u : reads(s)) {
          const bool next = s + 1 < n && std::find(reads(s + 1).begin(), reads(s + 1).end(), u) !=
                                             reads(s + 1).end();
          if (!g->unit(u).persistent && g->live(u) && !next) g->release(u);
        }
      }
    }
    sum += static_cast<double>(tensor::to_host_f32(*device_, x).at(0));
  }
  return sum / static_cast<double>(micro_batches.size());
}

void Engine::set_params_host(const std::vector<float>& values) {
  Impl& im = *impl_;
  const int64_t p = model_->layout().total_elems();
  PORTER_CHECK(static_cast<int64_t>(values.size()) == p, "set_params_host: ", values.size(),
               " values for a layout of ", p, " elements (padding included)");
  // Note [Flat partition]: the tail past the layout is zero.
  std::vector<float> padded = values;
  padded.resize(static_cast<size_t>(im.part.padded_elems), 0.0f);
  im.optimizer->set_params(padded);
  if (im.gatherer) im.gatherer->refresh_persistent();  // a collective at stage 3
}

checkpoint::ChainCosts Engine::profile() {
  Impl& im = *impl_;
  im.fold_peaks(allocator_->stats());
  const int64_t b = run_.shape.micro_batch;
  const int64_t t = run_.shape.seq;
  const int64_t vocab =
      std::max<int64_t>(1, model_->vocab_size().value_or(run_.shape.model.vocab));
  io::HostBatch mb;
  mb.batch = b;
  mb.seq = t;
  for (int64_t i = 0; i < b * t; ++i) {
    mb.tokens.push_back(static_cast<int32_t>((i * 7 + 3) % vocab));
    mb.targets.push_back(static_cast<int32_t>((i * 5 + 1) % vocab));
  }
  // Profiling runs real backwards: keep the gradient buffer as the last step left it. At
  // stages 2 and 3 there is none: while a stage is measured, the entries its backward writes
  // (its own and, for the head, the tied embedding's: Model::grad_writers) are bound to a
  // scratch buffer (comm) per written stage, so the pass holds one stage's gradients at a
  // time, not the whole model's.
  const bool scratch = !im.flat->grads().defined();
  tensor::Tensor grads = scratch ? tensor::Tensor() : im.flat->grads();
  const std::vector<float> saved_grads = scratch ? std::vector<float>{}
                                                 : tensor::to_host_f32(*device_, grads);
  const nn::ParamLayout& layout = model_->layout();
  const int num_stages = model_->num_stages();
  const std::vector<std::vector<int>>& writes = im.writes;
  const zero::StageLayout& sl = im.stage_layout;
  std::vector<tensor::Tensor> scratch_of(static_cast<size_t>(num_stages));  // per written stage
  auto bind_scratch = [&](int i, bool on) {
    for (int j : writes[static_cast<size_t>(i)]) {
      const zero::StageRange& r = sl.ranges[static_cast<size_t>(j)];
      tensor::Tensor& buf = scratch_of[static_cast<size_t>(j)];
      if (on && r.hi > r.lo) {
        buf = tensor::Tensor::empty(*allocator_, tensor::Shape{r.hi - r.lo}, tensor::DType::kF32,
                                memory::Category::kComm);
        kernels_->fill(buf, 0.0f);
      }
      for (size_t e = 0; e < sl.entry_stage.size(); ++e) {
        if (sl.entry_stage[e] != j) continue;
        const nn::ParamEntry& pe = layout.entries()[e];
        const int64_t off = pe.offset_elems - r.lo;
        im.flat->set_grad_view(
            e, on ? buf.slice(off, off + pe.shape.numel()).reshape(pe.shape) : tensor::Tensor());
      }
      if (!on) buf = tensor::Tensor();
    }
    model_->bind(*im.flat);
  };
  // Stage 3: each stage's units are gathered before its measurements and freed after them,
  // within stage3_max_live_parameters as the plan's gathers are.
  zero::ParamGatherer* g = im.gatherer.get();
  std::function<void(int, bool)> stage_hook;
  if (g != nullptr || scratch) {
    stage_hook = [g, &im, &bind_scratch, scratch](int s, bool begin) {
      if (scratch && begin) bind_scratch(s, true);
      if (g != nullptr) {
        for (int u : im.param_costs.reads[static_cast<size_t>(s)]) {
          if (g->unit(u).persistent || g->unit(u).elems() == 0) continue;
          if (begin) {
            g->gather(u);
            g->wait(u);
          } else {
            g->release(u);
          }
        }
      }
      if (scratch && !begin) bind_scratch(s, false);
    };
  }
  auto restore = [&] {
    if (im.gatherer) im.gatherer->release_all();
    if (scratch) {
      for (int s = 0; s < num_stages; ++s) {
        if (!writes[static_cast<size_t>(s)].empty()) bind_scratch(s, false);
      }
    } else {
      tensor::from_host_f32(*device_, saved_grads, grads);
    }
  };
  checkpoint::ChainCosts costs;
  try {
    tensor::Tensor tokens = upload_ids(*allocator_, mb.tokens, b, t);
    tensor::Tensor targets = upload_ids(*allocator_, mb.targets, b, t);
    im.ctx->set_run({run_.seed, 0, 0, static_cast<int64_t>(b), static_cast<int64_t>(t)});
    model_->set_loss_scale(1.0f / static_cast<float>(run_.gradient_accumulation_steps));
    costs = profile_chain(*model_, *im.ctx, tokens, targets, run_.selective_policy,
                          run_.selective_name, stage_hook);
  } catch (...) {
    restore();
    allocator_->reset_peak();
    throw;
  }
  restore();
  grads = tensor::Tensor();
  allocator_->reset_peak();
  // FLOPs are not measured: a model with analytic costs gives them (Note [Model
  // capabilities]).
  if (const std::optional<checkpoint::ChainCosts> a = model_->analytic_costs(run_)) {
    for (size_t i = 0; i < costs.stages.size() && i < a->stages.size(); ++i) {
      costs.stages[i].forward_flops = a->stages[i].forward_flops;
    }
  }
  return costs;
}

std::string WallClockBreakdown::format(int rank) const {
  char line[320];
  std::snprintf(line, sizeof line,
                "[Rank %d] time (ms) | fwd: %.2f | bwd: %.2f | bwd_inner: %.2f | "
                "bwd_allreduce: %.2f | step: %.2f | recompute: %.2f | offload_wait: %.2f",
                rank, forward_ms, backward_ms(), backward_inner_ms, reduce_ms, optimizer_ms,
                recompute_ms, offload_wait_ms);
  return line;
}

int Engine::dp_rank() const { return impl_->dp != nullptr ? impl_->dp->rank() : 0; }
int Engine::tp_rank() const { return impl_->tp != nullptr ? impl_->tp->rank() : 0; }
int Engine::tp_size() const { return impl_->tp != nullptr ? impl_->tp->size() : 1; }
TensorParallelStats Engine::tp_stats() const { return impl_->tp_total; }
int Engine::dp_size() const { return impl_->part.world_size; }

ZeroStats Engine::zero_stats() const {
  const Impl& im = *impl_;
  ZeroStats z = im.zero_total;
  z.zero_stage = run_.zero_stage();
  z.world_size = im.part.world_size;
  z.shard_elems = im.part.shard_elems;
  z.padded_elems = im.part.padded_elems;
  z.reduce_hidden_fraction = hidden_fraction(im.reduce_busy_total_s, im.reduce_exposed_total_s);
  z.loss_scale = im.optimizer->loss_scale();
  set_gather_stats(z, im.gather_total, im.plan.prediction.params);
  set_host_state(z, *im.optimizer);
  return z;
}

std::vector<float> Engine::params_host() const {
  const Impl& im = *impl_;
  const int64_t p = model_->layout().total_elems();
  if (!im.gatherer) return tensor::to_host_f32(*device_, im.flat->params().slice(0, p));
  // Stage 3: the shards, all-gathered (every rank calls this).
  const tensor::Tensor& shard = im.optimizer->working();
  tensor::Tensor all = tensor::Tensor::empty(*allocator_, tensor::Shape{im.part.padded_elems}, shard.dtype(),
                                     memory::Category::kWorkspace);
  if (comm::Communicator* dp = im.comm()) {
    const comm::CommLabel label(dp, "params");
    dp->all_gather(shard.data(), all.data(), static_cast<size_t>(im.part.shard_elems),
                   nn::comm_type(shard.dtype())).wait_on(device_->compute_stream());
  } else {
    device_->copy_sync(all.data(), shard.data(), shard.nbytes());
  }
  return tensor::to_host_f32(*device_, all.slice(0, p));
}

// Stage 0: the whole (reduced) buffer. Stages 1 and 2: the rank's shard, zero elsewhere (with
// one rank the shard is the whole buffer).
std::vector<float> Engine::grads_host() const {
  const Impl& im = *impl_;
  const int64_t p = model_->layout().total_elems();
  if (run_.zero_stage() == 0) return tensor::to_host_f32(*device_, im.flat->grads().slice(0, p));
  std::vector<float> out(static_cast<size_t>(p), 0.0f);
  const std::vector<float> shard = tensor::to_host_f32(*device_, im.reducer->shard());
  const int64_t lo = im.optimizer->begin();
  for (int64_t i = 0; i < static_cast<int64_t>(shard.size()) && lo + i < p; ++i) {
    out[static_cast<size_t>(lo + i)] = shard[static_cast<size_t>(i)];
  }
  return out;
}

void Engine::reset_peaks() {
  impl_->peak_by_category.fill(0);
  impl_->peak_requested_bytes = 0;
  impl_->peak_activation_bytes = 0;
  impl_->offload_total = offload::StashStats{};
  impl_->zero_total = ZeroStats{};
  impl_->gather_total = zero::GatherStats{};
  impl_->tp_total = TensorParallelStats{};
  impl_->reduce_busy_total_s = 0.0;
  impl_->reduce_exposed_total_s = 0.0;
  impl_->stash->reset_stats();
  allocator_->reset_peak();
}

void Engine::record_step_memory(bool on) {
  Impl& im = *impl_;
  if (!on) {
    im.step_memory.reset();
  } else if (!im.step_memory) {
    im.step_memory = std::make_unique<StepMemoryRecorder>(*allocator_, *im.pinned);
  }
}

const StepMemory* Engine::last_step_memory() const {
  return impl_->step_memory ? impl_->step_memory->last() : nullptr;
}

offload::StashStats Engine::offload_stats() const { return impl_->offload_total; }
const std::vector<offload::CopyRecord>& Engine::last_copies() const { return impl_->copies; }
const std::vector<offload::WaitRecord>& Engine::last_waits() const { return impl_->waits; }
double Engine::link_bytes_per_s() const { return impl_->link_bytes_per_s; }
memory::PinnedPool& Engine::pinned_pool() { return *impl_->pinned; }

}  // namespace porter::engine
