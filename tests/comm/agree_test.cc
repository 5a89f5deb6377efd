// Store votes (comm/agree.h): every rank of a world gets the same count of yes votes, for any
// mix of votes, for several decisions in a row, over an in-memory and a TCP store.
#include "comm/agree.h"

#include <atomic>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "comm/communicator.h"
#include "base/error.h"
#include "comm/store.h"

namespace porter::comm {
namespace {

TEST(CountVotes, EveryRankGetsTheSameCountForEachDecision) {
  constexpr int kRanks = 4;
  constexpr int kDecisions = 20;
  std::vector<std::vector<int>> seen(kRanks, std::vector<int>(kDecisions, -1));
  const auto errors = run_thread_ranks(kRanks, [&](int rank, std::shared_ptr<Store> store) {
    for (int d = 0; d < kDecisions; ++d) {
      // Decision d: the ranks r with bit r of d set vote yes.
      const bool yes = ((d >> rank) & 1) != 0;
      seen[rank][d] = count_votes(*store, "vote/" + std::to_string(d), kRanks, yes, Seconds{20});
    }
  });
  for (const auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
  for (int d = 0; d < kDecisions; ++d) {
    const int want = __builtin_popcount(static_cast<unsigned>(d) & ((1u << kRanks) - 1));
    for (int r = 0; r < kRanks; ++r) EXPECT_EQ(seen[r][d], want) << "decision " << d << " rank " << r;
  }
}

TEST(CountVotes, OneRankCountsItself) {
  InMemoryStore store;
  EXPECT_EQ(count_votes(store, "a", 1, true), 1);
  EXPECT_EQ(count_votes(store, "b", 1, false), 0);
}

TEST(CountVotes, ARankThatNeverVotesIsATimeoutNotAWrongCount) {
  InMemoryStore store;
  EXPECT_THROW(count_votes(store, "c", 2, true, Seconds{0.2}), TimeoutError);
}

}  // namespace
}  // namespace porter::comm
