// The layer library (nn/library.h): every module and loss against a float64 reference forward
// written here on host loops, its gradients against the float64 gradient of that reference
// (central differences in f64, exact to ~1e-9) and against central finite differences of
// porter's own forward; bit-identical results under checkpoint + recompute; Sequential's
// derived backward against running its children one by one; init; the JSON factory; errors.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <nlohmann/json.hpp>

#include "base/error.h"
#include "nn/library.h"
#include "tensor/philox.h"
#include "tests/nn/nn_test_util.h"

namespace porter::nn {

using namespace porter::tensor;
using namespace porter::kernels;
namespace {

using testing::Env;
using testing::random_values;
using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

using Vec = std::vector<double>;
using Params = std::vector<Vec>;  // one per params() entry, in order
// A float64 reference forward: y from x and the parameters.
using Ref = std::function<Vec(const Vec& x, const Params& p)>;

constexpr uint64_t kSeed = 1234;
RunInfo run_info(int64_t batch = 0, int64_t seq = 0) {
  RunInfo r;
  r.seed = 99;
  r.step = 3;
  r.micro_batch = 1;
  r.batch = batch;
  r.seq = seq;
  return r;
}

// ---- float64 references ----

Vec linear_ref(const Vec& x, const Vec& w, const Vec* b, int64_t in, int64_t out) {
  const int64_t n = static_cast<int64_t>(x.size()) / in;
  Vec y(static_cast<size_t>(n * out));
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t o = 0; o < out; ++o) {
      double s = b ? (*b)[o] : 0.0;
      for (int64_t i = 0; i < in; ++i) s += x[r * in + i] * w[o * in + i];
      y[r * out + o] = s;
    }
  }
  return y;
}

Vec layernorm_ref(const Vec& x, const Vec& g, const Vec& b, int64_t c, double eps) {
  Vec y(x.size());
  for (size_t r = 0; r < x.size() / c; ++r) {
    double m = 0, v = 0;
    for (int64_t i = 0; i < c; ++i) m += x[r * c + i];
    m /= c;
    for (int64_t i = 0; i < c; ++i) v += (x[r * c + i] - m) * (x[r * c + i] - m);
    v /= c;
    for (int64_t i = 0; i < c; ++i) y[r * c + i] = (x[r * c + i] - m) / std::sqrt(v + eps) * g[i] + b[i];
  }
  return y;
}

Vec rmsnorm_ref(const Vec& x, const Vec& g, int64_t c, double eps) {
  Vec y(x.size());
  for (size_t r = 0; r < x.size() / c; ++r) {
    double ms = 0;
    for (int64_t i = 0; i < c; ++i) ms += x[r * c + i] * x[r * c + i];
    ms /= c;
    for (int64_t i = 0; i < c; ++i) y[r * c + i] = x[r * c + i] / std::sqrt(ms + eps) * g[i];
  }
  return y;
}

double gelu(double v) {
  return 0.5 * v * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (v + 0.044715 * v * v * v)));
}

Vec map(const Vec& x, double (*f)(double)) {
  Vec y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = f(x[i]);
  return y;
}

Vec add(const Vec& a, const Vec& b) {
  Vec y(a.size());
  for (size_t i = 0; i < a.size(); ++i) y[i] = a[i] + b[i];
  return y;
}

// ctx.dropout's mask at `site` of stage 0 under run_info() (Note [Dropout keys]).
Vec dropout_ref(const Vec& x, double p, int site) {
  if (p == 0.0) return x;
  const RunInfo r = run_info();
  const PhiloxKey key = dropout_key(r.seed, 0, r.step, r.micro_batch, static_cast<uint32_t>(site));
  const double scale = 1.0f / (1.0f - static_cast<float>(p));
  Vec y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = philox_uniform(key, i) >= p ? x[i] * scale : 0.0;
  return y;
}

// Causal softmax attention of qkv (B, T, 3C), heads of C / heads.
Vec attention_ref(const Vec& qkv, int64_t b, int64_t t, int64_t c, int heads) {
  const int64_t d = c / heads;
  Vec out(static_cast<size_t>(b * t * c), 0.0);
  for (int64_t bi = 0; bi < b; ++bi) {
    for (int h = 0; h < heads; ++h) {
      for (int64_t i = 0; i < t; ++i) {
        const double* q = &qkv[(bi * t + i) * 3 * c + h * d];
        Vec s(static_cast<size_t>(i + 1));
        double mx = -1e300, sum = 0;
        for (int64_t j = 0; j <= i; ++j) {
          const double* k = &qkv[(bi * t + j) * 3 * c + c + h * d];
          double dot = 0;
          for (int64_t e = 0; e < d; ++e) dot += q[e] * k[e];
          s[j] = dot / std::sqrt(static_cast<double>(d));
          mx = std::max(mx, s[j]);
        }
        for (int64_t j = 0; j <= i; ++j) sum += (s[j] = std::exp(s[j] - mx));
        for (int64_t j = 0; j <= i; ++j) {
          const double* v = &qkv[(bi * t + j) * 3 * c + 2 * c + h * d];
          for (int64_t e = 0; e < d; ++e) out[(bi * t + i) * c + h * d + e] += s[j] / sum * v[e];
        }
      }
    }
  }
  return out;
}

Ref attention_block_ref(int64_t b, int64_t t, int64_t c, int heads, double p, int site) {
  return [=](const Vec& x, const Params& w) {
    Vec ln = layernorm_ref(x, w[0], w[1], c, 1e-5);
    Vec qkv = linear_ref(ln, w[2], &w[3], c, 3 * c);
    Vec att = attention_ref(qkv, b, t, c, heads);
    return add(x, dropout_ref(linear_ref(att, w[4], &w[5], c, c), p, site));
  };
}

Ref mlp_block_ref(int64_t c, int64_t f, double p, int site) {
  return [=](const Vec& x, const Params& w) {
    Vec ln = layernorm_ref(x, w[0], w[1], c, 1e-5);
    Vec g = map(linear_ref(ln, w[2], &w[3], c, f), gelu);
    return add(x, dropout_ref(linear_ref(g, w[4], &w[5], f, c), p, site));
  };
}

// ---- the harness: one module as stage 0 of the cpu device ----

// One cpu device for every harness: it must outlive the modules, which hold views of the
// parameters it allocated.
Env& shared_env() {
  static Env env;
  return env;
}

struct Harness {
  Env& env = shared_env();
  Layer& layer;
  ParamLayout layout;
  std::unique_ptr<FlatParams> flat;
  Tensor x;          // the stage input
  Vec w;             // L = sum(w * y) for modules
  RunInfo run = run_info();

  // Params from the module's own init_param (a Module) or small sines.
  Harness(Layer& l, const std::vector<float>& xv, Shape xshape, DType xdtype = DType::kF32)
      : layer(l) {
    layout.add("m", layer.params());
    flat = std::make_unique<FlatParams>(*env.allocator, layout, DType::kF32, DType::kF32);
    std::vector<float> p(static_cast<size_t>(layout.total_elems()), 0.0f);
    auto* module = dynamic_cast<Module*>(&layer);
    const std::vector<ParamSpec> specs = layer.params();
    for (size_t i = 0; i < specs.size(); ++i) {
      const ParamEntry& e = layout.entries()[i];
      std::vector<float> v = module ? module->init_param(i, e.name, kSeed)
                                    : std::vector<float>(static_cast<size_t>(e.shape.numel()));
      // Norm gains of 1 and biases of 0 would hide their gradients' mistakes: perturb them.
      for (size_t j = 0; j < v.size(); ++j) v[j] += 0.2f * std::sin(1.3f * static_cast<float>(j + 7 * i));
      std::copy(v.begin(), v.end(), p.begin() + e.offset_elems);
    }
    Tensor pt = flat->params();
    from_host_f32(*env.device, p, pt);
    bind_layer(layer, "m", *flat);
    if (xdtype == DType::kI32) {
      std::vector<int32_t> ids(xv.begin(), xv.end());
      x = env.ids(ids, xshape);
    } else {
      x = env.from(xv, xshape, xdtype);
    }
  }

  Params params_f64() const {
    Params out;
    const float* p = flat->params().data_as<float>();  // cpu device: host memory
    for (const ParamEntry& e : layout.entries()) {
      out.emplace_back(p + e.offset_elems, p + e.offset_elems + e.shape.numel());
    }
    return out;
  }
  Vec x_f64() const {
    if (x.dtype() == DType::kI32) {
      const int32_t* v = x.data_as<int32_t>();
      return Vec(v, v + x.numel());
    }
    const float* v = x.data_as<float>();
    return Vec(v, v + x.numel());
  }

  struct Result {
    std::vector<float> y, dx, grads;
  };

  // One forward (and backward) of the stage; grads are zeroed first.
  Result run_once(SaveMode mode, const OpPolicy& policy, bool backward) {
    Tensor g = flat->grads();
    env.kernels->fill(g, 0.0f);
    Ctx ctx(*env.kernels, *env.allocator);
    ctx.set_run(run);
    Tape tape;
    Result r;
    Tensor y = forward_stage(ctx, layer, 0, tape, mode, x, policy);
    r.y = env.host(y);
    if (!backward) return r;
    if (w.empty()) w = Vec(r.y.size());
    for (size_t i = 0; i < w.size(); ++i) w[i] = 0.1 * static_cast<double>(i % 7) - 0.27;
    if (mode == SaveMode::kCheckpoint) recompute_stage(ctx, layer, 0, tape, x);
    std::vector<float> wf(w.begin(), w.end());
    Tensor dy = env.from(wf, y.shape());
    if (dynamic_cast<LossLayer*>(&layer) != nullptr) dy = env.from({1.0f}, Shape{1});
    Tensor dx = backward_stage(ctx, layer, 0, tape, dy);
    if (dx.defined() && dx.numel() > 0) r.dx = env.host(dx);
    r.grads = env.host(flat->grads());
    return r;
  }

  double objective(const std::vector<float>& y) const {
    if (dynamic_cast<LossLayer*>(&layer) != nullptr) return y[0];
    double s = 0;
    for (size_t i = 0; i < y.size(); ++i) s += y[i] * w[i];
    return s;
  }
};

// Checks a module (or loss) against its reference: forward, the f64 gradient of the reference,
// porter's own finite differences, and bit identity under checkpoint + recompute.
void check_layer(Harness& h, const Ref& ref, double fwd_tol = 2e-5, double grad_tol = 2e-4) {
  const bool is_loss = dynamic_cast<LossLayer*>(&h.layer) != nullptr;
  Harness::Result base = h.run_once(SaveMode::kSaveAll, OpPolicy::keep_none(), true);
  const Params p = h.params_f64();
  const Vec x = h.x_f64();
  auto objective = [&](const Vec& xv, const Params& pv) {
    Vec y = ref(xv, pv);
    if (is_loss) return y[0];
    double s = 0;
    for (size_t i = 0; i < y.size(); ++i) s += y[i] * h.w[i];
    return s;
  };
  // Forward.
  Vec y = ref(x, p);
  ASSERT_EQ(y.size(), base.y.size());
  for (size_t i = 0; i < y.size(); ++i) {
    ASSERT_NEAR(base.y[i], y[i], fwd_tol * std::max(1.0, std::fabs(y[i]))) << "y[" << i << "]";
  }
  // Gradients: f64 central differences of the reference (h = 1e-6: error ~1e-9), and central
  // differences of porter's f32 forward (h = 1e-2, accumulated in f64), on a sample.
  const bool float_input = h.x.dtype() != DType::kI32;
  float* xp = float_input ? h.x.data_as<float>() : nullptr;
  float* pp = h.flat->params().data_as<float>();
  constexpr float kStep = 1e-2f;
  int smooth = 0;
  // ref_big: the reference's own difference quotient at porter's step; where it is far from
  // the gradient, the step straddles a kink (relu) and no finite difference can compare.
  auto check = [&](double analytic, double ref_grad, double ref_big, float* porter_value,
                   const std::string& what) {
    EXPECT_NEAR(analytic, ref_grad, grad_tol * std::max(1.0, std::fabs(ref_grad))) << what << " vs f64 reference";
    if (std::fabs(ref_big - ref_grad) > 1e-3 + 1e-3 * std::fabs(ref_grad)) return;
    ++smooth;
    const float orig = *porter_value;
    const float step = kStep;
    *porter_value = orig + step;
    const double up = h.objective(h.run_once(SaveMode::kSaveAll, OpPolicy::keep_none(), false).y);
    *porter_value = orig - step;
    const double down = h.objective(h.run_once(SaveMode::kSaveAll, OpPolicy::keep_none(), false).y);
    *porter_value = orig;
    const double numeric = (up - down) / (2.0 * step);
    EXPECT_NEAR(analytic, numeric, 3e-3 + 3e-3 * std::fabs(numeric)) << what << " vs finite differences";
  };
  constexpr double kH = 1e-6;
  if (float_input) {
    ASSERT_EQ(base.dx.size(), x.size());
    for (size_t i = 0; i < x.size(); i += 1 + x.size() / 12) {
      auto at = [&](double step) {
        Vec xu = x, xd = x;
        xu[i] += step;
        xd[i] -= step;
        return (objective(xu, p) - objective(xd, p)) / (2 * step);
      };
      check(base.dx[i], at(kH), at(kStep), xp + i, "dx[" + std::to_string(i) + "]");
    }
  } else {
    EXPECT_TRUE(base.dx.empty());
  }
  for (size_t e = 0; e < p.size(); ++e) {
    const ParamEntry& entry = h.layout.entries()[e];
    for (size_t j = 0; j < p[e].size(); j += 1 + p[e].size() / 8) {
      auto at = [&](double step) {
        Params pu = p, pd = p;
        pu[e][j] += step;
        pd[e][j] -= step;
        return (objective(x, pu) - objective(x, pd)) / (2 * step);
      };
      const size_t flat_index = static_cast<size_t>(entry.offset_elems) + j;
      check(base.grads[flat_index], at(kH), at(kStep), pp + flat_index,
            entry.name + "[" + std::to_string(j) + "]");
    }
  }
  EXPECT_GT(smooth, 0) << "no element was compared with finite differences";
  // Memory settings never change results: checkpoint + recompute under several policies.
  for (const OpPolicy& policy : {OpPolicy::keep_none(), OpPolicy::keep_only({OpKind::kMatmul}),
                                 OpPolicy::selective_attention(), OpPolicy::keep_all()}) {
    Harness::Result r = h.run_once(SaveMode::kCheckpoint, policy, true);
    EXPECT_EQ(r.y, base.y) << policy.to_string();
    ASSERT_EQ(r.dx.size(), base.dx.size());
    ASSERT_EQ(r.grads.size(), base.grads.size());
    // Bits, not values (NaN == NaN); no input gradient (ids) or no parameters compare empty.
    if (!r.dx.empty()) {
      EXPECT_EQ(std::memcmp(r.dx.data(), base.dx.data(), r.dx.size() * 4), 0) << policy.to_string();
    }
    if (!r.grads.empty()) {
      EXPECT_EQ(std::memcmp(r.grads.data(), base.grads.data(), r.grads.size() * 4), 0)
          << policy.to_string();
    }
  }
}

std::vector<float> inputs(size_t n, uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  return random_values(n, seed, lo, hi);
}

// ---- modules ----

TEST(LibraryTest, Linear) {
  for (bool bias : {true, false}) {
    Linear layer(5, 4, bias);
    Harness h(layer, inputs(30, 1), Shape{2, 3, 5});  // (..., in)
    check_layer(h, [&](const Vec& x, const Params& p) {
      return linear_ref(x, p[0], bias ? &p[1] : nullptr, 5, 4);
    });
  }
}

TEST(LibraryTest, Embedding) {
  Embedding layer(7, 4);
  Harness h(layer, {0, 6, 3, 3, 1, 5}, Shape{2, 3}, DType::kI32);
  check_layer(h, [](const Vec& ids, const Params& p) {
    Vec y;
    for (double id : ids) {
      for (int64_t j = 0; j < 4; ++j) y.push_back(p[0][static_cast<size_t>(id) * 4 + j]);
    }
    return y;
  });
}

TEST(LibraryTest, LayerNormAndRmsNorm) {
  LayerNorm ln(6);
  Harness h1(ln, inputs(24, 2, -2.0f, 2.0f), Shape{4, 6});
  check_layer(h1, [](const Vec& x, const Params& p) { return layernorm_ref(x, p[0], p[1], 6, 1e-5); });
  RMSNorm rms(6);
  Harness h2(rms, inputs(24, 3, -2.0f, 2.0f), Shape{2, 2, 6});
  check_layer(h2, [](const Vec& x, const Params& p) { return rmsnorm_ref(x, p[0], 6, 1e-6); });
}

TEST(LibraryTest, Activations) {
  // Away from relu's kink, where finite differences straddle it.
  std::vector<float> x = inputs(15, 4, -3.0f, 3.0f);
  for (float& v : x) v = v < 0 ? v - 0.05f : v + 0.05f;
  GELU g;
  Harness h1(g, x, Shape{3, 5});
  check_layer(h1, [](const Vec& v, const Params&) { return map(v, gelu); }, 1e-5);
  ReLU r;
  Harness h2(r, x, Shape{3, 5});
  check_layer(h2, [](const Vec& v, const Params&) {
    return map(v, [](double a) { return a > 0 ? a : 0.0; });
  }, 1e-6);
  SiLU s;
  Harness h3(s, x, Shape{3, 5});
  check_layer(h3, [](const Vec& v, const Params&) {
    return map(v, [](double a) { return a / (1.0 + std::exp(-a)); });
  }, 1e-5);
}

TEST(LibraryTest, Dropout) {
  Dropout d(0.3f);
  Harness h(d, inputs(64, 5), Shape{8, 8});
  check_layer(h, [](const Vec& x, const Params&) { return dropout_ref(x, 0.3, 0); });
  // Evaluation: the identity.
  h.run.eval = true;
  EXPECT_EQ(h.run_once(SaveMode::kSaveAll, OpPolicy::keep_none(), false).y, inputs(64, 5));
}

TEST(LibraryTest, AttentionBlock) {
  for (bool flash : {false, true}) {
    for (bool rows : {false, true}) {
      AttentionBlock block(8, 2, 0.1f, flash);
      Harness h(block, inputs(48, 6), rows ? Shape{6, 8} : Shape{2, 3, 8});
      if (rows) h.run = run_info(2, 3);  // (B*T, C) takes (B, T) from RunInfo
      check_layer(h, attention_block_ref(2, 3, 8, 2, 0.1, 0));
    }
  }
}

TEST(LibraryTest, MlpBlock) {
  MlpBlock block(6, 12, 0.2f);
  Harness h(block, inputs(24, 7), Shape{4, 6});
  check_layer(h, mlp_block_ref(6, 12, 0.2, 0));
}

TEST(LibraryTest, Residual) {
  Residual res(std::make_unique<Linear>(6, 6));
  EXPECT_EQ(res.params()[0].name, "weight");  // transparent
  Harness h(res, inputs(18, 8), Shape{3, 6});
  check_layer(h, [](const Vec& x, const Params& p) { return add(x, linear_ref(x, p[0], &p[1], 6, 6)); });
}

// Every kind of module in one stage, two dropouts among them: save names must not collide
// and each dropout must regenerate its own site's mask.
std::unique_ptr<Sequential> mixed_model() {
  auto seq = std::make_unique<Sequential>();
  seq->add(std::make_unique<Linear>(5, 8))
      .add("act", std::make_unique<ReLU>())
      .add(std::make_unique<Dropout>(0.25f))
      .add(std::make_unique<Residual>(std::make_unique<MlpBlock>(8, 16, 0.1f)))
      .add("attn", std::make_unique<AttentionBlock>(8, 2, 0.1f))
      .add(std::make_unique<SiLU>())
      .add(std::make_unique<RMSNorm>(8))
      .add(std::make_unique<Linear>(8, 3, false));
  return seq;
}

Ref mixed_ref() {
  return [](const Vec& x, const Params& p) {
    Vec h = linear_ref(x, p[0], &p[1], 5, 8);
    h = map(h, [](double a) { return a > 0 ? a : 0.0; });
    h = dropout_ref(h, 0.25, 0);
    h = add(h, mlp_block_ref(8, 16, 0.1, 1)(h, Params(p.begin() + 2, p.begin() + 8)));
    h = attention_block_ref(1, 6, 8, 2, 0.1, 2)(h, Params(p.begin() + 8, p.begin() + 14));
    h = map(h, [](double a) { return a / (1.0 + std::exp(-a)); });
    h = rmsnorm_ref(h, p[14], 8, 1e-6);
    return linear_ref(h, p[15], nullptr, 8, 3);
  };
}

TEST(LibraryTest, SequentialOfEveryModule) {
  auto seq = mixed_model();
  std::vector<std::string> names;
  for (const ParamSpec& s : seq->params()) names.push_back(s.name);
  EXPECT_THAT(names, ::testing::ElementsAre(
                         "0.weight", "0.bias", "3.ln.weight", "3.ln.bias", "3.fc1.weight",
                         "3.fc1.bias", "3.fc2.weight", "3.fc2.bias", "attn.ln.weight",
                         "attn.ln.bias", "attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight",
                         "attn.proj.bias", "6.weight", "7.weight"));
  EXPECT_EQ(seq->dropout_sites(), 3);
  Harness h(*seq, inputs(30, 9), Shape{1, 6, 5});
  check_layer(h, mixed_ref());
}

// Sequential's derived backward is its children's backwards composed in reverse: the same
// bits as running each child as its own stage.
TEST(LibraryTest, SequentialBackwardComposesChildren) {
  Sequential seq;
  seq.add(std::make_unique<Linear>(5, 8))
      .add(std::make_unique<GELU>())
      .add(std::make_unique<Residual>(std::make_unique<Linear>(8, 8)))
      .add(std::make_unique<LayerNorm>(8));
  Harness h(seq, inputs(20, 10), Shape{4, 5});
  Harness::Result whole = h.run_once(SaveMode::kSaveAll, OpPolicy::keep_none(), true);

  Tensor g = h.flat->grads();
  h.env.kernels->fill(g, 0.0f);
  Ctx ctx(*h.env.kernels, *h.env.allocator);
  ctx.set_run(h.run);
  std::vector<Tape> tapes(seq.size());
  std::vector<Tensor> acts = {h.x};
  for (size_t i = 0; i < seq.size(); ++i) {
    acts.push_back(forward_stage(ctx, seq.child(i), static_cast<int>(i), tapes[i],
                                 SaveMode::kSaveAll, acts.back()));
  }
  EXPECT_EQ(h.env.host(acts.back()), whole.y);
  std::vector<float> wf(h.w.begin(), h.w.end());
  Tensor d = h.env.from(wf, acts.back().shape());
  for (size_t i = seq.size(); i-- > 0;) {
    d = backward_stage(ctx, seq.child(i), static_cast<int>(i), tapes[i], d);
  }
  EXPECT_EQ(h.env.host(d), whole.dx);
  EXPECT_EQ(h.env.host(h.flat->grads()), whole.grads);
}

// ---- losses ----

TEST(LibraryTest, CrossEntropyLoss) {
  CrossEntropyLoss loss;
  Harness h(loss, inputs(30, 11, -3.0f, 3.0f), Shape{2, 3, 5});
  Env& env = h.env;
  const std::vector<int32_t> t = {0, 4, 2, 2, 1, 3};
  loss.set_targets(env.ids(t, Shape{2, 3}));
  check_layer(h, [&](const Vec& x, const Params&) {
    double sum = 0;
    for (size_t r = 0; r < t.size(); ++r) {
      double mx = -1e300, s = 0;
      for (int j = 0; j < 5; ++j) mx = std::max(mx, x[r * 5 + j]);
      for (int j = 0; j < 5; ++j) s += std::exp(x[r * 5 + j] - mx);
      sum += std::log(s) + mx - x[r * 5 + t[r]];
    }
    return Vec{sum / static_cast<double>(t.size())};
  });
  // backward scales by loss_scale().
  std::vector<float> dx1 = h.run_once(SaveMode::kSaveAll, OpPolicy::keep_none(), true).dx;
  loss.set_loss_scale(0.25f);
  std::vector<float> dx2 = h.run_once(SaveMode::kSaveAll, OpPolicy::keep_none(), true).dx;
  for (size_t i = 0; i < dx1.size(); ++i) EXPECT_EQ(dx2[i], dx1[i] * 0.25f) << i;
}

TEST(LibraryTest, MseLoss) {
  MseLoss loss;
  Harness h(loss, inputs(12, 12, -2.0f, 2.0f), Shape{4, 3});
  const std::vector<float> t = inputs(12, 13);
  loss.set_targets(h.env.from(t, Shape{4, 3}));
  check_layer(h, [&](const Vec& x, const Params&) {
    double s = 0;
    for (size_t i = 0; i < x.size(); ++i) s += (x[i] - t[i]) * (x[i] - t[i]);
    return Vec{s / static_cast<double>(x.size())};
  });
  std::vector<float> dx1 = h.run_once(SaveMode::kSaveAll, OpPolicy::keep_none(), true).dx;
  loss.set_loss_scale(0.5f);
  std::vector<float> dx2 = h.run_once(SaveMode::kSaveAll, OpPolicy::keep_none(), true).dx;
  for (size_t i = 0; i < dx1.size(); ++i) EXPECT_EQ(dx2[i], dx1[i] * 0.5f) << i;
}

// ---- analytic float64 backwards ----

// The closed-form float64 gradients of the simple layers, besides the differenced ones above.
TEST(LibraryTest, AnalyticFloat64Backward) {
  auto expect_close = [](const std::vector<float>& got, const Vec& want, const char* what) {
    ASSERT_EQ(got.size(), want.size()) << what;
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_NEAR(got[i], want[i], 1e-5 * std::max(1.0, std::fabs(want[i]))) << what << "[" << i << "]";
    }
  };
  {  // Linear: dx = dy W, dW = dy^T x, db = sum_rows dy.
    Linear lin(5, 4);
    Harness h(lin, inputs(15, 21), Shape{3, 5});
    Harness::Result r = h.run_once(SaveMode::kSaveAll, OpPolicy::keep_none(), true);
    const Params p = h.params_f64();
    const Vec x = h.x_f64();
    Vec dx(15, 0.0), dw(20, 0.0), db(4, 0.0);
    for (int n = 0; n < 3; ++n) {
      for (int o = 0; o < 4; ++o) {
        const double dy = h.w[n * 4 + o];
        db[o] += dy;
        for (int i = 0; i < 5; ++i) {
          dx[n * 5 + i] += dy * p[0][o * 5 + i];
          dw[o * 5 + i] += dy * x[n * 5 + i];
        }
      }
    }
    expect_close(r.dx, dx, "linear dx");
    const auto& e = h.layout.entries();
    expect_close({r.grads.begin() + e[0].offset_elems, r.grads.begin() + e[0].offset_elems + 20}, dw,
                 "linear dW");
    expect_close({r.grads.begin() + e[1].offset_elems, r.grads.begin() + e[1].offset_elems + 4}, db,
                 "linear db");
  }
  {  // Activations: dx = dy f'(x).
    const std::vector<float> xv = inputs(20, 22, -4.0f, 4.0f);
    GELU g;
    ReLU r;
    SiLU si;
    for (Layer* layer : std::initializer_list<Layer*>{&g, &r, &si}) {
      Harness h(*layer, xv, Shape{4, 5});
      Harness::Result res = h.run_once(SaveMode::kSaveAll, OpPolicy::keep_none(), true);
      Vec want(20);
      for (size_t i = 0; i < 20; ++i) {
        const double v = xv[i];
        double d = 0;
        if (layer == &g) {
          const double u = std::sqrt(2.0 / M_PI) * (v + 0.044715 * v * v * v);
          const double t = std::tanh(u);
          d = 0.5 * (1 + t) + 0.5 * v * (1 - t * t) * std::sqrt(2.0 / M_PI) * (1 + 3 * 0.044715 * v * v);
        } else if (layer == &r) {
          d = v > 0 ? 1.0 : 0.0;
        } else {
          const double sg = 1.0 / (1.0 + std::exp(-v));
          d = sg * (1 + v * (1 - sg));
        }
        want[i] = h.w[i] * d;
      }
      expect_close(res.dx, want, "activation dx");
    }
  }
  {  // MSE: dx = 2 (x - t) / numel; cross-entropy: (softmax - onehot) / rows.
    MseLoss mse;
    Harness h(mse, inputs(12, 23), Shape{4, 3});
    const std::vector<float> t = inputs(12, 24);
    mse.set_targets(h.env.from(t, Shape{4, 3}));
    Harness::Result r = h.run_once(SaveMode::kSaveAll, OpPolicy::keep_none(), true);
    const Vec x = h.x_f64();
    Vec want(12);
    for (size_t i = 0; i < 12; ++i) want[i] = 2.0 * (x[i] - t[i]) / 12.0;
    expect_close(r.dx, want, "mse dx");
    CrossEntropyLoss ce;
    Harness h2(ce, inputs(12, 25, -3.0f, 3.0f), Shape{3, 4});
    const std::vector<int32_t> ids = {3, 0, 2};
    ce.set_targets(h2.env.ids(ids, Shape{3}));
    Harness::Result r2 = h2.run_once(SaveMode::kSaveAll, OpPolicy::keep_none(), true);
    const Vec l = h2.x_f64();
    Vec want2(12);
    for (int n = 0; n < 3; ++n) {
      double sum = 0;
      for (int j = 0; j < 4; ++j) sum += std::exp(l[n * 4 + j]);
      for (int j = 0; j < 4; ++j) {
        want2[n * 4 + j] = (std::exp(l[n * 4 + j]) / sum - (j == ids[n] ? 1.0 : 0.0)) / 3.0;
      }
    }
    expect_close(r2.dx, want2, "cross-entropy dlogits");
  }
}

// ---- bf16 compute ----

// bf16 parameters and activations with f32 gradients, as a bf16 run lays them out: the
// gradients stay within bf16 rounding of the f32 run's.
TEST(LibraryTest, Bf16ComputeFollowsF32) {
  auto run = [](DType dt) {
    Env env;
    auto seq = mixed_model();
    ParamLayout layout;
    layout.add("", seq->params());
    FlatParams flat(*env.allocator, layout, dt, DType::kF32);
    std::vector<float> p(static_cast<size_t>(layout.total_elems()), 0.0f);
    for (size_t i = 0; i < layout.entries().size(); ++i) {
      const ParamEntry& e = layout.entries()[i];
      std::vector<float> v = seq->init_param(i, e.name, kSeed);
      std::copy(v.begin(), v.end(), p.begin() + e.offset_elems);
    }
    Tensor pt = flat.params();
    from_host_f32(*env.device, p, pt);
    Tensor g = flat.grads();
    env.kernels->fill(g, 0.0f);
    bind_layer(*seq, "", flat);
    Ctx ctx(*env.kernels, *env.allocator, dt);
    ctx.set_run(run_info());
    Tape tape;
    Tensor x = env.from(inputs(30, 9), Shape{1, 6, 5}, dt);
    Tensor y = forward_stage(ctx, *seq, 0, tape, SaveMode::kSaveAll, x);
    Tensor dy = env.from(std::vector<float>(18, 0.5f), y.shape(), dt);
    backward_stage(ctx, *seq, 0, tape, dy);
    return std::make_pair(env.host(y), env.host(flat.grads()));
  };
  auto [y32, g32] = run(DType::kF32);
  auto [y16, g16] = run(DType::kBF16);
  double gmax = 0;
  for (float v : g32) gmax = std::max(gmax, static_cast<double>(std::fabs(v)));
  for (size_t i = 0; i < y32.size(); ++i) EXPECT_NEAR(y16[i], y32[i], 0.05 + 0.05 * std::fabs(y32[i])) << i;
  for (size_t i = 0; i < g32.size(); ++i) EXPECT_NEAR(g16[i], g32[i], 0.05 * gmax) << i;
}

// ---- init ----

TEST(LibraryTest, InitIsAPureFunctionOfSeedAndName) {
  Linear lin(16, 3);
  const std::vector<float> w = lin.init_param(0, "a.weight", 7);
  ASSERT_EQ(w.size(), 48u);
  const float bound = 1.0f / 4.0f;  // 1 / sqrt(in)
  float lo = 1, hi = -1;
  for (float v : w) {
    lo = std::min(lo, v);
    hi = std::max(hi, v);
  }
  EXPECT_GE(lo, -bound);
  EXPECT_LE(hi, bound);
  EXPECT_LT(lo, -bound / 2);  // spread over the range
  EXPECT_GT(hi, bound / 2);
  EXPECT_EQ(lin.init_param(0, "a.weight", 7), w);
  EXPECT_NE(lin.init_param(0, "b.weight", 7), w);
  EXPECT_NE(lin.init_param(0, "a.weight", 8), w);
  for (float v : lin.init_param(1, "a.bias", 7)) EXPECT_LE(std::fabs(v), bound);
  LayerNorm ln(4);
  EXPECT_EQ(ln.init_param(0, "ln.weight", 7), std::vector<float>(4, 1.0f));
  EXPECT_EQ(ln.init_param(1, "ln.bias", 7), std::vector<float>(4, 0.0f));
  auto seq = mixed_model();  // children's init under the full name
  EXPECT_EQ(seq->init_param(0, "0.weight", 7), Linear(5, 8).init_param(0, "0.weight", 7));
  EXPECT_EQ(seq->init_param(14, "6.weight", 7), std::vector<float>(8, 1.0f));
}

// ---- JSON ----

TEST(LibraryTest, JsonBuildsTheSameModel) {
  const nlohmann::json j = nlohmann::json::parse(R"({"type": "sequential", "layers": [
      {"type": "linear", "in": 5, "out": 8},
      {"type": "relu", "name": "act"},
      {"type": "dropout", "p": 0.25},
      {"type": "residual", "inner": {"type": "mlp", "dim": 8, "hidden": 16, "dropout": 0.1}},
      {"type": "attention", "dim": 8, "heads": 2, "dropout": 0.1, "name": "attn"},
      {"type": "silu"},
      {"type": "rmsnorm", "dim": 8},
      {"type": "linear", "in": 8, "out": 3, "bias": false}]})");
  std::unique_ptr<Module> from_json = module_from_json(j);
  auto built = mixed_model();
  std::vector<std::string> a, b;
  for (const ParamSpec& s : from_json->params()) a.push_back(s.name + s.shape.to_string());
  for (const ParamSpec& s : built->params()) b.push_back(s.name + s.shape.to_string());
  EXPECT_EQ(a, b);
  Harness h1(*from_json, inputs(30, 9), Shape{1, 6, 5});
  Harness h2(*built, inputs(30, 9), Shape{1, 6, 5});
  Harness::Result r1 = h1.run_once(SaveMode::kSaveAll, OpPolicy::keep_none(), true);
  Harness::Result r2 = h2.run_once(SaveMode::kSaveAll, OpPolicy::keep_none(), true);
  EXPECT_EQ(r1.y, r2.y);
  EXPECT_EQ(r1.grads, r2.grads);
  EXPECT_NE(dynamic_cast<MseLoss*>(loss_from_json({{"type", "mse"}}).get()), nullptr);
  EXPECT_NE(dynamic_cast<CrossEntropyLoss*>(loss_from_json({{"type", "cross_entropy"}}).get()),
            nullptr);
  EXPECT_NE(dynamic_cast<Embedding*>(
                module_from_json({{"type", "embedding"}, {"num", 10}, {"dim", 4}}).get()),
            nullptr);
  EXPECT_NE(dynamic_cast<LayerNorm*>(module_from_json({{"type", "layernorm"}, {"dim", 4}}).get()),
            nullptr);
  EXPECT_NE(dynamic_cast<GELU*>(module_from_json({{"type", "gelu"}}).get()), nullptr);
}

// The examples of docs/layers.md, "Composing a model".
TEST(LibraryTest, DocsExamplesBuild) {
  const int64_t vocab = 50;
  auto body = std::make_unique<Sequential>();
  body->add("embed", std::make_unique<Embedding>(vocab, 64))
      .add(std::make_unique<AttentionBlock>(64, 4, /*dropout=*/0.1f))
      .add(std::make_unique<MlpBlock>(64, 256, /*dropout=*/0.1f))
      .add("norm", std::make_unique<LayerNorm>(64))
      .add("head", std::make_unique<Linear>(64, vocab));
  const std::vector<ParamSpec> p = body->params();
  EXPECT_EQ(p.front().name, "embed.weight");
  EXPECT_EQ(p[1].name, "1.ln.weight");
  EXPECT_EQ(p[12].name, "2.fc2.bias");
  EXPECT_EQ(p.back().name, "head.bias");
  EXPECT_EQ(body->dropout_sites(), 2);
  std::unique_ptr<Module> m = module_from_json(nlohmann::json::parse(R"({"type": "sequential", "layers": [
      {"type": "linear", "in": 16, "out": 64},
      {"type": "relu"},
      {"type": "residual", "inner": {"type": "mlp", "dim": 64, "hidden": 256}},
      {"type": "linear", "in": 64, "out": 1, "name": "head"}]})"));
  EXPECT_EQ(m->params().back().name, "head.bias");
  EXPECT_EQ(m->params()[2].name, "2.ln.weight");
}

void expect_json_error(const std::string& text, const std::string& message) {
  EXPECT_THAT([&] { module_from_json(nlohmann::json::parse(text)); },
              ThrowsMessage<InvalidArgument>(HasSubstr(message)))
      << text;
}

TEST(LibraryTest, JsonErrorsNameTheKey) {
  expect_json_error(R"({"type": "conv"})",
                    "$.type: unknown module type \"conv\"; valid types: linear, embedding");
  expect_json_error(R"({"type": "linear", "in": 4, "out": 2, "bais": true})",
                    "$.bais: unknown key for type \"linear\"; valid keys: in, out, bias, type");
  expect_json_error(R"({"type": "linear", "in": 4})", "$.out: missing; type \"linear\" needs it");
  expect_json_error(R"({"type": "linear", "in": -4, "out": 2})",
                    "$.in: -4 must be a positive integer");
  expect_json_error(R"({"type": "sequential", "layers": [{"type": "relu"}, {"type": "residual",
                       "inner": {"type": "mlp", "dim": 4}}]})",
                    "$.layers[1].inner.hidden: missing");
  expect_json_error(R"({"type": "attention", "dim": 6, "heads": 4})",
                    "$: AttentionBlock(dim 6, heads 4): heads must be positive and divide dim");
  expect_json_error(R"({"type": "sequential", "layers": [{"type": "relu", "name": "a"},
                       {"type": "relu", "name": "a"}]})", "a child is already named 'a'");
  expect_json_error(R"({"type": "dropout", "p": "high"})", "$.p: \"high\" must be a number");
  expect_json_error(R"({"layers": []})", "$.type: missing or not a string; valid types:");
  EXPECT_THAT([] { loss_from_json({{"type", "l1"}}); },
              ThrowsMessage<InvalidArgument>(HasSubstr(
                  "$.type: unknown loss type \"l1\"; valid types: cross_entropy, mse")));
}

// ---- bad shapes ----

TEST(LibraryTest, BadShapesThrow) {
  Env env;
  auto forward = [&](Layer& layer, const Tensor& x, RunInfo run = run_info()) {
    ParamLayout layout;
    layout.add("", layer.params());
    FlatParams flat(*env.allocator, layout, DType::kF32, DType::kF32);
    bind_layer(layer, "", flat);
    Ctx ctx(*env.kernels, *env.allocator);
    ctx.set_run(run);
    Tape tape;
    forward_stage(ctx, layer, 0, tape, SaveMode::kSaveAll, x);
  };
  Tensor x = env.from(inputs(12, 1), Shape{3, 4});
  Linear lin(5, 2);
  EXPECT_THAT([&] { forward(lin, x); },
              ThrowsMessage<InvalidArgument>(HasSubstr(
                  "Linear: input (3, 4) must have 5 features in its last dimension, not 4")));
  Embedding emb(10, 4);
  EXPECT_THAT([&] { forward(emb, x); },
              ThrowsMessage<InvalidArgument>(HasSubstr("must be i32 token ids")));
  AttentionBlock attn(4, 2);
  EXPECT_THAT([&] { forward(attn, x, run_info()); },
              ThrowsMessage<InvalidArgument>(HasSubstr("needs the micro-batch's (batch, seq)")));
  Residual res(std::make_unique<Linear>(4, 3));
  EXPECT_THAT([&] { forward(res, x); },
              ThrowsMessage<InvalidArgument>(HasSubstr("needs the same shape and dtype")));
  CrossEntropyLoss ce;
  ce.set_targets(env.ids({0, 1}, Shape{2}));
  EXPECT_THAT([&] { forward(ce, x); },
              ThrowsMessage<InvalidArgument>(HasSubstr("CrossEntropyLoss: targets (2) i32 must be i32 (3)")));
  MseLoss mse;
  mse.set_targets(env.from(inputs(12, 2), Shape{4, 3}));
  EXPECT_THAT([&] { forward(mse, x); },
              ThrowsMessage<InvalidArgument>(HasSubstr("must be float of pred's shape (3, 4)")));
  Sequential seq;
  seq.add("a", std::make_unique<ReLU>());
  EXPECT_THROW(seq.add("a", std::make_unique<ReLU>()), InvalidArgument);
  EXPECT_THROW(seq.add("a.b", std::make_unique<ReLU>()), InvalidArgument);
  EXPECT_THROW(Dropout(1.0f), InvalidArgument);
}

}  // namespace
}  // namespace porter::nn
