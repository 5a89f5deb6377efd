// Gradient buckets (Notes [Gradient buckets], [Bucketed reduce-scatter]).
#include "zero/buckets.h"

#include <algorithm>

#include "base/check.h"

namespace porter::zero {

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
