// PORTER_GPU_CHECK/PORTER_GPU_WARN for cuBLAS(Lt) calls (Note [GPU status traits] in
// base/gpu_check.h): a failure throws CudaError with cuBLASLt's status name and string.
#pragma once

#include <cublasLt.h>

#include "base/error.h"
#include "base/gpu_check.h"

namespace porter {

template <>
struct GpuStatus<cublasStatus_t>
    : GpuStatusOf<cublasStatus_t, CUBLAS_STATUS_SUCCESS, CudaError, cublasLtGetStatusName,
                  cublasLtGetStatusString> {};

}  // namespace porter
