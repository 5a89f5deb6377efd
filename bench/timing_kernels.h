// Kernels that time each call of other kernels: the per-op split of a step's time, for
// benchmarks on the cpu device, whose kernels run on the calling thread (kernels.h), so a
// call's wall time is the op's time.
#pragma once

#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdio>
#include <map>
#include <string>
#include <utility>

#include "nn/ctx.h"
#include "kernels/kernels.h"

namespace porter::bench {

struct OpTime {
  double seconds = 0.0;
  double flops = 0.0;  // matmuls only
  int64_t calls = 0;
};

class TimingKernels : public kernels::Kernels {
 public:
  // `inner` is not owned and outlives this; its workspace allocator is this one's.
  explicit TimingKernels(kernels::Kernels& inner)
      : Kernels(inner.workspace_allocator()), inner_(&inner) {}
  memory::DeviceKind kind() const override { return inner_->kind(); }

  // Per op ("rmsnorm_forward", or "matmul MxNxK" plus "^T" on transposed operands), summed
  // since the last reset().
  const std::map<std::string, OpTime>& times() const { return times_; }
  void reset() { times_.clear(); }

 protected:
  using Tensor = tensor::Tensor;

  template <typename F>
  void timed(const std::string& name, F&& f, double flops = 0.0) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    OpTime& t = times_[name];
    t.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    t.flops += flops;
    ++t.calls;
  }

  void do_matmul(const Tensor& a, const Tensor& b, Tensor& out, const kernels::MatmulSpec& s) override {
    const int64_t m = out.dim(-2), n = out.dim(-1);
    const int64_t k = s.trans_a ? a.dim(-2) : a.dim(-1);
    const int64_t batch = out.rank() == 3 ? out.dim(0) : 1;
    char name[96];
    std::snprintf(name, sizeof name, "matmul %lldx%lldx%lld%s%s%s",
                  static_cast<long long>(m), static_cast<long long>(n), static_cast<long long>(k),
                  s.trans_a ? " a^T" : "", s.trans_b ? " b^T" : "", s.beta != 0.0f ? " +=" : "");
    timed(name, [&] { inner_->matmul(a, b, out, s); }, 2.0 * batch * m * n * k);
  }
  void do_bias_add(Tensor& x, const Tensor& bias) override {
    timed("bias_add", [&] { inner_->bias_add(x, bias); });
  }
  void do_bias_backward(const Tensor& dy, Tensor& dbias) override {
    timed("bias_backward", [&] { inner_->bias_backward(dy, dbias); });
  }
  void do_layernorm_forward(const Tensor& x, const Tensor& gamma, const Tensor& beta, Tensor& y,
                            Tensor& mean, Tensor& rstd, float eps) override {
    timed("layernorm_forward",
          [&] { inner_->layernorm_forward(x, gamma, beta, y, mean, rstd, eps); });
  }
  void do_layernorm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma,
                             const Tensor& mean, const Tensor& rstd, Tensor& dx, Tensor& dgamma,
                             Tensor& dbeta) override {
    timed("layernorm_backward",
          [&] { inner_->layernorm_backward(dy, x, gamma, mean, rstd, dx, dgamma, dbeta); });
  }
  void do_rmsnorm_forward(const Tensor& x, const Tensor& gamma, Tensor& y, Tensor& rstd,
                          float eps) override {
    timed("rmsnorm_forward", [&] { inner_->rmsnorm_forward(x, gamma, y, rstd, eps); });
  }
  void do_rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma,
                           const Tensor& rstd, Tensor& dx, Tensor& dgamma) override {
    timed("rmsnorm_backward", [&] { inner_->rmsnorm_backward(dy, x, gamma, rstd, dx, dgamma); });
  }
  void do_rope_qkv_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& qkv,
                           int heads, int kv_heads, double theta) override {
    timed("rope_qkv_forward",
          [&] { inner_->rope_qkv_forward(q, k, v, qkv, heads, kv_heads, theta); });
  }
  void do_rope_qkv_backward(const Tensor& dqkv, Tensor& dq, Tensor& dk, Tensor& dv, int heads,
                            int kv_heads, double theta) override {
    timed("rope_qkv_backward",
          [&] { inner_->rope_qkv_backward(dqkv, dq, dk, dv, heads, kv_heads, theta); });
  }
  void do_swiglu_forward(const Tensor& gate, const Tensor& up, Tensor& y) override {
    timed("swiglu_forward", [&] { inner_->swiglu_forward(gate, up, y); });
  }
  void do_swiglu_backward(const Tensor& gate, const Tensor& up, const Tensor& dy, Tensor& dgate,
                          Tensor& dup) override {
    timed("swiglu_backward", [&] { inner_->swiglu_backward(gate, up, dy, dgate, dup); });
  }
  void do_gelu_forward(const Tensor& x, Tensor& y) override {
    timed("gelu_forward", [&] { inner_->gelu_forward(x, y); });
  }
  void do_gelu_backward(const Tensor& x, const Tensor& dy, Tensor& dx) override {
    timed("gelu_backward", [&] { inner_->gelu_backward(x, dy, dx); });
  }
  void do_relu_forward(const Tensor& x, Tensor& y) override {
    timed("relu_forward", [&] { inner_->relu_forward(x, y); });
  }
  void do_relu_backward(const Tensor& x, const Tensor& dy, Tensor& dx) override {
    timed("relu_backward", [&] { inner_->relu_backward(x, dy, dx); });
  }
  void do_silu_forward(const Tensor& x, Tensor& y) override {
    timed("silu_forward", [&] { inner_->silu_forward(x, y); });
  }
  void do_silu_backward(const Tensor& x, const Tensor& dy, Tensor& dx) override {
    timed("silu_backward", [&] { inner_->silu_backward(x, dy, dx); });
  }
  void do_mse_forward(const Tensor& pred, const Tensor& target, Tensor& losses) override {
    timed("mse_forward", [&] { inner_->mse_forward(pred, target, losses); });
  }
  void do_mse_backward(const Tensor& pred, const Tensor& target, Tensor& dpred,
                       float scale) override {
    timed("mse_backward", [&] { inner_->mse_backward(pred, target, dpred, scale); });
  }
  void do_attention_forward(const Tensor& qkv, Tensor& out, Tensor& probs, int heads) override {
    timed("attention_forward", [&] { inner_->attention_forward(qkv, out, probs, heads); });
  }
  void do_attention_backward(const Tensor& dout, const Tensor& qkv, const Tensor& probs,
                             Tensor& dqkv, int heads) override {
    timed("attention_backward", [&] { inner_->attention_backward(dout, qkv, probs, dqkv, heads); });
  }
  void do_flash_attention_forward(const Tensor& qkv, Tensor& out, Tensor& lse, int heads,
                                  int kv_heads) override {
    timed("flash_attention_forward",
          [&] { inner_->flash_attention_forward(qkv, out, lse, heads, kv_heads); });
  }
  void do_flash_attention_backward(const Tensor& dout, const Tensor& qkv, const Tensor& out,
                                   const Tensor& lse, Tensor& dqkv, int heads,
                                   int kv_heads) override {
    timed("flash_attention_backward", [&] {
      inner_->flash_attention_backward(dout, qkv, out, lse, dqkv, heads, kv_heads);
    });
  }
  void do_dropout_forward(const Tensor& x, Tensor& y, float p, const tensor::PhiloxKey& key) override {
    timed("dropout_forward", [&] { inner_->dropout_forward(x, y, p, key); });
  }
  void do_dropout_backward(const Tensor& dy, Tensor& dx, float p,
                           const tensor::PhiloxKey& key) override {
    timed("dropout_backward", [&] { inner_->dropout_backward(dy, dx, p, key); });
  }
  void do_add(const Tensor& a, const Tensor& b, Tensor& out) override {
    timed("add", [&] { inner_->add(a, b, out); });
  }
  void do_accumulate(Tensor& acc, const Tensor& x) override {
    timed("accumulate", [&] { inner_->accumulate(acc, x); });
  }
  void do_embedding_forward(const Tensor& tokens, const Tensor& wte, const Tensor& wpe,
                            Tensor& out) override {
    timed("embedding_forward", [&] { inner_->embedding_forward(tokens, wte, wpe, out); });
  }
  void do_embedding_backward(const Tensor& dout, const Tensor& tokens, Tensor& dwte,
                             Tensor& dwpe) override {
    timed("embedding_backward", [&] { inner_->embedding_backward(dout, tokens, dwte, dwpe); });
  }
  void do_cross_entropy_forward(const Tensor& logits, const Tensor& targets,
                                Tensor& losses) override {
    timed("cross_entropy_forward", [&] { inner_->cross_entropy_forward(logits, targets, losses); });
  }
  void do_cross_entropy_backward(const Tensor& logits, const Tensor& targets, Tensor& dlogits,
                                 float scale) override {
    timed("cross_entropy_backward",
          [&] { inner_->cross_entropy_backward(logits, targets, dlogits, scale); });
  }
  void do_embedding_forward_vocab_range(const Tensor& tokens, const Tensor& wte,
                                        int64_t vocab_begin, const Tensor& wpe,
                                        Tensor& out) override {
    timed("embedding_forward",
          [&] { inner_->embedding_forward_vocab_range(tokens, wte, vocab_begin, wpe, out); });
  }
  void do_embedding_backward_vocab_range(const Tensor& dout, const Tensor& tokens,
                                         int64_t vocab_begin, Tensor& dwte,
                                         Tensor& dwpe) override {
    timed("embedding_backward",
          [&] { inner_->embedding_backward_vocab_range(dout, tokens, vocab_begin, dwte, dwpe); });
  }
  void do_cross_entropy_partial(const Tensor& logits, const Tensor& targets, int64_t vocab_begin,
                                int64_t valid, Tensor& stats) override {
    timed("cross_entropy_forward",
          [&] { inner_->cross_entropy_partial(logits, targets, vocab_begin, valid, stats); });
  }
  void do_cross_entropy_combine(const Tensor& gathered, Tensor& losses, Tensor& lse) override {
    timed("cross_entropy_forward", [&] { inner_->cross_entropy_combine(gathered, losses, lse); });
  }
  void do_cross_entropy_backward_partial(const Tensor& logits, const Tensor& targets,
                                         int64_t vocab_begin, int64_t valid, const Tensor& lse,
                                         Tensor& dlogits, float scale) override {
    timed("cross_entropy_backward", [&] {
      inner_->cross_entropy_backward_partial(logits, targets, vocab_begin, valid, lse, dlogits,
                                             scale);
    });
  }
  void do_adamw(Tensor& params, const Tensor& grad, Tensor& m, Tensor& v,
                const kernels::AdamWArgs& args, Tensor* params_out) override {
    timed("adamw", [&] { inner_->adamw(params, grad, m, v, args, params_out); });
  }
  void do_sum(const Tensor& x, Tensor& out) override {
    timed("sum", [&] { inner_->sum(x, out); });
  }
  void do_squared_norm(const Tensor& x, Tensor& out) override {
    timed("squared_norm", [&] { inner_->squared_norm(x, out); });
  }
  void do_nonfinite_count(const Tensor& x, Tensor& out) override {
    timed("nonfinite_count", [&] { inner_->nonfinite_count(x, out); });
  }
  void do_cast(const Tensor& x, Tensor& y) override {
    timed("cast", [&] { inner_->cast(x, y); });
  }
  void do_fill(Tensor& x, float value) override {
    timed("fill", [&] { inner_->fill(x, value); });
  }
  void do_scale(Tensor& x, float s) override {
    timed("scale", [&] { inner_->scale(x, s); });
  }

 private:
  kernels::Kernels* inner_;  // not owned; outlives this
  std::map<std::string, OpTime> times_;
};

// Prints `timing`'s per-op table to stderr (ms per step, calls per step, and GFLOP/s of the
// matmuls) under `label`, for `steps` steps that took `step_s` seconds in all, and sets one
// counter per group of ops (ms per step, "matmul_ms", "attention_ms", ...). Returns the
// seconds spent inside kernels.
inline double print_op_split(const TimingKernels& timing, const std::string& label, int steps,
                             double step_s, benchmark::State& state) {
  // Groups: the first matching prefix of the op's name.
  const std::pair<const char*, const char*> groups[] = {
      {"matmul", "matmul"},       {"attention", "attention"},         {"layernorm", "layernorm"},
      {"gelu", "gelu"},           {"rmsnorm", "rmsnorm"},             {"rope", "rope_qkv"},
      {"swiglu", "swiglu"},       {"cross_entropy", "cross_entropy"}, {"embedding", "embedding"},
      {"bias", "bias"},           {"fill", "fill"},                   {"add", "add"},
      {"accumulate", "accumulate"}, {"other_kernels", ""}};
  std::map<std::string, double> group_ms;
  double kernels_s = 0.0;
  std::fprintf(stderr, "\n%s, %d steps: ms per step, calls per step, GFLOP/s\n", label.c_str(),
               steps);
  for (const auto& [name, t] : timing.times()) {
    kernels_s += t.seconds;
    for (const auto& [group, prefix] : groups) {
      if (name.rfind(prefix, 0) == 0) {
        group_ms[group] += t.seconds * 1e3 / steps;
        break;
      }
    }
    std::fprintf(stderr, "  %-36s %9.1f %5lld", name.c_str(), t.seconds * 1e3 / steps,
                 static_cast<long long>(t.calls / steps));
    if (t.flops > 0) std::fprintf(stderr, " %7.0f", t.flops / t.seconds / 1e9);
    std::fprintf(stderr, "\n");
  }
  std::fprintf(stderr, "  %-36s %9.1f\n  %-36s %9.1f\n", "outside kernels",
               (step_s - kernels_s) * 1e3 / steps, "step", step_s * 1e3 / steps);
  for (const auto& [group, ms] : group_ms) state.counters[group + "_ms"] = ms;
  return kernels_s;
}

// The body of a step's op-split benchmark: `run.step(kernels, ctx)` (which returns the loss)
// through TimingKernels around `kernels`, the first step checked by `loss_ok(state, loss)`
// and not timed; then the table (print_op_split) and the counters outside_kernels_ms and
// step_ms, ms per step.
template <typename Run, typename LossOk>
void op_split_benchmark(benchmark::State& state, Run& run, tensor::DType dtype, kernels::Kernels& kernels,
                        memory::CachingAllocator& allocator, LossOk loss_ok) {
  TimingKernels timing(kernels);
  nn::Ctx ctx(timing, allocator, dtype);
  if (!loss_ok(state, run.step(timing, ctx))) return;
  timing.reset();
  double step_s = 0.0;
  int steps = 0;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    benchmark::DoNotOptimize(run.step(timing, ctx));
    step_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    ++steps;
  }
  const std::string label(tensor::dtype_name(dtype));
  const double kernels_s = print_op_split(timing, label, steps, step_s, state);
  state.counters["outside_kernels_ms"] = (step_s - kernels_s) * 1e3 / steps;
  state.counters["step_ms"] = step_s * 1e3 / steps;
  state.SetLabel(label);
}

}  // namespace porter::bench
