// Fixed-slot arenas over one device or pinned allocation.
#include "memory/arena.h"

#include "base/check.h"
#include "base/log.h"
#include "memory/allocator_policy.h"

namespace porter::memory {

namespace {

size_t checked_stride(const std::string& name, size_t slot_bytes, size_t num_slots) {
  PORTER_CHECK(slot_bytes > 0, "arena '", name, "': slot size must be positive");
  PORTER_CHECK(num_slots > 0, "arena '", name, "': needs at least one slot");
  size_t stride = round_up(slot_bytes, policy::kMinBlockSize);
  PORTER_CHECK(stride <= SIZE_MAX / num_slots, "arena '", name, "': ", num_slots, " slots of ",
               slot_bytes, " bytes overflow");
  return stride;
}

}  // namespace

Arena::Arena(std::string name, size_t slot_bytes, size_t num_slots)
    : name_(std::move(name)),
      slot_bytes_(slot_bytes),
      stride_(checked_stride(name_, slot_bytes, num_slots)),
      in_use_(num_slots, false) {}

Arena Arena::on_device(CachingAllocator& allocator, std::string name, size_t slot_bytes,
                       size_t num_slots, Category category) {
  Arena a(std::move(name), slot_bytes, num_slots);
  a.backing_ = allocator.allocate(a.stride_ * num_slots, category);
  return a;
}

Arena Arena::on_pinned(PinnedPool& pool, std::string name, size_t slot_bytes, size_t num_slots) {
  Arena a(std::move(name), slot_bytes, num_slots);
  a.backing_ = pool.allocate(a.stride_ * num_slots);
  return a;
}

Arena::Arena(Arena&& other) noexcept
    : name_(std::move(other.name_)),
      slot_bytes_(other.slot_bytes_),
      stride_(other.stride_),
      backing_(std::move(other.backing_)) {
  std::lock_guard<std::mutex> lock(other.mu_);
  in_use_ = std::move(other.in_use_);
}

Arena::~Arena() {
  size_t n = in_use();
  if (n > 0) PORTER_LOG_WARN("arena '{}' destroyed with {} slot(s) still acquired", name_, n);
}

void* Arena::base() const {
  return std::visit([](const auto& b) { return b.data(); }, backing_);
}

size_t Arena::in_use() const {
  std::lock_guard<std::mutex> lock(mu_);
  size_t n = 0;
  for (bool b : in_use_) n += b ? 1 : 0;
  return n;
}

std::optional<size_t> Arena::try_acquire() {
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t i = 0; i < in_use_.size(); ++i) {
    if (!in_use_[i]) {
      in_use_[i] = true;
      return i;
    }
  }
  return std::nullopt;
}

size_t Arena::acquire() {
  auto slot = try_acquire();
  PORTER_CHECK_T(UsageError, slot.has_value(), "arena '", name_, "': all ", in_use_.size(),
                 " slots of ", slot_bytes_, " bytes are in use; release one first, or size the "
                 "arena for more slots");
  return *slot;
}

void Arena::check_slot(size_t slot, const char* op) const {
  PORTER_CHECK_T(UsageError, slot < in_use_.size(), "arena '", name_, "': ", op, " of slot ", slot,
                 ", but the arena has ", in_use_.size(), " slots");
  PORTER_CHECK_T(UsageError, in_use_[slot], "arena '", name_, "': ", op, " of slot ", slot,
                 ", which is not acquired (released twice, or never acquired)");
}

void Arena::release(size_t slot) {
  std::lock_guard<std::mutex> lock(mu_);
  check_slot(slot, "release");
  in_use_[slot] = false;
}

void* Arena::slot_data(size_t slot) const {
  std::lock_guard<std::mutex> lock(mu_);
  check_slot(slot, "access");
  return static_cast<std::byte*>(base()) + slot * stride_;
}

}  // namespace porter::memory
