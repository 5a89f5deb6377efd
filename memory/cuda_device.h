// The cuda device: cudaMalloc segments, cudaHostAlloc pinned memory, CUDA streams and events.
// Only compiled when PORTER_WITH_CUDA; reached through make_device().
#pragma once

#include <atomic>
#include <memory>

#include "memory/device.h"

namespace porter::memory {

int cuda_device_count();

// Creates the cuda device for options.index. Throws CudaError when CUDA fails.
std::unique_ptr<Device> make_cuda_device(const DeviceOptions& options);

}  // namespace porter::memory
