// TraceRecorder: spans and counters in memory, written as Chrome Trace Event Format JSON;
// the file of several ranks (Notes [Trace lanes], [Trace of several ranks] in trace.h).
#include "engine/trace.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <ostream>

#include <nlohmann/json.hpp>
#include <unistd.h>

#include "base/error.h"

namespace porter::engine {

TraceRecorder::TraceRecorder(size_t max_events) : max_events_(max_events) {}

int64_t TraceRecorder::now_us() const { return to_us(clock::now()); }

int64_t TraceRecorder::to_us(clock::time_point t) const {
  return std::chrono::duration_cast<std::chrono::microseconds>(t - start_).count();
}

void TraceRecorder::span(TraceSpan span) {
  std::lock_guard lock(mu_);
  if (spans_.size() + counters_.size() >= max_events_) {
    ++dropped_;
    return;
  }
  spans_.push_back(std::move(span));
}

void TraceRecorder::counter(TraceCounter counter) {
  std::lock_guard lock(mu_);
  if (spans_.size() + counters_.size() >= max_events_) {
    ++dropped_;
    return;
  }
  counters_.push_back(std::move(counter));
}

uint64_t TraceRecorder::dropped() const {
  std::lock_guard lock(mu_);
  return dropped_;
}

std::vector<TraceSpan> TraceRecorder::spans() const {
  std::lock_guard lock(mu_);
  return spans_;
}

std::vector<TraceCounter> TraceRecorder::counters() const {
  std::lock_guard lock(mu_);
  return counters_;
}

std::string TraceRecorder::events_json(int rank) const {
  std::lock_guard lock(mu_);
  using nlohmann::json;
  const int pid = rank + 1;
  const int tid0 = rank * kTraceLaneStride;
  // The standard lanes get fixed thread ids, in this order, so every trace of porter shows
  // them the same way; other lanes follow in order of appearance (Note [Trace lanes]).
  std::map<std::string, int> lane_ids = {{"compute", 1}, {"d2h", 2}, {"h2d", 3}, {"comm", 4}};
  std::vector<std::string> lane_order = {"compute", "d2h", "h2d", "comm"};
  for (const TraceSpan& s : spans_) {
    const std::string lane = s.lane.empty() ? "compute" : s.lane;
    if (lane_ids.emplace(lane, static_cast<int>(lane_ids.size()) + 1).second) {
      lane_order.push_back(lane);
    }
  }

  json events = json::array();
  const std::string name = "rank " + std::to_string(rank);
  events.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", pid}, {"tid", tid0},
                    {"ts", 0}, {"args", {{"name", name}}}});
  events.push_back({{"name", "process_sort_index"}, {"ph", "M"}, {"pid", pid}, {"tid", tid0},
                    {"ts", 0}, {"args", {{"sort_index", rank}}}});
  for (const std::string& lane : lane_order) {
    const int tid = tid0 + lane_ids[lane];
    events.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", pid}, {"tid", tid},
                      {"ts", 0}, {"args", {{"name", lane}}}});
    events.push_back({{"name", "thread_sort_index"}, {"ph", "M"}, {"pid", pid}, {"tid", tid},
                      {"ts", 0}, {"args", {{"sort_index", lane_ids[lane]}}}});
  }
  for (const TraceSpan& s : spans_) {
    json args = json::object();
    if (s.step >= 0) args["step"] = s.step;
    if (s.stage >= 0) args["stage"] = s.stage;
    if (s.micro_batch >= 0) args["micro_batch"] = s.micro_batch;
    for (const auto& [key, value] : s.args) args[key] = value;
    for (const auto& [key, value] : s.text_args) args[key] = value;
    events.push_back({{"name", s.name}, {"cat", s.category}, {"ph", "X"}, {"pid", pid},
                      {"tid", tid0 + lane_ids[s.lane.empty() ? "compute" : s.lane]},
                      {"ts", s.start_us}, {"dur", s.dur_us}, {"args", std::move(args)}});
  }
  for (const TraceCounter& c : counters_) {
    json args = json::object();
    for (const auto& [series, value] : c.values) args[series] = value;
    events.push_back({{"name", c.name}, {"ph", "C"}, {"pid", pid}, {"tid", tid0},
                      {"ts", c.time_us}, {"args", std::move(args)}});
  }
  return events.dump();
}

void TraceRecorder::write_json(std::ostream& out) const {
  merge_trace_json(out, {TraceRank{0, events_json(0), 0, dropped()}});
}

void TraceRecorder::write_file(const std::string& path) const {
  write_trace_file(path, {TraceRank{0, events_json(0), 0, dropped()}});
}

void merge_trace_json(std::ostream& out, const std::vector<TraceRank>& ranks) {
  using nlohmann::json;
  json events = json::array();
  uint64_t dropped = 0;
  int64_t earliest = 0;
  for (const TraceRank& r : ranks) {
    json mine = json::parse(r.events, nullptr, /*allow_exceptions=*/false);
    if (!mine.is_array()) {
      throw InvalidArgument("trace: the events of rank " + std::to_string(r.rank) +
                            " are not a JSON array (" + std::to_string(r.events.size()) +
                            " bytes); was a chunk lost?");
    }
    for (json& e : mine) {
      if (e.value("ph", "") != "M") {
        e["ts"] = e["ts"].get<int64_t>() + r.shift_us;
        earliest = std::min(earliest, e["ts"].get<int64_t>());
      }
      events.push_back(std::move(e));
    }
    dropped += r.dropped;
  }
  // Perfetto rejects negative timestamps: an event a rank recorded before rank 0's recorder
  // began moves the whole file later. Metadata stays at 0.
  if (earliest < 0) {
    for (json& e : events) {
      if (e.value("ph", "") != "M") e["ts"] = e["ts"].get<int64_t>() - earliest;
    }
  }
  json doc = {{"traceEvents", std::move(events)},
              {"displayTimeUnit", "ms"},
              {"otherData", {{"producer", "porter"}, {"dropped_events", dropped}}}};
  out << doc.dump() << "\n";
}

void write_trace_file(const std::string& path, const std::vector<TraceRank>& ranks) {
  namespace fs = std::filesystem;
  const fs::path target(path);
  const fs::path tmp = target.parent_path() /
                       ("." + target.filename().string() + ".tmp" + std::to_string(::getpid()));
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) throw IoError("trace: cannot write \"" + tmp.string() + "\"");
    merge_trace_json(out, ranks);
    out.flush();
    if (!out) {
      std::error_code ec;
      fs::remove(tmp, ec);
      throw IoError("trace: error while writing \"" + tmp.string() + "\"");
    }
  }
  std::error_code ec;
  fs::rename(tmp, target, ec);
  if (ec) {
    fs::remove(tmp, ec);
    throw IoError("trace: cannot rename \"" + tmp.string() + "\" to \"" + path + "\": " +
                  ec.message());
  }
}

ScopedSpan::ScopedSpan(TraceRecorder* recorder, TraceSpan span)
    : recorder_(recorder), span_(std::move(span)) {
  if (recorder_) span_.start_us = recorder_->now_us();
}

ScopedSpan::~ScopedSpan() {
  if (!recorder_) return;
  try {
    span_.dur_us = recorder_->now_us() - span_.start_us;
    recorder_->span(std::move(span_));
  } catch (...) {
    // Destructors swallow (STYLE.md); a lost span is not worth a terminate().
  }
}

}  // namespace porter::engine
