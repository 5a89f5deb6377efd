// The Device interface: memory segments, pinned host memory, streams and events. One
// implementation per folder boundary: cpu (a simulated device) and cuda.
//
// Note [Stream semantics]
// Streams follow CUDA's model on both devices. Work queued on one stream runs in FIFO order.
// An Event records a point in a stream; it completes when the stream has reached that point.
// record() replaces the point an event tracks; wait() makes a stream wait for the point the
// event tracked when wait() was called (later records do not matter), and query() on an
// event that was never recorded is true. On cpu the compute stream is the calling thread, so
// its work runs immediately and its wait() blocks the caller; each copy stream is a worker
// thread.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>

namespace porter::memory {

enum class DeviceKind { kCpu, kCuda };

std::string_view device_kind_name(DeviceKind kind);

class Event {
 public:
  virtual ~Event() = default;
  // True once the stream reached the most recent record() (true if never recorded).
  virtual bool query() const = 0;
  // Blocks the calling thread until query() would be true.
  virtual void synchronize() const = 0;
};

class Stream {
 public:
  virtual ~Stream() = default;
  virtual const std::string& name() const = 0;
  // Queues a copy of `bytes` from src to dst. Either side may be device or pinned memory.
  // The buffers must stay alive until the copy completes (record an event to know when).
  virtual void copy_async(void* dst, const void* src, size_t bytes) = 0;
  virtual void record(Event& event) = 0;
  virtual void wait(const Event& event) = 0;
  // Runs fn in stream order: after all earlier work, before all later work.
  virtual void host_callback(std::function<void()> fn) = 0;
  // Blocks until all queued work is done; rethrows the first error raised by queued work.
  virtual void synchronize() = 0;
  // cudaStream_t on cuda, nullptr on cpu.
  virtual void* native_handle() const = 0;
};

class Device {
 public:
  virtual ~Device() = default;

  virtual DeviceKind kind() const = 0;
  virtual int index() const = 0;
  virtual std::string description() const = 0;
  // True when device memory can be dereferenced by the host (cpu).
  virtual bool host_accessible() const = 0;

  // Device memory, in segments (the caching allocator carves blocks from them).
  // Returns nullptr when the device cannot provide `bytes` (never throws for that).
  virtual size_t memory_capacity_bytes() const = 0;
  virtual size_t segment_alignment() const = 0;
  virtual void* allocate_segment(size_t bytes) = 0;
  virtual void free_segment(void* ptr, size_t bytes) = 0;

  // Page-locked host memory, for asynchronous copies. Returns nullptr when exhausted.
  virtual size_t pinned_capacity_bytes() const = 0;
  virtual void* allocate_pinned(size_t bytes) = 0;
  virtual void free_pinned(void* ptr, size_t bytes) = 0;

  virtual Stream& compute_stream() = 0;
  virtual std::unique_ptr<Stream> create_stream(std::string name) = 0;
  virtual std::unique_ptr<Event> create_event() = 0;

  // Number of host threads kernels may use (cpu), 1 on cuda.
  virtual int threads() const = 0;

  // Copies on the compute stream and waits: a convenience for set-up and tests.
  void copy_sync(void* dst, const void* src, size_t bytes) {
    compute_stream().copy_async(dst, src, bytes);
    compute_stream().synchronize();
  }
};

struct DeviceOptions {
  DeviceKind kind = DeviceKind::kCpu;
  int index = 0;
  size_t memory_limit_bytes = 0;  // 0: cpu 8 GiB, cuda the whole device
  size_t pinned_limit_bytes = 0;  // 0: 8 GiB
  double sim_link_gbps = 0;       // cpu copy streams: simulated link, 0 = unthrottled
  int threads = 0;                // cpu kernel threads, 0 = hardware concurrency
};

inline constexpr size_t kDefaultCpuMemoryLimitBytes = size_t{8} << 30;
inline constexpr size_t kDefaultPinnedLimitBytes = size_t{8} << 30;

// Creates a device. Throws InvalidArgument for cuda when porter was built without CUDA or
// no GPU is present, naming the fix.
std::unique_ptr<Device> make_device(const DeviceOptions& options);

// Whether this build has the cuda device and a GPU is visible.
bool cuda_available();

}  // namespace porter::memory
