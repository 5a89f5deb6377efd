// The cuda device over the CUDA runtime. Every runtime call is checked; failures throw
// CudaError naming the statement, the device, the file:line and CUDA's error string.
#include "memory/cuda_device.h"

#include <cuda_runtime_api.h>

#include <mutex>

#include "base/check.h"
#include "base/log.h"
#include "base/units.h"
#include "memory/cuda_check.h"

namespace porter::memory {
namespace {

class CudaEvent final : public Event {
 public:
  explicit CudaEvent(int device) : device_(device) {
    PORTER_GPU_CHECK(cudaSetDevice(device_), device_);
    PORTER_GPU_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming), device_);
  }
  ~CudaEvent() override { PORTER_GPU_WARN(cudaEventDestroy(event_)); }
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;

  bool query() const override {
    cudaError_t err = cudaEventQuery(event_);
    if (err == cudaErrorNotReady) return false;
    PORTER_GPU_CHECK(err, device_);
    return true;
  }
  void synchronize() const override { PORTER_GPU_CHECK(cudaEventSynchronize(event_), device_); }
  cudaEvent_t get() const { return event_; }

 private:
  int device_;
  cudaEvent_t event_ = nullptr;  // owned
};

const CudaEvent& as_cuda_event(const Event& event) {
  auto* e = dynamic_cast<const CudaEvent*>(&event);
  PORTER_CHECK_T(UsageError, e != nullptr, "an event of another device was used on a cuda stream");
  return *e;
}

class CudaStream final : public Stream {
 public:
  CudaStream(int device, std::string name) : device_(device), name_(std::move(name)) {
    PORTER_GPU_CHECK(cudaSetDevice(device_), device_);
    PORTER_GPU_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), device_);
  }
  ~CudaStream() override {
    PORTER_GPU_WARN(cudaStreamSynchronize(stream_));
    PORTER_GPU_WARN(cudaStreamDestroy(stream_));
  }
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;

  const std::string& name() const override { return name_; }
  void copy_async(void* dst, const void* src, size_t bytes) override {
    if (bytes == 0) return;
    PORTER_GPU_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_), device_);
  }
  void record(Event& event) override {
    PORTER_GPU_CHECK(cudaEventRecord(as_cuda_event(event).get(), stream_), device_);
  }
  void wait(const Event& event) override {
    PORTER_GPU_CHECK(cudaStreamWaitEvent(stream_, as_cuda_event(event).get(), 0), device_);
  }
  void host_callback(std::function<void()> fn) override {
    auto heap_fn = std::make_unique<std::function<void()>>(std::move(fn));
    PORTER_GPU_CHECK(cudaLaunchHostFunc(stream_, &trampoline, heap_fn.get()), device_);
    heap_fn.release();  // owned by the trampoline from now on
  }
  void synchronize() override { PORTER_GPU_CHECK(cudaStreamSynchronize(stream_), device_); }
  void* native_handle() const override { return stream_; }

 private:
  static void CUDART_CB trampoline(void* arg) {
    std::unique_ptr<std::function<void()>> fn(static_cast<std::function<void()>*>(arg));
    try {
      (*fn)();
    } catch (const std::exception& e) {
      // CUDA host functions cannot propagate errors; the callback's owner must record them.
      PORTER_LOG_ERROR("host callback on a cuda stream threw: {}", e.what());
    }
  }

  int device_;
  std::string name_;
  cudaStream_t stream_ = nullptr;  // owned
};

class CudaDevice final : public Device {
 public:
  explicit CudaDevice(const DeviceOptions& options) : index_(options.index) {
    PORTER_GPU_CHECK(cudaSetDevice(index_), index_);
    size_t free_bytes = 0, total_bytes = 0;
    PORTER_GPU_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes), index_);
    capacity_bytes_ = options.memory_limit_bytes ? std::min(options.memory_limit_bytes, total_bytes)
                                                 : total_bytes;
    pinned_capacity_bytes_ =
        options.pinned_limit_bytes ? options.pinned_limit_bytes : kDefaultPinnedLimitBytes;
    cudaDeviceProp prop{};
    PORTER_GPU_CHECK(cudaGetDeviceProperties(&prop, index_), index_);
    name_ = prop.name;
    compute_ = std::make_unique<CudaStream>(index_, "compute");
  }

  DeviceKind kind() const override { return DeviceKind::kCuda; }
  int index() const override { return index_; }
  std::string description() const override {
    return str_cat("cuda:", index_, " (", name_, ", capacity ", format_bytes(capacity_bytes_),
                   ", pinned limit ", format_bytes(pinned_capacity_bytes_), ")");
  }
  bool host_accessible() const override { return false; }

  size_t memory_capacity_bytes() const override { return capacity_bytes_; }
  size_t segment_alignment() const override { return 256; }

  void* allocate_segment(size_t bytes) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (bytes == 0 || bytes > capacity_bytes_ - segment_bytes_) return nullptr;
    PORTER_GPU_CHECK(cudaSetDevice(index_), index_);
    void* p = nullptr;
    cudaError_t err = cudaMalloc(&p, bytes);
    if (err == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();  // clear the sticky-free error state
      return nullptr;
    }
    PORTER_GPU_CHECK(err, index_);
    segment_bytes_ += bytes;
    return p;
  }
  void free_segment(void* ptr, size_t bytes) override {
    if (ptr == nullptr) return;
    std::lock_guard<std::mutex> lock(mu_);
    PORTER_GPU_WARN(cudaFree(ptr));
    segment_bytes_ -= bytes;
  }

  size_t pinned_capacity_bytes() const override { return pinned_capacity_bytes_; }
  void* allocate_pinned(size_t bytes) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (bytes == 0 || bytes > pinned_capacity_bytes_ - pinned_bytes_) return nullptr;
    void* p = nullptr;
    cudaError_t err = cudaHostAlloc(&p, bytes, cudaHostAllocDefault);
    if (err == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      return nullptr;
    }
    PORTER_GPU_CHECK(err, index_);
    pinned_bytes_ += bytes;
    return p;
  }
  void free_pinned(void* ptr, size_t bytes) override {
    if (ptr == nullptr) return;
    std::lock_guard<std::mutex> lock(mu_);
    PORTER_GPU_WARN(cudaFreeHost(ptr));
    pinned_bytes_ -= bytes;
  }

  Stream& compute_stream() override { return *compute_; }
  std::unique_ptr<Stream> create_stream(std::string name) override {
    return std::make_unique<CudaStream>(index_, std::move(name));
  }
  std::unique_ptr<Event> create_event() override { return std::make_unique<CudaEvent>(index_); }
  int threads() const override { return 1; }

 private:
  int index_;
  std::string name_;
  size_t capacity_bytes_ = 0;
  size_t pinned_capacity_bytes_ = 0;
  std::mutex mu_;  // guards segment_bytes_, pinned_bytes_
  size_t segment_bytes_ = 0;
  size_t pinned_bytes_ = 0;
  std::unique_ptr<CudaStream> compute_;
};

}  // namespace

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

std::unique_ptr<Device> make_cuda_device(const DeviceOptions& options) {
  int n = cuda_device_count();
  PORTER_CHECK(n > 0, "porter.device.type is \"cuda\" but no GPU is visible; use \"cpu\" or \"auto\"");
  PORTER_CHECK(options.index >= 0 && options.index < n, "cuda device index ", options.index,
               " out of range: ", n, " GPU(s) visible");
  return std::make_unique<CudaDevice>(options);
}

}  // namespace porter::memory
