// The simulator: the staging of a schedule's host holds, handed to the replay of
// checkpoint/schedule.h (Note [One replay]), and the timing of their copies.
#include "checkpoint/simulate.h"

#include <algorithm>

#include "base/check.h"

namespace porter::checkpoint {

namespace {

// Note [Offload timing]
// The copy timing model of simulate() (docs/offload.md). A compute clock T advances by each
// op's compute time. An entry's D2H copy starts at max(T at the start of hold_op, the D2H
// stream free) and lasts bytes / link; its H2D copy is issued at the start of prefetch_op and
// starts at max(T there, its D2H end, the H2D stream free), lasting bytes / link. At the
// start of use_op the compute stream waits max(0, H2D end - T): the wait is added to T, to
// exposed_s and to exposed_by_stage[stage]. Copies of one direction run one at a time, in
// issue order; the two directions overlap each other and the compute.
void time_copies(const Schedule& schedule, const OffloadLayout& layout,
                 const std::vector<double>& op_s, double link, int n, OffloadPrediction& out) {
  out.timed = true;
  out.exposed_by_stage.assign(static_cast<size_t>(n), 0.0);
  std::vector<double> d2h_end(layout.entries.size(), 0.0), h2d_end(layout.entries.size(), 0.0);
  // H2D issue order at one op: by use (the order layout_offload assigns prefetches in).
  std::vector<size_t> by_use;
  for (size_t e = 0; e < layout.entries.size(); ++e)
    if (layout.entries[e].use_op >= 0) by_use.push_back(e);
  std::sort(by_use.begin(), by_use.end(), [&](size_t a, size_t b) {
    return layout.entries[a].use_op < layout.entries[b].use_op;
  });
  double t = 0.0, d2h_free = 0.0, h2d_free = 0.0;
  for (size_t k = 0; k < schedule.ops.size(); ++k) {
    const int op = static_cast<int>(k);
    for (size_t e : by_use) {
      const StashEntry& s = layout.entries[e];
      if (s.prefetch_op != op) continue;
      const double c = static_cast<double>(s.bytes) / link;
      const double start = std::max({t, d2h_end[e], h2d_free});
      h2d_end[e] = h2d_free = start + c;
      out.copy_busy_s += c;
    }
    for (size_t e : by_use) {
      const StashEntry& s = layout.entries[e];
      if (s.use_op != op) continue;
      const double wait = std::max(0.0, h2d_end[e] - t);
      t += wait;
      out.exposed_s += wait;
      out.exposed_by_stage[static_cast<size_t>(s.stage)] += wait;
    }
    for (size_t e = 0; e < layout.entries.size(); ++e) {
      const StashEntry& s = layout.entries[e];
      if (s.hold_op != op) continue;
      const double c = static_cast<double>(s.bytes) / link;
      const double start = std::max(t, d2h_free);
      d2h_end[e] = d2h_free = start + c;
      out.copy_busy_s += c;
    }
    t += op_s[k];
  }
}

void check_link(double link_bytes_per_s) {
  PORTER_CHECK(link_bytes_per_s >= 0.0, "simulate: link bandwidth ", link_bytes_per_s,
               " B/s must be >= 0 (porter.device.sim_link_gbps)");
}

size_t count_host_holds(const Schedule& schedule) {
  return static_cast<size_t>(std::count_if(schedule.ops.begin(), schedule.ops.end(),
                                           [](const ScheduleOp& op) { return op.offload; }));
}

// A layout belongs to a schedule when its entries are the schedule's host holds, one each.
void check_layout(const Schedule& schedule, const OffloadLayout& layout) {
  const size_t holds = count_host_holds(schedule);
  bool same = holds == layout.entries.size();
  for (const StashEntry& e : layout.entries) {
    same = same && e.hold_op >= 0 && static_cast<size_t>(e.hold_op) < schedule.ops.size() &&
           schedule.ops[static_cast<size_t>(e.hold_op)].offload &&
           schedule.ops[static_cast<size_t>(e.hold_op)].stage == e.stage;
  }
  PORTER_CHECK(same, "simulate: the offload layout has ", layout.entries.size(),
               " entries that are not the schedule's ", holds, " host holds (",
               schedule.to_string(), "); build it with layout_offload(schedule, costs, ...)");
}

}  // namespace

Prediction simulate(const Schedule& schedule, const ChainCosts& costs, const OffloadLayout& layout,
                    double link_bytes_per_s) {
  check_link(link_bytes_per_s);
  check_layout(schedule, layout);
  const bool timed = costs.has_times() && link_bytes_per_s > 0.0;
  if (layout.empty()) {
    Prediction p = replay(schedule, costs);
    if (timed) {
      p.offload.timed = true;
      p.offload.exposed_by_stage.assign(static_cast<size_t>(schedule.num_stages), 0.0);
    }
    return p;
  }
  // Note [Offload semantics]: a read-back entry is staged from just before its prefetch op to
  // just after its release op; the contiguous arena is there throughout.
  Staging staging;
  if (layout.contiguous) {
    staging.arena_bytes = layout.staging_arena_bytes();
  } else {
    for (const StashEntry& e : layout.entries)
      if (e.prefetch_op >= 0) staging.windows.push_back({e.prefetch_op, e.release_op, e.bytes});
  }
  std::vector<double> op_s;
  Prediction p = replay(schedule, costs, staging, &op_s);
  p.offload.d2h_bytes = layout.offloaded_bytes;
  for (const StashEntry& e : layout.entries) p.offload.h2d_bytes += e.use_op >= 0 ? e.bytes : 0;
  p.offload.pinned_bytes = layout.pinned_bytes;
  if (timed) time_copies(schedule, layout, op_s, link_bytes_per_s, schedule.num_stages, p.offload);
  return p;
}

Prediction simulate(const Schedule& schedule, const ChainCosts& costs, const SimOptions& options) {
  PORTER_CHECK(options.prefetch_depth >= 0, "porter.checkpointing.prefetch_depth = ",
               options.prefetch_depth, " must be >= 0");
  check_link(options.link_bytes_per_s);
  const OffloadLayout layout = count_host_holds(schedule) == 0
                                   ? OffloadLayout{}
                                   : layout_offload(schedule, costs, options.prefetch_depth);
  return simulate(schedule, costs, layout, options.link_bytes_per_s);
}

}  // namespace porter::checkpoint
