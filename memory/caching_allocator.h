// The caching allocator: device memory for every porter buffer, with accounting by category.
//
// Rules:
// 1. Segments come from the Device and are carved into blocks; see Note [Size classes] in
//    allocator_policy.h for rounding, pools and splitting.
// 2. A request takes the best-fitting free block of its pool (smallest size, then lowest
//    address); a block much larger than the request is split and the tail stays free.
// 3. A freed block merges with its free neighbours in the same segment (coalescing), so
//    freed space is reusable by larger requests.
// 4. A block freed while another stream may use it is reusable only after that stream's
//    event completes; see Note [Deferred free] in deferred_free.h. Such pending blocks join
//    the free pool only when a request finds no fit in it: then the oldest first, each after
//    waiting for its events, until the request fits (Note [Deterministic reuse]).
// 5. When no block fits (pending blocks included) and the device refuses a new segment, the
//    allocator tries a segment of exactly the request, then releases every fully free cached
//    segment and retries. Only then does it throw OutOfMemoryError (Note [Out-of-memory
//    message]) and it stays consistent afterwards.
//
// Note [Deterministic reuse]
// Which block serves a request, and whether the device must give a new segment, depends only
// on the order of allocations and frees on the allocating thread, never on how far another
// stream has got: a block freed with record_stream stays pending (out of the pool) until a
// request misses the pool, and then pending blocks are waited for and returned oldest first,
// one at a time, until the request fits, before any segment is reserved. (The oldest is the
// likeliest to be done already, so the wait is usually none.) Picking up pending blocks whenever their events happened to have
// completed (PyTorch's rule) makes the pool's layout, and so whether a tight device runs out of
// memory, change from run to run: a run that fits at some capacity must fit every time. The
// wait is for copies already queued (the gradients streamed to the host, an offloaded
// checkpoint), and happens only where the pool would otherwise grow.
// 6. Accounting is by Category; the invariants are written above MemoryStats.
// Thread-safe: one mutex guards all state.
#pragma once

#include <chrono>
#include <cstddef>
#include <iosfwd>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "base/error.h"
#include "memory/category.h"
#include "memory/deferred_free.h"
#include "memory/device.h"
#include "memory/memory_stats.h"
#include "memory/pooled_buffer.h"

namespace porter::memory {

class CachingAllocator;

// Move-only owner of one device allocation; frees it on destruction.
class DeviceBuffer : public PooledBuffer<CachingAllocator> {
 public:
  DeviceBuffer() = default;
  Category category() const { return category_; }
  // Moves the allocation to another category (CachingAllocator::retag).
  void retag(Category category);

 private:
  friend class CachingAllocator;
  DeviceBuffer(CachingAllocator* owner, void* data, size_t size, Category category)
      : PooledBuffer(owner, data, size), category_(category) {}

  Category category_ = Category::kWorkspace;
};

struct AllocatorOptions {
  bool record_timeline = true;
  // Debug: when a block returns to the free pool (after any deferred free), fill it with
  // 0xFF bytes, a NaN in f32, bf16 and f16, so a read after release shows up in results.
  // Host-accessible devices (cpu) only; ignored on cuda.
  bool poison_freed = false;
  size_t timeline_capacity = size_t{1} << 20;  // entries
};

// One segment and its blocks, as reported by snapshot().
struct SegmentInfo {
  uintptr_t address;
  size_t size_bytes;
  bool small_pool;
  struct BlockInfo {
    uintptr_t address;
    size_t size_bytes;
    size_t requested_bytes;  // 0 unless allocated
    bool allocated;
    bool pending;  // freed, waiting for other streams
  };
  std::vector<BlockInfo> blocks;  // in address order, covering the segment exactly
};

class CachingAllocator {
 public:
  explicit CachingAllocator(Device& device, AllocatorOptions options = {});
  ~CachingAllocator();
  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;

  // Zero bytes gives an empty buffer. Throws OutOfMemoryError (rule 5).
  DeviceBuffer allocate(size_t bytes, Category category);
  // The same, without an owner object. Free with raw_free.
  void* raw_allocate(size_t bytes, Category category);
  // Throws UsageError for a pointer this allocator did not hand out (or already freed).
  void raw_free(void* ptr);
  void record_stream(void* ptr, Stream& stream);
  // Moves a live allocation to another category (for example a stage's output that the
  // engine holds as a checkpoint). Stats and the timeline see the bytes leave one category
  // and enter the other. Throws UsageError for a pointer this allocator did not hand out.
  void retag(void* ptr, Category category);

  // Returns every fully free cached segment to the device.
  void empty_cache();
  void reset_peak();
  MemoryStats stats() const;
  std::vector<SegmentInfo> snapshot() const;

  // The timeline of (time, category, delta); see Timeline.
  void write_timeline_csv(std::ostream& out) const;
  std::vector<TimelineEntry> timeline() const;
  uint64_t timeline_dropped() const;
  void clear_timeline();
  // `t` on the timeline's clock (TimelineEntry::time_ns), so that other records of a step
  // (op times, copies) line up with the allocator's events. No lock: the clock's origin is
  // fixed when the allocator is made.
  int64_t timeline_ns(std::chrono::steady_clock::time_point t) const {
    return timeline_.time_ns(t);
  }
  int64_t timeline_now_ns() const { return timeline_ns(std::chrono::steady_clock::now()); }

  Device& device() const { return *device_; }

 private:
  struct Block;
  struct BlockLess {
    bool operator()(const Block* a, const Block* b) const;
  };
  using FreeSet = std::set<Block*, BlockLess>;

  Block* find_free_block(FreeSet& pool, size_t size);
  Block* allocate_segment(size_t segment_bytes, bool small);
  Block* take_block(size_t rounded, bool small);
  void release_block(Block* block);  // into the free pool, coalescing
  void release_cached_segments();
  void drain_deferred();  // waits for every pending block and returns it to the pool
  size_t largest_free_block() const;
  MemoryStats stats_locked() const;
  [[noreturn]] void throw_oom(size_t bytes, Category category);

  Device* device_;  // not owned; outlives the allocator
  AllocatorOptions options_;
  mutable std::mutex mu_;  // guards everything below
  FreeSet small_free_;
  FreeSet large_free_;
  std::unordered_map<void*, Block*> live_;
  std::vector<Block*> segments_;  // head blocks; each owns its chain
  DeferredFrees<Block*> deferred_;
  MemoryStats stats_;
  Timeline timeline_;
};

}  // namespace porter::memory
