// PORTER_GPU_CHECK/PORTER_GPU_WARN for CUDA runtime calls (Note [GPU status traits] in
// base/gpu_check.h), and PORTER_GPU_CHECK_LAUNCH for kernel launches. Only files at the CUDA
// boundary include it.
#pragma once

#include <cuda_runtime_api.h>

#include "base/error.h"
#include "base/gpu_check.h"

namespace porter {

template <>
struct GpuStatus<cudaError_t> : GpuStatusOf<cudaError_t, cudaSuccess, CudaError,
                                             cudaGetErrorName, cudaGetErrorString> {};

}  // namespace porter

// After a <<<...>>> launch (`what` is a string literal naming the kernel): configuration
// errors surface here, at the launch that caused them, not at the next synchronisation.
#define PORTER_GPU_CHECK_LAUNCH(what, device) \
  PORTER_GPU_CHECK_AS_(cudaGetLastError(), "launch of " what, device)
