// Category names and the knob that lowers each one.
#include "memory/category.h"

namespace porter::memory {

std::optional<Category> category_from_name(std::string_view name) {
  for (Category c : kAllCategories) {
    if (category_name(c) == name) return c;
  }
  return std::nullopt;
}

std::string_view category_hint(Category c) {
  switch (c) {
    case Category::kParams:
      return "partition parameters with zero_optimization.stage=3 (with "
             "zero_optimization.offload_param.device=\"cpu\" the shard stays in host memory), "
             "or use a smaller porter.model";
    case Category::kGrads:
      return "partition gradients with zero_optimization.stage>=2 (the shard is 4 bytes per "
             "parameter over the data-parallel ranks: at stage 2 or 3, add ranks)";
    case Category::kOptimizer:
      return "partition optimizer state with zero_optimization.stage>=1, or set "
             "zero_optimization.offload_optimizer.device=\"cpu\"";
    case Category::kActivations:
      return "checkpoint activations (porter.checkpointing.policy \"full\", or \"optimal\" with a "
             "lower memory_budget), or lower train_micro_batch_size_per_gpu";
    case Category::kCheckpoints:
      return "offload checkpoints with activation_checkpointing.cpu_checkpointing=true, or "
             "partition them with activation_checkpointing.partition_activations=true";
    case Category::kStaging:
      return "lower porter.checkpointing.prefetch_depth";
    case Category::kWorkspace:
      return "lower train_micro_batch_size_per_gpu or porter.model.seq_len";
    case Category::kComm:
      return "lower zero_optimization.reduce_bucket_size and allgather_bucket_size";
  }
  return "";
}

}  // namespace porter::memory
