// Token/position embedding and softmax cross-entropy on cpu. Ids are range-checked here,
// since only the device implementation can read them.
#include <cmath>
#include <cstdint>

#include "base/check.h"
#include "nn/cpu_kernels.h"

namespace porter::nn {
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

}  // namespace

void CpuKernels::do_embedding_forward(const Tensor& tokens, const Tensor& wte, const Tensor& wpe,
                                      Tensor& out) {
  check_ids("embedding_forward", "tokens", tokens, wte.dim(0));
  const int64_t t_len = tokens.dim(1), cols = wte.dim(1);
  const int32_t* tok = tokens.data_as<int32_t>();
  cpu::dispatch_float(wte.dtype(), [&](auto tw) {
    cpu::dispatch_float(out.dtype(), [&](auto to) {
      using TW = decltype(tw);
      using TO = decltype(to);
      const TW* we = ptr<TW>(wte);
      const TW* wp = ptr<TW>(wpe);
      TO* op = ptr<TO>(out);
      cpu::parallel_rows(threads_, tokens.numel(), [&](int64_t n) {
        embed_row(we + tok[n] * cols, wp + (n % t_len) * cols, op + n * cols, cols);
      });
    });
  });
}

void CpuKernels::do_embedding_backward(const Tensor& dout, const Tensor& tokens, Tensor& dwte,
                                       Tensor& dwpe) {
  check_ids("embedding_backward", "tokens", tokens, dwte.dim(0));
  const int64_t batch = tokens.dim(0), t_len = tokens.dim(1), cols = dwte.dim(1);
  const int64_t n_rows = tokens.numel();
  const int32_t* tok = tokens.data_as<int32_t>();
  cpu::dispatch_float(dout.dtype(), [&](auto td) {
    cpu::dispatch_float(dwte.dtype(), [&](auto tg) {
      using TD = decltype(td);
      using TG = decltype(tg);
      const TD* dp = ptr<TD>(dout);
      TG* gte = ptr<TG>(dwte);
      TG* gpe = ptr<TG>(dwpe);
      // dwte: repeated tokens add into the same row, so threads own column blocks and walk
      // the rows in order (Note [Cpu determinism]).
      const int64_t blocks = (cols + kColumnBlock - 1) / kColumnBlock;
#pragma omp parallel for num_threads(threads_) schedule(static)
      for (int64_t blk = 0; blk < blocks; ++blk) {
        const int64_t c0 = blk * kColumnBlock, width = std::min(kColumnBlock, cols - c0);
        for (int64_t n = 0; n < n_rows; ++n) {
          add_into(gte + tok[n] * cols + c0, dp + n * cols + c0, width);
        }
      }
      // dwpe: position t sums over the batch, in batch order.
      cpu::parallel_rows(threads_, t_len, [&](int64_t t) {
        for (int64_t b = 0; b < batch; ++b) {
          add_into(gpe + t * cols, dp + (b * t_len + t) * cols, cols);
        }
      });
    });
  });
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

}  // namespace porter::nn
