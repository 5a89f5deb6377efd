// porter::zero::ShardedOptimizer: the rank's share of the optimizer (f32 master weights,
// AdamW moments) and the phases of a step that read the reduced gradients: the global norm,
// overflow agreement, clipping, the AdamW update and the parameter all-gather.
//
// Note [Sharded optimizer]
// With N data-parallel ranks at ZeRO stage z (docs/zero.md), the optimizer range is the whole
// padded flat buffer [0, P') at z = 0 and the rank's shard [r*S, (r+1)*S) above (Note [Flat
// partition]). Over that range it owns, in category `optimizer`:
//   master      f32 copy of the parameters (bf16/fp16 compute only; f32 updates in place)
//   exp_avg     AdamW m (f32)
//   exp_avg_sq  AdamW v (f32)
// and the fp16 loss scaler. A step calls, in order, after the gradients are reduced into the
// shard (zero/reducer.h):
//   1. global_norm(shard): at z = 0 the local buffer (every rank holds the whole reduced
//      gradient), else the square root of the all-reduced sum of the shards' squared norms;
//      divided by the loss scale. With fp16 an inf/nan on any rank (all_reduce max of this
//      rank's count) is an overflow for everyone. The clip coefficient is
//      min(1, clip / (norm + 1e-6)) when gradient_clipping > 0 (DeepSpeed's rule).
//   2. update(shard, lr, norm): unless the step overflowed, AdamW at `lr` for the count of
//      updating steps, once per run of Note [Parameter groups] in the range (that run's weight
//      decay, lr x its lr_scale), with the clip coefficient and 1 / loss_scale folded into its gradient
//      scale (the gradients themselves stay unclipped and scaled, so they can be dumped); the
//      bf16/fp16 working copy of the range is written in the same pass. At z = 1 and 2 the
//      ranks' updated ranges are then all-gathered into every rank's working buffer; at z = 3
//      the working copy is the rank's shard alone (working()), and each stage's parameters
//      are gathered from the shards when the next step needs them (zero/param_gatherer.h).
//   3. finish_step(overflowed): the loss scaler's update and the count of updating steps.
// Host time spent waiting on its collectives is counted (take_exposed_s), so the engine can
// report what communication the step did not hide.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "comm/communicator.h"
#include "config/config.h"
#include "memory/caching_allocator.h"
#include "memory/host_tier.h"
#include "memory/pinned_pool.h"
#include "kernels/kernels.h"
#include "nn/layer.h"
#include "zero/loss_scaler.h"
#include "zero/param_groups.h"
#include "zero/partition.h"
#include "zero/reducer.h"

namespace porter::zero {

// Note [Optimizer offload]
// zero_optimization.offload_optimizer.device "cpu" (ZeRO-Offload; "nvme" reads as "cpu"):
// the f32 master weights and both AdamW moments of the rank's range live in host memory,
// pinned (in the engine's pinned pool, within porter.device.pinned_limit) when pin_memory is
// on, pageable otherwise, and none of it on the device; so does a host copy of the range's
// gradients and of its updated working copy (Note [Host-state bytes per rank] in
// zero/partition.h), all blocks of a host tier (Note [Host tier] in memory/host_tier.h: the
// pinned one, or a pageable one without pin_memory), whose lane is the copy stream below.
// A step then
//   1. at stages 2 and 3 (with the whole range offloaded) receives every micro-batch's reduced
//      bucket parts on the host as the reducer produces them, and the device keeps no
//      gradient shard (grad_sink(), Note [Streamed gradients] in zero/host_grads.h);
//      global_norm() waits for the copies. At stage 1 and with a partial offload, copies each
//      bucket's part of the reduced gradient shard to the host on the optimizer's copy stream
//      ("optimizer offload") as soon as the reducer reports it final (gradients_ready, Note
//      [Ready gradients] in zero/reducer.h), while backward goes on; update() copies what is
//      left and waits for the copies. Either way a copy error throws before any state changed,
//   2. runs AdamW there (zero::CpuAdam, bit-identical to the device kernel: Note [CpuAdam bit
//      identity]) on the host threads, writing the working copy in the compute dtype,
//   3. copies the working copy back into the device's range on the copy stream, piece by piece
//      as the update writes it (Note [Pipelined host update]; with parameter offload the
//      working copy is the host shard: nothing goes back), and
//      all-gathers it as without offload (stages 1 and 2).
// The global norm (clipping, fp16 overflow) is computed before (on the host from the host
// shard when the gradients stream, on the device otherwise), so the update waits for it: nothing is speculative and nothing is rolled back; the
// host update is on the step's critical path (exposed: OffloadStats). A run with the
// optimizer offloaded is bitwise one without. With f32 compute the host master equals the
// working copy, which is what a checkpoint stores, so checkpoints are the same with and
// without offload.
//
// Note [Pipelined host update]
// The host AdamW runs over the offloaded range in pieces, in flat-layout order (the model's
// order: embeddings and the first layers first), of max(kHostUpdatePieceElems, h / 8)
// elements; each piece's working copy is queued to the device on the optimizer's copy lane as
// soon as the host has written it, so the upload of the first pieces overlaps the update of
// the later ones and the step waits, after the last piece, only for that piece's copy rather
// than the whole working copy's. Each element is updated by the same formula whatever the
// pieces (Note [CpuAdam bit identity]), so the result is bitwise the unpipelined one. The next
// forward still starts after the whole update and its upload: a forward whose first stages
// start while the host updates the later pieces would need each stage to wait for its own
// piece, which porter does not do.
inline constexpr int64_t kHostUpdatePieceElems = int64_t{1} << 22;

// Note [Partial offload]
// offload_optimizer.ratio r < 1 (stage 3; DeepSpeed's ZeRO-Offload++): of the rank's range of
// n elements the first h = offloaded_elems(n, r) = floor(r n) are the host's (master, moments,
// gradient copy and working copy in host memory, CpuAdam), and the other n - h stay on the
// device, updated there by the device kernel in the same step. Each element is updated by the
// same formula either way, so any ratio is bitwise the run without offload; checkpoints hold
// each state tensor whole (host part, then device part), the same for every ratio.
struct OptimizerOffloadOptions {
  bool enabled = false;
  double ratio = 1.0;       // offload_optimizer.ratio: the fraction of the range on the host
  bool pin_memory = true;   // offload_optimizer.pin_memory
  int threads = 0;          // host threads of the update (CpuAdam); 0: every core
  bool operator==(const OptimizerOffloadOptions&) const = default;
};

// Note [Parameter offload]
// zero_optimization.offload_param.device "cpu" at stage 3 (ZeRO-Infinity's parameter offload
// to host memory; "nvme" reads as "cpu"): the rank's working shard, working(), lives in host
// memory (pinned within porter.device.pinned_limit when pin_memory is on, pageable otherwise)
// instead of on the device. The device then holds, of the parameters, only the gathered
// units in flight and the persistent ones: the gatherer copies this rank's part of a unit to
// the device on its own copy stream ("param h2d", over the link) and broadcasts it from
// there (Note [Stage 3 gather]). The update writes the shard on the host:
//   * with the optimizer offloaded too, CpuAdam's working-copy output is the shard itself,
//     so nothing goes back to the device after the update;
//   * with the optimizer on the device, AdamW writes the range into a transient device
//     buffer (category params, the shard's size, alive for the update only), which is then
//     copied to the host shard (param_d2h_bytes).
// The values are those of the run without offload, bit for bit: only where they are kept
// changes.
struct ParamOffloadOptions {
  bool enabled = false;
  bool pin_memory = true;   // offload_param.pin_memory
  bool operator==(const ParamOffloadOptions&) const = default;
};

// The offloaded optimizer's traffic and host time since the last take_offload_stats().
struct OffloadStats {
  uint64_t d2h_bytes = 0;     // gradients to the host
  uint64_t d2h_overlapped_bytes = 0;  // of which queued during backward (gradients_ready)
  double d2h_wait_s = 0.0;            // the update's wait for the gradient copies
  uint64_t h2d_bytes = 0;     // working copies back
  double cpu_update_s = 0.0;  // the host AdamW
  double exposed_s = 0.0;     // copies + host update: the time the step waited for them
  uint64_t param_d2h_bytes = 0;  // Note [Parameter offload]: the device-updated shard to the host
  // The host update's span, for the trace (steady_clock; equal when there was none).
  std::chrono::steady_clock::time_point update_begin, update_end;
  // Folds a later window in: bytes and times add; the span is the later window's when it had
  // one.
  OffloadStats& operator+=(const OffloadStats& s) {
    d2h_bytes += s.d2h_bytes;
    d2h_overlapped_bytes += s.d2h_overlapped_bytes;
    d2h_wait_s += s.d2h_wait_s;
    h2d_bytes += s.h2d_bytes;
    cpu_update_s += s.cpu_update_s;
    exposed_s += s.exposed_s;
    param_d2h_bytes += s.param_d2h_bytes;
    if (s.update_end != s.update_begin) {
      update_begin = s.update_begin;
      update_end = s.update_end;
    }
    return *this;
  }
};

// Whether the gradient shard streams to the host (Note [Streamed gradients] in
// zero/host_grads.h): the optimizer wholly offloaded at stage 2 or 3.
bool streams_gradients(int zero_stage, const OptimizerOffloadOptions& offload);

struct OptimizerOptions {
  int zero_stage = 0;                  // zero_optimization.stage: 0..3
  config::OptimizerConfig adamw;       // lr (the schedule's base), betas, eps, weight_decay
  double gradient_clipping = 0.0;      // 0: off
  config::Fp16Config fp16;             // loss scaling when enabled
  OptimizerOffloadOptions offload;     // Note [Optimizer offload]
  ParamOffloadOptions param_offload;   // Note [Parameter offload]; stage 3 only
  // zero_optimization.allgather_bucket_size: Note [Bucketed parameter all-gather].
  int64_t allgather_bucket_elems = 500'000'000;
  // porter.optimizer (Note [Parameter groups] in zero/param_groups.h), resolved against the
  // flat buffer's layout when the optimizer is built. Empty here, so every parameter decays;
  // the config's default (only matrices decay) is filled in by engine/run_options.cc.
  config::PorterOptimizerConfig param_groups{.no_decay = {}, .param_groups = {}};
  bool operator==(const OptimizerOptions&) const = default;
};

// Note [Bucketed parameter all-gather]
// At stages 1 and 2 the updated shards (S elements per rank) are all-gathered into every
// rank's working flat buffer after the update, in all-gathers that each move at most
// zero_optimization.allgather_bucket_size elements in all, as DeepSpeed's bucketed
// all_gather_dp_groups does: a chunk of c = max(1, floor(bucket / N)) elements of every shard
// per op (so a bucket below N elements still moves N), ceil(S / c) ops. When c >= S this is one
// all-gather in place, into the flat buffer itself, with no extra memory (the default bucket,
// 5e8 elements, covers any model of up to 5e8 padded elements). Otherwise the ranks' chunks
// arrive in a staging buffer of N*c elements in the compute dtype (category comm; at most
// allgather_bucket_size elements), from which N - 1 copies on the compute stream put them at
// r*S + offset; the one buffer serves every chunk in turn. It lives for the all-gather only,
// after backward, like stage 2's reduce buckets, which are transient in `comm` too (neither
// is part of the model-state prediction). An all-gather copies bytes, so any bucket gives the
// parameters bit for bit.
// The chunk c of every shard per all-gather (Note [Bucketed parameter all-gather]); throws
// InvalidArgument for a bucket below 1.
int64_t allgather_chunk_elems(int64_t bucket_elems, int world_size);

// What global_norm found, for the step's report and for update().
struct GradNorm {
  double norm = 0.0;       // of the unscaled gradients, before clipping
  double clip_coef = 1.0;  // applied in update() (1: no clipping, and 1 on overflow)
  bool overflow = false;   // fp16: an inf/nan on some rank; update() then does nothing
};

class ShardedOptimizer {
 public:
  // `flat` holds the working parameters over part.padded_elems; `dp` may be null (one rank).
  // The moments start at zero; the master copy is loaded by set_params.
  // With options.offload (or options.param_offload) enabled and pin_memory, the host tier
  // `pinned` (not owned; Note [Host tier] in memory/host_tier.h) holds the host state, and a
  // shortfall there throws OutOfMemoryError naming the offload key and the tier's limit
  // (porter.device.pinned_limit); without pin_memory a PageableHostTier of the optimizer's
  // own does. The copies go on a lane of the optimizer state's tier.
  ShardedOptimizer(nn::FlatParams& flat, kernels::Kernels& kernels,
                   memory::CachingAllocator& allocator, comm::Communicator* dp,
                   const Partition& part, const OptimizerOptions& options,
                   memory::HostTier* pinned = nullptr);
  // The same with the pinned pool (not owned), as a PinnedHostTier.
  ShardedOptimizer(nn::FlatParams& flat, kernels::Kernels& kernels,
                   memory::CachingAllocator& allocator, comm::Communicator* dp,
                   const Partition& part, const OptimizerOptions& options,
                   memory::PinnedPool* pinned);
  ~ShardedOptimizer();
  ShardedOptimizer(const ShardedOptimizer&) = delete;
  ShardedOptimizer& operator=(const ShardedOptimizer&) = delete;

  // The optimizer range in the padded flat buffer.
  int64_t begin() const { return begin_; }
  int64_t end() const { return end_; }
  bool has_master() const;  // bf16/fp16 compute: an f32 master copy
  bool offloaded() const;
  bool params_offloaded() const;
  // Host bytes the offloaded state holds (0 without offload; pinned buffers at their pool
  // capacity), by array kind (zero::host_state_bytes predicts them), and the traffic since
  // the last call (Note [Optimizer offload]).
  HostStateBytes host_state() const;
  size_t host_bytes() const { return host_state().total(); }
  OffloadStats take_offload_stats();
  const OffloadStats& offload_stats() const { return offload_stats_; }
  // The offload lane's traffic and waits (zero without optimizer offload), cumulative.
  memory::HostTierStats host_tier_stats() const;
  // The tier holding the parameter shard with parameter offload (the gatherer uploads from
  // it: Note [Parameter offload]); null without.
  memory::HostTier* param_tier() const;
  // After load_checkpoint wrote state_tensors(): with f32 compute and offload the host master
  // is the working copy again.
  void state_loaded();
  // The working parameters of the range: a view of the flat buffer at stages 0-2, the rank's
  // own shard (category params) at stage 3, from which zero/param_gatherer.h gathers; in host
  // memory with parameter offload (Note [Parameter offload]).
  // Throws UsageError while the states are away (set_away).
  const tensor::Tensor& working() const {
    if (!away_.empty()) throw_away("ShardedOptimizer::working");
    return working_;
  }

  // Moving the device state to host memory and back (Note [Offloaded model states] in
  // engine/states_offload.cc), between steps only. for_each_state calls `f` on every device
  // tensor this optimizer owns, defined or not, in a fixed order (master, exp_avg, exp_avg_sq,
  // and at stage 3 the working shard unless it is in host memory), which it may replace or
  // drop. set_away(why) marks them away: working() (at stages 0-2 a view of the flat buffer,
  // which is dropped), state_tensors(), streamed_grads(), set_params() and begin_step() then
  // throw UsageError(why). set_away("") brings them back, after the flat buffer's own return (the
  // view is taken again).
  void for_each_state(const std::function<void(tensor::Tensor&)>& f);
  void set_away(std::string why);

  // The scale the loss stage multiplies the gradients by this step (1 without fp16).
  double loss_scale() const { return scaler_.scale(); }
  // Optimizer offload: a new step's gradient copies start from none (the engine calls it
  // first), and the reducer's bucket parts [lo, hi) of `grads` (the shard) as they become
  // final (Note [Ready gradients] in zero/reducer.h), copied to the host while backward goes
  // on. Both do nothing without offload.
  void begin_step();
  void gradients_ready(const tensor::Tensor& grads, int64_t lo, int64_t hi);
  // Note [Streamed gradients]: the reducer's sink when the gradient shard lives on the host
  // only (streams_gradients), else null; global_norm() and update() then read that host shard
  // and ignore their `grads` argument. streamed_grads() is the host shard (null otherwise),
  // holding the step's gradients after global_norm().
  GradSink* grad_sink() const;
  const void* streamed_grads() const;  // in the flat buffer's grad_dtype()

  // Phases 1-3 of Note [Sharded optimizer]. `grads` is the reducer's shard (the whole
  // buffer at stage 0).
  GradNorm global_norm(const tensor::Tensor& grads);
  void update(const tensor::Tensor& grads, double lr, const GradNorm& norm);
  void finish_step(bool overflow);
  // Host seconds waited on this optimizer's collectives since the last call.
  double take_exposed_s();

  // Tensor parallelism: `tp` (not owned; null or one rank: none) and the element ranges
  // [first, second) of the padded flat buffer holding parameters replicated on every rank of
  // the tp group (layernorms, row-parallel biases, position embeddings). global_norm then
  // counts the split parameters on every tp rank and the replicated ones once, so the norm
  // (and the clipping) is that of the whole model, and an overflow on any tp rank is one for
  // all.
  void set_tensor_parallel(comm::Communicator* tp,
                           std::vector<std::pair<int64_t, int64_t>> replicated);

  // Loads the parameters: `padded` (part.padded_elems values, layout order, zero tail) into
  // the working buffer, and the optimizer range of it into the master copy.
  void set_params(const std::vector<float>& padded);

  // Training checkpoints (engine/state.cc, Note [Engine state]): the state tensors by name
  // ("master" for bf16/fp16, "exp_avg", "exp_avg_sq"), the count of updating steps (the LR
  // schedule's and AdamW's step) and the loss scaler.
  // A state tensor is `tensor` followed by `rest` (when defined): with a partial offload the
  // host's part and the device's (Note [Partial offload]); checkpoints store the two as one.
  struct StateTensor {
    const char* name;
    tensor::Tensor tensor;
    tensor::Tensor rest = {};
  };
  std::vector<StateTensor> state_tensors() const;
  int64_t steps() const { return steps_; }
  void set_steps(int64_t steps) { steps_ = steps; }
  const LossScaler& loss_scaler() const { return scaler_; }
  LossScaler& loss_scaler() { return scaler_; }

 private:
  // `pinned` when not null, else `owned_pinned` (which may be null too).
  ShardedOptimizer(nn::FlatParams& flat, kernels::Kernels& kernels,
                   memory::CachingAllocator& allocator, comm::Communicator* dp,
                   const Partition& part, const OptimizerOptions& options,
                   std::unique_ptr<memory::HostTier> owned_pinned, memory::HostTier* pinned);
  [[noreturn]] void throw_away(const char* what) const;
  void wait(comm::Work work);
  void gather_params();  // Note [Bucketed parameter all-gather]
  void finish_gradient_copies(const tensor::Tensor& grads);
  void finish_streamed_gradients();
  // Calls f(lo, hi, args) for each piece of [lo, hi) (range-local) that one parameter-group
  // run covers, with `base` at that run's weight decay and lr (Note [Parameter groups]).
  template <typename F>
  void for_each_group_run(int64_t lo, int64_t hi, const kernels::AdamWArgs& base, double lr,
                          F&& f) const;

  nn::FlatParams* flat_;                 // not owned; outlives this
  kernels::Kernels* kernels_;                 // not owned
  memory::CachingAllocator* allocator_;  // not owned
  comm::Communicator* dp_;               // not owned; null with one rank
  comm::Communicator* tp_ = nullptr;     // not owned; null without tensor parallelism
  std::vector<std::pair<int64_t, int64_t>> replicated_;  // set_tensor_parallel
  Partition part_;
  OptimizerOptions options_;
  int64_t begin_ = 0, end_ = 0;
  std::vector<ParamRun> runs_;  // Note [Parameter groups], over the whole padded buffer
  struct Host;                  // Note [Optimizer offload], Note [Parameter offload]
  std::unique_ptr<Host> host_;  // null without either offload
  OffloadStats offload_stats_;
  tensor::Tensor working_;     // (end - begin) in the compute dtype; see working()
  // The device's part [h, end - begin) of the range (all of it without offload, none with a
  // full one; undefined then), and the host's [0, h) as views of the host arrays (Note
  // [Partial offload]). The masters are undefined for f32 compute.
  int64_t host_elems_ = 0;  // h
  tensor::Tensor master_, exp_avg_, exp_avg_sq_;                 // f32, device
  tensor::Tensor host_master_, host_exp_avg_, host_exp_avg_sq_;  // f32, host
  LossScaler scaler_;
  int64_t steps_ = 0;      // steps that updated (fp16 overflow skips)
  double exposed_s_ = 0.0;
  std::string away_;  // non-empty: the device state is in host memory (set_away)
};

}  // namespace porter::zero
