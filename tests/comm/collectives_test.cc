// Every collective of the Gloo communicator over thread ranks, world sizes 1..8 and counts
// {0, 1, 7, non-divisible, large}, against host references (Note [Collective semantics],
// Note [Gloo ring]); process groups; the Work handle and CommStats.
#include <gtest/gtest.h>

#include <bit>
#include <cstdint>
#include <cstring>
#include <future>
#include <thread>
#include <random>
#include <vector>

#include "base/error.h"
#include "comm/communicator.h"
#include "comm_test_util.h"

namespace porter::comm {
namespace {

using testing::run_world;
using testing::run_world_ok;
using testing::what_of;

// ---- host references ----------------------------------------------------------------------

// Independent of comm/gloo_reduce.h on purpose: round to nearest even by hand.
uint16_t to_bf16(float f) {
  uint32_t u = std::bit_cast<uint32_t>(f);
  const uint32_t lsb = (u >> 16) & 1u;
  const uint32_t rounded = u + 0x7fffu + lsb;
  return static_cast<uint16_t>(rounded >> 16);
}
float from_bf16(uint16_t h) { return std::bit_cast<float>(uint32_t{h} << 16); }

// Integer-valued, so f32 sums over <= 8 ranks are exact whatever the order.
float int_value(int rank, size_t i) {
  return static_cast<float>(static_cast<int>((i * 7 + static_cast<size_t>(rank) * 131) % 1001) -
                            500);
}

// Non-integer bf16 values: sums round, so the order of additions shows.
uint16_t bf16_value(int rank, size_t i) {
  uint32_t h = static_cast<uint32_t>(i * 2654435761u + static_cast<uint32_t>(rank) * 40503u);
  float f = static_cast<float>(static_cast<int>(h % 20011u) - 10005) / 97.0f;
  return to_bf16(f);
}

// Chunk c of an all_reduce of `count` over n ranks: [c*count/n, (c+1)*count/n).
int all_reduce_chunk(size_t i, size_t count, int n) {
  for (int c = 0; c < n; ++c) {
    if (i < static_cast<size_t>(c + 1) * count / static_cast<size_t>(n)) return c;
  }
  return n - 1;
}

// The ring's order for chunk c: ranks c+1, c+2, ..., c (mod n), rounding after every add.
uint16_t bf16_ring_sum(const std::vector<uint16_t>& per_rank, int c) {
  const int n = static_cast<int>(per_rank.size());
  float acc = from_bf16(per_rank[static_cast<size_t>((c + 1) % n)]);
  for (int k = 2; k <= n; ++k) {
    acc = from_bf16(to_bf16(acc + from_bf16(per_rank[static_cast<size_t>((c + k) % n)])));
  }
  return to_bf16(acc);
}

size_t mismatches(const std::vector<float>& got, const std::vector<float>& want) {
  size_t bad = 0;
  for (size_t i = 0; i < want.size(); ++i) bad += std::bit_cast<uint32_t>(got[i]) !=
                                                  std::bit_cast<uint32_t>(want[i]);
  return bad + (got.size() != want.size() ? 1 : 0);
}

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kSanitized = true;  // 10-50x slower: the large case shrinks
#else
constexpr bool kSanitized = false;
#endif

// The large case: an all_reduce of 1M elements per rank at world sizes <= 4 (256K under a
// sanitizer), 256K elements in all for reduce_scatter and all_gather, 16K elsewhere. The
// suite runs three times in CI, so it stays quick.
enum class Large { kNone, kAllReduce, kPerBlock };
std::vector<size_t> counts_for(int ws, Large large) {
  std::vector<size_t> counts = {0, 1, 7, 1000 + 3};
  size_t big = size_t{1} << 14;
  if (large == Large::kAllReduce && ws <= 4) big = size_t{1} << (kSanitized ? 18 : 20);
  if (large == Large::kPerBlock && ws <= 4) big = (size_t{1} << 18) / static_cast<size_t>(ws);
  counts.push_back(big);
  return counts;
}

// ---- the grid -----------------------------------------------------------------------------

class CollectivesTest : public ::testing::TestWithParam<int> {};

TEST_P(CollectivesTest, AllReduceF32SumAndMax) {
  const int ws = GetParam();
  run_world_ok(ws, [&](Communicator& comm, memory::Device&) {
    const int r = comm.rank();
    for (size_t count : counts_for(ws, Large::kAllReduce)) {
      std::vector<float> buf(count), want_sum(count, 0.0f), want_max(count);
      for (size_t i = 0; i < count; ++i) {
        buf[i] = int_value(r, i);
        want_max[i] = int_value(0, i);
        for (int p = 0; p < ws; ++p) {
          want_sum[i] += int_value(p, i);
          want_max[i] = std::max(want_max[i], int_value(p, i));
        }
      }
      std::vector<float> maxbuf = buf;
      Work w = comm.all_reduce(buf.data(), count, ElemType::kF32, ReduceOp::kSum);
      w.wait();
      EXPECT_TRUE(w.done());
      EXPECT_EQ(mismatches(buf, want_sum), 0u) << "sum, count " << count << " rank " << r;
      if (count > (size_t{1} << 14)) continue;  // max: the small and mid sizes suffice
      comm.all_reduce(maxbuf.data(), count, ElemType::kF32, ReduceOp::kMax).wait();
      EXPECT_EQ(mismatches(maxbuf, want_max), 0u) << "max, count " << count << " rank " << r;
    }
  });
}

TEST_P(CollectivesTest, AllReduceBf16MatchesTheRoundedRingOrder) {
  const int ws = GetParam();
  run_world_ok(ws, [&](Communicator& comm, memory::Device&) {
    const int r = comm.rank();
    for (size_t count : counts_for(ws, Large::kNone)) {
      std::vector<uint16_t> buf(count);
      for (size_t i = 0; i < count; ++i) buf[i] = bf16_value(r, i);
      comm.all_reduce(buf.data(), count, ElemType::kBF16, ReduceOp::kSum).wait();
      size_t bad = 0;
      std::vector<uint16_t> per_rank(static_cast<size_t>(ws));
      for (size_t i = 0; i < count; ++i) {
        for (int p = 0; p < ws; ++p) per_rank[static_cast<size_t>(p)] = bf16_value(p, i);
        bad += buf[i] != bf16_ring_sum(per_rank, all_reduce_chunk(i, count, ws));
      }
      EXPECT_EQ(bad, 0u) << "count " << count << " rank " << r;
    }
  });
}

TEST_P(CollectivesTest, ReduceScatterOutOfPlaceAndInPlace) {
  const int ws = GetParam();
  run_world_ok(ws, [&](Communicator& comm, memory::Device&) {
    const int r = comm.rank();
    for (size_t count : counts_for(ws, Large::kPerBlock)) {
      const size_t total = count * static_cast<size_t>(ws);
      std::vector<float> in(total), out(count, -1.0f), want(count, 0.0f);
      for (size_t i = 0; i < total; ++i) in[i] = int_value(r, i);
      for (size_t j = 0; j < count; ++j) {
        for (int p = 0; p < ws; ++p) want[j] += int_value(p, static_cast<size_t>(r) * count + j);
      }
      comm.reduce_scatter(in.data(), out.data(), count, ElemType::kF32, ReduceOp::kSum).wait();
      EXPECT_EQ(mismatches(out, want), 0u) << "count " << count << " rank " << r;
      // In place: out is this rank's block of in.
      float* own = in.data() + static_cast<size_t>(r) * count;
      comm.reduce_scatter(in.data(), own, count, ElemType::kF32, ReduceOp::kSum).wait();
      EXPECT_EQ(mismatches(std::vector<float>(own, own + count), want), 0u)
          << "in place, count " << count << " rank " << r;
    }
  });
}

// Note [Collective semantics]: a reduce-scatter equals the matching block of the all-reduce,
// bitwise, for values whose sums round (f32 and bf16).
TEST_P(CollectivesTest, ReduceScatterIsTheBlockOfAllReduceBitwise) {
  const int ws = GetParam();
  run_world_ok(ws, [&](Communicator& comm, memory::Device&) {
    const int r = comm.rank();
    const size_t count = 257;
    const size_t total = count * static_cast<size_t>(ws);
    std::mt19937 gen(static_cast<uint32_t>(1000 + r));
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    std::vector<float> in(total);
    for (auto& v : in) v = dist(gen);
    std::vector<float> all = in, block(count);
    comm.all_reduce(all.data(), total, ElemType::kF32, ReduceOp::kSum).wait();
    comm.reduce_scatter(in.data(), block.data(), count, ElemType::kF32, ReduceOp::kSum).wait();
    EXPECT_EQ(std::memcmp(block.data(), all.data() + static_cast<size_t>(r) * count,
                          count * sizeof(float)),
              0);
    std::vector<uint16_t> in16(total), block16(count);
    for (size_t i = 0; i < total; ++i) in16[i] = to_bf16(in[i]);
    std::vector<uint16_t> all16 = in16;
    comm.all_reduce(all16.data(), total, ElemType::kBF16, ReduceOp::kSum).wait();
    comm.reduce_scatter(in16.data(), block16.data(), count, ElemType::kBF16, ReduceOp::kSum)
        .wait();
    EXPECT_EQ(std::memcmp(block16.data(), all16.data() + static_cast<size_t>(r) * count,
                          count * sizeof(uint16_t)),
              0);
    // Run to run: the same inputs give the same bits.
    std::vector<float> again(in.begin(), in.end());
    for (size_t i = 0; i < total; ++i) again[i] = in[i];
    comm.all_reduce(again.data(), total, ElemType::kF32, ReduceOp::kSum).wait();
    EXPECT_EQ(std::memcmp(again.data(), all.data(), total * sizeof(float)), 0);
  });
}

TEST_P(CollectivesTest, AllGatherOutOfPlaceAndInPlace) {
  const int ws = GetParam();
  run_world_ok(ws, [&](Communicator& comm, memory::Device&) {
    const int r = comm.rank();
    for (size_t count : counts_for(ws, Large::kPerBlock)) {
      const size_t total = count * static_cast<size_t>(ws);
      std::vector<float> in(count), out(total, -1.0f), want(total);
      for (size_t j = 0; j < count; ++j) in[j] = int_value(r, j);
      for (int p = 0; p < ws; ++p) {
        for (size_t j = 0; j < count; ++j) {
          want[static_cast<size_t>(p) * count + j] = int_value(p, j);
        }
      }
      comm.all_gather(in.data(), out.data(), count, ElemType::kF32).wait();
      EXPECT_EQ(mismatches(out, want), 0u) << "count " << count << " rank " << r;
      std::vector<float> inplace(total, -2.0f);
      std::copy(in.begin(), in.end(), inplace.begin() + static_cast<ptrdiff_t>(r * count));
      const float* own = inplace.data() + static_cast<size_t>(r) * count;
      comm.all_gather(own, inplace.data(), count, ElemType::kF32).wait();
      EXPECT_EQ(mismatches(inplace, want), 0u) << "in place, count " << count << " rank " << r;
    }
  });
}

TEST_P(CollectivesTest, BroadcastFromEveryRootAndBarrier) {
  const int ws = GetParam();
  run_world_ok(ws, [&](Communicator& comm, memory::Device&) {
    const int r = comm.rank();
    for (size_t count : {size_t{0}, size_t{1}, size_t{7}, size_t{1003}}) {
      for (int root = 0; root < ws; ++root) {
        std::vector<int32_t> buf(count), want(count);
        for (size_t i = 0; i < count; ++i) {
          buf[i] = static_cast<int32_t>(i) * 10 + r;
          want[i] = static_cast<int32_t>(i) * 10 + root;
        }
        comm.broadcast(buf.data(), count, ElemType::kI32, root).wait();
        EXPECT_EQ(buf, want) << "count " << count << " root " << root << " rank " << r;
      }
    }
    for (int i = 0; i < 3; ++i) comm.barrier().wait();
  });
}

// Several ops in flight at once, waited in order: the comm stream runs them FIFO.
TEST_P(CollectivesTest, QueuedOpsCompleteInOrder) {
  const int ws = GetParam();
  run_world_ok(ws, [&](Communicator& comm, memory::Device& device) {
    const int r = comm.rank();
    constexpr int kOps = 4;
    std::vector<std::vector<float>> bufs(kOps, std::vector<float>(1003));
    std::vector<Work> works;
    for (int k = 0; k < kOps; ++k) {
      for (size_t i = 0; i < bufs[static_cast<size_t>(k)].size(); ++i) {
        bufs[static_cast<size_t>(k)][i] = int_value(r + k, i);
      }
      works.push_back(comm.all_reduce(bufs[static_cast<size_t>(k)].data(), 1003, ElemType::kF32,
                                      ReduceOp::kSum));
    }
    for (int k = 0; k < kOps; ++k) {
      works[static_cast<size_t>(k)].wait_on(device.compute_stream());
      EXPECT_TRUE(works[static_cast<size_t>(k)].done());
      float want = 0;
      for (int p = 0; p < ws; ++p) want += int_value(p + k, 5);
      EXPECT_EQ(bufs[static_cast<size_t>(k)][5], want);
    }
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, CollectivesTest, ::testing::Range(1, 9),
                         [](const auto& p) { return "ws" + std::to_string(p.param); });

// ---- other element types --------------------------------------------------------------------

TEST(Collectives, F16I32I64U8F64Sums) {
  run_world_ok(3, [&](Communicator& comm, memory::Device&) {
    const int r = comm.rank();
    std::vector<uint16_t> h(5);
    for (size_t i = 0; i < h.size(); ++i) {
      h[i] = std::bit_cast<uint16_t>(static_cast<_Float16>(0.5f * static_cast<float>(i + r)));
    }
    comm.all_reduce(h.data(), h.size(), ElemType::kF16, ReduceOp::kSum).wait();
    for (size_t i = 0; i < h.size(); ++i) {
      EXPECT_EQ(static_cast<float>(std::bit_cast<_Float16>(h[i])), 0.5f * (3.0f * i + 3.0f));
    }
    std::vector<int32_t> a = {r, -r, 1000000 * r};
    comm.all_reduce(a.data(), a.size(), ElemType::kI32, ReduceOp::kSum).wait();
    EXPECT_EQ(a, (std::vector<int32_t>{3, -3, 3000000}));
    std::vector<int64_t> b = {int64_t{1} << 40, r};
    comm.all_reduce(b.data(), b.size(), ElemType::kI64, ReduceOp::kMax).wait();
    EXPECT_EQ(b, (std::vector<int64_t>{int64_t{1} << 40, 2}));
    std::vector<uint8_t> c = {200, static_cast<uint8_t>(r)};
    comm.all_reduce(c.data(), c.size(), ElemType::kU8, ReduceOp::kSum).wait();
    EXPECT_EQ(c, (std::vector<uint8_t>{static_cast<uint8_t>(600 % 256), 3}));
    std::vector<double> d = {0.25 * r};
    comm.all_reduce(d.data(), d.size(), ElemType::kF64, ReduceOp::kSum).wait();
    EXPECT_EQ(d[0], 0.75);
  });
}

// ---- Work, stats, errors ----------------------------------------------------------------------

TEST(Collectives, WorkReportsOpBytesTimesAndStatsCount) {
  run_world_ok(2, [&](Communicator& comm, memory::Device&) {
    EXPECT_EQ(comm.backend(), "gloo");
    EXPECT_EQ(comm.group_name(), "world");
    EXPECT_EQ(comm.stream().name(), "comm");
    std::vector<float> buf(100, 1.0f), big(200, 1.0f), out(100);
    Work a = comm.all_reduce(buf.data(), 100, ElemType::kF32, ReduceOp::kSum);
    Work b = comm.reduce_scatter(big.data(), out.data(), 100, ElemType::kF32, ReduceOp::kSum);
    Work copy = b;  // copies share one state
    copy.wait();
    EXPECT_TRUE(b.done());
    a.wait();
    EXPECT_EQ(a.op(), "all_reduce");
    EXPECT_EQ(b.op(), "reduce_scatter");
    EXPECT_EQ(a.payload_bytes(), 400u);
    EXPECT_EQ(b.payload_bytes(), 800u);
    EXPECT_LE(a.start_s(), a.end_s());
    EXPECT_LE(a.end_s(), b.start_s());  // FIFO on the comm stream
    CommStats s = comm.stats();
    EXPECT_EQ(s.ops, 2);
    EXPECT_EQ(s.payload_bytes, 1200u);
    EXPECT_GE(s.busy_s, 0.0);
    comm.reset_stats();
    EXPECT_EQ(comm.stats().ops, 0);
    EXPECT_EQ(out[0], 2.0f);
  });
}

TEST(Collectives, EmptyWorkAndBadArgumentsAreRejected) {
  Work empty;
  EXPECT_FALSE(empty.valid());
  EXPECT_TRUE(empty.done());
  EXPECT_THROW(empty.wait(), UsageError);
  run_world_ok(2, [&](Communicator& comm, memory::Device&) {
    std::vector<float> buf(4);
    EXPECT_THROW(comm.broadcast(buf.data(), 4, ElemType::kF32, 2), InvalidArgument);
    EXPECT_THROW(comm.all_reduce(nullptr, 4, ElemType::kF32, ReduceOp::kSum), InvalidArgument);
    // out overlapping in without being this rank's block.
    EXPECT_THROW(comm.reduce_scatter(buf.data(), buf.data() + 1, 2, ElemType::kF32,
                                     ReduceOp::kSum),
                 InvalidArgument);
    EXPECT_THROW(comm.split({0, 0}, "bad"), InvalidArgument);
    comm.barrier().wait();
  });
  auto device = testing::small_cpu_device();
  auto store = std::make_shared<InMemoryStore>(Seconds{1});
  try {
    make_communicator(*device, store, 2, 2, CommOptions{});
    ADD_FAILURE() << "rank 2 of 2 accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("RANK"), std::string::npos) << e.what();
  }
}

// A group can be formed again on the same store (a second run in one process).
TEST(Collectives, SameGroupTwiceOnOneStore) {
  auto errors = run_thread_ranks(3, [](int rank, std::shared_ptr<Store> store) {
    auto device = testing::small_cpu_device();
    for (int round = 0; round < 2; ++round) {
      auto comm = make_communicator(*device, store, rank, 3, CommOptions{});
      int32_t v = rank + round;
      comm->all_reduce(&v, 1, ElemType::kI32, ReduceOp::kSum).wait();
      EXPECT_EQ(v, 3 + 3 * round);
    }
  });
  for (auto& e : errors) EXPECT_FALSE(e) << what_of(e);
}

// The multi-process path: a TcpStore (rank 0 serves) instead of the in-memory store.
TEST(Collectives, OverATcpStore) {
  constexpr int kWs = 3;
  std::promise<uint16_t> port_promise;
  std::shared_future<uint16_t> port = port_promise.get_future().share();
  std::vector<std::exception_ptr> errors(kWs);
  std::vector<std::thread> threads;
  bool port_set = false;  // rank 0's thread only
  for (int rank = 0; rank < kWs; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        TcpStoreOptions so;
        so.is_server = rank == 0;
        so.port = rank == 0 ? 0 : port.get();
        so.timeout = Seconds{20};
        auto store = std::make_shared<TcpStore>(so);
        if (rank == 0) {
          port_promise.set_value(store->port());
          port_set = true;
        }
        auto device = testing::small_cpu_device();
        auto comm = make_communicator(*device, store, rank, kWs, CommOptions{});
        std::vector<float> v(1003, static_cast<float>(rank + 1));
        comm->all_reduce(v.data(), v.size(), ElemType::kF32, ReduceOp::kSum).wait();
        EXPECT_EQ(v[1002], 6.0f);
        comm->barrier().wait();  // rank 0's server outlives the others' last request
      } catch (...) {
        errors[static_cast<size_t>(rank)] = std::current_exception();
        if (rank == 0 && !port_set) port_promise.set_value(0);  // the others fail at once
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors) EXPECT_FALSE(e) << what_of(e);
}

// ---- process groups -------------------------------------------------------------------------

TEST(ProcessGroups, Ws4Tp2ReduceOverTheRightRanks) {
  auto errors = run_thread_ranks(4, [](int rank, std::shared_ptr<Store> store) {
    auto device = testing::small_cpu_device();
    std::shared_ptr<Communicator> world = make_communicator(*device, store, rank, 4, CommOptions{});
    ProcessGroups g = make_process_groups(world, 2);
    EXPECT_EQ(g.tp_size, 2);
    EXPECT_EQ(g.dp_size, 2);
    EXPECT_EQ(g.tp_rank, rank % 2);
    EXPECT_EQ(g.dp_rank, rank / 2);
    EXPECT_EQ(g.dp->size(), 2);
    EXPECT_EQ(g.tp->size(), 2);
    EXPECT_EQ(g.dp->rank(), g.dp_rank);
    EXPECT_EQ(g.tp->rank(), g.tp_rank);
    // Each rank contributes 1 << rank: the sum names the members.
    int32_t dp_sum = 1 << rank, tp_sum = 1 << rank, world_sum = 1 << rank;
    g.dp->all_reduce(&dp_sum, 1, ElemType::kI32, ReduceOp::kSum).wait();
    g.tp->all_reduce(&tp_sum, 1, ElemType::kI32, ReduceOp::kSum).wait();
    g.world->all_reduce(&world_sum, 1, ElemType::kI32, ReduceOp::kSum).wait();
    const int t = rank % 2, d = rank / 2;
    EXPECT_EQ(dp_sum, (1 << t) | (1 << (2 + t)));  // ranks {t, 2 + t}
    EXPECT_EQ(tp_sum, (1 << (2 * d)) | (1 << (2 * d + 1)));  // ranks {2d, 2d + 1}
    EXPECT_EQ(world_sum, 15);
    EXPECT_NE(g.dp->group_name(), g.tp->group_name());
  });
  for (auto& e : errors) EXPECT_FALSE(e) << what_of(e);
}

TEST(ProcessGroups, Tp1IsPureDataParallelAndBadTpIsRejected) {
  auto errors = run_thread_ranks(4, [](int rank, std::shared_ptr<Store> store) {
    auto device = testing::small_cpu_device();
    std::shared_ptr<Communicator> world = make_communicator(*device, store, rank, 4, CommOptions{});
    ProcessGroups g = make_process_groups(world, 1);
    EXPECT_EQ(g.dp.get(), world.get());
    EXPECT_EQ(g.tp->size(), 1);
    EXPECT_EQ(g.dp_rank, rank);
    int32_t v = 1;
    g.tp->all_reduce(&v, 1, ElemType::kI32, ReduceOp::kSum).wait();
    EXPECT_EQ(v, 1);
    try {
      make_process_groups(world, 3);
      ADD_FAILURE() << "tp 3 accepted at world size 4";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("divide the world size 4"), std::string::npos)
          << e.what();
    }
  });
  for (auto& e : errors) EXPECT_FALSE(e) << what_of(e);
}

TEST(ProcessGroups, SplitOfASubset) {
  auto errors = run_thread_ranks(4, [](int rank, std::shared_ptr<Store> store) {
    auto device = testing::small_cpu_device();
    auto world = make_communicator(*device, store, rank, 4, CommOptions{});
    if (rank == 1 || rank == 3) {
      auto sub = world->split({1, 3}, "odd");
      EXPECT_EQ(sub->rank(), rank / 2);
      EXPECT_EQ(sub->group_name(), "odd");
      int32_t v = rank;
      sub->all_reduce(&v, 1, ElemType::kI32, ReduceOp::kSum).wait();
      EXPECT_EQ(v, 4);
    }
    world->barrier().wait();
  });
  for (auto& e : errors) EXPECT_FALSE(e) << what_of(e);
}

}  // namespace
}  // namespace porter::comm
