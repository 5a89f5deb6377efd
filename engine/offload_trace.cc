// Offload records as trace spans (Note [Offload trace] in offload_trace.h).
#include "engine/offload_trace.h"

#include <algorithm>
#include <chrono>

namespace porter::engine {

void trace_offload(TraceRecorder& trace, const std::function<std::string(int)>& stage_name,
                   int64_t step, const std::vector<offload::CopyRecord>& copies,
                   const std::vector<offload::WaitRecord>& waits) {
  for (const offload::CopyRecord& c : copies) {
    const bool d2h = c.direction == offload::CopyRecord::Direction::kD2H;
    TraceSpan span;
    span.name = std::string(d2h ? "d2h " : "h2d ") + stage_name(c.stage);
    span.category = d2h ? "d2h" : "h2d";
    span.lane = span.category;
    span.start_us = trace.to_us(c.start);
    span.dur_us = std::max<int64_t>(
        0, std::chrono::duration_cast<std::chrono::microseconds>(c.end - c.start).count());
    span.step = step;
    span.stage = c.stage;
    span.micro_batch = c.micro_batch;
    span.args = {{"bytes", static_cast<double>(c.bytes)}};
    trace.span(std::move(span));
  }
  for (const offload::WaitRecord& w : waits) {
    if (w.exposed_s <= 0.0) continue;
    TraceSpan span;
    span.name = "wait " + stage_name(w.stage);
    span.category = "wait";
    span.lane = "compute";
    span.start_us = trace.to_us(w.reached);
    span.dur_us = static_cast<int64_t>(w.exposed_s * 1e6);
    span.step = step;
    span.stage = w.stage;
    span.micro_batch = w.micro_batch;
    span.args = {{"exposed_s", w.exposed_s}};
    trace.span(std::move(span));
  }
}

}  // namespace porter::engine
