// The analytic activation model of the built-in GPT: each stage's forward is written down as
// the op graph models/blocks.cc runs on one tensor-parallel rank (outputs, inputs, lifetimes,
// saves), and the byte figures of every save option follow from replaying that graph the way
// nn/ctx.cc does; backward's workspace follows from its allocations in order.
#include "checkpoint/analytic.h"

#include <algorithm>
#include <set>
#include <utility>
#include <vector>

#include "base/check.h"
#include "models/transformer.h"
#include "kernels/kernels.h"

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
//
// At tensor_parallel t > 1 the graph is one rank's (Note [GPT tensor parallelism] in
// models/transformer.h): the same ops with this rank's shapes, and the collectives' buffers as workspace
// inside the op that runs them (a sequence-parallel matmul's gathered input or partial
// output, the sequence-parallel embedding's whole output, the loss's gathered statistics).
// The collectives themselves allocate nothing from the caching allocator. Backward, which
// allocates only workspace, is a WorkspaceTrace of GptBlock::backward and its helpers.
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

// The sizes of one tensor-parallel rank's tensors (Note [GPT tensor parallelism] in
// models/transformer.h). At tp 1 every per-rank size is the whole one.
struct Dims {
  size_t b, t, c, h, v, dt, n;  // n = b * t rows
  size_t tp;                    // ranks of the tensor-parallel group
  bool sp;                      // sequence parallelism (tp > 1 only)
  size_t rows;                  // token rows of the residual stream here: n, or n / tp under sp
  size_t cs, hs;                // this rank's channels C / tp and heads H / tp
  size_t vs;                    // this rank's logit columns: V, or ceil(V / tp) at tp > 1
  bool drop;
  tensor::DType dtype;
  memory::DeviceKind device;
  bool llama = false;           // Note [Llama] in models/transformer.h
  size_t kvs = 0;               // Llama: this rank's key/value channels Hkv * D / tp
  size_t fs = 0;                // Llama: this rank's MLP width F / tp
  size_t kv_col() const { return n * kvs * dt; }  // (B, T, Hkv D / tp)
  size_t mlp() const { return n * fs * dt; }      // (B, T, F / tp)
  size_t whole() const { return n * c * dt; }     // a (B, T, C) activation, A
  size_t res() const { return rows * c * dt; }    // the residual stream's rows here
  size_t col() const { return n * cs * dt; }      // (B, T, C / tp): this rank's channels
  size_t stat() const { return rows * 4; }        // a layernorm mean or rstd (f32)
  size_t probs() const { return b * hs * t * t * 4; }
  // Inside a sequence-parallel matmul: its gathered input (column-parallel) or its partial
  // output (row-parallel), both (N, C).
  size_t sp_gather() const { return sp ? whole() : 0; }
};

// The attention call of a block: this rank's heads, qkv, out, dout and dqkv all in the
// compute dtype.
kernels::AttentionCall attention_call(const Dims& d) {
  return kernels::AttentionCall{static_cast<int64_t>(d.b), static_cast<int64_t>(d.t),
                           static_cast<int64_t>(d.cs), static_cast<int>(d.hs), d.dtype, d.dtype,
                           d.dtype};
}

Dims dims_of(const GptShape& shape) {
  const config::ModelConfig& m = shape.model;
  PORTER_CHECK(m.layers >= 1 && m.hidden >= 1 && m.heads >= 1 && m.vocab >= 1 && m.seq_len >= 1,
               "porter.model: layers, hidden, heads, seq_len and vocab must be >= 1");
  PORTER_CHECK(shape.micro_batch >= 1, "micro-batch size ", shape.micro_batch, " must be >= 1");
  PORTER_CHECK(m.tensor_parallel >= 1 && m.heads % m.tensor_parallel == 0,
               "porter.model.tensor_parallel ", m.tensor_parallel,
               " must be >= 1 and divide heads ", m.heads);
  const int64_t t = shape.seq > 0 ? shape.seq : m.seq_len;
  PORTER_CHECK_LE(t, m.seq_len, "sequence length of the micro-batch (porter.model.seq_len)");
  Dims d;
  d.b = static_cast<size_t>(shape.micro_batch);
  d.t = static_cast<size_t>(t);
  d.c = static_cast<size_t>(m.hidden);
  d.h = static_cast<size_t>(m.heads);
  d.v = static_cast<size_t>(m.vocab);
  d.dt = tensor::dtype_size(shape.compute_dtype);
  d.n = d.b * d.t;
  d.tp = static_cast<size_t>(m.tensor_parallel);
  d.sp = m.sequence_parallel && d.tp > 1;
  PORTER_CHECK(!d.sp || d.n % d.tp == 0, "sequence parallelism: ", d.b, " x ", d.t,
               " token rows do not split into ", d.tp, " equal shards");
  d.rows = d.sp ? d.n / d.tp : d.n;
  d.cs = d.c / d.tp;
  d.hs = d.h / d.tp;
  d.vs = (d.v + d.tp - 1) / d.tp;
  d.drop = m.dropout > 0.0;
  d.dtype = shape.compute_dtype;
  d.device = shape.device;
  d.llama = m.type == config::ModelType::kLlama;
  if (d.llama) {
    const size_t kv = static_cast<size_t>(m.kv_heads == 0 ? m.heads : m.kv_heads);
    d.kvs = kv * (d.c / d.h) / d.tp;
    d.fs = static_cast<size_t>(models::llama_intermediate(m)) / d.tp;
  }
  return d;
}

// The workspace a layer's backward allocates, in its order: alloc returns a handle that free
// (and the handle's end of scope in the layer) releases; peak is the most alive at once. The
// backward models below mirror models/blocks.cc line by line.
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

// models/blocks.cc's backward helpers: each returns its result, dx, whose input x has x_bytes;
// the gathered tensors of sequence parallelism are freed when the helper returns.
int column_linear_backward(WorkspaceTrace& w, const Dims& d, size_t x_bytes) {
  if (!d.sp) return w.alloc(x_bytes);
  const int xg = w.alloc(d.whole());   // the input, gathered again
  const int dxg = w.alloc(d.whole());  // the whole input gradient, before its reduce-scatter
  const int dx = w.alloc(x_bytes);
  w.free(xg);
  w.free(dxg);
  return dx;
}

int row_linear_backward(WorkspaceTrace& w, const Dims& d, size_t x_bytes) {
  if (!d.sp) return w.alloc(x_bytes);
  const int dyg = w.alloc(d.whole());  // the output gradient, gathered
  const int dx = w.alloc(x_bytes);
  w.free(dyg);
  return dx;
}

int dropout_backward(WorkspaceTrace& w, const Dims& d, size_t bytes) {
  return d.drop ? w.alloc(bytes) : WorkspaceTrace::kNone;
}

StageGraph embedding_graph(const Dims& d) {
  GraphBuilder gb;
  // At tp > 1 each rank looks up its vocabulary range; under sp into a whole (B, T, C)
  // workspace that is reduce-scattered into this rank's rows.
  Ref x = gb.op(nn::OpKind::kEmbedding, {d.res()}, {kExt, kExt, kExt}, 0.0, d.sp_gather());
  Ref y = gb.dropout(x, d.res(), d.drop, /*temporary=*/false);
  StageGraph& g = gb.graph();
  g.saves = {kIn};  // the tokens
  g.output = y;
  WorkspaceTrace w;
  dropout_backward(w, d, d.res());
  if (d.sp) w.alloc(d.whole());  // dy gathered: every rank needs every row for its dwte
  g.backward_workspace_peak = w.peak();
  return g;
}

StageGraph block_graph(const Dims& d) {
  GraphBuilder gb;
  const size_t r = d.res(), u = d.col(), st = d.stat();
  const double nc = static_cast<double>(d.n) * static_cast<double>(d.c);
  const double cs = static_cast<double>(d.cs);
  const double ncs = static_cast<double>(d.n) * cs;
  Ref ln1 = gb.op(nn::OpKind::kLayerNorm, {r, st, st}, {kIn, kExt, kExt});
  Ref qkv = gb.op(nn::OpKind::kMatmul, {3 * u}, {ln1, kExt, kExt}, 2.0 * nc * 3.0 * cs,
                  d.sp_gather());
  // The kernel's scratch is workspace inside the op (Note [Kernel workspace]).
  Ref att = gb.op(nn::OpKind::kAttention, {u, d.probs()}, {qkv},
                  4.0 * ncs * static_cast<double>(d.t),
                  kernels::attention_forward_workspace_bytes(d.device, attention_call(d)));
  Ref proj = gb.op(nn::OpKind::kMatmul, {r}, {att, kExt, kExt}, 2.0 * nc * cs, d.sp_gather());
  Ref x2 = gb.op(nn::OpKind::kAdd, {r}, {kIn, gb.dropout(proj, r, d.drop, true)});
  Ref ln2 = gb.op(nn::OpKind::kLayerNorm, {r, st, st}, {x2, kExt, kExt});
  Ref h = gb.op(nn::OpKind::kMatmul, {4 * u}, {ln2, kExt, kExt}, 8.0 * nc * cs, d.sp_gather());
  Ref gl = gb.op(nn::OpKind::kGelu, {4 * u}, {h});
  Ref f = gb.op(nn::OpKind::kMatmul, {r}, {gl, kExt, kExt}, 8.0 * nc * cs, d.sp_gather());
  Ref y = gb.op(nn::OpKind::kAdd, {r}, {x2, gb.dropout(f, r, d.drop, true)});
  StageGraph& g = gb.graph();
  g.saves = {kIn,
             ln1, GraphBuilder::slot(ln1, 1), GraphBuilder::slot(ln1, 2),
             qkv,
             att, GraphBuilder::slot(att, 1),
             x2,
             ln2, GraphBuilder::slot(ln2, 1), GraphBuilder::slot(ln2, 2),
             h, gl};
  g.output = y;
  // GptBlock::backward (docs/memory-model.md, "porter's GPT, op by op").
  WorkspaceTrace w;
  if (d.sp) w.alloc(4 * d.c * 4);  // RowPartialGrads: the layernorms' f32 partial gradients
  const int df = dropout_backward(w, d, r);
  const int dg = row_linear_backward(w, d, 4 * u);
  w.free(df);
  const int dh = w.alloc(4 * u);
  w.free(dg);
  column_linear_backward(w, d, r);  // dln2
  w.free(dh);
  w.alloc(r);  // dx2
  const int dproj = dropout_backward(w, d, r);
  const int datt = row_linear_backward(w, d, u);
  w.free(dproj);
  const int dqkv = w.alloc(3 * u);
  w.transient(kernels::attention_backward_workspace_bytes(d.device, attention_call(d)));
  w.free(datt);
  column_linear_backward(w, d, r);  // dln1
  w.free(dqkv);
  w.alloc(r);  // dx, the result
  g.backward_workspace_peak = w.peak();
  return g;
}

// LlamaBlock (Note [Llama] in models/transformer.h), op by op as models/blocks.cc runs it.
StageGraph llama_block_graph(const Dims& d) {
  GraphBuilder gb;
  const size_t r = d.res(), u = d.col(), kvb = d.kv_col(), fb = d.mlp(), st = d.stat();
  const double nc = static_cast<double>(d.n) * static_cast<double>(d.c);
  const double cs = static_cast<double>(d.cs), kvs = static_cast<double>(d.kvs);
  const double fs = static_cast<double>(d.fs);
  const double ncs = static_cast<double>(d.n) * cs;
  Ref n1 = gb.op(nn::OpKind::kLayerNorm, {r, st}, {kIn, kExt});
  Ref q = gb.op(nn::OpKind::kMatmul, {u}, {n1, kExt}, 2.0 * nc * cs, d.sp_gather());
  Ref k = gb.op(nn::OpKind::kMatmul, {kvb}, {n1, kExt}, 2.0 * nc * kvs, d.sp_gather());
  Ref v = gb.op(nn::OpKind::kMatmul, {kvb}, {n1, kExt}, 2.0 * nc * kvs, d.sp_gather());
  Ref qkv = gb.op(nn::OpKind::kOther, {3 * u}, {q, k, v});
  // The forward drops q, k and v once the rotary op has read them.
  for (Ref t : {q, k, v}) gb.graph().ops[t.op].dies_after = qkv.op;
  Ref att = gb.op(nn::OpKind::kAttention, {u, d.probs()}, {qkv},
                  4.0 * ncs * static_cast<double>(d.t),
                  kernels::attention_forward_workspace_bytes(d.device, attention_call(d)));
  Ref o = gb.op(nn::OpKind::kMatmul, {r}, {att, kExt}, 2.0 * nc * cs, d.sp_gather());
  Ref x2 = gb.op(nn::OpKind::kAdd, {r}, {kIn, gb.dropout(o, r, d.drop, true)});
  Ref n2 = gb.op(nn::OpKind::kLayerNorm, {r, st}, {x2, kExt});
  Ref gate = gb.op(nn::OpKind::kMatmul, {fb}, {n2, kExt}, 2.0 * nc * fs, d.sp_gather());
  Ref up = gb.op(nn::OpKind::kMatmul, {fb}, {n2, kExt}, 2.0 * nc * fs, d.sp_gather());
  Ref a = gb.op(nn::OpKind::kGelu, {fb}, {gate, up});
  Ref f = gb.op(nn::OpKind::kMatmul, {r}, {a, kExt}, 2.0 * nc * fs, d.sp_gather());
  Ref y = gb.op(nn::OpKind::kAdd, {r}, {x2, gb.dropout(f, r, d.drop, true)});
  StageGraph& g = gb.graph();
  g.saves = {kIn, n1, GraphBuilder::slot(n1, 1), qkv, att, GraphBuilder::slot(att, 1),
             x2,  n2, GraphBuilder::slot(n2, 1), gate, up, a};
  g.output = y;
  // LlamaBlock::backward.
  WorkspaceTrace w;
  if (d.sp) w.alloc(2 * d.c * 4);  // RowPartialGrads: the two RMSNorms' f32 partial gradients
  const int df = dropout_backward(w, d, r);
  const int da = row_linear_backward(w, d, fb);
  w.free(df);
  const int dgate = w.alloc(fb);
  const int dup = w.alloc(fb);
  w.free(da);
  const int dn2 = column_linear_backward(w, d, r);
  w.free(dgate);
  const int dn2_up = column_linear_backward(w, d, r);
  w.free(dup);
  w.free(dn2_up);
  w.alloc(r);  // dx2
  w.free(dn2);
  const int dproj = dropout_backward(w, d, r);
  const int datt = row_linear_backward(w, d, u);
  w.free(dproj);
  const int dqkv = w.alloc(3 * u);
  w.transient(kernels::attention_backward_workspace_bytes(d.device, attention_call(d)));
  w.free(datt);
  const int dq = w.alloc(u);
  const int dk = w.alloc(kvb);
  const int dv = w.alloc(kvb);
  w.free(dqkv);
  const int dn1 = column_linear_backward(w, d, r);
  w.free(dq);
  const int dn1_k = column_linear_backward(w, d, r);
  w.free(dk);
  w.free(dn1_k);
  const int dn1_v = column_linear_backward(w, d, r);
  w.free(dv);
  w.free(dn1_v);
  w.alloc(r);  // dx, the result
  w.free(dn1);
  g.backward_workspace_peak = w.peak();
  return g;
}

StageGraph head_graph(const Dims& d) {
  GraphBuilder gb;
  const size_t st = d.stat(), logits_bytes = d.n * d.vs * d.dt;
  const double nc = static_cast<double>(d.n) * static_cast<double>(d.c);
  // The Llama head's RMSNorm has one statistic (rstd) where the layernorm has two.
  Ref lnf = d.llama ? gb.op(nn::OpKind::kLayerNorm, {d.res(), st}, {kIn, kExt})
                    : gb.op(nn::OpKind::kLayerNorm, {d.res(), st, st}, {kIn, kExt, kExt});
  Ref logits = gb.op(nn::OpKind::kMatmul, {logits_bytes}, {lnf, kExt},
                     2.0 * nc * static_cast<double>(d.vs), d.sp_gather());
  // The per-row losses are workspace inside the op, and so are the partials of their sum.
  const size_t sum_ws = kernels::reduction_workspace_bytes(d.device, static_cast<int64_t>(d.n));
  Ref loss;
  StageGraph& g = gb.graph();
  std::vector<Ref> norm_saves = {lnf, GraphBuilder::slot(lnf, 1)};
  if (!d.llama) norm_saves.push_back(GraphBuilder::slot(lnf, 2));
  if (d.tp == 1) {
    loss = gb.op(nn::OpKind::kLoss, {4}, {logits, kExt}, 0.0, d.n * 4 + sum_ws);
    g.saves = {kIn};
    g.saves.insert(g.saves.end(), norm_saves.begin(), norm_saves.end());
    g.saves.insert(g.saves.end(), {logits, kExt});
  } else {
    // Vocabulary-parallel: the loss and the rows' log-sum-exp (N) f32, which backward reads;
    // inside, this rank's (max, sum of exp, target logit) per row, every rank's gathered, and
    // the losses.
    loss = gb.op(nn::OpKind::kLoss, {4, d.n * 4}, {logits, kExt}, 0.0,
                 d.n * 12 + d.tp * d.n * 12 + d.n * 4 + sum_ws);
    g.saves = {kIn};
    g.saves.insert(g.saves.end(), norm_saves.begin(), norm_saves.end());
    g.saves.insert(g.saves.end(), {logits, kExt, GraphBuilder::slot(loss, 1)});
  }
  g.output = loss;
  // GptHead::backward: dlogits stays alive through a row view until the end, with dlnf and
  // the returned dx.
  WorkspaceTrace w;
  w.alloc(logits_bytes);               // dlogits
  column_linear_backward(w, d, d.res());  // dlnf
  w.alloc(d.res());                    // dx
  if (d.sp) w.alloc((d.llama ? 1 : 2) * d.c * 4);  // RowPartialGrads of the final norm
  g.backward_workspace_peak = w.peak();
  return g;
}

}  // namespace

ChainCosts analytic_gpt_costs(const GptShape& shape, const nn::OpPolicy& selective) {
  const Dims d = dims_of(shape);
  ChainCosts costs;
  costs.source = "analytic";
  costs.selective_ops = selective.to_string();
  StageGraph emb = embedding_graph(d);
  costs.stages.push_back(stage_cost("embedding", false, 0, emb, selective));
  StageGraph blk = d.llama ? llama_block_graph(d) : block_graph(d);
  const StageCost block = stage_cost("block", true, d.res(), blk, selective);
  for (int64_t l = 0; l < shape.model.layers; ++l) {
    costs.stages.push_back(block);
    costs.stages.back().name = "block." + std::to_string(l);
  }
  StageGraph head = head_graph(d);
  costs.stages.push_back(stage_cost("head", false, d.res(), head, selective));
  return costs;
}

size_t gpt_none_peak_bytes(const GptShape& shape) {
  // docs/memory-model.md, "The none peak": L blocks' tapes and inputs are alive, plus the
  // head's input, when either the last block's forward or the head's forward peaks. r is
  // the residual stream's bytes on this rank (A, or A / t under sequence parallelism).
  const Dims d = dims_of(shape);
  const size_t L = static_cast<size_t>(shape.model.layers);
  if (d.llama) {
    // The same sum from the stage graphs: the blocks' tapes and inputs, then the peak of the
    // last block's or the head's forward above them.
    StageGraph emb = embedding_graph(d), blk = llama_block_graph(d), head = head_graph(d);
    const OptionCost e = evaluate(emb, nn::SaveMode::kSaveAll, nn::OpPolicy::keep_all()).cost;
    const OptionCost b = evaluate(blk, nn::SaveMode::kSaveAll, nn::OpPolicy::keep_all()).cost;
    const OptionCost h = evaluate(head, nn::SaveMode::kSaveAll, nn::OpPolicy::keep_all()).cost;
    const size_t r = d.res();
    const size_t before_last = (L - 1) * (b.saved_bytes + r) + r;
    return std::max({e.forward_peak_bytes, before_last + b.forward_peak_bytes,
                     L * (b.saved_bytes + r) + r + h.forward_peak_bytes});
  }
  const size_t r = d.res(), u = d.col(), stat = d.stat();
  const size_t block_saved = 3 * r + 12 * u + 4 * stat + d.probs();  // without its input x
  const size_t drop = d.drop ? 1 : 0;
  const size_t before_last_block = (L - 1) * (block_saved + r) + r;
  const size_t last_block = before_last_block + block_saved + (3 + drop) * r;
  const size_t loss = 4 + (d.tp > 1 ? d.n * 4 : 0);  // the loss, and the log-sum-exp at tp > 1
  const size_t head = L * (block_saved + r) + r + r + 2 * stat + d.n * d.vs * d.dt + loss;
  const size_t embedding = (1 + drop) * r;
  return std::max({embedding, last_block, head});
}

double korthikanti_layer_bytes(const GptShape& shape) {
  const Dims d = dims_of(shape);
  const double s = static_cast<double>(d.t), b = static_cast<double>(d.b);
  const double h = static_cast<double>(d.c), a = static_cast<double>(d.h);
  const double t = static_cast<double>(d.tp);
  if (d.tp == 1) return s * b * h * (34.0 + 5.0 * a * s / h);
  if (d.sp) return s * b * h * (34.0 + 5.0 * a * s / h) / t;
  return s * b * h * (10.0 + 24.0 / t + 5.0 * a * s / (h * t));
}

size_t gpt_layer_bytes(const GptShape& shape) {
  const Dims d = dims_of(shape);
  StageGraph blk = d.llama ? llama_block_graph(d) : block_graph(d);
  return evaluate(blk, nn::SaveMode::kSaveAll, nn::OpPolicy::keep_all()).cost.saved_bytes +
         d.res();
}

ModelStateBytes gpt_model_state_bytes(const config::ModelConfig& model, tensor::DType compute_dtype) {
  const models::Gpt gpt(model);  // rank 0's layout (every rank's has its size); allocates nothing
  const size_t p = static_cast<size_t>(gpt.layout().total_elems());
  ModelStateBytes m;
  m.params = p * tensor::dtype_size(compute_dtype);
  m.grads = p * 4;
  m.optimizer = p * 4 * 2 + (compute_dtype == tensor::DType::kF32 ? 0 : p * 4);
  return m;
}

}  // namespace porter::checkpoint
