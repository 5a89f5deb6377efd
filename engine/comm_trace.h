// The communicator's op records of one step as spans on the trace's "comm" lane.
//
// Note [Comm trace]
// While a trace is attached the engine has its data-parallel communicator record every op
// (Note [Comm records] in comm/communicator.h); once the step has synchronised (phase
// collect_comm) each record becomes a span on the "comm" lane over the op's run on the comm
// stream: name "<op> <label>" ("reduce_scatter bucket 3", "all_reduce grad norm",
// "all_gather params"), category "comm", and args bytes (payload bytes, as CommStats counts
// them), count and, as text, op, bucket (the label: which gradient bucket, or what the op is
// for), group and type. Over a step the spans' bytes add up to StepResult::zero.comm_bytes.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "engine/trace.h"

namespace porter::engine {

// `lane`: "comm" for the data-parallel group, "tp comm" for the tensor-parallel one (whose
// ops are labelled with the schedule op that issued them, e.g. "recompute block.3").
void trace_comm(TraceRecorder& trace, int64_t step, const std::vector<comm::CommRecord>& records,
                const std::string& lane = "comm");

}  // namespace porter::engine
