// Note [Host fit] in host_fit.h.
#include "engine/host_fit.h"

#include <unistd.h>

#include <algorithm>

#include "base/checked.h"
#include "base/units.h"
#include "memory/device.h"

namespace porter::engine {

size_t HostFit::per_rank_bytes() const {
  return CheckedSum("the host's bytes per rank")
      .add(in.states.total(), "model states")
      .add(in.stash_pinned_bytes, "the activation stash")
      .add(in.simulated_device_bytes, "the simulated device")
      .add(in.checkpoint_snapshot_bytes, "the checkpoint snapshot")
      .value();
}

size_t HostFit::pinned_per_rank_bytes() const {
  return CheckedSum("the pinned bytes per rank")
      .add(in.pinned_state_bytes, "model states")
      .add(in.stash_pinned_bytes, "the activation stash")
      .value();
}

size_t HostFit::per_node_bytes() const {
  return checked_mul(per_rank_bytes(), static_cast<size_t>(in.ranks_per_node),
                     "the host's bytes per node", "per rank x ranks per node");
}

std::string HostFit::verdict() const {
  const std::string node = format_bytes(per_node_bytes()) + " per node (" +
                           std::to_string(in.ranks_per_node) + " rank" +
                           (in.ranks_per_node == 1 ? "" : "s") + " x " +
                           format_bytes(per_rank_bytes()) + ")";
  if (!fits_machine()) {
    return "host does not fit: needs " + node + ", " +
           format_bytes(per_node_bytes() - in.machine_bytes) + " more than the machine's " +
           format_bytes(in.machine_bytes);
  }
  if (!fits_pinned()) {
    return "host does not fit: " + format_bytes(pinned_per_rank_bytes()) +
           " pinned per rank, over porter.device.pinned_limit " + format_bytes(*in.pinned_limit) +
           " (raise it, or set pin_memory false in offload_optimizer / offload_param)";
  }
  return "host fits: " + node + " of the machine's " + format_bytes(in.machine_bytes);
}

HostFit host_fit(const RunOptions& run, const zero::HostStateBytes& states,
                 size_t stash_pinned_bytes, size_t device_peak_bytes, int ranks_per_node,
                 size_t machine_bytes) {
  HostFit h;
  h.in.states = states;
  const zero::OptimizerOptions& o = run.optimizer;
  const bool pin_opt = o.offload.enabled && o.offload.pin_memory;
  // The working copy sits with the optimizer's arrays unless the parameters are offloaded
  // (Note [Host-state bytes per rank]).
  const bool pin_params = o.param_offload.enabled ? o.param_offload.pin_memory : pin_opt;
  h.in.pinned_state_bytes =
      (pin_opt ? states.optimizer + states.grads : 0) + (pin_params ? states.params : 0);
  h.in.stash_pinned_bytes = stash_pinned_bytes;
  if (run.device.kind == memory::DeviceKind::kCpu) h.in.simulated_device_bytes = device_peak_bytes;
  h.in.ranks_per_node = std::max(1, ranks_per_node);
  h.in.machine_bytes = machine_bytes;
  // Unset, both devices bound their pinned pool by kDefaultPinnedLimitBytes.
  h.in.pinned_limit = run.pinned_limit_bytes > 0 ? run.pinned_limit_bytes
                                                 : memory::kDefaultPinnedLimitBytes;
  return h;
}

HostFit host_fit(const Forecast& f, int ranks_per_node, size_t machine_bytes) {
  return host_fit(f.run, f.host_states, f.plan.offload.pinned_bytes, f.total_peak_bytes,
                  ranks_per_node, machine_bytes);
}

size_t checkpoint_snapshot_bytes(const Forecast& f) {
  return CheckedSum("the checkpoint snapshot's bytes")
      .add(f.model_states.params, "device params")
      .add(f.model_states.optimizer, "device optimizer state")
      .add(f.host_states.params, "host params")
      .add(f.host_states.optimizer, "host optimizer state")
      .value();
}

size_t machine_memory_bytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES);
  const long page = ::sysconf(_SC_PAGE_SIZE);
  if (pages <= 0 || page <= 0) return 0;
  return static_cast<size_t>(pages) * static_cast<size_t>(page);
}

}  // namespace porter::engine
