// porter::zero::HostGradients: the rank's gradient shard kept in host memory only, filled by
// the reducer bucket by bucket while backward goes on, for the offloaded optimizer.
//
// Note [Streamed gradients]
// With the optimizer wholly offloaded (offload_optimizer.device "cpu", ratio 1) at ZeRO stage
// 2 or 3, nothing on the device reads the gradient shard: the norm, the overflow test and
// AdamW all run on the host. So the device keeps none (category grads: 0 bytes, where it held
// 4 S), and the host holds the only copy, as ZeRO-Offload does. Per micro-batch, as each
// reduce bucket's reduction completes (or, on one rank, as backward finishes the bucket), the
// reducer hands this rank's reduced part of it to the sink (GradSink in zero/reducer.h), which
//   1. queues its copy to the host on the optimizer's copy lane ("optimizer offload"), after
//      the compute stream's work so far, through a staging block of at most kStagingElems f32
//      values in the same host tier (larger parts go in pieces), and marks the part's device
//      buffer as used by the lane (record_stream), so the reducer frees it as before and the
//      allocator reuses its bytes once the copy has read them;
//   2. queues, behind the copy on the same lane, the host accumulation into the host shard:
//         first micro-batch of the step:  g = 0 + part      (what the device path's zeroed
//                                                          shard plus accumulate gives: -0
//                                                          becomes +0)
//         later micro-batches:           g = g + part
//         the step's last micro-batch:    g = g * s         (the reducer's post-scale s, when
//                                                          Note [Gradient reduction] has one)
//      each an f32 operation rounded on its own (this file is compiled without contraction),
//      on 16-bit gradients (Note [Gradient dtype] in engine/run_options.h) widened first and
//      rounded to their dtype after each operation, as the device kernels store them,
//      in micro-batch order, which is the device path's order (kernels' accumulate, then
//      scale), so the shard's bits are the device path's.
// The device therefore holds, of the gradients, only the reducer's buckets in flight (category
// comm, Note [Gradient buckets in the footprint] in checkpoint/costs.h), whose lifetimes do not
// change. The optimizer's global_norm waits for the lane (finish(), the exposed part of the
// copies) and then reduces the host shard with kernels::host_squared_norm and
// host_nonfinite_count, which are the cpu device's own reductions over host memory: on the cpu
// device the norm, the clip coefficient and the fp16 overflow verdict are those of the device
// path bit for bit, and there is no second pass over device memory. (On cuda the device path's
// norm is the cuda kernel's sum, whose order differs: the two agree to rounding.)
// Host bytes: the shard (4 S in f32, 2 S in 16 bits) and the staging block, both in the tier pin_memory names
// (Note [Host-state bytes per rank] in zero/partition.h). A partial offload (ratio < 1) and
// stage 1 keep their device gradient buffers: stage 1 accumulates in the whole flat buffer by
// definition, and a partial offload updates part of the range on the device.
#pragma once

#include <cstdint>
#include <optional>

#include "memory/host_tier.h"
#include "tensor/tensor.h"
#include "zero/partition.h"
#include "zero/reducer.h"

namespace porter::zero {

class HostGradients final : public GradSink {
 public:
  // The most elements one staged copy moves (4 MiB in f32).
  static constexpr int64_t kStagingElems = kGradStagingElems;
  // The staging block's elements for a shard of `shard_elems`.
  static int64_t staging_elems(int64_t shard_elems);

  // `grad` is the host shard of `elems` values of `dtype` (the gradients' dtype: f32, bf16 or
  // f16; zeroed here: elements no bucket covers, the partition's padding, stay zero); `staging`
  // a block of the lane's tier holding staging_elems(elems) of them. Neither is owned; both
  // outlive this, as does the lane.
  HostGradients(memory::HostLane& lane, memory::Device& device, tensor::DType dtype, void* grad,
                int64_t elems, void* staging, int threads);

  // GradSink: Note [Streamed gradients], steps 1 and 2.
  void add(const tensor::Tensor& part, int64_t lo, bool first, std::optional<float> scale) override;

  // Waits for every queued copy and accumulation (rethrowing a copy's error); returns the
  // seconds it waited. After it, data() holds the step's reduced gradients.
  double finish();
  const void* data() const { return grad_; }
  tensor::DType dtype() const { return dtype_; }
  int64_t size() const { return elems_; }
  // Of the host shard's [lo, hi), after finish(): the sum of squares and the count of inf/NaN
  // values, as the cpu device's kernels compute them.
  float squared_norm(int64_t lo, int64_t hi) const;
  float nonfinite_count() const;
  // Bytes queued to the host since the last call.
  uint64_t take_sent_bytes();

 private:
  memory::HostLane* lane_;
  memory::Device* device_;
  tensor::DType dtype_;
  size_t elem_;  // its bytes
  void* grad_;
  int64_t elems_;
  void* staging_;
  int64_t staging_elems_;
  int threads_;
  uint64_t sent_bytes_ = 0;
};

// Note [Streamed gradients], step 2 over n values of `dtype`: dst = (first ? 0 + src : dst +
// src), then dst *= scale when there is one; f32 operations on the widened values, each
// rounded to `dtype` on store, as the cpu kernels' add and scale round.
void accumulate_host_grads(tensor::DType dtype, void* dst, const void* src, int64_t n, bool first,
                           std::optional<float> scale);

}  // namespace porter::zero
