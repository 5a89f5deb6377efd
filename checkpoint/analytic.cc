// The analytic activation model of the built-in GPT: each stage's forward is written down as
// the op graph nn/gpt_blocks.cc runs (outputs, inputs, lifetimes, saves), and the byte
// figures of every save option follow from replaying that graph the way nn/ctx.cc does.
#include "checkpoint/analytic.h"

#include <algorithm>
#include <set>

#include "base/check.h"
#include "nn/gpt.h"
#include "nn/kernels.h"

namespace porter::checkpoint {

namespace {

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
struct Ref {
  int op = kInput;  // kInput: the stage input; kExternal: parameters, tokens, targets
  int slot = 0;
  static constexpr int kInput = -1;
  static constexpr int kExternal = -2;
  bool operator==(const Ref&) const = default;
  auto operator<=>(const Ref&) const = default;
};

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

size_t out_size(const StageGraph& g, Ref r) {
  return r.op >= 0 ? g.ops[r.op].out_bytes[r.slot] : 0;
}

// Bytes of the distinct op outputs in `refs` other than the stage output.
size_t tape_bytes(const StageGraph& g, const std::set<Ref>& refs) {
  size_t total = 0;
  for (const Ref& r : refs)
    if (r.op >= 0 && !(r == g.output)) total += out_size(g, r);
  return total;
}

// The forward under `mode` (kSaveAll or kCheckpoint with `policy`), then for kCheckpoint the
// recompute. Returns the option's figures.
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

constexpr Ref kIn{Ref::kInput, 0};
constexpr Ref kExt{Ref::kExternal, 0};

StageCost stage_cost(std::string name, bool is_block, size_t input_bytes, StageGraph& g,
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

struct Dims {
  size_t b, t, c, h, v, dt, n;  // n = b * t rows
  bool drop;
  nn::DType dtype;
  memory::DeviceKind device;
};

// The attention call of a block: qkv, out, dout and dqkv all in the compute dtype.
nn::AttentionCall attention_call(const Dims& d) {
  return nn::AttentionCall{static_cast<int64_t>(d.b), static_cast<int64_t>(d.t),
                           static_cast<int64_t>(d.c), static_cast<int>(d.h), d.dtype, d.dtype,
                           d.dtype};
}

Dims dims_of(const GptShape& shape) {
  const config::ModelConfig& m = shape.model;
  PORTER_CHECK(m.layers >= 1 && m.hidden >= 1 && m.heads >= 1 && m.vocab >= 1 && m.seq_len >= 1,
               "porter.model: layers, hidden, heads, seq_len and vocab must be >= 1");
  PORTER_CHECK(shape.micro_batch >= 1, "micro-batch size ", shape.micro_batch, " must be >= 1");
  const int64_t t = shape.seq > 0 ? shape.seq : m.seq_len;
  PORTER_CHECK_LE(t, m.seq_len, "sequence length of the micro-batch (porter.model.seq_len)");
  Dims d;
  d.b = static_cast<size_t>(shape.micro_batch);
  d.t = static_cast<size_t>(t);
  d.c = static_cast<size_t>(m.hidden);
  d.h = static_cast<size_t>(m.heads);
  d.v = static_cast<size_t>(m.vocab);
  d.dt = nn::dtype_size(shape.compute_dtype);
  d.n = d.b * d.t;
  d.drop = m.dropout > 0.0;
  d.dtype = shape.compute_dtype;
  d.device = shape.device;
  return d;
}

StageGraph embedding_graph(const Dims& d) {
  GraphBuilder gb;
  const size_t act = d.n * d.c * d.dt;
  Ref x = gb.op(nn::OpKind::kEmbedding, {act}, {kExt, kExt, kExt});
  Ref y = gb.dropout(x, act, d.drop, /*temporary=*/false);
  StageGraph& g = gb.graph();
  g.saves = {kIn};  // the tokens
  g.output = y;
  g.backward_workspace_peak = d.drop ? act : 0;  // dropout backward's dx
  return g;
}

StageGraph block_graph(const Dims& d) {
  GraphBuilder gb;
  const size_t a = d.n * d.c * d.dt, stat = d.n * 4;
  const double nc = static_cast<double>(d.n) * static_cast<double>(d.c);
  const double cc = static_cast<double>(d.c);
  Ref ln1 = gb.op(nn::OpKind::kLayerNorm, {a, stat, stat}, {kIn, kExt, kExt});
  Ref qkv = gb.op(nn::OpKind::kMatmul, {3 * a}, {ln1, kExt, kExt}, 2.0 * nc * 3.0 * cc);
  // The kernel's scratch is workspace inside the op (Note [Kernel workspace]).
  Ref att = gb.op(nn::OpKind::kAttention, {a, d.b * d.h * d.t * d.t * 4}, {qkv},
                  4.0 * nc * static_cast<double>(d.t),
                  nn::attention_forward_workspace_bytes(d.device, attention_call(d)));
  Ref proj = gb.op(nn::OpKind::kMatmul, {a}, {att, kExt, kExt}, 2.0 * nc * cc);
  Ref x2 = gb.op(nn::OpKind::kAdd, {a}, {kIn, gb.dropout(proj, a, d.drop, true)});
  Ref ln2 = gb.op(nn::OpKind::kLayerNorm, {a, stat, stat}, {x2, kExt, kExt});
  Ref h = gb.op(nn::OpKind::kMatmul, {4 * a}, {ln2, kExt, kExt}, 8.0 * nc * cc);
  Ref gl = gb.op(nn::OpKind::kGelu, {4 * a}, {h});
  Ref f = gb.op(nn::OpKind::kMatmul, {a}, {gl, kExt, kExt}, 8.0 * nc * cc);
  Ref y = gb.op(nn::OpKind::kAdd, {a}, {x2, gb.dropout(f, a, d.drop, true)});
  StageGraph& g = gb.graph();
  g.saves = {kIn,
             ln1, GraphBuilder::slot(ln1, 1), GraphBuilder::slot(ln1, 2),
             qkv,
             att, GraphBuilder::slot(att, 1),
             x2,
             ln2, GraphBuilder::slot(ln2, 1), GraphBuilder::slot(ln2, 2),
             h, gl};
  g.output = y;
  // GptBlock::backward's workspace, in units of a (docs/memory-model.md, "porter's GPT, op
  // by op"): df (dropout) δ, dg 4, dh 4 while the GELU backward runs; or df δ, dln2 1, dx2 1,
  // dproj δ, datt 1, dqkv 3 and the attention kernel's scratch while attention backward
  // runs. The returned dx is part of the later, smaller moments.
  const size_t drop = d.drop ? 1 : 0;
  g.backward_workspace_peak =
      std::max((8 + drop) * a, (6 + 2 * drop) * a + nn::attention_backward_workspace_bytes(
                                                        d.device, attention_call(d)));
  return g;
}

StageGraph head_graph(const Dims& d) {
  GraphBuilder gb;
  const size_t a = d.n * d.c * d.dt, stat = d.n * 4;
  const double nc = static_cast<double>(d.n) * static_cast<double>(d.c);
  Ref lnf = gb.op(nn::OpKind::kLayerNorm, {a, stat, stat}, {kIn, kExt, kExt});
  Ref logits = gb.op(nn::OpKind::kMatmul, {d.n * d.v * d.dt}, {lnf, kExt}, 2.0 * nc * static_cast<double>(d.v));
  // The per-row losses are workspace inside the op, and so are the partials of their sum.
  Ref loss = gb.op(nn::OpKind::kLoss, {4}, {logits, kExt}, 0.0,
                   d.n * 4 + nn::reduction_workspace_bytes(d.device, static_cast<int64_t>(d.n)));
  StageGraph& g = gb.graph();
  g.saves = {kIn, lnf, GraphBuilder::slot(lnf, 1), GraphBuilder::slot(lnf, 2), logits, kExt};
  g.output = loss;
  // GptHead::backward: dlogits stays alive through a row view until the end, with dlnf and
  // the returned dx.
  g.backward_workspace_peak = d.n * d.v * d.dt + 2 * a;
  return g;
}

}  // namespace

ChainCosts analytic_gpt_costs(const GptShape& shape, const nn::OpPolicy& selective) {
  const Dims d = dims_of(shape);
  const size_t act = d.n * d.c * d.dt;
  ChainCosts costs;
  costs.source = "analytic";
  costs.selective_ops = selective.to_string();
  StageGraph emb = embedding_graph(d);
  costs.stages.push_back(stage_cost("embedding", false, 0, emb, selective));
  StageGraph blk = block_graph(d);
  const StageCost block = stage_cost("block", true, act, blk, selective);
  for (int64_t l = 0; l < shape.model.layers; ++l) {
    costs.stages.push_back(block);
    costs.stages.back().name = "block." + std::to_string(l);
  }
  StageGraph head = head_graph(d);
  costs.stages.push_back(stage_cost("head", false, act, head, selective));
  return costs;
}

size_t gpt_none_peak_bytes(const GptShape& shape) {
  // docs/memory-model.md, "The none peak": L blocks' tapes and inputs are alive, plus the
  // head's input, when either the last block's forward or the head's forward peaks.
  const Dims d = dims_of(shape);
  const size_t L = static_cast<size_t>(shape.model.layers);
  const size_t a = d.n * d.c * d.dt, stat = d.n * 4;
  const size_t probs = d.b * d.h * d.t * d.t * 4;
  const size_t block_saved = 15 * a + 4 * stat + probs;  // without its input x
  const size_t drop = d.drop ? 1 : 0;
  const size_t before_last_block = (L - 1) * (block_saved + a) + a;
  const size_t last_block = before_last_block + block_saved + (3 + drop) * a;
  const size_t head = L * (block_saved + a) + a + a + 2 * stat + d.n * d.v * d.dt + 4;
  const size_t embedding = (1 + drop) * a;
  return std::max({embedding, last_block, head});
}

ModelStateBytes gpt_model_state_bytes(const config::ModelConfig& model, nn::DType compute_dtype) {
  const nn::Gpt gpt(model);  // builds the layout only; allocates nothing
  const size_t p = static_cast<size_t>(gpt.layout().total_elems());
  ModelStateBytes m;
  m.params = p * nn::dtype_size(compute_dtype);
  m.grads = p * 4;
  m.optimizer = p * 4 * 2 + (compute_dtype == nn::DType::kF32 ? 0 : p * 4);
  return m;
}

}  // namespace porter::checkpoint
