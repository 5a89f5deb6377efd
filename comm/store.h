// Key/value stores for rendezvous: the interface, an in-memory store for ranks that are
// threads of one process, and TcpStore, a server on MASTER_ADDR:MASTER_PORT (Boost.Asio)
// with a client on every rank. See docs/rendezvous.md.
//
// Note [Store semantics]
// - Keys are strings, values are byte strings. set() overwrites. get() blocks until the key
//   exists (at most the timeout). wait() blocks until every key exists. add() adds a signed
//   delta to an 8-byte little-endian integer value (created as 0) and returns the new value;
//   get() of such a key returns those 8 bytes.
// - Every blocking call takes a timeout; timeout <= 0 uses the store's default. A call that
//   runs out throws TimeoutError naming the store, the operation, the keys still missing and
//   the seconds waited. A TcpStore client whose server goes away throws PeerError naming the
//   server's address and the operation, within the timeout and usually at once.
// - Stores are thread-safe: several threads of one rank (the comm stream, the launcher's
//   health check) may share one.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace porter::comm {

using Bytes = std::vector<char>;
using Seconds = std::chrono::duration<double>;

class Store {
 public:
  virtual ~Store() = default;
  virtual void set(const std::string& key, const Bytes& value) = 0;
  virtual Bytes get(const std::string& key, Seconds timeout = Seconds{0}) = 0;
  virtual void wait(const std::vector<std::string>& keys, Seconds timeout = Seconds{0}) = 0;
  virtual int64_t add(const std::string& key, int64_t delta) = 0;
  // Whether the key exists now (never blocks).
  virtual bool check(const std::string& key) = 0;
  virtual Seconds default_timeout() const = 0;

  // Convenience: string values.
  void set_string(const std::string& key, const std::string& value) {
    set(key, Bytes(value.begin(), value.end()));
  }
  std::string get_string(const std::string& key, Seconds timeout = Seconds{0}) {
    Bytes b = get(key, timeout);
    return std::string(b.begin(), b.end());
  }
};

// All keys of `inner` under "<prefix>/" (one namespace per process group or generation).
class PrefixStore final : public Store {
 public:
  PrefixStore(std::string prefix, std::shared_ptr<Store> inner);
  void set(const std::string& key, const Bytes& value) override;
  Bytes get(const std::string& key, Seconds timeout = Seconds{0}) override;
  void wait(const std::vector<std::string>& keys, Seconds timeout = Seconds{0}) override;
  int64_t add(const std::string& key, int64_t delta) override;
  bool check(const std::string& key) override;
  Seconds default_timeout() const override { return inner_->default_timeout(); }

 private:
  std::string prefix_;
  std::shared_ptr<Store> inner_;
};

// A store in this process's memory: the ranks of a thread-rank world share one.
class InMemoryStore final : public Store {
 public:
  explicit InMemoryStore(Seconds default_timeout = Seconds{300});
  ~InMemoryStore() override;
  void set(const std::string& key, const Bytes& value) override;
  Bytes get(const std::string& key, Seconds timeout = Seconds{0}) override;
  void wait(const std::vector<std::string>& keys, Seconds timeout = Seconds{0}) override;
  int64_t add(const std::string& key, int64_t delta) override;
  bool check(const std::string& key) override;
  Seconds default_timeout() const override { return default_timeout_; }

 private:
  struct State;
  std::unique_ptr<State> state_;
  Seconds default_timeout_;
};

// The longest store token (PORTER_STORE_TOKEN): its hello must fit the small frame the server
// reads from a connection that has not proven itself yet.
constexpr size_t kMaxStoreTokenBytes = 1024;

struct TcpStoreOptions {
  std::string host = "127.0.0.1";  // MASTER_ADDR; the server listens on this address only
  uint16_t port = 29500;           // MASTER_PORT; 0 with is_server: pick a free port
  bool is_server = false;          // rank 0 runs the server (and is also a client)
  Seconds timeout{300};            // default for every blocking call, connecting included
  int world_size = 0;              // > 0: the constructor waits until that many clients joined
  // The shared secret every connection proves first (PORTER_STORE_TOKEN; the same on every
  // rank). Empty: the server admits any connection, and warns once.
  std::string token;
  // How long the server waits for a new connection's hello before closing it (token set).
  Seconds hello_timeout{5};
};

// The client (and, with is_server, the server on a background thread). Connecting retries
// until the timeout, so clients may start before the server. Who may connect, and what a
// connection may cost the server: Note [Store authentication] in comm/tcp_store.cc.
class TcpStore final : public Store {
 public:
  explicit TcpStore(const TcpStoreOptions& options);
  ~TcpStore() override;
  void set(const std::string& key, const Bytes& value) override;
  Bytes get(const std::string& key, Seconds timeout = Seconds{0}) override;
  void wait(const std::vector<std::string>& keys, Seconds timeout = Seconds{0}) override;
  int64_t add(const std::string& key, int64_t delta) override;
  bool check(const std::string& key) override;
  Seconds default_timeout() const override { return options_.timeout; }
  // The port the server listens on (the chosen one when options.port was 0).
  uint16_t port() const;

 private:
  struct Impl;
  TcpStoreOptions options_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace porter::comm
