// The layout of a schedule's host and partitioned holds: stash entries, their prefetch, use
// and release ops, pinned offsets, staging slots and slice slots (Note [Offload semantics] and
// Note [Partition semantics] in offload_plan.h).
#include "checkpoint/offload_plan.h"

#include <algorithm>
#include <functional>
#include <queue>
#include <utility>
#include <vector>

#include "base/check.h"
#include "base/units.h"

namespace porter::checkpoint {

size_t partition_slice_bytes(size_t bytes, int ways) {
  PORTER_CHECK_GE(ways, 1, "partition ways");
  const auto t = static_cast<size_t>(ways);
  return round_up((bytes + t - 1) / t, kSliceAlignment);
}

bool OffloadLayout::any_partitioned() const {
  return std::any_of(entries.begin(), entries.end(), [](const StashEntry& e) { return e.partitioned; });
}

int OffloadLayout::entry_at_hold(int op_index) const {
  for (size_t e = 0; e < entries.size(); ++e)
    if (entries[e].hold_op == op_index) return static_cast<int>(e);
  return -1;
}

namespace {

// Slots handed out in nondecreasing order of the op that takes them (Note [Slot heaps]).
class SlotPool {
 public:
  // The lowest slot free at op `at` (its latest occupant gone at an op <= at), a new one when
  // none is; it is busy again until op `free_at`.
  int take(int at, int free_at) {
    while (!busy_.empty() && busy_.top().first <= at) {
      free_.push(busy_.top().second);
      busy_.pop();
    }
    int slot;
    if (free_.empty()) {
      slot = slots_++;
    } else {
      slot = free_.top();
      free_.pop();
    }
    busy_.push({free_at, slot});
    return slot;
  }
  int size() const { return slots_; }

 private:
  using Busy = std::pair<int, int>;  // (the op at which it is free, slot)
  std::priority_queue<Busy, std::vector<Busy>, std::greater<>> busy_;
  std::priority_queue<int, std::vector<int>, std::greater<>> free_;
  int slots_ = 0;
};

}  // namespace

OffloadLayout layout_offload(const Schedule& schedule, const ChainCosts& costs, int prefetch_depth,
                             bool contiguous, int partition_ways) {
  PORTER_CHECK(prefetch_depth >= 0, "porter.checkpointing.prefetch_depth = ", prefetch_depth,
               " must be >= 0 (0 loads each checkpoint on demand)");
  PORTER_CHECK(partition_ways >= 1, "partition ways = ", partition_ways,
               " must be >= 1 (the tensor-parallel group's size)");
  validate(schedule);
  PORTER_CHECK(costs.num_stages() == schedule.num_stages, "schedule has ", schedule.num_stages,
               " stages but the costs have ", costs.num_stages());
  for (size_t k = 0; k < schedule.ops.size(); ++k) {
    PORTER_CHECK(!schedule.ops[k].partition || partition_ways >= 2, "schedule op ", k, " (stage ",
                 schedule.ops[k].stage, ") holds a partitioned checkpoint, but the layout is for ",
                 partition_ways, " rank; partitioning needs a tensor-parallel group of 2 or more "
                 "(activation_checkpointing.partition_activations with porter.model.tensor_parallel > 1)");
  }
  const int n = schedule.num_stages;
  const int num_ops = static_cast<int>(schedule.ops.size());
  OffloadLayout out;
  out.contiguous = contiguous;
  out.ways = partition_ways;

  // One pass keeping `cur` as the executor does (Note [Schedule semantics]): an op reads
  // held[i] only when its input is not cur. open[i] is the entry whose a_i is the stash's;
  // device_open[i] says a_i is held on the device and not read back yet. `segments` collects
  // the first read of every hold, device or host: where each segment's backward starts.
  std::vector<int> open(static_cast<size_t>(n), -1);
  std::vector<bool> device_open(static_cast<size_t>(n), false);
  std::vector<int> segments;
  int cur = 0;
  int first_backward = -1;
  for (int k = 0; k < num_ops; ++k) {
    const ScheduleOp& op = schedule.ops[k];
    const int i = op.stage;
    switch (op.kind) {
      case ScheduleOp::Kind::kForward:
      case ScheduleOp::Kind::kRecompute:
        if (cur != i && open[i] >= 0 && out.entries[open[i]].use_op < 0) {
          out.entries[open[i]].use_op = k;
          segments.push_back(k);
        }
        if (cur != i && device_open[i]) {
          device_open[i] = false;
          segments.push_back(k);
        }
        if (op.kind == ScheduleOp::Kind::kForward) {
          if (op.hold_input && !op.stashed() && open[i] < 0) device_open[i] = true;
          if (op.stashed()) {
            StashEntry e;
            e.stage = i;
            e.bytes = costs.stages[i].input_bytes;
            e.hold_op = k;
            e.partitioned = op.partition;
            e.on_host = op.offload;
            e.slice_bytes = op.partition ? partition_slice_bytes(e.bytes, partition_ways) : 0;
            open[i] = static_cast<int>(out.entries.size());
            out.entries.push_back(e);
          }
          cur = i + 1 < n ? i + 1 : -1;
        }
        break;
      case ScheduleOp::Kind::kBackward:
        if (first_backward < 0) first_backward = k;
        if (cur == i + 1) cur = -1;
        if (open[i] >= 0) out.entries[open[i]].release_op = k;
        open[i] = -1;
        device_open[i] = false;
        break;
    }
  }

  // Prefetch: an entry whose use is segment start j (in the order segments start, device
  // holds included) is issued at segment start j - d, or at the first backward when j < d,
  // clamped to [hold_op + 1, use_op].
  std::sort(segments.begin(), segments.end());
  std::vector<int> by_use;
  for (size_t e = 0; e < out.entries.size(); ++e)
    if (out.entries[e].use_op >= 0) by_use.push_back(static_cast<int>(e));
  std::sort(by_use.begin(), by_use.end(),
            [&](int a, int b) { return out.entries[a].use_op < out.entries[b].use_op; });
  for (int idx : by_use) {
    StashEntry& e = out.entries[idx];
    const auto j = static_cast<size_t>(
        std::lower_bound(segments.begin(), segments.end(), e.use_op) - segments.begin());
    int at = first_backward;
    if (j >= static_cast<size_t>(prefetch_depth)) at = segments[j - prefetch_depth];
    e.prefetch_op = std::clamp(at, e.hold_op + 1, e.use_op);
  }

  // Staging slots, greedily in prefetch order: the lowest slot whose last entry was released
  // before this prefetch. Greedy interval colouring is optimal: slots = the most alive at once.
  std::vector<int> by_prefetch = by_use;
  std::stable_sort(by_prefetch.begin(), by_prefetch.end(), [&](int a, int b) {
    return out.entries[a].prefetch_op < out.entries[b].prefetch_op;
  });
  // Note [Slot heaps]: entries come in nondecreasing prefetch (hold) order, so a slot once
  // free stays free for every later entry; the busy slots wait in a heap by the op that frees
  // them and the free ones in a heap by index, which gives the lowest free slot without a
  // scan of every slot per entry.
  SlotPool staging_pool;
  for (int idx : by_prefetch) {
    StashEntry& e = out.entries[idx];
    // Free: released before this prefetch (release_op + 1 <= prefetch_op).
    const int slot = staging_pool.take(e.prefetch_op, e.release_op + 1);
    e.staging_slot = slot;
    out.staging_slot_bytes =
        std::max(out.staging_slot_bytes, round_up(out.staged_bytes(e), kStagingSlotAlignment));
  }
  out.staging_slots = staging_pool.size();

  // Slice slots of device slices, greedily in hold order (entries are in hold order): a slot
  // is free for a hold at or after the use_op where fetch() freed its last slice, or after the
  // release_op of a slice never read. The slot comes from here, never from a count of the
  // tensors the stash has seen, so a tensor of any size or dtype takes its own.
  SlotPool slice_pool;  // Note [Slot heaps]
  for (StashEntry& e : out.entries) {
    if (!e.partitioned || e.on_host) continue;
    const int slot = slice_pool.take(e.hold_op, e.use_op >= 0 ? e.use_op : e.release_op + 1);
    e.slice_slot = slot;
    out.slice_slot_bytes = std::max(out.slice_slot_bytes, round_up(e.slice_bytes, kStagingSlotAlignment));
  }
  out.slice_slots = slice_pool.size();

  for (StashEntry& e : out.entries) {
    if (!e.on_host) continue;
    e.pinned_offset = out.pinned_bytes;
    out.pinned_bytes += round_up(out.host_bytes(e), kPinnedSlotAlignment);
    out.offloaded_bytes += out.host_bytes(e);
  }
  return out;
}

}  // namespace porter::checkpoint
