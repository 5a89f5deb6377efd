// The standard checkpoint policies as schedules, the per-stage summary, budgets, the searches
// around the Rotor/Rockmate program (Note [Plan search]; one solve is rotor.cc's), and
// make_plan, which picks a policy's schedule and predicts it (Note [Policies] in planner.h).
#include "checkpoint/planner.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <string_view>
#include <unordered_map>

#include "base/check.h"
#include "base/checked.h"
#include "base/error.h"
#include "base/units.h"

namespace porter::checkpoint {

namespace {

using Kind = ScheduleOp::Kind;

// A run of stages compiled together (Note [Policies]):
//   kKeep        one stage, saved in full;
//   kSegment     stages [s, e): the first input held, every forward keeps nothing; before
//                the backwards the segment is re-forwarded with kKeep up to e-2 and e-1 is
//                recomputed from `cur` (a one-stage segment is "hold, recompute");
//   kSelective   one stage, forwarded kSelective with its input held, recomputed.
struct Segment {
  enum class Type : uint8_t { kKeep, kSegment, kSelective };
  Type type;
  int begin;
  int end;
};

Schedule compile(int n, const std::vector<Segment>& segments) {
  Schedule s;
  s.num_stages = n;
  auto& ops = s.ops;
  for (const Segment& g : segments) {
    switch (g.type) {
      case Segment::Type::kKeep: ops.push_back(ScheduleOp::forward(g.begin, SaveOption::kKeep, false)); break;
      case Segment::Type::kSelective:
        ops.push_back(ScheduleOp::forward(g.begin, SaveOption::kSelective, true));
        break;
      case Segment::Type::kSegment:
        for (int i = g.begin; i < g.end; ++i)
          ops.push_back(ScheduleOp::forward(i, SaveOption::kCheckpoint, i == g.begin));
        break;
    }
  }
  for (auto it = segments.rbegin(); it != segments.rend(); ++it) {
    const Segment& g = *it;
    if (g.type == Segment::Type::kSegment) {
      for (int i = g.begin; i + 1 < g.end; ++i) ops.push_back(ScheduleOp::forward(i, SaveOption::kKeep, false));
    }
    if (g.type != Segment::Type::kKeep) ops.push_back(ScheduleOp::recompute(g.end - 1));
    for (int i = g.end - 1; i >= g.begin; --i) ops.push_back(ScheduleOp::backward(i));
  }
  return s;
}

int count_blocks(const ChainCosts& costs) {
  int b = 0;
  for (const StageCost& s : costs.stages) b += s.is_block ? 1 : 0;
  return b;
}

// Blocks in segments of `per` consecutive blocks (at most `limit` blocks checkpointed, the
// rest keep); non-block stages keep.
std::vector<Segment> block_segments(const ChainCosts& costs, int per, int limit) {
  std::vector<Segment> out;
  const int n = costs.num_stages();
  int done = 0;
  for (int i = 0; i < n;) {
    if (!costs.stages[i].is_block || done >= limit) {
      out.push_back({Segment::Type::kKeep, i, i + 1});
      ++i;
      continue;
    }
    int e = i;
    while (e < n && e - i < per && done < limit && costs.stages[e].is_block) {
      ++e;
      ++done;
    }
    out.push_back({Segment::Type::kSegment, i, e});
    i = e;
  }
  return out;
}

// The objective the planner minimises: time when the costs have times (with the exposed copy
// and gather time when they are known), else recompute FLOPs.
double objective(const Prediction& p, const ChainCosts& costs) {
  return costs.has_times() ? p.compute_s + p.offload.exposed_s + p.offload.gather_exposed_s
                           : p.recompute_flops;
}

// Whether `a` is a better plan than `b` (both fit): a lower objective; on a tie, fewer bytes
// copied to the host (copies cost time the model may not see), then a lower peak.
bool better(const Prediction& a, const Prediction& b, const ChainCosts& costs) {
  const double oa = objective(a, costs), ob = objective(b, costs);
  if (oa != ob) return oa < ob;
  if (a.offload.d2h_bytes != b.offload.d2h_bytes) return a.offload.d2h_bytes < b.offload.d2h_bytes;
  return a.peak_budget_bytes < b.peak_budget_bytes;
}

const char* kBudgetKey = "porter.checkpointing.memory_budget";

// What simulate() assumes for a plan besides its layout: the offload options (without offload
// only the link, for OffloadPrediction::timed) and the partition's ways and tp link.
SimOptions sim_options(const OffloadOptions& offload, const PartitionOptions& partition) {
  SimOptions s;
  if (offload.enabled || partition.enabled()) s = offload.sim();
  s.link_bytes_per_s = offload.link_bytes_per_s;
  s.partition_ways = partition.ways;
  s.tp_bytes_per_s = partition.tp_bytes_per_s;
  return s;
}

bool has_stashed_holds(const Schedule& schedule) {
  return std::any_of(schedule.ops.begin(), schedule.ops.end(),
                     [](const ScheduleOp& op) { return op.stashed(); });
}

struct Candidate {
  std::string description;
  Schedule schedule;
  Prediction prediction;
};

size_t schedule_hash(const Schedule& s) {
  size_t h = std::hash<int>()(s.num_stages);
  for (const ScheduleOp& op : s.ops) {
    const size_t v = static_cast<size_t>(op.stage) << 8 | static_cast<size_t>(op.kind) << 4 |
                     static_cast<size_t>(op.save) << 3 | (op.hold_input ? 4u : 0u) |
                     (op.offload ? 2u : 0u) | (op.partition ? 1u : 0u);
    h ^= v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
  }
  return h;
}

// Every standard schedule the optimal planner compares with, simulated. With offload, each
// also with its holds placed on the host (place_offload, keeping the last 0, 1, 2 and the
// configured number on device); with partitioning, each of those also partitioned
// (place_partition).
std::vector<Candidate> standard_candidates(const ChainCosts& costs, const OffloadOptions& offload,
                                           const PartitionOptions& partition) {
  std::vector<Candidate> out;
  // A schedule is compared only with those of its hash: the candidates grow with the blocks
  // (uniform and block at every count), so a scan of all of them per push was quadratic.
  std::unordered_multimap<size_t, size_t> seen;  // schedule hash -> index in out
  auto push = [&](std::string d, Schedule s) {
    const size_t h = schedule_hash(s);
    const auto [lo, hi] = seen.equal_range(h);
    for (auto it = lo; it != hi; ++it)
      if (out[it->second].schedule == s) return;
    Prediction p = predict(s, costs, offload, partition);
    // The comparison reads the objective and the peaks only; the per-op curves of thousands
    // of candidates would hold memory quadratic in the stages.
    p.footprint_after_op = {};
    p.peak_total_during_op = {};
    seen.emplace(h, out.size());
    out.push_back({std::move(d), std::move(s), std::move(p)});
  };
  auto push_partitioned = [&](const std::string& d, const Schedule& s) {
    if (!partition.enabled()) return;
    Schedule q = s;
    place_partition(q, costs, partition);
    if (q != s) push(d + ", partitioned " + std::to_string(partition.ways) + " ways", std::move(q));
  };
  auto add = [&](std::string d, Schedule s) {
    // A policy that needs an option some stage lacks (full and sqrt checkpoint every stage)
    // is no candidate.
    for (const ScheduleOp& op : s.ops)
      if (op.kind == Kind::kForward && !costs.stages[op.stage].option(op.save).available) return;
    if (offload.enabled) {
      std::vector<int> keeps = {0, 1, 2, offload.keep_last_on_device};
      std::sort(keeps.begin(), keeps.end());
      keeps.erase(std::unique(keeps.begin(), keeps.end()), keeps.end());
      for (int keep : keeps) {
        Schedule h = s;
        place_offload(h, costs, keep);
        if (h == s) continue;
        const std::string hd = d + ", host holds but the last " + std::to_string(keep);
        push_partitioned(hd, h);
        push(hd, std::move(h));
      }
    }
    push_partitioned(d, s);
    push(std::move(d), std::move(s));
  };
  add("none", schedule_none(costs));
  add("full", schedule_full(costs));
  const int blocks = count_blocks(costs);
  for (int per = 1; per <= blocks; ++per) add("uniform, " + std::to_string(per) + " blocks per segment", schedule_uniform(costs, per));
  for (int b = 1; b < blocks; ++b) add("block, first " + std::to_string(b) + " blocks", schedule_block(costs, b));
  add("sqrt", schedule_sqrt(costs));
  bool any_selective = false;
  for (const StageCost& s : costs.stages)
    any_selective |= s.is_block && s.option(SaveOption::kSelective).available;
  if (any_selective) add("selective", schedule_selective(costs));
  return out;
}

std::string policy_key(const char* key) { return std::string("porter.checkpointing.") + key; }

}  // namespace

std::string_view where_name(Where w) {
  switch (w) {
    case Where::kDevice: return "device";
    case Where::kPartitioned: return "partitioned";
    case Where::kHost: return "host";
  }
  return "?";
}

nn::OpPolicy selective_policy(const std::vector<std::string>& selective_ops) {
  if (selective_ops.empty()) return nn::OpPolicy::selective_attention();
  // The config names a GPT block's ops; the save context knows op kinds, so every linear
  // (qkv, proj, fc1, fc2) is one kind: naming any of them recomputes all four.
  std::vector<nn::OpKind> kinds;
  for (const std::string& op : selective_ops) {
    nn::OpKind k;
    if (op == "layernorm") k = nn::OpKind::kLayerNorm;
    else if (op == "qkv" || op == "proj" || op == "fc1" || op == "fc2") k = nn::OpKind::kMatmul;
    else if (op == "core_attention" || op == "attention") k = nn::OpKind::kAttention;
    else if (op == "gelu") k = nn::OpKind::kGelu;
    else if (op == "dropout") k = nn::OpKind::kDropout;
    else {
      std::string names;
      for (const std::string& s : config::selective_op_kinds()) names += (names.empty() ? "" : ", ") + s;
      throw InvalidArgument("porter.checkpointing.selective_ops: unknown op \"" + op + "\" (expected one of " +
                            names + ")");
    }
    kinds.push_back(k);
  }
  // OpPolicy takes a fixed list; repeating a kind is harmless.
  while (kinds.size() < 5) kinds.push_back(kinds.front());
  PORTER_ASSERT(kinds.size() <= 8, "selective_ops lists ", kinds.size(), " ops");
  while (kinds.size() < 8) kinds.push_back(kinds.front());
  return nn::OpPolicy::recompute_only(
      {kinds[0], kinds[1], kinds[2], kinds[3], kinds[4], kinds[5], kinds[6], kinds[7]});
}

Schedule schedule_none(const ChainCosts& costs) {
  std::vector<Segment> seg;
  for (int i = 0; i < costs.num_stages(); ++i) seg.push_back({Segment::Type::kKeep, i, i + 1});
  return compile(costs.num_stages(), seg);
}

Schedule schedule_full(const ChainCosts& costs) {
  std::vector<Segment> seg;
  for (int i = 0; i < costs.num_stages(); ++i) seg.push_back({Segment::Type::kSegment, i, i + 1});
  return compile(costs.num_stages(), seg);
}

Schedule schedule_uniform(const ChainCosts& costs, int blocks_per_segment) {
  PORTER_CHECK_GE(blocks_per_segment, 1, "uniform checkpointing: blocks per segment");
  return compile(costs.num_stages(), block_segments(costs, blocks_per_segment, count_blocks(costs)));
}

Schedule schedule_block(const ChainCosts& costs, int checkpointed_blocks) {
  PORTER_CHECK_GE(checkpointed_blocks, 0, "block checkpointing: checkpointed blocks");
  return compile(costs.num_stages(), block_segments(costs, 1, checkpointed_blocks));
}

Schedule schedule_sqrt(const ChainCosts& costs) {
  const int n = costs.num_stages();
  const int per = std::max(1, static_cast<int>(std::lround(std::sqrt(static_cast<double>(n)))));
  std::vector<Segment> seg;
  for (int i = 0; i < n; i += per) seg.push_back({Segment::Type::kSegment, i, std::min(n, i + per)});
  return compile(n, seg);
}

Schedule schedule_selective(const ChainCosts& costs) {
  std::vector<Segment> seg;
  for (int i = 0; i < costs.num_stages(); ++i) {
    const StageCost& s = costs.stages[i];
    const bool sel = s.is_block && s.option(SaveOption::kSelective).available;
    seg.push_back({sel ? Segment::Type::kSelective : Segment::Type::kKeep, i, i + 1});
  }
  return compile(costs.num_stages(), seg);
}

void place_partition(Schedule& schedule, const ChainCosts& costs, const PartitionOptions& partition) {
  PORTER_CHECK(partition.ways >= 1, "partition ways = ", partition.ways,
               " must be >= 1 (porter.model.tensor_parallel)");
  PORTER_CHECK_EQ(costs.num_stages(), schedule.num_stages, "place_partition: the costs' stages");
  std::vector<bool> held(static_cast<size_t>(schedule.num_stages), false);
  for (ScheduleOp& op : schedule.ops) {
    if (op.stage < 0 || op.stage >= schedule.num_stages) continue;  // validate() names it
    if (op.kind == Kind::kBackward) held[op.stage] = false;
    if (op.kind != Kind::kForward || !op.hold_input) continue;
    op.partition = partition.enabled() && !held[op.stage] && op.save != SaveOption::kKeep &&
                   partitionable(costs.stages[op.stage], op.stage, partition.min_bytes);
    held[op.stage] = true;
  }
}

void place_offload(Schedule& schedule, const ChainCosts& costs, int keep_last_on_device) {
  PORTER_CHECK(keep_last_on_device >= 0, "porter.checkpointing.keep_last_on_device = ", keep_last_on_device,
               " must be >= 0");
  PORTER_CHECK_EQ(costs.num_stages(), schedule.num_stages, "place_offload: the costs' stages");
  // The offloadable holds in op order (a stage held a second time while still held stays
  // where its first hold is).
  std::vector<size_t> holds;
  std::vector<bool> held(static_cast<size_t>(schedule.num_stages), false);
  for (size_t k = 0; k < schedule.ops.size(); ++k) {
    ScheduleOp& op = schedule.ops[k];
    if (op.stage < 0 || op.stage >= schedule.num_stages) continue;  // validate() names it
    if (op.kind == Kind::kBackward) held[op.stage] = false;
    if (op.kind != Kind::kForward || !op.hold_input) continue;
    op.offload = false;
    if (!held[op.stage] && op.save != SaveOption::kKeep && op.stage > 0 &&
        costs.stages[op.stage].input_bytes > 0) {
      holds.push_back(k);
    }
    held[op.stage] = true;
  }
  const size_t keep = std::min(holds.size(), static_cast<size_t>(keep_last_on_device));
  for (size_t h = 0; h + keep < holds.size(); ++h) schedule.ops[holds[h]].offload = true;
}

std::vector<StagePlan> summarize(const Schedule& schedule, const ChainCosts& costs,
                                 const Prediction* prediction) {
  std::vector<StagePlan> out(static_cast<size_t>(schedule.num_stages));
  std::vector<bool> seen(out.size(), false);
  for (StagePlan& p : out) p.forwards = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    out[i].name = i < costs.stages.size() ? costs.stages[i].name : "stage." + std::to_string(i);
  }
  for (const ScheduleOp& op : schedule.ops) {
    PORTER_CHECK(op.stage >= 0 && op.stage < schedule.num_stages, "summarize: op stage ", op.stage,
                 " outside the schedule's ", schedule.num_stages, " stages");
    StagePlan& p = out[op.stage];
    if (op.kind == Kind::kBackward) continue;
    ++p.forwards;
    if (op.kind != Kind::kForward) continue;
    if (!seen[op.stage]) p.action = std::string(save_option_name(op.save));
    seen[op.stage] = true;
    p.holds_input = p.holds_input || op.hold_input;
    if (op.offload) p.where = Where::kHost;
    else if (op.partition) p.where = Where::kPartitioned;
    p.partitioned = p.partitioned || op.partition;
  }
  if (prediction != nullptr && prediction->offload.timed) {
    const std::vector<double>& e = prediction->offload.exposed_by_stage;
    for (size_t i = 0; i < out.size() && i < e.size(); ++i) out[i].exposed_copy_s = e[i];
  }
  if (prediction != nullptr && prediction->offload.gather_timed) {
    const std::vector<double>& e = prediction->offload.gather_exposed_by_stage;
    for (size_t i = 0; i < out.size() && i < e.size(); ++i) out[i].exposed_gather_s = e[i];
  }
  return out;
}

size_t resolve_budget(const config::MemoryBudget& budget, const ChainCosts& costs) {
  if (!budget.is_fraction()) return static_cast<size_t>(std::get<uint64_t>(budget.value));
  const double f = std::get<double>(budget.value);
  if (!(f > 0.0 && f <= 1.0)) {
    throw InvalidArgument(std::string(kBudgetKey) + " = " + std::to_string(f) +
                          ": a fractional budget must be in (0, 1] (a fraction of the no-checkpointing "
                          "activation peak); give bytes (\"2GiB\") for more");
  }
  const size_t none = simulate(schedule_none(costs), costs).peak_budget_bytes;
  return static_cast<size_t>(std::floor(f * static_cast<double>(none)));
}

OffloadLayout plan_layout(const Schedule& schedule, const ChainCosts& costs,
                          const OffloadOptions& offload, const PartitionOptions& partition) {
  if (offload.enabled || has_stashed_holds(schedule)) {
    return layout_offload(schedule, costs, offload.prefetch_depth, offload.contiguous, partition.ways);
  }
  OffloadLayout none;
  none.contiguous = offload.contiguous;
  none.ways = partition.ways;
  return none;
}

Prediction predict(const Schedule& schedule, const ChainCosts& costs,
                   const OffloadOptions& offload, const PartitionOptions& partition) {
  if (!offload.enabled && !has_stashed_holds(schedule)) {
    return simulate(schedule, costs, sim_options(offload, partition));
  }
  return simulate(schedule, costs, plan_layout(schedule, costs, offload, partition),
                  offload.link_bytes_per_s, partition.tp_bytes_per_s);
}

// Note [Plan search]
// Every loop around the Rotor program (checkpoint/rotor.h solves once) is here:
//   reserve retries   schedule_rotor. With host or partitioned holds the program does not
//                     charge the staged copies alive ahead of their use (Note [Rotor
//                     recurrence] in rotor.cc), nor the moment at a partitioned hold's read
//                     when its slice and gathered copy are both there, so each result is
//                     simulated as the plan would run it (predict) and, over budget, solved
//                     again within the budget less a reserve: first none, then the overshoot
//                     measured, added up over four tries, then at least depth x the largest
//                     staged copy in staging slots (one slot more with contiguous staging:
//                     the arena's slot for the copy in use). After six tries, or when a
//                     reserve leaves nothing, the device-only program without partitioning,
//                     whose results the simulator always finds within the budget.
//   budget bisection  minimum_candidate (minimum_budget_bytes, and make_plan when nothing
//                     fits): a binary search on schedule_rotor's budget below the lowest
//                     standard peak. Feasibility is monotone in the budget up to the
//                     discretisation, so it stops at 0.1% precision.

namespace {

// Note [Plan progress]
// The optimal policy may solve the program many times (the reserve retries, the budget
// bisection), each a table filled in order. A caller that wants to show progress (porter plan
// and estimate print a line to stderr about every second) passes make_plan a function; it
// hears each solve's number and the fraction of its table filled. The library prints nothing.
struct Progress {
  const PlanProgressFn* fn = nullptr;  // not owned; null or empty: no reports
  int solves = 0;
  // The reporter of the next solve (empty without a function).
  std::function<void(double)> next_solve() {
    if (fn == nullptr || !*fn) return {};
    const int k = ++solves;
    const PlanProgressFn* f = fn;
    return [f, k](double fraction) { (*f)(PlanProgress{k, fraction}); };
  }
};

std::optional<Schedule> rotor_search(const ChainCosts& costs, size_t budget_bytes,
                                     const OffloadOptions& offload,
                                     const PartitionOptions& partition, Progress& progress) {
  PORTER_CHECK(costs.num_stages() >= 1, "schedule_rotor: the chain has no stages");
  PORTER_CHECK(partition.ways >= 1, "partition ways = ", partition.ways,
               " must be >= 1 (porter.model.tensor_parallel)");
  // Note [Plan search]: the reserve retries.
  // ZeRO stage 3's gathered parameters share the budget (Note [Gathered parameters]): the
  // program does not see them, so its result is simulated and solved again below the budget
  // less the overshoot, as for host and partitioned holds.
  if (offload.enabled || partition.enabled() || costs.params.enabled) {
    PORTER_CHECK(offload.prefetch_depth >= 0, "porter.checkpointing.prefetch_depth = ",
                 offload.prefetch_depth, " must be >= 0");
    size_t largest = 0;
    for (int j = 1; j < costs.num_stages(); ++j) {
      const StageCost& st = costs.stages[j];
      const bool part = partition.enabled() && partitionable(st, j, partition.min_bytes);
      largest = std::max(largest, part ? static_cast<size_t>(partition.ways) *
                                             partition_slice_bytes(st.input_bytes, partition.ways)
                                       : st.input_bytes);
    }
    const size_t slot = round_up(largest, kStagingSlotAlignment);
    size_t reserve =
        offload.enabled || partition.enabled()
            ? slot * (static_cast<size_t>(offload.prefetch_depth) + (offload.contiguous ? 1 : 0))
            : 0;
    if (costs.params.enabled) {
      // At least one op's own gathered units, and what prefetch adds beside them.
      size_t reads = 0;
      for (const std::vector<int>& r : costs.params.reads) {
        size_t b = 0;
        for (int u : r) b += costs.params.units[static_cast<size_t>(u)].persistent ? 0 : costs.params.units[static_cast<size_t>(u)].bytes;
        reads = std::max(reads, b);
      }
      reserve += 2 * reads;
    }
    RotorOptions options;
    options.host_holds = offload.enabled;
    options.prefetch_depth = offload.prefetch_depth;
    options.link_bytes_per_s = offload.link_bytes_per_s;
    options.partition_ways = partition.ways;
    options.partition_min_bytes = partition.min_bytes;
    options.tp_bytes_per_s = partition.tp_bytes_per_s;
    size_t r = 0;
    for (int attempt = 0; attempt < 6 && r < budget_bytes; ++attempt) {
      std::optional<Schedule> s = solve_rotor(costs, budget_bytes - r, options, progress.next_solve());
      if (!s) break;  // a larger reserve leaves less
      const size_t peak = predict(*s, costs, offload, partition).peak_budget_bytes;
      if (peak <= budget_bytes) return s;
      r = attempt < 4 ? r + (peak - budget_bytes) : std::max(r + (peak - budget_bytes), reserve);
    }
    if (costs.params.enabled) return std::nullopt;
  }
  std::optional<Schedule> s = solve_rotor(costs, budget_bytes, RotorOptions{}, progress.next_solve());
  if (s) {
    const Prediction p = simulate(*s, costs);
    PORTER_ASSERT(p.peak_activation_bytes <= budget_bytes, "rotor schedule ", s->to_string(),
                  " peaks at ", p.peak_activation_bytes, " bytes, over its budget of ",
                  budget_bytes);
  }
  return s;
}

// The schedule with the lowest simulated peak among the optimal planner's candidates (Note
// [Plan search]: the budget bisection).
Candidate minimum_candidate(const ChainCosts& costs, const OffloadOptions& offload,
                            const PartitionOptions& partition, Progress& progress) {
  std::vector<Candidate> all = standard_candidates(costs, offload, partition);
  auto lower = [](const Candidate& a, const Candidate& b) {
    return a.prediction.peak_budget_bytes < b.prediction.peak_budget_bytes;
  };
  Candidate best = *std::min_element(all.begin(), all.end(), lower);
  size_t lo = 0, hi = best.prediction.peak_budget_bytes;
  while (hi > lo + std::max<size_t>(1, hi / 1000)) {
    const size_t mid = lo + (hi - lo) / 2;
    std::optional<Schedule> s = rotor_search(costs, mid, offload, partition, progress);
    if (!s) {
      lo = mid;
      continue;
    }
    Prediction p = predict(*s, costs, offload, partition);
    if (p.peak_budget_bytes < best.prediction.peak_budget_bytes) {
      best = {"rotor", std::move(*s), std::move(p)};
    }
    hi = std::min(mid, best.prediction.peak_budget_bytes);
  }
  return best;
}

}  // namespace

std::optional<Schedule> schedule_rotor(const ChainCosts& costs, size_t budget_bytes,
                                       const OffloadOptions& offload,
                                       const PartitionOptions& partition,
                                       const PlanProgressFn& progress) {
  Progress p{&progress};
  return rotor_search(costs, budget_bytes, offload, partition, p);
}

size_t minimum_budget_bytes(const ChainCosts& costs, const OffloadOptions& offload,
                            const PartitionOptions& partition) {
  Progress none;
  return minimum_candidate(costs, offload, partition, none).prediction.peak_budget_bytes;
}

namespace {

void check_chain_bytes(const ChainCosts& costs, const PartitionOptions& partition) {
  // Note [Checked sizes] in base/checked.h: whatever the replay adds up at one moment (live
  // activations and tapes, one op's peak and workspace, the staged copies and slices, the
  // gathered parameters and the gradient buckets) is at most the sum of every figure of every
  // stage, every slot the staging arenas can have, every parameter unit and every bucket. When
  // that sum fits 64 bits no peak, sum or delta of a plan can wrap. The analytic model checks
  // its own chains first and names the config keys; this catches profiled or user costs.
  size_t total = 0;
  // `where` names the figure, built only for the message.
  auto add = [&](size_t bytes, const auto& where) {
    if (!try_add(total, bytes, total)) {
      throw InvalidArgument("the chain's byte figures overflow 64-bit counts (more than 8 EiB) at " +
                            std::string(where()) + "; the model or micro-batch is too large to plan");
    }
  };
  auto stage_name = [&](int j) {
    return "stage " + std::to_string(j) + " (" + costs.stages[static_cast<size_t>(j)].name + ")";
  };
  size_t largest_staged = 0;
  const auto ways = static_cast<size_t>(std::max(1, partition.ways));
  for (int j = 0; j < costs.num_stages(); ++j) {
    const StageCost& st = costs.stages[static_cast<size_t>(j)];
    size_t stage = 0;
    bool fits = try_add(st.input_bytes, st.output_bytes, stage) &&
                try_add(stage, st.backward_total_peak_bytes, stage);
    for (const OptionCost& o : st.options) {
      for (size_t b : {o.forward_peak_bytes, o.forward_total_peak_bytes, o.saved_bytes,
                       o.recompute_peak_bytes, o.recompute_total_peak_bytes, o.recompute_saved_bytes}) {
        fits = fits && try_add(stage, b, stage);
      }
    }
    // A partitioned hold's staged copy: ways x round_up(ceil(input / ways), slice alignment).
    size_t staged = st.input_bytes;
    if (ways > 1) {
      fits = fits && try_add(st.input_bytes / ways, kSliceAlignment + 1, staged) &&
             try_mul(staged, ways, staged);
    }
    if (!fits) add(kMaxCheckedSize, [&] { return stage_name(j) + "'s figures"; });
    add(stage, [&] { return stage_name(j); });
    largest_staged = std::max(largest_staged, staged);
  }
  size_t arenas = 0;  // the staging and slice arenas: at most a slot per stage each
  if (!try_add(largest_staged, kStagingSlotAlignment, arenas) ||
      !try_mul(arenas, 2 * static_cast<size_t>(costs.num_stages()), arenas)) {
    add(kMaxCheckedSize, [] { return "the staging slots"; });
  }
  add(arenas, [] { return "the staging slots"; });
  for (const GatherUnit& u : costs.params.units) add(u.bytes, [&] { return "gather unit " + u.name; });
  for (const CommStage& c : costs.comm) {
    for (size_t b : {c.between, c.during, c.after}) add(b, [] { return "the gradient buckets"; });
  }
}

}  // namespace

Plan make_plan(const PlanOptions& options, const ChainCosts& costs, const PlanProgressFn& progress_fn) {
  PORTER_CHECK(costs.num_stages() >= 1, "make_plan: the chain has no stages");
  check_chain_bytes(costs, options.partition);
  Progress progress{&progress_fn};
  const config::CheckpointingConfig& ck = options.checkpointing;
  const OffloadOptions& offload = options.offload;
  const PartitionOptions& partition = options.partition;
  PORTER_CHECK(partition.ways >= 1, "partition ways = ", partition.ways,
               " must be >= 1 (porter.model.tensor_parallel)");
  Plan plan;
  plan.policy = ck.policy;
  plan.selective_policy = selective_policy(ck.selective_ops);
  const int blocks = count_blocks(costs);
  switch (ck.policy) {
    case config::CheckpointPolicy::kNone:
      plan.schedule = schedule_none(costs);
      plan.description = "none: every stage keeps its activations";
      break;
    case config::CheckpointPolicy::kFull:
      plan.schedule = schedule_full(costs);
      plan.description = "full: all " + std::to_string(costs.num_stages()) +
                         " stages checkpointed and recomputed";
      break;
    case config::CheckpointPolicy::kUniform: {
      int64_t per = 1;
      PORTER_CHECK(!(ck.every_n_layers && ck.segments), policy_key("every_n_layers"), " = ",
                   ck.every_n_layers.value_or(0), " and ", policy_key("segments"), " = ",
                   ck.segments.value_or(0), " are both set; set one of them");
      if (ck.every_n_layers) {
        per = *ck.every_n_layers;
        PORTER_CHECK(per >= 1, policy_key("every_n_layers"), " = ", per, " must be >= 1");
        PORTER_CHECK(per <= blocks, policy_key("every_n_layers"), " = ", per, " is more than the model's ",
                     blocks, " blocks");
      } else if (ck.segments) {
        const int64_t k = *ck.segments;
        PORTER_CHECK(k >= 1, policy_key("segments"), " = ", k, " must be >= 1");
        per = std::max<int64_t>(1, (blocks + k - 1) / k);
      }
      PORTER_CHECK(blocks >= 1, "policy \"uniform\" needs blocks to checkpoint; the chain has none");
      plan.schedule = schedule_uniform(costs, static_cast<int>(per));
      const int64_t segs = (blocks + per - 1) / per;
      plan.description = "uniform: " + std::to_string(segs) + " segment" + (segs == 1 ? "" : "s") + " of " +
                         std::to_string(per) + " block" + (per == 1 ? "" : "s");
      break;
    }
    case config::CheckpointPolicy::kBlock: {
      PORTER_CHECK(ck.block_layers.has_value(), policy_key("block_layers"),
                   " is required by policy \"block\" (the number of blocks to checkpoint)");
      const int64_t b = *ck.block_layers;
      PORTER_CHECK(b >= 0, policy_key("block_layers"), " = ", b, " must be >= 0");
      PORTER_CHECK(b <= blocks, policy_key("block_layers"), " = ", b, " is more than the model's ", blocks,
                   " blocks");
      plan.schedule = schedule_block(costs, static_cast<int>(b));
      plan.description = "block: the first " + std::to_string(b) + " of " + std::to_string(blocks) +
                         " blocks checkpointed";
      break;
    }
    case config::CheckpointPolicy::kSqrt: {
      const int per = std::max(1, static_cast<int>(std::lround(std::sqrt(costs.num_stages()))));
      plan.schedule = schedule_sqrt(costs);
      plan.description = "sqrt: segments of " + std::to_string(per) + " stages";
      break;
    }
    case config::CheckpointPolicy::kSelective: {
      int n_sel = 0;
      for (const StageCost& s : costs.stages)
        n_sel += s.is_block && s.option(SaveOption::kSelective).available ? 1 : 0;
      PORTER_CHECK(n_sel > 0, "policy \"selective\": no block of this chain has a selective option (",
                   policy_key("selective_ops"), " names ops it does not run)");
      plan.schedule = schedule_selective(costs);
      plan.description = "selective: " + std::to_string(n_sel) + " blocks " +
                         plan.selective_policy.to_string();
      break;
    }
    case config::CheckpointPolicy::kOptimal: {
      std::optional<config::MemoryBudget> b = options.budget ? options.budget : ck.memory_budget;
      PORTER_CHECK(b.has_value(), kBudgetKey, " is required by policy \"optimal\" (bytes such as \"2GiB\", "
                   "or a fraction of the no-checkpointing peak such as 0.5)");
      const size_t budget = resolve_budget(*b, costs);
      plan.budget_bytes = budget;
      std::vector<Candidate> cands = standard_candidates(costs, offload, partition);
      const bool stash = offload.enabled || partition.enabled();
      if (stash) {
        // The device-only program too (a slow link may not pay), or where its discretisation
        // finds nothing, the device-only minimum, so that offload and partitioning never plan
        // slower than the same budget without them.
        if (std::optional<Schedule> r = rotor_search(costs, budget, OffloadOptions{}, PartitionOptions{}, progress)) {
          Prediction p = predict(*r, costs, offload, partition);
          cands.insert(cands.begin(), {"rotor", std::move(*r), std::move(p)});
        } else {
          Candidate m = minimum_candidate(costs, OffloadOptions{}, PartitionOptions{}, progress);
          m.prediction = predict(m.schedule, costs, offload, partition);
          cands.push_back(std::move(m));
        }
      }
      if (offload.enabled && partition.enabled()) {
        // The program with host holds but no partitioning too (a partitionable hold goes to
        // the host only as its slice, which may not pay), so that partitioning never plans
        // slower than the same budget without it.
        if (std::optional<Schedule> r = rotor_search(costs, budget, offload, PartitionOptions{}, progress)) {
          Prediction p = predict(*r, costs, offload, partition);
          cands.insert(cands.begin(), {"rotor", std::move(*r), std::move(p)});
        } else {
          Candidate m = minimum_candidate(costs, offload, PartitionOptions{}, progress);
          m.prediction = predict(m.schedule, costs, offload, partition);
          cands.push_back(std::move(m));
        }
      }
      if (std::optional<Schedule> r = rotor_search(costs, budget, offload, partition, progress)) {
        Prediction p = predict(*r, costs, offload, partition);
        cands.insert(cands.begin(), {"rotor", std::move(*r), std::move(p)});
      } else if (stash) {
        cands.push_back(minimum_candidate(costs, offload, partition, progress));
      }
      const Candidate* best = nullptr;
      for (const Candidate& c : cands) {
        if (c.prediction.peak_budget_bytes > budget) continue;
        if (best == nullptr || better(c.prediction, best->prediction, costs)) best = &c;
      }
      Candidate minimum;
      if (best == nullptr) {
        // The discretised DP may miss a schedule that fits exactly; the minimum search
        // (finer budgets) finds the lowest peak reachable.
        minimum = minimum_candidate(costs, offload, partition, progress);
        if (minimum.prediction.peak_budget_bytes > budget) {
          throw InvalidArgument(std::string(kBudgetKey) + ": " + format_bytes(budget) +
                                " is below the minimum feasible activation peak of " +
                                format_bytes(minimum.prediction.peak_budget_bytes) +
                                (costs.params.enabled ? " (with ZeRO stage 3's gathered parameters)"
                                                      : "") +
                                " for this model and micro-batch (policy \"optimal\")");
        }
        best = &minimum;
      }
      plan.schedule = best->schedule;
      plan.description = "optimal: budget " + format_bytes(budget) + ", chose " + best->description;
      break;
    }
  }
  if (ck.policy != config::CheckpointPolicy::kOptimal) {
    if (offload.enabled) place_offload(plan.schedule, costs, offload.keep_last_on_device);
    if (partition.enabled()) place_partition(plan.schedule, costs, partition);
  }
  plan.sim = sim_options(offload, partition);
  plan.offload = plan_layout(plan.schedule, costs, offload, partition);
  plan.prediction = simulate(plan.schedule, costs, plan.offload, plan.sim.link_bytes_per_s,
                             plan.sim.tp_bytes_per_s);
  plan.stages = summarize(plan.schedule, costs, &plan.prediction);
  size_t on_host = 0, partitioned = 0;
  for (const StashEntry& e : plan.offload.entries) {
    on_host += e.on_host ? 1 : 0;
    partitioned += e.partitioned ? 1 : 0;
  }
  if (offload.enabled) {
    if (on_host == 0) {
      plan.description += "; offload on, no checkpoint to offload";
    } else {
      plan.description += "; " + std::to_string(on_host) + " checkpoint" + (on_host == 1 ? "" : "s") +
                          " on host (" + format_bytes(plan.offload.offloaded_bytes) + "), prefetch depth " +
                          std::to_string(offload.prefetch_depth);
    }
  }
  if (partition.enabled()) {
    if (partitioned == 0) {
      plan.description += "; partition on, no checkpoint of at least " + format_bytes(partition.min_bytes) +
                          " to partition";
    } else {
      plan.description += "; " + std::to_string(partitioned) + " checkpoint" + (partitioned == 1 ? "" : "s") +
                          " partitioned " + std::to_string(partition.ways) + " ways";
    }
  }
  return plan;
}

}  // namespace porter::checkpoint
