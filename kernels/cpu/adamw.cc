// AdamW on cpu, in the order torch.optim.AdamW (PyTorch 1.13, single-tensor path) computes
// it, so porter's f32 update matches PyTorch's to rounding:
//   p *= 1 - lr * wd;  m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2;
//   p -= (lr / (1 - b1^t)) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
#include <cmath>
#include <cstdint>

#include "kernels/cpu/cpu_kernels.h"

namespace porter::kernels {
namespace {

template <typename TG, typename TO>
PORTER_CPU_CLONES void adamw_range(float* p, const TG* g, float* m, float* v, TO* out,
                                   int64_t n, AdamWConstants k) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    float grad = cpu::load(g + i) * k.grad_scale;
    float param = p[i] * k.decay;
    float mi = m[i] * k.beta1 + k.one_minus_beta1 * grad;
    float vi = v[i] * k.beta2 + k.one_minus_beta2 * grad * grad;
    float denom = std::sqrt(vi) / k.bc2_sqrt + k.eps;
    param = param - k.step_size * (mi / denom);
    m[i] = mi;
    v[i] = vi;
    p[i] = param;
    if (out != nullptr) cpu::store(out + i, param);
  }
}

}  // namespace

AdamWConstants adamw_constants(const AdamWArgs& args) {
  // Bias corrections in double, as PyTorch computes them in Python floats.
  const double bc1 = 1.0 - std::pow(static_cast<double>(args.beta1), static_cast<double>(args.step));
  const double bc2 = 1.0 - std::pow(static_cast<double>(args.beta2), static_cast<double>(args.step));
  AdamWConstants k;
  k.decay = 1.0f - args.lr * args.weight_decay;  // no contraction: nn/CMakeLists.txt
  k.beta1 = args.beta1;
  k.one_minus_beta1 = 1.0f - args.beta1;
  k.beta2 = args.beta2;
  k.one_minus_beta2 = 1.0f - args.beta2;
  k.step_size = static_cast<float>(args.lr / bc1);
  k.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  k.eps = args.eps;
  k.grad_scale = args.grad_scale;
  return k;
}

void CpuKernels::do_adamw(Tensor& params, const Tensor& grad, Tensor& m, Tensor& v,
                          const AdamWArgs& args, Tensor* params_out) {
  const AdamWConstants k = adamw_constants(args);
  float* pp = params.data_as<float>();
  float* mp = m.data_as<float>();
  float* vp = v.data_as<float>();
  const bool has_out = params_out != nullptr && params_out->defined() && params_out->numel() > 0;
  const DType out_dtype = has_out ? params_out->dtype() : DType::kF32;
  cpu::dispatch_float(grad.dtype(), [&](auto tg) {
    cpu::dispatch_float(out_dtype, [&](auto to) {
      using TG = decltype(tg);
      using TO = decltype(to);
      const TG* gp = static_cast<const TG*>(grad.data());
      TO* op = has_out ? static_cast<TO*>(params_out->data()) : nullptr;
      cpu::parallel_blocks(threads_, params.numel(), [&](int64_t b, int64_t e) {
        adamw_range(pp + b, gp + b, mp + b, vp + b, op == nullptr ? nullptr : op + b, e - b, k);
      });
    });
  });
}

}  // namespace porter::kernels
