// Whether a run's host memory fits the machine: per rank, per node, against the machine's
// memory and the pinned limit.
//
// Note [Host fit]
// Offload moves model states to host memory, and a node runs several ranks, so the device's
// verdict (Note [Forecast]) is half the question. Per rank the host holds
//   states   the offloaded model states (Note [Host-state bytes per rank] in zero/partition.h),
//            pinned or pageable as their pin_memory says;
//   stash    activation offload's pinned slots (the plan's OffloadLayout);
//   device   on the cpu device, the simulated device's memory itself, which the process takes
//            from host memory as the step needs it: the forecast's total peak (the capacity is
//            a bound, not an allocation);
//   snapshot with periodic checkpoints (porter.train.save_every), the copy of the rank's
//            checkpointed state that a background write holds (Note [Background checkpoints]
//            in engine/checkpointer.h): its parameters, master weights and moments, wherever
//            they live (checkpoint_snapshot_bytes).
// and a node holds ranks_per_node of them. The node's total must fit the machine's memory
// (MemTotal: what the kernel can give, swap aside), and each rank's pinned bytes the pinned
// limit (porter.device.pinned_limit, 8 GiB when unset, as the devices bound it). Ranks per node come from the launcher
// (LOCAL_WORLD_SIZE, OpenMPI's local size, porter train --nproc), else --ranks-per-node.
// `porter estimate` prints the figures and the verdict; `porter train` refuses a run that does
// not fit before step 1, naming the node's total and the machine's memory.
#pragma once

#include <cstddef>
#include <optional>
#include <string>

#include "engine/forecast.h"

namespace porter::engine {

struct HostFitInput {
  zero::HostStateBytes states;     // per rank
  size_t pinned_state_bytes = 0;   // of which pinned
  size_t stash_pinned_bytes = 0;   // activation offload's pinned slots per rank
  size_t simulated_device_bytes = 0;  // cpu device: its memory per rank; 0 on cuda
  size_t checkpoint_snapshot_bytes = 0;  // per rank, with periodic checkpoints
  int ranks_per_node = 1;
  size_t machine_bytes = 0;            // the node's memory
  std::optional<size_t> pinned_limit;  // per rank; none: unbounded
};

struct HostFit {
  HostFitInput in;
  size_t per_rank_bytes() const;
  size_t pinned_per_rank_bytes() const;
  size_t per_node_bytes() const;
  bool fits_machine() const { return per_node_bytes() <= in.machine_bytes; }
  bool fits_pinned() const { return !in.pinned_limit || pinned_per_rank_bytes() <= *in.pinned_limit; }
  bool fits() const { return fits_machine() && fits_pinned(); }
  // "host fits: 11.52 GiB per node (8 ranks x 1.44 GiB) of 503.2 GiB" or what does not fit,
  // naming the numbers and the key to change.
  std::string verdict() const;
};

// The host figures of a run whose ranks hold `states` on the host, `stash_pinned_bytes` of
// offloaded activations and a device peak of `device_peak_bytes` (counted on the cpu device
// only), for `ranks_per_node` ranks on a machine of `machine_bytes`.
HostFit host_fit(const RunOptions& run, const zero::HostStateBytes& states,
                 size_t stash_pinned_bytes, size_t device_peak_bytes, int ranks_per_node,
                 size_t machine_bytes);
// The same from a forecast (its host states, its plan's stash, its total peak).
HostFit host_fit(const Forecast& f, int ranks_per_node, size_t machine_bytes);

// The bytes of one rank's checkpoint snapshot: the working parameters and the optimizer
// state (master, moments) the rank holds, on the device and on the host.
size_t checkpoint_snapshot_bytes(const Forecast& f);

// This machine's memory (MemTotal), 0 when unknown.
size_t machine_memory_bytes();

}  // namespace porter::engine
