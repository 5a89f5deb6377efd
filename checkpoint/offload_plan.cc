// The layout of a schedule's host holds: stash entries, their prefetch, use and release ops,
// pinned offsets and staging slots (Note [Offload semantics] in offload_plan.h).
#include "checkpoint/offload_plan.h"

#include <algorithm>

#include "base/check.h"
#include "base/units.h"

namespace porter::checkpoint {

int OffloadLayout::entry_at_hold(int op_index) const {
  for (size_t e = 0; e < entries.size(); ++e)
    if (entries[e].hold_op == op_index) return static_cast<int>(e);
  return -1;
}

OffloadLayout layout_offload(const Schedule& schedule, const ChainCosts& costs, int prefetch_depth,
                             bool contiguous) {
  PORTER_CHECK(prefetch_depth >= 0, "porter.checkpointing.prefetch_depth = ", prefetch_depth,
               " must be >= 0 (0 loads each checkpoint on demand)");
  validate(schedule);
  PORTER_CHECK(costs.num_stages() == schedule.num_stages, "schedule has ", schedule.num_stages,
               " stages but the costs have ", costs.num_stages());
  const int n = schedule.num_stages;
  const int num_ops = static_cast<int>(schedule.ops.size());
  OffloadLayout out;
  out.contiguous = contiguous;

  // One pass keeping `cur` as the executor does (Note [Schedule semantics]): an op reads
  // held[i] only when its input is not cur. open[i] is the entry whose a_i is on the host;
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
          if (op.hold_input && !op.offload && open[i] < 0) device_open[i] = true;
          if (op.offload) {
            StashEntry e;
            e.stage = i;
            e.bytes = costs.stages[i].input_bytes;
            e.hold_op = k;
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
  std::vector<int> slot_release;  // release op of each slot's latest entry
  for (int idx : by_prefetch) {
    StashEntry& e = out.entries[idx];
    int slot = -1;
    for (size_t s = 0; s < slot_release.size(); ++s) {
      if (slot_release[s] < e.prefetch_op) {
        slot = static_cast<int>(s);
        break;
      }
    }
    if (slot < 0) {
      slot = static_cast<int>(slot_release.size());
      slot_release.push_back(0);
    }
    slot_release[slot] = e.release_op;
    e.staging_slot = slot;
    out.staging_slot_bytes = std::max(out.staging_slot_bytes, round_up(e.bytes, kStagingSlotAlignment));
  }
  out.staging_slots = static_cast<int>(slot_release.size());

  for (StashEntry& e : out.entries) {
    e.pinned_offset = out.pinned_bytes;
    out.pinned_bytes += round_up(e.bytes, kPinnedSlotAlignment);
    out.offloaded_bytes += e.bytes;
  }
  return out;
}

}  // namespace porter::checkpoint
