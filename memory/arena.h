// An Arena is one allocation carved into equal slots, so that buffers of one size can be
// taken and returned without fragmenting anything (contiguous_memory_optimization).
//
// Invariants: slot i is [base + i*stride, base + i*stride + slot_bytes), stride is
// slot_bytes rounded up to 512 B; in_use() == number of acquired slots <= num_slots().
// Misuse (releasing a slot twice, touching a slot not acquired, acquiring from a full arena)
// throws UsageError naming the arena and the slot. Thread-safe.
#pragma once

#include <cstddef>
#include <mutex>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "memory/caching_allocator.h"
#include "memory/pinned_pool.h"

namespace porter::memory {

class Arena {
 public:
  // Slots in device memory, taken from the allocator as one allocation of `category`.
  static Arena on_device(CachingAllocator& allocator, std::string name, size_t slot_bytes,
                         size_t num_slots, Category category);
  // Slots in pinned host memory, taken from the pool as one buffer.
  static Arena on_pinned(PinnedPool& pool, std::string name, size_t slot_bytes, size_t num_slots);

  Arena(Arena&& other) noexcept;
  Arena& operator=(Arena&&) = delete;
  ~Arena();

  // The lowest free slot; throws UsageError when every slot is in use.
  size_t acquire();
  std::optional<size_t> try_acquire();
  // Throws UsageError when the slot is out of range or not acquired.
  void release(size_t slot);
  // The slot's memory; throws UsageError when the slot is not acquired.
  void* slot_data(size_t slot) const;

  const std::string& name() const { return name_; }
  size_t slot_bytes() const { return slot_bytes_; }
  size_t stride_bytes() const { return stride_; }
  size_t num_slots() const { return in_use_.size(); }
  size_t in_use() const;
  void* base() const;

 private:
  using Backing = std::variant<DeviceBuffer, PinnedBuffer>;
  Arena(std::string name, size_t slot_bytes, size_t num_slots);
  void check_slot(size_t slot, const char* op) const;

  std::string name_;
  size_t slot_bytes_;
  size_t stride_;
  Backing backing_;
  mutable std::mutex mu_;  // guards in_use_
  std::vector<bool> in_use_;
};

}  // namespace porter::memory
