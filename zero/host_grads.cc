// Streamed gradients (Note [Streamed gradients] in host_grads.h). Compiled with
// -ffp-contract=off, so each addition and multiplication rounds on its own, as the device
// kernels' do.
#include "zero/host_grads.h"

#include <algorithm>
#include <cstring>

#include "base/check.h"
#include "kernels/host_reduce.h"

namespace porter::zero {

void accumulate_host_grads(float* dst, const float* src, int64_t n, bool first,
                           std::optional<float> scale) {
  if (first) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) dst[i] = 0.0f + src[i];
  } else {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) dst[i] = dst[i] + src[i];
  }
  if (scale) {
    const float s = *scale;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) dst[i] = dst[i] * s;
  }
}

int64_t HostGradients::staging_elems(int64_t shard_elems) {
  return std::min(shard_elems, kStagingElems);
}

HostGradients::HostGradients(memory::HostLane& lane, memory::Device& device, float* grad,
                             int64_t elems, float* staging, int threads)
    : lane_(&lane),
      device_(&device),
      grad_(grad),
      elems_(elems),
      staging_(staging),
      staging_elems_(staging_elems(elems)),
      threads_(std::max(1, threads)) {
  PORTER_CHECK(elems == 0 || (grad != nullptr && staging != nullptr),
               "HostGradients: the host shard and the staging block");
  if (elems > 0) std::memset(grad_, 0, static_cast<size_t>(elems) * sizeof(float));
}

void HostGradients::add(const tensor::Tensor& part, int64_t lo, bool first,
                        std::optional<float> scale) {
  const int64_t n = part.numel();
  PORTER_CHECK(part.dtype() == tensor::DType::kF32 && lo >= 0 && lo + n <= elems_,
               "HostGradients::add: [", lo, ", ", lo + n, ") of a shard of ", elems_);
  if (n == 0) return;
  lane_->after(device_->compute_stream());
  const auto* src = static_cast<const float*>(part.data());
  for (int64_t off = 0; off < n; off += staging_elems_) {
    const int64_t len = std::min(staging_elems_, n - off);
    // The lane is in order: this copy into the staging block starts after the previous
    // piece's accumulation read it.
    lane_->to_host(staging_, src + off, static_cast<size_t>(len) * sizeof(float));
    float* dst = grad_ + lo + off;
    const float* staged = staging_;
    lane_->stream().host_callback(
        [dst, staged, len, first, scale] { accumulate_host_grads(dst, staged, len, first, scale); });
  }
  part.record_stream(lane_->stream());
  sent_bytes_ += static_cast<uint64_t>(n) * sizeof(float);
}

double HostGradients::finish() {
  lane_->synchronize();
  return lane_->last_wait_s();
}

float HostGradients::squared_norm(int64_t lo, int64_t hi) const {
  PORTER_CHECK(lo >= 0 && lo <= hi && hi <= elems_, "HostGradients::squared_norm: [", lo, ", ",
               hi, ") of ", elems_);
  return kernels::host_squared_norm(grad_ + lo, hi - lo, threads_);
}

float HostGradients::nonfinite_count() const {
  return kernels::host_nonfinite_count(grad_, elems_, threads_);
}

uint64_t HostGradients::take_sent_bytes() {
  const uint64_t b = sent_bytes_;
  sent_bytes_ = 0;
  return b;
}

}  // namespace porter::zero
