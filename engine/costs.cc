// Cost acquisition (costs.h): the profiler, which measures every stage of a chain under every
// save option one stage at a time on a synthetic micro-batch (Note [Activation bytes] in
// checkpoint/costs.h); Engine::profile, which runs it on the engine's model; what the ranks
// agree on before they compute (Notes [Agreed costs], [Kernel table agreement]); the link and
// tensor-parallel probes; and Engine::plan_from_costs, which puts them together.
//
// Note [Profiling]
// Stage i's input comes from running stages 0..i-1 (checkpointed forwards, tapes dropped at
// once). Between stages the input waits on the host, and each option's run gets a fresh
// device copy, so that dropping the copy reveals whether the tape still references it
// (tape_refs_input) and at most one stage's input is on the device at a time: profiling fits
// wherever the `full` policy fits (stage 0's token ids get a fresh copy the same way). Per
// option:
//   reset_peak; forward            -> forward_s, forward_peak_bytes, forward_total_peak_bytes
//   footprint delta - output        -> saved_bytes
//   drop the output                 -> tape_refs_output (nothing freed)
//   kSelective/kCheckpoint: reset_peak; recompute -> recompute_* (above start + saved)
//   kKeep: drop the input copy      -> tape_refs_input; then backward -> backward_s and
//                                      backward_total_peak_bytes (the incoming dy alive)
// A save option is available when it differs from kKeep: selective needs at least one op the
// selective policy recomputes (a stage without attention has none). Times are the minimum of
// kTimingRuns runs after a warm-up: cheap, and stable enough to rank plans.
#include "engine/costs.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>
#include <vector>

#include "base/check.h"
#include "engine/engine.h"
#include "engine/engine_impl.h"
#include "engine/executor.h"
#include "offload/link_probe.h"

namespace porter::engine {

namespace {

using Clock = std::chrono::steady_clock;
using checkpoint::OptionCost;

constexpr int kTimingRuns = 3;
using checkpoint::SaveOption;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

struct HostTensor {
  tensor::Shape shape;
  tensor::DType dtype = tensor::DType::kF32;
  memory::Category category = memory::Category::kActivations;
  std::vector<std::byte> bytes;
};

HostTensor download(memory::Device& device, const tensor::Tensor& t) {
  HostTensor h{t.shape(), t.dtype(), t.category(), std::vector<std::byte>(t.nbytes())};
  if (!h.bytes.empty()) device.copy_sync(h.bytes.data(), t.data(), h.bytes.size());
  return h;
}

tensor::Tensor upload(memory::CachingAllocator& alloc, const HostTensor& h) {
  tensor::Tensor t = tensor::Tensor::empty(alloc, h.shape, h.dtype, h.category);
  if (!h.bytes.empty()) alloc.device().copy_sync(t.data(), h.bytes.data(), h.bytes.size());
  return t;
}

size_t footprint(const memory::CachingAllocator& a) { return a.stats().activation_bytes; }

}  // namespace

checkpoint::ChainCosts profile_chain(Model& model, nn::Ctx& ctx, const tensor::Tensor& tokens,
                                     const tensor::Tensor& targets,
                                     const nn::OpPolicy& selective_policy,
                                     const std::string& selective_ops,
                                     const std::function<void(int stage, bool begin)>& stage_hook) {
  memory::CachingAllocator& alloc = ctx.allocator();
  memory::Device& device = alloc.device();
  const int n = model.num_stages();
  checkpoint::ChainCosts costs;
  costs.source = "profiled";
  costs.selective_ops = selective_ops;
  costs.stages.resize(static_cast<size_t>(n));

  struct TargetsGuard {
    Model& m;
    ~TargetsGuard() { m.set_targets(tensor::Tensor()); }
  } targets_guard{model};

  HostTensor input = download(device, tokens);
  input.category = tokens.category();
  for (int i = 0; i < n; ++i) {
    if (stage_hook) stage_hook(i, true);
    checkpoint::StageCost& sc = costs.stages[static_cast<size_t>(i)];
    sc.name = model.stage_name(i);
    sc.is_block = model.is_block(i);
    nn::Layer& layer = model.stage(i);
    const bool last = i == n - 1;
    // Stage 0's input is the token ids, in workspace: not part of the footprint.
    sc.input_bytes = i == 0 ? 0 : input.bytes.size();
    HostTensor next;

    {  // Warm-up, so that first-touch costs do not land on one option's time.
      nn::Tape tape;
      tensor::Tensor x = upload(alloc, input);
      if (last) model.set_targets(targets);
      nn::forward_stage(ctx, layer, i, tape, nn::SaveMode::kCheckpoint, x);
    }

    for (SaveOption o : {SaveOption::kKeep, SaveOption::kSelective, SaveOption::kCheckpoint}) {
      OptionCost& oc = sc.option(o);
      nn::Tape tape;
      tensor::Tensor x = upload(alloc, input);
      if (last) model.set_targets(targets);
      const nn::SaveMode mode =
          o == SaveOption::kKeep ? nn::SaveMode::kSaveAll : nn::SaveMode::kCheckpoint;
      const nn::OpPolicy policy =
          o == SaveOption::kSelective ? selective_policy : nn::OpPolicy::keep_none();

      alloc.reset_peak();
      memory::MemoryStats s0 = alloc.stats();
      auto t0 = Clock::now();
      tensor::Tensor y = nn::forward_stage(ctx, layer, i, tape, mode, x, policy);
      oc.forward_s = seconds_since(t0);
      memory::MemoryStats s1 = alloc.stats();
      oc.forward_peak_bytes = s1.peak_activation_bytes - s0.activation_bytes;
      oc.forward_total_peak_bytes = s1.peak_requested_bytes - s0.requested_bytes;
      const size_t out_bytes = y.nbytes();
      const tensor::Shape out_shape = y.shape();
      const tensor::DType out_dtype = y.dtype();
      sc.output_bytes = out_bytes;
      PORTER_ASSERT(s1.activation_bytes >= s0.activation_bytes + out_bytes,
                    "stage ", sc.name, ": the footprint grew less than its output");
      oc.saved_bytes = s1.activation_bytes - s0.activation_bytes - out_bytes;
      if (o == SaveOption::kCheckpoint && !last) next = download(device, y);
      const size_t before_drop = footprint(alloc);
      y = tensor::Tensor();
      oc.tape_refs_output = before_drop - footprint(alloc) < out_bytes;

      if (o == SaveOption::kKeep) {
        oc.available = true;
        // All categories: stage 0's input (token ids) is workspace, outside the footprint.
        const size_t before = alloc.stats().requested_bytes;
        const size_t in_bytes = x.nbytes();
        x = tensor::Tensor();
        oc.tape_refs_input = before - alloc.stats().requested_bytes < in_bytes;
        // Backward with the incoming gradient (workspace, the activation's dtype) alive, as
        // in a step; the loss stage ignores its dy.
        tensor::Tensor dy;
        if (!last) {
          dy = ctx.workspace(out_shape, out_dtype);
          ctx.kernels().fill(dy, 0.0f);
        }
        alloc.reset_peak();
        s0 = alloc.stats();
        t0 = Clock::now();
        nn::backward_stage(ctx, layer, i, tape, dy);
        sc.backward_s = seconds_since(t0);
        sc.backward_total_peak_bytes = alloc.stats().peak_requested_bytes - s0.requested_bytes;
        continue;
      }
      const std::vector<std::string> actions = tape.plan_actions();
      bool recomputes = false;
      for (const std::string& a : actions) {  // "<op name>:<action>"
        recomputes = recomputes || a.ends_with(":compute");
      }
      oc.available = o == SaveOption::kCheckpoint || recomputes;

      if (last) model.set_targets(targets);
      alloc.reset_peak();
      s0 = alloc.stats();
      t0 = Clock::now();
      nn::recompute_stage(ctx, layer, i, tape, x);
      oc.recompute_s = seconds_since(t0);
      s1 = alloc.stats();
      oc.recompute_peak_bytes = s1.peak_activation_bytes - s0.activation_bytes;
      oc.recompute_total_peak_bytes = s1.peak_requested_bytes - s0.requested_bytes;
      oc.recompute_saved_bytes = s1.activation_bytes - s0.activation_bytes;
      tape.clear();
    }

    // Times: the minimum over kTimingRuns runs (the byte-measuring run above is the first),
    // so that first-touch costs (new segments, cold caches) do not pass for compute.
    for (int run = 1; run < kTimingRuns; ++run) {
      for (SaveOption o : {SaveOption::kKeep, SaveOption::kSelective, SaveOption::kCheckpoint}) {
        OptionCost& oc = sc.option(o);
        nn::Tape tape;
        tensor::Tensor x = upload(alloc, input);
        if (last) model.set_targets(targets);
        const bool keep = o == SaveOption::kKeep;
        auto t0 = Clock::now();
        tensor::Tensor y = nn::forward_stage(
            ctx, layer, i, tape, keep ? nn::SaveMode::kSaveAll : nn::SaveMode::kCheckpoint, x,
            o == SaveOption::kSelective ? selective_policy : nn::OpPolicy::keep_none());
        oc.forward_s = std::min(oc.forward_s, seconds_since(t0));
        tensor::Tensor dy;
        if (keep && !last) {
          dy = ctx.workspace(y.shape(), y.dtype());
          ctx.kernels().fill(dy, 0.0f);
        }
        y = tensor::Tensor();
        t0 = Clock::now();
        if (keep) {
          nn::backward_stage(ctx, layer, i, tape, dy);
          sc.backward_s = std::min(sc.backward_s, seconds_since(t0));
        } else {
          if (last) model.set_targets(targets);
          nn::recompute_stage(ctx, layer, i, tape, x);
          oc.recompute_s = std::min(oc.recompute_s, seconds_since(t0));
          tape.clear();
        }
      }
    }
    input = std::move(next);
    if (stage_hook) stage_hook(i, false);
  }
  return costs;
}


// Note [Agreed costs]: every rank of the world must run the same schedule: the ranks of a
// tp group because their layers' collectives pair up op by op, and at ZeRO stage 3 the ranks
// of a dp group because their parameter gathers do (Note [Gather plan]). Profiled times and
// measured bandwidths differ from rank to rank, so every time is replaced by its maximum and
// every bandwidth by its minimum over the world (all-reduced over the tp group, then over the
// dp group) before planning; the plan is a function of the costs, so every rank gets the same
// one. Bytes are exact and equal on every rank already.
void Engine::agree_max(std::vector<double>& values, const char* label) {
  Impl& im = *impl_;
  for (comm::Communicator* c : {im.tp_comm(), im.comm()}) {
    if (c == nullptr || values.empty()) continue;
    const comm::CommLabel l(c, label);
    c->all_reduce(values.data(), values.size(), comm::ElemType::kF64, comm::ReduceOp::kMax).wait();
  }
}

double Engine::agree_bandwidth(double bytes_per_s, const char* label) {
  // The slowest rank's: the maximum of seconds per byte (0 stays unknown only if every rank's is).
  std::vector<double> v{bytes_per_s > 0.0 ? 1.0 / bytes_per_s : 0.0};
  agree_max(v, label);
  return v[0] > 0.0 ? 1.0 / v[0] : 0.0;
}

void Engine::agree_on_costs() {
  Impl& im = *impl_;
  if (im.tp_comm() == nullptr && im.comm() == nullptr) return;
  std::vector<double> times;
  for (const checkpoint::StageCost& st : im.costs.stages) {
    times.push_back(st.backward_s);
    for (const checkpoint::OptionCost& o : st.options) {
      times.push_back(o.forward_s);
      times.push_back(o.recompute_s);
    }
  }
  agree_max(times, "profile");
  size_t i = 0;
  for (checkpoint::StageCost& st : im.costs.stages) {
    st.backward_s = times[i++];
    for (checkpoint::OptionCost& o : st.options) {
      o.forward_s = times[i++];
      o.recompute_s = times[i++];
    }
  }
}

// The tp group's all-gather bandwidth, bytes/s received, from one all-gather of `bytes`
// (the largest checkpoint) after a warm-up; the same figure on every rank (the maximum time).
double Engine::measure_tp_bytes_per_s(size_t bytes) {
  comm::Communicator* tp = impl_->tp_comm();
  if (tp == nullptr || bytes == 0) return 0.0;
  const size_t slice = (bytes + static_cast<size_t>(tp->size()) - 1) / static_cast<size_t>(tp->size());
  tensor::Tensor buf = tensor::Tensor::empty(*allocator_, tensor::Shape{static_cast<int64_t>(slice) * tp->size()},
                                     tensor::DType::kI32 /* bytes / 4 */, memory::Category::kWorkspace);
  const size_t count = slice / 4;
  const comm::CommLabel label(tp, "link probe");
  char* base = static_cast<char*>(buf.data());
  tp->all_gather(base + count * 4 * static_cast<size_t>(tp->rank()), base, count,
                 comm::ElemType::kI32).wait();
  const auto t0 = Clock::now();
  tp->all_gather(base + count * 4 * static_cast<size_t>(tp->rank()), base, count,
                 comm::ElemType::kI32).wait();
  std::vector<double> seconds{std::chrono::duration<double>(Clock::now() - t0).count()};
  tp->all_reduce(seconds.data(), 1, comm::ElemType::kF64, comm::ReduceOp::kMax).wait();
  const double received = static_cast<double>(count * 4) * (tp->size() - 1);
  return seconds[0] > 0.0 ? received / seconds[0] : 0.0;
}

// Note [Kernel table agreement]
// Each rank records its own kernel choices as its kernels first meet each problem (Note
// [Kernel table] in kernels/kernel_table.cc). After the first step, world rank 0's table replaces
// every other rank's: broadcast over the tensor-parallel group, then over the data-parallel
// group, so every rank ends with world rank 0's. Under kernel_choice "exact" this changes no
// bits (any recorded candidate gives the same ones) but makes every rank's checkpoint and
// report hold one table; under "fastest" it makes every later step compute the same way on
// every rank. A collective: every rank's first train_step calls it.
void Engine::agree_kernel_table() {
  Impl& im = *impl_;
  kernels::KernelTable& table = kernels_->kernel_table();
  for (comm::Communicator* c : {im.tp_comm(), im.comm()}) {
    if (c == nullptr) continue;
    const comm::CommLabel l(c, "kernel table");
    std::string text = c->rank() == 0 ? table.to_json().dump() : std::string();
    // Through device buffers: NCCL reads device memory only.
    auto broadcast = [&](void* host, size_t bytes, comm::ElemType type, size_t count) {
      memory::DeviceBuffer buf = allocator_->allocate(bytes, memory::Category::kWorkspace);
      device_->copy_sync(buf.data(), host, bytes);
      c->broadcast(buf.data(), count, type, 0).wait();
      device_->copy_sync(host, buf.data(), bytes);
    };
    int64_t n = static_cast<int64_t>(text.size());
    broadcast(&n, sizeof n, comm::ElemType::kI64, 1);
    text.resize(static_cast<size_t>(n));
    if (n > 0) broadcast(text.data(), text.size(), comm::ElemType::kU8, text.size());
    if (c->rank() != 0 && n > 0) {
      const nlohmann::json agreed = nlohmann::json::parse(text);
      table.pin(agreed, "rank 0's table (" + agreed.value("origin", std::string("measured")) + ")");
    }
  }
}

checkpoint::ChainCosts Engine::profile() {
  if (pending_ != nullptr) throw_step_begun("profile");
  Impl& im = *impl_;
  im.fold_peaks(allocator_->stats());
  const io::HostBatch mb = synthetic_batch(run_, *model_);
  const std::vector<BatchField> spec = model_->batch_spec(run_);
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
        buf = tensor::Tensor::empty(*allocator_, tensor::Shape{r.hi - r.lo}, run_.grad_dtype,
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
  // Stage 3: the forward pass's gather plan, played around each stage's measurements (Note
  // [Stage 3 driver] in stage3.h).
  const Stage3Driver* gathers = im.forward_gathers.active() ? &im.forward_gathers : nullptr;
  std::function<void(int, bool)> stage_hook;
  if (gathers != nullptr || scratch) {
    stage_hook = [gathers, &bind_scratch, scratch](int s, bool begin) {
      if (scratch && begin) bind_scratch(s, true);
      if (gathers != nullptr) {
        if (begin) {
          gathers->before_op(static_cast<size_t>(s));
        } else {
          gathers->after_op(static_cast<size_t>(s));
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
    const nn::Batch batch = upload_batch(*allocator_, mb, spec);
    const tensor::Tensor& input = batch.get(model_->input_name());
    const tensor::Tensor& targets = batch.get(model_->target_name());
    im.ctx->set_run({run_.seed, 0, 0, input.dim(0), batch_positions(input)});
    im.ctx->set_batch(&batch);
    model_->set_loss_scale(1.0f / static_cast<float>(run_.gradient_accumulation_steps));
    costs = profile_chain(*model_, *im.ctx, input, targets, run_.selective_policy,
                          run_.selective_name, stage_hook);
    im.ctx->set_batch(nullptr);
  } catch (...) {
    im.ctx->set_batch(nullptr);
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
  im.costs.comm = im.comm_costs;     // Note [Gradient buckets in the footprint]
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

}  // namespace porter::engine
