// Host-side launchers of kernels/cuda/relu_silu_mse.cu (the layer library's activations and
// squared-error loss), in the raw-pointer form of kernels/cuda/launch.h.
#pragma once

#include <cstdint>

#include "kernels/cuda/launch.h"

namespace porter::kernels::cuda {

// y = max(x, 0); dx = x > 0 ? dy : 0.
void relu_forward(const Launch& l, DevPtr x, DevPtr y, int64_t n);
void relu_backward(const Launch& l, DevPtr x, DevPtr dy, DevPtr dx, int64_t n);
// y = x sigmoid(x); dx = dy s (1 + x (1 - s)).
void silu_forward(const Launch& l, DevPtr x, DevPtr y, int64_t n);
void silu_backward(const Launch& l, DevPtr x, DevPtr dy, DevPtr dx, int64_t n);
// losses[r] = sum_c (pred - target)^2 over row r of (rows, cols): one block per row.
void mse_forward(const Launch& l, DevPtr pred, DevPtr target, float* losses, int64_t rows,
                 int64_t cols);
// dpred = 2 scale (pred - target).
void mse_backward(const Launch& l, DevPtr pred, DevPtr target, DevPtr dpred, int64_t n,
                  float scale);

}  // namespace porter::kernels::cuda
