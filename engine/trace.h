// A recorder of spans and counters for a Chrome/Perfetto trace (chrome://tracing or
// ui.perfetto.dev, "Trace Event Format" JSON), and the file of one or several ranks' traces.
// The CLI writes the file.
//
// Note [Trace lanes]
// A trace has one lane (a Chrome "thread") per stream of a rank, in this order:
// - compute: the spans per stage (forward, recompute, backward), the optimizer, the step, and
//   the exposed offload waits (engine/executor.cc, engine/offload_trace.h);
// - d2h, h2d: the checkpoint stash's copies (Note [Offload trace]);
// - comm: the collectives on the comm stream, one span per op with its bytes, its purpose
//   ("bucket 3", "grad norm", ...), group, count and element type (Note [Comm trace]);
// and a "memory" counter track. Other lanes follow in order of appearance.
//
// Note [Trace of several ranks]
// Each rank is a process of the file: pid r + 1 (Perfetto reserves pid 0 for the kernel's
// idle task), named "rank r" by process_name metadata and sorted by rank with
// process_sort_index, so rank 0 is shown first; lane l of rank r is tid r * kTraceLaneStride +
// l, unique in the file (lane ids start at 1), so rank 0 keeps the tids of a one-rank trace.
// A rank's timestamps are microseconds since its recorder was created; merge_trace_json()
// adds each rank's shift_us to put them on rank 0's clock (cli/train_trace.h computes the
// shifts at the rendezvous).
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
  std::vector<std::pair<std::string, double>> args{};  // extra args, e.g. {"bytes", 4096}
  std::vector<std::pair<std::string, std::string>> text_args{};  // e.g. {"group", "world"}
};

struct TraceCounter {
  std::string name;  // "memory"
  int64_t time_us = 0;
  std::vector<std::pair<std::string, double>> values;  // series name -> value (bytes)
};

inline constexpr int kTraceLaneStride = 1000;

// One rank's events in a trace file (Note [Trace of several ranks]).
struct TraceRank {
  int rank = 0;
  std::string events;    // TraceRecorder::events_json(rank): a JSON array
  int64_t shift_us = 0;  // added to every timestamp
  uint64_t dropped = 0;  // TraceRecorder::dropped()
};

class TraceRecorder {
 public:
  using clock = std::chrono::steady_clock;
  explicit TraceRecorder(size_t max_events = size_t{1} << 21);

  int64_t now_us() const;
  // A steady_clock time as the recorder's microseconds (negative before its creation).
  int64_t to_us(clock::time_point t) const;
  void span(TraceSpan span);
  void counter(TraceCounter counter);
  // Events beyond max_events are counted, not stored.
  uint64_t dropped() const;
  std::vector<TraceSpan> spans() const;
  std::vector<TraceCounter> counters() const;

  // The events of rank `rank` (Note [Trace of several ranks]) as a JSON array: process and
  // lane metadata ("M"), spans ("X"), counters ("C").
  std::string events_json(int rank) const;
  // {"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}: one process (rank 0),
  // one thread per lane (named by "thread_name" metadata events), "X" events for spans and
  // "C" events for counters.
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

// One trace document of several ranks' events, in the order given (by rank); throws
// InvalidArgument when a rank's events are not a JSON array.
void merge_trace_json(std::ostream& out, const std::vector<TraceRank>& ranks);
// merge_trace_json into a temporary file next to `path`, then renamed. Throws IoError.
void write_trace_file(const std::string& path, const std::vector<TraceRank>& ranks);

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
