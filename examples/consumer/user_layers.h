// The user-layer example of docs/engine.md: layers written to the nn::Layer contract (a
// lookup, a residual MLP and a mean-squared-error LossLayer) and trained through the Engine
// as an engine::ChainModel. examples/consumer/main.cc trains them against the installed
// package; tests/engine/engine_user_layer_test.cc checks them in-tree (the loss falls, the
// gradients pass finite differences, full checkpointing is bit-identical).
// Host loops keep it short: on the cpu device, device memory is host memory.
#pragma once

#include <cstdint>
#include <vector>

#if __has_include(<porter/engine/model.h>)  // an installed porter (find_package)
#include <porter/engine/model.h>
#include <porter/nn/ctx.h>
#include <porter/kernels/kernels.h>
#include <porter/nn/layer.h>
#else  // porter's own tree
#include "engine/model.h"
#include "nn/ctx.h"
#include "kernels/kernels.h"
#include "nn/layer.h"
#endif

namespace porter::engine::example {

// --- begin docs/engine.md example ---
// Stage 0: token ids (B, T) i32 -> rows of a learned table (B*T, C).
class Lookup : public nn::Layer {
 public:
  Lookup(int64_t vocab, int64_t channels) : v_(vocab), c_(channels) {}
  std::vector<nn::ParamSpec> params() const override { return {{"table.weight", tensor::Shape{v_, c_}}}; }

  tensor::Tensor forward(nn::Ctx& ctx, const tensor::Tensor& ids) override {
    const int64_t n = ids.numel();
    tensor::Tensor y = ctx.op(nn::OpKind::kEmbedding, "lookup", {ids, param(0)},
                          {{tensor::Shape{n, c_}, tensor::DType::kF32}}, [&](std::span<tensor::Tensor> out) {
                            const int32_t* id = ids.data_as<int32_t>();
                            const float* w = param(0).data_as<float>();
                            float* o = out[0].data_as<float>();
                            for (int64_t i = 0; i < n; ++i)
                              for (int64_t j = 0; j < c_; ++j) o[i * c_ + j] = w[id[i] * c_ + j];
                          })[0];
    ctx.save("ids", ids);
    return y;
  }

  tensor::Tensor backward(nn::Ctx& ctx, const tensor::Tensor& dy) override {
    const tensor::Tensor& ids = ctx.saved("ids");
    const int32_t* id = ids.data_as<int32_t>();
    const float* d = dy.data_as<float>();
    float* dw = grad(0).data_as<float>();  // accumulate: micro-batches sum
    for (int64_t i = 0; i < ids.numel(); ++i)
      for (int64_t j = 0; j < c_; ++j) dw[id[i] * c_ + j] += d[i * c_ + j];
    return tensor::Tensor();  // token ids have no gradient
  }

 private:
  int64_t v_, c_;
};

// A residual MLP: y = x + fc2(gelu(fc1(x))), x (N, C).
class ResidualMlp : public nn::Layer {
 public:
  ResidualMlp(int64_t channels, int64_t inner) : c_(channels), f_(inner) {}
  std::vector<nn::ParamSpec> params() const override {
    return {{"fc1.weight", tensor::Shape{f_, c_}}, {"fc1.bias", tensor::Shape{f_}},
            {"fc2.weight", tensor::Shape{c_, f_}}, {"fc2.bias", tensor::Shape{c_}}};
  }

  tensor::Tensor forward(nn::Ctx& ctx, const tensor::Tensor& x) override {
    tensor::Tensor h = ctx.linear("fc1", x, param(0), param(1));
    tensor::Tensor g = ctx.gelu("gelu", h);
    tensor::Tensor f = ctx.linear("fc2", g, param(2), param(3));
    tensor::Tensor y = ctx.add("residual", x, f);
    ctx.save("x", x);
    ctx.save("h", h);
    ctx.save("g", g);
    return y;
  }

  tensor::Tensor backward(nn::Ctx& ctx, const tensor::Tensor& dy) override {
    kernels::Kernels& k = ctx.kernels();
    const kernels::MatmulSpec acc{true, false, 1.0f, 1.0f};  // dW += dy^T @ input
    tensor::Tensor dg = ctx.workspace(ctx.saved("g").shape(), tensor::DType::kF32);
    k.matmul(dy, param(2), dg);
    k.matmul(dy, ctx.saved("g"), grad(2), acc);
    k.bias_backward(dy, grad(3));
    tensor::Tensor dh = ctx.workspace(dg.shape(), tensor::DType::kF32);
    k.gelu_backward(ctx.saved("h"), dg, dh);
    tensor::Tensor dx = ctx.grad_like(dy);
    k.matmul(dh, param(0), dx);
    k.matmul(dh, ctx.saved("x"), grad(0), acc);
    k.bias_backward(dh, grad(1));
    k.accumulate(dx, dy);  // the residual path
    return dx;
  }

 private:
  int64_t c_, f_;
};

// Mean squared error against targets / vocab, broadcast over the C channels:
// loss = mean_{n,c} (x[n,c] - t_n)^2.
class MseLoss : public LossLayer {
 public:
  explicit MseLoss(int64_t vocab) : v_(vocab) {}
  std::vector<nn::ParamSpec> params() const override { return {}; }

  tensor::Tensor forward(nn::Ctx& ctx, const tensor::Tensor& x) override {
    const tensor::Tensor& t = targets();
    tensor::Tensor loss = ctx.op(nn::OpKind::kLoss, "mse", {x, t}, {{tensor::Shape{1}, tensor::DType::kF32}},
                             [&](std::span<tensor::Tensor> out) {
                               double sum = 0;
                               for_each(x, t, [&](int64_t, float diff) { sum += double(diff) * diff; });
                               out[0].data_as<float>()[0] = static_cast<float>(sum / double(x.numel()));
                             })[0];
    ctx.save("x", x);
    return loss;
  }

  tensor::Tensor backward(nn::Ctx& ctx, const tensor::Tensor&) override {  // dy ignored (LossLayer)
    const tensor::Tensor& x = ctx.saved("x");
    tensor::Tensor dx = ctx.grad_like(x);
    float* d = dx.data_as<float>();
    const float k = 2.0f * loss_scale() / static_cast<float>(x.numel());
    for_each(x, targets(), [&](int64_t i, float diff) { d[i] = k * diff; });
    return dx;
  }

 private:
  template <typename Fn>
  void for_each(const tensor::Tensor& x, const tensor::Tensor& t, Fn fn) const {
    const float* xv = x.data_as<float>();
    const int32_t* tv = t.data_as<int32_t>();
    const int64_t c = x.dim(-1);
    for (int64_t i = 0; i < x.numel(); ++i)
      fn(i, xv[i] - static_cast<float>(tv[i / c]) / static_cast<float>(v_));
  }
  int64_t v_;
};

inline std::unique_ptr<ChainModel> make_regressor(int64_t vocab, int64_t channels, int64_t inner) {
  std::vector<std::unique_ptr<nn::Layer>> layers;
  layers.push_back(std::make_unique<Lookup>(vocab, channels));
  layers.push_back(std::make_unique<ResidualMlp>(channels, inner));
  layers.push_back(std::make_unique<ResidualMlp>(channels, inner));
  return std::make_unique<ChainModel>(std::move(layers), std::make_unique<MseLoss>(vocab));
}
// --- end docs/engine.md example ---

}  // namespace porter::engine::example
