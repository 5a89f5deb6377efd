// Work::State, shared by the Work handles of one collective and by the backend that runs it.
// Private to comm/: the backends fill it, Work reads it.
#pragma once

#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "comm/communicator.h"

namespace porter::comm {

// Invariant: `event` is recorded on the comm stream right after the op, so event->query()
// is true exactly when the op has finished (successfully or not). On cpu the op's host
// callback calls finish() before the stream reaches the event, so once the event completes
// the error and the times are final.
struct Work::State {
  State(std::string op_name, size_t bytes) : op(std::move(op_name)), payload_bytes(bytes) {}

  const std::string op;       // "all_reduce", ...
  const size_t payload_bytes;  // see CommStats
  std::unique_ptr<memory::Event> event;  // owned; recorded on the comm stream after the op

  // cuda only: blocks until the op completes or the communicator's timeout passes, aborting
  // the communicator and calling finish() with the error in that case. Null on cpu, where the
  // op's own blocking calls carry the timeout.
  std::function<void(State&)> device_wait;

  // What the communicator will keep of the op once it finishes (Note [Comm records]); null
  // when it records nothing. Set before the op is queued, then the comm stream's alone.
  std::unique_ptr<CommRecord> record;

  // Records the outcome. The first call wins: it returns true, later ones false.
  bool finish(std::exception_ptr err, double start, double end) {
    std::lock_guard<std::mutex> lock(mu);
    if (finished) return false;
    finished = true;
    error = std::move(err);
    start_s = start;
    end_s = end;
    return true;
  }
  std::exception_ptr get_error() const {
    std::lock_guard<std::mutex> lock(mu);
    return error;
  }

  mutable std::mutex mu;  // guards the fields below
  bool finished = false;
  std::exception_ptr error;
  double start_s = 0.0;
  double end_s = 0.0;
};

}  // namespace porter::comm
