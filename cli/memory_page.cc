// The memory page's data (Note [Memory page data] in memory_page.h) from a recorded step or
// from a plan alone, and the page itself: the template filled with the data and the static
// SVG.
#include "cli/memory_page.h"

#include <algorithm>
#include <fstream>
#include <map>
#include <numeric>
#include <utility>

#include "base/check.h"
#include "base/error.h"
#include "memory/category.h"

namespace porter::cli {
namespace {

using nlohmann::ordered_json;
using checkpoint::ScheduleOp;
using engine::StepPhase;

constexpr int kFormatVersion = 1;

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

ordered_json predicted_ops_json(const std::vector<OpSpan>& spans, const checkpoint::Plan& plan,
                                const std::function<std::string(int)>& stage_name) {
  ordered_json out = ordered_json::array();
  const std::vector<size_t>& after = plan.prediction.footprint_after_op;
  for (const OpSpan& s : spans) {
    const size_t k = static_cast<size_t>(s.op);
    out.push_back({{"micro_batch", s.micro_batch},
                   {"op", s.op},
                   {"phase", engine::phase_name(s.phase)},
                   {"stage", s.stage},
                   {"name", stage_name(s.stage)},
                   {"start", s.start},
                   {"end", s.end},
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
ordered_json checkpoints_json(const std::vector<OpSpan>& spans, const checkpoint::Plan& plan,
                              const checkpoint::ChainCosts& costs,
                              const std::function<std::string(int)>& stage_name) {
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

// Every category's bytes after each allocator event of the step, and where their sum peaks.
ordered_json measured_json(const engine::StepMemory& step) {
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
  for (const memory::TimelineEntry& e : step.entries) {
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

}  // namespace

ordered_json train_page_data(engine::Engine& engine, const engine::StepMemory& step,
                             const std::string& config_file) {
  const checkpoint::Plan& plan = engine.plan();
  const engine::MemoryReport mem = engine.memory_report();
  auto stage_name = [&engine](int s) { return engine.model().stage_name(s); };
  std::vector<OpSpan> spans;
  for (const engine::OpTime& o : step.ops) {
    spans.push_back({o.micro_batch, o.op, o.phase, o.stage, ms_since(o.start_ns, step.start_ns),
                     ms_since(o.end_ns, step.start_ns)});
  }
  ordered_json phases = phases_json(spans);
  if (step.optimizer) {
    phases.push_back({{"phase", "optimizer"},
                      {"micro_batch", nullptr},
                      {"start", ms_since(step.optimizer->start_ns, step.start_ns)},
                      {"end", ms_since(step.optimizer->end_ns, step.start_ns)}});
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
  // end (the prefetch brings it back before its use op).
  ordered_json lives = checkpoints_json(spans, plan, engine.costs(), stage_name);
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
  ordered_json measured = measured_json(step);
  measured["pinned"]["limit_bytes"] = mem.pinned_limit_bytes;
  measured["report_peak_bytes"] = mem.peak_bytes;
  const size_t baseline = mem.model_state_bytes + engine.run_options().batch_bytes;
  return {{"format", "porter-memory-page"},
          {"version", kFormatVersion},
          {"kind", "train"},
          {"title", "porter train " + config_file + ": step " + std::to_string(step.step)},
          {"config", config_file},
          {"description", plan.description},
          {"device", engine.device().description()},
          {"step", step.step},
          {"micro_batches", engine.run_options().gradient_accumulation_steps},
          {"time_unit", "ms"},
          {"duration", ms_since(step.end_ns, step.start_ns)},
          {"capacity_bytes", mem.capacity_bytes > 0 ? ordered_json(mem.capacity_bytes)
                                                    : ordered_json()},
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
          {"copies", std::move(copies)}};
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
  return {{"format", "porter-memory-page"},
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
          {"copies", ordered_json::array()}};
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
