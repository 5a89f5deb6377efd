// Every matmul of the GPT step that bench/gpt_step_bench.cc times (B = 4, T = 512, C = 768,
// 12 heads, vocab 8192, tied head), one row each: the Linears' forward, dgrad and wgrad in all
// four transpose forms, f32 and bf16, and the attention's batched matmuls at porter's strides.
// A row reports its median time, GFLOP/s, the ratio to a peak measured in this process, and
// the oneDNN implementation chosen; it is checked against oneDNN's sgemm before it is timed.
//
// Note [Sweep forms]
// Porter stores a Linear's weight (out, in) and computes forward y = x W^T (NT), dgrad
// dx = dy W (NN) and wgrad dW += dy^T x (TN, beta = 1), Ctx::linear and linear_backward in
// nn/gpt_blocks.cc. Each is also timed with its operands stored in the other layouts (the
// same M, N, K), so a slow form shows whether a relayout would pay. In a bf16 run the
// activations are bf16, so forward and dgrad write bf16 and wgrad accumulates into the f32
// gradients; the bf16 rows do the same. The attention rows are the calls of one row block:
// f32 on strided views of qkv (Note [Causal row blocks] in kernels/cpu/attention.cc), bf16 on the
// packed per-head copies (Note [Bf16 attention]). Where porter runs its own attention head tiles
// instead (Note [Attention head tiles] in kernels/cpu/attention_heads.cc), the attn/call rows time
// whole forward and backward calls, softmax included, since the tiles' products are not
// separate calls.
//
// Note [Sweep peaks]
// f32: oneDNN's sgemm at 2048^3, best of 5. bf16: porter's bf16 matmul (bf16 operands, f32
// out) on squares of 1024 to 4096, the best rate of any. Both are measured before the rows
// and again after them, each retried like a contended row (kQuietCpuUtil); the summary on
// stderr divides by the best of all, so a busy moment on a shared machine does not
// understate the peak. A row's own of_peak counter divides by the peak known when it ran
// (the one before), so it can only read higher than the summary.
#include <benchmark/benchmark.h>

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <memory>
#include <oneapi/dnnl/dnnl.h>
#include <string>
#include <thread>
#include <vector>

#include "memory/caching_allocator.h"
#include "memory/device.h"
#include "kernels/cpu/attention_heads.h"
#include "kernels/kernel_table.h"
#include "kernels/cpu/matmul.h"
#include "kernels/kernels.h"

namespace porter::kernels {

using namespace porter::tensor;
namespace {

using Clock = std::chrono::steady_clock;

// The GPT step's shapes (bench/gpt_step_bench.cc).
constexpr int64_t kBatch = 4, kSeq = 512, kTokens = kBatch * kSeq, kHidden = 768, kHeads = 12;
constexpr int64_t kHeadDim = kHidden / kHeads, kVocab = 8192;
// Attention's query row block (Note [Causal row blocks] in kernels/cpu/attention.cc); the rows
// time the last one, which attends to all T keys.
constexpr int64_t kRowBlock = 64;
// Each row repeats until about this much time is spent, at least 5 and at most 41 runs.
constexpr double kRowSeconds = 0.4;
// A row timed under contention (cpu_util below kQuietCpuUtil, see Timing) is timed again
// after a pause, up to kMaxAttempts in all, and keeps its least contended attempt. The
// retries of the whole run share kRetryBudgetSeconds, so a machine that stays busy costs at
// most that much more; past it, rows keep their first attempt and show its cpu_util.
constexpr double kQuietCpuUtil = 0.9, kRetryBudgetSeconds = 90.0;
constexpr int kMaxAttempts = 3;

int bench_threads() {
  const char* env = std::getenv("PORTER_BENCH_THREADS");
  return env != nullptr ? std::max(1, std::atoi(env)) : 2;
}

// One cpu device, allocator and kernels for the whole run, plus a kernels::DnnlMatmul of the same
// thread count: it names the implementation of a problem and runs the attention's strided
// ones, which kernels::Kernels::matmul cannot express.
struct Env {
  Env() {
    memory::DeviceOptions o;
    o.kind = memory::DeviceKind::kCpu;
    o.memory_limit_bytes = size_t{8} << 30;
    o.threads = bench_threads();
    device = memory::make_device(o);
    allocator = std::make_unique<memory::CachingAllocator>(*device);
    kernels = kernels::make_kernels(*allocator);
    probe = std::make_unique<kernels::DnnlMatmul>(device->threads());
  }
  // Uniform in [-1, 1), from a hash of the index: quick enough to refill 16M elements per row.
  tensor::Tensor random(tensor::Shape shape, uint64_t seed, tensor::DType dtype) {
    std::vector<float> v(static_cast<size_t>(shape.numel()));
    for (size_t i = 0; i < v.size(); ++i) {
      uint64_t z = (i + 1) * 0x9E3779B97F4A7C15ull ^ seed * 0xBF58476D1CE4E5B9ull;
      z = (z ^ (z >> 31)) * 0x94D049BB133111EBull;
      v[i] = static_cast<float>(z >> 40) * (2.0f / 16777216.0f) - 1.0f;
    }
    tensor::Tensor t = tensor::Tensor::empty(*allocator, shape, dtype, memory::Category::kWorkspace);
    from_host_f32(*device, v, t);
    return t;
  }
  tensor::Tensor copy(const tensor::Tensor& t) {
    tensor::Tensor c = tensor::Tensor::empty(*allocator, t.shape(), t.dtype(), memory::Category::kWorkspace);
    std::memcpy(c.data(), t.data(), t.nbytes());
    return c;
  }
  std::vector<float> host(const tensor::Tensor& t) { return tensor::to_host_f32(*device, t); }

  std::unique_ptr<memory::Device> device;
  std::unique_ptr<memory::CachingAllocator> allocator;
  std::unique_ptr<kernels::Kernels> kernels;
  std::unique_ptr<kernels::DnnlMatmul> probe;
};

Env& env() {
  static Env e;
  return e;
}

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// A row's timing: the median of its runs, and the process's cpu time over the runs' wall time
// times the threads. oneDNN's threads spin while they wait, so the latter is near 1 when they
// had their cores to themselves and drops when other processes took turns on them; a row
// whose value is well below 1 was timed under contention.
struct Timing {
  double median_s = 0, cpu_util = 0;
  int runs = 0;
};

// One warm-up call, then runs until kRowSeconds (5 to 41 of them).
template <typename Fn>
Timing median_seconds(Fn&& fn) {
  fn();
  std::vector<double> t;
  const std::clock_t cpu0 = std::clock();
  auto t0 = Clock::now();
  fn();
  t.push_back(seconds_since(t0));
  const int runs = std::clamp(static_cast<int>(kRowSeconds / t[0]), 5, 41);
  while (static_cast<int>(t.size()) < runs) {
    t0 = Clock::now();
    fn();
    t.push_back(seconds_since(t0));
  }
  const double cpu_s = static_cast<double>(std::clock() - cpu0) / CLOCKS_PER_SEC;
  double wall_s = 0;
  for (double x : t) wall_s += x;
  std::sort(t.begin(), t.end());
  return Timing{t[t.size() / 2], cpu_s / (wall_s * bench_threads()), runs};
}

// oneDNN's sgemm (row-major) on the bench's thread count: the reference and the f32 peak.
void sgemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
           const float* b, float beta, float* c) {
  omp_set_num_threads(bench_threads());
  dnnl_sgemm(ta ? 'T' : 'N', tb ? 'T' : 'N', m, n, k, alpha, a, ta ? m : k, b, tb ? k : n, beta,
             c, n);
}

// What is left of kRetryBudgetSeconds, for the rows and the peaks together.
double& retry_seconds_left() {
  static double left = kRetryBudgetSeconds;
  return left;
}

// ---- peaks (Note [Sweep peaks]) ----

// One peak measurement: its rate, the square size that gave it, and cpu_util (see Timing)
// over its timed calls.
struct PeakSample {
  double gflops = 0, cpu_util = 0;
  int64_t n = 0;
};

// The best sample of each peak so far.
struct Peaks {
  PeakSample f32, bf16;
  bool measured = false;
};

Peaks& peaks() {
  static Peaks p;
  return p;
}

// Best time of `runs` calls after a warm-up, with the cpu and wall seconds of those calls.
struct Best {
  double best_s = 1e30, cpu_s = 0, wall_s = 0;
};

template <typename Fn>
Best best_seconds(int runs, Fn&& fn) {
  fn();
  Best b;
  const std::clock_t cpu0 = std::clock();
  for (int r = 0; r < runs; ++r) {
    auto t0 = Clock::now();
    fn();
    const double s = seconds_since(t0);
    b.best_s = std::min(b.best_s, s);
    b.wall_s += s;
  }
  b.cpu_s = static_cast<double>(std::clock() - cpu0) / CLOCKS_PER_SEC;
  return b;
}

PeakSample sgemm_peak() {
  const int64_t n = 2048;
  std::vector<float> a(n * n, 0.5f), b(n * n, 0.25f), c(n * n);
  const Best t = best_seconds(5, [&] {
    sgemm(false, false, n, n, n, 1.0f, a.data(), b.data(), 0.0f, c.data());
  });
  return {2.0 * n * n * n / t.best_s / 1e9, t.cpu_s / (t.wall_s * bench_threads()), n};
}

PeakSample bf16_peak() {
  Env& e = env();
  PeakSample best;
  double cpu_s = 0, wall_s = 0;
  for (int64_t n : {1024, 2048, 3072, 4096}) {
    tensor::Tensor a = e.random({n, n}, 11, tensor::DType::kBF16), b = e.random({n, n}, 12, tensor::DType::kBF16);
    tensor::Tensor out =
        tensor::Tensor::empty(*e.allocator, tensor::Shape{n, n}, tensor::DType::kF32, memory::Category::kWorkspace);
    const Best t = best_seconds(3, [&] { e.kernels->matmul(a, b, out); });
    cpu_s += t.cpu_s;
    wall_s += t.wall_s;
    const double rate = 2.0 * n * n * n / t.best_s / 1e9;
    if (rate > best.gflops) {
      best.gflops = rate;
      best.n = n;
    }
  }
  best.cpu_util = cpu_s / (wall_s * bench_threads());
  return best;
}

// Measures both peaks now, again after a pause while either was contended (within the retry
// budget), and keeps the best of these and of any earlier measurement. Returns this call's
// best samples.
void measure_peaks(PeakSample* f32_now, PeakSample* bf16_now) {
  Peaks& p = peaks();
  *f32_now = *bf16_now = PeakSample{};
  for (int attempt = 0; attempt < kMaxAttempts; ++attempt) {
    const auto t0 = Clock::now();
    if (attempt > 0) std::this_thread::sleep_for(std::chrono::seconds(1));
    const PeakSample f = sgemm_peak(), b = bf16_peak();
    if (f.gflops > f32_now->gflops) *f32_now = f;
    if (b.gflops > bf16_now->gflops) *bf16_now = b;
    if (attempt > 0) retry_seconds_left() -= seconds_since(t0);
    if (std::min(f.cpu_util, b.cpu_util) >= kQuietCpuUtil || retry_seconds_left() <= 0) break;
  }
  if (f32_now->gflops > p.f32.gflops) p.f32 = *f32_now;
  if (bf16_now->gflops > p.bf16.gflops) p.bf16 = *bf16_now;
  p.measured = true;
}

void ensure_peaks() {
  if (peaks().measured) return;
  PeakSample f, b;
  measure_peaks(&f, &b);
}

double peak_of(tensor::DType ab) {
  return ab == tensor::DType::kF32 ? peaks().f32.gflops : peaks().bf16.gflops;
}

void BM_Peaks(benchmark::State& state) {
  PeakSample f32, bf16;
  for (auto _ : state) measure_peaks(&f32, &bf16);
  state.counters["f32_sgemm2048_GFLOP/s"] = f32.gflops;
  state.counters["f32_cpu_util"] = f32.cpu_util;
  state.counters["bf16_GFLOP/s"] = bf16.gflops;
  state.counters["bf16_best_n"] = static_cast<double>(bf16.n);
  state.counters["bf16_cpu_util"] = bf16.cpu_util;
  state.counters["f32_max_GFLOP/s"] = peaks().f32.gflops;
  state.counters["bf16_max_GFLOP/s"] = peaks().bf16.gflops;
}

// ---- results, for the summary ----

struct RowResult {
  std::string name;
  bool porter;  // the form porter runs
  tensor::DType ab;     // the operands' dtype, which picks the peak
  double ms, gflops, cpu_util;
  std::string impl;
};

std::vector<RowResult>& results() {
  static std::vector<RowResult> r;
  return r;
}

// Largest |got - want| over the largest |want|: one bound for the whole output, as the
// accumulation error grows with K rather than with each element.
double max_rel_error(const std::vector<float>& got, const std::vector<float>& want) {
  double err = 0, mag = 1e-30;
  for (size_t i = 0; i < want.size(); ++i) {
    err = std::max(err, std::abs(double(got[i]) - double(want[i])));
    mag = std::max(mag, std::abs(double(want[i])));
  }
  return err / mag;
}

double tolerance(tensor::DType ab) { return ab == tensor::DType::kF32 ? 1e-4 : 2e-2; }

// Times fn, then sets the row's time, counters and label and records it.
template <typename Fn>
void time_row(benchmark::State& state, const std::string& name, bool porter, tensor::DType ab,
              double flops, const std::string& impl, double rel_error, Fn&& fn) {
  ensure_peaks();
  Timing t;
  int attempts = 0;
  for (auto _ : state) {
    t = median_seconds(fn);
    for (attempts = 1; attempts < kMaxAttempts && t.cpu_util < kQuietCpuUtil &&
                       retry_seconds_left() > 0;
         ++attempts) {
      const auto t0 = Clock::now();
      std::this_thread::sleep_for(std::chrono::seconds(1));
      const Timing again = median_seconds(fn);
      if (again.cpu_util > t.cpu_util) t = again;
      retry_seconds_left() -= seconds_since(t0);
    }
    state.SetIterationTime(t.median_s);
  }
  const double gflops = flops / t.median_s / 1e9;
  state.counters["GFLOP/s"] = gflops;
  state.counters["of_peak"] = gflops / peak_of(ab);
  state.counters["runs"] = t.runs;
  state.counters["cpu_util"] = t.cpu_util;
  state.counters["attempts"] = attempts;
  state.counters["rel_err"] = rel_error;
  state.SetLabel((porter ? "porter | " : "       | ") + impl);
  results().push_back({name, porter, ab, t.median_s * 1e3, gflops, t.cpu_util, impl});
}

// ---- the Linears' rows (Note [Sweep forms]) ----

struct LinearShape {
  const char* name;
  int64_t in, out;
};

// The head multiplies by the tied embedding (V, C), stored like any Linear's weight.
constexpr LinearShape kLinears[] = {{"qkv", kHidden, 3 * kHidden},
                                    {"proj", kHidden, kHidden},
                                    {"fc1", kHidden, 4 * kHidden},
                                    {"fc2", 4 * kHidden, kHidden},
                                    {"head", kHidden, kVocab}};

enum Pass { kForward, kDgrad, kWgrad };
constexpr const char* kPassNames[] = {"fwd", "dgrad", "wgrad"};

// One Linear pass as out (M, N) = A (M, K) @ B (K, N), and the form porter stores it in.
struct LinearMatmul {
  int64_t m, n, k;
  bool porter_ta, porter_tb;
  float beta;
};

LinearMatmul linear_matmul(const LinearShape& l, Pass pass) {
  switch (pass) {
    case kForward: return {kTokens, l.out, l.in, false, true, 0.0f};  // x (N, in) @ W^T
    case kDgrad: return {kTokens, l.in, l.out, false, false, 0.0f};   // dy (N, out) @ W
    case kWgrad: return {l.out, l.in, kTokens, true, false, 1.0f};    // dy^T @ x, +=
  }
  return {};
}

std::string form_name(bool ta, bool tb) { return std::string(ta ? "T" : "N") + (tb ? "T" : "N"); }

void BM_Linear(benchmark::State& state, std::string name, LinearShape layer, Pass pass, bool ta,
               bool tb, tensor::DType ab) {
  Env& e = env();
  const LinearMatmul mm = linear_matmul(layer, pass);
  const int64_t m = mm.m, n = mm.n, k = mm.k;
  // Activations are ab; the gradients that wgrad accumulates into are f32.
  const tensor::DType out_dtype = pass == kWgrad ? tensor::DType::kF32 : ab;
  tensor::Tensor a = e.random(ta ? tensor::Shape{k, m} : tensor::Shape{m, k}, 1, ab);
  tensor::Tensor b = e.random(tb ? tensor::Shape{n, k} : tensor::Shape{k, n}, 2, ab);
  tensor::Tensor out = e.random({m, n}, 3, out_dtype);  // wgrad adds to it
  const MatmulSpec spec{ta, tb, 1.0f, mm.beta};
  const MatmulProblem problem = matmul_problem(a, b, out, spec);
  double err = 0;
  {
    // Check: the kernels and the probe (running the mirrored problem) against oneDNN's
    // sgemm on f32 copies of the same operands and initial out.
    std::vector<float> ref = e.host(out);
    sgemm(ta, tb, m, n, k, 1.0f, e.host(a).data(), e.host(b).data(), mm.beta, ref.data());
    tensor::Tensor probe_out = e.copy(out);
    e.kernels->matmul(a, b, out, spec);
    e.probe->run(problem, a.data(), b.data(), probe_out.data());
    err = max_rel_error(e.host(out), ref);
    const double probe_err = max_rel_error(e.host(probe_out), ref);
    if (!(err <= tolerance(ab)) || !(probe_err <= tolerance(ab))) {
      const std::string msg = "disagrees with oneDNN sgemm: kernels rel err " +
                              std::to_string(err) + ", probe " + std::to_string(probe_err) +
                              ", tolerance " + std::to_string(tolerance(ab));
      state.SkipWithError(msg.c_str());
      return;
    }
  }
  const bool porter = ta == mm.porter_ta && tb == mm.porter_tb;
  time_row(state, name, porter, ab, 2.0 * m * n * k, e.probe->implementation(problem), err,
           [&] { e.kernels->matmul(a, b, out, spec); });
}

// ---- the attention's rows ----
//
// f32: the strided calls of Note [Causal row blocks] in kernels/cpu/attention.cc, for the last row
// block (it attends to all T keys). bf16: the packed calls of Note [Bf16 attention], which
// every row block makes at the same shape, multiplying bf16 by bf16 into f32.

enum AttentionOp { kScores, kPV, kDP, kDQ, kDK, kDV };
constexpr const char* kAttentionNames[] = {"fwd/S=QK^T", "fwd/O=PV",    "bwd/dP=dOV^T",
                                           "bwd/dQ=dSK", "bwd/dK=dS^TQ", "bwd/dV=P^TdO"};

// The f32 path's tensors: the (B, T, 3C) qkv that q, k and v are strided views of, the
// (B, H, T, T) probabilities, the (B, T, C) output and its gradient, the (B, H, kRowBlock, T)
// dS scratch and the (B, T, 3C) dqkv.
struct F32AttentionTensors {
  explicit F32AttentionTensors(Env& e)
      : qkv(e.random({kBatch, kSeq, 3 * kHidden}, 4, tensor::DType::kF32)),
        probs(e.random({kBatch, kHeads, kSeq, kSeq}, 5, tensor::DType::kF32)),
        out(e.random({kBatch, kSeq, kHidden}, 6, tensor::DType::kF32)),
        dout(e.random({kBatch, kSeq, kHidden}, 7, tensor::DType::kF32)),
        ds(e.random({kBatch, kHeads, kRowBlock, kSeq}, 8, tensor::DType::kF32)),
        dqkv(e.random({kBatch, kSeq, 3 * kHidden}, 9, tensor::DType::kF32)) {}
  tensor::Tensor qkv, probs, out, dout, ds, dqkv;
};

// The bf16 path's packed tensors: a row block of Q and dout and all of K and V as bf16
// (B, H, rows, hd) / (B, H, T, hd), a row block's bf16 P (or dS) copy, and the f32 results:
// scores (or dP) for a row block, its out (or dQ), and dK, dV.
struct Bf16AttentionTensors {
  explicit Bf16AttentionTensors(Env& e)
      : q(e.random({kBatch, kHeads, kRowBlock, kHeadDim}, 4, tensor::DType::kBF16)),
        k(e.random({kBatch, kHeads, kSeq, kHeadDim}, 5, tensor::DType::kBF16)),
        v(e.random({kBatch, kHeads, kSeq, kHeadDim}, 6, tensor::DType::kBF16)),
        dy(e.random({kBatch, kHeads, kRowBlock, kHeadDim}, 7, tensor::DType::kBF16)),
        p16(e.random({kBatch, kHeads, kRowBlock, kSeq}, 8, tensor::DType::kBF16)),
        scores(e.random({kBatch, kHeads, kRowBlock, kSeq}, 9, tensor::DType::kF32)),
        o(e.random({kBatch, kHeads, kRowBlock, kHeadDim}, 10, tensor::DType::kF32)),
        dkv(e.random({kBatch, kHeads, kSeq, kHeadDim}, 11, tensor::DType::kF32)) {}
  tensor::Tensor q, k, v, dy, p16, scores, o, dkv;
};

// An operand of a strided call: a tensor, the element where the view starts, and the view's
// (batch0, batch1, row, column) strides.
struct View {
  const tensor::Tensor* t = nullptr;
  int64_t offset = 0;
  int64_t strides[4] = {0, 0, 0, 1};
  void* data() const {
    return static_cast<char*>(const_cast<void*>(t->data())) +
           offset * static_cast<int64_t>(tensor::dtype_size(t->dtype()));
  }
};

struct StridedCall {
  MatmulProblem p;
  View a, b, out;
};

View view(const tensor::Tensor& t, int64_t offset, const int64_t (&st)[4]) {
  View v{&t, offset, {st[0], st[1], st[2], st[3]}};
  return v;
}

StridedCall strided_call(int64_t m, int64_t n, int64_t k, const View& a, const View& b,
                         const View& out, float alpha) {
  StridedCall s;
  s.p.batch0 = kBatch;
  s.p.batch1 = kHeads;
  s.p.m = m;
  s.p.n = n;
  s.p.k = k;
  for (int i = 0; i < 4; ++i) {
    s.p.a_strides[i] = a.strides[i];
    s.p.b_strides[i] = b.strides[i];
    s.p.out_strides[i] = out.strides[i];
  }
  s.p.a_dtype = a.t->dtype();
  s.p.b_dtype = b.t->dtype();
  s.p.out_dtype = out.t->dtype();
  s.p.alpha = alpha;
  s.p.beta = 0.0f;
  s.a = a;
  s.b = b;
  s.out = out;
  return s;
}

// The call do_attention_forward / do_attention_backward makes in f32 for the last row block
// (i0 = T - 64, i1 = T), with the same offsets and strides. Backward runs that block first
// with beta = 0 (it initialises dK and dV), so beta is 0 here.
StridedCall f32_attention_call(AttentionOp op, const F32AttentionTensors& t) {
  const int64_t c = kHidden, c3 = 3 * c, T = kSeq, hd = kHeadDim;
  const int64_t i1 = T, i0 = T - kRowBlock, rows = i1 - i0;
  const int64_t qkv_str[4] = {T * c3, hd, c3, 1};
  const int64_t qkv_t_str[4] = {T * c3, hd, 1, c3};
  const int64_t probs_str[4] = {kHeads * T * T, T * T, T, 1};
  const int64_t probs_t_str[4] = {kHeads * T * T, T * T, 1, T};
  const int64_t out_str[4] = {T * c, hd, c, 1};
  const int64_t ds_str[4] = {kHeads * kRowBlock * T, kRowBlock * T, T, 1};
  const int64_t ds_t_str[4] = {kHeads * kRowBlock * T, kRowBlock * T, 1, T};
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  // Each as in kernels/cpu/attention.cc: m, n, k, then a, b and out at their offsets and strides.
  switch (op) {
    case kScores:  // S = scale Q[i0:i1] K[0:i1]^T
      return strided_call(rows, i1, hd, view(t.qkv, i0 * c3, qkv_str), view(t.qkv, c, qkv_t_str),
                          view(t.probs, i0 * T, probs_str), scale);
    case kPV:  // O[i0:i1] = P[i0:i1, 0:i1] V[0:i1]
      return strided_call(rows, hd, i1, view(t.probs, i0 * T, probs_str),
                          view(t.qkv, 2 * c, qkv_str), view(t.out, i0 * c, out_str), 1.0f);
    case kDP:  // dP = dO[i0:i1] V[0:i1]^T
      return strided_call(rows, i1, hd, view(t.dout, i0 * c, out_str),
                          view(t.qkv, 2 * c, qkv_t_str), view(t.ds, 0, ds_str), 1.0f);
    case kDQ:  // dQ[i0:i1] = dS K[0:i1]
      return strided_call(rows, hd, i1, view(t.ds, 0, ds_str), view(t.qkv, c, qkv_str),
                          view(t.dqkv, i0 * c3, qkv_str), 1.0f);
    case kDK:  // dK[0:i1] = dS^T Q[i0:i1]
      return strided_call(i1, hd, rows, view(t.ds, 0, ds_t_str), view(t.qkv, i0 * c3, qkv_str),
                          view(t.dqkv, c, qkv_str), 1.0f);
    case kDV:  // dV[0:i1] = P[i0:i1, 0:i1]^T dO[i0:i1]
      return strided_call(i1, hd, rows, view(t.probs, i0 * T, probs_t_str),
                          view(t.dout, i0 * c, out_str), view(t.dqkv, 2 * c, qkv_str), 1.0f);
  }
  return {};
}

// Strides of a dense (B, H, rows, cols) tensor, and of its transpose.
struct Dense {
  int64_t plain[4], trans[4];
};

Dense dense(int64_t rows, int64_t cols) {
  const int64_t head = rows * cols;
  return {{kHeads * head, head, cols, 1}, {kHeads * head, head, 1, cols}};
}

// The call forward_bf16 / backward_bf16 in kernels/cpu/attention.cc makes for a row block.
StridedCall bf16_attention_call(AttentionOp op, const Bf16AttentionTensors& t) {
  const int64_t T = kSeq, hd = kHeadDim, rows = kRowBlock;
  const Dense kv = dense(T, hd), qb = dense(rows, hd), sb = dense(rows, T);
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  switch (op) {
    case kScores:  // S = scale Q_blk K^T, every key
      return strided_call(rows, T, hd, view(t.q, 0, qb.plain), view(t.k, 0, kv.trans),
                          view(t.scores, 0, sb.plain), scale);
    case kPV:  // O_blk = P_blk V
      return strided_call(rows, hd, T, view(t.p16, 0, sb.plain), view(t.v, 0, kv.plain),
                          view(t.o, 0, qb.plain), 1.0f);
    case kDP:  // dP = dO_blk V^T
      return strided_call(rows, T, hd, view(t.dy, 0, qb.plain), view(t.v, 0, kv.trans),
                          view(t.scores, 0, sb.plain), 1.0f);
    case kDQ:  // dQ_blk = dS K
      return strided_call(rows, hd, T, view(t.p16, 0, sb.plain), view(t.k, 0, kv.plain),
                          view(t.o, 0, qb.plain), 1.0f);
    case kDK:  // dK = dS^T Q_blk
      return strided_call(T, hd, rows, view(t.p16, 0, sb.trans), view(t.q, 0, qb.plain),
                          view(t.dkv, 0, kv.plain), 1.0f);
    case kDV:  // dV = P^T dO_blk
      return strided_call(T, hd, rows, view(t.p16, 0, sb.trans), view(t.dy, 0, qb.plain),
                          view(t.dkv, 0, kv.plain), 1.0f);
  }
  return {};
}

// One (batch0, batch1) matrix of a view, rows x cols, row-major, from the f32 host copy of
// its tensor.
std::vector<float> gather(const std::vector<float>& host, const View& v, int64_t b0, int64_t b1,
                          int64_t rows, int64_t cols) {
  std::vector<float> m(static_cast<size_t>(rows * cols));
  const float* p = host.data() + v.offset + b0 * v.strides[0] + b1 * v.strides[1];
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) m[i * cols + j] = p[i * v.strides[2] + j * v.strides[3]];
  return m;
}

void BM_Attention(benchmark::State& state, std::string name, AttentionOp op, tensor::DType ab) {
  Env& e = env();
  // Both kinds live for the row; only one is used.
  std::unique_ptr<F32AttentionTensors> f32;
  std::unique_ptr<Bf16AttentionTensors> bf16;
  StridedCall s;
  if (ab == tensor::DType::kF32) {
    f32 = std::make_unique<F32AttentionTensors>(e);
    s = f32_attention_call(op, *f32);
  } else {
    bf16 = std::make_unique<Bf16AttentionTensors>(e);
    s = bf16_attention_call(op, *bf16);
  }
  const MatmulProblem& p = s.p;
  double err = 0;
  {
    // Check: each (batch, head) matrix against oneDNN's sgemm on f32 copies of its operands.
    const std::vector<float> a = e.host(*s.a.t), b = e.host(*s.b.t);
    std::vector<std::vector<float>> refs;
    {
      const std::vector<float> out0 = e.host(*s.out.t);
      for (int64_t b0 = 0; b0 < p.batch0; ++b0) {
        for (int64_t b1 = 0; b1 < p.batch1; ++b1) {
          std::vector<float> ref = gather(out0, s.out, b0, b1, p.m, p.n);
          sgemm(false, false, p.m, p.n, p.k, p.alpha, gather(a, s.a, b0, b1, p.m, p.k).data(),
                gather(b, s.b, b0, b1, p.k, p.n).data(), p.beta, ref.data());
          refs.push_back(std::move(ref));
        }
      }
    }
    e.probe->run(p, s.a.data(), s.b.data(), s.out.data());
    const std::vector<float> out1 = e.host(*s.out.t);
    std::vector<float> got, want;
    for (int64_t b0 = 0, i = 0; b0 < p.batch0; ++b0) {
      for (int64_t b1 = 0; b1 < p.batch1; ++b1, ++i) {
        std::vector<float> g = gather(out1, s.out, b0, b1, p.m, p.n);
        got.insert(got.end(), g.begin(), g.end());
        want.insert(want.end(), refs[i].begin(), refs[i].end());
      }
    }
    // The products of bf16 values are exact in f32, so bf16 operands meet the f32 bound.
    err = max_rel_error(got, want);
    if (!(err <= tolerance(tensor::DType::kF32))) {
      const std::string msg = "disagrees with oneDNN sgemm: rel err " + std::to_string(err);
      state.SkipWithError(msg.c_str());
      return;
    }
  }
  const double flops = 2.0 * p.batch0 * p.batch1 * p.m * p.n * p.k;
  // porter runs these calls where its head tiles do not apply, or measure slower; the
  // attn/call rows time what it runs, so these count as porter's only in the first case.
  const bool tiles = ab == tensor::DType::kF32 ? cpu::attention_tiles_f32_supported()
                                       : cpu::attention_tiles_bf16_supported(kHeadDim);
  const bool porter = !tiles || cpu::attention_impl_from_env() == cpu::AttentionImpl::kOneDnn;
  time_row(state, name, porter, ab, flops, e.probe->implementation(p), err,
           [&] { e.probe->run(p, s.a.data(), s.b.data(), s.out.data()); });
}

// The whole attention call as porter runs it: on its head tiles or oneDNN's batched calls,
// whichever it measured faster at the first call (Note [Attention head tiles] in
// kernels/cpu/attention_heads.cc; the label names which). The tiles do not expose their products one
// by one, so one row times the forward (two products of the causal triangle, softmax and the write of
// the saved probabilities included) and one the backward (four products, the softmax backward
// and the read of the probabilities), at the GPT step's shapes. The FLOPs are the triangle's
// products only, so the ratio to the matmul peak is what the softmax and memory traffic leave.
void BM_AttentionCall(benchmark::State& state, std::string name, bool backward, tensor::DType ab) {
  Env& e = env();
  tensor::Tensor qkv = e.random({kBatch, kSeq, 3 * kHidden}, 4, ab);
  tensor::Tensor out = e.random({kBatch, kSeq, kHidden}, 5, ab);
  tensor::Tensor probs = e.random({kBatch, kHeads, kSeq, kSeq}, 6, tensor::DType::kF32);
  tensor::Tensor dout = e.random({kBatch, kSeq, kHidden}, 7, ab);
  tensor::Tensor dqkv = e.random({kBatch, kSeq, 3 * kHidden}, 8, ab);
  e.kernels->attention_forward(qkv, out, probs, static_cast<int>(kHeads));
  // Check: every probability row sums to 1 and is zero above the diagonal.
  {
    const std::vector<float> p = e.host(probs);
    for (int64_t r = 0; r < kBatch * kHeads * kSeq; r += 37) {
      const int64_t i = r % kSeq;
      double sum = 0, above = 0;
      for (int64_t j = 0; j < kSeq; ++j) (j <= i ? sum : above) += std::abs(p[r * kSeq + j]);
      if (std::abs(sum - 1.0) > 1e-4 || above != 0) {
        state.SkipWithError("attention probabilities are not a causal softmax");
        return;
      }
    }
  }
  if (backward) e.kernels->attention_backward(dout, qkv, probs, dqkv, static_cast<int>(kHeads));
  // What porter runs for this call: the kernel table's choice (Note [Kernel table]).
  const AttentionCall call{kBatch, kSeq, kHidden, static_cast<int>(kHeads), ab, ab,
                           backward ? ab : tensor::DType::kF32};
  const std::optional<bool> on_tiles =
      cpu::attention_choice(e.kernels->kernel_table(), call, backward, bench_threads());
  const bool tiles = on_tiles.value_or(ab == tensor::DType::kF32
                                           ? cpu::attention_tiles_f32_supported()
                                           : cpu::attention_tiles_bf16_supported(kHeadDim)) &&
                     cpu::attention_impl_from_env() != cpu::AttentionImpl::kOneDnn;
  const double flops = (backward ? 4.0 : 2.0) * kBatch * kHidden * kSeq * (kSeq + 1);
  const std::string impl = !tiles ? "oneDNN batched calls"
                           : ab == tensor::DType::kF32 ? "porter tiles, avx512f"
                                               : "porter tiles, avx512_bf16";
  time_row(state, name, true, ab, flops, impl, 0.0, [&] {
    if (backward) {
      e.kernels->attention_backward(dout, qkv, probs, dqkv, static_cast<int>(kHeads));
    } else {
      e.kernels->attention_forward(qkv, out, probs, static_cast<int>(kHeads));
    }
  });
}

// ---- registration and summary ----

void register_rows() {
  auto row = [](benchmark::internal::Benchmark* b) {
    b->Unit(benchmark::kMillisecond)->UseManualTime()->Iterations(1);
  };
  benchmark::RegisterBenchmark("peaks/before", BM_Peaks)->Unit(benchmark::kMillisecond)->Iterations(1);
  for (tensor::DType ab : {tensor::DType::kF32, tensor::DType::kBF16}) {
    for (const LinearShape& l : kLinears) {
      for (Pass pass : {kForward, kDgrad, kWgrad}) {
        for (int form = 0; form < 4; ++form) {
          const bool ta = form >= 2, tb = form % 2 == 1;
          const std::string name = std::string(l.name) + "/" + kPassNames[pass] + "/" +
                                   form_name(ta, tb) + "/" + std::string(tensor::dtype_name(ab));
          row(benchmark::RegisterBenchmark(name.c_str(), BM_Linear, name, l, pass, ta, tb, ab));
        }
      }
    }
    for (AttentionOp op : {kScores, kPV, kDP, kDQ, kDK, kDV}) {
      const std::string name =
          std::string("attn/") + kAttentionNames[op] + "/" + std::string(tensor::dtype_name(ab));
      row(benchmark::RegisterBenchmark(name.c_str(), BM_Attention, name, op, ab));
    }
    for (bool backward : {false, true}) {
      const std::string name = std::string("attn/call/") + (backward ? "bwd" : "fwd") + "/" +
                               std::string(tensor::dtype_name(ab));
      row(benchmark::RegisterBenchmark(name.c_str(), BM_AttentionCall, name, backward, ab));
    }
  }
  benchmark::RegisterBenchmark("peaks/after", BM_Peaks)->Unit(benchmark::kMillisecond)->Iterations(1);
}

void print_summary(const double (&load_before)[3]) {
  const std::vector<RowResult>& rows = results();
  if (rows.empty()) return;
  const Peaks& pk = peaks();
  double load_after[3] = {0, 0, 0};
  getloadavg(load_after, 3);
  std::fprintf(stderr,
               "\nmatmul sweep, %d threads; peaks, the best of before and after the rows: f32 "
               "sgemm 2048^3 %.1f GFLOP/s (cpu_util %.2f), bf16 matmul %.1f GFLOP/s at n = %lld "
               "(cpu_util %.2f)\n",
               bench_threads(), pk.f32.gflops, pk.f32.cpu_util, pk.bf16.gflops,
               static_cast<long long>(pk.bf16.n), pk.bf16.cpu_util);
  std::fprintf(stderr, "load average before %.2f %.2f %.2f, after %.2f %.2f %.2f\n",
               load_before[0], load_before[1], load_before[2], load_after[0], load_after[1],
               load_after[2]);
  std::fprintf(stderr, "%-24s %-6s %9s %9s %7s %8s  %s\n", "row", "porter", "ms", "GFLOP/s",
               "of_peak", "cpu_util", "oneDNN implementation");
  for (const RowResult& r : rows) {
    std::fprintf(stderr, "%-24s %-6s %9.3f %9.1f %7.3f %8.2f  %s\n", r.name.c_str(),
                 r.porter ? "yes" : "", r.ms, r.gflops, r.gflops / peak_of(r.ab), r.cpu_util,
                 r.impl.c_str());
  }
  // Minimum ratio to peak over the rows of each dtype, and where it is.
  for (tensor::DType ab : {tensor::DType::kF32, tensor::DType::kBF16}) {
    for (bool porter_only : {true, false}) {
      const RowResult* worst = nullptr;
      for (const RowResult& r : rows) {
        if (r.ab != ab || (porter_only && !r.porter)) continue;
        if (worst == nullptr || r.gflops < worst->gflops) worst = &r;
      }
      if (worst == nullptr) continue;
      std::fprintf(stderr, "min of_peak, %s, %-13s %.3f (%s)\n",
                   std::string(tensor::dtype_name(ab)).c_str(),
                   porter_only ? "porter's rows:" : "all rows:", worst->gflops / peak_of(ab),
                   worst->name.c_str());
    }
  }
}

}  // namespace
}  // namespace porter::kernels

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  double load_before[3] = {0, 0, 0};
  getloadavg(load_before, 3);
  porter::kernels::register_rows();
  benchmark::RunSpecifiedBenchmarks();
  porter::kernels::print_summary(load_before);
  benchmark::Shutdown();
  return 0;
}
