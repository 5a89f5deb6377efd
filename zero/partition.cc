// ZeRO's flat partition and per-rank model-state bytes (Note [Flat partition]).
#include "zero/partition.h"

#include <algorithm>
#include <string>

#include "base/check.h"
#include "base/checked.h"
#include "memory/pinned_pool.h"
#include "nn/layer.h"

namespace porter::zero {

Partition make_partition(int64_t total_elems, int world_size) {
  PORTER_CHECK(world_size >= 1, "world size must be at least 1, got ", world_size);
  PORTER_CHECK(total_elems >= 0, "a flat buffer of ", total_elems, " elements");
  Partition p;
  p.total_elems = total_elems;
  p.world_size = world_size;
  const int64_t unit = static_cast<int64_t>(world_size) * nn::kParamAlignElems;
  // Note [Checked sizes]: the padding cannot wrap.
  const size_t units = static_cast<size_t>(total_elems / unit + (total_elems % unit != 0 ? 1 : 0));
  p.padded_elems = static_cast<int64_t>(checked_mul(
      units, static_cast<size_t>(unit), "the flat parameter buffer",
      "the model's " + std::to_string(total_elems) + " parameter elements padded to " +
          std::to_string(world_size) + " shards"));
  p.shard_elems = p.padded_elems / world_size;
  return p;
}

StateBytes exact_bytes(const Partition& part, int zero_stage, const StateDTypes& dtypes) {
  PORTER_CHECK(zero_stage >= 0 && zero_stage <= 3, "zero_optimization.stage must be 0..3, got ",
               zero_stage);
  const auto full = static_cast<size_t>(part.padded_elems);
  const auto shard = static_cast<size_t>(part.shard_elems);
  // Note [Checked sizes]: each figure and their total (StateBytes::total) fit 64 bits.
  auto bytes = [&](size_t per_elem, bool sharded, const char* what) {
    const size_t elems = sharded ? shard : full;
    return checked_mul(elems, per_elem, what,
                       std::to_string(elems) + " parameter elements per rank (ZeRO stage " +
                           std::to_string(zero_stage) + ") x " + std::to_string(per_elem) +
                           " bytes");
  };
  StateBytes b;
  b.params = bytes(dtypes.param_bytes(), zero_stage >= 3, "the parameters");
  b.grads = bytes(dtypes.grad_bytes(), zero_stage >= 2, "the gradients");
  b.optimizer = bytes(dtypes.optimizer_bytes(), zero_stage >= 1, "the optimizer state");
  CheckedSum("the model states per rank")
      .add(b.params, "params + grads + optimizer")
      .add(b.grads, "params + grads + optimizer")
      .add(b.optimizer, "params + grads + optimizer");
  return b;
}

HostStateBytes host_state_bytes(const Partition& part, int zero_stage, const StateDTypes& dtypes,
                                bool optimizer_offload, bool param_offload,
                                bool optimizer_pinned, bool param_pinned, double ratio) {
  PORTER_CHECK(!param_offload || zero_stage == 3, "parameter offload needs ZeRO stage 3, got ",
               zero_stage);
  PORTER_CHECK(!optimizer_offload || zero_stage >= 1, "optimizer offload needs ZeRO stage 1-3");
  const auto n = static_cast<size_t>(part.shard_elems);
  const auto h = static_cast<size_t>(offloaded_elems(part.shard_elems, ratio));
  // Note [Checked sizes]: elements x bytes, rounded up to the pinned granularity, and the total.
  auto array = [&](size_t elems, size_t per_elem, bool pinned) {
    constexpr size_t g = memory::PinnedPool::kGranularity;
    const std::string terms = std::to_string(elems) + " offloaded elements per rank x " +
                              std::to_string(per_elem) + " bytes";
    const size_t bytes = checked_mul(elems, per_elem, "the host's model states", terms);
    return pinned ? checked_add(bytes, g - 1, "the host's model states", terms) / g * g : bytes;
  };
  HostStateBytes b;
  if (optimizer_offload) {
    b.optimizer = checked_mul(3, array(h, 4, optimizer_pinned), "the host's optimizer state",
                              "3 arrays of " + std::to_string(h) + " f32 elements");
    b.grads = array(h, dtypes.grad_bytes(), optimizer_pinned);
    if (ratio >= 1.0 && zero_stage >= 2) {  // Note [Streamed gradients]: the staging block
      const auto staging = static_cast<size_t>(std::min<int64_t>(part.shard_elems, kGradStagingElems));
      b.grads = checked_add(b.grads, array(staging, dtypes.grad_bytes(), optimizer_pinned),
                            "the host's model states",
                            "the gradient shard and its staging block");
    }
  }
  if (param_offload) {
    b.params = array(n, dtypes.param_bytes(), param_pinned);
  } else if (optimizer_offload) {
    b.params = array(h, dtypes.param_bytes(), optimizer_pinned);
  }
  CheckedSum("the host's model states per rank")
      .add(b.optimizer, "optimizer + grads + params")
      .add(b.grads, "optimizer + grads + params")
      .add(b.params, "optimizer + grads + params");
  return b;
}

int64_t offloaded_elems(int64_t n, double ratio) {
  PORTER_CHECK(ratio >= 0.0 && ratio <= 1.0, "offload_optimizer.ratio ", ratio, " outside [0, 1]");
  if (ratio >= 1.0) return n;
  return std::min<int64_t>(n, static_cast<int64_t>(static_cast<double>(n) * ratio));
}

StateBytes device_state_bytes(StateBytes exact, const Partition& part, int zero_stage,
                              const StateDTypes& dtypes, bool optimizer_offload, double ratio,
                              bool param_offload) {
  if (optimizer_offload) {
    exact.optimizer = dtypes.optimizer_bytes() *
                      static_cast<size_t>(part.shard_elems - offloaded_elems(part.shard_elems, ratio));
    // Note [Streamed gradients] in zero/host_grads.h: the shard lives on the host only.
    if (ratio >= 1.0 && zero_stage >= 2) exact.grads = 0;
  }
  if (param_offload) exact.params = 0;
  return exact;
}

StateBytes paper_bytes(int64_t num_params, int world_size, int zero_stage,
                       const StateDTypes& dtypes) {
  PORTER_CHECK(zero_stage >= 0 && zero_stage <= 3, "zero_optimization.stage must be 0..3, got ",
               zero_stage);
  PORTER_CHECK(world_size >= 1, "world size must be at least 1, got ", world_size);
  const double psi = static_cast<double>(num_params);
  const double n = world_size;
  auto part = [&](size_t per_elem, bool sharded) {
    return static_cast<size_t>(static_cast<double>(per_elem) * (sharded ? psi / n : psi) + 0.5);
  };
  StateBytes b;
  b.params = part(dtypes.param_bytes(), zero_stage >= 3);
  b.grads = part(dtypes.grad_bytes(), zero_stage >= 2);
  b.optimizer = part(dtypes.optimizer_bytes(), zero_stage >= 1);
  return b;
}

}  // namespace porter::zero
