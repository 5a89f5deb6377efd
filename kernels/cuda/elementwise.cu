// Elementwise cuda kernels: bias add, GELU, dropout, add, accumulate, cast, fill, scale, AdamW.
// Grid-stride loops; each element is independent, so results do not depend on the launch shape.
#include <cmath>

#include "kernels/cuda/common.cuh"
#include "tensor/philox.h"

namespace porter::kernels::cuda {
namespace {

__global__ void bias_add_kernel(DevPtr x, DevPtr bias, int64_t n, int64_t cols) {
  PORTER_GRID_STRIDE(i, n) { st(x, i, ld(x, i) + ld(bias, i % cols)); }
}

// GELU, tanh form (as PyTorch's approximate="tanh").
constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kGeluCoeff = 0.044715f;

__global__ void gelu_forward_kernel(DevPtr x, DevPtr y, int64_t n) {
  PORTER_GRID_STRIDE(i, n) {
    float v = ld(x, i);
    float u = kSqrt2OverPi * (v + kGeluCoeff * v * v * v);
    st(y, i, 0.5f * v * (1.0f + tanhf(u)));
  }
}

// d/dx = 0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u) sqrt(2/pi) (1 + 3 * 0.044715 x^2).
__global__ void gelu_backward_kernel(DevPtr x, DevPtr dy, DevPtr dx, int64_t n) {
  PORTER_GRID_STRIDE(i, n) {
    float v = ld(x, i);
    float u = kSqrt2OverPi * (v + kGeluCoeff * v * v * v);
    float t = tanhf(u);
    float du = kSqrt2OverPi * (1.0f + 3.0f * kGeluCoeff * v * v);
    float grad = 0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * du;
    st(dx, i, ld(dy, i) * grad);
  }
}

// One thread per Philox group of four elements, so each group costs one Philox call. The mask
// of element i is philox_uniform(key, i) >= p, exactly as on the cpu (Note [Dropout keys]),
// and a kept value is x * (1 / (1 - p)) with the scale rounded once on the host, as the cpu
// computes it, so both devices produce the same bits.
__global__ void dropout_kernel(DevPtr x, DevPtr y, int64_t n, float p, float keep_scale,
                               PhiloxKey key) {
  const int64_t groups = (n + 3) / 4;
  PORTER_GRID_STRIDE(g, groups) {
    float u[4];
    philox_uniform4(key, static_cast<uint64_t>(g), u);
    for (int j = 0; j < 4; ++j) {
      int64_t i = 4 * g + j;
      if (i >= n) break;
      st(y, i, u[j] >= p ? ld(x, i) * keep_scale : 0.0f);
    }
  }
}

__global__ void add_kernel(DevPtr a, DevPtr b, DevPtr out, int64_t n) {
  PORTER_GRID_STRIDE(i, n) { st(out, i, ld(a, i) + ld(b, i)); }
}

__global__ void cast_kernel(DevPtr x, DevPtr y, int64_t n) {
  PORTER_GRID_STRIDE(i, n) { st(y, i, ld(x, i)); }
}

__global__ void fill_kernel(DevPtr x, float value, int64_t n) {
  PORTER_GRID_STRIDE(i, n) { st(x, i, value); }
}

__global__ void scale_kernel(DevPtr x, float s, int64_t n) {
  PORTER_GRID_STRIDE(i, n) { st(x, i, ld(x, i) * s); }
}

// Note [Device AdamW bit identity]
// The host's AdamW (kernels/cpu/adamw.cc, and zero/cpu_adam.cc for an offloaded optimizer,
// Note [CpuAdam bit identity]) rounds every operation to f32 in this order, with no fused
// multiply-add:
//   grad  = g * grad_scale;  param = p * decay
//   m     = m * beta1 + one_minus_beta1 * grad
//   v     = v * beta2 + (one_minus_beta2 * grad) * grad
//   denom = sqrt(v) / bc2_sqrt + eps;  param = param - step_size * (m / denom)
// with the constants computed once on the host (AdamWStep, from the same double bias
// corrections). nvcc contracts a multiply followed by an add into an FMA by default (-fmad=true),
// which rounds once instead of twice, so the same source gave other bits on a GPU. The kernel
// therefore spells each operation as a round-to-nearest intrinsic: __fmul_rn and __fadd_rn are
// never merged into an FMA, and __fdiv_rn and __fsqrt_rn are IEEE-correct whatever -prec-div,
// -prec-sqrt or --use_fast_math say. Intrinsics rather than -fmad=false for this file: the
// other kernels here (GELU, dropout, ...) keep nvcc's contraction and speed, and the guarantee
// sits in the code it protects, not in a build flag that a later edit could drop. The bf16
// and f16 stores round to nearest-even like the host's (kernels/cuda/common.cuh).
__global__ void adamw_kernel(float* params, DevPtr grad, float* m, float* v, DevPtr params_out,
                             int64_t n, AdamWStep s) {
  PORTER_GRID_STRIDE(i, n) {
    const float g = __fmul_rn(ld(grad, i), s.grad_scale);
    float p = __fmul_rn(params[i], s.decay);
    const float mi = __fadd_rn(__fmul_rn(m[i], s.beta1), __fmul_rn(s.one_minus_beta1, g));
    const float vi =
        __fadd_rn(__fmul_rn(v[i], s.beta2), __fmul_rn(__fmul_rn(s.one_minus_beta2, g), g));
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), s.bc2_sqrt), s.eps);
    p = __fsub_rn(p, __fmul_rn(s.step_size, __fdiv_rn(mi, denom)));
    m[i] = mi;
    v[i] = vi;
    params[i] = p;
    if (params_out.data != nullptr) st(params_out, i, p);
  }
}

}  // namespace

void bias_add(const Launch& l, DevPtr x, DevPtr bias, int64_t rows, int64_t cols) {
  const int64_t n = rows * cols;
  if (n == 0) return;
  bias_add_kernel<<<grid_for(n), kBlock, 0, l.stream>>>(x, bias, n, cols);
  PORTER_GPU_CHECK_LAUNCH("bias_add_kernel", l.device);
}

void gelu_forward(const Launch& l, DevPtr x, DevPtr y, int64_t n) {
  if (n == 0) return;
  gelu_forward_kernel<<<grid_for(n), kBlock, 0, l.stream>>>(x, y, n);
  PORTER_GPU_CHECK_LAUNCH("gelu_forward_kernel", l.device);
}

void gelu_backward(const Launch& l, DevPtr x, DevPtr dy, DevPtr dx, int64_t n) {
  if (n == 0) return;
  gelu_backward_kernel<<<grid_for(n), kBlock, 0, l.stream>>>(x, dy, dx, n);
  PORTER_GPU_CHECK_LAUNCH("gelu_backward_kernel", l.device);
}

void dropout(const Launch& l, DevPtr x, DevPtr y, int64_t n, float p, const PhiloxKey& key) {
  if (n == 0) return;
  const float keep_scale = 1.0f / (1.0f - p);
  dropout_kernel<<<grid_for((n + 3) / 4), kBlock, 0, l.stream>>>(x, y, n, p, keep_scale, key);
  PORTER_GPU_CHECK_LAUNCH("dropout_kernel", l.device);
}

void add(const Launch& l, DevPtr a, DevPtr b, DevPtr out, int64_t n) {
  if (n == 0) return;
  add_kernel<<<grid_for(n), kBlock, 0, l.stream>>>(a, b, out, n);
  PORTER_GPU_CHECK_LAUNCH("add_kernel", l.device);
}

void accumulate(const Launch& l, DevPtr acc, DevPtr x, int64_t n) { add(l, acc, x, acc, n); }

void cast(const Launch& l, DevPtr x, DevPtr y, int64_t n) {
  if (n == 0) return;
  cast_kernel<<<grid_for(n), kBlock, 0, l.stream>>>(x, y, n);
  PORTER_GPU_CHECK_LAUNCH("cast_kernel", l.device);
}

void fill(const Launch& l, DevPtr x, float value, int64_t n) {
  if (n == 0) return;
  fill_kernel<<<grid_for(n), kBlock, 0, l.stream>>>(x, value, n);
  PORTER_GPU_CHECK_LAUNCH("fill_kernel", l.device);
}

void scale(const Launch& l, DevPtr x, float s, int64_t n) {
  if (n == 0) return;
  scale_kernel<<<grid_for(n), kBlock, 0, l.stream>>>(x, s, n);
  PORTER_GPU_CHECK_LAUNCH("scale_kernel", l.device);
}

void adamw(const Launch& l, float* params, DevPtr grad, float* m, float* v, DevPtr params_out,
           int64_t n, const AdamWStep& s) {
  if (n == 0) return;
  adamw_kernel<<<grid_for(n), kBlock, 0, l.stream>>>(params, grad, m, v, params_out, n, s);
  PORTER_GPU_CHECK_LAUNCH("adamw_kernel", l.device);
}

}  // namespace porter::kernels::cuda
