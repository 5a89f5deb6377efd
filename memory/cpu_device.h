// The simulated device: host memory with a hard capacity, a compute stream that is the
// calling thread, and copy streams that are worker threads throttled to a simulated link.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <variant>

#include "memory/device.h"

namespace porter::memory {

// A point in a cpu stream. Shared between the event that tracks it and the stream that
// will reach it.
class CpuSignal {
 public:
  void set();
  bool is_set() const { return done_.load(std::memory_order_acquire); }
  void wait() const;

 private:
  std::atomic<bool> done_{false};
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
};

class CpuEvent final : public Event {
 public:
  bool query() const override;
  void synchronize() const override;

  // The point this event tracks now; nullptr when never recorded.
  std::shared_ptr<CpuSignal> current() const;
  void reset(std::shared_ptr<CpuSignal> signal);

 private:
  mutable std::mutex mu_;  // guards signal_
  std::shared_ptr<CpuSignal> signal_;
};

// The compute stream: work runs on the calling thread, at once.
class CpuComputeStream final : public Stream {
 public:
  const std::string& name() const override { return name_; }
  void copy_async(void* dst, const void* src, size_t bytes) override;
  void record(Event& event) override;
  void wait(const Event& event) override;
  void host_callback(std::function<void()> fn) override { fn(); }
  void synchronize() override {}
  void* native_handle() const override { return nullptr; }

 private:
  std::string name_ = "compute";
};

// A copy stream: one worker thread runs queued operations in FIFO order.
//
// Note [Simulated link]
// With link_gbps > 0 a copy of B bytes occupies the link for B / link_gbps nanoseconds
// (1 GB/s is one byte per nanosecond). The copy proceeds in chunks, each released when the
// link would have carried it, so the source is read (and the destination written) over the
// whole window, as on a real link. A link-free clock carries over between back-to-back
// copies, so scheduling jitter does not accumulate.
class CpuCopyStream final : public Stream {
 public:
  CpuCopyStream(std::string name, double link_gbps);
  ~CpuCopyStream() override;
  CpuCopyStream(const CpuCopyStream&) = delete;
  CpuCopyStream& operator=(const CpuCopyStream&) = delete;

  const std::string& name() const override { return name_; }
  void copy_async(void* dst, const void* src, size_t bytes) override;
  void record(Event& event) override;
  void wait(const Event& event) override;
  void host_callback(std::function<void()> fn) override;
  void synchronize() override;
  void* native_handle() const override { return nullptr; }

 private:
  struct Copy {
    void* dst;
    const void* src;
    size_t bytes;
  };
  struct Signal {
    std::shared_ptr<CpuSignal> signal;
  };
  struct Wait {
    std::shared_ptr<CpuSignal> signal;
  };
  struct Callback {
    std::function<void()> fn;
  };
  using Op = std::variant<Copy, Signal, Wait, Callback>;

  void enqueue(Op op);
  void run();
  void do_copy(const Copy& c);

  const std::string name_;
  const double link_gbps_;
  std::chrono::steady_clock::time_point link_free_at_{};  // worker thread only

  std::mutex mu_;  // guards queue_, stop_, error_
  std::condition_variable cv_;
  std::deque<Op> queue_;
  bool stop_ = false;
  std::exception_ptr error_;
  std::thread worker_;  // last member: starts after everything above is constructed
};

class CpuDevice final : public Device {
 public:
  explicit CpuDevice(const DeviceOptions& options);
  ~CpuDevice() override;

  DeviceKind kind() const override { return DeviceKind::kCpu; }
  int index() const override { return index_; }
  std::string description() const override;
  bool host_accessible() const override { return true; }

  size_t memory_capacity_bytes() const override { return capacity_bytes_; }
  size_t segment_alignment() const override { return kSegmentAlignment; }
  void* allocate_segment(size_t bytes) override;
  void free_segment(void* ptr, size_t bytes) override;

  size_t pinned_capacity_bytes() const override { return pinned_capacity_bytes_; }
  void* allocate_pinned(size_t bytes) override;
  void free_pinned(void* ptr, size_t bytes) override;

  Stream& compute_stream() override { return compute_; }
  std::unique_ptr<Stream> create_stream(std::string name) override;
  std::unique_ptr<Event> create_event() override;
  int threads() const override { return threads_; }

  size_t segment_bytes_in_use() const { return segment_bytes_.load(); }
  size_t pinned_bytes_in_use() const { return pinned_bytes_.load(); }
  double link_gbps() const { return link_gbps_; }

  static constexpr size_t kSegmentAlignment = 4096;

 private:
  const int index_;
  const size_t capacity_bytes_;
  const size_t pinned_capacity_bytes_;
  const double link_gbps_;
  const int threads_;
  std::atomic<size_t> segment_bytes_{0};
  std::atomic<size_t> pinned_bytes_{0};
  CpuComputeStream compute_;
};

}  // namespace porter::memory
