// A device for failure tests: a cpu device whose copy streams of a given name can be made to
// fail. fail_copy(name, n) makes the n-th copy queued from then on on a stream of that name
// (1: the next) raise an error on the stream instead of copying; the stream reports it at its
// next synchronize(), as a real copy error would be (Note [Stream semantics]). Everything else
// is the wrapped device's.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>

#include "memory/device.h"

namespace porter::engine::testing {

class FaultyDevice final : public memory::Device {
 public:
  explicit FaultyDevice(std::unique_ptr<memory::Device> inner) : inner_(std::move(inner)) {}

  void fail_copy(std::string stream_name, int nth) {
    std::lock_guard<std::mutex> lock(mu_);
    armed_name_ = std::move(stream_name);
    countdown_ = nth;
  }
  int failures() const { return failures_.load(); }

  memory::DeviceKind kind() const override { return inner_->kind(); }
  int index() const override { return inner_->index(); }
  std::string description() const override { return "faulty " + inner_->description(); }
  bool host_accessible() const override { return inner_->host_accessible(); }
  size_t memory_capacity_bytes() const override { return inner_->memory_capacity_bytes(); }
  size_t segment_alignment() const override { return inner_->segment_alignment(); }
  void* allocate_segment(size_t bytes) override { return inner_->allocate_segment(bytes); }
  void free_segment(void* ptr, size_t bytes) override { inner_->free_segment(ptr, bytes); }
  size_t pinned_capacity_bytes() const override { return inner_->pinned_capacity_bytes(); }
  void* allocate_pinned(size_t bytes) override { return inner_->allocate_pinned(bytes); }
  void free_pinned(void* ptr, size_t bytes) override { inner_->free_pinned(ptr, bytes); }
  memory::Stream& compute_stream() override { return inner_->compute_stream(); }
  std::unique_ptr<memory::Stream> create_stream(std::string name) override {
    return std::make_unique<Stream>(*this, inner_->create_stream(std::move(name)));
  }
  std::unique_ptr<memory::Event> create_event() override { return inner_->create_event(); }
  int threads() const override { return inner_->threads(); }

 private:
  class Stream final : public memory::Stream {
   public:
    Stream(FaultyDevice& device, std::unique_ptr<memory::Stream> inner)
        : device_(&device), inner_(std::move(inner)) {}
    const std::string& name() const override { return inner_->name(); }
    void copy_async(void* dst, const void* src, size_t bytes) override {
      if (device_->take_failure(inner_->name())) {
        const std::string what = "injected copy failure on stream '" + inner_->name() + "'";
        inner_->host_callback([what] { throw std::runtime_error(what); });
        return;
      }
      inner_->copy_async(dst, src, bytes);
    }
    void record(memory::Event& event) override { inner_->record(event); }
    void wait(const memory::Event& event) override { inner_->wait(event); }
    void host_callback(std::function<void()> fn) override { inner_->host_callback(std::move(fn)); }
    void synchronize() override { inner_->synchronize(); }
    void* native_handle() const override { return inner_->native_handle(); }

   private:
    FaultyDevice* device_;
    std::unique_ptr<memory::Stream> inner_;
  };

  bool take_failure(const std::string& name) {
    std::lock_guard<std::mutex> lock(mu_);
    if (countdown_ <= 0 || name != armed_name_) return false;
    if (--countdown_ > 0) return false;
    ++failures_;
    return true;
  }

  std::unique_ptr<memory::Device> inner_;
  std::mutex mu_;  // guards armed_name_ and countdown_
  std::string armed_name_;
  int countdown_ = 0;
  std::atomic<int> failures_{0};
};

}  // namespace porter::engine::testing
