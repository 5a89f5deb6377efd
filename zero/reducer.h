// The gradient reducer of ZeRO stages 0 to 3: buckets, their reductions on the comm
// stream, and the rank's gradient shard. See docs/zero.md, "Stages" and "Buckets".
//
// Note [Gradient reduction]
// Per step, with N data-parallel ranks (for N = 1 nothing is communicated or scaled; stage 2
// still moves each bucket into the shard, which is then the whole buffer):
// - stage 0: gradients accumulate in the full flat buffer; in the last micro-batch each
//   bucket of it (Note [Gradient buckets]) is all-reduced in place, as soon as backward
//   completed it (overlap_comm) or after backward.
// - stage 1: as stage 0, but each bucket is reduce-scattered (Note [Bucketed
//   reduce-scatter]) and rank r's result overwrites its shard's part of the flat buffer.
// - stage 2: there is no full gradient buffer. In every micro-batch, before the first
//   backward that writes into a bucket its contiguous buffer (category comm) is allocated,
//   zeroed and the entries it covers are bound to views of it (Note [Gradient views] in
//   nn/layer.h); after the last writer's backward the entries are unbound again and the
//   bucket is packed, freed, and reduce-scattered; the rank adds its block into its f32
//   gradient shard (category grads, S elements: contiguous_gradients). Stage 3 reduces
//   exactly as stage 2 (only the parameters differ, zero/param_gatherer.h). At most two packed
//   buckets are in flight (stage 1 too): issuing a third first completes the oldest (the
//   wait is exposed).
// Scaling follows DeepSpeed's allreduce_bucket (f = gradient_predivide_factor):
//   prescale_gradients false: times 1/f before the reduction (when f != 1), times f/N after
//                             (when f != N)  -- the default f = 1 sums, then takes 1/N;
//   prescale_gradients true:  times 1/N before, nothing after.
// "Before" scales each bucket's local gradients; "after" scales the rank's reduced shard (the
// whole buffer at stage 0) once per element, in the step's last micro-batch: each bucket's
// part of the shard as soon as its reduction is complete (Note [Ready gradients]), and what
// no bucket reduced (one rank at stages 0 and 1) at the end.
//
// Note [Reduce-scatter off]
// zero_optimization.reduce_scatter false (DeepSpeed: all-reduce the gradients, then each rank
// keeps its partition) applies at stages 1, 2 and 3, as in DeepSpeed (its stage 3 all-reduces a
// contiguous bucket and narrows it to the partition in __avg_scatter_contiguous_grads). Each
// packed bucket (Note [Bucketed reduce-scatter]) is all-reduced instead of reduce-scattered,
// count N*B, and rank r keeps block r. The ring splits an all-reduce of N*B elements into the
// same N chunks of B that the reduce-scatter reduces (Note [Gloo ring]: chunk c is [c*B,
// (c+1)*B) either way) and adds each chunk's contributions in the same order, so on Gloo the
// gradients, and so the whole training state, are bitwise those of reduce_scatter true at every
// world size. Memory is the same too (the packed buffer, category comm). What differs is the
// traffic: the op is all_reduce, whose payload (CommStats) is the same N*B elements, but a ring
// all-reduce sends 2(N-1)*B per rank, twice the reduce-scatter's. A bucket all-reduced anyway
// (use_all_reduce) is unchanged. On NCCL, which may pick another algorithm (a tree) for
// all_reduce than for reduce_scatter, the sums agree only to rounding beyond two ranks.
//
// Note [Ready gradients]
// A part of the shard is final once the last micro-batch's reduction of its bucket is complete
// and post-scaled. on_ready(lo, hi) (set_on_ready) is then called with the part, in shard
// elements, in compute-stream order: its values are there for work queued after the call. The
// optimizer offload uses it to copy each bucket's gradients to the host while backward goes on
// (Note [Optimizer offload]). Parts no reduction covers (one rank at stages 0 and 1, where
// nothing is reduced) are not reported: the caller takes them after end_micro_batch.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "memory/caching_allocator.h"
#include "kernels/kernels.h"
#include "nn/layer.h"
#include "zero/buckets.h"
#include "zero/partition.h"

namespace porter::zero {

struct ReducerOptions {
  int zero_stage = 0;             // 0..3 (3 reduces as 2)
  // The gradients' dtype: buckets, reductions and the shard (Note [Gradient dtype] in
  // engine/run_options.h). The flat gradient buffer of stages 0 and 1 has it too.
  tensor::DType grad_dtype = tensor::DType::kF32;
  bool overlap_comm = false;
  bool reduce_scatter = true;     // stages 1-3: false all-reduces (Note [Reduce-scatter off])
  bool prescale_gradients = false;
  double predivide_factor = 1.0;
};

// Where a streamed gradient shard goes (Note [Streamed gradients] in zero/host_grads.h): the
// reducer then keeps no shard on the device and hands each reduced part to the sink instead.
class GradSink {
 public:
  virtual ~GradSink() = default;
  // `part` (f32, on the device, valid for work queued after the call on the compute stream)
  // is this rank's reduced gradient of one micro-batch for shard elements [lo, lo +
  // part.numel()). The sink adds it to its copy (`first`: the step's first micro-batch, whose
  // part replaces the copy as 0 + part does), then multiplies by `scale` when given (the
  // post-scale, in the step's last micro-batch). It keeps `part`'s storage alive for as long
  // as it reads it (record_stream), so the reducer frees it as soon as the call returns.
  virtual void add(const tensor::Tensor& part, int64_t lo, bool first,
                   std::optional<float> scale) = 0;
};

// Communication figures of the reducer since the last take_stats().
struct ReducerStats {
  double reduce_busy_s = 0.0;     // comm-stream time of the gradient reductions
  double reduce_exposed_s = 0.0;  // host time the compute stream waited for them
  int64_t buckets = 0;            // reductions issued
};

class GradReducer {
 public:
  // `flat` has the padded layout (and a gradient buffer unless ZeRO stage 2); entry_stage[i]
  // is the chain stage owning layout entry i; `rebind` binds the model to `flat` again. dp may
  // be null. A `sink` (not owned; stages 2 and 3 only) streams the shard to it (Note [Streamed
  // gradients] in zero/host_grads.h): the reducer then allocates no shard.
  GradReducer(nn::FlatParams& flat, kernels::Kernels& kernels, memory::CachingAllocator& allocator,
              comm::Communicator* dp, const Partition& part, std::vector<Bucket> buckets,
              std::vector<int> entry_stage, const ReducerOptions& options,
              std::function<void()> rebind, GradSink* sink = nullptr);
  ~GradReducer();

  // The gradients the optimizer reads: stage 2's shard buffer; else the flat buffer's
  // [r*S, (r+1)*S) at stage 1, the whole flat buffer at stage 0. Undefined when streamed.
  // Throws UsageError while the gradients are away (set_away).
  const tensor::Tensor& shard() const {
    if (!away_.empty()) throw_away("GradReducer::shard");
    return shard_;
  }
  bool streamed() const { return sink_ != nullptr; }
  int64_t shard_begin() const { return shard_begin_; }  // flat index of shard()[0]
  bool distributed() const { return n_ > 1; }
  const std::vector<Bucket>& buckets() const { return buckets_; }

  // Note [Ready gradients]: called for each bucket's part of the shard once it is final.
  void set_on_ready(std::function<void(int64_t lo, int64_t hi)> on_ready) {
    on_ready_ = std::move(on_ready);
  }

  // Zeroes the gradients (the shard at stage 2) for a new step.
  void zero_grads();
  void begin_micro_batch(bool last);
  void before_backward(int chain_stage);
  void after_backward(int chain_stage);
  // After the micro-batch's schedule: issues what backward left, completes every reduction
  // and, after the last micro-batch, applies the post-scale.
  void end_micro_batch();
  // After an error: the communicator must have been aborted (or be healthy); waits out the
  // pending reductions ignoring their errors, frees every bucket and unbinds. Never throws.
  void abort() noexcept;
  ReducerStats take_stats();

  // Moving the gradient shard to host memory and back (Note [Offloaded model states] in
  // engine/states_offload.cc), between steps only (no bucket live, no reduction pending):
  // for_each_state calls `f` on the shard the reducer owns (stages 2 and 3 unless streamed;
  // none otherwise), which it may replace or drop. set_away(why) marks it away: shard() (at
  // stages 0 and 1 a view of the flat gradient buffer, then dropped) and zero_grads() throw
  // UsageError(why). set_away("") brings it back, after the flat buffer's own return.
  void for_each_state(const std::function<void(tensor::Tensor&)>& f);
  void set_away(std::string why);

 private:
  [[noreturn]] void throw_away(const char* what) const;
  struct Pending {  // a reduction in flight
    size_t bucket = 0;
    comm::Work work;
    tensor::Tensor packed;  // the packed bucket (Note [Bucketed reduce-scatter]); else undefined
    // A scattering stage's bucket all-reduced in place (BucketBlocks::use_all_reduce): the
    // reduced bucket, of which this rank keeps its intersection.
    tensor::Tensor reduced;
  };
  void issue(size_t b, tensor::Tensor contiguous);
  void finished(size_t b);  // Note [Ready gradients]
  void complete_oldest();
  void complete(Pending& p);
  void prescale(tensor::Tensor& t);
  void bind_bucket(size_t b, const tensor::Tensor& buffer);
  // The post-scale of the step's last micro-batch, if any (Note [Gradient reduction]).
  std::optional<float> post_scale() const;
  // Shard elements [at, at + part.numel()) of this micro-batch: into the shard, or the sink.
  void add_to_shard(const tensor::Tensor& part, int64_t at);

  nn::FlatParams* flat_;
  kernels::Kernels* kernels_;
  memory::CachingAllocator* allocator_;
  comm::Communicator* dp_;
  Partition part_;
  int n_ = 1, rank_ = 0;
  std::vector<Bucket> buckets_;
  std::vector<BucketBlocks> blocks_;
  std::vector<std::vector<size_t>> bucket_entries_;
  ReducerOptions options_;
  std::function<void()> rebind_;
  std::function<void(int64_t, int64_t)> on_ready_;
  GradSink* sink_ = nullptr;
  bool first_ = true;  // the step's first micro-batch (the sink's `first`)
  tensor::Tensor shard_;
  int64_t shard_begin_ = 0;
  bool last_ = false;
  bool reducing_ = false;  // this micro-batch reduces (stage 2: always; else the last)
  std::vector<tensor::Tensor> live_;          // per bucket: stage 2's contiguous buffer
  std::vector<bool> issued_;
  std::deque<Pending> pending_;
  ReducerStats stats_;
  std::string away_;  // non-empty: the gradients are in host memory (set_away)
};

}  // namespace porter::zero
