// Formatting of memory stats, and the allocation timeline.
#include "memory/memory_stats.h"

#include <cstdio>
#include <ostream>

#include "base/units.h"

namespace porter::memory {

std::string format_stats(const MemoryStats& s) {
  std::string out;
  char line[160];
  std::snprintf(line, sizeof(line), "  %-12s %14s %14s %10s %8s\n", "category", "current",
                "peak", "allocs", "live");
  out += line;
  for (Category c : kAllCategories) {
    const CategoryStats& cs = s[c];
    std::snprintf(line, sizeof(line), "  %-12s %14s %14s %10llu %8llu\n",
                  std::string(category_name(c)).c_str(), format_bytes(cs.current_bytes).c_str(),
                  format_bytes(cs.peak_bytes).c_str(),
                  static_cast<unsigned long long>(cs.alloc_count),
                  static_cast<unsigned long long>(cs.live_count));
    out += line;
  }
  auto row = [&](const char* name, size_t cur, size_t peak) {
    std::snprintf(line, sizeof(line), "  %-12s %14s %14s\n", name, format_bytes(cur).c_str(),
                  format_bytes(peak).c_str());
    out += line;
  };
  row("requested", s.requested_bytes, s.peak_requested_bytes);
  row("allocated", s.allocated_bytes, s.peak_allocated_bytes);
  row("reserved", s.reserved_bytes, s.peak_reserved_bytes);
  std::snprintf(line, sizeof(line),
                "  capacity %s, cached free %s (largest block %s), pending free %s, %llu OOM(s)\n",
                format_bytes(s.capacity_bytes).c_str(), format_bytes(s.cached_free_bytes).c_str(),
                format_bytes(s.largest_free_block_bytes).c_str(),
                format_bytes(s.pending_free_bytes).c_str(),
                static_cast<unsigned long long>(s.num_ooms));
  out += line;
  return out;
}

void Timeline::record(Category c, int64_t delta_bytes, size_t category_bytes) {
  if (entries_.size() >= capacity_) {
    ++dropped_;
    return;
  }
  entries_.push_back(TimelineEntry{time_ns(clock::now()), c, delta_bytes, category_bytes});
}

int64_t Timeline::time_ns(clock::time_point t) const {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t - start_).count();
}

void Timeline::clear() {
  entries_.clear();
  dropped_ = 0;
}

void Timeline::write_csv(std::ostream& out) const {
  out << "time_us,category,delta_bytes,category_bytes\n";
  for (const TimelineEntry& e : entries_) {
    out << (e.time_ns / 1000) << "." << (e.time_ns % 1000 / 100) << "," << category_name(e.category)
        << "," << e.delta_bytes << "," << e.category_bytes << "\n";
  }
  if (dropped_ > 0) out << "# " << dropped_ << " entries dropped (timeline capacity reached)\n";
}

}  // namespace porter::memory
