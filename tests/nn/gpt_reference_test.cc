// porter's GPT against PyTorch: loss and every parameter gradient, from fixtures made by
// tests/reference/make_fixtures.py (PyTorch is not needed to run this test).
//
// Note [Reference tolerances]
// Errors are per tensor: max |porter - reference| / max |reference|. The fixtures are an f64
// PyTorch run on the f32 weights, so the error measured is porter's own.
// - f32: <= 1e-4 (the bound).
// - bf16 compute (bf16 weights, activations and matmul inputs; f32 accumulation, f32
//   gradients), against the same f64 reference: <= 3e-2, loss <= 1e-3. Rounding the weights
//   alone to bf16 moves them by up to 2^-9 (0.2%) relative; a 2-block model re-rounds every
//   activation ~15 times, and the gradients of small tensors (biases, layernorm) come from
//   reductions over rounded products. The largest error measured when this was written
//   was 1.0e-2 (h.0.ln2.bias, tied config), so 3e-2 leaves 3x headroom for other CPUs'
//   kernels while a wrong kernel (off by O(1)) still fails.
// - f16 compute (the same, in f16; no loss scaling: these gradients are well inside f16's
//   range): <= 5e-3, loss <= 1e-4. f16 keeps 3 more mantissa bits than bf16, so its errors
//   are about 8x smaller: the largest measured when this was written was 1.4e-3
//   (h.0.qkv.weight, tied config), loss 6.8e-6.
#include <cmath>
#include <cstdio>
#include <ostream>
#include <string>

#include <gtest/gtest.h>

#include "memory/caching_allocator.h"
#include "memory/device.h"
#include "nn/ctx.h"
#include "models/transformer.h"
#include "kernels/kernels.h"
#include "io/npy.h"

namespace porter::nn {

using namespace porter::tensor;
using namespace porter::kernels;
namespace {

struct RefConfig {
  const char* dir;
  int64_t layers, hidden, heads, seq_len, vocab;
  bool tied;
};

// Same table as CONFIGS in tests/reference/make_fixtures.py.
constexpr RefConfig kConfigs[] = {
    {"tied_l2_c32_h2_t16", 2, 32, 2, 16, 64, true},
    {"untied_l2_c48_h4_t13", 2, 48, 4, 13, 67, false},
};

void PrintTo(const RefConfig& c, std::ostream* os) { *os << c.dir; }

std::string fixture(const RefConfig& c, const std::string& rel) {
  return std::string(PORTER_NN_FIXTURE_DIR) + "/" + c.dir + "/" + rel;
}

double max_rel_error(const std::vector<float>& got, const std::vector<float>& want) {
  double max_ref = 0.0, max_diff = 0.0;
  for (size_t i = 0; i < want.size(); ++i) {
    max_ref = std::max(max_ref, std::fabs(static_cast<double>(want[i])));
    max_diff = std::max(max_diff, std::fabs(static_cast<double>(got[i]) - want[i]));
  }
  return max_ref == 0.0 ? max_diff : max_diff / max_ref;
}

class GptReferenceTest : public ::testing::TestWithParam<std::tuple<RefConfig, DType>> {};

TEST_P(GptReferenceTest, LossAndGradientsMatchPyTorch) {
  const auto& [rc, dtype] = GetParam();
  memory::DeviceOptions opts;
  opts.memory_limit_bytes = size_t{1} << 30;
  opts.threads = 2;
  auto device = memory::make_device(opts);
  memory::CachingAllocator alloc(*device);
  auto kernels = make_kernels(alloc);

  config::ModelConfig mc;
  mc.layers = rc.layers;
  mc.hidden = rc.hidden;
  mc.heads = rc.heads;
  mc.seq_len = rc.seq_len;
  mc.vocab = rc.vocab;
  mc.tie_embeddings = rc.tied;
  mc.dropout = 0.0;
  models::Transformer gpt(mc);
  FlatParams flat(alloc, gpt.layout(), dtype, DType::kF32);

  std::vector<float> host(static_cast<size_t>(gpt.layout().total_elems()), 0.0f);
  for (const ParamEntry& e : gpt.layout().entries()) {
    io::NpyArray a = io::read_npy(fixture(rc, "params/" + e.name + ".npy"));
    ASSERT_EQ(Shape(a.shape), e.shape) << e.name;
    std::vector<float> v = io::npy_to_f32(a);
    std::copy(v.begin(), v.end(), host.begin() + e.offset_elems);
  }
  Tensor params = flat.params();
  from_host_f32(*device, host, params);
  Tensor grads = flat.grads();
  kernels->fill(grads, 0.0f);
  gpt.bind(flat);

  Tensor tokens = io::load_tensor_npy(fixture(rc, "tokens.npy"), alloc, DType::kI32);
  Tensor targets = io::load_tensor_npy(fixture(rc, "targets.npy"), alloc, DType::kI32);
  Ctx ctx(*kernels, alloc, dtype);
  const float loss = gpt.forward_backward(ctx, tokens, targets);
  const float ref_loss = io::npy_to_f32(io::read_npy(fixture(rc, "loss.npy")))[0];

  const double tol = dtype == DType::kF32 ? 1e-4 : (dtype == DType::kF16 ? 5e-3 : 3e-2);
  const double loss_tol = dtype == DType::kF32 ? 1e-5 : (dtype == DType::kF16 ? 1e-4 : 1e-3);
  const double loss_err = std::fabs(loss - ref_loss) / std::fabs(ref_loss);
  std::printf("%s %s: loss %.6f (reference %.6f, rel err %.2e)\n", rc.dir,
              std::string(dtype_name(dtype)).c_str(), loss, ref_loss, loss_err);
  EXPECT_LE(loss_err, loss_tol);

  double worst = 0.0;
  std::string worst_name;
  for (size_t i = 0; i < gpt.layout().entries().size(); ++i) {
    const ParamEntry& e = gpt.layout().entries()[i];
    std::vector<float> got = to_host_f32(*device, flat.grad(i));
    std::vector<float> want = io::npy_to_f32(io::read_npy(fixture(rc, "grads/" + e.name + ".npy")));
    ASSERT_EQ(got.size(), want.size()) << e.name;
    const double err = max_rel_error(got, want);
    EXPECT_LE(err, tol) << "gradient of " << e.name << " " << e.shape.to_string();
    if (err > worst) {
      worst = err;
      worst_name = e.name;
    }
  }
  std::printf("%s %s: max gradient rel err %.2e (%s) over %zu tensors\n", rc.dir,
              std::string(dtype_name(dtype)).c_str(), worst, worst_name.c_str(),
              gpt.layout().entries().size());
}

INSTANTIATE_TEST_SUITE_P(
    Configs, GptReferenceTest,
    ::testing::Combine(::testing::ValuesIn(kConfigs),
                       ::testing::Values(DType::kF32, DType::kBF16, DType::kF16)),
    [](const auto& param_info) {
      return std::string(std::get<0>(param_info.param).dir) + "_" +
             std::string(dtype_name(std::get<1>(param_info.param)));
    });

}  // namespace
}  // namespace porter::nn
