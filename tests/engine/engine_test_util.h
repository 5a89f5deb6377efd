// Shared set-up of the engine tests: a tiny GPT config, a cpu device and deterministic
// micro-batches.
#pragma once

#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "config/config.h"
#include "engine/data.h"
#include "engine/engine.h"
#include "memory/device.h"

namespace porter::engine::testing {

inline config::Config tiny_config(config::CheckpointPolicy policy = config::CheckpointPolicy::kNone,
                                  double dropout = 0.1, int64_t accumulation = 2,
                                  bool bf16 = false) {
  config::Config c;
  c.train_micro_batch_size_per_gpu = 2;
  c.gradient_accumulation_steps = accumulation;
  c.train_batch_size = 2 * accumulation;
  c.gradient_clipping = 1.0;
  c.bf16.enabled = bf16;
  config::OptimizerConfig opt;
  opt.lr = 1e-2;
  opt.weight_decay = 0.01;
  c.optimizer = opt;
  c.porter.model.layers = 3;
  c.porter.model.hidden = 32;
  c.porter.model.heads = 4;
  c.porter.model.seq_len = 16;
  c.porter.model.vocab = 64;
  c.porter.model.dropout = dropout;
  c.porter.checkpointing.policy = policy;
  c.porter.train.seed = 7;
  return c;
}

inline std::unique_ptr<memory::Device> cpu_device(size_t limit_bytes = size_t{256} << 20) {
  memory::DeviceOptions o;
  o.memory_limit_bytes = limit_bytes;
  o.threads = 1;
  return memory::make_device(o);
}

// Step `step`'s micro-batches: a learnable pattern (the target is a function of the token).
inline std::vector<HostBatch> batches(const config::Config& c, int64_t step) {
  std::vector<HostBatch> out;
  const int64_t b = c.train_micro_batch_size_per_gpu, t = c.porter.model.seq_len;
  const int64_t v = c.porter.model.vocab;
  for (int64_t m = 0; m < c.gradient_accumulation_steps; ++m) {
    HostBatch mb;
    mb.batch = b;
    mb.seq = t;
    for (int64_t i = 0; i < b * t; ++i) {
      const int64_t tok = (i * 7 + m * 13 + step * 5 + (i * i) % 11) % v;
      mb.tokens.push_back(static_cast<int32_t>(tok));
      mb.targets.push_back(static_cast<int32_t>((tok * 3 + 1) % v));
    }
    out.push_back(std::move(mb));
  }
  return out;
}

inline std::unique_ptr<Engine> gpt_engine(memory::Device& device, const config::Config& c) {
  return std::make_unique<Engine>(device, std::make_unique<GptModel>(c.porter.model), c);
}

inline bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// The message of the E that fn throws, or "(no error)".
template <typename E>
std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const E& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace porter::engine::testing
