// Collective communication on a comm stream: Communicator (Gloo on cpu, NCCL on cuda),
// process groups, and thread ranks for tests. See docs/comm.md.
//
// Note [Comm stream]
// Every collective is queued on the communicator's own stream (memory::Stream; on cpu a
// worker thread, so communication overlaps compute as on a GPU). At the call, the comm stream
// is made to wait for an event recorded on the device's compute stream, so the op sees every
// kernel queued before the call. The call returns a Work at once. Buffers must stay alive,
// and must not be written, until the Work is complete. work.wait_on(stream) makes another
// stream wait for it (on cpu the compute stream is the calling thread, so that blocks);
// work.wait() blocks the host. Both rethrow the op's error.
//
// Note [Collective semantics]
// - all_reduce(buf, count): buf <- op over ranks of buf, in place.
// - reduce_scatter(in, out, count): `in` holds size() * count elements; out (count
//   elements) <- op over ranks of in[rank*count, (rank+1)*count). out may alias exactly that
//   block of in.
// - all_gather(in, out, count): out (size() * count) block r <- rank r's in (count). in may
//   alias exactly out's own block.
// - broadcast(buf, count, root): buf <- root's buf.
// - count 0 is valid and still synchronises nothing but completes.
// - Sums are computed in f32 for bf16/f16 (each partial rounded back to the element type
//   after every addition) and in the element type otherwise.
// - Determinism: the Gloo backend adds the ranks' contributions to each element in one fixed
//   order, the same for all_reduce and reduce_scatter (all_reduce is reduce_scatter followed
//   by all_gather on the same ring), so the results are bitwise reproducible run to run and
//   a reduce-scatter of a buffer equals the matching block of its all-reduce.
//
// Note [Comm failure]
// Every op gives up after the timeout (porter.comm.timeout_s). Errors are PeerError (a peer
// closed its connection or died) or TimeoutError, and their message names this rank, the
// group, the operation, the element count and, where known, the peer rank, e.g.
//   rank 1 of world: all_reduce of 1048576 f32 failed: rank 0 closed the connection
// abort(reason) makes this rank's pending and later ops fail at once and closes its
// connections, so peers fail at once instead of waiting out the timeout; a rank that throws
// mid-step calls it. After an error the communicator is unusable (every op rethrows).
//
// Note [Comm records]
// For a trace, a communicator can keep a record of every op it finishes (record_ops(true);
// off by default, so nothing is kept when no one takes them): what the op was (name, group,
// element count and type, payload bytes as CommStats counts them, and a label saying what it
// was for) and when it ran on the comm stream, in steady_clock time so that it lines up with
// the other streams' records. take_records() hands them over in order of completion. The
// label comes from the issuer: set_label() (or a CommLabel for a scope) names the ops the
// calling thread starts from then on, e.g. "bucket 3" or "grad norm"; it costs nothing when
// recording is off. At most kMaxCommRecords wait to be taken; later ones are counted by
// dropped_records(), not kept. On cpu the interval is the op's run on the comm thread; on
// cuda (NCCL) it is from the call to the host's first sight of completion in Work::wait(),
// and an op only waited on by a stream leaves no record.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "comm/store.h"
#include "memory/device.h"

namespace porter::comm {

enum class ElemType : uint8_t { kF32, kF64, kBF16, kF16, kI32, kI64, kU8 };
size_t elem_size(ElemType t);
std::string_view elem_name(ElemType t);  // "f32", "bf16", ...

enum class ReduceOp : uint8_t { kSum, kMax };

// Counters for reports: ops issued, payload bytes (the bytes this rank hands to the op: count
// * elem_size, times size() for reduce_scatter's input), and comm-stream busy time.
struct CommStats {
  int64_t ops = 0;
  uint64_t payload_bytes = 0;
  double busy_s = 0.0;
};

// One finished op (Note [Comm records]).
struct CommRecord {
  std::string op;       // "all_reduce", "reduce_scatter", "all_gather", "broadcast", "barrier"
  std::string group;    // the communicator's group name: "world", "dp", ...
  std::string label;    // what the issuer said the op is for ("bucket 3"); may be empty
  size_t count = 0;     // elements, as the call gave them (0 for barrier)
  ElemType type = ElemType::kU8;
  bool has_payload = true;  // false for barrier: no count or type
  uint64_t bytes = 0;       // payload bytes, as CommStats counts them
  bool failed = false;
  std::chrono::steady_clock::time_point start, end;  // on the comm stream
};
inline constexpr size_t kMaxCommRecords = size_t{1} << 16;

// A collective in flight (copyable handle; all copies share one state).
class Work {
 public:
  struct State;
  Work() = default;
  explicit Work(std::shared_ptr<State> state) : state_(std::move(state)) {}

  bool valid() const { return state_ != nullptr; }
  // Complete, successfully or not. Never blocks.
  bool done() const;
  // Blocks the host until complete; rethrows the op's error.
  void wait();
  // Makes `stream` wait for the op; rethrows the op's error when it is already known (on cpu
  // it always is: waiting on the compute stream blocks the caller).
  void wait_on(memory::Stream& stream);
  // Host-clock interval (seconds since the communicator's construction) during which the
  // op ran on the comm stream; valid once done().
  double start_s() const;
  double end_s() const;
  std::string_view op() const;
  size_t payload_bytes() const;

 private:
  std::shared_ptr<State> state_;
};

struct CommOptions {
  std::string group_name = "world";
  Seconds timeout{300};  // porter.comm.timeout_s
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string_view backend() const = 0;  // "gloo" or "nccl"
  virtual const std::string& group_name() const = 0;

  virtual Work all_reduce(void* buf, size_t count, ElemType type, ReduceOp op) = 0;
  virtual Work reduce_scatter(const void* in, void* out, size_t count, ElemType type,
                              ReduceOp op) = 0;
  virtual Work all_gather(const void* in, void* out, size_t count, ElemType type) = 0;
  virtual Work broadcast(void* buf, size_t count, ElemType type, int root) = 0;
  virtual Work barrier() = 0;

  // A communicator over `ranks` (ranks of this group, ascending, this rank among them); every
  // member calls it with the same list and name. Used for the process groups.
  virtual std::unique_ptr<Communicator> split(const std::vector<int>& ranks,
                                              const std::string& name) = 0;
  virtual void abort(const std::string& reason) = 0;
  virtual memory::Stream& stream() = 0;
  virtual CommStats stats() const = 0;
  virtual void reset_stats() = 0;

  // Note [Comm records]. record_ops and set_label: calling thread only (the thread that calls
  // the ops). take_records may be called from any thread.
  virtual void record_ops(bool on) = 0;
  virtual std::vector<CommRecord> take_records() = 0;
  virtual uint64_t dropped_records() const = 0;
  virtual void set_label(std::string label) = 0;
  virtual const std::string& label() const = 0;
};

// Labels the ops issued on `comm` during its scope (Note [Comm records]); the label before it
// comes back at the end. A null comm is allowed (one rank: nothing is communicated).
class CommLabel {
 public:
  CommLabel(Communicator* comm, std::string label);
  ~CommLabel();
  CommLabel(const CommLabel&) = delete;
  CommLabel& operator=(const CommLabel&) = delete;

 private:
  Communicator* comm_;  // not owned; outlives the label
  std::string previous_;
};

// Gloo (TCP on loopback, or on MASTER_ADDR's interface) for a cpu device, NCCL for cuda (its
// unique id travels through the store). Rendezvous keys live under "<group_name>/". Throws
// InvalidArgument for a backend the device cannot use, TimeoutError when peers do not arrive.
std::unique_ptr<Communicator> make_communicator(memory::Device& device,
                                                std::shared_ptr<Store> store, int rank,
                                                int size, const CommOptions& options);

// world, data-parallel and tensor-parallel groups; rank = dp_rank * tp + tp_rank.
struct ProcessGroups {
  std::shared_ptr<Communicator> world;
  std::shared_ptr<Communicator> dp;  // ranks {dp * tp + tp_rank : dp}
  std::shared_ptr<Communicator> tp;  // ranks {dp_rank * tp + t : t}
  int dp_rank = 0, dp_size = 1, tp_rank = 0, tp_size = 1;
};
// Throws InvalidArgument when world->size() is not a multiple of tp.
ProcessGroups make_process_groups(std::shared_ptr<Communicator> world, int tp);

// Runs fn(rank, store) on world_size threads sharing one InMemoryStore, joins them all, and
// returns each rank's exception (null for success). The threads stand for processes: each
// builds its own device and communicator.
std::vector<std::exception_ptr> run_thread_ranks(
    int world_size, const std::function<void(int rank, std::shared_ptr<Store> store)>& fn,
    Seconds store_timeout = Seconds{60});

}  // namespace porter::comm
