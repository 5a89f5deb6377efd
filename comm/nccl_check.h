// PORTER_GPU_CHECK for NCCL calls (Note [GPU status traits] in base/gpu_check.h): a failure
// throws NcclError with NCCL's error string and its last error message.
#pragma once

#include <nccl.h>

#include "base/error.h"
#include "base/gpu_check.h"

namespace porter {

template <>
struct GpuStatus<ncclResult_t> {
  using Error = NcclError;
  // porter's comms are non-blocking (Note [NCCL timeouts]): ncclInProgress means "poll for
  // completion", not failure.
  static bool ok(ncclResult_t s) { return s == ncclSuccess || s == ncclInProgress; }
  static const char* name(ncclResult_t s) { return ncclGetErrorString(s); }
  // NCCL's last error message, asked of no comm in particular: the failing call may have none
  // yet (ncclGetUniqueId, ncclCommInitRankConfig).
  static const char* detail(ncclResult_t) { return ncclGetLastError(nullptr); }
};

}  // namespace porter
