// Deferred release of buffers that other streams may still be using.
//
// Note [Deferred free]
// A buffer is allocated in the order of the compute stream (the host thread). When another
// stream (a copy or comm stream) has been told to use it (record_stream), freeing it must
// not make it reusable until that stream has finished with it. On free we record one event
// per such stream and park the buffer here. collect() releases the buffers whose events have
// all completed, without blocking; drain() waits for them (the allocator does that only
// before declaring out-of-memory). This is PyTorch's recordStream, and the same mechanism
// serves device blocks and pinned host buffers. Not thread-safe: the owner's lock guards it.
#pragma once

#include <deque>
#include <memory>
#include <vector>

#include "memory/device.h"

namespace porter::memory {

template <typename T>
class DeferredFrees {
 public:
  explicit DeferredFrees(Device& device) : device_(&device) {}

  // Records an event on every stream in `streams`; `item` becomes releasable once all of
  // them complete.
  void defer(T item, const std::vector<Stream*>& streams) {
    Entry entry{std::move(item), {}};
    for (Stream* s : streams) {
      std::unique_ptr<Event> e = take_event();
      s->record(*e);
      entry.events.push_back(std::move(e));
    }
    entries_.push_back(std::move(entry));
  }

  // Releases every parked item whose events completed; returns how many.
  template <typename Release>
  size_t collect(Release&& release) {
    size_t n = 0;
    for (auto it = entries_.begin(); it != entries_.end();) {
      if (ready(*it)) {
        finish(*it, release);
        it = entries_.erase(it);
        ++n;
      } else {
        ++it;
      }
    }
    return n;
  }

  // Waits for every parked item's events, then releases them all.
  template <typename Release>
  size_t drain(Release&& release) {
    size_t n = entries_.size();
    for (Entry& e : entries_) {
      for (auto& ev : e.events) ev->synchronize();
      finish(e, release);
    }
    entries_.clear();
    return n;
  }

  // Waits for the oldest parked item's events, then releases it. Nothing when empty.
  template <typename Release>
  void drain_oldest(Release&& release) {
    if (entries_.empty()) return;
    Entry& e = entries_.front();
    for (auto& ev : e.events) ev->synchronize();
    finish(e, release);
    entries_.pop_front();
  }

  bool empty() const { return entries_.empty(); }
  size_t size() const { return entries_.size(); }

 private:
  struct Entry {
    T item;
    std::vector<std::unique_ptr<Event>> events;
  };

  static bool ready(const Entry& e) {
    for (const auto& ev : e.events) {
      if (!ev->query()) return false;
    }
    return true;
  }

  template <typename Release>
  void finish(Entry& e, Release& release) {
    for (auto& ev : e.events) spare_events_.push_back(std::move(ev));
    release(e.item);
  }

  std::unique_ptr<Event> take_event() {
    if (spare_events_.empty()) return device_->create_event();
    std::unique_ptr<Event> e = std::move(spare_events_.back());
    spare_events_.pop_back();
    return e;
  }

  Device* device_;  // not owned; outlives this
  std::deque<Entry> entries_;
  std::vector<std::unique_ptr<Event>> spare_events_;  // recycled: events are not free on cuda
};

}  // namespace porter::memory
