// Failure of the Gloo communicator (Note [Comm failure], Note [Gloo abort]): a rank that throws,
// a rank that stays silent, abort(), and use after failure. Nothing may hang: every wait is
// bounded by a short timeout.
#include <gtest/gtest.h>

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "base/error.h"
#include "comm/communicator.h"
#include "comm_test_util.h"

namespace porter::comm {
namespace {

using testing::small_cpu_device;
using testing::what_of;

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

// Which kind of error a rank ended with: "peer", "timeout", "other: ..." or "" for none.
std::string kind_of(const std::exception_ptr& e) {
  if (!e) return "";
  try {
    std::rethrow_exception(e);
  } catch (const PeerError&) {
    return "peer";
  } catch (const TimeoutError&) {
    return "timeout";
  } catch (const std::exception& ex) {
    return std::string("other: ") + ex.what();
  }
}

struct RankThrew : std::runtime_error {
  RankThrew() : std::runtime_error("rank 1 threw mid-step") {}
};

// Rank 1 throws before the third all_reduce; its communicator is destroyed while unwinding,
// which closes its connections. The others fail with an error naming the op instead of
// hanging.
TEST(CommFailure, RankThatThrowsMakesThePeersFail) {
  constexpr int kWs = 4;
  auto errors = run_thread_ranks(kWs, [](int rank, std::shared_ptr<Store> store) {
    auto device = small_cpu_device();
    CommOptions o;
    o.timeout = Seconds{2};
    auto comm = make_communicator(*device, store, rank, kWs, o);
    std::vector<float> buf(1000, 1.0f);
    for (int step = 0; step < 3; ++step) {
      if (rank == 1 && step == 2) throw RankThrew();
      comm->all_reduce(buf.data(), buf.size(), ElemType::kF32, ReduceOp::kSum).wait();
    }
  });
  ASSERT_TRUE(errors[1]);
  try {
    std::rethrow_exception(errors[1]);
  } catch (const RankThrew&) {
  } catch (const std::exception& e) {
    ADD_FAILURE() << "rank 1 ended with " << e.what();
  }
  for (int r : {0, 2, 3}) {
    const std::string kind = kind_of(errors[static_cast<size_t>(r)]);
    EXPECT_TRUE(kind == "peer" || kind == "timeout") << "rank " << r << ": " << kind;
    const auto& err = errors[static_cast<size_t>(r)];
    const std::string msg = err ? what_of(err) : "";
    EXPECT_TRUE(
        contains(msg, "rank " + std::to_string(r) + " of world: all_reduce of 1000 f32 failed"))
        << msg;
  }
}

// Rank 0 stays alive but never issues the collective: the others time out (or, once the
// first of them gives up and closes its connections, see that peer close), naming the op.
TEST(CommFailure, SilentRankMakesThePeersTimeOut) {
  constexpr int kWs = 3;
  std::atomic<int> finished{0};
  auto errors = run_thread_ranks(kWs, [&](int rank, std::shared_ptr<Store> store) {
    auto device = small_cpu_device();
    CommOptions o;
    o.timeout = Seconds{1};
    auto comm = make_communicator(*device, store, rank, kWs, o);
    if (rank == 0) {
      while (finished.load() < kWs - 1) std::this_thread::yield();
      return;
    }
    struct Done {
      std::atomic<int>& n;
      ~Done() { n.fetch_add(1); }
    } done{finished};
    int32_t v = rank;
    comm->all_reduce(&v, 1, ElemType::kI32, ReduceOp::kSum).wait();
  });
  EXPECT_FALSE(errors[0]) << what_of(errors[0]);
  int timeouts = 0;
  for (int r = 1; r < kWs; ++r) {
    const std::string kind = kind_of(errors[static_cast<size_t>(r)]);
    EXPECT_TRUE(kind == "peer" || kind == "timeout") << "rank " << r << ": " << kind;
    timeouts += kind == "timeout";
    if (kind == "timeout") {
      const std::string msg = what_of(errors[static_cast<size_t>(r)]);
      EXPECT_TRUE(contains(msg, "all_reduce of 1 i32 failed: timed out after 1 s waiting for rank"))
          << msg;
      EXPECT_TRUE(contains(msg, "porter.comm.timeout_s")) << msg;
    }
  }
  EXPECT_GE(timeouts, 1);
}

// abort() on rank 0 while the others wait in an all_reduce it never joins: with a timeout far
// longer than the test, the peers must fail with PeerError (a TimeoutError would mean they
// waited it out). Afterwards every op on any of them rethrows.
TEST(CommFailure, AbortMakesPeersFailAtOnceAndLaterOpsRethrow) {
  constexpr int kWs = 3;
  std::atomic<int> waiting{0};
  auto errors = run_thread_ranks(kWs, [&](int rank, std::shared_ptr<Store> store) {
    auto device = small_cpu_device();
    CommOptions o;
    o.timeout = Seconds{60};
    auto comm = make_communicator(*device, store, rank, kWs, o);
    comm->barrier().wait();
    std::vector<float> buf(100, 1.0f);
    if (rank == 0) {
      while (waiting.load() < kWs - 1) std::this_thread::yield();
      comm->abort("rank 0 hit an error in its step");
      try {
        comm->all_reduce(buf.data(), buf.size(), ElemType::kF32, ReduceOp::kSum);
        ADD_FAILURE() << "an op after abort() was accepted";
      } catch (const PeerError& e) {
        EXPECT_TRUE(contains(e.what(), "failed earlier: rank 0 of world aborted: rank 0 hit an "
                                       "error in its step"))
            << e.what();
      }
      return;
    }
    Work w = comm->all_reduce(buf.data(), buf.size(), ElemType::kF32, ReduceOp::kSum);
    waiting.fetch_add(1);
    try {
      w.wait();
      ADD_FAILURE() << "rank " << rank << ": all_reduce succeeded without rank 0";
    } catch (const PeerError& e) {
      EXPECT_TRUE(contains(e.what(), "rank " + std::to_string(rank) +
                                         " of world: all_reduce of 100 f32 failed: rank "))
          << e.what();
      EXPECT_TRUE(contains(e.what(), "closed the connection")) << e.what();
    }
    // Use after failure rethrows, at the call.
    std::vector<float> out(300);
    try {
      comm->all_gather(buf.data(), out.data(), 100, ElemType::kF32);
      ADD_FAILURE() << "an op after a failure was accepted";
    } catch (const PeerError& e) {
      EXPECT_TRUE(contains(e.what(), "all_gather of 100 f32 failed: the communicator failed "
                                     "earlier"))
          << e.what();
    }
  });
  for (auto& e : errors) EXPECT_FALSE(e) << what_of(e);
}

// abort() wakes this rank's own op that is waiting for peers which never come.
TEST(CommFailure, AbortWakesThisRanksPendingOp) {
  constexpr int kWs = 2;
  std::atomic<bool> aborted{false};
  // Rank 0 aborts only once rank 1's communicator is built: Gloo's full-mesh connect can
  // return on one rank while the other is still connecting, and an abort then would fail
  // rank 1's rendezvous instead of rank 0's pending op.
  std::atomic<bool> connected{false};
  auto errors = run_thread_ranks(kWs, [&](int rank, std::shared_ptr<Store> store) {
    auto device = small_cpu_device();
    CommOptions o;
    o.timeout = Seconds{60};
    auto comm = make_communicator(*device, store, rank, kWs, o);
    if (rank == 1) {
      connected.store(true);
      while (!aborted.load()) std::this_thread::yield();
      return;
    }
    while (!connected.load()) std::this_thread::yield();
    int32_t v = 1;
    Work w = comm->all_reduce(&v, 1, ElemType::kI32, ReduceOp::kSum);
    comm->abort("shutting down");
    aborted.store(true);
    try {
      w.wait();
      ADD_FAILURE() << "all_reduce succeeded without rank 1";
    } catch (const PeerError& e) {
      EXPECT_TRUE(contains(e.what(), "rank 0 of world aborted: shutting down")) << e.what();
      EXPECT_TRUE(contains(e.what(), "all_reduce of 1 i32 failed")) << e.what();
    }
    EXPECT_TRUE(w.done());
  });
  for (auto& e : errors) EXPECT_FALSE(e) << what_of(e);
}

// A rendezvous that not every rank joins times out naming the group and the size.
TEST(CommFailure, RendezvousTimesOut) {
  auto device = small_cpu_device();
  auto store = std::make_shared<InMemoryStore>(Seconds{1});
  CommOptions o;
  o.timeout = Seconds{0.3};
  try {
    make_communicator(*device, store, 0, 2, o);
    ADD_FAILURE() << "a rendezvous without rank 1 succeeded";
  } catch (const TimeoutError& e) {
    EXPECT_TRUE(contains(e.what(), "rank 0 of world: gloo rendezvous of 2 ranks timed out"))
        << e.what();
  }
}

}  // namespace
}  // namespace porter::comm
