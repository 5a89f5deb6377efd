// porter's error hierarchy. Every error a user can see is a porter::Error subclass.
//
// Note [Error policy]
// - Bad input from a user (config, flags, files) throws a typed subclass whose message names
//   the thing (JSON path, flag, file and offset), the value, the rule and the fix.
// - Resource exhaustion throws OutOfMemoryError with a full accounting of where bytes went.
// - Failures of CUDA/NCCL throw CudaError/NcclError naming the statement, device, file:line.
// - A peer that is slow or dead throws TimeoutError/PeerError naming the rank and operation.
// - A broken invariant inside porter throws InternalError (PORTER_ASSERT): a bug in porter.
// - Library code never calls exit() or abort(); destructors log and swallow.
#pragma once

#include <stdexcept>
#include <string>

namespace porter {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// Bad input: a config value, a flag, an argument that breaks a documented rule.
class InvalidArgument : public Error {
 public:
  using Error::Error;
};

// An API used in the wrong order or state: double free, use after release, foreign slot.
class UsageError : public Error {
 public:
  using Error::Error;
};

// A file that cannot be read or written, or whose contents are corrupt.
class IoError : public Error {
 public:
  using Error::Error;
};

// Device or pinned memory exhausted. The message carries the full accounting.
class OutOfMemoryError : public Error {
 public:
  OutOfMemoryError(const std::string& what, size_t requested_bytes)
      : Error(what), requested_bytes_(requested_bytes) {}
  size_t requested_bytes() const { return requested_bytes_; }

 private:
  size_t requested_bytes_;
};

class CudaError : public Error {
 public:
  using Error::Error;
};

class NcclError : public Error {
 public:
  using Error::Error;
};

// A blocking call that did not finish in time. Names the rank and the operation.
class TimeoutError : public Error {
 public:
  using Error::Error;
};

// A peer rank failed or disconnected.
class PeerError : public Error {
 public:
  using Error::Error;
};

// A bug in porter: an invariant that must always hold did not.
class InternalError : public Error {
 public:
  using Error::Error;
};

}  // namespace porter
