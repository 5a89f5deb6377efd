// The one definition of each op: shape, dtype and aliasing rules, checked before any device
// runs it. This file stays device-agnostic: it never reads tensor contents.
//
// Note [Kernel dtypes]
// "float" below means f32, bf16 or f16, on both devices. Unless an op says otherwise:
// - activations (x, y, dy, dx, out, qkv, logits) are float, each independently;
// - parameters and their gradients (bias, gamma, beta, wte, wpe, dbias, ...) are float, and
//   the two tensors of a pair (gamma/beta, wte/wpe, dgamma/dbeta, dwte/dwpe) share a dtype;
// - saved statistics (mean, rstd, probs) and losses are f32; token ids and targets are i32.
// The cpu kernels take one 16-bit type per call next to f32 (bf16 with f16 only in cast,
// adamw, attention, embedding and cross-entropy: Note [Cpu dtype combinations] in
// kernels/cpu/cpu_kernels.h).
//
// Note [Kernel aliasing]
// Outputs never partially overlap inputs. An output may be the very same memory as an input
// only for elementwise ops (add, accumulate, gelu, dropout, scale: computed in place), for
// cross_entropy_backward's dlogits = logits (each row is read whole before it is written) and
// for cross_entropy_backward_partial's (elementwise once lse is known).
//
// Note [Vocabulary-parallel kernels]
// Megatron-style tensor parallelism splits the vocabulary over t ranks: rank r holds rows
// [v0, v0 + Vs) of the token table (which the LM head shares) and produces the logits'
// columns [v0, v0 + Vs). Collectives want equal shapes, so V is padded to t * Vs: a shard's
// first `valid` columns are vocabulary and the last shards end in Vs - valid padding columns,
// which the kernels never read (their contents may be garbage) and give 0 gradients.
// - Embedding: each rank looks up only its own rows (0 for other ids) and the caller sums the
//   (B, T, C) partials with an all-reduce. wpe is optional so that exactly one rank (or none,
//   adding it after the reduction) contributes the positions.
// - Cross-entropy: the softmax needs the row max and sum over all V columns, and the loss the
//   target's logit, which lives on one rank. Each rank reduces its columns to (m, s, z) per
//   row, so one all-gather of 3 floats per row and rank replaces three all-reduces (max, sum
//   and target logit); every rank then combines the t triples itself, in rank order, so all
//   ranks hold the same losses and lse bits. The backward needs only lse (saved from the
//   combine) and no communication. With t = 1 and valid = V this is cross_entropy_forward's
//   arithmetic: S = s * exp(0) = s, lse = m + log s.
// None of these kernels needs workspace.
#include "kernels/kernels.h"

#include <cmath>
#include <cstdint>
#include <string>

#include "base/check.h"

namespace porter::kernels {
namespace {

bool is_float(DType t) { return t == DType::kF32 || t == DType::kBF16 || t == DType::kF16; }

std::string describe(const Tensor& t) {
  return str_cat(t.shape().to_string(), " ", dtype_name(t.dtype()));
}

void check_defined(const char* op, const char* name, const Tensor& t) {
  PORTER_CHECK(t.defined(), op, ": tensor ", name, " is undefined (no memory)");
}

void check_float(const char* op, const char* name, const Tensor& t) {
  check_defined(op, name, t);
  PORTER_CHECK(is_float(t.dtype()), op, ": ", name, " ", describe(t),
               " must be f32, bf16 or f16 (Note [Kernel dtypes])");
}

void check_dtype(const char* op, const char* name, const Tensor& t, DType want) {
  check_defined(op, name, t);
  PORTER_CHECK(t.dtype() == want, op, ": ", name, " ", describe(t), " must be ",
               dtype_name(want));
}

void check_same_dtype(const char* op, const char* name_a, const Tensor& a, const char* name_b,
                      const Tensor& b) {
  PORTER_CHECK(a.dtype() == b.dtype(), op, ": ", name_a, " ", describe(a), " and ", name_b, " ",
               describe(b), " must have the same dtype");
}

void check_shape(const char* op, const char* name, const Tensor& t, const Shape& want) {
  PORTER_CHECK(t.shape() == want, op, ": ", name, " has shape ", t.shape().to_string(),
               ", expected ", want.to_string());
}

void check_rank(const char* op, const char* name, const Tensor& t, int lo, int hi) {
  PORTER_CHECK(t.rank() >= lo && t.rank() <= hi, op, ": ", name, " ", t.shape().to_string(),
               " must have rank ", lo == hi ? std::to_string(lo) : str_cat(lo, " to ", hi));
}

// Rows of a (..., C) tensor: the leading dimensions flattened.
int64_t rows_of(const Tensor& t) {
  return t.dim(-1) == 0 ? 0 : t.numel() / t.dim(-1);
}

bool overlaps(const Tensor& a, const Tensor& b) {
  if (a.nbytes() == 0 || b.nbytes() == 0) return false;
  auto a0 = reinterpret_cast<uintptr_t>(a.data()), b0 = reinterpret_cast<uintptr_t>(b.data());
  return a0 < b0 + b.nbytes() && b0 < a0 + a.nbytes();
}

// An output must not overlap an input (Note [Kernel aliasing]).
void check_no_alias(const char* op, const char* out_name, const Tensor& out, const char* in_name,
                    const Tensor& in) {
  PORTER_CHECK(!overlaps(out, in), op, ": output ", out_name, " ", out.shape().to_string(),
               " overlaps input ", in_name, " ", in.shape().to_string(),
               "; this op cannot run in place");
}

// An output may be exactly an input, but must not partially overlap it.
void check_same_or_disjoint(const char* op, const char* out_name, const Tensor& out,
                            const char* in_name, const Tensor& in) {
  bool same = out.data() == in.data() && out.nbytes() == in.nbytes();
  PORTER_CHECK(same || !overlaps(out, in), op, ": output ", out_name, " ",
               out.shape().to_string(), " partially overlaps input ", in_name, " ",
               in.shape().to_string(), "; in place it must be the very same memory");
}

// The (N, C) checks shared by row-wise ops with a (C) parameter vector.
void check_rows_param(const char* op, const char* x_name, const Tensor& x, const char* p_name,
                      const Tensor& p) {
  check_float(op, x_name, x);
  check_float(op, p_name, p);
  check_rank(op, x_name, x, 1, kMaxRank);
  check_shape(op, p_name, p, Shape{x.dim(-1)});
}

}  // namespace

void Kernels::matmul(const Tensor& a, const Tensor& b, Tensor& out, const MatmulSpec& spec) {
  const char* op = "matmul";
  check_float(op, "a", a);
  check_float(op, "b", b);
  check_float(op, "out", out);
  check_rank(op, "a", a, 2, 3);
  PORTER_CHECK(b.rank() == a.rank() && out.rank() == a.rank(), op, ": a ", describe(a), ", b ",
               describe(b), " and out ", describe(out), " must all have rank 2 or all rank 3");
  check_same_dtype(op, "a", a, "b", b);
  PORTER_CHECK(out.dtype() == DType::kF32 || out.dtype() == a.dtype(), op, ": out ",
               describe(out), " must be f32 or the inputs' dtype ", dtype_name(a.dtype()));
  const int64_t m = spec.trans_a ? a.dim(-1) : a.dim(-2);
  const int64_t ka = spec.trans_a ? a.dim(-2) : a.dim(-1);
  const int64_t kb = spec.trans_b ? b.dim(-1) : b.dim(-2);
  const int64_t n = spec.trans_b ? b.dim(-2) : b.dim(-1);
  PORTER_CHECK(ka == kb, op, ": op(a) of a ", a.shape().to_string(),
               spec.trans_a ? " (transposed)" : "", " and op(b) of b ", b.shape().to_string(),
               spec.trans_b ? " (transposed)" : "", " have different inner dimensions (", ka,
               " vs ", kb, ")");
  if (a.rank() == 3) {
    PORTER_CHECK(a.dim(0) == b.dim(0), op, ": batch of a ", a.shape().to_string(),
                 " and b ", b.shape().to_string(), " differ");
    check_shape(op, "out", out, Shape{a.dim(0), m, n});
  } else {
    check_shape(op, "out", out, Shape{m, n});
  }
  check_no_alias(op, "out", out, "a", a);
  check_no_alias(op, "out", out, "b", b);
  do_matmul(a, b, out, spec);
}

void Kernels::bias_add(Tensor& x, const Tensor& bias) {
  check_rows_param("bias_add", "x", x, "bias", bias);
  check_no_alias("bias_add", "x", x, "bias", bias);
  do_bias_add(x, bias);
}

void Kernels::bias_backward(const Tensor& dy, Tensor& dbias) {
  check_rows_param("bias_backward", "dy", dy, "dbias", dbias);
  check_no_alias("bias_backward", "dbias", dbias, "dy", dy);
  do_bias_backward(dy, dbias);
}

void Kernels::layernorm_forward(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                Tensor& y, Tensor& mean, Tensor& rstd, float eps) {
  const char* op = "layernorm_forward";
  check_rows_param(op, "x", x, "gamma", gamma);
  check_float(op, "beta", beta);
  check_shape(op, "beta", beta, gamma.shape());
  check_same_dtype(op, "gamma", gamma, "beta", beta);
  check_float(op, "y", y);
  check_shape(op, "y", y, x.shape());
  check_dtype(op, "mean", mean, DType::kF32);
  check_dtype(op, "rstd", rstd, DType::kF32);
  check_shape(op, "mean", mean, Shape{rows_of(x)});
  check_shape(op, "rstd", rstd, Shape{rows_of(x)});
  PORTER_CHECK(eps > 0.0f, op, ": eps ", eps, " must be positive");
  for (const Tensor* in : {&x, &gamma, &beta}) {
    check_no_alias(op, "y", y, "an input", *in);
    check_no_alias(op, "mean", mean, "an input", *in);
    check_no_alias(op, "rstd", rstd, "an input", *in);
  }
  check_no_alias(op, "mean", mean, "rstd", rstd);
  do_layernorm_forward(x, gamma, beta, y, mean, rstd, eps);
}

void Kernels::layernorm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma,
                                 const Tensor& mean, const Tensor& rstd, Tensor& dx,
                                 Tensor& dgamma, Tensor& dbeta) {
  const char* op = "layernorm_backward";
  check_rows_param(op, "x", x, "gamma", gamma);
  check_float(op, "dy", dy);
  check_shape(op, "dy", dy, x.shape());
  check_float(op, "dx", dx);
  check_shape(op, "dx", dx, x.shape());
  check_dtype(op, "mean", mean, DType::kF32);
  check_dtype(op, "rstd", rstd, DType::kF32);
  check_shape(op, "mean", mean, Shape{rows_of(x)});
  check_shape(op, "rstd", rstd, Shape{rows_of(x)});
  check_float(op, "dgamma", dgamma);
  check_float(op, "dbeta", dbeta);
  check_shape(op, "dgamma", dgamma, gamma.shape());
  check_shape(op, "dbeta", dbeta, gamma.shape());
  check_same_dtype(op, "dgamma", dgamma, "dbeta", dbeta);
  for (const Tensor* in : {&dy, &x, &gamma, &mean, &rstd}) {
    check_no_alias(op, "dx", dx, "an input", *in);
    check_no_alias(op, "dgamma", dgamma, "an input", *in);
    check_no_alias(op, "dbeta", dbeta, "an input", *in);
  }
  check_no_alias(op, "dx", dx, "dgamma", dgamma);
  check_no_alias(op, "dx", dx, "dbeta", dbeta);
  check_no_alias(op, "dgamma", dgamma, "dbeta", dbeta);
  do_layernorm_backward(dy, x, gamma, mean, rstd, dx, dgamma, dbeta);
}

void Kernels::gelu_forward(const Tensor& x, Tensor& y) {
  check_float("gelu_forward", "x", x);
  check_float("gelu_forward", "y", y);
  check_shape("gelu_forward", "y", y, x.shape());
  check_same_or_disjoint("gelu_forward", "y", y, "x", x);
  do_gelu_forward(x, y);
}

void Kernels::rmsnorm_forward(const Tensor& x, const Tensor& gamma, Tensor& y, Tensor& rstd,
                              float eps) {
  const char* op = "rmsnorm_forward";
  check_rows_param(op, "x", x, "gamma", gamma);
  check_float(op, "y", y);
  check_shape(op, "y", y, x.shape());
  check_dtype(op, "rstd", rstd, DType::kF32);
  check_shape(op, "rstd", rstd, Shape{rows_of(x)});
  PORTER_CHECK(eps > 0.0f, op, ": eps ", eps, " must be positive");
  for (const Tensor* in : {&x, &gamma}) {
    check_no_alias(op, "y", y, "an input", *in);
    check_no_alias(op, "rstd", rstd, "an input", *in);
  }
  check_no_alias(op, "y", y, "rstd", rstd);
  do_rmsnorm_forward(x, gamma, y, rstd, eps);
}

void Kernels::rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma,
                               const Tensor& rstd, Tensor& dx, Tensor& dgamma) {
  const char* op = "rmsnorm_backward";
  check_rows_param(op, "x", x, "gamma", gamma);
  check_float(op, "dy", dy);
  check_shape(op, "dy", dy, x.shape());
  check_float(op, "dx", dx);
  check_shape(op, "dx", dx, x.shape());
  check_dtype(op, "rstd", rstd, DType::kF32);
  check_shape(op, "rstd", rstd, Shape{rows_of(x)});
  check_float(op, "dgamma", dgamma);
  check_shape(op, "dgamma", dgamma, gamma.shape());
  for (const Tensor* in : {&dy, &x, &gamma, &rstd}) {
    check_no_alias(op, "dx", dx, "an input", *in);
    check_no_alias(op, "dgamma", dgamma, "an input", *in);
  }
  check_no_alias(op, "dx", dx, "dgamma", dgamma);
  do_rmsnorm_backward(dy, x, gamma, rstd, dx, dgamma);
}

namespace {

// Note [Rotary qkv]
// Llama's q, k and v projections and its rotary embedding meet in one op that writes the
// (B, T, 3C) qkv attention_forward takes, C = H*D: q rotated, k rotated and v, with each of
// the Hkv key/value heads repeated for the H / Hkv query heads of its group (grouped-query
// attention, Hugging Face's repeat_kv). The expansion costs the same activation bytes as the
// GPT's qkv and lets Llama use the GPT's attention kernels unchanged. flash_attention_forward
// reads the shared heads in place, so for it the op writes (B, T, (H + 2 Hkv) D), k and v
// unexpanded, and its backward's group sums are the flash kernel's (Note [Flash attention]). The angles are t *
// theta^(-2i/D) computed in double and rounded once to f32 cos and sin, on both devices.
// Backward is the transpose: a rotation by -angle, and for k and v a sum over the group's
// query heads in head order, so the result does not depend on threads or device.
void check_rope_shapes(const char* op, const Tensor& qkv, const Tensor& q, const Tensor& k,
                       const Tensor& v, int heads, int kv_heads, double theta) {
  PORTER_CHECK(heads >= 1 && kv_heads >= 1 && heads % kv_heads == 0, op, ": kv_heads ",
               kv_heads, " must be >= 1 and divide heads ", heads);
  PORTER_CHECK(theta > 0.0 && std::isfinite(theta), op, ": theta ", theta, " must be positive");
  check_float(op, "qkv", qkv);
  check_rank(op, "qkv", qkv, 3, 3);
  check_float(op, "q", q);
  check_rank(op, "q", q, 3, 3);
  const int64_t b = qkv.dim(0), t = qkv.dim(1), d = q.dim(2) / heads;
  PORTER_CHECK(q.dim(2) % heads == 0 && d % 2 == 0, op, ": q ", q.shape().to_string(),
               " is not (B, T, heads * D) with heads ", heads, " and an even D");
  PORTER_CHECK(qkv.dim(2) == 3 * heads * d || qkv.dim(2) == (heads + 2 * int64_t{kv_heads}) * d,
               op, ": qkv ", qkv.shape().to_string(), " is neither (B, T, 3 * heads * D) nor (B, "
               "T, (heads + 2 * kv_heads) * D) with heads ", heads, ", kv_heads ", kv_heads,
               " and D ", d);
  check_float(op, "k", k);
  check_float(op, "v", v);
  check_shape(op, "q", q, Shape{b, t, heads * d});
  check_shape(op, "k", k, Shape{b, t, kv_heads * d});
  check_shape(op, "v", v, Shape{b, t, kv_heads * d});
  check_same_dtype(op, "q", q, "k", k);
  check_same_dtype(op, "q", q, "v", v);
}

}  // namespace

void Kernels::rope_qkv_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& qkv,
                               int heads, int kv_heads, double theta) {
  const char* op = "rope_qkv_forward";
  check_rope_shapes(op, qkv, q, k, v, heads, kv_heads, theta);
  for (const Tensor* in : {&q, &k, &v}) check_no_alias(op, "qkv", qkv, "an input", *in);
  do_rope_qkv_forward(q, k, v, qkv, heads, kv_heads, theta);
}

void Kernels::rope_qkv_backward(const Tensor& dqkv, Tensor& dq, Tensor& dk, Tensor& dv,
                                int heads, int kv_heads, double theta) {
  const char* op = "rope_qkv_backward";
  check_rope_shapes(op, dqkv, dq, dk, dv, heads, kv_heads, theta);
  check_no_alias(op, "dq", dq, "dqkv", dqkv);
  check_no_alias(op, "dk", dk, "dqkv", dqkv);
  check_no_alias(op, "dv", dv, "dqkv", dqkv);
  check_no_alias(op, "dq", dq, "dk", dk);
  check_no_alias(op, "dq", dq, "dv", dv);
  check_no_alias(op, "dk", dk, "dv", dv);
  do_rope_qkv_backward(dqkv, dq, dk, dv, heads, kv_heads, theta);
}

void Kernels::swiglu_forward(const Tensor& gate, const Tensor& up, Tensor& y) {
  const char* op = "swiglu_forward";
  check_float(op, "gate", gate);
  check_float(op, "up", up);
  check_float(op, "y", y);
  check_shape(op, "up", up, gate.shape());
  check_shape(op, "y", y, gate.shape());
  check_same_or_disjoint(op, "y", y, "gate", gate);
  check_same_or_disjoint(op, "y", y, "up", up);
  do_swiglu_forward(gate, up, y);
}

void Kernels::swiglu_backward(const Tensor& gate, const Tensor& up, const Tensor& dy,
                              Tensor& dgate, Tensor& dup) {
  const char* op = "swiglu_backward";
  check_float(op, "gate", gate);
  check_float(op, "up", up);
  check_float(op, "dy", dy);
  check_float(op, "dgate", dgate);
  check_float(op, "dup", dup);
  check_shape(op, "up", up, gate.shape());
  check_shape(op, "dy", dy, gate.shape());
  check_shape(op, "dgate", dgate, gate.shape());
  check_shape(op, "dup", dup, gate.shape());
  for (const Tensor* in : {&gate, &up, &dy}) {
    check_no_alias(op, "dgate", dgate, "an input", *in);
    check_no_alias(op, "dup", dup, "an input", *in);
  }
  check_no_alias(op, "dgate", dgate, "dup", dup);
  do_swiglu_backward(gate, up, dy, dgate, dup);
}

void Kernels::gelu_backward(const Tensor& x, const Tensor& dy, Tensor& dx) {
  const char* op = "gelu_backward";
  check_float(op, "x", x);
  check_float(op, "dy", dy);
  check_float(op, "dx", dx);
  check_shape(op, "dy", dy, x.shape());
  check_shape(op, "dx", dx, x.shape());
  check_same_or_disjoint(op, "dx", dx, "x", x);
  check_same_or_disjoint(op, "dx", dx, "dy", dy);
  do_gelu_backward(x, dy, dx);
}

namespace {

// The checks of a unary activation (relu, silu): y is x's shape, any float dtypes, and y
// is x itself or disjoint from it.
void check_unary(const char* op, const Tensor& x, const Tensor& y) {
  check_float(op, "x", x);
  check_float(op, "y", y);
  check_shape(op, "y", y, x.shape());
  check_same_or_disjoint(op, "y", y, "x", x);
}

void check_unary_backward(const char* op, const Tensor& x, const Tensor& dy, const Tensor& dx) {
  check_float(op, "x", x);
  check_float(op, "dy", dy);
  check_float(op, "dx", dx);
  check_shape(op, "dy", dy, x.shape());
  check_shape(op, "dx", dx, x.shape());
  check_same_or_disjoint(op, "dx", dx, "x", x);
  check_same_or_disjoint(op, "dx", dx, "dy", dy);
}

}  // namespace

void Kernels::relu_forward(const Tensor& x, Tensor& y) {
  check_unary("relu_forward", x, y);
  do_relu_forward(x, y);
}

void Kernels::relu_backward(const Tensor& x, const Tensor& dy, Tensor& dx) {
  check_unary_backward("relu_backward", x, dy, dx);
  do_relu_backward(x, dy, dx);
}

void Kernels::silu_forward(const Tensor& x, Tensor& y) {
  check_unary("silu_forward", x, y);
  do_silu_forward(x, y);
}

void Kernels::silu_backward(const Tensor& x, const Tensor& dy, Tensor& dx) {
  check_unary_backward("silu_backward", x, dy, dx);
  do_silu_backward(x, dy, dx);
}

void Kernels::mse_forward(const Tensor& pred, const Tensor& target, Tensor& losses) {
  const char* op = "mse_forward";
  check_float(op, "pred", pred);
  check_float(op, "target", target);
  check_rank(op, "pred", pred, 1, kMaxRank);
  check_shape(op, "target", target, pred.shape());
  check_dtype(op, "losses", losses, DType::kF32);
  PORTER_CHECK(losses.numel() == rows_of(pred), op, ": losses ", losses.shape().to_string(),
               " must hold one value per row of pred ", pred.shape().to_string());
  check_no_alias(op, "losses", losses, "pred", pred);
  check_no_alias(op, "losses", losses, "target", target);
  do_mse_forward(pred, target, losses);
}

void Kernels::mse_backward(const Tensor& pred, const Tensor& target, Tensor& dpred, float scale) {
  const char* op = "mse_backward";
  check_float(op, "pred", pred);
  check_float(op, "target", target);
  check_float(op, "dpred", dpred);
  check_shape(op, "target", target, pred.shape());
  check_shape(op, "dpred", dpred, pred.shape());
  check_same_or_disjoint(op, "dpred", dpred, "pred", pred);
  check_no_alias(op, "dpred", dpred, "target", target);
  do_mse_backward(pred, target, dpred, scale);
}

namespace {

// qkv (B, T, 3C), out (B, T, C), probs (B, heads, T, T).
void check_attention(const char* op, const Tensor& qkv, const Tensor& out, const char* out_name,
                     const Tensor& probs, int heads) {
  check_float(op, "qkv", qkv);
  check_float(op, out_name, out);
  check_rank(op, "qkv", qkv, 3, 3);
  PORTER_CHECK(heads >= 1, op, ": heads ", heads, " must be at least 1");
  PORTER_CHECK(qkv.dim(2) % (3 * int64_t{heads}) == 0, op, ": qkv ", qkv.shape().to_string(),
               " last dimension must be 3 * C with C divisible by heads = ", heads);
  check_dtype(op, "probs", probs, DType::kF32);
  check_shape(op, "probs", probs, Shape{qkv.dim(0), heads, qkv.dim(1), qkv.dim(1)});
}

}  // namespace

void Kernels::attention_forward(const Tensor& qkv, Tensor& out, Tensor& probs, int heads) {
  const char* op = "attention_forward";
  check_attention(op, qkv, out, "out", probs, heads);
  check_shape(op, "out", out, Shape{qkv.dim(0), qkv.dim(1), qkv.dim(2) / 3});
  check_no_alias(op, "out", out, "qkv", qkv);
  check_no_alias(op, "probs", probs, "qkv", qkv);
  check_no_alias(op, "probs", probs, "out", out);
  do_attention_forward(qkv, out, probs, heads);
}

void Kernels::attention_backward(const Tensor& dout, const Tensor& qkv, const Tensor& probs,
                                 Tensor& dqkv, int heads) {
  const char* op = "attention_backward";
  check_attention(op, qkv, dqkv, "dqkv", probs, heads);
  check_float(op, "dout", dout);
  check_shape(op, "dout", dout, Shape{qkv.dim(0), qkv.dim(1), qkv.dim(2) / 3});
  check_shape(op, "dqkv", dqkv, qkv.shape());
  for (const Tensor* in : {&dout, &qkv, &probs}) check_no_alias(op, "dqkv", dqkv, "an input", *in);
  do_attention_backward(dout, qkv, probs, dqkv, heads);
}

// Note [Flash attention]
// The memory-efficient attention of Dao et al. (FlashAttention, 2022; FlashAttention-2, 2023),
// with porter's exactness rules. Per (batch, query head) and per block of query rows, the
// keys go in tiles; each tile's scores S = Q K^T / sqrt(D) update a running row maximum m,
// a running sum l of exp(S - m) and an f32 output accumulator rescaled by exp(m_old - m_new)
// (the online softmax). After the diagonal tile, out = acc / l and lse = m + log l. Only out
// (B, T, H D) and lse (B, H, T) f32 are kept for backward, against the (B, H, T, T) f32
// probabilities of attention_forward: with T = 4096 and D = 128 that is 4 bytes per row and
// head instead of 16 KiB.
// - Backward first computes each row's D = sum(dout * out) (the workspace), then per tile
//   recomputes P = exp(S - lse), dP = dout V^T, dS = P (dP - D) / sqrt(D), and accumulates
//   dQ += dS K, dK += dS^T Q, dV += P^T dout in f32, rounded once into dqkv.
// - Causality: a query block reads the key tiles up to its diagonal; tiles right of it are
//   never computed, and the diagonal tile masks j > i.
// - Grouped-query attention: query head h reads key/value head h / (H / Hkv) in the packed
//   qkv; dK and dV of a key/value head sum over its group's query heads in head order.
// - Order: every sum runs in a fixed order that depends on the call's shapes alone (tiles in
//   key order, group heads in head order), so the bits do not depend on the thread count.
//   They differ from attention_forward's in the last bits (different summation order and a
//   rescaled accumulator): for one choice of attention the bits are fixed, across checkpoint
//   policies too, since recompute runs the same kernel on the same input.
// - The kernels' tile sizes and packing are theirs (kernels/cpu/attention_flash.cc,
//   kernels/cuda/flash_attention.cu); the only device workspace is backward's D.
namespace {

void check_flash(const char* op, const Tensor& qkv, const Tensor& out, const char* out_name,
                 const Tensor& lse, int heads, int kv_heads) {
  check_float(op, "qkv", qkv);
  check_float(op, out_name, out);
  check_rank(op, "qkv", qkv, 3, 3);
  PORTER_CHECK(heads >= 1 && kv_heads >= 1 && heads % kv_heads == 0, op, ": kv_heads ",
               kv_heads, " must be >= 1 and divide heads ", heads);
  const int64_t parts = heads + 2 * int64_t{kv_heads};
  PORTER_CHECK(qkv.dim(2) % parts == 0 && qkv.dim(2) > 0, op, ": qkv ", qkv.shape().to_string(),
               " last dimension must be (heads + 2 * kv_heads) * D with heads ", heads,
               " and kv_heads ", kv_heads);
  check_dtype(op, "lse", lse, DType::kF32);
  check_shape(op, "lse", lse, Shape{qkv.dim(0), heads, qkv.dim(1)});
}

}  // namespace

void Kernels::flash_attention_forward(const Tensor& qkv, Tensor& out, Tensor& lse, int heads,
                                      int kv_heads) {
  const char* op = "flash_attention_forward";
  check_flash(op, qkv, out, "out", lse, heads, kv_heads);
  const int64_t d = qkv.dim(2) / (heads + 2 * int64_t{kv_heads});
  check_shape(op, "out", out, Shape{qkv.dim(0), qkv.dim(1), heads * d});
  check_no_alias(op, "out", out, "qkv", qkv);
  check_no_alias(op, "lse", lse, "qkv", qkv);
  check_no_alias(op, "lse", lse, "out", out);
  do_flash_attention_forward(qkv, out, lse, heads, kv_heads);
}

void Kernels::flash_attention_backward(const Tensor& dout, const Tensor& qkv, const Tensor& out,
                                       const Tensor& lse, Tensor& dqkv, int heads, int kv_heads) {
  const char* op = "flash_attention_backward";
  check_flash(op, qkv, dqkv, "dqkv", lse, heads, kv_heads);
  const int64_t d = qkv.dim(2) / (heads + 2 * int64_t{kv_heads});
  check_float(op, "dout", dout);
  check_float(op, "out", out);
  check_shape(op, "dout", dout, Shape{qkv.dim(0), qkv.dim(1), heads * d});
  check_shape(op, "out", out, Shape{qkv.dim(0), qkv.dim(1), heads * d});
  check_shape(op, "dqkv", dqkv, qkv.shape());
  for (const Tensor* in : {&dout, &qkv, &out, &lse}) {
    check_no_alias(op, "dqkv", dqkv, "an input", *in);
  }
  do_flash_attention_backward(dout, qkv, out, lse, dqkv, heads, kv_heads);
}

namespace {

void check_dropout(const char* op, const char* in_name, const Tensor& in, const char* out_name,
                   const Tensor& out, float p) {
  check_float(op, in_name, in);
  check_float(op, out_name, out);
  check_shape(op, out_name, out, in.shape());
  check_same_or_disjoint(op, out_name, out, in_name, in);
  PORTER_CHECK(p >= 0.0f && p < 1.0f, op, ": p = ", p, " must be in [0, 1)");
}

// tokens (B, T) i32 indexing a token table (V, C) and a position table (Tmax >= T, C) of one
// float dtype: the rules embedding forward and backward share (for weights or their grads).
// With `pe_optional`, an undefined pe (Tensor()) means no position table.
void check_embedding_tables(const char* op, const Tensor& tokens, const char* te_name,
                            const Tensor& te, const char* pe_name, const Tensor& pe,
                            bool pe_optional = false) {
  check_dtype(op, "tokens", tokens, DType::kI32);
  check_rank(op, "tokens", tokens, 2, 2);
  check_float(op, te_name, te);
  check_rank(op, te_name, te, 2, 2);
  if (pe_optional && !pe.defined()) return;
  check_float(op, pe_name, pe);
  check_rank(op, pe_name, pe, 2, 2);
  check_same_dtype(op, te_name, te, pe_name, pe);
  PORTER_CHECK(pe.dim(1) == te.dim(1), op, ": ", te_name, " ", te.shape().to_string(), " and ",
               pe_name, " ", pe.shape().to_string(), " must have the same number of columns");
  PORTER_CHECK(tokens.dim(1) <= pe.dim(0), op, ": tokens ", tokens.shape().to_string(),
               " has more positions than ", pe_name, " ", pe.shape().to_string(), " has rows");
}

// The first vocabulary id of a shard of `rows` table rows (or logit columns): ids are i32, so
// the shard must lie in [0, 2^31).
void check_vocab_begin(const char* op, int64_t vocab_begin, int64_t rows) {
  constexpr int64_t kIdLimit = int64_t{1} << 31;
  PORTER_CHECK(vocab_begin >= 0 && vocab_begin <= kIdLimit - rows, op, ": vocab_begin ",
               vocab_begin, " with a shard of ", rows, " ids must lie in [0, 2^31) (ids are i32)");
}

}  // namespace

void Kernels::dropout_forward(const Tensor& x, Tensor& y, float p, const PhiloxKey& key) {
  check_dropout("dropout_forward", "x", x, "y", y, p);
  do_dropout_forward(x, y, p, key);
}

void Kernels::dropout_backward(const Tensor& dy, Tensor& dx, float p, const PhiloxKey& key) {
  check_dropout("dropout_backward", "dy", dy, "dx", dx, p);
  do_dropout_backward(dy, dx, p, key);
}

void Kernels::add(const Tensor& a, const Tensor& b, Tensor& out) {
  check_float("add", "a", a);
  check_float("add", "b", b);
  check_float("add", "out", out);
  check_shape("add", "b", b, a.shape());
  check_shape("add", "out", out, a.shape());
  check_same_or_disjoint("add", "out", out, "a", a);
  check_same_or_disjoint("add", "out", out, "b", b);
  do_add(a, b, out);
}

void Kernels::accumulate(Tensor& acc, const Tensor& x) {
  check_float("accumulate", "acc", acc);
  check_float("accumulate", "x", x);
  check_shape("accumulate", "x", x, acc.shape());
  check_same_or_disjoint("accumulate", "acc", acc, "x", x);
  do_accumulate(acc, x);
}

void Kernels::embedding_forward(const Tensor& tokens, const Tensor& wte, const Tensor& wpe,
                                Tensor& out) {
  const char* op = "embedding_forward";
  check_embedding_tables(op, tokens, "wte", wte, "wpe", wpe);
  check_float(op, "out", out);
  check_shape(op, "out", out, Shape{tokens.dim(0), tokens.dim(1), wte.dim(1)});
  for (const Tensor* in : {&tokens, &wte, &wpe}) check_no_alias(op, "out", out, "an input", *in);
  do_embedding_forward(tokens, wte, wpe, out);
}

void Kernels::embedding_backward(const Tensor& dout, const Tensor& tokens, Tensor& dwte,
                                 Tensor& dwpe) {
  const char* op = "embedding_backward";
  check_embedding_tables(op, tokens, "dwte", dwte, "dwpe", dwpe);
  check_float(op, "dout", dout);
  check_shape(op, "dout", dout, Shape{tokens.dim(0), tokens.dim(1), dwte.dim(1)});
  for (const Tensor* in : {&dout, &tokens}) {
    check_no_alias(op, "dwte", dwte, "an input", *in);
    check_no_alias(op, "dwpe", dwpe, "an input", *in);
  }
  check_no_alias(op, "dwte", dwte, "dwpe", dwpe);
  do_embedding_backward(dout, tokens, dwte, dwpe);
}

void Kernels::embedding_forward_vocab_range(const Tensor& tokens, const Tensor& wte,
                                            int64_t vocab_begin, const Tensor& wpe,
                                            Tensor& out) {
  const char* op = "embedding_forward_vocab_range";
  check_embedding_tables(op, tokens, "wte", wte, "wpe", wpe, /*pe_optional=*/true);
  check_vocab_begin(op, vocab_begin, wte.dim(0));
  check_float(op, "out", out);
  check_shape(op, "out", out, Shape{tokens.dim(0), tokens.dim(1), wte.dim(1)});
  check_no_alias(op, "out", out, "tokens", tokens);
  check_no_alias(op, "out", out, "wte", wte);
  if (wpe.defined()) check_no_alias(op, "out", out, "wpe", wpe);
  do_embedding_forward_vocab_range(tokens, wte, vocab_begin, wpe, out);
}

void Kernels::embedding_backward_vocab_range(const Tensor& dout, const Tensor& tokens,
                                             int64_t vocab_begin, Tensor& dwte, Tensor& dwpe) {
  const char* op = "embedding_backward_vocab_range";
  check_embedding_tables(op, tokens, "dwte", dwte, "dwpe", dwpe, /*pe_optional=*/true);
  check_vocab_begin(op, vocab_begin, dwte.dim(0));
  check_float(op, "dout", dout);
  check_shape(op, "dout", dout, Shape{tokens.dim(0), tokens.dim(1), dwte.dim(1)});
  for (const Tensor* in : {&dout, &tokens}) {
    check_no_alias(op, "dwte", dwte, "an input", *in);
    if (dwpe.defined()) check_no_alias(op, "dwpe", dwpe, "an input", *in);
  }
  if (dwpe.defined()) check_no_alias(op, "dwte", dwte, "dwpe", dwpe);
  do_embedding_backward_vocab_range(dout, tokens, vocab_begin, dwte, dwpe);
}

namespace {

// logits (..., V) with targets holding one i32 per row.
void check_cross_entropy(const char* op, const Tensor& logits, const Tensor& targets) {
  check_float(op, "logits", logits);
  check_rank(op, "logits", logits, 2, kMaxRank);
  check_dtype(op, "targets", targets, DType::kI32);
  PORTER_CHECK(targets.numel() == rows_of(logits), op, ": targets ",
               targets.shape().to_string(), " must hold one id per row of logits ",
               logits.shape().to_string(), " (", rows_of(logits), " rows)");
  PORTER_CHECK(logits.dim(-1) >= 1, op, ": logits ", logits.shape().to_string(),
               " have no classes");
}

// A vocabulary shard of logits (..., Vs): columns [vocab_begin, vocab_begin + Vs) of the full
// logits, the first `valid` of them real.
void check_vocab_shard(const char* op, const Tensor& logits, const Tensor& targets,
                       int64_t vocab_begin, int64_t valid) {
  check_cross_entropy(op, logits, targets);
  PORTER_CHECK(valid >= 0 && valid <= logits.dim(-1), op, ": valid ", valid,
               " must be in [0, ", logits.dim(-1), "], the columns of logits ",
               logits.shape().to_string());
  check_vocab_begin(op, vocab_begin, logits.dim(-1));
}

// One f32 value per row of logits (losses, lse).
void check_per_row(const char* op, const char* name, const Tensor& t, int64_t rows,
                   const char* rows_of_what) {
  check_dtype(op, name, t, DType::kF32);
  PORTER_CHECK(t.numel() == rows, op, ": ", name, " ", t.shape().to_string(),
               " must hold one value per row of ", rows_of_what, " (", rows, " rows)");
}

}  // namespace

void Kernels::cross_entropy_forward(const Tensor& logits, const Tensor& targets, Tensor& losses) {
  const char* op = "cross_entropy_forward";
  check_cross_entropy(op, logits, targets);
  check_dtype(op, "losses", losses, DType::kF32);
  PORTER_CHECK(losses.numel() == rows_of(logits), op, ": losses ", losses.shape().to_string(),
               " must hold one value per row of logits ", logits.shape().to_string());
  check_no_alias(op, "losses", losses, "logits", logits);
  check_no_alias(op, "losses", losses, "targets", targets);
  do_cross_entropy_forward(logits, targets, losses);
}

void Kernels::cross_entropy_backward(const Tensor& logits, const Tensor& targets,
                                     Tensor& dlogits, float scale) {
  const char* op = "cross_entropy_backward";
  check_cross_entropy(op, logits, targets);
  check_float(op, "dlogits", dlogits);
  check_shape(op, "dlogits", dlogits, logits.shape());
  check_same_or_disjoint(op, "dlogits", dlogits, "logits", logits);
  check_no_alias(op, "dlogits", dlogits, "targets", targets);
  do_cross_entropy_backward(logits, targets, dlogits, scale);
}

void Kernels::cross_entropy_partial(const Tensor& logits, const Tensor& targets,
                                    int64_t vocab_begin, int64_t valid, Tensor& stats) {
  const char* op = "cross_entropy_partial";
  check_vocab_shard(op, logits, targets, vocab_begin, valid);
  check_dtype(op, "stats", stats, DType::kF32);
  check_shape(op, "stats", stats, Shape{rows_of(logits), 3});
  check_no_alias(op, "stats", stats, "logits", logits);
  check_no_alias(op, "stats", stats, "targets", targets);
  do_cross_entropy_partial(logits, targets, vocab_begin, valid, stats);
}

void Kernels::cross_entropy_combine(const Tensor& gathered, Tensor& losses, Tensor& lse) {
  const char* op = "cross_entropy_combine";
  check_dtype(op, "gathered", gathered, DType::kF32);
  check_rank(op, "gathered", gathered, 3, 3);
  PORTER_CHECK(gathered.dim(0) >= 1 && gathered.dim(2) == 3, op, ": gathered ",
               gathered.shape().to_string(), " must be (t >= 1 ranks, N rows, 3)");
  check_per_row(op, "losses", losses, gathered.dim(1), "gathered");
  check_per_row(op, "lse", lse, gathered.dim(1), "gathered");
  check_no_alias(op, "losses", losses, "gathered", gathered);
  check_no_alias(op, "lse", lse, "gathered", gathered);
  check_no_alias(op, "losses", losses, "lse", lse);
  do_cross_entropy_combine(gathered, losses, lse);
}

void Kernels::cross_entropy_backward_partial(const Tensor& logits, const Tensor& targets,
                                             int64_t vocab_begin, int64_t valid,
                                             const Tensor& lse, Tensor& dlogits, float scale) {
  const char* op = "cross_entropy_backward_partial";
  check_vocab_shard(op, logits, targets, vocab_begin, valid);
  check_per_row(op, "lse", lse, rows_of(logits), "logits");
  check_float(op, "dlogits", dlogits);
  check_shape(op, "dlogits", dlogits, logits.shape());
  check_same_or_disjoint(op, "dlogits", dlogits, "logits", logits);
  check_no_alias(op, "dlogits", dlogits, "targets", targets);
  check_no_alias(op, "dlogits", dlogits, "lse", lse);
  do_cross_entropy_backward_partial(logits, targets, vocab_begin, valid, lse, dlogits, scale);
}

void Kernels::adamw(Tensor& params, const Tensor& grad, Tensor& m, Tensor& v,
                    const AdamWArgs& args, Tensor* params_out) {
  const char* op = "adamw";
  check_dtype(op, "params", params, DType::kF32);
  check_dtype(op, "m", m, DType::kF32);
  check_dtype(op, "v", v, DType::kF32);
  check_float(op, "grad", grad);
  const int64_t n = params.numel();
  PORTER_CHECK(grad.numel() == n && m.numel() == n && v.numel() == n, op, ": params ",
               params.shape().to_string(), ", grad ", grad.shape().to_string(), ", m ",
               m.shape().to_string(), " and v ", v.shape().to_string(),
               " must have the same number of elements");
  PORTER_CHECK(args.step >= 1, op, ": step ", args.step, " must be >= 1 (bias correction)");
  PORTER_CHECK(args.lr >= 0.0f && args.eps > 0.0f && args.beta1 >= 0.0f && args.beta1 < 1.0f &&
                   args.beta2 >= 0.0f && args.beta2 < 1.0f,
               op, ": lr ", args.lr, ", eps ", args.eps, ", beta1 ", args.beta1, ", beta2 ",
               args.beta2, ": need lr >= 0, eps > 0 and betas in [0, 1)");
  check_no_alias(op, "params", params, "grad", grad);
  check_no_alias(op, "m", m, "grad", grad);
  check_no_alias(op, "v", v, "grad", grad);
  check_no_alias(op, "params", params, "m", m);
  check_no_alias(op, "params", params, "v", v);
  check_no_alias(op, "m", m, "v", v);
  if (params_out != nullptr && params_out->defined() && params_out->numel() > 0) {
    check_float(op, "params_out", *params_out);
    PORTER_CHECK(params_out->numel() == n, op, ": params_out ",
                 params_out->shape().to_string(), " must have as many elements as params ",
                 params.shape().to_string());
    const Tensor* others[] = {&params, &grad, &m, &v};
    for (const Tensor* t : others) check_no_alias(op, "params_out", *params_out, "an argument", *t);
  }
  do_adamw(params, grad, m, v, args, params_out);
}

void Kernels::sum(const Tensor& x, Tensor& out) {
  check_float("sum", "x", x);
  check_dtype("sum", "out", out, DType::kF32);
  PORTER_CHECK(out.numel() == 1, "sum: out ", out.shape().to_string(), " must hold 1 element");
  check_no_alias("sum", "out", out, "x", x);
  do_sum(x, out);
}

void Kernels::squared_norm(const Tensor& x, Tensor& out) {
  check_float("squared_norm", "x", x);
  check_dtype("squared_norm", "out", out, DType::kF32);
  PORTER_CHECK(out.numel() == 1, "squared_norm: out ", out.shape().to_string(),
               " must hold 1 element");
  check_no_alias("squared_norm", "out", out, "x", x);
  do_squared_norm(x, out);
}

void Kernels::nonfinite_count(const Tensor& x, Tensor& out) {
  check_float("nonfinite_count", "x", x);
  check_dtype("nonfinite_count", "out", out, DType::kF32);
  PORTER_CHECK(out.numel() == 1, "nonfinite_count: out ", out.shape().to_string(),
               " must hold 1 element");
  check_no_alias("nonfinite_count", "out", out, "x", x);
  do_nonfinite_count(x, out);
}

void Kernels::cast(const Tensor& x, Tensor& y) {
  check_float("cast", "x", x);
  check_float("cast", "y", y);
  check_shape("cast", "y", y, x.shape());
  check_no_alias("cast", "y", y, "x", x);
  do_cast(x, y);
}

void Kernels::fill(Tensor& x, float value) {
  check_float("fill", "x", x);
  do_fill(x, value);
}

void Kernels::scale(Tensor& x, float s) {
  check_float("scale", "x", x);
  do_scale(x, s);
}

}  // namespace porter::kernels
