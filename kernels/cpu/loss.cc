// Token/position embedding and softmax cross-entropy on cpu, whole or vocabulary-parallel
// (Note [Vocabulary-parallel kernels] in kernels.cc). Ids of the whole-vocabulary ops are
// range-checked here, since only the device implementation can read them.
#include <cmath>
#include <cstdint>

#include "base/check.h"
#include "kernels/cpu/cpu_kernels.h"

namespace porter::kernels {
namespace {

using cpu::load;
using cpu::store;

constexpr int64_t kColumnBlock = 64;

template <typename T>
T* ptr(const Tensor& t) {
  return static_cast<T*>(t.data());
}

// Every id in [0, limit), or InvalidArgument naming the op, the position and the id.
void check_ids(const char* op, const char* name, const Tensor& ids, int64_t limit) {
  const int32_t* p = ids.data_as<int32_t>();
  for (int64_t i = 0; i < ids.numel(); ++i) {
    PORTER_CHECK(p[i] >= 0 && p[i] < limit, op, ": ", name, " ", ids.shape().to_string(),
                 " holds id ", p[i], " at flat index ", i, ", outside [0, ", limit, ")");
  }
}

template <typename TW, typename TO>
PORTER_CPU_CLONES void embed_row(const TW* wte_row, const TW* wpe_row, TO* out, int64_t cols) {
#pragma omp simd
  for (int64_t c = 0; c < cols; ++c) store(out + c, load(wte_row + c) + load(wpe_row + c));
}

template <typename TW, typename TO>
PORTER_CPU_CLONES void copy_row(const TW* row, TO* out, int64_t cols) {
#pragma omp simd
  for (int64_t c = 0; c < cols; ++c) store(out + c, load(row + c));
}

template <typename TD, typename TG>
PORTER_CPU_CLONES void add_into(TG* acc, const TD* x, int64_t n) {
#pragma omp simd
  for (int64_t c = 0; c < n; ++c) store(acc + c, load(acc + c) + load(x + c));
}

// max and sum of exp(x - max) over one row.
template <typename T>
PORTER_CPU_CLONES void softmax_stats(const T* x, int64_t n, float* max_out, float* sum_out) {
  float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
  for (int64_t i = 0; i < n; ++i) mx = std::max(mx, load(x + i));
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += cpu::fast_exp(load(x + i) - mx);
  *max_out = mx;
  *sum_out = s;
}

template <typename TL, typename TD>
PORTER_CPU_CLONES void softmax_grad_row(const TL* x, TD* dx, int64_t n, float mx, float mul) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) store(dx + i, cpu::fast_exp(load(x + i) - mx) * mul);
}

// Stats layout of cross_entropy_partial: (m, s, z) per row.
enum StatsColumn : int64_t { kStatsMax = 0, kStatsSum = 1, kStatsTarget = 2, kStatsColumns = 3 };

// The row of token `tok` in a table holding ids [vocab_begin, vocab_begin + rows), or -1.
inline int64_t local_row(int32_t tok, int64_t vocab_begin, int64_t rows) {
  const int64_t r = int64_t{tok} - vocab_begin;
  return r >= 0 && r < rows ? r : -1;
}

// out (B, T, C) = wte[tok - vocab_begin] (0 for ids outside the table) + wpe[t] (when wpe is
// defined). The whole-vocabulary forward is vocab_begin 0, so both give the same bits.
void embedding_forward_rows(int threads, const Tensor& tokens, const Tensor& wte,
                            int64_t vocab_begin, const Tensor& wpe, Tensor& out) {
  const int64_t t_len = tokens.dim(1), cols = wte.dim(1), vocab = wte.dim(0);
  const int32_t* tok = tokens.data_as<int32_t>();
  const bool has_wpe = wpe.defined();
  cpu::dispatch_float(wte.dtype(), [&](auto tw) {
    cpu::dispatch_float(out.dtype(), [&](auto to) {
      using TW = decltype(tw);
      using TO = decltype(to);
      const TW* we = ptr<TW>(wte);
      const TW* wp = has_wpe ? ptr<TW>(wpe) : nullptr;
      TO* op = ptr<TO>(out);
      cpu::parallel_rows(threads, tokens.numel(), [&](int64_t n) {
        const int64_t v = local_row(tok[n], vocab_begin, vocab);
        TO* dst = op + n * cols;
        if (v >= 0 && has_wpe) {
          embed_row(we + v * cols, wp + (n % t_len) * cols, dst, cols);
        } else if (v >= 0) {
          copy_row(we + v * cols, dst, cols);
        } else if (has_wpe) {
          copy_row(wp + (n % t_len) * cols, dst, cols);
        } else {
          for (int64_t c = 0; c < cols; ++c) store(dst + c, 0.0f);
        }
      });
    });
  });
}

// dwte[tok - vocab_begin] += dout rows of in-range tokens; dwpe[t] += (when defined).
void embedding_backward_rows(int threads, const Tensor& dout, const Tensor& tokens,
                             int64_t vocab_begin, Tensor& dwte, Tensor& dwpe) {
  const int64_t batch = tokens.dim(0), t_len = tokens.dim(1), cols = dwte.dim(1);
  const int64_t vocab = dwte.dim(0), n_rows = tokens.numel();
  const int32_t* tok = tokens.data_as<int32_t>();
  const bool has_wpe = dwpe.defined();
  cpu::dispatch_float(dout.dtype(), [&](auto td) {
    cpu::dispatch_float(dwte.dtype(), [&](auto tg) {
      using TD = decltype(td);
      using TG = decltype(tg);
      const TD* dp = ptr<TD>(dout);
      TG* gte = ptr<TG>(dwte);
      TG* gpe = has_wpe ? ptr<TG>(dwpe) : nullptr;
      // dwte: repeated tokens add into the same row, so threads own column blocks and walk
      // the rows in order (Note [Cpu determinism]).
      const int64_t blocks = (cols + kColumnBlock - 1) / kColumnBlock;
#pragma omp parallel for num_threads(threads) schedule(static)
      for (int64_t blk = 0; blk < blocks; ++blk) {
        const int64_t c0 = blk * kColumnBlock, width = std::min(kColumnBlock, cols - c0);
        for (int64_t n = 0; n < n_rows; ++n) {
          const int64_t v = local_row(tok[n], vocab_begin, vocab);
          if (v >= 0) add_into(gte + v * cols + c0, dp + n * cols + c0, width);
        }
      }
      if (!has_wpe) return;
      // dwpe: position t sums over the batch, in batch order.
      cpu::parallel_rows(threads, t_len, [&](int64_t t) {
        for (int64_t b = 0; b < batch; ++b) {
          add_into(gpe + t * cols, dp + (b * t_len + t) * cols, cols);
        }
      });
    });
  });
}

}  // namespace

void CpuKernels::do_embedding_forward(const Tensor& tokens, const Tensor& wte, const Tensor& wpe,
                                      Tensor& out) {
  check_ids("embedding_forward", "tokens", tokens, wte.dim(0));
  embedding_forward_rows(threads_, tokens, wte, 0, wpe, out);
}

void CpuKernels::do_embedding_backward(const Tensor& dout, const Tensor& tokens, Tensor& dwte,
                                       Tensor& dwpe) {
  check_ids("embedding_backward", "tokens", tokens, dwte.dim(0));
  embedding_backward_rows(threads_, dout, tokens, 0, dwte, dwpe);
}

void CpuKernels::do_embedding_forward_vocab_range(const Tensor& tokens, const Tensor& wte,
                                                  int64_t vocab_begin, const Tensor& wpe,
                                                  Tensor& out) {
  embedding_forward_rows(threads_, tokens, wte, vocab_begin, wpe, out);
}

void CpuKernels::do_embedding_backward_vocab_range(const Tensor& dout, const Tensor& tokens,
                                                   int64_t vocab_begin, Tensor& dwte,
                                                   Tensor& dwpe) {
  embedding_backward_rows(threads_, dout, tokens, vocab_begin, dwte, dwpe);
}

void CpuKernels::do_cross_entropy_forward(const Tensor& logits, const Tensor& targets,
                                          Tensor& losses) {
  const int64_t classes = logits.dim(-1), rows = cpu::rows_of(logits);
  check_ids("cross_entropy_forward", "targets", targets, classes);
  const int32_t* tgt = targets.data_as<int32_t>();
  float* lp = losses.data_as<float>();
  cpu::dispatch_float(logits.dtype(), [&](auto tl) {
    using TL = decltype(tl);
    const TL* xp = ptr<TL>(logits);
    cpu::parallel_rows(threads_, rows, [&](int64_t r) {
      const TL* row = xp + r * classes;
      float mx, s;
      softmax_stats(row, classes, &mx, &s);
      // -log softmax[target] = log(sum exp(x - max)) + max - x[target].
      lp[r] = std::log(s) + mx - load(row + tgt[r]);
    });
  });
}

void CpuKernels::do_cross_entropy_backward(const Tensor& logits, const Tensor& targets,
                                           Tensor& dlogits, float scale) {
  const int64_t classes = logits.dim(-1), rows = cpu::rows_of(logits);
  check_ids("cross_entropy_backward", "targets", targets, classes);
  const int32_t* tgt = targets.data_as<int32_t>();
  cpu::dispatch_float(logits.dtype(), [&](auto tl) {
    cpu::dispatch_float(dlogits.dtype(), [&](auto td) {
      using TL = decltype(tl);
      using TD = decltype(td);
      const TL* xp = ptr<TL>(logits);
      TD* dp = ptr<TD>(dlogits);
      cpu::parallel_rows(threads_, rows, [&](int64_t r) {
        const TL* row = xp + r * classes;
        TD* drow = dp + r * classes;
        float mx, s;
        softmax_stats(row, classes, &mx, &s);
        // The whole row is read above before it is written (in place is allowed).
        softmax_grad_row(row, drow, classes, mx, scale / s);
        store(drow + tgt[r], load(drow + tgt[r]) - scale);
      });
    });
  });
}

void CpuKernels::do_cross_entropy_partial(const Tensor& logits, const Tensor& targets,
                                          int64_t vocab_begin, int64_t valid, Tensor& stats) {
  const int64_t cols = logits.dim(-1), rows = cpu::rows_of(logits);
  const int32_t* tgt = targets.data_as<int32_t>();
  float* sp = stats.data_as<float>();
  cpu::dispatch_float(logits.dtype(), [&](auto tl) {
    using TL = decltype(tl);
    const TL* xp = ptr<TL>(logits);
    cpu::parallel_rows(threads_, rows, [&](int64_t r) {
      const TL* row = xp + r * cols;
      float mx, s;
      // valid = 0 leaves mx = -inf and s = 0 (empty reductions).
      softmax_stats(row, valid, &mx, &s);
      const int64_t local = local_row(tgt[r], vocab_begin, valid);
      float* out = sp + r * kStatsColumns;
      out[kStatsMax] = mx;
      out[kStatsSum] = s;
      out[kStatsTarget] = local >= 0 ? load(row + local) : 0.0f;
    });
  });
}

void CpuKernels::do_cross_entropy_combine(const Tensor& gathered, Tensor& losses, Tensor& lse) {
  const int64_t ranks = gathered.dim(0), rows = gathered.dim(1);
  const float* gp = gathered.data_as<float>();
  float* lp = losses.data_as<float>();
  float* ep = lse.data_as<float>();
  cpu::parallel_rows(threads_, rows, [&](int64_t r) {
    auto at = [&](int64_t rank, int64_t col) {
      return gp[(rank * rows + r) * kStatsColumns + col];
    };
    float mx = -INFINITY;
    for (int64_t k = 0; k < ranks; ++k) mx = std::max(mx, at(k, kStatsMax));
    // In rank order, so every rank combines to the same bits. A rank with s = 0 (no valid
    // columns: m = -inf) is skipped, since exp(-inf - -inf) would be NaN.
    float s = 0.0f, z = 0.0f;
    for (int64_t k = 0; k < ranks; ++k) {
      const float sk = at(k, kStatsSum);
      if (sk != 0.0f) s += sk * std::exp(at(k, kStatsMax) - mx);
      z += at(k, kStatsTarget);
    }
    const float l = mx + std::log(s);
    ep[r] = l;
    lp[r] = l - z;
  });
}

void CpuKernels::do_cross_entropy_backward_partial(const Tensor& logits, const Tensor& targets,
                                                   int64_t vocab_begin, int64_t valid,
                                                   const Tensor& lse, Tensor& dlogits,
                                                   float scale) {
  const int64_t cols = logits.dim(-1), rows = cpu::rows_of(logits);
  const int32_t* tgt = targets.data_as<int32_t>();
  const float* ep = lse.data_as<float>();
  cpu::dispatch_float(logits.dtype(), [&](auto tl) {
    cpu::dispatch_float(dlogits.dtype(), [&](auto td) {
      using TL = decltype(tl);
      using TD = decltype(td);
      const TL* xp = ptr<TL>(logits);
      TD* dp = ptr<TD>(dlogits);
      cpu::parallel_rows(threads_, rows, [&](int64_t r) {
        const TL* row = xp + r * cols;
        TD* drow = dp + r * cols;
        // softmax = exp(l - lse); each element is read before it is written (in place).
        softmax_grad_row(row, drow, valid, ep[r], scale);
        const int64_t local = local_row(tgt[r], vocab_begin, valid);
        if (local >= 0) store(drow + local, load(drow + local) - scale);
        for (int64_t c = valid; c < cols; ++c) store(drow + c, 0.0f);
      });
    });
  });
}

}  // namespace porter::kernels
