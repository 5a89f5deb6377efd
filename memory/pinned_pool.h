// The pinned host pool: page-locked buffers for asynchronous copies, reused by size, within
// a hard limit (porter.device.pinned_limit).
//
// Rules:
// 1. Requests round up to 4 KiB. A cached buffer is reused when it is at least the request
//    and at most twice it (best fit); otherwise a new one comes from the device.
// 2. The pool never holds more than its limit: live + cached + pending <= limit. To make room
//    it first drops cached buffers, then waits for pending deferred frees; if the request
//    still does not fit it throws OutOfMemoryError, naming the limit and the knob.
// 3. Buffers used by copy streams are released after their events (Note [Deferred free]).
// Thread-safe: one mutex guards all state.
#pragma once

#include <cstddef>
#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "base/error.h"
#include "memory/deferred_free.h"
#include "memory/device.h"
#include "memory/pooled_buffer.h"

namespace porter::memory {

class PinnedPool;

// Move-only owner of one pinned buffer; returns it to its pool on destruction.
using PinnedBuffer = PooledBuffer<PinnedPool>;

struct PinnedStats {
  size_t limit_bytes = 0;
  size_t in_use_bytes = 0;  // capacity of live buffers
  size_t peak_in_use_bytes = 0;
  size_t cached_bytes = 0;
  size_t pending_bytes = 0;
  uint64_t num_allocs = 0;
  uint64_t num_reused = 0;  // allocations served from the cache
  uint64_t num_device_allocs = 0;
};

class PinnedPool {
 public:
  static constexpr size_t kGranularity = 4096;

  // limit_bytes 0 means the device's pinned capacity.
  explicit PinnedPool(Device& device, size_t limit_bytes = 0);
  ~PinnedPool();
  PinnedPool(const PinnedPool&) = delete;
  PinnedPool& operator=(const PinnedPool&) = delete;

  PinnedBuffer allocate(size_t bytes);
  void* raw_allocate(size_t bytes);
  void raw_free(void* ptr);
  void record_stream(void* ptr, Stream& stream);
  void empty_cache();
  PinnedStats stats() const;
  Device& device() const { return *device_; }
  // The bytes the pool holds for the live buffer at `ptr`: its block's capacity, which is the
  // request rounded up to kGranularity for a new block, and up to twice the request for a
  // cached block reused (rule 1). Throws UsageError for a pointer that is not live here.
  size_t block_bytes(const void* ptr) const;

 private:
  struct Buffer {
    void* ptr = nullptr;
    size_t capacity = 0;
    std::vector<Stream*> streams;  // not owned
  };

  void drop_cache_locked();
  void collect_deferred_locked();
  [[noreturn]] void throw_exhausted(size_t bytes, const char* why) const;

  Device* device_;  // not owned
  const size_t limit_bytes_;
  mutable std::mutex mu_;  // guards everything below
  std::multimap<size_t, void*> cached_;  // capacity -> buffer
  std::unordered_map<void*, Buffer> live_;
  DeferredFrees<Buffer> deferred_;
  PinnedStats stats_;
};

}  // namespace porter::memory
