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
             "zero_optimization.offload_param.device=\"cpu\" the shard stays in host memory); "
             "at stage 3 the device holds the gathered layers: lower "
             "stage3_max_live_parameters and stage3_prefetch_bucket_size; or use a smaller "
             "porter.model";
    case Category::kGrads:
      return "partition gradients with zero_optimization.stage>=2 (the shard is 4 bytes per "
             "parameter over the data-parallel ranks: at stage 2 or 3, add ranks), keep them in "
             "16 bits with data_types.grad_accum_dtype, or, at stage 2 or 3, set "
             "zero_optimization.offload_optimizer.device=\"cpu\" (the gradients then stream to "
             "host memory)";
    case Category::kOptimizer:
      return "partition optimizer state with zero_optimization.stage>=1, or set "
             "zero_optimization.offload_optimizer.device=\"cpu\"";
    case Category::kActivations:
      return "checkpoint activations (porter.checkpointing.policy \"full\", or \"optimal\" with a "
             "lower memory_budget), or lower train_micro_batch_size_per_gpu";
    case Category::kCheckpoints:
      // partition_activations splits checkpoints over the tensor-parallel ranks only (a
      // warning says it has no effect at porter.model.tensor_parallel 1).
      return "offload checkpoints with activation_checkpointing.cpu_checkpointing=true, or, "
             "with porter.model.tensor_parallel > 1, partition them over the tensor-parallel "
             "ranks with activation_checkpointing.partition_activations=true";
    case Category::kStaging:
      return "lower porter.checkpointing.prefetch_depth";
    case Category::kWorkspace:
      return "lower train_micro_batch_size_per_gpu or porter.model.seq_len";
    case Category::kComm:
      // comm holds the gradient buckets of ZeRO stages 2 and 3, the packed copies the
      // reductions send (Note [Gradient reduction] in zero/reducer.h), and at stages 1 and 2 the
      // staging buffer of the parameter all-gather when allgather_bucket_size is below the
      // rank's shard (Note [Bucketed parameter all-gather] in zero/sharded_optimizer.h). A hint
      // names only keys that change what it counts.
      return "lower zero_optimization.reduce_bucket_size (the gradient buckets and the copies "
             "their reductions send); an allgather_bucket_size below the rank's shard stages the "
             "stage 1-2 parameter all-gather here too (up to that many elements): lower it, or "
             "raise it past the shard to gather in place";
  }
  return "";
}

}  // namespace porter::memory
