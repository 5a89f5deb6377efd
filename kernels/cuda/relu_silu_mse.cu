// Cuda kernels of the layer library's activations and loss: ReLU, SiLU and squared error.
// Elementwise ops are grid-stride loops; each squared-error row is one block whose sum is the
// fixed warp-then-block tree of common.cuh, so results do not depend on the launch.
#include <cmath>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/relu_silu_mse.h"

namespace porter::kernels::cuda {
namespace {

__global__ void relu_forward_kernel(DevPtr x, DevPtr y, int64_t n) {
  PORTER_GRID_STRIDE(i, n) {
    const float v = ld(x, i);
    st(y, i, v > 0.0f ? v : 0.0f);
  }
}

__global__ void relu_backward_kernel(DevPtr x, DevPtr dy, DevPtr dx, int64_t n) {
  PORTER_GRID_STRIDE(i, n) { st(dx, i, ld(x, i) > 0.0f ? ld(dy, i) : 0.0f); }
}

__global__ void silu_forward_kernel(DevPtr x, DevPtr y, int64_t n) {
  PORTER_GRID_STRIDE(i, n) {
    const float v = ld(x, i);
    st(y, i, v / (1.0f + expf(-v)));
  }
}

__global__ void silu_backward_kernel(DevPtr x, DevPtr dy, DevPtr dx, int64_t n) {
  PORTER_GRID_STRIDE(i, n) {
    const float v = ld(x, i);
    const float s = 1.0f / (1.0f + expf(-v));
    st(dx, i, ld(dy, i) * (s * (1.0f + v * (1.0f - s))));
  }
}

__global__ void mse_forward_kernel(DevPtr pred, DevPtr target, float* losses, int64_t cols) {
  __shared__ float scratch[kWarp];
  const int64_t base = static_cast<int64_t>(blockIdx.x) * cols;
  float acc = 0.0f;
  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
    const float d = ld(pred, base + j) - ld(target, base + j);
    acc += d * d;
  }
  acc = block_reduce<false>(acc, scratch);
  if (threadIdx.x == 0) losses[blockIdx.x] = acc;
}

// dpred may alias pred: each element is read, then written, by one thread.
__global__ void mse_backward_kernel(DevPtr pred, DevPtr target, DevPtr dpred, int64_t n,
                                    float k) {
  PORTER_GRID_STRIDE(i, n) { st(dpred, i, k * (ld(pred, i) - ld(target, i))); }
}

}  // namespace

void relu_forward(const Launch& l, DevPtr x, DevPtr y, int64_t n) {
  if (n == 0) return;
  relu_forward_kernel<<<grid_for(n), kBlock, 0, l.stream>>>(x, y, n);
  PORTER_GPU_CHECK_LAUNCH("relu_forward_kernel", l.device);
}

void relu_backward(const Launch& l, DevPtr x, DevPtr dy, DevPtr dx, int64_t n) {
  if (n == 0) return;
  relu_backward_kernel<<<grid_for(n), kBlock, 0, l.stream>>>(x, dy, dx, n);
  PORTER_GPU_CHECK_LAUNCH("relu_backward_kernel", l.device);
}

void silu_forward(const Launch& l, DevPtr x, DevPtr y, int64_t n) {
  if (n == 0) return;
  silu_forward_kernel<<<grid_for(n), kBlock, 0, l.stream>>>(x, y, n);
  PORTER_GPU_CHECK_LAUNCH("silu_forward_kernel", l.device);
}

void silu_backward(const Launch& l, DevPtr x, DevPtr dy, DevPtr dx, int64_t n) {
  if (n == 0) return;
  silu_backward_kernel<<<grid_for(n), kBlock, 0, l.stream>>>(x, dy, dx, n);
  PORTER_GPU_CHECK_LAUNCH("silu_backward_kernel", l.device);
}

void mse_forward(const Launch& l, DevPtr pred, DevPtr target, float* losses, int64_t rows,
                 int64_t cols) {
  if (rows == 0) return;
  mse_forward_kernel<<<static_cast<unsigned>(rows), kBlock, 0, l.stream>>>(pred, target, losses,
                                                                           cols);
  PORTER_GPU_CHECK_LAUNCH("mse_forward_kernel", l.device);
}

void mse_backward(const Launch& l, DevPtr pred, DevPtr target, DevPtr dpred, int64_t n,
                  float scale) {
  if (n == 0) return;
  mse_backward_kernel<<<grid_for(n), kBlock, 0, l.stream>>>(pred, target, dpred, n,
                                                            2.0f * scale);
  PORTER_GPU_CHECK_LAUNCH("mse_backward_kernel", l.device);
}

}  // namespace porter::kernels::cuda
