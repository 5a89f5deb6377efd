// The cuda Kernels: cuBLASLt matmul plus porter's own kernels, on the device's compute
// stream. Only built when PORTER_WITH_CUDA; reached through make_kernels().
#pragma once

#include <memory>

#include "memory/device.h"
#include "nn/kernels.h"

namespace porter::nn {

std::unique_ptr<Kernels> make_cuda_kernels(memory::Device& device);

}  // namespace porter::nn
