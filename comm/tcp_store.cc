// TcpStore: the rendezvous key/value server (Boost.Asio, one io_context thread on rank 0) and
// its client on every rank. Protocol and failure behaviour: Note [TcpStore protocol] below;
// who may connect and what a connection may cost: Note [Store authentication].
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <string_view>
#include <thread>
#include <utility>  // before asio: Boost 1.74's awaitable.hpp uses std::exchange unincluded

// GCC warns under -fsanitize=thread that asio's std::atomic_thread_fence is not instrumented;
// asio's fences order nothing this file relies on (its handlers run on one thread).
#if defined(__SANITIZE_THREAD__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wtsan"
#endif
#include <boost/asio.hpp>

#include "base/check.h"
#include "base/error.h"
#include "base/log.h"
#include "comm/store.h"
#include "comm/tcp_store_wire.h"

// Note [TcpStore protocol]
// Every message is a frame: a u32 little-endian byte count, then that many bytes.
//   request: u64 id | u8 op | u32 nfields | nfields x (u32 length | bytes)
//            kSet [key, value]  kGet [key]  kWait [key...]  kAdd [key, i64 delta]  kCheck [key]
//            kHello [token]: the first frame of every connection when the store has a token
//   reply:   u64 id | u8 status (0 ok, 1 error) | payload
//            set, wait, hello: empty; get: the value; add: the new i64; check: one byte 0/1;
//            error: a message (add on a value that is not an 8-byte counter).
// All integers are little-endian. The server answers set/add/check at once. get and wait are
// deferred replies: the server parks a waiter and answers when the last missing key is set, so
// a blocked client costs nothing but a socket.
// Timeouts are the client's: it polls its socket with a deadline. On timeout it throws
// TimeoutError and keeps the connection; the server's late reply carries the old request id
// and the next call on that connection reads and drops it. A deadline that passes in the
// middle of a reply frame closes that connection instead (the next call opens a fresh one).
// Threads of one rank that share a TcpStore each take their own connection from a pool, so a
// thread blocked in get() never delays another thread's set().
// Failure: the server's sockets close when its process dies or its TcpStore is destroyed; a
// client parked in poll() sees EOF/reset at once and throws PeerError naming host:port and the
// operation, and any later call does too (a refused reconnect is not retried once the server
// had been reached). Only a silent network partition waits out the timeout.

// Note [Store authentication]
// The store holds the run's addresses and NCCL's unique id, so whoever joins it can join the
// run or derail it. The server admits only the world:
// 1. It listens on the address MASTER_ADDR resolves to (the first of them that belongs to this
//    host), not on every interface: a store on 127.0.0.1 is unreachable from other hosts, one
//    on a cluster network is unreachable from the internet-facing interface. A MASTER_ADDR
//    that is no address of this host is an error naming it.
// 2. With a token (TcpStoreOptions::token, PORTER_STORE_TOKEN), every connection's first frame
//    must be kHello carrying it. A connection that sends anything else first, a wrong token,
//    or nothing within hello_timeout (5 s) is closed and logged once with its remote address;
//    at most kMaxRefusalLines such lines a minute, then one line counting the rest, so that a
//    flood cannot fill the log. Tokens are compared in time that depends only on their
//    lengths. Clients send the hello on every connection they open and wait for its reply, so
//    a wrong token is a PeerError that says so, at once. Without a token the server admits
//    anyone, as before, and warns once.
// 3. A stranger's word never allocates: before its hello a connection may send one frame of
//    at most kMaxHelloBytes (a larger header is refused before any body is read). After it,
//    a frame's body is read in pieces of kReadPieceBytes and the buffer grows only as bytes
//    arrive, so a header claiming 1 GiB costs nothing until the bytes come; a frame is at
//    most kMaxFrameBytes, and a buffer grown for a large frame is released after it.
// Not protected: the token and all keys travel in clear text (TCP, no TLS), so anyone who can
// read the network can read the token; and a flood of connections can still exhaust the
// server's file descriptors (each stranger holds one for at most hello_timeout).

namespace porter::comm {
namespace {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;
using Clock = std::chrono::steady_clock;
using boost::system::error_code;
using namespace tcp_wire;  // the frame format (comm/tcp_store_wire.h)

constexpr int kMaxRefusalLines = 10;  // per kRefusalWindow
constexpr auto kRefusalWindow = std::chrono::seconds(60);
const std::string kJoinedKey = "porter.tcp_store/joined";
const std::string kAllJoinedKey = "porter.tcp_store/all_joined";

// A completion condition for asio::async_read/async_write that moves as many bytes per system
// call as the socket takes (asio's own transfer_all caps every call at 64 KiB, which makes a
// multi-MiB value cost a thread wake-up per 64 KiB).
auto whole(size_t total) {
  return [total](const error_code& ec, size_t done) -> size_t { return ec ? 0 : total - done; };
}

std::string quoted(std::string_view key) { return str_cat("\"", std::string(key), "\""); }

std::string endpoint_string(const tcp::endpoint& ep) {
  const auto a = ep.address();
  return a.is_v6() ? str_cat("[", a.to_string(), "]:", ep.port())
                   : str_cat(a.to_string(), ":", ep.port());
}

// One log line per refused connection, at most kMaxRefusalLines per kRefusalWindow; the rest
// are counted and reported in one line when the next window opens or the server stops.
class RefusalLog {
 public:
  explicit RefusalLog(std::string where) : where_(std::move(where)) {}
  ~RefusalLog() { flush(); }

  void note(const std::string& peer, const std::string& why) {
    const auto now = Clock::now();
    if (now - window_start_ >= kRefusalWindow) {
      flush();
      window_start_ = now;
    }
    if (logged_ < kMaxRefusalLines) {
      ++logged_;
      PORTER_LOG_WARN("TcpStore server on {}: refused the connection from {}: it {}{}", where_,
                      peer, why,
                      logged_ == kMaxRefusalLines
                          ? " (further refusals this minute are counted, not logged)"
                          : "");
    } else {
      ++suppressed_;
    }
  }

 private:
  void flush() {
    if (suppressed_ > 0) {
      PORTER_LOG_WARN("TcpStore server on {}: refused {} more connections that were not logged "
                      "one by one",
                      where_, suppressed_);
    }
    logged_ = 0;
    suppressed_ = 0;
  }

  std::string where_;
  Clock::time_point window_start_ = Clock::now();
  int logged_ = 0;
  int64_t suppressed_ = 0;
};

// --- server ------------------------------------------------------------------------------

// Lock rule: none needed. Every member below the thread is touched only by the io thread
// (the constructor runs before the thread starts; the destructor posts its shutdown).
class Server {
 public:
  explicit Server(const TcpStoreOptions& o)
      : acceptor_(io_),
        accept_retry_(io_),
        token_(o.token),
        hello_timeout_(std::chrono::duration_cast<Clock::duration>(o.hello_timeout)) {
    listen(o.host, o.port);
    port_ = acceptor_.local_endpoint().port();
    where_ = endpoint_string(acceptor_.local_endpoint());
    refusals_ = std::make_unique<RefusalLog>(where_);
    if (token_.empty()) {
      PORTER_LOG_WARN("TcpStore server on {} is unauthenticated: any process that reaches this "
                      "address can join the run and read or change its keys. Set "
                      "PORTER_STORE_TOKEN (or PORTER_STORE_TOKEN_FILE) to the same secret on "
                      "every rank, e.g. export PORTER_STORE_TOKEN=$(openssl rand -hex 32)",
                      where_);
    }
    accept();
    thread_ = std::thread([this] {
      try {
        io_.run();
      } catch (const std::exception& e) {
        PORTER_LOG_ERROR("TcpStore server on port {} stopped: {}", port_, e.what());
      }
    });
  }

  ~Server() {
    asio::post(io_, [this] {
      error_code ec;
      acceptor_.close(ec);
      accept_retry_.cancel();
      for (auto& [ptr, weak] : sessions_) {
        if (auto s = weak.lock()) {
          s->closed = true;  // its aborted reads are not refusals
          s->hello_timer.cancel();
          s->socket.shutdown(tcp::socket::shutdown_both, ec);
          s->socket.close(ec);
        }
      }
      sessions_.clear();
      waiters_.clear();
      io_.stop();
    });
    if (thread_.joinable()) thread_.join();
  }

  uint16_t port() const { return port_; }

 private:
  struct Session {
    Session(tcp::socket s, std::string remote, bool admitted)
        : socket(std::move(s)),
          hello_timer(socket.get_executor()),
          peer(std::move(remote)),
          authenticated(admitted) {}
    tcp::socket socket;
    asio::steady_timer hello_timer;  // closes a connection that sends no hello in time
    std::string peer;                // the remote address, for the refusal log
    bool authenticated;              // sent the right hello (or the store has no token)
    bool closed = false;             // dropped: later handlers only unwind
    char header[4] = {};
    uint32_t frame_bytes = 0;        // the body length the header announced
    std::vector<char> body;          // the bytes of it received so far
    std::deque<std::vector<char>> outbox;  // replies not yet written; front() in flight
    bool writing = false;
  };
  struct Waiter {
    std::weak_ptr<Session> session;
    uint64_t id = 0;
    Op op = Op::kWait;
    std::string get_key;    // kGet: the value to answer with
    size_t missing = 0;     // keys not yet set
  };

  // Listens on `host`'s address only (Note [Store authentication], rule 1): the first of the
  // addresses it resolves to that this host owns.
  void listen(const std::string& host, uint16_t port) {
    error_code ec;
    tcp::resolver resolver(io_);
    auto results = resolver.resolve(host, std::to_string(port),
                                    tcp::resolver::numeric_service, ec);
    PORTER_CHECK(!ec && !results.empty(), "TcpStore: cannot resolve MASTER_ADDR \"", host,
                 "\" (", ec.message(), "); set MASTER_ADDR to this host's name or address");
    std::string foreign;  // resolved addresses that are not this host's
    for (const auto& entry : results) {
      const tcp::endpoint ep = entry.endpoint();
      acceptor_.close(ec);
      acceptor_.open(ep.protocol(), ec);
      if (!ec) acceptor_.set_option(tcp::acceptor::reuse_address(true), ec);
      if (!ec) acceptor_.bind(ep, ec);
      if (!ec) acceptor_.listen(asio::socket_base::max_listen_connections, ec);
      if (!ec) {
        warn_if_loopback(host, ep.address());
        return;
      }
      if (ec != boost::system::errc::address_not_available) {
        PORTER_CHECK(false, "TcpStore: cannot listen on ", endpoint_string(ep), " (",
                     ec.message(), "); another job may hold MASTER_PORT: pick a free "
                     "MASTER_PORT (or port 0 in tests)");
      }
      foreign += (foreign.empty() ? "" : ", ") + ep.address().to_string();
    }
    acceptor_.close(ec);
    PORTER_CHECK(false, "TcpStore: MASTER_ADDR \"", host, "\" resolves to ", foreign,
                 ", which is not an address of this host; rank 0 runs the store server and "
                 "listens on MASTER_ADDR: set MASTER_ADDR to rank 0's host name or address (or "
                 "start rank 0 on the host it names)");
  }

  // A host name that maps to a loopback address on rank 0 (Debian maps its own name to
  // 127.0.1.1) works on one host but hides the store from every other host.
  static void warn_if_loopback(const std::string& host, const asio::ip::address& a) {
    error_code ec;
    asio::ip::make_address(host, ec);
    const bool literal = !ec || host == "localhost";
    if (a.is_loopback() && !literal) {
      PORTER_LOG_WARN("TcpStore: MASTER_ADDR \"{}\" resolves to {} on this host, a loopback "
                      "address: only ranks on this host can reach the store. If the run spans "
                      "hosts, set MASTER_ADDR to an address the other hosts reach",
                      host, a.to_string());
    }
  }

  void accept() {
    acceptor_.async_accept([this](error_code ec, tcp::socket socket) {
      if (!acceptor_.is_open()) return;
      if (ec) {
        // Out of file descriptors (or memory): accepting again at once would spin. Wait, so
        // that connections that close (strangers time out) free some.
        if (accept_errors_++ % 100 == 0) {
          PORTER_LOG_WARN("TcpStore server on {}: accepting a connection failed ({}); "
                          "retrying in 100 ms",
                          where_, ec.message());
        }
        accept_retry_.expires_after(std::chrono::milliseconds(100));
        accept_retry_.async_wait([this](error_code ec2) {
          if (!ec2 && acceptor_.is_open()) accept();
        });
        return;
      }
      socket.set_option(tcp::no_delay(true), ec);
      error_code pe;
      const tcp::endpoint remote = socket.remote_endpoint(pe);
      auto s = std::make_shared<Session>(std::move(socket),
                                         pe ? std::string("an unknown address")
                                            : endpoint_string(remote),
                                         token_.empty());
      sessions_[s.get()] = s;
      if (!s->authenticated) arm_hello_deadline(s);
      read_frame(s);
      accept();
    });
  }

  void arm_hello_deadline(const std::shared_ptr<Session>& s) {
    s->hello_timer.expires_after(hello_timeout_);
    std::weak_ptr<Session> weak = s;  // the timer must not keep a dropped session alive
    s->hello_timer.async_wait([this, weak](error_code ec) {
      if (ec) return;  // cancelled: the hello came, or the session closed
      auto alive = weak.lock();
      if (alive != nullptr && !alive->authenticated) {
        refuse(alive, str_cat("sent no hello within ",
                          std::chrono::duration<double>(hello_timeout_).count(), " s"));
      }
    });
  }

  void drop(const std::shared_ptr<Session>& s) {
    error_code ec;
    s->closed = true;
    s->hello_timer.cancel();
    s->socket.close(ec);
    sessions_.erase(s.get());
  }

  // Closes a connection that did not prove itself, logging it once (Note [Store
  // authentication]).
  void refuse(const std::shared_ptr<Session>& s, const std::string& why) {
    if (s->closed) return;
    refusals_->note(s->peer, why);
    drop(s);
  }

  // A read failed: the peer left (or we closed it). Before its hello that is a refusal too.
  void on_read_error(const std::shared_ptr<Session>& s) {
    if (!s->authenticated) return refuse(s, "closed the connection before its hello");
    drop(s);
  }

  void read_frame(std::shared_ptr<Session> s) {
    asio::async_read(s->socket, asio::buffer(s->header), [this, s](error_code ec, size_t) {
      if (ec) return on_read_error(s);
      const auto n = static_cast<uint32_t>(load_le(s->header, 4));
      if (!s->authenticated) {
        // Note [Store authentication]: the only frame before a hello is a small hello.
        if (n > kMaxHelloBytes) {
          return refuse(s, str_cat("announced a first frame of ", n,
                                   " bytes, more than a hello's ", kMaxHelloBytes));
        }
        s->body.resize(n);
        asio::async_read(s->socket, asio::buffer(s->body), [this, s](error_code ec2, size_t) {
          if (ec2) return on_read_error(s);
          if (!handle_hello(s)) return;
          read_frame(s);
        });
        return;
      }
      if (n > kMaxFrameBytes) return drop(s);
      s->frame_bytes = n;
      s->body.clear();
      read_body(s);
    });
  }

  // Reads the body in pieces of at most kReadPieceBytes, growing the buffer only by what
  // arrived (Note [Store authentication], rule 3).
  void read_body(std::shared_ptr<Session> s) {
    const size_t have = s->body.size();
    if (have == s->frame_bytes) {
      if (!handle(s)) return drop(s);
      // A buffer grown for a large value would stay with an idle connection: release it.
      if (s->body.capacity() > 4 * kReadPieceBytes) std::vector<char>().swap(s->body);
      return read_frame(s);
    }
    const size_t piece = std::min(kReadPieceBytes, s->frame_bytes - have);
    s->body.resize(have + piece);
    s->socket.async_read_some(asio::buffer(s->body.data() + have, piece),
                              [this, s, have](error_code ec, size_t got) {
                                if (ec) return drop(s);
                                s->body.resize(have + got);
                                read_body(s);
                              });
  }

  // The first frame of a connection to a store with a token: a hello with that token, or
  // the connection is refused. False when refused.
  bool handle_hello(const std::shared_ptr<Session>& s) {
    Reader r{s->body.data(), s->body.size()};
    const uint64_t id = r.u(8);
    const auto op = static_cast<Op>(r.u(1));
    const auto nfields = r.u(4);
    if (!r.ok || op != Op::kHello) {
      refuse(s, "sent a request before its hello (it has no token, or it is not a porter "
                "rank)");
      return false;
    }
    const std::string_view token = r.field();
    if (nfields != 1 || !r.ok || r.n != 0) {
      refuse(s, "sent a malformed hello");
      return false;
    }
    if (!same_token(token_, token)) {
      refuse(s, "sent a wrong token (PORTER_STORE_TOKEN differs from rank 0's)");
      return false;
    }
    s->authenticated = true;
    s->hello_timer.cancel();
    std::vector<char>().swap(s->body);
    reply(s, id, kStatusOk, {});
    return true;
  }

  void reply(const std::shared_ptr<Session>& s, uint64_t id, uint8_t status,
             std::string_view payload) {
    std::vector<char> frame(4);
    frame.reserve(4 + 9 + payload.size());
    put_u64(frame, id);
    frame.push_back(static_cast<char>(status));
    frame.insert(frame.end(), payload.begin(), payload.end());
    finish_frame(frame);
    s->outbox.push_back(std::move(frame));  // deque: references to front() stay valid
    if (!s->writing) write_next(s);
  }

  void write_next(const std::shared_ptr<Session>& s) {
    if (s->outbox.empty()) {
      s->writing = false;
      return;
    }
    s->writing = true;
    const size_t n = s->outbox.front().size();
    auto on_written = [this, s](error_code ec, size_t) {
      if (ec) return drop(s);
      s->outbox.pop_front();
      write_next(s);
    };
    asio::async_write(s->socket, asio::buffer(s->outbox.front()), whole(n),
                      std::move(on_written));
  }

  // A key was set or added: answer the waiters whose last missing key it was.
  void on_key(const std::string& key) {
    auto it = waiters_.find(key);
    if (it == waiters_.end()) return;
    auto list = std::move(it->second);
    waiters_.erase(it);
    for (auto& w : list) {
      if (--w->missing != 0) continue;
      auto s = w->session.lock();
      if (s == nullptr) continue;  // the client left (timed out and closed, or died)
      if (w->op == Op::kGet) {
        const Bytes& v = values_.at(w->get_key);
        reply(s, w->id, kStatusOk, std::string_view(v.data(), v.size()));
      } else {
        reply(s, w->id, kStatusOk, {});
      }
    }
  }

  // Serves one request; false means a malformed frame (the session is dropped).
  bool handle(const std::shared_ptr<Session>& s) {
    Reader r{s->body.data(), s->body.size()};
    const uint64_t id = r.u(8);
    const auto op = static_cast<Op>(r.u(1));
    const auto nfields = static_cast<size_t>(r.u(4));
    if (!r.ok || nfields > r.n / 4) return false;
    std::vector<std::string_view> f;
    f.reserve(nfields);
    for (size_t i = 0; i < nfields; ++i) f.push_back(r.field());
    if (!r.ok || r.n != 0) return false;
    switch (op) {
      case Op::kSet: {
        if (f.size() != 2) return false;
        std::string key(f[0]);
        values_[key] = Bytes(f[1].begin(), f[1].end());
        reply(s, id, kStatusOk, {});
        on_key(key);
        return true;
      }
      case Op::kGet: {
        if (f.size() != 1) return false;
        std::string key(f[0]);
        auto it = values_.find(key);
        if (it != values_.end()) {
          reply(s, id, kStatusOk, std::string_view(it->second.data(), it->second.size()));
        } else {
          auto w = std::make_shared<Waiter>();
          *w = Waiter{s, id, Op::kGet, key, 1};
          waiters_[key].push_back(std::move(w));
        }
        return true;
      }
      case Op::kWait: {
        std::set<std::string> missing;
        for (auto k : f) {
          if (values_.find(std::string(k)) == values_.end()) missing.emplace(k);
        }
        if (missing.empty()) {
          reply(s, id, kStatusOk, {});
          return true;
        }
        auto w = std::make_shared<Waiter>();
        *w = Waiter{s, id, Op::kWait, "", missing.size()};
        for (const auto& k : missing) waiters_[k].push_back(w);
        return true;
      }
      case Op::kAdd: {
        if (f.size() != 2 || f[1].size() != 8) return false;
        std::string key(f[0]);
        uint64_t v = load_le(f[1].data(), 8);
        auto it = values_.find(key);
        if (it != values_.end()) {
          if (it->second.size() != 8) {
            reply(s, id, kStatusError,
                  str_cat("TcpStore: add(", quoted(key), ") on a value of ", it->second.size(),
                          " bytes that is not an 8-byte counter (it was set() with other "
                          "bytes); use a separate key for counters"));
            return true;
          }
          v += load_le(it->second.data(), 8);  // two's complement wrap-around
        }
        Bytes enc;
        enc.reserve(8);
        put_u64(enc, v);
        values_[key] = enc;
        reply(s, id, kStatusOk, std::string_view(enc.data(), enc.size()));
        on_key(key);
        return true;
      }
      case Op::kCheck: {
        if (f.size() != 1) return false;
        const char found = values_.count(std::string(f[0])) != 0 ? 1 : 0;
        reply(s, id, kStatusOk, std::string_view(&found, 1));
        return true;
      }
      case Op::kHello: {
        // A second hello, or one to a store without a token (a client that has one while
        // rank 0 has none: the server already warned that it is unauthenticated).
        if (f.size() != 1) return false;
        if (!token_.empty() && !same_token(token_, f[0])) return false;
        reply(s, id, kStatusOk, {});
        return true;
      }
    }
    return false;  // unknown op
  }

  asio::io_context io_;
  tcp::acceptor acceptor_;
  asio::steady_timer accept_retry_;  // the pause after a failed accept
  const std::string token_;           // empty: admit every connection
  const Clock::duration hello_timeout_;
  uint16_t port_ = 0;
  std::string where_;  // the listening address, for log lines
  std::unique_ptr<RefusalLog> refusals_;
  uint64_t accept_errors_ = 0;
  std::map<std::string, Bytes> values_;
  std::map<std::string, std::vector<std::shared_ptr<Waiter>>> waiters_;  // by missing key
  std::map<Session*, std::weak_ptr<Session>> sessions_;
  std::thread thread_;  // last: started after everything above exists
};

// --- client ------------------------------------------------------------------------------

// Why a client read or write stopped.
enum class IoResult { kOk, kTimeout, kClosed };

struct Conn {
  explicit Conn(asio::io_context& io) : socket(io) {}
  tcp::socket socket;  // non-blocking; waited on with poll()
  uint64_t next_id = 1;
  std::string error;  // the last kClosed cause
};

// Waits for `events` on fd until the deadline; false on timeout.
bool poll_until(int fd, short events, Clock::time_point deadline) {
  while (true) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline -
                                                                            Clock::now());
    if (left.count() <= 0) {
      pollfd p{fd, events, 0};
      return ::poll(&p, 1, 0) > 0;
    }
    pollfd p{fd, events, 0};
    const int timeout_ms = static_cast<int>(std::min<int64_t>(left.count() + 1, 1 << 30));
    const int rc = ::poll(&p, 1, timeout_ms);
    if (rc > 0) return true;  // ready, or POLLHUP/POLLERR: the read/write reports why
    if (rc < 0 && errno != EINTR) return true;
  }
}

IoResult write_all(Conn& c, const std::vector<char>& buf, Clock::time_point deadline) {
  size_t done = 0;
  while (done < buf.size()) {
    error_code ec;
    done += c.socket.write_some(asio::buffer(buf.data() + done, buf.size() - done), ec);
    if (ec == asio::error::would_block || ec == asio::error::try_again) {
      if (!poll_until(c.socket.native_handle(), POLLOUT, deadline)) return IoResult::kTimeout;
    } else if (ec) {
      c.error = ec.message();
      return IoResult::kClosed;
    }
  }
  return IoResult::kOk;
}

IoResult read_all(Conn& c, char* out, size_t n, Clock::time_point deadline) {
  size_t done = 0;
  while (done < n) {
    error_code ec;
    done += c.socket.read_some(asio::buffer(out + done, n - done), ec);
    if (ec == asio::error::would_block || ec == asio::error::try_again) {
      if (!poll_until(c.socket.native_handle(), POLLIN, deadline)) return IoResult::kTimeout;
    } else if (ec) {
      c.error = ec == asio::error::eof ? "connection closed by the server" : ec.message();
      return IoResult::kClosed;
    }
  }
  return IoResult::kOk;
}

}  // namespace

struct TcpStore::Impl {
  explicit Impl(const TcpStoreOptions& o) : options(o) {}

  TcpStoreOptions options;
  std::unique_ptr<Server> server;  // rank 0 only
  uint16_t port = 0;               // where the client connects
  asio::io_context client_io;      // owns the client sockets' services; never run
  std::mutex mu;                   // guards idle and reached
  std::vector<std::unique_ptr<Conn>> idle;
  bool reached = false;  // a connection succeeded once: later refusals mean the server left

  std::string address() const { return str_cat(options.host, ":", port); }

  [[noreturn]] void peer_error(const std::string& what, const std::string& cause) const {
    // A store with a token closes a connection without one at its first request, which
    // looks the same as a server that went away.
    const char* hint = options.token.empty()
                           ? ", or it requires a token this rank lacks: set PORTER_STORE_TOKEN "
                             "to rank 0's"
                           : "";
    throw PeerError(str_cat("TcpStore: lost the store server at ", address(), " during ", what,
                            " (", cause, "); rank 0 hosts the server: it exited or failed, "
                            "see its log", hint));
  }

  // Proves a new connection with the token before its first request (Note [Store
  // authentication]) and waits for the answer, so that a refusal names its cause.
  void hello(Conn& c, const std::string& what, Clock::time_point deadline) {
    const uint64_t id = c.next_id++;
    IoResult res = write_all(c, hello_frame(id, options.token), deadline);
    char header[4];
    if (res == IoResult::kOk) res = read_all(c, header, 4, deadline);
    Bytes body;
    if (res == IoResult::kOk) {
      const auto n = static_cast<uint32_t>(load_le(header, 4));
      if (n != 9) peer_error(what, str_cat("corrupt reply of ", n, " bytes to the hello"));
      body.resize(n);
      res = read_all(c, body.data(), n, deadline);
    }
    if (res == IoResult::kClosed) {
      throw PeerError(str_cat(
          "TcpStore: the store server at ", address(), " closed the connection after this "
          "rank's hello during ", what, " (", c.error, "): it refused this rank's token. Every "
          "rank needs the same PORTER_STORE_TOKEN (or PORTER_STORE_TOKEN_FILE contents) as "
          "rank 0; the server's log names the refused address"));
    }
    if (res == IoResult::kTimeout) {
      throw TimeoutError(str_cat("TcpStore: the store server at ", address(),
                                 " did not answer this rank's hello during ", what,
                                 " within the timeout; rank 0 (the server) is hung or "
                                 "overloaded"));
    }
    if (load_le(body.data(), 8) != id || static_cast<uint8_t>(body[8]) != kStatusOk) {
      peer_error(what, "corrupt reply to the hello");
    }
  }

  // One connection attempt to every resolved address; empty on success, else the error.
  std::string try_connect(Conn& c, Clock::time_point deadline) {
    error_code ec;
    tcp::resolver resolver(client_io);
    auto results = resolver.resolve(options.host, std::to_string(port), ec);
    if (ec) return str_cat("cannot resolve \"", options.host, "\": ", ec.message());
    std::string last = "no address";
    for (const auto& entry : results) {
      const tcp::endpoint ep = entry.endpoint();
      error_code ignored;
      c.socket.close(ignored);
      c.socket.open(ep.protocol(), ec);
      if (!ec) c.socket.non_blocking(true, ec);
      if (ec) return ec.message();
      // asio's synchronous connect waits without a bound, so connect the socket directly.
      const int fd = c.socket.native_handle();
      int rc = ::connect(fd, ep.data(), static_cast<socklen_t>(ep.size()));
      int err = rc == 0 ? 0 : errno;
      if (err == EINPROGRESS) {
        if (!poll_until(fd, POLLOUT, deadline)) {
          last = "connect timed out";
          continue;
        }
        socklen_t len = sizeof(err);
        if (::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
      }
      if (err == 0) {
        c.socket.set_option(tcp::no_delay(true), ec);
        return "";
      }
      last = std::strerror(err);
    }
    c.socket.close(ec);
    return last;
  }

  // A connection for one call: an idle one, else a new one. `retry` keeps trying until the
  // deadline (clients may start before the server); otherwise a refusal is a PeerError.
  std::unique_ptr<Conn> acquire(const std::string& what, Clock::time_point deadline,
                                bool retry) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (!idle.empty()) {
        auto c = std::move(idle.back());
        idle.pop_back();
        return c;
      }
    }
    auto c = std::make_unique<Conn>(client_io);
    auto pause = std::chrono::milliseconds(10);
    while (true) {
      std::string err = try_connect(*c, deadline);
      if (err.empty()) {
        if (!options.token.empty()) hello(*c, what, deadline);
        std::lock_guard<std::mutex> lock(mu);
        reached = true;
        return c;
      }
      if (!retry) peer_error(what, str_cat("reconnecting failed: ", err));
      const auto now = Clock::now();
      if (now >= deadline) {
        throw TimeoutError(str_cat(
            "TcpStore: could not connect to the store server at ", address(), " within ",
            options.timeout.count(), " s (last error: ", err,
            "); rank 0 starts the server: check that it runs and that MASTER_ADDR and "
            "MASTER_PORT are the same on every rank"));
      }
      std::this_thread::sleep_for(std::min<Clock::duration>(pause, deadline - now));
      pause = std::min(pause * 2, std::chrono::milliseconds(200));
    }
  }

  void release(std::unique_ptr<Conn> c) {
    std::lock_guard<std::mutex> lock(mu);
    idle.push_back(std::move(c));
  }

  // Sends one request and returns the reply's payload. `what` names the operation for
  // errors; on timeout throws TimeoutError with `on_timeout()`'s message.
  template <typename TimeoutMessage>
  Bytes call(Op op, const std::vector<std::string_view>& fields, const std::string& what,
             Seconds timeout, TimeoutMessage&& on_timeout) {
    size_t total = 4 + 8 + 1 + 4;
    for (auto f : fields) total += 4 + f.size();
    PORTER_CHECK_LE(total, size_t{kMaxFrameBytes}, "TcpStore: ", what,
                    " is larger than the 1 GiB a store message may carry");
    if (timeout.count() <= 0) timeout = options.timeout;
    const auto deadline =
        Clock::now() + std::chrono::duration_cast<Clock::duration>(timeout);
    bool was_reached;
    {
      std::lock_guard<std::mutex> lock(mu);
      was_reached = reached;
    }
    auto c = acquire(what, deadline, /*retry=*/!was_reached);
    const uint64_t id = c->next_id++;
    std::vector<char> frame(4);
    frame.reserve(total);
    put_u64(frame, id);
    frame.push_back(static_cast<char>(op));
    put_u32(frame, static_cast<uint32_t>(fields.size()));
    for (auto f : fields) put_field(frame, f);
    finish_frame(frame);

    IoResult res = write_all(*c, frame, deadline);
    if (res == IoResult::kClosed) peer_error(what, c->error);
    if (res == IoResult::kTimeout) throw TimeoutError(on_timeout(timeout));  // conn dropped
    while (true) {
      char header[4];
      res = read_all(*c, header, 1, deadline);  // a timeout before the reply: conn stays
      if (res == IoResult::kTimeout) {
        release(std::move(c));
        throw TimeoutError(on_timeout(timeout));
      }
      if (res == IoResult::kOk) res = read_all(*c, header + 1, 3, deadline);
      const auto n = static_cast<uint32_t>(load_le(header, 4));
      if (res == IoResult::kOk && (n < 9 || n > kMaxFrameBytes)) {
        peer_error(what, str_cat("corrupt reply frame of ", n, " bytes"));
      }
      Bytes body;
      if (res == IoResult::kOk) {
        body.resize(n);
        res = read_all(*c, body.data(), n, deadline);
      }
      if (res == IoResult::kClosed) peer_error(what, c->error);
      if (res == IoResult::kTimeout) throw TimeoutError(on_timeout(timeout));  // mid-frame
      if (load_le(body.data(), 8) != id) continue;  // a late reply to a timed-out call
      const auto status = static_cast<uint8_t>(body[8]);
      Bytes payload(body.begin() + 9, body.end());
      release(std::move(c));
      if (status != kStatusOk) throw InvalidArgument(std::string(payload.begin(), payload.end()));
      return payload;
    }
  }

  bool check_key(const std::string& key, Seconds timeout) {
    const std::string what = str_cat("check(", quoted(key), ")");
    Bytes r = call(Op::kCheck, {key}, what, timeout,
                   [&](Seconds t) { return no_reply(what, t); });
    if (r.size() != 1) peer_error(what, "corrupt reply");
    return r[0] != 0;
  }

  // For calls the server answers at once: a timeout means the server hangs.
  std::string no_reply(const std::string& what, Seconds t) const {
    return str_cat("TcpStore: ", what, " got no reply from the store server at ", address(),
                   " within ", t.count(), " s; rank 0 (the server) is hung or overloaded");
  }
};

TcpStore::TcpStore(const TcpStoreOptions& options)
    : options_(options), impl_(std::make_unique<Impl>(options)) {
  PORTER_CHECK(options.timeout.count() > 0, "TcpStore: the timeout must be > 0 s, got ",
               options.timeout.count(), " s (porter.comm.timeout_s)");
  PORTER_CHECK_GE(options.world_size, 0, "TcpStore: world_size must be >= 0 (0: do not wait)");
  PORTER_CHECK(!options.host.empty(), "TcpStore: MASTER_ADDR is empty");
  PORTER_CHECK(options.is_server || options.port != 0,
               "TcpStore: a client needs the server's port; MASTER_PORT is 0");
  PORTER_CHECK_LE(options.token.size(), kMaxStoreTokenBytes,
                  "TcpStore: the token (PORTER_STORE_TOKEN) is too long; 32 random bytes (64 hex "
                  "digits) are plenty");
  PORTER_CHECK(options.hello_timeout.count() > 0, "TcpStore: hello_timeout must be > 0 s, got ",
               options.hello_timeout.count(), " s");
  impl_->port = options.port;
  if (options.is_server) {
    impl_->server = std::make_unique<Server>(options);
    impl_->port = impl_->server->port();
  }
  // The first connection retries until the timeout: the server may not be up yet.
  const auto deadline =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(options.timeout);
  impl_->release(impl_->acquire("connect", deadline, /*retry=*/true));
  if (options.world_size > 0) {
    const int64_t joined = add(kJoinedKey, 1);
    if (joined >= options.world_size) set(kAllJoinedKey, Bytes{1});
    try {
      wait({kAllJoinedKey}, options.timeout);
    } catch (const TimeoutError&) {
      const int64_t now = add(kJoinedKey, 0);
      throw TimeoutError(str_cat("TcpStore at ", impl_->address(), ": only ", now, " of ",
                                 options.world_size, " ranks joined within ",
                                 options.timeout.count(),
                                 " s; the missing ranks did not start, or cannot reach "
                                 "MASTER_ADDR:MASTER_PORT"));
    }
  }
}

TcpStore::~TcpStore() {
  try {
    {
      std::lock_guard<std::mutex> lock(impl_->mu);
      for (auto& c : impl_->idle) {
        error_code ec;
        c->socket.shutdown(tcp::socket::shutdown_both, ec);
        c->socket.close(ec);
      }
      impl_->idle.clear();
    }
    impl_->server.reset();  // closes its sessions, joins its thread
  } catch (const std::exception& e) {
    PORTER_LOG_ERROR("TcpStore at {}: shutdown failed: {}", impl_->address(), e.what());
  }
}

uint16_t TcpStore::port() const { return impl_->port; }

void TcpStore::set(const std::string& key, const Bytes& value) {
  const std::string what = str_cat("set(", quoted(key), ")");
  impl_->call(Op::kSet, {key, std::string_view(value.data(), value.size())}, what, Seconds{0},
              [&](Seconds t) { return impl_->no_reply(what, t); });
}

Bytes TcpStore::get(const std::string& key, Seconds timeout) {
  return impl_->call(Op::kGet, {key}, str_cat("get(", quoted(key), ")"), timeout,
                     [&](Seconds t) {
                       return str_cat("TcpStore at ", impl_->address(), ": get timed out after ",
                                      t.count(), " s; keys still missing: [", quoted(key),
                                      "]. A rank that should set them is slow or failed; raise "
                                      "porter.comm.timeout_s if it is only slow");
                     });
}

void TcpStore::wait(const std::vector<std::string>& keys, Seconds timeout) {
  std::vector<std::string_view> fields(keys.begin(), keys.end());
  std::string list;
  for (const auto& k : keys) list += (list.empty() ? "" : ", ") + quoted(k);
  impl_->call(Op::kWait, fields, str_cat("wait([", list, "])"), timeout, [&](Seconds t) {
    // Name only the keys still missing (best effort: the server may be gone too).
    std::string missing;
    for (const auto& k : keys) {
      bool present = false;
      try {
        present = impl_->check_key(k, std::min(t, Seconds{1}));
      } catch (const Error&) {
      }
      if (!present) missing += (missing.empty() ? "" : ", ") + quoted(k);
    }
    return str_cat("TcpStore at ", impl_->address(), ": wait timed out after ", t.count(),
                   " s; keys still missing: [", missing,
                   "]. A rank that should set them is slow or failed; raise "
                   "porter.comm.timeout_s if it is only slow");
  });
}

int64_t TcpStore::add(const std::string& key, int64_t delta) {
  std::vector<char> enc;
  put_u64(enc, static_cast<uint64_t>(delta));
  const std::string what = str_cat("add(", quoted(key), ")");
  Bytes r = impl_->call(Op::kAdd, {key, std::string_view(enc.data(), enc.size())}, what,
                        Seconds{0}, [&](Seconds t) { return impl_->no_reply(what, t); });
  if (r.size() != 8) impl_->peer_error(what, "corrupt reply");
  return static_cast<int64_t>(load_le(r.data(), 8));
}

bool TcpStore::check(const std::string& key) { return impl_->check_key(key, Seconds{0}); }

}  // namespace porter::comm
