// porter::engine::predict_step_time: one training step's predicted time per rank on a device
// model (engine/device_model.h): compute, recompute, the communication and offload the
// compute waits for, tokens per second and MFU. docs/planning.md describes the rules.
//
// Note [Step time]
// Per rank and step, over the step's m = gradient_accumulation_steps micro-batches, from a
// plan made on costs with times (a device model's roofline, or profiled):
//   compute    m x (the plan's compute_s - recompute_s): one forward and one backward of
//              every stage;
//   recompute  m x the plan's recompute_s;
//   comm       the collectives (Note [Step communication] in step_time.cc), each a ring on
//              the device's collective bus: all-reduce 2(n-1)/n x bytes / bandwidth,
//              reduce-scatter and all-gather (n-1)/n x bytes / bandwidth, for n ranks;
//              only the part the compute waits for counts (exposed);
//   offload    the activation copies the compute waits for (the plan's offload exposed_s,
//              when timed) and the optimizer and parameter offload's host work and copies
//              on the step's critical path;
//   optimizer  the device AdamW over the elements the rank updates on the device (all P
//              at stage 0, its shard P/n above, less what optimizer offload moves to the
//              host): (28 + dtype size) bytes each at the memory bandwidth (gradient,
//              master weight and two moments read; master, moments and the working copy
//              written), a memory-bound pass;
//   total      their sum.
// tokens/s is the whole run's (micro-batch x seq_len x m x data-parallel ranks per step);
// MFU is the rank's model FLOPs over total x the device's dense peak at the compute dtype,
// with model FLOPs 3 x the analytic forward FLOPs (forward + backward = 2 x forward, without
// recompute, attention included), or 6 x parameters x tokens when the costs carry no FLOPs
// (profiled). Every figure is a floor, as the roofline's (Note [Roofline times]).
#pragma once

#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "checkpoint/costs.h"
#include "checkpoint/planner.h"
#include "engine/device_model.h"
#include "engine/run_options.h"

namespace porter::engine {

struct StepTimePrediction {
  std::string device;            // the device model's name
  int64_t micro_batches = 1;
  double compute_s = 0.0;        // forwards and backwards, every micro-batch
  double recompute_s = 0.0;
  // Collective busy time on the bus per step (ZeRO over the data-parallel ranks, tensor
  // parallelism's per-layer all-reduces), and the part of each the compute waits for.
  double dp_comm_s = 0.0;
  double tp_comm_s = 0.0;
  double exposed_dp_comm_s = 0.0;
  double exposed_tp_comm_s = 0.0;
  // Activation offload's exposed copies (only when the plan timed them: offload_timed), and
  // the optimizer and parameter offload's exposed host work and copies.
  bool offload_timed = false;
  double exposed_activation_offload_s = 0.0;
  double host_adam_s = 0.0;      // the host AdamW (inside exposed_optimizer_offload_s)
  bool host_adam_timed = false;  // false: no host memory bandwidth was given
  double exposed_optimizer_offload_s = 0.0;
  double optimizer_s = 0.0;      // the device AdamW
  double total_s = 0.0;
  int64_t tokens_per_step = 0;   // every data-parallel rank's
  double tokens_per_s = 0.0;
  double model_flops = 0.0;      // this rank's, per step
  double mfu = 0.0;

  double exposed_comm_s() const { return exposed_dp_comm_s + exposed_tp_comm_s; }
  double exposed_offload_s() const {
    return exposed_activation_offload_s + exposed_optimizer_offload_s;
  }
  nlohmann::ordered_json to_json() const;
};

struct StepTimeInputs {
  int dp_size = 1;             // data-parallel ranks (Config::data_parallel_size())
  // Elements of one tensor-parallel rank's parameters (models::Transformer::layout()
  // .total_elems(), padding included).
  int64_t param_elems = 0;
  // The host memory's bandwidth, for optimizer offload's host AdamW (measure_host_copy
  // _bytes_per_s on the machine that will train); 0: the update is not timed.
  double host_memory_bytes_per_s = 0.0;
};

// Note [Step time]. `plan` is the plan made on `costs`, which must have times (throws
// InvalidArgument otherwise).
StepTimePrediction predict_step_time(const RunOptions& run, const DeviceModel& device,
                                     const checkpoint::Plan& plan,
                                     const checkpoint::ChainCosts& costs,
                                     const StepTimeInputs& inputs);

// The device model of a run (Note [Device models]): on the cpu device calibrated on a cpu
// device made from run.device, with the link at porter.device.sim_link_gbps when set.
DeviceModel run_device_model(const RunOptions& run, const CpuCalibrationOptions& calibration = {});

// run.plan with the links the device model gives where the config leaves them unknown (0):
// the offload link (the host link) and the tensor-parallel gathers' (the collective bus), so
// that a plan on the model's costs times its copies and gathers.
checkpoint::PlanOptions timed_plan_options(const RunOptions& run, const DeviceModel& device);

// Ring collectives over n ranks at `bytes_per_s` each direction (Note [Step time]); 0 for
// one rank.
double ring_all_reduce_s(double bytes, int n, double bytes_per_s);
double ring_reduce_scatter_s(double bytes, int n, double bytes_per_s);  // = all-gather's

}  // namespace porter::engine
