// Who may join a TcpStore and what a stranger may cost it (Note [Store authentication] in
// comm/tcp_store.cc): the bind address, the token's hello, refusals logged once and rate-limited,
// memory that grows only with bytes received, and a fuzzer that must not disturb the world.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <poll.h>
#include <spdlog/sinks/ringbuffer_sink.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <iostream>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "base/error.h"
#include "base/log.h"
#include "comm/store.h"

namespace porter::comm {
namespace {

using namespace std::chrono_literals;

const std::string kToken = "0123456789abcdef0123456789abcdef";

TcpStoreOptions server_options(const std::string& token = kToken) {
  TcpStoreOptions o;
  o.port = 0;
  o.is_server = true;
  o.timeout = 5s;
  o.token = token;
  return o;
}

TcpStoreOptions client_options(uint16_t port, const std::string& token = kToken) {
  TcpStoreOptions o;
  o.port = port;
  o.timeout = 5s;
  o.token = token;
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

// The porter logger's lines while it lives. Install it before the server starts and destroy
// it after the server is gone: the logger's sink list is not guarded against its writers.
class CapturedLog {
 public:
  CapturedLog() : sink_(std::make_shared<spdlog::sinks::ringbuffer_sink_mt>(1000)) {
    auto& l = log::logger();
    saved_level_ = l.level();
    l.set_level(spdlog::level::info);
    l.sinks().push_back(sink_);
  }
  ~CapturedLog() {
    auto& l = log::logger();
    auto& sinks = l.sinks();
    sinks.erase(std::remove(sinks.begin(), sinks.end(), sink_), sinks.end());
    l.set_level(saved_level_);
  }
  std::vector<std::string> lines_with(const std::string& text) const {
    std::vector<std::string> out;
    for (auto& line : sink_->last_formatted()) {
      if (line.find(text) != std::string::npos) out.push_back(line);
    }
    return out;
  }

 private:
  std::shared_ptr<spdlog::sinks::ringbuffer_sink_mt> sink_;
  spdlog::level::level_enum saved_level_;
};

// --- raw sockets: what a stranger (or a fuzzer) sends -----------------------------------

void put_u32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

// A frame of the wire protocol (Note [TcpStore protocol]): request id 1, `op`, the fields.
std::string request(uint8_t op, const std::vector<std::string>& fields) {
  std::string body(8, '\0');
  body[0] = 1;
  body.push_back(static_cast<char>(op));
  put_u32(body, static_cast<uint32_t>(fields.size()));
  for (const auto& f : fields) {
    put_u32(body, static_cast<uint32_t>(f.size()));
    body += f;
  }
  std::string frame;
  put_u32(frame, static_cast<uint32_t>(body.size()));
  return frame + body;
}
constexpr uint8_t kOpSet = 1;
constexpr uint8_t kOpHello = 6;

// A connected blocking socket to 127.0.0.1:port (or -1); closed with the object.
class RawSocket {
 public:
  explicit RawSocket(uint16_t port, const char* addr = "127.0.0.1") {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    ::inet_pton(AF_INET, addr, &a.sin_addr);
    timeval tv{2, 0};  // bound every send/recv and the connect
    ::setsockopt(fd_, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    if (::connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
      connect_errno_ = errno;
      ::close(fd_);
      fd_ = -1;
    }
  }
  ~RawSocket() {
    if (fd_ >= 0) ::close(fd_);
  }
  RawSocket(const RawSocket&) = delete;
  RawSocket& operator=(const RawSocket&) = delete;

  bool connected() const { return fd_ >= 0; }
  int connect_errno() const { return connect_errno_; }
  // Sends what it can; false once the server closed the connection.
  bool send(const std::string& bytes) {
    size_t done = 0;
    while (done < bytes.size()) {
      const ssize_t n = ::send(fd_, bytes.data() + done, bytes.size() - done, MSG_NOSIGNAL);
      if (n <= 0) return false;
      done += static_cast<size_t>(n);
    }
    return true;
  }
  // The hello with `token`; true when the server answered it (a 13-byte ok frame).
  bool hello(const std::string& token) {
    if (!send(request(kOpHello, {token}))) return false;
    char reply[13];
    size_t got = 0;
    while (got < sizeof(reply)) {
      const ssize_t n = ::recv(fd_, reply + got, sizeof(reply) - got, 0);
      if (n <= 0) return false;
      got += static_cast<size_t>(n);
    }
    return reply[0] == 9 && reply[12] == 0;
  }
  // Whether the server closed the connection within `wait` (EOF or reset, any unread bytes
  // discarded).
  bool closed_within(std::chrono::milliseconds wait) {
    const auto deadline = std::chrono::steady_clock::now() + wait;
    while (std::chrono::steady_clock::now() < deadline) {
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, 20) <= 0) continue;
      char buf[256];
      const ssize_t n = ::recv(fd_, buf, sizeof(buf), MSG_DONTWAIT);
      if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK)) return true;
    }
    return false;
  }

 private:
  int fd_ = -1;
  int connect_errno_ = 0;
};

// This process's resident memory (/proc/self/statm).
int64_t resident_bytes() {
  std::ifstream statm("/proc/self/statm");
  int64_t size_pages = 0, resident_pages = 0;
  statm >> size_pages >> resident_pages;
  return resident_pages * ::sysconf(_SC_PAGESIZE);
}

// --- admission ---------------------------------------------------------------------------

TEST(StoreSecurity, ClientWithoutTheTokenIsRefusedAndTheWorldKeepsWorking) {
  CapturedLog log;
  {
    TcpStore server(server_options());
    TcpStore member(client_options(server.port()));
    member.set_string("before", "1");
    // The stranger connects (a connection proves nothing), but its first request is refused.
    TcpStore stranger(client_options(server.port(), ""));
    std::string msg = error_message<PeerError>([&] { stranger.set_string("mine", "x"); });
    EXPECT_NE(msg.find("PORTER_STORE_TOKEN"), std::string::npos) << msg;
    EXPECT_FALSE(server.check("mine"));
    member.set_string("after", "2");
    EXPECT_EQ(server.get_string("before"), "1");
    EXPECT_EQ(member.get_string("after"), "2");
    EXPECT_EQ(member.add("n", 5), 5);
  }
  auto refused = log.lines_with("refused the connection from 127.0.0.1:");
  ASSERT_EQ(refused.size(), 1u);
  EXPECT_NE(refused[0].find("before its hello"), std::string::npos) << refused[0];
}

TEST(StoreSecurity, WrongTokenIsRefusedAtTheHello) {
  CapturedLog log;
  {
    TcpStore server(server_options());
    TcpStore member(client_options(server.port()));
    // Same length, last byte differs: the comparison must look at every byte.
    std::string wrong = kToken;
    wrong.back() = 'g';
    std::string msg =
        error_message<PeerError>([&] { TcpStore c(client_options(server.port(), wrong)); });
    EXPECT_NE(msg.find("token"), std::string::npos) << msg;
    EXPECT_NE(msg.find("127.0.0.1:" + std::to_string(server.port())), std::string::npos) << msg;
    msg = error_message<PeerError>([&] { TcpStore c(client_options(server.port(), "short")); });
    EXPECT_NE(msg.find("token"), std::string::npos) << msg;
    member.set_string("k", "v");
    EXPECT_EQ(server.get_string("k"), "v");
  }
  EXPECT_EQ(log.lines_with("sent a wrong token").size(), 2u);
}

TEST(StoreSecurity, TokenIsSentOnEveryConnection) {
  // Eight threads of one client open several pooled connections; each proves itself.
  TcpStore server(server_options());
  TcpStore client(client_options(server.port()));
  std::vector<std::thread> ts;
  for (int t = 0; t < 8; ++t) {
    ts.emplace_back([&] {
      for (int i = 0; i < 50; ++i) client.add("count", 1);
    });
  }
  std::thread waiter([&] { EXPECT_EQ(client.get_string("late", 5s), "here"); });
  std::this_thread::sleep_for(20ms);
  client.set_string("late", "here");
  for (auto& t : ts) t.join();
  waiter.join();
  EXPECT_EQ(server.add("count", 0), 400);
}

TEST(StoreSecurity, RequestBeforeTheHelloIsRefused) {
  CapturedLog log;
  {
    TcpStore server(server_options());
    RawSocket raw(server.port());
    ASSERT_TRUE(raw.connected());
    raw.send(request(kOpSet, {"injected", "x"}));
    EXPECT_TRUE(raw.closed_within(2000ms));
    EXPECT_FALSE(server.check("injected"));
  }
  EXPECT_EQ(log.lines_with("sent a request before its hello").size(), 1u);
}

TEST(StoreSecurity, SilentConnectionIsClosedAfterTheHelloTimeout) {
  CapturedLog log;
  {
    TcpStoreOptions o = server_options();
    o.hello_timeout = 0.2s;
    TcpStore server(o);
    RawSocket raw(server.port());
    ASSERT_TRUE(raw.connected());
    EXPECT_TRUE(raw.closed_within(2000ms));
  }
  auto lines = log.lines_with("sent no hello within 0.2 s");
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_NE(lines[0].find("127.0.0.1:"), std::string::npos) << lines[0];
}

TEST(StoreSecurity, WithoutATokenTheServerWarnsOnceAndAdmitsAnyone) {
  CapturedLog log;
  {
    TcpStore server(server_options(""));
    TcpStore plain(client_options(server.port(), ""));
    TcpStore with_token(client_options(server.port()));  // a hello is answered, not required
    plain.set_string("a", "1");
    EXPECT_EQ(with_token.get_string("a"), "1");
  }
  auto lines = log.lines_with("unauthenticated");
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_NE(lines[0].find("PORTER_STORE_TOKEN"), std::string::npos) << lines[0];
}

TEST(StoreSecurity, RefusalsAreLoggedAtMostTenAMinuteThenCounted) {
  CapturedLog log;
  {
    TcpStore server(server_options());
    for (int i = 0; i < 30; ++i) {
      RawSocket raw(server.port());
      ASSERT_TRUE(raw.connected());
      raw.send(request(kOpSet, {"k", "v"}));
      ASSERT_TRUE(raw.closed_within(2000ms)) << "connection " << i;
    }
  }  // the server's shutdown reports the refusals it did not log
  EXPECT_EQ(log.lines_with("refused the connection from").size(), 10u);
  auto summary = log.lines_with("refused 20 more connections");
  EXPECT_EQ(summary.size(), 1u);
}

TEST(StoreSecurity, OverlongTokenIsRejected) {
  TcpStoreOptions o = server_options(std::string(kMaxStoreTokenBytes + 1, 'x'));
  std::string msg = error_message<InvalidArgument>([&] { TcpStore s(o); });
  EXPECT_NE(msg.find("PORTER_STORE_TOKEN"), std::string::npos) << msg;
  TcpStore s(server_options(std::string(kMaxStoreTokenBytes, 'x')));  // the longest is fine
  TcpStore c(client_options(s.port(), std::string(kMaxStoreTokenBytes, 'x')));
  c.set_string("k", "v");
  EXPECT_EQ(s.get_string("k"), "v");
}

// --- memory ------------------------------------------------------------------------------

TEST(StoreSecurity, HeaderClaimingAGibibyteCostsNoMemory) {
  constexpr uint32_t kClaim = (1u << 30) - 1;
  std::string header;
  put_u32(header, kClaim);
  TcpStore server(server_options());
  TcpStore member(client_options(server.port()));
  member.set_string("warm", std::string(1 << 20, 'w'));  // the first large read, outside the
  EXPECT_EQ(member.get_string("warm").size(), 1u << 20);  // measurement

  // Before its hello, such a header is refused without reading a byte of the body.
  {
    RawSocket stranger(server.port());
    ASSERT_TRUE(stranger.connected());
    stranger.send(header);
    EXPECT_TRUE(stranger.closed_within(2000ms));
  }

  // After the hello, the server waits for the body, but buffers only what arrived.
  const int64_t before = resident_bytes();
  std::vector<std::unique_ptr<RawSocket>> raws;
  for (int i = 0; i < 3; ++i) {
    raws.push_back(std::make_unique<RawSocket>(server.port()));
    ASSERT_TRUE(raws.back()->connected());
    ASSERT_TRUE(raws.back()->hello(kToken));
  }
  for (auto& r : raws) ASSERT_TRUE(r->send(header + std::string(1000, 'z')));
  // The server reads the three headers before it answers these (one io thread, and the
  // headers were sent first); the pause covers a slow scheduler.
  std::this_thread::sleep_for(200ms);
  member.set_string("k", "v");
  EXPECT_EQ(member.get_string("k"), "v");
  const int64_t after = resident_bytes();
  const int64_t growth = after - before;
  std::cout << "resident memory: " << before / 1024 << " KiB before, " << after / 1024
            << " KiB after three connections announcing " << kClaim
            << " bytes each; growth " << growth / 1024 << " KiB\n";
  RecordProperty("rss_growth_kib", static_cast<int>(growth / 1024));
  EXPECT_LT(growth, int64_t{64} << 20);
  for (auto& r : raws) EXPECT_FALSE(r->closed_within(50ms)) << "an honest slow frame is kept";
  raws.clear();
  EXPECT_EQ(member.add("n", 1), 1);
}

// --- fuzzing -----------------------------------------------------------------------------

// Random frames from strangers and from connections that know the token, while two members
// set, get and add: every member operation must return exactly the right value.
TEST(StoreSecurity, FuzzedFramesLeaveAuthenticatedClientsCorrect) {
  TcpStoreOptions o = server_options();
  o.hello_timeout = 0.3s;
  TcpStore server(o);
  const uint16_t port = server.port();
  std::atomic<bool> stop{false};
  std::atomic<int> fuzz_connections{0};
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE("fuzz seed " + std::to_string(seed));

  std::thread fuzzer([&] {
    std::mt19937_64 rng(seed);
    while (!stop.load()) {
      RawSocket raw(port);
      if (!raw.connected()) continue;
      ++fuzz_connections;
      switch (rng() % 4) {
        case 0: raw.hello(kToken); break;          // a member's hello, then garbage
        case 1: raw.hello("not the token"); break;  // refused
        default: break;                             // a stranger's garbage
      }
      const int frames = 1 + static_cast<int>(rng() % 4);
      for (int f = 0; f < frames; ++f) {
        uint32_t len = 0;
        switch (rng() % 5) {
          case 0: len = static_cast<uint32_t>(rng() % 32); break;
          case 1: len = static_cast<uint32_t>(rng() % 4200); break;
          case 2: len = static_cast<uint32_t>(rng() % (1u << 30)); break;
          case 3: len = (1u << 30) - 1 + static_cast<uint32_t>(rng() % 3); break;
          default: len = static_cast<uint32_t>(rng()); break;
        }
        std::string frame;
        put_u32(frame, len);
        const size_t body = std::min<size_t>(len, rng() % 9000);
        for (size_t i = 0; i < body; ++i) frame.push_back(static_cast<char>(rng()));
        if (rng() % 8 == 0 && frame.size() > 13) frame[12] = static_cast<char>(1 + rng() % 6);
        if (!raw.send(frame)) break;
      }
    }
  });

  constexpr auto kFuzzFor = 1500ms;
  std::atomic<int> member_ops{0};
  auto member = [&](int m) {
    TcpStore c(client_options(port));
    const auto end = std::chrono::steady_clock::now() + kFuzzFor;
    int64_t mine = 0;
    for (int i = 0; std::chrono::steady_clock::now() < end; ++i) {
      const std::string key = "m" + std::to_string(m) + "/" + std::to_string(i % 17);
      const std::string value =
          std::to_string(i) + std::string(static_cast<size_t>(i % 300), 'v');
      c.set_string(key, value);
      ASSERT_EQ(c.get_string(key), value);
      ASSERT_EQ(c.add("count/" + std::to_string(m), 3), mine + 3);
      mine += 3;
      EXPECT_GT(c.add("shared", 1), 0);
      member_ops += 3;
    }
    c.set_string("done/" + std::to_string(m), std::to_string(mine));
  };
  std::thread a(member, 0);
  std::thread b(member, 1);
  a.join();
  b.join();
  stop = true;
  fuzzer.join();

  const int64_t count0 = std::stoll(server.get_string("done/0"));
  const int64_t count1 = std::stoll(server.get_string("done/1"));
  EXPECT_EQ(server.add("count/0", 0), count0);
  EXPECT_EQ(server.add("count/1", 0), count1);
  EXPECT_EQ(server.add("shared", 0), (count0 + count1) / 3);
  EXPECT_GT(fuzz_connections.load(), 10);
  std::cout << fuzz_connections.load() << " fuzzing connections, " << member_ops.load()
            << " member operations\n";
}

// --- bind address ------------------------------------------------------------------------

// IPv4 addresses of this host's interfaces other than loopback.
std::vector<std::string> non_loopback_addresses() {
  std::vector<std::string> out;
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return out;
  for (ifaddrs* i = list; i != nullptr; i = i->ifa_next) {
    if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != AF_INET) continue;
    const auto* a = reinterpret_cast<const sockaddr_in*>(i->ifa_addr);
    if ((ntohl(a->sin_addr.s_addr) >> 24) == 127) continue;
    char text[INET_ADDRSTRLEN];
    ::inet_ntop(AF_INET, &a->sin_addr, text, sizeof(text));
    out.emplace_back(text);
  }
  ::freeifaddrs(list);
  return out;
}

TEST(StoreSecurity, ListensOnMasterAddrOnly) {
  TcpStore server(server_options());  // host 127.0.0.1
  {
    RawSocket ok(server.port(), "127.0.0.1");
    EXPECT_TRUE(ok.connected());
  }
  // 127.0.0.2 reaches this host's loopback too; a server on every interface would answer it.
  RawSocket other_loopback(server.port(), "127.0.0.2");
  EXPECT_FALSE(other_loopback.connected());
  EXPECT_EQ(other_loopback.connect_errno(), ECONNREFUSED)
      << std::strerror(other_loopback.connect_errno());
  const auto addrs = non_loopback_addresses();
  if (addrs.empty()) GTEST_SKIP() << "this machine has only loopback interfaces";
  for (const auto& addr : addrs) {
    RawSocket outside(server.port(), addr.c_str());
    EXPECT_FALSE(outside.connected()) << addr;
    EXPECT_EQ(outside.connect_errno(), ECONNREFUSED) << addr;
  }
}

TEST(StoreSecurity, LocalhostIsLoopback) {
  TcpStoreOptions o = server_options();
  o.host = "localhost";
  TcpStore server(o);
  TcpStoreOptions c = client_options(server.port());
  c.host = "localhost";
  TcpStore client(c);
  client.set_string("k", "v");
  EXPECT_EQ(server.get_string("k"), "v");
  const auto addrs = non_loopback_addresses();
  if (addrs.empty()) GTEST_SKIP() << "this machine has only loopback interfaces";
  RawSocket outside(server.port(), addrs.front().c_str());
  EXPECT_FALSE(outside.connected()) << addrs.front();
}

TEST(StoreSecurity, MasterAddrThatIsNotThisHostIsAnError) {
  // An address from the documentation ranges (RFC 5737) that this host does not have.
  const auto mine = non_loopback_addresses();
  std::string foreign;
  for (const char* a : {"203.0.113.77", "198.51.100.77", "192.0.2.77"}) {
    if (std::find(mine.begin(), mine.end(), a) == mine.end()) {
      foreign = a;
      break;
    }
  }
  TcpStoreOptions o = server_options();
  o.host = foreign;
  std::string msg = error_message<InvalidArgument>([&] { TcpStore s(o); });
  EXPECT_NE(msg.find("MASTER_ADDR \"" + foreign + "\""), std::string::npos) << msg;
  EXPECT_NE(msg.find("not an address of this host"), std::string::npos) << msg;
}

}  // namespace
}  // namespace porter::comm
