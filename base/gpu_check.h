// One checked-call mechanism for every GPU library (CUDA runtime, cuBLAS, NCCL): a failed
// status throws the library's typed error naming the statement, device, file:line and the
// library's error name and string, or, in a destructor, is logged and swallowed.
//
//   PORTER_GPU_CHECK(stmt, device)         throws GpuStatus<S>::Error (CudaError, NcclError)
//   PORTER_GPU_WARN(stmt)                  logs the failure; for destructors, which never throw
//   PORTER_GPU_CHECK_LAUNCH(what, device)  after a kernel launch (memory/cuda_check.h)
//
// Note [GPU status traits]
// The macros work for any status type S with a specialisation of porter::GpuStatus<S>. Each
// library's specialisation lives in a header that only that library's callers include
// (memory/cuda_check.h, kernels/cuda/cublas_check.h, comm/nccl_check.h), so this header includes no
// GPU header at all, a cuBLAS user never sees nccl.h, and a build without CUDA compiles it
// (and tests the messages) like any other header.
#pragma once

#include <string>
#include <string_view>

#include "base/error.h"

namespace porter {

// Specialised per library (Note [GPU status traits]) with:
//   using Error = CudaError;               // the porter::Error subclass a failure throws
//   static bool ok(S s);                   // s is not a failure
//   static const char* name(S s);          // the status's name, e.g. "cudaErrorInvalidValue"
//   static const char* detail(S s);        // the library's explanation of it
template <typename S>
struct GpuStatus;

// The usual shape of a specialisation: one success value and two functions from the library,
// e.g. GpuStatus<cudaError_t> : GpuStatusOf<cudaError_t, cudaSuccess, CudaError,
// cudaGetErrorName, cudaGetErrorString>.
template <typename S, S kSuccess, typename E, const char* (*kName)(S),
          const char* (*kDetail)(S)>
struct GpuStatusOf {
  using Error = E;
  static bool ok(S s) { return s == kSuccess; }
  static const char* name(S s) { return kName(s); }
  static const char* detail(S s) { return kDetail(s); }
};

namespace detail {

// "<stmt> failed on cuda:<device> at <file>:<line>: <name> (<detail>)". name and detail come
// straight from the library and may be null (printed as "(null)").
std::string gpu_failure_message(std::string_view stmt, int device, std::string_view file,
                                int line, const char* name, const char* detail);
// Logs "<stmt> failed at <file>:<line>: <name> (<detail>)" as an error.
void log_gpu_failure(std::string_view stmt, std::string_view file, int line, const char* name,
                     const char* detail);

template <typename S>
[[noreturn]] void throw_gpu_failure(S status, const char* stmt, int device, const char* file,
                                    int line) {
  using Traits = GpuStatus<S>;
  throw typename Traits::Error(gpu_failure_message(stmt, device, file, line,
                                                   Traits::name(status),
                                                   Traits::detail(status)));
}

template <typename S>
void warn_gpu_failure(S status, const char* stmt, const char* file, int line) {
  using Traits = GpuStatus<S>;
  log_gpu_failure(stmt, file, line, Traits::name(status), Traits::detail(status));
}

}  // namespace detail
}  // namespace porter

// Evaluates `status_expr` once; `text` is what the message calls the statement.
#define PORTER_GPU_CHECK_AS_(status_expr, text, device)                                     \
  do {                                                                                      \
    auto porter_gpu_status_ = (status_expr);                                                \
    if (!::porter::GpuStatus<decltype(porter_gpu_status_)>::ok(porter_gpu_status_))         \
        [[unlikely]] {                                                                      \
      ::porter::detail::throw_gpu_failure(porter_gpu_status_, text, device, __FILE__,       \
                                          __LINE__);                                        \
    }                                                                                       \
  } while (0)

#define PORTER_GPU_CHECK(stmt, device) PORTER_GPU_CHECK_AS_(stmt, #stmt, device)

#define PORTER_GPU_WARN(stmt)                                                               \
  do {                                                                                      \
    auto porter_gpu_status_ = (stmt);                                                       \
    if (!::porter::GpuStatus<decltype(porter_gpu_status_)>::ok(porter_gpu_status_)) {       \
      ::porter::detail::warn_gpu_failure(porter_gpu_status_, #stmt, __FILE__, __LINE__);    \
    }                                                                                       \
  } while (0)
