// The pinned host pool; its rules are numbered in pinned_pool.h.
#include "memory/pinned_pool.h"

#include <algorithm>

#include "base/check.h"
#include "base/log.h"
#include "base/units.h"

namespace porter::memory {

PinnedPool::PinnedPool(Device& device, size_t limit_bytes)
    : device_(&device),
      limit_bytes_(limit_bytes ? limit_bytes : device.pinned_capacity_bytes()),
      deferred_(device) {
  stats_.limit_bytes = limit_bytes_;
}

PinnedPool::~PinnedPool() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!live_.empty()) {
    PORTER_LOG_ERROR("pinned pool destroyed with {} live buffer(s) ({}): they now dangle",
                     live_.size(), format_bytes(stats_.in_use_bytes));
  }
  try {
    deferred_.drain([this](Buffer& b) { device_->free_pinned(b.ptr, b.capacity); });
  } catch (const std::exception& e) {
    PORTER_LOG_ERROR("waiting for deferred pinned frees failed: {}", e.what());
  }
  drop_cache_locked();
  for (auto& [ptr, b] : live_) device_->free_pinned(ptr, b.capacity);
}

PinnedBuffer PinnedPool::allocate(size_t bytes) {
  if (bytes == 0) return PinnedBuffer();
  return PinnedBuffer(this, raw_allocate(bytes), bytes);
}

void PinnedPool::drop_cache_locked() {
  for (auto& [capacity, ptr] : cached_) device_->free_pinned(ptr, capacity);
  cached_.clear();
  stats_.cached_bytes = 0;
}

void PinnedPool::collect_deferred_locked() {
  deferred_.collect([this](Buffer& b) {
    stats_.pending_bytes -= b.capacity;
    stats_.cached_bytes += b.capacity;
    cached_.emplace(b.capacity, b.ptr);
  });
}

void* PinnedPool::raw_allocate(size_t bytes) {
  if (bytes == 0) return nullptr;
  PORTER_CHECK_LE(bytes, SIZE_MAX - kGranularity, "pinned request too large");
  const size_t capacity = round_up(bytes, kGranularity);
  std::lock_guard<std::mutex> lock(mu_);
  collect_deferred_locked();
  ++stats_.num_allocs;

  void* ptr = nullptr;
  size_t got = 0;
  if (auto it = cached_.lower_bound(capacity); it != cached_.end() && it->first <= 2 * capacity) {
    got = it->first;
    ptr = it->second;
    cached_.erase(it);
    stats_.cached_bytes -= got;
    ++stats_.num_reused;
  } else {
    auto held = [&] { return stats_.in_use_bytes + stats_.cached_bytes + stats_.pending_bytes; };
    if (capacity > limit_bytes_ || held() > limit_bytes_ - capacity) drop_cache_locked();
    if ((capacity > limit_bytes_ || held() > limit_bytes_ - capacity) && !deferred_.empty()) {
      deferred_.drain([this](Buffer& b) {
        stats_.pending_bytes -= b.capacity;
        device_->free_pinned(b.ptr, b.capacity);
      });
    }
    if (capacity > limit_bytes_ || held() > limit_bytes_ - capacity) {
      throw_exhausted(bytes, "the pool's limit would be exceeded");
    }
    ptr = device_->allocate_pinned(capacity);
    if (ptr == nullptr) {
      drop_cache_locked();
      ptr = device_->allocate_pinned(capacity);
    }
    if (ptr == nullptr) throw_exhausted(bytes, "the device refused the allocation");
    got = capacity;
    ++stats_.num_device_allocs;
  }
  live_.emplace(ptr, Buffer{ptr, got, {}});
  stats_.in_use_bytes += got;
  stats_.peak_in_use_bytes = std::max(stats_.peak_in_use_bytes, stats_.in_use_bytes);
  return ptr;
}

void PinnedPool::raw_free(void* ptr) {
  if (ptr == nullptr) return;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.find(ptr);
  PORTER_CHECK_T(UsageError, it != live_.end(), "free of pinned buffer ", ptr,
                 ", which this pool did not allocate or has already freed (double free?)");
  Buffer b = std::move(it->second);
  live_.erase(it);
  stats_.in_use_bytes -= b.capacity;
  if (b.streams.empty()) {
    cached_.emplace(b.capacity, b.ptr);
    stats_.cached_bytes += b.capacity;
    return;
  }
  stats_.pending_bytes += b.capacity;
  std::vector<Stream*> streams = std::move(b.streams);
  b.streams.clear();
  deferred_.defer(std::move(b), streams);
}

void PinnedPool::record_stream(void* ptr, Stream& stream) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.find(ptr);
  PORTER_CHECK_T(UsageError, it != live_.end(), "record_stream on pinned buffer ", ptr,
                 ", which is not live in this pool");
  auto& streams = it->second.streams;
  if (std::find(streams.begin(), streams.end(), &stream) == streams.end()) streams.push_back(&stream);
}

void PinnedPool::empty_cache() {
  std::lock_guard<std::mutex> lock(mu_);
  collect_deferred_locked();
  drop_cache_locked();
}

size_t PinnedPool::block_bytes(const void* ptr) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.find(const_cast<void*>(ptr));
  PORTER_CHECK_T(UsageError, it != live_.end(), "block_bytes of pinned buffer ", ptr,
                 ", which is not live in this pool");
  return it->second.capacity;
}

PinnedStats PinnedPool::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void PinnedPool::throw_exhausted(size_t bytes, const char* why) const {
  throw OutOfMemoryError(
      str_cat("pinned host memory exhausted: tried to allocate ", format_bytes(bytes), " (",
              bytes, " bytes) and ", why, ".\n  limit      ", format_bytes(limit_bytes_),
              " (porter.device.pinned_limit)\n  in use     ", format_bytes(stats_.in_use_bytes),
              " in ", live_.size(), " buffer(s)\n  pending    ", format_bytes(stats_.pending_bytes),
              " (waiting for copy streams)\n  device     ", device_->description(),
              "\nhint: raise porter.device.pinned_limit, or offload fewer checkpoints "
              "(raise porter.checkpointing.keep_last_on_device)"),
      bytes);
}

}  // namespace porter::memory
