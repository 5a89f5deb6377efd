// A recorder of spans and counters for a Chrome/Perfetto trace (chrome://tracing or
// ui.perfetto.dev, "Trace Event Format" JSON). The engine records spans per stage (forward,
// recompute, backward, optimizer) and the memory footprint as a counter track; the CLI
// writes the file.
#pragma once

#include <chrono>
#include <cstdint>
#include <iosfwd>
#include <mutex>
#include <string>
#include <vector>

namespace porter::engine {

struct TraceSpan {
  std::string name;      // "forward block.3"
  std::string category;  // "forward", "recompute", "backward", "optimizer", "step", ...
  std::string lane;      // "compute", "d2h", "h2d", "comm"
  int64_t start_us = 0;  // since the recorder was created
  int64_t dur_us = 0;
  int64_t step = -1;
  int stage = -1;
  int micro_batch = -1;
  std::vector<std::pair<std::string, double>> args;  // extra args, e.g. {"bytes", 4096}
};

struct TraceCounter {
  std::string name;  // "memory"
  int64_t time_us = 0;
  std::vector<std::pair<std::string, double>> values;  // series name -> value (bytes)
};

class TraceRecorder {
 public:
  using clock = std::chrono::steady_clock;
  explicit TraceRecorder(size_t max_events = size_t{1} << 21);

  int64_t now_us() const;
  void span(TraceSpan span);
  void counter(TraceCounter counter);
  // Events beyond max_events are counted, not stored.
  uint64_t dropped() const;
  std::vector<TraceSpan> spans() const;
  std::vector<TraceCounter> counters() const;

  // {"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}: one process, one
  // thread per lane (named by "thread_name" metadata events), "X" events for spans and "C"
  // events for counters.
  void write_json(std::ostream& out) const;
  // Writes to a temporary file next to `path`, then renames it. Throws IoError.
  void write_file(const std::string& path) const;

 private:
  clock::time_point start_ = clock::now();
  size_t max_events_;
  mutable std::mutex mu_;
  std::vector<TraceSpan> spans_;
  std::vector<TraceCounter> counters_;
  uint64_t dropped_ = 0;
};

// Records a span from construction to destruction (no-op when the recorder is null).
class ScopedSpan {
 public:
  ScopedSpan(TraceRecorder* recorder, TraceSpan span);
  ~ScopedSpan();
  ScopedSpan(const ScopedSpan&) = delete;
  ScopedSpan& operator=(const ScopedSpan&) = delete;

 private:
  TraceRecorder* recorder_;
  TraceSpan span_;
};

}  // namespace porter::engine
