// Causal attention one (batch, head) at a time on porter's own AVX-512 tiles (Note [Attention
// head tiles] in kernels/cpu/attention_heads.cc). Internal to the cpu kernels.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "kernels/kernels.h"
#include "tensor/tensor.h"

namespace porter::kernels::cpu {

// Sizes of one attention call: qkv (b, t, 3c), c = heads * hd.
struct HeadDims {
  int64_t b, t, c, heads, hd;
};

// Which implementation a cpu attention call runs (PORTER_CPU_ATTENTION).
enum class AttentionImpl {
  kAuto,    // as the kernel table says (Note [Kernel table]): where the cpu has the head
            // tiles' instructions, the tiles, or under kernel_choice "fastest" whichever of the
            // two measures faster per call shape; oneDNN otherwise
  kTiles,   // the head tiles wherever the cpu has their instructions
  kOneDnn,  // always oneDNN's batched matmuls over row blocks
};

// $PORTER_CPU_ATTENTION: auto (the default), tiles or onednn. Throws InvalidArgument, naming
// the variable and the accepted values, on another value.
AttentionImpl attention_impl_from_env();

// The kernel table's choice for calls like `call` on `threads` threads: true for the tiles,
// false for oneDNN, nullopt where none is recorded (Note [Kernel table]).
std::optional<bool> attention_choice(const KernelTable& table, const AttentionCall& call,
                                     bool backward, int threads);

// Whether this cpu runs the f32 head tiles (AVX-512F) and the bf16 ones (AVX512-BF16, and an
// even head_dim, since they multiply pairs of bf16 values along it).
bool attention_tiles_f32_supported();
bool attention_tiles_bf16_supported(int64_t head_dim);

// Host scratch for the tiles' packed per-head copies: one slice per thread, grown to the
// largest call so far. Owned by the kernels object, outside the device's capacity like
// oneDNN's own scratchpad (Note [Attention head tiles]).
class TileScratch {
 public:
  // `threads` slices of at least `bytes` each, 64-byte aligned; slice(tid) after this.
  void reserve(int threads, size_t bytes);
  char* slice(int tid) { return base_ + static_cast<size_t>(tid) * slice_bytes_; }
  size_t bytes() const { return storage_.size(); }

 private:
  std::vector<std::byte> storage_;
  char* base_ = nullptr;
  size_t slice_bytes_ = 0;
};

// f32 forward. x: (b, t, 3c) qkv; o: (b, t, c) out; pr: (b, heads, t, t) probabilities, written
// whole (zeros above the diagonal).
void attention_forward_tiles_f32(int threads, const HeadDims& d, const float* x, float* o,
                                 float* pr, TileScratch& scratch);
// f32 backward. dy: (b, t, c); ds: (b, heads, R, t) f32 scratch, R = min(64, t) (the device
// workspace's dP block); dx: (b, t, 3c), written whole.
void attention_backward_tiles_f32(int threads, const HeadDims& d, const float* x, const float* dy,
                                  const float* pr, float* ds, float* dx, TileScratch& scratch);
// bf16 forward: qkv bf16; out any float dtype, rounded once from f32.
void attention_forward_tiles_bf16(int threads, const HeadDims& d, const uint16_t* x, Tensor& out,
                                  float* pr, TileScratch& scratch);
// bf16 backward: qkv and dout bf16; dp as ds above; dqkv any float dtype, rounded once.
void attention_backward_tiles_bf16(int threads, const HeadDims& d, const uint16_t* x,
                                   const uint16_t* dy, const float* pr, float* dp, Tensor& dqkv,
                                   TileScratch& scratch);

}  // namespace porter::kernels::cpu
