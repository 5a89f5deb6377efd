// The link probe (Note [Link probe] in link_probe.h).
#include "offload/link_probe.h"

#include <algorithm>
#include <chrono>
#include <cstring>

namespace porter::offload {

namespace {

constexpr size_t kLinkProbeMaxBytes = size_t{16} << 20;
constexpr int kLinkProbeRuns = 3;

}  // namespace

double measure_link_bytes_per_s(memory::CachingAllocator& allocator, memory::PinnedPool& pinned,
                                CheckpointStash& stash, size_t bytes) {
  bytes = std::min({bytes, kLinkProbeMaxBytes, pinned.stats().limit_bytes});
  if (bytes == 0) return 0.0;
  double best_s[2] = {0.0, 0.0};
  {
    memory::DeviceBuffer dev = allocator.allocate(bytes, memory::Category::kWorkspace);
    memory::PinnedBuffer host = pinned.allocate(bytes);
    std::memset(host.data(), 0, bytes);
    for (int dir = 0; dir < 2; ++dir) {
      memory::Stream& stream = dir == 0 ? stash.d2h_stream() : stash.h2d_stream();
      for (int run = 0; run < kLinkProbeRuns; ++run) {
        const auto t0 = Clock::now();
        if (dir == 0) {
          stream.copy_async(host.data(), dev.data(), bytes);
        } else {
          stream.copy_async(dev.data(), host.data(), bytes);
        }
        stream.synchronize();
        const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
        if (run == 0 || dt < best_s[dir]) best_s[dir] = dt;
      }
    }
  }
  pinned.empty_cache();
  const double slower_s = std::max({best_s[0], best_s[1], 1e-9});
  return static_cast<double>(bytes) / slower_s;
}

}  // namespace porter::offload
