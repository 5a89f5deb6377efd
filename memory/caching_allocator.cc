// The caching allocator; its rules are numbered in caching_allocator.h.
#include "memory/caching_allocator.h"

#include <algorithm>
#include <cstring>
#include <ostream>

#include "base/check.h"
#include "base/log.h"
#include "base/units.h"
#include "memory/allocator_policy.h"

namespace porter::memory {

// A run of bytes inside a segment. The blocks of a segment form a doubly linked list in
// address order that covers the segment exactly; the head (prev == nullptr) is never
// deleted while the segment lives, because merging always keeps the lower-address block.
struct CachingAllocator::Block {
  std::byte* ptr = nullptr;
  size_t size = 0;           // bytes, a multiple of kMinBlockSize
  size_t requested = 0;      // bytes asked for, when allocated
  size_t segment_size = 0;   // on head blocks: the whole segment's size
  bool small = false;        // which pool
  bool allocated = false;
  bool pending = false;      // freed, parked in deferred_ until other streams finish
  Category category = Category::kWorkspace;
  Block* prev = nullptr;     // owned by the segment chain
  Block* next = nullptr;
  std::vector<Stream*> streams;  // not owned: streams recorded with record_stream

  bool is_free() const { return !allocated && !pending; }
};

bool CachingAllocator::BlockLess::operator()(const Block* a, const Block* b) const {
  if (a->size != b->size) return a->size < b->size;
  return a->ptr < b->ptr;
}

// ---- MemorySpan -----------------------------------------------------------------------

MemorySpan MemorySpan::subspan(size_t offset, size_t bytes) const {
  PORTER_CHECK(offset <= size_ && bytes <= size_ - offset, "subspan [", offset, ", ", offset,
               " + ", bytes, ") is outside a span of ", size_, " bytes");
  return MemorySpan(data_ + offset, bytes);
}

// ---- CachingAllocator -----------------------------------------------------------------

CachingAllocator::CachingAllocator(Device& device, AllocatorOptions options)
    : device_(&device),
      options_(options),
      deferred_(device),
      timeline_(options.record_timeline ? options.timeline_capacity : 0) {
  PORTER_CHECK_EQ(device.segment_alignment() % policy::kMinBlockSize == 0 ||
                      policy::kMinBlockSize % device.segment_alignment() == 0,
                  true, "device segment alignment must be compatible with 512-byte blocks");
  stats_.capacity_bytes = device.memory_capacity_bytes();
}

CachingAllocator::~CachingAllocator() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!live_.empty()) {
    PORTER_LOG_ERROR("caching allocator destroyed with {} live allocation(s) ({}): they now dangle",
                     live_.size(), format_bytes(stats_.requested_bytes));
  }
  try {
    deferred_.drain([](Block*) {});
  } catch (const std::exception& e) {
    PORTER_LOG_ERROR("waiting for deferred frees failed: {}", e.what());
  }
  for (Block* head : segments_) {
    device_->free_segment(head->ptr, head->segment_size);
    for (Block* b = head; b != nullptr;) {
      Block* next = b->next;
      delete b;
      b = next;
    }
  }
}

void DeviceBuffer::retag(Category category) {
  if (pool() != nullptr && data() != nullptr) pool()->retag(data(), category);
  category_ = category;
}

DeviceBuffer CachingAllocator::allocate(size_t bytes, Category category) {
  if (bytes == 0) return DeviceBuffer();
  void* p = raw_allocate(bytes, category);
  return DeviceBuffer(this, p, bytes, category);
}

CachingAllocator::Block* CachingAllocator::find_free_block(FreeSet& pool, size_t size) {
  Block key;
  key.size = size;
  key.ptr = nullptr;
  auto it = pool.lower_bound(&key);
  if (it == pool.end()) return nullptr;
  Block* b = *it;
  pool.erase(it);
  return b;
}

CachingAllocator::Block* CachingAllocator::allocate_segment(size_t segment_bytes, bool small) {
  void* p = device_->allocate_segment(segment_bytes);
  if (p == nullptr) return nullptr;
  PORTER_ASSERT(reinterpret_cast<uintptr_t>(p) % policy::kMinBlockSize == 0,
                "device returned a segment that is not 512-byte aligned");
  auto* b = new Block;
  b->ptr = static_cast<std::byte*>(p);
  b->size = segment_bytes;
  b->segment_size = segment_bytes;
  b->small = small;
  segments_.push_back(b);
  stats_.reserved_bytes += segment_bytes;
  stats_.peak_reserved_bytes = std::max(stats_.peak_reserved_bytes, stats_.reserved_bytes);
  ++stats_.num_segments;
  ++stats_.num_segment_allocs;
  return b;
}

CachingAllocator::Block* CachingAllocator::take_block(size_t rounded, bool small) {
  if (Block* b = find_free_block(small ? small_free_ : large_free_, rounded)) return b;
  size_t preferred = policy::preferred_segment_size(rounded);
  if (Block* b = allocate_segment(preferred, small)) return b;
  size_t minimal = policy::minimal_segment_size(rounded);
  if (minimal != preferred) return allocate_segment(minimal, small);
  return nullptr;
}

void* CachingAllocator::raw_allocate(size_t bytes, Category category) {
  if (bytes == 0) return nullptr;
  const size_t rounded = policy::round_size(bytes);
  const bool small = policy::is_small(rounded);
  std::lock_guard<std::mutex> lock(mu_);
  // Rule 4 (Note [Deterministic reuse]): pending blocks join the pool only when the pool has
  // no fit, all of them at once, after their streams finished with them.
  FreeSet& pool = small ? small_free_ : large_free_;
  Block* b = find_free_block(pool, rounded);
  while (b == nullptr && !deferred_.empty()) {
    deferred_.drain_oldest([this](Block* d) {
      stats_.pending_free_bytes -= d->size;
      release_block(d);
    });
    b = find_free_block(pool, rounded);
  }
  if (b == nullptr) b = take_block(rounded, small);
  if (b == nullptr) {
    release_cached_segments();
    ++stats_.num_cache_flushes;
    b = take_block(rounded, small);
  }
  if (b == nullptr) throw_oom(bytes, category);

  if (policy::should_split(b->size, rounded, small)) {
    auto* rest = new Block;
    rest->ptr = b->ptr + rounded;
    rest->size = b->size - rounded;
    rest->small = small;
    rest->prev = b;
    rest->next = b->next;
    if (rest->next != nullptr) rest->next->prev = rest;
    b->next = rest;
    b->size = rounded;
    // b was free, so its old neighbour is not (free neighbours are always merged).
    (small ? small_free_ : large_free_).insert(rest);
  }
  b->allocated = true;
  b->requested = bytes;
  b->category = category;
  live_.emplace(b->ptr, b);

  CategoryStats& cs = stats_[category];
  cs.current_bytes += bytes;
  cs.peak_bytes = std::max(cs.peak_bytes, cs.current_bytes);
  ++cs.alloc_count;
  ++cs.live_count;
  stats_.requested_bytes += bytes;
  stats_.peak_requested_bytes = std::max(stats_.peak_requested_bytes, stats_.requested_bytes);
  stats_.allocated_bytes += b->size;
  stats_.peak_allocated_bytes = std::max(stats_.peak_allocated_bytes, stats_.allocated_bytes);
  if (is_activation(category)) {
    stats_.activation_bytes += bytes;
    stats_.peak_activation_bytes = std::max(stats_.peak_activation_bytes, stats_.activation_bytes);
  }
  if (options_.record_timeline) {
    timeline_.record(category, static_cast<int64_t>(bytes), cs.current_bytes);
  }
  return b->ptr;
}

void CachingAllocator::retag(void* ptr, Category category) {
  if (ptr == nullptr) return;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.find(ptr);
  PORTER_CHECK_T(UsageError, it != live_.end(), "retag of ", ptr,
                 ", which this allocator did not allocate or has already freed");
  Block* b = it->second;
  if (b->category == category) return;
  CategoryStats& from = stats_[b->category];
  CategoryStats& to = stats_[category];
  from.current_bytes -= b->requested;
  --from.live_count;
  to.current_bytes += b->requested;
  to.peak_bytes = std::max(to.peak_bytes, to.current_bytes);
  ++to.live_count;
  if (is_activation(b->category) != is_activation(category)) {
    if (is_activation(category)) {
      stats_.activation_bytes += b->requested;
      stats_.peak_activation_bytes =
          std::max(stats_.peak_activation_bytes, stats_.activation_bytes);
    } else {
      stats_.activation_bytes -= b->requested;
    }
  }
  if (options_.record_timeline) {
    timeline_.record(b->category, -static_cast<int64_t>(b->requested), from.current_bytes);
    timeline_.record(category, static_cast<int64_t>(b->requested), to.current_bytes);
  }
  b->category = category;
}

void CachingAllocator::raw_free(void* ptr) {
  if (ptr == nullptr) return;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.find(ptr);
  PORTER_CHECK_T(UsageError, it != live_.end(), "free of ", ptr,
                 ", which this allocator did not allocate or has already freed (double free?)");
  Block* b = it->second;
  live_.erase(it);

  CategoryStats& cs = stats_[b->category];
  cs.current_bytes -= b->requested;
  --cs.live_count;
  stats_.requested_bytes -= b->requested;
  stats_.allocated_bytes -= b->size;
  if (is_activation(b->category)) stats_.activation_bytes -= b->requested;
  if (options_.record_timeline) {
    timeline_.record(b->category, -static_cast<int64_t>(b->requested), cs.current_bytes);
  }
  b->allocated = false;
  b->requested = 0;
  if (b->streams.empty()) {
    release_block(b);
    return;
  }
  b->pending = true;
  stats_.pending_free_bytes += b->size;
  std::vector<Stream*> streams = std::move(b->streams);
  b->streams.clear();
  deferred_.defer(b, streams);
}

void CachingAllocator::record_stream(void* ptr, Stream& stream) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.find(ptr);
  PORTER_CHECK_T(UsageError, it != live_.end(), "record_stream on ", ptr,
                 ", which is not a live allocation of this allocator");
  if (&stream == &device_->compute_stream()) return;  // the allocation stream itself
  auto& streams = it->second->streams;
  if (std::find(streams.begin(), streams.end(), &stream) == streams.end()) streams.push_back(&stream);
}

void CachingAllocator::release_block(Block* b) {
  FreeSet& pool = b->small ? small_free_ : large_free_;
  b->pending = false;
  if (options_.poison_freed && device_->host_accessible()) std::memset(b->ptr, 0xFF, b->size);
  if (b->next != nullptr && b->next->is_free()) {
    Block* n = b->next;
    pool.erase(n);
    b->size += n->size;
    b->next = n->next;
    if (b->next != nullptr) b->next->prev = b;
    delete n;
  }
  if (b->prev != nullptr && b->prev->is_free()) {
    Block* p = b->prev;
    pool.erase(p);
    p->size += b->size;
    p->next = b->next;
    if (p->next != nullptr) p->next->prev = p;
    delete b;
    b = p;
  }
  pool.insert(b);
}

void CachingAllocator::drain_deferred() {
  deferred_.drain([this](Block* d) {
    stats_.pending_free_bytes -= d->size;
    release_block(d);
  });
}

void CachingAllocator::release_cached_segments() {
  auto whole_and_free = [](const Block* head) {
    return head->next == nullptr && head->is_free() && head->size == head->segment_size;
  };
  std::vector<Block*> kept;
  kept.reserve(segments_.size());
  for (Block* head : segments_) {
    if (!whole_and_free(head)) {
      kept.push_back(head);
      continue;
    }
    (head->small ? small_free_ : large_free_).erase(head);
    device_->free_segment(head->ptr, head->segment_size);
    stats_.reserved_bytes -= head->segment_size;
    --stats_.num_segments;
    ++stats_.num_segment_frees;
    delete head;
  }
  segments_ = std::move(kept);
}

void CachingAllocator::empty_cache() {
  std::lock_guard<std::mutex> lock(mu_);
  drain_deferred();  // Note [Deterministic reuse]
  release_cached_segments();
}

void CachingAllocator::reset_peak() {
  std::lock_guard<std::mutex> lock(mu_);
  for (CategoryStats& cs : stats_.by_category) cs.peak_bytes = cs.current_bytes;
  stats_.peak_requested_bytes = stats_.requested_bytes;
  stats_.peak_allocated_bytes = stats_.allocated_bytes;
  stats_.peak_reserved_bytes = stats_.reserved_bytes;
  stats_.peak_activation_bytes = stats_.activation_bytes;
}

size_t CachingAllocator::largest_free_block() const {
  size_t largest = 0;
  if (!small_free_.empty()) largest = (*small_free_.rbegin())->size;
  if (!large_free_.empty()) largest = std::max(largest, (*large_free_.rbegin())->size);
  return largest;
}

MemoryStats CachingAllocator::stats_locked() const {
  MemoryStats s = stats_;
  s.cached_free_bytes = 0;
  for (const FreeSet* pool : {&small_free_, &large_free_}) {
    for (const Block* b : *pool) s.cached_free_bytes += b->size;
  }
  s.largest_free_block_bytes = largest_free_block();
  return s;
}

MemoryStats CachingAllocator::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_locked();
}

std::vector<SegmentInfo> CachingAllocator::snapshot() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<SegmentInfo> out;
  for (const Block* head : segments_) {
    SegmentInfo seg{reinterpret_cast<uintptr_t>(head->ptr), head->segment_size, head->small, {}};
    for (const Block* b = head; b != nullptr; b = b->next) {
      seg.blocks.push_back({reinterpret_cast<uintptr_t>(b->ptr), b->size, b->requested,
                            b->allocated, b->pending});
    }
    out.push_back(std::move(seg));
  }
  std::sort(out.begin(), out.end(),
            [](const SegmentInfo& a, const SegmentInfo& b) { return a.address < b.address; });
  return out;
}

void CachingAllocator::write_timeline_csv(std::ostream& out) const {
  std::lock_guard<std::mutex> lock(mu_);
  timeline_.write_csv(out);
}

std::vector<TimelineEntry> CachingAllocator::timeline() const {
  std::lock_guard<std::mutex> lock(mu_);
  return timeline_.entries();
}

uint64_t CachingAllocator::timeline_dropped() const {
  std::lock_guard<std::mutex> lock(mu_);
  return timeline_.dropped();
}

void CachingAllocator::clear_timeline() {
  std::lock_guard<std::mutex> lock(mu_);
  timeline_.clear();
}

// Note [Out-of-memory message]
// The message accounts for every byte of the device: what each category holds, what the
// allocator has reserved but is not using (and the largest piece of it, which is what a
// request actually needs), what waits on other streams, and what the device has never
// handed out. It ends with the knob that lowers the largest category, because that is the
// first thing a user can change.
void CachingAllocator::throw_oom(size_t bytes, Category category) {
  ++stats_.num_ooms;
  const MemoryStats s = stats_locked();
  std::string msg = str_cat("out of memory on ", device_->description(), ": tried to allocate ",
                            format_bytes(bytes), " (", bytes, " bytes) for ",
                            category_name(category), ".\n");
  msg += str_cat("  capacity            ", format_bytes(s.capacity_bytes), "\n");
  msg += str_cat("  allocated           ", format_bytes(s.requested_bytes), " requested, ",
                 format_bytes(s.allocated_bytes), " in blocks:\n");
  Category largest = category;
  size_t largest_bytes = 0;
  for (Category c : kAllCategories) {
    const CategoryStats& cs = s[c];
    msg += str_cat("    ", category_name(c), std::string(12 - category_name(c).size(), ' '),
                   format_bytes(cs.current_bytes), " (", cs.current_bytes, " bytes, ",
                   cs.live_count, " allocations)\n");
    if (cs.current_bytes > largest_bytes) {
      largest_bytes = cs.current_bytes;
      largest = c;
    }
  }
  msg += str_cat("  reserved but free   ", format_bytes(s.cached_free_bytes),
                 " (largest free block ", format_bytes(s.largest_free_block_bytes), ")\n");
  msg += str_cat("  pending free        ", format_bytes(s.pending_free_bytes),
                 " (waiting for other streams)\n");
  size_t unreserved = s.capacity_bytes > s.reserved_bytes ? s.capacity_bytes - s.reserved_bytes : 0;
  msg += str_cat("  never reserved      ", format_bytes(unreserved), "\n");
  if (largest_bytes == 0) {
    msg += str_cat("hint: the request alone exceeds what the device can give; raise "
                   "porter.device.memory_limit or ",
                   category_hint(category));
  } else {
    msg += str_cat("hint: the largest category is ", category_name(largest), " (",
                   format_bytes(largest_bytes), "); to lower it, ", category_hint(largest));
  }
  throw OutOfMemoryError(msg, bytes);
}

}  // namespace porter::memory
