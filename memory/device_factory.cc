// make_device(): the one place that knows which device implementations this build has.
#include "base/build_config.h"
#include "base/check.h"
#include "memory/cpu_device.h"
#include "memory/device.h"
#if PORTER_WITH_CUDA
#include "memory/cuda_device.h"
#endif

namespace porter::memory {

std::string_view device_kind_name(DeviceKind kind) {
  return kind == DeviceKind::kCpu ? "cpu" : "cuda";
}

bool cuda_available() {
#if PORTER_WITH_CUDA
  return cuda_device_count() > 0;
#else
  return false;
#endif
}

std::unique_ptr<Device> make_device(const DeviceOptions& options) {
  switch (options.kind) {
    case DeviceKind::kCpu:
      return std::make_unique<CpuDevice>(options);
    case DeviceKind::kCuda:
#if PORTER_WITH_CUDA
      return make_cuda_device(options);
#else
      throw InvalidArgument(
          "porter.device.type is \"cuda\" but this porter was built without CUDA "
          "(PORTER_CUDA=OFF or no nvcc at configure time); rebuild with -DPORTER_CUDA=ON or use "
          "\"cpu\"");
#endif
  }
  throw InvalidArgument("unknown device kind");
}

}  // namespace porter::memory
