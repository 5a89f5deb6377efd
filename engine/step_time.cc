// A training step's predicted time on a device model (engine/step_time.h).
#include "engine/step_time.h"

#include <algorithm>
#include <cmath>
#include <memory>

#include "base/check.h"
#include "base/error.h"

namespace porter::engine {

double ring_all_reduce_s(double bytes, int n, double bytes_per_s) {
  if (n <= 1 || bytes <= 0.0) return 0.0;
  PORTER_CHECK(bytes_per_s > 0.0, "an all-reduce over ", n, " ranks needs a bus bandwidth > 0");
  return 2.0 * (n - 1) / n * bytes / bytes_per_s;
}

double ring_reduce_scatter_s(double bytes, int n, double bytes_per_s) {
  if (n <= 1 || bytes <= 0.0) return 0.0;
  PORTER_CHECK(bytes_per_s > 0.0, "a reduce-scatter over ", n,
               " ranks needs a bus bandwidth > 0");
  return static_cast<double>(n - 1) / n * bytes / bytes_per_s;
}

// Note [Step communication]
// ZeRO over n data-parallel ranks (docs/zero.md, "Stages"), with P the rank's parameter
// elements (of its tensor-parallel part), gradients in f32 and parameters in the compute
// dtype:
//   gradients   stage 0: an all-reduce of 4P bytes in the step's last micro-batch; stage 1
//               the same as a reduce-scatter (an all-reduce with reduce_scatter false);
//               stages 2 and 3 that in every micro-batch.
//   parameters  stages 1 and 2: an all-gather of the updated P x dtype bytes after the
//               update; stage 3: each micro-batch's gathers (the plan's gathered_bytes, of
//               which a rank receives the (n-1)/n it does not own), and the persistent
//               units' refresh after the update.
// Tensor parallelism over t ranks (Megatron): per micro-batch, each block's forward runs two
// all-reduces of a (B, T, C) activation (each recomputed forward again) and its backward two,
// the embedding's forward one and the head's backward one (sequence parallelism's all-gather
// and reduce-scatter pairs move the same bytes); plus the partitioned checkpoints' gathers
// as the plan timed them.
// What the compute waits for, per micro-batch:
//   - the gradient reduction can overlap that micro-batch's backward and recompute, with
//     overlap_comm; stage 3's gathers (with parameter offload's uploads, which precede them)
//     can overlap the whole micro-batch's compute when stage3_prefetch_bucket_size > 0;
//   - the bus and the compute stream each do one thing at a time, so the overlappable
//     reduction R hides at most behind the backward and recompute B, and R with the
//     overlappable gathers G at most behind the whole micro-batch C: exposed = the
//     communication that cannot overlap + max(0, R - B, R + G - C);
//   - the all-gathers after the update, and tensor parallelism's all-reduces (the next op
//     reads their result), are exposed whole.
// Optimizer offload (docs/zero.md, "Optimizer offload") on the rank's host share H of its
// shard (P/n, x the offload ratio): the gradients go down (4H bytes on the host link) during
// the last backward with overlap_comm (exposed beyond it), after it otherwise; the host AdamW
// reads and writes (28 + dtype) x H bytes (gradient, master, two moments in; master, moments
// and the working copy out) at the host memory's bandwidth; the working copy comes back up
// (dtype x H bytes), except with parameter offload, where it stays on the host. Parameter
// offload without optimizer offload copies the updated shard down (dtype x P/n bytes).
// Collectives are intra-node, on the device's collective bus; a multi-node network is not
// modelled.
StepTimePrediction predict_step_time(const RunOptions& run, const DeviceModel& device,
                                     const checkpoint::Plan& plan,
                                     const checkpoint::ChainCosts& costs,
                                     const StepTimeInputs& in) {
  if (!costs.has_times()) {
    throw InvalidArgument("predict_step_time: the costs (" + costs.source +
                          ") have no times; time them on a device model (roofline_costs) or "
                          "profile them");
  }
  PORTER_CHECK(in.dp_size >= 1, "data-parallel size ", in.dp_size, " must be >= 1");
  PORTER_CHECK(in.param_elems >= 0, "parameter elements ", in.param_elems, " must be >= 0");
  PORTER_CHECK_EQ(plan.stages.size(), costs.stages.size(), "the plan's stages and the costs'");
  const checkpoint::Prediction& pred = plan.prediction;
  const int64_t m = std::max<int64_t>(1, run.gradient_accumulation_steps);
  const double md = static_cast<double>(m);
  const int n = in.dp_size;
  const double p = static_cast<double>(in.param_elems);
  const double dt = static_cast<double>(tensor::dtype_size(run.compute_dtype));
  const double bus = device.collective_bytes_per_s();
  const double link = device.host_link_bytes_per_s;

  StepTimePrediction r;
  r.device = device.name;
  r.micro_batches = m;

  // Compute, per micro-batch and per step.
  double backward_mb = 0.0;
  for (const checkpoint::StageCost& st : costs.stages) backward_mb += st.backward_s;
  const double compute_mb = pred.compute_s;  // forwards + recomputes + backwards
  const double recompute_mb = pred.recompute_s;
  r.compute_s = md * (compute_mb - recompute_mb);
  r.recompute_s = md * recompute_mb;

  // ZeRO (Note [Step communication]).
  const int stage = run.zero_stage();
  const double grad_bytes = 4.0 * p;
  const bool all_reduce = stage == 0 || !run.reducer.reduce_scatter;
  const double reduce_s = all_reduce ? ring_all_reduce_s(grad_bytes, n, bus)
                                     : ring_reduce_scatter_s(grad_bytes, n, bus);
  const int64_t reducing_mbs = stage >= 2 ? m : 1;
  const bool param_offload = run.optimizer.param_offload.enabled;
  double gather_mb = 0.0, upload_mb = 0.0, after_update_s = 0.0;
  if (stage == 1 || stage == 2) {
    after_update_s = ring_reduce_scatter_s(p * dt, n, bus);
  } else if (stage == 3) {
    gather_mb = ring_reduce_scatter_s(static_cast<double>(pred.params.gathered_bytes), n, bus);
    if (param_offload && link > 0.0) {
      upload_mb = static_cast<double>(pred.params.gathered_bytes) / n / link;
    }
    after_update_s = ring_reduce_scatter_s(static_cast<double>(pred.params.persistent_bytes), n, bus);
  }
  const bool gathers_overlap = stage == 3 && run.stage3.prefetch_elems > 0;
  const bool reduce_overlaps = run.reducer.overlap_comm;
  auto exposed_mb = [&](bool reduces) {
    const double reduce = reduces ? reduce_s : 0.0;
    const double gathers = gather_mb + upload_mb;
    const double r_o = reduce_overlaps ? reduce : 0.0;
    const double g_o = gathers_overlap ? gathers : 0.0;
    const double fixed = (reduce - r_o) + (gathers - g_o);
    return fixed + std::max({0.0, r_o - (backward_mb + recompute_mb), r_o + g_o - compute_mb});
  };
  r.dp_comm_s = static_cast<double>(reducing_mbs) * reduce_s + md * gather_mb + after_update_s;
  r.exposed_dp_comm_s = static_cast<double>(reducing_mbs) * exposed_mb(true) +
                        static_cast<double>(m - reducing_mbs) * exposed_mb(false) +
                        after_update_s;

  // Tensor parallelism.
  const int t = static_cast<int>(run.shape.model.tensor_parallel);
  if (t > 1) {
    const int64_t seq = run.shape.seq > 0 ? run.shape.seq : run.shape.model.seq_len;
    const double whole = static_cast<double>(run.shape.micro_batch) * static_cast<double>(seq) *
                         static_cast<double>(run.shape.model.hidden) * dt;
    int64_t all_reduces = 0;
    for (size_t s = 0; s < costs.stages.size(); ++s) {
      const int forwards = plan.stages[s].forwards;
      if (costs.stages[s].is_block) {
        all_reduces += 2 * forwards + 2;
      } else if (s == 0) {
        all_reduces += forwards;  // the embedding's vocabulary-parallel lookup
      } else {
        all_reduces += 1;         // the head's input gradient
      }
    }
    r.tp_comm_s = md * static_cast<double>(all_reduces) * ring_all_reduce_s(whole, t, bus);
    r.exposed_tp_comm_s = r.tp_comm_s;
    if (pred.offload.gather_timed) {
      r.tp_comm_s += md * pred.offload.gather_busy_s;
      r.exposed_tp_comm_s += md * pred.offload.gather_exposed_s;
    }
  }

  // Offload.
  r.offload_timed = pred.offload.timed;
  if (pred.offload.timed) r.exposed_activation_offload_s = md * pred.offload.exposed_s;
  const double shard = std::ceil(p / n);
  const double ratio = run.optimizer.offload.enabled
                           ? (stage == 3 ? std::clamp(run.optimizer.offload.ratio, 0.0, 1.0) : 1.0)
                           : 0.0;
  const double h = std::floor(ratio * shard);  // the host's elements
  const double updated = stage == 0 ? p : shard;
  r.optimizer_s = device.hbm_bytes_per_s > 0.0
                      ? (28.0 + dt) * std::max(0.0, updated - h) / device.hbm_bytes_per_s
                      : 0.0;
  if (run.optimizer.offload.enabled && link > 0.0) {
    const double d2h = 4.0 * h / link;
    const double exposed_d2h =
        reduce_overlaps ? std::max(0.0, d2h - (backward_mb + recompute_mb)) : d2h;
    r.host_adam_timed = in.host_memory_bytes_per_s > 0.0;
    r.host_adam_s = r.host_adam_timed ? (28.0 + dt) * h / in.host_memory_bytes_per_s : 0.0;
    const double h2d = param_offload ? 0.0 : dt * h / link;
    r.exposed_optimizer_offload_s = exposed_d2h + r.host_adam_s + h2d;
  } else if (param_offload && link > 0.0) {
    r.exposed_optimizer_offload_s = dt * shard / link;
  }

  r.total_s = r.compute_s + r.recompute_s + r.exposed_comm_s() + r.exposed_offload_s() +
              r.optimizer_s;
  const int64_t seq = run.shape.seq > 0 ? run.shape.seq : run.shape.model.seq_len;
  const int64_t rank_tokens = run.shape.micro_batch * seq * m;
  r.tokens_per_step = rank_tokens * n;
  r.tokens_per_s = r.total_s > 0.0 ? static_cast<double>(r.tokens_per_step) / r.total_s : 0.0;
  double forward_flops = 0.0;
  for (const checkpoint::StageCost& st : costs.stages) forward_flops += st.forward_flops;
  r.model_flops = forward_flops > 0.0 ? 3.0 * forward_flops * md
                                      : 6.0 * p * static_cast<double>(rank_tokens);
  const double peak = device.peak_flops_per_s(run.compute_dtype);
  r.mfu = r.total_s > 0.0 && peak > 0.0 ? r.model_flops / (r.total_s * peak) : 0.0;
  return r;
}

nlohmann::ordered_json StepTimePrediction::to_json() const {
  using J = nlohmann::ordered_json;
  return {{"device", device},
          {"micro_batches", micro_batches},
          {"compute_s", compute_s},
          {"recompute_s", recompute_s},
          {"dp_comm_s", dp_comm_s},
          {"tp_comm_s", tp_comm_s},
          {"exposed_dp_comm_s", exposed_dp_comm_s},
          {"exposed_tp_comm_s", exposed_tp_comm_s},
          {"offload_timed", offload_timed},
          {"exposed_activation_offload_s", offload_timed ? J(exposed_activation_offload_s) : J()},
          {"host_adam_s", host_adam_timed ? J(host_adam_s) : J()},
          {"exposed_optimizer_offload_s", exposed_optimizer_offload_s},
          {"optimizer_s", optimizer_s},
          {"total_s", total_s},
          {"tokens_per_step", tokens_per_step},
          {"tokens_per_s", tokens_per_s},
          {"model_flops", model_flops},
          {"mfu", mfu}};
}

DeviceModel run_device_model(const RunOptions& run, const CpuCalibrationOptions& calibration) {
  return resolve_device_model(run.device_model, run.device.kind, run.compute_dtype, [&] {
    std::unique_ptr<memory::Device> device = memory::make_device(run.device);
    CpuCalibrationOptions o = calibration;
    if (o.link_bytes_per_s <= 0.0 && run.device.sim_link_gbps > 0.0) {
      o.link_bytes_per_s = run.device.sim_link_gbps * 1e9;
    }
    return calibrate_cpu_device(*device, o);
  });
}

checkpoint::PlanOptions timed_plan_options(const RunOptions& run, const DeviceModel& device) {
  checkpoint::PlanOptions o = run.plan;
  if (o.offload.link_bytes_per_s <= 0.0) o.offload.link_bytes_per_s = device.host_link_bytes_per_s;
  if (o.partition.tp_bytes_per_s <= 0.0) {
    o.partition.tp_bytes_per_s = device.collective_bytes_per_s();
  }
  return o;
}

}  // namespace porter::engine
