// make_kernels: the one place that picks the cpu or cuda kernels for a device.
#include "base/build_config.h"
#include "base/check.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/kernels.h"

#if PORTER_WITH_CUDA
#include "kernels/cuda/cuda_kernels.h"
#endif

namespace porter::kernels {

std::unique_ptr<Kernels> make_kernels(memory::CachingAllocator& allocator) {
  memory::Device& device = allocator.device();
  switch (device.kind()) {
    case memory::DeviceKind::kCpu:
      return std::make_unique<CpuKernels>(allocator);
    case memory::DeviceKind::kCuda:
#if PORTER_WITH_CUDA
      return make_cuda_kernels(allocator);
#else
      PORTER_CHECK(false, "make_kernels: a cuda device, but porter was built without CUDA; "
                          "rebuild with -DPORTER_CUDA=ON or use porter.device.type = \"cpu\"");
#endif
  }
  PORTER_CHECK(false, "make_kernels: unknown device kind ", static_cast<int>(device.kind()));
  return nullptr;
}

std::unique_ptr<Kernels> make_kernels(memory::Device& device) {
  // Nobody reads this allocator's timeline (Note [Kernel workspace]).
  memory::AllocatorOptions options;
  options.record_timeline = false;
  auto allocator = std::make_unique<memory::CachingAllocator>(device, options);
  std::unique_ptr<Kernels> kernels = make_kernels(*allocator);
  kernels->owned_allocator_ = std::move(allocator);
  return kernels;
}

}  // namespace porter::kernels
