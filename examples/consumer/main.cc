// A program outside porter's tree, built against the installed package
// (find_package(porter)). It shows two things:
// 1. user-defined layers, written to the nn::Layer contract, trained through the Engine as
//    an engine::ChainModel with a user LossLayer (mean squared error), under full activation
//    checkpointing, printing the loss as it falls and the memory report;
// 2. the simulated device's memory budget: allocate by category, run out of memory on
//    purpose, recover.
#include <cstdio>
#include <memory>
#include <vector>

#include <porter/base/build_config.h>
#include <porter/config/parse.h>
#include <porter/engine/engine.h>
#include <porter/engine/model.h>
#include <porter/memory/caching_allocator.h>
#include <porter/memory/device.h>
#include <porter/nn/ctx.h>
#include <porter/kernels/kernels.h>
#include <porter/nn/layer.h>

#include "user_layers.h"

namespace {

using namespace porter;

// Learn target(token) = (3 * token + 1) mod vocab, scaled to [0, 1), from token ids.
std::vector<io::HostBatch> make_batches(const config::Config& c, int64_t step) {
  std::vector<io::HostBatch> out;
  const int64_t b = c.train_micro_batch_size_per_gpu, t = c.porter.model.seq_len;
  const int64_t v = c.porter.model.vocab;
  for (int64_t m = 0; m < c.gradient_accumulation_steps; ++m) {
    io::HostBatch mb;
    mb.batch = b;
    mb.seq = t;
    for (int64_t i = 0; i < b * t; ++i) {
      const auto tok = static_cast<int32_t>((i * 5 + m * 3 + step * 7) % v);
      mb.tokens.push_back(tok);
      mb.targets.push_back(static_cast<int32_t>((3 * tok + 1) % v));
    }
    out.push_back(std::move(mb));
  }
  return out;
}

int train_user_chain() {
  const char* json = R"({
    "train_batch_size": 8,
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 0,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.03, "weight_decay": 0.0}},
    "porter": {
      "model": {"seq_len": 8, "vocab": 16},
      "device": {"type": "cpu"},
      "checkpointing": {"policy": "full"},
      "train": {"seed": 1}
    }
  })";
  const config::Config c = config::parse_config_string(json).config;
  memory::DeviceOptions options;
  options.memory_limit_bytes = 64u << 20;
  auto device = memory::make_device(options);
  engine::Engine e(*device, engine::example::make_regressor(16, 8, 16), c);
  std::printf("plan: %s\n", e.plan().description.c_str());
  double first = 0, last = 0;
  for (int64_t s = 0; s < 60; ++s) {
    const engine::StepResult r = e.train_step(make_batches(c, s));
    if (s == 0) first = r.loss;
    last = r.loss;
    if (s % 10 == 0 || s == 59) std::printf("step %3lld  loss %.5f\n", static_cast<long long>(r.step), r.loss);
  }
  std::printf("%s", e.memory_report().format().c_str());
  if (!(last < 0.2 * first)) {
    std::printf("unexpected: the loss did not fall (%.5f -> %.5f)\n", first, last);
    return 1;
  }
  return 0;
}

int memory_budget_demo() {
  using namespace porter::memory;
  DeviceOptions options;
  options.kind = DeviceKind::kCpu;
  options.memory_limit_bytes = 64u << 20;
  auto device = make_device(options);
  CachingAllocator allocator(*device);

  DeviceBuffer params = allocator.allocate(16u << 20, Category::kParams);
  DeviceBuffer acts = allocator.allocate(40u << 20, Category::kActivations);
  try {
    DeviceBuffer too_much = allocator.allocate(16u << 20, Category::kWorkspace);
    std::printf("unexpected: the 64 MiB device accepted 72 MiB\n");
    return 1;
  } catch (const porter::OutOfMemoryError& e) {
    std::printf("porter %s caught the expected out-of-memory:\n%s\n", PORTER_VERSION, e.what());
  }
  acts.reset();
  DeviceBuffer retry = allocator.allocate(16u << 20, Category::kWorkspace);
  std::printf("after freeing activations the retry succeeded:\n%s",
              format_stats(allocator.stats()).c_str());
  return retry.empty() ? 1 : 0;
}

}  // namespace

int main() {
  if (int rc = train_user_chain(); rc != 0) return rc;
  return memory_budget_demo();
}
