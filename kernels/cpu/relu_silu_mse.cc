// Cpu kernels of the layer library's activations and loss: ReLU, SiLU and squared error.
// Elementwise work is cut into fixed blocks and each squared-error row is summed by one
// thread in column order, so the bits do not depend on the thread count (Note [Cpu
// determinism]).
#include <cstdint>

#include "kernels/cpu/cpu_kernels.h"

namespace porter::kernels {
namespace {

using cpu::load;
using cpu::store;

template <typename TX, typename TY>
PORTER_CPU_CLONES void relu_fwd(const TX* x, TY* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float v = load(x + i);
    store(y + i, v > 0.0f ? v : 0.0f);
  }
}

template <typename TX, typename TD, typename TO>
PORTER_CPU_CLONES void relu_bwd(const TX* x, const TD* dy, TO* dx, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) store(dx + i, load(x + i) > 0.0f ? load(dy + i) : 0.0f);
}

// sigmoid(v) = 1 / (1 + exp(-v)), with the same fast_exp as SwiGLU's silu.
template <typename TX, typename TY>
PORTER_CPU_CLONES void silu_fwd(const TX* x, TY* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float v = load(x + i);
    const float s = 1.0f / (1.0f + cpu::fast_exp(-v));
    store(y + i, v * s);
  }
}

template <typename TX, typename TD, typename TO>
PORTER_CPU_CLONES void silu_bwd(const TX* x, const TD* dy, TO* dx, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float v = load(x + i);
    const float s = 1.0f / (1.0f + cpu::fast_exp(-v));
    store(dx + i, load(dy + i) * (s * (1.0f + v * (1.0f - s))));
  }
}

template <typename TP, typename TT>
PORTER_CPU_CLONES float squared_error_row(const TP* p, const TT* t, int64_t cols) {
  float acc = 0.0f;
  for (int64_t c = 0; c < cols; ++c) {
    const float d = load(p + c) - load(t + c);
    acc += d * d;
  }
  return acc;
}

template <typename TP, typename TT, typename TO>
PORTER_CPU_CLONES void mse_bwd(const TP* p, const TT* t, TO* dp, int64_t n, float k) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) store(dp + i, k * (load(p + i) - load(t + i)));
}

}  // namespace

void CpuKernels::do_relu_forward(const Tensor& x, Tensor& y) {
  cpu::with_typed(
      [&](auto* xp, auto* yp) {
        cpu::parallel_blocks(threads_, x.numel(),
                             [&](int64_t b, int64_t e) { relu_fwd(xp + b, yp + b, e - b); });
      },
      x, y);
}

void CpuKernels::do_relu_backward(const Tensor& x, const Tensor& dy, Tensor& dx) {
  cpu::with_typed(
      [&](auto* xp, auto* dyp, auto* dxp) {
        cpu::parallel_blocks(threads_, x.numel(), [&](int64_t b, int64_t e) {
          relu_bwd(xp + b, dyp + b, dxp + b, e - b);
        });
      },
      x, dy, dx);
}

void CpuKernels::do_silu_forward(const Tensor& x, Tensor& y) {
  cpu::with_typed(
      [&](auto* xp, auto* yp) {
        cpu::parallel_blocks(threads_, x.numel(),
                             [&](int64_t b, int64_t e) { silu_fwd(xp + b, yp + b, e - b); });
      },
      x, y);
}

void CpuKernels::do_silu_backward(const Tensor& x, const Tensor& dy, Tensor& dx) {
  cpu::with_typed(
      [&](auto* xp, auto* dyp, auto* dxp) {
        cpu::parallel_blocks(threads_, x.numel(), [&](int64_t b, int64_t e) {
          silu_bwd(xp + b, dyp + b, dxp + b, e - b);
        });
      },
      x, dy, dx);
}

void CpuKernels::do_mse_forward(const Tensor& pred, const Tensor& target, Tensor& losses) {
  const int64_t cols = pred.dim(-1);
  const int64_t rows = cpu::rows_of(pred);
  float* out = losses.data_as<float>();
  cpu::with_typed(
      [&](auto* pp, auto* tp) {
        cpu::parallel_rows(threads_, rows, [&](int64_t r) {
          out[r] = squared_error_row(pp + r * cols, tp + r * cols, cols);
        });
      },
      pred, target);
}

void CpuKernels::do_mse_backward(const Tensor& pred, const Tensor& target, Tensor& dpred,
                                 float scale) {
  const float k = 2.0f * scale;
  cpu::with_typed(
      [&](auto* pp, auto* tp, auto* dp) {
        cpu::parallel_blocks(threads_, pred.numel(), [&](int64_t b, int64_t e) {
          mse_bwd(pp + b, tp + b, dp + b, e - b, k);
        });
      },
      pred, target, dpred);
}

}  // namespace porter::kernels
