// porter::engine::Forecast: what one rank of a run needs and how long its step takes,
// predicted from the config alone: nothing of the model is allocated, no device is opened
// (beyond the cpu device's short calibration when no device model is named). `porter plan`,
// `porter estimate`'s verdict, `porter plan --fit` and `porter train`'s preflight all read it.
//
// Note [Forecast]
// Bytes are exact: the model states at the configured ZeRO stage, world size and offload
// (Note [Model-state bytes per rank] in zero/partition.h), stage 3's persistent units, one
// micro-batch's token ids and targets, and the plan's predicted peak of everything else in
// the step (activations, checkpoints, staging, workspace, stage 3's gathered parameters and
// the gradient buckets, Note [Gradient buckets in the footprint]). Their sum is the total the
// Engine's memory report predicts and, on the cpu device, measures to the byte. Times come
// from the device model's roofline (Note [Device models], Note [Roofline times]), which are
// floors. The plan is made on those timed costs, so the optimal policy and offload plan
// without the hardware.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "checkpoint/planner.h"
#include "config/config.h"
#include "engine/device_model.h"
#include "engine/run_options.h"
#include "engine/step_time.h"
#include "zero/partition.h"

namespace porter::engine {

struct ForecastOptions {
  // The device model to time with; none: resolved from the config (Note [Device models]),
  // with a cuda device that names none planned as `default_gpu`.
  std::optional<DeviceModel> device;
  config::GpuModel default_gpu = config::GpuModel::kH100Sxm;
  // The device's memory when it is open (porter train's preflight); none: the configured
  // limit, else the device model's memory.
  std::optional<size_t> capacity_bytes;
  // Measure the host's memory bandwidth for optimizer offload's host update (a few ms).
  bool time_host_update = true;
  // The host's memory bandwidth when already measured (skips the measurement).
  std::optional<double> host_memory_bytes_per_s;
  // Hears the optimal planner's solves (checkpoint::make_plan's progress).
  checkpoint::PlanProgressFn progress;
};

// Figures of the cpu device that need no measurement, for forecasts that want bytes, not
// times (porter train's preflight): the plan's choices that depend on times (optimal,
// offload) are made on them, so its peak may differ from the training run's profiled plan by
// the choice, never by the accounting.
DeviceModel nominal_cpu_device_model(size_t memory_bytes);

struct Forecast {
  config::Config config;  // the config forecast (its world size, tensor parallelism)
  RunOptions run;
  int dp_size = 1;
  DeviceModel device;
  bool default_device = false;  // a cuda device without porter.device.model
  checkpoint::ChainCosts costs;  // the analytic model's, timed on `device`
  checkpoint::Plan plan;
  int64_t param_elems = 0;       // this tensor-parallel rank's flat parameters
  zero::StateBytes model_states;  // on the device, stage 3's persistent units included
  zero::HostStateBytes host_states;
  size_t batch_bytes = 0;
  size_t total_peak_bytes = 0;   // model states + batch + the plan's total peak
  std::optional<size_t> capacity_bytes;  // the configured limit, else the device model's memory
  StepTimePrediction time;

  bool fits() const { return capacity_bytes && total_peak_bytes <= *capacity_bytes; }
  // Capacity minus total: the headroom when it fits, negative by the shortfall when not.
  int64_t margin_bytes() const;
  // "fits: 61.20 GiB of 80.00 GiB (18.80 GiB free)" or "does not fit: needs 95.30 GiB, 15.30
  // GiB more than the 80.00 GiB device"; without a capacity, says it is unknown.
  std::string verdict() const;
};

// Note [Forecast]. Throws InvalidArgument for what the planner refuses (a budget below the
// smallest plan, an overflowing shape). With porter.model.attention "auto" the forecast is
// of the resolved choice (Note [Attention choice]), which f.config holds.
Forecast forecast(const config::Config& config, const ForecastOptions& options = {});

// Note [Attention choice]
// porter.model.attention says which attention kernels the blocks run: "materialized" keeps
// each block's (B, H, T, T) f32 probabilities for backward, "flash" keeps its (B, H, T) row
// log-sum-exp and recomputes the scores tile by tile in backward (Note [Flash attention] in
// kernels/kernels.cc). "auto" is resolved once, from the config, before a model is built
// (porter train, plan and estimate, and the Engine's callers through this function): the
// run is forecast with the materialised attention under its own policy, ZeRO stage, offload
// and budget (its plan made on the analytic bytes, untimed, as porter estimate makes it);
// where that total fits the device (or the capacity is unknown) the choice is
// "materialized", otherwise "flash". On the cpu device, from porter.model.seq_len 8192 the
// choice is "flash" either way: there the flash kernels measured faster too, below it the
// materialised ones 2-15% faster in f32 and level in bf16 (docs/benchmarks.md, "Flash
// attention"). On cuda the speeds have not been measured on a GPU, so only the bytes decide. The bytes compared are the analytic model's exact
// figures for both. The choice depends on the config and the capacity alone, never on a
// timing, so every rank and every restart of a run makes the same one, and the report names
// it (resolved_config). porter.model.loss_tiles 0 is chosen the same way, after the
// attention: the fewest loss tiles with which the forecast fits (resolve_loss_tiles). With
// both left to porter, the materialised attention is forecast with its own fewest tiles. The two give different bits (Note [Flash attention]); a run resumed
// under the other choice continues within f32 rounding.
config::AttentionKind resolve_attention(const config::Config& config,
                                        const ForecastOptions& options = {});
// porter.model.loss_tiles and mlp_tiles 0 (Note [Loss tiles] in models/transformer.cc, Note
// [MLP tiles] in models/blocks.cc), resolved like the attention and after it: both left to
// porter take the same count, the fewest of 1, 2, 4, ... 256 (at most the token rows; mlp
// tiles stay 1 under sequence parallelism) with which the forecast total fits the device,
// else the most of them. A value the config gives is kept.
config::Config resolve_tiles(const config::Config& config, const ForecastOptions& options = {});
// resolve_tiles's loss tile count.
int64_t resolve_loss_tiles(const config::Config& config, const ForecastOptions& options = {});
// Both choices, in that order, into a copy of `config`.
config::Config resolve_model_choices(const config::Config& config,
                                     const ForecastOptions& options = {});

// The device model a forecast of `config` times with (Note [Device models]; a cuda device
// without porter.device.model is `default_gpu`, and *defaulted says so).
DeviceModel forecast_device_model(const RunOptions& run, config::GpuModel default_gpu,
                                  bool* defaulted = nullptr);

// The host threads a run's cpu work uses: porter.device.threads, else every hardware thread.
int host_threads(const RunOptions& run);

// Model states per rank on the device and the host for a run, as porter estimate lists them
// (the optimizer and parameter offload of the config applied).
struct RankStates {
  zero::StateBytes device;
  zero::HostStateBytes host;
  int64_t param_elems = 0;
  size_t persistent_bytes = 0;  // stage 3's persistent units (in device.params)
};
RankStates rank_states(const RunOptions& run, const checkpoint::ChainCosts& costs, int dp_size);

}  // namespace porter::engine
