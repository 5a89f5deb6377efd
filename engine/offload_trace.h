// The checkpoint stash's copy and wait records of one step as trace spans.
//
// Note [Offload trace]
// The stash's records become spans once the step has synchronised: each copy on the "d2h" or
// "h2d" lane (name "d2h block.3", bytes in args), and each exposed wait (> 0) on the compute
// lane as "wait block.3", so a trace viewer shows the copies beside the compute they overlap.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "engine/trace.h"
#include "offload/stash.h"

namespace porter::engine {

void trace_offload(TraceRecorder& trace, const std::function<std::string(int)>& stage_name,
                   int64_t step, const std::vector<offload::CopyRecord>& copies,
                   const std::vector<offload::WaitRecord>& waits);

}  // namespace porter::engine
