// The NCCL backend: one non-blocking ncclComm per group, collectives enqueued on the comm
// stream's cudaStream_t after it waits for the compute stream (Note [Comm stream]).
//
// Note [NCCL timeouts]
// NCCL kernels cannot be interrupted from the host, so a dead peer would hang the comm stream
// for ever. The comm is created non-blocking (config.blocking = 0). Work::wait() polls the
// op's event and ncclCommGetAsyncError until the event completes, NCCL reports an error, or
// porter.comm.timeout_s passes; in the last two cases it calls ncclCommAbort (which also
// releases the peers' kernels with an error) and throws PeerError/TimeoutError in the format
// of Note [Comm failure]. Work::wait_on() only orders the streams: a hang is detected by the
// next host wait. Work times are host observations (enqueue, completion seen by wait()).
#include "comm/nccl_communicator.h"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <chrono>
#include <cstring>
#include <mutex>
#include <thread>

#include "base/check.h"
#include "base/log.h"
#include "comm/work_state.h"

namespace porter::comm {
namespace {

using Clock = std::chrono::steady_clock;

[[noreturn]] void throw_nccl(ncclResult_t res, const char* stmt, int device, const char* file,
                             int line) {
  throw NcclError(str_cat(stmt, " failed on cuda:", device, " at ", file, ":", line, ": ",
                          ncclGetErrorString(res), " (", ncclGetLastError(nullptr), ")"));
}

// ncclInProgress is not an error for a non-blocking comm: completion is polled.
#define PORTER_NCCL_CHECK(stmt, device)                                                 \
  do {                                                                                  \
    ncclResult_t porter_nccl_res_ = (stmt);                                             \
    if (porter_nccl_res_ != ncclSuccess && porter_nccl_res_ != ncclInProgress) {        \
      throw_nccl(porter_nccl_res_, #stmt, device, __FILE__, __LINE__);                  \
    }                                                                                   \
  } while (0)

#define PORTER_NCCL_CUDA_CHECK(stmt, device)                                             \
  do {                                                                                   \
    cudaError_t porter_cuda_err_ = (stmt);                                               \
    if (porter_cuda_err_ != cudaSuccess) {                                               \
      throw CudaError(str_cat(#stmt, " failed on cuda:", device, " at ", __FILE__, ":",  \
                              __LINE__, ": ", cudaGetErrorString(porter_cuda_err_)));    \
    }                                                                                    \
  } while (0)

ncclDataType_t nccl_type(ElemType t) {
  switch (t) {
    case ElemType::kF32: return ncclFloat32;
    case ElemType::kF64: return ncclFloat64;
    case ElemType::kBF16: return ncclBfloat16;
    case ElemType::kF16: return ncclFloat16;
    case ElemType::kI32: return ncclInt32;
    case ElemType::kI64: return ncclInt64;
    case ElemType::kU8: return ncclUint8;
  }
  PORTER_ASSERT(false, "unknown comm::ElemType ", static_cast<int>(t));
  return ncclFloat32;
}

ncclRedOp_t nccl_op(ReduceOp op) { return op == ReduceOp::kSum ? ncclSum : ncclMax; }

struct OpInfo {
  const char* name;
  size_t count;
  ElemType type;
  bool has_payload;
};

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(memory::Device& device, std::shared_ptr<Store> store, int rank, int size,
                   const CommOptions& options)
      : device_(device),
        store_(std::move(store)),
        rank_(rank),
        size_(size),
        options_(options),
        compute_done_(device.create_event()) {
    const int dev = device_.index();
    PORTER_NCCL_CUDA_CHECK(cudaSetDevice(dev), dev);
    barrier_buf_ = device_.allocate_segment(256);
    if (barrier_buf_ == nullptr) {
      throw OutOfMemoryError(str_cat("rank ", rank_, " of ", options_.group_name,
                                     ": no 256 bytes of device memory for the barrier"),
                             256);
    }
    const int64_t generation = store_->add(str_cat(options_.group_name, "/nccl_joins/", rank_), 1);
    const std::string key = str_cat(options_.group_name, "/", generation, "/nccl_unique_id");
    ncclUniqueId id{};
    if (rank_ == 0) {
      PORTER_NCCL_CHECK(ncclGetUniqueId(&id), dev);
      store_->set(key, Bytes(id.internal, id.internal + sizeof(id.internal)));
    } else {
      Bytes b = store_->get(key, options_.timeout);
      PORTER_CHECK_EQ(b.size(), sizeof(id.internal), "rank ", rank_, " of ", options_.group_name,
                      ": malformed NCCL unique id under store key '", key, "'");
      std::memcpy(id.internal, b.data(), b.size());
    }
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;  // Note [NCCL timeouts]
    PORTER_NCCL_CHECK(ncclCommInitRankConfig(&comm_, size_, id, rank_, &config), dev);
    wait_ready(OpInfo{"communicator initialisation", 0, ElemType::kU8, false});
    stream_ = device_.create_stream(options_.group_name == "world"
                                        ? std::string("comm")
                                        : str_cat("comm:", options_.group_name));
  }

  ~NcclCommunicator() override {
    try {
      if (stream_) stream_->synchronize();
    } catch (const std::exception& e) {
      PORTER_LOG_ERROR("rank {} of {}: comm stream error at destruction: {}", rank_,
                       options_.group_name, e.what());
    }
    if (barrier_buf_ != nullptr) device_.free_segment(barrier_buf_, 256);
    if (comm_ != nullptr) {
      ncclResult_t res = aborted_ ? ncclSuccess : ncclCommFinalize(comm_);
      if (res == ncclSuccess || res == ncclInProgress) {
        ncclResult_t state = ncclInProgress;
        const auto deadline =
            Clock::now() + std::chrono::duration_cast<Clock::duration>(options_.timeout);
        while (!aborted_ && state == ncclInProgress && Clock::now() < deadline) {
          ncclCommGetAsyncError(comm_, &state);
          std::this_thread::yield();
        }
        if (aborted_ || state != ncclSuccess) {
          ncclCommAbort(comm_);
        } else {
          ncclCommDestroy(comm_);
        }
      } else {
        ncclCommAbort(comm_);
      }
    }
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string_view backend() const override { return "nccl"; }
  const std::string& group_name() const override { return options_.group_name; }

  Work all_reduce(void* buf, size_t count, ElemType type, ReduceOp op) override {
    const OpInfo info{"all_reduce", count, type, true};
    return enqueue(info, count * elem_size(type), [=, this](cudaStream_t s) {
      return ncclAllReduce(buf, buf, count, nccl_type(type), nccl_op(op), comm_, s);
    });
  }
  Work reduce_scatter(const void* in, void* out, size_t count, ElemType type,
                      ReduceOp op) override {
    const OpInfo info{"reduce_scatter", count, type, true};
    return enqueue(info, count * elem_size(type) * static_cast<size_t>(size_),
                   [=, this](cudaStream_t s) {
                     return ncclReduceScatter(in, out, count, nccl_type(type), nccl_op(op),
                                              comm_, s);
                   });
  }
  Work all_gather(const void* in, void* out, size_t count, ElemType type) override {
    const OpInfo info{"all_gather", count, type, true};
    return enqueue(info, count * elem_size(type), [=, this](cudaStream_t s) {
      return ncclAllGather(in, out, count, nccl_type(type), comm_, s);
    });
  }
  Work broadcast(void* buf, size_t count, ElemType type, int root) override {
    const OpInfo info{"broadcast", count, type, true};
    PORTER_CHECK(root >= 0 && root < size_, what(info), "root ", root, " is not a rank of ",
                 options_.group_name, " (size ", size_, ")");
    return enqueue(info, count * elem_size(type), [=, this](cudaStream_t s) {
      return ncclBroadcast(buf, buf, count, nccl_type(type), root, comm_, s);
    });
  }
  Work barrier() override {
    const OpInfo info{"barrier", 1, ElemType::kF32, false};
    void* buf = barrier_buf_;
    return enqueue(info, 0, [=, this](cudaStream_t s) {
      return ncclAllReduce(buf, buf, 1, ncclFloat32, ncclSum, comm_, s);
    });
  }

  std::unique_ptr<Communicator> split(const std::vector<int>& ranks,
                                      const std::string& name) override {
    const std::string head = str_cat("rank ", rank_, " of ", options_.group_name,
                                     ": split into '", name, "': ");
    PORTER_CHECK(!ranks.empty() && !name.empty(), head, "needs ranks and a name");
    int sub_rank = -1;
    for (size_t i = 0; i < ranks.size(); ++i) {
      PORTER_CHECK(ranks[i] >= 0 && ranks[i] < size_, head, "rank ", ranks[i],
                   " is not in [0, ", size_, ")");
      PORTER_CHECK(i == 0 || ranks[i - 1] < ranks[i], head, "ranks must be ascending and unique");
      if (ranks[i] == rank_) sub_rank = static_cast<int>(i);
    }
    PORTER_CHECK(sub_rank >= 0, head, "this rank is not in the list; only members call split");
    check_usable(OpInfo{"split", 0, ElemType::kU8, false});
    CommOptions sub = options_;
    sub.group_name = name;
    return std::make_unique<NcclCommunicator>(device_, store_, sub_rank,
                                              static_cast<int>(ranks.size()), sub);
  }

  void abort(const std::string& reason) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failure_) {
      failure_ = std::make_exception_ptr(PeerError(
          str_cat("rank ", rank_, " of ", options_.group_name, " aborted: ", reason)));
    }
    if (!aborted_) {
      aborted_ = true;
      ncclCommAbort(comm_);
      comm_ = nullptr;
    }
  }

  memory::Stream& stream() override { return *stream_; }
  CommStats stats() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return stats_;
  }
  void reset_stats() override {
    std::lock_guard<std::mutex> lock(mu_);
    stats_ = CommStats{};
  }

 private:
  double now_s() const { return std::chrono::duration<double>(Clock::now() - t0_).count(); }

  std::string what(const OpInfo& op) const {
    if (!op.has_payload) {
      return str_cat("rank ", rank_, " of ", options_.group_name, ": ", op.name, " failed: ");
    }
    return str_cat("rank ", rank_, " of ", options_.group_name, ": ", op.name, " of ", op.count,
                   " ", elem_name(op.type), " failed: ");
  }

  void check_usable(const OpInfo& op) const {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failure_) return;
    std::string first;
    bool timeout = false;
    try {
      std::rethrow_exception(failure_);
    } catch (const TimeoutError& e) {
      first = e.what();
      timeout = true;
    } catch (const std::exception& e) {
      first = e.what();
    }
    std::string msg = str_cat(what(op), "the communicator failed earlier: ", first);
    if (timeout) throw TimeoutError(msg);
    throw PeerError(msg);
  }

  // Records `err` as the communicator's failure and aborts the comm (Note [NCCL timeouts]).
  [[noreturn]] void fail(std::exception_ptr err) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!failure_) failure_ = err;
      if (!aborted_) {
        aborted_ = true;
        ncclCommAbort(comm_);
        comm_ = nullptr;
      }
    }
    std::rethrow_exception(err);
  }

  // Polls ncclCommGetAsyncError until the comm is ready, failing after the timeout.
  void wait_ready(const OpInfo& op) {
    const auto deadline =
        Clock::now() + std::chrono::duration_cast<Clock::duration>(options_.timeout);
    for (;;) {
      ncclResult_t state = ncclSuccess;
      PORTER_NCCL_CHECK(ncclCommGetAsyncError(comm_, &state), device_.index());
      if (state == ncclSuccess) return;
      if (state != ncclInProgress) {
        fail(std::make_exception_ptr(PeerError(str_cat(what(op), "NCCL reported ",
                                                       ncclGetErrorString(state), " (",
                                                       ncclGetLastError(comm_), ")"))));
      }
      if (Clock::now() > deadline) {
        fail(std::make_exception_ptr(TimeoutError(
            str_cat(what(op), "timed out after ", options_.timeout.count(),
                    " s (is every rank alive and issuing the same collectives? the limit is "
                    "porter.comm.timeout_s)"))));
      }
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }

  template <typename Launch>
  Work enqueue(const OpInfo& op, size_t payload_bytes, Launch launch) {
    check_usable(op);
    auto state = std::make_shared<Work::State>(op.name, payload_bytes);
    state->event = device_.create_event();
    device_.compute_stream().record(*compute_done_);
    stream_->wait(*compute_done_);
    const double start = now_s();
    if (op.count > 0) {
      const int dev = device_.index();
      PORTER_NCCL_CUDA_CHECK(cudaSetDevice(dev), dev);
      ncclResult_t res = launch(static_cast<cudaStream_t>(stream_->native_handle()));
      if (res != ncclSuccess && res != ncclInProgress) {
        fail(std::make_exception_ptr(PeerError(str_cat(what(op), "NCCL reported ",
                                                       ncclGetErrorString(res), " (",
                                                       ncclGetLastError(comm_), ")"))));
      }
      wait_ready(op);  // a non-blocking comm may still be enqueueing
    }
    stream_->record(*state->event);
    {
      std::lock_guard<std::mutex> lock(mu_);
      stats_.ops += 1;
      stats_.payload_bytes += payload_bytes;
    }
    state->device_wait = [this, op, start](Work::State& s) {
      const auto deadline =
          Clock::now() + std::chrono::duration_cast<Clock::duration>(options_.timeout);
      std::exception_ptr err;
      try {
        while (!s.event->query()) {
          check_usable(op);
          {
            std::lock_guard<std::mutex> lock(mu_);
            ncclResult_t async = ncclSuccess;
            if (comm_ != nullptr) ncclCommGetAsyncError(comm_, &async);
            if (async != ncclSuccess && async != ncclInProgress) {
              throw PeerError(str_cat(what(op), "NCCL reported ", ncclGetErrorString(async),
                                      " (", ncclGetLastError(comm_), ")"));
            }
          }
          if (Clock::now() > deadline) {
            throw TimeoutError(str_cat(what(op), "timed out after ", options_.timeout.count(),
                                       " s (is every rank alive and issuing the same "
                                       "collectives? the limit is porter.comm.timeout_s)"));
          }
          std::this_thread::sleep_for(std::chrono::microseconds(50));
        }
      } catch (...) {
        err = std::current_exception();
        try {
          fail(err);
        } catch (...) {
        }
      }
      const double end = now_s();
      {
        std::lock_guard<std::mutex> lock(mu_);
        stats_.busy_s += end - start;
      }
      s.finish(err, start, end);
      if (err) s.event->synchronize();  // the abort released the stream
    };
    return Work(state);
  }

  memory::Device& device_;  // not owned; outlives the communicator
  std::shared_ptr<Store> store_;
  const int rank_;
  const int size_;
  const CommOptions options_;
  const Clock::time_point t0_ = Clock::now();
  std::unique_ptr<memory::Event> compute_done_;
  std::unique_ptr<memory::Stream> stream_;
  void* barrier_buf_ = nullptr;  // 256 bytes of device memory, owned

  mutable std::mutex mu_;  // guards comm_ (after construction), aborted_, failure_, stats_
  ncclComm_t comm_ = nullptr;  // owned
  bool aborted_ = false;
  std::exception_ptr failure_;
  CommStats stats_;
};

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(memory::Device& device,
                                                     std::shared_ptr<Store> store, int rank,
                                                     int size, const CommOptions& options) {
  PORTER_CHECK(device.kind() == memory::DeviceKind::kCuda,
               "the nccl backend needs a cuda device, got ", device.description());
  return std::make_unique<NcclCommunicator>(device, std::move(store), rank, size, options);
}

}  // namespace porter::comm
