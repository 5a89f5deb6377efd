// The checkpoint stash: streams a micro-batch's host-held checkpoints to pinned host memory
// and back, following an OffloadLayout (checkpoint/offload_plan.h, Note [Offload
// semantics]). The engine's executor calls it at the ops the layout names; the stash owns the
// two copy streams, the pinned slots and the device staging slots, and measures the copies.
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
#include "memory/caching_allocator.h"
#include "memory/device.h"
#include "memory/pinned_pool.h"
#include "nn/tensor.h"

namespace porter::offload {

struct StashOptions {
  // contiguous_memory_optimization: one arena each side. Layouts must agree (Note [One
  // contiguity]).
  bool contiguous = false;
  bool synchronize_boundary = false;  // synchronize_checkpoint_boundary
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
  double exposed_s = 0.0;     // how long it waited (0: the copy had landed)
};

struct StashStats {
  size_t d2h_bytes = 0;
  size_t h2d_bytes = 0;
  double copy_busy_s = 0.0;     // both copy streams, summed
  double exposed_wait_s = 0.0;  // compute-stream waits (fetch, and synchronize_boundary)
  size_t pinned_peak_bytes = 0;   // pinned memory held by the stash at once, at most
  size_t staging_peak_bytes = 0;  // staging bytes alive at once, at most (arena: its size)
  // 1 - exposed / busy; 1 when nothing was copied.
  double hidden_fraction() const {
    return copy_busy_s > 0 ? 1.0 - exposed_wait_s / copy_busy_s : 1.0;
  }
  // Folds a later window in: bytes and times add, the peaks take the larger.
  void add(const StashStats& s) {
    d2h_bytes += s.d2h_bytes;
    h2d_bytes += s.h2d_bytes;
    copy_busy_s += s.copy_busy_s;
    exposed_wait_s += s.exposed_wait_s;
    pinned_peak_bytes = std::max(pinned_peak_bytes, s.pinned_peak_bytes);
    staging_peak_bytes = std::max(staging_peak_bytes, s.staging_peak_bytes);
  }
};

class CheckpointStash {
 public:
  // Creates the D2H and H2D streams on the allocator's device.
  CheckpointStash(memory::CachingAllocator& allocator, memory::PinnedPool& pinned,
                  StashOptions options);
  ~CheckpointStash();  // abort()s a micro-batch in flight
  CheckpointStash(const CheckpointStash&) = delete;
  CheckpointStash& operator=(const CheckpointStash&) = delete;

  // Adopts `layout` (at engine start and on every replan). Throws InvalidArgument, with
  // nothing changed, for a layout whose contiguity is not StashOptions::contiguous (Note [One
  // contiguity]). Checks layout.pinned_bytes against the pinned pool's limit first and
  // throws OutOfMemoryError naming porter.device.pinned_limit, the bytes needed and the
  // limit. With contiguous, allocates the pinned arena (layout.pinned_bytes) and the staging
  // arena (staging_arena_bytes(), category `staging`) beside the previous ones, then frees
  // those. On failure nothing new stays allocated and the previous layout remains, except
  // when only freeing the previous arenas first would have made room: then the stash is left
  // with an empty layout.
  void prepare(const checkpoint::OffloadLayout& layout);
  const checkpoint::OffloadLayout& layout() const { return layout_; }

  void begin(int micro_batch);
  void offload(int entry, const nn::Tensor& t);
  void prefetch(int entry);
  nn::Tensor fetch(int entry);
  void release(int entry);
  void end();
  void abort() noexcept;

  // Waits for both copy streams (after a step; never inside a micro-batch).
  void synchronize();

  // Cumulative since construction or reset_stats(); complete after synchronize().
  StashStats stats() const;
  void reset_stats();
  // The records since the last take (complete after synchronize()).
  std::vector<CopyRecord> take_copies();
  std::vector<WaitRecord> take_waits();

  memory::Stream& d2h_stream() { return *d2h_; }
  memory::Stream& h2d_stream() { return *h2d_; }

 private:
  struct Impl;
  memory::CachingAllocator* allocator_;  // not owned
  memory::PinnedPool* pinned_;           // not owned
  StashOptions options_;
  checkpoint::OffloadLayout layout_;
  std::unique_ptr<memory::Stream> d2h_;
  std::unique_ptr<memory::Stream> h2d_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace porter::offload
