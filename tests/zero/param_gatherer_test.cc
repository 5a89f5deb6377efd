// ZeRO stage 3's gatherer on its own (Note [Stage 3 gather]): thread ranks, each with its own
// device, allocator and Gloo communicator, and a shard holding known values. Runs under ASan
// and TSan (no cpu kernels): the broadcasts write the buffers on the comm thread while the
// compute side binds and reads them.
#include "zero/param_gatherer.h"

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "base/error.h"
#include "comm/communicator.h"
#include "tensor/tensor.h"

namespace porter::zero {
namespace {

// A layout of three "stages" that straddle the shards: 3 entries of 100, 150 and 40 elements
// (aligned to 64: offsets 0, 128, 320; total 384).
nn::ParamLayout three_stage_layout() {
  nn::ParamLayout layout;
  layout.add("a", {{"w", tensor::Shape{100}}});
  layout.add("b", {{"w", tensor::Shape{150}}});
  layout.add("c", {{"w", tensor::Shape{40}}});
  return layout;
}

std::vector<ParamUnit> units_of(const nn::ParamLayout& layout, int64_t persistent_below) {
  std::vector<ParamUnit> units;
  const auto& e = layout.entries();
  for (size_t i = 0; i < e.size(); ++i) {
    ParamUnit u;
    u.name = "stage" + std::to_string(i);
    u.lo = e[i].offset_elems;
    u.hi = i + 1 < e.size() ? e[i + 1].offset_elems : layout.total_elems();
    u.entries = {i};
    u.persistent = u.elems() < persistent_below;
    units.push_back(u);
  }
  return units;
}

// Runs fn(rank, gatherer, flat, device, shard) on `ws` thread ranks whose shard r holds the
// values v[i] = i + 0.5 of the padded buffer: on the device, or with `shard_on_host` in host
// memory (parameter offload), uploaded over a throttled link so that the uploads are still
// running when the broadcasts and the waits are queued.
void run(int ws, int64_t max_live, int64_t persistent_below,
         const std::function<void(int, ParamGatherer&, nn::FlatParams&, memory::Device&,
                                  tensor::Tensor&, memory::CachingAllocator&)>& fn,
         bool shard_on_host = false) {
  auto errors = comm::run_thread_ranks(ws, [&](int rank, std::shared_ptr<comm::Store> store) {
    memory::DeviceOptions o;
    o.memory_limit_bytes = size_t{16} << 20;
    o.threads = 1;
    if (shard_on_host) o.sim_link_gbps = 0.001;  // 1 MB/s: a 1 KiB part takes about 1 ms
    auto device = memory::make_device(o);
    memory::CachingAllocator alloc(*device);
    comm::CommOptions co;
    co.timeout = comm::Seconds{20};
    std::shared_ptr<comm::Communicator> dp = comm::make_communicator(*device, store, rank, ws, co);
    const nn::ParamLayout layout = three_stage_layout();
    const Partition part = make_partition(layout.total_elems(), ws);
    nn::FlatParams flat(alloc, layout, tensor::DType::kF32, tensor::DType::kF32, part.padded_elems,
                        /*allocate_grads=*/false, /*allocate_params=*/false);
    std::vector<float> host(static_cast<size_t>(part.shard_elems));
    tensor::Tensor shard =
        shard_on_host
            ? tensor::Tensor::from_blob(host.data(), tensor::Shape{part.shard_elems}, tensor::DType::kF32,
                                    memory::Category::kParams)
            : tensor::Tensor::empty(alloc, tensor::Shape{part.shard_elems}, tensor::DType::kF32,
                                memory::Category::kParams);
    std::vector<float> mine(static_cast<size_t>(part.shard_elems));
    for (int64_t i = 0; i < part.shard_elems; ++i) {
      mine[static_cast<size_t>(i)] = static_cast<float>(part.begin(rank) + i) + 0.5f;
    }
    tensor::from_host_f32(*device, mine, shard);
    int binds = 0;
    memory::PageableHostTier host_tier(*device);  // the tier the host shard stands for
    ParamGatherer g(flat, alloc, dp.get(), part, shard, units_of(layout, persistent_below),
                    max_live, [&binds] { ++binds; }, shard_on_host ? &host_tier : nullptr);
    fn(rank, g, flat, *device, shard, alloc);
    EXPECT_GT(binds, 0);
  });
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

// The gathered entry i holds the padded buffer's values at its offset.
void expect_entry(memory::Device& device, const nn::FlatParams& flat, size_t i, float add = 0.0f) {
  const nn::ParamEntry& e = flat.layout().entries()[i];
  const tensor::Tensor t = flat.param(i);
  ASSERT_TRUE(t.defined()) << e.name;
  const std::vector<float> v = tensor::to_host_f32(device, t);
  for (int64_t j = 0; j < e.shape.numel(); ++j) {
    ASSERT_EQ(v[static_cast<size_t>(j)], static_cast<float>(e.offset_elems + j) + 0.5f + add)
        << e.name << " element " << j;
  }
}

TEST(ParamGatherer, GathersEveryUnitFromItsOwnersAtTwoAndThreeRanks) {
  for (int ws : {1, 2, 3}) {
    run(ws, 1000, 0, [&](int, ParamGatherer& g, nn::FlatParams& flat, memory::Device& device,
                         tensor::Tensor&, memory::CachingAllocator& alloc) {
      const size_t before = alloc.stats().by_category[0].current_bytes;  // params: the shard
      for (int u = 0; u < g.num_units(); ++u) EXPECT_FALSE(flat.param(static_cast<size_t>(u)).defined());
      for (int u = 0; u < g.num_units(); ++u) g.gather(u);  // all in flight at once
      EXPECT_EQ(g.live_elems(), 384);
      for (int u = g.num_units() - 1; u >= 0; --u) g.wait(u);
      for (size_t i = 0; i < 3; ++i) expect_entry(device, flat, i);
      for (int u = 0; u < g.num_units(); ++u) g.release(u);
      EXPECT_EQ(g.live_elems(), 0);
      EXPECT_FALSE(flat.param(1).defined());
      EXPECT_EQ(alloc.stats().by_category[0].current_bytes, before);
      const GatherStats s = g.take_stats();
      EXPECT_EQ(s.gathers, 3);
      EXPECT_EQ(s.peak_live_elems, 384);
      EXPECT_EQ(s.peak_live_bytes, 384u * 4);
      // Received: everything but this rank's part of the 384 elements.
      if (ws == 1) {
        EXPECT_EQ(s.gathered_bytes, 0u);
      } else {
        EXPECT_GT(s.gathered_bytes, 0u);
      }
    });
  }
}

// Note [Parameter offload]: the shard in host memory. Each rank's part goes up on the
// gatherer's copy stream, which the broadcasts wait for; the device holds only the buffers.
TEST(ParamGatherer, GathersFromAShardInHostMemory) {
  for (int ws : {1, 2, 3}) {
    run(
        ws, 1000, 100,
        [&](int rank, ParamGatherer& g, nn::FlatParams& flat, memory::Device& device,
            tensor::Tensor& shard, memory::CachingAllocator& alloc) {
          EXPECT_EQ(alloc.stats().by_category[0].current_bytes, 0u);  // nothing on the device
          g.refresh_persistent();
          expect_entry(device, flat, 2);
          for (int u = 0; u < 2; ++u) g.gather(u);
          for (int u = 1; u >= 0; --u) g.wait(u);
          for (size_t i = 0; i < 2; ++i) expect_entry(device, flat, i);
          g.release(0);
          g.gather(0);
          g.release(0);  // an upload still in flight is waited for before its buffer goes
          g.release(1);
          g.check();
          const GatherStats s = g.take_stats();
          const Partition part = make_partition(384, ws);
          // This rank's parts of unit 0 (gathered twice), unit 1 and unit 2 (persistent).
          uint64_t mine = 0;
          const int64_t lo = part.begin(rank), hi = part.end(rank);
          const int64_t bounds[4] = {0, 128, 320, 384};
          for (int u : {0, 0, 1, 2}) {
            mine += static_cast<uint64_t>(
                std::max<int64_t>(0, std::min(hi, bounds[u + 1]) - std::max(lo, bounds[u])) * 4);
          }
          EXPECT_EQ(s.h2d_bytes, mine);
          // The shard changes on the host: the next gather sees it.
          float* p = static_cast<float*>(shard.data());
          for (int64_t i = 0; i < shard.numel(); ++i) p[i] += 1.0f;
          g.gather(1);
          g.wait(1);
          expect_entry(device, flat, 1, 1.0f);
          g.release(1);
        },
        /*shard_on_host=*/true);
  }
}

TEST(ParamGatherer, AnEvictedPrefetchIsWaitedForBeforeItsBufferGoes) {
  run(2, 1000, 0, [](int, ParamGatherer& g, nn::FlatParams& flat, memory::Device& device,
                     tensor::Tensor&, memory::CachingAllocator&) {
    g.gather(1);
    g.release(1);  // never waited: release waits for the broadcasts first
    g.gather(1);
    g.wait(1);
    expect_entry(device, flat, 1);
    g.release(1);
  });
}

TEST(ParamGatherer, ThePlanAndTheGathererMustAgree) {
  run(2, 200, 0, [](int, ParamGatherer& g, nn::FlatParams&, memory::Device&, tensor::Tensor&,
                    memory::CachingAllocator&) {
    EXPECT_THROW(g.wait(0), InternalError);     // not gathered
    EXPECT_THROW(g.release(0), InternalError);  // not gathered
    g.gather(1);                                // 192 elements
    EXPECT_THROW(g.gather(1), InternalError);   // twice
    EXPECT_THROW(g.gather(2), InternalError);   // 192 + 64 > the cap of 200
    // Both ranks threw at the same point, so their collectives still pair up.
    g.wait(1);
    g.release(1);
  });
}

TEST(ParamGatherer, PersistentUnitsFollowTheShard) {
  run(2, 1000, 100, [](int, ParamGatherer& g, nn::FlatParams& flat, memory::Device& device,
                       tensor::Tensor& shard, memory::CachingAllocator&) {
    g.refresh_persistent();  // stage2 (64 elements) only
    expect_entry(device, flat, 2);
    EXPECT_EQ(g.live_elems(), 0);  // persistent units are not live ones
    EXPECT_FALSE(flat.param(0).defined());
    // An update of the shard reaches the persistent buffer at the next refresh.
    std::vector<float> v = tensor::to_host_f32(device, shard);
    for (float& x : v) x += 1.0f;
    tensor::from_host_f32(device, v, shard);
    g.refresh_persistent();
    expect_entry(device, flat, 2, 1.0f);
    g.gather_all();
    expect_entry(device, flat, 0, 1.0f);
    expect_entry(device, flat, 1, 1.0f);
    g.release_all();
    EXPECT_FALSE(flat.param(0).defined());
    EXPECT_TRUE(flat.param(2).defined());
  });
}

}  // namespace
}  // namespace porter::zero
