// Checked CUDA runtime calls for the nn cuda files: a failure throws CudaError naming the
// statement, the device, file:line and CUDA's error string (as memory/cuda_device.cc does).
#pragma once

#include <cuda_runtime_api.h>

#include "base/check.h"
#include "base/error.h"

namespace porter::nn::cuda {

[[noreturn]] inline void throw_cuda_error(cudaError_t err, const char* stmt, int device,
                                          const char* file, int line) {
  throw CudaError(str_cat(stmt, " failed on cuda:", device, " at ", file, ":", line, ": ",
                          cudaGetErrorName(err), " (", cudaGetErrorString(err), ")"));
}

}  // namespace porter::nn::cuda

#define PORTER_NN_CUDA_CHECK(stmt, device)                                               \
  do {                                                                                   \
    cudaError_t porter_nn_cuda_err_ = (stmt);                                            \
    if (porter_nn_cuda_err_ != cudaSuccess) [[unlikely]] {                               \
      ::porter::nn::cuda::throw_cuda_error(porter_nn_cuda_err_, #stmt, device, __FILE__, \
                                           __LINE__);                                    \
    }                                                                                    \
  } while (0)

// After a <<<...>>> launch (`what` is a string literal naming the kernel): configuration
// errors surface here, at the launch that caused them, not at the next synchronisation.
#define PORTER_NN_CUDA_CHECK_LAUNCH(what, device)                                          \
  do {                                                                                     \
    cudaError_t porter_nn_cuda_err_ = cudaGetLastError();                                  \
    if (porter_nn_cuda_err_ != cudaSuccess) [[unlikely]] {                                 \
      ::porter::nn::cuda::throw_cuda_error(porter_nn_cuda_err_, "launch of " what, device, \
                                           __FILE__, __LINE__);                            \
    }                                                                                      \
  } while (0)
