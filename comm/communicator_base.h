// CommunicatorBase: what the Gloo and NCCL backends share, written once: identity, the comm
// stream, statistics, the failure state, and the error messages of Note [Comm failure].
// Private to comm/.
#pragma once

#include <chrono>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "base/error.h"
#include "comm/communicator.h"
#include "comm/work_state.h"

namespace porter::comm {

// What an op is, for error messages (Note [Comm failure]).
struct OpInfo {
  const char* name;
  size_t count;
  ElemType type;
  bool has_payload;  // false for barrier, split and initialisation: no count or type shown
};

// Note [Comm failure state]
// A communicator is usable until its first failure: an op that fails, a timeout, or abort().
// fail() records that first error (later ones are dropped) and stops the backend's traffic,
// and from then on every op throws at the call "... failed: the communicator failed earlier:
// <first error>", as a TimeoutError when the first error was one and as a PeerError
// otherwise. The record and the backend's halt_locked() happen under mu_, the same lock an
// op takes to check usability and register its traffic, so an op either sees the failure or
// is registered in time to be stopped.
class CommunicatorBase : public Communicator {
 public:
  int rank() const final { return rank_; }
  int size() const final { return size_; }
  const std::string& group_name() const final { return options_.group_name; }
  memory::Stream& stream() final { return *stream_; }
  CommStats stats() const final;
  void reset_stats() final;
  // Fails the communicator with PeerError("rank R of G aborted: <reason>"), see
  // Note [Comm failure state]. When it failed already the first error stays on record, and
  // the backend is stopped again all the same.
  void abort(const std::string& reason) final;
  // Note [Comm records].
  void record_ops(bool on) final { recording_ = on; }
  std::vector<CommRecord> take_records() final;
  uint64_t dropped_records() const final;
  void set_label(std::string label) final { label_ = std::move(label); }
  const std::string& label() const final { return label_; }

 protected:
  using Clock = std::chrono::steady_clock;

  CommunicatorBase(memory::Device& device, std::shared_ptr<Store> store, int rank, int size,
                   const CommOptions& options);

  // Creates the comm stream ("comm", or "comm:<group>" for split groups). Backends call it
  // last in their constructor, once connected.
  void open_stream();
  // Waits for the ops still queued on the comm stream; for destructors, so it logs instead
  // of throwing.
  void drain_stream() noexcept;

  // "rank R of G: OP of COUNT TYPE failed: " (Note [Comm failure]).
  std::string what(const OpInfo& op) const;
  // what(op) + "timed out after T s ..." + detail: waiting for `peer` when it is known
  // (>= 0), for every rank otherwise.
  TimeoutError timeout_error(const OpInfo& op, int peer, std::string_view detail = {}) const;
  void check_root(const OpInfo& op, int root) const;
  // Checks split's arguments and that the communicator is usable; returns this rank's index
  // in `ranks`.
  int split_rank(const std::vector<int>& ranks, const std::string& name) const;
  CommOptions options_for_group(const std::string& name) const;

  // Throw when a failure is recorded (Note [Comm failure state]).
  void check_usable(const OpInfo& op) const;
  void check_usable_locked(const OpInfo& op) const;  // mu_ held
  // Records `err` unless a failure is recorded already, then calls halt_locked() under mu_
  // and halt() after releasing it. Never throws `err`: callers rethrow it where they must.
  void fail(std::exception_ptr err);
  // Stops the backend's traffic after a failure; may run more than once. mu_ held.
  virtual void halt_locked() = 0;
  // The part of stopping that must not hold mu_ (it may wait for the comm thread).
  virtual void halt() {}

  // Checks the communicator is usable and returns the state of a new op whose comm-stream
  // work sees everything queued on the compute stream before the call (Note [Comm stream]).
  // Calling thread only.
  std::shared_ptr<Work::State> start_op(const OpInfo& op, size_t payload_bytes);
  // Adds to the counters of stats() (mu_ not held).
  void add_stats(const CommStats& delta);
  // Ends an op that started at `start` (now_s()): fails the communicator when `err` is set,
  // adds the time since `start` and `counted` (what the call did not count yet) to stats(),
  // and records the outcome in `state`.
  void finish_op(Work::State& state, std::exception_ptr err, double start, CommStats counted);
  // Seconds since construction, the clock of Work::start_s()/end_s().
  double now_s() const { return std::chrono::duration<double>(Clock::now() - t0_).count(); }

  memory::Device& device_;  // not owned; outlives the communicator
  const std::shared_ptr<Store> store_;
  const int rank_;
  const int size_;
  const CommOptions options_;

  // Guards failure_ and stats_, and the backend's fields that say so.
  mutable std::mutex mu_;

 private:
  const Clock::time_point t0_ = Clock::now();
  std::unique_ptr<memory::Event> compute_done_;  // calling thread only
  std::exception_ptr failure_;                   // mu_; the first failure, or null
  CommStats stats_;                              // mu_
  bool recording_ = false;                       // calling thread only
  std::string label_;                            // calling thread only
  std::vector<CommRecord> records_;              // mu_; at most kMaxCommRecords
  uint64_t dropped_records_ = 0;                 // mu_

 protected:
  // Destroyed before the members above. A backend whose queued work uses its own members
  // drains and resets it in its destructor.
  std::unique_ptr<memory::Stream> stream_;
};

}  // namespace porter::comm
