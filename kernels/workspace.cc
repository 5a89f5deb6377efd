// Kernel workspace: the allocation every kernel's temporaries go through, and the sizes the
// memory model reads (Note [Kernel workspace] in kernels.h).
#include "kernels/workspace.h"

#include "base/check.h"
#include "base/error.h"
#include "memory/category.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/kernel_table.h"

namespace porter::kernels {

Kernels::Kernels(memory::CachingAllocator& allocator)
    : allocator_(&allocator), kernel_table_(std::make_unique<KernelTable>()) {}

Kernels::~Kernels() = default;

memory::DeviceBuffer Kernels::workspace(size_t bytes, const char* op) {
  try {
    return allocator_->allocate(bytes, memory::Category::kWorkspace);
  } catch (const OutOfMemoryError& e) {
    throw OutOfMemoryError(str_cat(op, " needs ", bytes,
                                   " bytes of kernel workspace (Note [Kernel workspace]): ",
                                   e.what()),
                           e.requested_bytes());
  }
}

size_t attention_forward_workspace_bytes(memory::DeviceKind kind, const AttentionCall& call) {
  if (call.batch == 0 || call.seq == 0 || call.channels == 0) return 0;
  switch (kind) {
    case memory::DeviceKind::kCpu:
      return workspace_layout::cpu_attention_forward(call).total_bytes();
    case memory::DeviceKind::kCuda:
      return workspace_layout::kCudaForwardHeadBuffers *
             workspace_layout::cuda_attention(call).head_elems * sizeof(float);
  }
  PORTER_ASSERT(false, "unknown device kind ", static_cast<int>(kind));
  return 0;
}

size_t attention_backward_workspace_bytes(memory::DeviceKind kind, const AttentionCall& call) {
  if (call.batch == 0 || call.seq == 0 || call.channels == 0) return 0;
  switch (kind) {
    case memory::DeviceKind::kCpu:
      return workspace_layout::cpu_attention_backward(call).total_bytes();
    case memory::DeviceKind::kCuda: {
      const workspace_layout::CudaAttention w = workspace_layout::cuda_attention(call);
      return (workspace_layout::kCudaBackwardHeadBuffers * w.head_elems + w.probs_elems) *
             sizeof(float);
    }
  }
  PORTER_ASSERT(false, "unknown device kind ", static_cast<int>(kind));
  return 0;
}

size_t flash_attention_forward_workspace_bytes(memory::DeviceKind, const FlashAttentionCall&) {
  return 0;
}

size_t flash_attention_backward_workspace_bytes(memory::DeviceKind kind,
                                                const FlashAttentionCall& call) {
  if (call.batch == 0 || call.seq == 0 || call.head_dim == 0) return 0;
  const size_t rows = static_cast<size_t>(call.batch * call.heads * call.seq);
  switch (kind) {
    case memory::DeviceKind::kCpu:
      return rows * sizeof(float);
    case memory::DeviceKind::kCuda:
      return workspace_layout::cuda_padded_elems(rows) * sizeof(float);
  }
  PORTER_ASSERT(false, "unknown device kind ", static_cast<int>(kind));
  return 0;
}

size_t matmul_workspace_bytes(memory::DeviceKind kind, const MatmulCall& call) {
  switch (kind) {
    case memory::DeviceKind::kCpu:
      return workspace_layout::cpu_matmul(call).total_elems() * sizeof(float);
    case memory::DeviceKind::kCuda:
      return 0;
  }
  PORTER_ASSERT(false, "unknown device kind ", static_cast<int>(kind));
  return 0;
}

size_t reduction_workspace_bytes(memory::DeviceKind kind, int64_t numel) {
  switch (kind) {
    case memory::DeviceKind::kCpu:
      return static_cast<size_t>(cpu::blocks_of(numel)) * sizeof(double);
    case memory::DeviceKind::kCuda:
      return workspace_layout::kCudaReductionPartials * sizeof(float);
  }
  PORTER_ASSERT(false, "unknown device kind ", static_cast<int>(kind));
  return 0;
}

}  // namespace porter::kernels
