// The cuda Kernels (cuBLASLt matmul and porter's own kernels); built only with CUDA.
#pragma once

#include <memory>

#include "memory/device.h"
#include "nn/kernels.h"

namespace porter::nn {

std::unique_ptr<Kernels> make_cuda_kernels(memory::Device& device);

}  // namespace porter::nn
