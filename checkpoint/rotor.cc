// The Rotor dynamic program (Beaumont et al. 2019, "Optimal checkpointing for heterogeneous
// chains") with Rockmate's per-stage save options, over a ChainCosts, under a byte budget.
#include <algorithm>
#include <cmath>
#include <limits>

#include "base/check.h"
#include "checkpoint/planner.h"

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
constexpr int kLeafRecompute = kNumSaveOptions;  // choice codes 0..2: an option
constexpr int kCheckpointAt = 16;                // + i: F_ck(i)
constexpr double kInf = std::numeric_limits<double>::infinity();

class Rotor {
 public:
  Rotor(const ChainCosts& costs, size_t budget_bytes) : costs_(costs), n_(costs.num_stages()) {
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
    cost_.assign(static_cast<size_t>(n_) * n_ * (m_ + 1), kInf);
    choice_.assign(cost_.size(), -1);
  }

  std::optional<Schedule> solve() {
    for (int len = 0; len < n_; ++len)
      for (int s = 0; s + len < n_; ++s)
        for (int m = 0; m <= m_; ++m) fill(s, s + len, m);
    if (choice_[idx(0, n_ - 1, m_)] < 0) return std::nullopt;
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
  size_t idx(int s, int t, int64_t m) const {
    return (static_cast<size_t>(s) * n_ + t) * (m_ + 1) + static_cast<size_t>(m);
  }
  double at(int s, int t, int64_t m) const { return m < 0 ? kInf : cost_[idx(s, t, std::min<int64_t>(m, m_))]; }
  int64_t stale(int s, int t) const { return t < n_ - 1 ? ck_prefix_[t + 1] - ck_prefix_[s] : 0; }
  // The input of C(j, t) alive after it when it was a ck leaf (see the Note).
  int64_t stale_cur(int j, int t) const { return j == t && t < n_ - 1 ? in_[j] : 0; }
  const Opt& opt(int o, int j) const { return opt_[o][j]; }

  void fill(int s, int t, int m) {
    double best = kInf;
    int pick = -1;
    auto consider = [&](double c, int code) {
      if (c < best) {
        best = c;
        pick = code;
      }
    };
    const int64_t a = in_[s];
    const int64_t st = stale(s, t);
    if (s == t) {
      if (t == n_ - 1) {
        for (int o = 0; o < kNumSaveOptions; ++o) {
          const Opt& p = opt(o, s);
          if (!p.available) continue;
          int64_t need = a + std::max(p.fwd_peak, p.saved);
          if (o != 0) need = std::max(need, a + p.saved + std::max(p.rc_peak, p.rc_saved));
          if (need <= m) consider(p.f + (o != 0 ? p.r : 0.0) + b_[s], o);
        }
      } else {
        const Opt& p = opt(2, s);
        if (a + st + std::max(p.rc_peak, p.rc_saved) <= m) consider(p.r + b_[s], kLeafRecompute);
      }
    } else {
      for (int o = 0; o < kNumSaveOptions; ++o) {
        const Opt& p = opt(o, s);
        if (!p.available || a + st + p.fwd_peak > m) continue;
        const int64_t after = a + p.saved;
        if (o != 0 && after + std::max(p.rc_peak + stale_cur(s + 1, t), p.rc_saved) > m) continue;
        const double sub = at(s + 1, t, m - after);
        if (sub < kInf) consider(p.f + (o != 0 ? p.r : 0.0) + b_[s] + sub, o);
      }
      double fwd = 0.0;
      int64_t fneed = 0;
      for (int i = s + 1; i <= t; ++i) {
        const int j = i - 1;  // the last stage of the kCheckpoint pass
        const Opt& p = opt(2, j);
        if (!p.available) break;
        fwd += p.f;
        fneed = std::max(fneed, a + (j > s ? in_[j] : 0) + (ck_prefix_[j] - ck_prefix_[s]) + p.fwd_peak + st);
        if (fneed > m) break;
        const double sub1 = at(i, t, m - a - (ck_prefix_[i] - ck_prefix_[s]));
        if (sub1 == kInf) continue;
        const double sub2 = at(s, i - 1, m - stale_cur(i, t));
        if (sub2 < kInf) consider(fwd + sub1 + sub2, kCheckpointAt + i);
      }
    }
    cost_[idx(s, t, m)] = best;
    choice_[idx(s, t, m)] = pick;
  }

  void emit(int s, int t, int64_t m, std::vector<ScheduleOp>& ops) const {
    m = std::min<int64_t>(m, m_);
    const int c = choice_[idx(s, t, m)];
    PORTER_ASSERT(c >= 0, "rotor: no choice for C(", s, ", ", t, ", ", m, ")");
    if (c == kLeafRecompute) {
      ops.push_back(ScheduleOp::recompute(s));
      ops.push_back(ScheduleOp::backward(s));
    } else if (c < kNumSaveOptions) {
      const auto o = static_cast<SaveOption>(c);
      ops.push_back(ScheduleOp::forward(s, o, o != SaveOption::kKeep));
      if (s < t) emit(s + 1, t, m - in_[s] - opt(c, s).saved, ops);
      if (o != SaveOption::kKeep) ops.push_back(ScheduleOp::recompute(s));
      ops.push_back(ScheduleOp::backward(s));
    } else {
      const int i = c - kCheckpointAt;
      for (int j = s; j < i; ++j) ops.push_back(ScheduleOp::forward(j, SaveOption::kCheckpoint, j == s));
      emit(i, t, m - in_[s] - (ck_prefix_[i] - ck_prefix_[s]), ops);
      emit(s, i - 1, m - stale_cur(i, t), ops);
    }
  }

  const ChainCosts& costs_;
  int n_;
  int slots_ = 0;
  size_t slot_bytes_ = 1;
  int m_ = 0;  // the budget in slots
  std::vector<int64_t> in_;         // slots of a_j, j = 0..n
  std::array<std::vector<Opt>, kNumSaveOptions> opt_;
  std::vector<double> b_;
  std::vector<int64_t> ck_prefix_;  // prefix sums of kCheckpoint saved slots
  std::vector<double> cost_;
  std::vector<int> choice_;
};

}  // namespace

std::optional<Schedule> schedule_rotor(const ChainCosts& costs, size_t budget_bytes,
                                       const OffloadOptions& offload) {
  PORTER_CHECK(!offload.enabled, "schedule_rotor: host holds arrive with the offload planner");
  PORTER_CHECK(costs.num_stages() >= 1, "schedule_rotor: the chain has no stages");
  Rotor rotor(costs, budget_bytes);
  std::optional<Schedule> s = rotor.solve();
  if (s) {
    const Prediction p = simulate(*s, costs);
    PORTER_ASSERT(p.peak_activation_bytes <= budget_bytes, "rotor schedule ", s->to_string(),
                  " peaks at ", p.peak_activation_bytes, " bytes, over its budget of ", budget_bytes);
  }
  return s;
}

}  // namespace porter::checkpoint
