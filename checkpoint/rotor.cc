// The Rotor dynamic program (Beaumont et al. 2019, "Optimal checkpointing for heterogeneous
// chains") with Rockmate's per-stage save options, over a ChainCosts, within a byte limit.
#include "checkpoint/rotor.h"

#include <algorithm>
#include <array>
#include <functional>
#include <utility>
#include <limits>
#include <vector>

#include "base/check.h"

namespace porter::checkpoint {

namespace {

// Note [Rotor recurrence]
// C(s, t, m) is the cheapest way to produce the gradient of a_s from a_s (alive) and the
// gradient of a_{t+1}, with m bytes for everything alive while it runs, a_s included. Two
// contexts exist, and t tells them apart:
//   fresh (t == n-1)  stages s..t were never forwarded in this micro-batch;
//   ck    (t <  n-1)  stages s..t were forwarded kCheckpoint (an F_ck pass of a caller): their
//                    partial tapes exist (their bytes, "stale", are charged to every op of
//                    the subproblem, conservatively) and a_s is held.
// Choices:
//   leaf, fresh   Forward(s, o, hold = o != keep) [Recompute(s)] Backward(s)
//   leaf, ck      Recompute(s) Backward(s)   (the partial tape is there)
//   F_all(o)      Forward(s, o, hold = o != keep); C(s+1, t, m - a_s - saved_o);
//                 [Recompute(s)] Backward(s)
//   F_ck(i)       Forward(s, kCheckpoint, hold), Forward(s+1..i-1, kCheckpoint);
//                 C(i, t, m - a_s - saved_ck(s..i-1)); C(s, i-1, m)
// Schedule semantics keep `cur` after a backward (Note [Schedule semantics]): when C(s+1, t)
// or C(i, t) is a ck leaf, its input (a_{s+1}, a_i) is still alive during the caller's next
// op, which the recurrence charges. Every size is rounded up to whole slots and the budget
// down, so the DP never accepts a schedule the simulator would find over budget.
//
// Host holds (RotorOptions::host_holds; Note [Offload placement] in planner.h). In a fresh
// context with s > 0 and a_s > 0 bytes, F_all(o != keep) and F_ck(i) gain a host variant:
// the Forward of s holds a_s on the host, so a_s is charged only while it is that forward's
// input (in F_ck(i), not during the forwards s+1..i-1 either) and not in the subproblem that
// follows (C(s+1, t, m - saved_o), C(i, t, m - saved_ck(s..i-1))). It is charged again where
// it is back on the device: the Recompute(s) / Backward(s) of F_all, and the whole of
// C(s, i-1), whose first op reads it. (A ck context never holds on the host: a_s is already
// held.) Leaves have no host variant: nothing runs between the hold and the read.
// Partitioned holds (RotorOptions::partition_ways > 1; Note [Partition placement] in
// planner.h). In a fresh context with a_s partitionable, F_all(o != keep) and F_ck(i) gain a
// partitioned variant: the Forward of s holds only the slice (sl bytes) of a_s, so a_s + sl
// is charged at that forward, sl (instead of a_s) in the subproblem that follows, and where
// a_s is back the gathered copy (g = t x sl bytes >= a_s): at Recompute(s) / Backward(s) of
// F_all (with the slice too at the fetch, sl + g), and g - a_s more throughout C(s, i-1) of
// F_ck. The host variant of a partitionable hold is a partitioned host hold: its staged copy
// is g and its copies move sl bytes. The time of a partitioned variant adds the gather
// ((t-1) x sl / tp link) to the read-back that the depth backwards before the use may hide.
// Two things the recurrence does not see, and how they are made safe or approximated:
//   prefetch  a staged copy is alive from its prefetch op, up to `prefetch_depth` reads
//             ahead of its use (and the contiguous arena always). The planner's
//             schedule_rotor simulates each result exactly and, over budget, solves again
//             within the budget less a reserve (Note [Plan search] in planner.cc), so what it
//             returns always fits under the simulator.
//   time      a host variant costs the copy time the neighbouring compute cannot hide, per
//             hold, with c = a_s / link: max(0, c - the forwards of stages s+1..n-1) for the
//             D2H copy, plus for the H2D copy max(0, c - the backwards of the depth ops just
//             before the use: stages s+1.. for F_all, i.. for F_ck(i)), or c at depth 0.
//             Copies queueing on one stream are not modelled; the planner picks among the
//             program's result and the standard plans by the simulated time (compute +
//             exposed), which models them exactly. Without a link bandwidth or times the
//             copies cost nothing and ties go to the device variant.
constexpr int kLeafRecompute = kNumSaveOptions;  // choice codes 0..2: an option
constexpr int kCheckpointAt = 16;                // + i: F_ck(i)
constexpr int kHost = 1 << 24;                   // | choice: the host variant
constexpr int kPart = 1 << 25;                   // | choice: the partitioned (device) variant
constexpr double kInf = std::numeric_limits<double>::infinity();

class Rotor {
 public:
  Rotor(const ChainCosts& costs, size_t budget_bytes, const RotorOptions& options)
      : costs_(costs), n_(costs.num_stages()), host_(options.host_holds),
        depth_(options.prefetch_depth), share_runs_(options.share_runs) {
    const int64_t n3 = static_cast<int64_t>(n_) * n_ * n_;
    slots_ = static_cast<int>(std::clamp<int64_t>(50'000'000 / std::max<int64_t>(1, n3), 50, 500));
    slot_bytes_ = std::max<size_t>(1, (budget_bytes + slots_ - 1) / slots_);
    m_ = static_cast<int>(std::min<size_t>(budget_bytes / slot_bytes_, static_cast<size_t>(slots_)));
    for (int j = 0; j <= n_; ++j) {
      in_.push_back(to_slots(j < n_ ? costs.stages[j].input_bytes : costs.stages[n_ - 1].output_bytes));
    }
    ck_prefix_.push_back(0);
    for (int j = 0; j < n_; ++j) {
      const StageCost& st = costs.stages[j];
      for (int o = 0; o < kNumSaveOptions; ++o) {
        const OptionCost& c = st.options[o];
        Opt& p = opt_[o].emplace_back();
        p.available = c.available;
        p.fwd_peak = to_slots(c.forward_peak_bytes);
        p.saved = to_slots(c.saved_bytes);
        p.rc_peak = to_slots(c.recompute_peak_bytes);
        p.rc_saved = to_slots(c.recompute_saved_bytes);
        if (costs.has_times()) {
          p.f = c.forward_s;
          p.r = c.recompute_s;
        } else if (st.forward_flops > 0) {
          p.f = st.forward_flops;
          p.r = c.recompute_flops;
        } else {  // nothing known: count stage runs
          p.f = 1.0;
          p.r = o == 0 ? 0.0 : 1.0;
        }
      }
      b_.push_back(costs.has_times() ? st.backward_s : 0.0);
      ck_prefix_.push_back(ck_prefix_.back() + opt_[2][j].saved);
    }
    // Host variants: the exposed copy time of each hold (see the Note), and which holds may go.
    const bool timed = costs.has_times() && options.link_bytes_per_s > 0.0;
    fwd_after_.assign(static_cast<size_t>(n_) + 1, 0.0);
    for (int j = n_ - 1; j >= 0; --j) {
      double f = kInf;
      for (const OptionCost& c : costs.stages[j].options)
        if (c.available) f = std::min(f, c.forward_s);
      fwd_after_[j] = fwd_after_[j + 1] + (f < kInf ? f : 0.0);
    }
    b_prefix_.assign(static_cast<size_t>(n_) + 1, 0.0);
    for (int j = 0; j < n_; ++j) b_prefix_[j + 1] = b_prefix_[j] + b_[j];
    const bool tp_timed = costs.has_times() && options.tp_bytes_per_s > 0.0;
    const int ways = std::max(1, options.partition_ways);
    for (int j = 0; j < n_; ++j) {
      const StageCost& st = costs.stages[j];
      const bool part = ways > 1 && partitionable(st, j, options.partition_min_bytes);
      const size_t slice = part ? partition_slice_bytes(st.input_bytes, ways) : 0;
      part_.push_back(part);
      slice_.push_back(to_slots(slice));
      staged_.push_back(part ? to_slots(static_cast<size_t>(ways) * slice) : in_[j]);
      // A partitionable hold goes to the host as its slice.
      const double bytes = static_cast<double>(part ? slice : st.input_bytes);
      copy_s_.push_back(timed ? bytes / options.link_bytes_per_s : 0.0);
      gather_s_.push_back(tp_timed ? static_cast<double>(ways - 1) * static_cast<double>(slice) /
                                         options.tp_bytes_per_s
                                   : 0.0);
      can_host_.push_back(host_ && j > 0 && st.input_bytes > 0);
    }
    index_runs();
    cost_.assign(rows_ * static_cast<size_t>(m_ + 1), kInf);
    choice_.assign(cost_.size(), -1);
  }

  // `progress`, when given, is called with the fraction of the table filled, about every
  // 1/64 of it.
  std::optional<Schedule> solve(const std::function<void(double)>& progress) {
    // Note [Rotor runs]: only the canonical subproblems are solved, shortest first (each
    // reads shorter ones only).
    std::vector<std::pair<int, int>> pairs;
    pairs.reserve(rows_);
    for (int s = 0; s < n_; ++s)
      for (int t = first_t_[s]; t < n_; ++t) pairs.emplace_back(s, t);
    std::stable_sort(pairs.begin(), pairs.end(), [](const auto& x, const auto& y) {
      return x.second - x.first < y.second - y.first;
    });
    // The work of a pair is about its length (the F_ck loop); report by that.
    double total = 0.0, done = 0.0, next = 0.0;
    for (const auto& [s, t] : pairs) total += 1.0 + (t - s);
    for (const auto& [s, t] : pairs) {
      fill(s, t);
      done += 1.0 + (t - s);
      if (progress && done >= next) {
        progress(done / total);
        next = done + total / 64.0;
      }
    }
    if (choice_[locate(0, n_ - 1).first * static_cast<size_t>(m_ + 1) + static_cast<size_t>(m_)] < 0) {
      return std::nullopt;
    }
    Schedule out;
    out.num_stages = n_;
    emit(0, n_ - 1, m_, out.ops);
    return out;
  }

 private:
  struct Opt {
    bool available = false;
    int64_t fwd_peak = 0, saved = 0, rc_peak = 0, rc_saved = 0;
    double f = 0.0, r = 0.0;
  };

  int64_t to_slots(size_t bytes) const {
    return static_cast<int64_t>((bytes + slot_bytes_ - 1) / slot_bytes_);
  }
  // Note [Rotor runs]
  // The chain of a transformer is mostly one run of identical blocks. A ck subproblem C(s, t)
  // (t < n-1) reads only the costs of stages s..t and indices relative to s (the recurrence
  // above; the host and partitioned variants, which read absolute suffix times, exist only in
  // the fresh context), so when s..t lie in one run of stages whose costs are all equal, C(s, t,
  // m) = C(p, p + t - s, m) for the run's first stage p, with its F_ck choice i shifted by
  // s - p: the same values, the same choices in the same order of consideration, so the same
  // schedule as solving every (s, t). Only canonical subproblems are stored and solved: per s,
  // t from first_t_[s] (s itself at a run's start; else past the run's end, or n-1) to n-1.
  // With one run of L blocks that is about 3L rows instead of L^2 / 2, and O(L^2) work per
  // budget instead of O(L^3).
  bool same_stage(int j, int k) const {
    auto same_opt = [](const Opt& x, const Opt& y) {
      return x.available == y.available && x.fwd_peak == y.fwd_peak && x.saved == y.saved &&
             x.rc_peak == y.rc_peak && x.rc_saved == y.rc_saved && x.f == y.f && x.r == y.r;
    };
    for (int o = 0; o < kNumSaveOptions; ++o)
      if (!same_opt(opt_[o][j], opt_[o][k])) return false;
    return in_[j] == in_[k] && b_[j] == b_[k] && part_[j] == part_[k] && slice_[j] == slice_[k] &&
           staged_[j] == staged_[k] && copy_s_[j] == copy_s_[k] && gather_s_[j] == gather_s_[k] &&
           can_host_[j] == can_host_[k];
  }
  void index_runs() {
    run_start_.assign(static_cast<size_t>(n_), 0);
    std::vector<int> run_end(static_cast<size_t>(n_), 0);
    for (int j = 0; j < n_; ++j) {
      run_start_[j] = share_runs_ && j > 0 && same_stage(j, j - 1) ? run_start_[j - 1] : j;
    }
    for (int j = n_ - 1; j >= 0; --j) run_end[j] = j + 1 < n_ && run_start_[j + 1] == run_start_[j] ? run_end[j + 1] : j;
    first_t_.assign(static_cast<size_t>(n_), 0);
    row_base_.assign(static_cast<size_t>(n_), 0);
    rows_ = 0;
    for (int s = 0; s < n_; ++s) {
      first_t_[s] = run_start_[s] == s ? s : std::min(run_end[s] + 1, n_ - 1);
      row_base_[s] = rows_;
      rows_ += static_cast<size_t>(n_ - first_t_[s]);
    }
  }
  // The row of C(s, t)'s canonical subproblem, and the shift from its stages to s..t.
  std::pair<size_t, int> locate(int s, int t) const {
    int shift = 0;
    if (t < n_ - 1 && run_start_[s] == run_start_[t]) shift = s - run_start_[s];
    const int cs = s - shift, ct = t - shift;
    return {row_base_[cs] + static_cast<size_t>(ct - first_t_[cs]), shift};
  }
  const double* row(int s, int t) const {
    return &cost_[locate(s, t).first * static_cast<size_t>(m_ + 1)];
  }
  double at(const double* r, int64_t m) const { return m < 0 ? kInf : r[std::min<int64_t>(m, m_)]; }
  int64_t stale(int s, int t) const { return t < n_ - 1 ? ck_prefix_[t + 1] - ck_prefix_[s] : 0; }
  // The input of C(j, t) alive after it when it was a ck leaf (see the Note).
  int64_t stale_cur(int j, int t) const { return j == t && t < n_ - 1 ? in_[j] : 0; }
  const Opt& opt(int o, int j) const { return opt_[o][j]; }
  // The exposed transfer time of holding a_s on the host (`host`) or partitioned on the device
  // when it is next read after the backward of stage `next` (s+1 for F_all, i for F_ck(i)):
  // the copies of a host hold, the gather of a partitioned one (a host hold of a
  // partitionable stage is both).
  double transfer_cost(int s, int next, bool host) const {
    const double c = host ? copy_s_[s] : 0.0;
    const double g = part_[s] ? gather_s_[s] : 0.0;
    if (c == 0.0 && g == 0.0) return 0.0;
    const double d2h = host ? std::max(0.0, c - fwd_after_[s + 1]) : 0.0;
    if (depth_ == 0) return d2h + c + g;
    const int end = std::min(n_, next + depth_);
    return d2h + std::max(0.0, c + g - (b_prefix_[end] - b_prefix_[next]));
  }

  // Every m of C(s, t) (a canonical pair, Note [Rotor runs]). For each m the candidates are
  // considered in the recurrence's order (F_all's options with their variants, then F_ck(i)
  // for i = s+1.. with theirs) and the first of the cheapest is kept; the loops run m inside
  // each candidate family so that a subproblem's row is read in order.
  void fill(int s, int t) {
    const size_t base = locate(s, t).first * static_cast<size_t>(m_ + 1);
    double* best = &cost_[base];
    int* pick = &choice_[base];
    auto consider = [&](int64_t m, double c, int code) {
      if (c < best[m]) {
        best[m] = c;
        pick[m] = code;
      }
    };
    const int64_t a = in_[s];
    const int64_t st = stale(s, t);
    if (s == t) {
      for (int64_t m = 0; m <= m_; ++m) {
        if (t == n_ - 1) {
          for (int o = 0; o < kNumSaveOptions; ++o) {
            const Opt& p = opt(o, s);
            if (!p.available) continue;
            int64_t need = a + std::max(p.fwd_peak, p.saved);
            if (o != 0) need = std::max(need, a + p.saved + std::max(p.rc_peak, p.rc_saved));
            if (need <= m) consider(m, p.f + (o != 0 ? p.r : 0.0) + b_[s], o);
          }
        } else {
          const Opt& p = opt(2, s);
          if (a + st + std::max(p.rc_peak, p.rc_saved) <= m) consider(m, p.r + b_[s], kLeafRecompute);
        }
      }
      return;
    }
    // Host and partitioned variants only where a_s is not held yet: the fresh context (see
    // the Note). A stashed hold's read-back stages g = staged_[s] (a_s, or the gathered copy
    // of a partitionable one).
    const bool host = can_host_[s] && t == n_ - 1;
    const bool part = part_[s] && t == n_ - 1;
    const int64_t g = staged_[s];
    const int64_t sl = slice_[s];
    const double* next = row(s + 1, t);
    for (int64_t m = 0; m <= m_; ++m) {
      for (int o = 0; o < kNumSaveOptions; ++o) {
        const Opt& p = opt(o, s);
        if (!p.available || a + st + p.fwd_peak > m) continue;
        const int64_t rc = o != 0 ? std::max(p.rc_peak + stale_cur(s + 1, t), p.rc_saved) : 0;
        const double own = p.f + (o != 0 ? p.r : 0.0) + b_[s];
        if (o == 0 || a + p.saved + rc <= m) {
          const double sub = at(next, m - a - p.saved);
          if (sub < kInf) consider(m, own + sub, o);
        }
        if (o == 0) continue;  // a keep forward holds nothing
        if (part && a + sl + st + p.fwd_peak <= m && g + p.saved + rc <= m &&
            g + sl + p.saved + stale_cur(s + 1, t) <= m) {
          const double psub = at(next, m - sl - p.saved);
          if (psub < kInf) consider(m, own + psub + transfer_cost(s, s + 1, false), o | kPart);
        }
        if (host && g + p.saved + rc <= m) {
          const double hsub = at(next, m - p.saved);
          if (hsub < kInf) consider(m, own + hsub + transfer_cost(s, s + 1, true), o | kHost);
        }
      }
    }
    double fwd = 0.0;
    // The pass's peak with a_s held on device / on host / partitioned. Each only grows with
    // i, so a variant that does not fit an m at some i fits it at no later i.
    int64_t fneed = 0, hneed = 0, pneed = 0;
    for (int i = s + 1; i <= t; ++i) {
      const int j = i - 1;  // the last stage of the kCheckpoint pass
      const Opt& p = opt(2, j);
      if (!p.available) break;
      fwd += p.f;
      const int64_t rest = (ck_prefix_[j] - ck_prefix_[s]) + p.fwd_peak + st;
      fneed = std::max(fneed, a + (j > s ? in_[j] : 0) + rest);
      hneed = std::max(hneed, (j > s ? in_[j] : a) + rest);
      pneed = std::max(pneed, (j > s ? in_[j] : a) + sl + rest);
      int64_t lowest = fneed;
      if (host) lowest = std::min(lowest, hneed);
      if (part) lowest = std::min(lowest, pneed);
      if (lowest > m_) break;
      const int64_t ck = ck_prefix_[i] - ck_prefix_[s];
      const int64_t sc = stale_cur(i, t);
      const double* sub2_row = row(s, i - 1);
      const double* sub1_row = row(i, t);
      const double tc_part = part ? transfer_cost(s, i, false) : 0.0;
      const double tc_host = host ? transfer_cost(s, i, true) : 0.0;
      for (int64_t m = std::max<int64_t>(0, lowest); m <= m_; ++m) {
        const bool f_ok = fneed <= m;
        const bool h_ok = host && hneed <= m;
        const bool p_ok = part && pneed <= m;
        const double sub2 = at(sub2_row, m - sc);
        // C(s, i-1) reads the staged copy, g - a_s more than it charges for a_s.
        const double sub2_staged = g > a ? at(sub2_row, m - sc - (g - a)) : sub2;
        if (f_ok && sub2 < kInf) {
          const double sub1 = at(sub1_row, m - a - ck);
          if (sub1 < kInf) consider(m, fwd + sub1 + sub2, kCheckpointAt + i);
        }
        if (p_ok && sub2_staged < kInf) {
          const double psub1 = at(sub1_row, m - sl - ck);
          if (psub1 < kInf) consider(m, fwd + psub1 + sub2_staged + tc_part, (kCheckpointAt + i) | kPart);
        }
        if (h_ok && sub2_staged < kInf) {
          const double hsub1 = at(sub1_row, m - ck);
          if (hsub1 < kInf) consider(m, fwd + hsub1 + sub2_staged + tc_host, (kCheckpointAt + i) | kHost);
        }
      }
    }
  }

  void emit(int s, int t, int64_t m, std::vector<ScheduleOp>& ops) const {
    m = std::min<int64_t>(m, m_);
    const auto [r, shift] = locate(s, t);
    const int code = choice_[r * static_cast<size_t>(m_ + 1) + static_cast<size_t>(m)];
    PORTER_ASSERT(code >= 0, "rotor: no choice for C(", s, ", ", t, ", ", m, ")");
    const bool host = (code & kHost) != 0;
    const bool part = (code & kPart) != 0;
    const int c = code & ~(kHost | kPart);
    // A host hold's input is not charged in the subproblem that follows, a partitioned one's
    // slice is (see the Note); a host hold of a partitionable stage is partitioned.
    const int64_t a = host ? 0 : part ? slice_[s] : in_[s];
    const bool sliced = part || (host && part_[s]);
    const int64_t staged_extra = sliced ? staged_[s] - in_[s] : 0;
    if (c == kLeafRecompute) {
      ops.push_back(ScheduleOp::recompute(s));
      ops.push_back(ScheduleOp::backward(s));
    } else if (c < kNumSaveOptions) {
      const auto o = static_cast<SaveOption>(c);
      ops.push_back(ScheduleOp::forward(s, o, o != SaveOption::kKeep, host, sliced));
      if (s < t) emit(s + 1, t, m - a - opt(c, s).saved, ops);
      if (o != SaveOption::kKeep) ops.push_back(ScheduleOp::recompute(s));
      ops.push_back(ScheduleOp::backward(s));
    } else {
      const int i = c - kCheckpointAt + shift;  // Note [Rotor runs]
      for (int j = s; j < i; ++j) {
        ops.push_back(ScheduleOp::forward(j, SaveOption::kCheckpoint, j == s, j == s && host, j == s && sliced));
      }
      emit(i, t, m - a - (ck_prefix_[i] - ck_prefix_[s]), ops);
      emit(s, i - 1, m - stale_cur(i, t) - std::max<int64_t>(0, staged_extra), ops);
    }
  }

  const ChainCosts& costs_;
  int n_;
  bool host_ = false;  // host variants (offload on)
  int depth_ = 1;      // prefetch depth
  bool share_runs_ = true;
  int slots_ = 0;
  size_t slot_bytes_ = 1;
  int m_ = 0;  // the budget in slots
  std::vector<int64_t> in_;         // slots of a_j, j = 0..n
  std::array<std::vector<Opt>, kNumSaveOptions> opt_;
  std::vector<double> b_;
  std::vector<int64_t> ck_prefix_;  // prefix sums of kCheckpoint saved slots
  std::vector<double> fwd_after_;   // forward time of stages j..n-1 (their fastest option)
  std::vector<double> b_prefix_;    // prefix sums of backward times
  std::vector<double> copy_s_;      // a_j (its slice when partitionable) / link (0 without
                                    // times or link)
  std::vector<bool> can_host_;      // a_j may be held on the host
  std::vector<bool> part_;          // a_j may be partitioned
  std::vector<int64_t> slice_;      // slots of a_j's slice (0 unless partitionable)
  std::vector<int64_t> staged_;     // slots of a_j's staged read-back (the gathered copy when
                                    // partitionable, else in_[j])
  std::vector<double> gather_s_;    // (t-1) x slice / tp link (0 without times or tp link)
  // Note [Rotor runs]: the canonical subproblems' rows, m_ + 1 entries each.
  std::vector<int> run_start_;      // the first stage of j's run of identical stages
  std::vector<int> first_t_;        // the first t of s's rows
  std::vector<size_t> row_base_;    // the row of C(s, first_t_[s])
  size_t rows_ = 0;
  std::vector<double> cost_;
  std::vector<int> choice_;
};

}  // namespace

std::optional<Schedule> solve_rotor(const ChainCosts& costs, size_t limit_bytes,
                                    const RotorOptions& options,
                                    const std::function<void(double)>& progress) {
  PORTER_CHECK(costs.num_stages() >= 1, "solve_rotor: the chain has no stages");
  PORTER_CHECK(options.prefetch_depth >= 0, "solve_rotor: prefetch depth ", options.prefetch_depth,
               " must be >= 0");
  return Rotor(costs, limit_bytes, options).solve(progress);
}

}  // namespace porter::checkpoint
