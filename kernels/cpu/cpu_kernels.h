// The cpu Kernels: oneDNN matmul (kernels/cpu/matmul.cc) and vectorised OpenMP loops for the rest
// (kernels/cpu/elementwise.cc, kernels/cpu/relu_silu_mse.cc, kernels/cpu/layernorm.cc, kernels/cpu/attention.cc, kernels/cpu/loss.cc, kernels/cpu/adamw.cc,
// kernels/cpu/reduce.cc). Shared helpers for those files live here.
//
// Note [Cpu determinism]
// Every cpu kernel gives bit-identical results for any thread count:
// - elementwise and per-row work is independent of the partition;
// - reductions over rows (dbias, dgamma, dbeta, dwte, dwpe) are partitioned over columns, so
//   each output element is summed by one thread in row order;
// - whole-tensor reductions (sum, squared_norm) sum fixed-size chunks (kReduceChunkElems),
//   independent of the thread count, then add the chunk partials in order, in double.
// oneDNN matmul is the exception we cannot force: see Note [Matmul determinism].
//
// Note [Cpu vectorisation]
// The project builds at -O2 for the x86-64 baseline. Hot loops carry `#pragma omp simd`
// (vectorised regardless of GCC's -O2 "very cheap" cost model) and PORTER_CPU_CLONES, which
// compiles AVX-512, AVX2 and baseline clones picked at load time (Note [Cpu ISA dispatch] in
// kernels/cpu/isa.h). exp() is our own
// polynomial (fast_exp), since libm's expf is never vectorised without -ffast-math.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <memory>
#include <type_traits>
#include <vector>

#include "base/check.h"
#include "memory/device.h"
#include "kernels/cpu/attention_heads.h"
#include "kernels/cpu/isa.h"
#include "kernels/kernels.h"

namespace porter::kernels {

class DnnlMatmul;

// Runs on the calling thread (the cpu compute stream) with up to device.threads() OpenMP
// threads. Scratch memory comes from the allocator per call (Note [Kernel workspace]).
class CpuKernels final : public Kernels {
 public:
  // Kernels for the allocator's (cpu) device, with workspace from `allocator`.
  explicit CpuKernels(memory::CachingAllocator& allocator);
  ~CpuKernels() override;
  memory::DeviceKind kind() const override { return memory::DeviceKind::kCpu; }
  int threads() const { return threads_; }

 protected:
  void do_matmul(const Tensor& a, const Tensor& b, Tensor& out, const MatmulSpec& spec) override;
  void do_bias_add(Tensor& x, const Tensor& bias) override;
  void do_bias_backward(const Tensor& dy, Tensor& dbias) override;
  void do_layernorm_forward(const Tensor& x, const Tensor& gamma, const Tensor& beta, Tensor& y,
                            Tensor& mean, Tensor& rstd, float eps) override;
  void do_layernorm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma,
                             const Tensor& mean, const Tensor& rstd, Tensor& dx, Tensor& dgamma,
                             Tensor& dbeta) override;
  void do_rmsnorm_forward(const Tensor& x, const Tensor& gamma, Tensor& y, Tensor& rstd,
                          float eps) override;
  void do_rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma,
                           const Tensor& rstd, Tensor& dx, Tensor& dgamma) override;
  void do_rope_qkv_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& qkv,
                           int heads, int kv_heads, double theta) override;
  void do_rope_qkv_backward(const Tensor& dqkv, Tensor& dq, Tensor& dk, Tensor& dv, int heads,
                            int kv_heads, double theta) override;
  void do_swiglu_forward(const Tensor& gate, const Tensor& up, Tensor& y) override;
  void do_swiglu_backward(const Tensor& gate, const Tensor& up, const Tensor& dy, Tensor& dgate,
                          Tensor& dup) override;
  void do_gelu_forward(const Tensor& x, Tensor& y) override;
  void do_gelu_backward(const Tensor& x, const Tensor& dy, Tensor& dx) override;
  void do_relu_forward(const Tensor& x, Tensor& y) override;
  void do_relu_backward(const Tensor& x, const Tensor& dy, Tensor& dx) override;
  void do_silu_forward(const Tensor& x, Tensor& y) override;
  void do_silu_backward(const Tensor& x, const Tensor& dy, Tensor& dx) override;
  void do_mse_forward(const Tensor& pred, const Tensor& target, Tensor& losses) override;
  void do_mse_backward(const Tensor& pred, const Tensor& target, Tensor& dpred,
                       float scale) override;
  void do_attention_forward(const Tensor& qkv, Tensor& out, Tensor& probs, int heads) override;
  void do_attention_backward(const Tensor& dout, const Tensor& qkv, const Tensor& probs,
                             Tensor& dqkv, int heads) override;
  void do_flash_attention_forward(const Tensor& qkv, Tensor& out, Tensor& lse, int heads,
                                  int kv_heads) override;
  void do_flash_attention_backward(const Tensor& dout, const Tensor& qkv, const Tensor& out,
                                   const Tensor& lse, Tensor& dqkv, int heads,
                                   int kv_heads) override;
  void do_dropout_forward(const Tensor& x, Tensor& y, float p, const PhiloxKey& key) override;
  void do_dropout_backward(const Tensor& dy, Tensor& dx, float p, const PhiloxKey& key) override;
  void do_add(const Tensor& a, const Tensor& b, Tensor& out) override;
  void do_accumulate(Tensor& acc, const Tensor& x) override;
  void do_embedding_forward(const Tensor& tokens, const Tensor& wte, const Tensor& wpe,
                            Tensor& out) override;
  void do_embedding_backward(const Tensor& dout, const Tensor& tokens, Tensor& dwte,
                             Tensor& dwpe) override;
  void do_cross_entropy_forward(const Tensor& logits, const Tensor& targets,
                                Tensor& losses) override;
  void do_cross_entropy_backward(const Tensor& logits, const Tensor& targets, Tensor& dlogits,
                                 float scale) override;
  void do_embedding_forward_vocab_range(const Tensor& tokens, const Tensor& wte,
                                        int64_t vocab_begin, const Tensor& wpe,
                                        Tensor& out) override;
  void do_embedding_backward_vocab_range(const Tensor& dout, const Tensor& tokens,
                                         int64_t vocab_begin, Tensor& dwte,
                                         Tensor& dwpe) override;
  void do_cross_entropy_partial(const Tensor& logits, const Tensor& targets, int64_t vocab_begin,
                                int64_t valid, Tensor& stats) override;
  void do_cross_entropy_combine(const Tensor& gathered, Tensor& losses, Tensor& lse) override;
  void do_cross_entropy_backward_partial(const Tensor& logits, const Tensor& targets,
                                         int64_t vocab_begin, int64_t valid, const Tensor& lse,
                                         Tensor& dlogits, float scale) override;
  void do_adamw(Tensor& params, const Tensor& grad, Tensor& m, Tensor& v, const AdamWArgs& args,
                Tensor* params_out) override;
  void do_sum(const Tensor& x, Tensor& out) override;
  void do_squared_norm(const Tensor& x, Tensor& out) override;
  void do_nonfinite_count(const Tensor& x, Tensor& out) override;
  void do_cast(const Tensor& x, Tensor& y) override;
  void do_fill(Tensor& x, float value) override;
  void do_scale(Tensor& x, float s) override;

 private:
  // Whether an attention call runs on the head tiles (Note [Attention head tiles]):
  // `supported` when the cpu has their instructions, then as PORTER_CPU_ATTENTION says, or as
  // the kernel table says or decides (Note [Kernel table]), timing run(true) against
  // run(false) under kernel_choice "fastest".
  bool attention_on_tiles(const AttentionCall& call, bool backward, bool supported,
                          const std::function<void(bool)>& run);

  memory::Device& device_;  // not owned; outlives the kernels
  int threads_;
  std::unique_ptr<DnnlMatmul> dnnl_;
  cpu::AttentionImpl attention_impl_;
  cpu::TileScratch tile_scratch_;  // the head tiles' packed copies
};

namespace cpu {

// Element access: f32 is `float`, bf16 is its bit pattern in `uint16_t`, f16 its bit
// pattern in `Half` (a distinct type, so that load and store overload on it); see
// tensor/dtype.h. Loads widen to f32, stores round to nearest-even.
struct Half {
  uint16_t bits;
};
static_assert(sizeof(Half) == 2 && alignof(Half) == 2, "Half must be the bare f16 bits");

inline float load(const float* p) { return *p; }
inline float load(const uint16_t* p) { return bf16_to_f32(*p); }
inline float load(const Half* p) { return f16_to_f32(p->bits); }
inline void store(float* p, float v) { *p = v; }
inline void store(uint16_t* p, float v) { *p = f32_to_bf16(v); }
inline void store(Half* p, float v) { p->bits = f32_to_f16(v); }

// The element type of a float dtype: float (f32), uint16_t (bf16) or Half (f16).
template <typename Fn>
void dispatch_float(DType t, Fn&& fn) {
  switch (t) {
    case DType::kF32: fn(float{}); return;
    case DType::kBF16: fn(uint16_t{}); return;
    case DType::kF16: fn(Half{}); return;
    case DType::kI32:
    case DType::kI64:
    case DType::kBool: break;
  }
  PORTER_CHECK(false, "the cpu kernels take f32, bf16 or f16 tensors here, not ", dtype_name(t));
}

// Note [Cpu dtype combinations]
// An op with k float arguments could take 3^k dtype combinations, each its own template
// instantiation (times 3 PORTER_CPU_CLONES). A call mixes f32 with at most one 16-bit type,
// which is every mix a bf16 or fp16 model makes (f32 master parameters and gradients with
// 16-bit activations), so each argument dispatches over {f32, that type}: 2 * 2^k + 1
// instantiations. A cpu call mixing bf16 with f16 throws InvalidArgument (the validation in
// kernels.cc accepts it, and cuda runs it); cast, AdamW, attention, embedding and
// cross-entropy (whole or vocabulary-parallel) dispatch each argument on its own and take any
// mix (matmul's rule, a and b alike and out f32 or theirs, admits none).

// The one 16-bit dtype among `dtypes` (kF32 when all are f32); throws on bf16 mixed with f16.
inline DType half_dtype_of(std::initializer_list<DType> dtypes) {
  DType half = DType::kF32;
  for (DType t : dtypes) {
    PORTER_CHECK(t == DType::kF32 || t == DType::kBF16 || t == DType::kF16,
                 "the cpu kernels take f32, bf16 or f16 tensors here, not ", dtype_name(t));
    if (t == DType::kF32) continue;
    PORTER_CHECK(half == DType::kF32 || half == t, "a cpu kernel call mixes bf16 and f16 "
                 "tensors; use one 16-bit type per call, or cast first (Note [Cpu dtype "
                 "combinations])");
    half = t;
  }
  return half;
}

template <typename H, typename Fn>
void dispatch_floats_as(Fn&& fn) {
  fn();
}

template <typename H, typename Fn, typename... Rest>
void dispatch_floats_as(Fn&& fn, DType first, Rest... rest) {
  auto next = [&](auto tag) {
    dispatch_floats_as<H>([&](auto... tags) { fn(tag, tags...); }, rest...);
  };
  if (first == DType::kF32) {
    next(float{});
  } else {
    next(H{});
  }
}

// Calls fn(T1{}, T2{}, ...) with the element type of each dtype, which may mix f32 with one
// 16-bit type (Note [Cpu dtype combinations]).
template <typename Fn, typename... D>
void dispatch_floats(Fn&& fn, D... dtypes) {
  switch (half_dtype_of({dtypes...})) {
    case DType::kBF16: dispatch_floats_as<uint16_t>(fn, dtypes...); return;
    case DType::kF16: dispatch_floats_as<Half>(fn, dtypes...); return;
    default: dispatch_floats_as<float>(fn, dtypes...); return;
  }
}

// Calls fn with each tensor's data as a pointer to its element type, const for const
// tensors: with_typed(fn, x, dy, dx) calls fn(xp, dyp, dxp). Dispatches as dispatch_floats.
template <typename Fn, typename... Ts>
void with_typed(Fn&& fn, Ts&... ts) {
  dispatch_floats(
      [&](auto... tags) {
        fn(static_cast<std::conditional_t<std::is_const_v<Ts>, const decltype(tags)*,
                                          decltype(tags)*>>(ts.data())...);
      },
      ts.dtype()...);
}

// A 64-byte aligned start of a host buffer grown to hold `bytes` (oneDNN's kernels and the
// attention tiles load whole cache lines). Growing discards the contents.
inline char* aligned_bytes(std::vector<std::byte>& buffer, size_t bytes) {
  if (buffer.size() < bytes + 64) buffer.assign(bytes + 64, std::byte{0});
  return reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(buffer.data()) + 63) &
                                 ~uintptr_t{63});
}

// dst (x.numel() f32) = x widened; x is any float dtype (kernels/cpu/elementwise.cc).
void widen_to_f32(int threads, const Tensor& x, float* dst);
// y = src (y.numel() f32) rounded to y's dtype (kernels/cpu/elementwise.cc).
void narrow_from_f32(int threads, const float* src, Tensor& y);

// exp(x) to a few ulp, with x clamped to [-87, 88] (below -87 it returns ~1e-38, which
// every caller treats as 0); vectorisable (Note [Cpu vectorisation]).
inline float fast_exp(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  // Round to nearest integer by the 1.5 * 2^23 trick: pure arithmetic, so it vectorises.
  constexpr float kRound = 12582912.0f;
  float n = (x * 1.44269504088896341f + kRound) - kRound;
  // Cody-Waite: ln2 split in a part exact in float and the rest.
  float r = x - n * 0.693145751953125f;
  r = r - n * 1.428606765330187045e-06f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

// Rows of a (..., C) tensor: the leading dimensions flattened.
inline int64_t rows_of(const Tensor& t) { return t.dim(-1) == 0 ? 0 : t.numel() / t.dim(-1); }

// Elementwise work is cut into blocks of this many elements, one OpenMP task each.
inline constexpr int64_t kBlockElems = 16384;
inline int64_t blocks_of(int64_t n) { return (n + kBlockElems - 1) / kBlockElems; }

// Runs fn(begin, end) over [0, n) in kBlockElems blocks on up to `threads` threads.
template <typename Fn>
void parallel_blocks(int threads, int64_t n, Fn&& fn) {
  const int64_t blocks = blocks_of(n);
  if (blocks <= 1) {
    if (n > 0) fn(int64_t{0}, n);
    return;
  }
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t begin = blk * kBlockElems;
    fn(begin, std::min(n, begin + kBlockElems));
  }
}

// Runs fn(row) for each of `rows` rows on up to `threads` threads.
template <typename Fn>
void parallel_rows(int threads, int64_t rows, Fn&& fn) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t r = 0; r < rows; ++r) fn(r);
}

}  // namespace cpu
}  // namespace porter::kernels
