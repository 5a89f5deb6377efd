// cuBLASLt GEMM for porter's row-major tensors, with a per-shape plan cache.
//
// Note [Row-major on cuBLASLt]
// cuBLASLt is column-major. A row-major (r, c) matrix with leading dimension c is the
// column-major (c, r) matrix, its transpose. So row-major out = op(a) @ op(b) is computed as
// column-major out^T = op(b)^T @ op(a)^T: cuBLASLt's A is our b and its B is our a, each
// described exactly as stored, with the transpose flags unchanged, and m and n swapped.
//
// Compute is CUBLAS_COMPUTE_32F (never TF32), so f32 results are comparable with the cpu
// reference; bf16 and f16 inputs are multiplied with f32 accumulation.
#include "kernels/cuda/matmul.h"

#include <cublasLt.h>

#include "base/check.h"
#include "memory/cuda_check.h"
#include "kernels/cuda/cublas_check.h"

namespace porter::kernels::cuda {
namespace {

// 32 MiB, NVIDIA's recommendation for Hopper; enough for every algorithm on Ampere too.
constexpr size_t kWorkspaceBytes = size_t{32} << 20;

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::kF32: return CUDA_R_32F;
    case DType::kBF16: return CUDA_R_16BF;
    case DType::kF16: return CUDA_R_16F;
    case DType::kI32:
    case DType::kI64:
    case DType::kBool: break;
  }
  PORTER_ASSERT(false, "matmul on dtype ", dtype_name(t));
  return CUDA_R_32F;
}

// The largest power of two (up to 256) dividing the address of every batch entry.
uint32_t alignment_of(const void* p, int64_t stride_elems, DType t, int64_t batch) {
  uintptr_t bits = reinterpret_cast<uintptr_t>(p);
  if (batch > 1) bits |= static_cast<uintptr_t>(stride_elems) * dtype_size(t);
  uint32_t a = 256;
  while (a > 1 && bits % a != 0) a /= 2;
  return a;
}

struct DescDeleter {
  void operator()(cublasLtMatmulDescOpaque_t* d) const {
    PORTER_GPU_WARN(cublasLtMatmulDescDestroy(d));
  }
};
struct LayoutDeleter {
  void operator()(cublasLtMatrixLayoutOpaque_t* l) const {
    PORTER_GPU_WARN(cublasLtMatrixLayoutDestroy(l));
  }
};
struct PreferenceDeleter {
  void operator()(cublasLtMatmulPreferenceOpaque_t* p) const {
    PORTER_GPU_WARN(cublasLtMatmulPreferenceDestroy(p));
  }
};
using DescPtr = std::unique_ptr<cublasLtMatmulDescOpaque_t, DescDeleter>;
using LayoutPtr = std::unique_ptr<cublasLtMatrixLayoutOpaque_t, LayoutDeleter>;
using PreferencePtr = std::unique_ptr<cublasLtMatmulPreferenceOpaque_t, PreferenceDeleter>;

// A column-major layout of `rows` x `cols` (leading dimension rows), batched with `stride`.
LayoutPtr make_layout(DType t, int64_t rows, int64_t cols, int64_t batch, int64_t stride,
                      int device) {
  cublasLtMatrixLayout_t raw = nullptr;
  PORTER_GPU_CHECK(cublasLtMatrixLayoutCreate(&raw, cuda_type(t), static_cast<uint64_t>(rows),
                                              static_cast<uint64_t>(cols), rows),
                   device);
  LayoutPtr layout(raw);
  if (batch > 1) {
    int32_t count = static_cast<int32_t>(batch);
    PORTER_GPU_CHECK(cublasLtMatrixLayoutSetAttribute(raw, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                                                      &count, sizeof(count)),
                     device);
    PORTER_GPU_CHECK(cublasLtMatrixLayoutSetAttribute(
                         raw, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof(stride)),
                     device);
  }
  return layout;
}

}  // namespace

struct CublasLtMatmul::Handle {
  explicit Handle(int device) : device_index(device) {
    PORTER_GPU_CHECK(cudaSetDevice(device), device);
    PORTER_GPU_CHECK(cublasLtCreate(&handle), device);
  }
  ~Handle() { PORTER_GPU_WARN(cublasLtDestroy(handle)); }
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;

  int device_index;
  cublasLtHandle_t handle = nullptr;  // owned
};

struct CublasLtMatmul::Plan {
  DescPtr desc;
  LayoutPtr lt_a;    // our b, as stored (Note [Row-major on cuBLASLt])
  LayoutPtr lt_b;    // our a
  LayoutPtr lt_out;  // C and D
  cublasLtMatmulAlgo_t algo{};
};

CublasLtMatmul::CublasLtMatmul(memory::Device& device)
    : device_(device), handle_(std::make_unique<Handle>(device.index())) {
  workspace_ = device_.allocate_segment(kWorkspaceBytes);
  if (workspace_ == nullptr) {
    throw OutOfMemoryError(
        str_cat("cuBLASLt workspace of ", kWorkspaceBytes, " bytes does not fit on ",
                device_.description(), "; lower porter.device.memory_limit's other users"),
        kWorkspaceBytes);
  }
  workspace_bytes_ = kWorkspaceBytes;
}

CublasLtMatmul::~CublasLtMatmul() {
  plans_.clear();
  handle_.reset();
  // free_segment synchronises the device (cudaFree), so no queued GEMM still uses it.
  device_.free_segment(workspace_, workspace_bytes_);
}

const CublasLtMatmul::Plan& CublasLtMatmul::plan_for(const GemmArgs& g) {
  const uint32_t align_a = alignment_of(g.a, g.stride_a, g.ab_dtype, g.batch);
  const uint32_t align_b = alignment_of(g.b, g.stride_b, g.ab_dtype, g.batch);
  const uint32_t align_out = alignment_of(g.out, g.stride_out, g.out_dtype, g.batch);
  PlanKey key{static_cast<int>(g.ab_dtype), static_cast<int>(g.out_dtype), g.trans_a, g.trans_b,
              g.m, g.n, g.k, g.batch, g.stride_a, g.stride_b, g.stride_out, g.beta == 0.0f,
              align_a, align_b, align_out};
  auto it = plans_.find(key);
  if (it != plans_.end()) return *it->second;

  const int dev = handle_->device_index;
  auto plan = std::make_unique<Plan>();
  cublasLtMatmulDesc_t desc = nullptr;
  PORTER_GPU_CHECK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), dev);
  plan->desc.reset(desc);
  const int32_t op_a = g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;  // cuBLASLt's A is our b
  const int32_t op_b = g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  PORTER_GPU_CHECK(
      cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a)), dev);
  PORTER_GPU_CHECK(
      cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b)), dev);

  // Stored shapes, column-major: our b is (K, N) row-major = (N, K) column-major, or with
  // trans_b (N, K) row-major = (K, N) column-major; likewise for a with M.
  plan->lt_a = make_layout(g.ab_dtype, g.trans_b ? g.k : g.n, g.trans_b ? g.n : g.k, g.batch,
                           g.stride_b, dev);
  plan->lt_b = make_layout(g.ab_dtype, g.trans_a ? g.m : g.k, g.trans_a ? g.k : g.m, g.batch,
                           g.stride_a, dev);
  plan->lt_out = make_layout(g.out_dtype, g.n, g.m, g.batch, g.stride_out, dev);

  cublasLtMatmulPreference_t raw_pref = nullptr;
  PORTER_GPU_CHECK(cublasLtMatmulPreferenceCreate(&raw_pref), dev);
  PreferencePtr pref(raw_pref);
  uint64_t ws = workspace_bytes_;
  PORTER_GPU_CHECK(cublasLtMatmulPreferenceSetAttribute(
                       raw_pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)),
                   dev);
  // cuBLASLt's A and B are our b and a.
  const std::pair<cublasLtMatmulPreferenceAttributes_t, uint32_t> aligns[] = {
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align_b},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align_a},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_out},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_out}};
  for (const auto& [attr, value] : aligns) {
    PORTER_GPU_CHECK(cublasLtMatmulPreferenceSetAttribute(raw_pref, attr, &value, sizeof(value)),
                     dev);
  }

  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  PORTER_GPU_CHECK(cublasLtMatmulAlgoGetHeuristic(handle_->handle, desc, plan->lt_a.get(),
                                                  plan->lt_b.get(), plan->lt_out.get(),
                                                  plan->lt_out.get(), raw_pref, 1, &result, &found),
                   dev);
  if (found == 0) {
    throw CudaError(str_cat("cuBLASLt has no algorithm for matmul ", dtype_name(g.ab_dtype), "->",
                            dtype_name(g.out_dtype), " m=", g.m, " n=", g.n, " k=", g.k,
                            " batch=", g.batch, " trans_a=", g.trans_a, " trans_b=", g.trans_b,
                            " on cuda:", dev));
  }
  plan->algo = result.algo;
  return *plans_.emplace(key, std::move(plan)).first->second;
}

void CublasLtMatmul::run(const GemmArgs& g, cudaStream_t stream) {
  PORTER_ASSERT(g.stride_out != 0 || g.batch == 1, "batched matmul with out stride 0");
  if (g.m == 0 || g.n == 0 || g.batch == 0) return;
  const int dev = handle_->device_index;
  // cuBLASLt does not promise out = beta * out for k = 0; the caller handles that case.
  PORTER_ASSERT(g.k > 0, "cuBLASLt matmul with k = 0 on cuda:", dev);
  const Plan& plan = plan_for(g);
  PORTER_GPU_CHECK(
      cublasLtMatmul(handle_->handle, plan.desc.get(), &g.alpha, g.b, plan.lt_a.get(), g.a,
                     plan.lt_b.get(), &g.beta, g.out, plan.lt_out.get(), g.out, plan.lt_out.get(),
                     &plan.algo, workspace_, workspace_bytes_, stream),
      dev);
}

}  // namespace porter::kernels::cuda
