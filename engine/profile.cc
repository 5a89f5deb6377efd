// The profiler: every stage of a chain under every save option, measured one stage at a
// time on a synthetic micro-batch (Note [Activation bytes] in checkpoint/costs.h).
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
#include <algorithm>
#include <chrono>
#include <cstring>
#include <vector>

#include "base/check.h"
#include "engine/executor.h"

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

}  // namespace porter::engine
