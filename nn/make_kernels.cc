// make_kernels: the one place that picks the cpu or cuda kernels for a device.
#include "base/build_config.h"
#include "base/check.h"
#include "nn/cpu_kernels.h"
#include "nn/kernels.h"

#if PORTER_WITH_CUDA
#include "nn/cuda_kernels.h"
#endif

namespace porter::nn {

std::unique_ptr<Kernels> make_kernels(memory::Device& device) {
  switch (device.kind()) {
    case memory::DeviceKind::kCpu:
      return std::make_unique<CpuKernels>(device);
    case memory::DeviceKind::kCuda:
#if PORTER_WITH_CUDA
      return make_cuda_kernels(device);
#else
      PORTER_CHECK(false, "make_kernels: a cuda device, but porter was built without CUDA; "
                          "rebuild with -DPORTER_CUDA=ON or use porter.device.type = \"cpu\"");
#endif
  }
  PORTER_CHECK(false, "make_kernels: unknown device kind ", static_cast<int>(device.kind()));
  return nullptr;
}

}  // namespace porter::nn
