// The layer library: Modules (Linear, Embedding, norms, activations, dropout, attention and
// MLP blocks, Residual, Sequential) and losses that users compose into a model without writing
// a backward, plus the JSON factory the Python module and configs build them from
// (docs/layers.md, "The layer library").
//
// Note [Module scopes]
// Several modules may run in one stage, and ctx.save names must be unique within a stage. A
// Module prefixes every save name and op name with its scope (set_scope); Sequential gives
// child `name` the scope "<its own scope><name>.", so the saves of "0" and "1" never collide,
// and the op names a trace or a recompute mismatch reports say which child ran. Residual is
// transparent: its inner module has the residual's scope and parameter names.
//
// Note [Library dropout sites]
// A dropout's mask is keyed by its site, the ordinal of the ctx.dropout call within the stage
// (Note [Dropout keys] in philox.h), and backward regenerates the mask from the same key. The
// ctx does not hand the site back, and a module keeps nothing from its forward, so each module
// knows its sites statically: dropout_sites() says how many ctx.dropout calls its forward
// makes (every call counts, p == 0 included, as in the ctx), and set_dropout_site(first)
// tells it the ordinal of its first one. Sequential hands its children consecutive ranges. A
// module that is a stage's whole layer starts at site 0, which is what the ctx counts; a
// user's own layer that calls ctx.dropout before running a Module calls set_dropout_site.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "nn/layer.h"

namespace porter::nn {

class Module : public Layer {
 public:
  // Note [Module scopes]. Containers override it to pass the scope on to their children.
  virtual void set_scope(std::string scope) { scope_ = std::move(scope); }
  const std::string& scope() const { return scope_; }
  // Note [Library dropout sites].
  virtual int dropout_sites() const { return 0; }
  virtual void set_dropout_site(int first) { dropout_site_ = first; }

  // The initial values of params()[i] (its numel() floats), a pure function of (seed,
  // full_name): the same name and seed give the same values in every process and layout.
  // The default: rank >= 2 normal(0, 0.02), a rank-1 "weight" (a norm's gain) 1, anything
  // else 0.
  virtual std::vector<float> init_param(size_t i, const std::string& full_name,
                                        uint64_t seed) const;

 protected:
  // `name` in this module's scope, for ctx.save, ctx.saved and op names.
  std::string scoped(const char* name) const { return scope_ + name; }
  int dropout_site() const { return dropout_site_; }

 private:
  std::string scope_;
  int dropout_site_ = 0;
};

// Deterministic initial values keyed by (seed, full_name) through Philox (used by init_param).
std::vector<float> init_uniform(const std::string& full_name, uint64_t seed, int64_t n,
                                float bound);  // uniform(-bound, bound)
std::vector<float> init_normal(const std::string& full_name, uint64_t seed, int64_t n,
                               float stddev);  // normal(0, stddev)

// y (..., out) = x (..., in) @ weight (out, in)^T + bias (out). Init as PyTorch's default:
// weight and bias uniform(-1/sqrt(in), 1/sqrt(in)).
class Linear : public Module {
 public:
  Linear(int64_t in, int64_t out, bool bias = true);
  std::vector<ParamSpec> params() const override;
  Tensor forward(Ctx& ctx, const Tensor& x) override;
  Tensor backward(Ctx& ctx, const Tensor& dy) override;
  std::vector<float> init_param(size_t i, const std::string& full_name,
                                uint64_t seed) const override;

 private:
  int64_t in_, out_;
  bool bias_;
};

// ids i32 of any shape -> (ids' shape..., dim) rows of weight (num, dim), in the ctx's compute
// dtype. Ids outside [0, num) give zero rows (the kernel cannot report them without a host
// sync). No input gradient: backward returns an undefined Tensor. Init normal(0, 0.02).
class Embedding : public Module {
 public:
  Embedding(int64_t num, int64_t dim);
  std::vector<ParamSpec> params() const override;
  Tensor forward(Ctx& ctx, const Tensor& ids) override;
  Tensor backward(Ctx& ctx, const Tensor& dy) override;
  std::vector<float> init_param(size_t i, const std::string& full_name,
                                uint64_t seed) const override;

 private:
  int64_t num_, dim_;
};

// Per row of x (..., dim): (x - mean) / sqrt(var + eps) * weight + bias.
class LayerNorm : public Module {
 public:
  explicit LayerNorm(int64_t dim, float eps = 1e-5f);
  std::vector<ParamSpec> params() const override;
  Tensor forward(Ctx& ctx, const Tensor& x) override;
  Tensor backward(Ctx& ctx, const Tensor& dy) override;

 private:
  int64_t dim_;
  float eps_;
};

// Per row of x (..., dim): x / sqrt(mean(x^2) + eps) * weight.
class RMSNorm : public Module {
 public:
  explicit RMSNorm(int64_t dim, float eps = 1e-6f);
  std::vector<ParamSpec> params() const override;
  Tensor forward(Ctx& ctx, const Tensor& x) override;
  Tensor backward(Ctx& ctx, const Tensor& dy) override;

 private:
  int64_t dim_;
  float eps_;
};

// Elementwise activations on any shape; op kind gelu (the MLP activation kind) for all three.
enum class Activation { kGelu, kRelu, kSilu };

class ActivationModule : public Module {
 public:
  explicit ActivationModule(Activation act) : act_(act) {}
  std::vector<ParamSpec> params() const override { return {}; }
  Tensor forward(Ctx& ctx, const Tensor& x) override;
  Tensor backward(Ctx& ctx, const Tensor& dy) override;

 private:
  Activation act_;
};

// GELU, tanh form (PyTorch's approximate="tanh").
class GELU : public ActivationModule {
 public:
  GELU() : ActivationModule(Activation::kGelu) {}
};
class ReLU : public ActivationModule {
 public:
  ReLU() : ActivationModule(Activation::kRelu) {}
};
// x * sigmoid(x).
class SiLU : public ActivationModule {
 public:
  SiLU() : ActivationModule(Activation::kSilu) {}
};

// ctx.dropout: y = x * mask / (1 - p) with Philox masks (Note [Library dropout sites]); the
// identity in evaluation. p in [0, 1).
class Dropout : public Module {
 public:
  explicit Dropout(float p);
  std::vector<ParamSpec> params() const override { return {}; }
  Tensor forward(Ctx& ctx, const Tensor& x) override;
  Tensor backward(Ctx& ctx, const Tensor& dy) override;
  int dropout_sites() const override { return 1; }

 private:
  float p_;
};

// Pre-norm causal self-attention with its residual: y = x + drop(proj(attn(qkv(ln(x))))).
// x is (B, T, dim), or (B·T, dim) with (B, T) from ctx.run().batch and .seq. Heads of dim /
// heads channels; `flash` picks ctx.flash_attention over ctx.attention (the same values; flash
// never materialises the (B, heads, T, T) probabilities). Parameters ln.weight, ln.bias,
// qkv.weight (3 dim, dim), qkv.bias, proj.weight (dim, dim), proj.bias.
class AttentionBlock : public Module {
 public:
  AttentionBlock(int64_t dim, int heads, float dropout = 0.0f, bool flash = false,
                 float eps = 1e-5f);
  std::vector<ParamSpec> params() const override;
  Tensor forward(Ctx& ctx, const Tensor& x) override;
  Tensor backward(Ctx& ctx, const Tensor& dy) override;
  std::vector<float> init_param(size_t i, const std::string& full_name,
                                uint64_t seed) const override;
  int dropout_sites() const override { return 1; }

 private:
  int64_t dim_;
  int heads_;
  float dropout_;
  bool flash_;
  float eps_;
};

// Pre-norm MLP with its residual: y = x + drop(fc2(gelu(fc1(ln(x))))), x (..., dim).
// Parameters ln.weight, ln.bias, fc1.weight (hidden, dim), fc1.bias, fc2.weight (dim,
// hidden), fc2.bias.
class MlpBlock : public Module {
 public:
  MlpBlock(int64_t dim, int64_t hidden, float dropout = 0.0f, float eps = 1e-5f);
  std::vector<ParamSpec> params() const override;
  Tensor forward(Ctx& ctx, const Tensor& x) override;
  Tensor backward(Ctx& ctx, const Tensor& dy) override;
  std::vector<float> init_param(size_t i, const std::string& full_name,
                                uint64_t seed) const override;
  int dropout_sites() const override { return 1; }

 private:
  int64_t dim_, hidden_;
  float dropout_;
  float eps_;
};

// y = x + inner(x); inner must keep x's shape and dtype. Transparent (Note [Module scopes]):
// the parameters are inner's, under inner's names.
class Residual : public Module {
 public:
  explicit Residual(std::unique_ptr<Module> inner);
  std::vector<ParamSpec> params() const override { return inner_->params(); }
  void bind(std::span<const Tensor> params, std::span<const Tensor> grads) override;
  Tensor forward(Ctx& ctx, const Tensor& x) override;
  Tensor backward(Ctx& ctx, const Tensor& dy) override;
  std::vector<float> init_param(size_t i, const std::string& full_name,
                                uint64_t seed) const override;
  void set_scope(std::string scope) override;
  int dropout_sites() const override { return inner_->dropout_sites(); }
  void set_dropout_site(int first) override;
  Module& inner() { return *inner_; }

 private:
  std::unique_ptr<Module> inner_;
};

// Children run in order; backward runs their backwards in reverse, each child's dx the dy of
// the one before. Parameters are the children's, named "<child name>.<name>".
class Sequential : public Module {
 public:
  Sequential() = default;
  // Appends `module` under `name` (default: its index); names are unique, non-empty and
  // without '.'.
  Sequential& add(std::string name, std::unique_ptr<Module> module);
  Sequential& add(std::unique_ptr<Module> module);
  size_t size() const { return children_.size(); }
  Module& child(size_t i) { return *children_.at(i).second; }
  const std::string& child_name(size_t i) const { return children_.at(i).first; }

  std::vector<ParamSpec> params() const override;
  void bind(std::span<const Tensor> params, std::span<const Tensor> grads) override;
  Tensor forward(Ctx& ctx, const Tensor& x) override;
  Tensor backward(Ctx& ctx, const Tensor& dy) override;
  std::vector<float> init_param(size_t i, const std::string& full_name,
                                uint64_t seed) const override;
  void set_scope(std::string scope) override;
  int dropout_sites() const override;
  void set_dropout_site(int first) override;

 private:
  std::vector<std::pair<std::string, std::unique_ptr<Module>>> children_;
  std::vector<size_t> num_params_;  // per child, its params().size()
};

// Mean cross-entropy of logits (N, V) or (B, T, V) against targets i32 of the leading shape
// (N) or (B, T). Forward returns loss (1) f32; backward gives dlogits scaled by loss_scale().
class CrossEntropyLoss : public LossLayer {
 public:
  std::vector<ParamSpec> params() const override { return {}; }
  Tensor forward(Ctx& ctx, const Tensor& logits) override;
  Tensor backward(Ctx& ctx, const Tensor& dy) override;
};

// Mean over all elements of (pred - target)^2: pred (N, K) (or any rank >= 1), targets of
// pred's shape, any float dtypes. Forward returns loss (1) f32.
class MseLoss : public LossLayer {
 public:
  std::vector<ParamSpec> params() const override { return {}; }
  Tensor forward(Ctx& ctx, const Tensor& pred) override;
  Tensor backward(Ctx& ctx, const Tensor& dy) override;
};

// The JSON forms (docs/layers.md): {"type": "sequential", "layers": [{"type": "linear",
// "in": 16, "out": 64}, {"type": "relu"}, ...]}, {"type": "mse"}. Every key is checked:
// an unknown type or key, a missing or mistyped value throws InvalidArgument naming its JSON
// path and listing the valid types or keys.
std::unique_ptr<Module> module_from_json(const nlohmann::json& j);
std::unique_ptr<LossLayer> loss_from_json(const nlohmann::json& j);

}  // namespace porter::nn
