// Communicator records as trace spans (Note [Comm trace] in comm_trace.h).
#include "engine/comm_trace.h"

#include <algorithm>
#include <string>

namespace porter::engine {

void trace_comm(TraceRecorder& trace, int64_t step, const std::vector<comm::CommRecord>& records,
                const std::string& lane) {
  for (const comm::CommRecord& r : records) {
    TraceSpan span;
    span.name = r.label.empty() ? r.op : r.op + " " + r.label;
    span.category = "comm";
    span.lane = lane;
    span.start_us = trace.to_us(r.start);
    span.dur_us = std::max<int64_t>(0, trace.to_us(r.end) - span.start_us);
    span.step = step;
    span.args = {{"bytes", static_cast<double>(r.bytes)}};
    span.text_args = {{"op", r.op}, {"group", r.group}};
    if (!r.label.empty()) span.text_args.emplace_back("bucket", r.label);
    if (r.has_payload) {
      span.args.emplace_back("count", static_cast<double>(r.count));
      span.text_args.emplace_back("type", std::string(comm::elem_name(r.type)));
    }
    if (r.failed) span.text_args.emplace_back("error", "failed");
    trace.span(std::move(span));
  }
}

}  // namespace porter::engine
