// The layer library's modules and losses (nn/library.h; the JSON factory is
// nn/library_json.cc). Every op runs through the Ctx with its kind, so every checkpoint policy
// and recompute works unchanged; backward writes dx fresh and accumulates into the bound
// parameter gradients (Note [Layer contract]).
#include "nn/library.h"

#include <cmath>
#include <string_view>

#include <nlohmann/json.hpp>

#include "base/check.h"
#include "base/error.h"
#include "tensor/philox.h"

namespace porter::nn {
namespace {

bool is_float(DType t) { return t == DType::kF32 || t == DType::kBF16 || t == DType::kF16; }

// A (..., C) tensor as (rows, C): a view, the same memory.
Tensor rows(const Tensor& t) { return t.reshape({t.numel() / t.dim(-1), t.dim(-1)}); }

// Accumulating weight gradient: dW += dy^T @ x.
constexpr MatmulSpec kAccumulateWeight{true, false, 1.0f, 1.0f};

// Backward of y (.., out) = x (.., in) @ w^T + b: returns dx (x's shape and dtype) and
// accumulates dw, and db when given.
Tensor linear_backward(Ctx& ctx, const Tensor& dy, const Tensor& x, const Tensor& w, Tensor& dw,
                       Tensor* db) {
  Kernels& k = ctx.kernels();
  const Tensor dy2 = rows(dy);
  Tensor dx = ctx.workspace(x.shape(), x.dtype());
  Tensor dx2 = rows(dx);
  k.matmul(dy2, w, dx2);
  k.matmul(dy2, rows(x), dw, kAccumulateWeight);
  if (db != nullptr) k.bias_backward(dy2, *db);
  return dx;
}

// dx of a ctx.dropout at `site`; a fresh copy of dy when p == 0 (a module's backward returns
// a fresh dx).
Tensor dropout_backward(Ctx& ctx, const Tensor& dy, float p, int site) {
  Tensor dx = ctx.grad_like(dy);
  if (p == 0.0f) {
    ctx.kernels().cast(dy, dx);
  } else {
    ctx.kernels().dropout_backward(dy, dx, p, ctx.dropout_key_for(site));
  }
  return dx;
}

void check_features(const char* layer, const Tensor& x, int64_t dim) {
  PORTER_CHECK(x.defined() && x.rank() >= 1, layer, ": input ", x.shape().to_string(),
               " must be (..., ", dim, ")");
  PORTER_CHECK(is_float(x.dtype()), layer, ": input ", x.shape().to_string(), " is ",
               dtype_name(x.dtype()), "; it takes f32, bf16 or f16");
  PORTER_CHECK(x.dim(-1) == dim, layer, ": input ", x.shape().to_string(),
               " must have ", dim, " features in its last dimension, not ", x.dim(-1));
}

uint64_t fnv1a(std::string_view s) {
  uint64_t h = 14695981039346656037ull;
  for (char c : s) {
    h ^= static_cast<uint8_t>(c);
    h *= 1099511628211ull;
  }
  return h;
}

// Note [Library init]: each parameter's values come from its own Philox stream, keyed by the
// FNV-1a hash of its full name, with a tag disjoint from the dropout, GPT and ChainModel
// streams; element i takes word i % 4 of group i / 4.
PhiloxKey init_key(const std::string& full_name, uint64_t seed) {
  const uint64_t h = fnv1a(full_name);
  PhiloxKey key;
  key.seed = seed;
  key.stream[0] = static_cast<uint32_t>(h);
  key.stream[1] = static_cast<uint32_t>(h >> 32);
  key.stream[2] = 0x4c494249u;  // "LIBI"
  return key;
}

bool ends_with(std::string_view s, std::string_view tail) {
  return s.size() >= tail.size() && s.substr(s.size() - tail.size()) == tail;
}

// Inside a block: dy itself when p == 0 (only read, never returned).
Tensor dropout_input_grad(Ctx& ctx, const Tensor& dy, float p, int site) {
  return p == 0.0f ? dy : dropout_backward(ctx, dy, p, site);
}

// PyTorch's nn.Linear default for a weight or bias of a layer with fan-in `in`.
std::vector<float> linear_init(const std::string& full_name, uint64_t seed, int64_t n,
                               int64_t in) {
  return init_uniform(full_name, seed, n, 1.0f / std::sqrt(static_cast<float>(in)));
}

}  // namespace

std::vector<float> init_uniform(const std::string& full_name, uint64_t seed, int64_t n,
                                float bound) {
  const PhiloxKey key = init_key(full_name, seed);
  std::vector<float> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; i += 4) {
    float u[4];
    philox_uniform4(key, static_cast<uint64_t>(i / 4), u);
    for (int64_t j = 0; j < 4 && i + j < n; ++j) {
      out[static_cast<size_t>(i + j)] = static_cast<float>((2.0 * u[j] - 1.0) * bound);
    }
  }
  return out;
}

std::vector<float> init_normal(const std::string& full_name, uint64_t seed, int64_t n,
                               float stddev) {
  const PhiloxKey key = init_key(full_name, seed);
  std::vector<float> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; i += 4) {
    float u[4];
    philox_uniform4(key, static_cast<uint64_t>(i / 4), u);
    for (int64_t j = 0; j < 4; j += 2) {  // Box-Muller on the pairs (u0, u1), (u2, u3)
      const double r = std::sqrt(-2.0 * std::log(1.0 - static_cast<double>(u[j])));
      const double theta = 2.0 * M_PI * static_cast<double>(u[j + 1]);
      if (i + j < n) out[static_cast<size_t>(i + j)] = static_cast<float>(stddev * r * std::cos(theta));
      if (i + j + 1 < n) {
        out[static_cast<size_t>(i + j + 1)] = static_cast<float>(stddev * r * std::sin(theta));
      }
    }
  }
  return out;
}

// ---- Module ----

std::vector<float> Module::init_param(size_t i, const std::string& full_name,
                                      uint64_t seed) const {
  const ParamSpec spec = params().at(i);
  const int64_t n = spec.shape.numel();
  if (spec.shape.rank() >= 2) return init_normal(full_name, seed, n, 0.02f);
  if (ends_with(spec.name, "weight")) return std::vector<float>(static_cast<size_t>(n), 1.0f);
  return std::vector<float>(static_cast<size_t>(n), 0.0f);
}

// ---- Linear ----

Linear::Linear(int64_t in, int64_t out, bool bias) : in_(in), out_(out), bias_(bias) {
  PORTER_CHECK(in > 0 && out > 0, "Linear(in ", in, ", out ", out, "): sizes must be positive");
}

std::vector<ParamSpec> Linear::params() const {
  std::vector<ParamSpec> p = {{"weight", Shape{out_, in_}}};
  if (bias_) p.push_back({"bias", Shape{out_}});
  return p;
}

Tensor Linear::forward(Ctx& ctx, const Tensor& x) {
  check_features("Linear", x, in_);
  Tensor y = ctx.linear(scoped("linear"), x, param(0), bias_ ? param(1) : Tensor());
  ctx.save(scoped("x"), x);
  return y;
}

Tensor Linear::backward(Ctx& ctx, const Tensor& dy) {
  return linear_backward(ctx, dy, ctx.saved(scoped("x")), param(0), grad(0),
                         bias_ ? &grad(1) : nullptr);
}

std::vector<float> Linear::init_param(size_t i, const std::string& full_name,
                                      uint64_t seed) const {
  return linear_init(full_name, seed, i == 0 ? out_ * in_ : out_, in_);
}

// ---- Embedding ----

Embedding::Embedding(int64_t num, int64_t dim) : num_(num), dim_(dim) {
  PORTER_CHECK(num > 0 && dim > 0, "Embedding(num ", num, ", dim ", dim,
               "): sizes must be positive");
}

std::vector<ParamSpec> Embedding::params() const { return {{"weight", Shape{num_, dim_}}}; }

Tensor Embedding::forward(Ctx& ctx, const Tensor& ids) {
  PORTER_CHECK(ids.defined() && ids.dtype() == DType::kI32, "Embedding: ids ",
               ids.shape().to_string(), " ", dtype_name(ids.dtype()), " must be i32 token ids");
  PORTER_CHECK(ids.rank() < kMaxRank, "Embedding: ids ", ids.shape().to_string(),
               " leave no room for the feature dimension (rank < ", kMaxRank, ")");
  const int64_t n = ids.numel();
  std::vector<int64_t> dims = ids.shape().to_vector();
  dims.push_back(dim_);
  Tensor y = ctx.op(OpKind::kEmbedding, scoped("embedding"), {ids, param(0)},
                    {{Shape(dims), ctx.compute_dtype()}}, [&](std::span<Tensor> out) {
                      Tensor o = out[0].reshape({1, n, dim_});
                      ctx.kernels().embedding_forward_vocab_range(ids.reshape({1, n}), param(0),
                                                                  0, Tensor(), o);
                    })[0];
  ctx.save(scoped("ids"), ids);
  return y;
}

Tensor Embedding::backward(Ctx& ctx, const Tensor& dy) {
  const Tensor& ids = ctx.saved(scoped("ids"));
  const int64_t n = ids.numel();
  Tensor no_positions;
  ctx.kernels().embedding_backward_vocab_range(dy.reshape({1, n, dim_}), ids.reshape({1, n}), 0,
                                               grad(0), no_positions);
  return Tensor();  // token ids have no gradient
}

std::vector<float> Embedding::init_param(size_t, const std::string& full_name,
                                         uint64_t seed) const {
  return init_normal(full_name, seed, num_ * dim_, 0.02f);
}

// ---- norms ----

LayerNorm::LayerNorm(int64_t dim, float eps) : dim_(dim), eps_(eps) {
  PORTER_CHECK(dim > 0 && eps > 0.0f, "LayerNorm(dim ", dim, ", eps ", eps,
               "): dim and eps must be positive");
}

std::vector<ParamSpec> LayerNorm::params() const {
  return {{"weight", Shape{dim_}}, {"bias", Shape{dim_}}};
}

Tensor LayerNorm::forward(Ctx& ctx, const Tensor& x) {
  check_features("LayerNorm", x, dim_);
  auto [y, mean, rstd] = ctx.layernorm(scoped("layernorm"), x, param(0), param(1), eps_);
  ctx.save(scoped("x"), x);
  ctx.save(scoped("mean"), mean);
  ctx.save(scoped("rstd"), rstd);
  return y;
}

Tensor LayerNorm::backward(Ctx& ctx, const Tensor& dy) {
  const Tensor& x = ctx.saved(scoped("x"));
  Tensor dx = ctx.grad_like(x);
  Tensor dx2 = rows(dx);
  ctx.kernels().layernorm_backward(rows(dy), rows(x), param(0), ctx.saved(scoped("mean")),
                                   ctx.saved(scoped("rstd")), dx2, grad(0), grad(1));
  return dx;
}

RMSNorm::RMSNorm(int64_t dim, float eps) : dim_(dim), eps_(eps) {
  PORTER_CHECK(dim > 0 && eps > 0.0f, "RMSNorm(dim ", dim, ", eps ", eps,
               "): dim and eps must be positive");
}

std::vector<ParamSpec> RMSNorm::params() const { return {{"weight", Shape{dim_}}}; }

Tensor RMSNorm::forward(Ctx& ctx, const Tensor& x) {
  check_features("RMSNorm", x, dim_);
  auto [y, rstd] = ctx.rmsnorm(scoped("rmsnorm"), x, param(0), eps_);
  ctx.save(scoped("x"), x);
  ctx.save(scoped("rstd"), rstd);
  return y;
}

Tensor RMSNorm::backward(Ctx& ctx, const Tensor& dy) {
  const Tensor& x = ctx.saved(scoped("x"));
  Tensor dx = ctx.grad_like(x);
  Tensor dx2 = rows(dx);
  ctx.kernels().rmsnorm_backward(rows(dy), rows(x), param(0), ctx.saved(scoped("rstd")), dx2,
                                 grad(0));
  return dx;
}

// ---- activations and dropout ----

Tensor ActivationModule::forward(Ctx& ctx, const Tensor& x) {
  PORTER_CHECK(x.defined() && is_float(x.dtype()), "activation: input ",
               x.shape().to_string(), " ", dtype_name(x.dtype()), " must be f32, bf16 or f16");
  Tensor y;
  switch (act_) {
    case Activation::kGelu: y = ctx.gelu(scoped("gelu"), x); break;
    case Activation::kRelu:
      y = ctx.op(OpKind::kGelu, scoped("relu"), {x}, {{x.shape(), x.dtype()}},
                 [&](std::span<Tensor> out) { ctx.kernels().relu_forward(x, out[0]); })[0];
      break;
    case Activation::kSilu:
      y = ctx.op(OpKind::kGelu, scoped("silu"), {x}, {{x.shape(), x.dtype()}},
                 [&](std::span<Tensor> out) { ctx.kernels().silu_forward(x, out[0]); })[0];
      break;
  }
  ctx.save(scoped("x"), x);
  return y;
}

Tensor ActivationModule::backward(Ctx& ctx, const Tensor& dy) {
  const Tensor& x = ctx.saved(scoped("x"));
  Tensor dx = ctx.grad_like(x);
  Kernels& k = ctx.kernels();
  switch (act_) {
    case Activation::kGelu: k.gelu_backward(x, dy, dx); break;
    case Activation::kRelu: k.relu_backward(x, dy, dx); break;
    case Activation::kSilu: k.silu_backward(x, dy, dx); break;
  }
  return dx;
}

Dropout::Dropout(float p) : p_(p) {
  PORTER_CHECK(p >= 0.0f && p < 1.0f, "Dropout(p ", p, "): p must be in [0, 1)");
}

Tensor Dropout::forward(Ctx& ctx, const Tensor& x) {
  PORTER_CHECK(x.defined() && is_float(x.dtype()), "Dropout: input ", x.shape().to_string(),
               " ", dtype_name(x.dtype()), " must be f32, bf16 or f16");
  return ctx.dropout(scoped("dropout"), x, p_);
}

Tensor Dropout::backward(Ctx& ctx, const Tensor& dy) {
  return dropout_backward(ctx, dy, p_, dropout_site());
}

// ---- AttentionBlock ----

enum AttnParam : size_t { kAttnLnW, kAttnLnB, kQkvW, kQkvB, kProjW, kProjB };

AttentionBlock::AttentionBlock(int64_t dim, int heads, float dropout, bool flash, float eps)
    : dim_(dim), heads_(heads), dropout_(dropout), flash_(flash), eps_(eps) {
  PORTER_CHECK(dim > 0 && heads > 0 && dim % heads == 0, "AttentionBlock(dim ", dim,
               ", heads ", heads, "): heads must be positive and divide dim");
  PORTER_CHECK(dropout >= 0.0f && dropout < 1.0f, "AttentionBlock: dropout ", dropout,
               " must be in [0, 1)");
  PORTER_CHECK(eps > 0.0f, "AttentionBlock: eps ", eps, " must be positive");
}

std::vector<ParamSpec> AttentionBlock::params() const {
  const int64_t c = dim_;
  return {{"ln.weight", Shape{c}},         {"ln.bias", Shape{c}},
          {"qkv.weight", Shape{3 * c, c}}, {"qkv.bias", Shape{3 * c}},
          {"proj.weight", Shape{c, c}},    {"proj.bias", Shape{c}}};
}

Tensor AttentionBlock::forward(Ctx& ctx, const Tensor& x) {
  check_features("AttentionBlock", x, dim_);
  int64_t b = 0, t = 0;
  if (x.rank() == 3) {
    b = x.dim(0);
    t = x.dim(1);
  } else {
    PORTER_CHECK(x.rank() == 2, "AttentionBlock: input ", x.shape().to_string(),
                 " must be (B, T, C) or (B*T, C)");
    b = ctx.run().batch;
    t = ctx.run().seq;
    PORTER_CHECK(b > 0 && t > 0 && b * t == x.dim(0), "AttentionBlock: a (B*T, C) input ",
                 x.shape().to_string(), " needs the micro-batch's (batch, seq) in RunInfo "
                 "(Ctx::set_run); got ", b, " x ", t);
  }
  auto [ln, mean, rstd] = ctx.layernorm(scoped("ln"), x, param(kAttnLnW), param(kAttnLnB), eps_);
  Tensor qkv = ctx.linear(scoped("qkv"), ln, param(kQkvW), param(kQkvB)).reshape({b, t, 3 * dim_});
  auto [att, stats] = flash_ ? ctx.flash_attention(scoped("attn"), qkv, heads_, heads_)
                             : ctx.attention(scoped("attn"), qkv, heads_);  // att (B, T, C)
  Tensor proj = ctx.linear(scoped("proj"), att, param(kProjW), param(kProjB)).reshape(x.shape());
  Tensor y = ctx.add(scoped("residual"), x, ctx.dropout(scoped("dropout"), proj, dropout_));
  ctx.save(scoped("x"), x);
  ctx.save(scoped("ln"), ln);
  ctx.save(scoped("mean"), mean);
  ctx.save(scoped("rstd"), rstd);
  ctx.save(scoped("qkv"), qkv);
  ctx.save(scoped("att"), att);
  ctx.save(scoped(flash_ ? "lse" : "probs"), stats);
  return y;
}

Tensor AttentionBlock::backward(Ctx& ctx, const Tensor& dy) {
  Kernels& k = ctx.kernels();
  const Tensor& att = ctx.saved(scoped("att"));
  Tensor dproj = dropout_input_grad(ctx, dy, dropout_, dropout_site());
  Tensor datt = linear_backward(ctx, dproj.reshape(att.shape()), att, param(kProjW),
                                grad(kProjW), &grad(kProjB));
  dproj = Tensor();
  const Tensor& qkv = ctx.saved(scoped("qkv"));
  Tensor dqkv = ctx.workspace(qkv.shape(), qkv.dtype());
  if (flash_) {
    k.flash_attention_backward(datt, qkv, att, ctx.saved(scoped("lse")), dqkv, heads_, heads_);
  } else {
    k.attention_backward(datt, qkv, ctx.saved(scoped("probs")), dqkv, heads_);
  }
  datt = Tensor();
  const Tensor& ln = ctx.saved(scoped("ln"));
  Tensor dln = linear_backward(ctx, dqkv, ln, param(kQkvW), grad(kQkvW), &grad(kQkvB));
  dqkv = Tensor();
  const Tensor& x = ctx.saved(scoped("x"));
  Tensor dx = ctx.grad_like(x);
  Tensor dx2 = rows(dx);
  k.layernorm_backward(rows(dln), rows(x), param(kAttnLnW), ctx.saved(scoped("mean")),
                       ctx.saved(scoped("rstd")), dx2, grad(kAttnLnW), grad(kAttnLnB));
  k.accumulate(dx, dy);  // the residual path
  return dx;
}

std::vector<float> AttentionBlock::init_param(size_t i, const std::string& full_name,
                                              uint64_t seed) const {
  if (i == kQkvW || i == kQkvB || i == kProjW || i == kProjB) {
    return linear_init(full_name, seed, params()[i].shape.numel(), dim_);
  }
  return Module::init_param(i, full_name, seed);
}

// ---- MlpBlock ----

enum MlpParam : size_t { kMlpLnW, kMlpLnB, kFc1W, kFc1B, kFc2W, kFc2B };

MlpBlock::MlpBlock(int64_t dim, int64_t hidden, float dropout, float eps)
    : dim_(dim), hidden_(hidden), dropout_(dropout), eps_(eps) {
  PORTER_CHECK(dim > 0 && hidden > 0, "MlpBlock(dim ", dim, ", hidden ", hidden,
               "): sizes must be positive");
  PORTER_CHECK(dropout >= 0.0f && dropout < 1.0f, "MlpBlock: dropout ", dropout,
               " must be in [0, 1)");
  PORTER_CHECK(eps > 0.0f, "MlpBlock: eps ", eps, " must be positive");
}

std::vector<ParamSpec> MlpBlock::params() const {
  return {{"ln.weight", Shape{dim_}},           {"ln.bias", Shape{dim_}},
          {"fc1.weight", Shape{hidden_, dim_}}, {"fc1.bias", Shape{hidden_}},
          {"fc2.weight", Shape{dim_, hidden_}}, {"fc2.bias", Shape{dim_}}};
}

Tensor MlpBlock::forward(Ctx& ctx, const Tensor& x) {
  check_features("MlpBlock", x, dim_);
  auto [ln, mean, rstd] = ctx.layernorm(scoped("ln"), x, param(kMlpLnW), param(kMlpLnB), eps_);
  Tensor h = ctx.linear(scoped("fc1"), ln, param(kFc1W), param(kFc1B));
  Tensor g = ctx.gelu(scoped("gelu"), h);
  Tensor f = ctx.linear(scoped("fc2"), g, param(kFc2W), param(kFc2B));
  Tensor y = ctx.add(scoped("residual"), x, ctx.dropout(scoped("dropout"), f, dropout_));
  ctx.save(scoped("x"), x);
  ctx.save(scoped("ln"), ln);
  ctx.save(scoped("mean"), mean);
  ctx.save(scoped("rstd"), rstd);
  ctx.save(scoped("h"), h);
  ctx.save(scoped("g"), g);
  return y;
}

Tensor MlpBlock::backward(Ctx& ctx, const Tensor& dy) {
  Kernels& k = ctx.kernels();
  Tensor df = dropout_input_grad(ctx, dy, dropout_, dropout_site());
  Tensor dg = linear_backward(ctx, df, ctx.saved(scoped("g")), param(kFc2W), grad(kFc2W),
                              &grad(kFc2B));
  df = Tensor();
  const Tensor& h = ctx.saved(scoped("h"));
  Tensor dh = ctx.workspace(h.shape(), h.dtype());
  k.gelu_backward(h, dg, dh);
  dg = Tensor();
  Tensor dln = linear_backward(ctx, dh, ctx.saved(scoped("ln")), param(kFc1W), grad(kFc1W),
                               &grad(kFc1B));
  dh = Tensor();
  const Tensor& x = ctx.saved(scoped("x"));
  Tensor dx = ctx.grad_like(x);
  Tensor dx2 = rows(dx);
  k.layernorm_backward(rows(dln), rows(x), param(kMlpLnW), ctx.saved(scoped("mean")),
                       ctx.saved(scoped("rstd")), dx2, grad(kMlpLnW), grad(kMlpLnB));
  k.accumulate(dx, dy);  // the residual path
  return dx;
}

std::vector<float> MlpBlock::init_param(size_t i, const std::string& full_name,
                                        uint64_t seed) const {
  if (i == kFc1W || i == kFc1B) return linear_init(full_name, seed, params()[i].shape.numel(), dim_);
  if (i == kFc2W || i == kFc2B) {
    return linear_init(full_name, seed, params()[i].shape.numel(), hidden_);
  }
  return Module::init_param(i, full_name, seed);
}

// ---- Residual ----

Residual::Residual(std::unique_ptr<Module> inner) : inner_(std::move(inner)) {
  PORTER_CHECK(inner_ != nullptr, "Residual: the inner module is null");
}

void Residual::bind(std::span<const Tensor> params, std::span<const Tensor> grads) {
  inner_->bind(params, grads);
}

Tensor Residual::forward(Ctx& ctx, const Tensor& x) {
  Tensor f = inner_->forward(ctx, x);
  PORTER_CHECK(f.shape() == x.shape() && f.dtype() == x.dtype(), "Residual: the inner module "
               "maps ", x.shape().to_string(), " ", dtype_name(x.dtype()), " to ",
               f.shape().to_string(), " ", dtype_name(f.dtype()),
               "; y = x + inner(x) needs the same shape and dtype");
  return ctx.add(scoped("residual"), x, f);
}

Tensor Residual::backward(Ctx& ctx, const Tensor& dy) {
  Tensor dx = inner_->backward(ctx, dy);
  PORTER_CHECK(dx.defined() && dx.shape() == dy.shape(), "Residual: the inner module returned "
               "no input gradient of ", dy.shape().to_string());
  ctx.kernels().accumulate(dx, dy);  // the identity path
  return dx;
}

std::vector<float> Residual::init_param(size_t i, const std::string& full_name,
                                        uint64_t seed) const {
  return inner_->init_param(i, full_name, seed);
}

void Residual::set_scope(std::string scope) {
  inner_->set_scope(scope);
  Module::set_scope(std::move(scope));
}

void Residual::set_dropout_site(int first) {
  Module::set_dropout_site(first);
  inner_->set_dropout_site(first);
}

// ---- Sequential ----

Sequential& Sequential::add(std::string name, std::unique_ptr<Module> module) {
  PORTER_CHECK(module != nullptr, "Sequential::add('", name, "'): the module is null");
  PORTER_CHECK(!name.empty() && name.find('.') == std::string::npos, "Sequential::add: child "
               "name '", name, "' must be non-empty and without '.'");
  for (const auto& [n, _] : children_) {
    PORTER_CHECK(n != name, "Sequential::add: a child is already named '", name, "'");
  }
  num_params_.push_back(module->params().size());
  children_.emplace_back(std::move(name), std::move(module));
  set_scope(scope());
  set_dropout_site(dropout_site());
  return *this;
}

Sequential& Sequential::add(std::unique_ptr<Module> module) {
  return add(std::to_string(children_.size()), std::move(module));
}

std::vector<ParamSpec> Sequential::params() const {
  std::vector<ParamSpec> out;
  for (const auto& [name, child] : children_) {
    for (ParamSpec& p : child->params()) out.push_back({name + "." + p.name, p.shape});
  }
  return out;
}

void Sequential::bind(std::span<const Tensor> params, std::span<const Tensor> grads) {
  size_t total = 0;
  for (size_t n : num_params_) total += n;
  PORTER_CHECK(params.size() == total && grads.size() == total, "Sequential::bind: ",
               params.size(), " parameter and ", grads.size(), " gradient views for ", total,
               " parameters");
  size_t at = 0;
  for (size_t i = 0; i < children_.size(); ++i) {
    children_[i].second->bind(params.subspan(at, num_params_[i]),
                              grads.subspan(at, num_params_[i]));
    at += num_params_[i];
  }
}

Tensor Sequential::forward(Ctx& ctx, const Tensor& x) {
  PORTER_CHECK(!children_.empty(), "Sequential: no children");
  // Children added to a nested container after it was added here shift the sites of those
  // after it; handing the ranges out again keeps them right (Note [Library dropout sites]).
  set_dropout_site(dropout_site());
  Tensor h = x;
  for (auto& [name, child] : children_) h = child->forward(ctx, h);
  return h;
}

Tensor Sequential::backward(Ctx& ctx, const Tensor& dy) {
  Tensor d = dy;
  for (size_t i = children_.size(); i-- > 0;) {
    PORTER_CHECK(d.defined(), "Sequential: child '", children_[i].first, "' gets no output "
                 "gradient: child '", children_[i + 1].first, "' returns none (its input is "
                 "not differentiable, e.g. token ids) and must come first");
    d = children_[i].second->backward(ctx, d);
  }
  return d;
}

std::vector<float> Sequential::init_param(size_t i, const std::string& full_name,
                                          uint64_t seed) const {
  for (size_t c = 0; c < children_.size(); ++c) {
    if (i < num_params_[c]) return children_[c].second->init_param(i, full_name, seed);
    i -= num_params_[c];
  }
  throw InvalidArgument(str_cat("Sequential::init_param: no parameter ", i, " ('", full_name,
                                "')"));
}

void Sequential::set_scope(std::string scope) {
  for (auto& [name, child] : children_) child->set_scope(scope + name + ".");
  Module::set_scope(std::move(scope));
}

int Sequential::dropout_sites() const {
  int n = 0;
  for (const auto& [_, child] : children_) n += child->dropout_sites();
  return n;
}

void Sequential::set_dropout_site(int first) {
  Module::set_dropout_site(first);
  for (auto& [_, child] : children_) {
    child->set_dropout_site(first);
    first += child->dropout_sites();
  }
}

// ---- losses ----

Tensor CrossEntropyLoss::forward(Ctx& ctx, const Tensor& logits) {
  const Tensor& t = targets();
  PORTER_CHECK(logits.defined() && is_float(logits.dtype()) &&
                   (logits.rank() == 2 || logits.rank() == 3),
               "CrossEntropyLoss: logits ", logits.shape().to_string(), " ",
               dtype_name(logits.dtype()), " must be float (N, V) or (B, T, V)");
  std::vector<int64_t> lead = logits.shape().to_vector();
  lead.pop_back();
  PORTER_CHECK(t.defined() && t.dtype() == DType::kI32 && t.shape() == Shape(lead),
               "CrossEntropyLoss: targets ", t.shape().to_string(), " ", dtype_name(t.dtype()),
               " must be i32 ", Shape(lead).to_string(), " (logits ",
               logits.shape().to_string(), " without the class dimension)");
  const int64_t n = t.numel();
  PORTER_CHECK(n > 0, "CrossEntropyLoss: no rows in logits ", logits.shape().to_string());
  Tensor loss = ctx.op(OpKind::kLoss, "cross_entropy", {logits, t}, {{Shape{1}, DType::kF32}},
                       [&](std::span<Tensor> out) {
                         Kernels& k = ctx.kernels();
                         Tensor losses = ctx.workspace(Shape{n}, DType::kF32);
                         k.cross_entropy_forward(rows(logits), t.reshape({n}), losses);
                         k.sum(losses, out[0]);
                         k.scale(out[0], 1.0f / static_cast<float>(n));
                       })[0];
  ctx.save("logits", logits);
  ctx.save("targets", t);
  return loss;
}

Tensor CrossEntropyLoss::backward(Ctx& ctx, const Tensor&) {  // dy ignored (LossLayer)
  const Tensor& logits = ctx.saved("logits");
  const Tensor& t = ctx.saved("targets");
  const int64_t n = t.numel();
  Tensor dlogits = ctx.grad_like(logits);
  Tensor d2 = rows(dlogits);
  ctx.kernels().cross_entropy_backward(rows(logits), t.reshape({n}), d2,
                                       loss_scale() / static_cast<float>(n));
  return dlogits;
}

Tensor MseLoss::forward(Ctx& ctx, const Tensor& pred) {
  const Tensor& t = targets();
  PORTER_CHECK(pred.defined() && is_float(pred.dtype()) && pred.rank() >= 1 && pred.numel() > 0,
               "MseLoss: pred ", pred.shape().to_string(), " ", dtype_name(pred.dtype()),
               " must be a non-empty float tensor");
  PORTER_CHECK(t.defined() && is_float(t.dtype()) && t.shape() == pred.shape(),
               "MseLoss: targets ", t.shape().to_string(), " ", dtype_name(t.dtype()),
               " must be float of pred's shape ", pred.shape().to_string());
  const int64_t numel = pred.numel();
  Tensor loss = ctx.op(OpKind::kLoss, "mse", {pred, t}, {{Shape{1}, DType::kF32}},
                       [&](std::span<Tensor> out) {
                         Kernels& k = ctx.kernels();
                         Tensor losses = ctx.workspace(Shape{numel / pred.dim(-1)}, DType::kF32);
                         k.mse_forward(pred, t, losses);
                         k.sum(losses, out[0]);
                         k.scale(out[0], 1.0f / static_cast<float>(numel));
                       })[0];
  ctx.save("pred", pred);
  ctx.save("targets", t);
  return loss;
}

Tensor MseLoss::backward(Ctx& ctx, const Tensor&) {  // dy ignored (LossLayer)
  const Tensor& pred = ctx.saved("pred");
  Tensor dpred = ctx.grad_like(pred);
  ctx.kernels().mse_backward(pred, ctx.saved("targets"), dpred,
                             loss_scale() / static_cast<float>(pred.numel()));
  return dpred;
}

}  // namespace porter::nn
