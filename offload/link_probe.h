// porter::offload::measure_link_bytes_per_s: the device <-> pinned host bandwidth, timed on
// the checkpoint stash's own copy streams, for the planner's exposed copy time.
//
// Note [Link probe]
// With offload on and no porter.device.sim_link_gbps, the planner needs the link's bandwidth
// to charge exposed copy time. The probe times copies of one buffer device -> pinned on the
// stash's D2H stream and pinned -> device on its H2D stream, best of three each (the first
// touches fresh pages), and takes the slower direction. The buffer is `bytes` (the engine
// passes the largest stage input: a checkpoint's size, which is what offload copies), at most
// 16 MiB and at most the pinned limit: it fits wherever profiling fitted, so the probe never
// makes a run fail that would otherwise fit. Both buffers are returned before planning (the
// pinned cache emptied), so the pool starts training empty.
#pragma once

#include <cstddef>

#include "memory/caching_allocator.h"
#include "memory/pinned_pool.h"
#include "offload/stash.h"

namespace porter::offload {

// Bytes per second each way (the slower direction); 0 when `bytes` or the pinned limit is 0.
double measure_link_bytes_per_s(memory::CachingAllocator& allocator, memory::PinnedPool& pinned,
                                CheckpointStash& stash, size_t bytes);

}  // namespace porter::offload
