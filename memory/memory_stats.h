// Memory accounting: per-category current/peak bytes, allocator-wide totals, and a timeline.
//
// Invariants (checked by tests/memory against a reference model):
//   sum over categories of current_bytes  == sum of requested bytes of live allocations
//   allocated_bytes                       == sum of block sizes of live allocations
//   reserved_bytes == allocated_bytes + cached_free_bytes + pending_free_bytes
//   activation_bytes == current bytes of activations + checkpoints + staging
//   peak_x >= x for every tracked x; reset_peak() sets peak_x = x
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <iosfwd>
#include <string>
#include <vector>

#include "memory/category.h"

namespace porter::memory {

struct CategoryStats {
  size_t current_bytes = 0;  // requested bytes of live allocations
  size_t peak_bytes = 0;
  uint64_t alloc_count = 0;  // allocations made since creation
  uint64_t live_count = 0;   // allocations alive now
};

struct MemoryStats {
  std::array<CategoryStats, kNumCategories> by_category{};

  size_t capacity_bytes = 0;
  size_t requested_bytes = 0;       // sum of current_bytes over categories
  size_t peak_requested_bytes = 0;  // peak of the sum, not the sum of peaks
  size_t allocated_bytes = 0;       // block bytes of live allocations (after rounding)
  size_t peak_allocated_bytes = 0;
  size_t reserved_bytes = 0;        // segments held from the device
  size_t peak_reserved_bytes = 0;
  size_t cached_free_bytes = 0;     // reserved, free, reusable now
  size_t pending_free_bytes = 0;    // freed, waiting for other streams' events
  size_t largest_free_block_bytes = 0;
  // The activation footprint: activations + checkpoints + staging, with the peak of that
  // sum. A checkpoint policy moves bytes between them (CachingAllocator::retag), so the
  // sum's peak is what a policy is judged by (docs/memory-model.md).
  size_t activation_bytes = 0;
  size_t peak_activation_bytes = 0;

  uint64_t num_segments = 0;
  uint64_t num_segment_allocs = 0;
  uint64_t num_segment_frees = 0;
  uint64_t num_cache_flushes = 0;   // times cached segments were released to satisfy a request
  uint64_t num_ooms = 0;

  const CategoryStats& operator[](Category c) const { return by_category[index_of(c)]; }
  CategoryStats& operator[](Category c) { return by_category[index_of(c)]; }
};

// A human-readable table of the stats (one line per category, then totals).
std::string format_stats(const MemoryStats& stats);

struct TimelineEntry {
  int64_t time_ns;        // since the allocator was created
  Category category;
  int64_t delta_bytes;    // +requested on allocation, -requested on free
  size_t category_bytes;  // the category's current bytes after this change
};

// A bounded record of allocation events. When full, later entries are counted as dropped
// rather than silently lost.
class Timeline {
 public:
  explicit Timeline(size_t capacity) : capacity_(capacity) {}

  void record(Category c, int64_t delta_bytes, size_t category_bytes);
  const std::vector<TimelineEntry>& entries() const { return entries_; }
  uint64_t dropped() const { return dropped_; }
  // Empties the record; the clock keeps its origin, so later times continue from earlier ones.
  void clear();
  // A steady_clock time on this timeline's clock: nanoseconds since the timeline was made.
  int64_t time_ns(std::chrono::steady_clock::time_point t) const;

  // CSV with a header: time_us,category,delta_bytes,category_bytes.
  void write_csv(std::ostream& out) const;

 private:
  using clock = std::chrono::steady_clock;
  size_t capacity_;
  clock::time_point start_ = clock::now();
  std::vector<TimelineEntry> entries_;
  uint64_t dropped_ = 0;
};

}  // namespace porter::memory
