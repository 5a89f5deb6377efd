// Gradient buckets (Notes [Gradient buckets], [Bucketed reduce-scatter]) and the chain
// stages' flat ranges they are made of.
#include "zero/buckets.h"

#include <algorithm>

#include "base/check.h"

namespace porter::zero {

StageLayout stage_layout(const nn::ParamLayout& layout, const std::vector<StageParams>& stages) {
  const std::vector<nn::ParamEntry>& entries = layout.entries();
  StageLayout out;
  size_t next = 0;
  int64_t at = 0;
  for (size_t s = 0; s < stages.size(); ++s) {
    StageRange r{at, at};
    for (const nn::ParamSpec& spec : stages[s].params) {
      const bool ok = next < entries.size() && entries[next].shape == spec.shape &&
                      entries[next].name.size() >= spec.name.size() &&
                      entries[next].name.compare(entries[next].name.size() - spec.name.size(),
                                                 spec.name.size(), spec.name) == 0;
      PORTER_CHECK(ok, "Engine: stage ", s, " (", stages[s].name, ") declares '", spec.name,
                   "' but the layout's entry ", next, " is ",
                   next < entries.size() ? "'" + entries[next].name + "'" : "missing",
                   "; the model's layout must list the stages' parameters in stage order");
      const int64_t numel = entries[next].shape.numel();
      r.hi = entries[next].offset_elems +
             (numel + nn::kParamAlignElems - 1) / nn::kParamAlignElems * nn::kParamAlignElems;
      out.entry_stage.push_back(static_cast<int>(s));
      ++next;
    }
    at = r.hi;
    out.ranges.push_back(r);
  }
  PORTER_CHECK(next == entries.size(), "Engine: the layout has ", entries.size(),
               " parameters but the stages declare ", next);
  return out;
}

std::vector<Bucket> plan_buckets(const std::vector<StageRange>& ranges,
                                 const std::vector<std::vector<int>>& writers,
                                 int64_t bucket_elems) {
  PORTER_CHECK(bucket_elems >= 1, "zero_optimization.reduce_bucket_size: expected >= 1, got ",
               bucket_elems);
  const int n = static_cast<int>(ranges.size());
  PORTER_CHECK(writers.empty() || writers.size() == ranges.size(), "plan_buckets: ",
               writers.size(), " writer lists for ", n, " stages");
  for (int s = 0; s < n; ++s) {
    const StageRange& r = ranges[static_cast<size_t>(s)];
    PORTER_CHECK(r.lo <= r.hi, "stage ", s, " has the range [", r.lo, ", ", r.hi, ")");
    if (s > 0) {
      PORTER_CHECK(r.lo == ranges[static_cast<size_t>(s - 1)].hi, "stage ", s,
                   "'s parameters start at ", r.lo, " but stage ", s - 1, "'s end at ",
                   ranges[static_cast<size_t>(s - 1)].hi,
                   " (the layout must list the stages' parameters in stage order)");
    }
  }
  std::vector<Bucket> out;
  Bucket cur;
  bool open = false;
  auto close = [&] {
    if (!open) return;
    cur.alloc_before = -1;
    cur.ready_after = n;
    for (int s = cur.first_stage; s <= cur.last_stage; ++s) {
      std::vector<int> w = writers.empty() ? std::vector<int>{} : writers[static_cast<size_t>(s)];
      w.push_back(s);
      for (int x : w) {
        PORTER_CHECK(x >= 0 && x < n, "stage ", x, " writes into stage ", s,
                     "'s gradients but the model has ", n, " stages");
        cur.alloc_before = std::max(cur.alloc_before, x);
        cur.ready_after = std::min(cur.ready_after, x);
      }
    }
    out.push_back(cur);
    open = false;
  };
  for (int s = n - 1; s >= 0; --s) {
    const StageRange& r = ranges[static_cast<size_t>(s)];
    const int64_t e = r.hi - r.lo;
    if (e == 0) continue;
    if (open && cur.elems() + e > bucket_elems) close();
    if (!open) {
      cur = Bucket{};
      cur.hi = r.hi;
      cur.last_stage = s;
      open = true;
    }
    cur.lo = r.lo;
    cur.first_stage = s;
  }
  close();
  return out;
}

BucketBlocks bucket_blocks(int64_t lo, int64_t hi, const Partition& part) {
  PORTER_CHECK(0 <= lo && lo <= hi && hi <= part.padded_elems, "bucket [", lo, ", ", hi,
               ") outside the padded buffer of ", part.padded_elems, " elements");
  BucketBlocks b;
  for (int r = 0; r < part.world_size; ++r) {
    const int64_t a = std::max(lo, part.begin(r));
    const int64_t z = std::min(hi, part.end(r));
    b.lo.push_back(a < z ? a : part.begin(r));
    b.hi.push_back(a < z ? z : part.begin(r));
    b.block = std::max(b.block, std::max<int64_t>(0, z - a));
  }
  return b;
}

}  // namespace porter::zero
