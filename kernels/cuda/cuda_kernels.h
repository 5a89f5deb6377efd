// The cuda Kernels (cuBLASLt matmul and porter's own kernels); built only with CUDA.
#pragma once

#include <memory>

#include "memory/caching_allocator.h"
#include "memory/device.h"
#include "kernels/kernels.h"

namespace porter::kernels {

// Workspace from `allocator`, whose device must be cuda (Note [Kernel workspace]).
std::unique_ptr<Kernels> make_cuda_kernels(memory::CachingAllocator& allocator);
// The same with a private allocator on `device` (as make_kernels(device)).
std::unique_ptr<Kernels> make_cuda_kernels(memory::Device& device);

}  // namespace porter::kernels
