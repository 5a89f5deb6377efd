// CpuKernels' construction.
#include "kernels/cpu/cpu_kernels.h"

#include "base/check.h"
#include "kernels/cpu/matmul.h"
#include "kernels/kernel_table.h"

namespace porter::kernels {

CpuKernels::CpuKernels(memory::CachingAllocator& allocator)
    : Kernels(allocator),
      device_(allocator.device()),
      threads_(device_.threads()),
      dnnl_(std::make_unique<DnnlMatmul>(threads_, matmul_layout_from_env(), &kernel_table())),
      attention_impl_(cpu::attention_impl_from_env()) {
  PORTER_CHECK(device_.kind() == memory::DeviceKind::kCpu, "CpuKernels need a cpu device, got ",
               device_.description());
  PORTER_CHECK_GE(threads_, 1, "cpu kernels need at least one thread");
}

CpuKernels::~CpuKernels() = default;

}  // namespace porter::kernels
