// Thread ranks: a world of threads in one process sharing an InMemoryStore (the tests).
#include <thread>

#include "base/check.h"
#include "base/log.h"
#include "comm/communicator.h"

namespace porter::comm {

std::vector<std::exception_ptr> run_thread_ranks(
    int world_size, const std::function<void(int rank, std::shared_ptr<Store> store)>& fn,
    Seconds store_timeout) {
  PORTER_CHECK_GE(world_size, 1, "run_thread_ranks: world size");
  auto store = std::make_shared<InMemoryStore>(store_timeout);
  std::vector<std::exception_ptr> errors(static_cast<size_t>(world_size));
  std::vector<std::thread> threads;
  threads.reserve(errors.size());
  for (int r = 0; r < world_size; ++r) {
    threads.emplace_back([&, r] {
      log::set_thread_rank(r);
      try {
        fn(r, store);
      } catch (...) {
        errors[static_cast<size_t>(r)] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

}  // namespace porter::comm
