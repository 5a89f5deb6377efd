// The simulated cpu device: capacity-limited host memory, thread streams, signal events.
#include "memory/cpu_device.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "base/check.h"
#include "base/log.h"
#include "base/units.h"

namespace porter::memory {

// ---- CpuSignal / CpuEvent -------------------------------------------------------------

void CpuSignal::set() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    done_.store(true, std::memory_order_release);
  }
  cv_.notify_all();
}

void CpuSignal::wait() const {
  if (is_set()) return;
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] { return is_set(); });
}

bool CpuEvent::query() const {
  auto s = current();
  return s == nullptr || s->is_set();
}

void CpuEvent::synchronize() const {
  if (auto s = current()) s->wait();
}

std::shared_ptr<CpuSignal> CpuEvent::current() const {
  std::lock_guard<std::mutex> lock(mu_);
  return signal_;
}

void CpuEvent::reset(std::shared_ptr<CpuSignal> signal) {
  std::lock_guard<std::mutex> lock(mu_);
  signal_ = std::move(signal);
}

namespace {

CpuEvent& as_cpu_event(Event& event) {
  auto* e = dynamic_cast<CpuEvent*>(&event);
  PORTER_CHECK_T(UsageError, e != nullptr, "an event of another device was used on a cpu stream");
  return *e;
}

const CpuEvent& as_cpu_event(const Event& event) {
  auto* e = dynamic_cast<const CpuEvent*>(&event);
  PORTER_CHECK_T(UsageError, e != nullptr, "an event of another device was used on a cpu stream");
  return *e;
}

}  // namespace

// ---- CpuComputeStream -----------------------------------------------------------------

void CpuComputeStream::copy_async(void* dst, const void* src, size_t bytes) {
  if (bytes > 0) std::memcpy(dst, src, bytes);
}

void CpuComputeStream::record(Event& event) {
  auto signal = std::make_shared<CpuSignal>();
  signal->set();  // the calling thread has already reached this point
  as_cpu_event(event).reset(std::move(signal));
}

void CpuComputeStream::wait(const Event& event) { as_cpu_event(event).synchronize(); }

// ---- CpuCopyStream --------------------------------------------------------------------

namespace {

// Validated before the worker thread starts: a constructor that throws after starting it
// would destroy a joinable std::thread.
double checked_link_gbps(double gbps) {
  PORTER_CHECK_GE(gbps, 0.0, "simulated link bandwidth (porter.device.sim_link_gbps)");
  return gbps;
}

}  // namespace

CpuCopyStream::CpuCopyStream(std::string name, double link_gbps)
    : name_(std::move(name)), link_gbps_(checked_link_gbps(link_gbps)), worker_([this] { run(); }) {}

CpuCopyStream::~CpuCopyStream() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  worker_.join();  // drains the queue first, so queued copies and signals are never lost
  if (error_) {
    try {
      std::rethrow_exception(error_);
    } catch (const std::exception& e) {
      PORTER_LOG_ERROR("copy stream '{}' destroyed with an unreported error: {}", name_, e.what());
    }
  }
}

void CpuCopyStream::enqueue(Op op) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(op));
  }
  cv_.notify_all();
}

void CpuCopyStream::copy_async(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return;
  PORTER_CHECK(dst != nullptr && src != nullptr, "copy of ", bytes, " bytes with a null pointer");
  enqueue(Copy{dst, src, bytes});
}

void CpuCopyStream::record(Event& event) {
  auto signal = std::make_shared<CpuSignal>();
  as_cpu_event(event).reset(signal);
  enqueue(Signal{std::move(signal)});
}

void CpuCopyStream::wait(const Event& event) {
  auto signal = as_cpu_event(event).current();
  if (signal == nullptr || signal->is_set()) return;
  enqueue(Wait{std::move(signal)});
}

void CpuCopyStream::host_callback(std::function<void()> fn) { enqueue(Callback{std::move(fn)}); }

void CpuCopyStream::synchronize() {
  auto signal = std::make_shared<CpuSignal>();
  enqueue(Signal{signal});
  signal->wait();
  std::exception_ptr error;
  {
    std::lock_guard<std::mutex> lock(mu_);
    std::swap(error, error_);
  }
  if (error) std::rethrow_exception(error);
}

void CpuCopyStream::do_copy(const Copy& c) {
  if (link_gbps_ <= 0) {
    std::memcpy(c.dst, c.src, c.bytes);
    return;
  }
  using clock = std::chrono::steady_clock;
  // See Note [Simulated link].
  constexpr size_t kChunkBytes = 256 * 1024;
  const auto start = std::max(clock::now(), link_free_at_);
  auto* dst = static_cast<char*>(c.dst);
  const auto* src = static_cast<const char*>(c.src);
  for (size_t off = 0; off < c.bytes; off += kChunkBytes) {
    size_t n = std::min(kChunkBytes, c.bytes - off);
    std::memcpy(dst + off, src + off, n);
    auto due = start + std::chrono::nanoseconds(
                           static_cast<int64_t>(static_cast<double>(off + n) / link_gbps_));
    std::this_thread::sleep_until(due);
  }
  link_free_at_ =
      start + std::chrono::nanoseconds(static_cast<int64_t>(static_cast<double>(c.bytes) / link_gbps_));
}

void CpuCopyStream::run() {
  for (;;) {
    Op op;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop_ and drained
      op = std::move(queue_.front());
      queue_.pop_front();
    }
    try {
      if (auto* copy = std::get_if<Copy>(&op)) {
        do_copy(*copy);
      } else if (auto* sig = std::get_if<Signal>(&op)) {
        sig->signal->set();
      } else if (auto* w = std::get_if<Wait>(&op)) {
        w->signal->wait();
      } else if (auto* cb = std::get_if<Callback>(&op)) {
        cb->fn();
      }
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu_);
      if (!error_) error_ = std::current_exception();
    }
  }
}

// ---- CpuDevice ------------------------------------------------------------------------

CpuDevice::CpuDevice(const DeviceOptions& options)
    : index_(options.index),
      capacity_bytes_(options.memory_limit_bytes ? options.memory_limit_bytes
                                                 : kDefaultCpuMemoryLimitBytes),
      pinned_capacity_bytes_(options.pinned_limit_bytes ? options.pinned_limit_bytes
                                                        : kDefaultPinnedLimitBytes),
      link_gbps_(options.sim_link_gbps),
      threads_(options.threads > 0 ? options.threads
                                   : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()))) {
  PORTER_CHECK_GE(options.sim_link_gbps, 0.0, "porter.device.sim_link_gbps must not be negative");
  PORTER_CHECK_GE(options.threads, 0, "porter.device.threads must not be negative");
}

CpuDevice::~CpuDevice() {
  if (segment_bytes_ != 0 || pinned_bytes_ != 0) {
    PORTER_LOG_ERROR("cpu device destroyed with {} of segments and {} of pinned memory still held",
                     format_bytes(segment_bytes_), format_bytes(pinned_bytes_));
  }
}

std::string CpuDevice::description() const {
  std::string s = str_cat("cpu:", index_, " (simulated, capacity ", format_bytes(capacity_bytes_),
                          ", pinned limit ", format_bytes(pinned_capacity_bytes_));
  if (link_gbps_ > 0) s += str_cat(", link ", link_gbps_, " GB/s");
  return s + ")";
}

namespace {

// Reserves `bytes` against `limit` with a compare-and-swap, so concurrent callers never
// overshoot the hard capacity.
bool try_reserve(std::atomic<size_t>& used, size_t bytes, size_t limit) {
  size_t cur = used.load();
  do {
    if (bytes > limit || cur > limit - bytes) return false;
  } while (!used.compare_exchange_weak(cur, cur + bytes));
  return true;
}

// Host memory counted against `limit` in `used`: the cpu device's segments and pinned pool
// are both this, with separate counters.
void* counted_alloc(std::atomic<size_t>& used, size_t bytes, size_t limit) {
  if (bytes == 0 || !try_reserve(used, bytes, limit)) return nullptr;
  void* p = std::aligned_alloc(CpuDevice::kSegmentAlignment, round_up(bytes, CpuDevice::kSegmentAlignment));
  if (p == nullptr) used -= bytes;
  return p;
}

void counted_free(std::atomic<size_t>& used, void* ptr, size_t bytes) {
  if (ptr == nullptr) return;
  std::free(ptr);
  used -= bytes;
}

}  // namespace

void* CpuDevice::allocate_segment(size_t bytes) {
  return counted_alloc(segment_bytes_, bytes, capacity_bytes_);
}

void CpuDevice::free_segment(void* ptr, size_t bytes) { counted_free(segment_bytes_, ptr, bytes); }

void* CpuDevice::allocate_pinned(size_t bytes) {
  return counted_alloc(pinned_bytes_, bytes, pinned_capacity_bytes_);
}

void CpuDevice::free_pinned(void* ptr, size_t bytes) { counted_free(pinned_bytes_, ptr, bytes); }

std::unique_ptr<Stream> CpuDevice::create_stream(std::string name) {
  return std::make_unique<CpuCopyStream>(std::move(name), link_gbps_);
}

std::unique_ptr<Event> CpuDevice::create_event() { return std::make_unique<CpuEvent>(); }

}  // namespace porter::memory
