// The cuda kernels against the cpu kernels (the reference): the same random inputs on both
// devices, each op run through the validated kernels::Kernels interface, results compared.
// Skips when no GPU is visible; compiled only when porter is built with CUDA.
//
// Tolerances, as the max absolute difference over the tensor divided by the cpu tensor's
// max magnitude:
// - f32: 1e-5 (kF32Tol). Both sides compute in f32; they differ only in summation order
//   and in the last ulps of expf/tanhf, far below this for the sizes tested.
// - chains of matmuls and reductions in f32 (attention, layernorm backward): 5e-5.
// - bf16 outputs: 1e-2 (kBF16Tol). One bf16 ulp is 2^-8 of the value; an f32 difference of
//   one ulp before rounding can flip the rounded result by one bf16 ulp.
// - f16 outputs: 2e-3 (kF16Tol), the same argument with f16's 2^-11 ulp.
// Dropout masks and f32 -> bf16 / f16 casts must match bit for bit (porter's f16 conversion
// and cuda's __float2half_rn both round to nearest-even).
#include "base/build_config.h"

#if PORTER_WITH_CUDA

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "memory/caching_allocator.h"
#include "memory/device.h"
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/kernels.h"
#include "tensor/tensor.h"

namespace porter::nn {

using namespace porter::tensor;
using namespace porter::kernels;
namespace {

constexpr double kF32Tol = 1e-5;
constexpr double kChainTol = 5e-5;
constexpr double kBF16Tol = 1e-2;
constexpr double kF16Tol = 2e-3;

double tol_for(tensor::DType t, double f32_tol) {
  return t == tensor::DType::kF32 ? f32_tol : (t == tensor::DType::kF16 ? kF16Tol : kBF16Tol);
}

// The same logical tensor on both devices.
struct Pair {
  tensor::Tensor cpu;
  tensor::Tensor gpu;
};

class CudaKernelsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!memory::cuda_available()) {
      GTEST_SKIP() << "no GPU visible: cuda kernels are not compared with the cpu here";
    }
    memory::DeviceOptions cpu_options;
    cpu_options.kind = memory::DeviceKind::kCpu;
    cpu_options.threads = 2;
    cpu_dev_ = memory::make_device(cpu_options);
    memory::DeviceOptions cuda_options;
    cuda_options.kind = memory::DeviceKind::kCuda;
    cuda_dev_ = memory::make_device(cuda_options);
    cpu_alloc_ = std::make_unique<memory::CachingAllocator>(*cpu_dev_);
    cuda_alloc_ = std::make_unique<memory::CachingAllocator>(*cuda_dev_);
    cpu_ = kernels::make_kernels(*cpu_alloc_);
    gpu_ = kernels::make_cuda_kernels(*cuda_alloc_);
    ASSERT_EQ(gpu_->kind(), memory::DeviceKind::kCuda);
  }

  Pair empty(tensor::Shape shape, tensor::DType dtype) {
    return {tensor::Tensor::empty(*cpu_alloc_, shape, dtype, memory::Category::kWorkspace),
            tensor::Tensor::empty(*cuda_alloc_, shape, dtype, memory::Category::kWorkspace)};
  }

  // Values from `values` (rounded to the dtype on both sides identically).
  Pair from(const std::vector<float>& values, tensor::Shape shape, tensor::DType dtype) {
    Pair p = empty(shape, dtype);
    tensor::from_host_f32(*cpu_dev_, values, p.cpu);
    tensor::from_host_f32(*cuda_dev_, values, p.gpu);
    return p;
  }

  std::vector<float> uniform(int64_t n, float lo = -1.0f, float hi = 1.0f) {
    std::uniform_real_distribution<float> dist(lo, hi);
    std::vector<float> v(static_cast<size_t>(n));
    for (auto& x : v) x = dist(rng_);
    return v;
  }

  Pair random(tensor::Shape shape, tensor::DType dtype = tensor::DType::kF32, float lo = -1.0f, float hi = 1.0f) {
    return from(uniform(shape.numel(), lo, hi), shape, dtype);
  }

  Pair ints(const std::vector<int32_t>& values, tensor::Shape shape) {
    Pair p = empty(shape, tensor::DType::kI32);
    cpu_dev_->copy_sync(p.cpu.data(), values.data(), values.size() * sizeof(int32_t));
    cuda_dev_->copy_sync(p.gpu.data(), values.data(), values.size() * sizeof(int32_t));
    return p;
  }

  std::vector<float> host(const tensor::Tensor& t, bool gpu) {
    return tensor::to_host_f32(gpu ? *cuda_dev_ : *cpu_dev_, t);
  }

  // max |cpu - gpu| / max |cpu| <= tol.
  void expect_close(const Pair& p, double tol, const std::string& what) {
    std::vector<float> c = host(p.cpu, false), g = host(p.gpu, true);
    ASSERT_EQ(c.size(), g.size()) << what;
    double max_mag = 0.0, max_diff = 0.0;
    size_t worst = 0;
    for (size_t i = 0; i < c.size(); ++i) {
      ASSERT_FALSE(std::isnan(g[i]) && !std::isnan(c[i])) << what << ": NaN on cuda at " << i;
      max_mag = std::max(max_mag, std::abs(static_cast<double>(c[i])));
      double d = std::abs(static_cast<double>(c[i]) - g[i]);
      if (d > max_diff) {
        max_diff = d;
        worst = i;
      }
    }
    const double rel = max_diff / std::max(max_mag, 1e-30);
    EXPECT_LE(rel, tol) << what << ": max |cpu - cuda| = " << max_diff << " at element " << worst
                        << " (cpu " << c[worst] << ", cuda " << g[worst]
                        << "), max |cpu| = " << max_mag;
  }

  void expect_bitwise(const Pair& p, const std::string& what) {
    ASSERT_EQ(p.cpu.nbytes(), p.gpu.nbytes());
    std::vector<unsigned char> c(p.cpu.nbytes()), g(p.gpu.nbytes());
    cpu_dev_->copy_sync(c.data(), p.cpu.data(), c.size());
    cuda_dev_->copy_sync(g.data(), p.gpu.data(), g.size());
    EXPECT_TRUE(c == g) << what << ": cpu and cuda bytes differ";
  }

  // Runs `op` once on each device, with the matching half of every Pair.
  void both(const std::function<void(kernels::Kernels&, bool gpu)>& op) {
    op(*cpu_, false);
    op(*gpu_, true);
    cuda_dev_->compute_stream().synchronize();
  }

  static tensor::Tensor& side(Pair& p, bool gpu) { return gpu ? p.gpu : p.cpu; }

  std::mt19937 rng_{1234};
  std::unique_ptr<memory::Device> cpu_dev_, cuda_dev_;
  std::unique_ptr<memory::CachingAllocator> cpu_alloc_, cuda_alloc_;
  std::unique_ptr<kernels::Kernels> cpu_, gpu_;
};

// ---- matmul ------------------------------------------------------------------------------

struct MatmulCase {
  int64_t m, k, n;
};

TEST_F(CudaKernelsTest, MatmulRank2AllTransposesF32) {
  for (MatmulCase c : {MatmulCase{7, 13, 5}, MatmulCase{64, 48, 32}, MatmulCase{1, 130, 3}}) {
    for (bool ta : {false, true}) {
      for (bool tb : {false, true}) {
        Pair a = random(ta ? tensor::Shape{c.k, c.m} : tensor::Shape{c.m, c.k});
        Pair b = random(tb ? tensor::Shape{c.n, c.k} : tensor::Shape{c.k, c.n});
        Pair out = random(tensor::Shape{c.m, c.n});
        kernels::MatmulSpec spec{ta, tb, 0.5f, 0.25f};
        both([&](kernels::Kernels& k, bool gpu) { k.matmul(side(a, gpu), side(b, gpu), side(out, gpu), spec); });
        expect_close(out, kF32Tol,
                     "matmul m=" + std::to_string(c.m) + " k=" + std::to_string(c.k) +
                         " n=" + std::to_string(c.n) + " ta=" + std::to_string(ta) +
                         " tb=" + std::to_string(tb));
      }
    }
  }
}

TEST_F(CudaKernelsTest, MatmulBatchedF32) {
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      const int64_t batch = 3, m = 9, k = 17, n = 6;
      Pair a = random(ta ? tensor::Shape{batch, k, m} : tensor::Shape{batch, m, k});
      Pair b = random(tb ? tensor::Shape{batch, n, k} : tensor::Shape{batch, k, n});
      Pair out = random(tensor::Shape{batch, m, n});
      kernels::MatmulSpec spec{ta, tb, 1.0f, 0.0f};
      both([&](kernels::Kernels& kern, bool gpu) { kern.matmul(side(a, gpu), side(b, gpu), side(out, gpu), spec); });
      expect_close(out, kF32Tol, "batched matmul ta=" + std::to_string(ta) + " tb=" + std::to_string(tb));
    }
  }
}

TEST_F(CudaKernelsTest, MatmulBF16) {
  for (tensor::DType out_dtype : {tensor::DType::kF32, tensor::DType::kBF16}) {
    for (bool tb : {false, true}) {
      const int64_t m = 32, k = 64, n = 24;
      Pair a = random(tensor::Shape{m, k}, tensor::DType::kBF16);
      Pair b = random(tb ? tensor::Shape{n, k} : tensor::Shape{k, n}, tensor::DType::kBF16);
      Pair out = random(tensor::Shape{m, n}, out_dtype);
      kernels::MatmulSpec spec{false, tb, 1.0f, out_dtype == tensor::DType::kF32 ? 1.0f : 0.0f};
      both([&](kernels::Kernels& kern, bool gpu) { kern.matmul(side(a, gpu), side(b, gpu), side(out, gpu), spec); });
      // bf16 inputs are exact in f32, so an f32 output differs only by summation order.
      expect_close(out, tol_for(out_dtype, kF32Tol),
                   std::string("bf16 matmul -> ") + std::string(tensor::dtype_name(out_dtype)));
    }
  }
}

// cuBLASLt multiplies f16 directly; the cpu multiplies f32 copies (Note [Cpu f16 matmul]).
TEST_F(CudaKernelsTest, MatmulF16) {
  for (tensor::DType out_dtype : {tensor::DType::kF32, tensor::DType::kF16}) {
    for (bool tb : {false, true}) {
      const int64_t batch = 2, m = 32, k = 64, n = 24;
      Pair a = random(tensor::Shape{batch, m, k}, tensor::DType::kF16);
      Pair b = random(tb ? tensor::Shape{batch, n, k} : tensor::Shape{batch, k, n}, tensor::DType::kF16);
      Pair out = random(tensor::Shape{batch, m, n}, out_dtype);
      kernels::MatmulSpec spec{false, tb, 1.0f, 1.0f};
      both([&](kernels::Kernels& kern, bool gpu) { kern.matmul(side(a, gpu), side(b, gpu), side(out, gpu), spec); });
      expect_close(out, tol_for(out_dtype, kF32Tol),
                   std::string("f16 matmul -> ") + std::string(tensor::dtype_name(out_dtype)));
    }
  }
}

// ---- bias, layernorm, gelu ------------------------------------------------------------------

TEST_F(CudaKernelsTest, BiasAddAndBackward) {
  for (tensor::DType dt : {tensor::DType::kF32, tensor::DType::kBF16, tensor::DType::kF16}) {
    const int64_t rows = 37, cols = 70;
    Pair x = random(tensor::Shape{rows, cols}, dt);
    Pair bias = random(tensor::Shape{cols}, dt);
    both([&](kernels::Kernels& k, bool gpu) { k.bias_add(side(x, gpu), side(bias, gpu)); });
    expect_close(x, tol_for(dt, kF32Tol), "bias_add");
    Pair dy = random(tensor::Shape{rows, cols}, dt);
    Pair dbias = random(tensor::Shape{cols}, dt);  // accumulates onto existing values
    both([&](kernels::Kernels& k, bool gpu) { k.bias_backward(side(dy, gpu), side(dbias, gpu)); });
    expect_close(dbias, tol_for(dt, kF32Tol), "bias_backward");
  }
}

TEST_F(CudaKernelsTest, LayerNormForwardBackward) {
  for (tensor::DType dt : {tensor::DType::kF32, tensor::DType::kBF16, tensor::DType::kF16}) {
    for (int64_t cols : {int64_t{24}, int64_t{768}}) {
      const int64_t rows = 19;
      Pair x = random(tensor::Shape{rows, cols}, dt, -2.0f, 3.0f);
      Pair gamma = random(tensor::Shape{cols}, dt);
      Pair beta = random(tensor::Shape{cols}, dt);
      Pair y = empty(tensor::Shape{rows, cols}, dt);
      Pair mean = empty(tensor::Shape{rows}, tensor::DType::kF32);
      Pair rstd = empty(tensor::Shape{rows}, tensor::DType::kF32);
      both([&](kernels::Kernels& k, bool gpu) {
        k.layernorm_forward(side(x, gpu), side(gamma, gpu), side(beta, gpu), side(y, gpu), side(mean, gpu), side(rstd, gpu));
      });
      expect_close(y, tol_for(dt, kF32Tol), "layernorm y");
      expect_close(mean, kF32Tol, "layernorm mean");
      expect_close(rstd, kF32Tol, "layernorm rstd");
      Pair dy = random(tensor::Shape{rows, cols}, dt);
      Pair dx = random(tensor::Shape{rows, cols}, dt);  // overwritten
      Pair dgamma = random(tensor::Shape{cols}, dt);    // accumulated
      Pair dbeta = random(tensor::Shape{cols}, dt);
      both([&](kernels::Kernels& k, bool gpu) {
        k.layernorm_backward(side(dy, gpu), side(x, gpu), side(gamma, gpu), side(mean, gpu), side(rstd, gpu), side(dx, gpu), side(dgamma, gpu), side(dbeta, gpu));
      });
      expect_close(dx, tol_for(dt, kChainTol), "layernorm dx");
      expect_close(dgamma, tol_for(dt, kChainTol), "layernorm dgamma");
      expect_close(dbeta, tol_for(dt, kF32Tol), "layernorm dbeta");
    }
  }
}

TEST_F(CudaKernelsTest, Gelu) {
  for (tensor::DType dt : {tensor::DType::kF32, tensor::DType::kBF16, tensor::DType::kF16}) {
    Pair x = random(tensor::Shape{1000}, dt, -5.0f, 5.0f);
    Pair y = empty(tensor::Shape{1000}, dt);
    both([&](kernels::Kernels& k, bool gpu) { k.gelu_forward(side(x, gpu), side(y, gpu)); });
    expect_close(y, tol_for(dt, kF32Tol), "gelu forward");
    Pair dy = random(tensor::Shape{1000}, dt);
    Pair dx = empty(tensor::Shape{1000}, dt);
    both([&](kernels::Kernels& k, bool gpu) { k.gelu_backward(side(x, gpu), side(dy, gpu), side(dx, gpu)); });
    expect_close(dx, tol_for(dt, kF32Tol), "gelu backward");
  }
}

// ---- Llama: RMSNorm, rotary qkv, SwiGLU ---------------------------------------------------

TEST_F(CudaKernelsTest, RmsNormForwardBackward) {
  for (tensor::DType dt : {tensor::DType::kF32, tensor::DType::kBF16}) {
    for (int64_t cols : {int64_t{24}, int64_t{768}}) {
      const int64_t rows = 19;
      Pair x = random(tensor::Shape{rows, cols}, dt, -2.0f, 3.0f);
      Pair gamma = random(tensor::Shape{cols}, dt);
      Pair y = empty(tensor::Shape{rows, cols}, dt);
      Pair rstd = empty(tensor::Shape{rows}, tensor::DType::kF32);
      both([&](kernels::Kernels& k, bool gpu) {
        k.rmsnorm_forward(side(x, gpu), side(gamma, gpu), side(y, gpu), side(rstd, gpu), 1e-6f);
      });
      expect_close(y, tol_for(dt, kF32Tol), "rmsnorm y");
      expect_close(rstd, kF32Tol, "rmsnorm rstd");
      Pair dy = random(tensor::Shape{rows, cols}, dt);
      Pair dx = random(tensor::Shape{rows, cols}, dt);  // overwritten
      Pair dgamma = random(tensor::Shape{cols}, dt);    // accumulated
      both([&](kernels::Kernels& k, bool gpu) {
        k.rmsnorm_backward(side(dy, gpu), side(x, gpu), side(gamma, gpu), side(rstd, gpu), side(dx, gpu), side(dgamma, gpu));
      });
      expect_close(dx, tol_for(dt, kChainTol), "rmsnorm dx");
      expect_close(dgamma, tol_for(dt, kChainTol), "rmsnorm dgamma");
    }
  }
}

TEST_F(CudaKernelsTest, RopeQkvForwardBackward) {
  struct Case {
    int64_t b, t;
    int heads, kv;
    int64_t d;
    double theta;
  };
  // Both qkv layouts (Note [Rotary qkv]): k and v expanded to every query head, or packed.
  for (Case c : {Case{2, 9, 4, 2, 8, 1e4}, Case{1, 33, 8, 1, 64, 5e5}, Case{3, 4, 2, 2, 6, 1e4}}) {
    for (bool packed : {false, true}) {
      for (tensor::DType dt : {tensor::DType::kF32, tensor::DType::kBF16}) {
        const int64_t C = c.heads * c.d, Ckv = c.kv * c.d;
        const int64_t width = packed ? C + 2 * Ckv : 3 * C;
        const std::string what = std::string("rope_qkv ") + (packed ? "packed " : "expanded ") +
                                 std::string(tensor::dtype_name(dt)) + " H=" +
                                 std::to_string(c.heads) + " Hkv=" + std::to_string(c.kv);
        Pair q = random(tensor::Shape{c.b, c.t, C}, dt), k = random(tensor::Shape{c.b, c.t, Ckv}, dt);
        Pair v = random(tensor::Shape{c.b, c.t, Ckv}, dt);
        Pair qkv = random(tensor::Shape{c.b, c.t, width}, dt);  // every element overwritten
        both([&](kernels::Kernels& kk, bool gpu) {
          kk.rope_qkv_forward(side(q, gpu), side(k, gpu), side(v, gpu), side(qkv, gpu), c.heads, c.kv, c.theta);
        });
        expect_close(qkv, tol_for(dt, kF32Tol), what + " forward");
        Pair g = random(tensor::Shape{c.b, c.t, width}, dt);
        Pair dq = empty(tensor::Shape{c.b, c.t, C}, dt), dk = empty(tensor::Shape{c.b, c.t, Ckv}, dt);
        Pair dv = empty(tensor::Shape{c.b, c.t, Ckv}, dt);
        both([&](kernels::Kernels& kk, bool gpu) {
          kk.rope_qkv_backward(side(g, gpu), side(dq, gpu), side(dk, gpu), side(dv, gpu), c.heads, c.kv, c.theta);
        });
        expect_close(dq, tol_for(dt, kF32Tol), what + " dq");
        expect_close(dk, tol_for(dt, kChainTol), what + " dk");
        expect_close(dv, tol_for(dt, kChainTol), what + " dv");
      }
    }
  }
}

TEST_F(CudaKernelsTest, Swiglu) {
  for (tensor::DType dt : {tensor::DType::kF32, tensor::DType::kBF16}) {
    Pair gate = random(tensor::Shape{1000}, dt, -6.0f, 6.0f), up = random(tensor::Shape{1000}, dt);
    Pair y = empty(tensor::Shape{1000}, dt);
    both([&](kernels::Kernels& k, bool gpu) { k.swiglu_forward(side(gate, gpu), side(up, gpu), side(y, gpu)); });
    expect_close(y, tol_for(dt, kF32Tol), "swiglu forward");
    Pair dy = random(tensor::Shape{1000}, dt);
    Pair dgate = empty(tensor::Shape{1000}, dt), dup = empty(tensor::Shape{1000}, dt);
    both([&](kernels::Kernels& k, bool gpu) {
      k.swiglu_backward(side(gate, gpu), side(up, gpu), side(dy, gpu), side(dgate, gpu), side(dup, gpu));
    });
    expect_close(dgate, tol_for(dt, kF32Tol), "swiglu dgate");
    expect_close(dup, tol_for(dt, kF32Tol), "swiglu dup");
  }
}

// ---- the layer library's ReLU, SiLU and squared error -------------------------------------

TEST_F(CudaKernelsTest, ReluAndSilu) {
  for (tensor::DType dt : {tensor::DType::kF32, tensor::DType::kBF16, tensor::DType::kF16}) {
    Pair x = random(tensor::Shape{1001}, dt, -6.0f, 6.0f), dy = random(tensor::Shape{1001}, dt);
    Pair y = empty(tensor::Shape{1001}, dt), dx = empty(tensor::Shape{1001}, dt);
    both([&](kernels::Kernels& k, bool gpu) { k.relu_forward(side(x, gpu), side(y, gpu)); });
    expect_bitwise(y, "relu forward");
    both([&](kernels::Kernels& k, bool gpu) { k.relu_backward(side(x, gpu), side(dy, gpu), side(dx, gpu)); });
    expect_bitwise(dx, "relu backward");
    both([&](kernels::Kernels& k, bool gpu) { k.silu_forward(side(x, gpu), side(y, gpu)); });
    expect_close(y, tol_for(dt, kF32Tol), "silu forward");
    both([&](kernels::Kernels& k, bool gpu) { k.silu_backward(side(x, gpu), side(dy, gpu), side(dx, gpu)); });
    expect_close(dx, tol_for(dt, kF32Tol), "silu backward");
  }
}

TEST_F(CudaKernelsTest, MseForwardBackward) {
  for (int64_t cols : {int64_t{7}, int64_t{700}}) {
    for (tensor::DType dt : {tensor::DType::kF32, tensor::DType::kBF16}) {
      const int64_t rows = 11;
      Pair pred = random(tensor::Shape{rows, cols}, dt, -3.0f, 3.0f);
      Pair target = random(tensor::Shape{rows, cols}, tensor::DType::kF32);
      Pair losses = empty(tensor::Shape{rows}, tensor::DType::kF32);
      both([&](kernels::Kernels& k, bool gpu) { k.mse_forward(side(pred, gpu), side(target, gpu), side(losses, gpu)); });
      expect_close(losses, kF32Tol, "mse losses");
      Pair dpred = empty(tensor::Shape{rows, cols}, dt);
      both([&](kernels::Kernels& k, bool gpu) {
        k.mse_backward(side(pred, gpu), side(target, gpu), side(dpred, gpu), 0.25f);
      });
      expect_close(dpred, tol_for(dt, kF32Tol), "mse dpred");
    }
  }
}

// ---- attention ------------------------------------------------------------------------------

struct AttentionCase {
  int64_t batch, seq, channels;
  int heads;
};

TEST_F(CudaKernelsTest, AttentionForwardBackward) {
  for (AttentionCase c : {AttentionCase{2, 7, 12, 3}, AttentionCase{1, 33, 64, 4},
                          AttentionCase{2, 1, 8, 1}}) {
    for (tensor::DType dt : {tensor::DType::kF32, tensor::DType::kBF16, tensor::DType::kF16}) {
      const std::string what = "attention B=" + std::to_string(c.batch) + " T=" +
                               std::to_string(c.seq) + " C=" + std::to_string(c.channels) +
                               " H=" + std::to_string(c.heads) + " " + std::string(tensor::dtype_name(dt));
      Pair qkv = random(tensor::Shape{c.batch, c.seq, 3 * c.channels}, dt, -2.0f, 2.0f);
      Pair out = empty(tensor::Shape{c.batch, c.seq, c.channels}, dt);
      Pair probs = empty(tensor::Shape{c.batch, c.heads, c.seq, c.seq}, tensor::DType::kF32);
      both([&](kernels::Kernels& k, bool gpu) { k.attention_forward(side(qkv, gpu), side(out, gpu), side(probs, gpu), c.heads); });
      expect_close(out, tol_for(dt, kChainTol), what + " out");
      expect_close(probs, kChainTol, what + " probs");
      // Above the diagonal the probabilities are exactly zero.
      std::vector<float> p = host(probs.gpu, true);
      for (int64_t bh = 0; bh < c.batch * c.heads; ++bh) {
        for (int64_t i = 0; i < c.seq; ++i) {
          for (int64_t j = i + 1; j < c.seq; ++j) {
            ASSERT_EQ(p[static_cast<size_t>((bh * c.seq + i) * c.seq + j)], 0.0f) << what;
          }
        }
      }
      Pair dout = random(tensor::Shape{c.batch, c.seq, c.channels}, dt);
      Pair dqkv = random(tensor::Shape{c.batch, c.seq, 3 * c.channels}, dt);  // overwritten
      both([&](kernels::Kernels& k, bool gpu) {
        k.attention_backward(side(dout, gpu), side(qkv, gpu), side(probs, gpu), side(dqkv, gpu), c.heads);
      });
      expect_close(dqkv, tol_for(dt, kChainTol), what + " dqkv");
    }
  }
}

// ---- flash attention ------------------------------------------------------------------------

struct FlashCase {
  int64_t batch, seq;
  int heads, kv_heads;
  int64_t head_dim;
};

// The cuda flash kernels against the cpu's (Note [Flash attention]): odd sequence lengths that
// end mid-tile, grouped-query attention and head_dim up to 256 (one tile row per 8 on cuda).
// Backward gets the same out and lse on both devices (the cpu's), so it is compared as a
// function of its inputs alone.
TEST_F(CudaKernelsTest, FlashAttentionForwardBackward) {
  for (FlashCase c : {FlashCase{1, 1, 4, 2, 64}, FlashCase{2, 65, 4, 2, 64},
                      FlashCase{1, 257, 4, 2, 128}, FlashCase{1, 40, 2, 1, 256},
                      FlashCase{2, 9, 3, 3, 8}}) {
    for (tensor::DType dt : {tensor::DType::kF32, tensor::DType::kBF16}) {
      const std::string what = "flash attention B=" + std::to_string(c.batch) + " T=" +
                               std::to_string(c.seq) + " H=" + std::to_string(c.heads) +
                               " Hkv=" + std::to_string(c.kv_heads) + " D=" +
                               std::to_string(c.head_dim) + " " +
                               std::string(tensor::dtype_name(dt));
      const int64_t width = (c.heads + 2 * c.kv_heads) * c.head_dim;
      const tensor::Shape out_shape{c.batch, c.seq, c.heads * c.head_dim};
      const tensor::Shape lse_shape{c.batch, c.heads, c.seq};
      Pair qkv = random(tensor::Shape{c.batch, c.seq, width}, dt, -2.0f, 2.0f);
      Pair out = random(out_shape, dt), lse = random(lse_shape, tensor::DType::kF32);
      both([&](kernels::Kernels& k, bool gpu) {
        k.flash_attention_forward(side(qkv, gpu), side(out, gpu), side(lse, gpu), c.heads, c.kv_heads);
      });
      expect_close(out, tol_for(dt, kChainTol), what + " out");
      expect_close(lse, kChainTol, what + " lse");

      Pair same_out = from(host(out.cpu, false), out_shape, dt);
      Pair same_lse = from(host(lse.cpu, false), lse_shape, tensor::DType::kF32);
      Pair dout = random(out_shape, dt);
      Pair dqkv = random(tensor::Shape{c.batch, c.seq, width}, dt);  // overwritten
      both([&](kernels::Kernels& k, bool gpu) {
        k.flash_attention_backward(side(dout, gpu), side(qkv, gpu), side(same_out, gpu),
                                   side(same_lse, gpu), side(dqkv, gpu), c.heads, c.kv_heads);
      });
      expect_close(dqkv, tol_for(dt, kChainTol), what + " dqkv");

      // No atomics: a second backward gives the same bits.
      tensor::Tensor again = tensor::Tensor::empty(*cuda_alloc_, dqkv.gpu.shape(), dt,
                                                   memory::Category::kWorkspace);
      gpu_->flash_attention_backward(dout.gpu, qkv.gpu, same_out.gpu, same_lse.gpu, again,
                                     c.heads, c.kv_heads);
      cuda_dev_->compute_stream().synchronize();
      std::vector<unsigned char> first(dqkv.gpu.nbytes()), second(again.nbytes());
      cuda_dev_->copy_sync(first.data(), dqkv.gpu.data(), first.size());
      cuda_dev_->copy_sync(second.data(), again.data(), second.size());
      EXPECT_TRUE(first == second) << what << ": two cuda backwards differ";
    }
  }
}

// Forward takes no workspace; backward takes exactly the published bytes, freed as it returns.
TEST_F(CudaKernelsTest, FlashAttentionWorkspaceIsThePublishedBytes) {
  for (tensor::DType dt : {tensor::DType::kF32, tensor::DType::kBF16, tensor::DType::kF16}) {
    const FlashAttentionCall call{2, 33, 16, 4, 2, dt, dt, dt};
    const tensor::Shape qkv_shape{2, 33, (4 + 2 * 2) * 16}, out_shape{2, 33, 4 * 16};
    Pair qkv = random(qkv_shape, dt), dout = random(out_shape, dt);
    Pair out = empty(out_shape, dt), dqkv = empty(qkv_shape, dt);
    Pair lse = empty(tensor::Shape{2, 4, 33}, tensor::DType::kF32);
    const size_t forward_bytes =
        kernels::flash_attention_forward_workspace_bytes(memory::DeviceKind::kCuda, call);
    const size_t backward_bytes =
        kernels::flash_attention_backward_workspace_bytes(memory::DeviceKind::kCuda, call);
    EXPECT_EQ(forward_bytes, 0u);
    EXPECT_GE(backward_bytes, size_t{2 * 4 * 33} * sizeof(float));
    const std::pair<size_t, std::function<void()>> calls[] = {
        {forward_bytes, [&] { gpu_->flash_attention_forward(qkv.gpu, out.gpu, lse.gpu, 4, 2); }},
        {backward_bytes, [&] {
           gpu_->flash_attention_backward(dout.gpu, qkv.gpu, out.gpu, lse.gpu, dqkv.gpu, 4, 2);
         }}};
    for (const auto& [bytes, run] : calls) {
      const size_t before = cuda_alloc_->stats().requested_bytes;
      cuda_alloc_->reset_peak();
      run();
      cuda_dev_->compute_stream().synchronize();
      EXPECT_EQ(cuda_alloc_->stats().peak_requested_bytes - before, bytes) << tensor::dtype_name(dt);
      EXPECT_EQ(cuda_alloc_->stats().requested_bytes, before);
    }
  }
}

// The cuda workspace comes from the kernels' allocator (Note [Kernel workspace]): exactly
// the published bytes, freed before the call returns.
TEST_F(CudaKernelsTest, WorkspaceComesFromTheAllocatorInThePublishedBytes) {
  ASSERT_EQ(&gpu_->workspace_allocator(), cuda_alloc_.get());
  for (tensor::DType dt : {tensor::DType::kF32, tensor::DType::kBF16, tensor::DType::kF16}) {
    const AttentionCall call{2, 33, 64, 4, dt, dt, dt};
    Pair qkv = random(tensor::Shape{2, 33, 192}, dt);
    Pair out = empty(tensor::Shape{2, 33, 64}, dt);
    Pair probs = empty(tensor::Shape{2, 4, 33, 33}, tensor::DType::kF32);
    Pair dout = random(tensor::Shape{2, 33, 64}, dt);
    Pair dqkv = empty(tensor::Shape{2, 33, 192}, dt);
    tensor::Tensor s = tensor::Tensor::empty(*cuda_alloc_, tensor::Shape{1}, tensor::DType::kF32, memory::Category::kWorkspace);
    const std::pair<size_t, std::function<void()>> calls[] = {
        {kernels::attention_forward_workspace_bytes(memory::DeviceKind::kCuda, call),
         [&] { gpu_->attention_forward(qkv.gpu, out.gpu, probs.gpu, 4); }},
        {kernels::attention_backward_workspace_bytes(memory::DeviceKind::kCuda, call),
         [&] { gpu_->attention_backward(dout.gpu, qkv.gpu, probs.gpu, dqkv.gpu, 4); }},
        {kernels::reduction_workspace_bytes(memory::DeviceKind::kCuda, qkv.gpu.numel()),
         [&] { gpu_->squared_norm(qkv.gpu, s); }},
        {kernels::reduction_workspace_bytes(memory::DeviceKind::kCuda, qkv.gpu.numel()),
         [&] { gpu_->nonfinite_count(qkv.gpu, s); }}};
    for (const auto& [bytes, run] : calls) {
      const size_t before = cuda_alloc_->stats().requested_bytes;
      cuda_alloc_->reset_peak();
      run();
      cuda_dev_->compute_stream().synchronize();
      EXPECT_GT(bytes, 0u);
      EXPECT_EQ(cuda_alloc_->stats().peak_requested_bytes - before, bytes) << tensor::dtype_name(dt);
      EXPECT_EQ(cuda_alloc_->stats().requested_bytes, before);
    }
  }
}

// ---- dropout, add, accumulate ------------------------------------------------------------

TEST_F(CudaKernelsTest, DropoutMaskMatchesCpuBitForBit) {
  const tensor::PhiloxKey key = tensor::dropout_key(42, 3, 1000, 2, 1);
  for (float p : {0.0f, 0.1f, 0.5f}) {
    for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{4099}}) {
      Pair x = random(tensor::Shape{n});
      Pair y = empty(tensor::Shape{n}, tensor::DType::kF32);
      both([&](kernels::Kernels& k, bool gpu) { k.dropout_forward(side(x, gpu), side(y, gpu), p, key); });
      std::vector<float> c = host(y.cpu, false), g = host(y.gpu, true);
      for (size_t i = 0; i < c.size(); ++i) {
        ASSERT_EQ(c[i] == 0.0f, g[i] == 0.0f) << "mask differs at " << i << " p=" << p;
      }
      expect_bitwise(y, "dropout forward");
      Pair dy = random(tensor::Shape{n});
      Pair dx = empty(tensor::Shape{n}, tensor::DType::kF32);
      both([&](kernels::Kernels& k, bool gpu) { k.dropout_backward(side(dy, gpu), side(dx, gpu), p, key); });
      expect_bitwise(dx, "dropout backward");
    }
  }
}

// A shard's dropout (Note [Dropout keys]): the group offset shifts the counter alike on both.
TEST_F(CudaKernelsTest, DropoutWithGroupOffsetMatchesCpuBitForBit) {
  tensor::PhiloxKey key = tensor::dropout_key(42, 3, 1000, 2, 1);
  key.group_offset = 1001;
  Pair x = random(tensor::Shape{4099});
  Pair y = empty(tensor::Shape{4099}, tensor::DType::kF32);
  both([&](kernels::Kernels& k, bool gpu) { k.dropout_forward(side(x, gpu), side(y, gpu), 0.3f, key); });
  expect_bitwise(y, "dropout forward with group offset");
}

TEST_F(CudaKernelsTest, AddAndAccumulate) {
  for (tensor::DType dt : {tensor::DType::kF32, tensor::DType::kBF16, tensor::DType::kF16}) {
    Pair a = random(tensor::Shape{3, 333}, dt);
    Pair b = random(tensor::Shape{3, 333}, dt);
    Pair out = empty(tensor::Shape{3, 333}, dt);
    both([&](kernels::Kernels& k, bool gpu) { k.add(side(a, gpu), side(b, gpu), side(out, gpu)); });
    expect_bitwise(out, "add");
    both([&](kernels::Kernels& k, bool gpu) { k.add(side(a, gpu), side(b, gpu), side(a, gpu)); });  // out aliases a
    expect_bitwise(a, "add in place");
    both([&](kernels::Kernels& k, bool gpu) { k.accumulate(side(b, gpu), side(out, gpu)); });
    expect_bitwise(b, "accumulate");
  }
}

// ---- embedding, cross-entropy --------------------------------------------------------------

TEST_F(CudaKernelsTest, EmbeddingForwardBackward) {
  const int64_t batch = 3, seq = 10, channels = 20, vocab = 17, max_seq = 16;
  std::vector<int32_t> tok(static_cast<size_t>(batch * seq));
  for (size_t i = 0; i < tok.size(); ++i) tok[i] = static_cast<int32_t>((i * 7) % 5 + (i % 3) * 4);
  Pair tokens = ints(tok, tensor::Shape{batch, seq});
  Pair wte = random(tensor::Shape{vocab, channels});
  Pair wpe = random(tensor::Shape{max_seq, channels});
  Pair out = empty(tensor::Shape{batch, seq, channels}, tensor::DType::kF32);
  both([&](kernels::Kernels& k, bool gpu) { k.embedding_forward(side(tokens, gpu), side(wte, gpu), side(wpe, gpu), side(out, gpu)); });
  expect_bitwise(out, "embedding forward");
  Pair dout = random(tensor::Shape{batch, seq, channels});
  Pair dwte = random(tensor::Shape{vocab, channels});
  Pair dwpe = random(tensor::Shape{max_seq, channels});
  both([&](kernels::Kernels& k, bool gpu) { k.embedding_backward(side(dout, gpu), side(tokens, gpu), side(dwte, gpu), side(dwpe, gpu)); });
  expect_close(dwte, kF32Tol, "embedding dwte");
  expect_close(dwpe, kF32Tol, "embedding dwpe");
}

TEST_F(CudaKernelsTest, CrossEntropyForwardBackward) {
  for (int64_t vocab : {int64_t{50}, int64_t{1000}}) {
    for (tensor::DType dt : {tensor::DType::kF32, tensor::DType::kBF16, tensor::DType::kF16}) {
      const int64_t rows = 13;
      std::vector<int32_t> t(static_cast<size_t>(rows));
      for (size_t i = 0; i < t.size(); ++i) t[i] = static_cast<int32_t>((i * 37) % vocab);
      Pair targets = ints(t, tensor::Shape{rows});
      Pair logits = random(tensor::Shape{rows, vocab}, dt, -8.0f, 8.0f);
      Pair losses = empty(tensor::Shape{rows}, tensor::DType::kF32);
      both([&](kernels::Kernels& k, bool gpu) { k.cross_entropy_forward(side(logits, gpu), side(targets, gpu), side(losses, gpu)); });
      expect_close(losses, kF32Tol, "cross-entropy losses");
      Pair dlogits = empty(tensor::Shape{rows, vocab}, dt);
      both([&](kernels::Kernels& k, bool gpu) {
        k.cross_entropy_backward(side(logits, gpu), side(targets, gpu), side(dlogits, gpu), 1.0f / rows);
      });
      expect_close(dlogits, tol_for(dt, kF32Tol), "cross-entropy dlogits");
    }
  }
}

// Rows [10, 20) of a 37-row table: tokens of other shards and negative ids add nothing.
TEST_F(CudaKernelsTest, EmbeddingVocabRangeForwardBackward) {
  const int64_t batch = 3, seq = 10, channels = 20, shard = 10, begin = 10, max_seq = 16;
  std::vector<int32_t> tok(static_cast<size_t>(batch * seq));
  for (size_t i = 0; i < tok.size(); ++i) tok[i] = static_cast<int32_t>((i * 7) % 37);
  tok[0] = -1;
  tok[1] = 15;
  tok[2] = 15;
  Pair tokens = ints(tok, tensor::Shape{batch, seq});
  for (tensor::DType dt : {tensor::DType::kF32, tensor::DType::kBF16}) {
    Pair wte = random(tensor::Shape{shard, channels}, dt);
    Pair wpe = random(tensor::Shape{max_seq, channels}, dt);
    for (bool with_wpe : {true, false}) {
      Pair out = empty(tensor::Shape{batch, seq, channels}, dt);
      both([&](kernels::Kernels& k, bool gpu) {
        k.embedding_forward_vocab_range(side(tokens, gpu), side(wte, gpu), begin,
                                        with_wpe ? side(wpe, gpu) : tensor::Tensor(), side(out, gpu));
      });
      expect_bitwise(out, "embedding_forward_vocab_range");
      Pair dout = random(tensor::Shape{batch, seq, channels}, dt);
      Pair dwte = random(tensor::Shape{shard, channels}, dt);
      Pair dwpe = random(tensor::Shape{max_seq, channels}, dt);
      both([&](kernels::Kernels& k, bool gpu) {
        tensor::Tensor pe = with_wpe ? side(dwpe, gpu) : tensor::Tensor();
        k.embedding_backward_vocab_range(side(dout, gpu), side(tokens, gpu), begin,
                                         side(dwte, gpu), pe);
      });
      expect_close(dwte, tol_for(dt, kF32Tol), "embedding_backward_vocab_range dwte");
      expect_close(dwpe, tol_for(dt, kF32Tol), "embedding_backward_vocab_range dwpe");
    }
  }
}

// The second of two 19-column shards of a 37-column vocabulary: 18 valid columns and one
// padding column of garbage.
TEST_F(CudaKernelsTest, CrossEntropyVocabParallel) {
  const int64_t rows = 13, shard = 19, begin = 19, valid = 18;
  std::vector<int32_t> t(static_cast<size_t>(rows));
  for (size_t i = 0; i < t.size(); ++i) t[i] = static_cast<int32_t>((i * 5) % 37);
  t[0] = 36;  // the last valid column
  Pair targets = ints(t, tensor::Shape{rows});
  for (tensor::DType dt : {tensor::DType::kF32, tensor::DType::kBF16, tensor::DType::kF16}) {
    std::vector<float> values = uniform(rows * shard, -8.0f, 8.0f);
    for (int64_t r = 0; r < rows; ++r) values[r * shard + valid] = 1e4f;
    Pair logits = from(values, tensor::Shape{rows, shard}, dt);
    Pair stats = empty(tensor::Shape{rows, 3}, tensor::DType::kF32);
    both([&](kernels::Kernels& k, bool gpu) {
      k.cross_entropy_partial(side(logits, gpu), side(targets, gpu), begin, valid,
                              side(stats, gpu));
    });
    expect_close(stats, kF32Tol, "cross_entropy_partial stats");
    // Two ranks' stats: this shard's (from the cpu) and another row-shifted copy of them.
    std::vector<float> s = host(stats.cpu, false), gathered = s;
    for (int64_t r = 0; r < rows; ++r) {
      for (int c = 0; c < 3; ++c) gathered.push_back(s[((r + 1) % rows) * 3 + c] * 0.5f);
    }
    Pair g = from(gathered, tensor::Shape{2, rows, 3}, tensor::DType::kF32);
    Pair losses = empty(tensor::Shape{rows}, tensor::DType::kF32), lse = empty(tensor::Shape{rows}, tensor::DType::kF32);
    both([&](kernels::Kernels& k, bool gpu) {
      k.cross_entropy_combine(side(g, gpu), side(losses, gpu), side(lse, gpu));
    });
    expect_close(losses, kF32Tol, "cross_entropy_combine losses");
    expect_close(lse, kF32Tol, "cross_entropy_combine lse");
    Pair dlogits = empty(tensor::Shape{rows, shard}, dt);
    both([&](kernels::Kernels& k, bool gpu) {
      k.cross_entropy_backward_partial(side(logits, gpu), side(targets, gpu), begin, valid,
                                       side(lse, gpu), side(dlogits, gpu), 0.25f);
    });
    expect_close(dlogits, tol_for(dt, kF32Tol), "cross_entropy_backward_partial dlogits");
  }
}

// ---- optimizer, reductions, casts ---------------------------------------------------------

// Note [Device AdamW bit identity] in kernels/cuda/elementwise.cu: the device update is the host
// formula, operation by operation, so it matches the cpu kernel (and zero/cpu_adam.cc, which
// matches that) bit for bit: every gradient and working-copy dtype, weight decay, a gradient
// scale, three consecutive steps (the bias corrections change), values over several decades.
TEST_F(CudaKernelsTest, AdamWMatchesTheHostBitForBit) {
  for (tensor::DType gt : {tensor::DType::kF32, tensor::DType::kBF16, tensor::DType::kF16}) {
    for (tensor::DType ot : {tensor::DType::kF32, tensor::DType::kBF16, tensor::DType::kF16}) {
      const std::string what = std::string("adamw grad ") + std::string(tensor::dtype_name(gt)) +
                               ", out " + std::string(tensor::dtype_name(ot));
      const int64_t n = 1027;
      Pair params = random(tensor::Shape{n}, tensor::DType::kF32, -2.0f, 2.0f);
      Pair m = random(tensor::Shape{n}, tensor::DType::kF32, -0.1f, 0.1f);
      Pair v = random(tensor::Shape{n}, tensor::DType::kF32, 0.0f, 0.01f);
      Pair out = empty(tensor::Shape{n}, ot);
      kernels::AdamWArgs args;
      args.lr = 3e-3f;
      args.weight_decay = 0.1f;
      args.eps = 1e-8f;
      args.grad_scale = 0.37f;
      for (int64_t step = 1; step <= 3; ++step) {
        std::vector<float> g = uniform(n, -1.0f, 1.0f);
        for (size_t i = 0; i < g.size(); i += 7) g[i] *= 1e-4f;  // small and large gradients
        Pair grad = from(g, tensor::Shape{n}, gt);
        args.step = step;
        both([&](kernels::Kernels& k, bool gpu) {
          tensor::Tensor& o = side(out, gpu);
          k.adamw(side(params, gpu), side(grad, gpu), side(m, gpu), side(v, gpu), args, &o);
        });
        const std::string at = what + " step " + std::to_string(step);
        expect_bitwise(params, at + " params");
        expect_bitwise(m, at + " m");
        expect_bitwise(v, at + " v");
        expect_bitwise(out, at + " params_out");
      }
    }
  }
}

TEST_F(CudaKernelsTest, SumAndSquaredNormAreDeterministic) {
  for (int64_t n : {int64_t{1}, int64_t{1000}, int64_t{300001}}) {
    for (tensor::DType dt : {tensor::DType::kF32, tensor::DType::kBF16, tensor::DType::kF16}) {
      Pair x = random(tensor::Shape{n}, dt);
      Pair s = empty(tensor::Shape{1}, tensor::DType::kF32);
      Pair s2 = empty(tensor::Shape{1}, tensor::DType::kF32);
      both([&](kernels::Kernels& k, bool gpu) {
        k.sum(side(x, gpu), side(s, gpu));
        k.squared_norm(side(x, gpu), side(s2, gpu));
      });
      // Summation order differs (cpu threads, cuda blocks), so the bound scales with
      // sum |x|, as the classic f32 summation error bound does, with a far smaller constant.
      std::vector<float> xs = host(x.cpu, false);
      double abs_sum = 0.0;
      for (float e : xs) abs_sum += std::abs(e);
      std::vector<float> c = host(s.cpu, false), g = host(s.gpu, true);
      EXPECT_NEAR(c[0], g[0], 2e-6 * abs_sum + 1e-6) << "sum n=" << n;
      expect_close(s2, 1e-4, "squared_norm n=" + std::to_string(n));
      tensor::Tensor again = tensor::Tensor::empty(*cuda_alloc_, tensor::Shape{1}, tensor::DType::kF32, memory::Category::kWorkspace);
      gpu_->sum(x.gpu, again);
      EXPECT_EQ(host(again, true)[0], g[0]) << "sum is not deterministic on cuda";
    }
  }
}

TEST_F(CudaKernelsTest, CastsFillScale) {
  const int64_t n = 2049;
  std::vector<float> values = uniform(n, -100.0f, 100.0f);
  values[0] = 0.0f;
  values[1] = -0.0f;
  values[2] = 1.00390625f;  // exactly halfway between two bf16 values: ties to even
  Pair x = from(values, tensor::Shape{n}, tensor::DType::kF32);
  Pair h = empty(tensor::Shape{n}, tensor::DType::kBF16);
  both([&](kernels::Kernels& k, bool gpu) { k.cast(side(x, gpu), side(h, gpu)); });
  expect_bitwise(h, "cast f32 -> bf16");
  Pair back = empty(tensor::Shape{n}, tensor::DType::kF32);
  both([&](kernels::Kernels& k, bool gpu) { k.cast(side(h, gpu), side(back, gpu)); });
  expect_bitwise(back, "cast bf16 -> f32");

  // f16: the same bits on both devices, ties to even included, and past 65504 inf.
  values[3] = 1.00048828125f;  // 1 + 2^-11: halfway between two f16 values
  values[4] = 70000.0f;
  values[5] = 6e-6f;           // an f16 subnormal
  Pair x16 = from(values, tensor::Shape{n}, tensor::DType::kF32);
  Pair f16 = empty(tensor::Shape{n}, tensor::DType::kF16);
  both([&](kernels::Kernels& k, bool gpu) { k.cast(side(x16, gpu), side(f16, gpu)); });
  expect_bitwise(f16, "cast f32 -> f16");
  Pair back16 = empty(tensor::Shape{n}, tensor::DType::kF32);
  both([&](kernels::Kernels& k, bool gpu) { k.cast(side(f16, gpu), side(back16, gpu)); });
  expect_bitwise(back16, "cast f16 -> f32");
  EXPECT_EQ(host(back16.gpu, true)[4], INFINITY);
  Pair f16_to_bf16 = empty(tensor::Shape{n}, tensor::DType::kBF16);
  both([&](kernels::Kernels& k, bool gpu) { k.cast(side(f16, gpu), side(f16_to_bf16, gpu)); });
  expect_bitwise(f16_to_bf16, "cast f16 -> bf16");

  for (tensor::DType dt : {tensor::DType::kF32, tensor::DType::kBF16, tensor::DType::kF16}) {
    Pair y = random(tensor::Shape{n}, dt);
    both([&](kernels::Kernels& k, bool gpu) { k.scale(side(y, gpu), -1.5f); });
    expect_bitwise(y, "scale");
    both([&](kernels::Kernels& k, bool gpu) { k.fill(side(y, gpu), 0.3f); });
    expect_bitwise(y, "fill");
  }
}

// The fp16 loss scaler's overflow test: the same count on both devices, for every dtype.
TEST_F(CudaKernelsTest, NonfiniteCountMatchesCpu) {
  for (int64_t n : {int64_t{1}, int64_t{1000}, int64_t{300001}}) {
    for (tensor::DType dt : {tensor::DType::kF32, tensor::DType::kBF16, tensor::DType::kF16}) {
      std::vector<float> values = uniform(n);
      Pair count = empty(tensor::Shape{1}, tensor::DType::kF32);
      Pair clean = from(values, tensor::Shape{n}, dt);
      both([&](kernels::Kernels& k, bool gpu) { k.nonfinite_count(side(clean, gpu), side(count, gpu)); });
      EXPECT_EQ(host(count.gpu, true)[0], 0.0f) << tensor::dtype_name(dt) << " n=" << n;
      const float specials[] = {INFINITY, -INFINITY, NAN, 1e30f};  // 1e30: inf in f16 only
      for (int64_t i = 0; i < n; i += 997) values[static_cast<size_t>(i)] = specials[(i / 997) % 4];
      Pair dirty = from(values, tensor::Shape{n}, dt);
      int expected = 0;
      for (float v : host(dirty.cpu, false)) expected += std::isfinite(v) ? 0 : 1;
      EXPECT_GT(expected, 0);
      both([&](kernels::Kernels& k, bool gpu) { k.nonfinite_count(side(dirty, gpu), side(count, gpu)); });
      EXPECT_EQ(host(count.gpu, true)[0], static_cast<float>(expected))
          << tensor::dtype_name(dt) << " n=" << n;
      expect_bitwise(count, std::string("nonfinite_count ") + std::string(tensor::dtype_name(dt)));
    }
  }
}

// The checkpointing layer needs gradients bit-identical across runs: no float atomics.
TEST_F(CudaKernelsTest, BackwardReductionsAreBitwiseRepeatable) {
  const int64_t batch = 4, seq = 64, channels = 32, vocab = 8;
  std::vector<int32_t> tok(static_cast<size_t>(batch * seq));
  for (size_t i = 0; i < tok.size(); ++i) tok[i] = static_cast<int32_t>(i % vocab);
  Pair tokens = ints(tok, tensor::Shape{batch, seq});
  Pair dout = random(tensor::Shape{batch, seq, channels});
  std::vector<float> first;
  for (int run = 0; run < 2; ++run) {
    tensor::Tensor dwte = tensor::Tensor::empty(*cuda_alloc_, tensor::Shape{vocab, channels}, tensor::DType::kF32,
                                memory::Category::kWorkspace);
    tensor::Tensor dwpe = tensor::Tensor::empty(*cuda_alloc_, tensor::Shape{seq, channels}, tensor::DType::kF32,
                                memory::Category::kWorkspace);
    gpu_->fill(dwte, 0.0f);
    gpu_->fill(dwpe, 0.0f);
    gpu_->embedding_backward(dout.gpu, tokens.gpu, dwte, dwpe);
    std::vector<float> got = host(dwte, true);
    if (run == 0) {
      first = got;
    } else {
      EXPECT_EQ(0, std::memcmp(first.data(), got.data(), first.size() * sizeof(float)));
    }
  }
}

}  // namespace
}  // namespace porter::nn

#endif  // PORTER_WITH_CUDA
