// The GPT's layers: embedding, block and head, each a forward through ctx and a
// hand-written backward from what the forward saved.
#include "base/check.h"
#include "nn/gpt.h"

namespace porter::nn {

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

// dy through dropout site `site` (p > 0), or dy itself.
Tensor dropout_backward(Ctx& ctx, const Tensor& dy, float p, int site) {
  if (p == 0.0f) return dy;
  Tensor dx = ctx.workspace(dy.shape(), dy.dtype());
  ctx.kernels().dropout_backward(dy, dx, p, ctx.dropout_key_for(site));
  return dx;
}

}  // namespace

// ---- embedding ----

enum EmbeddingParam : size_t { kWte, kWpe };

GptEmbedding::GptEmbedding(int64_t vocab, int64_t max_seq, int64_t hidden, float dropout)
    : vocab_(vocab), max_seq_(max_seq), hidden_(hidden), dropout_(dropout) {}

std::vector<ParamSpec> GptEmbedding::params() const {
  return {{"wte", Shape{vocab_, hidden_}}, {"wpe", Shape{max_seq_, hidden_}}};
}

Tensor GptEmbedding::forward(Ctx& ctx, const Tensor& tokens) {
  PORTER_CHECK(tokens.rank() == 2 && tokens.dtype() == DType::kI32,
               "GPT input tokens must be (B, T) i32, got ", tokens.shape().to_string(), " ",
               dtype_name(tokens.dtype()));
  PORTER_CHECK_LE(tokens.dim(1), max_seq_, "sequence length of the batch (model seq_len)");
  const Tensor& wte = param(kWte);
  const Tensor& wpe = param(kWpe);
  Tensor x = ctx.op(OpKind::kEmbedding, "embed", {tokens, wte, wpe},
                    {{Shape{tokens.dim(0), tokens.dim(1), hidden_}, ctx.compute_dtype()}},
                    [&](std::span<Tensor> out) {
                      ctx.kernels().embedding_forward(tokens, wte, wpe, out[0]);
                    })[0];
  ctx.save("tokens", tokens);
  return ctx.dropout("drop", x, dropout_);
}

Tensor GptEmbedding::backward(Ctx& ctx, const Tensor& dy) {
  Tensor dx = dropout_backward(ctx, dy, dropout_, 0);
  ctx.kernels().embedding_backward(dx, ctx.saved("tokens"), grad(kWte), grad(kWpe));
  return Tensor();
}

// ---- block ----

enum BlockParam : size_t {
  kLn1W, kLn1B, kQkvW, kQkvB, kProjW, kProjB, kLn2W, kLn2B, kFc1W, kFc1B, kFc2W, kFc2B
};

GptBlock::GptBlock(int64_t hidden, int heads, float dropout)
    : hidden_(hidden), heads_(heads), dropout_(dropout) {}

std::vector<ParamSpec> GptBlock::params() const {
  const int64_t c = hidden_;
  return {{"ln1.weight", Shape{c}},         {"ln1.bias", Shape{c}},
          {"qkv.weight", Shape{3 * c, c}},  {"qkv.bias", Shape{3 * c}},
          {"proj.weight", Shape{c, c}},     {"proj.bias", Shape{c}},
          {"ln2.weight", Shape{c}},         {"ln2.bias", Shape{c}},
          {"fc1.weight", Shape{4 * c, c}},  {"fc1.bias", Shape{4 * c}},
          {"fc2.weight", Shape{c, 4 * c}},  {"fc2.bias", Shape{c}}};
}

Tensor GptBlock::forward(Ctx& ctx, const Tensor& x) {  // x (B, T, C)
  auto [ln1, mean1, rstd1] = ctx.layernorm("ln1", x, param(kLn1W), param(kLn1B));
  Tensor qkv = ctx.linear("qkv", ln1, param(kQkvW), param(kQkvB));  // (B, T, 3C)
  auto [att, probs] = ctx.attention("attn", qkv, heads_);          // (B, T, C), (B, H, T, T)
  Tensor proj = ctx.linear("proj", att, param(kProjW), param(kProjB));
  Tensor x2 = ctx.add("res1", x, ctx.dropout("drop1", proj, dropout_));
  auto [ln2, mean2, rstd2] = ctx.layernorm("ln2", x2, param(kLn2W), param(kLn2B));
  Tensor h = ctx.linear("fc1", ln2, param(kFc1W), param(kFc1B));   // (B, T, 4C)
  Tensor g = ctx.gelu("gelu", h);
  Tensor f = ctx.linear("fc2", g, param(kFc2W), param(kFc2B));
  Tensor y = ctx.add("res2", x2, ctx.dropout("drop2", f, dropout_));
  ctx.save("x", x);
  ctx.save("ln1", ln1);
  ctx.save("mean1", mean1);
  ctx.save("rstd1", rstd1);
  ctx.save("qkv", qkv);
  ctx.save("att", att);
  ctx.save("probs", probs);
  ctx.save("x2", x2);
  ctx.save("ln2", ln2);
  ctx.save("mean2", mean2);
  ctx.save("rstd2", rstd2);
  ctx.save("h", h);
  ctx.save("g", g);
  return y;
}

Tensor GptBlock::backward(Ctx& ctx, const Tensor& dy) {
  Kernels& k = ctx.kernels();
  // Second half: y = x2 + drop2(fc2(gelu(fc1(ln2(x2))))).
  Tensor df = dropout_backward(ctx, dy, dropout_, 1);
  Tensor dg = linear_backward(ctx, df, ctx.saved("g"), param(kFc2W), grad(kFc2W), &grad(kFc2B));
  const Tensor& h = ctx.saved("h");
  Tensor dh = ctx.workspace(h.shape(), h.dtype());
  k.gelu_backward(h, dg, dh);
  dg = Tensor();
  Tensor dln2 = linear_backward(ctx, dh, ctx.saved("ln2"), param(kFc1W), grad(kFc1W), &grad(kFc1B));
  dh = Tensor();
  Tensor dx2 = ctx.grad_like(dy);
  Tensor dx2_rows = rows(dx2);
  k.layernorm_backward(rows(dln2), rows(ctx.saved("x2")), param(kLn2W), ctx.saved("mean2"),
                       ctx.saved("rstd2"), dx2_rows, grad(kLn2W), grad(kLn2B));
  k.accumulate(dx2, dy);  // the residual path
  // First half: x2 = x + drop1(proj(attn(qkv(ln1(x))))).
  Tensor dproj = dropout_backward(ctx, dx2, dropout_, 0);
  Tensor datt = linear_backward(ctx, dproj, ctx.saved("att"), param(kProjW), grad(kProjW),
                                &grad(kProjB));
  const Tensor& qkv = ctx.saved("qkv");
  Tensor dqkv = ctx.workspace(qkv.shape(), qkv.dtype());
  k.attention_backward(datt, qkv, ctx.saved("probs"), dqkv, heads_);
  datt = Tensor();
  Tensor dln1 = linear_backward(ctx, dqkv, ctx.saved("ln1"), param(kQkvW), grad(kQkvW),
                                &grad(kQkvB));
  dqkv = Tensor();
  Tensor dx = ctx.grad_like(dy);
  Tensor dx_rows = rows(dx);
  k.layernorm_backward(rows(dln1), rows(ctx.saved("x")), param(kLn1W), ctx.saved("mean1"),
                       ctx.saved("rstd1"), dx_rows, grad(kLn1W), grad(kLn1B));
  k.accumulate(dx, dx2);
  return dx;
}

// ---- head ----

enum HeadParam : size_t { kLnfW, kLnfB, kHeadW };

GptHead::GptHead(int64_t vocab, int64_t hidden, bool tied)
    : vocab_(vocab), hidden_(hidden), tied_(tied) {}

std::vector<ParamSpec> GptHead::params() const {
  std::vector<ParamSpec> p = {{"lnf.weight", Shape{hidden_}}, {"lnf.bias", Shape{hidden_}}};
  if (!tied_) p.push_back({"head.weight", Shape{vocab_, hidden_}});
  return p;
}

void GptHead::bind(std::span<const Tensor> params, std::span<const Tensor> grads) {
  PORTER_CHECK_EQ(params.size(), tied_ ? size_t{2} : size_t{3}, "GptHead parameter views");
  lnf_w_ = params[kLnfW];
  lnf_b_ = params[kLnfB];
  dlnf_w_ = grads[kLnfW];
  dlnf_b_ = grads[kLnfB];
  if (!tied_) {
    head_w_ = params[kHeadW];
    dhead_w_ = grads[kHeadW];
  }
}

void GptHead::bind_tied(const Tensor& wte, const Tensor& dwte) {
  PORTER_CHECK(tied_, "bind_tied on an untied head");
  head_w_ = wte;
  dhead_w_ = dwte;
}

Tensor GptHead::forward(Ctx& ctx, const Tensor& x) {
  PORTER_CHECK(targets_.defined() && targets_.numel() == x.numel() / hidden_,
               "GptHead: set_targets with the micro-batch's (B, T) targets before forward");
  auto [lnf, mean, rstd] = ctx.layernorm("lnf", x, lnf_w_, lnf_b_);
  Tensor logits = ctx.linear("head", lnf, head_w_, Tensor());  // (B, T, V)
  const int64_t n = logits.numel() / vocab_;
  Tensor targets = targets_.reshape({n});
  Tensor loss = ctx.op(OpKind::kLoss, "loss", {logits, targets}, {{Shape{1}, DType::kF32}},
                       [&](std::span<Tensor> out) {
                         Tensor losses = ctx.workspace(Shape{n}, DType::kF32);
                         ctx.kernels().cross_entropy_forward(logits.reshape({n, vocab_}),
                                                             targets, losses);
                         ctx.kernels().sum(losses, out[0]);
                         ctx.kernels().scale(out[0], 1.0f / static_cast<float>(n));
                       })[0];
  ctx.save("x", x);
  ctx.save("lnf", lnf);
  ctx.save("mean", mean);
  ctx.save("rstd", rstd);
  ctx.save("logits", logits);
  ctx.save("targets", targets);
  return loss;
}

Tensor GptHead::backward(Ctx& ctx, const Tensor& /*dy*/) {
  Kernels& k = ctx.kernels();
  const Tensor& logits = ctx.saved("logits");
  const int64_t n = logits.numel() / vocab_;
  Tensor dlogits = ctx.workspace(logits.shape(), logits.dtype());
  Tensor dlogits_rows = rows(dlogits);
  k.cross_entropy_backward(rows(logits), ctx.saved("targets"), dlogits_rows,
                           loss_scale_ / static_cast<float>(n));
  Tensor dlnf = linear_backward(ctx, dlogits, ctx.saved("lnf"), head_w_, dhead_w_, nullptr);
  dlogits = Tensor();
  const Tensor& x = ctx.saved("x");
  Tensor dx = ctx.grad_like(x);
  Tensor dx_rows = rows(dx);
  k.layernorm_backward(rows(dlnf), rows(x), lnf_w_, ctx.saved("mean"), ctx.saved("rstd"),
                       dx_rows, dlnf_w_, dlnf_b_);
  return dx;
}

}  // namespace porter::nn
