// The rendezvous stores (comm/store.h): InMemoryStore and PrefixStore semantics, TcpStore with
// clients on threads and in forked processes, timeouts, and a server that goes away.
#include "comm/store.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "base/error.h"

namespace porter::comm {
namespace {

using namespace std::chrono_literals;

int64_t i64_of(const Bytes& b) {
  EXPECT_EQ(b.size(), 8u);
  uint64_t u = 0;
  for (size_t i = 0; i < 8 && i < b.size(); ++i) {
    u |= static_cast<uint64_t>(static_cast<uint8_t>(b[i])) << (8 * i);
  }
  return static_cast<int64_t>(u);
}

// The semantics every store shares (Note [Store semantics]), run against any store.
void check_basic_semantics(Store& s) {
  EXPECT_FALSE(s.check("a"));
  s.set_string("a", "one");
  EXPECT_TRUE(s.check("a"));
  EXPECT_EQ(s.get_string("a"), "one");
  s.set_string("a", "two");  // overwrites
  EXPECT_EQ(s.get_string("a"), "two");
  s.set("empty", Bytes{});
  EXPECT_TRUE(s.check("empty"));
  EXPECT_TRUE(s.get("empty").empty());
  Bytes binary = {'\0', '\xff', 'x', '\0'};
  s.set("bin", binary);
  EXPECT_EQ(s.get("bin"), binary);

  EXPECT_EQ(s.add("n", 5), 5);  // created as 0
  EXPECT_EQ(s.add("n", -7), -2);
  EXPECT_EQ(s.add("n", 0), -2);
  EXPECT_EQ(i64_of(s.get("n")), -2);
  s.wait({"a", "n", "bin"});
}

void check_get_blocks_until_set(Store& s) {
  std::thread setter([&] {
    std::this_thread::sleep_for(20ms);
    s.set_string("late", "here");
  });
  EXPECT_EQ(s.get_string("late", 5s), "here");
  setter.join();
  std::thread setter2([&] {
    std::this_thread::sleep_for(20ms);
    s.set_string("w1", "1");
    s.add("w2", 1);
  });
  s.wait({"w1", "w2"}, 5s);
  setter2.join();
}

template <typename Fn>
std::string timeout_message(Fn&& fn) {
  try {
    fn();
  } catch (const TimeoutError& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected TimeoutError";
  return "";
}

TEST(InMemoryStore, Semantics) {
  InMemoryStore s(5s);
  check_basic_semantics(s);
  EXPECT_EQ(s.default_timeout(), Seconds{5});
}

TEST(InMemoryStore, GetAndWaitBlockUntilAnotherThreadSets) {
  InMemoryStore s(5s);
  check_get_blocks_until_set(s);
}

TEST(InMemoryStore, TimeoutNamesStoreOperationKeysAndSeconds) {
  InMemoryStore s(5s);
  s.set_string("present", "x");
  std::string msg = timeout_message([&] { s.wait({"present", "missing_key"}, 0.05s); });
  EXPECT_NE(msg.find("InMemoryStore"), std::string::npos) << msg;
  EXPECT_NE(msg.find("wait"), std::string::npos) << msg;
  EXPECT_NE(msg.find("missing_key"), std::string::npos) << msg;
  EXPECT_EQ(msg.find("\"present\""), std::string::npos) << msg;
  EXPECT_NE(msg.find("0.05"), std::string::npos) << msg;
  msg = timeout_message([&] { s.get("nokey", 0.05s); });
  EXPECT_NE(msg.find("get"), std::string::npos) << msg;
  EXPECT_NE(msg.find("nokey"), std::string::npos) << msg;
}

TEST(InMemoryStore, DefaultTimeoutAppliesWhenZero) {
  InMemoryStore s(Seconds{0.05});
  std::string msg = timeout_message([&] { s.get("k"); });
  EXPECT_NE(msg.find("0.05"), std::string::npos) << msg;
}

TEST(InMemoryStore, AddFromManyThreadsCountsExactly) {
  InMemoryStore s(5s);
  std::vector<std::thread> ts;
  for (int t = 0; t < 8; ++t) {
    ts.emplace_back([&] {
      for (int i = 0; i < 500; ++i) s.add("count", 1);
    });
  }
  for (auto& t : ts) t.join();
  EXPECT_EQ(s.add("count", 0), 8 * 500);
}

TEST(InMemoryStore, AddOnNonCounterValueIsRejected) {
  InMemoryStore s(5s);
  s.set_string("str", "abc");
  EXPECT_THROW(s.add("str", 1), InvalidArgument);
}

TEST(PrefixStore, NamespacesKeys) {
  auto inner = std::make_shared<InMemoryStore>(5s);
  PrefixStore p("group0", inner);
  check_basic_semantics(p);
  EXPECT_TRUE(inner->check("group0/a"));
  EXPECT_FALSE(inner->check("a"));
  EXPECT_EQ(inner->get_string("group0/a"), "two");
  PrefixStore q("group1", inner);
  EXPECT_FALSE(q.check("a"));
  q.set_string("a", "other");
  EXPECT_EQ(p.get_string("a"), "two");
  EXPECT_EQ(q.get_string("a"), "other");
  EXPECT_EQ(p.default_timeout(), Seconds{5});
  PrefixStore nested("outer", std::make_shared<PrefixStore>("inner", inner));
  nested.set_string("k", "v");
  EXPECT_EQ(inner->get_string("inner/outer/k"), "v");
}

TEST(PrefixStore, BlocksAndTimesOutThroughTheInnerStore) {
  auto inner = std::make_shared<InMemoryStore>(5s);
  PrefixStore p("pg", inner);
  check_get_blocks_until_set(p);
  std::string msg = timeout_message([&] { p.wait({"gone"}, 0.05s); });
  EXPECT_NE(msg.find("pg/gone"), std::string::npos) << msg;
}

TEST(PrefixStore, NullInnerIsRejected) {
  EXPECT_THROW(PrefixStore("x", nullptr), InvalidArgument);
}

}  // namespace
}  // namespace porter::comm
