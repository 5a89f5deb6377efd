// ZeRO's flat-buffer partition and its per-rank model-state bytes: porter's exact bytes
// (padding included) beside the ZeRO paper's formulas. See docs/zero.md.
//
// Note [Flat partition]
// The flat parameter layout (nn::ParamLayout: every tensor at a multiple of
// nn::kParamAlignElems) has P = total_elems elements. For N ranks it is padded to
//   padded = round_up(P, N * align)   (align = nn::kParamAlignElems)
// and shard r is [r*S, (r+1)*S) with S = padded / N, itself a multiple of align. The padding
// is zero in the parameters and the gradients and never changes. Every stage, 0 included,
// uses the padded buffers, so a checkpoint written at one world size is a prefix-compatible
// flat buffer at any other.
//
// Note [Model-state bytes per rank]
// With p = bytes of a working parameter (2 for bf16/fp16, 4 for f32), g = bytes of a stored
// gradient element (4 for f32, the default; 2 with data_types.grad_accum_dtype bf16 or fp16,
// Note [Gradient dtype] in engine/run_options.h), and k = optimizer bytes per element
// (AdamW's two f32 moments, plus an f32 master copy when the parameters are not f32: 8 or
// 12), porter holds per rank, in elements of the padded buffer:
//   stage 0: params p*padded, grads g*padded, optimizer k*padded
//   stage 1: params p*padded, grads g*padded, optimizer k*S
//   stage 2: params p*padded, grads g*S,      optimizer k*S
//   stage 3: params p*S,      grads g*S,      optimizer k*S
// Stage 2's reduce buckets are transient and count under `comm`, not `grads`
// (docs/zero.md, "Buckets"). The ZeRO paper (Rajbhandari et al. 2020) writes the same with
// Psi = P unpadded, fp16 params and grads (2 + 2) and K = 12: stage 0 (2+2+K)Psi, stage 1
// 4Psi + K Psi/N, stage 2 2Psi + (2+K)Psi/N, stage 3 (2+2+K)Psi/N. paper_bytes() gives those
// with porter's p, g, k in place of 2, 2, K, so the two differ by the padding only.
#pragma once

#include <cstddef>
#include <cstdint>

#include "tensor/dtype.h"

namespace porter::zero {

struct Partition {
  int64_t total_elems = 0;   // P (the layout's, per-tensor alignment included)
  int64_t padded_elems = 0;  // round_up(P, N * align)
  int world_size = 1;        // N
  int64_t shard_elems = 0;   // S = padded / N
  int64_t begin(int rank) const { return static_cast<int64_t>(rank) * shard_elems; }
  int64_t end(int rank) const { return begin(rank) + shard_elems; }
};
// Throws InvalidArgument for world_size < 1 or total_elems < 0.
Partition make_partition(int64_t total_elems, int world_size);

// The dtypes that set p, g, k (Note [Model-state bytes per rank]).
struct StateDTypes {
  tensor::DType param = tensor::DType::kF32;
  tensor::DType grad = tensor::DType::kF32;  // data_types.grad_accum_dtype (Note [Gradient dtype])
  size_t param_bytes() const { return tensor::dtype_size(param); }
  size_t grad_bytes() const { return tensor::dtype_size(grad); }
  size_t optimizer_bytes() const { return param == tensor::DType::kF32 ? 8 : 12; }
};

struct StateBytes {
  size_t params = 0;
  size_t grads = 0;
  size_t optimizer = 0;
  size_t total() const { return params + grads + optimizer; }
};

// Note [Host-state bytes per rank]
// With the optimizer offloaded (Note [Optimizer offload]) the rank's range of S' elements (S
// at stages 1-3) keeps on the host the f32 master, both f32 moments and an f32 copy of the
// gradient shard, 16 S' bytes (the master even for f32 compute, where the device has none),
// plus the working copy in the compute dtype, p S' (the gradient copy is g S' with 16-bit
// gradients). When the gradients stream (ratio 1 at
// stages 2 and 3, Note [Streamed gradients] in zero/host_grads.h) the f32 copy is the only
// gradient shard, and a staging block of min(S, kGradStagingElems) f32 values joins it under
// grads. Parameter offload (stage 3, Note
// [Parameter offload]) keeps the working shard there, p S; with both, the working copy is the
// shard, counted once (and pinned as offload_param.pin_memory says). Pinned arrays round up
// to the pinned pool's granularity, each one.
// The streamed gradients' staging block, at most (zero::HostGradients::kStagingElems).
inline constexpr int64_t kGradStagingElems = int64_t{1} << 20;

struct HostStateBytes {
  size_t optimizer = 0;  // master + exp_avg + exp_avg_sq
  size_t grads = 0;      // the gradient shard's host copy
  size_t params = 0;     // the working copy / parameter shard
  size_t total() const { return optimizer + grads + params; }
};
// `ratio`: offload_optimizer.ratio (Note [Partial offload]); the optimizer's arrays hold
// offloaded_elems(S, ratio) elements.
HostStateBytes host_state_bytes(const Partition& part, int zero_stage, const StateDTypes& dtypes,
                                bool optimizer_offload, bool param_offload,
                                bool optimizer_pinned, bool param_pinned, double ratio = 1.0);
// floor(ratio * n), the elements of a range of n that a partial offload keeps on the host.
int64_t offloaded_elems(int64_t n, double ratio);
// The device's part of `exact` (exact_bytes at `zero_stage`) with the optimizer offloaded (the
// optimizer's bytes for the S - offloaded_elems(S, ratio) elements left on the device, and no
// gradient shard when the whole range is offloaded at stage 2 or 3: Note [Streamed gradients]
// in zero/host_grads.h) and/or the parameters (no parameter shard on the device).
StateBytes device_state_bytes(StateBytes exact, const Partition& part, int zero_stage,
                              const StateDTypes& dtypes, bool optimizer_offload, double ratio,
                              bool param_offload);

// porter's exact per-rank bytes at `stage` (0..3).
StateBytes exact_bytes(const Partition& part, int zero_stage, const StateDTypes& dtypes);
// The paper's formula with porter's dtypes, Psi = num_params (unpadded parameter count).
StateBytes paper_bytes(int64_t num_params, int world_size, int zero_stage,
                       const StateDTypes& dtypes);

}  // namespace porter::zero
