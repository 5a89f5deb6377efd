// The Gloo backend: a gloo context (TCP pairs, full mesh) per group, rendezvous through a
// porter Store, and porter's own ring collectives over Gloo's unbound buffers, each run as a
// host callback on the cpu comm stream (Note [Comm stream]).
//
// Note [Gloo ring]
// Chunk c of a buffer belongs to rank c. reduce_scatter runs n-1 steps: at step s rank r
// sends its partial of chunk (r-s-1) mod n to rank r+1 and receives the partial of chunk
// (r-s-2) mod n from rank r-1, adding its own contribution. So chunk c is summed in the
// fixed order c+1, c+2, ..., c (mod n): ((x[c+1] + x[c+2]) + x[c+3]) + ... + x[c], with
// bf16/f16 partials rounded after every addition. all_reduce is that reduce_scatter in place
// (chunk c = elements [c*count/n, (c+1)*count/n), so any count works) followed by a ring
// all_gather, so it is bitwise identical to reduce_scatter block by block and reproducible
// run to run (Note [Collective semantics]). The ring needs one chunk of scratch in place
// (the incoming partial) and three out of place (plus two alternating partials); it is kept
// by the communicator and grows to the largest op seen. Every message has its own slot (op
// sequence number << 16 | step), so a rank that issues a different op than its peers times
// out instead of reading the wrong bytes.
//
// Note [Gloo abort]
// Failing fast is the point: an op that fails (timeout, peer gone) or an abort() marks the
// communicator failed and closes all its TCP pairs, so every peer's pending receive from this
// rank fails at once with "closed the connection", and they close theirs in turn: one dead
// rank brings the whole group down in milliseconds instead of one timeout per hop. abort()
// also wakes this rank's own pending wait (abortWaitRecv/abortWaitSend on the buffers the op
// in flight registered in pending_).
//
// Note [SIGPIPE]
// Gloo writes to its sockets with writev(), without MSG_NOSIGNAL, so a write to a peer that
// just died raises SIGPIPE, whose default action kills the whole process before the error can
// be reported. The first Gloo communicator of a process therefore ignores SIGPIPE when it
// still has its default action (a handler the application installed is left alone); writes
// then fail with EPIPE, which Gloo turns into an error on that pair.
#include "comm/gloo_communicator.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include <gloo/common/error.h>
#include <gloo/common/logging.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>

#include "base/check.h"
#include "base/log.h"
#include "comm/agree.h"
#include "comm/communicator_base.h"
#include "comm/gloo_reduce.h"

namespace porter::comm {
namespace {

using UnboundBuffer = gloo::transport::UnboundBuffer;

std::chrono::milliseconds to_ms(Seconds s) {
  return std::chrono::milliseconds(std::max<int64_t>(1, static_cast<int64_t>(s.count() * 1e3)));
}

// gloo's rendezvous over a porter Store, under `prefix`.
class GlooStore final : public gloo::rendezvous::Store {
 public:
  GlooStore(std::shared_ptr<comm::Store> store, std::string prefix, Seconds timeout)
      : store_(std::move(store)), prefix_(std::move(prefix)), timeout_(timeout) {}
  void set(const std::string& key, const std::vector<char>& data) override {
    store_->set(prefix_ + key, data);
  }
  std::vector<char> get(const std::string& key) override {
    return store_->get(prefix_ + key, timeout_);
  }
  void wait(const std::vector<std::string>& keys) override { wait_for(keys, timeout_); }
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override {
    wait_for(keys, timeout.count() > 0 ? Seconds(timeout) : timeout_);
  }

 private:
  void wait_for(const std::vector<std::string>& keys, Seconds timeout) {
    std::vector<std::string> full;
    full.reserve(keys.size());
    for (const auto& k : keys) full.push_back(prefix_ + k);
    store_->wait(full, timeout);
  }

  std::shared_ptr<comm::Store> store_;
  std::string prefix_;
  Seconds timeout_;
};

bool is_loopback(const std::string& host) {
  return host.empty() || host == "127.0.0.1" || host == "localhost" || host == "::1";
}

// The address Gloo binds and advertises: loopback for a local world, else the address of the
// interface that routes to MASTER_ADDR (found by connecting a UDP socket, which sends nothing).
// MASTER_ADDR is read directly: it is the launcher's (Note [Launcher environment]).
std::string gloo_host() {
  const char* env = std::getenv("MASTER_ADDR");
  std::string master = env != nullptr ? env : "";
  if (is_loopback(master)) return "127.0.0.1";
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  if (getaddrinfo(master.c_str(), "29500", &hints, &res) != 0 || res == nullptr) {
    throw InvalidArgument(str_cat("MASTER_ADDR=", master,
                                  " does not resolve; set it to the address of rank 0's host"));
  }
  std::string local;
  int fd = ::socket(res->ai_family, SOCK_DGRAM, 0);
  if (fd >= 0 && ::connect(fd, res->ai_addr, res->ai_addrlen) == 0) {
    sockaddr_storage ss{};
    socklen_t len = sizeof(ss);
    char buf[INET6_ADDRSTRLEN] = {};
    if (::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len) == 0) {
      auto* v4 = reinterpret_cast<sockaddr_in*>(&ss);
      auto* v6 = reinterpret_cast<sockaddr_in6*>(&ss);
      const void* addr = ss.ss_family == AF_INET ? static_cast<const void*>(&v4->sin_addr)
                                                 : static_cast<const void*>(&v6->sin6_addr);
      if (inet_ntop(ss.ss_family, addr, buf, sizeof(buf)) != nullptr) local = buf;
    }
  }
  if (fd >= 0) ::close(fd);
  freeaddrinfo(res);
  if (local.empty()) {
    throw InvalidArgument(str_cat("no local interface routes to MASTER_ADDR=", master,
                                  "; check the address and the network"));
  }
  return local;
}

// Chunk layout of a ring: chunk c is [off(c), off(c+1)) elements.
struct Chunks {
  size_t count;  // elements in all chunks together
  int n;
  bool equal;  // equal blocks of count / n (reduce_scatter, all_gather)
  size_t off(int c) const {
    return equal ? static_cast<size_t>(c) * (count / n)
                 : static_cast<size_t>(c) * count / static_cast<size_t>(n);
  }
  size_t len(int c) const { return off(c + 1) - off(c); }
  size_t max_len() const {
    size_t m = 0;
    for (int c = 0; c < n; ++c) m = std::max(m, len(c));
    return m;
  }
};

class GlooCommunicator;

// One op's point-to-point traffic: registered buffers, posted sends and receives, and waits
// that translate Gloo's errors into porter's (Note [Comm failure]).
class Exchange {
 public:
  Exchange(GlooCommunicator& comm, const OpInfo& op, uint64_t slot_base);
  ~Exchange();
  Exchange(const Exchange&) = delete;
  Exchange& operator=(const Exchange&) = delete;

  // A buffer over [ptr, ptr + bytes); lives until the Exchange ends.
  UnboundBuffer* buffer(const void* ptr, size_t bytes);
  void send(UnboundBuffer* buf, int peer, uint64_t tag, size_t off_bytes, size_t bytes);
  void recv(UnboundBuffer* buf, int peer, uint64_t tag, size_t off_bytes, size_t bytes);
  void wait_send(UnboundBuffer* buf, int peer);
  void wait_recv(UnboundBuffer* buf, int peer);

 private:
  [[noreturn]] void fail(int peer, const std::exception& e);

  GlooCommunicator& comm_;
  OpInfo op_;
  uint64_t slot_base_;
  std::vector<std::unique_ptr<UnboundBuffer>> buffers_;
};

class GlooCommunicator final : public CommunicatorBase {
 public:
  GlooCommunicator(memory::Device& device, std::shared_ptr<comm::Store> store, int rank,
                   int size, const CommOptions& options,
                   std::shared_ptr<gloo::transport::Device> transport);
  ~GlooCommunicator() override;

  std::string_view backend() const override { return "gloo"; }

  Work all_reduce(void* buf, size_t count, ElemType type, ReduceOp op) override;
  Work reduce_scatter(const void* in, void* out, size_t count, ElemType type,
                      ReduceOp op) override;
  Work all_gather(const void* in, void* out, size_t count, ElemType type) override;
  Work broadcast(void* buf, size_t count, ElemType type, int root) override;
  Work barrier() override;

  std::unique_ptr<Communicator> split(const std::vector<int>& ranks,
                                      const std::string& name) override;

 private:
  friend class Exchange;

  Work enqueue(const OpInfo& op, size_t payload_bytes, std::function<void(Exchange*)> body);
  // After a failure (Note [Gloo abort]): wakes the pending waits of the op in flight, then
  // closes the pairs.
  void halt_locked() override;
  void halt() override;
  void register_buffer(UnboundBuffer* buf, const OpInfo& op);
  void unregister_buffer(UnboundBuffer* buf);
  // Comm-thread scratch of at least `bytes`, kept between ops: first-touch page faults of a
  // fresh buffer per op cost more than the transfer (Note [Gloo ring]).
  char* scratch_for(size_t bytes) {
    if (bytes > scratch_bytes_) {
      scratch_.reset();
      scratch_ = std::make_unique_for_overwrite<char[]>(bytes);
      scratch_bytes_ = bytes;
    }
    return scratch_.get();
  }

  void ring_reduce_scatter(Exchange& x, const char* src, char* out, const Chunks& chunks,
                           ElemType type, ReduceOp op, bool in_place);
  void ring_all_gather(Exchange& x, char* buf, const Chunks& chunks, size_t elem_bytes);

  int left() const { return (rank_ + size_ - 1) % size_; }
  int right() const { return (rank_ + 1) % size_; }

  std::shared_ptr<gloo::transport::Device> transport_;
  std::shared_ptr<gloo::rendezvous::Context> context_;  // null when size_ == 1
  uint64_t next_seq_ = 0;                               // calling thread only
  std::unique_ptr<char[]> scratch_;                     // comm thread only
  size_t scratch_bytes_ = 0;                            // comm thread only
  std::vector<UnboundBuffer*> pending_;  // mu_; buffers of the op in flight (not owned)
};

// ---- Exchange --------------------------------------------------------------------------

Exchange::Exchange(GlooCommunicator& comm, const OpInfo& op, uint64_t slot_base)
    : comm_(comm), op_(op), slot_base_(slot_base) {}

Exchange::~Exchange() {
  for (auto& b : buffers_) comm_.unregister_buffer(b.get());
}

UnboundBuffer* Exchange::buffer(const void* ptr, size_t bytes) {
  // Gloo only reads a buffer that is sent from; the cast is for its one buffer type.
  buffers_.push_back(comm_.context_->createUnboundBuffer(const_cast<void*>(ptr), bytes));
  comm_.register_buffer(buffers_.back().get(), op_);
  return buffers_.back().get();
}

void Exchange::send(UnboundBuffer* buf, int peer, uint64_t tag, size_t off_bytes,
                    size_t bytes) {
  try {
    buf->send(peer, slot_base_ | tag, off_bytes, bytes);
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    fail(peer, e);
  }
}

void Exchange::recv(UnboundBuffer* buf, int peer, uint64_t tag, size_t off_bytes,
                    size_t bytes) {
  try {
    buf->recv(peer, slot_base_ | tag, off_bytes, bytes);
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    fail(peer, e);
  }
}

void Exchange::wait_send(UnboundBuffer* buf, int peer) {
  bool ok = false;
  try {
    ok = buf->waitSend(to_ms(comm_.options_.timeout));
  } catch (const std::exception& e) {
    fail(peer, e);
  }
  if (!ok) comm_.check_usable(op_);  // aborted: throws the abort error
  PORTER_ASSERT(ok, "gloo send aborted without a recorded failure");
}

void Exchange::wait_recv(UnboundBuffer* buf, int peer) {
  bool ok = false;
  try {
    ok = buf->waitRecv(to_ms(comm_.options_.timeout));
  } catch (const std::exception& e) {
    fail(peer, e);
  }
  if (!ok) comm_.check_usable(op_);
  PORTER_ASSERT(ok, "gloo receive aborted without a recorded failure");
}

void Exchange::fail(int peer, const std::exception& e) {
  // An abort closes our own pairs too; report the abort, not its echo.
  comm_.check_usable(op_);
  const std::string reason = e.what();
  const std::string head = comm_.what(op_);
  if (reason.find("Timed out") != std::string::npos ||
      reason.find("timed out") != std::string::npos) {
    throw comm_.timeout_error(op_, peer, str_cat(" [gloo: ", reason, "]"));
  }
  const bool closed = reason.find("closed") != std::string::npos ||
                      reason.find("reset") != std::string::npos ||
                      reason.find("Broken pipe") != std::string::npos;
  if (closed) {
    throw PeerError(str_cat(head, "rank ", peer, " closed the connection [gloo: ", reason, "]"));
  }
  throw PeerError(str_cat(head, "error on the connection to rank ", peer, " [gloo: ", reason,
                          "]"));
}

// ---- GlooCommunicator ------------------------------------------------------------------

GlooCommunicator::GlooCommunicator(memory::Device& device, std::shared_ptr<comm::Store> store,
                                   int rank, int size, const CommOptions& options,
                                   std::shared_ptr<gloo::transport::Device> transport)
    : CommunicatorBase(device, std::move(store), rank, size, options),
      transport_(std::move(transport)) {
  if (size_ > 1) {
    // A group may be formed again on the same store (a later run in one process): every
    // rank counts its own joins, so the n-th formation of a group meets under "<name>/n/".
    const int64_t generation =
        store_->add(str_cat(options_.group_name, "/gloo_joins/", rank_), 1);
    GlooStore gloo_store(store_, str_cat(options_.group_name, "/", generation, "/"),
                         options_.timeout);
    auto ctx = std::make_shared<gloo::rendezvous::Context>(rank_, size_);
    ctx->setTimeout(to_ms(options_.timeout));
    try {
      ctx->connectFullMesh(gloo_store, transport_);
    } catch (const TimeoutError& e) {
      throw TimeoutError(str_cat("rank ", rank_, " of ", options_.group_name,
                                 ": gloo rendezvous of ", size_, " ranks timed out after ",
                                 options_.timeout.count(),
                                 " s (did every rank create the communicator? the limit is "
                                 "porter.comm.timeout_s): ",
                                 e.what()));
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {
      throw PeerError(str_cat("rank ", rank_, " of ", options_.group_name,
                              ": gloo could not connect ", size_, " ranks: ", e.what()));
    }
    // connectFullMesh returns on a rank once its own pairs are up, which may be before a
    // peer's are: a rank that failed and closed its connections at once would then break the
    // peer's rendezvous instead of its first collective. Every rank waits for all to connect.
    try {
      count_votes(*store_, str_cat(options_.group_name, "/", generation, "/connected"), size_,
                  true, options_.timeout);
    } catch (const TimeoutError& e) {
      throw TimeoutError(str_cat("rank ", rank_, " of ", options_.group_name,
                                 ": gloo connected, but not every rank confirmed within ",
                                 options_.timeout.count(),
                                 " s (the limit is porter.comm.timeout_s): ", e.what()));
    }
    context_ = std::move(ctx);
  }
  open_stream();
}

GlooCommunicator::~GlooCommunicator() {
  // The queued host callbacks use this class's members, which die before the base's stream:
  // the stream's worker must finish and go first.
  drain_stream();
  stream_.reset();
}

void GlooCommunicator::halt_locked() {
  for (auto* buf : pending_) {
    buf->abortWaitRecv();
    buf->abortWaitSend();
  }
}

void GlooCommunicator::halt() {
  if (context_ == nullptr) return;
  try {
    context_->closeConnections();
  } catch (const std::exception& e) {
    PORTER_LOG_WARN("rank {} of {}: closing gloo connections: {}", rank_, options_.group_name,
                    e.what());
  }
}

void GlooCommunicator::register_buffer(UnboundBuffer* buf, const OpInfo& op) {
  std::lock_guard<std::mutex> lock(mu_);
  check_usable_locked(op);
  pending_.push_back(buf);
}

void GlooCommunicator::unregister_buffer(UnboundBuffer* buf) {
  std::lock_guard<std::mutex> lock(mu_);
  pending_.erase(std::remove(pending_.begin(), pending_.end(), buf), pending_.end());
}

Work GlooCommunicator::enqueue(const OpInfo& op, size_t payload_bytes,
                               std::function<void(Exchange*)> body) {
  auto state = start_op(op, payload_bytes);
  const uint64_t slot_base = next_seq_++ << 16;
  stream_->host_callback([this, state, op, payload_bytes, slot_base, body = std::move(body)] {
    const double start = now_s();
    std::exception_ptr err;
    try {
      check_usable(op);
      if (size_ > 1) {
        Exchange x(*this, op, slot_base);
        body(&x);
      } else {
        body(nullptr);  // every body handles size 1 locally
      }
    } catch (...) {
      err = std::current_exception();
    }
    finish_op(*state, err, start, {.ops = 1, .payload_bytes = payload_bytes});
  });
  stream_->record(*state->event);
  return Work(state);
}

void GlooCommunicator::ring_reduce_scatter(Exchange& x, const char* src, char* out,
                                           const Chunks& chunks, ElemType type, ReduceOp op,
                                           bool in_place) {
  // Note [Gloo ring]. In place (all_reduce; out == src): the partial of chunk c is kept in
  // src's chunk c. Otherwise partials alternate between two scratch chunks, and the last step
  // writes rank_'s finished chunk to out (count elements).
  const size_t es = elem_size(type);
  const int n = size_;
  const size_t max_bytes = chunks.max_len() * es;
  char* scratch = scratch_for(max_bytes * (in_place ? 1 : 3));
  char* recv_ptr = scratch;
  char* acc[2] = {in_place ? nullptr : scratch + max_bytes,
                  in_place ? nullptr : scratch + 2 * max_bytes};
  UnboundBuffer* recv_buf = x.buffer(recv_ptr, max_bytes);
  UnboundBuffer* src_buf = x.buffer(src, chunks.count * es);
  UnboundBuffer* acc_buf[2] = {in_place ? nullptr : x.buffer(acc[0], max_bytes),
                               in_place ? nullptr : x.buffer(acc[1], max_bytes)};
  auto mod = [n](int v) { return ((v % n) + n) % n; };
  UnboundBuffer* prev_buf = nullptr;  // where step s-1 wrote its partial
  size_t prev_off = 0;
  for (int s = 0; s < n - 1; ++s) {
    const int c_send = mod(rank_ - s - 1);
    const int c_recv = mod(rank_ - s - 2);
    const size_t send_bytes = chunks.len(c_send) * es;
    const size_t recv_bytes = chunks.len(c_recv) * es;
    UnboundBuffer* send_buf = s == 0 ? src_buf : prev_buf;
    const size_t send_off = s == 0 ? chunks.off(c_send) * es : prev_off;
    if (recv_bytes > 0) x.recv(recv_buf, left(), s, 0, recv_bytes);
    if (send_bytes > 0) x.send(send_buf, right(), s, send_off, send_bytes);
    // Where this step's partial of chunk c_recv goes.
    char* dst;
    if (in_place) {
      dst = out + chunks.off(c_recv) * es;
      prev_buf = src_buf;
      prev_off = chunks.off(c_recv) * es;
    } else if (s == n - 2) {
      dst = out;
    } else {
      dst = acc[s % 2];
      prev_buf = acc_buf[s % 2];
      prev_off = 0;
    }
    if (recv_bytes > 0) {
      x.wait_recv(recv_buf, left());
      reduce_into(dst, recv_ptr, src + chunks.off(c_recv) * es, chunks.len(c_recv), type, op);
    }
    if (send_bytes > 0) x.wait_send(send_buf, right());
  }
}

void GlooCommunicator::ring_all_gather(Exchange& x, char* buf, const Chunks& chunks,
                                       size_t elem_bytes) {
  // At step s rank r forwards chunk (r-s) mod n, which it owns (s = 0) or received at s-1.
  const int n = size_;
  auto mod = [n](int v) { return ((v % n) + n) % n; };
  UnboundBuffer* send_buf = x.buffer(buf, chunks.count * elem_bytes);
  UnboundBuffer* recv_buf = x.buffer(buf, chunks.count * elem_bytes);
  for (int s = 0; s < n - 1; ++s) {
    const int c_send = mod(rank_ - s);
    const int c_recv = mod(rank_ - s - 1);
    const size_t send_bytes = chunks.len(c_send) * elem_bytes;
    const size_t recv_bytes = chunks.len(c_recv) * elem_bytes;
    const uint64_t tag = 0x8000u | static_cast<uint64_t>(s);  // distinct from the RS steps
    if (recv_bytes > 0) x.recv(recv_buf, left(), tag, chunks.off(c_recv) * elem_bytes, recv_bytes);
    if (send_bytes > 0) x.send(send_buf, right(), tag, chunks.off(c_send) * elem_bytes, send_bytes);
    if (recv_bytes > 0) x.wait_recv(recv_buf, left());
    if (send_bytes > 0) x.wait_send(send_buf, right());
  }
}

Work GlooCommunicator::all_reduce(void* buf, size_t count, ElemType type, ReduceOp op) {
  const OpInfo info{"all_reduce", count, type, true};
  PORTER_CHECK(count == 0 || buf != nullptr, what(info), "null buffer");
  const size_t es = elem_size(type);
  return enqueue(info, count * es, [this, buf, count, type, op, es](Exchange* x) {
    if (count == 0 || size_ == 1) return;
    const Chunks chunks{count, size_, false};
    char* p = static_cast<char*>(buf);
    ring_reduce_scatter(*x, p, p, chunks, type, op, true);
    ring_all_gather(*x, p, chunks, es);
  });
}

Work GlooCommunicator::reduce_scatter(const void* in, void* out, size_t count, ElemType type,
                                      ReduceOp op) {
  const OpInfo info{"reduce_scatter", count, type, true};
  PORTER_CHECK(count == 0 || (in != nullptr && out != nullptr), what(info), "null buffer");
  const size_t es = elem_size(type);
  const char* in_begin = static_cast<const char*>(in);
  const char* in_end = in_begin + static_cast<size_t>(size_) * count * es;
  const char* own_block = in_begin + static_cast<size_t>(rank_) * count * es;
  const char* o = static_cast<const char*>(out);
  PORTER_CHECK(count == 0 || o == own_block || o >= in_end || o + count * es <= in_begin,
               what(info), "out overlaps in without being exactly this rank's block");
  return enqueue(info, count * es * static_cast<size_t>(size_),
                 [this, in, out, count, type, op, es, own_block](Exchange* x) {
                   if (count == 0) return;
                   if (size_ == 1) {
                     if (out != own_block) std::memmove(out, own_block, count * es);
                     return;
                   }
                   const Chunks chunks{count * static_cast<size_t>(size_), size_, true};
                   const char* src = static_cast<const char*>(in);
                   char* dst = static_cast<char*>(out);
                   // out may alias this rank's block of in: that block is read only by
                   // the last step, element by element into the same place.
                   ring_reduce_scatter(*x, src, dst, chunks, type, op, false);
                 });
}

Work GlooCommunicator::all_gather(const void* in, void* out, size_t count, ElemType type) {
  const OpInfo info{"all_gather", count, type, true};
  PORTER_CHECK(count == 0 || (in != nullptr && out != nullptr), what(info), "null buffer");
  const size_t es = elem_size(type);
  return enqueue(info, count * es, [this, in, out, count, es](Exchange* x) {
    if (count == 0) return;
    char* dst = static_cast<char*>(out);
    char* own = dst + static_cast<size_t>(rank_) * count * es;
    if (own != in) std::memmove(own, in, count * es);
    if (size_ == 1) return;
    ring_all_gather(*x, dst, Chunks{count * static_cast<size_t>(size_), size_, true}, es);
  });
}

Work GlooCommunicator::broadcast(void* buf, size_t count, ElemType type, int root) {
  const OpInfo info{"broadcast", count, type, true};
  PORTER_CHECK(count == 0 || buf != nullptr, what(info), "null buffer");
  check_root(info, root);
  const size_t bytes = count * elem_size(type);
  return enqueue(info, bytes, [this, buf, bytes, root](Exchange* x) {
    if (bytes == 0 || size_ == 1) return;
    UnboundBuffer* b = x->buffer(buf, bytes);
    if (rank_ == root) {
      for (int p = 0; p < size_; ++p) {
        if (p != root) x->send(b, p, 0, 0, bytes);
      }
      for (int p = 0; p < size_; ++p) {
        if (p != root) x->wait_send(b, p);
      }
    } else {
      x->recv(b, root, 0, 0, bytes);
      x->wait_recv(b, root);
    }
  });
}

Work GlooCommunicator::barrier() {
  const OpInfo info{"barrier", 0, ElemType::kU8, false};
  return enqueue(info, 0, [this](Exchange* x) {
    if (size_ == 1) return;
    // Dissemination: after round k every rank has heard, directly or not, from 2^(k+1) ranks.
    char token_out = 1;
    char token_in = 0;
    UnboundBuffer* out = x->buffer(&token_out, 1);
    UnboundBuffer* in = x->buffer(&token_in, 1);
    uint64_t round = 0;
    for (int k = 1; k < size_; k *= 2, ++round) {
      const int to = (rank_ + k) % size_;
      const int from = (rank_ - k + size_) % size_;
      x->recv(in, from, round, 0, 1);
      x->send(out, to, round, 0, 1);
      x->wait_recv(in, from);
      x->wait_send(out, to);
    }
  });
}

std::unique_ptr<Communicator> GlooCommunicator::split(const std::vector<int>& ranks,
                                                      const std::string& name) {
  const int sub_rank = split_rank(ranks, name);
  return std::make_unique<GlooCommunicator>(device_, store_, sub_rank,
                                            static_cast<int>(ranks.size()),
                                            options_for_group(name), transport_);
}

// Note [SIGPIPE].
void ignore_default_sigpipe() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction old {};
    if (sigaction(SIGPIPE, nullptr, &old) == 0 && old.sa_handler == SIG_DFL &&
        (old.sa_flags & SA_SIGINFO) == 0) {
      signal(SIGPIPE, SIG_IGN);
      PORTER_LOG_DEBUG("gloo: SIGPIPE is now ignored, so a dead peer is an error, not a kill");
    }
  });
}

}  // namespace

std::unique_ptr<Communicator> make_gloo_communicator(memory::Device& device,
                                                     std::shared_ptr<Store> store, int rank,
                                                     int size, const CommOptions& options) {
  ignore_default_sigpipe();
  gloo::transport::tcp::attr attr;
  attr.hostname = gloo_host();
  auto transport = gloo::transport::tcp::CreateDevice(attr);
  return std::make_unique<GlooCommunicator>(device, std::move(store), rank, size, options,
                                            std::move(transport));
}

}  // namespace porter::comm
