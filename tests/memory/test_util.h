// Shared helpers for the memory tests.
#pragma once

#include <memory>

#include "base/error.h"
#include "base/units.h"
#include "memory/cpu_device.h"
#include "memory/device.h"

namespace porter::memory::testing {

inline std::unique_ptr<CpuDevice> make_cpu(size_t capacity_bytes, double link_gbps = 0,
                                           size_t pinned_bytes = 64 * kMiB) {
  DeviceOptions o;
  o.memory_limit_bytes = capacity_bytes;
  o.pinned_limit_bytes = pinned_bytes;
  o.sim_link_gbps = link_gbps;
  return std::make_unique<CpuDevice>(o);
}

}  // namespace porter::memory::testing
