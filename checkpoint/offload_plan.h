// Where a schedule's host-held and partitioned checkpoints go and when they come back: the
// pure function of (schedule, costs, prefetch depth, contiguity, partition ways) that both the
// simulator (checkpoint/simulate.h) and the checkpoint stash (offload/stash.h, driven by the
// engine's executor) follow, so predicted and measured bytes agree exactly.
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
//
// Note [Partition semantics]
// A partitioned hold is an op Forward(i, save, hold, partition) (with offload too: a
// partitioned host hold). The t ranks of a tensor-parallel group compute the same a_i, so
// each keeps only its block of a_i's bytes and the group all-gathers the blocks back before
// a_i is read. Partitioning is by bytes, whatever the dtype:
//   slice_bytes = round_up(ceil(bytes / t), 16)   (kSliceAlignment)
//   rank r's block = bytes [r * slice_bytes, min((r + 1) * slice_bytes, bytes)) of a_i,
//                    zero-padded to slice_bytes (a block past the end is all padding)
//   the gathered copy = t * slice_bytes >= bytes, the first `bytes` of which are a_i.
// A partitioned hold is a StashEntry (partitioned, slice_bytes; on_host with offload) with
// the ops of Note [Offload semantics]; what the stash does at them:
//   hold_op     device: a slice of slice_bytes (category `checkpoints`) is allocated and
//               this rank's block copied into it on the compute stream; host: the block goes
//               to the entry's pinned slot (slice_bytes) on the D2H stream, as a host hold's
//               a_i does. Either way a_i is dropped like an unheld cur.
//   prefetch_op a staging buffer of t * slice_bytes (category `staging`) is allocated; a host
//               slice is copied into its own block on the H2D stream; then the all_gather
//               (u8, count slice_bytes) is issued on the tp communicator's stream: from the
//               device slice into the buffer, or in place from the buffer's own block.
//   use_op      the compute stream waits for the gather; held[i] becomes the gathered
//               buffer's first `bytes`, with a_i's shape and dtype; a device slice is freed.
//   release_op  the staging buffer is freed (a pinned slot as for a host hold).
// Footprint, per rank (added to Note [Activation bytes] as the simulator's windows):
//   device slice   slice_bytes of `checkpoints` from just before hold_op until fetch() at
//                  use_op frees it, which is after the prefetches issued at use_op and before
//                  use_op runs (StagingWindow::until_fetch: the simulator checks that moment
//                  as a peak of use_op). The gathered copy holds every byte of the slice, so
//                  keeping the slice to release_op would only cost 1/t of a_i through the
//                  segment's recompute and backward, where the peak usually is. A slice never
//                  read back (use_op -1) is freed after release_op.
//   host slice     nothing on the device at hold_op (the D2H copy reads a_i's own buffer).
//   gathered copy  t * slice_bytes of `staging` from just before prefetch_op until just after
//                  release_op, as a host hold's staged copy.
// With contiguous staging (OffloadLayout::contiguous) the gathered copies take staging slots
// of the one staging arena (sized with them), and the device slices slots of a slice arena
// (slice_slots x slice_slot_bytes, category `checkpoints`), assigned by the layout, never by
// a count of tensors seen: both arenas count for the whole micro-batch instead.
// The gather is issued on the tp comm stream, which first waits for the slice to be in place
// (the H2D copy's event; a device slice is written on the compute stream, which every
// collective waits for, Note [Comm stream] in comm/communicator.h).
#pragma once

#include <cstddef>
#include <vector>

#include "checkpoint/costs.h"
#include "checkpoint/schedule.h"

namespace porter::checkpoint {

inline constexpr size_t kPinnedSlotAlignment = 4096;  // the pinned pool's granularity
inline constexpr size_t kStagingSlotAlignment = 512;  // the allocator's block rounding
inline constexpr size_t kSliceAlignment = 16;         // a partition slice's size (Note [Partition semantics])

// round_up(ceil(bytes / ways), kSliceAlignment); 0 for 0 bytes. ways >= 1.
size_t partition_slice_bytes(size_t bytes, int ways);
// Whether a hold of stage `stage`'s input may be partitioned: stage > 0 (a_0 is the token
// ids), and its input has at least max(min_bytes, 1) bytes (porter.checkpointing.
// partition_min_bytes; a smaller one stays whole on every rank).
inline bool partitionable(const StageCost& s, int stage, size_t min_bytes) {
  return stage > 0 && s.input_bytes > 0 && s.input_bytes >= min_bytes;
}

struct StashEntry {
  int stage = 0;
  size_t bytes = 0;        // costs.stages[stage].input_bytes
  int hold_op = 0;
  int use_op = -1;
  int prefetch_op = -1;
  int release_op = 0;
  size_t pinned_offset = 0;  // in the contiguous pinned arena (kPinnedSlotAlignment-aligned)
  int staging_slot = -1;     // in the contiguous staging arena; -1 when never read back
  // Note [Partition semantics]. A plain host hold is on_host and not partitioned; a
  // partitioned hold is on_host only with offload.
  bool partitioned = false;
  bool on_host = true;
  size_t slice_bytes = 0;    // partition_slice_bytes(bytes, ways) when partitioned, else 0
  int slice_slot = -1;       // device slices, in the contiguous slice arena
  bool operator==(const StashEntry&) const = default;
};

struct OffloadLayout {
  std::vector<StashEntry> entries;  // in hold order: host holds and partitioned holds
  int ways = 1;                     // the tp group's size t; entries are partitioned only at t > 1
  size_t offloaded_bytes = 0;       // sum of host entries' host_bytes: what goes to the host
  size_t pinned_bytes = 0;          // sum of host entries' host_bytes rounded to
                                    // kPinnedSlotAlignment
  size_t staging_slot_bytes = 0;    // the largest read-back entry's staged_bytes, rounded up
  int staging_slots = 0;            // read-back entries alive at once, at most
  size_t slice_slot_bytes = 0;      // the largest device slice, rounded up (contiguous)
  int slice_slots = 0;              // device slices alive at once, at most
  // contiguous_memory_optimization: the pinned slots and the staging slots are each carved
  // from one arena, allocated when the stash adopts the layout, and the simulator counts the
  // staging arena for the whole micro-batch. The stash runs only a layout whose contiguity
  // is its own (Note [One contiguity] in offload/stash.h).
  bool contiguous = false;
  size_t staging_arena_bytes() const { return staging_slot_bytes * static_cast<size_t>(staging_slots); }
  size_t slice_arena_bytes() const { return slice_slot_bytes * static_cast<size_t>(slice_slots); }
  bool empty() const { return entries.empty(); }
  bool any_partitioned() const;
  // What an entry's read-back stages on the device: the gathered copy (ways x slice_bytes)
  // of a partitioned entry, else its bytes.
  size_t staged_bytes(const StashEntry& e) const {
    return e.partitioned ? static_cast<size_t>(ways) * e.slice_bytes : e.bytes;
  }
  // What an on_host entry keeps on the host (and copies each way): its slice, or its bytes.
  size_t host_bytes(const StashEntry& e) const { return e.partitioned ? e.slice_bytes : e.bytes; }
  // The entry held at op `op_index`, or -1.
  int entry_at_hold(int op_index) const;
  bool operator==(const OffloadLayout&) const = default;
};

// The layout of `schedule`'s host and partitioned holds (Note [Offload semantics], Note
// [Partition semantics]), contiguous or not, with `partition_ways` ranks sharing each
// partitioned hold. Staging slots are assigned greedily in prefetch order, a slot becoming
// free after its entry's release_op; slice slots greedily in hold order, a slot becoming free
// at its entry's use_op (after release_op when never read). Throws InvalidArgument for
// prefetch_depth < 0, and for partitioned holds with partition_ways < 2 (a group of one rank
// holds whole checkpoints); validates the schedule first.
OffloadLayout layout_offload(const Schedule& schedule, const ChainCosts& costs, int prefetch_depth,
                             bool contiguous = false, int partition_ways = 1);

}  // namespace porter::checkpoint
