// The caching allocator's size policy, as pure functions so it can be tested on its own.
//
// Note [Size classes]
// 1. Every request is rounded up to a multiple of kMinBlockSize (512 B), so every block is
//    512-byte aligned within its segment (segments are at least 512-aligned).
// 2. Rounded requests of at most kSmallSize (1 MiB) are served from the small pool, whose
//    segments are kSmallBuffer (2 MiB). Larger ones come from the large pool.
// 3. Large requests under kMinLargeAlloc (10 MiB) get a kLargeBuffer (20 MiB) segment, so
//    several medium tensors share one; larger requests get a segment rounded to 2 MiB.
// 4. When the device cannot give the preferred segment (a nearly full device), a segment of
//    exactly the rounded request is tried before giving up.
// 5. A free block is split only when the remainder is worth keeping: at least 512 B in the
//    small pool, more than 1 MiB in the large pool (smaller tails would only fragment it).
#pragma once

#include <cstddef>

#include "base/units.h"

namespace porter::memory::policy {

inline constexpr size_t kMinBlockSize = 512;
inline constexpr size_t kSmallSize = size_t{1} << 20;
inline constexpr size_t kSmallBuffer = size_t{2} << 20;
inline constexpr size_t kLargeBuffer = size_t{20} << 20;
inline constexpr size_t kMinLargeAlloc = size_t{10} << 20;
inline constexpr size_t kRoundLarge = size_t{2} << 20;

constexpr size_t round_size(size_t bytes) {
  return bytes < kMinBlockSize ? kMinBlockSize : round_up(bytes, kMinBlockSize);
}

constexpr bool is_small(size_t rounded_bytes) { return rounded_bytes <= kSmallSize; }

constexpr size_t preferred_segment_size(size_t rounded_bytes) {
  if (is_small(rounded_bytes)) return kSmallBuffer;
  if (rounded_bytes < kMinLargeAlloc) return kLargeBuffer;
  return round_up(rounded_bytes, kRoundLarge);
}

constexpr size_t minimal_segment_size(size_t rounded_bytes) { return rounded_bytes; }

constexpr bool should_split(size_t block_bytes, size_t rounded_bytes, bool small_pool) {
  size_t remaining = block_bytes - rounded_bytes;
  return small_pool ? remaining >= kMinBlockSize : remaining > kSmallSize;
}

}  // namespace porter::memory::policy
