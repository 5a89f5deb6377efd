// The simulator: the stash's bytes of a schedule's host and partitioned holds, handed to the
// replay of checkpoint/schedule.h (Note [One replay]), and the timing of their copies and
// gathers.
#include "checkpoint/simulate.h"

#include <algorithm>

#include "base/check.h"
#include "checkpoint/param_gather.h"

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
//
// Note [Partition timing]
// A partitioned entry's copies (host slices only) are timed as above with its slice's bytes
// (host_bytes). Its gather is issued at the start of prefetch_op, after the entry's H2D copy
// when there is one: it starts at max(T there, that copy's end, the tp comm stream free) and
// lasts (t - 1) x slice_bytes / tp link (a ring all-gather moves t - 1 blocks over each
// rank's link: the gathered bytes x (t - 1) / t). Gathers run one at a time in issue order;
// the tp stream carries nothing else in this model (the model's own tensor-parallel
// collectives are not charged here). At the start of use_op the compute stream first waits
// for the H2D copy as above (exposed_s), then max(0, gather end - T) more, which is added to
// T, to gather_exposed_s and to gather_exposed_by_stage[stage]. An unknown link makes its
// transfers take no time.
struct Clocks {
  double link = 0.0;  // 0: copies take no time
  double tp = 0.0;    // 0: gathers take no time
};

void time_transfers(const Schedule& schedule, const OffloadLayout& layout,
                    const std::vector<double>& op_s, const Clocks& clocks,
                    OffloadPrediction& out) {
  const size_t m = layout.entries.size();
  std::vector<double> d2h_end(m, 0.0), h2d_end(m, 0.0), gather_end(m, 0.0);
  // Issue order at one op: by use (the order layout_offload assigns prefetches in).
  std::vector<size_t> by_use;
  for (size_t e = 0; e < m; ++e)
    if (layout.entries[e].use_op >= 0) by_use.push_back(e);
  std::sort(by_use.begin(), by_use.end(), [&](size_t a, size_t b) {
    return layout.entries[a].use_op < layout.entries[b].use_op;
  });
  auto copy_s = [&](const StashEntry& s) {
    return clocks.link > 0.0 ? static_cast<double>(layout.host_bytes(s)) / clocks.link : 0.0;
  };
  auto gather_s = [&](const StashEntry& s) {
    const double bytes = static_cast<double>(layout.ways - 1) * static_cast<double>(s.slice_bytes);
    return clocks.tp > 0.0 ? bytes / clocks.tp : 0.0;
  };
  double t = 0.0, d2h_free = 0.0, h2d_free = 0.0, tp_free = 0.0;
  for (size_t k = 0; k < schedule.ops.size(); ++k) {
    const int op = static_cast<int>(k);
    for (size_t e : by_use) {
      const StashEntry& s = layout.entries[e];
      if (s.prefetch_op != op) continue;
      double ready = t;
      if (s.on_host) {
        const double c = copy_s(s);
        const double start = std::max({t, d2h_end[e], h2d_free});
        h2d_end[e] = h2d_free = start + c;
        out.copy_busy_s += c;
        ready = h2d_end[e];
      }
      if (s.partitioned) {
        const double g = gather_s(s);
        const double start = std::max(ready, tp_free);
        gather_end[e] = tp_free = start + g;
        out.gather_busy_s += g;
      }
    }
    for (size_t e : by_use) {
      const StashEntry& s = layout.entries[e];
      if (s.use_op != op) continue;
      const auto stage = static_cast<size_t>(s.stage);
      if (s.on_host) {
        const double wait = std::max(0.0, h2d_end[e] - t);
        t += wait;
        out.exposed_s += wait;
        if (out.timed) out.exposed_by_stage[stage] += wait;
      }
      if (s.partitioned) {
        const double wait = std::max(0.0, gather_end[e] - t);
        t += wait;
        out.gather_exposed_s += wait;
        if (out.gather_timed) out.gather_exposed_by_stage[stage] += wait;
      }
    }
    for (size_t e = 0; e < m; ++e) {
      const StashEntry& s = layout.entries[e];
      if (s.hold_op != op || !s.on_host) continue;
      const double c = copy_s(s);
      const double start = std::max(t, d2h_free);
      d2h_end[e] = d2h_free = start + c;
      out.copy_busy_s += c;
    }
    t += op_s[k];
  }
}

void check_link(double link_bytes_per_s, double tp_bytes_per_s) {
  PORTER_CHECK(link_bytes_per_s >= 0.0, "simulate: link bandwidth ", link_bytes_per_s,
               " B/s must be >= 0 (porter.device.sim_link_gbps)");
  PORTER_CHECK(tp_bytes_per_s >= 0.0, "simulate: tensor-parallel link bandwidth ", tp_bytes_per_s,
               " B/s must be >= 0 (porter.comm.sim_tp_gbps)");
}

size_t count_stashed_holds(const Schedule& schedule) {
  return static_cast<size_t>(std::count_if(schedule.ops.begin(), schedule.ops.end(),
                                           [](const ScheduleOp& op) { return op.stashed(); }));
}

// A layout belongs to a schedule when its entries are the schedule's host and partitioned
// holds, one each, placed as the ops say.
void check_layout(const Schedule& schedule, const OffloadLayout& layout) {
  const size_t holds = count_stashed_holds(schedule);
  bool same = holds == layout.entries.size() && layout.ways >= 1;
  for (const StashEntry& e : layout.entries) {
    if (!(e.hold_op >= 0 && static_cast<size_t>(e.hold_op) < schedule.ops.size())) {
      same = false;
      continue;
    }
    const ScheduleOp& op = schedule.ops[static_cast<size_t>(e.hold_op)];
    same = same && op.stashed() && op.stage == e.stage && op.offload == e.on_host &&
           op.partition == e.partitioned &&
           e.slice_bytes == (e.partitioned ? partition_slice_bytes(e.bytes, layout.ways) : 0);
  }
  const bool any_partition = std::any_of(schedule.ops.begin(), schedule.ops.end(),
                                         [](const ScheduleOp& op) { return op.partition; });
  PORTER_CHECK(same, "simulate: the offload layout has ", layout.entries.size(),
               " entries that are not the schedule's ", holds,
               any_partition ? " host and partitioned holds (" : " host holds (",
               schedule.to_string(), "); build it with layout_offload(schedule, costs, ...)");
}

}  // namespace

Prediction simulate(const Schedule& schedule, const ChainCosts& costs, const OffloadLayout& layout,
                    double link_bytes_per_s, double tp_bytes_per_s) {
  check_link(link_bytes_per_s, tp_bytes_per_s);
  check_layout(schedule, layout);
  const bool timed = costs.has_times() && link_bytes_per_s > 0.0;
  const bool gather_timed = costs.has_times() && tp_bytes_per_s > 0.0;
  const auto n = static_cast<size_t>(schedule.num_stages);
  auto mark_timed = [&](OffloadPrediction& o) {
    o.timed = timed;
    o.gather_timed = gather_timed;
    if (timed) o.exposed_by_stage.assign(n, 0.0);
    if (gather_timed) o.gather_exposed_by_stage.assign(n, 0.0);
  };
  // ZeRO stage 3: each gathered buffer from just before its issue op to just after its
  // release op (Note [Gather plan]).
  const GatherPlan gathers = plan_gathers(schedule, costs.params);
  auto add_params = [&](Staging& staging, Prediction* p) {
    if (p == nullptr) {
      for (const GatherWindow& w : gathers.windows) {
        StagingWindow sw{w.first_op, w.last_op, costs.params.units[static_cast<size_t>(w.unit)].bytes};
        sw.params = true;
        staging.windows.push_back(sw);
      }
      return;
    }
    p->params.peak_live_elems = gathers.peak_live_elems;
    p->params.gathers = gathers.gathers;
    p->params.gathered_bytes = gathers.gathered_bytes;
    p->params.persistent_bytes = costs.params.enabled ? costs.params.persistent_bytes() : 0;
    if (p->peak_budget_bytes < p->peak_activation_bytes) p->peak_budget_bytes = p->peak_activation_bytes;
  };
  if (layout.empty()) {
    Staging staging;
    add_params(staging, nullptr);
    Prediction p = replay(schedule, costs, staging);
    add_params(staging, &p);
    mark_timed(p.offload);
    return p;
  }
  // Note [Offload semantics], Note [Partition semantics]: a read-back entry's staged copy is
  // there from just before its prefetch op to just after its release op, a device slice from
  // just before its hold op until fetch() at its use op (after its release op when never
  // read); the contiguous arenas are there throughout.
  Staging staging;
  if (layout.contiguous) {
    staging.arena_bytes = layout.staging_arena_bytes();
    staging.slice_arena_bytes = layout.slice_arena_bytes();
  } else {
    for (const StashEntry& e : layout.entries) {
      if (e.prefetch_op >= 0) staging.windows.push_back({e.prefetch_op, e.release_op, layout.staged_bytes(e)});
      if (e.partitioned && !e.on_host) {
        if (e.use_op >= 0) {
          staging.windows.push_back({e.hold_op, e.use_op, e.slice_bytes, true, true});
        } else {
          staging.windows.push_back({e.hold_op, e.release_op, e.slice_bytes, true, false});
        }
      }
    }
  }
  add_params(staging, nullptr);
  std::vector<double> op_s;
  Prediction p = replay(schedule, costs, staging, &op_s);
  add_params(staging, &p);
  p.offload.d2h_bytes = layout.offloaded_bytes;
  for (const StashEntry& e : layout.entries) {
    if (e.use_op < 0) continue;
    if (e.on_host) p.offload.h2d_bytes += layout.host_bytes(e);
    if (e.partitioned) {
      ++p.offload.gathers;
      p.offload.gathered_bytes += static_cast<size_t>(layout.ways - 1) * e.slice_bytes;
    }
  }
  p.offload.pinned_bytes = layout.pinned_bytes;
  mark_timed(p.offload);
  if (timed || gather_timed) {
    const Clocks clocks{timed ? link_bytes_per_s : 0.0, gather_timed ? tp_bytes_per_s : 0.0};
    time_transfers(schedule, layout, op_s, clocks, p.offload);
  }
  return p;
}

Prediction simulate(const Schedule& schedule, const ChainCosts& costs, const SimOptions& options) {
  PORTER_CHECK(options.prefetch_depth >= 0, "porter.checkpointing.prefetch_depth = ",
               options.prefetch_depth, " must be >= 0");
  check_link(options.link_bytes_per_s, options.tp_bytes_per_s);
  const OffloadLayout layout =
      count_stashed_holds(schedule) == 0
          ? OffloadLayout{}
          : layout_offload(schedule, costs, options.prefetch_depth, false, options.partition_ways);
  return simulate(schedule, costs, layout, options.link_bytes_per_s, options.tp_bytes_per_s);
}

}  // namespace porter::checkpoint
