// Kernel workspace (Note [Kernel workspace] in kernels/kernels.h): every scratch byte a kernel
// uses comes from the kernels' CachingAllocator in category workspace, in exactly the bytes
// the published size functions give, is freed before the call returns, and counts against
// the device's capacity.
#include <gtest/gtest.h>

#include <gmock/gmock.h>

#include <string>

#include "base/error.h"
#include "kernels/kernels.h"
#include "tests/nn/nn_test_util.h"

namespace porter::nn {

using namespace porter::tensor;
using namespace porter::kernels;
namespace {

using ::testing::HasSubstr;
using memory::Category;
using memory::DeviceKind;

// Tensors for one attention call: qkv (B, T, 3C), out / dout (B, T, C), probs, dqkv.
struct AttentionTensors {
  tensor::Tensor qkv, out, probs, dout, dqkv;
};

AttentionTensors attention_tensors(testing::Env& env, const AttentionCall& c) {
  const int64_t b = c.batch, t = c.seq, ch = c.channels;
  AttentionTensors a;
  a.qkv = env.from(testing::random_values(static_cast<size_t>(b * t * 3 * ch), 1),
                   tensor::Shape{b, t, 3 * ch}, c.qkv);
  a.out = env.empty(tensor::Shape{b, t, ch}, c.out);
  a.probs = env.empty(tensor::Shape{b, c.heads, t, t}, tensor::DType::kF32);
  a.dout = env.from(testing::random_values(static_cast<size_t>(b * t * ch), 2), tensor::Shape{b, t, ch},
                    c.out);
  a.dqkv = env.empty(tensor::Shape{b, t, 3 * ch}, c.dqkv);
  return a;
}

// What one call did to the allocator: the peak of requested bytes above the start, and the
// workspace allocations it made.
struct CallStats {
  size_t peak_above_start = 0;
  uint64_t workspace_allocs = 0;
  size_t requested_after = 0;
  size_t requested_before = 0;
};

template <typename Fn>
CallStats measure(memory::CachingAllocator& alloc, Fn&& fn) {
  const memory::MemoryStats before = alloc.stats();
  alloc.reset_peak();
  fn();
  const memory::MemoryStats after = alloc.stats();
  CallStats s;
  s.peak_above_start = after.peak_requested_bytes - before.requested_bytes;
  s.workspace_allocs =
      after[Category::kWorkspace].alloc_count - before[Category::kWorkspace].alloc_count;
  s.requested_before = before.requested_bytes;
  s.requested_after = after.requested_bytes;
  return s;
}

struct DtypeCase {
  tensor::DType qkv, out, dqkv;
};

TEST(KernelWorkspaceTest, CpuAttentionScratchComesFromTheAllocatorInExactBytes) {
  for (const DtypeCase& d : {DtypeCase{tensor::DType::kF32, tensor::DType::kF32, tensor::DType::kF32},
                             DtypeCase{tensor::DType::kBF16, tensor::DType::kBF16, tensor::DType::kBF16},
                             DtypeCase{tensor::DType::kBF16, tensor::DType::kBF16, tensor::DType::kF32},
                             DtypeCase{tensor::DType::kBF16, tensor::DType::kF32, tensor::DType::kF32},
                             DtypeCase{tensor::DType::kF32, tensor::DType::kBF16, tensor::DType::kBF16},
                             DtypeCase{tensor::DType::kF16, tensor::DType::kF16, tensor::DType::kF16},
                             DtypeCase{tensor::DType::kF16, tensor::DType::kF32, tensor::DType::kF32}}) {
    // T = 70 > 64: two row blocks, the block buffers are (B, H, 64, T).
    for (int64_t seq : {5, 70}) {
      SCOPED_TRACE(std::string(dtype_name(d.qkv)) + "/" + std::string(dtype_name(d.out)) + "/" +
                   std::string(dtype_name(d.dqkv)) + " T=" + std::to_string(seq));
      testing::Env env;
      const AttentionCall call{2, seq, 24, 3, d.qkv, d.out, d.dqkv};
      AttentionTensors a = attention_tensors(env, call);

      // Note [Attention scratch], Note [Bf16 attention]: with n = N·C elements, f32 copies of
      // what is not f32, or in bf16 the packed heads (6n or 8n bytes) and one row block's
      // f32 scores or dP, bf16 P (6 B·H·rows·T) and f32 result (4 B·rows·C).
      const size_t n = static_cast<size_t>(2 * seq * 24);
      const size_t rows = static_cast<size_t>(std::min<int64_t>(seq, 64));
      const size_t block = 2 * 3 * rows * static_cast<size_t>(seq);
      const size_t row_block = 6 * block + 4 * 2 * rows * 24;
      const bool bf16_fwd = d.qkv == tensor::DType::kBF16;
      const bool bf16_bwd = d.qkv == tensor::DType::kBF16 && d.out == tensor::DType::kBF16;
      const size_t fwd = kernels::attention_forward_workspace_bytes(DeviceKind::kCpu, call);
      EXPECT_EQ(fwd, bf16_fwd ? row_block + 6 * n
                              : (d.qkv == tensor::DType::kF32 ? 0 : 12 * n) +
                                    (d.out == tensor::DType::kF32 ? 0 : 4 * n));
      const CallStats f = measure(*env.allocator, [&] {
        env.kernels->attention_forward(a.qkv, a.out, a.probs, call.heads);
      });
      EXPECT_EQ(f.peak_above_start, fwd);
      EXPECT_EQ(f.workspace_allocs, fwd == 0 ? 0u : 1u);
      EXPECT_EQ(f.requested_after, f.requested_before);

      const size_t bwd = kernels::attention_backward_workspace_bytes(DeviceKind::kCpu, call);
      EXPECT_EQ(bwd, bf16_bwd ? row_block + 16 * n
                              : 4 * block + (d.qkv == tensor::DType::kF32 ? 0 : 12 * n) +
                                    (d.out == tensor::DType::kF32 ? 0 : 4 * n) +
                                    (d.dqkv == tensor::DType::kF32 ? 0 : 12 * n));
      const CallStats b = measure(*env.allocator, [&] {
        env.kernels->attention_backward(a.dout, a.qkv, a.probs, a.dqkv, call.heads);
      });
      EXPECT_EQ(b.peak_above_start, bwd);
      EXPECT_EQ(b.workspace_allocs, 1u);
      EXPECT_EQ(b.requested_after, b.requested_before);
    }
  }
}

// Note [Cpu f16 matmul]: f32 copies of f16 a and b, and of an f16 out, in one buffer of
// exactly kernels::matmul_workspace_bytes; f32 and bf16 take none.
TEST(KernelWorkspaceTest, CpuMatmulF16CopiesComeFromTheAllocatorInExactBytes) {
  struct Case {
    int64_t batch, m, n, k;
    tensor::DType ab, out;
    float beta;
  };
  for (const Case& c : {Case{0, 5, 7, 3, tensor::DType::kF16, tensor::DType::kF16, 0.0f},
                        Case{0, 5, 7, 3, tensor::DType::kF16, tensor::DType::kF32, 1.0f},
                        Case{3, 4, 6, 9, tensor::DType::kF16, tensor::DType::kF16, 1.0f},
                        Case{0, 5, 7, 3, tensor::DType::kBF16, tensor::DType::kBF16, 0.0f},
                        Case{2, 5, 7, 3, tensor::DType::kF32, tensor::DType::kF32, 0.0f},
                        Case{0, 5, 7, 0, tensor::DType::kF16, tensor::DType::kF16, 1.0f},
                        Case{0, 0, 7, 3, tensor::DType::kF16, tensor::DType::kF16, 0.0f}}) {
    SCOPED_TRACE(std::string(dtype_name(c.ab)) + " -> " + std::string(dtype_name(c.out)) +
                 " batch " + std::to_string(c.batch) + " k " + std::to_string(c.k));
    testing::Env env;
    const int64_t batch = c.batch == 0 ? 1 : c.batch;
    auto shape = [&](int64_t r, int64_t cols) {
      return c.batch == 0 ? tensor::Shape{r, cols} : tensor::Shape{c.batch, r, cols};
    };
    tensor::Tensor a = env.from(testing::random_values(static_cast<size_t>(batch * c.m * c.k), 1),
                        shape(c.m, c.k), c.ab);
    tensor::Tensor b = env.from(testing::random_values(static_cast<size_t>(batch * c.k * c.n), 2),
                        shape(c.k, c.n), c.ab);
    tensor::Tensor out = env.from(testing::random_values(static_cast<size_t>(batch * c.m * c.n), 3),
                          shape(c.m, c.n), c.out);
    const size_t want = kernels::matmul_workspace_bytes(
        DeviceKind::kCpu, kernels::MatmulCall{batch, c.m, c.n, c.k, c.ab, c.out});
    const bool any = c.ab == tensor::DType::kF16 && c.m > 0 && c.k > 0;
    EXPECT_EQ(want, any ? 4 * static_cast<size_t>(batch * (c.m * c.k + c.k * c.n) +
                                                  (c.out == tensor::DType::kF16 ? batch * c.m * c.n : 0))
                        : 0u);
    const CallStats s = measure(*env.allocator, [&] {
      env.kernels->matmul(a, b, out, {false, false, 1.0f, c.beta});
    });
    EXPECT_EQ(s.peak_above_start, want);
    EXPECT_EQ(s.workspace_allocs, want == 0 ? 0u : 1u);
    EXPECT_EQ(s.requested_after, s.requested_before);
    EXPECT_EQ(kernels::matmul_workspace_bytes(DeviceKind::kCuda, kernels::MatmulCall{batch, c.m, c.n, c.k, c.ab,
                                                                    c.out}),
              0u);
  }
}

TEST(KernelWorkspaceTest, CpuReductionPartialsComeFromTheAllocator) {
  testing::Env env;
  for (int64_t n : {int64_t{1}, int64_t{16384}, int64_t{40000}}) {
    tensor::Tensor x = env.from(testing::random_values(static_cast<size_t>(n), 3), tensor::Shape{n});
    tensor::Tensor out = env.empty(tensor::Shape{1});
    const size_t expected = static_cast<size_t>((n + 16383) / 16384) * sizeof(double);
    EXPECT_EQ(kernels::reduction_workspace_bytes(DeviceKind::kCpu, n), expected);
    for (int op = 0; op < 3; ++op) {
      const CallStats s = measure(*env.allocator, [&] {
        if (op == 0) env.kernels->sum(x, out);
        if (op == 1) env.kernels->squared_norm(x, out);
        if (op == 2) env.kernels->nonfinite_count(x, out);
      });
      EXPECT_EQ(s.peak_above_start, expected) << n;
      EXPECT_EQ(s.workspace_allocs, 1u);
      EXPECT_EQ(s.requested_after, s.requested_before);
    }
  }
}

TEST(KernelWorkspaceTest, RepeatedCallsReuseTheCachedBlock) {
  testing::Env env;
  const AttentionCall call{2, 70, 24, 3, tensor::DType::kBF16, tensor::DType::kBF16, tensor::DType::kBF16};
  AttentionTensors a = attention_tensors(env, call);
  env.kernels->attention_backward(a.dout, a.qkv, a.probs, a.dqkv, call.heads);
  const memory::MemoryStats first = env.allocator->stats();
  for (int i = 0; i < 3; ++i) {
    env.kernels->attention_forward(a.qkv, a.out, a.probs, call.heads);
    env.kernels->attention_backward(a.dout, a.qkv, a.probs, a.dqkv, call.heads);
  }
  const memory::MemoryStats later = env.allocator->stats();
  EXPECT_EQ(later.num_segment_allocs, first.num_segment_allocs);
  EXPECT_EQ(later.reserved_bytes, first.reserved_bytes);
  EXPECT_EQ(later.requested_bytes, first.requested_bytes);
}

// The scratch counts against the device's capacity: a bf16 backward whose f32 copies do not
// fit next to its arguments fails with the allocator's accounting, naming the op, and the
// allocator is consistent afterwards.
TEST(KernelWorkspaceTest, ScratchThatDoesNotFitIsAnOutOfMemoryErrorNamingTheOp) {
  testing::Env env;
  // Replace the 1 GiB device with an 8 MiB one.
  memory::DeviceOptions o;
  o.kind = DeviceKind::kCpu;
  o.memory_limit_bytes = size_t{8} << 20;
  o.threads = 2;
  env.kernels.reset();
  env.allocator.reset();
  env.device = memory::make_device(o);
  env.allocator = std::make_unique<memory::CachingAllocator>(*env.device);
  env.kernels = kernels::make_kernels(*env.allocator);
  // Arguments 4.5 MiB in bf16; the scratch is 16·N·C = 4 MiB of packed heads and f32 dK,
  // dV, plus 1.75 MiB of row-block buffers (Note [Bf16 attention]).
  const AttentionCall call{4, 64, 1024, 8, tensor::DType::kBF16, tensor::DType::kBF16, tensor::DType::kBF16};
  AttentionTensors a = attention_tensors(env, call);
  const size_t bwd = kernels::attention_backward_workspace_bytes(DeviceKind::kCpu, call);
  ASSERT_EQ(bwd, (size_t{23} << 20) / 4);
  const size_t before = env.allocator->stats().requested_bytes;
  try {
    env.kernels->attention_backward(a.dout, a.qkv, a.probs, a.dqkv, call.heads);
    ADD_FAILURE() << "expected OutOfMemoryError";
  } catch (const OutOfMemoryError& e) {
    EXPECT_THAT(e.what(), HasSubstr("attention_backward"));
    EXPECT_THAT(e.what(), HasSubstr("kernel workspace"));
    EXPECT_THAT(e.what(), HasSubstr("for workspace"));
    EXPECT_EQ(e.requested_bytes(), bwd);
  }
  const memory::MemoryStats s = env.allocator->stats();
  EXPECT_EQ(s.requested_bytes, before);
  EXPECT_EQ(s.num_ooms, 1u);
  // Smaller workspace still works afterwards.
  tensor::Tensor total = env.empty(tensor::Shape{1});
  env.kernels->sum(a.qkv, total);
  EXPECT_EQ(env.allocator->stats().requested_bytes, before + total.nbytes());
}

// kernels::make_kernels(device): a private allocator. The user's allocator sees none of the scratch;
// the kernels' own allocator does, on the same device.
TEST(KernelWorkspaceTest, StandaloneKernelsUseAPrivateAllocatorOnTheDevice) {
  testing::Env env;
  std::unique_ptr<kernels::Kernels> alone = kernels::make_kernels(*env.device);
  EXPECT_NE(&alone->workspace_allocator(), env.allocator.get());
  EXPECT_EQ(&alone->workspace_allocator().device(), env.device.get());
  EXPECT_EQ(&env.kernels->workspace_allocator(), env.allocator.get());
  const AttentionCall call{2, 70, 24, 3, tensor::DType::kF32, tensor::DType::kF32, tensor::DType::kF32};
  AttentionTensors a = attention_tensors(env, call);
  const CallStats user = measure(*env.allocator, [&] {
    const CallStats own = measure(alone->workspace_allocator(), [&] {
      alone->attention_backward(a.dout, a.qkv, a.probs, a.dqkv, call.heads);
    });
    EXPECT_EQ(own.peak_above_start, kernels::attention_backward_workspace_bytes(DeviceKind::kCpu, call));
    EXPECT_EQ(own.workspace_allocs, 1u);
  });
  EXPECT_EQ(user.peak_above_start, 0u);
  EXPECT_EQ(user.workspace_allocs, 0u);
  // Same results as the kernels on the user's allocator.
  tensor::Tensor dqkv2 = env.empty(a.dqkv.shape());
  env.kernels->attention_backward(a.dout, a.qkv, a.probs, dqkv2, call.heads);
  EXPECT_EQ(env.host(a.dqkv), env.host(dqkv2));
}

// The cuda sizes are pure functions (no GPU needed): padded (B, H, T, hd) f32 matrices, four
// in forward, seven and a padded dP in backward; 1024 f32 partials per reduction.
TEST(KernelWorkspaceTest, CudaSizesFollowTheLayout) {
  // N·C = 2·7·12 = 168 -> 192 floats; dP 2·3·7·7 = 294 -> 320 floats.
  const AttentionCall call{2, 7, 12, 3, tensor::DType::kBF16, tensor::DType::kBF16, tensor::DType::kF32};
  EXPECT_EQ(kernels::attention_forward_workspace_bytes(DeviceKind::kCuda, call), 4u * 192 * 4);
  EXPECT_EQ(kernels::attention_backward_workspace_bytes(DeviceKind::kCuda, call), (7u * 192 + 320) * 4);
  EXPECT_EQ(kernels::reduction_workspace_bytes(DeviceKind::kCuda, 5), 4096u);
  EXPECT_EQ(kernels::reduction_workspace_bytes(DeviceKind::kCuda, 1 << 24), 4096u);
  const AttentionCall empty{0, 7, 12, 3};
  EXPECT_EQ(kernels::attention_forward_workspace_bytes(DeviceKind::kCuda, empty), 0u);
  EXPECT_EQ(kernels::attention_backward_workspace_bytes(DeviceKind::kCpu, empty), 0u);
}

}  // namespace
}  // namespace porter::nn
