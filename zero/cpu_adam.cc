// CpuAdam (zero/cpu_adam.h): the scalar, AVX2 and AVX-512 AdamW kernels, the choice among them
// (Note [Cpu ISA dispatch] in kernels/cpu/isa.h), and the thread pool that runs them over
// tiles. Compiled with -ffp-contract=off (zero/CMakeLists.txt): Note [CpuAdam bit identity].
#include "zero/cpu_adam.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <thread>

#include "base/check.h"
#include "kernels/cpu/isa.h"

namespace porter::zero {
namespace {

using tensor::DType;

using RangeFn = void (*)(const CpuAdamArrays&, const AdamWConstants&, int64_t, int64_t);

bool is_float(DType t) { return t == DType::kF32 || t == DType::kBF16 || t == DType::kF16; }

// ---- scalar: the reference formula, one element at a time --------------------------------

template <DType G>
inline float load_grad(const void* g, int64_t i) {
  if constexpr (G == DType::kF32) {
    return static_cast<const float*>(g)[i];
  } else if constexpr (G == DType::kBF16) {
    return tensor::bf16_to_f32(static_cast<const uint16_t*>(g)[i]);
  } else {
    return tensor::f16_to_f32(static_cast<const uint16_t*>(g)[i]);
  }
}

template <DType O>
inline void store_out(void* out, int64_t i, float x) {
  if constexpr (O == DType::kF32) {
    static_cast<float*>(out)[i] = x;
  } else if constexpr (O == DType::kBF16) {
    static_cast<uint16_t*>(out)[i] = tensor::f32_to_bf16(x);
  } else {
    static_cast<uint16_t*>(out)[i] = tensor::f32_to_f16(x);
  }
}

// The update of Note [CpuAdam bit identity], as kernels/cpu/adamw.cc writes it.
template <DType G, DType O, bool kOut>
void adamw_scalar(const CpuAdamArrays& a, const AdamWConstants& k, int64_t begin, int64_t end) {
  float* p = a.params;
  float* m = a.exp_avg;
  float* v = a.exp_avg_sq;
  for (int64_t i = begin; i < end; ++i) {
    const float grad = load_grad<G>(a.grad, i) * k.grad_scale;
    float param = p[i] * k.decay;
    const float mi = m[i] * k.beta1 + k.one_minus_beta1 * grad;
    const float vi = v[i] * k.beta2 + k.one_minus_beta2 * grad * grad;
    const float denom = std::sqrt(vi) / k.bc2_sqrt + k.eps;
    param = param - k.step_size * (mi / denom);
    m[i] = mi;
    v[i] = vi;
    p[i] = param;
    if constexpr (kOut) store_out<O>(a.out, i, param);
  }
}

#if PORTER_CPU_X86

// Whether the working copy at element `i` sits on a `bytes` boundary (a whole vector's
// store). Every vector of a range is then aligned, as ranges step by whole vectors.
inline bool out_aligned(const CpuAdamArrays& a, int64_t i, size_t bytes) {
  const auto addr =
      reinterpret_cast<uintptr_t>(a.out) + static_cast<uintptr_t>(i) * tensor::dtype_size(a.out_dtype);
  return addr % bytes == 0;
}

// ---- AVX-512: 16 lanes; the tail is one masked vector ------------------------------------

// g[i, i + 16) under mask `k`, widened to f32 as tensor::bf16_to_f32 / tensor::f16_to_f32 do.
template <DType G>
PORTER_CPU_TARGET(PORTER_ISA_AVX512)
inline __m512 load_grad16(const void* g, int64_t i, __mmask16 k) {
  if constexpr (G == DType::kF32) {
    return _mm512_maskz_loadu_ps(k, static_cast<const float*>(g) + i);
  } else {
    const __m512i h16 =
        _mm512_maskz_loadu_epi16(static_cast<__mmask32>(k), static_cast<const uint16_t*>(g) + i);
    const __m512i w = _mm512_cvtepu16_epi32(_mm512_castsi512_si256(h16));
    if constexpr (G == DType::kBF16) {
      return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
    } else {
      // f16: the bits in an f32's place read 2^112 too small; one exact multiply rescales
      // them (subnormals included); exponent 31 (inf, NaN) is set directly; then the sign.
      const __m512i em = _mm512_and_si512(w, _mm512_set1_epi32(0x7fff));
      const __m512i shifted = _mm512_slli_epi32(em, 13);
      __m512i u = _mm512_castps_si512(
          _mm512_mul_ps(_mm512_castsi512_ps(shifted), _mm512_set1_ps(0x1p112f)));
      const __mmask16 special = _mm512_cmpge_epu32_mask(em, _mm512_set1_epi32(0x7c00));
      u = _mm512_mask_mov_epi32(u, special,
                                _mm512_or_si512(shifted, _mm512_set1_epi32(0x7f800000)));
      const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(w, _mm512_set1_epi32(0x8000)), 16);
      return _mm512_castsi512_ps(_mm512_or_si512(u, sign));
    }
  }
}

// tensor::f32_to_bf16 per lane, in the low 16 bits of each 32-bit lane.
PORTER_CPU_TARGET(PORTER_ISA_AVX512) inline __m512i to_bf16_16(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i hi = _mm512_srli_epi32(u, 16);
  const __m512i bias =
      _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(hi, _mm512_set1_epi32(1)));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
  const __m512i abs = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(abs, _mm512_set1_epi32(0x7f800000));
  return _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(hi, _mm512_set1_epi32(0x40)));
}

// tensor::f32_to_f16 per lane (Note [f16 conversion]): all three cases, then a select.
PORTER_CPU_TARGET(PORTER_ISA_AVX512) inline __m512i to_f16_16(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x8000));
  const __m512i a = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
  const __m512i a13 = _mm512_srli_epi32(a, 13);
  // Normal: rebias, add just under half an ulp plus the parity, truncate.
  const __m512i odd = _mm512_and_si512(a13, _mm512_set1_epi32(1));
  __m512i h = _mm512_srli_epi32(_mm512_add_epi32(_mm512_sub_epi32(a, _mm512_set1_epi32(0x38000000)),
                                                 _mm512_add_epi32(_mm512_set1_epi32(0xfff), odd)),
                                13);
  // Subnormal or zero: one f32 addition of 0.5 rounds on the 2^-24 grid.
  const __m512i sub = _mm512_sub_epi32(
      _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(a), _mm512_set1_ps(0.5f))),
      _mm512_set1_epi32(0x3f000000));
  h = _mm512_mask_mov_epi32(h, _mm512_cmplt_epu32_mask(a, _mm512_set1_epi32(0x38800000)), sub);
  // |x| >= 65536, inf or NaN.
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(a, _mm512_set1_epi32(0x7f800000));
  const __m512i big = _mm512_mask_mov_epi32(
      _mm512_set1_epi32(0x7c00), nan,
      _mm512_or_si512(_mm512_set1_epi32(0x7e00), _mm512_and_si512(a13, _mm512_set1_epi32(0x3ff))));
  h = _mm512_mask_mov_epi32(h, _mm512_cmpge_epu32_mask(a, _mm512_set1_epi32(0x47800000)), big);
  return _mm512_or_si512(h, sign);
}

// The working copy of [i, i + 16) under mask `k`; kStream: all 16 lanes, with a
// non-temporal store to an aligned address (Note [CpuAdam working copy stores]).
template <DType O, bool kStream>
PORTER_CPU_TARGET(PORTER_ISA_AVX512)
inline void store_out16(void* out, int64_t i, __m512 x, __mmask16 k) {
  if constexpr (O == DType::kF32) {
    if constexpr (kStream) {
      _mm512_stream_ps(static_cast<float*>(out) + i, x);
    } else {
      _mm512_mask_storeu_ps(static_cast<float*>(out) + i, k, x);
    }
  } else {
    const __m512i h = O == DType::kBF16 ? to_bf16_16(x) : to_f16_16(x);
    if constexpr (kStream) {
      _mm256_stream_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out) + i),
                          _mm512_cvtepi32_epi16(h));
    } else {
      _mm512_mask_cvtepi32_storeu_epi16(static_cast<uint16_t*>(out) + i, k, h);
    }
  }
}

struct Consts512 {
  __m512 grad_scale, decay, beta1, one_minus_beta1, beta2, one_minus_beta2, bc2_sqrt, eps,
      step_size;
};

// Elements [i, i + 16) under mask `mk`, in the reference's order of operations.
template <DType G, DType O, bool kOut, bool kStream>
PORTER_CPU_TARGET(PORTER_ISA_AVX512)
inline void adamw16(const CpuAdamArrays& a, const Consts512& c, int64_t i, __mmask16 mk) {
  const __m512 grad = _mm512_mul_ps(load_grad16<G>(a.grad, i, mk), c.grad_scale);
  __m512 param = _mm512_mul_ps(_mm512_maskz_loadu_ps(mk, a.params + i), c.decay);
  const __m512 mi = _mm512_add_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(mk, a.exp_avg + i), c.beta1),
                                  _mm512_mul_ps(c.one_minus_beta1, grad));
  const __m512 vi =
      _mm512_add_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(mk, a.exp_avg_sq + i), c.beta2),
                    _mm512_mul_ps(_mm512_mul_ps(c.one_minus_beta2, grad), grad));
  const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(vi), c.bc2_sqrt), c.eps);
  param = _mm512_sub_ps(param, _mm512_mul_ps(c.step_size, _mm512_div_ps(mi, denom)));
  _mm512_mask_storeu_ps(a.exp_avg + i, mk, mi);
  _mm512_mask_storeu_ps(a.exp_avg_sq + i, mk, vi);
  _mm512_mask_storeu_ps(a.params + i, mk, param);
  if constexpr (kOut) store_out16<O, kStream>(a.out, i, param, mk);
}

template <DType G, DType O, bool kOut>
PORTER_CPU_TARGET(PORTER_ISA_AVX512)
void adamw_avx512(const CpuAdamArrays& a, const AdamWConstants& k, int64_t begin, int64_t end) {
  const Consts512 c{
      _mm512_set1_ps(k.grad_scale),      _mm512_set1_ps(k.decay), _mm512_set1_ps(k.beta1),
      _mm512_set1_ps(k.one_minus_beta1), _mm512_set1_ps(k.beta2), _mm512_set1_ps(k.one_minus_beta2),
      _mm512_set1_ps(k.bc2_sqrt),        _mm512_set1_ps(k.eps),   _mm512_set1_ps(k.step_size)};
  constexpr auto kAll = static_cast<__mmask16>(0xffff);
  int64_t i = begin;
  if (kOut && out_aligned(a, begin, 16 * tensor::dtype_size(O))) {
    for (; i + 16 <= end; i += 16) adamw16<G, O, kOut, true>(a, c, i, kAll);
    _mm_sfence();  // order the streamed stores before the pool's hand-back
  } else {
    for (; i + 16 <= end; i += 16) adamw16<G, O, kOut, false>(a, c, i, kAll);
  }
  if (i < end) {
    const auto tail = static_cast<__mmask16>((1u << (end - i)) - 1u);
    adamw16<G, O, kOut, false>(a, c, i, tail);
  }
}

// ---- AVX2: 8 lanes; the tail (< 8 elements) runs the scalar code -------------------------

template <DType G>
PORTER_CPU_TARGET(PORTER_ISA_AVX2)
inline __m256 load_grad8(const void* g, int64_t i) {
  if constexpr (G == DType::kF32) {
    return _mm256_loadu_ps(static_cast<const float*>(g) + i);
  } else {
    const __m256i w = _mm256_cvtepu16_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(g) + i)));
    if constexpr (G == DType::kBF16) {
      return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
    } else {
      // As load_grad16: rescale by 2^112, set inf / NaN directly, then the sign.
      const __m256i em = _mm256_and_si256(w, _mm256_set1_epi32(0x7fff));
      const __m256i shifted = _mm256_slli_epi32(em, 13);
      const __m256i scaled = _mm256_castps_si256(
          _mm256_mul_ps(_mm256_castsi256_ps(shifted), _mm256_set1_ps(0x1p112f)));
      // em <= 0x7fff, so the signed compare is the unsigned one.
      const __m256i special = _mm256_cmpgt_epi32(em, _mm256_set1_epi32(0x7bff));
      const __m256i u = _mm256_blendv_epi8(
          scaled, _mm256_or_si256(shifted, _mm256_set1_epi32(0x7f800000)), special);
      const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(w, _mm256_set1_epi32(0x8000)), 16);
      return _mm256_castsi256_ps(_mm256_or_si256(u, sign));
    }
  }
}

// As to_bf16_16. |x|'s bits are <= 0x7fffffff, so signed compares are the unsigned ones.
PORTER_CPU_TARGET(PORTER_ISA_AVX2) inline __m256i to_bf16_8(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i hi = _mm256_srli_epi32(u, 16);
  const __m256i bias =
      _mm256_add_epi32(_mm256_set1_epi32(0x7fff), _mm256_and_si256(hi, _mm256_set1_epi32(1)));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
  const __m256i abs = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
  const __m256i nan = _mm256_cmpgt_epi32(abs, _mm256_set1_epi32(0x7f800000));
  return _mm256_blendv_epi8(rounded, _mm256_or_si256(hi, _mm256_set1_epi32(0x40)), nan);
}

// As to_f16_16.
PORTER_CPU_TARGET(PORTER_ISA_AVX2) inline __m256i to_f16_8(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x8000));
  const __m256i a = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
  const __m256i a13 = _mm256_srli_epi32(a, 13);
  const __m256i odd = _mm256_and_si256(a13, _mm256_set1_epi32(1));
  __m256i h = _mm256_srli_epi32(_mm256_add_epi32(_mm256_sub_epi32(a, _mm256_set1_epi32(0x38000000)),
                                                 _mm256_add_epi32(_mm256_set1_epi32(0xfff), odd)),
                                13);
  const __m256i sub = _mm256_sub_epi32(
      _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(a), _mm256_set1_ps(0.5f))),
      _mm256_set1_epi32(0x3f000000));
  h = _mm256_blendv_epi8(h, sub, _mm256_cmpgt_epi32(_mm256_set1_epi32(0x38800000), a));
  const __m256i nan = _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7f800000));
  const __m256i big = _mm256_blendv_epi8(
      _mm256_set1_epi32(0x7c00),
      _mm256_or_si256(_mm256_set1_epi32(0x7e00), _mm256_and_si256(a13, _mm256_set1_epi32(0x3ff))),
      nan);
  h = _mm256_blendv_epi8(h, big, _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x477fffff)));
  return _mm256_or_si256(h, sign);
}

// The working copy of [i, i + 8); kStream: a non-temporal store to an aligned address.
template <DType O, bool kStream>
PORTER_CPU_TARGET(PORTER_ISA_AVX2)
inline void store_out8(void* out, int64_t i, __m256 x) {
  if constexpr (O == DType::kF32) {
    if constexpr (kStream) {
      _mm256_stream_ps(static_cast<float*>(out) + i, x);
    } else {
      _mm256_storeu_ps(static_cast<float*>(out) + i, x);
    }
  } else {
    const __m256i h = O == DType::kBF16 ? to_bf16_8(x) : to_f16_8(x);
    // Lanes hold <= 0xffff, so the saturating pack is exact; it packs within 128-bit
    // halves, and the permute brings the two halves' results together.
    const __m128i packed =
        _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(h, h), 0x08));
    auto* dst = reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + i);
    if constexpr (kStream) {
      _mm_stream_si128(dst, packed);
    } else {
      _mm_storeu_si128(dst, packed);
    }
  }
}

struct Consts256 {
  __m256 grad_scale, decay, beta1, one_minus_beta1, beta2, one_minus_beta2, bc2_sqrt, eps,
      step_size;
};

// Elements [i, i + 8), in the reference's order of operations.
template <DType G, DType O, bool kOut, bool kStream>
PORTER_CPU_TARGET(PORTER_ISA_AVX2)
inline void adamw8(const CpuAdamArrays& a, const Consts256& c, int64_t i) {
  const __m256 grad = _mm256_mul_ps(load_grad8<G>(a.grad, i), c.grad_scale);
  __m256 param = _mm256_mul_ps(_mm256_loadu_ps(a.params + i), c.decay);
  const __m256 mi = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(a.exp_avg + i), c.beta1),
                                  _mm256_mul_ps(c.one_minus_beta1, grad));
  const __m256 vi = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(a.exp_avg_sq + i), c.beta2),
                                  _mm256_mul_ps(_mm256_mul_ps(c.one_minus_beta2, grad), grad));
  const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(vi), c.bc2_sqrt), c.eps);
  param = _mm256_sub_ps(param, _mm256_mul_ps(c.step_size, _mm256_div_ps(mi, denom)));
  _mm256_storeu_ps(a.exp_avg + i, mi);
  _mm256_storeu_ps(a.exp_avg_sq + i, vi);
  _mm256_storeu_ps(a.params + i, param);
  if constexpr (kOut) store_out8<O, kStream>(a.out, i, param);
}

template <DType G, DType O, bool kOut>
PORTER_CPU_TARGET(PORTER_ISA_AVX2)
void adamw_avx2(const CpuAdamArrays& a, const AdamWConstants& k, int64_t begin, int64_t end) {
  const Consts256 c{
      _mm256_set1_ps(k.grad_scale),      _mm256_set1_ps(k.decay), _mm256_set1_ps(k.beta1),
      _mm256_set1_ps(k.one_minus_beta1), _mm256_set1_ps(k.beta2), _mm256_set1_ps(k.one_minus_beta2),
      _mm256_set1_ps(k.bc2_sqrt),        _mm256_set1_ps(k.eps),   _mm256_set1_ps(k.step_size)};
  int64_t i = begin;
  if (kOut && out_aligned(a, begin, 8 * tensor::dtype_size(O))) {
    for (; i + 8 <= end; i += 8) adamw8<G, O, kOut, true>(a, c, i);
    _mm_sfence();  // order the streamed stores before the pool's hand-back
  } else {
    for (; i + 8 <= end; i += 8) adamw8<G, O, kOut, false>(a, c, i);
  }
  adamw_scalar<G, O, kOut>(a, k, i, end);
}

#endif  // PORTER_CPU_X86

template <DType G, DType O, bool kOut>
RangeFn kernel_for(CpuIsa isa) {
  switch (isa) {
#if PORTER_CPU_X86
    case CpuIsa::kAvx512: return &adamw_avx512<G, O, kOut>;
    case CpuIsa::kAvx2: return &adamw_avx2<G, O, kOut>;
#endif
    case CpuIsa::kScalar: return &adamw_scalar<G, O, kOut>;
    default: break;
  }
  PORTER_ASSERT(false, "CpuAdam: no ", cpu_isa_name(isa), " kernel in this build");
  return nullptr;
}

template <DType G>
RangeFn kernel_for(CpuIsa isa, bool has_out, DType out) {
  if (!has_out) return kernel_for<G, DType::kF32, false>(isa);
  switch (out) {
    case DType::kBF16: return kernel_for<G, DType::kBF16, true>(isa);
    case DType::kF16: return kernel_for<G, DType::kF16, true>(isa);
    default: return kernel_for<G, DType::kF32, true>(isa);
  }
}

// The kernel for the arrays' dtypes on `isa`; the dtypes are already checked.
RangeFn kernel_for(CpuIsa isa, const CpuAdamArrays& a) {
  const bool has_out = a.out != nullptr;
  switch (a.grad_dtype) {
    case DType::kBF16: return kernel_for<DType::kBF16>(isa, has_out, a.out_dtype);
    case DType::kF16: return kernel_for<DType::kF16>(isa, has_out, a.out_dtype);
    default: return kernel_for<DType::kF32>(isa, has_out, a.out_dtype);
  }
}

bool cpu_runs(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kAvx512: return kernels::cpu::cpu_runs(PORTER_ISA_AVX512);
    case CpuIsa::kAvx2: return kernels::cpu::cpu_runs(PORTER_ISA_AVX2);
    case CpuIsa::kScalar: return true;
  }
  return false;
}

struct ByteRange {
  const char* name;
  uintptr_t begin, end;
};

void check_arrays(const CpuAdamArrays& a) {
  const char* op = "CpuAdam::update";
  PORTER_CHECK_GE(a.elems, 0, op, ": elems must not be negative");
  PORTER_CHECK(is_float(a.grad_dtype), op, ": grad_dtype ", tensor::dtype_name(a.grad_dtype),
               ": gradients are f32, bf16 or f16");
  PORTER_CHECK(a.out == nullptr || is_float(a.out_dtype), op, ": out_dtype ",
               tensor::dtype_name(a.out_dtype), ": the working copy is f32, bf16 or f16");
  if (a.elems == 0) return;
  const void* required[] = {a.params, a.exp_avg, a.exp_avg_sq, a.grad};
  const char* names[] = {"params", "exp_avg", "exp_avg_sq", "grad"};
  for (int j = 0; j < 4; ++j) {
    PORTER_CHECK(required[j] != nullptr, op, ": ", names[j], " is null for ", a.elems,
                 " elements; only out may be null");
  }
  const auto range = [&](const char* name, const void* p, DType t) {
    const auto b = reinterpret_cast<uintptr_t>(p);
    return ByteRange{name, b, b + static_cast<uintptr_t>(a.elems) * tensor::dtype_size(t)};
  };
  std::vector<ByteRange> ranges = {
      range("params", a.params, DType::kF32), range("exp_avg", a.exp_avg, DType::kF32),
      range("exp_avg_sq", a.exp_avg_sq, DType::kF32), range("grad", a.grad, a.grad_dtype)};
  if (a.out != nullptr) ranges.push_back(range("out", a.out, a.out_dtype));
  for (size_t x = 0; x < ranges.size(); ++x) {
    for (size_t y = x + 1; y < ranges.size(); ++y) {
      const bool disjoint = ranges[x].end <= ranges[y].begin || ranges[y].end <= ranges[x].begin;
      PORTER_CHECK(disjoint, op, ": ", ranges[x].name, " and ", ranges[y].name, " overlap (",
                   a.elems, " elements each); every array must be its own memory");
    }
  }
}

void check_args(const kernels::AdamWArgs& args) {
  const char* op = "CpuAdam::update";
  PORTER_CHECK(args.step >= 1, op, ": step ", args.step, " must be >= 1 (bias correction)");
  PORTER_CHECK(args.lr >= 0.0f && args.eps > 0.0f && args.beta1 >= 0.0f && args.beta1 < 1.0f &&
                   args.beta2 >= 0.0f && args.beta2 < 1.0f,
               op, ": lr ", args.lr, ", eps ", args.eps, ", beta1 ", args.beta1, ", beta2 ",
               args.beta2, ": need lr >= 0, eps > 0 and betas in [0, 1)");
}

}  // namespace

std::string_view cpu_isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kScalar: return "scalar";
    case CpuIsa::kAvx2: return "avx2";
    case CpuIsa::kAvx512: return "avx512";
  }
  return "?";
}

CpuIsa best_cpu_isa() {
  if (cpu_runs(CpuIsa::kAvx512)) return CpuIsa::kAvx512;
  if (cpu_runs(CpuIsa::kAvx2)) return CpuIsa::kAvx2;
  return CpuIsa::kScalar;
}

std::vector<CpuIsa> supported_cpu_isas() {
  std::vector<CpuIsa> isas;
  for (CpuIsa isa : {CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    if (cpu_runs(isa)) isas.push_back(isa);
  }
  return isas;
}

int64_t cpu_adam_bytes(const CpuAdamArrays& a) {
  const auto grad = static_cast<int64_t>(tensor::dtype_size(a.grad_dtype));
  const int64_t out = a.out != nullptr ? static_cast<int64_t>(tensor::dtype_size(a.out_dtype)) : 0;
  return a.elems * (grad + 3 * 4 + 3 * 4 + out);
}

void cpu_adamw_range(CpuIsa isa, const CpuAdamArrays& a, const AdamWConstants& k, int64_t begin,
                     int64_t end) {
  PORTER_CHECK(cpu_runs(isa), "cpu_adamw_range: this CPU does not run ", cpu_isa_name(isa),
               "; the best it runs is ", cpu_isa_name(best_cpu_isa()));
  if (begin < end) kernel_for(isa, a)(a, k, begin, end);
}

// Note [CpuAdam pool]
// The workers sleep on wake_ between updates. run() publishes the job and bumps generation_
// under mu_, runs the job on the calling thread too, then waits until every worker has
// finished it (running_ back to 0). So each worker runs each job exactly once, and every
// array write of a job happens before run() returns (the workers' last mu_ release is
// ordered before the caller's acquire), which is what makes the results visible to the
// caller without further fences.
class CpuAdam::Pool {
 public:
  explicit Pool(int workers) {
    threads_.reserve(static_cast<size_t>(workers));
    try {
      for (int w = 0; w < workers; ++w) threads_.emplace_back([this] { loop(); });
    } catch (...) {
      stop_and_join();
      throw;
    }
  }
  ~Pool() { stop_and_join(); }
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  // Runs job() on every worker and on the caller; returns when all of them have returned.
  void run(const std::function<void()>& job) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      job_ = &job;
      running_ = static_cast<int>(threads_.size());
      ++generation_;
    }
    wake_.notify_all();
    job();
    std::unique_lock<std::mutex> lock(mu_);
    done_.wait(lock, [&] { return running_ == 0; });
    job_ = nullptr;
  }

 private:
  void loop() {
    uint64_t seen = 0;
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      const std::function<void()>* job = job_;
      lock.unlock();
      (*job)();
      lock.lock();
      if (--running_ == 0) done_.notify_one();
    }
  }

  void stop_and_join() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    wake_.notify_all();
    for (std::thread& t : threads_) {
      if (t.joinable()) t.join();
    }
  }

  std::mutex mu_;
  std::condition_variable wake_;                // workers wait here for a new generation_ or stop_
  std::condition_variable done_;                // run() waits here for running_ == 0
  const std::function<void()>* job_ = nullptr;  // guarded by mu_; run()'s argument, not owned
  uint64_t generation_ = 0;                     // guarded by mu_; one per run()
  int running_ = 0;                             // guarded by mu_; workers still in the job
  bool stop_ = false;                           // guarded by mu_
  std::vector<std::thread> threads_;            // joined by stop_and_join()
};

CpuAdam::CpuAdam(const CpuAdamOptions& options) {
  PORTER_CHECK_GE(options.threads, 0, "CpuAdam: threads must be >= 0 (0: one per hardware thread)");
  PORTER_CHECK_GT(options.tile_elems, 0, "CpuAdam: tile_elems must be positive");
  threads_ = options.threads > 0
                 ? options.threads
                 : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  isa_ = std::min(options.max_isa, best_cpu_isa());
  tile_elems_ = options.tile_elems;
  if (threads_ > 1) pool_ = std::make_unique<Pool>(threads_ - 1);
}

CpuAdam::~CpuAdam() = default;

void CpuAdam::update(const CpuAdamArrays& a, const kernels::AdamWArgs& args) {
  check_arrays(a);
  check_args(args);
  if (a.elems == 0) return;
  const AdamWConstants k = adamw_constants(args);
  const RangeFn kernel = kernel_for(isa_, a);
  const int64_t tiles = (a.elems + tile_elems_ - 1) / tile_elems_;
  std::lock_guard<std::mutex> lock(update_mu_);
  if (pool_ == nullptr || tiles == 1) {
    kernel(a, k, 0, a.elems);
    return;
  }
  std::atomic<int64_t> next{0};
  const std::function<void()> job = [&] {
    for (int64_t t = next.fetch_add(1, std::memory_order_relaxed); t < tiles;
         t = next.fetch_add(1, std::memory_order_relaxed)) {
      const int64_t begin = t * tile_elems_;
      kernel(a, k, begin, std::min(a.elems, begin + tile_elems_));
    }
  };
  pool_->run(job);
}

}  // namespace porter::zero
