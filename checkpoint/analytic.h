// The analytic op graph: a stage's forward written down as the ops its layer runs (outputs,
// inputs, lifetimes, saves), and the byte figures of every save option obtained by
// replaying that graph the way nn/ctx.cc does; backward's workspace follows from its
// allocations in order (WorkspaceTrace). Nothing here knows a model: each architecture's
// spec (models/) writes its stages' graphs with these pieces, and docs/memory-model.md
// derives the formulas they reproduce.
#pragma once

#include <algorithm>
#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/costs.h"
#include "nn/ctx.h"

namespace porter::checkpoint {

// Note [Analytic op graph]
// Ctx allocates every op output as an activation (Note [Save context]); what differs between
// modes is only when each output dies:
//   - a named local of Layer::forward lives until the forward returns;
//   - a temporary (the dropout output fed straight into a residual add) dies once the op
//     that consumes it has run — unless a kCheckpoint forward keeps its kind, in which case
//     the op record holds it until end() plans the recompute;
//   - after the forward, the tape holds the saved tensors (kKeep), or the kept outputs the
//     recompute plan needs (kSelective, kCheckpoint); the output lives on as `cur`.
// A recompute allocates the outputs of computed ops, reuses replayed ones (held by the tape)
// and skips the rest; at its end the tape holds exactly what a kKeep forward saves.
// Replaying this graph gives every figure of Note [Activation bytes] to the byte.
//
// A tensor-parallel stage's graph is one rank's: the same ops with this rank's shapes, and
// the collectives' buffers as workspace inside the op that runs them. The collectives
// themselves allocate nothing from the caching allocator. Backward, which allocates only
// workspace, is a WorkspaceTrace of the layer's backward and its helpers.
struct Ref {
  int op = kInput;  // kInput: the stage input; kExternal: parameters, tokens, targets
  int slot = 0;
  static constexpr int kInput = -1;
  static constexpr int kExternal = -2;
  bool operator==(const Ref&) const = default;
  auto operator<=>(const Ref&) const = default;
};

inline constexpr Ref kStageInput{Ref::kInput, 0};
inline constexpr Ref kExternal{Ref::kExternal, 0};

struct GraphOp {
  nn::OpKind kind;
  std::vector<size_t> out_bytes;
  std::vector<Ref> inputs;
  int dies_after = -1;  // a temporary: index of its consumer; -1: a local until return
  double flops = 0.0;
  size_t workspace_bytes = 0;  // allocated and freed inside the op
};

struct StageGraph {
  std::vector<GraphOp> ops;
  std::vector<Ref> saves;
  Ref output;
  size_t backward_workspace_peak = 0;
};

struct GraphFigures {
  OptionCost cost;
  bool has_recomputed_kind = false;
};

// The bytes of output `r` (0 for the stage input and external tensors).
size_t out_size(const StageGraph& g, Ref r);

// The forward under `mode` (kSaveAll or kCheckpoint with `policy`), then for kCheckpoint the
// recompute. Returns the option's figures.
GraphFigures evaluate(const StageGraph& g, nn::SaveMode mode, const nn::OpPolicy& policy);

// A stage's costs under every save option (kSelective only where the stage runs an op kind
// `selective` recomputes). Times are 0.
StageCost stage_cost(std::string name, bool is_block, size_t input_bytes, const StageGraph& g,
                     const nn::OpPolicy& selective);

class GraphBuilder {
 public:
  Ref op(nn::OpKind kind, std::vector<size_t> outs, std::vector<Ref> inputs, double flops = 0.0,
         size_t workspace = 0) {
    g_.ops.push_back({kind, std::move(outs), std::move(inputs), -1, flops, workspace});
    return {static_cast<int>(g_.ops.size()) - 1, 0};
  }
  static Ref slot(Ref r, int s) { return {r.op, s}; }
  // Ctx::dropout: an op only when p > 0. Fed straight into the next op (a residual add), its
  // output is a temporary of that op.
  Ref dropout(Ref x, size_t bytes, bool on, bool temporary) {
    if (!on) return x;
    Ref d = op(nn::OpKind::kDropout, {bytes}, {x});
    if (temporary) g_.ops[d.op].dies_after = d.op + 1;
    return d;
  }
  StageGraph& graph() { return g_; }

 private:
  StageGraph g_;
};

// The workspace a layer's backward allocates, in its order: alloc returns a handle that free
// (and the handle's end of scope in the layer) releases; peak is the most alive at once.
class WorkspaceTrace {
 public:
  static constexpr int kNone = -1;
  int alloc(size_t bytes) {
    sizes_.push_back(bytes);
    cur_ += bytes;
    peak_ = std::max(peak_, cur_);
    return static_cast<int>(sizes_.size()) - 1;
  }
  void free(int handle) {
    if (handle == kNone) return;
    cur_ -= std::exchange(sizes_.at(static_cast<size_t>(handle)), 0);
  }
  // A kernel's scratch: allocated when the call starts, freed before it returns.
  void transient(size_t bytes) { free(alloc(bytes)); }
  size_t peak() const { return peak_; }

 private:
  std::vector<size_t> sizes_;
  size_t cur_ = 0, peak_ = 0;
};

}  // namespace porter::checkpoint
