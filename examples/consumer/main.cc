// A program outside porter's tree: it budgets a simulated 64 MiB device, allocates by
// category, runs out of memory on purpose, and recovers.
#include <cstdio>

#include <porter/base/build_config.h>
#include <porter/memory/caching_allocator.h>
#include <porter/memory/device.h>

int main() {
  using namespace porter::memory;
  DeviceOptions options;
  options.kind = DeviceKind::kCpu;
  options.memory_limit_bytes = 64u << 20;
  auto device = make_device(options);
  CachingAllocator allocator(*device);

  DeviceBuffer params = allocator.allocate(16u << 20, Category::kParams);
  DeviceBuffer acts = allocator.allocate(40u << 20, Category::kActivations);
  try {
    DeviceBuffer too_much = allocator.allocate(16u << 20, Category::kWorkspace);
    std::printf("unexpected: the 64 MiB device accepted 72 MiB\n");
    return 1;
  } catch (const porter::OutOfMemoryError& e) {
    std::printf("porter %s caught the expected out-of-memory:\n%s\n", PORTER_VERSION, e.what());
  }
  acts.reset();
  DeviceBuffer retry = allocator.allocate(16u << 20, Category::kWorkspace);
  std::printf("after freeing activations the retry succeeded:\n%s",
              format_stats(allocator.stats()).c_str());
  return retry.empty() ? 1 : 0;
}
