// The Engine: flat buffers, planning, one training step (Note [One engine step] in engine.h),
// evaluation and the memory report. Training checkpoints are in state.cc, the schedule
// executor in executor.cc, profiling in profile.cc.
#include "engine/engine.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <iomanip>
#include <sstream>

#include "base/check.h"
#include "base/error.h"
#include "base/units.h"
#include "checkpoint/analytic.h"
#include "engine/engine_impl.h"
#include "engine/executor.h"

namespace porter::engine {

namespace {

using Clock = std::chrono::steady_clock;

// Note [What the engine runs]
// One device per rank; data parallelism over a dp communicator with ZeRO stages 0, 1 and 2
// (docs/zero.md). Stage 3, optimizer/parameter offload and tensor parallelism arrive with
// later issues, and until then a config asking for them is refused rather than silently run
// differently. fp16 runs with loss scaling (zero/loss_scaler.h) on both devices. Checkpoint
// offload (activation_checkpointing.cpu_checkpointing) runs (docs/engine.md, Offload). Weight
// decay is decoupled (AdamW) and applies to every parameter, biases and norms included
// (DeepSpeed applies the optimizer's weight_decay to every parameter group it builds by
// default); Adam with coupled L2 decay (adam_w_mode false) is refused when weight_decay > 0,
// because the kernel implements only the decoupled form.
void check_supported(const config::Config& c, memory::Device& device, int dp_size) {
  if (c.zero_optimization.stage == 3) {
    throw InvalidArgument(
        "zero_optimization.stage: 3 (partitioned parameters) arrives in a later issue; this "
        "engine runs stages 0, 1 and 2 (stage 2 partitions gradients and optimizer state)");
  }
  if (c.zero_optimization.stage < 0 || c.zero_optimization.stage > 3) {
    throw InvalidArgument("zero_optimization.stage: expected 0..3, got " +
                          std::to_string(c.zero_optimization.stage));
  }
  if (c.porter.model.tensor_parallel > 1) {
    throw InvalidArgument("porter.model.tensor_parallel: " +
                          std::to_string(c.porter.model.tensor_parallel) +
                          ": tensor parallelism arrives with a later issue; set it to 1");
  }
  if (c.world_size != static_cast<int64_t>(dp_size) * c.porter.model.tensor_parallel) {
    throw InvalidArgument(
        "world_size " + std::to_string(c.world_size) + " does not match the data-parallel "
        "communicator's " + std::to_string(dp_size) + " ranks times porter.model."
        "tensor_parallel " + std::to_string(c.porter.model.tensor_parallel) +
        ": parse the config with the launch's world size and pass the dp group of that world");
  }
  if (c.zero_optimization.offload_optimizer.device != config::OffloadDevice::kNone ||
      c.zero_optimization.offload_param.device != config::OffloadDevice::kNone) {
    throw InvalidArgument(
        "zero_optimization.offload_optimizer/offload_param.device: optimizer and parameter "
        "offload arrive in a later issue; set device to \"none\" "
        "(activation_checkpointing.cpu_checkpointing offloads checkpoints and runs)");
  }
  if (c.gradient_predivide_factor <= 0.0) {
    throw InvalidArgument("gradient_predivide_factor: expected > 0, got " +
                          std::to_string(c.gradient_predivide_factor));
  }
  if (c.activation_checkpointing && c.activation_checkpointing->partition_activations) {
    throw InvalidArgument(
        "activation_checkpointing.partition_activations: partitioned checkpoints need tensor "
        "parallelism, which arrives with a later issue; set it to false "
        "(cpu_checkpointing offloads whole checkpoints without it)");
  }
  const config::OptimizerConfig opt = c.optimizer.value_or(config::OptimizerConfig{});
  if (!opt.adam_w_mode && opt.weight_decay > 0.0) {
    throw InvalidArgument("optimizer.params.adam_w_mode: false with weight_decay " +
                          std::to_string(opt.weight_decay) +
                          " asks for Adam with L2 decay added to the gradient; porter's "
                          "optimizer implements decoupled decay only: set adam_w_mode to true "
                          "(AdamW) or weight_decay to 0");
  }
}

nn::Tensor upload_ids(memory::CachingAllocator& alloc, const std::vector<int32_t>& ids,
                      int64_t batch, int64_t seq) {
  nn::Tensor t = nn::Tensor::empty(alloc, nn::Shape{batch, seq}, nn::DType::kI32,
                                   memory::Category::kWorkspace);
  if (!ids.empty()) alloc.device().copy_sync(t.data(), ids.data(), t.nbytes());
  return t;
}

GptModel* as_gpt(Model& m) { return dynamic_cast<GptModel*>(&m); }

comm::ElemType elem_type(nn::DType t) {
  switch (t) {
    case nn::DType::kF32: return comm::ElemType::kF32;
    case nn::DType::kBF16: return comm::ElemType::kBF16;
    case nn::DType::kF16: return comm::ElemType::kF16;
    case nn::DType::kI32: return comm::ElemType::kI32;
  }
  return comm::ElemType::kF32;
}

// Note [Link probe]
// With offload on and no porter.device.sim_link_gbps, the planner needs the link's bandwidth
// to charge exposed copy time. The engine times copies of one buffer device -> pinned on the
// stash's D2H stream and pinned -> device on its H2D stream, best of three each (the first
// touches fresh pages), and takes the slower direction. The buffer is the largest stage input
// (a checkpoint's size, which is what offload copies), at most 16 MiB and at most the pinned
// limit: it fits wherever profiling fitted, so the probe never makes a run fail that would
// otherwise fit. Both buffers are returned before planning (the pinned cache emptied), so
// the pool starts training empty.
constexpr size_t kLinkProbeMaxBytes = size_t{16} << 20;
constexpr int kLinkProbeRuns = 3;

double measure_link_bytes_per_s(memory::CachingAllocator& alloc, memory::PinnedPool& pinned,
                                offload::CheckpointStash& stash,
                                const checkpoint::ChainCosts& costs) {
  size_t bytes = 0;
  for (const checkpoint::StageCost& st : costs.stages) bytes = std::max(bytes, st.input_bytes);
  bytes = std::min({bytes, kLinkProbeMaxBytes, pinned.stats().limit_bytes});
  if (bytes == 0) return 0.0;
  double best_s[2] = {0.0, 0.0};
  {
    memory::DeviceBuffer dev = alloc.allocate(bytes, memory::Category::kWorkspace);
    memory::PinnedBuffer host = pinned.allocate(bytes);
    std::memset(host.data(), 0, bytes);
    for (int dir = 0; dir < 2; ++dir) {
      memory::Stream& stream = dir == 0 ? stash.d2h_stream() : stash.h2d_stream();
      for (int run = 0; run < kLinkProbeRuns; ++run) {
        const auto t0 = Clock::now();
        if (dir == 0) {
          stream.copy_async(host.data(), dev.data(), bytes);
        } else {
          stream.copy_async(dev.data(), host.data(), bytes);
        }
        stream.synchronize();
        const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
        if (run == 0 || dt < best_s[dir]) best_s[dir] = dt;
      }
    }
  }
  pinned.empty_cache();
  const double slower_s = std::max({best_s[0], best_s[1], 1e-9});
  return static_cast<double>(bytes) / slower_s;
}

void add_stats(offload::StashStats& total, const offload::StashStats& s) {
  total.d2h_bytes += s.d2h_bytes;
  total.h2d_bytes += s.h2d_bytes;
  total.copy_busy_s += s.copy_busy_s;
  total.exposed_wait_s += s.exposed_wait_s;
  total.pinned_peak_bytes = std::max(total.pinned_peak_bytes, s.pinned_peak_bytes);
  total.staging_peak_bytes = std::max(total.staging_peak_bytes, s.staging_peak_bytes);
}

// Converts a stash time point to the recorder's microseconds (both are steady_clock).
int64_t trace_us(const TraceRecorder& trace, offload::Clock::time_point t) {
  const auto now = offload::Clock::now();
  return trace.now_us() - std::chrono::duration_cast<std::chrono::microseconds>(now - t).count();
}

// Note [Offload trace]
// The stash's records become spans once the step has synchronised: each copy on the "d2h" or
// "h2d" lane (name "d2h block.3", bytes in args), and each exposed wait (> 0) on the compute
// lane as "wait block.3", so a trace viewer shows the copies beside the compute they overlap.
void trace_offload(TraceRecorder& trace, Model& model, int64_t step,
                   const std::vector<offload::CopyRecord>& copies,
                   const std::vector<offload::WaitRecord>& waits) {
  for (const offload::CopyRecord& c : copies) {
    const bool d2h = c.direction == offload::CopyRecord::Direction::kD2H;
    TraceSpan span;
    span.name = std::string(d2h ? "d2h " : "h2d ") + model.stage_name(c.stage);
    span.category = d2h ? "d2h" : "h2d";
    span.lane = span.category;
    span.start_us = trace_us(trace, c.start);
    span.dur_us = std::max<int64_t>(
        0, std::chrono::duration_cast<std::chrono::microseconds>(c.end - c.start).count());
    span.step = step;
    span.stage = c.stage;
    span.micro_batch = c.micro_batch;
    span.args = {{"bytes", static_cast<double>(c.bytes)}};
    trace.span(std::move(span));
  }
  for (const offload::WaitRecord& w : waits) {
    if (w.exposed_s <= 0.0) continue;
    TraceSpan span;
    span.name = "wait " + model.stage_name(w.stage);
    span.category = "wait";
    span.lane = "compute";
    span.start_us = trace_us(trace, w.reached);
    span.dur_us = static_cast<int64_t>(w.exposed_s * 1e6);
    span.step = step;
    span.stage = w.stage;
    span.micro_batch = w.micro_batch;
    span.args = {{"exposed_s", w.exposed_s}};
    trace.span(std::move(span));
  }
}

std::string selective_ops_name(const std::vector<std::string>& ops) {
  if (ops.empty()) return "attention";
  std::string s;
  for (const std::string& o : ops) s += (s.empty() ? "" : ",") + o;
  return s;
}

// Each stage's flat range, from the layout: a model lays out stage 0's params() first, then
// stage 1's, ... (GptModel and ChainModel do); anything else is refused, since ZeRO's
// buckets follow stages (Note [Gradient buckets]).
void stage_ranges(Model& model, std::vector<zero::StageRange>& ranges,
                  std::vector<std::vector<int>>& writers, std::vector<int>& entry_stage) {
  const auto& entries = model.layout().entries();
  size_t next = 0;
  int64_t at = 0;
  for (int s = 0; s < model.num_stages(); ++s) {
    const std::vector<nn::ParamSpec> specs = model.stage(s).params();
    zero::StageRange r{at, at};
    for (const nn::ParamSpec& spec : specs) {
      const bool ok = next < entries.size() && entries[next].shape == spec.shape &&
                      entries[next].name.size() >= spec.name.size() &&
                      entries[next].name.compare(entries[next].name.size() - spec.name.size(),
                                                 spec.name.size(), spec.name) == 0;
      PORTER_CHECK(ok, "Engine: stage ", s, " (", model.stage_name(s), ") declares '", spec.name,
                   "' but the layout's entry ", next, " is ",
                   next < entries.size() ? "'" + entries[next].name + "'" : "missing",
                   "; the model's layout must list the stages' parameters in stage order");
      const int64_t numel = entries[next].shape.numel();
      r.hi = entries[next].offset_elems +
             (numel + nn::kParamAlignElems - 1) / nn::kParamAlignElems * nn::kParamAlignElems;
      entry_stage.push_back(s);
      ++next;
    }
    at = r.hi;
    ranges.push_back(r);
    writers.push_back(model.grad_writers(s));
  }
  PORTER_CHECK(next == entries.size(), "Engine: the layout has ", entries.size(),
               " parameters but the stages declare ", next);
}

}  // namespace

Engine::Engine(memory::Device& device, std::unique_ptr<Model> model, const config::Config& config,
               std::shared_ptr<comm::Communicator> dp)
    : device_(&device), config_(config) {
  PORTER_CHECK(model != nullptr, "Engine: the model is null");
  check_supported(config, device, dp != nullptr ? dp->size() : 1);
  if (GptModel* gpt = as_gpt(*model)) {
    PORTER_CHECK(gpt->gpt().config() == config.porter.model,
                 "Engine: the GptModel was built from another model config than porter.model "
                 "(the plan and the checkpoints describe porter.model); build it from "
                 "config.porter.model");
  }
  compute_dtype_ = config.fp16.enabled   ? nn::DType::kF16
                   : config.bf16.enabled ? nn::DType::kBF16
                                         : nn::DType::kF32;
  memory::AllocatorOptions alloc_options;
  alloc_options.poison_freed = config.porter.device.poison_freed;
  allocator_ = std::make_unique<memory::CachingAllocator>(device, alloc_options);
  kernels_ = nn::make_kernels(*allocator_);
  model_ = std::move(model);
  impl_ = std::make_unique<Impl>();
  Impl& im = *impl_;
  // Offload (docs/engine.md, Offload): the pool within porter.device.pinned_limit (0: the
  // device's pinned capacity) and the stash, whose streams exist whether or not the plan
  // holds anything on the host (set_plan may bring host holds later).
  im.pinned = std::make_unique<memory::PinnedPool>(
      device, static_cast<size_t>(config.porter.device.pinned_limit_bytes.value_or(0)));
  offload::StashOptions stash_options;
  if (config.activation_checkpointing) {
    stash_options.contiguous = config.activation_checkpointing->contiguous_memory_optimization;
    stash_options.synchronize_boundary =
        config.activation_checkpointing->synchronize_checkpoint_boundary;
    im.keep_all_records = config.activation_checkpointing->profile;
  }
  im.stash = std::make_unique<offload::CheckpointStash>(*allocator_, *im.pinned, stash_options);
  im.optimizer = config.optimizer.value_or(config::OptimizerConfig{});
  im.lr = std::make_unique<LrSchedule>(im.optimizer.lr, config.scheduler);

  // Model states (Note [Model-state bytes per rank] in zero/partition.h): params in the
  // compute dtype over the padded buffer, f32 grads (the full buffer at stages 0 and 1, the
  // shard at stage 2), f32 master (bf16/fp16) and moments over the optimizer's range.
  im.dp = std::move(dp);
  im.zero_stage = config.zero_optimization.stage;
  const nn::ParamLayout& layout = model_->layout();
  const int n = im.dp != nullptr ? im.dp->size() : 1;
  const int rank = im.dp != nullptr ? im.dp->rank() : 0;
  im.part = zero::make_partition(layout.total_elems(), n);
  im.opt_lo = im.zero_stage >= 1 ? im.part.begin(rank) : 0;
  im.opt_hi = im.zero_stage >= 1 ? im.part.end(rank) : im.part.padded_elems;
  const int64_t opt_elems = im.opt_hi - im.opt_lo;
  im.flat = std::make_unique<nn::FlatParams>(*allocator_, layout, compute_dtype_, nn::DType::kF32,
                                             im.part.padded_elems, im.zero_stage < 2);
  im.has_master = compute_dtype_ != nn::DType::kF32;
  if (im.has_master) {
    im.master = nn::Tensor::empty(*allocator_, nn::Shape{opt_elems}, nn::DType::kF32,
                                  memory::Category::kOptimizer);
  }
  im.exp_avg = nn::Tensor::empty(*allocator_, nn::Shape{opt_elems}, nn::DType::kF32,
                                 memory::Category::kOptimizer);
  im.exp_avg_sq = nn::Tensor::empty(*allocator_, nn::Shape{opt_elems}, nn::DType::kF32,
                                    memory::Category::kOptimizer);
  kernels_->fill(im.exp_avg, 0.0f);
  kernels_->fill(im.exp_avg_sq, 0.0f);
  im.scaler = zero::LossScaler(config.fp16);
  {
    std::vector<zero::StageRange> ranges;
    std::vector<std::vector<int>> writers;
    std::vector<int> entry_stage;
    stage_ranges(*model_, ranges, writers, entry_stage);
    zero::ReducerOptions ro;
    ro.stage = im.zero_stage;
    ro.overlap_comm = config.zero_optimization.overlap_comm;
    ro.reduce_scatter = config.zero_optimization.reduce_scatter;
    ro.prescale_gradients = config.prescale_gradients;
    ro.predivide_factor = config.gradient_predivide_factor;
    Model* m = model_.get();
    nn::FlatParams* flat = im.flat.get();
    im.reducer = std::make_unique<zero::GradReducer>(
        *im.flat, *kernels_, *allocator_, im.comm(), im.part,
        zero::plan_buckets(ranges, writers, config.zero_optimization.reduce_bucket_size_elems),
        std::move(entry_stage), ro, [m, flat] { m->bind(*flat); });
  }
  if (im.flat->grads().defined()) {
    nn::Tensor grads = im.flat->grads();
    kernels_->fill(grads, 0.0f);
  }
  im.reducer->zero_grads();
  set_params_host(model_->init_values(config.porter.train.seed));
  model_->bind(*im.flat);
  im.ctx = std::make_unique<nn::Ctx>(*kernels_, *allocator_, compute_dtype_);

  // Note [Engine costs]: the built-in GPT under `none` plans from the analytic model (exact
  // bytes, and `none` recomputes nothing, so times do not matter). Every other case is
  // profiled, so that the plan's predicted recompute time is a measured one and a user
  // chain's bytes are known at all.
  const config::CheckpointPolicy policy = config.porter.checkpointing.policy;
  if (as_gpt(*model_) != nullptr && policy == config::CheckpointPolicy::kNone) {
    checkpoint::GptShape shape{config.porter.model, config.train_micro_batch_size_per_gpu,
                               config.porter.model.seq_len, compute_dtype_, device.kind()};
    im.costs = checkpoint::analytic_gpt_costs(
        shape, checkpoint::selective_policy(config.porter.checkpointing.selective_ops));
  } else {
    im.costs = profile();
  }
  checkpoint::PlanOptions options;
  options.checkpointing = config.porter.checkpointing;
  options.offload = checkpoint::offload_options(config);
  // Note [Link probe]: sim_link_gbps when set, else measured when offload is on.
  if (config.porter.device.sim_link_gbps) {
    im.link_bytes_per_s = *config.porter.device.sim_link_gbps * 1e9;
  } else if (options.offload.enabled) {
    im.link_bytes_per_s = measure_link_bytes_per_s(*allocator_, *im.pinned, *im.stash, im.costs);
  }
  options.offload.link_bytes_per_s = im.link_bytes_per_s;
  set_plan(checkpoint::make_plan(options, im.costs));
  allocator_->reset_peak();
}

Engine::~Engine() = default;

void Engine::set_plan(const checkpoint::Plan& plan) {
  PORTER_CHECK(plan.schedule.num_stages == model_->num_stages(), "set_plan: the plan's schedule has ",
               plan.schedule.num_stages, " stages, the model ", model_->num_stages());
  checkpoint::validate(plan.schedule);
  const bool host_holds = std::any_of(plan.schedule.ops.begin(), plan.schedule.ops.end(),
                                      [](const checkpoint::ScheduleOp& op) { return op.offload; });
  PORTER_CHECK(!host_holds || !plan.offload.empty(),
               "set_plan: the schedule holds inputs on the host but plan.offload is empty; "
               "build it with checkpoint::layout_offload(schedule, costs, prefetch_depth) "
               "(make_plan does)");
  // Before adopting the plan: a pinned shortfall is an OutOfMemoryError naming
  // porter.device.pinned_limit, and on any failure the previous plan and layout remain.
  impl_->stash->prepare(plan.offload);
  impl_->plan = plan;
  impl_->recompute_s_per_step.clear();
}

const checkpoint::Plan& Engine::plan() const { return impl_->plan; }
const checkpoint::ChainCosts& Engine::costs() const { return impl_->costs; }

namespace {

void check_batches(const config::Config& c, Model& model,
                   const std::vector<HostBatch>& micro_batches, size_t expected_count) {
  const int64_t b = c.train_micro_batch_size_per_gpu;
  const int64_t t = c.porter.model.seq_len;
  if (expected_count > 0) {
    PORTER_CHECK(micro_batches.size() == expected_count, "train_step: ", micro_batches.size(),
                 " micro-batches, but gradient_accumulation_steps is ", expected_count,
                 "; pass one HostBatch per accumulation step");
  } else {
    PORTER_CHECK(!micro_batches.empty(), "evaluate: no micro-batches");
  }
  const bool gpt = as_gpt(model) != nullptr;
  const int64_t vocab = c.porter.model.vocab;
  for (size_t i = 0; i < micro_batches.size(); ++i) {
    const HostBatch& mb = micro_batches[i];
    PORTER_CHECK(mb.batch == b && mb.seq == t, "micro-batch ", i, " is (", mb.batch, ", ",
                 mb.seq, "), the engine was planned for (train_micro_batch_size_per_gpu, "
                 "porter.model.seq_len) = (", b, ", ", t, ")");
    const size_t n = static_cast<size_t>(b * t);
    PORTER_CHECK(mb.tokens.size() == n && mb.targets.size() == n, "micro-batch ", i, " has ",
                 mb.tokens.size(), " tokens and ", mb.targets.size(), " targets; (", b, ", ", t,
                 ") needs ", n, " of each");
    if (!gpt) continue;
    for (size_t j = 0; j < n; ++j) {
      PORTER_CHECK(mb.tokens[j] >= 0 && mb.tokens[j] < vocab && mb.targets[j] >= 0 &&
                       mb.targets[j] < vocab,
                   "micro-batch ", i, " position ", j, ": token ", mb.tokens[j], " / target ",
                   mb.targets[j], " outside the vocabulary [0, ", vocab, ")");
    }
  }
}

}  // namespace

StepResult Engine::train_step(const std::vector<HostBatch>& micro_batches) {
  Impl& im = *impl_;
  const int64_t gas = config_.gradient_accumulation_steps;
  check_batches(config_, *model_, micro_batches, static_cast<size_t>(gas));
  const auto t0 = Clock::now();
  TraceSpan step_trace;
  step_trace.name = "step " + std::to_string(step_);
  step_trace.category = "step";
  step_trace.lane = "compute";
  step_trace.step = step_;
  ScopedSpan step_span(trace_, std::move(step_trace));
  im.fold_peaks(allocator_->stats());
  allocator_->reset_peak();
  // This step's offload statistics and records start empty (a failed step's are dropped).
  im.stash->reset_stats();
  (void)im.stash->take_copies();
  (void)im.stash->take_waits();

  // 1. Zero the gradients. 2. Every micro-batch through the schedule, its gradient buckets
  // reduced as Note [Gradient reduction] says. 3. Norm, overflow, clip. 4. AdamW on the
  // optimizer's range, then the all-gather of the parameters (stages 1 and 2).
  comm::Communicator* comm = im.comm();
  const comm::CommStats comm0 = comm != nullptr ? comm->stats() : comm::CommStats{};
  double exposed_s = 0.0;  // host time waiting on collectives outside the reducer
  auto wait = [&](comm::Work work) {
    const auto w0 = Clock::now();
    work.wait_on(device_->compute_stream());
    exposed_s += std::chrono::duration<double>(Clock::now() - w0).count();
  };
  const double loss_scale = im.scaler.scale();
  StepResult r;
  double loss_sum = 0.0;
  double norm = 0.0, coef = 1.0, lr = 0.0;
  bool overflow = false;
  zero::ReducerStats rs;
  try {
    im.reducer->zero_grads();
    model_->set_loss_scale(static_cast<float>(loss_scale / static_cast<double>(gas)));
    for (size_t i = 0; i < micro_batches.size(); ++i) {
      const HostBatch& mb = micro_batches[i];
      nn::Tensor tokens = upload_ids(*allocator_, mb.tokens, mb.batch, mb.seq);
      nn::Tensor targets = upload_ids(*allocator_, mb.targets, mb.batch, mb.seq);
      zero::GradReducer* reducer = im.reducer.get();
      ExecEnv env{model_.get(), im.ctx.get(), &im.plan.schedule, im.plan.selective_policy,
                  trace_, step_, static_cast<int>(i), config_.porter.train.seed, im.stash.get(),
                  [reducer](int stage) { reducer->before_backward(stage); },
                  [reducer](int stage) { reducer->after_backward(stage); }};
      reducer->begin_micro_batch(i + 1 == micro_batches.size());
      const MicroBatchResult mr = run_schedule(env, tokens, targets);
      reducer->end_micro_batch();
      loss_sum += mr.loss;
      r.recompute_s += mr.recompute_s;
    }
    rs = im.reducer->take_stats();

    // 3. Global norm (Note [One engine step]): the local buffer at stage 0 (every rank holds
    // the whole reduced gradient), else an all-reduce of the shards' squared norms. With
    // fp16 the gradients are still scaled: the norm is divided by the loss scale, and an
    // inf/nan on any rank (all_reduce max of the flag) skips the update.
    const int64_t opt_start_us = trace_ != nullptr ? trace_->now_us() : 0;
    const nn::Tensor& shard = im.reducer->shard();
    nn::Tensor sq = nn::Tensor::empty(*allocator_, nn::Shape{1}, nn::DType::kF32,
                                      memory::Category::kWorkspace);
    kernels_->squared_norm(shard, sq);
    const float local_sq = nn::to_host_f32(*device_, sq).at(0);
    double total_sq = local_sq;
    if (comm != nullptr && im.zero_stage >= 1) {
      wait(comm->all_reduce(sq.data(), 1, comm::ElemType::kF32, comm::ReduceOp::kSum));
      total_sq = nn::to_host_f32(*device_, sq).at(0);
    }
    if (config_.fp16.enabled) {
      // The flag: this rank's count of inf/nan gradients, max over ranks.
      kernels_->nonfinite_count(shard, sq);
      if (comm != nullptr) {
        wait(comm->all_reduce(sq.data(), 1, comm::ElemType::kF32, comm::ReduceOp::kMax));
      }
      overflow = nn::to_host_f32(*device_, sq).at(0) != 0.0f || !std::isfinite(total_sq);
    }
    sq = nn::Tensor();
    norm = std::sqrt(total_sq) / loss_scale;
    if (!overflow && config_.gradient_clipping > 0.0) {
      coef = std::min(1.0, config_.gradient_clipping / (norm + 1e-6));
    }

    // 4. AdamW over the optimizer's range (master f32; the working copy written back), then
    // every rank's updated range is all-gathered into the working buffer.
    lr = im.lr->lr(im.optimizer_steps);
    if (!overflow) {
      nn::AdamWArgs args;
      args.lr = static_cast<float>(lr);
      args.beta1 = static_cast<float>(im.optimizer.beta1);
      args.beta2 = static_cast<float>(im.optimizer.beta2);
      args.eps = static_cast<float>(im.optimizer.eps);
      args.weight_decay = static_cast<float>(im.optimizer.weight_decay);
      args.step = im.optimizer_steps + 1;
      args.grad_scale = static_cast<float>(coef / loss_scale);
      nn::Tensor target = im.update_target();
      nn::Tensor params = im.flat->params().slice(im.opt_lo, im.opt_hi);
      kernels_->adamw(target, shard, im.exp_avg, im.exp_avg_sq, args,
                      im.has_master ? &params : nullptr);
      if (comm != nullptr && im.zero_stage >= 1) {
        const nn::Tensor& all = im.flat->params();
        wait(comm->all_gather(params.data(), all.data(), static_cast<size_t>(im.part.shard_elems),
                              elem_type(compute_dtype_)));
      }
    }
    if (trace_ != nullptr) {
      TraceSpan span;
      span.name = "optimizer adamw";
      span.category = "optimizer";
      span.lane = "compute";
      span.start_us = opt_start_us;
      span.dur_us = trace_->now_us() - opt_start_us;
      span.step = step_;
      trace_->span(std::move(span));
    }
  } catch (const std::exception& e) {
    // Note [Comm failure]: peers must not wait out the timeout for this rank.
    if (comm != nullptr) {
      comm->abort("rank " + std::to_string(comm->rank()) + ": train_step " +
                  std::to_string(step_) + " failed: " + e.what());
    }
    im.reducer->abort();
    throw;
  }
  if (config_.fp16.enabled) im.scaler.update(overflow);
  if (!overflow) ++im.optimizer_steps;

  // The copies of this step: the D2H copies of holds never read back may still be running
  // (every other copy was waited on by a fetch). The host waits here, once per step, so the
  // stash's statistics and records are complete (docs/engine.md, Offload).
  im.stash->synchronize();
  r.offload = im.stash->stats();
  add_stats(im.offload_total, r.offload);
  std::vector<offload::CopyRecord> copies = im.stash->take_copies();
  std::vector<offload::WaitRecord> waits = im.stash->take_waits();
  if (trace_ != nullptr) trace_offload(*trace_, *model_, step_, copies, waits);
  if (!im.keep_all_records) {
    im.copies.clear();
    im.waits.clear();
  }
  im.copies.insert(im.copies.end(), copies.begin(), copies.end());
  im.waits.insert(im.waits.end(), waits.begin(), waits.end());

  // 5. Record.
  ++step_;
  last_batches_ = micro_batches;
  const memory::MemoryStats s = allocator_->stats();
  r.step = step_;
  r.loss = loss_sum / static_cast<double>(micro_batches.size());
  r.grad_norm = norm;
  r.clip_coef = overflow ? 1.0 : coef;
  r.lr = lr;
  r.skipped = overflow;
  ZeroStats& z = r.zero;
  z.stage = im.zero_stage;
  z.world_size = im.part.world_size;
  z.shard_elems = im.part.shard_elems;
  z.padded_elems = im.part.padded_elems;
  if (comm != nullptr) {
    const comm::CommStats comm1 = comm->stats();
    z.comm_bytes = comm1.payload_bytes - comm0.payload_bytes;
    z.comm_busy_s = comm1.busy_s - comm0.busy_s;
  }
  z.comm_exposed_s = exposed_s + rs.reduce_exposed_s;
  z.reduce_hidden_fraction =
      rs.reduce_busy_s > 0.0 ? std::clamp(1.0 - rs.reduce_exposed_s / rs.reduce_busy_s, 0.0, 1.0)
                             : 0.0;
  z.loss_scale = im.scaler.scale();
  z.skipped_steps = overflow ? 1 : 0;
  ZeroStats& t = im.zero_total;
  t.comm_bytes += z.comm_bytes;
  t.comm_busy_s += z.comm_busy_s;
  t.comm_exposed_s += z.comm_exposed_s;
  t.skipped_steps += z.skipped_steps;
  im.reduce_busy_total_s += rs.reduce_busy_s;
  im.reduce_exposed_total_s += rs.reduce_exposed_s;
  r.tokens = static_cast<int64_t>(micro_batches.size()) * micro_batches[0].batch * micro_batches[0].seq;
  r.peak_activation_bytes = s.peak_activation_bytes;
  r.peak_bytes = s.peak_requested_bytes;
  r.time_s = std::chrono::duration<double>(Clock::now() - t0).count();
  im.recompute_s_per_step.push_back(r.recompute_s);
  return r;
}

double Engine::evaluate(const std::vector<HostBatch>& micro_batches) {
  Impl& im = *impl_;
  check_batches(config_, *model_, micro_batches, 0);
  const int n = model_->num_stages();
  double sum = 0.0;
  struct TargetsGuard {
    Model& m;
    ~TargetsGuard() { m.set_targets(nn::Tensor()); }
  } guard{*model_};
  for (size_t i = 0; i < micro_batches.size(); ++i) {
    const HostBatch& mb = micro_batches[i];
    nn::Tensor x = upload_ids(*allocator_, mb.tokens, mb.batch, mb.seq);
    nn::Tensor targets = upload_ids(*allocator_, mb.targets, mb.batch, mb.seq);
    im.ctx->set_run({config_.porter.train.seed, static_cast<uint64_t>(step_),
                     static_cast<uint32_t>(i)});
    for (int s = 0; s < n; ++s) {
      nn::Tape tape;  // a checkpointed forward keeps nothing; dropped at once
      if (s == n - 1) model_->set_targets(targets);
      x = nn::forward_stage(*im.ctx, model_->stage(s), s, tape, nn::SaveMode::kCheckpoint, x);
    }
    sum += static_cast<double>(nn::to_host_f32(*device_, x).at(0));
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
  nn::Tensor params = im.flat->params();
  nn::from_host_f32(*device_, padded, params);
  if (im.has_master) {
    const std::vector<float> mine(padded.begin() + im.opt_lo, padded.begin() + im.opt_hi);
    nn::from_host_f32(*device_, mine, im.master);
  }
}

checkpoint::ChainCosts Engine::profile() {
  Impl& im = *impl_;
  im.fold_peaks(allocator_->stats());
  const int64_t b = config_.train_micro_batch_size_per_gpu;
  const int64_t t = config_.porter.model.seq_len;
  const int64_t vocab = std::max<int64_t>(1, config_.porter.model.vocab);
  HostBatch mb;
  mb.batch = b;
  mb.seq = t;
  for (int64_t i = 0; i < b * t; ++i) {
    mb.tokens.push_back(static_cast<int32_t>((i * 7 + 3) % vocab));
    mb.targets.push_back(static_cast<int32_t>((i * 5 + 1) % vocab));
  }
  // Profiling runs real backwards: keep the gradient buffer as the last step left it. At
  // stage 2 there is none: every entry is bound to a scratch buffer (comm) for the pass.
  const bool scratch = !im.flat->grads().defined();
  nn::Tensor grads = scratch ? nn::Tensor::empty(*allocator_, nn::Shape{im.part.padded_elems},
                                                 nn::DType::kF32, memory::Category::kComm)
                             : im.flat->grads();
  const std::vector<float> saved_grads = scratch ? std::vector<float>{}
                                                 : nn::to_host_f32(*device_, grads);
  const size_t num_entries = model_->layout().entries().size();
  auto bind_scratch = [&](bool on) {
    for (size_t i = 0; i < num_entries; ++i) {
      const nn::ParamEntry& e = model_->layout().entries()[i];
      im.flat->set_grad_view(
          i, on ? grads.slice(e.offset_elems, e.offset_elems + e.shape.numel()).reshape(e.shape)
                : nn::Tensor());
    }
    model_->bind(*im.flat);
  };
  if (scratch) {
    kernels_->fill(grads, 0.0f);
    bind_scratch(true);
  }
  auto restore = [&] {
    if (scratch) {
      bind_scratch(false);
    } else {
      nn::from_host_f32(*device_, saved_grads, grads);
    }
  };
  checkpoint::ChainCosts costs;
  try {
    nn::Tensor tokens = upload_ids(*allocator_, mb.tokens, b, t);
    nn::Tensor targets = upload_ids(*allocator_, mb.targets, b, t);
    im.ctx->set_run({config_.porter.train.seed, 0, 0});
    model_->set_loss_scale(1.0f / static_cast<float>(config_.gradient_accumulation_steps));
    costs = profile_chain(*model_, *im.ctx, tokens, targets,
                          checkpoint::selective_policy(config_.porter.checkpointing.selective_ops),
                          selective_ops_name(config_.porter.checkpointing.selective_ops));
  } catch (...) {
    restore();
    allocator_->reset_peak();
    throw;
  }
  restore();
  grads = nn::Tensor();
  allocator_->reset_peak();
  if (GptModel* gpt = as_gpt(*model_)) {  // FLOPs are not measured: take the analytic ones
    (void)gpt;
    checkpoint::GptShape shape{config_.porter.model, b, t, compute_dtype_, device_->kind()};
    const checkpoint::ChainCosts a = checkpoint::analytic_gpt_costs(
        shape, checkpoint::selective_policy(config_.porter.checkpointing.selective_ops));
    for (size_t i = 0; i < costs.stages.size() && i < a.stages.size(); ++i) {
      costs.stages[i].forward_flops = a.stages[i].forward_flops;
    }
  }
  return costs;
}

int Engine::dp_rank() const { return impl_->dp != nullptr ? impl_->dp->rank() : 0; }
int Engine::dp_size() const { return impl_->part.world_size; }

ZeroStats Engine::zero_stats() const {
  const Impl& im = *impl_;
  ZeroStats z = im.zero_total;
  z.stage = im.zero_stage;
  z.world_size = im.part.world_size;
  z.shard_elems = im.part.shard_elems;
  z.padded_elems = im.part.padded_elems;
  z.reduce_hidden_fraction =
      im.reduce_busy_total_s > 0.0
          ? std::clamp(1.0 - im.reduce_exposed_total_s / im.reduce_busy_total_s, 0.0, 1.0)
          : 0.0;
  z.loss_scale = im.scaler.scale();
  return z;
}

std::vector<float> Engine::params_host() const {
  const int64_t p = model_->layout().total_elems();
  return nn::to_host_f32(*device_, impl_->flat->params().slice(0, p));
}

// Stage 0: the whole (reduced) buffer. Stages 1 and 2: the rank's shard, zero elsewhere (with
// one rank the shard is the whole buffer).
std::vector<float> Engine::grads_host() const {
  const Impl& im = *impl_;
  const int64_t p = model_->layout().total_elems();
  if (im.zero_stage == 0) return nn::to_host_f32(*device_, im.flat->grads().slice(0, p));
  std::vector<float> out(static_cast<size_t>(p), 0.0f);
  const std::vector<float> shard = nn::to_host_f32(*device_, im.reducer->shard());
  for (int64_t i = 0; i < static_cast<int64_t>(shard.size()) && im.opt_lo + i < p; ++i) {
    out[static_cast<size_t>(im.opt_lo + i)] = shard[static_cast<size_t>(i)];
  }
  return out;
}

void Engine::reset_peaks() {
  impl_->peak_by_category.fill(0);
  impl_->peak_requested_bytes = 0;
  impl_->peak_activation_bytes = 0;
  impl_->offload_total = offload::StashStats{};
  impl_->zero_total = ZeroStats{};
  impl_->reduce_busy_total_s = 0.0;
  impl_->reduce_exposed_total_s = 0.0;
  impl_->stash->reset_stats();
  allocator_->reset_peak();
}

offload::StashStats Engine::offload_stats() const { return impl_->offload_total; }
const std::vector<offload::CopyRecord>& Engine::last_copies() const { return impl_->copies; }
const std::vector<offload::WaitRecord>& Engine::last_waits() const { return impl_->waits; }
double Engine::link_bytes_per_s() const { return impl_->link_bytes_per_s; }
memory::PinnedPool& Engine::pinned_pool() { return *impl_->pinned; }

MemoryReport Engine::memory_report() const {
  const Impl& im = *impl_;
  const memory::MemoryStats s = allocator_->stats();
  MemoryReport r;
  r.capacity_bytes = s.capacity_bytes;
  r.peak_bytes = std::max(im.peak_requested_bytes, s.peak_requested_bytes);
  for (size_t c = 0; c < memory::kNumCategories; ++c) {
    r.peak_by_category[c] = std::max(im.peak_by_category[c], s.by_category[c].peak_bytes);
    r.current_by_category[c] = s.by_category[c].current_bytes;
  }
  r.peak_activation_bytes = std::max(im.peak_activation_bytes, s.peak_activation_bytes);
  r.predicted_activation_bytes = im.plan.prediction.peak_activation_bytes;
  r.model_state_bytes = s[memory::Category::kParams].current_bytes +
                        s[memory::Category::kGrads].current_bytes +
                        s[memory::Category::kOptimizer].current_bytes;
  // The batch: one micro-batch's token ids and targets (i32) live during its schedule.
  const size_t batch_bytes = 2 * sizeof(int32_t) *
                             static_cast<size_t>(config_.train_micro_batch_size_per_gpu *
                                                 config_.porter.model.seq_len);
  r.predicted_peak_bytes = r.model_state_bytes + batch_bytes + im.plan.prediction.peak_total_bytes;
  r.predicted_recompute_s =
      im.plan.prediction.recompute_s * static_cast<double>(config_.gradient_accumulation_steps);
  r.peak_pinned_bytes = im.offload_total.pinned_peak_bytes;
  r.pinned_limit_bytes = im.pinned->stats().limit_bytes;
  r.predicted_pinned_bytes = im.plan.offload.pinned_bytes;
  r.offloaded_bytes = im.plan.offload.offloaded_bytes;
  r.offload = im.offload_total;
  if (!im.recompute_s_per_step.empty()) {
    std::vector<double> v = im.recompute_s_per_step;
    std::nth_element(v.begin(), v.begin() + static_cast<long>(v.size() / 2), v.end());
    r.measured_recompute_s = v[v.size() / 2];
  }
  return r;
}

std::string MemoryReport::format() const {
  std::ostringstream o;
  auto row = [&](std::string_view name, const std::string& a, const std::string& b) {
    o << "  " << std::left << std::setw(22) << name << std::right << std::setw(12) << a
      << std::setw(14) << b << "\n";
  };
  o << "memory (capacity " << format_bytes(capacity_bytes) << ")\n";
  row("category", "current", "peak");
  for (memory::Category c : memory::kAllCategories) {
    const size_t i = memory::index_of(c);
    row(memory::category_name(c), format_bytes(current_by_category[i]),
        format_bytes(peak_by_category[i]));
  }
  row("all categories", "", format_bytes(peak_bytes));
  o << "\n";
  row("", "predicted", "measured");
  row("activation peak", format_bytes(predicted_activation_bytes),
      format_bytes(peak_activation_bytes));
  row("total peak", format_bytes(predicted_peak_bytes), format_bytes(peak_bytes));
  std::ostringstream p, m;
  p << std::fixed << std::setprecision(3) << predicted_recompute_s * 1e3 << " ms";
  m << std::fixed << std::setprecision(3) << measured_recompute_s * 1e3 << " ms";
  row("recompute per step", p.str(), m.str());
  row("pinned peak", format_bytes(predicted_pinned_bytes), format_bytes(peak_pinned_bytes));
  o << "  pinned limit " << format_bytes(pinned_limit_bytes) << "\n";
  if (offloaded_bytes > 0 || offload.d2h_bytes > 0) {
    o << std::fixed << std::setprecision(3) << "  offload: " << format_bytes(offloaded_bytes)
      << " per micro-batch to host; copied d2h " << format_bytes(offload.d2h_bytes) << ", h2d "
      << format_bytes(offload.h2d_bytes) << "; copy busy " << offload.copy_busy_s * 1e3
      << " ms, exposed wait " << offload.exposed_wait_s * 1e3 << " ms, hidden "
      << std::setprecision(1) << offload.hidden_fraction() * 100.0 << "%\n";
  }
  return o.str();
}

}  // namespace porter::engine
