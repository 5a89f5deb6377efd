// The checkpoint stash (offload/stash.h) on the simulated cpu device: round trips, the
// contiguous arenas, slow links with poisoned frees, the pinned limit, and the failure paths.
#include "offload/stash.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <numeric>
#include <thread>
#include <vector>

#include "base/error.h"
#include "base/units.h"
#include "memory/cpu_device.h"

namespace porter::offload {
namespace {

using checkpoint::OffloadLayout;
using checkpoint::StashEntry;
using memory::Category;

constexpr int64_t kRows = 64;
constexpr int64_t kCols = 1024;  // 256 KiB of f32 per checkpoint
constexpr size_t kBytes = kRows * kCols * sizeof(float);

std::unique_ptr<memory::CpuDevice> make_cpu(double link_gbps = 0, size_t pinned = 64 * kMiB) {
  memory::DeviceOptions o;
  o.memory_limit_bytes = 64 * kMiB;
  o.pinned_limit_bytes = pinned;
  o.sim_link_gbps = link_gbps;
  return std::make_unique<memory::CpuDevice>(o);
}

// n entries of kBytes each, held at ops 0..n-1, used and released in reverse, one staging slot
// per entry (enough for any prefetch order the tests use), planned contiguous or not.
OffloadLayout layout_of(int n, bool contiguous = false) {
  OffloadLayout l;
  l.contiguous = contiguous;
  for (int i = 0; i < n; ++i) {
    StashEntry e;
    e.stage = i + 1;
    e.bytes = kBytes;
    e.hold_op = i;
    e.use_op = 2 * n - i;
    e.prefetch_op = e.use_op;
    e.release_op = e.use_op + 1;
    e.pinned_offset = static_cast<size_t>(i) * kBytes;
    e.staging_slot = i;
    l.entries.push_back(e);
  }
  l.offloaded_bytes = l.pinned_bytes = kBytes * static_cast<size_t>(n);
  l.staging_slot_bytes = kBytes;
  l.staging_slots = n;
  return l;
}

tensor::Tensor filled(memory::CachingAllocator& a, float base) {
  tensor::Tensor t = tensor::Tensor::empty(a, tensor::Shape{kRows, kCols}, tensor::DType::kF32, Category::kActivations);
  float* p = t.data_as<float>();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = base + static_cast<float>(i);
  return t;
}

void expect_filled(const tensor::Tensor& t, float base) {
  ASSERT_EQ(t.shape(), (tensor::Shape{kRows, kCols}));
  ASSERT_EQ(t.dtype(), tensor::DType::kF32);
  const float* p = t.data_as<float>();
  for (int64_t i = 0; i < t.numel(); ++i) {
    ASSERT_EQ(p[i], base + static_cast<float>(i)) << "element " << i;
  }
}

memory::AllocatorOptions poisoned(bool poison) {
  memory::AllocatorOptions o;
  o.poison_freed = poison;
  return o;
}

struct Fixture {
  explicit Fixture(double link_gbps = 0, bool contiguous = false, bool poison = true,
                   size_t pinned_limit = 64 * kMiB)
      : device(make_cpu(link_gbps, pinned_limit)),
        allocator(*device, poisoned(poison)),
        pinned(*device),
        stash(allocator, pinned, StashOptions{contiguous, false}) {}
  std::unique_ptr<memory::CpuDevice> device;
  memory::CachingAllocator allocator;
  memory::PinnedPool pinned;
  CheckpointStash stash;
};

// Offloads n tensors (dropping the originals at once, as the executor does), reads them back
// in reverse and releases them.
void round_trip(Fixture& f, int n, int micro_batch) {
  f.stash.begin(micro_batch);
  for (int i = 0; i < n; ++i) {
    tensor::Tensor t = filled(f.allocator, 1000.0f * static_cast<float>(i + micro_batch));
    f.stash.offload(i, t);
  }  // every original is freed here, deferred until its copy lands
  for (int i = n - 1; i >= 0; --i) {
    f.stash.prefetch(i);
    tensor::Tensor back = f.stash.fetch(i);
    EXPECT_EQ(back.category(), Category::kStaging);
    expect_filled(back, 1000.0f * static_cast<float>(i + micro_batch));
    back = tensor::Tensor();
    f.stash.release(i);
  }
  f.stash.end();
}

TEST(StashTest, RoundTripRestoresEveryByteAndReturnsToBaseline) {
  Fixture f;
  f.stash.prepare(layout_of(3));
  const size_t baseline = f.allocator.stats().requested_bytes;
  for (int mb = 0; mb < 3; ++mb) round_trip(f, 3, mb);
  f.stash.synchronize();
  EXPECT_EQ(f.allocator.stats().requested_bytes, baseline);
  EXPECT_EQ(f.allocator.stats().by_category[memory::index_of(Category::kStaging)].current_bytes, 0u);
  EXPECT_EQ(f.pinned.stats().in_use_bytes, 0u);
  const StashStats s = f.stash.stats();
  EXPECT_EQ(s.d2h_bytes, 9 * kBytes);
  EXPECT_EQ(s.h2d_bytes, 9 * kBytes);
  EXPECT_EQ(s.pinned_peak_bytes, 3 * kBytes);  // all three on host at once
  EXPECT_EQ(s.staging_peak_bytes, kBytes);     // read back one at a time
  EXPECT_GT(s.copy_busy_s, 0.0);
  EXPECT_EQ(f.stash.take_copies().size(), 18u);
  EXPECT_EQ(f.stash.take_waits().size(), 9u);
  EXPECT_TRUE(f.stash.take_copies().empty());
}

TEST(StashTest, ContiguousArenasAreCarvedOnceAndSlotsSitAtTheirOffsets) {
  Fixture f(0, /*contiguous=*/true);
  const OffloadLayout layout = layout_of(3, true);
  f.stash.prepare(layout);
  // The arenas: one pinned allocation, one staging allocation (in the footprint).
  EXPECT_EQ(f.pinned.stats().in_use_bytes, 3 * kBytes);
  EXPECT_EQ(f.allocator.stats().by_category[memory::index_of(Category::kStaging)].current_bytes, 3 * kBytes);
  const size_t baseline = f.allocator.stats().requested_bytes;
  const uint64_t device_allocs = f.pinned.stats().num_allocs;
  f.stash.begin(0);
  for (int i = 0; i < 3; ++i) f.stash.offload(i, filled(f.allocator, static_cast<float>(i)));
  std::vector<const std::byte*> slots;
  for (int i = 2; i >= 0; --i) {
    f.stash.prefetch(i);
    tensor::Tensor back = f.stash.fetch(i);
    slots.push_back(static_cast<const std::byte*>(back.data()));
    expect_filled(back, static_cast<float>(i));
    back = tensor::Tensor();
    f.stash.release(i);
  }
  f.stash.end();
  f.stash.synchronize();
  EXPECT_EQ(slots[0] - slots[2], static_cast<std::ptrdiff_t>(2 * kBytes));  // slot 2 vs slot 0
  EXPECT_EQ(f.pinned.stats().num_allocs, device_allocs);  // nothing allocated per micro-batch
  EXPECT_EQ(f.allocator.stats().requested_bytes, baseline);
  EXPECT_EQ(f.stash.stats().pinned_peak_bytes, 3 * kBytes);
  EXPECT_EQ(f.stash.stats().staging_peak_bytes, 3 * kBytes);
}

// The original is dropped right after offload(); with poison on, a free before the slow copy
// read it would turn the host copy into 0xFF bytes.
TEST(StashTest, SlowLinkWithPoisonedFreesKeepsEveryByte) {
  for (bool contiguous : {false, true}) {
    Fixture f(/*link_gbps=*/0.5, contiguous, /*poison=*/true);
    f.stash.prepare(layout_of(2, contiguous));
    for (int mb = 0; mb < 2; ++mb) {
      f.stash.begin(mb);
      f.stash.offload(0, filled(f.allocator, 7.0f + static_cast<float>(mb)));
      f.stash.offload(1, filled(f.allocator, 9.0f + static_cast<float>(mb)));
      // Reuse the freed memory at once: the allocator must not hand out a block the copy
      // stream is still reading.
      tensor::Tensor scribble = tensor::Tensor::empty(f.allocator, tensor::Shape{kRows, kCols},
                                              tensor::DType::kF32, Category::kActivations);
      std::memset(scribble.data(), 0x5A, scribble.nbytes());
      for (int i : {1, 0}) {
        tensor::Tensor back = f.stash.fetch(i);  // no prefetch: on demand, fully exposed
        expect_filled(back, (i == 0 ? 7.0f : 9.0f) + static_cast<float>(mb));
        back = tensor::Tensor();
        f.stash.release(i);
      }
      f.stash.end();
    }
    f.stash.synchronize();
    const StashStats s = f.stash.stats();
    // 256 KiB at 0.5 GB/s is about 0.5 ms per copy; on-demand fetches wait for all of it.
    EXPECT_GT(s.exposed_wait_s, 0.0);
    EXPECT_GT(s.copy_busy_s, 4 * 0.9 * static_cast<double>(kBytes) / 0.5e9);
    EXPECT_LT(s.hidden_fraction(), 1.0);
  }
}

TEST(StashTest, PoisonMarksReleasedMemory) {
  // The negative control for the test above: freed memory really is overwritten.
  Fixture f(0, false, /*poison=*/true);
  tensor::Tensor t = filled(f.allocator, 1.0f);
  const auto* raw = static_cast<const unsigned char*>(t.data());
  t = tensor::Tensor();
  for (size_t i = 0; i < kBytes; i += 4093) ASSERT_EQ(raw[i], 0xFF) << "byte " << i;
}

TEST(StashTest, DeferredFreeWaitsForTheCopyStream) {
  // With a slow link, the block of an offloaded tensor stays pending until its copy lands.
  Fixture f(/*link_gbps=*/0.05, false, true);
  f.stash.prepare(layout_of(1));
  f.stash.begin(0);
  f.stash.offload(0, filled(f.allocator, 3.0f));
  EXPECT_GT(f.allocator.stats().pending_free_bytes, 0u);  // 5 ms copy still running
  tensor::Tensor back = f.stash.fetch(0);
  expect_filled(back, 3.0f);
  back = tensor::Tensor();
  f.stash.release(0);
  f.stash.end();
}

TEST(StashTest, PinnedLimitIsCheckedBeforeAnythingIsAllocated) {
  for (bool contiguous : {false, true}) {
    Fixture f(0, contiguous, true, /*pinned_limit=*/kBytes);
    try {
      f.stash.prepare(layout_of(2, contiguous));
      FAIL() << "prepare accepted 2 checkpoints within a pinned limit of 1";
    } catch (const OutOfMemoryError& e) {
      EXPECT_NE(std::string(e.what()).find("porter.device.pinned_limit"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("512.00 KiB"), std::string::npos) << e.what();
    }
    EXPECT_EQ(f.pinned.stats().in_use_bytes, 0u);
    EXPECT_EQ(f.allocator.stats().requested_bytes, 0u);
    EXPECT_TRUE(f.stash.layout().empty());
    f.stash.prepare(layout_of(1, contiguous));  // one fits
    round_trip(f, 1, 0);
  }
}

// Note [One contiguity]: a layout planned under the other contiguity is refused with nothing
// changed: the previous layout stays, and so do its arenas and every byte allocated.
TEST(StashTest, ALayoutOfTheOtherContiguityIsRefused) {
  auto name = [](bool b) { return std::string(b ? "true" : "false"); };
  for (bool contiguous : {false, true}) {
    SCOPED_TRACE(contiguous ? "contiguous stash" : "slots stash");
    Fixture f(0, contiguous);
    const OffloadLayout own = layout_of(2, contiguous);
    f.stash.prepare(own);
    const size_t requested = f.allocator.stats().requested_bytes;
    const size_t staging =
        f.allocator.stats().by_category[memory::index_of(Category::kStaging)].current_bytes;
    const size_t pinned = f.pinned.stats().in_use_bytes;
    const size_t device_pinned = f.device->pinned_bytes_in_use();
    EXPECT_EQ(pinned, contiguous ? 2 * kBytes : 0u);
    EXPECT_EQ(staging, contiguous ? 2 * kBytes : 0u);
    for (int n : {0, 3}) {
      try {
        f.stash.prepare(layout_of(n, !contiguous));
        FAIL() << "prepare accepted a layout of the other contiguity";
      } catch (const InvalidArgument& e) {
        const std::string msg = e.what();
        EXPECT_THAT(msg, ::testing::HasSubstr(
                             "planned with activation_checkpointing.contiguous_memory_optimization"
                             " = " + name(!contiguous) + " but the stash runs with " +
                             name(contiguous)));
        EXPECT_THAT(msg, ::testing::HasSubstr("plan with the engine's offload options (make_plan "
                                              "with engine::make_run_options(config).plan"));
      }
      EXPECT_EQ(f.stash.layout(), own);
      EXPECT_EQ(f.allocator.stats().requested_bytes, requested);
      EXPECT_EQ(f.allocator.stats().by_category[memory::index_of(Category::kStaging)].current_bytes,
                staging);
      EXPECT_EQ(f.pinned.stats().in_use_bytes, pinned);
      EXPECT_EQ(f.device->pinned_bytes_in_use(), device_pinned);
    }
    round_trip(f, 2, 0);  // the previous layout still runs
    f.stash.synchronize();
    EXPECT_EQ(f.allocator.stats().requested_bytes, requested);
  }
}

TEST(StashTest, AbortMidMicroBatchFreesEverything) {
  for (bool contiguous : {false, true}) {
    Fixture f(/*link_gbps=*/0.5, contiguous, true);
    f.stash.prepare(layout_of(3, contiguous));
    const size_t baseline = f.allocator.stats().requested_bytes;
    const size_t pinned_baseline = f.pinned.stats().in_use_bytes;
    f.stash.begin(0);
    for (int i = 0; i < 3; ++i) f.stash.offload(i, filled(f.allocator, 1.0f));
    f.stash.prefetch(2);
    f.stash.prefetch(1);
    tensor::Tensor back = f.stash.fetch(2);
    back = tensor::Tensor();
    f.stash.abort();
    f.stash.synchronize();
    f.pinned.empty_cache();  // collects the deferred frees
    EXPECT_EQ(f.allocator.stats().requested_bytes, baseline);
    EXPECT_EQ(f.pinned.stats().in_use_bytes, pinned_baseline);
    round_trip(f, 3, 1);  // usable again
  }
}

TEST(StashTest, EndWithAnUnreleasedCheckpointIsAnInternalError) {
  Fixture f;
  f.stash.prepare(layout_of(2));
  f.stash.begin(0);
  f.stash.offload(0, filled(f.allocator, 1.0f));
  f.stash.offload(1, filled(f.allocator, 1.0f));
  f.stash.release(1);  // never read back: allowed
  EXPECT_THROW(f.stash.end(), InternalError);
  f.stash.synchronize();
  EXPECT_EQ(f.allocator.stats().requested_bytes, 0u);
  round_trip(f, 2, 1);
}

TEST(StashTest, MisuseIsAUsageError) {
  Fixture f;
  f.stash.prepare(layout_of(2));
  EXPECT_THROW(f.stash.offload(0, filled(f.allocator, 1.0f)), UsageError);  // before begin
  f.stash.begin(0);
  EXPECT_THROW(f.stash.begin(1), UsageError);
  EXPECT_THROW(f.stash.prefetch(0), UsageError);  // not offloaded
  EXPECT_THROW(f.stash.offload(5, filled(f.allocator, 1.0f)), UsageError);
  tensor::Tensor t = filled(f.allocator, 1.0f);
  EXPECT_THROW(f.stash.offload(0, tensor::Tensor::from_blob(t.data(), t.shape(), t.dtype())), UsageError);
  f.stash.offload(0, t);
  EXPECT_THROW(f.stash.offload(0, t), UsageError);
  tensor::Tensor back = f.stash.fetch(0);
  EXPECT_THROW(f.stash.fetch(0), UsageError);
  EXPECT_THROW(f.stash.prepare(layout_of(1)), UsageError);  // inside a micro-batch
  f.stash.abort();
}

TEST(StashTest, PrefetchedButNeverFetchedIsSafeToRelease) {
  Fixture f(/*link_gbps=*/0.5);
  f.stash.prepare(layout_of(1));
  f.stash.begin(0);
  f.stash.offload(0, filled(f.allocator, 1.0f));
  f.stash.prefetch(0);
  f.stash.release(0);  // waits for the copy into the slot before freeing it
  f.stash.end();
  f.stash.synchronize();
  EXPECT_EQ(f.allocator.stats().requested_bytes, 0u);
}

TEST(StashTest, SynchronizeBoundaryWaitsForEachCopy) {
  memory::DeviceOptions o;
  o.memory_limit_bytes = 64 * kMiB;
  o.pinned_limit_bytes = 64 * kMiB;
  o.sim_link_gbps = 0.5;
  memory::CpuDevice device(o);
  memory::CachingAllocator allocator(device);
  memory::PinnedPool pinned(device);
  CheckpointStash stash(allocator, pinned, StashOptions{false, /*synchronize_boundary=*/true});
  stash.prepare(layout_of(1));
  stash.begin(0);
  stash.offload(0, filled(allocator, 2.0f));
  // The host waited for the copy: its record (written by the callback after it) is there.
  const std::vector<CopyRecord> copies = stash.take_copies();
  ASSERT_EQ(copies.size(), 1u);
  EXPECT_EQ(copies[0].direction, CopyRecord::Direction::kD2H);
  tensor::Tensor back = stash.fetch(0);
  expect_filled(back, 2.0f);
  back = tensor::Tensor();
  stash.release(0);
  stash.end();
  stash.synchronize();
  const std::vector<WaitRecord> waits = stash.take_waits();
  ASSERT_EQ(waits.size(), 2u);  // the boundary and the fetch
  EXPECT_GT(waits[0].exposed_s, 0.0);
}

TEST(StashTest, PrefetchAheadHidesTheCopy) {
  // Issued long before its use, the copy has landed when fetch() runs: the wait record says 0.
  Fixture f(/*link_gbps=*/2.0);
  f.stash.prepare(layout_of(1));
  f.stash.begin(0);
  f.stash.offload(0, filled(f.allocator, 4.0f));
  f.stash.prefetch(0);
  f.stash.h2d_stream().synchronize();  // stands in for compute that outlasts the copy
  tensor::Tensor back = f.stash.fetch(0);
  expect_filled(back, 4.0f);
  back = tensor::Tensor();
  f.stash.release(0);
  f.stash.end();
  f.stash.synchronize();
  const std::vector<WaitRecord> waits = f.stash.take_waits();
  ASSERT_EQ(waits.size(), 1u);
  EXPECT_EQ(waits[0].exposed_s, 0.0);
  EXPECT_EQ(waits[0].stage, 1);
}

}  // namespace
}  // namespace porter::offload
