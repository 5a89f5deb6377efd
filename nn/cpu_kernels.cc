// CpuKernels' construction and the scratch memory its kernels share.
#include "nn/cpu_kernels.h"

#include "base/check.h"
#include "nn/cpu_matmul.h"

namespace porter::nn {

CpuKernels::CpuKernels(memory::Device& device)
    : device_(device), threads_(device.threads()), dnnl_(std::make_unique<DnnlMatmul>(threads_)) {
  PORTER_CHECK_GE(threads_, 1, "cpu kernels need at least one thread");
}

CpuKernels::~CpuKernels() = default;

float* CpuKernels::scratch_f32(size_t elems) {
  if (scratch_.size() < elems) scratch_.resize(elems);
  return scratch_.data();
}

}  // namespace porter::nn
