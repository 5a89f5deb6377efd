// The gradient reducer's buffers (category comm) over one micro-batch's backward, predicted
// without allocating: what zero/reducer.cc allocates and frees, replayed on the bucket plan.
// The checkpoint planner adds them to a step's total peak (Note [Gradient buckets in the
// footprint] in checkpoint/costs.h).
#pragma once

#include <cstddef>
#include <vector>

#include "zero/buckets.h"
#include "zero/partition.h"
#include "zero/reducer.h"

namespace porter::zero {

// Per chain stage s (Note [Gradient buckets in the footprint]): the comm bytes alive during
// the forwards and recomputes between the backwards of s + 1 and s, during the backward of s,
// and at most right after it while buckets are issued (for stage 0, through the flush at the
// end of the micro-batch).
struct BucketBytes {
  size_t between = 0;
  size_t during = 0;
  size_t after = 0;
};

// Replays GradReducer's allocations for a micro-batch that reduces (every one at stages 2 and
// 3; the last of a step at stages 0 and 1 with more than one rank) over `num_stages` stages.
// All zero at stage 0 and at stage 1 on one rank, which reduce in place.
std::vector<BucketBytes> bucket_bytes(const std::vector<Bucket>& buckets, const Partition& part,
                                      const ReducerOptions& options, int num_stages);

}  // namespace porter::zero
