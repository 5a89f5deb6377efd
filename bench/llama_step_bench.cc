// One Llama training step (forward + backward, no optimizer) on the cpu device, f32 and bf16,
// with model FLOP/s against oneDNN's f32 and bf16 gemm rates measured in the same run
// (2048^3), and the allocator's activation peak; and the step's split by kernel
// (BM_LlamaOpSplit). bench/compare_llama.sh runs the step and bench/compare_llama_pytorch.py
// and prints the ratios.
//
// Shapes: layers=4, hidden=768, heads=12, kv_heads=4, intermediate=2048, seq_len=1024,
// micro-batch=2, vocab=8192, untied head (Hugging Face's LlamaConfig default), rope_theta
// 10000, rms eps 1e-5, dropout 0, 2 threads. Override the threads with PORTER_BENCH_THREADS.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "bench/timing_kernels.h"
#include "memory/caching_allocator.h"
#include "memory/device.h"
#include "nn/ctx.h"
#include "models/transformer.h"
#include "kernels/kernels.h"

namespace {

using namespace porter;
using namespace porter::models;

constexpr int64_t kLayers = 4, kHidden = 768, kHeads = 12, kKvHeads = 4, kInter = 2048,
                  kSeq = 1024, kBatch = 2, kVocab = 8192;

int bench_threads() {
  const char* s = std::getenv("PORTER_BENCH_THREADS");
  return s != nullptr ? std::atoi(s) : 2;
}

// Model FLOPs of forward + backward: 3x the forward's, which is 2 N per matmul weight per
// token (q and o C x C, k and v C x (C kv_heads / heads), gate, up and down C x I, the head
// C x V) plus 4 T C per token per layer for the scores and the weighted sum over the full
// T x T, as Narayanan et al.'s GPT formula (bench/gpt_step_bench.cc) counts them; both
// frameworks' kernels compute the full square.
double model_flops() {
  const double n = kBatch * kSeq, t = kSeq, l = kLayers, c = kHidden, v = kVocab;
  const double ckv = c * kKvHeads / kHeads, i = kInter;
  const double weights = l * (2 * c * c + 2 * c * ckv + 3 * c * i) + c * v;
  return 3.0 * (2.0 * n * weights + l * 4.0 * n * t * c);
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
  }
};

Env& env() {
  static Env e;
  return e;
}

// porter's matmul (oneDNN on cpu) at 2048^3 with `dtype` inputs and an f32 output: GFLOP/s,
// best of 5 per call and the best over all calls so far. Each benchmark measures both
// before and after its steps, so one slow moment on a shared machine does not understate
// the peak.
double gemm_peak_gflops(DType dtype) {
  static double best_peak[2] = {0.0, 0.0};
  Env& e = env();
  const int64_t n = 2048;
  auto mk = [&](DType dt, float v) {
    Tensor t = Tensor::empty(*e.alloc, Shape{n, n}, dt, memory::Category::kWorkspace);
    e.kernels->fill(t, v);
    return t;
  };
  Tensor a = mk(dtype, 0.5f), b = mk(dtype, 0.25f), c = mk(DType::kF32, 0.0f);
  e.kernels->matmul(a, b, c);  // warm-up, primitive creation
  double best = 1e30;
  for (int i = 0; i < 5; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    e.kernels->matmul(a, b, c);
    const auto dt = std::chrono::steady_clock::now() - t0;
    best = std::min(best, std::chrono::duration<double>(dt).count());
  }
  double& peak = best_peak[dtype == DType::kF32 ? 0 : 1];
  peak = std::max(peak, 2.0 * n * n * n / best / 1e9);
  return peak;
}

constexpr double kMiB = 1024.0 * 1024.0;

// The bench's Llama with its parameters, gradients and one micro-batch on the env's device.
struct LlamaRun {
  Transformer llama;
  FlatParams flat;
  Tensor tokens, targets;  // (B, T) i32

  static config::ModelConfig config() {
    config::ModelConfig mc;
    mc.type = config::ModelType::kLlama;
    mc.layers = kLayers;
    mc.hidden = kHidden;
    mc.heads = kHeads;
    mc.kv_heads = kKvHeads;
    mc.intermediate = kInter;
    mc.seq_len = kSeq;
    mc.vocab = kVocab;
    mc.dropout = 0.0;
    mc.tie_embeddings = false;
    return mc;
  }

  explicit LlamaRun(DType dtype)
      : llama(config()), flat(*env().alloc, llama.layout(), dtype, DType::kF32) {
    Env& e = env();
    Tensor p = flat.params();
    from_host_f32(*e.device, llama.init_values(1), p);
    llama.bind(flat);
    std::vector<int32_t> tok(static_cast<size_t>(kBatch * kSeq));
    for (size_t i = 0; i < tok.size(); ++i) {
      tok[i] = static_cast<int32_t>((i * 2654435761u) % kVocab);
    }
    auto ids = [&](int shift) {
      Tensor t = Tensor::empty(*e.alloc, Shape{kBatch, kSeq}, DType::kI32,
                               memory::Category::kWorkspace);
      std::vector<int32_t> v(tok.size());
      for (size_t i = 0; i < v.size(); ++i) v[i] = tok[(i + shift) % tok.size()];
      e.device->copy_sync(t.data(), v.data(), t.nbytes());
      return t;
    };
    tokens = ids(0);
    targets = ids(1);
  }

  float step(Kernels& k, Ctx& ctx) {
    Tensor g = flat.grads();
    k.fill(g, 0.0f);
    return llama.forward_backward(ctx, tokens, targets);
  }
};

DType dtype_of(const benchmark::State& state) {
  return state.range(0) == 0 ? DType::kF32 : DType::kBF16;
}

// The check before timing: the untrained model's loss is close to ln(V). This step also
// creates the oneDNN primitives, so what is timed and measured after it is a steady step.
bool loss_ok(benchmark::State& state, float loss) {
  if (std::fabs(loss - std::log(static_cast<float>(kVocab))) < 0.5f) return true;
  state.SkipWithError("loss of the untrained model is not ~ln(V)");
  return false;
}

void BM_LlamaStep(benchmark::State& state) {
  const DType dtype = dtype_of(state);
  Env& e = env();
  gemm_peak_gflops(DType::kF32);
  gemm_peak_gflops(DType::kBF16);
  e.alloc->empty_cache();  // so that the reserved peak is this repetition's alone
  LlamaRun run(dtype);
  Ctx ctx(*e.kernels, *e.alloc, dtype);
  const float loss = run.step(*e.kernels, ctx);
  if (!loss_ok(state, loss)) return;
  e.alloc->reset_peak();
  const memory::MemoryStats before = e.alloc->stats();
  for (auto _ : state) benchmark::DoNotOptimize(run.step(*e.kernels, ctx));
  const memory::MemoryStats after = e.alloc->stats();
  const double peak = gemm_peak_gflops(DType::kF32);
  const double peak_bf16 = gemm_peak_gflops(DType::kBF16);
  const double flops = model_flops();
  state.counters["model_TFLOP"] = flops / 1e12;
  state.counters["GFLOP/s"] =
      benchmark::Counter(flops / 1e9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["tokens"] = static_cast<double>(kBatch * kSeq);
  state.counters["tokens/s"] = benchmark::Counter(static_cast<double>(kBatch * kSeq),
                                                  benchmark::Counter::kIsIterationInvariantRate);
  state.counters["sgemm_peak_GFLOP/s"] = peak;
  state.counters["bf16_gemm_peak_GFLOP/s"] = peak_bf16;
  // Memory, MiB: the activation peak (activations + checkpoints + staging, the quantity a
  // checkpoint policy is judged by), the peak of everything requested during the steps
  // (parameters, gradients, inputs, activations and kernel workspace) with the part that
  // was already live before the first step (parameters, gradients, inputs), and the peak
  // the allocator reserved from the device (requested bytes plus rounding and cached
  // blocks: what the process holds).
  state.counters["act_peak_MiB"] = static_cast<double>(after.peak_activation_bytes) / kMiB;
  state.counters["peak_MiB"] = static_cast<double>(after.peak_requested_bytes) / kMiB;
  state.counters["resident_MiB"] = static_cast<double>(before.requested_bytes) / kMiB;
  state.counters["reserved_peak_MiB"] = static_cast<double>(after.peak_reserved_bytes) / kMiB;
  state.counters["params_MiB"] = static_cast<double>(run.flat.params().nbytes()) / kMiB;
  state.counters["grads_MiB"] = static_cast<double>(run.flat.grads().nbytes()) / kMiB;
  state.counters["threads"] = e.device->threads();
  state.counters["loss"] = loss;
  state.SetLabel(std::string(dtype_name(dtype)));
}

// Iteration time ~ a second: five single-step repetitions, median reported.
BENCHMARK(BM_LlamaStep)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond)->UseRealTime()
    ->Iterations(1)->Repetitions(5)->ReportAggregatesOnly(true);

// Where a step's time goes: every kernel call timed (bench/timing_kernels.h), summed over
// the timed steps and divided by their number. Counters: ms per step of each group of ops,
// and of the step outside any kernel (the Ctx, the allocator, the tape); the per-op table,
// with each matmul shape's GFLOP/s, goes to stderr.
void BM_LlamaOpSplit(benchmark::State& state) {
  const DType dtype = dtype_of(state);
  Env& e = env();
  LlamaRun run(dtype);
  bench::op_split_benchmark(state, run, dtype, *e.kernels, *e.alloc, loss_ok);
}

BENCHMARK(BM_LlamaOpSplit)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond)->UseRealTime()
    ->Iterations(3);

}  // namespace

BENCHMARK_MAIN();
