// Gloo collectives over thread ranks on loopback: all_reduce, reduce_scatter and all_gather
// bus bandwidth at world size 2 and 4, 1..64 MiB, against memcpy bandwidth of the same size
// measured in the same run. See docs/comm.md.
//
// busbw follows NCCL-tests: with S the buffer bytes (the whole gathered/scattered buffer for
// all_gather and reduce_scatter) and t the time per op, algbw = S / t and
//   all_reduce:                 busbw = algbw * 2(n-1)/n
//   reduce_scatter, all_gather: busbw = algbw * (n-1)/n
// which is the rate each rank's link carries, comparable across world sizes.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "base/check.h"
#include "comm/communicator.h"
#include "memory/device.h"

namespace porter::comm {
namespace {

using Clock = std::chrono::steady_clock;

enum class Op { kAllReduce, kReduceScatter, kAllGather };

const char* op_name(Op op) {
  switch (op) {
    case Op::kAllReduce: return "all_reduce";
    case Op::kReduceScatter: return "reduce_scatter";
    case Op::kAllGather: return "all_gather";
  }
  return "?";
}

std::unique_ptr<memory::Device> bench_device() {
  memory::DeviceOptions o;
  o.kind = memory::DeviceKind::kCpu;
  o.threads = 1;
  return memory::make_device(o);
}

double memcpy_gbps(size_t bytes) {
  std::vector<char> src(bytes, 1), dst(bytes, 0);
  std::memcpy(dst.data(), src.data(), bytes);  // fault the pages in
  double best = 0;
  for (int r = 0; r < 5; ++r) {
    auto t0 = Clock::now();
    std::memcpy(dst.data(), src.data(), bytes);
    benchmark::DoNotOptimize(dst.data());
    best = std::max(best, static_cast<double>(bytes) /
                              std::chrono::duration<double>(Clock::now() - t0).count() / 1e9);
  }
  return best;
}

// One rank's buffers and the op on them. S = total_elems * 4 bytes.
struct RankBuffers {
  std::vector<float> in, out;
  RankBuffers(Op op, size_t total_elems, int ws, int rank) {
    const size_t block = total_elems / static_cast<size_t>(ws);
    switch (op) {
      case Op::kAllReduce: in.assign(total_elems, static_cast<float>(rank + 1)); break;
      case Op::kReduceScatter:
        in.assign(total_elems, static_cast<float>(rank + 1));
        out.assign(block, 0.0f);
        break;
      case Op::kAllGather:
        in.assign(block, static_cast<float>(rank + 1));
        out.assign(total_elems, 0.0f);
        break;
    }
  }
  Work issue(Communicator& comm, Op op) {
    const size_t block = (op == Op::kAllGather ? in.size() : in.size() / comm.size());
    switch (op) {
      case Op::kAllReduce:
        return comm.all_reduce(in.data(), in.size(), ElemType::kF32, ReduceOp::kSum);
      case Op::kReduceScatter:
        return comm.reduce_scatter(in.data(), out.data(), block, ElemType::kF32, ReduceOp::kSum);
      case Op::kAllGather: return comm.all_gather(in.data(), out.data(), block, ElemType::kF32);
    }
    return Work();
  }
  // After one op from fresh buffers: the expected values (checked once, before timing).
  void check(Op op, int ws) const {
    const float sum = static_cast<float>(ws * (ws + 1) / 2);
    if (op == Op::kAllReduce) PORTER_CHECK_EQ(in[in.size() / 2], sum, "all_reduce result");
    if (op == Op::kReduceScatter) {
      PORTER_CHECK_EQ(out[out.size() / 2], sum, "reduce_scatter result");
    }
    if (op == Op::kAllGather) {
      const size_t block = out.size() / static_cast<size_t>(ws);
      for (int p = 0; p < ws; ++p) {
        PORTER_CHECK_EQ(out[static_cast<size_t>(p) * block], static_cast<float>(p + 1),
                        "all_gather result");
      }
    }
  }
};

// Rank 0 runs on the benchmark's thread and times; ranks 1..ws-1 run the same fixed number
// of ops on their own threads (the iteration count is fixed at registration, so every rank
// knows it).
void bm_collective(benchmark::State& state, Op op, int ws, size_t bytes, int64_t iters) {
  const size_t total_elems = bytes / sizeof(float);
  auto store = std::make_shared<InMemoryStore>(Seconds{60});
  CommOptions options;
  options.timeout = Seconds{60};
  std::vector<std::thread> peers;
  std::vector<std::exception_ptr> errors(static_cast<size_t>(ws));
  for (int r = 1; r < ws; ++r) {
    peers.emplace_back([&, r] {
      try {
        auto device = bench_device();
        auto comm = make_communicator(*device, store, r, ws, options);
        RankBuffers b(op, total_elems, ws, r);
        b.issue(*comm, op).wait();
        for (int64_t i = 0; i < iters + 1; ++i) b.issue(*comm, op).wait();  // +1: warm-up
      } catch (...) {
        errors[static_cast<size_t>(r)] = std::current_exception();
      }
    });
  }
  {
    auto device = bench_device();
    auto comm = make_communicator(*device, store, 0, ws, options);
    RankBuffers b(op, total_elems, ws, 0);
    b.issue(*comm, op).wait();
    b.check(op, ws);
    b.issue(*comm, op).wait();  // warm-up
    for (auto _ : state) {
      auto t0 = Clock::now();
      b.issue(*comm, op).wait();
      state.SetIterationTime(std::chrono::duration<double>(Clock::now() - t0).count());
    }
  }
  for (auto& t : peers) t.join();
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
  const double n = ws;
  const double factor = op == Op::kAllReduce ? 2.0 * (n - 1) / n : (n - 1) / n;
  const double peak = memcpy_gbps(bytes);
  state.counters["algbw_GBps"] = benchmark::Counter(static_cast<double>(bytes) / 1e9,
                                                    benchmark::Counter::kIsIterationInvariantRate);
  state.counters["busbw_GBps"] = benchmark::Counter(
      factor * static_cast<double>(bytes) / 1e9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["memcpy_GBps"] = peak;
  // busbw / memcpy: a rate counter cannot be divided after the fact, so this one carries
  // busbw / peak per op and is turned into a rate the same way.
  state.counters["busbw_vs_memcpy"] = benchmark::Counter(
      factor * static_cast<double>(bytes) / 1e9 / peak,
      benchmark::Counter::kIsIterationInvariantRate);
  state.SetLabel(std::string(op_name(op)) + " ws" + std::to_string(ws));
}

}  // namespace
}  // namespace porter::comm

int main(int argc, char** argv) {
  using porter::comm::Op;
  for (Op op : {Op::kAllReduce, Op::kReduceScatter, Op::kAllGather}) {
    for (int ws : {2, 4}) {
      for (size_t mib : {size_t{1}, size_t{4}, size_t{16}, size_t{64}}) {
        const size_t bytes = mib << 20;
        // About 512 MiB through each benchmark, at least 3 ops.
        const int64_t iters =
            std::max<int64_t>(3, static_cast<int64_t>((size_t{512} << 20) / bytes));
        const std::string name = std::string(porter::comm::op_name(op)) + "/ws" +
                                 std::to_string(ws) + "/" + std::to_string(mib) + "MiB";
        benchmark::RegisterBenchmark(name.c_str(),
                                     [=](benchmark::State& st) {
                                       porter::comm::bm_collective(st, op, ws, bytes, iters);
                                     })
            ->Iterations(iters)
            ->UseManualTime()
            ->Unit(benchmark::kMillisecond);
      }
    }
  }
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
