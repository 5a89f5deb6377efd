// Row-major (batched) GEMM on cuBLASLt, with the descriptors, layouts and the heuristic's
// algorithm cached per shape. Only built when PORTER_WITH_CUDA.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <map>
#include <memory>
#include <tuple>

#include "memory/device.h"
#include "tensor/dtype.h"

namespace porter::kernels::cuda {

using namespace porter::tensor;

// out (M, N) = alpha * op(a) @ op(b) + beta * out per batch entry, all row-major. a is
// (M, K) or, with trans_a, (K, M); b is (K, N) or, with trans_b, (N, K). A batch stride of 0
// reuses the same matrix for every batch entry (out's stride must not be 0).
struct GemmArgs {
  DType ab_dtype = DType::kF32;  // a and b
  DType out_dtype = DType::kF32;
  bool trans_a = false;
  bool trans_b = false;
  int64_t m = 0, n = 0, k = 0;
  int64_t batch = 1;
  int64_t stride_a = 0, stride_b = 0, stride_out = 0;  // elements between batch entries
  const void* a = nullptr;
  const void* b = nullptr;
  void* out = nullptr;
  float alpha = 1.0f;
  float beta = 0.0f;
};

// Owns one cuBLASLt handle, a workspace, and the plan cache. Not thread-safe: one per
// Kernels, used from the thread that drives the device's compute stream.
class CublasLtMatmul {
 public:
  explicit CublasLtMatmul(memory::Device& device);
  ~CublasLtMatmul();
  CublasLtMatmul(const CublasLtMatmul&) = delete;
  CublasLtMatmul& operator=(const CublasLtMatmul&) = delete;

  void run(const GemmArgs& args, cudaStream_t stream);

  // Note [Matmul plan cache]: plans are keyed by everything cuBLASLt's choice depends on
  // except the pointers' values: dtypes, transposes, shapes, batch strides, whether beta is
  // zero, and the pointers' alignments (the heuristic is asked for at most that alignment).
  using PlanKey = std::tuple<int, int, bool, bool, int64_t, int64_t, int64_t, int64_t, int64_t,
                             int64_t, int64_t, bool, uint32_t, uint32_t, uint32_t>;
  struct Plan;

 private:
  const Plan& plan_for(const GemmArgs& args);

  memory::Device& device_;  // not owned; outlives this
  struct Handle;
  std::unique_ptr<Handle> handle_;
  void* workspace_ = nullptr;  // owned: a segment from device_, freed in the destructor
  size_t workspace_bytes_ = 0;
  std::map<PlanKey, std::unique_ptr<Plan>> plans_;
};

}  // namespace porter::kernels::cuda
