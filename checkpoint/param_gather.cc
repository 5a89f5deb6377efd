// The gather plan of ZeRO stage 3 (Note [Gather plan] in param_gather.h).
#include "checkpoint/param_gather.h"

#include <algorithm>
#include <limits>
#include <string>
#include <vector>

#include "base/error.h"

namespace porter::checkpoint {

namespace {

constexpr int kNever = std::numeric_limits<int>::max();

}  // namespace

GatherPlan plan_gathers(const Schedule& schedule, const ParamGather& params) {
  GatherPlan plan;
  if (!params.enabled) return plan;
  const int n = schedule.num_stages;
  const auto num_units = static_cast<int>(params.units.size());
  if (num_units != n || static_cast<int>(params.reads.size()) != n) {
    throw InvalidArgument("gather plan: " + std::to_string(num_units) + " gather units and " +
                          std::to_string(params.reads.size()) + " read lists for a schedule of " +
                          std::to_string(n) + " stages (one of each per stage)");
  }
  const size_t m = schedule.ops.size();
  plan.evict.assign(m, {});
  plan.issue.assign(m, {});
  plan.wait.assign(m, {});
  plan.release.assign(m, {});

  // R_k, and each unit's reads in op order.
  std::vector<std::vector<int>> reads(m);
  std::vector<std::vector<int>> read_ops(static_cast<size_t>(num_units));
  for (size_t k = 0; k < m; ++k) {
    const int s = schedule.ops[k].stage;
    if (s < 0 || s >= n) continue;  // validate() names it
    int64_t elems = 0;
    for (int u : params.reads[static_cast<size_t>(s)]) {
      if (u < 0 || u >= num_units) {
        throw InvalidArgument("gather plan: stage " + std::to_string(s) + " reads unit " +
                              std::to_string(u) + " of " + std::to_string(num_units));
      }
      const GatherUnit& unit = params.units[static_cast<size_t>(u)];
      if (unit.persistent || unit.elems == 0) continue;
      if (std::find(reads[k].begin(), reads[k].end(), u) != reads[k].end()) continue;
      reads[k].push_back(u);
      read_ops[static_cast<size_t>(u)].push_back(static_cast<int>(k));
      elems += unit.elems;
    }
    if (elems > params.max_live_elems) {
      throw InvalidArgument(
          "zero_optimization.stage3_max_live_parameters is " +
          std::to_string(params.max_live_elems) + " elements, but stage '" +
          params.units[static_cast<size_t>(s)].name + "' needs " + std::to_string(elems) +
          " gathered at once (its parameters" +
          (reads[k].size() > 1 ? std::string(" and those it shares with other stages") : "") +
          "); raise it to at least " + std::to_string(elems));
    }
  }
  // The first op after `k` that reads `u` (kNever: none).
  auto next_read = [&](int u, int k) {
    const std::vector<int>& ops = read_ops[static_cast<size_t>(u)];
    const auto it = std::upper_bound(ops.begin(), ops.end(), k);
    return it == ops.end() ? kNever : *it;
  };
  auto elems_of = [&](int u) { return params.units[static_cast<size_t>(u)].elems; };

  // Note [Reuse distance offline]: whether a unit read at op k stays gathered until its next
  // read depends only on the reads, so every (op, unit) pair's distance (the elements of the
  // distinct other units read strictly between the two reads) is summed in one sweep with a
  // Fenwick tree over op positions, each unit counted at its latest read: O(reads log ops)
  // instead of a walk over the ops between each pair.
  std::vector<std::vector<bool>> keep_after(m);
  {
    struct Query {
      int lo, hi;  // ops lo..hi, inclusive
      size_t op, slot;
    };
    std::vector<std::vector<Query>> by_hi(m);
    for (size_t k = 0; k < m; ++k) {
      keep_after[k].assign(reads[k].size(), false);
      for (size_t i = 0; i < reads[k].size(); ++i) {
        const int nr = next_read(reads[k][i], static_cast<int>(k));
        if (nr == kNever) continue;
        if (nr == static_cast<int>(k) + 1) {
          keep_after[k][i] = 0 <= params.max_reuse_distance;
          continue;
        }
        by_hi[static_cast<size_t>(nr - 1)].push_back({static_cast<int>(k) + 1, nr - 1, k, i});
      }
    }
    std::vector<int64_t> tree(m + 1, 0);
    auto tree_add = [&](size_t pos, int64_t v) {
      for (size_t x = pos + 1; x <= m; x += x & (~x + 1)) tree[x] += v;
    };
    auto tree_sum = [&](size_t end) {  // positions [0, end)
      int64_t total = 0;
      for (size_t x = end; x > 0; x -= x & (~x + 1)) total += tree[x];
      return total;
    };
    std::vector<int> last(static_cast<size_t>(num_units), -1);
    for (size_t j = 0; j < m; ++j) {
      for (int v : reads[j]) {
        int& l = last[static_cast<size_t>(v)];
        if (l >= 0) tree_add(static_cast<size_t>(l), -elems_of(v));
        tree_add(j, elems_of(v));
        l = static_cast<int>(j);
      }
      for (const Query& q : by_hi[j]) {
        const int64_t distance = tree_sum(static_cast<size_t>(q.hi) + 1) - tree_sum(static_cast<size_t>(q.lo));
        keep_after[q.op][q.slot] = distance <= params.max_reuse_distance;
      }
    }
  }

  std::vector<int> issued_at(static_cast<size_t>(num_units), -1);  // live when >= 0
  std::vector<bool> waited(static_cast<size_t>(num_units), false);
  int64_t live = 0;   // elements gathered or in flight
  size_t live_bytes = 0;  // their bytes
  int64_t ahead = 0;  // prefetched, not yet waited for
  auto is_live = [&](int u) { return issued_at[static_cast<size_t>(u)] >= 0; };
  auto issue = [&](int u, int k, bool prefetch) {
    issued_at[static_cast<size_t>(u)] = k;
    waited[static_cast<size_t>(u)] = false;
    live += elems_of(u);
    live_bytes += params.units[static_cast<size_t>(u)].bytes;
    if (prefetch) ahead += elems_of(u);
    plan.issue[static_cast<size_t>(k)].push_back(u);
    ++plan.gathers;
    plan.gathered_bytes += params.units[static_cast<size_t>(u)].bytes;
  };
  auto free = [&](int u, int last_op) {
    plan.windows.push_back({u, issued_at[static_cast<size_t>(u)], last_op});
    live -= elems_of(u);
    live_bytes -= params.units[static_cast<size_t>(u)].bytes;
    if (!waited[static_cast<size_t>(u)]) ahead -= elems_of(u);
    issued_at[static_cast<size_t>(u)] = -1;
    waited[static_cast<size_t>(u)] = false;
  };
  auto in = [](const std::vector<int>& v, int u) {
    return std::find(v.begin(), v.end(), u) != v.end();
  };

  for (size_t kk = 0; kk < m; ++kk) {
    const int k = static_cast<int>(kk);
    const std::vector<int>& r = reads[kk];
    // 1. Room for this op's missing units.
    int64_t need = 0;
    for (int u : r) need += is_live(u) ? 0 : elems_of(u);
    while (live + need > params.max_live_elems) {
      int victim = -1, victim_next = -1;
      for (int u = 0; u < num_units; ++u) {
        if (!is_live(u) || in(r, u)) continue;
        const int nr = next_read(u, k - 1);
        if (nr > victim_next) {
          victim = u;
          victim_next = nr;
        }
      }
      if (victim < 0) break;  // cannot happen: the op's reads fit on their own (checked above)
      plan.evict[kk].push_back(victim);
      free(victim, k - 1);
    }
    // 2. Gathers of what this op reads.
    for (int u : r) {
      if (!is_live(u)) issue(u, k, false);
    }
    // This op's units are read now: a prefetch of them no longer counts as ahead.
    for (int u : r) {
      if (!waited[static_cast<size_t>(u)] && issued_at[static_cast<size_t>(u)] < k) {
        ahead -= elems_of(u);
      }
    }
    // 3. Prefetches, in read order.
    bool stop = false;
    for (size_t j = kk + 1; j < m && !stop; ++j) {
      for (int u : reads[j]) {
        if (is_live(u)) continue;
        if (ahead + elems_of(u) > params.prefetch_elems || live + elems_of(u) > params.max_live_elems) {
          stop = true;
          break;
        }
        issue(u, k, true);
      }
    }
    // 4. Waits.
    for (int u : r) {
      if (waited[static_cast<size_t>(u)]) continue;
      waited[static_cast<size_t>(u)] = true;
      plan.wait[kk].push_back(u);
    }
    if (live > plan.peak_live_elems) plan.peak_live_elems = live;
    plan.peak_live_bytes = std::max(plan.peak_live_bytes, live_bytes);
    // After the op: free what is not read again soon (Note [Reuse distance offline]).
    for (size_t i = 0; i < r.size(); ++i) {
      const int u = r[i];
      if (!keep_after[kk][i]) {
        plan.release[kk].push_back(u);
        free(u, k);
      }
    }
  }
  // Every unit's last read released it (next_read is kNever there), and prefetches are only
  // of units read later.
  for (int u = 0; u < num_units; ++u) {
    if (is_live(u)) {
      throw InternalError("gather plan: unit " + std::to_string(u) + " is still live after the last op");
    }
  }
  return plan;
}

}  // namespace porter::checkpoint
