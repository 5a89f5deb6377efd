// The same Device contract on every device kind: cpu always, cuda when a GPU is present.
#include <cstring>
#include <vector>

#include <gtest/gtest.h>

#include "base/units.h"
#include "memory/caching_allocator.h"
#include "memory/device.h"
#include "memory/pinned_pool.h"

namespace porter::memory {
namespace {

class DeviceContractTest : public ::testing::TestWithParam<DeviceKind> {
 protected:
  void SetUp() override {
    if (GetParam() == DeviceKind::kCuda && !cuda_available()) {
      GTEST_SKIP() << "no GPU visible (or built without CUDA): cuda device test skipped";
    }
    DeviceOptions o;
    o.kind = GetParam();
    o.memory_limit_bytes = 64 * kMiB;
    o.pinned_limit_bytes = 64 * kMiB;
    device_ = make_device(o);
  }
  std::unique_ptr<Device> device_;
};

TEST_P(DeviceContractTest, RoundTripThroughCopyStreamsAndEvents) {
  CachingAllocator alloc(*device_);
  PinnedPool pinned(*device_);
  auto h2d = device_->create_stream("h2d");
  auto d2h = device_->create_stream("d2h");
  auto uploaded = device_->create_event();
  auto copied = device_->create_event();
  auto downloaded = device_->create_event();

  constexpr size_t kBytes = 3 * kMiB + 123;
  PinnedBuffer in = pinned.allocate(kBytes);
  PinnedBuffer out = pinned.allocate(kBytes);
  for (size_t i = 0; i < kBytes; ++i) in.as<uint8_t>()[i] = static_cast<uint8_t>(i * 7 + 1);
  std::memset(out.data(), 0, kBytes);
  DeviceBuffer a = alloc.allocate(kBytes, Category::kCheckpoints);
  DeviceBuffer b = alloc.allocate(kBytes, Category::kCheckpoints);

  h2d->copy_async(a.data(), in.data(), kBytes);
  h2d->record(*uploaded);
  device_->compute_stream().wait(*uploaded);
  device_->compute_stream().copy_async(b.data(), a.data(), kBytes);
  device_->compute_stream().record(*copied);
  d2h->wait(*copied);
  d2h->copy_async(out.data(), b.data(), kBytes);
  d2h->record(*downloaded);
  downloaded->synchronize();
  EXPECT_TRUE(downloaded->query());
  EXPECT_EQ(std::memcmp(in.data(), out.data(), kBytes), 0);
}

TEST_P(DeviceContractTest, AllocatorHonoursTheMemoryLimit) {
  CachingAllocator alloc(*device_);
  DeviceBuffer a = alloc.allocate(40 * kMiB, Category::kParams);
  EXPECT_THROW(alloc.allocate(40 * kMiB, Category::kParams), OutOfMemoryError);
  a.reset();
  EXPECT_NO_THROW(alloc.allocate(40 * kMiB, Category::kParams));
  alloc.empty_cache();
  EXPECT_EQ(alloc.stats().reserved_bytes, 0u);
}

TEST_P(DeviceContractTest, NeverRecordedEventIsComplete) {
  auto e = device_->create_event();
  EXPECT_TRUE(e->query());
  e->synchronize();
}

INSTANTIATE_TEST_SUITE_P(Devices, DeviceContractTest,
                         ::testing::Values(DeviceKind::kCpu, DeviceKind::kCuda),
                         [](const auto& p) { return std::string(device_kind_name(p.param)); });

TEST(DeviceFactoryTest, CudaWithoutGpuIsAClearError) {
  if (cuda_available()) GTEST_SKIP() << "a GPU is present";
  DeviceOptions o;
  o.kind = DeviceKind::kCuda;
  try {
    make_device(o);
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("\"cuda\""), std::string::npos);
  }
}

}  // namespace
}  // namespace porter::memory
