// LayerNorm on cpu: forward per row; backward per row for dx, then per column block for
// dgamma and dbeta so each is summed by one thread in row order (Note [Cpu determinism]).
#include <cmath>
#include <cstdint>

#include "kernels/cpu/cpu_kernels.h"

namespace porter::kernels {
namespace {

using cpu::load;
using cpu::store;

constexpr int64_t kColumnBlock = 64;

template <typename TX, typename TP, typename TY>
PORTER_CPU_CLONES void ln_fwd_row(const TX* x, const TP* gamma, const TP* beta, TY* y,
                                  int64_t cols, float eps, float* mean_out, float* rstd_out) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t c = 0; c < cols; ++c) s += load(x + c);
  const float mean = s / static_cast<float>(cols);
  // Two passes: the variance of (x - mean) does not cancel catastrophically.
  float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
  for (int64_t c = 0; c < cols; ++c) {
    float d = load(x + c) - mean;
    ss += d * d;
  }
  const float rstd = 1.0f / std::sqrt(ss / static_cast<float>(cols) + eps);
#pragma omp simd
  for (int64_t c = 0; c < cols; ++c) {
    store(y + c, (load(x + c) - mean) * rstd * load(gamma + c) + load(beta + c));
  }
  *mean_out = mean;
  *rstd_out = rstd;
}

// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), with g = dy * gamma.
template <typename TD, typename TX, typename TP, typename TO>
PORTER_CPU_CLONES void ln_bwd_row(const TD* dy, const TX* x, const TP* gamma, float mean,
                                  float rstd, TO* dx, int64_t cols) {
  float sg = 0.0f, sgx = 0.0f;
#pragma omp simd reduction(+ : sg, sgx)
  for (int64_t c = 0; c < cols; ++c) {
    float g = load(dy + c) * load(gamma + c);
    float xhat = (load(x + c) - mean) * rstd;
    sg += g;
    sgx += g * xhat;
  }
  const float inv_cols = 1.0f / static_cast<float>(cols);
  const float mg = sg * inv_cols, mgx = sgx * inv_cols;
#pragma omp simd
  for (int64_t c = 0; c < cols; ++c) {
    float g = load(dy + c) * load(gamma + c);
    float xhat = (load(x + c) - mean) * rstd;
    store(dx + c, rstd * (g - mg - xhat * mgx));
  }
}

// acc_gamma += sum_r dy * xhat, acc_beta += sum_r dy over columns [c0, c0 + width).
template <typename TD, typename TX>
PORTER_CPU_CLONES void ln_param_grads(const TD* dy, const TX* x, const float* mean,
                                      const float* rstd, int64_t rows, int64_t cols, int64_t c0,
                                      int64_t width, float* acc_gamma, float* acc_beta) {
  for (int64_t r = 0; r < rows; ++r) {
    const TD* dyr = dy + r * cols + c0;
    const TX* xr = x + r * cols + c0;
    const float m = mean[r], rs = rstd[r];
#pragma omp simd
    for (int64_t j = 0; j < width; ++j) {
      float d = load(dyr + j);
      acc_gamma[j] += d * ((load(xr + j) - m) * rs);
      acc_beta[j] += d;
    }
  }
}

}  // namespace

void CpuKernels::do_layernorm_forward(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                      Tensor& y, Tensor& mean, Tensor& rstd, float eps) {
  const int64_t cols = x.dim(-1), rows = cpu::rows_of(x);
  float* mp = mean.data_as<float>();
  float* rp = rstd.data_as<float>();
  cpu::with_typed(
      [&](const auto* xp, const auto* gp, auto* yp) {
        // beta has gamma's dtype (Note [Kernel dtypes]).
        const auto* bp = static_cast<decltype(gp)>(beta.data());
        cpu::parallel_rows(threads_, rows, [&](int64_t r) {
          ln_fwd_row(xp + r * cols, gp, bp, yp + r * cols, cols, eps, mp + r, rp + r);
        });
      },
      x, gamma, y);
}

void CpuKernels::do_layernorm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma,
                                       const Tensor& mean, const Tensor& rstd, Tensor& dx,
                                       Tensor& dgamma, Tensor& dbeta) {
  const int64_t cols = x.dim(-1), rows = cpu::rows_of(x);
  const float* mp = mean.data_as<float>();
  const float* rp = rstd.data_as<float>();
  cpu::with_typed(
      [&](const auto* dyp, const auto* xp, const auto* gp, auto* dxp) {
        cpu::parallel_rows(threads_, rows, [&](int64_t r) {
          ln_bwd_row(dyp + r * cols, xp + r * cols, gp, mp[r], rp[r], dxp + r * cols, cols);
        });
      },
      dy, x, gamma, dx);
  cpu::with_typed(
      [&](const auto* dyp, const auto* xp, auto* dgp) {
        auto* dbp = static_cast<decltype(dgp)>(dbeta.data());  // dgamma's dtype
        const int64_t blocks = (cols + kColumnBlock - 1) / kColumnBlock;
#pragma omp parallel for num_threads(threads_) schedule(static)
        for (int64_t blk = 0; blk < blocks; ++blk) {
          const int64_t c0 = blk * kColumnBlock, width = std::min(kColumnBlock, cols - c0);
          float acc_gamma[kColumnBlock] = {}, acc_beta[kColumnBlock] = {};
          ln_param_grads(dyp, xp, mp, rp, rows, cols, c0, width, acc_gamma, acc_beta);
          for (int64_t j = 0; j < width; ++j) {
            store(dgp + c0 + j, load(dgp + c0 + j) + acc_gamma[j]);
            store(dbp + c0 + j, load(dbp + c0 + j) + acc_beta[j]);
          }
        }
      },
      dy, x, dgamma);
}

}  // namespace porter::kernels
