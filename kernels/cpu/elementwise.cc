// Elementwise cpu kernels: bias, GELU, dropout, add/accumulate, cast, fill, scale.
#include <cstdint>

#include "kernels/cpu/cpu_kernels.h"

namespace porter::kernels {
namespace {

using cpu::load;
using cpu::store;

constexpr float kGeluS = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluC = 0.044715f;

// Bias reductions work on column blocks of this width (Note [Cpu determinism]).
constexpr int64_t kColumnBlock = 64;

template <typename TX, typename TB>
PORTER_CPU_CLONES void bias_add_row(TX* x, const TB* bias, int64_t cols) {
#pragma omp simd
  for (int64_t c = 0; c < cols; ++c) store(x + c, load(x + c) + load(bias + c));
}

// acc[0, width) += column sums of dy rows [0, rows) at columns [c0, c0 + width).
template <typename T>
PORTER_CPU_CLONES void column_sums(const T* dy, int64_t rows, int64_t cols, int64_t c0,
                                   int64_t width, float* acc) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* row = dy + r * cols + c0;
#pragma omp simd
    for (int64_t j = 0; j < width; ++j) acc[j] += load(row + j);
  }
}

// 0.5 (1 + tanh(u)) = e / (e + 1) with e = exp(2u): the sigmoid form has no cancellation
// for negative x, where 1 + tanh(u) would lose the low bits (PyTorch's f32 has that loss;
// this stays within its rounding and is exact-er). 1 - tanh^2(u) = 4 s (1 - s).
template <typename TX, typename TY>
PORTER_CPU_CLONES void gelu_fwd(const TX* x, TY* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    float v = load(x + i);
    float e = cpu::fast_exp(2.0f * kGeluS * (v + kGeluC * v * v * v));
    store(y + i, v * (e / (e + 1.0f)));
  }
}

template <typename TX, typename TD, typename TO>
PORTER_CPU_CLONES void gelu_bwd(const TX* x, const TD* dy, TO* dx, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    float v = load(x + i);
    float e = cpu::fast_exp(2.0f * kGeluS * (v + kGeluC * v * v * v));
    float inv = 1.0f / (e + 1.0f);
    float s = e * inv;  // 0.5 (1 + tanh(u))
    float du = kGeluS * (1.0f + 3.0f * kGeluC * v * v);
    float grad = s + 2.0f * v * s * inv * du;
    store(dx + i, load(dy + i) * grad);
  }
}

// Philox groups per vectorised batch in dropout: 4 uniforms each.
constexpr int64_t kDropoutGroups = 256;

// The raw Philox outputs of local groups [g0, g0 + count): bits[4 j + l] is word l of group
// g0 + j, the word for local element 4 (g0 + j) + l. This is philox_uniform4 (tensor/philox.h),
// key.group_offset included, written on plain scalars so that GCC vectorises it one group per
// SIMD lane; the tests check it against philox.h bit for bit, which keeps cpu and cuda masks
// identical.
PORTER_CPU_CLONES void philox_batch(const PhiloxKey& key, uint64_t g0, int64_t count,
                                    uint32_t* bits) {
  const uint32_t key0 = static_cast<uint32_t>(key.seed);
  const uint32_t key1 = static_cast<uint32_t>(key.seed >> 32);
  const uint32_t s0 = key.stream[0], s1 = key.stream[1], s2 = key.stream[2];
#pragma omp simd
  for (int64_t j = 0; j < count; ++j) {
    const uint64_t g = g0 + key.group_offset + static_cast<uint64_t>(j);
    uint32_t c0 = static_cast<uint32_t>(g), c1 = s0 ^ static_cast<uint32_t>(g >> 32);
    uint32_t c2 = s1, c3 = s2, k0 = key0, k1 = key1;
    for (int round = 0; round < 10; ++round) {
      const uint64_t p0 = uint64_t{0xD2511F53u} * c0, p1 = uint64_t{0xCD9E8D57u} * c2;
      const uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
      const uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
      c0 = hi1 ^ c1 ^ k0;
      c1 = lo1;
      c2 = hi0 ^ c3 ^ k1;
      c3 = lo0;
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    bits[4 * j] = c0;
    bits[4 * j + 1] = c1;
    bits[4 * j + 2] = c2;
    bits[4 * j + 3] = c3;
  }
}

// y[i] = x[i] * keep(i) / (1 - p) for elements [begin, end); begin is a multiple of 4.
// keep(i) is philox_uniform(key, i) >= p (tensor/philox.h), computed kDropoutGroups at a time.
template <typename TX, typename TY>
PORTER_CPU_CLONES void dropout_apply(const TX* x, TY* y, const uint32_t* bits, int64_t n,
                                     float p, float keep_scale) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    // philox_uniform: the top 24 bits, scaled to [0, 1).
    const float u = static_cast<float>(bits[i] >> 8) * (1.0f / 16777216.0f);
    store(y + i, u >= p ? load(x + i) * keep_scale : 0.0f);
  }
}

template <typename TX, typename TY>
void dropout_range(const TX* x, TY* y, int64_t begin, int64_t end, float p, float keep_scale,
                   const PhiloxKey& key) {
  uint32_t bits[4 * kDropoutGroups];
  for (int64_t i0 = begin; i0 < end; i0 += 4 * kDropoutGroups) {
    const int64_t n = std::min(end - i0, 4 * kDropoutGroups);
    philox_batch(key, static_cast<uint64_t>(i0 / 4), (n + 3) / 4, bits);
    dropout_apply(x + i0, y + i0, bits, n, p, keep_scale);
  }
}

template <typename TA, typename TB, typename TO>
PORTER_CPU_CLONES void add_range(const TA* a, const TB* b, TO* out, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) store(out + i, load(a + i) + load(b + i));
}

template <typename TX, typename TY>
PORTER_CPU_CLONES void cast_range(const TX* x, TY* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) store(y + i, load(x + i));
}

template <typename T>
PORTER_CPU_CLONES void scale_range(T* x, float s, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) store(x + i, load(x + i) * s);
}

}  // namespace

void CpuKernels::do_bias_add(Tensor& x, const Tensor& bias) {
  const int64_t cols = x.dim(-1), rows = cpu::rows_of(x);
  cpu::with_typed(
      [&](auto* xp, auto* bp) {
        cpu::parallel_rows(threads_, rows, [&](int64_t r) { bias_add_row(xp + r * cols, bp, cols); });
      },
      x, bias);
}

void CpuKernels::do_bias_backward(const Tensor& dy, Tensor& dbias) {
  const int64_t cols = dy.dim(-1), rows = cpu::rows_of(dy);
  const int64_t blocks = (cols + kColumnBlock - 1) / kColumnBlock;
  cpu::with_typed(
      [&](auto* dyp, auto* dbp) {
#pragma omp parallel for num_threads(threads_) schedule(static)
        for (int64_t blk = 0; blk < blocks; ++blk) {
          const int64_t c0 = blk * kColumnBlock, width = std::min(kColumnBlock, cols - c0);
          float acc[kColumnBlock] = {};
          column_sums(dyp, rows, cols, c0, width, acc);
          for (int64_t j = 0; j < width; ++j) store(dbp + c0 + j, load(dbp + c0 + j) + acc[j]);
        }
      },
      dy, dbias);
}

void CpuKernels::do_gelu_forward(const Tensor& x, Tensor& y) {
  cpu::with_typed(
      [&](auto* xp, auto* yp) {
        cpu::parallel_blocks(threads_, x.numel(), [&](int64_t b, int64_t e) {
          gelu_fwd(xp + b, yp + b, e - b);
        });
      },
      x, y);
}

void CpuKernels::do_gelu_backward(const Tensor& x, const Tensor& dy, Tensor& dx) {
  cpu::with_typed(
      [&](auto* xp, auto* dyp, auto* dxp) {
        cpu::parallel_blocks(threads_, x.numel(), [&](int64_t b, int64_t e) {
          gelu_bwd(xp + b, dyp + b, dxp + b, e - b);
        });
      },
      x, dy, dx);
}

void CpuKernels::do_dropout_forward(const Tensor& x, Tensor& y, float p, const PhiloxKey& key) {
  // The mask is a pure function of (key, element) (Note [Dropout keys]); blocks are a
  // multiple of 4 elements, so each Philox group lies in one block.
  static_assert(cpu::kBlockElems % 4 == 0);
  const float keep_scale = 1.0f / (1.0f - p);
  cpu::with_typed(
      [&](auto* xp, auto* yp) {
        cpu::parallel_blocks(threads_, x.numel(), [&](int64_t b, int64_t e) {
          dropout_range(xp, yp, b, e, p, keep_scale, key);
        });
      },
      x, y);
}

void CpuKernels::do_dropout_backward(const Tensor& dy, Tensor& dx, float p, const PhiloxKey& key) {
  // dx = dy * mask / (1 - p): the same map as forward, with the regenerated mask.
  do_dropout_forward(dy, dx, p, key);
}

void CpuKernels::do_add(const Tensor& a, const Tensor& b, Tensor& out) {
  cpu::with_typed(
      [&](auto* ap, auto* bp, auto* op) {
        cpu::parallel_blocks(threads_, a.numel(), [&](int64_t s, int64_t e) {
          add_range(ap + s, bp + s, op + s, e - s);
        });
      },
      a, b, out);
}

void CpuKernels::do_accumulate(Tensor& acc, const Tensor& x) { do_add(acc, x, acc); }

void CpuKernels::do_cast(const Tensor& x, Tensor& y) {
  // Any pair of float dtypes, bf16 <-> f16 included (Note [Cpu dtype combinations]): the value
  // goes through f32, which holds both exactly, so bf16 -> f16 rounds once.
  cpu::dispatch_float(x.dtype(), [&](auto tx) {
    cpu::dispatch_float(y.dtype(), [&](auto ty) {
      const auto* xp = static_cast<const decltype(tx)*>(x.data());
      auto* yp = static_cast<decltype(ty)*>(y.data());
      cpu::parallel_blocks(threads_, x.numel(), [&](int64_t b, int64_t e) {
        cast_range(xp + b, yp + b, e - b);
      });
    });
  });
}

void cpu::widen_to_f32(int threads, const Tensor& x, float* dst) {
  cpu::dispatch_float(x.dtype(), [&](auto tx) {
    const auto* xp = static_cast<const decltype(tx)*>(x.data());
    cpu::parallel_blocks(threads, x.numel(), [&](int64_t b, int64_t e) {
      cast_range(xp + b, dst + b, e - b);
    });
  });
}

void cpu::narrow_from_f32(int threads, const float* src, Tensor& y) {
  cpu::dispatch_float(y.dtype(), [&](auto ty) {
    auto* yp = static_cast<decltype(ty)*>(y.data());
    cpu::parallel_blocks(threads, y.numel(), [&](int64_t b, int64_t e) {
      cast_range(src + b, yp + b, e - b);
    });
  });
}

void CpuKernels::do_fill(Tensor& x, float value) {
  cpu::with_typed(
      [&](auto* xp) {
        cpu::parallel_blocks(threads_, x.numel(), [&](int64_t b, int64_t e) {
          for (int64_t i = b; i < e; ++i) store(xp + i, value);
        });
      },
      x);
}

void CpuKernels::do_scale(Tensor& x, float s) {
  cpu::with_typed(
      [&](auto* xp) {
        cpu::parallel_blocks(threads_, x.numel(), [&](int64_t b, int64_t e) {
          scale_range(xp + b, s, e - b);
        });
      },
      x);
}

}  // namespace porter::kernels
