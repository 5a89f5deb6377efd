// Where a schedule's host-held checkpoints go and when they come back: the pure function of
// (schedule, costs, prefetch depth, contiguity) that both the simulator (checkpoint/simulate.h)
// and the checkpoint stash (offload/stash.h, driven by the engine's executor) follow, so
// predicted and measured bytes agree exactly.
//
// Note [Offload semantics]
// A host hold is an op Forward(i, save, hold, offload) (checkpoint/schedule.h; validate()
// requires save != kKeep, i > 0 and a_i not already held). For each one,
// in op order, a StashEntry:
//   hold_op     the Forward. Before it runs, an event is recorded on the compute stream, the
//               D2H stream waits on it and copies a_i into the entry's pinned slot, and a_i's
//               device buffer is marked as used by the D2H stream (record_stream), so it is
//               freed only when the copy lands (Note [Deferred free]). a_i is never retagged
//               to `checkpoints`; it is dropped exactly as an unheld cur would be.
//   use_op      the first later op that reads held[i] (a Forward(i) or Recompute(i) whose
//               input is not cur; the executor prefers cur), or -1 if none does. Before it
//               runs, the compute stream waits on the entry's H2D event, and held[i] becomes
//               the staged copy.
//   prefetch_op where the H2D copy is issued, before that op runs (-1 with use_op). A
//               *segment start* is the first read of any hold's input, device or host (where
//               that segment's recompute, and so its backward, begins). With prefetch depth d,
//               an entry whose use_op is segment start j (in op order) is issued at segment
//               start j-d ("when the backward of segment j starts, prefetch j-1 .. j-d"), or
//               at the schedule's first Backward op when j < d. Never before hold_op + 1,
//               never after use_op; d = 0 issues at use_op (on demand, fully exposed). The H2D stream first waits on the entry's D2H event
//               and on an event recorded on the compute stream at prefetch_op (the staging
//               slot may have been compute-stream memory a moment ago).
//   release_op  Backward(i): after it runs, the staged copy (category `staging`) is freed and
//               the pinned slot is released once the H2D copy has landed.
// Footprint (what the simulator adds to Note [Activation bytes]): a host hold adds nothing at
// hold_op; a read-back entry adds `bytes` of staging from just before prefetch_op until just
// after release_op. With contiguous staging (OffloadLayout::contiguous) the arena
// (staging_slots x staging_slot_bytes) counts for the whole micro-batch instead.
// No host synchronisation happens anywhere unless synchronize_checkpoint_boundary is set
// (then the host waits for each D2H copy right after issuing it).
#pragma once

#include <cstddef>
#include <vector>

#include "checkpoint/costs.h"
#include "checkpoint/schedule.h"

namespace porter::checkpoint {

inline constexpr size_t kPinnedSlotAlignment = 4096;  // the pinned pool's granularity
inline constexpr size_t kStagingSlotAlignment = 512;  // the allocator's block rounding

struct StashEntry {
  int stage = 0;
  size_t bytes = 0;        // costs.stages[stage].input_bytes
  int hold_op = 0;
  int use_op = -1;
  int prefetch_op = -1;
  int release_op = 0;
  size_t pinned_offset = 0;  // in the contiguous pinned arena (kPinnedSlotAlignment-aligned)
  int staging_slot = -1;     // in the contiguous staging arena; -1 when never read back
  bool operator==(const StashEntry&) const = default;
};

struct OffloadLayout {
  std::vector<StashEntry> entries;  // in hold order
  size_t offloaded_bytes = 0;       // sum of entry bytes: what leaves the device
  size_t pinned_bytes = 0;          // sum of entry bytes rounded to kPinnedSlotAlignment
  size_t staging_slot_bytes = 0;    // the largest read-back entry, rounded up
  int staging_slots = 0;            // read-back entries alive at once, at most
  // contiguous_memory_optimization: the pinned slots and the staging slots are each carved
  // from one arena, allocated when the stash adopts the layout, and the simulator counts the
  // staging arena for the whole micro-batch. The stash runs only a layout whose contiguity
  // is its own (Note [One contiguity] in offload/stash.h).
  bool contiguous = false;
  size_t staging_arena_bytes() const { return staging_slot_bytes * static_cast<size_t>(staging_slots); }
  bool empty() const { return entries.empty(); }
  // The entry held at op `op_index`, or -1.
  int entry_at_hold(int op_index) const;
  bool operator==(const OffloadLayout&) const = default;
};

// The layout of `schedule`'s host holds (Note [Offload semantics]), contiguous or not. Staging
// slots are assigned greedily in prefetch order, a slot becoming free after its entry's
// release_op. Throws InvalidArgument for prefetch_depth < 0; validates the schedule first.
OffloadLayout layout_offload(const Schedule& schedule, const ChainCosts& costs, int prefetch_depth,
                             bool contiguous = false);

}  // namespace porter::checkpoint
