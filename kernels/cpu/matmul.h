// oneDNN matmul for the cpu kernels: one engine and stream, and a cache of primitives keyed
// by everything that shapes them, so a call after the first only binds pointers and runs.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "tensor/dtype.h"
#include "kernels/kernels.h"
#include "tensor/tensor.h"

namespace porter::kernels {

// out[b0, b1] = alpha * a[b0, b1] @ b[b0, b1] + beta * out[b0, b1], for a (M, K), b (K, N) and
// out (M, N) in each of batch0 x batch1 batches, every operand at arbitrary element strides.
// A transposed operand is the same matrix with its two strides swapped.
struct MatmulProblem {
  int64_t batch0 = 1, batch1 = 1, m = 0, n = 0, k = 0;
  // {batch0, batch1, row, column} strides, in elements.
  int64_t a_strides[4] = {0, 0, 0, 1};
  int64_t b_strides[4] = {0, 0, 0, 1};
  int64_t out_strides[4] = {0, 0, 0, 1};
  DType a_dtype = DType::kF32, b_dtype = DType::kF32, out_dtype = DType::kF32;
  float alpha = 1.0f, beta = 0.0f;
};

// The problem of Kernels::matmul(a, b, out, spec) on row-major rank-2 or rank-3 tensors, as
// CpuKernels runs it (dtypes as given; f16 is widened before it reaches oneDNN).
MatmulProblem matmul_problem(const Tensor& a, const Tensor& b, const Tensor& out,
                             const MatmulSpec& spec);

// How a matmul reads its operands: as the caller stores them, B reordered first into the
// blocked layout oneDNN's kernel prefers, through oneDNN's sgemm, bf16 widened to f32, or A
// copied row-major (Note [Matmul weight layout]).
enum class MatmulLayout {
  kMeasure,  // per problem, whichever of these is fastest on this cpu, measured at first use
  kPlain,
  kBlocked,  // wherever oneDNN prefers a blocked layout
  kGemm,     // oneDNN's gemm-based kernel (gemm:jit) wherever it has one, B plain
  kWidened,  // B plain, and bf16 x bf16 problems widened to f32 (Note [Widened bf16 matmul])
  kRows,     // an A stored transposed is copied row-major first, B read as oneDNN prefers
};

// The layout policy named by $PORTER_MATMUL_LAYOUT (measure, plain, blocked, gemm, widened or
// rows; measure when unset). Throws InvalidArgument, naming the variable and the accepted values, on another value.
MatmulLayout matmul_layout_from_env();
// "measure", "plain", "blocked", "gemm", "widened" or "rows": the kernel table's names.
std::string_view layout_name(MatmulLayout layout);

class KernelTable;

class DnnlMatmul {
 public:
  // Choices under kMeasure are looked up in and recorded to `table` (not owned; it must
  // outlive this), or a table of its own when null (Note [Kernel table]).
  explicit DnnlMatmul(int threads, MatmulLayout layout = matmul_layout_from_env(),
                      KernelTable* table = nullptr);
  ~DnnlMatmul();
  DnnlMatmul(const DnnlMatmul&) = delete;
  DnnlMatmul& operator=(const DnnlMatmul&) = delete;

  void run(const MatmulProblem& problem, const void* a, const void* b, void* out);
  // Distinct problems seen so far (primitives created).
  size_t cached_primitives() const;
  // The oneDNN implementation chosen for `problem` ("brg:avx512_core", "gemm:jit", ...), with
  // ", blocked weights" when B is reordered first.
  std::string implementation(const MatmulProblem& problem);
  // Whether `problem` reads B through the blocked layout.
  bool blocked_weights(const MatmulProblem& problem);
  // Host bytes held for blocked copies of B and row-major copies of A (the largest pair
  // needed so far).
  size_t blocked_buffer_bytes() const;
  // Whether `problem` (bf16 x bf16) runs on f32 copies of its operands through f32 kernels.
  bool widened_operands(const MatmulProblem& problem);
  // Host bytes held for those f32 copies (the largest set needed so far).
  size_t widened_buffer_bytes() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace porter::kernels
