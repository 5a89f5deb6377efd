// Streamed gradients (Note [Streamed gradients] in host_grads.h). Compiled with
// -ffp-contract=off, so each addition and multiplication rounds on its own, as the device
// kernels' do.
#include "zero/host_grads.h"

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "base/check.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/host_reduce.h"

namespace porter::zero {

namespace {

// The cpu kernels' element access (kernels/cpu/cpu_kernels.h): widen on load, round to
// nearest-even on store, so the host rounds as the device's add and scale do.
using kernels::cpu::load;
using kernels::cpu::store;

template <typename T>
void accumulate(T* dst, const T* src, int64_t n, bool first, std::optional<float> scale) {
  if (first) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) store(dst + i, 0.0f + load(src + i));
  } else {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) store(dst + i, load(dst + i) + load(src + i));
  }
  if (scale) {
    const float s = *scale;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) store(dst + i, load(dst + i) * s);
  }
}

}  // namespace

void accumulate_host_grads(tensor::DType dtype, void* dst, const void* src, int64_t n, bool first,
                           std::optional<float> scale) {
  kernels::cpu::dispatch_float(dtype, [&](auto tag) {
    using T = decltype(tag);
    accumulate(static_cast<T*>(dst), static_cast<const T*>(src), n, first, scale);
  });
}

int64_t HostGradients::staging_elems(int64_t shard_elems) {
  return std::min(shard_elems, kStagingElems);
}

HostGradients::HostGradients(memory::HostLane& lane, memory::Device& device, tensor::DType dtype,
                             void* grad, int64_t elems, void* staging, int threads)
    : lane_(&lane),
      device_(&device),
      dtype_(dtype),
      elem_(tensor::dtype_size(dtype)),
      grad_(grad),
      elems_(elems),
      staging_(staging),
      staging_elems_(staging_elems(elems)),
      threads_(std::max(1, threads)) {
  PORTER_CHECK(elems == 0 || (grad != nullptr && staging != nullptr),
               "HostGradients: the host shard and the staging block");
  if (elems > 0) std::memset(grad_, 0, static_cast<size_t>(elems) * elem_);
}

void HostGradients::add(const tensor::Tensor& part, int64_t lo, bool first,
                        std::optional<float> scale) {
  const int64_t n = part.numel();
  PORTER_CHECK(part.dtype() == dtype_ && lo >= 0 && lo + n <= elems_, "HostGradients::add: [",
               lo, ", ", lo + n, ") of ", tensor::dtype_name(part.dtype()), " into a shard of ",
               elems_, " ", tensor::dtype_name(dtype_));
  if (n == 0) return;
  lane_->after(device_->compute_stream());
  const auto* src = static_cast<const char*>(part.data());
  auto* grad = static_cast<char*>(grad_);
  for (int64_t off = 0; off < n; off += staging_elems_) {
    const int64_t len = std::min(staging_elems_, n - off);
    // The lane is in order: this copy into the staging block starts after the previous
    // piece's accumulation read it.
    lane_->to_host(staging_, src + static_cast<size_t>(off) * elem_, static_cast<size_t>(len) * elem_);
    void* dst = grad + static_cast<size_t>(lo + off) * elem_;
    const void* staged = staging_;
    const tensor::DType dtype = dtype_;
    lane_->stream().host_callback([dtype, dst, staged, len, first, scale] {
      accumulate_host_grads(dtype, dst, staged, len, first, scale);
    });
  }
  part.record_stream(lane_->stream());
  sent_bytes_ += static_cast<uint64_t>(n) * elem_;
}

double HostGradients::finish() {
  lane_->synchronize();
  return lane_->last_wait_s();
}

float HostGradients::squared_norm(int64_t lo, int64_t hi) const {
  PORTER_CHECK(lo >= 0 && lo <= hi && hi <= elems_, "HostGradients::squared_norm: [", lo, ", ",
               hi, ") of ", elems_);
  return kernels::host_squared_norm(static_cast<const char*>(grad_) + static_cast<size_t>(lo) * elem_,
                                    dtype_, hi - lo, threads_);
}

float HostGradients::nonfinite_count() const {
  return kernels::host_nonfinite_count(grad_, dtype_, elems_, threads_);
}

uint64_t HostGradients::take_sent_bytes() {
  const uint64_t b = sent_bytes_;
  sent_bytes_ = 0;
  return b;
}

}  // namespace porter::zero
