// make_communicator: the backend for the device's kind (Gloo on cpu, NCCL on cuda).
#include "base/build_config.h"
#include "base/check.h"
#include "comm/communicator.h"
#include "comm/gloo_communicator.h"
#if PORTER_WITH_CUDA
#include "comm/nccl_communicator.h"
#endif

namespace porter::comm {

std::unique_ptr<Communicator> make_communicator(memory::Device& device,
                                                std::shared_ptr<Store> store, int rank,
                                                int size, const CommOptions& options) {
  PORTER_CHECK(store != nullptr, "make_communicator needs a store (TcpStore for processes, "
               "the InMemoryStore of run_thread_ranks for threads)");
  PORTER_CHECK_GE(size, 1, "world size (WORLD_SIZE)");
  PORTER_CHECK(rank >= 0 && rank < size, "rank ", rank, " is not in [0, ", size,
               ") (RANK, WORLD_SIZE)");
  PORTER_CHECK(options.timeout.count() > 0, "porter.comm.timeout_s must be positive, got ",
               options.timeout.count());
  PORTER_CHECK(!options.group_name.empty(), "the communicator's group name is empty");
  switch (device.kind()) {
    case memory::DeviceKind::kCpu:
      return make_gloo_communicator(device, std::move(store), rank, size, options);
    case memory::DeviceKind::kCuda:
#if PORTER_WITH_CUDA
      return make_nccl_communicator(device, std::move(store), rank, size, options);
#else
      break;
#endif
  }
  throw InvalidArgument(str_cat(
      "no communicator backend for ", device.description(),
      ": NCCL needs porter built with CUDA (configure with PORTER_CUDA=ON and nvcc on PATH); "
      "set porter.device.type = \"cpu\" for the Gloo backend"));
}

}  // namespace porter::comm
