// Note [Forecast] (forecast.h).
#include "engine/forecast.h"

#include <algorithm>
#include <cstdlib>
#include <thread>

#include "base/error.h"
#include "base/units.h"
#include "engine/model.h"
#include "engine/stage3.h"

namespace porter::engine {

int64_t Forecast::margin_bytes() const {
  if (!capacity_bytes) return 0;
  return static_cast<int64_t>(*capacity_bytes) - static_cast<int64_t>(total_peak_bytes);
}

std::string Forecast::verdict() const {
  if (!capacity_bytes) {
    return "needs " + format_bytes(total_peak_bytes) +
           " per rank; the device's memory is unknown (set porter.device.memory_limit or "
           "porter.device.model)";
  }
  const int64_t m = margin_bytes();
  if (m >= 0) {
    return "fits: " + format_bytes(total_peak_bytes) + " of " + format_bytes(*capacity_bytes) +
           " per rank (" + format_bytes(static_cast<uint64_t>(m)) + " free)";
  }
  return "does not fit: needs " + format_bytes(total_peak_bytes) + " per rank, " +
         format_bytes(static_cast<uint64_t>(-m)) + " more than the " +
         format_bytes(*capacity_bytes) + " device";
}

DeviceModel forecast_device_model(const RunOptions& run, config::GpuModel default_gpu,
                                  bool* defaulted) {
  DeviceModelOptions o = run.device_model;
  const bool cuda = run.device.kind != memory::DeviceKind::kCpu;
  if (defaulted) *defaulted = cuda && !o.model;
  if (cuda && !o.model) o.model = default_gpu;
  if (o.model) return resolve_device_model(o, run.device.kind, run.compute_dtype, [] { return DeviceModel{}; });
  return run_device_model(run);
}

DeviceModel nominal_cpu_device_model(size_t memory_bytes) {
  DeviceModel m;
  m.name = "cpu";
  m.source = "nominal";
  m.f32_flops_per_s = 100e9;
  m.bf16_flops_per_s = 100e9;
  m.fp16_flops_per_s = 100e9;
  m.hbm_bytes_per_s = 20e9;
  m.host_link_bytes_per_s = 10e9;
  m.memory_bytes = memory_bytes;
  return m;
}

int host_threads(const RunOptions& run) {
  return run.device.threads > 0 ? run.device.threads
                                : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

RankStates rank_states(const RunOptions& run, const checkpoint::ChainCosts& costs, int dp_size) {
  TransformerModel model(run.shape.model);  // the layout only; allocates nothing
  RankStates s;
  s.param_elems = model.layout().total_elems();
  const zero::Partition part = zero::make_partition(s.param_elems, dp_size);
  const zero::StateDTypes dtypes = run.state_dtypes();
  const int stage = run.zero_stage();
  const zero::OptimizerOptions& zo = run.optimizer;
  const bool opt = zo.offload.enabled, params = zo.param_offload.enabled;
  const double ratio = opt ? zo.offload.ratio : 1.0;
  s.device = zero::device_state_bytes(zero::exact_bytes(part, stage, dtypes), part, stage, dtypes, opt,
                                      ratio, params);
  s.persistent_bytes = costs.params.enabled ? costs.params.persistent_bytes() : 0;
  s.device.params += s.persistent_bytes;
  s.host = zero::host_state_bytes(part, stage, dtypes, opt, params, zo.offload.pin_memory,
                                  zo.param_offload.pin_memory, ratio);
  return s;
}

namespace {

// Whether `config` fits its device by the analytic model's bytes: the total peak per rank of
// its plan made on untimed costs, as porter estimate's policy table makes it (no roofline and
// no step-time prediction, which at 100,000 layers take minutes where this takes a second).
// A plan whose choice depends on times (optimal, offload) may choose differently from the
// timed forecast; a fixed policy's bytes are the same. Without a capacity, true.
bool fits_by_bytes(const config::Config& config, const ForecastOptions& options) {
  const RunOptions run = make_run_options(config);
  std::optional<size_t> capacity = options.capacity_bytes ? options.capacity_bytes : run.capacity_bytes;
  if (!capacity) {
    const DeviceModel d =
        options.device ? *options.device : forecast_device_model(run, options.default_gpu, nullptr);
    if (d.memory_bytes > 0) capacity = d.memory_bytes;
  }
  if (!capacity) return true;
  const int dp = static_cast<int>(config.data_parallel_size());
  checkpoint::ChainCosts costs = run.analytic_costs();
  add_zero_costs(costs, run, dp);
  const checkpoint::Plan plan = checkpoint::make_plan(run.plan, costs);
  const RankStates states = rank_states(run, costs, dp);
  return run.predicted_peak_bytes(states.device.total(), plan.prediction) <= *capacity;
}

}  // namespace

config::AttentionKind resolve_attention(const config::Config& config,
                                        const ForecastOptions& options) {
  const config::AttentionKind asked = config.porter.model.attention;
  if (asked != config::AttentionKind::kAuto) return asked;
  // Measured on the cpu (docs/benchmarks.md, "Flash attention"): from T = 8192 the flash
  // kernels are faster as well as smaller, the probabilities no longer staying in cache.
  constexpr int64_t kCpuFlashFasterFrom = 8192;
  if (make_run_options(config).device.kind == memory::DeviceKind::kCpu &&
      config.porter.model.seq_len >= kCpuFlashFasterFrom) {
    return config::AttentionKind::kFlash;
  }
  config::Config materialized = config;
  materialized.porter.model.attention = config::AttentionKind::kMaterialized;
  try {
    if (fits_by_bytes(resolve_tiles(materialized, options), options)) {
      return config::AttentionKind::kMaterialized;
    }
  } catch (const InvalidArgument&) {
    // A budget below the smallest materialised plan, or probabilities that overflow.
  }
  return config::AttentionKind::kFlash;
}

config::Config resolve_tiles(const config::Config& config, const ForecastOptions& options) {
  const config::ModelConfig& m = config.porter.model;
  const bool loss = m.loss_tiles == 0;
  const bool mlp = m.mlp_tiles == 0;
  config::Config c = config;
  if (mlp && m.sequence_parallel) c.porter.model.mlp_tiles = 1;
  if (!loss && (!mlp || m.sequence_parallel)) return c;
  const int64_t rows = std::max<int64_t>(1, config.train_micro_batch_size_per_gpu * m.seq_len);
  for (int64_t k = 1; k <= 256; k *= 2) {
    const int64_t tiles = std::min(k, rows);
    if (loss) c.porter.model.loss_tiles = tiles;
    if (mlp && !m.sequence_parallel) c.porter.model.mlp_tiles = tiles;
    try {
      if (fits_by_bytes(c, options)) return c;
    } catch (const InvalidArgument&) {
      // A budget below this count's smallest plan: try more tiles.
    }
    if (tiles == rows) break;
  }
  return c;
}

int64_t resolve_loss_tiles(const config::Config& config, const ForecastOptions& options) {
  return resolve_tiles(config, options).porter.model.loss_tiles;
}

config::Config resolve_model_choices(const config::Config& config,
                                     const ForecastOptions& options) {
  config::Config c = config;
  c.porter.model.attention = resolve_attention(config, options);
  return resolve_tiles(c, options);
}

Forecast forecast(const config::Config& given, const ForecastOptions& options) {
  const config::Config config = resolve_model_choices(given, options);
  Forecast f;
  f.config = config;
  f.run = make_run_options(config);
  f.dp_size = static_cast<int>(config.data_parallel_size());
  f.device = options.device ? *options.device
                            : forecast_device_model(f.run, options.default_gpu, &f.default_device);
  f.costs = roofline_costs(f.run.analytic_costs(), f.device, f.run.compute_dtype);
  add_zero_costs(f.costs, f.run, f.dp_size);
  f.plan = checkpoint::make_plan(timed_plan_options(f.run, f.device), f.costs, options.progress);
  const RankStates states = rank_states(f.run, f.costs, f.dp_size);
  f.param_elems = states.param_elems;
  f.model_states = states.device;
  f.host_states = states.host;
  f.batch_bytes = f.run.batch_bytes;
  f.total_peak_bytes = f.run.predicted_peak_bytes(f.model_states.total(), f.plan.prediction);
  f.capacity_bytes = options.capacity_bytes ? options.capacity_bytes : f.run.capacity_bytes;
  if (!f.capacity_bytes && f.device.memory_bytes > 0) f.capacity_bytes = f.device.memory_bytes;
  StepTimeInputs in;
  in.dp_size = f.dp_size;
  in.param_elems = f.param_elems;
  if (f.run.optimizer.offload.enabled && options.host_memory_bytes_per_s) {
    in.host_memory_bytes_per_s = *options.host_memory_bytes_per_s;
  } else if (f.run.optimizer.offload.enabled && options.time_host_update) {
    const int threads = host_threads(f.run);
    in.host_memory_bytes_per_s = measure_host_copy_bytes_per_s(size_t{32} << 20, threads);
  }
  f.time = predict_step_time(f.run, f.device, f.plan, f.costs, in);
  return f;
}

}  // namespace porter::engine
