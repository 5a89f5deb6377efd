// The custom-layer example of docs/layers.md, compiled and checked so the document stays
// true: a gated MLP written to the layer contract, its gradients against finite
// differences, and bit-identical gradients under checkpoint + recompute.
#include <cmath>
#include <cstring>

#include <gtest/gtest.h>

#include "memory/caching_allocator.h"
#include "memory/device.h"
#include "kernels/kernels.h"
#include "nn/layer.h"

namespace porter::nn {

using namespace porter::tensor;
using namespace porter::kernels;
namespace {

// --- begin docs/layers.md example ---
// y = x + fc2(gelu(fc1(x))) * s, with a learned per-channel scale s (C).
class ScaledMlp : public Layer {
 public:
  ScaledMlp(int64_t hidden, int64_t inner) : c_(hidden), f_(inner) {}

  std::vector<ParamSpec> params() const override {
    return {{"fc1.weight", Shape{f_, c_}}, {"fc1.bias", Shape{f_}},
            {"fc2.weight", Shape{c_, f_}}, {"scale", Shape{c_}}};
  }

  Tensor forward(Ctx& ctx, const Tensor& x) override {  // x (N, C)
    Tensor h = ctx.linear("fc1", x, param(kFc1W), param(kFc1B));  // (N, F)
    Tensor g = ctx.gelu("gelu", h);
    Tensor f = ctx.linear("fc2", g, param(kFc2W), Tensor());     // (N, C), no bias
    // A user op through the generic entry point: out = f * scale, per channel.
    Tensor fs = ctx.op(OpKind::kOther, "scale", {f, param(kScale)}, {{f.shape(), f.dtype()}},
                       [&](std::span<Tensor> out) { scale_rows(ctx, f, out[0]); })[0];
    Tensor y = ctx.add("residual", x, fs);
    ctx.save("x", x);
    ctx.save("h", h);
    ctx.save("g", g);
    ctx.save("f", f);
    return y;
  }

  Tensor backward(Ctx& ctx, const Tensor& dy) override {
    Kernels& k = ctx.kernels();
    const Tensor& f = ctx.saved("f");
    // d(fs) = dy * scale; d(scale) += sum_rows(dy * f).
    Tensor dfs = ctx.workspace(dy.shape(), dy.dtype());
    scale_rows(ctx, dy, dfs);
    accumulate_scale_grad(ctx, dy, f);
    Tensor dg = ctx.workspace(ctx.saved("g").shape(), DType::kF32);
    k.matmul(dfs, param(kFc2W), dg);                                        // (N, C) @ (C, F)
    k.matmul(dfs, ctx.saved("g"), grad(kFc2W), MatmulSpec{true, false, 1.0f, 1.0f});
    Tensor dh = ctx.workspace(dg.shape(), DType::kF32);
    k.gelu_backward(ctx.saved("h"), dg, dh);
    Tensor dx = ctx.workspace(dy.shape(), dy.dtype());
    k.matmul(dh, param(kFc1W), dx);                                         // (N, F) @ (F, C)
    k.matmul(dh, ctx.saved("x"), grad(kFc1W), MatmulSpec{true, false, 1.0f, 1.0f});
    k.bias_backward(dh, grad(kFc1B));
    k.accumulate(dx, dy);  // the residual path
    return dx;
  }

 private:
  enum : size_t { kFc1W, kFc1B, kFc2W, kScale };

  // Host loops keep the example short; the cpu device's memory is host memory.
  void scale_rows(Ctx&, const Tensor& in, Tensor& out) const {
    const float* a = in.data_as<float>();
    const float* s = param(kScale).data_as<float>();
    float* o = out.data_as<float>();
    for (int64_t i = 0; i < in.numel(); ++i) o[i] = a[i] * s[i % c_];
  }
  void accumulate_scale_grad(Ctx&, const Tensor& dy, const Tensor& f) {
    const float* d = dy.data_as<float>();
    const float* v = f.data_as<float>();
    float* ds = grad(kScale).data_as<float>();
    for (int64_t i = 0; i < dy.numel(); ++i) ds[i % c_] += d[i] * v[i];
  }

  int64_t c_, f_;
};
// --- end docs/layers.md example ---

struct Fixture {
  std::unique_ptr<memory::Device> device = memory::make_device({});
  memory::CachingAllocator alloc{*device};
  std::unique_ptr<Kernels> kernels = make_kernels(alloc);
  ScaledMlp layer{8, 16};
  ParamLayout layout;
  std::unique_ptr<FlatParams> flat;
  Tensor x;

  Fixture() {
    layout.add("mlp", layer.params());
    flat = std::make_unique<FlatParams>(alloc, layout, DType::kF32, DType::kF32);
    std::vector<float> p(static_cast<size_t>(layout.total_elems()));
    for (size_t i = 0; i < p.size(); ++i) p[i] = 0.3f * std::sin(1.7f * static_cast<float>(i) + 0.2f);
    Tensor pt = flat->params();
    from_host_f32(*device, p, pt);
    bind_layer(layer, "mlp", *flat);
    x = Tensor::empty(alloc, Shape{5, 8}, DType::kF32, memory::Category::kWorkspace);
    std::vector<float> xv(40);
    for (size_t i = 0; i < xv.size(); ++i) xv[i] = std::cos(0.9f * static_cast<float>(i));
    from_host_f32(*device, xv, x);
  }

  // loss = sum(y * w) with fixed w; returns loss, leaves gradients in the flat buffer.
  double loss_and_grads(SaveMode mode, const OpPolicy& policy, bool backward) {
    Tensor g = flat->grads();
    kernels->fill(g, 0.0f);
    Ctx ctx(*kernels, alloc);
    Tape tape;
    Tensor y = forward_stage(ctx, layer, 0, tape, mode, x, policy);
    std::vector<float> yv = to_host_f32(*device, y);
    double loss = 0;
    std::vector<float> w(yv.size());
    for (size_t i = 0; i < yv.size(); ++i) {
      w[i] = 0.1f * static_cast<float>(i % 7) - 0.3f;
      loss += static_cast<double>(yv[i]) * w[i];
    }
    if (backward) {
      if (mode == SaveMode::kCheckpoint) recompute_stage(ctx, layer, 0, tape, x);
      Tensor dy = Tensor::empty(alloc, y.shape(), DType::kF32, memory::Category::kWorkspace);
      from_host_f32(*device, w, dy);
      backward_stage(ctx, layer, 0, tape, dy);
    }
    return loss;
  }
};

TEST(LayerExampleTest, GradientsMatchFiniteDifferences) {
  Fixture fx;
  fx.loss_and_grads(SaveMode::kSaveAll, OpPolicy::keep_none(), true);
  std::vector<float> analytic = to_host_f32(*fx.device, fx.flat->grads());
  float* p = fx.flat->params().data_as<float>();  // cpu device: host memory
  int checked = 0;
  for (const ParamEntry& e : fx.layout.entries()) {
    for (int64_t j = 0; j < e.shape.numel(); j += 5) {
      const int64_t i = e.offset_elems + j;
      const float orig = p[i];
      const float h = 1e-2f;
      p[i] = orig + h;
      const double up = fx.loss_and_grads(SaveMode::kSaveAll, OpPolicy::keep_none(), false);
      p[i] = orig - h;
      const double down = fx.loss_and_grads(SaveMode::kSaveAll, OpPolicy::keep_none(), false);
      p[i] = orig;
      const double numeric = (up - down) / (2.0 * h);
      EXPECT_NEAR(analytic[i], numeric, 2e-3 + 2e-3 * std::fabs(numeric)) << e.name << "[" << j << "]";
      ++checked;
    }
  }
  EXPECT_GT(checked, 40);
}

TEST(LayerExampleTest, RecomputeIsBitIdentical) {
  Fixture fx;
  fx.loss_and_grads(SaveMode::kSaveAll, OpPolicy::keep_none(), true);
  std::vector<float> base = to_host_f32(*fx.device, fx.flat->grads());
  for (const OpPolicy& policy : {OpPolicy::keep_none(), OpPolicy::keep_only({OpKind::kMatmul}),
                                 OpPolicy::recompute_only({OpKind::kOther})}) {
    fx.loss_and_grads(SaveMode::kCheckpoint, policy, true);
    std::vector<float> g = to_host_f32(*fx.device, fx.flat->grads());
    EXPECT_EQ(std::memcmp(g.data(), base.data(), g.size() * 4), 0) << policy.to_string();
  }
}

}  // namespace
}  // namespace porter::nn
