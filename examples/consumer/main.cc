// A program outside porter's tree, built against the installed package
// (find_package(porter)). It shows two things:
// 1. user-defined layers, written to the nn::Layer contract, trained through the Engine as
//    an engine::ChainModel with a user LossLayer (mean squared error), under full activation
//    checkpointing, printing the loss as it falls and the memory report;
// 2. the simulated device's memory budget: allocate by category, run out of memory on
//    purpose, recover.
#include <cstdio>
#include <memory>
#include <vector>

#include <porter/base/build_config.h>
#include <porter/config/parse.h>
#include <porter/engine/engine.h>
#include <porter/engine/model.h>
#include <porter/memory/caching_allocator.h>
#include <porter/memory/device.h>
#include <porter/nn/ctx.h>
#include <porter/nn/kernels.h>
#include <porter/nn/layer.h>

namespace porter::engine::example {

// Host loops keep the layers short: on the cpu device, device memory is host memory.
// Stage 0: token ids (B, T) i32 -> rows of a learned table (B*T, C).
class Lookup : public nn::Layer {
 public:
  Lookup(int64_t vocab, int64_t channels) : v_(vocab), c_(channels) {}
  std::vector<nn::ParamSpec> params() const override { return {{"table.weight", nn::Shape{v_, c_}}}; }

  nn::Tensor forward(nn::Ctx& ctx, const nn::Tensor& ids) override {
    const int64_t n = ids.numel();
    nn::Tensor y = ctx.op(nn::OpKind::kEmbedding, "lookup", {ids, param(0)},
                          {{nn::Shape{n, c_}, nn::DType::kF32}}, [&](std::span<nn::Tensor> out) {
                            const int32_t* id = ids.data_as<int32_t>();
                            const float* w = param(0).data_as<float>();
                            float* o = out[0].data_as<float>();
                            for (int64_t i = 0; i < n; ++i)
                              for (int64_t j = 0; j < c_; ++j) o[i * c_ + j] = w[id[i] * c_ + j];
                          })[0];
    ctx.save("ids", ids);
    return y;
  }

  nn::Tensor backward(nn::Ctx& ctx, const nn::Tensor& dy) override {
    const nn::Tensor& ids = ctx.saved("ids");
    const int32_t* id = ids.data_as<int32_t>();
    const float* d = dy.data_as<float>();
    float* dw = grad(0).data_as<float>();  // accumulate: micro-batches sum
    for (int64_t i = 0; i < ids.numel(); ++i)
      for (int64_t j = 0; j < c_; ++j) dw[id[i] * c_ + j] += d[i * c_ + j];
    return nn::Tensor();  // token ids have no gradient
  }

 private:
  int64_t v_, c_;
};

// A residual MLP: y = x + fc2(gelu(fc1(x))), x (N, C).
class ResidualMlp : public nn::Layer {
 public:
  ResidualMlp(int64_t channels, int64_t inner) : c_(channels), f_(inner) {}
  std::vector<nn::ParamSpec> params() const override {
    return {{"fc1.weight", nn::Shape{f_, c_}}, {"fc1.bias", nn::Shape{f_}},
            {"fc2.weight", nn::Shape{c_, f_}}, {"fc2.bias", nn::Shape{c_}}};
  }

  nn::Tensor forward(nn::Ctx& ctx, const nn::Tensor& x) override {
    nn::Tensor h = ctx.linear("fc1", x, param(0), param(1));
    nn::Tensor g = ctx.gelu("gelu", h);
    nn::Tensor f = ctx.linear("fc2", g, param(2), param(3));
    nn::Tensor y = ctx.add("residual", x, f);
    ctx.save("x", x);
    ctx.save("h", h);
    ctx.save("g", g);
    return y;
  }

  nn::Tensor backward(nn::Ctx& ctx, const nn::Tensor& dy) override {
    nn::Kernels& k = ctx.kernels();
    const nn::MatmulSpec acc{true, false, 1.0f, 1.0f};  // dW += dy^T @ input
    nn::Tensor dg = ctx.workspace(ctx.saved("g").shape(), nn::DType::kF32);
    k.matmul(dy, param(2), dg);
    k.matmul(dy, ctx.saved("g"), grad(2), acc);
    k.bias_backward(dy, grad(3));
    nn::Tensor dh = ctx.workspace(dg.shape(), nn::DType::kF32);
    k.gelu_backward(ctx.saved("h"), dg, dh);
    nn::Tensor dx = ctx.grad_like(dy);
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

  nn::Tensor forward(nn::Ctx& ctx, const nn::Tensor& x) override {
    const nn::Tensor& t = targets();
    nn::Tensor loss = ctx.op(nn::OpKind::kLoss, "mse", {x, t}, {{nn::Shape{1}, nn::DType::kF32}},
                             [&](std::span<nn::Tensor> out) {
                               double sum = 0;
                               for_each(x, t, [&](int64_t, float diff) { sum += double(diff) * diff; });
                               out[0].data_as<float>()[0] = static_cast<float>(sum / double(x.numel()));
                             })[0];
    ctx.save("x", x);
    return loss;
  }

  nn::Tensor backward(nn::Ctx& ctx, const nn::Tensor&) override {  // dy ignored (LossLayer)
    const nn::Tensor& x = ctx.saved("x");
    nn::Tensor dx = ctx.grad_like(x);
    float* d = dx.data_as<float>();
    const float k = 2.0f * loss_scale() / static_cast<float>(x.numel());
    for_each(x, targets(), [&](int64_t i, float diff) { d[i] = k * diff; });
    return dx;
  }

 private:
  template <typename Fn>
  void for_each(const nn::Tensor& x, const nn::Tensor& t, Fn fn) const {
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

}  // namespace porter::engine::example

namespace {

using namespace porter;

// Learn target(token) = (3 * token + 1) mod vocab, scaled to [0, 1), from token ids.
std::vector<engine::HostBatch> make_batches(const config::Config& c, int64_t step) {
  std::vector<engine::HostBatch> out;
  const int64_t b = c.train_micro_batch_size_per_gpu, t = c.porter.model.seq_len;
  const int64_t v = c.porter.model.vocab;
  for (int64_t m = 0; m < c.gradient_accumulation_steps; ++m) {
    engine::HostBatch mb;
    mb.batch = b;
    mb.seq = t;
    for (int64_t i = 0; i < b * t; ++i) {
      const auto tok = static_cast<int32_t>((i * 5 + m * 3 + step * 7) % v);
      mb.tokens.push_back(tok);
      mb.targets.push_back(static_cast<int32_t>((3 * tok + 1) % v));
    }
    out.push_back(std::move(mb));
  }
  return out;
}

int train_user_chain() {
  const char* json = R"({
    "train_batch_size": 8,
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 0,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.03, "weight_decay": 0.0}},
    "porter": {
      "model": {"seq_len": 8, "vocab": 16},
      "device": {"type": "cpu"},
      "checkpointing": {"policy": "full"},
      "train": {"seed": 1}
    }
  })";
  const config::Config c = config::parse_config_string(json).config;
  memory::DeviceOptions options;
  options.memory_limit_bytes = 64u << 20;
  auto device = memory::make_device(options);
  engine::Engine e(*device, engine::example::make_regressor(16, 8, 16), c);
  std::printf("plan: %s\n", e.plan().description.c_str());
  double first = 0, last = 0;
  for (int64_t s = 0; s < 60; ++s) {
    const engine::StepResult r = e.train_step(make_batches(c, s));
    if (s == 0) first = r.loss;
    last = r.loss;
    if (s % 10 == 0 || s == 59) std::printf("step %3lld  loss %.5f\n", static_cast<long long>(r.step), r.loss);
  }
  std::printf("%s", e.memory_report().format().c_str());
  if (!(last < 0.2 * first)) {
    std::printf("unexpected: the loss did not fall (%.5f -> %.5f)\n", first, last);
    return 1;
  }
  return 0;
}

int memory_budget_demo() {
  using namespace porter::memory;
  DeviceOptions options;
  options.kind = DeviceKind::kCpu;
  options.memory_limit_bytes = 64u << 20;
  auto device = make_device(options);
  CachingAllocator allocator(*device);

  DeviceBuffer params = allocator.allocate(16u << 20, Category::kParams);
  DeviceBuffer acts = allocator.allocate(40u << 20, Category::kActivations);
  try {
    DeviceBuffer too_much = allocator.allocate(16u << 20, Category::kWorkspace);
    std::printf("unexpected: the 64 MiB device accepted 72 MiB\n");
    return 1;
  } catch (const porter::OutOfMemoryError& e) {
    std::printf("porter %s caught the expected out-of-memory:\n%s\n", PORTER_VERSION, e.what());
  }
  acts.reset();
  DeviceBuffer retry = allocator.allocate(16u << 20, Category::kWorkspace);
  std::printf("after freeing activations the retry succeeded:\n%s",
              format_stats(allocator.stats()).c_str());
  return retry.empty() ? 1 : 0;
}

}  // namespace

int main() {
  if (int rc = train_user_chain(); rc != 0) return rc;
  return memory_budget_demo();
}
