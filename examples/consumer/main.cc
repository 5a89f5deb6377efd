// A program outside porter's tree, built against the installed package
// (find_package(porter)). It shows three things:
// 1. a float-feature regressor composed from the layer library (nn/library.h: no backward
//    written by hand), fed by batches of named tensors, trained through the Engine at ZeRO
//    stage 2 on 2 ranks: the program starts itself twice as a launcher would (RANK,
//    WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and each rank joins with porter::init_distributed;
//    both ranks print the loss as it falls and must end with the same parameters;
// 2. user-defined layers, written to the nn::Layer contract, trained through the Engine as
//    an engine::ChainModel with a user LossLayer (mean squared error), under full activation
//    checkpointing, printing the loss as it falls and the memory report;
// 3. the simulated device's memory budget: allocate by category, run out of memory on
//    purpose, recover.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <porter/base/build_config.h>
#include <porter/config/parse.h>
#include <porter/engine/distributed.h>
#include <porter/engine/engine.h>
#include <porter/engine/model.h>
#include <porter/memory/caching_allocator.h>
#include <porter/memory/device.h>
#include <porter/nn/ctx.h>
#include <porter/kernels/kernels.h>
#include <porter/nn/layer.h>
#include <porter/nn/library.h>

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

// y = tanh(sum_j c_j x_j) for fixed c: a regression on 16 float features. Each rank's
// micro-batches are its own (a pure function of step, rank and micro-batch).
std::vector<io::HostBatch> feature_batches(int64_t step, int rank, int64_t rows, int64_t accumulation) {
  std::vector<io::HostBatch> out;
  for (int64_t m = 0; m < accumulation; ++m) {
    std::vector<float> x(static_cast<size_t>(rows * 16)), y(static_cast<size_t>(rows));
    for (size_t i = 0; i < x.size(); ++i) {
      x[i] = static_cast<float>(std::sin(0.37 * double(i) + 1.3 * double(step * 8 + rank * 2 + m)));
    }
    for (int64_t r = 0; r < rows; ++r) {
      double s = 0;
      for (int j = 0; j < 16; ++j) s += (j % 3 - 1) * 0.25 * x[static_cast<size_t>(r * 16 + j)];
      y[static_cast<size_t>(r)] = static_cast<float>(std::tanh(s));
    }
    io::HostBatch mb;
    mb.tensors.push_back(io::HostTensor::of("x", tensor::Shape{rows, 16}, std::move(x)));
    mb.tensors.push_back(io::HostTensor::of("y", tensor::Shape{rows, 1}, std::move(y)));
    out.push_back(std::move(mb));
  }
  return out;
}

// The regressor, composed from library layers: nothing here writes a backward.
std::unique_ptr<engine::LayerModel> make_library_regressor() {
  using namespace porter::nn;
  std::vector<std::unique_ptr<Module>> stages;
  auto in = std::make_unique<Sequential>();
  in->add("fc", std::make_unique<Linear>(16, 64)).add("act", std::make_unique<ReLU>());
  auto block = std::make_unique<Sequential>();
  block->add("norm", std::make_unique<LayerNorm>(64))
      .add("fc1", std::make_unique<Linear>(64, 128))
      .add("act", std::make_unique<SiLU>())
      .add("fc2", std::make_unique<Linear>(128, 64));
  auto mid = std::make_unique<Sequential>();
  mid->add("residual", std::make_unique<Residual>(std::move(block)));
  auto out = std::make_unique<Sequential>();
  out->add("norm", std::make_unique<RMSNorm>(64)).add("fc", std::make_unique<Linear>(64, 1));
  stages.push_back(std::move(in));
  stages.push_back(std::move(mid));
  stages.push_back(std::move(out));
  std::vector<engine::BatchField> batch = {{"x", tensor::DType::kF32, tensor::Shape{16}},
                                           {"y", tensor::DType::kF32, tensor::Shape{1}}};
  return std::make_unique<engine::LayerModel>(std::move(stages), std::make_unique<MseLoss>(),
                                              std::move(batch), "x", "y");
}

// One rank of the ZeRO-2 run, started by run_two_ranks with a launcher's environment.
int train_library_rank() {
  const char* json = R"({
    "train_batch_size": 64,
    "train_micro_batch_size_per_gpu": 16,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.003, "weight_decay": 0.01}},
    "zero_optimization": {"stage": 2, "reduce_bucket_size": 4000, "overlap_comm": true},
    "porter": {
      "device": {"type": "cpu"},
      "checkpointing": {"policy": "full"},
      "comm": {"timeout_s": 60},
      "train": {"seed": 1}
    }
  })";
  memory::DeviceOptions options;
  options.memory_limit_bytes = 64u << 20;
  auto device = memory::make_device(options);
  // The launcher's world size checks the batch triple (64 = 16 x 2 x 2 ranks).
  config::ParseOptions po;
  po.world_size = 2;
  const config::Config c = config::parse_config_string(json, po).config;
  const Distributed world = init_distributed(*device, c);
  engine::Engine e(*device, make_library_regressor(), c, world.groups);
  const int rank = world.rank();
  if (rank == 0) std::printf("library regressor, ZeRO-2 on %d ranks: %s\n", world.world_size(), e.plan().description.c_str());
  double first = 0, last = 0;
  for (int64_t s = 0; s < 40; ++s) {
    const engine::StepResult r = e.train_step(feature_batches(s, rank, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps));
    if (s == 0) first = r.loss;
    last = r.loss;
    if (rank == 0 && (s % 10 == 0 || s == 39)) std::printf("step %3lld  loss %.5f\n", static_cast<long long>(r.step), r.loss);
  }
  // Both ranks hold the same parameters after the all-gathers: compare a checksum through
  // rank 0's output (each rank prints its own).
  const std::vector<float> p = e.params_host();
  double sum = 0;
  for (float v : p) sum += double(v) * double(v);
  std::printf("rank %d: %zu parameters, sum of squares %.9g\n", rank, p.size(), sum);
  if (!(last < 0.5 * first)) {
    std::printf("rank %d: unexpected: the loss did not fall (%.5f -> %.5f)\n", rank, first, last);
    return 1;
  }
  return 0;
}

// Starts this program twice with a launcher's environment (torchrun's variables) and waits
// for both ranks.
int run_two_ranks(const char* self) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);  // a free port for rank 0's store
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  if (fd < 0 || bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    std::perror("porter_consumer: finding a free port");
    return 1;
  }
  const std::string port = std::to_string(ntohs(addr.sin_port));
  close(fd);
  // A secret only the two ranks know admits them to rank 0's store.
  std::random_device entropy;
  char token[33];
  for (int i = 0; i < 4; ++i) std::snprintf(token + 8 * i, 9, "%08x", entropy());
  std::fflush(stdout);
  pid_t pids[2];
  for (int rank = 0; rank < 2; ++rank) {
    pids[rank] = fork();
    if (pids[rank] < 0) {
      std::perror("porter_consumer: fork");
      return 1;
    }
    if (pids[rank] == 0) {
      setenv("RANK", std::to_string(rank).c_str(), 1);
      setenv("LOCAL_RANK", std::to_string(rank).c_str(), 1);
      setenv("WORLD_SIZE", "2", 1);
      setenv("LOCAL_WORLD_SIZE", "2", 1);
      setenv("MASTER_ADDR", "127.0.0.1", 1);
      setenv("MASTER_PORT", port.c_str(), 1);
      setenv("PORTER_STORE_TOKEN", token, 1);
      execl(self, self, static_cast<char*>(nullptr));
      std::perror("porter_consumer: exec");
      _exit(127);
    }
  }
  int failed = 0;
  for (pid_t pid : pids) {
    int status = 0;
    waitpid(pid, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) ++failed;
  }
  if (failed > 0) std::printf("unexpected: %d of 2 ranks failed\n", failed);
  return failed > 0 ? 1 : 0;
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

int main(int argc, char** argv) {
  (void)argc;
  if (std::getenv("RANK") != nullptr) return train_library_rank();  // a rank of run_two_ranks
  if (int rc = run_two_ranks("/proc/self/exe"); rc != 0) return rc;
  if (int rc = train_user_chain(); rc != 0) return rc;
  (void)argv;
  return memory_budget_demo();
}
