// One GPT training step (forward + backward, no optimizer) on the cpu device, f32 and bf16,
// with model FLOP/s against oneDNN's sgemm rate measured in the same run (2048^3).
// bench/compare_step.sh runs this and bench/compare_pytorch.py and prints the ratio.
//
// Shapes: layers=6, hidden=768, heads=12, seq_len=512, micro-batch=4, vocab=8192, tied head,
// dropout 0 (PyTorch's dropout masks differ, and the comparison times the same math), 2
// threads. Override with PORTER_BENCH_THREADS.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <memory>

#include "memory/caching_allocator.h"
#include "memory/device.h"
#include "kernels/kernel_table.h"
#include "nn/ctx.h"
#include "models/transformer.h"
#include "kernels/kernels.h"
#include "bench/timing_kernels.h"

namespace {

using namespace porter;
using namespace porter::models;

constexpr int64_t kLayers = 6, kHidden = 768, kHeads = 12, kSeq = 512, kBatch = 4, kVocab = 8192;

int bench_threads() {
  const char* s = std::getenv("PORTER_BENCH_THREADS");
  return s != nullptr ? std::atoi(s) : 2;
}

// Model FLOPs of forward + backward (Narayanan et al. 2021, eq. 3 without recompute):
// 72 B T L C^2 (1 + T / (6 C) + V / (12 L C)). Attention counts the full T x T scores, as
// that formula does; porter's and PyTorch's kernels both compute them.
double model_flops() {
  const double b = kBatch, t = kSeq, l = kLayers, c = kHidden, v = kVocab;
  return 72.0 * b * t * l * c * c * (1.0 + t / (6.0 * c) + v / (12.0 * l * c));
}

struct Env {
  std::unique_ptr<memory::Device> device;
  std::unique_ptr<memory::CachingAllocator> alloc;
  std::unique_ptr<Kernels> kernels;
  Env() {
    memory::DeviceOptions o;
    o.memory_limit_bytes = size_t{12} << 30;
    o.threads = bench_threads();
    device = memory::make_device(o);
    alloc = std::make_unique<memory::CachingAllocator>(*device, memory::AllocatorOptions{false});
    kernels = make_kernels(*alloc);
    // porter.device.kernel_choice (Note [Kernel table]): exact unless
    // PORTER_BENCH_KERNEL_CHOICE says fastest.
    const char* choice = std::getenv("PORTER_BENCH_KERNEL_CHOICE");
    kernels->kernel_table().set_mode(
        kernel_choice_from_name(choice != nullptr ? choice : "exact", "PORTER_BENCH_KERNEL_CHOICE"));
  }
};

Env& env() {
  static Env e;
  return e;
}

// oneDNN sgemm 2048^3 (porter's matmul, which is oneDNN on cpu): GFLOP/s, best of 5 per
// call, and the best over all calls so far. Each benchmark measures it before and after its
// steps, so one slow moment on a shared machine does not understate the peak.
double sgemm_peak_gflops() {
  static double best_peak = 0.0;
  const double peak = [] {
    Env& e = env();
    const int64_t n = 2048;
    auto mk = [&](float v) {
      Tensor t = Tensor::empty(*e.alloc, Shape{n, n}, DType::kF32, memory::Category::kWorkspace);
      e.kernels->fill(t, v);
      return t;
    };
    Tensor a = mk(0.5f), b = mk(0.25f), c = mk(0.0f);
    e.kernels->matmul(a, b, c);  // warm-up, primitive creation
    double best = 1e30;
    for (int i = 0; i < 5; ++i) {
      auto t0 = std::chrono::steady_clock::now();
      e.kernels->matmul(a, b, c);
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    return 2.0 * n * n * n / best / 1e9;
  }();
  best_peak = std::max(best_peak, peak);
  return best_peak;
}

// The benchmark's model, parameters and batch in one dtype.
struct GptRun {
  explicit GptRun(DType dtype) : gpt(model_config()), flat(*env().alloc, gpt.layout(), dtype, DType::kF32) {
    Env& e = env();
    Tensor p = flat.params();
    from_host_f32(*e.device, gpt.init_values(1), p);
    gpt.bind(flat);
    std::vector<int32_t> tok(static_cast<size_t>(kBatch * kSeq));
    for (size_t i = 0; i < tok.size(); ++i) tok[i] = static_cast<int32_t>((i * 2654435761u) % kVocab);
    auto ids = [&](int shift) {
      Tensor t = Tensor::empty(*e.alloc, Shape{kBatch, kSeq}, DType::kI32, memory::Category::kWorkspace);
      std::vector<int32_t> v(tok.size());
      for (size_t i = 0; i < v.size(); ++i) v[i] = tok[(i + shift) % tok.size()];
      e.device->copy_sync(t.data(), v.data(), t.nbytes());
      return t;
    };
    tokens = ids(0);
    targets = ids(1);
  }
  static config::ModelConfig model_config() {
    config::ModelConfig mc;
    mc.layers = kLayers;
    mc.hidden = kHidden;
    mc.heads = kHeads;
    mc.seq_len = kSeq;
    mc.vocab = kVocab;
    mc.dropout = 0.0;
    mc.tie_embeddings = true;
    return mc;
  }
  // One step: gradients zeroed, forward and backward; the loss.
  float step(Kernels& k, Ctx& ctx) {
    Tensor g = flat.grads();
    k.fill(g, 0.0f);
    return gpt.forward_backward(ctx, tokens, targets);
  }

  Transformer gpt;
  FlatParams flat;
  Tensor tokens, targets;
};

// The untrained model's loss is close to ln(V): checked once, before timing.
bool loss_ok(benchmark::State& state, float loss) {
  if (std::fabs(loss - std::log(static_cast<float>(kVocab))) < 0.5f) return true;
  state.SkipWithError("loss of the untrained model is not ~ln(V)");
  return false;
}

DType dtype_of(const benchmark::State& state) {
  return state.range(0) == 0 ? DType::kF32 : DType::kBF16;
}

void BM_GptStep(benchmark::State& state) {
  const DType dtype = dtype_of(state);
  Env& e = env();
  sgemm_peak_gflops();
  GptRun run(dtype);
  Ctx ctx(*e.kernels, *e.alloc, dtype);
  const float loss = run.step(*e.kernels, ctx);
  if (!loss_ok(state, loss)) return;
  for (auto _ : state) benchmark::DoNotOptimize(run.step(*e.kernels, ctx));
  const double peak = sgemm_peak_gflops();
  const double flops = model_flops();
  state.counters["model_TFLOP"] = flops / 1e12;
  state.counters["GFLOP/s"] = benchmark::Counter(flops / 1e9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["sgemm_peak_GFLOP/s"] = peak;
  state.counters["threads"] = e.device->threads();
  state.counters["loss"] = loss;
  state.SetLabel(std::string(dtype_name(dtype)));
}

// Iteration time ~ seconds: five single-step repetitions, median reported.
BENCHMARK(BM_GptStep)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond)->UseRealTime()
    ->Iterations(1)->Repetitions(5)->ReportAggregatesOnly(true);

// Where a step's time goes: every kernel call timed (bench/timing_kernels.h), summed over
// the timed steps and divided by their number. Counters: ms per step of each group of ops,
// and of the step outside any kernel; the per-op table, with each matmul shape's GFLOP/s,
// goes to stderr.
void BM_GptOpSplit(benchmark::State& state) {
  const DType dtype = dtype_of(state);
  Env& e = env();
  GptRun run(dtype);
  bench::op_split_benchmark(state, run, dtype, *e.kernels, *e.alloc, loss_ok);
}

BENCHMARK(BM_GptOpSplit)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond)->UseRealTime()
    ->Iterations(3);

}  // namespace

BENCHMARK_MAIN();
