// The memory page's data (Note [Memory page data] in memory_page.h) from a recorded step or
// from a plan alone, and the page itself: the template filled with the data and the static
// SVG.
#include "cli/memory_page.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <numeric>
#include <regex>
#include <utility>

#include "base/check.h"
#include "base/error.h"
#include "memory/category.h"

namespace porter::cli {
namespace {

using nlohmann::ordered_json;
using checkpoint::ScheduleOp;
using engine::StepPhase;

constexpr int kFormatVersion = 2;

// One op of the drawn step, on the page's time axis.
struct OpSpan {
  int micro_batch = 0;
  int op = 0;
  StepPhase phase = StepPhase::kForward;
  int stage = 0;
  double start = 0.0;
  double end = 0.0;
};

// The phase of every op of a schedule, as the executor labels them (engine/step_memory.h).
std::vector<StepPhase> op_phases(const checkpoint::Schedule& schedule) {
  std::vector<int> forwards(static_cast<size_t>(schedule.num_stages), 0);
  std::vector<StepPhase> out;
  for (const ScheduleOp& op : schedule.ops) {
    const auto s = static_cast<size_t>(op.stage);
    if (op.kind == ScheduleOp::Kind::kBackward) {
      out.push_back(StepPhase::kBackward);
    } else if (op.kind == ScheduleOp::Kind::kRecompute || forwards[s]++ > 0) {
      out.push_back(StepPhase::kRecompute);
    } else {
      out.push_back(StepPhase::kForward);
    }
  }
  return out;
}

ordered_json interval(double start, double end) { return ordered_json::array({start, end}); }

// Consecutive ops of one phase make one band.
ordered_json phases_json(const std::vector<OpSpan>& spans) {
  ordered_json out = ordered_json::array();
  for (size_t i = 0; i < spans.size();) {
    size_t j = i + 1;
    while (j < spans.size() && spans[j].phase == spans[i].phase &&
           spans[j].micro_batch == spans[i].micro_batch) {
      ++j;
    }
    out.push_back({{"phase", engine::phase_name(spans[i].phase)},
                   {"micro_batch", spans[i].micro_batch},
                   {"start", spans[i].start},
                   {"end", spans[j - 1].end}});
    i = j;
  }
  return out;
}

// Each op's span with its predicted peak (Note [Predicted envelope]) and its footprint after.
ordered_json predicted_ops_json(const std::vector<OpSpan>& spans, const checkpoint::Plan& plan,
                                const std::function<std::string(int)>& stage_name) {
  ordered_json out = ordered_json::array();
  const std::vector<size_t>& after = plan.prediction.footprint_after_op;
  const std::vector<size_t>& during = plan.prediction.peak_total_during_op;
  for (const OpSpan& s : spans) {
    const size_t k = static_cast<size_t>(s.op);
    out.push_back({{"micro_batch", s.micro_batch},
                   {"op", s.op},
                   {"phase", engine::phase_name(s.phase)},
                   {"stage", s.stage},
                   {"name", stage_name(s.stage)},
                   {"start", s.start},
                   {"end", s.end},
                   {"peak_bytes", k < during.size() ? during[k] : 0},
                   {"footprint_bytes", k < after.size() ? after[k] : 0}});
  }
  return out;
}

// Note [Checkpoint lives]
// A checkpoint lives from the op that holds its input (a Forward with hold_input whose input
// is not held yet) to the end of that stage's Backward. It is on the device ("device"), or on
// the host ("host") from its hold op until the op that fetches it back into staging (the
// entry's use_op; to its end when never read back), then on the device again. Its
// "recomputes" are the recompute ops of the segment it starts: those of stages at or after
// it, up to the next held stage. A partitioned hold (Note [Partition semantics]) is
// "partitioned": this rank's 1/t slice on the device (or on the host with offload, then
// "host") from its hold op until the op that gathers it back into staging, listed in
// "partitioned" as host holds' intervals are in "host".
// On a failure page (`open_until`), a checkpoint whose backward did not run lives until then.
ordered_json checkpoints_json(const std::vector<OpSpan>& spans, const checkpoint::Plan& plan,
                              const checkpoint::ChainCosts& costs,
                              const std::function<std::string(int)>& stage_name,
                              std::optional<double> open_until = std::nullopt) {
  const checkpoint::Schedule& schedule = plan.schedule;
  ordered_json out = ordered_json::array();
  std::map<std::pair<int, int>, const OpSpan*> by_op;  // (micro-batch, op) -> span
  for (const OpSpan& s : spans) by_op[{s.micro_batch, s.op}] = &s;
  auto span_of = [&](int mb, int op) -> const OpSpan* {
    auto it = by_op.find({mb, op});
    return it == by_op.end() ? nullptr : it->second;
  };
  std::map<std::pair<int, int>, ordered_json> open;  // (micro-batch, stage) -> life
  for (const OpSpan& s : spans) {
    const ScheduleOp& op = schedule.ops[static_cast<size_t>(s.op)];
    const std::pair<int, int> key{s.micro_batch, op.stage};
    if (op.kind == ScheduleOp::Kind::kForward && op.hold_input && !open.contains(key)) {
      const std::string where = op.offload ? "host" : op.partition ? "partitioned" : "device";
      ordered_json life = {{"stage", op.stage},
                           {"name", stage_name(op.stage)},
                           {"micro_batch", s.micro_batch},
                           {"where", where},
                           {"bytes", costs.stages[static_cast<size_t>(op.stage)].input_bytes},
                           {"start", s.start},
                           {"end", s.end},
                           {"host", ordered_json::array()},
                           {"partitioned", ordered_json::array()},
                           {"recomputes", ordered_json::array()}};
      for (const checkpoint::StashEntry& e : plan.offload.entries) {
        if (!op.stashed() || e.hold_op != s.op) continue;
        const OpSpan* back = span_of(s.micro_batch, e.use_op >= 0 ? e.use_op : e.release_op);
        const double until = back == nullptr ? s.end : e.use_op >= 0 ? back->start : back->end;
        life[op.offload ? "host" : "partitioned"].push_back(interval(s.start, until));
      }
      open[key] = std::move(life);
    }
    if (s.phase == StepPhase::kRecompute) {
      // The segment's checkpoint: the latest held stage at or before this one.
      auto it = open.upper_bound({s.micro_batch, op.stage});
      if (it != open.begin() && std::prev(it)->first.first == s.micro_batch) {
        std::prev(it)->second["recomputes"].push_back(interval(s.start, s.end));
      }
    }
    if (op.kind == ScheduleOp::Kind::kBackward) {
      auto it = open.find(key);
      if (it != open.end()) {
        it->second["end"] = s.end;
        out.push_back(std::move(it->second));
        open.erase(it);
      }
    }
  }
  if (open_until) {
    for (auto& [key, life] : open) {
      life["end"] = *open_until;
      out.push_back(std::move(life));
    }
  }
  return out;
}

ordered_json category_names() {
  ordered_json out = ordered_json::array();
  for (memory::Category c : memory::kAllCategories) out.push_back(memory::category_name(c));
  return out;
}

ordered_json optional_bytes(const std::optional<size_t>& v) {
  return v ? ordered_json(*v) : ordered_json();
}

double ms_since(int64_t t_ns, int64_t origin_ns) {
  return static_cast<double>(t_ns - origin_ns) / 1e6;
}

// Every category's bytes after each of the step's first `events` allocator events, and where
// their sum peaks.
ordered_json measured_json(const engine::StepMemory& step, size_t events, double until_ms) {
  std::array<size_t, memory::kNumCategories> level = step.start_bytes;
  ordered_json times = ordered_json::array();
  std::array<ordered_json, memory::kNumCategories> cols;
  size_t peak = 0;
  double peak_time = 0.0;
  std::array<size_t, memory::kNumCategories> at_peak = level;
  auto push = [&](double t) {
    times.push_back(t);
    for (size_t c = 0; c < memory::kNumCategories; ++c) cols[c].push_back(level[c]);
    const size_t total = std::accumulate(level.begin(), level.end(), size_t{0});
    if (total > peak || times.size() == 1) {
      peak = total;
      peak_time = t;
      at_peak = level;
    }
  };
  push(0.0);
  for (size_t i = 0; i < events && i < step.entries.size(); ++i) {
    const memory::TimelineEntry& e = step.entries[i];
    level[memory::index_of(e.category)] = e.category_bytes;
    push(std::max(0.0, ms_since(e.time_ns, step.start_ns)));
  }
  ordered_json bytes = ordered_json::object(), peak_parts = ordered_json::object();
  for (memory::Category c : memory::kAllCategories) {
    bytes[std::string(memory::category_name(c))] = std::move(cols[memory::index_of(c)]);
    peak_parts[std::string(memory::category_name(c))] = at_peak[memory::index_of(c)];
  }
  ordered_json pinned_t = ordered_json::array(), pinned_b = ordered_json::array();
  for (const engine::PinnedSample& p : step.pinned) {
    if (ms_since(p.time_ns, step.start_ns) > until_ms) break;
    pinned_t.push_back(ms_since(p.time_ns, step.start_ns));
    pinned_b.push_back(p.bytes);
  }
  return {{"times", std::move(times)},
          {"bytes", std::move(bytes)},
          {"peak_bytes", peak},
          {"peak_time", peak_time},
          {"peak_by_category", std::move(peak_parts)},
          {"dropped_events", step.dropped},
          {"pinned", {{"times", std::move(pinned_t)}, {"bytes", std::move(pinned_b)}}}};
}

// What a failed step's page adds (Note [Out-of-memory page]).
struct Failure {
  size_t events = 0;  // the timeline's events before the failed request
  double time = 0.0;
  ordered_json json;
};

// What the allocator's out-of-memory message says (Note [Out-of-memory message] in
// memory/caching_allocator.cc): the failed request's category, and every category's bytes.
struct OomAccount {
  std::optional<std::string> category;
  std::optional<std::array<size_t, memory::kNumCategories>> live;
};

OomAccount read_oom_message(const std::string& what, size_t requested_bytes) {
  OomAccount out;
  std::smatch m;
  const std::regex request("\\(" + std::to_string(requested_bytes) + " bytes\\) for ([a-z]+)\\.");
  if (std::regex_search(what, m, request)) {
    for (memory::Category c : memory::kAllCategories) {
      if (m[1].str() == memory::category_name(c)) out.category = m[1].str();
    }
  } else if (what.find("pinned host memory exhausted") != std::string::npos) {
    out.category = "pinned host memory";
  }
  std::array<size_t, memory::kNumCategories> live{};
  for (memory::Category c : memory::kAllCategories) {
    const std::regex line("\n +" + std::string(memory::category_name(c)) +
                          " +[^\n]*\\((\\d+) bytes, \\d+ allocations\\)");
    if (!std::regex_search(what, m, line)) return out;
    live[memory::index_of(c)] = std::stoull(m[1].str());
  }
  out.live = live;
  return out;
}

// The failure of `step` (Note [Out-of-memory page]); `spans` gets the op that failed.
Failure find_failure(const engine::StepMemory& step, const OutOfMemoryError& error,
                     const checkpoint::Schedule& schedule, int micro_batches,
                     std::vector<OpSpan>& spans,
                     const std::function<std::string(int)>& stage_name) {
  const OomAccount account = read_oom_message(error.what(), error.requested_bytes());
  // The states of the timeline: before any event, then after each.
  std::array<size_t, memory::kNumCategories> level = step.start_bytes;
  std::optional<size_t> matched;  // events before the state equal to the message's
  size_t last_alloc = 0;          // events up to and with the latest allocation
  std::vector<std::array<size_t, memory::kNumCategories>> states{level};
  if (account.live && level == *account.live) matched = 0;
  for (size_t i = 0; i < step.entries.size(); ++i) {
    const memory::TimelineEntry& e = step.entries[i];
    level[memory::index_of(e.category)] = e.category_bytes;
    states.push_back(level);
    if (account.live && level == *account.live) matched = i + 1;
    if (e.delta_bytes > 0) last_alloc = i + 1;
  }
  Failure f;
  f.events = matched.value_or(last_alloc);
  const std::array<size_t, memory::kNumCategories>& live = states[f.events];
  f.time = f.events == 0 ? 0.0 : ms_since(step.entries[f.events - 1].time_ns, step.start_ns);

  // The op that failed: the first one of the schedule the step did not complete.
  const auto n_ops = static_cast<int>(schedule.ops.size());
  int mb = 0, k = 0;
  double op_start = 0.0;
  if (!step.ops.empty()) {
    const engine::OpTime& last = step.ops.back();
    mb = last.op + 1 < n_ops ? last.micro_batch : last.micro_batch + 1;
    k = last.op + 1 < n_ops ? last.op + 1 : 0;
    op_start = ms_since(last.end_ns, step.start_ns);
  }
  f.time = std::max(f.time, op_start);
  ordered_json where;
  if (mb < micro_batches && k < n_ops) {
    const StepPhase phase = op_phases(schedule)[static_cast<size_t>(k)];
    const int stage = schedule.ops[static_cast<size_t>(k)].stage;
    spans.push_back({mb, k, phase, stage, op_start, f.time});
    where = {{"micro_batch", mb},
             {"op", k},
             {"phase", engine::phase_name(phase)},
             {"stage", stage},
             {"name", stage_name(stage)},
             {"start", op_start}};
  } else {
    where = {{"micro_batch", nullptr},
             {"op", nullptr},
             {"phase", "optimizer"},
             {"stage", nullptr},
             {"name", "optimizer update"},
             {"start", op_start}};
  }
  ordered_json by_category = ordered_json::object();
  for (memory::Category c : memory::kAllCategories) {
    by_category[std::string(memory::category_name(c))] = live[memory::index_of(c)];
  }
  f.json = {{"requested_bytes", error.requested_bytes()},
            {"category", account.category ? ordered_json(*account.category) : ordered_json()},
            {"time", f.time},
            {"micro_batch", where["micro_batch"]},
            {"op", where["op"]},
            {"phase", where["phase"]},
            {"stage", where["stage"]},
            {"name", where["name"]},
            {"op_start", where["start"]},
            {"live_bytes", std::accumulate(live.begin(), live.end(), size_t{0})},
            {"live_by_category", std::move(by_category)},
            {"live_from", matched ? "allocator" : "timeline"},
            {"message", error.what()}};
  return f;
}

// The highest byte count the chart draws (Note [Chart scale]).
double highest_drawn(const ordered_json& data) {
  const ordered_json& p = data["predicted"];
  double top = p["peak_bytes"].get<double>();
  const double base = p["baseline_bytes"].get<double>();
  for (const ordered_json& op : p["ops"]) top = std::max(top, base + op["peak_bytes"].get<double>());
  if (!data["measured"].is_null()) top = std::max(top, data["measured"]["peak_bytes"].get<double>());
  if (!data["failure"].is_null()) {
    top = std::max(top, data["failure"]["live_bytes"].get<double>() +
                            data["failure"]["requested_bytes"].get<double>());
  }
  return top;
}

// The layout both drawings use (Note [Chart scale]).
ordered_json chart_json(const ordered_json& data) {
  const double top = std::max(1.0, 1.1 * highest_drawn(data));
  double unit = 1.0;
  while (top / unit >= 1024.0) unit *= 1024.0;
  // The smallest step of 1, 2, 2.5, 5 x 10^n (in `unit`) that spans `top` in at most 5 ticks.
  const double rough = top / unit / 4.0;
  double decade = std::pow(10.0, std::floor(std::log10(rough)));
  double step = decade * 10.0;
  for (double m : {1.0, 2.0, 2.5, 5.0, 10.0}) {
    if (m * decade >= rough) {
      step = m * decade;
      break;
    }
  }
  step *= unit;
  const double y_max = std::ceil(top / step - 1e-9) * step;
  ordered_json ticks = ordered_json::array();
  for (double t = 0.0; t <= y_max + step / 2; t += step) ticks.push_back(t);
  // Lane names are drawn right-aligned left of the time axis, at 12px: ~7.5px a character.
  size_t longest = 0;
  const bool numbered = data["micro_batches"].get<int>() > 1;
  for (const ordered_json& c : data["checkpoints"]) {
    const std::string name = c["name"].get<std::string>() +
                             (numbered ? " #" + std::to_string(c["micro_batch"].get<int>()) : "");
    longest = std::max(longest, name.size());
  }
  const double left = std::max(84.0, 14.0 + 7.5 * static_cast<double>(longest));
  const bool capacity_on_chart =
      !data["capacity_bytes"].is_null() && data["capacity_bytes"].get<double>() <= y_max;
  return {{"width", 1200},  {"height", 440},        {"left", left},
          {"right", 24},    {"top", 24},           {"bottom", 44},
          {"y_max_bytes", y_max}, {"y_ticks", std::move(ticks)},
          {"capacity_on_chart", capacity_on_chart}};
}

// The page data of a recorded step, whole or up to its failure.
ordered_json step_page_data(engine::Engine& engine, const engine::StepMemory& step,
                            const std::string& config_file, const OutOfMemoryError* error,
                            int rank) {
  const checkpoint::Plan& plan = engine.plan();
  const engine::MemoryReport mem = engine.memory_report();
  auto stage_name = [&engine](int s) { return engine.model().stage_name(s); };
  std::vector<OpSpan> spans;
  for (const engine::OpTime& o : step.ops) {
    spans.push_back({o.micro_batch, o.op, o.phase, o.stage, ms_since(o.start_ns, step.start_ns),
                     ms_since(o.end_ns, step.start_ns)});
  }
  std::optional<Failure> failure;
  if (error != nullptr) {
    failure = find_failure(step, *error, plan.schedule,
                           engine.run_options().gradient_accumulation_steps, spans, stage_name);
    failure->json["rank"] = rank;
  }
  ordered_json phases = phases_json(spans);
  if (step.optimizer) {
    phases.push_back({{"phase", "optimizer"},
                      {"micro_batch", nullptr},
                      {"start", ms_since(step.optimizer->start_ns, step.start_ns)},
                      {"end", ms_since(step.optimizer->end_ns, step.start_ns)}});
  } else if (failure && failure->json["op"].is_null()) {
    phases.push_back({{"phase", "optimizer"},
                      {"micro_batch", nullptr},
                      {"start", failure->json["op_start"]},
                      {"end", failure->time}});
  }
  ordered_json copies = ordered_json::array();
  for (const engine::CopyTime& c : step.copies) {
    copies.push_back(
        {{"direction", c.direction == offload::CopyRecord::Direction::kD2H ? "d2h" : "h2d"},
         {"stage", c.stage},
         {"micro_batch", c.micro_batch},
         {"bytes", c.bytes},
         {"start", ms_since(c.start_ns, step.start_ns)},
         {"end", ms_since(c.end_ns, step.start_ns)}});
  }
  // Measured, a host checkpoint is on the host from its D2H copy's start to its H2D copy's
  // end (the prefetch brings it back before its use op). A failed step has no copy records:
  // its host intervals are the plan's.
  ordered_json lives = checkpoints_json(
      spans, plan, engine.costs(), stage_name,
      failure ? std::optional<double>(failure->time) : std::nullopt);
  for (ordered_json& life : lives) {
    if (life["where"] != "host") continue;
    std::optional<double> from, to;
    for (const ordered_json& c : copies) {
      if (c["stage"] != life["stage"] || c["micro_batch"] != life["micro_batch"]) continue;
      if (c["direction"] == "d2h") from = c["start"].get<double>();
      if (c["direction"] == "h2d") to = c["end"].get<double>();
    }
    if (!from) continue;
    const double until = to.value_or(life["end"].get<double>());
    life["host"] = ordered_json::array({interval(*from, until)});
  }
  // A failure page ends a little after the failure, so that its mark is inside the chart.
  const double duration = failure ? std::max(failure->time * 1.03, failure->time + 1e-3)
                                  : ms_since(step.end_ns, step.start_ns);
  ordered_json measured =
      measured_json(step, failure ? failure->events : step.entries.size(),
                    failure ? failure->time : std::numeric_limits<double>::infinity());
  measured["pinned"]["limit_bytes"] = mem.pinned_limit_bytes;
  measured["report_peak_bytes"] = mem.peak_bytes;
  const size_t baseline = mem.model_state_bytes + engine.run_options().batch_bytes;
  std::string title = "porter train " + config_file + ": step " + std::to_string(step.step);
  if (failure) {
    title += ", out of memory" +
             (engine.dp_size() * engine.tp_size() > 1 ? " on rank " + std::to_string(rank) : std::string());
  }
  ordered_json data = {
      {"format", "porter-memory-page"},
      {"version", kFormatVersion},
      {"kind", "train"},
      {"title", std::move(title)},
      {"config", config_file},
      {"description", plan.description},
      {"device", engine.device().description()},
      {"step", step.step},
      {"micro_batches", engine.run_options().gradient_accumulation_steps},
      {"time_unit", "ms"},
      {"duration", duration},
      {"capacity_bytes",
       mem.capacity_bytes > 0 ? ordered_json(mem.capacity_bytes) : ordered_json()},
      {"categories", category_names()},
      {"measured", std::move(measured)},
      {"predicted",
       {{"baseline_bytes", baseline},
        {"peak_bytes", mem.predicted_peak_bytes},
        {"activation_peak_bytes", plan.prediction.peak_activation_bytes},
        {"pinned_bytes", plan.offload.pinned_bytes},
        {"ops", predicted_ops_json(spans, plan, stage_name)}}},
      {"phases", std::move(phases)},
      {"checkpoints", std::move(lives)},
      {"copies", std::move(copies)},
      {"failure", failure ? std::move(failure->json) : ordered_json()}};
  data["chart"] = chart_json(data);
  return data;
}

}  // namespace

ordered_json train_page_data(engine::Engine& engine, const engine::StepMemory& step,
                             const std::string& config_file) {
  return step_page_data(engine, step, config_file, nullptr, 0);
}

ordered_json oom_page_data(engine::Engine& engine, const engine::StepMemory& unfinished,
                           const OutOfMemoryError& error, const std::string& config_file,
                           int rank) {
  return step_page_data(engine, unfinished, config_file, &error, rank);
}

std::string oom_page_path(const std::string& memory_page, const std::string& report, int rank,
                          int world_size) {
  namespace fs = std::filesystem;
  fs::path path = !memory_page.empty() ? fs::path(memory_page)
                  : !report.empty()    ? fs::path(report).replace_extension(".html")
                                       : fs::path("porter-oom-memory.html");
  if (world_size > 1) {
    const std::string ext = path.has_extension() ? path.extension().string() : "";
    path.replace_extension(".rank" + std::to_string(rank) + ext);
  }
  return path.string();
}

ordered_json plan_page_data(const PlanPageInput& in) {
  PORTER_ASSERT(in.plan != nullptr && in.costs != nullptr, "plan_page_data: no plan");
  const checkpoint::Plan& plan = *in.plan;
  const std::vector<StepPhase> phase = op_phases(plan.schedule);
  std::vector<OpSpan> spans;
  for (size_t k = 0; k < plan.schedule.ops.size(); ++k) {
    spans.push_back({0, static_cast<int>(k), phase[k], plan.schedule.ops[k].stage,
                     static_cast<double>(k), static_cast<double>(k + 1)});
  }
  ordered_json data = {{"format", "porter-memory-page"},
          {"version", kFormatVersion},
          {"kind", "plan"},
          {"title", "porter plan " + in.config_file + ": one micro-batch, predicted"},
          {"config", in.config_file},
          {"description", plan.description},
          {"device", nullptr},
          {"step", nullptr},
          {"micro_batches", 1},
          {"time_unit", "op"},
          {"duration", static_cast<double>(spans.size())},
          {"capacity_bytes", optional_bytes(in.capacity_bytes)},
          {"categories", category_names()},
          {"measured", nullptr},
          {"predicted",
           {{"baseline_bytes", in.model_state_bytes + in.batch_bytes},
            {"model_state_bytes", in.model_state_bytes},
            {"batch_bytes", in.batch_bytes},
            {"peak_bytes", in.predicted_peak_bytes},
            {"activation_peak_bytes", plan.prediction.peak_activation_bytes},
            {"pinned_bytes", plan.offload.pinned_bytes},
            {"ops", predicted_ops_json(spans, plan, in.stage_name)}}},
          {"phases", phases_json(spans)},
          {"checkpoints", checkpoints_json(spans, plan, *in.costs, in.stage_name)},
          {"copies", ordered_json::array()},
          {"failure", nullptr}};
  data["chart"] = chart_json(data);
  return data;
}

std::string render_memory_page(const ordered_json& data) {
  // Note [Inline data]: "</" inside the JSON would end the <script> element early; "<\/" is
  // the same string to a JSON parser.
  std::string json = data.dump();
  for (size_t at = json.find("</"); at != std::string::npos; at = json.find("</", at + 3)) {
    json.replace(at, 2, "<\\/");
  }
  const std::string title = html_escape(data.value("title", std::string("porter memory")));
  // One pass over the template, so that nothing filled in is searched for placeholders.
  const std::pair<std::string_view, std::string> fills[] = {
      {"@TITLE@", title}, {"@SVG@", static_svg(data)}, {"@DATA@", json}};
  const std::string_view tpl = memory_page_template();
  std::string page;
  size_t from = 0;
  for (size_t at = tpl.find('@'); at != std::string_view::npos; at = tpl.find('@', at + 1)) {
    for (const auto& [key, value] : fills) {
      if (tpl.substr(at, key.size()) != key) continue;
      page.append(tpl.substr(from, at - from)).append(value);
      from = at + key.size();
      at = from - 1;
      break;
    }
  }
  page.append(tpl.substr(from));
  return page;
}

void write_memory_page(const std::string& path, const ordered_json& data, std::string_view flag) {
  std::ofstream f(path, std::ios::binary);
  f << render_memory_page(data);
  if (!f) throw IoError(std::string(flag) + ": cannot write \"" + path + "\"");
}

}  // namespace porter::cli
