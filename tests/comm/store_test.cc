// The rendezvous stores (comm/store.h): InMemoryStore and PrefixStore semantics, TcpStore with
// clients on threads and in forked processes (with and without the token), timeouts, and a
// server that goes away. Admission and a stranger's cost: store_security_test.cc.
#include "comm/store.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

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


// --- TcpStore ---------------------------------------------------------------------------

// A port that was free a moment ago (for tests where clients start before the server).
uint16_t free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  EXPECT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  socklen_t len = sizeof(a);
  EXPECT_EQ(::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len), 0);
  ::close(fd);
  return ntohs(a.sin_port);
}

TcpStoreOptions server_options(Seconds timeout = 5s) {
  TcpStoreOptions o;
  o.port = 0;
  o.is_server = true;
  o.timeout = timeout;
  return o;
}

TcpStoreOptions client_options(uint16_t port, Seconds timeout = 5s) {
  TcpStoreOptions o;
  o.port = port;
  o.timeout = timeout;
  return o;
}

template <typename E, typename Fn>
std::string error_message(Fn&& fn) {
  try {
    fn();
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "unexpected exception: " << e.what();
    return "";
  }
  ADD_FAILURE() << "expected an exception";
  return "";
}

TEST(TcpStore, PortZeroPicksAFreePort) {
  TcpStore a(server_options());
  TcpStore b(server_options());
  EXPECT_NE(a.port(), 0);
  EXPECT_NE(b.port(), 0);
  EXPECT_NE(a.port(), b.port());
  TcpStore c(client_options(a.port()));
  EXPECT_EQ(c.port(), a.port());
}

TEST(TcpStore, SemanticsOnServerAndClient) {
  TcpStore server(server_options());
  check_basic_semantics(server);
  TcpStore client(client_options(server.port()));
  EXPECT_EQ(client.get_string("a"), "two");  // the server's rank is a client of the same map
  EXPECT_EQ(client.add("n", 3), 1);
  EXPECT_EQ(client.default_timeout(), Seconds{5});
}

TEST(TcpStore, GetAndWaitBlockUntilAnotherThreadSets) {
  TcpStore server(server_options());
  TcpStore client(client_options(server.port()));
  check_get_blocks_until_set(client);  // one store shared by two threads
  std::thread setter([&] {
    std::this_thread::sleep_for(20ms);
    server.set_string("from_server", "x");
  });
  EXPECT_EQ(client.get_string("from_server", 5s), "x");
  setter.join();
}

TEST(TcpStore, ClientsStartBeforeTheServerAndWorldSizeWaitsForAll) {
  const uint16_t port = free_port();
  constexpr int kClients = 8;
  constexpr int kAddsPerClient = 100;
  std::atomic<int> failures{0};
  std::vector<std::thread> ts;
  for (int t = 0; t < kClients; ++t) {
    ts.emplace_back([&, t] {
      try {
        TcpStoreOptions o = client_options(port);
        o.world_size = kClients + 1;
        TcpStore c(o);
        for (int i = 0; i < kAddsPerClient; ++i) c.add("count", 1);
        c.set_string("done/" + std::to_string(t), "1");
      } catch (const std::exception& e) {
        ADD_FAILURE() << "client " << t << ": " << e.what();
        failures++;
      }
    });
  }
  std::this_thread::sleep_for(50ms);  // the clients are retrying by now
  TcpStoreOptions o = server_options();
  o.port = port;
  o.world_size = kClients + 1;
  TcpStore server(o);
  std::vector<std::string> done;
  for (int t = 0; t < kClients; ++t) done.push_back("done/" + std::to_string(t));
  server.wait(done, 5s);
  for (auto& t : ts) t.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(server.add("count", 0), kClients * kAddsPerClient);
}

TEST(TcpStore, AddFromEightThreadsOfOneClientCountsExactly) {
  TcpStore server(server_options());
  TcpStore client(client_options(server.port()));
  std::vector<std::thread> ts;
  for (int t = 0; t < 8; ++t) {
    ts.emplace_back([&] {
      for (int i = 0; i < 100; ++i) client.add("count", 1);
    });
  }
  for (auto& t : ts) t.join();
  EXPECT_EQ(server.add("count", 0), 800);
}

TEST(TcpStore, LargeValuesRoundTrip) {
  TcpStore server(server_options());
  TcpStore a(client_options(server.port()));
  TcpStore b(client_options(server.port()));
  Bytes big(4 << 20);
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>((i * 7919) >> 3);
  std::thread reader([&] { EXPECT_EQ(b.get("big", 5s), big); });
  a.set("big", big);
  reader.join();
  EXPECT_EQ(server.get("big"), big);
}

TEST(TcpStore, WaitTimesOutNamingTheMissingKeyAndTheConnectionStaysUsable) {
  TcpStore server(server_options());
  TcpStore client(client_options(server.port()));
  client.set_string("present", "p");
  std::string msg = error_message<TimeoutError>([&] { client.wait({"present", "never"}, 0.2s); });
  EXPECT_NE(msg.find("TcpStore"), std::string::npos) << msg;
  EXPECT_NE(msg.find("wait"), std::string::npos) << msg;
  EXPECT_NE(msg.find("\"never\""), std::string::npos) << msg;
  EXPECT_EQ(msg.find("\"present\""), std::string::npos) << msg;
  msg = error_message<TimeoutError>([&] { client.get("absent", 0.2s); });
  EXPECT_NE(msg.find("get"), std::string::npos) << msg;
  EXPECT_NE(msg.find("absent"), std::string::npos) << msg;
  // The server answers the timed-out calls late; the client drops those replies.
  server.set_string("never", "late");
  server.set_string("absent", "late too");
  EXPECT_EQ(client.get_string("present"), "p");
  EXPECT_EQ(client.add("c", 2), 2);
  EXPECT_TRUE(client.check("never"));
  EXPECT_EQ(client.get_string("absent"), "late too");
}

TEST(TcpStore, AddOnANonCounterValueIsRejectedAndTheStoreStaysUsable) {
  TcpStore server(server_options());
  TcpStore client(client_options(server.port()));
  client.set_string("str", "abc");
  std::string msg = error_message<InvalidArgument>([&] { client.add("str", 1); });
  EXPECT_NE(msg.find("str"), std::string::npos) << msg;
  EXPECT_EQ(client.get_string("str"), "abc");
}

TEST(TcpStore, ConnectingToNoServerTimesOutNamingTheAddress) {
  const uint16_t port = free_port();
  std::string msg = error_message<TimeoutError>([&] { TcpStore c(client_options(port, 0.3s)); });
  EXPECT_NE(msg.find("127.0.0.1:" + std::to_string(port)), std::string::npos) << msg;
}

TEST(TcpStore, WorldSizeTimesOutNamingHowManyJoined) {
  TcpStoreOptions o = server_options(0.3s);
  o.world_size = 3;
  std::string msg = error_message<TimeoutError>([&] { TcpStore s(o); });
  EXPECT_NE(msg.find("1 of 3"), std::string::npos) << msg;
}

TEST(TcpStore, InvalidOptionsAreRejected) {
  TcpStoreOptions o = server_options(0s);
  EXPECT_THROW(TcpStore{o}, InvalidArgument);
  EXPECT_THROW(TcpStore{client_options(0)}, InvalidArgument);
  o = server_options();
  o.world_size = -1;
  EXPECT_THROW(TcpStore{o}, InvalidArgument);
  TcpStore taken(server_options());
  o = server_options();
  o.port = taken.port();
  std::string msg = error_message<InvalidArgument>([&] { TcpStore{o}; });
  EXPECT_NE(msg.find(std::to_string(taken.port())), std::string::npos) << msg;
}

TEST(TcpStore, ServerDestroyedWhileAClientWaitsGivesPeerError) {
  auto server = std::make_unique<TcpStore>(server_options());
  const uint16_t port = server->port();
  TcpStore client(client_options(port, 30s));
  client.set_string("k", "v");
  std::string msg;
  std::thread waiter([&] {
    msg = error_message<PeerError>([&] { client.get("never"); });  // 30 s default
  });
  std::this_thread::sleep_for(50ms);
  server.reset();
  waiter.join();
  EXPECT_NE(msg.find("127.0.0.1:" + std::to_string(port)), std::string::npos) << msg;
  EXPECT_NE(msg.find("get(\"never\")"), std::string::npos) << msg;
  // The next call fails at once too.
  msg = error_message<PeerError>([&] { client.set_string("k", "w"); });
  EXPECT_NE(msg.find("set(\"k\")"), std::string::npos) << msg;
}

// --- TcpStore across processes ---------------------------------------------------------
// Children are forked while this process runs no other thread (every earlier test joined its
// threads; the parent's server or killer thread starts after the fork), so the children may
// start threads of their own, also under TSan. They do only store calls, report through their
// exit code, and leave with _exit.

int child_exit_code(pid_t pid) {
  int status = 0;
  if (::waitpid(pid, &status, 0) != pid) return -1;
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  return 128 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
}

// Exit codes: 0 ok, 1 an exception, 2 a wrong value.
int run_child(uint16_t port, int index, int children) {
  try {
    TcpStoreOptions o = client_options(port, 5s);
    o.world_size = children + 1;
    TcpStore c(o);
    c.add("count", index + 1);
    c.set_string("child/" + std::to_string(index), std::to_string(index * index));
    std::vector<std::string> all;
    for (int i = 0; i < children; ++i) all.push_back("child/" + std::to_string(i));
    c.wait(all, 5s);
    const int peer = (index + 1) % children;
    if (c.get_string("child/" + std::to_string(peer)) != std::to_string(peer * peer)) return 2;
    if (c.get_string("from_parent", 5s) != "hello") return 2;
    c.set_string("ack/" + std::to_string(index), "1");
    return 0;
  } catch (const std::exception&) {
    return 1;
  }
}

TEST(TcpStoreProcesses, ChildrenAndParentSetGetWaitAdd) {
  const uint16_t port = free_port();
  constexpr int kChildren = 3;
  std::vector<pid_t> pids;
  for (int i = 0; i < kChildren; ++i) {
    pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) ::_exit(run_child(port, i, kChildren));
    pids.push_back(pid);
  }
  TcpStoreOptions o = server_options();
  o.port = port;
  o.world_size = kChildren + 1;
  TcpStore server(o);
  std::vector<std::string> children;
  for (int i = 0; i < kChildren; ++i) children.push_back("child/" + std::to_string(i));
  server.wait(children, 5s);
  EXPECT_EQ(server.add("count", 0), 1 + 2 + 3);
  EXPECT_EQ(server.get_string("child/2"), "4");
  server.set_string("from_parent", "hello");
  std::vector<std::string> acks;
  for (int i = 0; i < kChildren; ++i) acks.push_back("ack/" + std::to_string(i));
  server.wait(acks, 5s);
  for (int i = 0; i < kChildren; ++i) EXPECT_EQ(child_exit_code(pids[i]), 0) << "child " << i;
}

// Exit codes: 0 refused with a PeerError naming the token, 1 admitted, 2 another error.
int run_stranger(uint16_t port, const std::string& token) {
  try {
    TcpStoreOptions o = client_options(port, 5s);
    o.token = token;
    TcpStore c(o);
    c.set_string("stranger", "was here");
    return 1;
  } catch (const PeerError& e) {
    return std::string(e.what()).find("PORTER_STORE_TOKEN") != std::string::npos ? 0 : 2;
  } catch (const std::exception&) {
    return 2;
  }
}

TEST(TcpStoreProcesses, OnlyProcessesWithTheTokenJoin) {
  const uint16_t port = free_port();
  const std::string token = "a shared secret";
  constexpr int kChildren = 2;
  std::vector<pid_t> members;
  for (int i = 0; i < kChildren; ++i) {
    pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      // run_child with the token: the world joins and works as without one.
      try {
        TcpStoreOptions o = client_options(port, 5s);
        o.world_size = kChildren + 1;
        o.token = token;
        TcpStore c(o);
        c.add("count", 1);
        c.set_string("child/" + std::to_string(i), "ok");
        ::_exit(c.get_string("from_parent", 5s) == "hello" ? 0 : 2);
      } catch (...) {
        ::_exit(1);
      }
    }
    members.push_back(pid);
  }
  std::vector<pid_t> strangers;
  for (const std::string& t : {std::string(), std::string("a guess")}) {
    pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) ::_exit(run_stranger(port, t));
    strangers.push_back(pid);
  }
  TcpStoreOptions o = server_options();
  o.port = port;
  o.world_size = kChildren + 1;
  o.token = token;
  TcpStore server(o);
  server.wait({"child/0", "child/1"}, 5s);
  EXPECT_EQ(server.add("count", 0), kChildren);
  server.set_string("from_parent", "hello");
  for (size_t i = 0; i < strangers.size(); ++i) {
    EXPECT_EQ(child_exit_code(strangers[i]), 0) << "stranger " << i;
  }
  for (int i = 0; i < kChildren; ++i) EXPECT_EQ(child_exit_code(members[i]), 0) << "child " << i;
  EXPECT_FALSE(server.check("stranger"));
}

TEST(TcpStoreProcesses, ServerKilledWhileTheParentWaitsGivesPeerError) {
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::close(fds[0]);
    try {
      TcpStore server(server_options());
      const uint16_t p = server.port();
      if (::write(fds[1], &p, sizeof(p)) != sizeof(p)) ::_exit(1);
      // Until SIGKILL; bounded, so that a parent that fails early leaves no orphan behind.
      for (int i = 0; i < 300; ++i) ::usleep(100 * 1000);
      ::_exit(3);
    } catch (...) {
      ::_exit(1);
    }
  }
  ::close(fds[1]);
  bool reaped = false;
  struct KillOnExit {  // the child never outlives this test, whatever fails
    pid_t pid;
    bool& reaped;
    ~KillOnExit() {
      if (!reaped) {
        ::kill(pid, SIGKILL);
        child_exit_code(pid);
      }
    }
  } kill_on_exit{pid, reaped};
  uint16_t port = 0;
  const ssize_t got = ::read(fds[0], &port, sizeof(port));
  ::close(fds[0]);
  ASSERT_EQ(got, static_cast<ssize_t>(sizeof(port))) << "the server child did not start";
  TcpStore client(client_options(port, 30s));
  client.set_string("k", "v");
  std::thread killer([&] {
    std::this_thread::sleep_for(100ms);  // the get below is parked on the server by now
    ::kill(pid, SIGKILL);
  });
  // A PeerError (not a TimeoutError after 30 s) shows the failure was seen at once.
  std::string msg = error_message<PeerError>([&] { client.get("never"); });
  killer.join();
  reaped = true;
  EXPECT_EQ(child_exit_code(pid), 128 + SIGKILL);
  EXPECT_NE(msg.find("127.0.0.1:" + std::to_string(port)), std::string::npos) << msg;
  EXPECT_NE(msg.find("get"), std::string::npos) << msg;
  msg = error_message<PeerError>([&] { client.add("n", 1); });
  EXPECT_NE(msg.find("add"), std::string::npos) << msg;
}

}  // namespace
}  // namespace porter::comm
