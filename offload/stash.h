// The checkpoint stash: streams a micro-batch's host-held checkpoints to pinned host memory
// and back, and keeps partitioned checkpoints as this rank's slice and all-gathers them on
// the tensor-parallel group, following an OffloadLayout (checkpoint/offload_plan.h, Note
// [Offload semantics], Note [Partition semantics]). The engine's executor calls it at the ops
// the layout names; the stash owns two copy lanes of its host tier (Note [Host tier] in
// memory/host_tier.h), the pinned slots, the device slices and the device staging slots, and
// measures the copies and gathers.
//
// Note [Stash protocol]
// Per micro-batch: begin(mb); then, in op order,
//   offload(e, a_i)   before entry e's hold_op. Records an event on the compute stream; the
//                     D2H stream waits on it and copies a_i into e's pinned slot; a_i's buffer
//                     is record_stream'ed on the D2H stream, so the caller may drop every
//                     reference at once and the allocator frees it when the copy lands.
//   prefetch(e)       before prefetch_op. Takes a staging slot (arena slot, or an allocation
//                     of category `staging`); the H2D stream waits on the D2H event and on a
//                     compute-stream event recorded now, then copies pinned -> staging.
//   fetch(e)          before use_op. The compute stream waits on e's H2D event (issuing the
//                     prefetch first if the layout left it to now); returns the staged tensor,
//                     with a_i's shape and dtype.
//   release(e)        after release_op, once the caller dropped fetch()'s tensor. Frees the
//                     staging slot and the pinned slot (after the H2D copy lands, through the
//                     pinned pool's deferred free).
// end() checks that every entry was released. abort() (any exception mid micro-batch) waits
// for both copy streams and frees everything, so the allocator and the pinned pool return to
// their baseline. The host never blocks inside a micro-batch except in fetch() on cpu (where
// the compute stream is the host thread) and after each D2H with synchronize_boundary.
//
// Note [Stash partition]
// A partitioned entry (Note [Partition semantics]) goes through the same four calls, so the
// executor drives it exactly as a host hold: offload() before hold_op, prefetch() before
// prefetch_op, fetch() before use_op, release() after release_op. What they do:
//   offload(e, a_i)   device slice: allocates slice_bytes (category `checkpoints`, or the
//                     entry's slot of the slice arena) and copies this rank's block of a_i's
//                     bytes into it on the compute stream, the tail padding from a pinned
//                     buffer of zeros; host slice: the D2H stream copies the block and its
//                     padding into the pinned slot and a_i is record_stream'ed on it. Either
//                     way the caller may drop a_i at once.
//   prefetch(e)       allocates the gathered copy (t x slice_bytes, category `staging`, or its
//                     staging arena slot); a host slice is copied into its own block on the
//                     H2D stream, and the tp comm stream waits for that copy's event; then the
//                     all_gather (u8) is issued on StashOptions::tp: from the device slice, or
//                     in place from the own block (Note [Collective semantics]). Collectives
//                     wait for the compute stream at the call (Note [Comm stream]), which
//                     covers the device slice's copy.
//   fetch(e)          the compute stream waits for the gather (Work::wait_on: on cpu the host
//                     blocks, and a failed gather's PeerError or TimeoutError propagates, its
//                     message naming the rank, the group and all_gather); frees the device
//                     slice; returns the first `bytes` of the gathered copy with a_i's shape
//                     and dtype.
//   release(e)        frees the gathered copy (and a slice never read back).
// abort() also waits for every gather it issued (an error is logged and swallowed), so that
// none writes into freed memory, before it frees everything. That wait is bounded by the tp
// communicator's timeout (porter.comm.timeout_s); a caller that aborts the communicator first
// (Note [Comm failure]) makes it immediate. Every rank of the tp group runs the same layout,
// so the gathers are issued in the same order on all of them.
//
// Note [One contiguity]
// contiguous_memory_optimization changes what a layout costs: the simulator counts the staging
// arena for the whole micro-batch, where separate slots count only while they are staged. A
// plan is a prediction of one of the two, so the flag lives once in what the plan carries
// (checkpoint::OffloadLayout::contiguous, set by the planner from OffloadOptions::contiguous)
// and once in what the stash runs (StashOptions::contiguous, set by the engine from the
// config), and prepare() refuses a layout whose contiguity is not the stash's.
//
// Timing uses host callbacks on the streams (both devices): a callback just before and just
// after each copy gives its busy interval; a callback on the compute stream at fetch() gives
// when compute reached the wait, and the wait is exposed by max(0, copy end - reached).
// Thread-compatible: one engine thread drives it; the callbacks synchronise internally.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <memory>
#include <mutex>
#include <vector>

#include "checkpoint/offload_plan.h"
#include "comm/communicator.h"
#include "memory/caching_allocator.h"
#include "memory/device.h"
#include "memory/host_tier.h"
#include "memory/pinned_pool.h"
#include "tensor/tensor.h"

namespace porter::offload {

struct StashOptions {
  // contiguous_memory_optimization: one arena each side. Layouts must agree (Note [One
  // contiguity]).
  bool contiguous = false;
  bool synchronize_boundary = false;  // synchronize_checkpoint_boundary
  // The tensor-parallel group that partitioned entries are gathered on (Note [Stash
  // partition]); required by a layout with partitioned entries, whose ways must be its
  // size(). Not owned; outlives the stash.
  comm::Communicator* tp = nullptr;
};

using Clock = std::chrono::steady_clock;

// One copy, or one compute-stream wait, as measured.
struct CopyRecord {
  enum class Direction : uint8_t { kD2H, kH2D };
  Direction direction = Direction::kD2H;
  int stage = 0;
  int micro_batch = 0;
  size_t bytes = 0;
  Clock::time_point start;
  Clock::time_point end;
  double seconds() const { return std::chrono::duration<double>(end - start).count(); }
};

struct WaitRecord {
  int stage = 0;
  int micro_batch = 0;
  Clock::time_point reached;  // when the compute stream reached the wait
  double exposed_s = 0.0;     // how long it waited for the copy (0: the copy had landed)
  // How long it then waited for the gather of a partitioned entry (0 for a plain host hold).
  double gather_exposed_s = 0.0;
};

// One gather of a partitioned entry on the tp comm stream, as measured.
struct GatherRecord {
  int stage = 0;
  int micro_batch = 0;
  size_t bytes = 0;  // received: (t - 1) x slice_bytes
  Clock::time_point start;
  Clock::time_point end;
  double seconds() const { return std::chrono::duration<double>(end - start).count(); }
};

struct StashStats {
  // The stash's two lanes' figures (memory::HostTierStats::d2h_bytes and h2d_bytes).
  size_t d2h_bytes = 0;
  size_t h2d_bytes = 0;
  double copy_busy_s = 0.0;     // both copy streams, summed
  double exposed_wait_s = 0.0;  // compute-stream waits for copies (fetch, and
                                // synchronize_boundary)
  size_t pinned_peak_bytes = 0;   // pinned memory held by the stash at once, at most
  size_t staging_peak_bytes = 0;  // staging bytes alive at once, at most (arena: its size)
  // Partitioned entries (Note [Stash partition]).
  int64_t gathers = 0;
  size_t gathered_bytes = 0;      // payload this rank received
  double gather_busy_s = 0.0;     // tp comm-stream time of the gathers
  double gather_exposed_s = 0.0;  // compute-stream waits for gathers (after their copies)
  size_t slice_peak_bytes = 0;    // device slices alive at once, at most (arena: its size)
  // 1 - exposed / busy; 1 when nothing was copied.
  double hidden_fraction() const {
    return copy_busy_s > 0 ? 1.0 - exposed_wait_s / copy_busy_s : 1.0;
  }
  // Folds a later window in: bytes and times add, the peaks take the larger.
  StashStats& operator+=(const StashStats& s) {
    d2h_bytes += s.d2h_bytes;
    h2d_bytes += s.h2d_bytes;
    copy_busy_s += s.copy_busy_s;
    exposed_wait_s += s.exposed_wait_s;
    pinned_peak_bytes = std::max(pinned_peak_bytes, s.pinned_peak_bytes);
    staging_peak_bytes = std::max(staging_peak_bytes, s.staging_peak_bytes);
    gathers += s.gathers;
    gathered_bytes += s.gathered_bytes;
    gather_busy_s += s.gather_busy_s;
    gather_exposed_s += s.gather_exposed_s;
    slice_peak_bytes = std::max(slice_peak_bytes, s.slice_peak_bytes);
    return *this;
  }
  void add(const StashStats& s) { *this += s; }
};

class CheckpointStash {
 public:
  // Opens the D2H and H2D lanes ("offload.d2h", "offload.h2d") of `host` (not owned;
  // outlives the stash), on the allocator's device; the slots come from `host` too.
  CheckpointStash(memory::CachingAllocator& allocator, memory::HostTier& host,
                  StashOptions options);
  // The same over the pinned pool (not owned; outlives the stash), as a PinnedHostTier.
  CheckpointStash(memory::CachingAllocator& allocator, memory::PinnedPool& pinned,
                  StashOptions options);
  ~CheckpointStash();  // abort()s a micro-batch in flight
  CheckpointStash(const CheckpointStash&) = delete;
  CheckpointStash& operator=(const CheckpointStash&) = delete;

  // Adopts `layout` (at engine start and on every replan). Throws InvalidArgument, with
  // nothing changed, for a layout whose contiguity is not StashOptions::contiguous (Note [One
  // contiguity]), and for one with partitioned entries without StashOptions::tp or whose ways
  // are not tp->size(). Checks layout.pinned_bytes against the pinned pool's limit first and
  // throws OutOfMemoryError naming porter.device.pinned_limit, the bytes needed and the
  // limit. With contiguous, allocates the pinned arena (layout.pinned_bytes) and the staging
  // arena (staging_arena_bytes(), category `staging`) beside the previous ones, then frees
  // those. On failure nothing new stays allocated and the previous layout remains, except
  // when only freeing the previous arenas first would have made room: then the stash is left
  // with an empty layout. With contiguous, a layout with device slices also gets the slice
  // arena (slice_arena_bytes(), category `checkpoints`). Where this rank's blocks need
  // padding, a pinned buffer of zeros of the largest padding (not counted in
  // pinned_peak_bytes) is kept too.
  void prepare(const checkpoint::OffloadLayout& layout);
  const checkpoint::OffloadLayout& layout() const { return layout_; }

  void begin(int micro_batch);
  void offload(int entry, const tensor::Tensor& t);
  void prefetch(int entry);
  tensor::Tensor fetch(int entry);
  void release(int entry);
  void end();
  void abort() noexcept;

  // Waits for both lanes, and the tp comm stream when the layout has partitioned
  // entries (after a step; never inside a micro-batch).
  void synchronize();

  // Cumulative since construction or reset_stats(); complete after synchronize().
  StashStats stats() const;
  void reset_stats();
  // The records since the last take (complete after synchronize()).
  std::vector<CopyRecord> take_copies();
  std::vector<WaitRecord> take_waits();
  std::vector<GatherRecord> take_gathers();

  memory::Stream& d2h_stream() { return d2h_->stream(); }
  memory::Stream& h2d_stream() { return h2d_->stream(); }
  memory::HostTier& host_tier() const { return *host_; }
  // The lanes' traffic and waits since construction or reset_stats().
  memory::HostTierStats host_tier_stats() const;

 private:
  struct Impl;
  // `host` when not null, else `owned`.
  CheckpointStash(memory::CachingAllocator& allocator, std::unique_ptr<memory::HostTier> owned,
                  memory::HostTier* host, StashOptions options);
  // Issues entry's all_gather on the tp comm stream (Note [Stash partition]).
  void issue_gather(int entry);

  memory::CachingAllocator* allocator_;  // not owned
  // Built over a pinned pool by the second constructor; first, so it goes last.
  std::unique_ptr<memory::HostTier> owned_host_;
  memory::HostTier* host_;  // owned_host_, or not owned
  StashOptions options_;
  checkpoint::OffloadLayout layout_;
  std::unique_ptr<memory::HostLane> d2h_;
  std::unique_ptr<memory::HostLane> h2d_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace porter::offload
