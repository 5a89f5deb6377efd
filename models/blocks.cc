// The transformer's layers: embedding, the GPT and Llama blocks and head, each a forward
// through ctx and a hand-written backward from what the forward saved, whole or split over a
// tensor-parallel group (Note [GPT tensor parallelism] in models/transformer.h).
#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "base/check.h"
#include "models/transformer.h"

namespace porter::models {

namespace {

// Rows of a (B, T, C) activation as a 2-D (N, C) view.
Tensor rows(const Tensor& t) { return t.reshape({t.numel() / t.dim(-1), t.dim(-1)}); }

// Backward of y (N, out) = x (N, in) @ w (out, in)^T + b: returns dx (N, in) and accumulates
// dw += dy^T @ x and db += sum_rows(dy).
Tensor linear_backward(Ctx& ctx, const Tensor& dy, const Tensor& x, const Tensor& w,
                       Tensor& dw, Tensor* db) {
  Kernels& k = ctx.kernels();
  Tensor dy2 = rows(dy), x2 = rows(x);
  Tensor dx = ctx.workspace(x.shape(), x.dtype());
  Tensor dx2 = rows(dx);
  k.matmul(dy2, w, dx2);                                     // (N, out) @ (out, in)
  k.matmul(dy2, x2, dw, MatmulSpec{true, false, 1.0f, 1.0f});  // (out, N) @ (N, in), +=
  if (db != nullptr) k.bias_backward(dy2, *db);
  return dx;
}

// dy through dropout site `site` (p > 0), or dy itself; element_offset as in Ctx::dropout.
Tensor dropout_backward(Ctx& ctx, const Tensor& dy, float p, int site,
                        int64_t element_offset = 0) {
  if (p == 0.0f) return dy;
  Tensor dx = ctx.workspace(dy.shape(), dy.dtype());
  ctx.kernels().dropout_backward(dy, dx, p, ctx.dropout_key_for(site, element_offset));
  return dx;
}

// ---- tensor-parallel building blocks (Note [GPT tensor parallelism]) ----

void check_group(const Ctx& ctx, const TpShard& tp, const char* layer) {
  PORTER_CHECK(ctx.tp_size() == tp.size && ctx.tp_rank() == tp.rank, layer,
               " was built as tensor-parallel rank ", tp.rank, " of ", tp.size,
               ", but the ctx's group is rank ", ctx.tp_rank(), " of ", ctx.tp_size(),
               " (Ctx::set_tensor_parallel)");
}

// Where this rank's rows start in a sequence-parallel tensor of which it holds `shard`.
int64_t shard_offset(const TpShard& tp, const Tensor& shard) {
  return tp.sequence_parallel ? tp.rank * shard.numel() : 0;
}

// y = x @ w^T + b with w this rank's rows (out/t, in). x is whole (.., in), or under sequence
// parallelism this rank's rows (N/t, in), all-gathered first into workspace; y (N, out/t).
Tensor column_linear(Ctx& ctx, std::string_view name, const Tensor& x, const Tensor& w,
                     const Tensor& b, const TpShard& tp) {
  if (!tp.sequence_parallel) return ctx.linear(name, x, w, b);
  const int64_t n = x.dim(0) * tp.size, in = x.dim(1), out = w.dim(0);
  return ctx.op(OpKind::kMatmul, name, {x, w, b}, {{Shape{n, out}, x.dtype()}},
                [&](std::span<Tensor> o) {
                  Tensor xg = ctx.workspace(Shape{n, in}, x.dtype());
                  comm::Work gather = ctx.tp_all_gather(x, xg);
                  ctx.tp_wait(gather);
                  ctx.kernels().matmul(xg, w, o[0], MatmulSpec{false, true});
                  if (b.data() != nullptr) ctx.kernels().bias_add(o[0], b);
                })[0];
}

// y = sum over the group of (x @ w^T) + b, with x (.., in/t) this rank's columns and w its
// columns (out, in/t). y is whole (.., out), or this rank's rows (N/t, out) under sequence
// parallelism (a reduce-scatter instead of the all-reduce).
Tensor row_linear(Ctx& ctx, std::string_view name, const Tensor& x, const Tensor& w,
                  const Tensor& b, const TpShard& tp) {
  if (tp.size == 1) return ctx.linear(name, x, w, b);
  const int64_t n = x.numel() / x.dim(-1), out = w.dim(0);
  std::vector<int64_t> dims = x.shape().to_vector();
  dims.back() = out;
  const Shape shape = tp.sequence_parallel ? Shape{n / tp.size, out} : Shape(dims);
  return ctx.op(OpKind::kMatmul, name, {x, w, b}, {{shape, x.dtype()}},
                [&](std::span<Tensor> o) {
                  Kernels& k = ctx.kernels();
                  Tensor y = rows(o[0]);
                  if (tp.sequence_parallel) {
                    Tensor partial = ctx.workspace(Shape{n, out}, x.dtype());
                    k.matmul(rows(x), w, partial, MatmulSpec{false, true});
                    comm::Work rs = ctx.tp_reduce_scatter(partial, y);
                    ctx.tp_wait(rs);
                  } else {
                    k.matmul(rows(x), w, y, MatmulSpec{false, true});
                    comm::Work ar = ctx.tp_all_reduce(y);
                    ctx.tp_wait(ar);
                  }
                  if (b.data() != nullptr) k.bias_add(y, b);
                })[0];
}

// Backward of column_linear: accumulates dw += dy^T @ x (x gathered again under sequence
// parallelism) and db += sum_rows(dy), and returns dx = dy @ w summed over the group (whole,
// or this rank's rows under sequence parallelism). The sum runs on the comm stream while the
// weight gradient is computed.
Tensor column_linear_backward(Ctx& ctx, const Tensor& dy, const Tensor& x, const Tensor& w,
                              Tensor& dw, Tensor* db, const TpShard& tp) {
  if (tp.size == 1) return linear_backward(ctx, dy, x, w, dw, db);
  Kernels& k = ctx.kernels();
  Tensor dy2 = rows(dy);
  if (!tp.sequence_parallel) {
    Tensor dx = ctx.workspace(x.shape(), x.dtype());
    Tensor dx2 = rows(dx);
    k.matmul(dy2, w, dx2);
    comm::Work sum = ctx.tp_all_reduce(dx2);
    k.matmul(dy2, rows(x), dw, MatmulSpec{true, false, 1.0f, 1.0f});
    if (db != nullptr) k.bias_backward(dy2, *db);
    ctx.tp_wait(sum);
    return dx;
  }
  const int64_t n = dy2.dim(0), in = w.dim(1);
  Tensor xg = ctx.workspace(Shape{n, in}, x.dtype());
  comm::Work gather = ctx.tp_all_gather(x, xg);
  Tensor dxg = ctx.workspace(Shape{n, in}, x.dtype());
  k.matmul(dy2, w, dxg);  // while x is gathered
  Tensor dx = ctx.workspace(x.shape(), x.dtype());
  Tensor dx2 = rows(dx);
  comm::Work sum = ctx.tp_reduce_scatter(dxg, dx2);
  ctx.tp_wait(gather);
  k.matmul(dy2, xg, dw, MatmulSpec{true, false, 1.0f, 1.0f});
  if (db != nullptr) k.bias_backward(dy2, *db);
  ctx.tp_wait(sum);
  return dx;
}

// Backward of row_linear: dy is whole (the same on every rank), or this rank's rows under
// sequence parallelism, all-gathered first. db is then complete on every rank.
Tensor row_linear_backward(Ctx& ctx, const Tensor& dy, const Tensor& x, const Tensor& w,
                           Tensor& dw, Tensor* db, const TpShard& tp) {
  if (!tp.sequence_parallel) return linear_backward(ctx, dy, x, w, dw, db);
  const int64_t n = x.numel() / x.dim(-1);
  Tensor dyg = ctx.workspace(Shape{n, w.dim(0)}, dy.dtype());
  comm::Work gather = ctx.tp_all_gather(dy, dyg);
  ctx.tp_wait(gather);
  return linear_backward(ctx, dyg, x, w, dw, db);
}

// Layernorm weight gradients under sequence parallelism are partial sums over this rank's
// rows. The layer computes them into one zeroed buffer, then finish() sums it over the group
// and accumulates into the bound gradients. Without sequence parallelism the views are the
// bound gradients themselves and finish() does nothing.
class RowPartialGrads {
 public:
  RowPartialGrads(Ctx& ctx, const TpShard& tp, std::initializer_list<Tensor*> grads)
      : ctx_(ctx), grads_(grads) {
    if (!tp.sequence_parallel) {
      for (Tensor* g : grads_) views_.push_back(*g);
      return;
    }
    int64_t total = 0;
    for (Tensor* g : grads_) total += g->numel();
    buffer_ = ctx.workspace(Shape{total}, grads_.front()->dtype());
    ctx.kernels().fill(buffer_, 0.0f);
    int64_t at = 0;
    for (Tensor* g : grads_) {
      views_.push_back(buffer_.slice(at, at + g->numel()).reshape(g->shape()));
      at += g->numel();
    }
  }
  Tensor& view(size_t i) { return views_.at(i); }
  void finish() {
    if (!buffer_.defined()) return;
    comm::Work sum = ctx_.tp_all_reduce(buffer_);
    ctx_.tp_wait(sum);
    for (size_t i = 0; i < grads_.size(); ++i) ctx_.kernels().accumulate(*grads_[i], views_[i]);
  }

 private:
  Ctx& ctx_;
  std::vector<Tensor*> grads_;
  std::vector<Tensor> views_;
  Tensor buffer_;
};

// ---- the MLP over tiles of the token rows (Note [MLP tiles]) ----

// Note [MLP tiles]
// With porter.model.mlp_tiles = k > 1 a block's MLP (GPT: fc1, GELU, fc2; Llama: gate, up,
// SwiGLU, down) is one op, "mlp", over contiguous tiles of the N = B*T token rows:
// R = ceil(N/k) rows each, [i*R, min((i+1)*R, N)), the last one shorter; tiles past N are
// empty and not run (k > N runs N tiles of one row), as Note [Loss tiles] splits the head.
//   forward:  per tile, its intermediates ((R, 4C/t) h and GELU g; or (R, F/t) gate, up and
//             SwiGLU a) are workspace, computed from the tile's rows of the MLP input (ln2 or
//             n2), and the tile's output rows written by the last matmul; the workspace is
//             freed before the next tile. At t > 1 the row-parallel partial outputs of every
//             tile are summed by one all-reduce of the whole (N, C) output after the last
//             tile, then the fc2 bias is added, as the untiled row_linear does.
//   backward: per tile, the intermediates are recomputed from the saved MLP input; then
//             dW2 += dy[tile]^T g (down: dy^T a), dg = dy[tile] W2, dh from the activation's
//             backward (written over g, or a, which is no longer read), dW1 += dh^T x[tile]
//             (the Llama: gate and up each), db1 += the tile's row sums, and dx[tile] = dh W1
//             (the Llama: dgate Wg, plus dup Wu added after). Weight gradients accumulate
//             tile by tile in row order; the fc2 bias gradient is one sum over all rows after
//             the loop, as untiled. At t > 1 one all-reduce of the whole dx follows.
// The block saves the MLP input and its norm's statistics (as untiled) but none of the
// intermediates: 2 x (B, T, 4C/t) fewer bytes for the GPT, 3 x (B, T, F/t) for the Llama.
// Inside the op, forward holds 2 (GPT) or 3 (Llama) tile-sized intermediates; backward holds
// 3 (GPT: h, g, dg) or 5 then 4 and a (R, C) product (Llama: gate, up, a, da, dup; then da
// freed and dup Wu computed) besides the whole dx (models/gpt.cc and models/llama.cc,
// block_graph, to the byte). The cost is the first matmul(s) run again in backward (GPT: fc1,
// 2 N C 4C/t FLOPs; Llama: gate and up, 4 N C F/t), beside the recompute a checkpoint policy
// already pays.
//
// Kind: the op is kMatmul, its time being its matmuls. Its output is never saved (only the
// MLP input is), so under every checkpoint policy a recompute skips it; its kind decides only
// what an op-kind list such as "keep {matmul}" says of it, and `selective` (which recomputes
// only attention) keeps it like the untiled fc1 and fc2. The block's op sequence is the same
// in every mode: ..., ln2 (post_norm), mlp, drop2, res2.
//
// What is bit-identical: every row of the intermediates and of the output is computed by the
// same kernels on the same row of the input as untiled; with matmul rows that do not depend
// on how many rows are multiplied with them (the cpu kernels' case; tests/engine/
// engine_mlp_tiles_test.cc checks it), the block's output, and so every activation and every
// loss, is the same bits for every k, and so is dx: the activation gradients, and with them
// every gradient but the MLP's own weights, agree across k. dW1, db1 and dW2 (the Llama's
// gate, up and down) sum over the rows tile by tile (the matmul's inner dimension split,
// partials added in tile order), so they agree across k only within f32 rounding; the order
// is fixed, so each k is deterministic and bit-identical across checkpoint policies. At
// t > 1 the Llama sums dgate Wg + dup Wu before its one all-reduce where untiled all-reduces
// each, so there dx agrees with untiled within rounding too.
//
// Sequence parallelism is refused (config check and the block): its MLP input is this rank's
// N/t rows, and a tile would need its rows gathered from every rank.

// Rows of each MLP tile but the last: ceil(rows / tiles).
int64_t mlp_tile_rows(int64_t rows, int64_t tiles) { return (rows + tiles - 1) / tiles; }

void check_mlp_tiles(const TpShard& tp, int64_t tiles, const char* layer) {
  PORTER_CHECK(tiles >= 1, layer, ": porter.model.mlp_tiles = ", tiles, " must be >= 1");
  PORTER_CHECK(tiles == 1 || !tp.sequence_parallel, layer, ": porter.model.mlp_tiles = ", tiles,
               " is not supported with porter.model.sequence_parallel; use mlp_tiles 1");
}

// The GPT's MLP: y = gelu(x @ w1^T + b1) @ w2^T + b2 over tiles; x (.., C), w1 this rank's
// rows (4C/t, C), w2 its columns (C, 4C/t); y whole (.., C).
Tensor gelu_mlp_tiles(Ctx& ctx, const Tensor& x, const Tensor& w1, const Tensor& b1,
                      const Tensor& w2, const Tensor& b2, const TpShard& tp, int64_t tiles) {
  const int64_t n = x.numel() / x.dim(-1), f = w1.dim(0);
  std::vector<int64_t> dims = x.shape().to_vector();
  dims.back() = w2.dim(0);
  return ctx.op(OpKind::kMatmul, "mlp", {x, w1, b1, w2, b2}, {{Shape(dims), x.dtype()}},
                [&](std::span<Tensor> o) {
                  Kernels& k = ctx.kernels();
                  const Tensor xr = rows(x);
                  Tensor y = rows(o[0]);
                  const int64_t tile = mlp_tile_rows(n, tiles);
                  for (int64_t r0 = 0; r0 < n; r0 += tile) {
                    const int64_t r1 = std::min(n, r0 + tile), m = r1 - r0;
                    Tensor h = ctx.workspace(Shape{m, f}, x.dtype());
                    k.matmul(xr.slice(r0, r1), w1, h, MatmulSpec{false, true});
                    k.bias_add(h, b1);
                    Tensor g = ctx.workspace(Shape{m, f}, x.dtype());
                    k.gelu_forward(h, g);
                    Tensor yt = y.slice(r0, r1);
                    k.matmul(g, w2, yt, MatmulSpec{false, true});
                  }
                  if (tp.size > 1) {
                    comm::Work ar = ctx.tp_all_reduce(y);
                    ctx.tp_wait(ar);
                  }
                  k.bias_add(y, b2);
                })[0];
}

// Backward of gelu_mlp_tiles from its saved input x: returns dx (x's shape, summed over the
// group) and accumulates the four gradients.
Tensor gelu_mlp_tiles_backward(Ctx& ctx, const Tensor& dy, const Tensor& x, const Tensor& w1,
                               const Tensor& b1, const Tensor& w2, Tensor& dw1, Tensor& db1,
                               Tensor& dw2, Tensor& db2, const TpShard& tp, int64_t tiles) {
  Kernels& k = ctx.kernels();
  const int64_t n = x.numel() / x.dim(-1), f = w1.dim(0);
  const Tensor xr = rows(x), dyr = rows(dy);
  Tensor dx = ctx.workspace(x.shape(), x.dtype());
  Tensor dxr = rows(dx);
  const int64_t tile = mlp_tile_rows(n, tiles);
  for (int64_t r0 = 0; r0 < n; r0 += tile) {
    const int64_t r1 = std::min(n, r0 + tile), m = r1 - r0;
    const Tensor xt = xr.slice(r0, r1), dyt = dyr.slice(r0, r1);
    Tensor h = ctx.workspace(Shape{m, f}, x.dtype());
    k.matmul(xt, w1, h, MatmulSpec{false, true});
    k.bias_add(h, b1);
    Tensor g = ctx.workspace(Shape{m, f}, x.dtype());
    k.gelu_forward(h, g);
    k.matmul(dyt, g, dw2, MatmulSpec{true, false, 1.0f, 1.0f});  // (C, m) @ (m, 4C/t), +=
    Tensor dg = ctx.workspace(Shape{m, f}, x.dtype());
    k.matmul(dyt, w2, dg);  // (m, C) @ (C, 4C/t)
    Tensor& dh = g;         // g is read no more
    k.gelu_backward(h, dg, dh);
    Tensor dxt = dxr.slice(r0, r1);
    k.matmul(dh, w1, dxt);  // (m, 4C/t) @ (4C/t, C)
    k.matmul(dh, xt, dw1, MatmulSpec{true, false, 1.0f, 1.0f});
    k.bias_backward(dh, db1);
  }
  k.bias_backward(dyr, db2);
  if (tp.size > 1) {
    comm::Work sum = ctx.tp_all_reduce(dxr);
    ctx.tp_wait(sum);
  }
  return dx;
}

// The Llama's MLP: y = (silu(x @ wg^T) * (x @ wu^T)) @ wd^T over tiles; wg and wu this rank's
// rows (F/t, C), wd its columns (C, F/t); y whole (.., C).
Tensor swiglu_mlp_tiles(Ctx& ctx, const Tensor& x, const Tensor& wg, const Tensor& wu,
                        const Tensor& wd, const TpShard& tp, int64_t tiles) {
  const int64_t n = x.numel() / x.dim(-1), f = wg.dim(0);
  std::vector<int64_t> dims = x.shape().to_vector();
  dims.back() = wd.dim(0);
  return ctx.op(OpKind::kMatmul, "mlp", {x, wg, wu, wd}, {{Shape(dims), x.dtype()}},
                [&](std::span<Tensor> o) {
                  Kernels& k = ctx.kernels();
                  const Tensor xr = rows(x);
                  Tensor y = rows(o[0]);
                  const int64_t tile = mlp_tile_rows(n, tiles);
                  for (int64_t r0 = 0; r0 < n; r0 += tile) {
                    const int64_t r1 = std::min(n, r0 + tile), m = r1 - r0;
                    const Tensor xt = xr.slice(r0, r1);
                    Tensor gate = ctx.workspace(Shape{m, f}, x.dtype());
                    k.matmul(xt, wg, gate, MatmulSpec{false, true});
                    Tensor up = ctx.workspace(Shape{m, f}, x.dtype());
                    k.matmul(xt, wu, up, MatmulSpec{false, true});
                    Tensor a = ctx.workspace(Shape{m, f}, x.dtype());
                    k.swiglu_forward(gate, up, a);
                    Tensor yt = y.slice(r0, r1);
                    k.matmul(a, wd, yt, MatmulSpec{false, true});
                  }
                  if (tp.size > 1) {
                    comm::Work ar = ctx.tp_all_reduce(y);
                    ctx.tp_wait(ar);
                  }
                })[0];
}

// Backward of swiglu_mlp_tiles from its saved input x: returns dx (x's shape, summed over
// the group) and accumulates the three weight gradients.
Tensor swiglu_mlp_tiles_backward(Ctx& ctx, const Tensor& dy, const Tensor& x, const Tensor& wg,
                                 const Tensor& wu, const Tensor& wd, Tensor& dwg, Tensor& dwu,
                                 Tensor& dwd, const TpShard& tp, int64_t tiles) {
  Kernels& k = ctx.kernels();
  const int64_t n = x.numel() / x.dim(-1), f = wg.dim(0), c = x.dim(-1);
  const Tensor xr = rows(x), dyr = rows(dy);
  Tensor dx = ctx.workspace(x.shape(), x.dtype());
  Tensor dxr = rows(dx);
  const int64_t tile = mlp_tile_rows(n, tiles);
  for (int64_t r0 = 0; r0 < n; r0 += tile) {
    const int64_t r1 = std::min(n, r0 + tile), m = r1 - r0;
    const Tensor xt = xr.slice(r0, r1), dyt = dyr.slice(r0, r1);
    Tensor gate = ctx.workspace(Shape{m, f}, x.dtype());
    k.matmul(xt, wg, gate, MatmulSpec{false, true});
    Tensor up = ctx.workspace(Shape{m, f}, x.dtype());
    k.matmul(xt, wu, up, MatmulSpec{false, true});
    Tensor a = ctx.workspace(Shape{m, f}, x.dtype());
    k.swiglu_forward(gate, up, a);
    k.matmul(dyt, a, dwd, MatmulSpec{true, false, 1.0f, 1.0f});  // (C, m) @ (m, F/t), +=
    Tensor da = ctx.workspace(Shape{m, f}, x.dtype());
    k.matmul(dyt, wd, da);  // (m, C) @ (C, F/t)
    Tensor& dgate = a;      // a is read no more
    Tensor dup = ctx.workspace(Shape{m, f}, x.dtype());
    k.swiglu_backward(gate, up, da, dgate, dup);
    da = Tensor();
    Tensor dxt = dxr.slice(r0, r1);
    k.matmul(dgate, wg, dxt);  // (m, F/t) @ (F/t, C)
    k.matmul(dgate, xt, dwg, MatmulSpec{true, false, 1.0f, 1.0f});
    Tensor dx_up = ctx.workspace(Shape{m, c}, x.dtype());
    k.matmul(dup, wu, dx_up);
    k.accumulate(dxt, dx_up);
    k.matmul(dup, xt, dwu, MatmulSpec{true, false, 1.0f, 1.0f});
  }
  if (tp.size > 1) {
    comm::Work sum = ctx.tp_all_reduce(dxr);
    ctx.tp_wait(sum);
  }
  return dx;
}

}  // namespace

// ---- embedding ----

enum EmbeddingParam : size_t { kWte, kWpe };

TransformerEmbedding::TransformerEmbedding(int64_t vocab, int64_t positions, int64_t hidden,
                                           float dropout, const TpShard& tp,
                                           std::string token_name, std::string position_name)
    : vocab_(vocab),
      max_seq_(positions),
      hidden_(hidden),
      dropout_(dropout),
      tp_(tp),
      token_name_(std::move(token_name)),
      position_name_(std::move(position_name)) {}

std::vector<ParamSpec> TransformerEmbedding::params() const {
  const int64_t rows = tp_.size == 1 ? vocab_ : tp_.vocab_shard;
  if (max_seq_ == 0) return {{token_name_, Shape{rows, hidden_}}};
  return {{token_name_, Shape{rows, hidden_}}, {position_name_, Shape{max_seq_, hidden_}}};
}

Tensor TransformerEmbedding::forward(Ctx& ctx, const Tensor& tokens) {
  PORTER_CHECK(tokens.rank() == 2 && tokens.dtype() == DType::kI32,
               "GPT input tokens must be (B, T) i32, got ", tokens.shape().to_string(), " ",
               dtype_name(tokens.dtype()));
  const bool rotary = max_seq_ == 0;  // no position table
  if (!rotary) {
    PORTER_CHECK_LE(tokens.dim(1), max_seq_, "sequence length of the batch (model seq_len)");
  }
  check_group(ctx, tp_, "TransformerEmbedding");
  const Tensor& wte = param(kWte);
  const Tensor wpe = rotary ? Tensor() : param(kWpe);
  const int64_t b = tokens.dim(0), t = tokens.dim(1);
  const DType dtype = ctx.compute_dtype();
  Tensor x;
  if (tp_.size == 1 && rotary) {
    x = ctx.op(OpKind::kEmbedding, "embed", {tokens, wte}, {{Shape{b, t, hidden_}, dtype}},
               [&](std::span<Tensor> out) {
                 ctx.kernels().embedding_forward_vocab_range(tokens, wte, 0, Tensor(), out[0]);
               })[0];
  } else if (tp_.size == 1) {
    x = ctx.op(OpKind::kEmbedding, "embed", {tokens, wte, wpe}, {{Shape{b, t, hidden_}, dtype}},
               [&](std::span<Tensor> out) {
                 ctx.kernels().embedding_forward(tokens, wte, wpe, out[0]);
               })[0];
  } else {
    PORTER_CHECK(!tp_.sequence_parallel || (b * t) % tp_.size == 0, "sequence parallelism: ",
                 b, " x ", t, " token rows do not split into ", tp_.size, " equal shards");
    const Shape shape =
        tp_.sequence_parallel ? Shape{b * t / tp_.size, hidden_} : Shape{b, t, hidden_};
    // Each rank looks up the tokens of its vocabulary range; rank 0 adds the positions, so
    // the sum over the group is wte[token] + wpe[t].
    x = ctx.op(OpKind::kEmbedding, "embed", {tokens, wte, wpe}, {{shape, dtype}},
               [&](std::span<Tensor> out) {
                 const Tensor positions = tp_.rank == 0 ? wpe : Tensor();
                 if (tp_.sequence_parallel) {
                   Tensor whole = ctx.workspace(Shape{b, t, hidden_}, dtype);
                   ctx.kernels().embedding_forward_vocab_range(tokens, wte, tp_.vocab_begin(),
                                                               positions, whole);
                   comm::Work rs = ctx.tp_reduce_scatter(whole, out[0]);
                   ctx.tp_wait(rs);
                 } else {
                   ctx.kernels().embedding_forward_vocab_range(tokens, wte, tp_.vocab_begin(),
                                                               positions, out[0]);
                   comm::Work ar = ctx.tp_all_reduce(out[0]);
                   ctx.tp_wait(ar);
                 }
               })[0];
  }
  ctx.save("tokens", tokens);
  return ctx.dropout("drop", x, dropout_, shard_offset(tp_, x));
}

Tensor TransformerEmbedding::backward(Ctx& ctx, const Tensor& dy) {
  Tensor dx = dropout_backward(ctx, dy, dropout_, 0, shard_offset(tp_, dy));
  const Tensor& tokens = ctx.saved("tokens");
  const bool rotary = max_seq_ == 0;
  Tensor no_positions;
  Tensor& dwpe = rotary ? no_positions : grad(kWpe);
  if (tp_.size == 1 && !rotary) {
    ctx.kernels().embedding_backward(dx, tokens, grad(kWte), dwpe);
    return Tensor();
  }
  if (tp_.sequence_parallel) {
    Tensor whole = ctx.workspace(Shape{tokens.dim(0), tokens.dim(1), hidden_}, dx.dtype());
    comm::Work gather = ctx.tp_all_gather(dx, whole);
    ctx.tp_wait(gather);
    dx = whole;
  }
  // Every rank has the whole dy: dwpe is complete everywhere, dwte for its own rows.
  ctx.kernels().embedding_backward_vocab_range(dx, tokens, tp_.vocab_begin(), grad(kWte), dwpe);
  return Tensor();
}

// ---- block ----

enum BlockParam : size_t {
  kLn1W, kLn1B, kQkvW, kQkvB, kProjW, kProjB, kLn2W, kLn2B, kFc1W, kFc1B, kFc2W, kFc2B
};

GptBlock::GptBlock(int64_t hidden, int heads, float dropout, const TpShard& tp, float norm_eps,
                   bool flash, int64_t mlp_tiles)
    : hidden_(hidden),
      heads_(heads),
      dropout_(dropout),
      tp_(tp),
      eps_(norm_eps),
      flash_(flash),
      mlp_tiles_(mlp_tiles) {
  check_mlp_tiles(tp_, mlp_tiles_, "GptBlock");
}

std::vector<ParamSpec> GptBlock::params() const {
  const int64_t c = hidden_, cs = hidden_ / tp_.size;  // cs: this rank's channels
  return {{"ln1.weight", Shape{c}},          {"ln1.bias", Shape{c}},
          {"qkv.weight", Shape{3 * cs, c}},  {"qkv.bias", Shape{3 * cs}},
          {"proj.weight", Shape{c, cs}},     {"proj.bias", Shape{c}},
          {"ln2.weight", Shape{c}},          {"ln2.bias", Shape{c}},
          {"fc1.weight", Shape{4 * cs, c}},  {"fc1.bias", Shape{4 * cs}},
          {"fc2.weight", Shape{c, 4 * cs}},  {"fc2.bias", Shape{c}}};
}

Tensor GptBlock::forward(Ctx& ctx, const Tensor& x) {  // x (B, T, C), or (N/t, C) under sp
  check_group(ctx, tp_, "GptBlock");
  const int heads = heads_ / tp_.size;
  auto [ln1, mean1, rstd1] = ctx.layernorm("ln1", x, param(kLn1W), param(kLn1B), eps_);
  Tensor qkv = column_linear(ctx, "qkv", ln1, param(kQkvW), param(kQkvB), tp_);
  if (tp_.sequence_parallel) {  // (N, 3C/t) -> (B, T, 3C/t)
    const RunInfo& run = ctx.run();
    PORTER_CHECK(run.batch * run.seq == qkv.dim(0), "sequence parallelism needs the "
                 "micro-batch's (batch, seq) in RunInfo (Ctx::set_run); got ", run.batch, " x ",
                 run.seq, " for ", qkv.dim(0), " token rows");
    qkv = qkv.reshape({run.batch, run.seq, qkv.dim(1)});
  }
  // (B, T, C/t), and (B, H/t, T, T) probabilities or, with flash, (B, H/t, T) lse
  auto [att, probs] = flash_ ? ctx.flash_attention("attn", qkv, heads, heads)
                             : ctx.attention("attn", qkv, heads);
  Tensor proj = row_linear(ctx, "proj", att, param(kProjW), param(kProjB), tp_);
  const int64_t offset = shard_offset(tp_, x);
  Tensor x2 = ctx.add("res1", x, ctx.dropout("drop1", proj, dropout_, offset));
  auto [ln2, mean2, rstd2] = ctx.layernorm("ln2", x2, param(kLn2W), param(kLn2B), eps_);
  Tensor h, g, f;  // (.., 4C/t), (.., 4C/t) untiled; (.., C)
  if (mlp_tiles_ == 1) {
    h = column_linear(ctx, "fc1", ln2, param(kFc1W), param(kFc1B), tp_);
    g = ctx.gelu("gelu", h);
    f = row_linear(ctx, "fc2", g, param(kFc2W), param(kFc2B), tp_);
  } else {
    f = gelu_mlp_tiles(ctx, ln2, param(kFc1W), param(kFc1B), param(kFc2W), param(kFc2B), tp_,
                       mlp_tiles_);
  }
  Tensor y = ctx.add("res2", x2, ctx.dropout("drop2", f, dropout_, offset));
  ctx.save("x", x);
  ctx.save("ln1", ln1);
  ctx.save("mean1", mean1);
  ctx.save("rstd1", rstd1);
  ctx.save("qkv", qkv);
  ctx.save("att", att);
  ctx.save(flash_ ? "lse" : "probs", probs);
  ctx.save("x2", x2);
  ctx.save("ln2", ln2);
  ctx.save("mean2", mean2);
  ctx.save("rstd2", rstd2);
  if (mlp_tiles_ == 1) {
    ctx.save("h", h);
    ctx.save("g", g);
  }
  return y;
}

Tensor GptBlock::backward(Ctx& ctx, const Tensor& dy) {
  Kernels& k = ctx.kernels();
  const int heads = heads_ / tp_.size;
  const int64_t offset = shard_offset(tp_, dy);
  RowPartialGrads ln_grads(ctx, tp_, {&grad(kLn2W), &grad(kLn2B), &grad(kLn1W), &grad(kLn1B)});
  // Second half: y = x2 + drop2(fc2(gelu(fc1(ln2(x2))))).
  Tensor df = dropout_backward(ctx, dy, dropout_, 1, offset);
  Tensor dln2;
  if (mlp_tiles_ == 1) {
    Tensor dg = row_linear_backward(ctx, df, ctx.saved("g"), param(kFc2W), grad(kFc2W),
                                    &grad(kFc2B), tp_);
    df = Tensor();
    const Tensor& h = ctx.saved("h");
    Tensor dh = ctx.workspace(h.shape(), h.dtype());
    k.gelu_backward(h, dg, dh);
    dg = Tensor();
    dln2 = column_linear_backward(ctx, dh, ctx.saved("ln2"), param(kFc1W), grad(kFc1W),
                                  &grad(kFc1B), tp_);
  } else {
    dln2 = gelu_mlp_tiles_backward(ctx, df, ctx.saved("ln2"), param(kFc1W), param(kFc1B),
                                   param(kFc2W), grad(kFc1W), grad(kFc1B), grad(kFc2W),
                                   grad(kFc2B), tp_, mlp_tiles_);
    df = Tensor();
  }
  Tensor dx2 = ctx.grad_like(dy);
  Tensor dx2_rows = rows(dx2);
  k.layernorm_backward(rows(dln2), rows(ctx.saved("x2")), param(kLn2W), ctx.saved("mean2"),
                       ctx.saved("rstd2"), dx2_rows, ln_grads.view(0), ln_grads.view(1));
  k.accumulate(dx2, dy);  // the residual path
  // First half: x2 = x + drop1(proj(attn(qkv(ln1(x))))).
  Tensor dproj = dropout_backward(ctx, dx2, dropout_, 0, offset);
  Tensor datt = row_linear_backward(ctx, dproj, ctx.saved("att"), param(kProjW), grad(kProjW),
                                    &grad(kProjB), tp_);
  dproj = Tensor();
  const Tensor& qkv = ctx.saved("qkv");
  Tensor dqkv = ctx.workspace(qkv.shape(), qkv.dtype());
  if (flash_) {
    k.flash_attention_backward(datt, qkv, ctx.saved("att"), ctx.saved("lse"), dqkv, heads, heads);
  } else {
    k.attention_backward(datt, qkv, ctx.saved("probs"), dqkv, heads);
  }
  datt = Tensor();
  Tensor dln1 = column_linear_backward(ctx, dqkv, ctx.saved("ln1"), param(kQkvW), grad(kQkvW),
                                       &grad(kQkvB), tp_);
  dqkv = Tensor();
  Tensor dx = ctx.grad_like(dy);
  Tensor dx_rows = rows(dx);
  k.layernorm_backward(rows(dln1), rows(ctx.saved("x")), param(kLn1W), ctx.saved("mean1"),
                       ctx.saved("rstd1"), dx_rows, ln_grads.view(2), ln_grads.view(3));
  k.accumulate(dx, dx2);
  ln_grads.finish();
  return dx;
}

// ---- Llama block (Note [Llama]) ----

enum LlamaParam : size_t {
  kInNorm, kQ, kK, kV, kO, kPostNorm, kGate, kUp, kDown,
  kQBias, kKBias, kVBias  // with LlamaShape::qkv_bias
};

LlamaBlock::LlamaBlock(const LlamaShape& shape, float dropout, const TpShard& tp)
    : shape_(shape), dropout_(dropout), tp_(tp) {
  check_mlp_tiles(tp_, shape_.mlp_tiles, "LlamaBlock");
}

std::vector<ParamSpec> LlamaBlock::params() const {
  const int64_t c = shape_.hidden, d = c / shape_.heads;
  const int64_t qs = c / tp_.size, kvs = shape_.kv_heads * d / tp_.size;
  const int64_t fs = shape_.intermediate / tp_.size;
  std::vector<ParamSpec> p = {{"input_layernorm.weight", Shape{c}},
                               {"self_attn.q_proj.weight", Shape{qs, c}},
                               {"self_attn.k_proj.weight", Shape{kvs, c}},
                               {"self_attn.v_proj.weight", Shape{kvs, c}},
                               {"self_attn.o_proj.weight", Shape{c, qs}},
                               {"post_attention_layernorm.weight", Shape{c}},
                               {"mlp.gate_proj.weight", Shape{fs, c}},
                               {"mlp.up_proj.weight", Shape{fs, c}},
                               {"mlp.down_proj.weight", Shape{c, fs}}};
  if (shape_.qkv_bias) {
    p.push_back({"self_attn.q_proj.bias", Shape{qs}});
    p.push_back({"self_attn.k_proj.bias", Shape{kvs}});
    p.push_back({"self_attn.v_proj.bias", Shape{kvs}});
  }
  return p;
}

Tensor LlamaBlock::forward(Ctx& ctx, const Tensor& x) {  // x (B, T, C), or (N/t, C) under sp
  check_group(ctx, tp_, "LlamaBlock");
  const int heads = shape_.heads / tp_.size, kv = shape_.kv_heads / tp_.size;
  const Tensor none;
  auto [n1, r1] = ctx.rmsnorm("input_norm", x, param(kInNorm), shape_.norm_eps);
  const bool bias = shape_.qkv_bias;
  Tensor q = column_linear(ctx, "q_proj", n1, param(kQ), bias ? param(kQBias) : none, tp_);
  Tensor k = column_linear(ctx, "k_proj", n1, param(kK), bias ? param(kKBias) : none, tp_);
  Tensor v = column_linear(ctx, "v_proj", n1, param(kV), bias ? param(kVBias) : none, tp_);
  // (B, T, .) for the rotary op: the micro-batch's shape under sequence parallelism.
  const RunInfo& run = ctx.run();
  const int64_t b = tp_.sequence_parallel ? run.batch : x.dim(0);
  const int64_t t = tp_.sequence_parallel ? run.seq : x.dim(1);
  PORTER_CHECK(b * t == q.numel() / q.dim(-1), "LlamaBlock: ", b, " x ", t, " token rows for ",
               q.numel() / q.dim(-1), " (under sequence parallelism the micro-batch's (batch, "
               "seq) come from RunInfo, Ctx::set_run)");
  // (B, T, 3C/t) with k and v expanded to every query head, or with flash (B, T, (H + 2 Hkv)
  // D / t) as they are (Note [Rotary qkv] in kernels/kernels.cc).
  Tensor qkv = ctx.rope_qkv("rope", q.reshape({b, t, q.dim(-1)}), k.reshape({b, t, k.dim(-1)}),
                            v.reshape({b, t, v.dim(-1)}), heads, kv, shape_.rope_theta,
                            shape_.flash);
  q = k = v = Tensor();
  // (B, T, C/t), and (B, H/t, T, T) probabilities or, with flash, (B, H/t, T) lse
  auto [att, probs] = shape_.flash ? ctx.flash_attention("attn", qkv, heads, kv)
                                   : ctx.attention("attn", qkv, heads);
  Tensor o = row_linear(ctx, "o_proj", att, param(kO), none, tp_);
  const int64_t offset = shard_offset(tp_, x);
  Tensor x2 = ctx.add("res1", x, ctx.dropout("drop1", o, dropout_, offset));
  auto [n2, r2] = ctx.rmsnorm("post_norm", x2, param(kPostNorm), shape_.norm_eps);
  Tensor gate, up, a, f;  // (.., F/t) each untiled; (.., C)
  if (shape_.mlp_tiles == 1) {
    gate = column_linear(ctx, "gate_proj", n2, param(kGate), none, tp_);
    up = column_linear(ctx, "up_proj", n2, param(kUp), none, tp_);
    a = ctx.swiglu("swiglu", gate, up);
    f = row_linear(ctx, "down_proj", a, param(kDown), none, tp_);
  } else {
    f = swiglu_mlp_tiles(ctx, n2, param(kGate), param(kUp), param(kDown), tp_, shape_.mlp_tiles);
  }
  Tensor y = ctx.add("res2", x2, ctx.dropout("drop2", f, dropout_, offset));
  ctx.save("x", x);
  ctx.save("n1", n1);
  ctx.save("r1", r1);
  ctx.save("qkv", qkv);
  ctx.save("att", att);
  ctx.save(shape_.flash ? "lse" : "probs", probs);
  ctx.save("x2", x2);
  ctx.save("n2", n2);
  ctx.save("r2", r2);
  if (shape_.mlp_tiles == 1) {
    ctx.save("gate", gate);
    ctx.save("up", up);
    ctx.save("a", a);
  }
  return y;
}

Tensor LlamaBlock::backward(Ctx& ctx, const Tensor& dy) {
  Kernels& k = ctx.kernels();
  const int heads = shape_.heads / tp_.size, kv = shape_.kv_heads / tp_.size;
  const int64_t offset = shard_offset(tp_, dy);
  RowPartialGrads norm_grads(ctx, tp_, {&grad(kPostNorm), &grad(kInNorm)});
  // Second half: y = x2 + drop2(down(silu(gate(n2)) * up(n2))).
  Tensor df = dropout_backward(ctx, dy, dropout_, 1, offset);
  const Tensor& n2 = ctx.saved("n2");
  Tensor dn2;
  if (shape_.mlp_tiles == 1) {
    Tensor da = row_linear_backward(ctx, df, ctx.saved("a"), param(kDown), grad(kDown), nullptr,
                                    tp_);
    df = Tensor();
    const Tensor& gate = ctx.saved("gate");
    Tensor dgate = ctx.workspace(gate.shape(), gate.dtype());
    Tensor dup = ctx.workspace(gate.shape(), gate.dtype());
    k.swiglu_backward(gate, ctx.saved("up"), da, dgate, dup);
    da = Tensor();
    dn2 = column_linear_backward(ctx, dgate, n2, param(kGate), grad(kGate), nullptr, tp_);
    dgate = Tensor();
    Tensor dn2_up = column_linear_backward(ctx, dup, n2, param(kUp), grad(kUp), nullptr, tp_);
    dup = Tensor();
    k.accumulate(dn2, dn2_up);
  } else {
    dn2 = swiglu_mlp_tiles_backward(ctx, df, n2, param(kGate), param(kUp), param(kDown),
                                    grad(kGate), grad(kUp), grad(kDown), tp_, shape_.mlp_tiles);
    df = Tensor();
  }
  Tensor dx2 = ctx.grad_like(dy);
  Tensor dx2_rows = rows(dx2);
  k.rmsnorm_backward(rows(dn2), rows(ctx.saved("x2")), param(kPostNorm), ctx.saved("r2"),
                     dx2_rows, norm_grads.view(0));
  dn2 = Tensor();
  k.accumulate(dx2, dy);  // the residual path
  // First half: x2 = x + drop1(o(attention(rope(q(n1), k(n1)), v(n1)))).
  Tensor dproj = dropout_backward(ctx, dx2, dropout_, 0, offset);
  Tensor datt = row_linear_backward(ctx, dproj, ctx.saved("att"), param(kO), grad(kO), nullptr,
                                    tp_);
  dproj = Tensor();
  const Tensor& qkv = ctx.saved("qkv");
  Tensor dqkv = ctx.workspace(qkv.shape(), qkv.dtype());
  if (shape_.flash) {
    k.flash_attention_backward(datt, qkv, ctx.saved("att"), ctx.saved("lse"), dqkv, heads, kv);
  } else {
    k.attention_backward(datt, qkv, ctx.saved("probs"), dqkv, heads);
  }
  datt = Tensor();
  const int64_t b = qkv.dim(0), t = qkv.dim(1), d = shape_.hidden / shape_.heads;
  Tensor dq = ctx.workspace(Shape{b, t, heads * d}, qkv.dtype());
  Tensor dk = ctx.workspace(Shape{b, t, kv * d}, qkv.dtype());
  Tensor dv = ctx.workspace(Shape{b, t, kv * d}, qkv.dtype());
  k.rope_qkv_backward(dqkv, dq, dk, dv, heads, kv, shape_.rope_theta);
  dqkv = Tensor();
  const Tensor& n1 = ctx.saved("n1");
  // Column-parallel inputs are (N, .) under sequence parallelism, (B, T, .) otherwise.
  auto as_output = [&](const Tensor& g) {
    return tp_.sequence_parallel ? g.reshape({b * t, g.dim(-1)}) : g;
  };
  const bool bias = shape_.qkv_bias;
  Tensor dn1 = column_linear_backward(ctx, as_output(dq), n1, param(kQ), grad(kQ),
                                      bias ? &grad(kQBias) : nullptr, tp_);
  dq = Tensor();
  Tensor dn1_k = column_linear_backward(ctx, as_output(dk), n1, param(kK), grad(kK),
                                        bias ? &grad(kKBias) : nullptr, tp_);
  dk = Tensor();
  k.accumulate(dn1, dn1_k);
  dn1_k = Tensor();
  Tensor dn1_v = column_linear_backward(ctx, as_output(dv), n1, param(kV), grad(kV),
                                        bias ? &grad(kVBias) : nullptr, tp_);
  dv = Tensor();
  k.accumulate(dn1, dn1_v);
  dn1_v = Tensor();
  Tensor dx = ctx.grad_like(dy);
  Tensor dx_rows = rows(dx);
  k.rmsnorm_backward(rows(dn1), rows(ctx.saved("x")), param(kInNorm), ctx.saved("r1"), dx_rows,
                     norm_grads.view(1));
  dn1 = Tensor();
  k.accumulate(dx, dx2);
  norm_grads.finish();
  return dx;
}

// ---- head ----

enum HeadParam : size_t { kLnfW, kLnfB, kHeadW };

TransformerHead::TransformerHead(int64_t vocab, int64_t hidden, bool tied, const TpShard& tp,
                                 Norm norm, float norm_eps, std::string norm_name,
                                 std::string head_name)
    : vocab_(vocab),
      hidden_(hidden),
      tied_(tied),
      tp_(tp),
      norm_(norm),
      eps_(norm_eps),
      norm_name_(std::move(norm_name)),
      head_name_(std::move(head_name)) {}

std::vector<ParamSpec> TransformerHead::params() const {
  const int64_t rows = tp_.size == 1 ? vocab_ : tp_.vocab_shard;
  std::vector<ParamSpec> p = {{norm_name_ + ".weight", Shape{hidden_}}};
  if (norm_ == Norm::kLayerNorm) p.push_back({norm_name_ + ".bias", Shape{hidden_}});
  if (!tied_) p.push_back({head_name_, Shape{rows, hidden_}});
  return p;
}

void TransformerHead::bind(std::span<const Tensor> params, std::span<const Tensor> grads) {
  const size_t norms = norm_ == Norm::kRmsNorm ? 1 : 2;
  PORTER_CHECK_EQ(params.size(), tied_ ? norms : norms + 1, "TransformerHead parameter views");
  lnf_w_ = params[0];
  dlnf_w_ = grads[0];
  if (norms == 2) {
    lnf_b_ = params[kLnfB];
    dlnf_b_ = grads[kLnfB];
  }
  if (!tied_) {
    head_w_ = params[norms];
    dhead_w_ = grads[norms];
  }
}

void TransformerHead::bind_tied(const Tensor& wte, const Tensor& dwte) {
  PORTER_CHECK(tied_, "bind_tied on an untied head");
  head_w_ = wte;
  dhead_w_ = dwte;
}

Tensor TransformerHead::logits(Ctx& ctx, const Tensor& x) {
  check_group(ctx, tp_, "TransformerHead");
  Tensor normed;
  if (norm_ == Norm::kRmsNorm) {
    normed = ctx.rmsnorm(norm_name_, x, lnf_w_, eps_)[0];
  } else {
    normed = ctx.layernorm(norm_name_, x, lnf_w_, lnf_b_, eps_)[0];
  }
  return column_linear(ctx, "head", normed, head_w_, Tensor(), tp_);
}

Tensor TransformerHead::forward(Ctx& ctx, const Tensor& x) {
  check_group(ctx, tp_, "TransformerHead");
  const int64_t n = targets_.defined() ? targets_.numel() : 0;
  const int64_t rows_here = tp_.sequence_parallel ? n / tp_.size : n;
  PORTER_CHECK(targets_.defined() && rows_here * hidden_ == x.numel(),
               "TransformerHead: set_targets with the micro-batch's (B, T) targets before forward");
  Tensor lnf, mean, rstd;
  if (norm_ == Norm::kRmsNorm) {
    auto outs = ctx.rmsnorm(norm_name_, x, lnf_w_, eps_);
    lnf = outs[0];
    rstd = outs[1];
  } else {
    auto outs = ctx.layernorm(norm_name_, x, lnf_w_, lnf_b_, eps_);
    lnf = outs[0];
    mean = outs[1];
    rstd = outs[2];
  }
  // (B, T, V), or this rank's vocabulary columns (N, Vs) under tensor parallelism.
  Tensor logits = column_linear(ctx, "head", lnf, head_w_, Tensor(), tp_);
  Tensor targets = targets_.reshape({n});
  Tensor loss;
  if (tp_.size == 1) {
    loss = ctx.op(OpKind::kLoss, "loss", {logits, targets}, {{Shape{1}, DType::kF32}},
                  [&](std::span<Tensor> out) {
                    Tensor losses = ctx.workspace(Shape{n}, DType::kF32);
                    ctx.kernels().cross_entropy_forward(logits.reshape({n, vocab_}), targets,
                                                        losses);
                    ctx.kernels().sum(losses, out[0]);
                    ctx.kernels().scale(out[0], 1.0f / static_cast<float>(n));
                  })[0];
  } else {
    // Vocabulary-parallel cross-entropy: each rank's (max, sum of exp, target logit) per row,
    // one all-gather, and every rank combines them into the same losses and log-sum-exp.
    auto outs = ctx.op(
        OpKind::kLoss, "loss", {logits, targets},
        {{Shape{1}, DType::kF32}, {Shape{n}, DType::kF32}}, [&](std::span<Tensor> out) {
          Kernels& k = ctx.kernels();
          Tensor stats = ctx.workspace(Shape{n, 3}, DType::kF32);
          k.cross_entropy_partial(rows(logits), targets, tp_.vocab_begin(), tp_.vocab_valid(),
                                  stats);
          Tensor all = ctx.workspace(Shape{tp_.size, n, 3}, DType::kF32);
          comm::Work gather = ctx.tp_all_gather(stats, all);
          ctx.tp_wait(gather);
          Tensor losses = ctx.workspace(Shape{n}, DType::kF32);
          k.cross_entropy_combine(all, losses, out[1]);
          k.sum(losses, out[0]);
          k.scale(out[0], 1.0f / static_cast<float>(n));
        });
    loss = outs[0];
    ctx.save("lse", outs[1]);
  }
  ctx.save("x", x);
  ctx.save("lnf", lnf);
  if (mean.defined()) ctx.save("mean", mean);
  ctx.save("rstd", rstd);
  ctx.save("logits", logits);
  ctx.save("targets", targets);
  return loss;
}

Tensor TransformerHead::backward(Ctx& ctx, const Tensor& /*dy*/) {
  Kernels& k = ctx.kernels();
  const Tensor& logits = ctx.saved("logits");
  const Tensor& targets = ctx.saved("targets");
  const int64_t n = targets.numel();
  const float scale = loss_scale_ / static_cast<float>(n);
  Tensor dlogits = ctx.workspace(logits.shape(), logits.dtype());
  Tensor dlogits_rows = rows(dlogits);
  if (tp_.size == 1) {
    k.cross_entropy_backward(rows(logits), targets, dlogits_rows, scale);
  } else {
    k.cross_entropy_backward_partial(rows(logits), targets, tp_.vocab_begin(), tp_.vocab_valid(),
                                     ctx.saved("lse"), dlogits_rows, scale);
  }
  Tensor dlnf =
      column_linear_backward(ctx, dlogits, ctx.saved("lnf"), head_w_, dhead_w_, nullptr, tp_);
  dlogits = Tensor();
  const Tensor& x = ctx.saved("x");
  Tensor dx = ctx.grad_like(x);
  Tensor dx_rows = rows(dx);
  if (norm_ == Norm::kRmsNorm) {
    RowPartialGrads norm_grads(ctx, tp_, {&dlnf_w_});
    k.rmsnorm_backward(rows(dlnf), rows(x), lnf_w_, ctx.saved("rstd"), dx_rows,
                       norm_grads.view(0));
    norm_grads.finish();
    return dx;
  }
  RowPartialGrads ln_grads(ctx, tp_, {&dlnf_w_, &dlnf_b_});
  k.layernorm_backward(rows(dlnf), rows(x), lnf_w_, ctx.saved("mean"), ctx.saved("rstd"),
                       dx_rows, ln_grads.view(0), ln_grads.view(1));
  ln_grads.finish();
  return dx;
}

}  // namespace porter::models
