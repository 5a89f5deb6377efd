// Schedules: printing, validation against Note [Schedule semantics], and the replay of a
// schedule over a chain's costs (Note [Activation bytes]) that the simulator builds on.
#include "checkpoint/schedule.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "base/error.h"

namespace porter::checkpoint {

namespace {

char option_letter(SaveOption o) {
  switch (o) {
    case SaveOption::kKeep: return 'k';
    case SaveOption::kSelective: return 's';
    case SaveOption::kCheckpoint: return 'c';
  }
  return '?';
}

std::string op_string(const ScheduleOp& op) {
  switch (op.kind) {
    case ScheduleOp::Kind::kForward:
      return "F" + std::to_string(op.stage) + option_letter(op.save) +
             (op.offload ? "^" : op.hold_input ? "+" : "") + (op.partition ? "/" : "");
    case ScheduleOp::Kind::kRecompute: return "R" + std::to_string(op.stage);
    case ScheduleOp::Kind::kBackward: return "B" + std::to_string(op.stage);
  }
  return "?";
}

enum class TapeState : uint8_t { kEmpty, kPartial, kFull };

struct StageTape {
  TapeState state = TapeState::kEmpty;
  SaveOption option = SaveOption::kKeep;  // of the forward that filled it
  bool refs_input = false;
  bool refs_output = false;
  size_t extra_bytes = 0;  // saved bytes beyond the stage's input and output
  // The input the tape references is the staged copy of a stashed hold (counted as staging).
  bool input_staged = false;
};

// The executor state of Note [Schedule semantics]. With costs it also keeps the footprint
// (Note [Activation bytes]); without, it only checks the rules (Note [One replay] in
// schedule.h).
class Replay {
 public:
  // `staging`: the stash's bytes of host and partitioned holds (Note [Offload semantics],
  // Note [Partition semantics]).
  Replay(const Schedule& s, const ChainCosts* costs, const Staging* staging = nullptr)
      : schedule_(s), costs_(costs), staging_(staging), n_(s.num_stages),
        held_(static_cast<size_t>(std::max(n_, 0)), false),
        held_stash_(static_cast<size_t>(std::max(n_, 0)), false),
        tapes_(static_cast<size_t>(std::max(n_, 0))), forwards_(static_cast<size_t>(std::max(n_, 0)), 0),
        g_(n_), contrib_(static_cast<size_t>(std::max(n_, 0)) + 1, 0) {
    if (costs_ != nullptr && staging_ != nullptr) index_windows();
  }

  void run() {
    if (n_ < 1) throw InvalidArgument("schedule: num_stages = " + std::to_string(n_) + ", expected >= 1");
    if (costs_ != nullptr && costs_->num_stages() != n_) {
      throw InvalidArgument("schedule has " + std::to_string(n_) + " stages but the costs have " +
                            std::to_string(costs_->num_stages()));
    }
    for (size_t k = 0; k < schedule_.ops.size(); ++k) {
      op_ = static_cast<int>(k);
      after_ = false;
      if (costs_ != nullptr) {
        pred_.offload.peak_staging_bytes = std::max(pred_.offload.peak_staging_bytes, staging_bytes());
        pred_.offload.peak_slice_bytes =
            std::max(pred_.offload.peak_slice_bytes, slice_bytes() + freed_at_fetch());
      }
      apply(static_cast<int>(k), schedule_.ops[k]);
    }
    if (g_ != 0) {
      fail_end("the backward of stage " + std::to_string(g_ - 1) + " never runs (backward must run "
               "once per stage, " + std::to_string(n_ - 1) + " down to 0)");
    }
    for (int i = 0; i < n_; ++i) {
      if (tapes_[i].state != TapeState::kEmpty) fail_end("the tape of stage " + std::to_string(i) + " is not empty");
      if (held_[i]) fail_end("the input of stage " + std::to_string(i) + " is still held");
    }
  }

  Prediction prediction() const { return pred_; }
  // Compute time of each op (forward_s, recompute_s or backward_s); with costs only.
  const std::vector<double>& op_seconds() const { return op_s_; }

 private:
  [[noreturn]] void fail(int k, const ScheduleOp& op, const std::string& rule) const {
    throw InvalidArgument("schedule op " + std::to_string(k) + " (" + op_string(op) + "): " + rule);
  }
  [[noreturn]] void fail_end(const std::string& rule) const {
    throw InvalidArgument("schedule ends after " + std::to_string(schedule_.ops.size()) +
                          " ops with an unfinished micro-batch: " + rule);
  }

  // Bytes of a_j: a stage's input, or the last stage's output (the loss).
  size_t act_bytes(int j) const {
    if (costs_ == nullptr) return 0;
    return j < n_ ? costs_->stages[j].input_bytes : costs_->stages[n_ - 1].output_bytes;
  }

  // A stashed hold (host or partitioned) is not alive as a checkpoint: its a_i left with the
  // D2H copy or was sliced, and its slice and staged copy (also when a tape references it)
  // are counted by the windows (slice_bytes(), staging_bytes()).
  bool alive(int j) const {
    if (cur_ == j) return true;
    if (j < n_ && held_[j] && !held_stash_[j]) return true;
    if (j < n_ && tapes_[j].state != TapeState::kEmpty && tapes_[j].refs_input && !tapes_[j].input_staged) {
      return true;
    }
    if (j > 0 && tapes_[j - 1].state != TapeState::kEmpty && tapes_[j - 1].refs_output) return true;
    return false;
  }

  // Note [Incremental footprint]
  // The footprint is asked for several times per op, so it is kept as running sums rather
  // than summed over the chain each time (which made a replay quadratic in the stages):
  // contrib_[j] is a_j's bytes when alive(j) plus tape j's extra bytes, as of the last
  // footprint() call, and act_total_ their sum. An op on stage i changes only held_[i],
  // held_stash_[i], tapes_[i] and cur_, so between two calls only contrib_ of i, i + 1 (tape
  // i's output reference), the current cur_ and the cur_ of the last call can change; those
  // are refreshed. The windows' bytes are step functions of the moment 2 op_ + after_,
  // summed once over the schedule (index_windows).
  size_t footprint() {
    if (costs_ == nullptr) return 0;
    refresh(last_stage_);
    refresh(last_stage_ + 1);
    refresh(last_cur_);
    refresh(cur_);
    last_cur_ = cur_;
    return act_total_ + staging_bytes() + slice_bytes();
  }
  void refresh(int j) {
    if (j < 0 || j > n_) return;
    size_t c = alive(j) ? act_bytes(j) : 0;
    if (j < n_) c += tapes_[static_cast<size_t>(j)].extra_bytes;
    size_t& old = contrib_[static_cast<size_t>(j)];
    act_total_ = act_total_ - old + c;
    old = c;
  }

  // The moment of op op_: 2 op_ before it runs, 2 op_ + 1 after.
  size_t moment() const { return 2 * static_cast<size_t>(op_) + (after_ ? 1 : 0); }

  // Sums, at every moment, of the stash's windows (index_windows): a window counts `bytes`
  // from just before its first op to just after its last (an until_fetch window: until just
  // before its last), so over the moments [2 first, 2 last] ([2 first, 2 last - 1]); the
  // gathered parameters during their ops, over [2 first, 2 last + 1]; and per op, the bytes
  // fetch() frees before it.
  void index_windows() {
    staging_base_ = staging_->arena_bytes;
    slice_base_ = staging_->slice_arena_bytes;
    // Most replays (the planner's candidates) have no window at all: nothing to sum.
    if (staging_->windows.empty()) return;
    const size_t moments = 2 * schedule_.ops.size() + 2;
    std::vector<int64_t> staging(moments + 1, 0), slices(moments + 1, 0), params(moments + 1, 0);
    freed_at_op_.assign(schedule_.ops.size() + 1, 0);
    auto add = [&](std::vector<int64_t>& diff, int64_t lo, int64_t hi, size_t bytes) {
      lo = std::max<int64_t>(lo, 0);
      hi = std::min<int64_t>(hi, static_cast<int64_t>(moments) - 1);
      if (lo > hi) return;
      diff[static_cast<size_t>(lo)] += static_cast<int64_t>(bytes);
      diff[static_cast<size_t>(hi) + 1] -= static_cast<int64_t>(bytes);
    };
    for (const StagingWindow& w : staging_->windows) {
      const int64_t f = 2 * static_cast<int64_t>(w.first_op), l = 2 * static_cast<int64_t>(w.last_op);
      if (w.until_fetch && w.first_op < w.last_op && w.last_op >= 0 &&
          static_cast<size_t>(w.last_op) < schedule_.ops.size()) {
        freed_at_op_[static_cast<size_t>(w.last_op)] += w.bytes;
      }
      if (w.params) {
        add(params, f, l + 1, w.bytes);
        continue;
      }
      add(w.slice ? slices : staging, f, w.until_fetch ? l - 1 : l, w.bytes);
    }
    auto prefix = [&](const std::vector<int64_t>& diff) {
      std::vector<size_t> out(moments, 0);
      int64_t run = 0;
      for (size_t k = 0; k < moments; ++k) {
        run += diff[k];
        out[k] = static_cast<size_t>(run);
      }
      return out;
    };
    staging_at_ = prefix(staging);
    slices_at_ = prefix(slices);
    params_at_ = prefix(params);
  }

  // The stash's bytes in the footprint at the start of op op_ (after_ false) or after it
  // (after_ true); the arenas throughout.
  size_t staging_bytes() const { return staging_base_ + (staging_at_.empty() ? 0 : staging_at_[moment()]); }
  size_t slice_bytes() const { return slice_base_ + (slices_at_.empty() ? 0 : slices_at_[moment()]); }
  // The gathered parameter buffers alive during op op_ (they are issued before it starts and
  // freed after it ends).
  size_t param_bytes() const { return params_at_.empty() ? 0 : params_at_[moment()]; }
  // The bytes fetch() frees before op op_ runs, after that op's prefetches allocated theirs.
  size_t freed_at_fetch() const {
    return freed_at_op_.empty() ? 0 : freed_at_op_[static_cast<size_t>(op_)];
  }
  // The moment before op k in which the slices its fetch frees are still there
  // (StagingWindow::until_fetch), as a peak of op k.
  void note_fetch_moment(int k) {
    const size_t freed = freed_at_fetch();
    if (freed == 0) return;
    const size_t moment = footprint() + freed;
    note_peak(k, moment, moment + grad_bytes());
  }

  // The activation gradient alive between stages: that of a_g (none for the loss).
  size_t grad_bytes() const { return g_ < n_ ? act_bytes(g_) : 0; }

  // ZeRO's gradient buckets alive during the op being applied (Note [Gradient buckets in the
  // footprint] in costs.h): `during` for a backward, else `between` once a backward ran.
  size_t comm_bytes(bool backward, int stage) const {
    if (costs_ == nullptr || costs_->comm.empty()) return 0;
    if (backward) return costs_->comm[static_cast<size_t>(stage)].during;
    return g_ < n_ ? costs_->comm[static_cast<size_t>(g_ - 1 >= 0 ? g_ - 1 : 0)].between : 0;
  }

  void note_peak(int k, size_t activation_peak, size_t total_peak) {
    if (pred_.peak_op < 0 || activation_peak > pred_.peak_activation_bytes) {
      pred_.peak_op = k;
      pred_.peak_activation_bytes = activation_peak;
    }
    const size_t params = param_bytes();
    const ScheduleOp& op = schedule_.ops[static_cast<size_t>(k)];
    const size_t comm = comm_bytes(op.kind == ScheduleOp::Kind::kBackward, op.stage);
    pred_.peak_comm_bytes = std::max(pred_.peak_comm_bytes, comm);
    pred_.peak_total_bytes = std::max(pred_.peak_total_bytes, total_peak + params + comm);
    note_op_total(k, total_peak + params + comm);
    pred_.peak_budget_bytes = std::max(pred_.peak_budget_bytes, activation_peak + params);
    pred_.params.peak_gathered_bytes = std::max(pred_.params.peak_gathered_bytes, params);
  }

  void note_op_total(int k, size_t bytes) {
    std::vector<size_t>& v = pred_.peak_total_during_op;
    if (v.size() <= static_cast<size_t>(k)) v.resize(static_cast<size_t>(k) + 1, 0);
    v[static_cast<size_t>(k)] = std::max(v[static_cast<size_t>(k)], bytes);
  }

  const OptionCost& option_cost(int k, const ScheduleOp& op, int stage, SaveOption o) const {
    const OptionCost& c = costs_->stages[stage].option(o);
    if (!c.available) {
      fail(k, op, "save option " + std::string(save_option_name(o)) + " is not available for stage " +
                      std::to_string(stage) + " (" + costs_->stages[stage].name + ")");
    }
    return c;
  }

  void apply(int k, const ScheduleOp& op) {
    const int i = op.stage;
    if (i < 0 || i >= n_) fail(k, op, "stage " + std::to_string(i) + " is outside 0.." + std::to_string(n_ - 1));
    // The stage whose state this op changes (Note [Incremental footprint]); the previous op's
    // changes were all refreshed by its footprint_after_op.
    last_stage_ = i;
    StageTape& tape = tapes_[i];
    const bool input_available = cur_ == i || held_[i];
    switch (op.kind) {
      case ScheduleOp::Kind::kForward: {
        if (g_ <= i) fail(k, op, "the backward of stage " + std::to_string(i) + " already ran");
        if (!input_available) {
          fail(k, op, "its input a_" + std::to_string(i) + " is neither the current activation nor held");
        }
        if (tape.state == TapeState::kFull) {
          fail(k, op, "the tape of stage " + std::to_string(i) + " is already full; a forward would "
                      "discard it");
        }
        if (op.stashed()) {
          // The same rules for both: the stash takes a_i away from the device.
          const char* what = op.offload ? "a host hold" : "a partitioned hold";
          if (!op.hold_input) {
            fail(k, op, std::string(what) + (op.offload ? " (offload)" : " (partition)") + " needs hold_input");
          }
          if (op.save == SaveOption::kKeep) {
            fail(k, op, std::string(what) + " needs save option selective or checkpoint (a keep tape "
                        "references its input, so stashing it would free nothing)");
          }
          if (i == 0) {
            fail(k, op, std::string(what) + " needs stage > 0 (a_0 is the token ids, not an activation)");
          }
          if (held_[i]) fail(k, op, std::string(what) + " of a_" + std::to_string(i) + ", which is already held");
        }
        const bool staged_input = cur_ != i && held_stash_[i];
        if (op.hold_input && !held_[i]) held_stash_[i] = op.stashed();
        if (op.hold_input) held_[i] = true;
        tape = StageTape{};  // a repeated forward replaces a partial tape
        tape.input_staged = staged_input;
        const bool first = forwards_[i]++ == 0;
        if (costs_ != nullptr) {
          const StageCost& st = costs_->stages[i];
          const OptionCost& c = option_cost(k, op, i, op.save);
          note_fetch_moment(k);
          const size_t start = footprint();
          note_peak(k, start + c.forward_peak_bytes, start + grad_bytes() + c.forward_total_peak_bytes);
          tape.extra_bytes = c.saved_bytes;
          tape.refs_input = c.tape_refs_input;
          tape.refs_output = c.tape_refs_output;
          pred_.compute_s += c.forward_s;
          op_s_.push_back(c.forward_s);
          if (!first) {
            pred_.recompute_s += c.forward_s;
            pred_.recompute_flops += st.forward_flops;
          }
        }
        tape.state = op.save == SaveOption::kKeep ? TapeState::kFull : TapeState::kPartial;
        tape.option = op.save;
        // The loss is consumed at once (Note [Activation bytes]): nothing holds it.
        cur_ = i + 1 < n_ ? i + 1 : -1;
        break;
      }
      case ScheduleOp::Kind::kRecompute: {
        if (tape.state != TapeState::kPartial) {
          fail(k, op, std::string("the tape of stage ") + std::to_string(i) + " is " +
                          (tape.state == TapeState::kEmpty ? "empty" : "already full") +
                          "; recompute needs the partial tape of a selective or checkpoint forward");
        }
        if (!input_available) {
          fail(k, op, "its input a_" + std::to_string(i) + " is neither the current activation nor held");
        }
        if (costs_ != nullptr) {
          const OptionCost& c = option_cost(k, op, i, tape.option);
          const OptionCost& keep = costs_->stages[i].option(SaveOption::kKeep);
          note_fetch_moment(k);
          const size_t start = footprint();
          note_peak(k, start + c.recompute_peak_bytes,
                    start + grad_bytes() + c.recompute_total_peak_bytes);
          tape.extra_bytes += c.recompute_saved_bytes;
          // A completed tape holds what a kKeep forward saves, references included.
          tape.refs_input = keep.tape_refs_input;
          tape.refs_output = keep.tape_refs_output;
          tape.input_staged = cur_ != i && held_stash_[i];
          pred_.compute_s += c.recompute_s;
          op_s_.push_back(c.recompute_s);
          pred_.recompute_s += c.recompute_s;
          pred_.recompute_flops += c.recompute_flops;
        }
        tape.state = TapeState::kFull;
        break;
      }
      case ScheduleOp::Kind::kBackward: {
        if (g_ != i + 1) {
          fail(k, op, g_ <= i ? "the backward of stage " + std::to_string(i) + " already ran"
                              : "the backward of stage " + std::to_string(g_ - 1) +
                                    " must run first (backward runs " + std::to_string(n_ - 1) +
                                    " down to 0)");
        }
        if (tape.state != TapeState::kFull) {
          fail(k, op, std::string("the tape of stage ") + std::to_string(i) + " is " +
                          (tape.state == TapeState::kEmpty ? "empty (no forward ran)"
                                                           : "partial (recompute it first)"));
        }
        if (cur_ == i + 1) cur_ = -1;  // an output nobody needs any more
        if (costs_ != nullptr) {
          const size_t start = footprint();
          note_peak(k, start, start + grad_bytes() + costs_->stages[i].backward_total_peak_bytes);
          pred_.compute_s += costs_->stages[i].backward_s;
          op_s_.push_back(costs_->stages[i].backward_s);
        }
        tape = StageTape{};
        held_[i] = false;
        held_stash_[i] = false;
        g_ = i;
        if (costs_ != nullptr && !costs_->comm.empty()) {
          // The reducer issues the buckets this backward completed, with the footprint and the
          // activation gradient of a_i as the backward left them.
          const size_t after = costs_->comm[static_cast<size_t>(i)].after;
          pred_.peak_comm_bytes = std::max(pred_.peak_comm_bytes, after);
          pred_.peak_total_bytes =
              std::max(pred_.peak_total_bytes, footprint() + grad_bytes() + param_bytes() + after);
          note_op_total(k, footprint() + grad_bytes() + param_bytes() + after);
        }
        break;
      }
    }
    after_ = true;
    if (costs_ != nullptr) {
      pred_.footprint_after_op.push_back(footprint());
      note_op_total(k, 0);  // every op has its entry
    }
  }

  const Schedule& schedule_;
  const ChainCosts* costs_;  // not owned; null when only validating
  const Staging* staging_;   // not owned; null when only validating
  int n_;
  int cur_ = 0;  // index j of the current activation a_j; -1 for none. a_0 = the tokens.
  std::vector<bool> held_;
  std::vector<bool> held_stash_;  // held_[i] is a host or partitioned hold (the stash's)
  std::vector<StageTape> tapes_;
  std::vector<int> forwards_;
  int g_;
  Prediction pred_;
  std::vector<double> op_s_;
  int op_ = 0;          // the op being applied
  bool after_ = false;  // its footprint is taken after it ran
  // Note [Incremental footprint].
  std::vector<size_t> contrib_;  // per a_j, j = 0..n
  size_t act_total_ = 0;
  int last_stage_ = -1;
  int last_cur_ = 0;
  size_t staging_base_ = 0, slice_base_ = 0;                // the arenas
  std::vector<size_t> staging_at_, slices_at_, params_at_;  // per moment, the windows'; empty
                                                            // without windows
  std::vector<size_t> freed_at_op_;                         // per op
};

}  // namespace

std::string Schedule::to_string() const {
  std::string s;
  for (const ScheduleOp& op : ops) {
    if (!s.empty()) s += ' ';
    s += op_string(op);
  }
  return s;
}

void validate(const Schedule& schedule) {
  Replay r(schedule, nullptr);
  r.run();
}

Prediction replay(const Schedule& schedule, const ChainCosts& costs, const Staging& staging,
                  std::vector<double>* op_seconds) {
  Replay r(schedule, &costs, &staging);
  r.run();
  if (op_seconds != nullptr) *op_seconds = r.op_seconds();
  return r.prediction();
}

}  // namespace porter::checkpoint
