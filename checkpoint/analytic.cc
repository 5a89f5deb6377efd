// The analytic op graph's replay (checkpoint/analytic.h): the forward of a stage's graph under
// each save mode, the recompute plan Ctx::plan_recompute makes, and the figures of
// Note [Activation bytes] that follow.
#include "checkpoint/analytic.h"

#include <algorithm>
#include <set>
#include <utility>
#include <vector>

namespace porter::checkpoint {

size_t out_size(const StageGraph& g, Ref r) {
  return r.op >= 0 ? g.ops[r.op].out_bytes[r.slot] : 0;
}

namespace {

// Bytes of the distinct op outputs in `refs` other than the stage output.
size_t tape_bytes(const StageGraph& g, const std::set<Ref>& refs) {
  size_t total = 0;
  for (const Ref& r : refs)
    if (r.op >= 0 && !(r == g.output)) total += out_size(g, r);
  return total;
}

}  // namespace

GraphFigures evaluate(const StageGraph& g, nn::SaveMode mode, const nn::OpPolicy& policy) {
  GraphFigures fig;
  OptionCost& c = fig.cost;
  c.available = true;
  const bool ck = mode == nn::SaveMode::kCheckpoint;
  const int n = static_cast<int>(g.ops.size());

  // Forward: current bytes above the start, with the input alive.
  int64_t cur = 0, peak = 0, total_peak = 0;
  std::vector<std::vector<Ref>> dying(static_cast<size_t>(n));
  for (int k = 0; k < n; ++k) {
    const GraphOp& op = g.ops[k];
    for (size_t s = 0; s < op.out_bytes.size(); ++s) cur += static_cast<int64_t>(op.out_bytes[s]);
    peak = std::max(peak, cur);
    total_peak = std::max(total_peak, cur + static_cast<int64_t>(op.workspace_bytes));
    if (op.dies_after >= 0 && !(ck && policy.keeps(op.kind))) {
      for (size_t s = 0; s < op.out_bytes.size(); ++s) dying[op.dies_after].push_back({k, static_cast<int>(s)});
    }
    for (const Ref& r : dying[k]) cur -= static_cast<int64_t>(out_size(g, r));
  }
  c.forward_peak_bytes = static_cast<size_t>(peak);
  c.forward_total_peak_bytes = static_cast<size_t>(total_peak);
  for (const GraphOp& op : g.ops) fig.has_recomputed_kind |= !policy.keeps(op.kind);

  const std::set<Ref> full(g.saves.begin(), g.saves.end());
  const bool full_refs_input = full.count(Ref{Ref::kInput, 0}) > 0;
  const bool full_refs_output = full.count(g.output) > 0;
  if (!ck) {
    c.saved_bytes = tape_bytes(g, full);
    c.tape_refs_input = full_refs_input;
    c.tape_refs_output = full_refs_output;
    return fig;
  }

  // The recompute plan (Ctx::plan_recompute): walk back from the saved tensors.
  enum class Action { kCompute, kReplay, kSkip };
  std::vector<std::vector<bool>> needed(static_cast<size_t>(n));
  for (int k = 0; k < n; ++k) needed[k].assign(g.ops[k].out_bytes.size(), false);
  for (const Ref& r : g.saves)
    if (r.op >= 0) needed[r.op][r.slot] = true;
  std::vector<Action> action(static_cast<size_t>(n), Action::kSkip);
  std::set<Ref> kept;
  for (int k = n - 1; k >= 0; --k) {
    const GraphOp& op = g.ops[k];
    if (std::find(needed[k].begin(), needed[k].end(), true) == needed[k].end()) continue;
    if (policy.keeps(op.kind)) {
      action[k] = Action::kReplay;
      for (size_t s = 0; s < needed[k].size(); ++s)
        if (needed[k][s]) kept.insert({k, static_cast<int>(s)});
    } else {
      action[k] = Action::kCompute;
      for (const Ref& r : op.inputs)
        if (r.op >= 0) needed[r.op][r.slot] = true;
    }
  }
  c.saved_bytes = tape_bytes(g, kept);
  c.tape_refs_input = false;
  c.tape_refs_output = kept.count(g.output) > 0;

  // The recompute, above (start + saved_bytes).
  cur = 0;
  peak = 0;
  total_peak = 0;
  for (auto& d : dying) d.clear();
  double flops = 0.0;
  for (int k = 0; k < n; ++k) {
    const GraphOp& op = g.ops[k];
    if (action[k] == Action::kSkip) continue;
    if (action[k] == Action::kCompute) {
      for (size_t s = 0; s < op.out_bytes.size(); ++s) cur += static_cast<int64_t>(op.out_bytes[s]);
      peak = std::max(peak, cur);
      total_peak = std::max(total_peak, cur + static_cast<int64_t>(op.workspace_bytes));
      flops += op.flops;
    }
    if (op.dies_after >= 0) {
      // A temporary dies after its consumer, replayed or computed (the tape hands a
      // replayed one over and forgets it), unless it is saved.
      for (size_t s = 0; s < op.out_bytes.size(); ++s) {
        const Ref r{k, static_cast<int>(s)};
        const bool real = action[k] == Action::kCompute || kept.count(r) > 0;
        if (real && full.count(r) == 0) dying[op.dies_after].push_back(r);
      }
    }
    for (const Ref& r : dying[k]) cur -= static_cast<int64_t>(out_size(g, r));
  }
  c.recompute_peak_bytes = static_cast<size_t>(std::max<int64_t>(0, peak));
  c.recompute_total_peak_bytes = static_cast<size_t>(std::max<int64_t>(0, total_peak));
  const size_t after = tape_bytes(g, full);
  // A policy that keeps a tensor backward never reads (to recompute from it) ends with less
  // than it started; the simulator cannot take bytes back, so it sees no growth.
  c.recompute_saved_bytes = after > c.saved_bytes ? after - c.saved_bytes : 0;
  c.recompute_flops = flops;
  return fig;
}

StageCost stage_cost(std::string name, bool is_block, size_t input_bytes, const StageGraph& g,
                     const nn::OpPolicy& selective) {
  StageCost st;
  st.name = std::move(name);
  st.is_block = is_block;
  st.input_bytes = input_bytes;
  st.output_bytes = out_size(g, g.output);
  if (g.output.op < 0) st.output_bytes = input_bytes;
  for (const GraphOp& op : g.ops) st.forward_flops += op.flops;
  st.backward_total_peak_bytes = g.backward_workspace_peak;
  st.option(SaveOption::kKeep) = evaluate(g, nn::SaveMode::kSaveAll, nn::OpPolicy::keep_all()).cost;
  st.option(SaveOption::kCheckpoint) =
      evaluate(g, nn::SaveMode::kCheckpoint, nn::OpPolicy::keep_none()).cost;
  GraphFigures sel = evaluate(g, nn::SaveMode::kCheckpoint, selective);
  // Selective means something only for a stage that runs an op kind the policy recomputes.
  st.option(SaveOption::kSelective) = sel.has_recomputed_kind ? sel.cost : OptionCost{};
  return st;
}

}  // namespace porter::checkpoint
