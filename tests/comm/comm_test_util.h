// Shared by the comm test binaries: a thread-rank world where every rank has its own small
// cpu device and a Gloo communicator.
#pragma once

#include <gtest/gtest.h>

#include <exception>
#include <functional>
#include <memory>
#include <string>

#include "comm/communicator.h"
#include "memory/device.h"

namespace porter::comm::testing {

inline std::unique_ptr<memory::Device> small_cpu_device() {
  memory::DeviceOptions o;
  o.kind = memory::DeviceKind::kCpu;
  o.memory_limit_bytes = size_t{64} << 20;
  o.pinned_limit_bytes = size_t{16} << 20;
  o.threads = 1;
  return memory::make_device(o);
}

inline std::string what_of(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& ex) {
    return ex.what();
  } catch (...) {
    return "non-std exception";
  }
}

// Runs fn(comm, device) on `world_size` thread ranks; returns each rank's exception.
inline std::vector<std::exception_ptr> run_world(
    int world_size, Seconds timeout,
    const std::function<void(Communicator& comm, memory::Device& device)>& fn) {
  return run_thread_ranks(
      world_size,
      [&](int rank, std::shared_ptr<Store> store) {
        auto device = small_cpu_device();
        CommOptions o;
        o.timeout = timeout;
        auto comm = make_communicator(*device, store, rank, world_size, o);
        fn(*comm, *device);
      },
      timeout);
}

// Like run_world, but every rank must succeed.
inline void run_world_ok(int world_size,
                         const std::function<void(Communicator& comm, memory::Device& device)>& fn,
                         Seconds timeout = Seconds{30}) {
  auto errors = run_world(world_size, timeout, fn);
  for (size_t r = 0; r < errors.size(); ++r) {
    EXPECT_FALSE(errors[r]) << "rank " << r << " of " << world_size << ": "
                            << (errors[r] ? what_of(errors[r]) : "");
  }
}

}  // namespace porter::comm::testing
