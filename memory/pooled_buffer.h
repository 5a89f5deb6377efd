// Move-only owners of one allocation from a pool (the CachingAllocator or the PinnedPool),
// returned to the pool on destruction, and the non-owning MemorySpan.
#pragma once

#include <cstddef>
#include <exception>
#include <utility>

#include "base/log.h"

namespace porter::memory {

class Stream;

// A non-owning view of bytes.
class MemorySpan {
 public:
  MemorySpan() = default;
  MemorySpan(void* data, size_t size_bytes) : data_(static_cast<std::byte*>(data)), size_(size_bytes) {}
  void* data() const { return data_; }
  size_t size_bytes() const { return size_; }
  // Throws InvalidArgument when [offset, offset + bytes) is not inside this span.
  MemorySpan subspan(size_t offset, size_t bytes) const;

 private:
  std::byte* data_ = nullptr;  // not owned
  size_t size_ = 0;
};

// Pool must provide raw_free(void*) and record_stream(void*, Stream&).
template <typename Pool>
class PooledBuffer {
 public:
  PooledBuffer() = default;
  PooledBuffer(PooledBuffer&& other) noexcept { *this = std::move(other); }
  PooledBuffer& operator=(PooledBuffer&& other) noexcept {
    if (this != &other) {
      reset();
      pool_ = std::exchange(other.pool_, nullptr);
      data_ = std::exchange(other.data_, nullptr);
      size_ = std::exchange(other.size_, 0);
    }
    return *this;
  }
  PooledBuffer(const PooledBuffer&) = delete;
  PooledBuffer& operator=(const PooledBuffer&) = delete;
  ~PooledBuffer() { reset(); }

  void* data() const { return data_; }
  template <typename T>
  T* as() const { return static_cast<T*>(data_); }
  size_t size_bytes() const { return size_; }
  bool empty() const { return data_ == nullptr; }
  MemorySpan span() const { return MemorySpan(data_, size_); }
  MemorySpan subspan(size_t offset, size_t bytes) const { return span().subspan(offset, bytes); }

  // Tells the pool that `stream` uses this buffer (Note [Deferred free] in deferred_free.h).
  void record_stream(Stream& stream) const {
    if (pool_ != nullptr && data_ != nullptr) pool_->record_stream(data_, stream);
  }

  // Returns the memory to the pool now (deferred if other streams were recorded).
  void reset() {
    if (pool_ != nullptr && data_ != nullptr) {
      try {
        pool_->raw_free(data_);
      } catch (const std::exception& e) {
        PORTER_LOG_ERROR("returning a buffer to its pool failed: {}", e.what());
      }
    }
    pool_ = nullptr;
    data_ = nullptr;
    size_ = 0;
  }

 protected:
  friend Pool;
  PooledBuffer(Pool* pool, void* data, size_t size) : pool_(pool), data_(data), size_(size) {}
  Pool* pool() const { return pool_; }

 private:
  Pool* pool_ = nullptr;  // not owned; must outlive the buffer
  void* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace porter::memory
