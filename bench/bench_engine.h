// Shared by the engine benchmarks (checkpoint_bench, offload_bench): an Engine on its own
// device with a data source, built from a Config, and the median of a sample.
#pragma once

#include <algorithm>
#include <memory>
#include <vector>

#include "config/config.h"
#include "io/data.h"
#include "engine/engine.h"
#include "engine/model.h"
#include "memory/device.h"

namespace porter::bench {

struct EngineRun {
  std::unique_ptr<memory::Device> device;
  std::unique_ptr<engine::Engine> engine;
  std::unique_ptr<io::DataSource> data;
};

// A cpu device with the config's memory and pinned limits, simulated link and threads, and
// the built-in GPT on it.
inline EngineRun make_engine_run(const config::Config& cfg) {
  EngineRun r;
  memory::DeviceOptions o;
  o.memory_limit_bytes = cfg.porter.device.memory_limit_bytes.value_or(0);
  o.pinned_limit_bytes = cfg.porter.device.pinned_limit_bytes.value_or(0);
  o.sim_link_gbps = cfg.porter.device.sim_link_gbps.value_or(0.0);
  o.threads = static_cast<int>(cfg.porter.device.threads);
  r.device = memory::make_device(o);
  r.engine = std::make_unique<engine::Engine>(
      *r.device, std::make_unique<engine::TransformerModel>(cfg.porter.model), cfg);
  r.data = std::make_unique<io::DataSource>(cfg.porter.data, cfg.porter.model.vocab,
                                                cfg.train_micro_batch_size_per_gpu,
                                                cfg.porter.model.seq_len);
  return r;
}

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n == 0 ? 0.0 : n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace porter::bench
