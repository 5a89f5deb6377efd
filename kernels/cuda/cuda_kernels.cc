// CudaKernels: the Kernels interface on a cuda Device. Matmuls go to cuBLASLt
// (kernels/cuda/matmul.cc); every other op is one of porter's kernels (cuda_*.cu) on the device's
// compute stream. The public Kernels methods have already validated shapes and dtypes.
//
// This file is host code only, compiled by the host compiler: the .cu files see raw
// pointers (kernels/cuda/launch.h), which keeps nvcc away from the Tensor and allocator headers.
#include "kernels/cuda/cuda_kernels.h"

#include <cmath>

#include "base/check.h"
#include "memory/cuda_check.h"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/matmul.h"
#include "kernels/cuda/relu_silu_mse.h"
#include "kernels/workspace.h"

namespace porter::kernels {
namespace {

using cuda::DevPtr;
using cuda::GemmArgs;

DevPtr dev(const Tensor& t) { return DevPtr{t.data(), t.dtype()}; }

// The query heads per key/value slot of a rotary qkv (Note [Rotary qkv] in kernels.cc):
// heads / kv_heads when its row is 3 * heads * d (k and v expanded), 1 when it is packed.
int64_t rope_group(const Tensor& qkv, int64_t d, int heads, int kv_heads) {
  return qkv.dim(2) == 3 * heads * d ? heads / kv_heads : 1;
}

// Note [Cuda kernel workspace]
// Attention needs per-head copies of q, k, v (and their gradients, and dP) that do not fit
// the packed (B, T, 3C) layout cuBLASLt's strided batches need, and reductions need a
// partials buffer. Each call takes one buffer from the kernels' allocator, category
// workspace (Note [Kernel workspace] in kernels.h), carved as kernels/workspace.h lays out:
// attention forward 4 padded (B, H, T, hd) f32 matrices, backward 7 and a padded dP
// (B, H, T, T) f32, flash attention backward the padded (B, H, T) f32 rows' sum(dout * out),
// reductions 1024 f32 partials. The buffer is freed as the call returns,
// with its kernels still queued on the compute stream: the allocator only hands the block
// out again to later compute-stream work (or to a copy stream that first waits on the
// compute stream), so no kernel reads memory another one reuses, and nothing synchronises.
// Sub-buffers start on 256-byte boundaries (kernels/workspace.h), cuBLASLt's preferred
// alignment; the allocator's blocks are at least that aligned.

class CudaKernels final : public Kernels {
 public:
  explicit CudaKernels(memory::CachingAllocator& allocator)
      : Kernels(allocator), device_(allocator.device()), matmul_(device_) {
    PORTER_ASSERT(static_cast<size_t>(cuda::reduction_partials_count()) <=
                      workspace_layout::kCudaReductionPartials,
                  "cuda reductions need ", cuda::reduction_partials_count(),
                  " partials, kernels/workspace.h sizes ", workspace_layout::kCudaReductionPartials);
  }

  memory::DeviceKind kind() const override { return memory::DeviceKind::kCuda; }

 protected:
  void do_matmul(const Tensor& a, const Tensor& b, Tensor& out, const MatmulSpec& spec) override;
  void do_bias_add(Tensor& x, const Tensor& bias) override {
    const int64_t cols = bias.numel();
    cuda::bias_add(launch(), dev(x), dev(bias), cols ? x.numel() / cols : 0, cols);
  }
  void do_bias_backward(const Tensor& dy, Tensor& dbias) override {
    const int64_t cols = dbias.numel();
    cuda::bias_backward(launch(), dev(dy), dev(dbias), cols ? dy.numel() / cols : 0, cols);
  }
  void do_layernorm_forward(const Tensor& x, const Tensor& gamma, const Tensor& beta, Tensor& y,
                            Tensor& mean, Tensor& rstd, float eps) override {
    const int64_t cols = x.dim(-1);
    cuda::layernorm_forward(launch(), dev(x), dev(gamma), dev(beta), dev(y),
                            mean.data_as<float>(), rstd.data_as<float>(),
                            cols ? x.numel() / cols : 0, cols, eps);
  }
  void do_layernorm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma,
                             const Tensor& mean, const Tensor& rstd, Tensor& dx, Tensor& dgamma,
                             Tensor& dbeta) override {
    const int64_t cols = x.dim(-1);
    cuda::layernorm_backward(launch(), dev(dy), dev(x), dev(gamma), mean.data_as<float>(),
                             rstd.data_as<float>(), dev(dx), dev(dgamma), dev(dbeta),
                             cols ? x.numel() / cols : 0, cols);
  }
  void do_rmsnorm_forward(const Tensor& x, const Tensor& gamma, Tensor& y, Tensor& rstd,
                          float eps) override {
    const int64_t cols = x.dim(-1);
    cuda::rmsnorm_forward(launch(), dev(x), dev(gamma), dev(y), rstd.data_as<float>(),
                          cols ? x.numel() / cols : 0, cols, eps);
  }
  void do_rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma,
                           const Tensor& rstd, Tensor& dx, Tensor& dgamma) override {
    const int64_t cols = x.dim(-1);
    cuda::rmsnorm_backward(launch(), dev(dy), dev(x), dev(gamma), rstd.data_as<float>(), dev(dx),
                           dev(dgamma), cols ? x.numel() / cols : 0, cols);
  }
  // D comes from q (or dq); qkv's row tells the expanded layout from the packed one.
  void do_rope_qkv_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& qkv,
                           int heads, int kv_heads, double theta) override {
    const int64_t d = q.dim(2) / heads;
    cuda::rope_qkv_forward(launch(), dev(q), dev(k), dev(v), dev(qkv), qkv.dim(0) * qkv.dim(1),
                           qkv.dim(1), heads, kv_heads, d,
                           rope_group(qkv, d, heads, kv_heads), theta);
  }
  void do_rope_qkv_backward(const Tensor& dqkv, Tensor& dq, Tensor& dk, Tensor& dv, int heads,
                            int kv_heads, double theta) override {
    const int64_t d = dq.dim(2) / heads;
    cuda::rope_qkv_backward(launch(), dev(dqkv), dev(dq), dev(dk), dev(dv),
                            dqkv.dim(0) * dqkv.dim(1), dqkv.dim(1), heads, kv_heads, d,
                            rope_group(dqkv, d, heads, kv_heads), theta);
  }
  void do_swiglu_forward(const Tensor& gate, const Tensor& up, Tensor& y) override {
    cuda::swiglu_forward(launch(), dev(gate), dev(up), dev(y), gate.numel());
  }
  void do_swiglu_backward(const Tensor& gate, const Tensor& up, const Tensor& dy, Tensor& dgate,
                          Tensor& dup) override {
    cuda::swiglu_backward(launch(), dev(gate), dev(up), dev(dy), dev(dgate), dev(dup),
                          gate.numel());
  }
  void do_relu_forward(const Tensor& x, Tensor& y) override {
    cuda::relu_forward(launch(), dev(x), dev(y), x.numel());
  }
  void do_relu_backward(const Tensor& x, const Tensor& dy, Tensor& dx) override {
    cuda::relu_backward(launch(), dev(x), dev(dy), dev(dx), x.numel());
  }
  void do_silu_forward(const Tensor& x, Tensor& y) override {
    cuda::silu_forward(launch(), dev(x), dev(y), x.numel());
  }
  void do_silu_backward(const Tensor& x, const Tensor& dy, Tensor& dx) override {
    cuda::silu_backward(launch(), dev(x), dev(dy), dev(dx), x.numel());
  }
  void do_mse_forward(const Tensor& pred, const Tensor& target, Tensor& losses) override {
    const int64_t cols = pred.dim(-1);
    cuda::mse_forward(launch(), dev(pred), dev(target), losses.data_as<float>(),
                      cols ? pred.numel() / cols : 0, cols);
  }
  void do_mse_backward(const Tensor& pred, const Tensor& target, Tensor& dpred,
                       float scale) override {
    cuda::mse_backward(launch(), dev(pred), dev(target), dev(dpred), pred.numel(), scale);
  }
  void do_gelu_forward(const Tensor& x, Tensor& y) override {
    cuda::gelu_forward(launch(), dev(x), dev(y), x.numel());
  }
  void do_gelu_backward(const Tensor& x, const Tensor& dy, Tensor& dx) override {
    cuda::gelu_backward(launch(), dev(x), dev(dy), dev(dx), x.numel());
  }
  void do_attention_forward(const Tensor& qkv, Tensor& out, Tensor& probs, int heads) override;
  void do_attention_backward(const Tensor& dout, const Tensor& qkv, const Tensor& probs,
                             Tensor& dqkv, int heads) override;
  void do_flash_attention_forward(const Tensor& qkv, Tensor& out, Tensor& lse, int heads,
                                  int kv_heads) override;
  void do_flash_attention_backward(const Tensor& dout, const Tensor& qkv, const Tensor& out,
                                   const Tensor& lse, Tensor& dqkv, int heads,
                                   int kv_heads) override;
  void do_dropout_forward(const Tensor& x, Tensor& y, float p, const PhiloxKey& key) override {
    cuda::dropout(launch(), dev(x), dev(y), x.numel(), p, key);
  }
  void do_dropout_backward(const Tensor& dy, Tensor& dx, float p, const PhiloxKey& key) override {
    cuda::dropout(launch(), dev(dy), dev(dx), dy.numel(), p, key);
  }
  void do_add(const Tensor& a, const Tensor& b, Tensor& out) override {
    cuda::add(launch(), dev(a), dev(b), dev(out), out.numel());
  }
  void do_accumulate(Tensor& acc, const Tensor& x) override {
    cuda::accumulate(launch(), dev(acc), dev(x), acc.numel());
  }
  void do_embedding_forward(const Tensor& tokens, const Tensor& wte, const Tensor& wpe,
                            Tensor& out) override {
    const int64_t seq = tokens.dim(-1);
    cuda::embedding_forward(launch(), tokens.data_as<int32_t>(), dev(wte), dev(wpe), dev(out),
                            seq ? tokens.numel() / seq : 0, seq, wte.dim(-1), wte.dim(0));
  }
  void do_embedding_backward(const Tensor& dout, const Tensor& tokens, Tensor& dwte,
                             Tensor& dwpe) override {
    const int64_t seq = tokens.dim(-1);
    cuda::embedding_backward(launch(), dev(dout), tokens.data_as<int32_t>(), dev(dwte), dev(dwpe),
                             seq ? tokens.numel() / seq : 0, seq, dwte.dim(-1), dwte.dim(0), 0);
  }
  void do_embedding_forward_vocab_range(const Tensor& tokens, const Tensor& wte,
                                        int64_t vocab_begin, const Tensor& wpe,
                                        Tensor& out) override {
    const int64_t seq = tokens.dim(-1);
    cuda::embedding_forward_vocab_range(launch(), tokens.data_as<int32_t>(), dev(wte), vocab_begin,
                                        wpe.defined() ? dev(wpe) : DevPtr{}, dev(out),
                                        seq ? tokens.numel() / seq : 0, seq, wte.dim(-1),
                                        wte.dim(0));
  }
  void do_embedding_backward_vocab_range(const Tensor& dout, const Tensor& tokens,
                                         int64_t vocab_begin, Tensor& dwte,
                                         Tensor& dwpe) override {
    const int64_t seq = tokens.dim(-1);
    cuda::embedding_backward(launch(), dev(dout), tokens.data_as<int32_t>(), dev(dwte),
                             dwpe.defined() ? dev(dwpe) : DevPtr{},
                             seq ? tokens.numel() / seq : 0, seq, dwte.dim(-1), dwte.dim(0),
                             vocab_begin);
  }
  void do_cross_entropy_forward(const Tensor& logits, const Tensor& targets,
                                Tensor& losses) override {
    const int64_t vocab = logits.dim(-1);
    cuda::cross_entropy_forward(launch(), dev(logits), targets.data_as<int32_t>(),
                                losses.data_as<float>(), vocab ? logits.numel() / vocab : 0, vocab);
  }
  void do_cross_entropy_backward(const Tensor& logits, const Tensor& targets, Tensor& dlogits,
                                 float scale) override {
    const int64_t vocab = logits.dim(-1);
    cuda::cross_entropy_backward(launch(), dev(logits), targets.data_as<int32_t>(), dev(dlogits),
                                 vocab ? logits.numel() / vocab : 0, vocab, scale);
  }
  void do_cross_entropy_partial(const Tensor& logits, const Tensor& targets, int64_t vocab_begin,
                                int64_t valid, Tensor& stats) override {
    const int64_t cols = logits.dim(-1);
    cuda::cross_entropy_partial(launch(), dev(logits), targets.data_as<int32_t>(), vocab_begin,
                                valid, stats.data_as<float>(), cols ? logits.numel() / cols : 0,
                                cols);
  }
  void do_cross_entropy_combine(const Tensor& gathered, Tensor& losses, Tensor& lse) override {
    cuda::cross_entropy_combine(launch(), gathered.data_as<float>(), losses.data_as<float>(),
                                lse.data_as<float>(), gathered.dim(0), gathered.dim(1));
  }
  void do_cross_entropy_backward_partial(const Tensor& logits, const Tensor& targets,
                                         int64_t vocab_begin, int64_t valid, const Tensor& lse,
                                         Tensor& dlogits, float scale) override {
    const int64_t cols = logits.dim(-1);
    cuda::cross_entropy_backward_partial(launch(), dev(logits), targets.data_as<int32_t>(),
                                         vocab_begin, valid, lse.data_as<float>(), dev(dlogits),
                                         cols ? logits.numel() / cols : 0, cols, scale);
  }
  void do_adamw(Tensor& params, const Tensor& grad, Tensor& m, Tensor& v, const AdamWArgs& args,
                Tensor* params_out) override {
    // Note [Device AdamW bit identity]: the host's constants (kernels::adamw_constants).
    const AdamWConstants k = adamw_constants(args);
    const cuda::AdamWStep s{k.decay,     k.beta1,    k.one_minus_beta1, k.beta2,     k.one_minus_beta2,
                            k.step_size, k.bc2_sqrt, k.eps,             k.grad_scale};
    DevPtr out = params_out != nullptr && params_out->defined() ? dev(*params_out) : DevPtr{};
    cuda::adamw(launch(), params.data_as<float>(), dev(grad), m.data_as<float>(),
                v.data_as<float>(), out, params.numel(), s);
  }
  void do_sum(const Tensor& x, Tensor& out) override { reduce(x, out, cuda::SumOf::kValues); }
  void do_squared_norm(const Tensor& x, Tensor& out) override {
    reduce(x, out, cuda::SumOf::kSquares);
  }
  void do_nonfinite_count(const Tensor& x, Tensor& out) override {
    reduce(x, out, cuda::SumOf::kNonfinite);
  }
  void do_cast(const Tensor& x, Tensor& y) override {
    cuda::cast(launch(), dev(x), dev(y), x.numel());
  }
  void do_fill(Tensor& x, float value) override {
    cuda::fill(launch(), dev(x), value, x.numel());
  }
  void do_scale(Tensor& x, float s) override { cuda::scale(launch(), dev(x), s, x.numel()); }

 private:
  // Makes the device current on this thread and names the stream the kernels go to.
  cuda::Launch launch() {
    PORTER_GPU_CHECK(cudaSetDevice(device_.index()), device_.index());
    return cuda::Launch{static_cast<cudaStream_t>(device_.compute_stream().native_handle()),
                        device_.index()};
  }

  void reduce(const Tensor& x, Tensor& out, cuda::SumOf what) {
    const char* op = what == cuda::SumOf::kValues    ? "sum"
                     : what == cuda::SumOf::kSquares ? "squared_norm"
                                                      : "nonfinite_count";
    const memory::DeviceBuffer partials =
        workspace(reduction_workspace_bytes(kind(), x.numel()), op);
    cuda::sum(launch(), dev(x), x.numel(), what, partials.as<float>(), out.data_as<float>());
  }

  void gemm(GemmArgs g) { matmul_.run(g, launch().stream); }

  memory::Device& device_;  // not owned; outlives this
  cuda::CublasLtMatmul matmul_;
};

AttentionCall call_of(const Tensor& qkv, const Tensor& out, const Tensor* dqkv, int heads) {
  return AttentionCall{qkv.dim(0), qkv.dim(1), qkv.dim(2) / 3, heads, qkv.dtype(), out.dtype(),
                       dqkv != nullptr ? dqkv->dtype() : DType::kF32};
}

// Note [Cuda matmul shapes]
// The validation makes a, b and out all rank 2, or all rank 3 with one batch: rank 3 is a
// cuBLASLt strided batch with one matrix per entry.
void CudaKernels::do_matmul(const Tensor& a, const Tensor& b, Tensor& out,
                            const MatmulSpec& spec) {
  PORTER_ASSERT((out.rank() == 2 || out.rank() == 3) && a.rank() == out.rank() &&
                    b.rank() == out.rank(),
                "cuda matmul ranks a ", a.rank(), " b ", b.rank(), " out ", out.rank());
  GemmArgs g;
  g.ab_dtype = a.dtype();
  g.out_dtype = out.dtype();
  g.trans_a = spec.trans_a;
  g.trans_b = spec.trans_b;
  g.alpha = spec.alpha;
  g.beta = spec.beta;
  g.a = a.data();
  g.b = b.data();
  g.out = out.data();
  const int64_t a_rows = a.dim(-2), a_cols = a.dim(-1);
  const int64_t b_rows = b.dim(-2), b_cols = b.dim(-1);
  g.m = out.dim(-2);
  g.n = out.dim(-1);
  if (out.rank() == 3) {
    g.batch = out.dim(0);
    g.stride_a = a_rows * a_cols;
    g.stride_b = b_rows * b_cols;
    g.stride_out = g.m * g.n;
  }
  g.k = spec.trans_a ? a_rows : a_cols;
  PORTER_ASSERT((spec.trans_a ? a_cols : a_rows) == g.m && (spec.trans_b ? b_cols : b_rows) == g.k &&
                    (spec.trans_b ? b_rows : b_cols) == g.n,
                "cuda matmul shapes a ", a.shape().to_string(), " b ", b.shape().to_string(),
                " out ", out.shape().to_string(), " disagree with the validation");
  if (g.k == 0) {
    // An empty sum: out = beta * out (beta 0 clears it, even of NaNs, as a GEMM would).
    if (g.beta == 0.0f) {
      cuda::fill(launch(), dev(out), 0.0f, out.numel());
    } else {
      cuda::scale(launch(), dev(out), g.beta, out.numel());
    }
    return;
  }
  gemm(g);
}

// Note [Cuda attention]
// q, k, v are copied out of the packed qkv (B, T, 3C) into f32 (B, H, T, hd) matrices, so
// every head is one entry of a cuBLASLt strided batch (B * H entries) and the products are
// f32 whatever the activations' dtype. Forward: S = q k^T / sqrt(hd) is written straight
// into probs, the causal softmax runs in place, and O = P v is merged back into (B, T, C).
// Backward: dV = P^T dO, dP = dO V^T, dS = P (dP - rowsum(dP P)), dQ = dS K / sqrt(hd),
// dK = dS^T Q / sqrt(hd), merged into dqkv (overwritten).
void CudaKernels::do_attention_forward(const Tensor& qkv, Tensor& out, Tensor& probs, int heads) {
  const int64_t batch = qkv.dim(0), seq = qkv.dim(1), channels = qkv.dim(2) / 3;
  const int64_t hd = channels / heads, bh = batch * heads;
  if (bh == 0 || seq == 0 || hd == 0) return;
  const AttentionCall call = call_of(qkv, out, nullptr, heads);
  const size_t head_floats = workspace_layout::cuda_attention(call).head_elems;
  const memory::DeviceBuffer buffer =
      workspace(attention_forward_workspace_bytes(kind(), call), "attention_forward");
  PORTER_ASSERT(buffer.size_bytes() == workspace_layout::kCudaForwardHeadBuffers * head_floats * 4,
                "attention_forward workspace layout");
  float* q = buffer.as<float>();
  float* k = q + head_floats;
  float* v = k + head_floats;
  float* o = v + head_floats;
  const cuda::Launch l = launch();
  cuda::split_heads(l, dev(qkv), 3 * channels, 0, q, batch, seq, heads, hd);
  cuda::split_heads(l, dev(qkv), 3 * channels, channels, k, batch, seq, heads, hd);
  cuda::split_heads(l, dev(qkv), 3 * channels, 2 * channels, v, batch, seq, heads, hd);
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  float* p = probs.data_as<float>();
  gemm(GemmArgs{DType::kF32, DType::kF32, false, true, seq, seq, hd, bh, seq * hd, seq * hd,
                seq * seq, q, k, p, scale, 0.0f});
  cuda::causal_softmax_forward(l, p, bh, seq);
  gemm(GemmArgs{DType::kF32, DType::kF32, false, false, seq, hd, seq, bh, seq * seq, seq * hd,
                seq * hd, p, v, o, 1.0f, 0.0f});
  cuda::merge_heads(l, o, dev(out), channels, 0, batch, seq, heads, hd);
}

void CudaKernels::do_attention_backward(const Tensor& dout, const Tensor& qkv, const Tensor& probs,
                                        Tensor& dqkv, int heads) {
  const int64_t batch = qkv.dim(0), seq = qkv.dim(1), channels = qkv.dim(2) / 3;
  const int64_t hd = channels / heads, bh = batch * heads;
  if (bh == 0 || seq == 0 || hd == 0) return;
  const AttentionCall call = call_of(qkv, dout, &dqkv, heads);
  const workspace_layout::CudaAttention layout = workspace_layout::cuda_attention(call);
  const size_t head_floats = layout.head_elems;
  const memory::DeviceBuffer buffer =
      workspace(attention_backward_workspace_bytes(kind(), call), "attention_backward");
  PORTER_ASSERT(buffer.size_bytes() ==
                    (workspace_layout::kCudaBackwardHeadBuffers * head_floats +
                     layout.probs_elems) * 4,
                "attention_backward workspace layout");
  float* q = buffer.as<float>();
  float* k = q + head_floats;
  float* v = k + head_floats;
  float* d_o = v + head_floats;
  float* dq = d_o + head_floats;
  float* dk = dq + head_floats;
  float* dv = dk + head_floats;
  float* dp = dv + head_floats;
  const cuda::Launch l = launch();
  cuda::split_heads(l, dev(qkv), 3 * channels, 0, q, batch, seq, heads, hd);
  cuda::split_heads(l, dev(qkv), 3 * channels, channels, k, batch, seq, heads, hd);
  cuda::split_heads(l, dev(qkv), 3 * channels, 2 * channels, v, batch, seq, heads, hd);
  cuda::split_heads(l, dev(dout), channels, 0, d_o, batch, seq, heads, hd);
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const float* p = probs.data_as<float>();
  const int64_t s_hd = seq * hd, s_s = seq * seq;
  // dV (T, hd) = P^T (T, T) dO (T, hd)
  gemm(GemmArgs{DType::kF32, DType::kF32, true, false, seq, hd, seq, bh, s_s, s_hd, s_hd, p, d_o,
                dv, 1.0f, 0.0f});
  // dP (T, T) = dO (T, hd) V^T
  gemm(GemmArgs{DType::kF32, DType::kF32, false, true, seq, seq, hd, bh, s_hd, s_hd, s_s, d_o, v,
                dp, 1.0f, 0.0f});
  cuda::softmax_backward(l, p, dp, bh, seq);
  // dQ (T, hd) = dS (T, T) K (T, hd) * scale
  gemm(GemmArgs{DType::kF32, DType::kF32, false, false, seq, hd, seq, bh, s_s, s_hd, s_hd, dp, k,
                dq, scale, 0.0f});
  // dK (T, hd) = dS^T Q * scale
  gemm(GemmArgs{DType::kF32, DType::kF32, true, false, seq, hd, seq, bh, s_s, s_hd, s_hd, dp, q,
                dk, scale, 0.0f});
  cuda::merge_heads(l, dq, dev(dqkv), 3 * channels, 0, batch, seq, heads, hd);
  cuda::merge_heads(l, dk, dev(dqkv), 3 * channels, channels, batch, seq, heads, hd);
  cuda::merge_heads(l, dv, dev(dqkv), 3 * channels, 2 * channels, batch, seq, heads, hd);
}

FlashAttentionCall flash_call_of(const Tensor& qkv, const Tensor& out, const Tensor* dqkv,
                                 int heads, int kv_heads) {
  return FlashAttentionCall{qkv.dim(0),
                            qkv.dim(1),
                            qkv.dim(2) / (heads + 2 * int64_t{kv_heads}),
                            heads,
                            kv_heads,
                            qkv.dtype(),
                            out.dtype(),
                            dqkv != nullptr ? dqkv->dtype() : DType::kF32};
}

// The limits of the cuda flash kernels (kernels/cuda/launch.h): bad input, so a typed error.
void check_cuda_flash(const char* op, const FlashAttentionCall& c) {
  PORTER_CHECK(c.head_dim <= cuda::kFlashMaxHeadDim, op, ": head_dim ", c.head_dim,
               " is more than the cuda kernel's ", cuda::kFlashMaxHeadDim);
  PORTER_CHECK(c.batch * c.heads * c.seq < (int64_t{1} << 31), op, ": batch ", c.batch,
               " * heads ", c.heads, " * seq ", c.seq, " is 2^31 or more rows");
}

// Note [Cuda flash attention] in kernels/cuda/flash_attention.cu. Forward needs no workspace;
// backward's is the rows' D = sum(dout * out), (B, H, T) f32.
void CudaKernels::do_flash_attention_forward(const Tensor& qkv, Tensor& out, Tensor& lse,
                                             int heads, int kv_heads) {
  const FlashAttentionCall call = flash_call_of(qkv, out, nullptr, heads, kv_heads);
  if (call.batch == 0 || call.seq == 0 || call.head_dim == 0) return;
  check_cuda_flash("flash_attention_forward", call);
  PORTER_ASSERT(flash_attention_forward_workspace_bytes(kind(), call) == 0,
                "flash_attention_forward takes no cuda workspace");
  cuda::flash_attention_forward(launch(), dev(qkv), dev(out), lse.data_as<float>(), call.batch,
                                call.seq, heads, kv_heads, call.head_dim);
}

void CudaKernels::do_flash_attention_backward(const Tensor& dout, const Tensor& qkv,
                                              const Tensor& out, const Tensor& lse, Tensor& dqkv,
                                              int heads, int kv_heads) {
  const FlashAttentionCall call = flash_call_of(qkv, dout, &dqkv, heads, kv_heads);
  if (call.batch == 0 || call.seq == 0 || call.head_dim == 0) return;
  check_cuda_flash("flash_attention_backward", call);
  const memory::DeviceBuffer buffer = workspace(
      flash_attention_backward_workspace_bytes(kind(), call), "flash_attention_backward");
  const size_t rows = static_cast<size_t>(call.batch * heads * call.seq);
  PORTER_ASSERT(buffer.size_bytes() == workspace_layout::cuda_padded_elems(rows) * 4,
                "flash_attention_backward workspace layout");
  cuda::flash_attention_backward(launch(), dev(dout), dev(qkv), dev(out), lse.data_as<float>(),
                                 buffer.as<float>(), dev(dqkv), call.batch, call.seq, heads,
                                 kv_heads, call.head_dim);
}

}  // namespace

std::unique_ptr<Kernels> make_cuda_kernels(memory::CachingAllocator& allocator) {
  PORTER_CHECK(allocator.device().kind() == memory::DeviceKind::kCuda,
               "make_cuda_kernels needs a cuda device, got ", allocator.device().description());
  return std::make_unique<CudaKernels>(allocator);
}

std::unique_ptr<Kernels> make_cuda_kernels(memory::Device& device) {
  PORTER_CHECK(device.kind() == memory::DeviceKind::kCuda,
               "make_cuda_kernels needs a cuda device, got ", device.description());
  return make_kernels(device);
}

}  // namespace porter::kernels
