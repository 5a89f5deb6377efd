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
#include "comm/communicator_base.h"
#include "comm/nccl_check.h"
#include "memory/cuda_check.h"

namespace porter::comm {
namespace {

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

class NcclCommunicator final : public CommunicatorBase {
 public:
  NcclCommunicator(memory::Device& device, std::shared_ptr<Store> store, int rank, int size,
                   const CommOptions& options)
      : CommunicatorBase(device, std::move(store), rank, size, options) {
    const int dev = device_.index();
    PORTER_GPU_CHECK(cudaSetDevice(dev), dev);
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
      PORTER_GPU_CHECK(ncclGetUniqueId(&id), dev);
      store_->set(key, Bytes(id.internal, id.internal + sizeof(id.internal)));
    } else {
      Bytes b = store_->get(key, options_.timeout);
      PORTER_CHECK_EQ(b.size(), sizeof(id.internal), "rank ", rank_, " of ", options_.group_name,
                      ": malformed NCCL unique id under store key '", key, "'");
      std::memcpy(id.internal, b.data(), b.size());
    }
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;  // Note [NCCL timeouts]
    PORTER_GPU_CHECK(ncclCommInitRankConfig(&comm_, size_, id, rank_, &config), dev);
    wait_ready(OpInfo{"communicator initialisation", 0, ElemType::kU8, false});
    open_stream();
  }

  ~NcclCommunicator() override {
    drain_stream();
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

  std::string_view backend() const override { return "nccl"; }

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
    check_root(info, root);
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
    const int sub_rank = split_rank(ranks, name);
    return std::make_unique<NcclCommunicator>(device_, store_, sub_rank,
                                              static_cast<int>(ranks.size()),
                                              options_for_group(name));
  }

 private:
  // Note [NCCL timeouts]: aborting releases this rank's kernels and the peers' with an error.
  void halt_locked() override {
    if (!aborted_) {
      aborted_ = true;
      ncclCommAbort(comm_);
      comm_ = nullptr;
    }
  }

  // Fails the communicator with `err` (Note [Comm failure state]) and throws it.
  [[noreturn]] void fail_and_throw(std::exception_ptr err) {
    fail(err);
    std::rethrow_exception(err);
  }

  // "... failed: NCCL reported <error> (<NCCL's last message>)".
  PeerError reported(const OpInfo& op, ncclResult_t res) const {
    return PeerError(str_cat(what(op), "NCCL reported ", ncclGetErrorString(res), " (",
                             ncclGetLastError(comm_), ")"));
  }

  // Polls ncclCommGetAsyncError until the comm is ready, failing after the timeout.
  void wait_ready(const OpInfo& op) {
    const auto deadline =
        Clock::now() + std::chrono::duration_cast<Clock::duration>(options_.timeout);
    for (;;) {
      ncclResult_t state = ncclSuccess;
      PORTER_GPU_CHECK(ncclCommGetAsyncError(comm_, &state), device_.index());
      if (state == ncclSuccess) return;
      if (state != ncclInProgress) fail_and_throw(std::make_exception_ptr(reported(op, state)));
      if (Clock::now() > deadline) {
        fail_and_throw(std::make_exception_ptr(timeout_error(op, -1)));
      }
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }

  template <typename Launch>
  Work enqueue(const OpInfo& op, size_t payload_bytes, Launch launch) {
    auto state = start_op(op, payload_bytes);
    const double start = now_s();
    if (op.count > 0) {
      const int dev = device_.index();
      PORTER_GPU_CHECK(cudaSetDevice(dev), dev);
      ncclResult_t res = launch(static_cast<cudaStream_t>(stream_->native_handle()));
      if (!GpuStatus<ncclResult_t>::ok(res)) {
        fail_and_throw(std::make_exception_ptr(reported(op, res)));
      }
      wait_ready(op);  // a non-blocking comm may still be enqueueing
    }
    stream_->record(*state->event);
    add_stats({.ops = 1, .payload_bytes = payload_bytes});
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
            if (!GpuStatus<ncclResult_t>::ok(async)) throw reported(op, async);
          }
          if (Clock::now() > deadline) throw timeout_error(op, -1);
          std::this_thread::sleep_for(std::chrono::microseconds(50));
        }
      } catch (...) {
        err = std::current_exception();
      }
      finish_op(s, err, start, CommStats{});
      if (err) s.event->synchronize();  // the abort released the stream
    };
    return Work(state);
  }

  void* barrier_buf_ = nullptr;  // 256 bytes of device memory, owned
  ncclComm_t comm_ = nullptr;    // owned; mu_ after construction
  bool aborted_ = false;         // mu_
};

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(memory::Device& device,
                                                     std::shared_ptr<Store> store, int rank,
                                                     int size, const CommOptions& options) {
  return std::make_unique<NcclCommunicator>(device, std::move(store), rank, size, options);
}

}  // namespace porter::comm
