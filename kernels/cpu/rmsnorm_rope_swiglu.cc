// Llama's own cpu kernels: RMSNorm, the rotary qkv (Note [Rotary qkv] in kernels.cc) and
// SwiGLU. Row-wise loops as kernels/cpu/layernorm.cc; parameter gradients per column block, each summed
// by one thread in row order (Note [Cpu determinism]).
#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels/cpu/cpu_kernels.h"

namespace porter::kernels {
namespace {

using cpu::load;
using cpu::store;

constexpr int64_t kColumnBlock = 64;

template <typename TX, typename TP, typename TY>
PORTER_CPU_CLONES void rms_fwd_row(const TX* x, const TP* gamma, TY* y, int64_t cols, float eps,
                                   float* rstd_out) {
  float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
  for (int64_t c = 0; c < cols; ++c) {
    float v = load(x + c);
    ss += v * v;
  }
  const float rstd = 1.0f / std::sqrt(ss / static_cast<float>(cols) + eps);
#pragma omp simd
  for (int64_t c = 0; c < cols; ++c) store(y + c, load(x + c) * rstd * load(gamma + c));
  *rstd_out = rstd;
}

// dx = rstd * (g - xhat * mean(g * xhat)), g = dy * gamma, xhat = x * rstd.
template <typename TD, typename TX, typename TP, typename TO>
PORTER_CPU_CLONES void rms_bwd_row(const TD* dy, const TX* x, const TP* gamma, float rstd, TO* dx,
                                   int64_t cols) {
  float sgx = 0.0f;
#pragma omp simd reduction(+ : sgx)
  for (int64_t c = 0; c < cols; ++c) sgx += load(dy + c) * load(gamma + c) * (load(x + c) * rstd);
  const float mgx = sgx / static_cast<float>(cols);
#pragma omp simd
  for (int64_t c = 0; c < cols; ++c) {
    float g = load(dy + c) * load(gamma + c);
    float xhat = load(x + c) * rstd;
    store(dx + c, rstd * (g - xhat * mgx));
  }
}

// The cos and sin of every position t < seq for the D/2 frequencies (Note [Rotary qkv]):
// row t holds D/2 cosines, then D/2 sines. It is host memory of the call, like oneDNN's
// scratchpad (Note [Kernel workspace] in kernels.h): seq * D floats, 512 KiB at T = 2048 and
// D = 64, shared by every row and head of the batch.
std::vector<float> rope_table(int threads, int64_t seq, int64_t half, double theta) {
  std::vector<float> table(static_cast<size_t>(seq * 2 * half));
  std::vector<double> inv_freq(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i) {
    inv_freq[static_cast<size_t>(i)] =
        std::pow(theta, -static_cast<double>(2 * i) / static_cast<double>(2 * half));
  }
  cpu::parallel_rows(threads, seq, [&](int64_t t) {
    float* row = table.data() + t * 2 * half;
    for (int64_t i = 0; i < half; ++i) {
      const double a = static_cast<double>(t) * inv_freq[static_cast<size_t>(i)];
      row[i] = static_cast<float>(std::cos(a));
      row[half + i] = static_cast<float>(std::sin(a));
    }
  });
  return table;
}

// out = rope(x) over one head of D = 2 * half channels; sign +1 rotates by the angle, -1 back.
template <typename TI, typename TO>
PORTER_CPU_CLONES void rotate_head(const TI* x, TO* out, const float* cs, const float* sn,
                                   int64_t half, float sign) {
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float a = load(x + i), b = load(x + half + i), s = sign * sn[i];
    store(out + i, a * cs[i] - b * s);
    store(out + half + i, b * cs[i] + a * s);
  }
}

template <typename TI, typename TO>
PORTER_CPU_CLONES void copy_head(const TI* x, TO* out, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) store(out + i, load(x + i));
}

// One row's dk (or dv) head: the sum over the group's query heads of dqkv's part, in order.
template <typename TI>
PORTER_CPU_CLONES void sum_group(const TI* part, int64_t d, int64_t group, float* acc) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) acc[i] = load(part + i);
  for (int64_t j = 1; j < group; ++j) {
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) acc[i] += load(part + j * d + i);
  }
}

template <typename TG, typename TU, typename TY>
PORTER_CPU_CLONES void swiglu_fwd(const TG* g, const TU* u, TY* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float v = load(g + i);
    const float s = 1.0f / (1.0f + cpu::fast_exp(-v));
    store(y + i, v * s * load(u + i));
  }
}

// d silu(g) / dg = s (1 + g (1 - s)), s = sigmoid(g).
template <typename TG, typename TU, typename TD, typename TO>
PORTER_CPU_CLONES void swiglu_bwd(const TG* g, const TU* u, const TD* dy, TO* dg, TO* du,
                                  int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float v = load(g + i), d = load(dy + i);
    const float s = 1.0f / (1.0f + cpu::fast_exp(-v));
    store(dg + i, d * load(u + i) * (s * (1.0f + v * (1.0f - s))));
    store(du + i, d * v * s);
  }
}

// group: the query heads of one key/value head in qkv's layout (Note [Rotary qkv]): H / Hkv
// when k and v are expanded, 1 when they are packed. width: qkv's row, the v part's offset:
// voff.
struct RopeDims {
  int64_t b, t, heads, kv, d, half, group, width, voff;
};

// q (or dq): (B, T, H D), which gives D.
RopeDims rope_dims(const Tensor& qkv, const Tensor& q, int heads, int kv_heads) {
  RopeDims r{qkv.dim(0), qkv.dim(1), heads, kv_heads, q.dim(2) / heads, 0, 0, qkv.dim(2), 0};
  r.half = r.d / 2;
  const bool expanded = qkv.dim(2) == 3 * heads * r.d;
  r.group = expanded ? r.heads / r.kv : 1;
  r.voff = (r.heads + r.group * r.kv) * r.d;
  return r;
}

}  // namespace

void CpuKernels::do_rmsnorm_forward(const Tensor& x, const Tensor& gamma, Tensor& y, Tensor& rstd,
                                    float eps) {
  const int64_t cols = x.dim(-1), rows = cpu::rows_of(x);
  float* rp = rstd.data_as<float>();
  cpu::with_typed(
      [&](const auto* xp, const auto* gp, auto* yp) {
        cpu::parallel_rows(threads_, rows, [&](int64_t r) {
          rms_fwd_row(xp + r * cols, gp, yp + r * cols, cols, eps, rp + r);
        });
      },
      x, gamma, y);
}

void CpuKernels::do_rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma,
                                     const Tensor& rstd, Tensor& dx, Tensor& dgamma) {
  const int64_t cols = x.dim(-1), rows = cpu::rows_of(x);
  const float* rp = rstd.data_as<float>();
  cpu::with_typed(
      [&](const auto* dyp, const auto* xp, const auto* gp, auto* dxp) {
        cpu::parallel_rows(threads_, rows, [&](int64_t r) {
          rms_bwd_row(dyp + r * cols, xp + r * cols, gp, rp[r], dxp + r * cols, cols);
        });
      },
      dy, x, gamma, dx);
  cpu::with_typed(
      [&](const auto* dyp, const auto* xp, auto* dgp) {
        const int64_t blocks = (cols + kColumnBlock - 1) / kColumnBlock;
#pragma omp parallel for num_threads(threads_) schedule(static)
        for (int64_t blk = 0; blk < blocks; ++blk) {
          const int64_t c0 = blk * kColumnBlock, width = std::min(kColumnBlock, cols - c0);
          float acc[kColumnBlock] = {};
          for (int64_t r = 0; r < rows; ++r) {
            const auto* dyr = dyp + r * cols + c0;
            const auto* xr = xp + r * cols + c0;
            const float rs = rp[r];
#pragma omp simd
            for (int64_t j = 0; j < width; ++j) acc[j] += load(dyr + j) * (load(xr + j) * rs);
          }
          for (int64_t j = 0; j < width; ++j) store(dgp + c0 + j, load(dgp + c0 + j) + acc[j]);
        }
      },
      dy, x, dgamma);
}

void CpuKernels::do_rope_qkv_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                     Tensor& qkv, int heads, int kv_heads, double theta) {
  const RopeDims r = rope_dims(qkv, q, heads, kv_heads);
  const int64_t c = r.heads * r.d, ckv = r.kv * r.d;
  const std::vector<float> table = rope_table(threads_, r.t, r.half, theta);
  cpu::with_typed(
      [&](const auto* qp, const auto* kp, const auto* vp, auto* op) {
        cpu::parallel_rows(threads_, r.b * r.t, [&](int64_t row) {
          const float* cs = table.data() + (row % r.t) * 2 * r.half;
          const float* sn = cs + r.half;
          auto* o = op + row * r.width;
          for (int64_t h = 0; h < r.heads; ++h) {
            rotate_head(qp + row * c + h * r.d, o + h * r.d, cs, sn, r.half, 1.0f);
          }
          for (int64_t g = 0; g < r.kv; ++g) {
            // The group's first query head gets the rotated head; the others copy it.
            auto* k0 = o + c + g * r.group * r.d;
            auto* v0 = o + r.voff + g * r.group * r.d;
            rotate_head(kp + row * ckv + g * r.d, k0, cs, sn, r.half, 1.0f);
            copy_head(vp + row * ckv + g * r.d, v0, r.d);
            for (int64_t j = 1; j < r.group; ++j) {
              copy_head(k0, k0 + j * r.d, r.d);
              copy_head(v0, v0 + j * r.d, r.d);
            }
          }
        });
      },
      q, k, v, qkv);
}

void CpuKernels::do_rope_qkv_backward(const Tensor& dqkv, Tensor& dq, Tensor& dk, Tensor& dv,
                                      int heads, int kv_heads, double theta) {
  const RopeDims r = rope_dims(dqkv, dq, heads, kv_heads);
  const int64_t c = r.heads * r.d, ckv = r.kv * r.d;
  const std::vector<float> table = rope_table(threads_, r.t, r.half, theta);
  // Per row, the group sum of one k or v head before it is rotated back (host, D floats).
  std::vector<float> sums(static_cast<size_t>(r.b * r.t * r.d));
  cpu::with_typed(
      [&](const auto* gp, auto* dqp, auto* dkp, auto* dvp) {
        cpu::parallel_rows(threads_, r.b * r.t, [&](int64_t row) {
          const float* cs = table.data() + (row % r.t) * 2 * r.half;
          const float* sn = cs + r.half;
          float* acc = sums.data() + row * r.d;
          const auto* g = gp + row * r.width;
          for (int64_t h = 0; h < r.heads; ++h) {
            rotate_head(g + h * r.d, dqp + row * c + h * r.d, cs, sn, r.half, -1.0f);
          }
          for (int64_t kvh = 0; kvh < r.kv; ++kvh) {
            sum_group(g + c + kvh * r.group * r.d, r.d, r.group, acc);
            rotate_head(acc, dkp + row * ckv + kvh * r.d, cs, sn, r.half, -1.0f);
            sum_group(g + r.voff + kvh * r.group * r.d, r.d, r.group, acc);
            copy_head(acc, dvp + row * ckv + kvh * r.d, r.d);
          }
        });
      },
      dqkv, dq, dk, dv);
}

void CpuKernels::do_swiglu_forward(const Tensor& gate, const Tensor& up, Tensor& y) {
  cpu::with_typed(
      [&](const auto* gp, const auto* up_, auto* yp) {
        cpu::parallel_blocks(threads_, gate.numel(), [&](int64_t b, int64_t e) {
          swiglu_fwd(gp + b, up_ + b, yp + b, e - b);
        });
      },
      gate, up, y);
}

void CpuKernels::do_swiglu_backward(const Tensor& gate, const Tensor& up, const Tensor& dy,
                                    Tensor& dgate, Tensor& dup) {
  PORTER_CHECK(dgate.dtype() == dup.dtype(), "swiglu_backward: dgate ",
               dtype_name(dgate.dtype()), " and dup ", dtype_name(dup.dtype()),
               " must share a dtype");
  cpu::with_typed(
      [&](const auto* gp, const auto* up_, const auto* dyp, auto* dgp) {
        auto* dup_ = static_cast<decltype(dgp)>(dup.data());
        cpu::parallel_blocks(threads_, gate.numel(), [&](int64_t b, int64_t e) {
          swiglu_bwd(gp + b, up_ + b, dyp + b, dgp + b, dup_ + b, e - b);
        });
      },
      gate, up, dy, dgate);
}

}  // namespace porter::kernels
