// Kernels: every op a GPT needs, defined once. The public methods check shapes and dtypes
// (the one definition of each op); the private do_* methods are the device implementations
// (kernels/cpu/cpu_kernels.cc: oneDNN + vectorised OpenMP loops; kernels/cuda/: cuBLASLt + our kernels).
//
// Conventions (Note [Kernel conventions]):
// - Row-major, contiguous tensors. (N, C) means N rows of C; a leading (B, T) is flattened.
// - Forward ops write their outputs. Backward ops *overwrite* input gradients (dx) and
//   *accumulate* (+=) parameter gradients (dweight, dbias, dgamma, dbeta, dwte, dwpe), so
//   micro-batches accumulate into the flat gradient buffer without extra passes.
// - Compute is f32. f32, bf16 and f16 tensors are accepted wherever noted (Note [Kernel
//   dtypes] in kernels.cc); 16-bit values are widened to f32 on load and rounded to
//   nearest-even on store (an f16 store of |v| >= 65520 gives inf). Reductions accumulate in
//   f32.
// - Kernels run on the device's compute stream; on cpu that is the calling thread, using up
//   to device.threads() OpenMP threads.
//
// Note [Kernel workspace]
// Every device byte a kernel uses beyond its arguments comes from a CachingAllocator, in
// category `workspace`: the cpu attention's scratch (Note [Attention scratch] and Note [Bf16
// attention] in kernels/cpu/attention.cc), the cpu matmul's f32 copies of f16 operands (Note [Cpu f16 matmul] in
// kernels/cpu/matmul.cc), the cpu reduction partials (kernels/cpu/reduce.cc), and the cuda attention and
// reduction buffers (Note [Cuda kernel workspace] in kernels/cuda/cuda_kernels.cc). So the device's
// capacity, MemoryStats, the out-of-memory accounting and the offload staging plans see
// those bytes like any other; the activation footprint does not (workspace is not in it).
// - Which allocator: the one given to make_kernels(allocator) at construction; the engine
//   passes its own, so the workspace lands in the step's statistics. Kernels are called
//   without a Ctx (tests, benchmarks, the optimizer step), so the allocator is the kernels'
//   own dependency rather than a per-call argument, and nn::Ctx stays as it is.
//   make_kernels(device) gives the kernels a private allocator on that device, for kernels
//   used alone: the bytes count against the device's capacity, but no other allocator's
//   statistics show them, and a block the private allocator caches is not released when
//   another allocator on the device runs out. Anything that also allocates tensors on the
//   device should share its allocator.
// - Lifetime: a buffer is allocated when a call starts and freed before it returns, so no
//   workspace is held between calls and the allocator returns to its baseline after every
//   op. Reuse is cheap: the allocator caches the freed block (rule 2 in
//   caching_allocator.h); an allocate/free pair of a cached 6 MiB block costs about 0.4 us
//   (3 us with the allocator's timeline on), against milliseconds for the attention call.
//   On cuda the free happens while the call's kernels are still queued; that is safe
//   because the allocator hands blocks out in compute-stream order, and a copy stream that
//   writes into a block first waits on a compute-stream event (Note [Stash protocol]).
// - Sizes are exact functions of the call's shapes and dtypes, published below for the
//   analytic memory model (checkpoint/analytic.cc, docs/memory-model.md "Kernel
//   workspace"); the kernels allocate exactly these requested bytes, laid out as
//   kernels/workspace.h defines. A call that needs none allocates nothing.
// - The exceptions are the matmul libraries' own temporaries, whose sizes the library picks
//   at run time: cuBLASLt's fixed 32 MiB workspace (kernels/cuda/matmul.h), a device segment owned
//   by the matmul object for the kernels' lifetime (the device counts it against its
//   capacity; MemoryStats does not show it), and oneDNN's library-managed scratchpad on cpu
//   (host heap, outside the simulated capacity), and likewise the cpu rotary op's cos/sin
//   table of T x D floats (kernels/cpu/rmsnorm_rope_swiglu.cc).
#pragma once

#include <memory>

#include "memory/caching_allocator.h"
#include "memory/device.h"
#include "tensor/philox.h"
#include "tensor/tensor.h"

namespace porter::kernels {

// The tensor core is the kernels' vocabulary.
using namespace porter::tensor;

class KernelTable;

struct MatmulSpec {
  bool trans_a = false;  // use a^T
  bool trans_b = false;  // use b^T
  float alpha = 1.0f;
  float beta = 0.0f;     // out = alpha * op(a) @ op(b) + beta * out
};

struct AdamWArgs {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;  // decoupled (AdamW)
  int64_t step = 1;           // 1-based, for bias correction
  float grad_scale = 1.0f;    // grads are multiplied by this first (clipping, loss scale)
};

// AdamW's per-step constants, the same for every implementation (the cpu kernels, the cuda
// kernel and zero::CpuAdam; Note [CpuAdam bit identity] in zero/cpu_adam.h): bias corrections
// in double (PyTorch's Python floats), then each constant rounded to float, lr * weight_decay
// rounded before the subtraction (kernels/cpu/adamw.cc, built without contraction, computes them).
struct AdamWConstants {
  float decay = 1.0f;  // 1 - lr * weight_decay
  float beta1 = 0.9f;
  float one_minus_beta1 = 0.1f;
  float beta2 = 0.999f;
  float one_minus_beta2 = 0.001f;
  float step_size = 1e-3f;  // lr / (1 - beta1^step)
  float bc2_sqrt = 1.0f;    // sqrt(1 - beta2^step)
  float eps = 1e-8f;
  float grad_scale = 1.0f;
};
AdamWConstants adamw_constants(const AdamWArgs& args);

class Kernels {
 public:
  virtual ~Kernels();
  Kernels(const Kernels&) = delete;
  Kernels& operator=(const Kernels&) = delete;
  virtual memory::DeviceKind kind() const = 0;
  // Where kernel workspace comes from (Note [Kernel workspace]).
  memory::CachingAllocator& workspace_allocator() const { return *allocator_; }
  // The choices these kernels made by measurement, or were pinned to (Note [Kernel table] in
  // kernels/kernel_table.cc); empty on devices that measure nothing.
  KernelTable& kernel_table() const { return *kernel_table_; }

  // out (M, N) = alpha * op(a) @ op(b) + beta * out, with op(a) (M, K) and op(b) (K, N).
  // Rank 3 (batch, rows, cols) for a, b and out multiplies batch by batch. a and b share a
  // dtype (f32, bf16 or f16); out is f32 or the inputs' dtype.
  void matmul(const Tensor& a, const Tensor& b, Tensor& out, const MatmulSpec& spec = {});
  // x (N, C) += bias (C), in place.
  void bias_add(Tensor& x, const Tensor& bias);
  // dbias (C) += sum over rows of dy (N, C).
  void bias_backward(const Tensor& dy, Tensor& dbias);
  // y = (x - mean) * rstd * gamma + beta per row of x (N, C); saves mean (N), rstd (N) f32.
  void layernorm_forward(const Tensor& x, const Tensor& gamma, const Tensor& beta, Tensor& y,
                         Tensor& mean, Tensor& rstd, float eps = 1e-5f);
  // dx = (overwrite); dgamma, dbeta += .
  void layernorm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma,
                          const Tensor& mean, const Tensor& rstd, Tensor& dx, Tensor& dgamma,
                          Tensor& dbeta);
  // RMSNorm (Llama): y = x * rstd * gamma per row of x (N, C), with rstd = 1 / sqrt(mean(x^2)
  // + eps) saved (N) f32.
  void rmsnorm_forward(const Tensor& x, const Tensor& gamma, Tensor& y, Tensor& rstd, float eps);
  // dx = (overwrite); dgamma += .
  void rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma,
                        const Tensor& rstd, Tensor& dx, Tensor& dgamma);
  // Llama's attention input (Note [Rotary qkv] in kernels.cc): q (B, T, H*D), k and v (B, T,
  // Hkv*D) with H = heads, Hkv = kv_heads dividing H, D even. qkv is [rope(q) | rope(k) | v] in
  // one of two layouts, told apart by its last dimension: (B, T, 3*H*D) with k and v expanded
  // so that query head h reads key/value head h / (H / Hkv), the layout attention_forward
  // takes with `heads` = H; or (B, T, (H + 2 Hkv) D), k and v as they are, the layout
  // flash_attention_forward takes (the two are one when Hkv = H). Position of row (b, t) is t;
  // rope rotates the channel pairs (i, i + D/2) of each head by t * theta^(-2i/D) (Hugging
  // Face's rotate_half convention).
  void rope_qkv_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& qkv,
                        int heads, int kv_heads, double theta);
  // The transpose: dq = rope^-1(dqkv's q part); dk, dv = dqkv's k and v parts, each summed
  // over its group's query heads (in head order) in the expanded layout, dk rotated back.
  // Overwrites dq, dk, dv.
  void rope_qkv_backward(const Tensor& dqkv, Tensor& dq, Tensor& dk, Tensor& dv, int heads,
                         int kv_heads, double theta);
  // SwiGLU (Llama's MLP): y = silu(gate) * up, silu(g) = g / (1 + exp(-g)); same shapes.
  void swiglu_forward(const Tensor& gate, const Tensor& up, Tensor& y);
  // dgate, dup = (overwrite).
  void swiglu_backward(const Tensor& gate, const Tensor& up, const Tensor& dy, Tensor& dgate,
                       Tensor& dup);
  // GELU, tanh form: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
  void gelu_forward(const Tensor& x, Tensor& y);
  void gelu_backward(const Tensor& x, const Tensor& dy, Tensor& dx);
  // ReLU: y = max(x, 0); same shapes, any float dtypes. y may be x (in place).
  void relu_forward(const Tensor& x, Tensor& y);
  // dx = dy where x > 0, else 0 (overwrite).
  void relu_backward(const Tensor& x, const Tensor& dy, Tensor& dx);
  // SiLU: y = x * sigmoid(x) = x / (1 + exp(-x)); same shapes. y may be x (in place).
  void silu_forward(const Tensor& x, Tensor& y);
  // dx = dy * s (1 + x (1 - s)), s = sigmoid(x) (overwrite).
  void silu_backward(const Tensor& x, const Tensor& dy, Tensor& dx);
  // Causal softmax attention. qkv (B, T, 3C) holds q, k, v side by side, each split into
  // `heads` heads of C / heads. out (B, T, C); probs (B, heads, T, T) f32 are the softmax
  // probabilities backward needs (zero above the diagonal). Scale 1 / sqrt(C / heads).
  void attention_forward(const Tensor& qkv, Tensor& out, Tensor& probs, int heads);
  void attention_backward(const Tensor& dout, const Tensor& qkv, const Tensor& probs,
                          Tensor& dqkv, int heads);
  // Memory-efficient causal attention (Note [Flash attention] in kernels.cc): the same
  // softmax(QK^T / sqrt(D)) V, computed over key tiles with an online softmax, so the (T, T)
  // probabilities never exist. qkv (B, T, (H + 2 Hkv) D) holds the H query heads, then the Hkv
  // key heads, then the Hkv value heads (H = heads, Hkv = kv_heads dividing H); query head h
  // reads key/value head h / (H / Hkv) in place, nothing expanded. With Hkv = H that is the
  // (B, T, 3C) qkv attention_forward takes. out (B, T, H D) any float dtype; lse (B, H, T) f32
  // is each row's log-sum-exp of its scaled scores, all backward needs besides qkv and out.
  void flash_attention_forward(const Tensor& qkv, Tensor& out, Tensor& lse, int heads,
                               int kv_heads);
  // dqkv (qkv's shape, overwritten) from dout (B, T, H D) and the forward's out and lse; each
  // tile's scores are recomputed. dK and dV sum over the group's query heads in head order.
  void flash_attention_backward(const Tensor& dout, const Tensor& qkv, const Tensor& out,
                                const Tensor& lse, Tensor& dqkv, int heads, int kv_heads);
  // y = x * mask / (1 - p), mask_i = (uniform(key, i) >= p). Nothing is saved: backward
  // regenerates the mask from the key (Note [Dropout keys] in philox.h). p in [0, 1). With
  // key.group_offset = o / 4, x is taken to be elements [o, o + n) of a larger tensor and
  // gets those elements' mask.
  void dropout_forward(const Tensor& x, Tensor& y, float p, const PhiloxKey& key);
  void dropout_backward(const Tensor& dy, Tensor& dx, float p, const PhiloxKey& key);
  // out = a + b (residual). out may alias a or b.
  void add(const Tensor& a, const Tensor& b, Tensor& out);
  // acc += x.
  void accumulate(Tensor& acc, const Tensor& x);
  // out (B, T, C) = wte[tokens] + wpe[t]; tokens (B, T) i32; wte (V, C); wpe (Tmax, C).
  void embedding_forward(const Tensor& tokens, const Tensor& wte, const Tensor& wpe, Tensor& out);
  // dwte, dwpe += .
  void embedding_backward(const Tensor& dout, const Tensor& tokens, Tensor& dwte, Tensor& dwpe);
  // Vocabulary-parallel embedding (Note [Vocabulary-parallel kernels] in kernels.cc): wte
  // (Vs, C) holds rows [v0, v0 + Vs) of the full token table, v0 = vocab_begin >= 0.
  // out (B, T, C) = (v0 <= tok < v0 + Vs ? wte[tok - v0] : 0) + (wpe defined ? wpe[t] : 0);
  // tokens (B, T) i32, any value (ids of other shards, negative ones, contribute 0); wpe
  // (Tmax, C) or Tensor(). Dtypes as embedding_forward, which it equals bit for bit when
  // v0 = 0, Vs = V and wpe is defined.
  void embedding_forward_vocab_range(const Tensor& tokens, const Tensor& wte,
                                     int64_t vocab_begin, const Tensor& wpe, Tensor& out);
  // dwte (Vs, C) += dout rows of the in-range tokens, at row tok - v0; dwpe (Tmax, C) += every
  // position's rows, when defined (Tensor() skips it). Equals embedding_backward as above.
  void embedding_backward_vocab_range(const Tensor& dout, const Tensor& tokens,
                                      int64_t vocab_begin, Tensor& dwte, Tensor& dwpe);
  // losses (N) f32 = -log softmax(logits (N, V))[targets]; targets (N) i32.
  void cross_entropy_forward(const Tensor& logits, const Tensor& targets, Tensor& losses);
  // dlogits (N, V) = (softmax(logits) - onehot(targets)) * scale (overwrite).
  void cross_entropy_backward(const Tensor& logits, const Tensor& targets, Tensor& dlogits,
                              float scale);
  // Squared error: losses (N) f32 = sum over the K columns of (pred - target)^2, per row of
  // pred (N, K) (a leading (B, T) is flattened); target has pred's shape. Each row is summed
  // in column order on cpu and by one block's fixed tree on cuda.
  void mse_forward(const Tensor& pred, const Tensor& target, Tensor& losses);
  // dpred = 2 (pred - target) * scale (overwrite); dpred may be pred itself.
  void mse_backward(const Tensor& pred, const Tensor& target, Tensor& dpred, float scale);
  // Vocabulary-parallel cross-entropy: partial on each rank, an all-gather of the stats (the
  // caller's), combine, backward_partial (Note [Vocabulary-parallel kernels] in kernels.cc).
  // logits (N, Vs) are columns [v0, v0 + Vs) of the full (N, V) logits, v0 = vocab_begin;
  // only the first `valid` (0 <= valid <= Vs) are vocabulary, the rest padding, never read.
  // targets (N) i32 are global ids. Logits and dlogits dtypes as cross_entropy_forward and
  // _backward; stats, gathered, losses and lse are f32. No workspace.
  // stats (N, 3) per row: m = max of the valid logits (-inf when valid = 0), s = sum of
  // exp(l - m) over them (0 when valid = 0), z = the target's logit when v0 <= target <
  // v0 + valid, else 0.
  void cross_entropy_partial(const Tensor& logits, const Tensor& targets, int64_t vocab_begin,
                             int64_t valid, Tensor& stats);
  // gathered (t, N, 3): the t ranks' stats, rank-major. Per row: M = max_r m_r, S = sum_r
  // s_r exp(m_r - M) (terms with s_r = 0 add nothing), lse (N) = M + log S, losses (N) =
  // lse - sum_r z_r. A target in no rank's valid columns is not detected: its loss is lse.
  void cross_entropy_combine(const Tensor& gathered, Tensor& losses, Tensor& lse);
  // dlogits (N, Vs) = (exp(l - lse) - [col == target - v0]) * scale in the valid columns, 0 in
  // the padding (overwrite). dlogits may be logits itself (in place).
  void cross_entropy_backward_partial(const Tensor& logits, const Tensor& targets,
                                      int64_t vocab_begin, int64_t valid, const Tensor& lse,
                                      Tensor& dlogits, float scale);
  // One AdamW step on f32 master params with f32 moments m, v; grad f32, bf16 or f16. When
  // `params_out` is defined (an f32, bf16 or f16 working copy), the updated params are
  // written there too, rounded to its dtype.
  void adamw(Tensor& params, const Tensor& grad, Tensor& m, Tensor& v, const AdamWArgs& args,
             Tensor* params_out = nullptr);
  // out (1) f32 = sum of x; out (1) f32 = sum of x^2.
  void sum(const Tensor& x, Tensor& out);
  void squared_norm(const Tensor& x, Tensor& out);
  // out (1) f32 = the number of elements of x (any float dtype) that are inf or NaN: exact
  // up to 2^24, and > 0 exactly when x has one. Overwrites out. The fp16 loss scaler's
  // overflow test: one call per gradient buffer (or shard), with no host sync until out is
  // read; counts add across calls and ranks, so a sum all-reduce of them tests all ranks.
  void nonfinite_count(const Tensor& x, Tensor& out);
  // y = x converted between float dtypes (f32, bf16, f16); same shape.
  void cast(const Tensor& x, Tensor& y);
  void fill(Tensor& x, float value);
  void scale(Tensor& x, float s);

 protected:
  explicit Kernels(memory::CachingAllocator& allocator);

  // `bytes` of device memory for one call's temporaries, category workspace, freed when the
  // buffer dies (Note [Kernel workspace]). Zero bytes gives an empty buffer. Throws
  // OutOfMemoryError naming `op`, with the allocator's accounting.
  memory::DeviceBuffer workspace(size_t bytes, const char* op);

  virtual void do_matmul(const Tensor& a, const Tensor& b, Tensor& out, const MatmulSpec& spec) = 0;
  virtual void do_bias_add(Tensor& x, const Tensor& bias) = 0;
  virtual void do_bias_backward(const Tensor& dy, Tensor& dbias) = 0;
  virtual void do_layernorm_forward(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                    Tensor& y, Tensor& mean, Tensor& rstd, float eps) = 0;
  virtual void do_layernorm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma,
                                     const Tensor& mean, const Tensor& rstd, Tensor& dx,
                                     Tensor& dgamma, Tensor& dbeta) = 0;
  virtual void do_rmsnorm_forward(const Tensor& x, const Tensor& gamma, Tensor& y, Tensor& rstd,
                                  float eps) = 0;
  virtual void do_rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma,
                                   const Tensor& rstd, Tensor& dx, Tensor& dgamma) = 0;
  virtual void do_rope_qkv_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                   Tensor& qkv, int heads, int kv_heads, double theta) = 0;
  virtual void do_rope_qkv_backward(const Tensor& dqkv, Tensor& dq, Tensor& dk, Tensor& dv,
                                    int heads, int kv_heads, double theta) = 0;
  virtual void do_swiglu_forward(const Tensor& gate, const Tensor& up, Tensor& y) = 0;
  virtual void do_swiglu_backward(const Tensor& gate, const Tensor& up, const Tensor& dy,
                                  Tensor& dgate, Tensor& dup) = 0;
  virtual void do_gelu_forward(const Tensor& x, Tensor& y) = 0;
  virtual void do_gelu_backward(const Tensor& x, const Tensor& dy, Tensor& dx) = 0;
  virtual void do_relu_forward(const Tensor& x, Tensor& y) = 0;
  virtual void do_relu_backward(const Tensor& x, const Tensor& dy, Tensor& dx) = 0;
  virtual void do_silu_forward(const Tensor& x, Tensor& y) = 0;
  virtual void do_silu_backward(const Tensor& x, const Tensor& dy, Tensor& dx) = 0;
  virtual void do_mse_forward(const Tensor& pred, const Tensor& target, Tensor& losses) = 0;
  virtual void do_mse_backward(const Tensor& pred, const Tensor& target, Tensor& dpred,
                               float scale) = 0;
  virtual void do_attention_forward(const Tensor& qkv, Tensor& out, Tensor& probs, int heads) = 0;
  virtual void do_attention_backward(const Tensor& dout, const Tensor& qkv, const Tensor& probs,
                                     Tensor& dqkv, int heads) = 0;
  virtual void do_flash_attention_forward(const Tensor& qkv, Tensor& out, Tensor& lse, int heads,
                                          int kv_heads) = 0;
  virtual void do_flash_attention_backward(const Tensor& dout, const Tensor& qkv,
                                           const Tensor& out, const Tensor& lse, Tensor& dqkv,
                                           int heads, int kv_heads) = 0;
  virtual void do_dropout_forward(const Tensor& x, Tensor& y, float p, const PhiloxKey& key) = 0;
  virtual void do_dropout_backward(const Tensor& dy, Tensor& dx, float p, const PhiloxKey& key) = 0;
  virtual void do_add(const Tensor& a, const Tensor& b, Tensor& out) = 0;
  virtual void do_accumulate(Tensor& acc, const Tensor& x) = 0;
  virtual void do_embedding_forward(const Tensor& tokens, const Tensor& wte, const Tensor& wpe,
                                    Tensor& out) = 0;
  virtual void do_embedding_backward(const Tensor& dout, const Tensor& tokens, Tensor& dwte,
                                     Tensor& dwpe) = 0;
  virtual void do_cross_entropy_forward(const Tensor& logits, const Tensor& targets,
                                        Tensor& losses) = 0;
  virtual void do_cross_entropy_backward(const Tensor& logits, const Tensor& targets,
                                         Tensor& dlogits, float scale) = 0;
  virtual void do_embedding_forward_vocab_range(const Tensor& tokens, const Tensor& wte,
                                                int64_t vocab_begin, const Tensor& wpe,
                                                Tensor& out) = 0;
  virtual void do_embedding_backward_vocab_range(const Tensor& dout, const Tensor& tokens,
                                                 int64_t vocab_begin, Tensor& dwte,
                                                 Tensor& dwpe) = 0;
  virtual void do_cross_entropy_partial(const Tensor& logits, const Tensor& targets,
                                        int64_t vocab_begin, int64_t valid, Tensor& stats) = 0;
  virtual void do_cross_entropy_combine(const Tensor& gathered, Tensor& losses, Tensor& lse) = 0;
  virtual void do_cross_entropy_backward_partial(const Tensor& logits, const Tensor& targets,
                                                 int64_t vocab_begin, int64_t valid,
                                                 const Tensor& lse, Tensor& dlogits,
                                                 float scale) = 0;
  virtual void do_adamw(Tensor& params, const Tensor& grad, Tensor& m, Tensor& v,
                        const AdamWArgs& args, Tensor* params_out) = 0;
  virtual void do_sum(const Tensor& x, Tensor& out) = 0;
  virtual void do_squared_norm(const Tensor& x, Tensor& out) = 0;
  virtual void do_nonfinite_count(const Tensor& x, Tensor& out) = 0;
  virtual void do_cast(const Tensor& x, Tensor& y) = 0;
  virtual void do_fill(Tensor& x, float value) = 0;
  virtual void do_scale(Tensor& x, float s) = 0;

 private:
  friend std::unique_ptr<Kernels> make_kernels(memory::Device& device);

  memory::CachingAllocator* allocator_;  // not owned (or owned_allocator_); outlives this
  std::unique_ptr<memory::CachingAllocator> owned_allocator_;  // make_kernels(device) only
  std::unique_ptr<KernelTable> kernel_table_;
};

// The kernels for the allocator's device (cpu or cuda), taking their workspace from
// `allocator` (Note [Kernel workspace]). The allocator and its device must outlive them.
std::unique_ptr<Kernels> make_kernels(memory::CachingAllocator& allocator);
// The same with a private allocator on `device`, owned by the kernels: for kernels used
// alone. The device must outlive them.
std::unique_ptr<Kernels> make_kernels(memory::Device& device);

// The shapes and dtypes of one attention call: qkv (batch, seq, 3 * channels).
struct AttentionCall {
  int64_t batch = 0;
  int64_t seq = 0;
  int64_t channels = 0;
  int heads = 1;
  DType qkv = DType::kF32;
  DType out = DType::kF32;   // forward: out; backward: dout
  DType dqkv = DType::kF32;  // backward only
};

// Requested bytes of workspace one call takes from the allocator on a device of `kind`
// (Note [Kernel workspace]); 0 when it takes none.
size_t attention_forward_workspace_bytes(memory::DeviceKind kind, const AttentionCall& call);
size_t attention_backward_workspace_bytes(memory::DeviceKind kind, const AttentionCall& call);
// The shapes and dtypes of one flash attention call: qkv (batch, seq, (heads + 2 kv_heads)
// head_dim).
struct FlashAttentionCall {
  int64_t batch = 0;
  int64_t seq = 0;
  int64_t head_dim = 0;
  int heads = 1;
  int kv_heads = 1;
  DType qkv = DType::kF32;
  DType out = DType::kF32;   // out and dout
  DType dqkv = DType::kF32;  // backward only
};
// Forward takes none; backward takes the rows' D = sum(dout * out), (B, H, T) f32 (padded to
// 256 bytes on cuda), on both devices.
size_t flash_attention_forward_workspace_bytes(memory::DeviceKind kind,
                                               const FlashAttentionCall& call);
size_t flash_attention_backward_workspace_bytes(memory::DeviceKind kind,
                                                const FlashAttentionCall& call);
// sum, squared_norm and nonfinite_count of a tensor of `numel` elements.
size_t reduction_workspace_bytes(memory::DeviceKind kind, int64_t numel);

// The shapes and dtypes of one matmul call: out (batch, m, n) = op(a) (batch, m, k) @
// op(b) (batch, k, n); batch 1 for rank 2.
struct MatmulCall {
  int64_t batch = 1;
  int64_t m = 0;
  int64_t n = 0;
  int64_t k = 0;
  DType ab = DType::kF32;   // a and b
  DType out = DType::kF32;
};

// Requested workspace bytes of one matmul (Note [Cpu f16 matmul] in kernels/cpu/matmul.cc): on cpu
// with f16 operands 4·(batch·m·k + batch·k·n) for their f32 copies, plus 4·batch·m·n when out
// is f16 too; 0 otherwise, and 0 when batch, m, n or k is 0. On cuda always 0 (cuBLASLt
// multiplies f16 directly; its own workspace is the exception above).
size_t matmul_workspace_bytes(memory::DeviceKind kind, const MatmulCall& call);

}  // namespace porter::kernels
