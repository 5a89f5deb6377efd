// The analytic activation model of the built-in transformers (models/analytic.h): the shared
// embedding and head graphs, the block graph of the architecture's spec, and the figures
// that follow from replaying them (checkpoint/analytic.h).
#include "models/analytic.h"

#include <algorithm>
#include <string>
#include <vector>

#include "base/check.h"
#include "models/factory.h"
#include "models/transformer.h"

namespace porter::models {

using checkpoint::GraphBuilder;
using checkpoint::kExternal;
using checkpoint::kStageInput;
using checkpoint::OptionCost;
using checkpoint::Ref;
using checkpoint::StageGraph;
using checkpoint::WorkspaceTrace;

kernels::AttentionCall attention_call(const TransformerDims& d) {
  return kernels::AttentionCall{static_cast<int64_t>(d.b), static_cast<int64_t>(d.t),
                                static_cast<int64_t>(d.cs), static_cast<int>(d.hs), d.dtype,
                                d.dtype, d.dtype};
}

kernels::FlashAttentionCall flash_attention_call(const TransformerDims& d) {
  return kernels::FlashAttentionCall{static_cast<int64_t>(d.b), static_cast<int64_t>(d.t),
                                     static_cast<int64_t>(d.c / d.h), static_cast<int>(d.hs),
                                     static_cast<int>(d.kvs / (d.c / d.h)), d.dtype, d.dtype,
                                     d.dtype};
}

size_t attention_forward_workspace(const TransformerDims& d) {
  return d.flash ? kernels::flash_attention_forward_workspace_bytes(d.device, flash_attention_call(d))
                 : kernels::attention_forward_workspace_bytes(d.device, attention_call(d));
}

size_t attention_backward_workspace(const TransformerDims& d) {
  return d.flash ? kernels::flash_attention_backward_workspace_bytes(d.device, flash_attention_call(d))
                 : kernels::attention_backward_workspace_bytes(d.device, attention_call(d));
}

TransformerDims dims_of(const TransformerShape& shape) {
  const config::ModelConfig& m = shape.model;
  PORTER_CHECK(m.layers >= 1 && m.hidden >= 1 && m.heads >= 1 && m.vocab >= 1 && m.seq_len >= 1,
               "porter.model: layers, hidden, heads, seq_len and vocab must be >= 1");
  PORTER_CHECK(shape.micro_batch >= 1, "micro-batch size ", shape.micro_batch, " must be >= 1");
  PORTER_CHECK(m.tensor_parallel >= 1 && m.heads % m.tensor_parallel == 0,
               "porter.model.tensor_parallel ", m.tensor_parallel,
               " must be >= 1 and divide heads ", m.heads);
  const int64_t t = shape.seq > 0 ? shape.seq : m.seq_len;
  PORTER_CHECK_LE(t, m.seq_len, "sequence length of the micro-batch (porter.model.seq_len)");
  TransformerDims d;
  d.b = static_cast<size_t>(shape.micro_batch);
  d.t = static_cast<size_t>(t);
  d.c = static_cast<size_t>(m.hidden);
  d.h = static_cast<size_t>(m.heads);
  d.v = static_cast<size_t>(m.vocab);
  d.dt = tensor::dtype_size(shape.compute_dtype);
  d.n = checked_product({{"micro-batch (train_micro_batch_size_per_gpu)", d.b}, {"porter.model.seq_len", d.t}},
                        "the token rows of a micro-batch");
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
  // Note [Architecture spec]: the key/value heads and the MLP width are the spec's.
  const ArchSpec& spec = arch_spec(m.type);
  d.kvs = checked_product({{"porter.model.kv_heads", static_cast<size_t>(spec.kv_heads(m))},
                           {"head dim (porter.model.hidden / heads)", d.c / d.h}},
                          "a block's key/value channels") /
          d.tp;
  d.fs = static_cast<size_t>(spec.intermediate(m)) / d.tp;
  d.flash = m.attention == config::AttentionKind::kFlash;
  PORTER_CHECK(m.loss_tiles >= 0, "porter.model.loss_tiles = ", m.loss_tiles, " must be >= 0");
  d.loss_tiles = static_cast<size_t>(std::max<int64_t>(1, m.loss_tiles));  // 0: not chosen, 1
  PORTER_CHECK(m.mlp_tiles >= 0, "porter.model.mlp_tiles = ", m.mlp_tiles, " must be >= 0");
  PORTER_CHECK(m.mlp_tiles == 1 || !d.sp, "porter.model.mlp_tiles = ", m.mlp_tiles,
               " is not supported with porter.model.sequence_parallel; use mlp_tiles 1");
  d.mlp_tiles = static_cast<size_t>(std::max<int64_t>(1, m.mlp_tiles));  // 0: not chosen, 1
  // Note [Checked sizes]: the largest tensors first, so that an overflow names their keys
  // rather than a sum's.
  (void)d.attn_saved();
  (void)d.logits();
  (void)d.mlp();
  (void)d.kv_col();
  (void)d.res();
  return d;
}

std::string TransformerDims::shape_terms() const {
  return "micro-batch " + std::to_string(b) + ", porter.model.seq_len " + std::to_string(t) +
         ", porter.model.hidden " + std::to_string(c) + ", porter.model.heads " + std::to_string(h) +
         ", porter.model.vocab " + std::to_string(v) + ", MLP width " + std::to_string(fs * tp) +
         ", porter.model.tensor_parallel " + std::to_string(tp) + ", " + std::to_string(dt) +
         " bytes per element";
}

int column_linear_backward(WorkspaceTrace& w, const TransformerDims& d, size_t x_bytes) {
  if (!d.sp) return w.alloc(x_bytes);
  const int xg = w.alloc(d.whole());   // the input, gathered again
  const int dxg = w.alloc(d.whole());  // the whole input gradient, before its reduce-scatter
  const int dx = w.alloc(x_bytes);
  w.free(xg);
  w.free(dxg);
  return dx;
}

int row_linear_backward(WorkspaceTrace& w, const TransformerDims& d, size_t x_bytes) {
  if (!d.sp) return w.alloc(x_bytes);
  const int dyg = w.alloc(d.whole());  // the output gradient, gathered
  const int dx = w.alloc(x_bytes);
  w.free(dyg);
  return dx;
}

int dropout_backward(WorkspaceTrace& w, const TransformerDims& d, size_t bytes) {
  return d.drop ? w.alloc(bytes) : WorkspaceTrace::kNone;
}


namespace {

StageGraph embedding_graph(const TransformerDims& d) {
  GraphBuilder gb;
  // At tp > 1 each rank looks up its vocabulary range; under sp into a whole (B, T, C)
  // workspace that is reduce-scattered into this rank's rows.
  Ref x = gb.op(nn::OpKind::kEmbedding, {d.res()}, {kExternal, kExternal, kExternal}, 0.0,
                d.sp_gather());
  Ref y = gb.dropout(x, d.res(), d.drop, /*temporary=*/false);
  StageGraph& g = gb.graph();
  g.saves = {kStageInput};  // the tokens
  g.output = y;
  WorkspaceTrace w;
  dropout_backward(w, d, d.res());
  if (d.sp) w.alloc(d.whole());  // dy gathered: every rank needs every row for its dwte
  g.backward_workspace_peak = w.peak();
  return g;
}

// TiledLossHead (Note [Loss tiles] in models/transformer.cc): after the norm `lnf`, one op of
// kind loss whose outputs are the loss and the rows' log-sum-exp (N) f32; inside, lnf
// gathered (sequence parallelism), the (N) losses, then per tile its logits, its stats and
// every rank's gathered stats, freed with the tile, and the sum's partials at the end.
StageGraph tiled_head_graph(const TransformerDims& d, GraphBuilder& gb, Ref lnf,
                            const std::vector<Ref>& norm_saves) {
  const std::string terms = d.shape_terms();
  const size_t m = d.tile_rows();
  WorkspaceTrace fw;
  if (d.sp) fw.alloc(d.whole());
  fw.alloc(d.times(4, d.n));  // the losses
  const int tile_logits = fw.alloc(d.logits_tile());
  const int stats = fw.alloc(d.times(12, m));
  fw.transient(d.tp > 1 ? checked_mul(d.times(12, d.tp), m, "a loss tile's gathered stats", terms) : 0);
  fw.free(stats);
  fw.free(tile_logits);
  fw.transient(kernels::reduction_workspace_bytes(d.device, static_cast<int64_t>(d.n)));
  const double nc = static_cast<double>(d.n) * static_cast<double>(d.c);
  Ref loss = gb.op(nn::OpKind::kLoss, {4, d.times(4, d.n)}, {lnf, kExternal, kExternal},
                   2.0 * nc * static_cast<double>(d.vs), fw.peak());
  StageGraph& g = gb.graph();
  g.saves = {kStageInput};
  g.saves.insert(g.saves.end(), norm_saves.begin(), norm_saves.end());
  g.saves.insert(g.saves.end(), {kExternal, GraphBuilder::slot(loss, 1)});
  g.output = loss;
  // TiledLossHead::backward: lnf gathered again (sp), dlnf of every row, one tile's dlogits at
  // a time; under sp dlnf's reduce-scatter into this rank's rows frees both; then dx and the
  // norm's partial weight gradients (sp).
  WorkspaceTrace w;
  const int xg = d.sp ? w.alloc(d.whole()) : WorkspaceTrace::kNone;
  const int dlnf = w.alloc(d.whole());
  w.transient(d.logits_tile());
  if (d.sp) {
    w.alloc(d.res());
    w.free(xg);
    w.free(dlnf);
  }
  w.alloc(d.res());  // dx
  if (d.sp) w.alloc(d.times((norm_saves.size() - 1) * 4, d.c));
  g.backward_workspace_peak = w.peak();
  return g;
}

// TransformerHead: the final norm (a LayerNorm has two statistics, mean and rstd; an RMSNorm
// one), the projection and the loss.
StageGraph head_graph(const TransformerDims& d, Norm norm) {
  GraphBuilder gb;
  const size_t st = d.stat(), logits_bytes = d.logits();
  const double nc = static_cast<double>(d.n) * static_cast<double>(d.c);
  const bool rms = norm == Norm::kRmsNorm;
  Ref lnf = rms ? gb.op(nn::OpKind::kLayerNorm, {d.res(), st}, {kStageInput, kExternal})
                : gb.op(nn::OpKind::kLayerNorm, {d.res(), st, st},
                        {kStageInput, kExternal, kExternal});
  std::vector<Ref> norm_saves = {lnf, GraphBuilder::slot(lnf, 1)};
  if (!rms) norm_saves.push_back(GraphBuilder::slot(lnf, 2));
  if (d.loss_tiles > 1) return tiled_head_graph(d, gb, lnf, norm_saves);
  Ref logits = gb.op(nn::OpKind::kMatmul, {logits_bytes}, {lnf, kExternal},
                     2.0 * nc * static_cast<double>(d.vs), d.sp_gather());
  // The per-row losses are workspace inside the op, and so are the partials of their sum.
  const size_t sum_ws = kernels::reduction_workspace_bytes(d.device, static_cast<int64_t>(d.n));
  Ref loss;
  StageGraph& g = gb.graph();
  if (d.tp == 1) {
    loss = gb.op(nn::OpKind::kLoss, {4}, {logits, kExternal}, 0.0,
                 checked_add(d.times(4, d.n), sum_ws, "the loss's workspace", d.shape_terms()));
    g.saves = {kStageInput};
    g.saves.insert(g.saves.end(), norm_saves.begin(), norm_saves.end());
    g.saves.insert(g.saves.end(), {logits, kExternal});
  } else {
    // Vocabulary-parallel: the loss and the rows' log-sum-exp (N) f32, which backward reads;
    // inside, this rank's (max, sum of exp, target logit) per row, every rank's gathered, and
    // the losses.
    // (1 + tp) x 12 + 4 bytes per row, and the partials.
    const size_t per_row = d.times(12, d.tp + 1) + 4;
    loss = gb.op(nn::OpKind::kLoss, {4, d.times(4, d.n)}, {logits, kExternal}, 0.0,
                 checked_add(d.times(per_row, d.n), sum_ws, "the loss's workspace", d.shape_terms()));
    g.saves = {kStageInput};
    g.saves.insert(g.saves.end(), norm_saves.begin(), norm_saves.end());
    g.saves.insert(g.saves.end(), {logits, kExternal, GraphBuilder::slot(loss, 1)});
  }
  g.output = loss;
  // TransformerHead::backward: dlogits stays alive through a row view until the end, with
  // dlnf and the returned dx.
  WorkspaceTrace w;
  w.alloc(logits_bytes);                  // dlogits
  column_linear_backward(w, d, d.res());  // dlnf
  w.alloc(d.res());                       // dx
  if (d.sp) w.alloc(d.times((rms ? 1 : 2) * 4, d.c));  // RowPartialGrads of the final norm
  g.backward_workspace_peak = w.peak();
  return g;
}

// Note [Checked sizes] for a stage graph: the replay (checkpoint::evaluate) sums the graph's
// outputs and adds an op's workspace to them, so if everything the graph allocates fits, so
// does every figure it derives.
const StageGraph& checked_graph(const StageGraph& g, const TransformerDims& d, const char* stage) {
  const std::string terms = d.shape_terms();
  CheckedSum total(stage);
  for (const checkpoint::GraphOp& op : g.ops) {
    for (size_t bytes : op.out_bytes) total.add(bytes, terms);
    total.add(op.workspace_bytes, terms);
  }
  total.add(g.backward_workspace_peak, terms);
  return g;
}

// Everything one stage's figures can add up to at once: its input and output, its backward
// workspace and every figure of every option. A chain whose stages' bounds sum within 64 bits
// has every peak, sum and delta the planner and the simulator form within them too.
size_t stage_bound(const checkpoint::StageCost& st, const std::string& terms) {
  CheckedSum b("one stage's activations");
  b.add(st.input_bytes, terms).add(st.output_bytes, terms).add(st.backward_total_peak_bytes, terms);
  for (const OptionCost& o : st.options) {
    b.add(o.forward_peak_bytes, terms).add(o.forward_total_peak_bytes, terms).add(o.saved_bytes, terms);
    b.add(o.recompute_peak_bytes, terms).add(o.recompute_total_peak_bytes, terms);
    b.add(o.recompute_saved_bytes, terms);
  }
  return b.value();
}

}  // namespace

checkpoint::ChainCosts analytic_transformer_costs(const TransformerShape& shape,
                                                  const nn::OpPolicy& selective) {
  const TransformerDims d = dims_of(shape);
  const ArchSpec& spec = arch_spec(shape.model.type);
  const std::string terms = d.shape_terms();
  checkpoint::ChainCosts costs;
  costs.source = "analytic";
  costs.selective_ops = selective.to_string();
  StageGraph emb = embedding_graph(d);
  costs.stages.push_back(checkpoint::stage_cost("embedding", false, 0, checked_graph(emb, d, "the embedding"),
                                                selective));
  StageGraph blk = spec.block_graph(d);
  const checkpoint::StageCost block =
      checkpoint::stage_cost("block", true, d.res(), checked_graph(blk, d, "a block"), selective);
  StageGraph head = head_graph(d, spec.norm());
  checkpoint::StageCost head_cost =
      checkpoint::stage_cost("head", false, d.res(), checked_graph(head, d, "the head"), selective);
  // The whole chain's bound (stage_bound): L blocks and the two ends.
  const auto layers = static_cast<size_t>(shape.model.layers);
  const size_t blocks = checked_mul(
      layers, stage_bound(block, terms), "the activations of every block",
      "porter.model.layers " + std::to_string(layers) + " x one block's " +
          std::to_string(stage_bound(block, terms)) + " bytes (" + terms + ")");
  CheckedSum chain("the activations of the chain");
  chain.add(blocks, terms).add(stage_bound(costs.stages.front(), terms), terms);
  chain.add(stage_bound(head_cost, terms), terms);
  costs.stages.reserve(layers + 2);
  for (size_t l = 0; l < layers; ++l) {
    costs.stages.push_back(block);
    costs.stages.back().name = "block." + std::to_string(l);
  }
  costs.stages.push_back(std::move(head_cost));
  return costs;
}

size_t none_peak_bytes(const TransformerShape& shape) {
  // docs/memory-model.md, "The none peak": L blocks' tapes and inputs are alive, plus the
  // head's input, when either the last block's forward or the head's forward peaks; before
  // them, the embedding's forward. r is the residual stream's bytes on this rank (A, or A / t
  // under sequence parallelism). The stage graphs give each term.
  const TransformerDims d = dims_of(shape);
  const ArchSpec& spec = arch_spec(shape.model.type);
  const size_t L = static_cast<size_t>(shape.model.layers);
  const StageGraph emb = embedding_graph(d), blk = spec.block_graph(d);
  const StageGraph head = head_graph(d, spec.norm());
  auto keep = [](const StageGraph& g) {
    return checkpoint::evaluate(g, nn::SaveMode::kSaveAll, nn::OpPolicy::keep_all()).cost;
  };
  const std::string terms = d.shape_terms();
  const OptionCost e = keep(checked_graph(emb, d, "the embedding"));
  const OptionCost b = keep(checked_graph(blk, d, "a block"));
  const OptionCost h = keep(checked_graph(head, d, "the head"));
  const size_t r = d.res();
  const size_t per_block = checked_add(b.saved_bytes, r, "a block's tape and input", terms);
  auto blocks = [&](size_t count) {
    return checked_mul(count, per_block, "the none policy's peak",
                       "porter.model.layers " + std::to_string(L) + " x one block's " +
                           std::to_string(per_block) + " bytes (" + terms + ")");
  };
  CheckedSum before_last("the none policy's peak"), last("the none policy's peak");
  before_last.add(blocks(L - 1), terms).add(r, terms).add(b.forward_peak_bytes, terms);
  last.add(blocks(L), terms).add(r, terms).add(h.forward_peak_bytes, terms);
  return std::max({e.forward_peak_bytes, before_last.value(), last.value()});
}

double korthikanti_layer_bytes(const TransformerShape& shape) {
  const TransformerDims d = dims_of(shape);
  const double s = static_cast<double>(d.t), b = static_cast<double>(d.b);
  const double h = static_cast<double>(d.c), a = static_cast<double>(d.h);
  const double t = static_cast<double>(d.tp);
  // Flash attention keeps no (s, s) matrix: their 5as/h term, the softmax's input and output
  // and the dropout mask, is gone (FlashAttention's own accounting keeps 4 bytes per row and
  // head, which their units do not count).
  const double attn = d.flash ? 0.0 : 5.0 * a * s / h;
  if (d.tp == 1) return s * b * h * (34.0 + attn);
  if (d.sp) return s * b * h * (34.0 + attn) / t;
  return s * b * h * (10.0 + 24.0 / t + attn / t);
}

size_t layer_bytes(const TransformerShape& shape) {
  const TransformerDims d = dims_of(shape);
  const StageGraph blk = arch_spec(shape.model.type).block_graph(d);
  return checked_add(checkpoint::evaluate(checked_graph(blk, d, "a block"), nn::SaveMode::kSaveAll,
                                          nn::OpPolicy::keep_all())
                         .cost.saved_bytes,
                     d.res(), "a block's activations", d.shape_terms());
}

ModelStateBytes model_state_bytes(const config::ModelConfig& model, tensor::DType compute_dtype) {
  // Rank 0's layout (every rank's has its size); allocates nothing.
  const Transformer transformer(model);
  const size_t p = static_cast<size_t>(transformer.layout().total_elems());
  const std::string elems = "the model's " + std::to_string(p) + " parameter elements (porter.model.layers " +
                            std::to_string(model.layers) + ", hidden " + std::to_string(model.hidden) +
                            ", vocab " + std::to_string(model.vocab) + ")";
  const char* what = "the model states";
  ModelStateBytes m;
  m.params = checked_mul(p, tensor::dtype_size(compute_dtype), what, elems + " x bytes per element");
  m.grads = checked_mul(p, 4, what, elems + " x 4 bytes (f32)");
  m.optimizer = checked_mul(p, compute_dtype == tensor::DType::kF32 ? 8 : 12, what,
                            elems + " x the optimizer's bytes per element");
  return m;
}

}  // namespace porter::models
