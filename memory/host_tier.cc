// The host tier interface, its lanes and its pinned and pageable implementations (Note [Host
// tier] in host_tier.h).
#include "memory/host_tier.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include "base/check.h"
#include "base/error.h"
#include "base/log.h"

namespace porter::memory {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

}  // namespace

HostTierStats& HostTierStats::operator+=(const HostTierStats& later) {
  d2h_bytes += later.d2h_bytes;
  h2d_bytes += later.h2d_bytes;
  d2h_copies += later.d2h_copies;
  h2d_copies += later.h2d_copies;
  waits += later.waits;
  wait_s += later.wait_s;
  held_bytes = later.held_bytes;
  peak_held_bytes = std::max(peak_held_bytes, later.peak_held_bytes);
  return *this;
}

// ---- HostLane -------------------------------------------------------------------------

HostLane::HostLane(HostTier& tier, std::string name)
    : tier_(&tier),
      stream_(tier.device().create_stream(std::move(name))),
      point_(tier.device().create_event()) {}

HostLane::~HostLane() = default;

void HostLane::after(Stream& other) {
  other.record(*point_);
  stream_->wait(*point_);
}

void HostLane::count_copy(bool to_host, size_t bytes) {
  HostTierStats s;
  (to_host ? s.d2h_bytes : s.h2d_bytes) = bytes;
  (to_host ? s.d2h_copies : s.h2d_copies) = 1;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.d2h_bytes += s.d2h_bytes;
    stats_.h2d_bytes += s.h2d_bytes;
    stats_.d2h_copies += s.d2h_copies;
    stats_.h2d_copies += s.h2d_copies;
  }
  tier_->add_traffic(s);
}

void HostLane::count_wait(double seconds) {
  last_wait_s_ = seconds;
  HostTierStats s;
  s.waits = 1;
  s.wait_s = seconds;
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.waits;
    stats_.wait_s += seconds;
  }
  tier_->add_traffic(s);
}

void HostLane::to_host(void* host_dst, const void* src, size_t bytes) {
  stream_->copy_async(host_dst, src, bytes);
  count_copy(true, bytes);
}

void HostLane::to_device(void* device_dst, const void* host_src, size_t bytes) {
  stream_->copy_async(device_dst, host_src, bytes);
  count_copy(false, bytes);
}

void HostLane::synchronize() {
  const auto t0 = Clock::now();
  try {
    stream_->synchronize();
  } catch (...) {
    count_wait(seconds_since(t0));
    throw;
  }
  count_wait(seconds_since(t0));
}

void HostLane::wait_on(Stream& stream, const Event& event) {
  const auto t0 = Clock::now();
  stream.wait(event);
  count_wait(seconds_since(t0));
}

HostTierStats HostLane::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

HostTierStats HostLane::take_stats() {
  std::lock_guard<std::mutex> lock(mu_);
  return std::exchange(stats_, HostTierStats{});
}

// ---- HostTier -------------------------------------------------------------------------

HostTier::~HostTier() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!held_.empty()) {
    PORTER_LOG_ERROR("host tier destroyed with {} live block(s): they now dangle", held_.size());
  }
}

HostBlock HostTier::allocate(size_t bytes) {
  if (bytes == 0) return HostBlock();
  void* ptr = store_allocate(bytes);
  size_t held = 0;
  try {
    held = block_bytes(ptr);
  } catch (...) {
    store_free(ptr);
    throw;
  }
  std::lock_guard<std::mutex> lock(mu_);
  held_.emplace(ptr, held);
  stats_.held_bytes += held;
  stats_.peak_held_bytes = std::max(stats_.peak_held_bytes, stats_.held_bytes);
  return HostBlock(this, ptr, bytes);
}

void HostTier::raw_free(void* ptr) {
  if (ptr == nullptr) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = held_.find(ptr);
    PORTER_CHECK_T(UsageError, it != held_.end(), "free of host block ", ptr,
                   ", which this tier did not allocate or has already freed (double free?)");
    stats_.held_bytes -= it->second;
    held_.erase(it);
  }
  store_free(ptr);
}

std::unique_ptr<HostLane> HostTier::open_lane(std::string name) {
  return std::make_unique<HostLane>(*this, std::move(name));
}

HostTierStats HostTier::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void HostTier::add_traffic(const HostTierStats& s) {
  std::lock_guard<std::mutex> lock(mu_);
  const size_t held = stats_.held_bytes;
  stats_ += s;
  stats_.held_bytes = held;
}

// ---- PinnedHostTier -------------------------------------------------------------------

PinnedHostTier::PinnedHostTier(PinnedPool& pool) : HostTier(pool.device()), pool_(&pool) {}

// ---- PageableHostTier -----------------------------------------------------------------

void* PageableHostTier::store_allocate(size_t bytes) {
  auto* p = new std::byte[bytes]();  // zero-filled; std::bad_alloc when the host has no more
  std::lock_guard<std::mutex> lock(mu_);
  sizes_.emplace(p, bytes);
  return p;
}

void PageableHostTier::store_free(void* ptr) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    sizes_.erase(ptr);
  }
  delete[] static_cast<std::byte*>(ptr);
}

size_t PageableHostTier::in_use_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  size_t n = 0;
  for (const auto& [ptr, bytes] : sizes_) n += bytes;
  return n;
}

size_t PageableHostTier::block_bytes(const void* ptr) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = sizes_.find(ptr);
  PORTER_CHECK_T(UsageError, it != sizes_.end(), "block_bytes of host block ", ptr,
                 ", which is not live in this tier");
  return it->second;
}

void PageableHostTier::record_stream(void* ptr, Stream& stream) {
  throw UsageError(str_cat("record_stream of pageable host block ", ptr, " on stream '",
                           stream.name(), "': pageable blocks are freed at once; synchronize the "
                           "stream before freeing, or allocate from a PinnedHostTier, whose frees "
                           "wait for the streams"));
}

}  // namespace porter::memory
